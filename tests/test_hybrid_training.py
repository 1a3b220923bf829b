"""Hybrid a2a x ring context parallelism (parallel.cp_ring) in the megatron-core model equals the single-process
model, float32, on gloo.

One 4-rank job: the reference (no TP/PP/CP, dp4: every rank trains the full batch), then UPipe and Ulysses with the
CP ranks cut into all-to-all groups of A and a ring of R of them (A x R = 2x2, 1x2, 1x4), combined with DP2, TP2+SP
and PP2. The sequence length, 24, is not a power of two (2·cp zigzag chunks of 3 tokens at cp 4). Every layout loads
the same HF-named weights and trains 3 Adam steps on the same global batch (tests/llama_harness.py), through
megatron's hierarchical CP groups, our batch split (attention.layout.local_positions), the RoPE rows of those
positions and the ring inside each UPipe stage. Compared as in tests/test_llama_layouts.py: the loss at every step
(rtol 1e-5), every gradient after the first step (relative norm error <= 1e-5) and every parameter after the last
step (<= 5e-5: Adam divides by sqrt(v), which amplifies 1e-7-level gradient rounding differences).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_helper import run_on_ranks

ARCH = "tiny-gqa"  # H=8 query heads, G=2 KV heads, d=8, D=64, 2 layers
VOCAB, BATCH, SEQ, STEPS = 256, 4, 24, 3

LAYOUTS = [
    dict(cp=4, cp_ring=2, cp_strategy="ulysses"),  # 2x2
    *[dict(cp=4, cp_ring=2, cp_strategy="upipe", upipe_heads_per_stage=u) for u in (2, 4)],  # 2x2, 4 / 2 stages
    dict(cp=2, cp_ring=2, dp=2, cp_strategy="upipe", upipe_heads_per_stage=2),  # 1x2 (a ring of single ranks)
    dict(cp=4, cp_ring=4, cp_strategy="upipe", upipe_heads_per_stage=4),  # 1x4
    dict(tp=2, sequence_parallel=True, cp=2, cp_ring=2, cp_strategy="upipe", upipe_heads_per_stage=2),
    dict(pp=2, cp=2, cp_ring=2, cp_strategy="upipe", upipe_heads_per_stage=2),
]


def _job(rank, world_size, layouts):
    from tests.llama_harness import run_layouts

    return {name: r for name, (_, r) in run_layouts(world_size, ARCH, VOCAB, BATCH, SEQ, STEPS, layouts).items()}


def _groups_job(rank, world_size):
    from megatron_upipe.parallel import ParallelLayout, destroy_parallel, initialize_parallel

    pg = initialize_parallel(ParallelLayout(cp=4, cp_ring=2, cp_strategy="upipe"))
    try:
        a2a, ring = pg.hcp
        return pg.cp.rank(), a2a.rank(), a2a.size(), ring.rank(), ring.size()
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def results():
    per_rank = run_on_ranks(_job, 4, LAYOUTS)
    for other in per_rank[1:]:  # every rank reports the same gathered numbers
        for key, r in other.items():
            assert r.losses == per_rank[0][key].losses
    return per_rank[0]


def test_hybrid_layouts_match_reference(results):
    from tests.llama_harness import rel_err

    (ref_name, ref), *others = results.items()
    assert ref_name == "tp1-pp1-cp1:none-dp4"
    assert len(others) == len(LAYOUTS) and all("x" in name for name, _ in others), list(results)
    assert all(b < a for a, b in zip(ref.losses, ref.losses[1:])), f"reference does not train: {ref.losses}"
    failures = []
    for name, r in others:
        if not torch.allclose(torch.tensor(r.losses), torch.tensor(ref.losses), rtol=1e-5, atol=1e-6):
            failures.append(f"{name}: losses {r.losses} != {ref.losses}")
        assert r.grads.keys() == ref.grads.keys() and r.params.keys() == ref.params.keys(), name
        for key in ref.grads:
            if (e := rel_err(r.grads[key], ref.grads[key])) > 1e-5:
                failures.append(f"{name}: grad {key} rel err {e:.2e}")
            if (e := rel_err(r.params[key], ref.params[key])) > 5e-5:
                failures.append(f"{name}: param {key} after {STEPS} steps rel err {e:.2e}")
        assert r.qkv_forward_calls == 0, name  # the op projects per stage, as without the ring
    assert not failures, "\n".join(failures)


def test_hybrid_groups_and_positions():
    """megatron's hierarchical CP groups are [a2a, ring] with CP rank = ring rank·A + a2a rank, the layout our
    batch split and RoPE rows assume; checked on 4 ranks for cp 4 = 2x2."""
    got = run_on_ranks(_groups_job, 4)
    assert [(c, a, r) for c, a, _, r, _ in got] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    assert {(A, R) for _, _, A, _, R in got} == {(2, 2)}
