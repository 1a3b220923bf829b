"""megatron-core self-attention whose forward runs a Ulysses-family context-parallel op (UPipe or Ulysses).

Legend: s/C tokens of this CP rank (s/(C·t) under sequence parallelism), b batch, D hidden size, G query groups
of this TP rank, g = query heads per group, d head dim, N global sequence length.

`HeadwiseCPSelfAttention` keeps megatron-core's `linear_qkv` / `linear_proj` parameters, their initialisation
and checkpoint layout. It never calls `linear_qkv`'s forward (that would project all heads at once and lose
UPipe's memory saving): the op receives views of the fused weight, rows interleaved per query group as
[q heads of the group, k, v], and projects only each stage's heads. Gradients flow back into
`linear_qkv.weight` through the views. `linear_proj` (RowParallelLinear) is not called either: its weight is
passed to the op, which returns out @ W_O^T (this TP rank's partial sums; reduced here as RowParallelLinear
would, all-reduce or reduce-scatter under sequence parallelism), so the backward never holds the
[s/C, b, H·d/t] gradient of the attention output whole. Which op (UPipe with its U, or plain Ulysses) is chosen by the layer
spec (`megatron_upipe.models.spec`), which binds it into the `cp_attention` parameter together with its gradient
accumulation and local kernel (`model.attention_kernel`); this layer passes only tensors and the CP group.

QKV biases (`linear_qkv.bias`, Qwen2) and QK-norm (`q_layernorm` / `k_layernorm`, our RMSNorm over the head dim,
Qwen3) are passed to the op too, grouped like the weight, and applied there stage by stage; their modules' own
forwards are never called, so parameters and checkpoints keep megatron-core's names.

Input norm: `fuse_input_norm(layer.input_layernorm)` (done by the model builder when tp = 1 or under sequence
parallelism) defers the layer's RMSNorm to the op, which regenerates RMSNorm(x) tile by tile and never holds it
whole (one [s/C, b, D] tensor less through the attention backward). With tp > 1 and no sequence parallelism the
norm stays in the layer: its weight gradient would be partial per TP rank, which megatron-core only reduces for
sequence-parallel weights.

Packed documents (megatron's THD PackedSeqParams, data.document_mask): the op gets the global document boundaries
cu_seqlens and attends causally inside each document; RoPE positions restart at each document (the rows of the
in-document positions of this rank's tokens, picked from the table the rotary module makes).

RoPE: the op takes the angles of this rank's positions (rank r holds tokens [r·N/C, (r+1)·N/C), or under hybrid
a2a x ring (`cp_ring`) the positions `attention.layout.local_positions` gives, see `megatron_upipe.cp_batch`): the
model builder replaces megatron's RotaryEmbedding by `RankRowsRotaryEmbedding`, which makes just those rows.

Hybrid a2a x ring (`cp_ring` = R > 1): the op's all-to-alls run inside megatron's first hierarchical CP group
(`pg_collection.hcp[0]`, A consecutive CP ranks) and each stage's attention is a causal ring over the second
(`hcp[1]`); see megatron_upipe.parallel.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_upipe.attention.varlen import documents
from megatron_upipe.data.packing import DocumentPackedSeqParams, document_positions


class AttentionInsideCPOp(MegatronModule):
    """Placeholder for `core_attention`: `Attention.__init__` always builds one, and megatron's local
    `DotProductAttention` refuses CP > 1. Attention itself runs inside the CP op; calling this is a bug."""

    def __init__(self, config: TransformerConfig, **kwargs) -> None:
        super().__init__(config=config)

    def forward(self, *args, **kwargs):
        raise RuntimeError("core attention runs inside the context-parallel op of HeadwiseCPSelfAttention")


def check_supported(config: TransformerConfig, tp_size: int) -> None:
    """Clear errors for configurations the headwise CP attention does not implement."""
    if config.add_bias_linear:
        raise ValueError("UPipe/Ulysses attention has no output-projection bias: set add_bias_linear=False "
                         "(QKV biases, add_qkv_bias, are supported)")
    if config.num_query_groups % tp_size:
        raise ValueError(
            f"num_query_groups={config.num_query_groups} is not a multiple of tp={tp_size}: UPipe/Ulysses need "
            f"whole query groups on each tensor-parallel rank; lower tp or use a model with more KV heads"
        )
    if config.qk_l2_norm or config.attention_output_gate:
        raise ValueError("UPipe/Ulysses attention supports neither L2 QK norms nor an attention output gate "
                         "(RMSNorm QK-norm, qk_layernorm, is supported)")


def _document_boundaries(params) -> torch.Tensor:
    """cu_seqlens [n_docs + 1] of megatron's THD PackedSeqParams (self-attention: the same for q and kv)."""
    if params.qkv_format != "thd":
        raise ValueError(f"packed sequences reach UPipe/Ulysses attention as qkv_format='thd'; got "
                         f"{params.qkv_format!r}")
    cu = params.cu_seqlens_q
    if params.cu_seqlens_kv is not None and params.cu_seqlens_kv is not cu and not torch.equal(params.cu_seqlens_kv,
                                                                                               cu):
        raise ValueError("UPipe/Ulysses self-attention needs cu_seqlens_q == cu_seqlens_kv")
    if params.cu_seqlens_q_padded is not None and not torch.equal(params.cu_seqlens_q_padded, cu):
        raise ValueError("UPipe/Ulysses attention takes unpadded documents: cu_seqlens_q_padded must be None or "
                         "equal cu_seqlens_q (the op needs no padding to 2·cp: every rank sees whole sequences)")
    return cu


