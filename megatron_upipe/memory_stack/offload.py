"""The one road from device memory to host memory and back, with a ledger of the host bytes it holds.

Everything this project moves off the accelerator goes through a `HostOffloader`:

    handle = offloader.to_host(t)      # device tensor -> HostCopy (t itself may then be freed)
    t2 = offloader.to_device(handle)   # HostCopy -> a new tensor on t's device, equal to t bit for bit
    offloader.live_bytes, offloader.peak_bytes   # host bytes alive now / at most (a HostCopy frees when dropped)
    offloader.reserved_peak_bytes                # at most, as the host allocator holds them (pinned: power of 2)

Where the copy lives:
- CUDA tensor: a pinned host buffer while `pinned_budget_bytes` allows and pinning succeeds, else pageable memory.
  The device->host copy runs on a side stream (ordered after the producer by `wait_stream`, the source kept alive
  for the allocator by `record_stream`); `to_device` makes the current stream wait for that copy's event and copies
  back asynchronously. [Unverified: no GPU where this was written; the CUDA branch is `_cuda_to_host` /
  `_cuda_to_device` and nothing else.]
- CPU tensor (this project's GPU-less machines): a plain copy. "Host" and "device" are the same RAM there, so the
  copy is made with torch's dispatch modes switched off: a storage-tracking `PeakMemoryTracker` (device memory)
  then never counts host copies, exactly as it would not count them on a GPU. Fake tensors stay fake.

For the memory planner: the ledger is the host side; device memory is whatever its tracker sees. To simulate
without copying (e.g. at full scale under FakeTensorMode), swap in `SimulatedHostOffloader`, which keeps only shape,
dtype and device, counts the same bytes, and hands back an uninitialised tensor of the same shape in `to_device`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s elements (what a contiguous copy of it occupies)."""
    return t.numel() * t.element_size()


def pinned_block_bytes(nbytes: int) -> int:
    """What torch's CUDA caching host allocator reserves for a pinned tensor of `nbytes`: the next power of two
    (a 6.1 GB layer input of Llama3-8B at 6M tokens over 8 ranks takes an 8 GB pinned block)."""
    return 1 << max(nbytes - 1, 0).bit_length()


@dataclass
class HostLedger:
    live_bytes: int = 0  # host bytes held by HostCopy objects alive now (the tensors' own sizes)
    peak_bytes: int = 0
    reserved_bytes: int = 0  # what the host allocator holds for them: pinned blocks rounded up to a power of two
    reserved_peak_bytes: int = 0
    pinned_reserved_bytes: int = 0  # the pinned part of reserved_bytes (CUDA only)
    live_copies: int = 0
    total_copies: int = 0  # to_host calls since creation

    def add(self, nbytes: int, pinned: bool) -> None:
        reserved = pinned_block_bytes(nbytes) if pinned else nbytes
        self.live_bytes += nbytes
        self.reserved_bytes += reserved
        self.pinned_reserved_bytes += reserved if pinned else 0
        self.live_copies += 1
        self.total_copies += 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.reserved_peak_bytes = max(self.reserved_peak_bytes, self.reserved_bytes)

    def free(self, nbytes: int, pinned: bool) -> None:
        reserved = pinned_block_bytes(nbytes) if pinned else nbytes
        self.live_bytes -= nbytes
        self.reserved_bytes -= reserved
        self.pinned_reserved_bytes -= reserved if pinned else 0
        self.live_copies -= 1


class HostCopy:
    """A tensor's copy in host memory (or, simulated, only its description). Dropping it frees the ledger entry."""

    __slots__ = ("host", "shape", "dtype", "device", "nbytes", "pinned", "event", "__weakref__")

    def __init__(self, host, shape, dtype, device, nbytes, pinned=False, event=None):
        self.host, self.shape, self.dtype, self.device = host, shape, dtype, device
        self.nbytes, self.pinned, self.event = nbytes, pinned, event


class HostOffloader:
    """Copies tensors to host memory and back, counting the host bytes alive (see the module docstring)."""

    def __init__(self, pinned_budget_bytes: int | None = None) -> None:
        """pinned_budget_bytes: most pinned bytes (as reserved, see pinned_block_bytes) alive at once (None: no
        limit); copies beyond it go to pageable memory (synchronous, slower, no rounding)."""
        self.ledger = HostLedger()
        self.pinned_budget_bytes = pinned_budget_bytes
        self._stream = None  # CUDA side stream for device->host copies, made on first use

    @property
    def live_bytes(self) -> int:
        return self.ledger.live_bytes

    @property
    def peak_bytes(self) -> int:
        return self.ledger.peak_bytes

    @property
    def reserved_peak_bytes(self) -> int:
        return self.ledger.reserved_peak_bytes

    def reset_peak(self) -> None:
        self.ledger.peak_bytes = self.ledger.live_bytes
        self.ledger.reserved_peak_bytes = self.ledger.reserved_bytes

    def to_host(self, t: torch.Tensor) -> HostCopy:
        nbytes = storage_bytes(t)
        if t.device.type == "cuda":
            host, pinned, event = self._cuda_to_host(t, nbytes)
        else:
            with _disable_current_modes():  # host memory is not device memory: hide it from dispatch-mode trackers
                host = t.detach().clone(memory_format=torch.contiguous_format)
            pinned, event = False, None
        return self._register(HostCopy(host, t.shape, t.dtype, t.device, nbytes, pinned, event))

    def to_device(self, copy: HostCopy) -> torch.Tensor:
        if copy.device.type == "cuda":
            return self._cuda_to_device(copy)
        return copy.host.clone()  # a new device-side tensor: counted by a tracker like any activation

    def _register(self, copy: HostCopy) -> HostCopy:
        self.ledger.add(copy.nbytes, copy.pinned)
        weakref.finalize(copy, self.ledger.free, copy.nbytes, copy.pinned)
        return copy

    # --- CUDA (unverified here) ---------------------------------------------------------------------------------
    def _cuda_to_host(self, t: torch.Tensor, nbytes: int):
        pinned = (self.pinned_budget_bytes is None
                  or self.ledger.pinned_reserved_bytes + pinned_block_bytes(nbytes) <= self.pinned_budget_bytes)
        host = None
        if pinned:
            try:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            except RuntimeError:  # pinned memory exhausted: fall back to pageable
                pinned = False
        if host is None:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=t.device)
        self._stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully written
        with torch.cuda.stream(self._stream):
            host.copy_(t, non_blocking=pinned)
            event = torch.cuda.Event()
            event.record(self._stream)
        t.record_stream(self._stream)  # the allocator must not reuse t's memory before the copy is done
        return host, pinned, event

    def _cuda_to_device(self, copy: HostCopy) -> torch.Tensor:
        if copy.event is not None:
            torch.cuda.current_stream(copy.device).wait_event(copy.event)
        return copy.host.to(copy.device, non_blocking=copy.pinned)


class SimulatedHostOffloader(HostOffloader):
    """Same ledger, no data: for memory planning (fake tensors, meta shapes). Round trips lose the values."""

    def to_host(self, t: torch.Tensor) -> HostCopy:
        return self._register(HostCopy(None, t.shape, t.dtype, t.device, storage_bytes(t)))

    def to_device(self, copy: HostCopy) -> torch.Tensor:
        return torch.empty(copy.shape, dtype=copy.dtype, device=copy.device)
