"""The one place that maps `cp_strategy` to a megatron-core layer spec.

| cp_strategy | self-attention                                              | sequence split | needs        |
|-------------|-------------------------------------------------------------|----------------|--------------|
| none        | megatron-core SelfAttention + local DotProductAttention     | (cp must be 1) | -            |
| ulysses     | HeadwiseCPSelfAttention running plain Ulysses (baseline)    | contiguous     | -            |
| upipe       | HeadwiseCPSelfAttention running UPipe (U heads per stage)   | contiguous     | -            |
| (cp_ring>1) | the same, a2a inside groups of cp/cp_ring, ring across them | zigzag x a2a   | -            |
| p2p         | TE spec, TEDotProductAttention, cp_comm_type="p2p" (ring)   | zigzag         | TE + GPU     |
| a2a         | TE spec, cp_comm_type="a2a" (TE's Ulysses)                  | zigzag         | TE + GPU     |
| a2a+p2p     | TE spec, cp_comm_type="a2a+p2p" (hierarchical)              | zigzag         | TE + GPU     |

Our strategies use megatron-core's local modules (ColumnParallelLinear, RowParallelLinear, MLP with SwiGLU) and our
`RMSNorm` (sequence-parallel capable), so parameter names and checkpoints are the same for none/ulysses/upipe.
The caller gets a `CPPlan`: the block spec plus the properties the rest of the stack must follow (how batches
are split over CP ranks, whether RoPE angles are made for this rank's contiguous positions only); nothing else reads the name.
The UPipe/Ulysses op is bound here with its arguments from the config: U, `memory.attention_grad_accum` and the local
kernel `model.attention_kernel` (None = the op's automatic choice), so every layer calls exactly the kernel asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_upipe.models.norm import RMSNorm
from megatron_upipe.models.upipe_attention import AttentionInsideCPOp, HeadwiseCPSelfAttention, check_supported
from megatron_upipe.parallel import ParallelLayout

TE_STRATEGIES = ("p2p", "a2a", "a2a+p2p")


@dataclass(frozen=True)
class CPPlan:
    block_spec: TransformerBlockSubmodules  # the layers of this pipeline stage and the final norm
    sequence_split: str  # "contiguous" or "zigzag": see megatron_upipe.cp_batch
    rope_rank_rows: bool  # attention takes the RoPE angles of this rank's positions only
    cp_ring: int = 1  # R of hybrid a2a x ring (layout.cp_ring): the "contiguous" split is then zigzag over R


def te_available() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE) and torch.cuda.is_available()


def _local_layer_spec(config: TransformerConfig) -> ModuleSpec:
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    if config.qk_layernorm:  # RMSNorm over the head dim of q and k (megatron-core sums its grads over TP)
        spec.submodules.self_attention.submodules.q_layernorm = RMSNorm
        spec.submodules.self_attention.submodules.k_layernorm = RMSNorm
    return spec


def _headwise_cp_layer_spec(config: TransformerConfig, cp_attention, cp_ring: int) -> ModuleSpec:
    spec = _local_layer_spec(config)
    attn = spec.submodules.self_attention
    attn.module = HeadwiseCPSelfAttention
    attn.params = {"attn_mask_type": AttnMaskType.causal, "cp_attention": cp_attention, "cp_ring": cp_ring}
    attn.submodules.core_attention = AttentionInsideCPOp
    return spec


def _te_layer_spec(strategy: str) -> tuple[ModuleSpec, type]:
    if not te_available():
        raise ValueError(
            f"cp_strategy={strategy!r} is TransformerEngine's context parallelism and needs transformer_engine "
            f"importable with a CUDA GPU; on this machine use cp_strategy='ulysses' or 'upipe'"
        )
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = get_gpt_layer_with_transformer_engine_spec()
    spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.causal, "cp_comm_type": strategy}
    return spec, TENorm


def _op_kernel(name: str, config: TransformerConfig, device) -> str | None:
    """`model.attention_kernel` as the op's `kernel` argument (None = automatic choice), refused here if unknown
    or, given the run's device, unusable there with the activation dtype and head dim. A kernel object (the
    planner's `kernels.planning_kernel` stand-ins) passes through as it is."""
    if not isinstance(name, str):
        return name
    if name == "auto":
        return None
    from megatron_upipe.attention.kernels import KERNELS, select_kernel

    if name not in KERNELS:
        raise ValueError(f"model.attention_kernel={name!r} is unknown; choose auto or one of {sorted(KERNELS)}")
    if device is not None:
        dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
        try:
            select_kernel(torch.device(device), dtype, config.kv_channels, name)
        except ValueError as e:
            raise ValueError(f"model.attention_kernel={name}: {e}; set model.attention_kernel=auto or a kernel "
                             f"for this device") from None
    return name