def _op_documents(params, cu_seqlens: torch.Tensor, x: torch.Tensor, cp_size: int):
    """cu_seqlens as the op takes it. With the training step's DocumentPackedSeqParams: the op's checked document
    boundaries and their int32 copy on x's device (attention.varlen.Documents, for N = s/C·C tokens), made by the
    first layer that asks and kept in the micro-batch's cache (DocumentPackedSeqParams.cached) for the
    other layers and the recomputed forward: one blocking host->device copy per micro-batch instead of one per layer
    call. Else, or for a single document (no copy either way), the tensor itself."""
    if not isinstance(params, DocumentPackedSeqParams):
        return cu_seqlens
    key = ("documents", x.device, x.shape[0] * cp_size)
    docs = params.cached(key, lambda: documents(cu_seqlens, key[2], x.shape[1], x.device))
    return cu_seqlens if docs is None else docs


class HeadwiseCPSelfAttention(SelfAttention):
    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: str | None = None,
        pg_collection=None,
        pp_layer_offset: int | None = None,
        name: str | None = None,
        *,
        cp_attention: Callable[..., torch.Tensor],
        cp_ring: int = 1,
    ) -> None:
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"UPipe/Ulysses attention is causal only; got attn_mask_type={attn_mask_type}")
        super().__init__(
            config, submodules, layer_number, attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type,
            pg_collection=pg_collection, pp_layer_offset=pp_layer_offset, name=name,
        )
        check_supported(config, self.world_size)
        self.cp_attention = cp_attention
        # The op's groups: the CP group, or under hybrid a2a x ring megatron's hierarchical CP groups (parallel.py)
        hcp = getattr(self.pg_collection, "hcp", None) or ()
        self._cp_groups = (self.pg_collection.cp, None) if cp_ring == 1 else tuple(hcp)
        if len(self._cp_groups) != 2 or (cp_ring > 1 and self._cp_groups[1].size() != cp_ring):
            raise ValueError(f"cp_ring={cp_ring}: the process groups have no matching hierarchical CP groups "
                             f"(initialize_parallel builds them from ParallelLayout.cp_ring)")
        self._input_norm: tuple = ()  # (RMSNorm,) when fused: a tuple, so not registered as a submodule
        self._rotary: tuple = ()  # (RankRowsRotaryEmbedding,) when the model has one: see use_rank_rotary

    def use_rank_rotary(self, rotary: torch.nn.Module) -> None:
        """Take packed documents' RoPE angles from `rotary` (the model's RankRowsRotaryEmbedding, which makes no
        table for them): the angles of this rank's in-document positions, made once per micro-batch."""
        self._rotary = (rotary,)  # a tuple: not registered as a submodule (the model owns it)

    def _document_angles(self, params, table: torch.Tensor, cu_seqlens: torch.Tensor, s: int) -> torch.Tensor:
        """[s/C, 1, 1, rot] RoPE angles of this rank's tokens at their in-document positions. With the model's
        RankRowsRotaryEmbedding (`use_rank_rotary`) they are made from the positions, once per micro-batch when
        `params` is a DocumentPackedSeqParams (as the training step's); else `table` ([L, 1, 1, rot]: positions
        [0, longest document), megatron's rotary module) gives the rows."""
        def positions() -> torch.Tensor:  # [s/C] in-document positions of global tokens [r·s, (r+1)·s)
            return document_positions(cu_seqlens, self.pg_collection.cp.rank() * s, s)

        if self._rotary:
            rotary = self._rotary[0]
            if isinstance(params, DocumentPackedSeqParams):
                return params.cached(rotary, lambda: rotary.angles_at(positions()))
            return rotary.angles_at(positions())
        return table.index_select(0, positions().to(table.device))  # [s/C, 1, 1, rot]

    def fuse_input_norm(self, norm: torch.nn.Module) -> None:
        """Apply the layer's input RMSNorm `norm` inside the op (see the module docstring); norm passes x through."""
        from megatron_upipe.models.norm import RMSNorm

        if not isinstance(norm, RMSNorm):
            raise TypeError(f"only megatron_upipe RMSNorm can be fused into the attention op, not {type(norm).__name__}")
        if self.world_size > 1 and not self.config.sequence_parallel:
            raise ValueError("fusing the input norm with tp > 1 needs sequence_parallel=True (the norm weight's "
                             "gradient is partial per TP rank); keep the norm in the layer")
        norm.deferred = True
        self._input_norm = (norm,)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if any(v is not None for v in (key_value_states, inference_context, inference_params, attention_bias,
                                        rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin)):
            raise NotImplementedError(
                "UPipe/Ulysses attention supports causal training batches only (no inference context, attention "
                "bias or precomputed cos/sin)"
            )
        if isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = rotary_pos_emb[0]
        if self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]:
            rotary_pos_emb = None
        tp_group = self.pg_collection.tp
        if self.config.sequence_parallel:
            x = gather_from_sequence_parallel_region(hidden_states, group=tp_group)  # [s/(C·t), b, D] -> [s/C, b, D]
        else:
            x = copy_to_tensor_model_parallel_region(hidden_states, group=tp_group)  # [s/C, b, D], grad all-reduced
        extras = {}
        if packed_seq_params is not None:  # packed documents: causal attention inside each one
            cu_seqlens = _document_boundaries(packed_seq_params)
            extras["cu_seqlens"] = _op_documents(packed_seq_params, cu_seqlens, x, self.pg_collection.cp.size())
            if rotary_pos_emb is not None:
                rotary_pos_emb = self._document_angles(packed_seq_params, rotary_pos_emb, cu_seqlens, x.shape[0])
        G = self.num_query_groups_per_partition
        g = self.num_attention_heads_per_partition // G
        d = self.hidden_size_per_attention_head
        w = self.linear_qkv.weight.view(G, g + 2, d, x.shape[-1])  # [G·(g+2)·d, D] -> [G, g+2, d, D]
        if self.linear_qkv.bias is not None:  # QKV biases, rows interleaved per group like the weight's
            bias = self.linear_qkv.bias.view(G, g + 2, d)  # [G·(g+2)·d] -> [G, g+2, d]
            extras.update(b_q=bias[:, :g], b_k=bias[:, g], b_v=bias[:, g + 1])  # [G, g, d], [G, d], [G, d]
        if self.config.qk_layernorm:  # RMSNorm of every q and k head, inside the op before RoPE
            extras.update(q_norm_w=self.q_layernorm.weight, k_norm_w=self.k_layernorm.weight,
                          qk_norm_eps=self.q_layernorm.eps)
        if self._input_norm:
            extras.update(norm_w=self._input_norm[0].weight, norm_eps=self._input_norm[0].eps)
        partial = self.cp_attention(
            x, w[:, :g], w[:, g], w[:, g + 1],  # w_q [G, g, d, D], w_k [G, d, D], w_v [G, d, D]
            cp_group=self._cp_groups[0],  # the all-to-all group
            ring_group=self._cp_groups[1],  # None, or the ring over the all-to-all groups (hybrid)
            rotary_pos_emb=rotary_pos_emb,  # [s/C, 1, 1, rot_dim]: this rank's positions
            causal=True,
            softmax_scale=self.config.softmax_scale,
            w_o=self.linear_proj.weight,  # [D, G·g·d]: heads group-major, linear_proj's column order
            **extras,
        )  # [s/C, b, D], partial sums over this TP rank's heads
        if self.config.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, group=tp_group)  # [s/(C·t), b, D]
        else:
            out = reduce_from_tensor_model_parallel_region(partial, group=tp_group)  # [s/C, b, D]
        return out, None  # RowParallelLinear's (output, bias): no bias (check_supported)
