"""attention.layout.local_positions: the global token positions each rank of an a2a x ring layout holds (the public
layout of the hybrid UPipe x ring issue; with ring_size=1 today's contiguous split)."""

from __future__ import annotations

import pytest
import torch

from megatron_upipe.attention import local_positions


@pytest.mark.parametrize("N, A, R", [(48, 1, 1), (48, 4, 1), (48, 1, 2), (48, 2, 2), (96, 2, 4), (96, 4, 2),
                                     (120, 3, 5)])  # lengths that are not powers of two included
def test_every_position_is_held_once_and_the_causal_work_is_balanced(N, A, R):
    held = {(a, r): local_positions(N, a, A, r, R) for a in range(A) for r in range(R)}
    everything = torch.cat(list(held.values()))
    assert torch.equal(everything.sort().values, torch.arange(N))  # a partition of the sequence
    assert all(p.dtype == torch.int64 and p.numel() == N // (A * R) for p in held.values())
    # causal work of a ring rank's group: sum over its queries of the keys they keep (position + 1); equal for all r
    work = {r: sum(int((held[(a, r)] + 1).sum()) for a in range(A)) for r in range(R)}
    assert len(set(work.values())) == 1, work
    n = N // (2 * R)
    if R > 1:
        assert work[0] == (2 * R - 1) * n * n + n * (n + 1)
        # the group's tokens, reassembled over its a2a ranks in rank order: chunk r, then chunk 2R-1-r
        for r in range(R):
            group = torch.cat([held[(a, r)] for a in range(A)])
            assert torch.equal(group, torch.cat([torch.arange(r * n, (r + 1) * n),
                                                 torch.arange((2 * R - 1 - r) * n, (2 * R - r) * n)]))


def test_ring_size_one_is_the_contiguous_split():
    for a in range(4):
        assert torch.equal(local_positions(64, a, 4), torch.arange(16 * a, 16 * (a + 1)))


@pytest.mark.parametrize("args, message", [
    ((50, 0, 4, 0, 1), "sequence length 50 is not a positive multiple of 4"),
    ((48, 0, 2, 0, 5), "not a positive multiple of 20 (a2a 2 x ring 5 x 2 zigzag chunks)"),
    ((48, 2, 2, 0, 1), "a2a_rank=2 is not a rank of the a2a group of 2"),
    ((48, 0, 2, 3, 2), "ring_rank=3 is not a rank of the ring group of 2"),
])
def test_bad_layouts_are_refused(args, message):
    with pytest.raises(ValueError) as e:
        local_positions(*args)
    assert message in str(e.value)
