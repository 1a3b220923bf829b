"""Sequence tiles, their tensor-parallel resharding and weight-gradient accumulation over tiles, shared by the
tiled MLP and the chunked LM loss.

Legend: s_l tokens of this rank ([s/C] without sequence parallelism, [s/(C·t)] with it), T tokens of one tile,
b batch, h any hidden size, t tensor-parallel size.

A tile is a contiguous range of this rank's s_l tokens. With sequence parallelism every TP rank holds the same
number of tokens, so tile i has the same bounds on all TP ranks; gathering tile i over TP gives the t·T tokens
{r·s_l + [start, end) : r < t} rank-major. Token-wise ops (MLP, LM head, cross-entropy) do not care about the
order, and reduce-scattering a [t·T, b, h] result hands each rank back exactly its own T tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tile_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """`chunks` contiguous, non-empty [start, end) ranges covering `length` (sizes differ by at most one).

    Any length works: with fewer tokens than chunks there is one token per tile.
    """
    if chunks < 1:
        raise ValueError(f"chunks={chunks} must be positive")
    n = max(1, min(chunks, length))
    base, extra = divmod(length, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def gather_tile(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """[T, b, h] -> [t·T, b, h] (rank-major) with SP; unchanged without it (every TP rank holds all tokens)."""
    t = dist.get_world_size(group) if group is not None else 1
    if not sequence_parallel or t == 1:
        return x
    out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # [t·T, b, h]
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def reduce_scatter_tile(y: torch.Tensor, group, out: torch.Tensor) -> None:
    """Sum over TP and write this rank's share into `out` (a contiguous [T, b, h] slice of a buffer):
    [t·T, b, h] -> [T, b, h]."""
    dist.reduce_scatter_tensor(out, y.contiguous(), group=group)


def tp_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def grad_accumulator(weight: torch.Tensor) -> torch.Tensor:
    """Zeros like `weight`, in float32 for bf16/fp16 weights: per-tile weight gradients are summed in float32."""
    dtype = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
    return torch.zeros(weight.shape, dtype=dtype, device=weight.device)


def accumulate_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b; acc may be float32 while a, b are bf16/fp16 (each tile's product is rounded to their dtype
    first, as megatron's per-micro-batch weight gradients are before they reach main_grad)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)
