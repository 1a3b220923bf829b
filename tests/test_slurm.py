"""The 8xH100 Slurm recipe, unmodified, trains under a real single-node Slurm on this machine.

tools/ci/start_slurm.sh starts munged, slurmctld and slurmd (installing slurm-wlm and munge with apt-get when they
are missing; needs root) on private ports, with one node `localhost` that has this machine's CPUs and 8 fake GPUs,
so the recipe's `#SBATCH --gpus-per-node=8` is accepted as written. The CPU run differs only in the environment
(NPROC_PER_NODE=2, RUN_DIR, MASTER_PORT, the interpreter) and in config overrides (the tiny model on gloo); the
test then checks the job state, the resolved config in the run directory and three finite losses in its metrics.
Skipped only when Slurm is absent and apt-get cannot install it.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_upipe.config import load_config
from tests.dist_helper import free_port

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "slurm" / "llama3_8b_upipe_8xh100.sbatch"
JOB_TIMEOUT_S = 240
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec_per_gpu", "peak_mem_bytes"}


def logs_of(directory: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(directory.glob("*.log")))


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """SLURM_CONF of a running single-node cluster; the daemons are stopped afterwards, whatever happens."""
    state = tmp_path_factory.mktemp("slurm")
    env = os.environ | {"SLURMCTLD_PORT": str(free_port()), "SLURMD_PORT": str(free_port())}
    try:
        r = subprocess.run(["bash", str(ROOT / "tools" / "ci" / "start_slurm.sh"), str(state)], env=env,
                           capture_output=True, text=True, timeout=900)
        if r.returncode == 3:
            pytest.skip(f"Slurm is not installed and apt-get could not install slurm-wlm munge:\n{r.stderr[-2000:]}")
        assert r.returncode == 0, f"start_slurm.sh failed:\n{r.stdout}{r.stderr}\n{logs_of(state / 'log')}"
        yield str(state / "slurm.conf")
    finally:
        subprocess.run(["bash", str(ROOT / "tools" / "ci" / "stop_slurm.sh"), str(state)], timeout=60)


def job_fields(job_id: str, env: dict) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def run_recipe(slurm: str, tmp_path: Path, *extra: str) -> tuple[dict, str, Path, dict]:
    """Submit the recipe with the CPU overrides (+ extra) and wait for it: (job fields, output, run dir, env)."""
    run_dir = tmp_path / "run"
    job_log = tmp_path / "job.out"
    venv_bin = str(Path(sys.executable).parent)  # torchrun of this interpreter's environment
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))} | {
        "SLURM_CONF": slurm, "PATH": f"{venv_bin}:{os.environ['PATH']}", "VENV": "none", "PYTHON": sys.executable,
        "NPROC_PER_NODE": "2", "RUN_DIR": str(run_dir), "MASTER_PORT": str(free_port()),
    }
    overrides = [
        "model.preset=tiny", "parallel.cp=2", "parallel.cp_strategy=upipe", "parallel.upipe_heads_per_stage=null",
        "train.seq_length=64", "train.steps=3", "train.bf16=false", "train.distributed_optimizer=false",
        "dist.backend=gloo", "dist.timeout_s=120", "memory.plan_check=false",
        f"data.path={ROOT}/data/corpus_text_document", f"data.tokenizer={ROOT}/data/tokenizer/spm.model",
        "data.num_workers=0", f"checkpoint.dir={tmp_path}/checkpoints", *extra,
    ]
    submit = subprocess.run(["sbatch", "--parsable", f"--output={job_log}", str(RECIPE), *overrides], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]

    start = time.monotonic()
    while (job := job_fields(job_id, env))["JobState"] in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
        if time.monotonic() - start > JOB_TIMEOUT_S:
            subprocess.run(["scancel", job_id], env=env, timeout=30)
            pytest.fail(f"job {job_id} still {job['JobState']} after {JOB_TIMEOUT_S} s:\n"
                        f"{job_log.read_text() if job_log.exists() else ''}")
        time.sleep(0.5)
    return job, job_log.read_text() if job_log.exists() else "(no job output)", run_dir, env


def test_8xh100_recipe_trains_under_slurm(slurm, tmp_path):
    job, output, run_dir, env = run_recipe(slurm, tmp_path)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), f"job {job['JobId']}: {job}\n{output}"

    assert f"rendezvous localhost:{env['MASTER_PORT']}" in output
    resolved = load_config(str(run_dir / "config.yaml"), [])
    assert resolved.model.preset == "tiny" and resolved.parallel.cp == 2 and resolved.train.steps == 3
    assert resolved.train.seq_length == 64 and resolved.dist.backend == "gloo"
    assert resolved.parallel.cp_strategy == "upipe" and resolved.memory.recompute == "full"  # from the recipe's config
    assert resolved.log.metrics_file == f"{run_dir}/metrics.jsonl"

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r.get("kind", "train") == "train"]
    assert [r["step"] for r in records] == [1, 2, 3], lines
    assert all(METRIC_KEYS <= r.keys() for r in records), records
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records), records


def test_a_job_stopped_before_its_deadline_tells_slurm_saved_resubmit(slurm, tmp_path):
    """train.exit_duration_mins=1: after step 1 another step, the save allowance and the margin pass the deadline,
    so the job saves step 1 and stops with 5; torchrun itself exits 1, and Slurm sees the job's 5 (the batch script
    exits with RUN_DIR/exit_status)."""
    job, output, run_dir, _ = run_recipe(slurm, tmp_path, "train.exit_duration_mins=1", "checkpoint.interval=0")
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "5:0"), f"job {job['JobId']}: {job}\n{output}"
    assert "stopped before the job's deadline after step 1 of 3" in output
    assert (run_dir / "exit_status").read_text() == "5\n"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "iter_0000001"
