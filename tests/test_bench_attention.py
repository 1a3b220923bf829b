"""tools/bench_attention.py end to end on 2 gloo ranks at a tiny size: numerics checked, table and JSON written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_attention_cli(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "tools/bench_attention.py", "--heads", "8", "--kv-heads", "2", "--head-dim", "16",
         "--seq-len", "128", "--cp", "2", "--check-seq-len", "32", "--iters", "2", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "peak/uly" in proc.stdout and "upipe" in proc.stdout
    data = json.loads(out.read_text())
    res = data["results"]
    assert [(r["strategy"], r["heads_per_stage"]) for r in res] == [("ulysses", 8), ("upipe", 2), ("upipe", 4), ("upipe", 8)]
    for r in res:
        assert r["max_rel_err"] < 1e-4
        assert len(r["times_s"]) == 2 and all(t > 0 for t in r["times_s"])
        # gloo may hold up to two all-to-all buffers a moment longer than the model assumes (see the module doc)
        assert r["model_peak_bytes"] <= r["tracked_peak_bytes"] <= 1.3 * r["model_peak_bytes"]
    assert res[1]["tracked_peak_bytes"] < res[0]["tracked_peak_bytes"]


def test_bench_refuses_illegal_u(tmp_path):
    proc = subprocess.run(
        [sys.executable, "tools/bench_attention.py", "--heads", "8", "--kv-heads", "2", "--head-dim", "16",
         "--seq-len", "64", "--cp", "2", "--u", "3", "--check-seq-len", "32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "heads_per_stage=3" in proc.stderr


def test_bench_attention_packed_documents(tmp_path):
    """--docs: every strategy also on the same N tokens packed as documents (checked against the block-diagonal
    reference first), side by side with one causal sequence: ratios docs / 1 seq in the table and the JSON."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "tools/bench_attention.py", "--heads", "8", "--kv-heads", "2", "--head-dim", "16",
         "--seq-len", "256", "--cp", "2", "--u", "2", "--check-seq-len", "64", "--iters", "1", "--docs", "16",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "docs/1seq" in proc.stdout and "packed documents of about 16 tokens" in proc.stdout
    res = json.loads(out.read_text())["results"]
    assert [(r["strategy"], r["heads_per_stage"], r["documents"] > 1) for r in res] == [
        ("ulysses", 8, False), ("ulysses", 8, True), ("upipe", 2, False), ("upipe", 2, True)]
    for one, docs in (res[0:2], res[2:4]):
        assert docs["documents"] >= 256 // 24 and docs["max_rel_err"] < 1e-4
        assert docs["time_ratio_vs_one_sequence"] == docs["median_s"] / one["median_s"]
        # the documents' kernel calls gather a length's documents: a little more than one sequence's peak
        assert one["tracked_peak_bytes"] <= docs["tracked_peak_bytes"] <= 1.2 * one["tracked_peak_bytes"]
        assert "time_ratio_vs_one_sequence" not in one


def test_bench_refuses_documents_with_a_batch(tmp_path):
    proc = subprocess.run(
        [sys.executable, "tools/bench_attention.py", "--heads", "8", "--kv-heads", "2", "--head-dim", "16",
         "--seq-len", "64", "--cp", "2", "--batch", "2", "--docs", "8", "--check-seq-len", "32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "need batch 1" in proc.stderr and "--docs 8 --batch 2" in proc.stderr


def test_bench_attention_overlap_and_bytes_sent(tmp_path):
    """--overlap: every UPipe U also with pipelined stages, checked and measured side by side; every row reports
    the bytes sent in forward and backward: the same for serial and pipelined UPipe, the same forward for UPipe and
    Ulysses, and UPipe's backward sends more (it re-sends q and out per stage and K/V per round)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "tools/bench_attention.py", "--heads", "8", "--kv-heads", "2", "--head-dim", "16",
         "--seq-len", "128", "--cp", "2", "--u", "2", "--check-seq-len", "32", "--iters", "1", "--overlap",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "upipe+ov" in proc.stdout and "sent bwd MiB" in proc.stdout
    uly, ser, ov = json.loads(out.read_text())["results"]
    assert (uly["strategy"], ser["strategy"], ov["strategy"]) == ("ulysses", "upipe", "upipe+ov")
    assert ov["max_rel_err"] < 1e-4 and ov["model_peak_bytes"] is None and len(ov["times_s"]) == 1
    from megatron_upipe.attention import make_schedule

    N, b, H, G, d, C = 128, 1, 8, 2, 16, 2
    share = lambda n_bytes: n_bytes * (C - 1) // C  # noqa: E731 - one of the C equal chunks stays on this rank
    q, kv = N // C * b * H * d * 4, N // C * b * G * d * 4  # this rank's q / k projections, float32
    assert uly["fwd_sent_bytes"] == ser["fwd_sent_bytes"] == ov["fwd_sent_bytes"] == share(2 * q + 2 * kv)
    assert uly["bwd_sent_bytes"] == share(2 * q + 2 * kv)  # dout in; dq, dK, dV back
    sched = make_schedule(H, G, C, 2)
    rounds = sum(st.new_round for st in sched.stages)
    kv_round = N // C * b * C * sched.kv_per_rank * d * 4  # one round's K (or V) send buffer
    # per stage q (recomputed), out and dout in, dq back; per round K, V (recomputed) in, dK, dV back
    assert ser["bwd_sent_bytes"] == ov["bwd_sent_bytes"] == share(4 * q + 4 * rounds * kv_round)
    assert ser["bwd_sent_bytes"] > uly["bwd_sent_bytes"]


def test_bench_attention_hybrid_ring(tmp_path):
    """--ring 2 --ring-overlap on 4 ranks (all-to-all groups of 2 x a ring of 2): every strategy checked against the
    float64 reference at its zigzag positions, serial and overlapped ring passes side by side, and the P2P bytes
    each rank sends are the passes' (float32, R = 2, one KV head per rank and call, K = one call's K and V bytes):
    forward (R - 1)·K; backward K/V and dK/dV along R - 1 hops and dK/dV home, (2R - 1)·K; the same overlapped."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "tools/bench_attention.py", "--heads", "8", "--kv-heads", "2", "--head-dim", "16",
         "--seq-len", "256", "--cp", "4", "--ring", "2", "--ring-overlap", "--u", "2", "--check-seq-len", "64",
         "--warmup", "0", "--iters", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hybrid: all-to-all groups of 2 x a ring of 2" in proc.stdout and "p2p bwd MiB" in proc.stdout
    res = json.loads(out.read_text())["results"]
    assert [(r["strategy"], r["heads_per_stage"], r["stages"]) for r in res] == [
        ("ulysses", 8, 1), ("ulysses+rov", 8, 1), ("upipe", 2, 4), ("upipe+rov", 2, 4)]
    K = 2 * (256 // 2) * 16 * 4  # K and V of one call: [b, 1 KV head, N/R tokens, d] float32 each
    for r in res:
        assert r["max_rel_err"] < 1e-4 and r["model_peak_bytes"] is None
        calls = r["stages"]  # one ring call per stage, one KV head each
        assert (r["fwd_p2p_bytes"], r["bwd_p2p_bytes"]) == (calls * K, calls * 3 * K), r


def test_bench_refuses_a_ring_that_does_not_divide(tmp_path):
    proc = subprocess.run(
        [sys.executable, "tools/bench_attention.py", "--heads", "8", "--kv-heads", "2", "--cp", "4", "--ring", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2 and "ring=3 must divide the C=4 ranks" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
