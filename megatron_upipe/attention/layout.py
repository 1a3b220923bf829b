"""Which global token positions a context-parallel rank holds: one function for every layout.

Legend: N global sequence length, A all-to-all (Ulysses/UPipe) group size, a this rank's index in it, R ring size,
r this rank's index in the ring.

- R = 1 (Ulysses, UPipe): rank a holds the contiguous tokens [a·N/A, (a+1)·N/A). The seq->head all-to-all gives
  every rank the full sequence for its heads, so causal work is balanced without reordering.
- R > 1 (a ring of all-to-all groups, and TransformerEngine's zigzag with A = 1): the sequence is cut into 2R
  chunks of N/(2R) tokens; ring rank r's group holds chunks r and 2R-1-r (in that order), which gives every ring
  rank the same causal work: the (query, key) pairs its queries keep sum to (2R-1)·n² + n(n+1) with n = N/(2R),
  whatever r. Inside the group the N/R tokens are split contiguously over the A ranks, so the group's seq->head
  all-to-all reassembles chunk r followed by chunk 2R-1-r for each head.
"""

from __future__ import annotations

import torch


def local_positions(N: int, a2a_rank: int, a2a_size: int, ring_rank: int = 0, ring_size: int = 1) -> torch.Tensor:
    """Global positions (int64 [N / (a2a_size·ring_size)], in the order the rank holds its tokens) of rank
    (a2a_rank, ring_rank) of an a2a_size x ring_size layout (see the module docstring)."""
    for name, rank, size in (("a2a", a2a_rank, a2a_size), ("ring", ring_rank, ring_size)):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"{name}_rank={rank} is not a rank of the {name} group of {size}")
    parts = a2a_size if ring_size == 1 else 2 * ring_size * a2a_size
    if N < 1 or N % parts:
        raise ValueError(f"sequence length {N} is not a positive multiple of {parts} (a2a {a2a_size} x ring "
                         f"{ring_size}{' x 2 zigzag chunks' if ring_size > 1 else ''}): pad the sequence or change "
                         f"the layout")
    if ring_size == 1:
        n = N // a2a_size
        return torch.arange(a2a_rank * n, (a2a_rank + 1) * n)
    n = N // (2 * ring_size)  # tokens per zigzag chunk
    group = torch.cat([torch.arange(ring_rank * n, (ring_rank + 1) * n),  # [N/R]: chunk r, then chunk 2R-1-r
                       torch.arange((2 * ring_size - 1 - ring_rank) * n, (2 * ring_size - ring_rank) * n)])
    m = N // (ring_size * a2a_size)
    return group[a2a_rank * m:(a2a_rank + 1) * m]


def cp_rank_positions(N: int, cp_rank: int, cp_size: int, ring_size: int = 1) -> torch.Tensor:
    """`local_positions` of CP rank `cp_rank` of `cp_size` when the CP group is cut into all-to-all groups of
    A = cp_size / ring_size consecutive ranks and a ring of them: CP rank = ring rank·A + a2a rank (megatron-core's
    hierarchical CP groups, megatron_upipe.parallel)."""
    if ring_size < 1 or cp_size % ring_size:
        raise ValueError(f"ring_size={ring_size} must divide the {cp_size} CP ranks")
    A = cp_size // ring_size
    return local_positions(N, cp_rank % A, A, cp_rank // A, ring_size)
