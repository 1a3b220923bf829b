"""The training job gives the same loss curve (float32) under cp=1, cp=2 UPipe, tp=2 x cp=2 UPipe and hybrid
a2a x ring UPipe (parallel.cp_ring: cp 4 = 2x2, and tp=2 x cp 2 = 1x2).

One 4-rank gloo job runs pretrain_llama.main() on the shipped corpus: dp4 (no context parallelism), cp2 UPipe x
dp2, tp2 x cp2 UPipe (dp1), cp 2x2 UPipe and tp2 x cp 1x2 UPipe. The global batch (4 sequences of 64 tokens, seed
1234) is the same in every layout; megatron-core's CPU initialisation gives the same initial weights. Compared per
step: the loss (rtol 1e-5) and the global gradient norm (rtol 1e-4), over 4 Adam steps with clipping and warmup +
cosine LR. The cp2 run's step-2 checkpoint is then resumed as cp=4 UPipe (dp1), and the 2x2 run's as cp 1x4 (a
ring of 4, with the ring's P2P passes overlapped: memory.ring_overlap): steps 3-4 must follow the same curve.
"""

from __future__ import annotations

import math

import pytest

from tests.dist_helper import run_on_ranks
from tests.train_harness import SMALL, read_metrics, run_main

STEPS = 4
LAYOUTS = {
    "cp1": ["parallel.cp=1", "parallel.cp_strategy=none"],
    "cp2-upipe": ["parallel.cp=2", "parallel.cp_strategy=upipe"],
    "tp2xcp2-upipe": ["parallel.tp=2", "parallel.cp=2", "parallel.cp_strategy=upipe"],
    "cp2x2-upipe": ["parallel.cp=4", "parallel.cp_ring=2", "parallel.cp_strategy=upipe"],
    "tp2xcp1x2-upipe": ["parallel.tp=2", "parallel.cp=2", "parallel.cp_ring=2", "parallel.cp_strategy=upipe"],
}
RESUMED = {  # name: (the run whose checkpoint it loads, its layout)
    "cp4-upipe-resumed": ("cp2-upipe", ["parallel.cp=4", "parallel.cp_strategy=upipe"]),
    "cp1x4-upipe-resumed": ("cp2x2-upipe", ["parallel.cp=4", "parallel.cp_ring=4", "parallel.cp_strategy=upipe",
                                            "memory.ring_overlap=true"]),
}
RESUME_AT = 2  # cp2-upipe (x dp2) saves here; a cp=4 UPipe run (dp1) resumes from it


def _job(rank, world_size, tmp):
    out = {name: run_main(*SMALL, f"train.steps={STEPS}", f"log.metrics_file={tmp}/{name}.jsonl",
                          f"checkpoint.dir={tmp}/{name}", f"checkpoint.interval={RESUME_AT}", *overrides)
           for name, overrides in LAYOUTS.items()}
    for name, (source, overrides) in RESUMED.items():
        out[name] = run_main(*SMALL, f"train.steps={STEPS}", f"log.metrics_file={tmp}/{name}.jsonl", *overrides,
                             f"checkpoint.load={tmp}/{source}/iter_{RESUME_AT:07d}")
    return out


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("equiv")
    per_rank = run_on_ranks(_job, 4, str(tmp))
    for rank, results in enumerate(per_rank):
        for name, (code, err) in results.items():
            assert code == 0, f"rank {rank}, {name}: exit {code}\n{err}"
    return {name: read_metrics(tmp / f"{name}.jsonl") for name in [*LAYOUTS, *RESUMED]}


def test_every_layout_ran_every_step(curves):
    for name, records in curves.items():
        first = RESUME_AT + 1 if name in RESUMED else 1
        assert [r["step"] for r in records] == list(range(first, STEPS + 1)), name
        assert all(math.isfinite(r["loss"]) for r in records), name


def test_loss_curves_equal_across_layouts(curves):
    ref = curves["cp1"]
    assert ref[-1]["loss"] < ref[0]["loss"], f"cp1 does not train: {[r['loss'] for r in ref]}"
    for name, records in curves.items():
        for r in records:
            q = ref[r["step"] - 1]
            assert r["loss"] == pytest.approx(q["loss"], rel=1e-5), f"{name} step {r['step']}"
            assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=1e-4), f"{name} step {r['step']}"
            assert r["lr"] == q["lr"], f"{name} step {r['step']}"
