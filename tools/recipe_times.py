#!/usr/bin/env python
"""Predict each Slurm recipe's step time and check its time limit and save interval against it.

    python tools/recipe_times.py            # run the planner on every examples/slurm/*.sbatch, write the JSON
    python tools/recipe_times.py --check    # only check the recipes against the committed JSON (no simulation)

For each batch script: its default config at its world size (--nodes x --gpus-per-node) through
tools/estimate_memory.py (the memory planner with the step-time model, H100 constants), one process per recipe;
the seconds per step go to examples/plans/recipe_step_times.json with the resolved config's sha256. Then every recipe is
held to the rule of megatron_upipe/training/recipe_times.py (the first checkpoint within the first half of --time)
and its header's timing lines are printed as they must read. A few minutes on 2 cores (the 70B recipe is the
longest). Exit 1 when a recipe breaks the rule or the JSON is stale.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_upipe.config import load_config  # noqa: E402
from megatron_upipe.training.recipe_times import (  # noqa: E402
    TIMES_FILE, config_sha256, header_lines, recipe_problems, sbatch_config, sbatch_directives, sbatch_world_size,
    time_limit_s,
)

PROG = "recipe_times.py"


def predict_step_s(config: str, world_size: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "estimate_memory.py"), "--config", config,
                               "--world-size", str(world_size), "--json", str(out)],
                              cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise RuntimeError(f"estimate_memory.py --config {config} failed:\n{proc.stderr[-2000:]}")
        return json.loads(out.read_text())["results"][0]["step_time"]["seconds"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="check against the committed JSON; simulate nothing")
    a = p.parse_args(argv)
    times_path = ROOT / TIMES_FILE
    recorded = json.loads(times_path.read_text()) if times_path.exists() else {}
    problems = []
    for script in sorted((ROOT / "examples" / "slurm").glob("*.sbatch")):
        d = sbatch_directives(script)
        config, world = sbatch_config(script), sbatch_world_size(d)
        sha = config_sha256(ROOT / config)
        if a.check:
            entry = recorded.get(script.name)
            if entry is None or entry["config_sha256"] != sha or entry["world_size"] != world:
                problems.append(f"{script.name}: {TIMES_FILE} is stale for {config} at {world} GPUs: rerun {PROG}")
                continue
        else:
            entry = {"config": config, "config_sha256": sha, "world_size": world,
                     "step_s": predict_step_s(config, world)}
            recorded[script.name] = entry
            print(f"{script.name}: {entry['step_s']:.0f} s per step", flush=True)
        interval = load_config(str(ROOT / config), []).checkpoint.interval
        limit = time_limit_s(d["--time"])
        problems += recipe_problems(script.name, limit, interval, entry["step_s"])
        print("\n".join([f"{script.name}:", *header_lines(entry["step_s"], interval, limit)]))
    if not a.check:
        times_path.write_text(json.dumps(recorded, indent=1) + "\n")
    for line in problems:
        print(f"{PROG}: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
