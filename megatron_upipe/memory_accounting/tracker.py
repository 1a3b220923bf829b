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

With `classify` (a function of the allocating op, called at allocation time; it may inspect the Python stack),
live bytes are also kept per category and `peak_breakdown` holds the categories' bytes at the peak.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def tensors_in(tree) -> list:
    """The tensors in an op's arguments or outputs (nested lists, tuples, dicts): pytree's tensor leaves, without
    pytree's cost (a dispatch mode sees every op)."""
    found, todo = [], [tree]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            todo.extend(reversed(x))
        elif isinstance(x, dict):
            todo.extend(reversed(list(x.values())))
    return found


class PeakMemoryTracker(TorchDispatchMode):
    def __init__(self, record_timeline: bool = False, classify: Callable[[object], str] | None = None):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seen: dict[int, str] = {}  # storage key -> category
        self.timeline: list[tuple[str, int, int]] | None = [] if record_timeline else None  # (op, delta, live)
        self.classify = classify
        self.live_by_category: dict[str, int] = defaultdict(int)
        self.peak_breakdown: dict[str, int] = {}

    def _free(self, key: int, nbytes: int) -> None:
        category = self._seen.pop(key, "all")
        self.live_bytes -= nbytes
        self.live_by_category[category] -= nbytes
        if self.timeline is not None:
            self.timeline.append(("free", -nbytes, self.live_bytes))

    def track(self, t: torch.Tensor, name: str = "external", category: str | None = None) -> None:
        """Count a tensor's storage from now on (e.g. one made before the tracker started)."""
        st = t.untyped_storage()
        key = st._cdata
        if key in self._seen:
            return
        nbytes = st.nbytes()
        if category is None:
            category = self.classify(name) if self.classify is not None else "all"
        self._seen[key] = category
        weakref.finalize(st, self._free, key, nbytes)
        self.live_bytes += nbytes
        self.live_by_category[category] += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            if self.classify is not None:
                self.peak_breakdown = {k: v for k, v in self.live_by_category.items() if v}
        if self.timeline is not None:
            self.timeline.append((str(name), nbytes, self.live_bytes))

    def retag(self, t: torch.Tensor, category: str) -> None:
        """Count a tracked tensor's storage under `category` from now on (registers it if it is new)."""
        st = t.untyped_storage()
        key = st._cdata
        old = self._seen.get(key)
        if old is None:
            self.track(t, category=category)
        elif old != category:
            self.live_by_category[old] -= st.nbytes()
            self.live_by_category[category] += st.nbytes()
            self._seen[key] = category

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.track_outputs(func, (args, kwargs), out)
        return out

    def track_outputs(self, func, inputs, out) -> None:
        """Count every tensor of `out` (op `func`'s result) whose storage no tensor in `inputs` (its arguments, any
        nesting) shares: an output sharing an input's storage (a view, an in-place or out= op) is not a new
        allocation, even when that input was made before tracking started. (Also called by the planner's fake
        mode, which feeds a tracker without running it as a mode.)"""
        outs = tensors_in(out)
        if outs:
            seen = {t.untyped_storage()._cdata for t in tensors_in(inputs)}
            for t in outs:
                if t.untyped_storage()._cdata not in seen:
                    self.track(t, func)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes


@contextmanager
def track_peak(record_timeline: bool = False):
    """Context manager yielding a running PeakMemoryTracker."""
    tracker = PeakMemoryTracker(record_timeline)
    with tracker:
        yield tracker
