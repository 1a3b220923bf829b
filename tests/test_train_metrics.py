"""Training metrics and failure policy: FLOPs formula, MFU, the sinks, the NaN policy, the console.

The console test launches a real 3-step run (torchrun, 2 gloo ranks, UPipe over cp=2) and its resumption to step 4,
and reads what a user sees: one labelled step line per step from rank 0 only, the end-of-run summary, and no
third-party warning line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import types
import warnings
from importlib.machinery import ModuleSpec

import pytest
import torch

from megatron_upipe.config.schema import LogConfig
from megatron_upipe.models.presets import get_preset
from megatron_upipe.training.failures import NonFiniteError, as_distributed_failure, check_step
from megatron_upipe.training import console, memory_check
from megatron_upipe.training.metrics import (MEMORY_LABELS, MetricsLogger, device_peak_flops, model_flops_per_token,
                                             step_record)
from tests.dist_helper import free_port
from tests.train_harness import DATA, ROOT, SMALL, TINY


def test_flops_llama3_8b_matches_the_6n_rule_plus_causal_attention():
    arch, seq, vocab = get_preset("llama3-8b"), 8192, 128256
    flops = model_flops_per_token(arch, seq, vocab)
    dense = 6 * (arch.num_parameters(vocab) - vocab * arch.hidden_size)  # every weight but the embedding lookup
    causal_attention = 3 * 2 * seq * arch.num_attention_heads * arch.kv_channels * arch.num_layers  # half of 4·N·H·d
    assert flops == pytest.approx(dense + causal_attention, rel=1e-3)  # the rest: norms are not matmuls
    # doubling the sequence adds exactly the attention term again
    assert model_flops_per_token(arch, 2 * seq, vocab) - flops == pytest.approx(causal_attention)


def test_mfu_is_null_on_cpu_and_uses_the_peak_elsewhere():
    assert device_peak_flops(torch.device("cpu")) is None
    r = step_record(3, 2.0, 1e-3, 0.5, seconds=2.0, tokens=8192, world_size=8, flops_per_token=1e9,
                    peak_flops=989e12, peak_mem=10, mem_kind="cuda_max_allocated", skipped=False)
    assert r["tokens_per_sec_per_gpu"] == 512.0
    assert r["tflops_per_gpu"] == pytest.approx(512 * 1e9 / 1e12)
    assert r["mfu"] == pytest.approx(512 * 1e9 / 989e12)


def test_logger_writes_jsonl_tensorboard_and_offline_wandb(tmp_path, monkeypatch, capsys):
    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(("init", kw)) or types.SimpleNamespace(
        log=lambda d, step: calls.append(("log", step, d)), finish=lambda: calls.append(("finish",)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = LogConfig(interval=2, metrics_file=str(tmp_path / "m.jsonl"), tensorboard_dir=str(tmp_path / "tb"),
                    wandb=True)
    log = MetricsLogger(cfg, {"train": {"lr": 1.0}}, resumed_step=0)
    for step in (1, 2):
        log.log(step_record(step, float("nan") if step == 1 else 2.5, 1e-3, None, 1.0, 100, 2, 1e6, None, 5,
                            "cpu_peak_rss", skipped=step == 1))
    log.log({"step": 2, "loss": 2.4, "tokens": 100}, kind="eval")
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in lines] == [("train", 1), ("train", 2), ("eval", 2)]
    assert lines[0]["loss"] is None and lines[0]["skipped"] is True  # NaN written as null, JSON stays valid
    assert calls[0][0] == "init" and calls[0][1]["mode"] == "offline" and calls[0][1]["project"] == "megatron_upipe"
    assert calls[0][1]["dir"] == str(tmp_path)  # next to the metrics file, not the working directory
    assert [c[1] for c in calls if c[0] == "log"] == [1, 2, 2] and calls[-1] == ("finish",)
    assert math.isnan(calls[1][2]["train/loss"]) and calls[2][2]["train/loss"] == 2.5
    assert calls[3][2] == {"eval/loss": 2.4, "eval/tokens": 100}
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    out = capsys.readouterr().out
    assert "SKIPPED" in out and "| loss 2.5000" in out and "loss nan" in out and "step      2 | eval loss 2.4000" in out
    assert "peak RSS 0.00 GiB" in out  # the figure says what it is


def test_console_step_line_eta_and_summary(capsys):
    log = MetricsLogger(LogConfig(interval=1), {}, resumed_step=0)
    for step, seconds in ((1, 9.0), (2, 1.0), (3, 3.0)):  # the first step's set-up work is left out of the mean
        log.log(step_record(step, 4.0 - step, 1e-3, 0.5, seconds, 100, 1, 1e6, None, 3 * 2**30, "cuda_max_allocated",
                            False, total_steps=10, consumed_samples=8 * step))
    log.log({"step": 3, "loss": 2.75, "tokens": 100}, kind="eval")
    log.log({"step": 2, "measured_peak_bytes": 2**20, "measured_kind": "tracked", "predicted_peak_bytes": 2**21,
             "rel_diff": -0.5, "predicted_with_margins_bytes": 2**22}, kind="memory")
    log.checkpoint(3, "/ckpt/iter_0000003")
    log.summary()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("step  1/10 | consumed samples 8 | 9000.0 ms/step | loss 3.0000 | lr 1.000e-03 | grad norm "
                        "0.500 | 11 tok/s/GPU | 0.000 TFLOP/s/GPU | MFU n/a | peak alloc 3.00 GiB | ETA 0:01:21")
    assert lines[1].endswith("| ETA 0:00:08") and lines[2].endswith("| ETA 0:00:14")  # 8 x 1 s, then 7 x 2 s
    assert lines[3] == "step  3/10 | eval loss 2.7500 over 100 tokens"
    assert lines[4] == "step  3/10 | saved checkpoint /ckpt/iter_0000003"
    summary = dict(re.match(r"  (.+?)  +(.*)", line).groups() for line in lines[6:])
    assert lines[5] == "run summary" and summary["steps"] == "3/10 (3 this run, 0 skipped)"
    assert summary["mean step time"] == "2000.0 ms (steps 2-3; the first, 9000.0 ms, excluded)"
    assert summary["final loss"] == "1.0000" and summary["best eval loss"] == "2.7500 (step 3)"
    assert summary["peak memory"] == "peak alloc 3.00 GiB (max over ranks)"
    assert summary["memory check"] == "step 2: peak tracked 1.00 MiB vs planner predicted 2.00 MiB"
    assert summary["checkpoint"] == "/ckpt/iter_0000003"


@pytest.fixture
def restore_logging():
    """quiet_third_party() changes process-wide filters; put them back after the test."""
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).filters)) for n in
             {r.logger for r in console.KNOWN_LOG_RECORDS} | set(console.MEGATRON_LOGGERS)}
    yield
    for name, (level, filters) in saved.items():
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).filters[:] = filters


def test_quiet_drops_only_the_listed_third_party_messages(restore_logging):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        console.quiet_third_party(cuda=False)
        console.quiet_third_party(cuda=False)  # idempotent

        def warn(text, module, category=UserWarning):
            warnings.warn_explicit(text, category, "f.py", 1, module=module)

        warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
             "megatron.core.optimizer")
        warn("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends")
        warn("full scope is deprecated. Use empty cuda_graph_modules", "megatron.core.transformer.transformer_config")
        warn("MimoModelConfig is experimental and still under active development.",
             "megatron.core.models.mimo.config.base_configs")
        warn("Apex is not installed.", "megatron_upipe.models.norm")  # ours: never hidden
        warn("full scope is deprecated.", "megatron.core.models.gpt.gpt_model")  # another module
        warn("Transformer Engine and Apex are not installed.", "megatron.core.optimizer", DeprecationWarning)
        warn("something new from megatron", "megatron.core.optimizer")
    assert [(str(w.message)[:22], w.category) for w in seen] == [
        ("Apex is not installed.", UserWarning), ("full scope is deprecat", UserWarning),
        ("Transformer Engine and", DeprecationWarning), ("something new from meg", UserWarning)]

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(r.logger) for r in console.KNOWN_LOG_RECORDS]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/x")
        logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel IS DEPRECATED. GPTModel is only")
        logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").warning(
            "MCore's async save is deprecated and will be removed")
        logging.getLogger("megatron.core.models.gpt.gpt_model").error("a real error")
        logging.getLogger("torch.utils.cpp_extension").warning("Error checking compiler version")
        logging.getLogger("megatron.core.models.gpt.gpt_model").info("chatter")  # megatron held at WARNING
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["a real error", "Error checking compiler version"]


SP_ADVICE = ("When using sequence parallelism it is recommended to set the environment variable "
             "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
FSDP_DEVICE = "[Rank 0] Megatron-FSDP is using device cpu instead of the current device cuda:0, which may cause"


@pytest.mark.parametrize("cuda", [False, True])
def test_quiet_keeps_gpu_advice_on_a_gpu(cuda, restore_logging):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        console.quiet_third_party(cuda=cuda)
        warnings.warn_explicit(SP_ADVICE, UserWarning, "layers.py", 848, module="megatron.core.tensor_parallel.layers")
        warnings.warn_explicit("Apex is not installed.", UserWarning, "b.py", 1, module="megatron.core.models.backends")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    fsdp = logging.getLogger("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp")
    fsdp.addHandler(handler)
    try:
        fsdp.warning(FSDP_DEVICE)
    finally:
        fsdp.removeHandler(handler)
    assert [str(w.message) for w in seen] == ([SP_ADVICE] if cuda else [])  # the fallback notice goes either way
    assert len(records) == (1 if cuda else 0)


# What a third-party warning looks like on the console: a Python warning ("path.py:12: UserWarning: ..." and its
# source line), torch's logging prefix ("[rank0]:W1203 ..."), a path into the installed packages, or the words
# megatron-core uses for its notices.
THIRD_PARTY = re.compile(r"site-packages|\b\w*Warning\b|^\s*warnings\.warn|^\[rank\d+\]:[WEI]\d|DEPRECATED|"
                         r"is deprecated|experimental|not installed")
STEP_LINE = re.compile(r"^step (\d+)/3 \| consumed samples (\d+) \| ([\d.]+) ms/step \| loss ([\d.]+) \| "
                       r"lr \S+ \| grad norm [\d.]+ \| (\d+) tok/s/GPU \| [\d.]+ TFLOP/s/GPU \| MFU n/a \| "
                       r"peak RSS [\d.]+ GiB \| ETA \d+:\d\d:\d\d$")


def assert_memory_figures_labelled(lines: list[str], at_least: int) -> None:
    """Every memory figure says what it is: a label stands between it and the previous figure or field."""
    labels = (*MEMORY_LABELS.values(), "planner predicted")
    figures = 0
    for line in lines:
        if line.startswith("host memory check: host "):  # the host plan (training/build.py): host RAM, not device
            assert " per rank (offload pool " in line and " per node of " in line, line
            continue
        for field in line.split(" | "):
            for before in re.split(r"[\d.]+ [MG]iB", field)[:-1]:
                figures += 1
                assert any(label in before for label in labels), line
    assert figures >= at_least, lines


def test_memory_check_lines_label_every_figure():
    predicted = {"device_bytes": 3 * 2**20, "peak_bytes": 9 * 2**20, "tracked_bytes": 2**20}
    lines = [memory_check.prediction_line(predicted)]
    for kind in ("tracked", "cuda_max_allocated"):
        lines.append(memory_check.comparison_line(memory_check.comparison(2, {"bytes": 2**20, "kind": kind},
                                                                          predicted)))
    assert lines[1] == ("memory: step 2 measured peak tracked 1.00 MiB (forward/backward, all model states) vs "
                        "planner predicted 1.00 MiB (+0.00%)")  # the tracker is compared with the tracked figure
    assert "measured peak alloc 1.00 MiB" in lines[2] and lines[2].endswith("planner predicted 3.00 MiB (-66.67%)")
    assert "planner predicted peak alloc 3.00 MiB/GPU" in lines[0] and "planner predicted total 9.0 MiB/GPU" in lines[0]
    assert_memory_figures_labelled(lines, at_least=6)


def _launch(tmp_path, *overrides: str) -> list[str]:
    """A 2-rank torchrun of pretrain_llama.py; its stdout and stderr lines, none of them a third-party warning."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "pretrain_llama.py", "--config", TINY, *DATA, *SMALL, "log.interval=1", "train.eval_iters=1",
           f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.interval=0", f"log.metrics_file={tmp_path}/m.jsonl",
           *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = out.splitlines()
    noise = [line for line in lines if THIRD_PARTY.search(line)]
    assert not noise, "\n".join(noise)
    return lines


