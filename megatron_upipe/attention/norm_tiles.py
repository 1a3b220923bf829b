"""RMSNorm tile math shared by the fused input norm of the UPipe/Ulysses op and models/tiled_norm.py (pure torch).

Legend: T tokens of one tile (any leading dims, e.g. [T, b, D] or [T·b, D]), D hidden size.

Formula (megatron_upipe.models.norm.RMSNorm's): y = weight * (x · rstd in float32, cast to x's dtype), with
rstd = 1 / sqrt(mean(x², -1) + eps) in float32. A tile needs only x and its rstd, so callers keep x (alive
anyway) and rstd [T, ..., 1] float32 and regenerate or differentiate the normalised rows tile by tile.
"""

from __future__ import annotations

import torch


def rms_tile_rstd(x_t: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """out [T, ..., 1] (float32) = 1 / rms(x_t) of a tile x_t [T, ..., D]."""
    torch.rsqrt(x_t.float().pow(2).mean(-1, keepdim=True) + eps, out=out)


def rms_tile(x_t: torch.Tensor, weight: torch.Tensor, rstd_t: torch.Tensor, out: torch.Tensor | None = None):
    """RMSNorm of a tile, given its rstd: weight * (x_t · rstd_t in float32, cast to x's dtype); [T, ..., D]."""
    return torch.mul(weight, (x_t.float() * rstd_t).to(x_t.dtype), out=out)


def rms_tile_backward(x_t, weight, rstd_t, dy_t, dw: torch.Tensor) -> torch.Tensor:
    """d x_t [T, ..., D] (x's dtype) of `rms_tile` given its output gradient dy_t (x's dtype); adds the weight
    gradient of the tile to dw ([D]: float32, or float64 for float64 inputs)."""
    xhat = x_t.float() * rstd_t  # [T, ..., D]
    dw += (dy_t * xhat.to(x_t.dtype)).flatten(0, -2).sum(0, dtype=dw.dtype)  # d weight of weight * y
    g = (dy_t * weight).float()  # d xhat
    mean = (g * xhat).mean(-1, keepdim=True)  # [T, ..., 1]
    return g.sub_(xhat.mul_(mean)).mul_(rstd_t).to(x_t.dtype)  # r·(g - xhat·mean(g·xhat))
