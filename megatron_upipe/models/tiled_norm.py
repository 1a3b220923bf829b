"""RMSNorm that saves only its input and per-token 1/rms, computing in sequence tiles.

Legend: s_l tokens of this rank, T tokens of one tile, b batch, D hidden size.

The plain `RMSNorm` (norm.py) is three autograd ops; in bf16 they keep a float32 copy of the input and the
normalised bf16 tensor for backward: 6 bytes per element of [s_l, b, D] on top of the input, i.e. three bf16
[s_l, b, D] tensors per norm (at 750K tokens per rank and D=4096: 18 GiB per norm, two norms per layer). This
norm's autograd Function saves the input x (the residual stream, alive anyway) and rstd [s_l, b, 1] float32; both
passes work tile by tile, so the float32 temporaries are [T, b, D]. Same formula as `RMSNorm` (float32, cast
back, then the weight; the tile math is megatron_upipe.attention.norm_tiles, shared with the UPipe/Ulysses
op's fused input norm), same parameter, same `sequence_parallel` marking (weight gradient all-reduced over TP by
megatron's finalize_model_grads).

With `residual_grad` (memory.residual_grad_in_place; the pre-MLP norm) the norm also returns its input as the
layer's residual, the (output, residual) pair megatron-core's TransformerLayer takes from a pre-MLP norm. Its
backward then receives both gradients at once, the residual path's (the layer output's gradient) and the MLP's,
and adds its own input gradient into the residual path's tensor tile by tile: d(h) = d_residual + d_norm without a
second [s_l, b, D] tensor. Each element is the same bf16 (or float32) sum autograd's accumulation forms, so the
result is bit-identical (tests/test_residual_grad.py). The residual path's gradient is written in place: by then its
other reader, the MLP's backward, has finished (it produced this norm's output gradient).
"""

from __future__ import annotations

import torch

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_upipe.attention.norm_tiles import rms_tile, rms_tile_backward, rms_tile_rstd
from megatron_upipe.models.norm import RMSNorm
from megatron_upipe.models.seq_tiles import tile_bounds


class _TiledRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, chunks, residual):
        # x [s_l, b, D], weight [D] -> [s_l, b, D] (and with residual, x itself as a view [s_l, b, D])
        out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)  # [s_l, b, D]
        rstd = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)  # [s_l, b, 1]
        for start, end in tile_bounds(x.shape[0], chunks):
            rms_tile_rstd(x[start:end], eps, rstd[start:end])
            rms_tile(x[start:end], weight, rstd[start:end], out=out[start:end])
        ctx.save_for_backward(x, weight, rstd)
        ctx.chunks = chunks
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zeros [s_l, b, D])
        return (out, x.view_as(x)) if residual else out

    @staticmethod
    def backward(ctx, dout, dres=None):
        x, weight, rstd = ctx.saved_tensors
        dw = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                         device=weight.device)  # [D]
        into = dres is not None and dres.dtype == x.dtype and dres.shape == x.shape
        dx = dres if into else torch.empty_like(x)  # [s_l, b, D]: the residual path's gradient, added to in place
        if dout is not None:
            for start, end in tile_bounds(x.shape[0], ctx.chunks):
                tile = rms_tile_backward(x[start:end], weight, rstd[start:end], dout[start:end], dw)
                if into:
                    dx[start:end] += tile
                else:
                    dx[start:end] = tile
        elif not into:
            dx.zero_()
        if dres is not None and not into:
            dx = dx + dres
        return dx, None if dout is None else dw.to(weight.dtype), None, None, None


def tiled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, chunks: int, residual: bool = False):
    """weight * (x * rsqrt(mean(x², -1) + eps)) in float32, cast to x's dtype before the weight; [s, b, D]. With
    `residual`: (that, x as the residual), the input's gradient formed in the residual's (module docstring)."""
    return _TiledRMSNorm.apply(x, weight, eps, chunks, residual)


class TiledRMSNorm(RMSNorm):
    """residual_grad: forward returns (output, residual), the pre-MLP norm's pair (module docstring)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, *, chunks: int,
                 residual_grad: bool = False) -> None:
        if chunks < 1:
            raise ValueError(f"norm chunks={chunks} must be positive")
        super().__init__(config, hidden_size, eps)
        self.chunks = chunks
        self.residual_grad = residual_grad

    def forward(self, x: torch.Tensor):  # [s, b, h] -> [s, b, h] (with residual_grad: ([s, b, h], [s, b, h]))
        if self.deferred:  # applied by the consumer (see norm.RMSNorm)
            return x
        return tiled_rms_norm(x, self.weight, self.eps, self.chunks, self.residual_grad)
