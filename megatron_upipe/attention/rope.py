"""Rotary position embedding in megatron-core's format, written into preallocated buffers.

megatron-core's `RotaryEmbedding` returns angles `freqs` of shape [N, 1, 1, rot_dim] (non-interleaved, the two
halves repeat the same frequencies) and applies `t * cos + rotate_half(t) * sin` to the first rot_dim channels;
the rest pass through. Here the rotation is computed half by half with `out=`/in-place ops, so rotating into an
all-to-all send buffer allocates nothing. The inverse rotation (angle -> -angle) is the exact gradient of the
forward one, which the UPipe backward uses to map dq/dk back through RoPE.
"""

from __future__ import annotations

import torch


def rope_cos_sin(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 1, 1, rot_dim] angles -> (cos, sin) of the first half, [n, rot_dim/2] each, in `dtype`."""
    half = freqs.shape[-1] // 2
    angles = freqs.reshape(freqs.shape[0], freqs.shape[-1])[:, :half]  # [n, rot_dim/2]
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def rotate_into(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor, inverse: bool = False) -> None:
    """dst = RoPE(src) (or its inverse). src, dst: [n, *mid, d] with the same shape; cos, sin: [n, rot_dim/2].

    dst may be any strided view (e.g. a permuted all-to-all send buffer); src and dst must not overlap.
    """
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (src.dim() - 2) + (half,)
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = src[..., :half], src[..., half:2 * half]
    y1, y2 = dst[..., :half], dst[..., half:2 * half]
    sign = 1.0 if inverse else -1.0
    # forward: y1 = x1*c - x2*s, y2 = x2*c + x1*s; inverse flips the sign of s.
    torch.mul(x1, c, out=y1)
    y1.addcmul_(x2, s, value=sign)
    torch.mul(x2, c, out=y2)
    y2.addcmul_(x1, s, value=-sign)
    if 2 * half < src.shape[-1]:
        dst[..., 2 * half:].copy_(src[..., 2 * half:])
