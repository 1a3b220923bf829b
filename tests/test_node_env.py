"""The job sets the environment its plan assumes (training/node_env.py), before anything touches CUDA or NCCL.

- `job_env` is pure: the variables the user left unset are set (NCCL_NVLS_ENABLE=0, TORCH_NCCL_ASYNC_ERROR_HANDLING=1,
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True with memory.expandable_segments, CUDA_DEVICE_MAX_CONNECTIONS=1
  with tensor parallelism), the user's values are kept (aliases included), and one line says which is which.
- The planner's NCCL margin follows NVLS as the job runs it: the start-up U choice and memory.plan_check pass
  `--nccl-topology nvswitch-nvls` (6 GiB) when the environment turns NVLS on, the NVLS-off margin otherwise; one real
  planner run on the tiny model shows the 6 GiB in its breakdown.
- pretrain_llama.main(), in this process, with a stand-in GPU (torch.cuda patched) and the process group patched
  out: PYTORCH_CUDA_ALLOC_CONF is set when the start-up U choice first reads the GPU (which initialises CUDA's
  caching allocator, which reads it once), and every variable is set when setup_distributed is called; a user's
  NCCL_NVLS_ENABLE=1 is kept and planned with the NVLS margin. --dry-run prints the line and sets nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import pretrain_llama
from megatron_upipe.config import load_config, machine, to_yaml
from megatron_upipe.planner import devices
from megatron_upipe.training import auto_heads, memory_check
from megatron_upipe.training.node_env import job_env, nvls_on

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "configs" / "tiny_cpu.yaml")
GIB = 1 << 30
JOB_VARS = ("NCCL_NVLS_ENABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING",
            "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_DEVICE_MAX_CONNECTIONS")


@pytest.fixture
def environ(monkeypatch):
    """At the repository root, without torchrun's or the job's variables; os.environ restored afterwards."""
    monkeypatch.chdir(ROOT)
    saved = dict(os.environ)
    for var in (*pretrain_llama.TORCHRUN_VARS, "LOCAL_WORLD_SIZE", *JOB_VARS):
        os.environ.pop(var, None)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


# --- the pure function -----------------------------------------------------------------------------------------------
def test_job_env_sets_what_is_unset_and_keeps_what_the_user_set():
    tiny = load_config(TINY, [])
    got = job_env(tiny, {})
    assert got.set == {"NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                       "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # tp=1, UPipe: CUDA's default queues
    assert "\n" not in got.line and not got.nvls
    assert "NCCL_NVLS_ENABLE=0 (set by the job; the plan's NCCL margin assumes NVLS off)" in got.line
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by the job" in got.line

    user = {"NCCL_NVLS_ENABLE": "1", "NCCL_ASYNC_ERROR_HANDLING": "3", "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}
    got = job_env(tiny, user)
    assert got.set == {} and got.nvls  # aliases count: torch reads PYTORCH_ALLOC_CONF, NCCL_ASYNC_ERROR_HANDLING
    assert "NCCL_NVLS_ENABLE=1 (yours: NVLS on; the plan uses the nvswitch-nvls NCCL margin)" in got.line
    assert "PYTORCH_ALLOC_CONF=max_split_size_mb:64 (yours: memory.expandable_segments=true is not applied)" in got.line

    assert job_env(tiny, {"NCCL_NVLS_ENABLE": "0"}).set.get("NCCL_NVLS_ENABLE") is None
    assert job_env(tiny, {"NCCL_NVLS_ENABLE": ""}).set["NCCL_NVLS_ENABLE"] == "0"  # empty: NCCL's default (on)
    off = load_config(TINY, ["memory.expandable_segments=false"])
    assert "PYTORCH_CUDA_ALLOC_CONF" not in job_env(off, {}).set

    tp2 = load_config(TINY, ["parallel.tp=2", "parallel.cp=1", "parallel.cp_strategy=none",
                             "parallel.upipe_heads_per_stage=null"])
    assert job_env(tp2, {}).set["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    mine = job_env(tp2, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in mine.set and "CUDA_DEVICE_MAX_CONNECTIONS=8 (yours" in mine.line
    assert [nvls_on(e) for e in ({}, {"NCCL_NVLS_ENABLE": "0"}, {"NCCL_NVLS_ENABLE": "1"},
                                 {"NCCL_NVLS_ENABLE": "2"})] == [False, False, True, True]


# --- the planner's NCCL margin follows the environment --------------------------------------------------------------
def test_topology_follows_nvls():
    h100 = devices.GPUS["h100-80gb"]
    assert [devices.topology_for(w) for w in (8, 16)] == ["nvswitch", "nvswitch-ib"]
    assert [devices.topology_for(w, nvls=True) for w in (8, 16)] == ["nvswitch-nvls"] * 2
    assert devices.margins_for(h100, 8, devices.topology_for(8, nvls=True)).nccl_bytes == 6 * GIB
    assert devices.margins_for(h100, 8, devices.topology_for(8)).nccl_bytes == 2 * GIB


def _fake_planner(calls: list, heads: int):
    """subprocess.run standing in for tools/estimate_memory.py: records its argv and writes a plan choosing `heads`."""
    def run(argv, **kwargs):
        calls.append(argv)
        out = Path(argv[argv.index("--json") + 1])
        out.write_text(json.dumps({"heads_choice": {"heads_per_stage": heads, "reason": f"U={heads} (stand-in)"},
                                   "results": [{"peak_bytes": 1}]}))
        return subprocess.CompletedProcess(argv, 0, "", "")
    return run


@pytest.mark.parametrize("value, topology", [(None, "nvswitch"), ("0", "nvswitch"), ("1", "nvswitch-nvls")])
def test_start_up_planner_runs_take_the_nvls_margin_from_the_environment(value, topology, environ, monkeypatch):
    if value is not None:
        os.environ["NCCL_NVLS_ENABLE"] = value
    calls = []
    monkeypatch.setattr(subprocess, "run", _fake_planner(calls, 2))
    config = load_config(TINY, ["memory.plan_gpu=h100-80gb"])
    auto_heads.resolve_auto_heads(config, 2)
    memory_check.predict(to_yaml(config), 2)
    assert len(calls) == 2
    for argv in calls:
        assert argv[argv.index("--nccl-topology") + 1] == topology, argv


def test_planner_margin_with_nvls_on_is_the_nvls_figure(environ):
    """One real planner run (tools/estimate_memory.py on the tiny model) in the job's environment with NVLS on."""
    os.environ["NCCL_NVLS_ENABLE"] = "1"
    predicted = memory_check.predict(to_yaml(load_config(TINY, ["parallel.upipe_heads_per_stage=2"])), 2)
    assert predicted is not None and predicted["breakdown"]["margin: nccl"] == 6 * GIB


