"""Stop at a step boundary on SIGTERM or SIGUSR1 (pre-emption, a batch scheduler's time limit), checkpoint first.

With checkpoint.dir set and checkpoint.save_on_signal=true (the default), the training loop runs inside
`StopOnSignal`: the handler of SIGTERM and SIGUSR1 only records the signal. After every step all ranks all-reduce
(MAX) what they recorded (`agreed`), so they stop after the same step even when the signal reached only some of them
or reached them at different moments, and no rank waits in a collective its peers never enter. The loop then saves
a checkpoint of that step (the atomic save: a kill during it leaves `latest` on the previous checkpoint), prints one
line and raises `StoppedBySignal`; pretrain_llama.py exits with EXIT_STOPPED (5). Resuming is relaunching the same
command: the run continues bit-exactly from the saved step.

Where the signal comes from:
  Slurm    `#SBATCH --signal=USR1@<seconds>` sends SIGUSR1 that long before the time limit to every process of the
           job steps (torchrun and the ranks); <seconds> must cover the rest of a step plus a save. torchrun must
           forward it rather than die of it: `--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1`, and
           `--shutdown-timeout` as long, or it kills the ranks 30 s after forwarding (examples/slurm/*.sbatch).
  torchrun a SIGTERM to torchrun (scancel, a pre-empting scheduler) is forwarded to the ranks, which then have
           --shutdown-timeout (default 30 s) to finish the step and the save before torchrun kills them.
A signal that arrives before the loop starts (set-up, model build, resume) keeps its default action.
`blocked_in_children` keeps the stop signals blocked in processes spawned meanwhile (megatron-core's checkpoint
writer starts a multiprocessing Manager on its first save), so a signal sent to every process of a job does not
kill that helper under a rank that is about to save through it.
"""

from __future__ import annotations

import contextlib
import signal
import threading

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_STOPPED = 5  # pretrain_llama.py's exit status after a stop on signal


class StoppedBySignal(Exception):
    """The run stopped after `step` on a signal; `saved` is the checkpoint written (None: checkpoint.dir unset)."""

    def __init__(self, signum: int, step: int, total: int, saved):
        self.signum, self.step, self.saved = signum, step, saved
        where = f"checkpoint {saved} saved" if saved is not None else "no checkpoint saved (checkpoint.dir is null)"
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step} of {total}: {where}; exit "
                         f"code {EXIT_STOPPED}; relaunch the same command to resume from step {step}")


class StopOnSignal:
    """Records SIGTERM / SIGUSR1 while active (a context manager; the main thread only, where Python runs signal
    handlers); `agreed(device)` is the signal every rank sees after one all-reduce, or 0."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received = 0
        self._previous: dict = {}

    def _record(self, signum, frame) -> None:
        self.received = self.received or int(signum)

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def agreed(self, device: torch.device, group=None) -> int:
        """Collective over `group` (default: all ranks): the largest signal number any rank recorded, 0 if none."""
        flag = torch.tensor([self.received], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())


@contextlib.contextmanager
def blocked_in_children(signals=STOP_SIGNALS):
    """Block `signals` in this thread for the block's duration: a process started meanwhile inherits the mask (fork
    and exec keep it) and never sees them. This process still records them (another thread takes the signal for
    it, or it stays pending until the block ends). multiprocessing's resource tracker is started first: starting it
    later, on the first spawn, would unblock SIGTERM in this thread just before that spawn."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from multiprocessing import resource_tracker

    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        resource_tracker.ensure_running()  # it blocks SIGINT/SIGTERM to spawn itself, then unblocks them here
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
