"""Stop at a step boundary on SIGTERM, SIGUSR1 (pre-emption, a batch scheduler's time limit) or SIGINT (Ctrl-C),
checkpoint first.

With checkpoint.dir set and checkpoint.save_on_signal=true (the default), the training loop runs inside
`StopOnSignal`: the handler of SIGTERM, SIGUSR1 and SIGINT only records the signal (a second Ctrl-C, more than
SAME_CTRL_C_S after the first, raises KeyboardInterrupt: stop at once, no save; pretrain_llama.py exits 130).
After every step all ranks all-reduce (MAX) what they recorded (`received`; training/agree.py, in the same
collective as the deadline's verdict), so they stop after the same step even
when the signal reached only some of them or reached them at different moments, and no rank waits in a collective
its peers never enter. The loop then saves
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
import time


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_STOPPED = 5  # pretrain_llama.py's exit status after a stop on signal
# A Ctrl-C reaches a rank twice: from the terminal (the whole foreground process group) and forwarded by torchrun.
# SIGINTs this close together are one Ctrl-C; a later one is a second Ctrl-C and stops at once (KeyboardInterrupt).
SAME_CTRL_C_S = 2.0


class StoppedBySignal(Exception):
    """The run stopped after `step` on a signal (signum 0: before the job's deadline, training/deadline.py); `saved`
    is the checkpoint written (None: checkpoint.dir unset)."""

    def __init__(self, signum: int, step: int, total: int, saved):
        self.signum, self.step, self.saved = signum, step, saved
        where = f"checkpoint {saved} saved" if saved is not None else "no checkpoint saved (checkpoint.dir is null)"
        why = f"by {signal.Signals(signum).name}" if signum else "before the job's deadline"
        super().__init__(f"stopped {why} after step {step} of {total}: {where}; exit code {EXIT_STOPPED}; relaunch "
                         f"the same command to resume from step {step}")


class StopOnSignal:
    """Records SIGTERM / SIGUSR1 / SIGINT while active (a context manager; the main thread only, where Python runs
    signal handlers) in `received` (0: none); the loop makes it every rank's with training/agree.py."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received = 0
        self._first_ctrl_c: float | None = None
        self._previous: dict = {}

    def _record(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_ctrl_c is None:
                self._first_ctrl_c = now
            elif now - self._first_ctrl_c > SAME_CTRL_C_S:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the save
        self.received = self.received or int(signum)

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


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
