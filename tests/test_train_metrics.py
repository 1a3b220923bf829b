"""Training metrics and failure policy without a process group: FLOPs formula, MFU, the sinks, the NaN policy."""

from __future__ import annotations

import json
import math
import sys
import types
from importlib.machinery import ModuleSpec

import pytest
import torch

from megatron_upipe.config.schema import LogConfig
from megatron_upipe.models.presets import get_preset
from megatron_upipe.training.failures import NonFiniteError, as_distributed_failure, check_step
from megatron_upipe.training.metrics import MetricsLogger, device_peak_flops, model_flops_per_token, step_record


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
    assert "SKIPPED" in out and "step      2 | loss 2.5000" in out and "loss nan" in out and "eval loss 2.4000" in out


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
