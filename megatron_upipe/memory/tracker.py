"""Byte-exact peak tracking of live tensor storage, on CPU, CUDA or fake tensors.

`PeakMemoryTracker` is a `TorchDispatchMode`: after every op it registers each output storage it has not seen
and adds `untyped_storage().nbytes()`; a `weakref.finalize` on the storage subtracts it when the storage dies.
Views, in-place ops and `out=` writes into existing buffers add nothing (an output that shares an input's storage
is never counted); storages created before the mode starts are invisible (the inputs of the measured region) unless
passed to `track`, and so is memory a kernel allocates internally (model it).
See ../shared/docs/measuring-memory.md (on these machines) for why process RSS is useless for this.

    with PeakMemoryTracker() as mem:
        loss = f(x); loss.backward()
    mem.peak_bytes, mem.live_bytes
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakMemoryTracker(TorchDispatchMode):
    def __init__(self, record_timeline: bool = False):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seen: set[int] = set()
        self.timeline: list[tuple[str, int, int]] | None = [] if record_timeline else None  # (op, delta, live)

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live_bytes -= nbytes
        if self.timeline is not None:
            self.timeline.append(("free", -nbytes, self.live_bytes))

    def track(self, t: torch.Tensor, name: str = "external") -> None:
        """Count a tensor's storage from now on (e.g. one made before the tracker started)."""
        st = t.untyped_storage()
        key = st._cdata
        if key in self._seen:
            return
        nbytes = st.nbytes()
        self._seen.add(key)
        weakref.finalize(st, self._free, key, nbytes)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.timeline is not None:
            self.timeline.append((name, nbytes, self.live_bytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # An output sharing an input's storage (a view, an in-place or out= op) is not a new allocation, even when
        # that input was made before tracking started.
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self.track(t, str(func))
        return out

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes


@contextmanager
def track_peak(record_timeline: bool = False):
    """Context manager yielding a running PeakMemoryTracker."""
    tracker = PeakMemoryTracker(record_timeline)
    with tracker:
        yield tracker
