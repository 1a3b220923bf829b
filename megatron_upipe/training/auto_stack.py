"""Start-up choice of the whole stack for `memory.auto=fastest|longest` (planner/fastest.py chooses it).

As the automatic U (auto_heads.py, whose subprocess and device rules this follows): every rank runs the planner
before the process group exists, on the same config and world size, so every rank gets the same stack without a
collective. tools/estimate_memory.py --fastest (or --longest) runs in a subprocess with no GPU visible, one
simulation at a time, against `memory.plan_gpu` ("local": this GPU's reported total) with the NCCL margin of the
NVLS setting the job runs with. The step-time model's constants are those of memory.plan_gpu when it names a GPU
model that has them (h100-80gb, h200), else the H100's, said in the log line. The chosen `section.key=value`
overrides replace the config's, with memory.auto then none; the planner's refusal (nothing fits) is the job's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_upipe.config import Config, ConfigError, load_config, to_yaml
from megatron_upipe.planner.devices import topology_for
from megatron_upipe.training.auto_heads import plan_gpu_spec
from megatron_upipe.training.node_env import nvls_on

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SPEED = "h100-80gb"


def plans_stack(config: Config) -> bool:
    return config.memory.auto != "none"


def resolve_auto_stack(config: Config, world_size: int, timeout_s: float = 3600.0,
                       nvls: bool | None = None) -> tuple[Config, str]:
    """`config` with the planner's stack for memory.auto in place (memory.auto=none), and the one-line reason;
    ConfigError (the planner's own message) when nothing fits."""
    from megatron_upipe.planner.step_time import HARDWARE  # torch: not before the job has set its environment

    mode = config.memory.auto
    gpu = plan_gpu_spec(config, setting=f"memory.auto={mode}")
    speed = gpu if gpu in HARDWARE else DEFAULT_SPEED
    topology = topology_for(world_size, nvls=nvls_on(os.environ) if nvls is None else nvls)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, out = Path(tmp) / "config.yaml", Path(tmp) / "plan.json"
        cfg.write_text(to_yaml(config))
        proc = subprocess.run(
            [sys.executable, str(REPO / "tools" / "estimate_memory.py"), "--config", str(cfg), "--world-size",
             str(world_size), "--gpu", gpu, "--speed", speed, "--nccl-topology", topology, "--jobs", "1",
             f"--{mode}", "--json", str(out)],
            capture_output=True, text=True, timeout=timeout_s,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
        )
        if proc.returncode == 2:  # the planner refused: its one-line reason
            raise ConfigError(f"memory.auto={mode}: " + proc.stderr.strip().splitlines()[-1].removeprefix(
                "estimate_memory.py: error: "))
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"memory.auto={mode}: the memory planner failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        got = json.loads(out.read_text())
        resolved = load_config(str(cfg), [*got["overrides"], "memory.auto=none"])
    return resolved, (f"memory.auto={mode} -> {' '.join(got['overrides'])}: planned {got['peak_bytes'] / 2**30:.2f} "
                      f"GiB per GPU, host {got['host_bytes_per_node'] / 2**30:.0f} GiB per node; step-time model "
                      f"({speed}): {got['step_time_s']:.4g} s/step, {got['tokens_per_s_per_gpu']:.0f} tokens/s per "
                      f"GPU (the config as set: {got['baseline']['step_time_s']:.4g} s/step)")
