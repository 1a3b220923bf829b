"""`tools/estimate_memory.py --fastest`: the fastest stack that fits (planner/fastest.py).

The shape: the `tiny-mha` preset (4 heads, 4 layers: partial recompute of 1 and 2) on cp 2 at 16K tokens, float32,
where the memory ladders' rungs differ by MiB. Every stack the search could choose (every legal U x pipelined stages
(serial, true, outputs) x ladder x rung: 40) is planned once (the brute force); the search, run at several device
sizes with those same plans, must return the fastest stack that fits among all of them, having planned fewer; the
ladder's premise (device memory falls and the modelled time rises rung by rung; every overlap variant does the same
work) holds in the brute force; when nothing fits it refuses in one line. The CLI writes the JSON the issue names.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_helper import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "examples/configs/tiny_cpu.yaml")
SEQ, VOCAB = 16384, 512  # mock data draws ids below max(vocab, 258)
SHAPE = ("model.preset=tiny-mha", "model.num_layers=4", f"model.vocab_size={VOCAB}", "data.path=mock",
         "data.tokenizer=null", "train.micro_batch_size=1", "train.global_batch_size=1", "memory.plan_check=false")
NO_MARGINS = ["--cuda-context-gib", "0", "--nccl-gib", "0", "--fragmentation", "0"]
GIB = 2**30


def _job(rank, world_size, capacities):
    import torch.distributed as dist

    import megatron_upipe.planner.fastest as fastest
    from megatron_upipe.config import ConfigError
    from megatron_upipe.planner.devices import Margins
    from megatron_upipe.planner.estimate import ConfigSource, estimate
    from megatron_upipe.planner.step_time import HARDWARE

    dist.destroy_process_group()  # the planner makes its own fake one
    hw, none = HARDWARE["h100-80gb"], Margins(0, 0, 0.0)
    plans = {}  # (overrides, strategy) -> Estimate at an unlimited device

    def planned(source, world, vocab, strategy, seq, gpu_mem_bytes, margins, jobs=1, memo=None):
        key = (source.overrides, strategy)
        if key not in plans:
            plans[key] = estimate(source, world, vocab, strategy, seq, 2**50, margins, jobs=jobs)
        e = plans[key]
        return dataclasses.replace(e, gpu_mem_bytes=gpu_mem_bytes, fits=e.peak_bytes <= gpu_mem_bytes and e.host_fits)

    fastest.estimate = planned  # every plan once, shared by the brute force and the searches
    source = ConfigSource(CONFIG, SHAPE)
    chains = fastest.ladders(source, 2)
    brute, works = {}, {}
    for U in (2, 4):
        for overlap in (False, True, "outputs") if U < 4 else (False,):
            for chain, rungs in chains.items():
                for r, rung in enumerate(rungs):
                    s = ConfigSource(CONFIG, (*SHAPE, *rung.overrides, f"memory.upipe_overlap={str(overlap).lower()}"))
                    e = planned(s, 2, VOCAB, f"upipe:{U}", SEQ, 2**50, none)
                    brute[(U, overlap, chain, r)] = (e.peak_bytes, e.host_fits, fastest.step_time(e, 2, hw).seconds)
                    works[(U, overlap, chain, r)] = e.work
    found = {}
    for gib in capacities:
        before = len(plans)
        try:
            f = fastest.search_fastest(source, 2, VOCAB, SEQ, int(gib * GIB), none, hw)
            b = f.best
            found[gib] = ((b.heads_per_stage, b.overlap, b.ladder, b.rung), b.seconds, len(f.tried), f.to_dict())
        except ConfigError as e:
            found[gib] = str(e)
        assert len(plans) - before <= 1  # the baseline at most: the brute force planned every stack
    same_work = all(w == works[(U, False, chain, r)] for (U, overlap, chain, r), w in works.items())
    return brute, found, {name: len(rungs) for name, rungs in chains.items()}, same_work


CAPACITIES = (1.0, 0.06, 0.05, 0.035, 0.025, 0.001)


@pytest.fixture(scope="module")
def searched():
    return run_on_ranks(_job, 1, CAPACITIES)[0]


def test_ladder_premise_memory_falls_and_time_rises_rung_by_rung(searched):
    """On each ladder memory falls and time rises rung by rung; pipelined stages never plan less than serial ones at
    the same U and rung (the search starts them at the serial floor), and the smallest U serially plans no more
    than any stack at the same rung (where it does not fit, the search plans no other U)."""
    brute, _, sizes, same_work = searched
    for U, overlap, chain in {(U, o, c) for U, o, c, _ in brute}:
        peaks = [brute[(U, overlap, chain, r)][0] for r in range(sizes[chain])]
        times = [brute[(U, overlap, chain, r)][2] for r in range(sizes[chain])]
        assert peaks == sorted(peaks, reverse=True), (U, overlap, peaks)
        assert all(b >= a * (1 - 1e-12) for a, b in zip(times, times[1:])), (U, overlap, times)  # float sums
    for (U, overlap, chain, r), (peak, _, _) in brute.items():  # pipelined stages start at the serial floor
        if overlap:
            assert peak >= brute[(U, False, chain, r)][0], (U, chain, r)
        if overlap == "outputs":  # drained outputs hold less than pipelined stages
            assert peak <= brute[(U, True, chain, r)][0], (U, chain, r)
    for (U, overlap, chain, r), (peak, _, _) in brute.items():  # the smallest U holds the least at every rung
        assert brute[(2, False, chain, r)][0] <= peak, (U, overlap, chain, r)
    # every variant does the same work (the search prices a variant from the serial candidate's work)
    assert same_work


@pytest.mark.parametrize("gib", CAPACITIES[:-1])
def test_search_returns_the_fastest_stack_that_fits(searched, gib):
    brute, found, _, _ = searched
    fitting = {k: t for k, (peak, host, t) in brute.items() if peak <= gib * GIB and host}
    assert fitting, f"{gib} GiB: the test's capacities must leave something that fits"
    choice, seconds, tried, as_dict = found[gib]
    assert seconds == min(fitting.values()), (gib, choice, seconds, sorted(fitting.items(), key=lambda kv: kv[1])[:3])
    assert choice in fitting
    assert tried < len(brute), (gib, tried)  # bisection and the U rule pruned
    assert as_dict["fits"] and as_dict["peak_bytes"] <= gib * GIB and as_dict["step_time_s"] == seconds
    assert 0 < as_dict["mfu"] < 1 and as_dict["baseline"]["overrides"] == []


def test_capacities_make_different_choices(searched):
    _, found, _, _ = searched
    rungs = {found[g][0][2:] for g in CAPACITIES[:-1]}
    assert len(rungs) == len(CAPACITIES) - 1, found  # the shape exercises both ladders, partial recompute included
    assert any(f[0][2] == "offloaded" and f[0][3] < 2 for f in found.values() if not isinstance(f, str)), found


def test_nothing_fits_refuses_in_one_line(searched):
    _, found, _, _ = searched
    message = found[CAPACITIES[-1]]
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith("--fastest: no stack fits 0.00 GiB per GPU at train.seq_length=16384: the most frugal "
                              "(memory.recompute=full, ")
    assert "parallel.upipe_heads_per_stage=2) plans" in message and "shorten train.seq_length or use more GPUs" in message


def test_cli_writes_the_json(tmp_path):
    """(The chosen overrides train on CPU in tests/test_auto_stack.py: memory.auto=fastest applies them.) At 0.025 GiB
    the search plans the fewest stacks of the test's capacities (9: the on-device ladder is ruled out at once)."""
    out = tmp_path / "fastest.json"
    proc = subprocess.run([sys.executable, "tools/estimate_memory.py", "--config", CONFIG, "--world-size", "2",
                           "--fastest", "--seq-length", str(SEQ), "--gpu", "0.025", "--speed", "h100-80gb",
                           *NO_MARGINS, "--json", str(out), *SHAPE], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    for key in ("overrides", "fits", "peak_bytes", "host_bytes_per_node", "step_time_s", "tokens_per_s_per_gpu",
                "mfu", "baseline"):
        assert key in got, key
    assert got["fits"] and got["seq_length"] == SEQ and "fastest: " + " ".join(got["overrides"]) in proc.stdout
    assert set(got["baseline"]) >= {"overrides", "fits", "peak_bytes", "step_time_s", "tokens_per_s_per_gpu", "mfu"}
