"""tools/gpu_check.py's CPU-runnable parts: its CLI (--help, --dry-run, no GPU), its numerics checks run on the CPU
kernel (they pass on a correct kernel and fail on a wrong one, so their float64 reference composition - RMSNorm,
attention, W_O, the fused-weight gradient mapping - is right), and the calibration file it writes, read back by
the planner's reader (megatron_upipe/planner/devices.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
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
