"""Build a Llama-family model (RMSNorm, SwiGLU, RoPE, GQA; QKV biases, QK-norm, tied embeddings and RoPE scaling
where the arch has them) on megatron-core's GPTModel.

`llama_transformer_config(arch, layout, ...)` is the one translation of our model shape and parallel layout
into megatron-core's `TransformerConfig`; `build_llama(...)` builds this pipeline stage's `GPTModel` from it with
the layer spec chosen by `megatron_upipe.models.spec.build_cp_plan`. The vocabulary comes from the tokenizer and
is padded to a multiple of lcm(128, tp) (TP-invariant for tp | 128); padded rows are zero after conversion from
HF and their logits are ignored by `hf_convert`.

Memory switches (numerically transparent; parameters and checkpoints unchanged), applied here and nowhere else:
`mlp_chunks > 1` swaps every layer's MLP for the sequence-tiled `TiledMLP` (models/tiled_mlp.py);
`loss_chunks > 1` builds a `ChunkedLossGPTModel` whose forward with labels never materialises the logits
(models/chunked_loss.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_upipe.attention.layout import cp_rank_positions
from megatron_upipe.models.chunked_loss import ChunkedLossGPTModel
from megatron_upipe.models.presets import LlamaArch
from megatron_upipe.models.rope_scaling import apply_rope_scaling
from megatron_upipe.models.spec import CPPlan, build_cp_plan
from megatron_upipe.models.tiled_mlp import with_tiled_mlp_block
from megatron_upipe.parallel import ParallelLayout

VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    step = math.lcm(multiple, tp)
    return -(-vocab_size // step) * step


def llama_transformer_config(
    arch: LlamaArch, layout: ParallelLayout, *, dtype: torch.dtype = torch.float32, init_method_std: float = 0.02,
    recompute_granularity: str | None = None, recompute_layers: int | None = None,
) -> TransformerConfig:
    """LlamaArch + ParallelLayout -> megatron-core TransformerConfig (no dropout, fused ops off on CPU; biases only on
    q, k, v with arch.qkv_bias; RMSNorm of q and k heads with arch.qk_norm; yarn's attention factor in the softmax
    scale, see models/rope_scaling.py). Full recompute checkpoints one layer at a time: every layer (method
    "uniform", one layer per chunk), or with `recompute_layers` = N the first N of each pipeline stage (method
    "block"; the others keep their activations)."""
    on_gpu = torch.cuda.is_available()
    full = recompute_granularity == "full"
    logit_scale = arch.rope_scaling.logit_scale if arch.rope_scaling is not None else 1.0
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        ffn_hidden_size=arch.ffn_hidden_size,
        kv_channels=arch.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        softmax_scale=None if logit_scale == 1.0 else logit_scale / math.sqrt(arch.kv_channels),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=init_method_std,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,  # the fused kernel needs apex; the local path is the no-CP baseline
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        recompute_granularity=recompute_granularity,
        recompute_method=(("uniform" if recompute_layers is None else "block") if full else None),
        recompute_num_layers=(recompute_layers or 1) if full else None,
    )


@dataclass
class LlamaStage:
    """This rank's pipeline stage: the GPTModel chunk and the CP plan its inputs must follow."""

    model: GPTModel
    config: TransformerConfig
    plan: CPPlan
    vocab_size: int  # tokenizer's
    padded_vocab_size: int
    offloader: object | None = None  # memory_switches HostOffloader holding the checkpointed layer inputs, if any


class RankRowsRotaryEmbedding(torch.nn.Module):
    """megatron-core's RotaryEmbedding reduced to this CP rank's positions: asked for N positions it returns the
    angles of positions [r·N/C, (r+1)·N/C) ([N/C, 1, 1, rot_dim], same values as those rows of the full table)
    instead of all N (at 6M tokens: 3 GiB of float32 angles per rank, alive through the step). With cp_ring = R > 1
    (hybrid a2a x ring) the rows are those of attention.layout.local_positions (zigzag over the ring).
    Holds no parameters or buffers (RotaryEmbedding's inv_freq is a plain attribute): state dicts are unchanged.
    Packed documents (megatron's THD PackedSeqParams, data.document_mask): megatron asks for the longest document's
    length; no table is made ([0, 1, 1, rot_dim]: up to N rows of float32 alive through the step otherwise, 2.5 GiB
    per rank for an 8B model at 5M tokens). The attention layers ask `angles_at` for their tokens' in-document
    positions instead (once per micro-batch, see HeadwiseCPSelfAttention.use_rank_rotary)."""

    def __init__(self, inner: torch.nn.Module, cp_group, cp_ring: int = 1) -> None:
        super().__init__()
        self.inner = inner
        self.cp_size, self.cp_rank, self.cp_ring = cp_group.size(), cp_group.rank(), cp_ring

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        if packed_seq:  # packed documents: the attention layers take angles_at(their in-document positions)
            return self.inner.get_emb(1, offset)[:0]  # [0, 1, 1, rot_dim] (and inv_freq on megatron's device)
        s = max_seq_len // self.cp_size  # [N] -> this rank's [s/C] positions
        if self.cp_ring > 1:  # hybrid a2a x ring: zigzag over the ring
            positions = cp_rank_positions(max_seq_len, self.cp_rank, self.cp_size, self.cp_ring)  # [s/C]
            return self.angles_at(positions + offset)  # [s/C, 1, 1, rot_dim]
        return self.inner.get_emb(s, offset + self.cp_rank * s)  # [s/C, 1, 1, rot_dim]

    def angles_at(self, positions: torch.Tensor) -> torch.Tensor:
        """[n, 1, 1, rot_dim] angles of the positions [n] (int, each < 2^24): bit for bit the rows `positions` of
        `inner.get_emb(max + 1)` (the same float32 products as megatron-core's get_freqs_non_repeated / get_emb;
        tests/test_document_mask.py checks it for every RoPE scaling)."""
        inner = self.inner
        inv_freq = inner.inv_freq  # [rot_dim / 2]
        seq = positions.to(device=inv_freq.device, dtype=inv_freq.dtype)  # [n], exact below 2^24
        if inner.seq_len_interpolation_factor is not None:
            seq = seq * (1 / inner.seq_len_interpolation_factor)
        freqs = torch.outer(seq, inv_freq)  # [n, rot_dim / 2]
        if not inner.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, rot_dim]
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]  # [n, 1, 1, rot_dim]


