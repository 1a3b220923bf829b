"""The environment variables the job's plan assumes, set by the job itself before anything touches CUDA or NCCL.

`job_env(config, env)` is pure: given the config and the environment the job was started with, it returns the
variables to set (only those the user has not set: the user's values are kept) and one line saying what was set
and what was found. pretrain_llama.py's main() applies it on a real start before anything reads a GPU (the
start-up choice of U reads its total) or builds a process group, and prints the line (also with --dry-run, where
nothing is set). examples/launch_env.sh sets the same values for the recipes; the job does not depend on it.

- NCCL_NVLS_ENABLE=0. On NVSwitch systems NCCL uses NVLink SHARP by default, whose multicast buffers cost GBs of
  GPU memory per communicator; the all-to-alls never use them. The planner's NCCL margin follows the value the job
  runs with (`nvls_on`): off -> the `nvswitch`/`nvswitch-ib` margins, on (the user set anything but 0) ->
  `nvswitch-nvls` (planner/devices.py).
- TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (TearDown): a failed or timed-out collective ends the process (torch's default,
  3, skips the clean-up). The legacy NCCL_ASYNC_ERROR_HANDLING counts as set.
- PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True with memory.expandable_segments. CUDA's caching allocator
  parses its configuration once, when CUDA is first initialised, so it must be set before that. A value the user
  gave in PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF (torch reads the former first) is kept.
- CUDA_DEVICE_MAX_CONNECTIONS=1 where megatron-core's overlap relies on it: tensor parallelism (its asynchronous
  gradient all-reduce and sequence-parallel all-gather are issued before the GEMM they overlap, and only one
  hardware queue keeps that order; megatron-core warns without it, tensor_parallel/layers.py), and TE's context
  parallelism (Megatron-LM refuses cp > 1 without it on Hopper, megatron/training/arguments.py). Elsewhere the job
  leaves CUDA's default: Megatron-FSDP wants more than one queue (Megatron-LM refuses 1 with it; with tp > 1 as well,
  megatron-core's need is served and Megatron-LM only warns that the two pull apart).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from megatron_upipe.config import Config
from megatron_upipe.config.schema import TE_CP_STRATEGIES

NVLS = "NCCL_NVLS_ENABLE"
ERRORS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
ALLOC = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


@dataclass(frozen=True)
class JobEnv:
    set: dict[str, str]  # the variables the job sets (none of them was in the environment)
    line: str  # what was set and what was found, one line
    nvls: bool  # NCCL will use NVLS: the planner's NCCL margin is `nvswitch-nvls`


def nvls_on(env: Mapping[str, str]) -> bool:
    """Whether NCCL uses NVLS in a job with environment `env`: NCCL_NVLS_ENABLE set to anything but 0 (unset is off,
    since the job then sets 0)."""
    return env.get(NVLS, "0").strip() not in ("0", "")


def needs_one_connection(config: Config) -> bool:
    """CUDA_DEVICE_MAX_CONNECTIONS=1: tensor parallelism, or TE's context parallelism (see the module docstring)."""
    p = config.parallel
    return p.tp > 1 or (p.cp > 1 and p.cp_strategy in TE_CP_STRATEGIES)


def job_env(config: Config, env: Mapping[str, str]) -> JobEnv:
    """The variables to set (those the user left unset) and the one line; see the module docstring."""
    to_set: dict[str, str] = {}
    said: list[str] = []
    given = [name for name, value in env.items() if value.strip()]  # set to something: an empty value reads as unset

    def set_or_keep(name: str, value: str, why: str, found: str | None = None) -> None:
        found = found or (name if name in given else None)
        if found is None:
            to_set[name] = value
            said.append(f"{name}={value} (set by the job; {why})")
        else:
            said.append(f"{found}={env[found]} (yours)")

    if nvls_on(env):
        said.append(f"{NVLS}={env[NVLS]} (yours: NVLS on; the plan uses the nvswitch-nvls NCCL margin)")
    else:
        set_or_keep(NVLS, "0", "the plan's NCCL margin assumes NVLS off")
    set_or_keep(ERRORS[0], "1", "a failed collective ends the job",
                found=next((v for v in ERRORS if v in given), None))
    if config.memory.expandable_segments:
        mine = next((v for v in ALLOC if v in given), None)
        set_or_keep(ALLOC[0], "expandable_segments:True", "memory.expandable_segments=true", found=mine)
        if mine is not None and "expandable_segments:true" not in env[mine].replace(" ", "").lower():
            said[-1] = f"{mine}={env[mine]} (yours: memory.expandable_segments=true is not applied)"
    if needs_one_connection(config):
        set_or_keep(CONNECTIONS, "1", "megatron-core's tensor/context-parallel overlap orders its kernels by it")
        if CONNECTIONS in given and env[CONNECTIONS].strip() != "1":
            said[-1] = f"{CONNECTIONS}={env[CONNECTIONS]} (yours: megatron-core's overlap wants 1)"
    elif CONNECTIONS in given:
        said.append(f"{CONNECTIONS}={env[CONNECTIONS]} (yours)")
    line = "environment: " + "; ".join(said)
    return JobEnv(to_set, line, nvls_on({**env, **to_set}))
