"""GPU capacities and margins of the planner (megatron_upipe/planner/devices.py) and the CLI's --gpu."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_upipe.planner import devices as D

ROOT = Path(__file__).resolve().parents[1]


def test_capacities_are_the_reported_totals_not_the_marketing_sizes():
    assert D.resolve_gpu("h100-80gb").total_bytes == 81082 * 2**20  # CUDA's total, not nvidia-smi's 81559 MiB
    assert round(D.resolve_gpu("H100-80GB").total_bytes / D.GIB, 2) == 79.18
    assert D.resolve_gpu("h200").total_bytes == 150109880320  # measured on the lent H200 (nvidia-smi: 143771 MiB)
    assert D.resolve_gpu("a100-80gb").total_bytes < 80 * D.GIB  # nvidia-smi's 81920 MiB less the largest gap seen
    assert D.resolve_gpu("79.5").total_bytes == int(79.5 * D.GIB)
    assert D.DEFAULT_GPU == "h100-80gb"


@pytest.mark.parametrize("spec", ["h900", "-3", "0", "nan", "local"])
def test_a_bad_or_absent_gpu_is_refused_naming_the_choices(spec):
    with pytest.raises(ValueError, match="--gpu"):
        D.resolve_gpu(spec)  # 'local' too: this machine has no GPU


def test_nccl_margin_follows_the_topology_and_is_named():
    one_node, two_nodes = D.margins_for(D.GPUS["h100-80gb"], 8), D.margins_for(D.GPUS["h100-80gb"], 16)
    assert one_node.nccl_bytes == D.NCCL_TOPOLOGIES["nvswitch"].bytes
    assert two_nodes.nccl_bytes == D.NCCL_TOPOLOGIES["nvswitch-ib"].bytes > one_node.nccl_bytes
    assert D.margins_for(D.GPUS["h100-80gb"], 8, "nvswitch-nvls").nccl_bytes == 6 * D.GIB
    named = one_node.named(100 * 2**20)
    assert named == {"margin: fragmentation": 5 * 2**20, "margin: cuda context": 1 * D.GIB,
                     "margin: nccl": 2 * D.GIB}
    with pytest.raises(ValueError, match="topology"):
        D.margins_for(D.GPUS["h100-80gb"], 8, "torus")


def test_a_calibration_of_the_gpu_model_replaces_the_stated_context_and_fragmentation(tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"h200": {"device": "NVIDIA H200", "cuda_context_bytes": 600 * 2**20,
                                        "fragmentation": 0.02}}))
    h200 = D.margins_for(D.GPUS["h200"], 8, calibration_file=cal)
    assert (h200.cuda_context_bytes, h200.fragmentation) == (600 * 2**20, 0.02)
    assert "calibrated on NVIDIA H200" in h200.source
    assert h200.provenance()["fragmentation"] == "measured on NVIDIA H200 by tools/gpu_check.sh (cal.json)"
    assert h200.provenance()["nccl"].startswith("stated for nvswitch: one NVSwitch node")
    h100 = D.margins_for(D.GPUS["h100-80gb"], 8, calibration_file=cal)  # no entry: stated defaults
    assert h100 == D.margins_for(D.GPUS["h100-80gb"], 8, calibration_file=tmp_path / "absent.json")
    assert h100.provenance()["fragmentation"].startswith("stated: 5% of the live peak (1.66% measured on the lent")
    assert h100.provenance()["cuda context"].startswith("stated: 1 GiB")
    assert D.margins_for(D.GPUS["h100-80gb"], 16).provenance()["nccl"].startswith("stated for nvswitch-ib:")
    cal.write_text(json.dumps({"h200": {"device": "NVIDIA H200"}}))
    with pytest.raises(ValueError, match="lacks"):
        D.margins_for(D.GPUS["h200"], 8, calibration_file=cal)


def test_estimate_cli_reports_capacity_and_margins_and_refuses_an_unknown_gpu():
    base = [sys.executable, "tools/estimate_memory.py", "--config", "examples/configs/tiny_cpu.yaml",
            "--world-size", "2", "model.vocab_size=256", "train.micro_batch_size=1", "train.global_batch_size=1"]
    ok = subprocess.run(base + ["--gpu", "h200", "--nccl-gib", "0.5"], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "h200 (139.80 GiB: torch.cuda.mem_get_info" in ok.stdout
    assert "calibrated on NVIDIA H200" in ok.stdout  # examples/plans/gpu_calibration.json, from tools/gpu_check.sh
    assert "nccl 0.50 GiB" in ok.stdout and "overridden: nccl_bytes" in ok.stdout
    # each margin's provenance, one line each
    assert "  margin cuda context: measured on NVIDIA H200 by tools/gpu_check.sh" in ok.stdout
    assert "  margin fragmentation: measured on NVIDIA H200 by tools/gpu_check.sh" in ok.stdout
    assert "  margin nccl: given on the command line" in ok.stdout
    assert "margin: nccl 0.50" in ok.stdout
    bad = subprocess.run(base + ["--gpu", "h900"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--gpu 'h900' is unknown" in bad.stderr
