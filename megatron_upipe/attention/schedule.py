"""The UPipe head schedule: which query and KV heads every context-parallel rank handles at every stage.

Legend: H query heads, H_kv KV heads, g = H / H_kv, C context-parallel ranks, U heads per stage (summed over
the C ranks), m = U / C query heads per rank per stage, S = H / U stages.

GQA schedule (generalising the paper's U = C schedule to U = m·C): stages are grouped into *KV rounds*. In a
round every rank holds n_kv KV heads (projected and communicated once, resident for the round) and works through
all query heads of those KV heads, m per stage. A KV head is therefore sent once. When the KV heads cannot be
spread over the ranks (H_kv < C, or H_kv·ρ not a multiple of C·n_kv), each KV head is replicated ρ times; replica
e of a KV head serves its own g/ρ query heads, and the replicas' gradients are summed because they read the same
weight rows. ρ is the smallest replication that makes the layout legal (ρ = 1 whenever H_kv is a multiple of C and
the group size fits).

Within a round, rank r's query slots are (a, j) for its a-th resident KV head and j < g_e = g/ρ, flattened as
a·g_e + j; stage σ of the round takes slots σ·m ... σ·m + m − 1. We require m | g_e or g_e | m, so every stage
uses whole, equal-sized GQA groups and the attention kernel sees a plain GQA problem.

All head lists here are in *rank-major* order: entries [r·m, (r+1)·m) belong to CP rank r, which is the order the
seq→head all-to-all needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Stage:
    q_heads: tuple[int, ...]  # U query heads, rank-major: rank r computes q_heads[r*m:(r+1)*m]
    round_index: int  # which KV round this stage belongs to
    kv_slots: tuple[int, int]  # [start, stop) of the resident KV slots (per rank) this stage attends to
    new_round: bool  # True for the first stage of a round: K/V must be projected and communicated first


@dataclass(frozen=True)
class UPipeSchedule:
    num_heads: int
    num_kv_heads: int
    cp_size: int
    heads_per_stage: int
    kv_replication: int  # ρ
    kv_per_rank: int  # n_kv: resident KV heads per rank in one round
    stages: tuple[Stage, ...]
    round_kv_heads: tuple[tuple[int, ...], ...]  # per round: C·n_kv original KV head ids, rank-major

    @property
    def q_per_rank(self) -> int:
        return self.heads_per_stage // self.cp_size

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def effective_group_size(self) -> int:
        return self.group_size // self.kv_replication

    @property
    def q_per_kv_in_stage(self) -> int:
        """Query heads per KV head in every stage's local attention (the kernel's GQA ratio)."""
        return min(self.q_per_rank, self.effective_group_size)


def _check_basic(num_heads: int, num_kv_heads: int, cp_size: int) -> None:
    if num_heads <= 0 or num_kv_heads <= 0 or cp_size <= 0:
        raise ValueError(
            f"num_heads={num_heads}, num_kv_heads={num_kv_heads} and cp size={cp_size} must all be positive"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}: every KV head must serve "
            f"the same number of query heads; use a KV head count that divides {num_heads}"
        )
    if num_heads % cp_size:
        raise ValueError(
            f"num_heads={num_heads} is not divisible by the context-parallel size {cp_size}: Ulysses/UPipe give "
            f"each CP rank whole heads; use a cp size that divides {num_heads} (heads local to one TP rank)"
        )


def _layout(num_heads: int, num_kv_heads: int, cp_size: int, m: int) -> tuple[int, int] | None:
    """Smallest KV replication ρ and resident KV heads per rank n_kv for m query heads per rank, or None."""
    g = num_heads // num_kv_heads
    for rho in (r for r in range(1, g + 1) if g % r == 0):
        g_e, kv_e = g // rho, num_kv_heads * rho
        if m % g_e and g_e % m:
            continue
        n_kv = max(1, m // g_e)
        if kv_e % (cp_size * n_kv) == 0:
            return rho, n_kv
    return None


def _validate(num_heads: int, num_kv_heads: int, cp_size: int, heads_per_stage: int) -> tuple[int, int]:
    _check_basic(num_heads, num_kv_heads, cp_size)
    legal = legal_heads_per_stage(num_heads, num_kv_heads, cp_size)
    hint = f"legal heads_per_stage values for these shapes: {legal}"
    if heads_per_stage <= 0 or heads_per_stage % cp_size:
        raise ValueError(
            f"heads_per_stage={heads_per_stage} is not a positive multiple of the cp size {cp_size}: every CP "
            f"rank must get the same number of heads per stage; {hint}"
        )
    if num_heads % heads_per_stage:
        raise ValueError(
            f"num_heads={num_heads} is not divisible by heads_per_stage={heads_per_stage}: stages must be of "
            f"equal size; {hint}"
        )
    layout = _layout(num_heads, num_kv_heads, cp_size, heads_per_stage // cp_size)
    if layout is None:
        g = num_heads // num_kv_heads
        raise ValueError(
            f"heads_per_stage={heads_per_stage} gives {heads_per_stage // cp_size} query heads per rank per stage, "
            f"which cannot be laid out over num_kv_heads={num_kv_heads} (group size {g}) on {cp_size} CP ranks: "
            f"the per-rank heads and the (possibly replicated) KV group size must divide one another and the KV "
            f"heads must spread evenly over the ranks; {hint}"
        )
    return layout


def legal_heads_per_stage(num_heads: int, num_kv_heads: int, cp_size: int) -> list[int]:
    """Every legal U, ascending. The last one is always num_heads (plain Ulysses), if any is legal."""
    _check_basic(num_heads, num_kv_heads, cp_size)
    return [
        u
        for u in range(cp_size, num_heads + 1, cp_size)
        if num_heads % u == 0 and _layout(num_heads, num_kv_heads, cp_size, u // cp_size) is not None
    ]


@lru_cache(maxsize=256)
def make_schedule(num_heads: int, num_kv_heads: int, cp_size: int, heads_per_stage: int | None = None) -> UPipeSchedule:
    """Build (and validate) the schedule. heads_per_stage=None picks the smallest legal value."""
    if heads_per_stage is None:
        legal = legal_heads_per_stage(num_heads, num_kv_heads, cp_size)
        if not legal:
            raise ValueError(
                f"no legal heads_per_stage for num_heads={num_heads}, num_kv_heads={num_kv_heads}, "
                f"cp size={cp_size}: the KV heads cannot be spread over the CP ranks; change the cp size"
            )
        heads_per_stage = legal[0]
    rho, n_kv = _validate(num_heads, num_kv_heads, cp_size, heads_per_stage)
    C, m = cp_size, heads_per_stage // cp_size
    g = num_heads // num_kv_heads
    g_e = g // rho
    stages_per_round = n_kv * g_e // m
    num_rounds = num_kv_heads * rho // (C * n_kv)

    def query_head(e: int, j: int) -> int:  # j-th query head served by effective (replicated) KV head e
        return (e // rho) * g + (e % rho) * g_e + j

    stages: list[Stage] = []
    rounds: list[tuple[int, ...]] = []
    for t in range(num_rounds):
        eff = [[t * C * n_kv + r * n_kv + a for a in range(n_kv)] for r in range(C)]  # [C][n_kv]
        rounds.append(tuple(e // rho for r in range(C) for e in eff[r]))
        for sigma in range(stages_per_round):
            slots = range(sigma * m, (sigma + 1) * m)
            q = tuple(query_head(eff[r][k // g_e], k % g_e) for r in range(C) for k in slots)
            first, last = slots[0] // g_e, slots[-1] // g_e
            stages.append(Stage(q, t, (first, last + 1), sigma == 0))
    sched = UPipeSchedule(num_heads, num_kv_heads, C, heads_per_stage, rho, n_kv, tuple(stages), tuple(rounds))
    _self_check(sched)
    return sched


def _self_check(s: UPipeSchedule) -> None:
    """Every query head exactly once, and each stage's heads attend to the KV heads of their own group."""
    seen = sorted(h for st in s.stages for h in st.q_heads)
    assert seen == list(range(s.num_heads)), "schedule does not cover every query head exactly once"
    m, g = s.q_per_rank, s.group_size
    for st in s.stages:
        kv = s.round_kv_heads[st.round_index]
        for r in range(s.cp_size):
            local_kv = kv[r * s.kv_per_rank + st.kv_slots[0]: r * s.kv_per_rank + st.kv_slots[1]]
            ratio = s.q_per_kv_in_stage
            for i, h in enumerate(st.q_heads[r * m:(r + 1) * m]):
                assert h // g == local_kv[i // ratio], "query head scheduled away from its KV head"

