"""The UPipe schedule's head ids as index tensors, made once per (schedule, device) (pure torch).

Legend: C ranks, U query heads per stage (rank-major: entries [r·m, (r+1)·m) are rank r's), n_kv resident KV
heads per rank in a KV round, G KV heads, g = H / G. A round's KV head ids [C·n_kv] repeat a head when KV heads are
replicated; their gradients are summed in a fixed order (`ordered_index_add_`).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .schedule import UPipeSchedule


def replica_groups(kv_heads: tuple[int, ...]) -> tuple[tuple[list[int], list[int]], ...]:
    """A round's KV head ids [C·n_kv] (a head repeats when KV heads are replicated, C·n_kv > G) split into groups of
    distinct heads, by occurrence: group r holds (positions, heads) of every head's r-th occurrence, positions in
    increasing order. Summing the groups in turn adds each head's replicas in the order they appear."""
    groups: list[tuple[list[int], list[int]]] = []
    seen: dict[int, int] = {}
    for pos, head in enumerate(kv_heads):
        r = seen.get(head, 0)
        seen[head] = r + 1
        if r == len(groups):
            groups.append(([], []))
        groups[r][0].append(pos)
        groups[r][1].append(head)
    return tuple(groups)


def _build_indices(sched: UPipeSchedule, device: torch.device):
    """Index tensors per stage (query heads [U], and their W_Q rows as (group, j)) and per round (KV head ids
    [C·n_kv], and `replica_groups` as (positions, heads) tensors), rank-major: (stage_heads, stage_rows, round_kv,
    round_groups)."""
    g = sched.group_size
    with torch.inference_mode(False):  # usable outside inference mode too, when cached
        stage_heads = tuple(torch.tensor(st.q_heads, device=device) for st in sched.stages)  # host -> device
        round_kv = tuple(torch.tensor(kv, device=device) for kv in sched.round_kv_heads)
        round_groups = tuple(tuple((torch.tensor(pos, device=device), torch.tensor(heads, device=device))
                                   for pos, heads in replica_groups(kv)) for kv in sched.round_kv_heads)
        return stage_heads, tuple((h // g, h % g) for h in stage_heads), round_kv, round_groups


def ordered_index_add_(dst: torch.Tensor, groups, src: torch.Tensor) -> None:
    """dst.index_add_(0, kv, src) with each head's replicas summed in their order in kv: one index_add_ per group of
    distinct heads (`replica_groups`). index_add_ with repeated indices sums them with atomics in no fixed order on
    CUDA; with distinct indices every row gets one addition, so the result is the same on every run."""
    if len(groups) == 1:
        dst.index_add_(0, groups[0][1], src)
        return
    for pos, heads in groups:
        dst.index_add_(0, heads, src.index_select(0, pos))


@lru_cache(maxsize=64)
def _cached_indices(sched: UPipeSchedule, device: torch.device):
    return _build_indices(sched, device)


def _stage_indices(sched: UPipeSchedule, like: torch.Tensor):
    """`_build_indices` for `like`'s device, made once per (schedule, device) and reused by every later forward and
    backward: the host-to-device copies (a synchronisation each) stay out of the per-layer path and out of CUDA
    graph capture. The schedule is frozen and the index tensors are only read. Fake, meta and other tensor
    subclasses (simulation, tracing) get fresh ones: a cached tensor must not cross into or out of such a mode."""
    if type(like) is torch.Tensor and like.device.type != "meta":
        return _cached_indices(sched, like.device)
    return _build_indices(sched, like.device)
