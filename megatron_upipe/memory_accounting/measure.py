"""Measure the tracked forward + backward peak of one attention op for a given shape, on CPU tensors.

Communication goes through torch's fake process group (one process plays rank 0 of C: all-to-alls return
correctly shaped, uninitialised buffers), so memory is exact while numerics are meaningless; numerics are
checked elsewhere against the float64 reference. Must run in a process with no other process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_upipe.attention import ulysses_attention, upipe_attention
from megatron_upipe.attention.reference import rope_angles
from megatron_upipe.memory_accounting.attention_model import AttentionShape
from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker

_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def measure_attention_peak(shape: AttentionShape, heads_per_stage: int | None = None, ulysses: bool = False) -> int:
    """Tracked peak bytes of rank 0's forward + backward (inputs, weights, RoPE angles and dout not counted)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("measure_attention_peak needs a process without a process group (it creates a fake one)")
    C = shape.cp
    if C > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=C)
    try:
        group = dist.group.WORLD if C > 1 else None
        dtype = _DTYPES[shape.dtype_bytes]
        s, b, D, H, G, d = shape.seq_len // C, shape.batch, shape.hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(s, b, D, generator=gen).to(dtype).requires_grad_()
        ws = [(torch.randn(n * d, D, generator=gen) * 0.05).to(dtype).requires_grad_() for n in (H, G, G)]
        rot = d if shape.rotary_dim is None else shape.rotary_dim
        freqs = rope_angles(shape.seq_len, rot) if rot else None
        dout = torch.randn(s, b, H * d, generator=gen).to(dtype)
        kwargs = dict(num_heads=H, num_kv_heads=G, cp_group=group, rotary_pos_emb=freqs)
        with PeakMemoryTracker() as mem:
            if ulysses:
                out = ulysses_attention(x, *ws, **kwargs)
            else:
                out = upipe_attention(x, *ws, heads_per_stage=heads_per_stage, **kwargs)
            grads = torch.autograd.grad(out, [x, *ws], dout)
            del out, grads
        return mem.peak_bytes
    finally:
        if C > 1:
            dist.destroy_process_group()