def test_console_of_a_short_run_and_its_resumption(tmp_path):
    lines = _launch(tmp_path, "train.steps=3", "train.eval_interval=3")

    steps = [STEP_LINE.match(line) for line in lines if line.startswith("step ") and "ms/step" in line]
    assert all(steps), [line for line in lines if line.startswith("step ")]
    assert [int(m[1]) for m in steps] == [1, 2, 3]  # once each: rank 0 alone prints them
    assert [int(m[2]) for m in steps] == [4, 8, 12]  # global batch 4
    assert all(float(m[3]) > 0 and int(m[5]) > 0 for m in steps)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert [float(m[4]) for m in steps] == pytest.approx(losses, abs=5e-5)

    assert lines.count("run summary") == 1
    summary = dict(re.match(r"  (.+?)  +(.*)", line).groups() for line in lines[lines.index("run summary") + 1:]
                   if line.startswith("  "))
    assert summary["steps"] == "3/3 (3 this run, 0 skipped)"
    assert re.fullmatch(r"\d+:\d\d:\d\d \(after the build\)", summary["wall time"])
    mean = float(re.match(r"([\d.]+) ms \(steps 2-3; the first", summary["mean step time"])[1])
    assert mean == pytest.approx(sum(float(m[3]) for m in steps[1:]) / 2, abs=0.1)
    assert summary["final loss"] == f"{losses[-1]:.4f}"
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    assert summary["best eval loss"] == f"{min(evals):.4f} (step 3)"
    assert summary["peak memory"].startswith("peak RSS ") and "max over ranks" in summary["peak memory"]
    assert summary["checkpoint"] == str(tmp_path / "ckpt" / "iter_0000003")

    assert_memory_figures_labelled(lines, at_least=3 + 1)  # the step lines and the summary's peak

    # resumed to step 4: the checkpoint load adds no third-party line either (checked in _launch)
    lines = _launch(tmp_path, "train.steps=4", "train.eval_interval=0")
    assert any(line.startswith(f"resumed from {tmp_path / 'ckpt' / 'iter_0000003'} at step 3") for line in lines)
    assert [line.split(" |")[0] for line in lines if "ms/step" in line] == ["step 4/4"]
    assert "  steps            4/4 (1 this run, 0 skipped)" in lines and "  mean step time   " in "\n".join(lines)
    assert "  checkpoint       " + str(tmp_path / "ckpt" / "iter_0000004") in lines


def test_nan_policy():
    assert check_step(5, 2.0, 1.0, "stop") is True
    assert check_step(5, float("nan"), 1.0, "skip") is False
    assert check_step(5, 2.0, float("inf"), "skip") is False
    with pytest.raises(NonFiniteError, match="step 7: non-finite gradient"):
        check_step(7, 2.0, float("inf"), "stop")
    with pytest.raises(NonFiniteError, match="step 8: non-finite loss"):
        check_step(8, math.nan, math.nan, "stop")


def test_distributed_errors_are_named():
    f = as_distributed_failure(RuntimeError("[../gloo/transport/tcp/pair.cc] Timed out waiting 5000ms"), 1, 4, 5)
    assert f is not None and "rank 1, step 4" in str(f) and "dist.timeout_s=5s" in str(f)
    assert as_distributed_failure(ValueError("shape mismatch"), 0, 1, 5) is None
