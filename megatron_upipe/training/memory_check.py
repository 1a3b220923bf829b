"""The planner's predicted peak beside the measured one, in the training log.

At start-up rank 0 runs the memory planner (tools/estimate_memory.py, a subprocess: it needs a process without a
process group) on the resolved config and this world size. In the run's second step (Adam's moments then exist and
Megatron-FSDP is past its first backward, as the planner assumes) the forward/backward schedule's peak is measured
with the model states alive — on GPU `torch.cuda.max_memory_allocated`, on CPU the planner's storage tracker with
the model states registered (Megatron-FSDP's shards and live buckets, and the in-place resizes of its buckets,
included), which is what the planner's simulation tracks — and both are logged with their difference. The
optimizer update itself is not part of either: with a fused Adam (TransformerEngine/apex on GPU) it allocates no
full-size temporaries, while torch's CPU Adam makes per-parameter temporaries that the planner does not model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from megatron_upipe.planner.devices import topology_for
from megatron_upipe.training.metrics import memory_label
from megatron_upipe.training.node_env import nvls_on

REPO = Path(__file__).resolve().parents[2]


def predict(config_yaml: str, world_size: int, timeout_s: float = 900.0, nvls: bool | None = None) -> dict | None:
    """The planner's estimate of this config (None if it failed; the reason goes to stderr). Its NCCL margin follows
    `nvls`, NCCL's NVLS setting of the job (None: this process's environment, which the job has set by now)."""
    topology = topology_for(world_size, nvls=nvls_on(os.environ) if nvls is None else nvls)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, out = Path(tmp) / "config.yaml", Path(tmp) / "plan.json"
        cfg.write_text(config_yaml)
        proc = subprocess.run(
            [sys.executable, str(REPO / "tools" / "estimate_memory.py"), "--config", str(cfg),
             "--world-size", str(world_size), "--nccl-topology", topology, "--json", str(out)],
            capture_output=True, text=True, timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        if proc.returncode != 0 or not out.exists():
            print(f"memory planner failed (exit {proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
            return None
        return json.loads(out.read_text())["results"][0]


class MeasuredPeak:
    """Context manager around the forward/backward schedule; `result` = {"bytes", "kind"} once it has exited."""

    def __init__(self, state, device: torch.device) -> None:
        self.state, self.device, self.result = state, device, {}
        self.on_resize = None  # CPU: the tracker's, while it runs
        self._cm = self._measure()

    def __enter__(self):
        return self._cm.__enter__()

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    @contextmanager
    def _measure(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield self
            torch.cuda.synchronize(self.device)
            self.result = {"bytes": int(torch.cuda.max_memory_allocated(self.device)), "kind": "cuda_max_allocated"}
            return
        from megatron_upipe.planner.simulate import StorageTracker, tracked_step

        mem = StorageTracker()
        with tracked_step(mem, self.state.model, self.state.ddp, self.state.optimizer):
            self.on_resize = mem.resized  # the parked optimizer states (memory.offload_optimizer_states)
            yield self
        self.result = {"bytes": mem.peak_bytes, "kind": "tracked"}


def comparison(step: int, measured: dict, predicted: dict) -> dict:
    """Metrics record of kind "memory": the measured peak of `step` beside the planner's prediction."""
    want = predicted["tracked_bytes"] if measured["kind"] == "tracked" else predicted["device_bytes"]
    return {"step": step, "measured_peak_bytes": measured["bytes"], "measured_kind": measured["kind"],
            "predicted_peak_bytes": want, "rel_diff": (measured["bytes"] - want) / want if want else None,
            "predicted_with_margins_bytes": predicted["peak_bytes"]}


def prediction_line(predicted: dict) -> str:
    return (f"memory: planner predicted peak alloc {predicted['device_bytes'] / 2**20:.2f} MiB/GPU (tensors and "
            f"attention workspace) | planner predicted total {predicted['peak_bytes'] / 2**20:.1f} MiB/GPU (with "
            f"margins for fragmentation, CUDA context, NCCL)")


def comparison_line(r: dict) -> str:
    diff = "n/a" if r["rel_diff"] is None else f"{r['rel_diff']:+.2%}"
    return (f"memory: step {r['step']} measured {memory_label(r['measured_kind'])} "
            f"{r['measured_peak_bytes'] / 2**20:.2f} MiB (forward/backward, all model states) vs planner predicted "
            f"{r['predicted_peak_bytes'] / 2**20:.2f} MiB ({diff})")
