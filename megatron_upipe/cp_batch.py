"""Cut a global batch into this context-parallel rank's share of every sequence.

Legend: b batch, N global sequence length, C context-parallel size, r this rank's index in the CP group.

Two splits, chosen by the layer spec (`CPPlan.sequence_split`), never by the strategy name:
- "contiguous" (Ulysses, UPipe): rank r keeps tokens [r·N/C, (r+1)·N/C). Both strategies give every rank the
  *full* sequence for its heads before attention, so causal work is balanced without reordering; the attention
  op receives RoPE angles of all N positions and applies rank r's slice itself. With a ring of R all-to-all
  groups (`ring_size` = CPPlan.cp_ring > 1, hybrid a2a x ring) the sequence is first cut zigzag over the ring,
  then contiguously inside each group of A = C/R ranks: CP rank r = ring rank·A + a2a rank (megatron-core's
  hierarchical CP groups, see megatron_upipe.parallel) keeps `local_positions(N, r % A, A, r // A, R)`.
- "zigzag" (TransformerEngine's p2p / a2a / a2a+p2p): the sequence is cut into 2C chunks and rank r keeps chunks
  r and 2C-1-r (megatron-core's `get_batch_on_this_cp_rank`), which balances causal ring attention.
"""

from __future__ import annotations

import torch

from megatron_upipe.attention.layout import cp_rank_positions, local_positions

SPLITS = ("contiguous", "zigzag")


def split_sequence(t: torch.Tensor, split: str, cp_rank: int, cp_size: int, seq_dim: int = 1,
                   ring_size: int = 1) -> torch.Tensor:
    """[.., N, ..] -> [.., N/C, ..] along `seq_dim`: this rank's tokens under `split` (positions from
    attention.layout.local_positions: contiguous = C all-to-all ranks, or C/R of them in a ring of R groups when
    ring_size = R > 1; zigzag = a ring of C)."""
    if split not in SPLITS:
        raise ValueError(f"sequence split {split!r} is unknown; choose one of {SPLITS}")
    if ring_size < 1 or cp_size % ring_size or (ring_size > 1 and split != "contiguous"):
        raise ValueError(f"ring_size={ring_size} must divide the {cp_size} CP ranks (and needs the contiguous split)")
    if cp_size == 1:
        return t
    N = t.shape[seq_dim]
    try:
        pos = (cp_rank_positions(N, cp_rank, cp_size, ring_size) if split == "contiguous" else
               local_positions(N, 0, 1, cp_rank, cp_size))  # [N/C]
    except ValueError as e:
        raise ValueError(f"{e} ({split} split over {cp_size} CP ranks)") from None
    if split == "contiguous" and ring_size == 1:
        return t.narrow(seq_dim, int(pos[0]), pos.numel())  # a view, as before
    return t.index_select(seq_dim, pos.to(t.device))  # [.., N/C, ..]


def split_batch(batch: dict[str, torch.Tensor | None], split: str, cp_group,
                ring_size: int = 1) -> dict[str, torch.Tensor | None]:
    """Apply `split_sequence` to every [b, N] tensor of a batch (tokens, labels, loss_mask, position_ids)."""
    cp_size = cp_group.size() if cp_group is not None else 1
    cp_rank = cp_group.rank() if cp_group is not None else 0
    return {k: (None if v is None else split_sequence(v, split, cp_rank, cp_size, seq_dim=1, ring_size=ring_size))
            for k, v in batch.items()}
