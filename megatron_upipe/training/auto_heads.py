"""Start-up choice of UPipe's U (planner/choose_heads.py picks it) for `parallel.upipe_heads_per_stage=auto`, and
for cp_strategy=upipe with upipe_heads_per_stage unset (null): the training job's default.

Every rank runs it before the process group exists, on the same config and world size, so every rank gets the
same U without a collective. The planner runs in a subprocess (tools/estimate_memory.py on the config written out
as YAML, as training/memory_check.py does: the planner builds its own fake process group) with no GPU visible and
one simulation at a time. The device it plans against is `memory.plan_gpu`: "local" is this rank's GPU as it
reports its total (torch.cuda.get_device_properties), passed on as usable GiB; the NCCL margin is the one of the
NVLS setting the job runs with (pretrain_llama.py sets NCCL_NVLS_ENABLE before this runs). With nothing to plan against
(memory.plan_gpu=local on a machine without a GPU) an unset U is the smallest legal one (the least attention
memory), said in one line; an explicit `auto` is refused there instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_upipe.config import Config, ConfigError, load_config, to_yaml, validate
from megatron_upipe.planner.devices import topology_for
from megatron_upipe.training.node_env import nvls_on

REPO = Path(__file__).resolve().parents[2]


def plans_heads(config: Config) -> bool:
    """Whether the job picks U at start-up: cp_strategy=upipe with upipe_heads_per_stage auto or unset."""
    p = config.parallel
    return p.cp_strategy == "upipe" and p.upipe_heads_per_stage in (None, "auto")


def _nothing_to_plan_against(config: Config) -> bool:
    import torch

    return config.memory.plan_gpu == "local" and not torch.cuda.is_available()


def plan_gpu_spec(config: Config, setting: str = "parallel.upipe_heads_per_stage=auto") -> str:
    """memory.plan_gpu as tools/estimate_memory.py's --gpu takes it ("local" resolved to this GPU's GiB); `setting`
    is what asks for the plan (named in the refusal on a machine without a GPU)."""
    spec = config.memory.plan_gpu
    if spec != "local":
        return str(spec)
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"{setting} plans against memory.plan_gpu=local, but this machine has no GPU: set "
                          "memory.plan_gpu to the GPUs the job will run on (h100-80gb, h200, ... or usable GiB)")
    props = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))
    return f"{props.total_memory / 2**30:.4f}"


def resolve_auto_heads(config: Config, world_size: int, timeout_s: float = 1800.0,
                       nvls: bool | None = None) -> tuple[Config, str]:
    """`config` with upipe_heads_per_stage auto (or unset: `plans_heads`) replaced by the planner's U, and the
    one-line reason; ConfigError (the planner's own message) when no legal U fits. `nvls`: whether the job runs
    with NCCL's NVLS on (the planner's NCCL margin follows it); None reads it from this process's environment
    (training/node_env.py `nvls_on`)."""
    if config.parallel.upipe_heads_per_stage is None and _nothing_to_plan_against(config):
        U = validate(config, world_size).heads_per_stage  # unset: the smallest legal
        return config, (f"parallel.upipe_heads_per_stage unset -> U={U}, the smallest legal (the least attention "
                        f"memory): no GPU here to plan against (memory.plan_gpu=local); set memory.plan_gpu to let "
                        f"the memory planner choose, or set the U")
    choice, resolved = run_planner(
        config, world_size, ["--gpu", plan_gpu_spec(config), "parallel.upipe_heads_per_stage=auto"],  # unset U too
        setting="parallel.upipe_heads_per_stage=auto", nvls=nvls, timeout_s=timeout_s,
        overrides=lambda got: [f"parallel.upipe_heads_per_stage={got['heads_choice']['heads_per_stage']}"])
    return resolved, f"parallel.upipe_heads_per_stage=auto -> {choice['heads_choice']['reason']}"


def run_planner(config: Config, world_size: int, args: list[str], *, setting: str, nvls: bool | None,
                timeout_s: float, overrides, refusal_prefix: str = "") -> tuple[dict, Config]:
    """tools/estimate_memory.py on `config` (written out as YAML) at `world_size` with `args`, in a subprocess with
    no GPU visible and one simulation at a time, the NCCL margin of `nvls` (None: this process's environment):
    (its JSON, the config with `overrides(json)` on top). The planner's refusal is a ConfigError (its one line
    after `refusal_prefix`); any other failure a RuntimeError naming `setting`."""
    topology = topology_for(world_size, nvls=nvls_on(os.environ) if nvls is None else nvls)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, out = Path(tmp) / "config.yaml", Path(tmp) / "plan.json"
        cfg.write_text(to_yaml(config))
        proc = subprocess.run(
            [sys.executable, str(REPO / "tools" / "estimate_memory.py"), "--config", str(cfg), "--world-size",
             str(world_size), "--nccl-topology", topology, "--jobs", "1", "--json", str(out), *args],
            capture_output=True, text=True, timeout=timeout_s,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
        )
        if proc.returncode == 2:  # the planner refused: its one-line reason
            raise ConfigError(refusal_prefix + proc.stderr.strip().splitlines()[-1].removeprefix(
                "estimate_memory.py: error: "))
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{setting}: the memory planner failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        got = json.loads(out.read_text())
        return got, load_config(str(cfg), overrides(got))
