"""Tiny Llama (GQA) under every supported layout equals the single-process model, float32, on gloo.

One 4-rank job runs all layouts one after another (megatron's parallel state is rebuilt per layout): the
reference (no TP/PP/CP, dp4: every rank trains the full batch), then TP2+SP, PP2, and CP2/CP4 with Ulysses and
UPipe for every legal U, combined with DP2, TP2+SP and PP2, and CP2 UPipe with full activation recompute. Every layout loads the same HF-named weights and
trains 3 Adam steps (grad clipping on) on the same global batch. Compared: the loss at every step (rtol 1e-5),
every parameter's gradient after the first step (relative norm error <= 1e-5; this covers the gradient
reduction over data- and context-parallel ranks, the SP norm all-reduce and the PP embedding/output split) and
every parameter after the last step (relative norm error <= 5e-5: Adam divides by sqrt(v), which amplifies
1e-7-level gradient rounding differences).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_helper import run_on_ranks

ARCH = "tiny-gqa"  # H=8 query heads, G=2 KV heads, d=8, D=64, 2 layers
VOCAB, BATCH, SEQ, STEPS = 256, 4, 32, 3

LAYOUTS = [
    dict(tp=2, sequence_parallel=True, dp=2),
    dict(pp=2, dp=2),
    dict(cp=2, dp=2, cp_strategy="ulysses"),
    *[dict(cp=2, dp=2, cp_strategy="upipe", upipe_heads_per_stage=u) for u in (2, 4, 8)],
    dict(cp=4, cp_strategy="ulysses"),
    *[dict(cp=4, cp_strategy="upipe", upipe_heads_per_stage=u) for u in (4, 8)],
    dict(tp=2, sequence_parallel=True, cp=2, cp_strategy="ulysses"),
    *[dict(tp=2, sequence_parallel=True, cp=2, cp_strategy="upipe", upipe_heads_per_stage=u) for u in (2, 4)],
    dict(pp=2, cp=2, cp_strategy="upipe"),
]
# again with full activation recompute (the paper's setting)
RECOMPUTE = dict(cp=2, dp=2, cp_strategy="upipe", run=dict(recompute_granularity="full"), tag="+recompute")


def _job(rank, world_size, layouts):
    from tests.llama_harness import run_layouts

    runs = run_layouts(world_size, ARCH, VOCAB, BATCH, SEQ, STEPS, layouts + [RECOMPUTE])
    return {name: (layout.cp_strategy, r) for name, (layout, r) in runs.items()}


@pytest.fixture(scope="module")
def results():
    per_rank = run_on_ranks(_job, 4, LAYOUTS)
    for other in per_rank[1:]:  # every rank reports the same gathered numbers
        for key, (_, r) in other.items():
            assert r.losses == per_rank[0][key][1].losses
    return per_rank


def test_all_layouts_ran(results):
    assert len(results[0]) == len(LAYOUTS) + 2


def test_losses_gradients_and_parameters_match_reference(results):
    from tests.llama_harness import rel_err

    (ref_name, (_, ref)), *others = results[0].items()
    assert ref_name == "tp1-pp1-cp1:none-dp4"
    assert all(b < a for a, b in zip(ref.losses, ref.losses[1:])), f"reference does not train: {ref.losses}"
    failures = []
    for name, (_, r) in others:
        if not torch.allclose(torch.tensor(r.losses), torch.tensor(ref.losses), rtol=1e-5, atol=1e-6):
            failures.append(f"{name}: losses {r.losses} != {ref.losses}")
        if r.grads.keys() != ref.grads.keys() or r.params.keys() != ref.params.keys():
            failures.append(f"{name}: parameter names differ")
            continue
        for key in ref.grads:
            if (e := rel_err(r.grads[key], ref.grads[key])) > 1e-5:
                failures.append(f"{name}: grad {key} rel err {e:.2e}")
            if (e := rel_err(r.params[key], ref.params[key])) > 5e-5:
                failures.append(f"{name}: param {key} after {STEPS} steps rel err {e:.2e}")
    assert not failures, "\n".join(failures)


def test_headwise_cp_never_projects_all_heads(results):
    """UPipe/Ulysses read row slices of linear_qkv.weight; linear_qkv.forward must never run."""
    for rank_results in results:
        for name, (strategy, r) in rank_results.items():
            if strategy in ("ulysses", "upipe"):
                assert r.qkv_forward_calls == 0, name
            else:
                assert r.qkv_forward_calls > 0, name  # every stage holds at least one layer
