"""tools/gpu_check_multirank.py (parts 2-4 of tools/gpu_check.sh) and megatron_upipe/benchmarks/multirank_check.py on
the CPU: the --dry-run runs the threaded-rank checks (cpu_flash, float64 and float32) and the one-rank check (gloo)
and writes the JSON the GPU run writes; every case it must hold is there and within its dtype's tolerance; the check
fails when the op is broken (a wrong head order, a missing wait on an all-to-all or on a ring pass); the threaded
group's added P2P and late-delivered all-to-alls behave as documented; a failing rank is reported, not hung on."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import megatron_upipe.attention.ring as ring_mod
import megatron_upipe.attention.upipe as upipe_mod
from tests.upipe_seams import replaced
from megatron_upipe.attention import legal_heads_per_stage
from megatron_upipe.benchmarks import multirank_check as mc

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check_multirank", REPO / "tools" / "gpu_check_multirank.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("multirank")
    t0 = time.perf_counter()
    rc = tool.main(["--dry-run", "--out", str(out)])
    return rc, json.loads((out / "gpu_multirank.json").read_text()), time.perf_counter() - t0


def test_dry_run_holds_every_case_within_tolerance(dry_run):
    rc, report, seconds = dry_run
    assert rc == 0 and seconds < 30, seconds
    threaded = report["threaded"]
    rows = threaded["cases"]
    assert threaded["ok"] and not threaded["skipped"] and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    for r in rows:  # measured: float64 ~1e-15, float32 ~5e-7
        assert r["max_rel_err"] <= {"float64": 1e-12, "float32": 5e-6}[r["dtype"]], r
        assert set(r["errors"]) == {"out", "dx", "dw_q", "dw_k", "dw_v"}
    f64 = [r for r in rows if r["dtype"] == "float64"]
    for C in (4, 8):
        plain = [r for r in f64 if r["C"] == C and r["R"] == 1 and r["H"] == 16 and not r["docs"] and not r["overlap"]]
        assert {r["U"] for r in plain if r["strategy"] == "upipe"} == set(legal_heads_per_stage(16, 4, C))
        assert any(r["strategy"] == "ulysses" for r in plain)
        mine = [r for r in f64 if r["C"] == C]
        assert {(r["strategy"], r["H"], r["G"]) for r in mine if r["R"] == 1} >= {("upipe", 8, 2), ("ulysses", 8, 2)}
        assert {r["strategy"] for r in mine if r["docs"]} == {"upipe", "ulysses"}
        assert {(r["A"], r["R"]) for r in mine} == set(mc.layouts(C))
        overlapped = [r for r in mine if r["overlap"]]
        assert {r["R"] > 1 for r in overlapped} == {False, True} and all(r["bitwise_equal"] for r in overlapped)
    assert mc.layouts(8) == [(8, 1), (4, 2), (2, 4)]
    assert {r["dtype"] for r in rows} == {"float64", "float32"}
    facts = threaded["threaded_pg"]
    assert "all_to_all_single" in facts["implements"] and "send" in facts["implements"] + facts["lacks"]
    one = report["one_rank"]
    assert one["ok"] and one["backend"] == "gloo" and one["inflight"]["ok"], one
    assert len(one["cases"]) == 5 and all(r["bitwise_equal"] and r["max_rel_err"] < 1e-12 for r in one["cases"])
    assert report["sanitizer"] == {"ran": False, "why": "--dry-run"}
    assert {n["part"] for n in report["not_run"]} >= {"Megatron-FSDP on one rank", "TransformerEngine / flash-attn"}


def _small_plan(full=False):
    s = mc.cpu_setup()
    return mc.plan(4, torch.float64, "cpu_flash", s.main, s.replicated, full=full)


def test_a_wrong_head_order_fails_every_case(monkeypatch):
    real = upipe_mod.seq_to_head

    def rolled(send, group, async_op=False):  # each rank's heads sent to the next rank
        return real(send.roll(1, 0), group, async_op)

    with replaced(seq_to_head=rolled):
        rows = mc.check_world(4, _small_plan(), CPU)
    assert len(rows) == 4 and not any(r["ok"] for r in rows), rows
    assert all(r["max_rel_err"] > 0.1 for r in rows)


def test_a_missing_wait_fails_the_overlapped_cases(monkeypatch):
    def not_waited(t):  # the receive buffer as it is, without wait()
        if isinstance(t, upipe_mod.InFlight):
            return t._recv if t._shape is None else t._recv.view(t._shape)
        return t

    cases = [c for c in _small_plan(full=True) if c.overlap or (c.R == 1 and c.strategy == "ulysses")]
    with replaced(_ready=not_waited):
        rows = mc.check_world(4, cases, CPU)
    by_kind = {(r["overlap"], r["R"] > 1): r for r in rows}
    assert by_kind[(False, False)]["ok"]  # nothing async in the serial op
    assert not by_kind[(True, False)]["ok"] and not by_kind[(True, False)]["bitwise_equal"]
    assert math.isnan(by_kind[(True, False)]["max_rel_err"])  # NaN until delivered
    assert by_kind[(True, True)]["ok"]  # the ring waits on its own works
    monkeypatch.setattr(ring_mod._Passing, "arrived", lambda self: self.received)  # the ring's passes not waited
    ring = [c for c in cases if c.overlap and c.R > 1]
    assert not any(r["ok"] for r in mc.check_world(4, ring, CPU))


def _p2p_job(rank, world):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    a, b = torch.full((3,), float(rank)), torch.full((2,), 10.0 + rank)
    ra, rb = torch.empty(3), torch.empty(2)
    ops = [dist.P2POp(dist.isend, a, nxt, tag=0), dist.P2POp(dist.isend, b, nxt, tag=1),
           dist.P2POp(dist.irecv, rb, prv, tag=1), dist.P2POp(dist.irecv, ra, prv, tag=0)]
    works = dist.batch_isend_irecv(ops)
    before = bool(ra.isnan().all() and rb.isnan().all())
    a.fill_(-5)  # a sent tensor changed after isend: what arrives is what was sent
    for w in works:
        w.wait()
    with dist.distributed_c10d._coalescing_manager(dist.group.WORLD, CPU, async_ops=True) as cm:  # older torch's
        rc = torch.empty(1)  # batch_isend_irecv path on CUDA: one work for the batch
        dist.isend(torch.full((1,), 20.0 + rank), nxt)
        dist.irecv(rc, prv)
    coalesced = bool(rc.isnan().all())
    cm.wait()
    before = before and coalesced and rc.item() == 20.0 + prv
    send = torch.arange(world * 2, dtype=torch.float64) + 100 * rank
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, async_op=True)
    pending = bool(recv.isnan().all())
    work.wait()
    return before, ra.tolist(), rb.tolist(), pending, recv.tolist()


def test_threaded_group_p2p_and_late_all_to_all():
    results = mc.run_threaded(3, _p2p_job)
    for rank, (before, ra, rb, pending, recv) in enumerate(results):
        prv = (rank - 1) % 3
        assert before and pending  # NaN until wait()
        assert ra == [float(prv)] * 3 and rb == [10.0 + prv] * 2  # matched by tag, whatever the receive order
        assert recv == [100.0 * src + 2 * rank + i for src in range(3) for i in range(2)]


def _failing_job(rank, world):
    if rank == 1:
        raise ValueError("rank 1 broke")
    t = torch.ones(1)
    dist.all_reduce(t)  # never completes: rank 1 is gone
    return t.item()


def _slow_job(rank, world):
    if rank == 1:
        time.sleep(2.5)  # past the world's time limit
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_a_failing_rank_is_reported_and_the_next_world_runs():
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        mc.run_threaded(3, _failing_job, timeout_s=60)
    assert time.perf_counter() - t0 < 30
    with pytest.raises(RuntimeError, match="still running after 1 s"):
        mc.run_threaded(2, _slow_job, timeout_s=1)
    assert not mc._LEFTOVER  # the slow rank finished within the grace period
    assert mc.run_threaded(2, lambda rank, world: dist.get_world_size()) == [2, 2]
    assert not dist.is_initialized()  # this thread's c10d world untouched


def test_cli_without_a_gpu_and_the_sanitizer_part(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tool.main(["threaded", "--out", str(tmp_path)]) == 2
    monkeypatch.setattr(tool, "find_sanitizer", lambda: None)
    assert tool.sanitizer(str(tmp_path), 5) is True
    assert json.loads((tmp_path / "gpu_multirank.json").read_text())["sanitizer"]["ran"] is False
    fake = tmp_path / "compute-sanitizer"  # reports an error, as memcheck does
    fake.write_text("#!/bin/sh\necho '========= Invalid __global__ read'\necho '========= ERROR SUMMARY: 1 error'\n"
                    "exit 9\n")
    fake.chmod(0o755)
    monkeypatch.setattr(tool, "find_sanitizer", lambda: str(fake))
    assert tool.sanitizer(str(tmp_path), 20) is False
    rep = json.loads((tmp_path / "gpu_multirank.json").read_text())["sanitizer"]
    assert rep["rc"] == 9 and rep["memcheck_errors"] == 1 and rep["ok"] is False
    fake.write_text("#!/bin/sh\necho '========= ERROR SUMMARY: 0 errors'\nexit 1\n")  # a failed check, no error
    assert tool.sanitizer(str(tmp_path), 20) is True


def test_the_gpu_plan():
    """What `threaded` runs on a GPU (planned here without one: selection reads only the device type): bf16 on the
    automatic kernel with the full plan, every other usable CUDA kernel on the reduced one, the rest listed."""
    setup, not_run = mc.gpu_setup(torch.device("cuda"))
    assert setup.kernels[0] == (None, torch.bfloat16) and ("sdpa_efficient", torch.float32) in setup.kernels
    names = {k for k, _ in setup.kernels[1:]} | {n["part"].split()[-1] for n in not_run}
    assert names >= {"sdpa_cudnn", "sdpa_efficient", "te_fused", "flash_attn"}
    cases = [c for C in setup.cps for c in mc.plan(C, torch.bfloat16, None, setup.main, setup.replicated)]
    for c in cases:  # every case's layout and U are legal at the GPU's shapes
        assert c.U is None or c.U in legal_heads_per_stage(c.problem.H, c.problem.G, c.A)
        assert c.problem.N % (2 * c.A * c.R) == 0 and setup.main.d % 8 == 0
    assert len(cases) == 29
