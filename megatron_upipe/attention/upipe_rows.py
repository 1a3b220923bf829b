"""The UPipe op's input rows and its float32 accumulation (pure torch; upipe.py's docstring has the method).

Legend: s local tokens, b micro-batch, D model dim, R output columns of one GEMM, T rows of one tile.

The op's projections read the rows [s·b, D] of x, or of RMSNorm(x) when the input norm is fused: those rows are
never whole but regenerated tile by tile from x and the saved per-token 1/rms (`_Rows`). `accumulate_mm` adds a
16-bit GEMM product into a float32 buffer without rounding the product to 16 bits.
"""

from __future__ import annotations

import torch

from .norm_tiles import rms_tile, rms_tile_backward, rms_tile_rstd


def _acc_dtype(dtype: torch.dtype, fp32: bool) -> torch.dtype:
    return torch.float32 if fp32 and dtype in (torch.float16, torch.bfloat16) else dtype


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b ([n, k] @ [k, p] into [n, p]) with the sum kept in acc's dtype; a and b share one dtype.

    Same dtype: one addmm_. A float32 acc with 16-bit a, b: on CUDA, cuBLAS writes the product straight into the
    float32 buffer (torch.addmm(..., out_dtype=torch.float32, out=acc): float32 accumulation, no 16-bit product);
    on CPU, which has no such kernel, a and b are upcast to float32 (exactly) and multiplied in float32, a in
    row tiles of p rows so that the temporaries are two float32 [k, p]-sized blocks. Either way nothing is
    rounded to 16 bits: the only roundings are float32 ones.
    """
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        b_up = b.to(acc.dtype)  # [k, p]
        rows = max(1, b.shape[1])
        for r0 in range(0, a.shape[0], rows):
            acc[r0:r0 + rows].addmm_(a[r0:r0 + rows].to(acc.dtype), b_up)  # [T, k] @ [k, p]


def _row_tiles(n: int, rows: int) -> list[tuple[int, int]]:
    """[start, end) ranges of `rows` rows (the last one shorter) covering n rows."""
    return [(a, min(n, a + rows)) for a in range(0, n, rows)]


class _Rows:
    """The op's input rows [s·b, D]: x itself, or RMSNorm(x) regenerated tile by tile (never whole)."""

    def __init__(self, x2: torch.Tensor, norm_w=None, rstd=None, tile_rows: int = 0) -> None:
        self.x2, self.norm_w, self.rstd = x2, norm_w, rstd  # x2 [s·b, D], rstd [s·b, 1] float32
        n = x2.shape[0]
        self.tiles = [(0, n)] if norm_w is None else _row_tiles(n, tile_rows)

    def tile(self, a: int, z: int) -> torch.Tensor:  # [z-a, D]
        return self.x2[a:z] if self.norm_w is None else rms_tile(self.x2[a:z], self.norm_w, self.rstd[a:z])

    def mm(self, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """rows @ w_t (+ bias): [s·b, D] @ [D, R] (+ [R]) -> [s·b, R]; with a bias one addmm, as F.linear."""
        if self.norm_w is None:
            return torch.mm(self.x2, w_t) if bias is None else torch.addmm(bias, self.x2, w_t)
        out = torch.empty((self.x2.shape[0], w_t.shape[1]), dtype=self.x2.dtype, device=self.x2.device)
        for a, z in self.tiles:
            if bias is None:
                torch.mm(self.tile(a, z), w_t, out=out[a:z])
            else:
                torch.addmm(bias, self.tile(a, z), w_t, out=out[a:z])
        return out

    def t_mm(self, g: torch.Tensor) -> torch.Tensor:
        """g^T @ rows: [s·b, R]^T @ [s·b, D] -> [R, D]: one GEMM, or with the norm the tiles' products accumulated
        in float32 for 16-bit inputs (`accumulate_mm`) and rounded once."""
        if self.norm_w is None:
            return torch.mm(g.t(), self.x2)
        acc = torch.zeros((g.shape[1], self.x2.shape[1]), dtype=_acc_dtype(g.dtype, True), device=g.device)
        for a, z in self.tiles:
            accumulate_mm(acc, g[a:z].t(), self.tile(a, z))  # [R, T] @ [T, D]
        return acc.to(g.dtype)


def _norm_rstd(x2: torch.Tensor, op) -> torch.Tensor:
    """Per-token 1/rms of x2 [s·b, D] -> [s·b, 1] float32, tile by tile (op: the StageOp, for its norm's eps and
    tile rows)."""
    rstd = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x2.device)
    for a, z in _row_tiles(x2.shape[0], op.norm_tile_rows):
        rms_tile_rstd(x2[a:z], op.norm_eps, rstd[a:z])
    return rstd


def _norm_backward(dxn: torch.Tensor, xin: _Rows, dtype):
    """Gradient of the normalised rows dxn [s·b, D] (accumulator dtype) -> (dx [s·b, D] in x's dtype, dw_norm
    [D]), tile by tile; dx is written into dxn itself when that has x's dtype."""
    x2 = xin.x2
    dx = dxn if dxn.dtype == dtype else torch.empty(x2.shape, dtype=dtype, device=x2.device)  # [s·b, D]
    dw = torch.zeros(xin.norm_w.shape, dtype=_acc_dtype(dtype, True), device=x2.device)  # [D]
    for a, z in xin.tiles:  # dxn rounded to x's dtype first, as norm-then-op hands it to the norm: same bits
        dx[a:z] = rms_tile_backward(x2[a:z], xin.norm_w, xin.rstd[a:z], dxn[a:z].to(dtype), dw)
    return dx, dw.to(xin.norm_w.dtype)