def build_llama(
    arch: LlamaArch, layout: ParallelLayout, pg_collection, *, vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32, config: TransformerConfig | None = None, mlp_chunks: int = 1,
    loss_chunks: int = 1, offloader=None, attention_grad_accum: str = "fp32", upipe_overlap: bool | str = False,
    ring_overlap: bool = False, attention_kernel: str = "auto", kernel_device=None,
    residual_grad_in_place: bool = False,
) -> LlamaStage:
    """GPTModel of this rank's pipeline stage, with groups from `initialize_parallel(layout)`.

    mlp_chunks / loss_chunks: `memory.mlp_chunks` / `memory.loss_chunks` (1 = megatron-core's plain modules).
    residual_grad_in_place: `memory.residual_grad_in_place`, the tiled pre-MLP norm forms the residual's gradient in
    place (models/tiled_norm.py; needs mlp_chunks > 1).
    offloader: `memory.offload_checkpoints` - a `megatron_upipe.memory_switches.offload.HostOffloader` (or the memory
    planner's SimulatedHostOffloader) that keeps each checkpointed layer input until its backward; needs the
    config's full recompute. None = off. attention_grad_accum: `memory.attention_grad_accum` of the UPipe/Ulysses op.
    upipe_overlap: `memory.upipe_overlap`, the UPipe op's pipelined stages (true or "outputs"). ring_overlap:
    `memory.ring_overlap`, the hybrid ring's P2P passes during its block computation.
    attention_kernel / kernel_device: `model.attention_kernel` and the run's device (see spec.build_cp_plan).
    """
    vocab = vocab_size if vocab_size is not None else arch.vocab_size
    if vocab is None:
        raise ValueError("vocab_size is unknown: pass the tokenizer's vocabulary size")
    if mlp_chunks < 1 or loss_chunks < 1:
        raise ValueError(f"mlp_chunks={mlp_chunks} and loss_chunks={loss_chunks} must be positive (1 = off)")
    config = config if config is not None else llama_transformer_config(arch, layout, dtype=dtype)
    pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
    plan = build_cp_plan(config, layout, pp_rank=pp_rank, grad_accum=attention_grad_accum,
                         attention_kernel=attention_kernel, kernel_device=kernel_device, overlap=upipe_overlap,
                         ring_overlap=ring_overlap)
    if residual_grad_in_place and mlp_chunks == 1:
        raise ValueError("residual_grad_in_place needs the tiled pre-MLP norm: set memory.mlp_chunks > 1 or "
                         "memory.residual_grad_in_place=false")
    if mlp_chunks > 1:
        plan = dataclasses.replace(plan, block_spec=with_tiled_mlp_block(plan.block_spec, mlp_chunks,
                                                                         residual_grad_in_place))
    model_cls, extra = (ChunkedLossGPTModel, {"loss_chunks": loss_chunks}) if loss_chunks > 1 else (GPTModel, {})
    padded = padded_vocab_size(vocab, layout.tp)
    model = model_cls(
        config=config,
        transformer_layer_spec=plan.block_spec,
        vocab_size=padded,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rotary_base,
        pg_collection=pg_collection,
        **extra,
    )
    apply_rope_scaling(model.rotary_pos_emb, arch.rotary_base, arch.kv_channels, arch.rope_scaling)
    if plan.rope_rank_rows:
        # The headwise CP ops rotate this rank's contiguous positions only: make just those angles ([s/C] rows, not
        # the [N] rows nor megatron's zigzag slice of them).
        model.rotary_pos_emb = RankRowsRotaryEmbedding(model.rotary_pos_emb, pg_collection.cp, layout.cp_ring)
        for layer in model.decoder.layers:
            layer.self_attention.use_rank_rotary(model.rotary_pos_emb)
        if layout.tp == 1 or layout.sequence_parallel:  # the op applies each layer's input norm itself
            for layer in model.decoder.layers:
                layer.self_attention.fuse_input_norm(layer.input_layernorm)
    if config.recompute_granularity == "full":
        from megatron_upipe.memory_switches.recompute_output import drop_recomputed_outputs

        drop_recomputed_outputs(model, config)
    if offloader is not None:
        from megatron_upipe.memory_switches.checkpoint_offload import attach_checkpoint_offload

        attach_checkpoint_offload(model, offloader)
    return LlamaStage(model=model, config=config, plan=plan, vocab_size=vocab, padded_vocab_size=padded,
                      offloader=offloader)
