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

from megatron_upipe.config import Config
from megatron_upipe.training.auto_heads import plan_gpu_spec, run_planner

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
    got, resolved = run_planner(config, world_size, ["--gpu", gpu, "--speed", speed, f"--{mode}"],
                                setting=f"memory.auto={mode}", nvls=nvls, timeout_s=timeout_s,
                                overrides=lambda chosen: [*chosen["overrides"], "memory.auto=none"],
                                refusal_prefix=f"memory.auto={mode}: ")
    return resolved, (f"memory.auto={mode} -> {' '.join(got['overrides'])}: planned {got['peak_bytes'] / 2**30:.2f} "
                      f"GiB per GPU, host {got['host_bytes_per_node'] / 2**30:.0f} GiB per node; step-time model "
                      f"({speed}): {got['step_time_s']:.4g} s/step, {got['tokens_per_s_per_gpu']:.0f} tokens/s per "
                      f"GPU (the config as set: {got['baseline']['step_time_s']:.4g} s/step)")
