"""Ulysses-style context-parallel attention ops: UPipe (headwise-chunked) and the plain Ulysses baseline.

Pure torch + torch.distributed; this package never imports training code. Modules, in import order:
schedule (which heads go where per stage; pure Python), comm (all-to-all resharding), rope, norm_tiles (the RMSNorm
tile math of the fused input norm, also used by models/tiled_norm.py), qk_norm (the per-head q/k RMSNorm: Qwen3's
QK-norm), varlen (packed documents: cu_seqlens checked and normalised, the CPU variable-length kernel),
kernel_libraries and varlen_kernels (flash-attn / TransformerEngine bindings; the CUDA kernels' cu_seqlens calls),
kernels (local attention with an explicit backward), upipe (the op for UPipe and, with one stage, Ulysses: its
autograd.Function; the stage code in upipe_rows, upipe_indices, upipe_stages, upipe_passes, and the serial and
pipelined stage loops in upipe_serial and upipe_pipelined),
api (checked public functions), reference (float64 full attention for tests and benchmarks), layout (which
global token positions a rank holds, for every a2a x ring layout).

Names are imported lazily so that `megatron_upipe.attention.schedule` (used by config validation and the
memory planner) does not pull in torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "upipe_attention": "api",
    "ulysses_attention": "api",
    "upipe_attention_grouped": "api",
    "ulysses_attention_grouped": "api",
    "legal_heads_per_stage": "schedule",
    "local_positions": "layout",
    "make_schedule": "schedule",
    "UPipeSchedule": "schedule",
    "select_kernel": "kernels",
    "KERNELS": "kernels",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