# --- pretrain_llama.main(): the order ---------------------------------------------------------------------------------
class Reached(Exception):
    pass


def _stand_in_gpu(monkeypatch, seen: dict):
    """torch.cuda as one 80 GiB GPU to the start-up code; what the environment held when it was first read."""
    def properties(index=0):
        seen.setdefault("first GPU read", {v: os.environ.get(v) for v in JOB_VARS})
        return SimpleNamespace(total_memory=80 * GIB, name="stand-in")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(machine, "_gpu_count", lambda: 1)


def _stop_at_setup(monkeypatch, seen: dict):
    def setup(config, plan):
        seen["setup_distributed"] = {v: os.environ.get(v) for v in JOB_VARS}
        raise Reached

    monkeypatch.setattr(pretrain_llama, "setup_distributed", setup)


def test_main_sets_the_environment_before_cuda_and_the_process_group(environ, monkeypatch, capsys):
    seen, calls = {}, []
    _stand_in_gpu(monkeypatch, seen)
    _stop_at_setup(monkeypatch, seen)
    monkeypatch.setattr(subprocess, "run", _fake_planner(calls, 2))
    with pytest.raises(Reached):  # one process (no torchrun), U unset: planned against the (stand-in) local GPU
        pretrain_llama.main(["--config", TINY, "parallel.cp=1", "dist.backend=gloo"])
    assert seen["first GPU read"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert seen["setup_distributed"] == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_ASYNC_ERROR_HANDLING": None,
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": None,
        "CUDA_DEVICE_MAX_CONNECTIONS": None}
    (argv,) = calls
    assert argv[argv.index("--nccl-topology") + 1] == "nvswitch" and argv[argv.index("--gpu") + 1] == "80.0000"
    out = capsys.readouterr().out
    assert "pretrain_llama.py: environment: NCCL_NVLS_ENABLE=0 (set by the job" in out


def test_main_keeps_the_users_values_and_plans_nvls_with_them(environ, monkeypatch):
    seen, calls = {}, []
    _stand_in_gpu(monkeypatch, seen)
    _stop_at_setup(monkeypatch, seen)
    monkeypatch.setattr(subprocess, "run", _fake_planner(calls, 2))
    os.environ.update(NCCL_NVLS_ENABLE="1", PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512")
    with pytest.raises(Reached):
        pretrain_llama.main(["--config", TINY, "parallel.cp=1", "dist.backend=gloo"])
    assert seen["setup_distributed"]["NCCL_NVLS_ENABLE"] == "1"
    assert seen["setup_distributed"]["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    (argv,) = calls
    assert argv[argv.index("--nccl-topology") + 1] == "nvswitch-nvls"


def test_dry_run_prints_the_line_and_sets_nothing(environ, capsys):
    before = dict(os.environ)
    assert pretrain_llama.main(["--config", TINY, "--dry-run", "--world-size", "2"]) == 0
    assert dict(os.environ) == before
    out = capsys.readouterr().out
    assert "at a real start: environment: NCCL_NVLS_ENABLE=0 (set by the job" in out
