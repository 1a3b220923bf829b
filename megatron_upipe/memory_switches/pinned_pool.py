"""One host buffer per rank, allocated once at its planned size and sliced into the offloaded tensors.

Why not `torch.empty(..., pin_memory=True)` per tensor: torch's pinned host allocator (CachingHostAllocator) rounds
every block up to a power of two and keeps freed blocks cached for the life of the process. A 6 GiB layer input of
Llama3-8B at 6M tokens over 8 ranks takes an 8 GiB block, so 32 of them pin 256 GiB per rank instead of 192. And a
single `torch.empty(n, pin_memory=True)` of the whole pool would be rounded the same way (192 GiB -> 256 GiB).

So a `HostPool` allocates `nbytes` of ordinary (pageable) host memory, exactly, and pins that range in place with
`cudaHostRegister` (torch.cuda.cudart(); unregistered when the pool is collected): no rounding, no allocator cache.
Where pinning is unavailable (no CUDA device: this project's CPU machines) or fails, the pool stays pageable and
says so in one logged line; device<->host copies from it are then synchronous.

`RangeAllocator` hands out byte ranges of the pool (first fit, ranges rounded up to ALIGN bytes, neighbours merged
on release). It holds offsets only, no memory, so the memory planner's simulated offloader runs the very same
allocator without a buffer. The ranges are never more than the pool: a request that does not fit returns None
and the caller copies that tensor elsewhere (offload.py: pageable, logged once). The pool never grows.

Reuse on CUDA: a range may be handed out again only after the device copies that read it are done. The reader
records a CUDA event per copy (`Range.fences`); whoever takes an overlapping range next makes its copy stream wait
for those events (`HostPool.fences_over`), on the GPU, without a host synchronisation. [Unverified: no GPU where
this was written; the CUDA-only lines are `_pin`, `_unpin` and the event handling in offload.py.]
"""

from __future__ import annotations

import bisect
import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import _disable_current_modes

log = logging.getLogger(__name__)

ALIGN = 512  # bytes: every range starts at a multiple (any dtype's element size divides it; DMA-friendly)


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN: what one range of the pool takes."""
    return -(-nbytes // ALIGN) * ALIGN


@dataclass
class Range:
    offset: int
    nbytes: int  # the tensor's bytes; the range itself is aligned(nbytes)
    fences: list = field(default_factory=list)  # CUDA events of device copies still reading it


class RangeAllocator:
    """First-fit byte ranges of a fixed capacity; offsets only (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"pool capacity {capacity} must be >= 0")
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []  # sorted, disjoint, merged
        self.used_bytes = 0  # aligned bytes handed out now
        self.peak_used_bytes = 0

    def take(self, nbytes: int) -> int | None:
        """Offset of a free range of aligned(nbytes) bytes, or None when no free range is that large."""
        size = aligned(nbytes)
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                self.used_bytes += size
                self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
                return off
        return None

    def give(self, offset: int, nbytes: int) -> None:
        """Return the range taken at `offset` for `nbytes`."""
        size = aligned(nbytes)
        i = bisect.bisect_left(self._free, (offset, 0))
        if (i < len(self._free) and self._free[i][0] < offset + size) or \
                (i > 0 and sum(self._free[i - 1]) > offset) or offset + size > self.capacity:
            raise RuntimeError(f"range [{offset}, {offset + size}) was not taken from this pool")
        start, end = offset, offset + size
        if i < len(self._free) and self._free[i][0] == end:  # merge with the next free range
            end = sum(self._free.pop(i))
        if i > 0 and sum(self._free[i - 1]) == start:  # and with the previous one
            start = self._free[i - 1][0]
            self._free[i - 1] = (start, end - start)
        else:
            self._free.insert(i, (start, end - start))
        self.used_bytes -= size

    @property
    def free_ranges(self) -> list[tuple[int, int]]:
        return list(self._free)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _code(err) -> int:
    return int(getattr(err, "value", err))


def _drain_cuda_error() -> None:
    """A failed cudaHostRegister can leave an error that the next CUDA call would report as its own: let a trivial
    kernel surface it and drop it."""
    try:
        (torch.ones(1, dtype=torch.uint8, device="cuda") + 1).cpu()
    except RuntimeError:
        pass


def _pin(buffer: torch.Tensor) -> str | None:
    """Register `buffer`'s memory with CUDA (page-locked, in place); None on success, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device (pinning needs one)"
    try:
        err = _code(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    except (RuntimeError, AssertionError, AttributeError) as e:  # CUDA not initialisable, or no cudart bindings
        return f"cudaHostRegister unavailable ({e})"
    if err != 0:
        _drain_cuda_error()
        return f"cudaHostRegister failed (cudaError {err}; page-locked memory limit reached on this node?)"
    return None


def _unpin(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class HostPool:
    """`nbytes` of host memory, pinned in place when possible, sliced by a RangeAllocator."""

    def __init__(self, nbytes: int, pin: bool = True, what: str = "offload pool") -> None:
        self.allocator = RangeAllocator(nbytes)
        with _disable_current_modes():  # host memory: never seen by a device tracker, never a fake tensor
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        self.pinned = False
        self._fences: list[tuple[int, int, object]] = []  # (start, end, CUDA event) of released ranges
        why = "pinning switched off" if not pin else (_pin(self.buffer) if nbytes else None)
        if why is None and nbytes:
            self.pinned = True
            weakref.finalize(self, _unpin, self.buffer)  # the buffer is freed after it is unregistered
        elif nbytes:
            log.warning(f"host {what} of {_size(nbytes)} is pageable: {why}; device<->host copies from it are "
                        f"synchronous")

    @property
    def nbytes(self) -> int:
        return self.allocator.capacity

    def take(self, nbytes: int, dtype: torch.dtype, shape) -> tuple[Range, torch.Tensor] | None:
        """A range of `nbytes` and the tensor of `dtype`/`shape` over it, or None when the pool has no room."""
        offset = self.allocator.take(nbytes)
        if offset is None:
            return None
        with _disable_current_modes():
            view = self.buffer[offset:offset + nbytes].view(dtype).view(shape)
        return Range(offset, nbytes), view

    def give(self, r: Range) -> None:
        self.allocator.give(r.offset, r.nbytes)
        if r.fences:
            end = r.offset + aligned(r.nbytes)
            self._fences += [(r.offset, end, ev) for ev in r.fences]

    def fences_over(self, r: Range) -> list:
        """Events of earlier device reads of any byte of `r` that may still be running (finished ones dropped)."""
        self._fences = [f for f in self._fences if not f[2].query()]
        end = r.offset + aligned(r.nbytes)
        return [ev for start, stop, ev in self._fences if start < end and r.offset < stop]
