"""Every rank's verdict made one: the largest value any rank holds, for a few small integers in one collective.

Used where each rank finds something on its own (a stop signal, a deadline, a problem with its own checkpoint file)
and all ranks must then act alike, so that none is left waiting in a collective the others skipped.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def largest_on_any_rank(values: Sequence[int], device: torch.device, group=None) -> list[int]:
    """Collective over `group` (default: all ranks): element-wise, the largest of every rank's `values`."""
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)  # [len(values)]
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]