def build_cp_plan(config: TransformerConfig, layout: ParallelLayout, pp_rank: int = 0,
                  grad_accum: str = "fp32", attention_kernel: str = "auto", kernel_device=None,
                  overlap: bool | str = False, ring_overlap: bool = False) -> CPPlan:
    """Layer spec of pipeline stage `pp_rank` for `layout.cp_strategy` (the only reader of that field).
    grad_accum: the UPipe/Ulysses op's backward accumulation ('fp32' or 'input'); other strategies need 'fp32'.
    attention_kernel: `model.attention_kernel`, the UPipe/Ulysses op's local kernel ('auto' or a name from
    megatron_upipe.attention.kernels.KERNELS); other strategies need 'auto'. kernel_device: the device the model
    will run on; with it a named kernel that cannot run there is refused now, before any parameter exists.
    overlap: UPipe's pipelined stages (`memory.upipe_overlap`: true or "outputs"); 'upipe' only. ring_overlap: the
    hybrid ring's P2P passes during its blocks (`memory.ring_overlap`); 'ulysses' or 'upipe' with layout.cp_ring >
    1."""
    strategy = layout.cp_strategy
    norm = RMSNorm
    if strategy == "none":
        if layout.cp > 1:
            raise ValueError("cp_strategy='none' cannot run with cp > 1")
        layer, split, rank_rope = _local_layer_spec(config), "contiguous", False
    elif strategy in ("ulysses", "upipe"):
        from megatron_upipe.attention import ulysses_attention_grouped, upipe_attention_grouped

        check_supported(config, layout.tp)
        kernel = _op_kernel(attention_kernel, config, kernel_device)
        op = (
            partial(ulysses_attention_grouped, grad_accum=grad_accum, kernel=kernel, ring_overlap=ring_overlap)
            if strategy == "ulysses"
            else partial(upipe_attention_grouped, heads_per_stage=layout.upipe_heads_per_stage, grad_accum=grad_accum,
                         kernel=kernel, overlap=overlap, ring_overlap=ring_overlap)
        )
        layer, split, rank_rope = _headwise_cp_layer_spec(config, op, layout.cp_ring), "contiguous", True
    elif strategy in TE_STRATEGIES:
        (layer, norm), split, rank_rope = _te_layer_spec(strategy), "zigzag", False
    else:
        raise ValueError(f"cp_strategy={strategy!r} is unknown")
    if grad_accum != "fp32" and strategy not in ("ulysses", "upipe"):
        raise ValueError(f"attention_grad_accum={grad_accum!r} applies to cp_strategy 'ulysses' or 'upipe' only; "
                         f"set memory.attention_grad_accum=fp32 for cp_strategy={strategy!r}")
    if isinstance(attention_kernel, str) and attention_kernel != "auto" and strategy not in ("ulysses", "upipe"):
        raise ValueError(f"model.attention_kernel={attention_kernel} applies to cp_strategy 'ulysses' or 'upipe' only "
                         f"(megatron-core's attention picks its own kernel); set model.attention_kernel=auto for "
                         f"cp_strategy={strategy!r}")
    if overlap and strategy != "upipe":
        raise ValueError(f"upipe_overlap pipelines UPipe's head stages; cp_strategy={strategy!r} has none to overlap: "
                         f"set memory.upipe_overlap=false")
    if ring_overlap and (layout.cp_ring == 1 or strategy not in ("ulysses", "upipe")):
        raise ValueError(f"ring_overlap overlaps the P2P passes of a hybrid a2a x ring layout "
                         f"(cp_ring={layout.cp_ring}, cp_strategy={strategy!r}): set memory.ring_overlap=false")
    if strategy != "upipe" and layout.upipe_heads_per_stage is not None:
        raise ValueError(f"upipe_heads_per_stage is set but cp_strategy={strategy!r}; it only applies to 'upipe'")
    num_layers = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    block = TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=norm)
    return CPPlan(block_spec=block, sequence_split=split, rope_rank_rows=rank_rope, cp_ring=layout.cp_ring)
