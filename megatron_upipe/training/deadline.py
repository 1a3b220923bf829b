"""Stop before the job's time limit with the last step saved: steps of hours make a late signal useless.

A long-context step takes hours (Llama3-8B at 5M tokens on 8 x H100: about 1.9 h by the step-time model), so
Slurm's `--signal=USR1@600` comes in the middle of a step that cannot finish in 600 s, and the job ends with its last
step lost. Instead the job plans against its deadline:

  deadline   the earliest of: the start plus `train.exit_duration_mins` (Megatron-LM's --exit-duration-in-mins), and
             under Slurm the job's end time (`SLURM_JOB_END_TIME`, set by Slurm 23.02 and newer, else `squeue -h -j
             $SLURM_JOB_ID -o %e`), read once by rank 0 at start-up and broadcast;
  next step  the longest step measured in this job; before the first one ends, the step-time model's prediction
             when the job has one (memory.plan_check on a GPU the model knows), else unknown (the job then runs
             its first step);
  save       the longest save measured in this job, else SAVE_ESTIMATE_S, a stated allowance, not a measurement:
             the 8B recipe's model and optimizer states are about 112 GB (bf16 weights, fp32 main weights and two
             Adam moments), 14 GB per rank, which a shared file system at 0.1-1 GB/s per rank writes in 14-140 s.

After every step, when `now + next step + save + MARGIN_S` passes the deadline, every rank (they agree through one
all-reduce) saves this step, unless it was just saved, and stops with exit status 5 ("saved; resubmit": the same
status as a stop on signal). Before the first step, a deadline that leaves less than one predicted step and its save
is refused (exit 2).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime

SAVE_ESTIMATE_S = 300.0  # a save's allowance before one has been measured (module docstring)
MARGIN_S = 120.0  # slack for the stop itself: the agreement, the log lines, the process exit


class DeadlineTooShort(Exception):
    """The job's time limit cannot hold one predicted step and its save (pretrain_llama.py exits 2)."""


def slurm_end_time(env=os.environ, squeue=None) -> float | None:
    """The Slurm job's end time as a UNIX time (None outside Slurm, or with no time limit)."""
    raw = env.get("SLURM_JOB_END_TIME", "")
    if raw.isdigit() and int(raw) > 0:
        return float(raw)
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    text = (squeue or _squeue_end)(job)
    try:
        return datetime.fromisoformat(text.strip()).timestamp() if text else None
    except ValueError:  # "N/A", "Unknown", "NONE": no end time
        return None


def _squeue_end(job: str) -> str | None:
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def job_deadline(exit_duration_mins: float | None, start: float, env=os.environ, squeue=None) -> float | None:
    """The earliest of start + exit_duration_mins and the Slurm end time (None: no deadline)."""
    candidates = [start + 60.0 * exit_duration_mins] if exit_duration_mins is not None else []
    end = slurm_end_time(env, squeue)
    if end is not None:
        candidates.append(end)
    return min(candidates) if candidates else None


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


@dataclass
class Deadline:
    """The job's deadline and what it has measured (module docstring)."""

    at: float  # UNIX time
    predicted_step_s: float | None = None
    step_s: list[float] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)

    def next_step_s(self) -> float | None:
        return max(self.step_s) if self.step_s else self.predicted_step_s

    def save_estimate_s(self) -> float:
        return max(self.save_s) if self.save_s else SAVE_ESTIMATE_S

    def must_stop(self, now: float) -> bool:
        """Whether another step and a save would pass the deadline (unknown step length: no)."""
        step = self.next_step_s()
        return step is not None and now + step + self.save_estimate_s() + MARGIN_S > self.at

    def start_refusal(self, now: float) -> str | None:
        """One line when the time left cannot hold one predicted step and its save (None otherwise)."""
        step = self.predicted_step_s
        if step is None or now + step + self.save_estimate_s() + MARGIN_S <= self.at:
            return None
        return (f"the job's time limit leaves {hours(self.at - now)} but one step takes about {hours(step)} (the "
                f"step-time model) plus a save: it would end with nothing saved; raise the time limit (sbatch "
                f"--time) or train.exit_duration_mins, or shorten train.seq_length")

    def line(self, now: float) -> str:
        step = self.next_step_s()
        known = f"; a step takes about {hours(step)}" if step is not None else ""
        return (f"deadline in {hours(self.at - now)} (train.exit_duration_mins / the Slurm time limit){known}: the "
                f"job saves and stops (exit 5) before a step that could not finish and save in time")


def now() -> float:
    return time.time()
