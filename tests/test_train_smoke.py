"""Smoke test of the entry point: pretrain_llama.main() on 2 gloo ranks, tiny Llama, UPipe over cp=2, shipped corpus.

One launch first trains 6 steps as pp=2 (megatron-core's 1F1B schedule over 4 micro-batches, evaluation included),
6 steps with packed documents (data.document_mask: cu_seqlens from the corpus's end-of-document tokens), then 20 steps (global batch 4 x 128 tokens, 2 accumulation steps) with evaluation and checkpoints
every 10 steps, tensorboard on, and checks what the run leaves behind: the metrics file (keys, finite values, the
LR schedule, a falling loss), the eval records, the checkpoints (keep_last=1) and the tensorboard events.
"""

from __future__ import annotations

import math

import pytest

from tests.dist_helper import run_on_ranks
from tests.train_harness import SMALL, read_metrics, run_main

STEPS, WARMUP, LR, MIN_LR = 20, 3, 3e-3, 3e-4
KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec_per_gpu", "tflops_per_gpu", "mfu", "peak_mem_bytes",
        "peak_mem_kind", "step_time_s", "skipped"}


def _job(rank, world_size, tmp):
    pp2 = run_main(*SMALL, "train.steps=6", "parallel.pp=2", "parallel.cp=1", "parallel.cp_strategy=none",
                   "train.eval_interval=3", "train.eval_iters=1", f"log.metrics_file={tmp}/pp2.jsonl")
    docs = run_main(*SMALL, "train.steps=6", "train.seq_length=256", "data.document_mask=true",
                    "data.eod_mask_loss=true", f"log.metrics_file={tmp}/docs.jsonl")
    return pp2, docs, run_main(
        f"train.steps={STEPS}", "train.seq_length=128", "train.global_batch_size=4", f"train.lr={LR}",
        f"train.min_lr={MIN_LR}", f"train.warmup_steps={WARMUP}", "train.eval_interval=10", "train.eval_iters=1",
        f"checkpoint.dir={tmp}/ckpt", "checkpoint.interval=10", "checkpoint.keep_last=1",
        f"log.metrics_file={tmp}/metrics.jsonl", f"log.tensorboard_dir={tmp}/tb", "log.interval=5",
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smoke")
    for rank, runs in enumerate(run_on_ranks(_job, 2, str(tmp))):
        for code, err in runs:
            assert code == 0, f"rank {rank}: exit {code}\n{err}"
    return tmp


def test_metrics_file_has_every_step_with_finite_values(run):
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert KEYS <= r.keys(), KEYS - r.keys()
        for k in ("loss", "lr", "grad_norm", "tokens_per_sec_per_gpu", "tflops_per_gpu", "step_time_s"):
            assert isinstance(r[k], float) and math.isfinite(r[k]) and r[k] > 0, (k, r)
        assert r["peak_mem_bytes"] > 100 * 2**20 and r["peak_mem_kind"] == "cpu_peak_rss"
        assert r["mfu"] is None  # no peak FLOP/s for a CPU
        assert r["skipped"] is False


def test_loss_goes_down(run):
    loss = [r["loss"] for r in read_metrics(run / "metrics.jsonl")]
    assert loss[0] == pytest.approx(math.log(4096), abs=0.1)  # a fresh model is uniform over the vocabulary
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.5, loss
    evals = read_metrics(run / "metrics.jsonl", kind="eval")
    assert [e["step"] for e in evals] == [10, 20] and evals[1]["loss"] < evals[0]["loss"]
    assert all(e["tokens"] == 4 * 128 for e in evals)  # eval_iters=1 global batch


def test_warmup_then_cosine_schedule(run):
    lr = {r["step"]: r["lr"] for r in read_metrics(run / "metrics.jsonl")}
    assert [lr[s] for s in (1, 2, 3)] == pytest.approx([LR / 3, 2 * LR / 3, LR])
    mid = (WARMUP + STEPS) / 2  # cosine half-way point: the mean of lr and min_lr
    assert lr[int(mid)] > (LR + MIN_LR) / 2 > lr[int(mid) + 1]
    assert lr[STEPS] == pytest.approx(MIN_LR)
    assert all(a >= b for a, b in zip(list(lr.values())[WARMUP - 1:], list(lr.values())[WARMUP:]))


def test_checkpoints_and_tensorboard(run):
    ckpt = run / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "iter_0000020"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000020", "latest"]  # keep_last=1, no .tmp left
    assert {p.name for p in (ckpt / "iter_0000020" / "rng").iterdir()} == {"rank00000.pt", "rank00001.pt"}
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tb").iterdir())


def test_pipeline_parallel_run_trains_and_evaluates(run):
    records = read_metrics(run / "pp2.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"] - 0.2, [r["loss"] for r in records]
    evals = read_metrics(run / "pp2.jsonl", kind="eval")
    assert [e["step"] for e in evals] == [3, 6] and all(math.isfinite(e["loss"]) for e in evals)


def test_packed_documents_run_trains(run):
    records = read_metrics(run / "docs.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"] - 0.2, [r["loss"] for r in records]
