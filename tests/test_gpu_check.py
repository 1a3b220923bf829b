"""tools/gpu_check.py's CPU-runnable parts: its CLI (--help, --dry-run, no GPU), its numerics checks run on the CPU
kernel (they pass on a correct kernel and fail on a wrong one, so their float64 reference composition - RMSNorm,
attention, W_O, the fused-weight gradient mapping - is right), and the calibration file it writes, read back by
the planner's reader (megatron_upipe/planner/devices.py). tools/gpu_check.sh: its parts' time limits fit the 8
minutes, and its --dry-run runs the multi-rank parts on the CPU (their checks: tests/test_gpu_check_multirank.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_upipe.attention.kernels import KERNELS
from megatron_upipe.planner import devices

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
gc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gc  # dataclasses look their module up while the file runs
_spec.loader.exec_module(gc)
CPU = torch.device("cpu")


def test_cli_help_and_dry_run_without_a_gpu(capsys, monkeypatch):
    r = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--dry-run" in r.stdout
    assert gc.main(["--dry-run", "--lengths", "4096", "8192", "16384"]) == 0
    out = capsys.readouterr().out
    assert "ulysses U=32 N=  16384" in out and "te_fused" in out
    with pytest.raises(SystemExit):
        gc.main(["--dry-run", "--lengths", "0", "1", "2"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.main(["--out", "/nonexistent"]) == 2  # refuses before writing anything


def test_numerics_checks_pass_on_a_correct_kernel_and_fail_on_a_wrong_one():
    small = gc.NumericsShape(H=4, G=2, d=8, D=32, N=48)
    rows = gc.op_numerics([KERNELS["cpu_flash"]], CPU, torch.float32, small)
    assert len(rows) == 9 and all(r["ok"] for r in rows), rows
    assert {(r["variant"], r["grad_accum"]) for r in rows} == {("natural", "fp32"), ("fused", "fp32"),
                                                               ("fused", "input")}
    kernel_rows = gc.kernel_numerics([KERNELS["cpu_flash"]], CPU, torch.float32, N=40, d=16)
    assert len(kernel_rows) == 2 and all(r["ok"] for r in kernel_rows), kernel_rows

    def wrong_bwd(dout, q, k, v, out, lse, aux, causal, scale):  # dK/dV off by a factor
        dq, dk, dv = KERNELS["cpu_flash"].bwd(dout, q, k, v, out, lse, aux, causal, scale)
        return dq, dk * 1.1, dv

    wrong = dataclasses.replace(KERNELS["cpu_flash"], name="wrong", bwd=wrong_bwd)
    assert not any(r["ok"] for r in gc.kernel_numerics([wrong], CPU, torch.float32, N=40, d=16))
    assert not any(r["ok"] for r in gc.op_numerics([wrong], CPU, torch.float32, small))


def test_workspace_fit_and_fragmentation():
    rows = [{"kernel": "k", "q_elements": q, "excess_bytes": 1000 + 6 * q, "reserved_peak_bytes": 110,
             "allocated_peak_bytes": 100} for q in (1 << 20, 1 << 21, 1 << 22)]
    fit = gc.fit_workspace(rows)["k"]
    assert fit["constant_bytes"] == 1000 and abs(fit["bytes_per_q_element"] - 6) < 1e-9
    assert abs(gc.fragmentation(rows) - 0.1) < 1e-12
    # the planner's workspace formula: fp32 dq accumulator + row statistic, + bf16 expanded dK/dV when m > w
    assert gc.planner_workspace_formula(1024, 4, 1) == 1024 * 4 * 128 * 4 + 4 * 1024 * 4 + 2 * 1024 * 4 * 128 * 2


def test_calibration_file_is_what_the_planner_reads(tmp_path):
    h200 = devices.GPUS["h200"]
    assert gc.gpu_key("NVIDIA H200", h200.total_bytes) == "h200"
    assert gc.gpu_key("NVIDIA Some GPU", 12345) == "nvidia-some-gpu"
    entry = gc.calibration_entry("NVIDIA H200", h200.total_bytes, 900 << 20, 0.031, 256 << 20,
                                 {"sdpa_flash": {"constant_bytes": 0, "bytes_per_q_element": 4.0, "runs": 3}},
                                 {"torch": torch.__version__})
    path = tmp_path / "gpu_calibration.json"
    path.write_text(json.dumps(entry))
    margins = devices.margins_for(h200, 8, calibration_file=path)
    assert margins.cuda_context_bytes == 900 << 20 and margins.fragmentation == 0.031
    assert "calibrated on NVIDIA H200" in margins.source


def _time_limits() -> dict[str, int]:
    """The default time limit (s) of each part of tools/gpu_check.sh, as the script sets them."""
    text = (REPO / "tools" / "gpu_check.sh").read_text()
    return {name: int(s) for name, s in re.findall(r"^(GPU_\w+_S)=\$\{\1:-(\d+)\}$", text, re.M)}


def test_the_parts_time_limits_fit_eight_minutes():
    limits = _time_limits()
    assert set(limits) == {"GPU_CHECK_S", "GPU_MULTIRANK_S", "GPU_ONE_RANK_S", "GPU_SANITIZER_S", "GPU_TRAIN_S",
                           "GPU_PYTEST_S"}
    assert sum(limits.values()) + limits["GPU_TRAIN_S"] <= 8 * 60, limits  # two training runs


def test_script_dry_run_runs_the_multirank_checks_on_the_cpu(tmp_path):
    """`bash tools/gpu_check.sh --dry-run`: part 1's plan, then parts 2-3 on the CPU, their JSON in $OUT."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "--dry-run"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "gpu_check plan" in r.stdout and "threaded: " in r.stdout and "one_rank (gloo)" in r.stdout
    report = json.loads((tmp_path / "gpu_multirank.json").read_text())
    assert report["threaded"]["ok"] and report["one_rank"]["ok"] and len(report["threaded"]["cases"]) > 30
