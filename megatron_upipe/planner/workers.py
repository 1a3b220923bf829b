"""Independent simulations side by side: one forked process each, up to `jobs` at a time.

A simulation is single-threaded Python (fake tensors dispatch op by op), so two of them on two cores take the time
of one. The workers are forked from this process, so they start with its imports instead of paying them again, and
each makes its own fake process group (simulate_step needs a process without one: so must this one be). Results
come back pickled; a worker's exception is raised here. They run here, one after the other, with jobs=1, on a
platform without fork, or once this process has run an autograd backward (a simulation, a training step): torch's
autograd engine then refuses to run in a forked child ("Unable to handle autograd's threading in combination with
fork-based multiprocessing"), which a forked probe finds out first.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import torch


def default_jobs() -> int:
    """Workers worth starting: the CPUs this process may run on, at most 2 (the depth extrapolation's two
    simulations)."""
    return max(1, min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def fork_usable() -> bool:
    """Whether a child forked now can run autograd (see the module docstring)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    pid = os.fork()
    if pid == 0:  # the probe: one backward, then leave without running this process's exit handlers
        try:
            torch.ones(1, requires_grad=True).sum().backward()
        except BaseException:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def run_all(fn, calls: list[tuple], jobs: int = 1) -> list:
    """[fn(*args) for args in calls], in forked workers when jobs > 1 (fn and the results must pickle)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if jobs == 1 or len(calls) < 2 or not fork_usable():
        return [fn(*args) for args in calls]
    with ProcessPoolExecutor(max_workers=min(jobs, len(calls)),
                             mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(fn, *zip(*calls)))
