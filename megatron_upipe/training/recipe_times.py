"""Does a Slurm recipe's time limit hold its first checkpoint? Judged against the step-time model.

A recipe is a batch script (examples/slurm/*.sbatch: its `#SBATCH --time`, `--nodes`, `--gpus-per-node` and the
config it defaults to) and that config's `checkpoint.interval`. `tools/recipe_times.py` runs the memory planner with
the step-time model (tools/estimate_memory.py, the H100 constants of planner/step_time.py) on each recipe's config
at its world size and records the predicted seconds per step, with the resolved config's sha256, in
examples/plans/recipe_step_times.json. `recipe_problems` then holds each recipe to the rule:

  first checkpoint = interval x step + the save allowance (training/deadline.py SAVE_ESTIMATE_S) + MARGIN_S
  must come within the first half of --time

so a job that meets its limit has saved at least once, and the deadline logic of the job (training/deadline.py)
saves the last step that can finish before the limit. `header_lines` are the lines each batch script's header
carries.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from megatron_upipe.training.deadline import MARGIN_S, SAVE_ESTIMATE_S

TIMES_FILE = "examples/plans/recipe_step_times.json"


def sbatch_directives(script: Path) -> dict[str, str]:
    """The #SBATCH --key=value lines of a batch script (those before its first command, as sbatch reads them)."""
    out = {}
    for line in script.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").strip().partition("=")
            out[key] = value
    return out


def sbatch_config(script: Path) -> str:
    """The config path (relative to the repository) a batch script defaults to."""
    m = re.search(r"^CONFIG=\$\{CONFIG:-(\S+)\}$", script.read_text(), re.MULTILINE)
    if not m:
        raise ValueError(f"{script.name} must default CONFIG to a shipped config (CONFIG=${{CONFIG:-...}})")
    return m.group(1)


def sbatch_world_size(directives: dict[str, str]) -> int:
    return int(directives["--nodes"]) * int(directives["--gpus-per-node"])


def time_limit_s(value: str) -> int:
    """Slurm's --time in seconds: [D-]HH:MM:SS, HH:MM:SS, MM:SS or minutes."""
    days, _, rest = value.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if len(parts) == 1:
        seconds = parts[0] * 60
    else:
        parts = [0] * (3 - len(parts)) + parts
        seconds = parts[0] * 3600 + parts[1] * 60 + parts[2]
    return seconds + (int(days) * 86400 if days else 0)


def config_sha256(path: Path) -> str:
    """sha256 of the resolved config (defaults < file): what the planner simulates; comments do not count."""
    from megatron_upipe.config import load_config, to_yaml

    return hashlib.sha256(to_yaml(load_config(str(path), [])).encode()).hexdigest()


def first_checkpoint_s(step_s: float, interval: int) -> float:
    return interval * step_s + SAVE_ESTIMATE_S + MARGIN_S


def recipe_problems(name: str, limit_s: int, interval: int, step_s: float) -> list[str]:
    """What is wrong with a recipe's time limit and save interval for its predicted step time (empty: nothing)."""
    if interval <= 0:
        return [f"{name}: checkpoint.interval={interval} saves nothing periodically"]
    first = first_checkpoint_s(step_s, interval)
    if first > limit_s / 2:
        return [f"{name}: the first checkpoint comes after {first / 3600:.2f} h (checkpoint.interval={interval} x "
                f"{step_s / 3600:.2f} h per step + a save), past half of --time ({limit_s / 3600:.2f} h): lower "
                f"checkpoint.interval or raise --time"]
    return []


def header_lines(step_s: float, interval: int, limit_s: int) -> list[str]:
    """The timing lines of a batch script's header (checked by tests/test_recipes.py)."""
    steps = int((limit_s - SAVE_ESTIMATE_S - MARGIN_S) // step_s)
    return [f"# Time: one step takes about {step_s / 3600:.2f} h (step-time model, H100: {TIMES_FILE}); a checkpoint",
            f"# every {interval} step(s), the first after about {first_checkpoint_s(step_s, interval) / 3600:.2f} h; "
            f"--time holds about {steps} step(s); the job saves",
            "# and stops (exit 5) before a step that could not finish in time (training/deadline.py)."]
