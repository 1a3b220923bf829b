"""Per-head RMSNorm of q and k (QK-norm: HF Qwen3's q_norm / k_norm, megatron-core's qk_layernorm), pure torch.

Legend: T rows (this rank's tokens, s·b), h heads, d head dim.

Formula (HF `Qwen3RMSNorm`, over the head dim of every head, applied after the projection and before RoPE):
y = weight * (p · rstd, cast to p's dtype), rstd = 1 / sqrt(mean(p², -1) + eps), both computed in float32 for
16-bit and float32 inputs: the same operations in the same order, so the op gives HF's bits for 16-bit inputs.
float64 inputs (tests only) are normalised in float64 (HF would drop to float32).
The UPipe op keeps p and rstd [T, h, 1] only for the stage being computed and differentiates with them.
"""

from __future__ import annotations

import torch


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the normalisation runs in: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def head_rstd(p: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms over the head dim: p [T, h, d] -> rstd [T, h, 1] (float32; float64 for float64 p)."""
    return torch.rsqrt(p.to(norm_dtype(p.dtype)).pow(2).mean(-1, keepdim=True) + eps)


def head_norm(p: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, out: torch.Tensor | None = None):
    """weight [d] * (p [T, h, d] · rstd [T, h, 1], cast to p's dtype) -> [T, h, d]; `out` may be p itself."""
    return torch.mul(weight, (p.to(rstd.dtype) * rstd).to(p.dtype), out=out)


def head_norm_backward(p, weight, rstd, dy, dw: torch.Tensor | None) -> torch.Tensor:
    """Gradient of p [T, h, d] (p's dtype) given dy [T, h, d] (p's dtype), the gradient of `head_norm`'s output;
    adds the weight's gradient (summed over rows and heads) to dw [d] (float32, or float64 for float64 inputs)
    unless dw is None.

    As autograd through HF's formula: d(weight·y16) -> dy·y16 and dy·weight in p's dtype, the rest in float32."""
    d = p.shape[-1]
    xhat = p.to(rstd.dtype) * rstd  # [T, h, d] normalised, float32
    if dw is not None:
        dw += (dy * xhat.to(p.dtype)).reshape(-1, d).sum(0, dtype=dw.dtype)
    g = (dy * weight).to(rstd.dtype)  # gradient of xhat [T, h, d]
    mean = (g * xhat).mean(-1, keepdim=True)  # [T, h, 1]
    return g.sub_(xhat.mul_(mean)).mul_(rstd).to(p.dtype)  # rstd·(g - xhat·mean(g·xhat))
