"""No helper process outlives its rank.

megatron-core's checkpoint writer (torch_dist strategy) starts a multiprocessing Manager in each rank on its first
save (start method spawn), and training/signals.py keeps the stop signals blocked in it so that a signal meant for
the job does not kill it under a rank that is about to save. A rank that dies (SIGKILL, or torchrun's SIGKILL after
its shutdown timeout) left that helper behind, reparented to PID 1 and deaf to SIGTERM, with its memory (about
765 MB RSS each): on a cluster node it leaks into the next job.

Every process that multiprocessing spawns re-runs the entry script's top level as `__mp_main__` before it does its
work. The entry script calls `die_with_parent(__name__)` there, which in such a child asks the kernel for SIGKILL
when its parent dies (Linux prctl PR_SET_PDEATHSIG; SIGKILL cannot be blocked), and checks that the parent is still
there (it may have died before the call). In the rank itself (`__main__`) it does nothing. multiprocessing's
resource tracker, a separate process, ends by itself once every process holding its pipe is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(module_name: str) -> bool:
    """In a process multiprocessing spawned from the entry script (module_name == "__mp_main__"): SIGKILL when the
    parent dies. Returns whether it was set (False in the rank itself, or where prctl is not available)."""
    if module_name != "__mp_main__":
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # not Linux
        return False
    if parent == 1 or os.getppid() != parent:  # the parent died before the call: follow it now
        os.kill(os.getpid(), signal.SIGKILL)
    return True
