"""The one road from device memory to host memory and back, with a ledger of the host bytes it holds.

Everything this project moves off the accelerator goes through a `HostOffloader`:

    handle = offloader.to_host(t)      # device tensor -> HostCopy (t itself may then be freed)
    t2 = offloader.to_device(handle)   # HostCopy -> a new tensor on t's device, equal to t bit for bit
    offloader.live_bytes, offloader.peak_bytes   # host bytes alive now / at most (a HostCopy frees when dropped)
    offloader.reserved_peak_bytes                # at most, as allocated: the whole pool, plus any copy beside it
    offloader.prefetch(handle)         # start bringing it back now; the next to_device(handle) returns that tensor

Where the copy lives:
- `HostOffloader(pool_bytes=N)` (what training builds, N planned by host_budget.offload_pool_bytes): a range of one
  host buffer of exactly N bytes, allocated at construction, pinned in place on CUDA (pinned_pool.HostPool: no
  power-of-two rounding, no cached blocks; pageable with one logged line where pinning is unavailable or fails).
  Freed ranges are reused by the next copies; the pool never grows. A tensor that finds no room (the plan missed
  it) is copied to pageable memory beside the pool, logged once and counted in `ledger.pool_misses`.
- `HostOffloader()` (no pool): one host allocation per tensor, pinned through torch's caching host allocator on
  CUDA (each block a power of two, see pinned_block_bytes). Kept as the reference the pool is tested against.
- CUDA tensor: the device->host copy runs on a side stream (ordered after the producer by `wait_stream`, the
  source kept alive for the allocator by `record_stream`, and after the device reads of a reused pool range by
  their events); `to_device` makes the current stream wait for that copy's event and copies back asynchronously
  from pinned memory. `prefetch` makes the same copy back on a second side stream, ordered after the current
  stream's work so far and after the device->host copy; `to_device` then makes the current stream wait for it.
  [Unverified: no GPU where this was written; the CUDA branch is `_cuda_to_host` / `_cuda_to_device` /
  `_cuda_prefetch` and nothing else.]
- CPU tensor (this project's GPU-less machines): a plain copy into the pool range (or a clone). "Host" and "device"
  are the same RAM there, so the copy is made with torch's dispatch modes switched off: a storage-tracking
  `PeakMemoryTracker` (device memory) then never counts host copies, exactly as it would not count them on a GPU.
  Fake tensors stay fake (a fake copy; with a pool its range is still taken, so the ledger is the same).
  `prefetch` makes the device copy at once, so a tracker sees it alive from then on, as it would be on a GPU.

Prefetch (`HostOffloader(prefetch_ahead=True)`, memory.offload_prefetch): the user of the offloader (here
checkpoint_offload.py) calls `prefetch` on the copy it will need next, so the copy back overlaps other work; the
device holds that copy from the prefetch on: one more tensor alive, which the memory planner sees because the
simulated offloader allocates it at the same moment.

Disk tier (`HostOffloader(disk_dir=D, disk_layers=N)`, memory.offload_disk_dir / offload_disk_layers): `to_host(t,
disk=True)` writes the tensor's bytes to an unlinked file under D (disk_file.py) instead of keeping them in host
memory, and `to_device` / `prefetch` read them back. A CUDA tensor is staged through a pool range (the pool is
empty when the first layers' inputs go out and when they come back last, so the plan needs no extra range): copied
to it on the side stream, waited for, written; read into a range, then copied up as any host copy (the range
fenced until that copy is done). The write and the read block the calling thread (seconds per layer input at 8M
tokens, minutes of attention per layer: priced on the critical path by the step-time model). The ledger counts
the bytes on disk (`disk_live_bytes`, `disk_peak_bytes`) and the bytes written and read. checkpoint_offload.py
sends the first N layer inputs of each forward there: they are the ones kept longest.

For the memory planner: the ledger is the host side; device memory is whatever its tracker sees. To simulate
without copying (e.g. at full scale under FakeTensorMode), swap in `SimulatedHostOffloader(pool_bytes=N)`, which
keeps only shape, dtype and device, runs the same range allocator over no memory, counts the same bytes (the pool
as reserved from the start), and hands back an uninitialised tensor of the same shape in `to_device`.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from megatron_upipe.memory_switches.disk_file import DiskFile
from megatron_upipe.memory_switches.pinned_pool import HostPool, Range, RangeAllocator, _size

log = logging.getLogger(__name__)


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s elements (what a contiguous copy of it occupies)."""
    return t.numel() * t.element_size()


def pinned_block_bytes(nbytes: int) -> int:
    """What torch's CUDA caching host allocator reserves for a pinned tensor of `nbytes`: the next power of two
    (a 6.1 GB layer input of Llama3-8B at 6M tokens over 8 ranks takes an 8 GB pinned block)."""
    return 1 << max(nbytes - 1, 0).bit_length()


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or t.device.type == "meta"


def _on_real_cuda(copy: "HostCopy") -> bool:
    return copy.device.type == "cuda" and copy.host is not None and not _is_fake(copy.host)


@dataclass
class HostLedger:
    live_bytes: int = 0  # host bytes held by HostCopy objects alive now (the tensors' own sizes)
    peak_bytes: int = 0
    reserved_bytes: int = 0  # host memory held for them: the pool (all of it, from the start) + copies beside it
    reserved_peak_bytes: int = 0
    live_copies: int = 0
    total_copies: int = 0  # to_host calls since creation
    pool_misses: int = 0  # copies that found no room in the pool (and went to pageable memory beside it)
    returned_bytes: int = 0  # bytes copied back to the device (to_device or prefetch) since creation
    disk_live_bytes: int = 0  # bytes of the copies on disk alive now
    disk_peak_bytes: int = 0
    disk_written_bytes: int = 0  # since creation
    disk_read_bytes: int = 0

    def disk_add(self, nbytes: int) -> None:
        self.disk_live_bytes += nbytes
        self.disk_written_bytes += nbytes
        self.disk_peak_bytes = max(self.disk_peak_bytes, self.disk_live_bytes)

    def reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.reserved_peak_bytes = max(self.reserved_peak_bytes, self.reserved_bytes)

    def add(self, nbytes: int, reserved: int) -> None:
        self.live_bytes += nbytes
        self.live_copies += 1
        self.total_copies += 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.reserve(reserved)

    def free(self, nbytes: int, reserved: int) -> None:
        self.live_bytes -= nbytes
        self.reserved_bytes -= reserved
        self.live_copies -= 1


class HostCopy:
    """A tensor's copy in host memory (or, simulated, only its description). Dropping it frees the ledger entry
    and its pool range."""

    __slots__ = ("host", "shape", "dtype", "device", "nbytes", "pinned", "event", "slot", "prefetched", "before",
                 "disk", "__weakref__")

    def __init__(self, host, shape, dtype, device, nbytes, pinned=False, event=None, slot: Range | None = None):
        self.host, self.shape, self.dtype, self.device = host, shape, dtype, device
        self.nbytes, self.pinned, self.event, self.slot = nbytes, pinned, event, slot
        self.prefetched = None  # (device tensor, CUDA event or None) made by HostOffloader.prefetch, until used
        self.before = None  # weakref to the copy its user needs next (checkpoint_offload: the previous layer's)
        self.disk = None  # (DiskFile or None when simulated,) for a copy on the disk tier; host is then None


class _OffsetsOnly:
    """A HostPool's bookkeeping without its memory (SimulatedHostOffloader): the same allocator, no buffer."""

    pinned = False

    def __init__(self, nbytes: int) -> None:
        self.allocator = RangeAllocator(nbytes)

    @property
    def nbytes(self) -> int:
        return self.allocator.capacity

    def take(self, nbytes: int, dtype, shape):
        offset = self.allocator.take(nbytes)
        return None if offset is None else (Range(offset, nbytes), None)

    def give(self, r: Range) -> None:
        self.allocator.give(r.offset, r.nbytes)


class HostOffloader:
    """Copies tensors to host memory and back, counting the host bytes alive (see the module docstring)."""

    def __init__(self, pool_bytes: int | None = None, pin: bool = True, prefetch_ahead: bool = False,
                 disk_dir: str | None = None, disk_layers: int = 0) -> None:
        """pool_bytes: the host bytes of the offloaded tensors alive at once (host_budget.offload_pool_bytes), held
        as one buffer allocated now; None: one host allocation per copy (the unpooled reference). pin: pin the
        pool (CUDA only; False keeps it pageable). prefetch_ahead: the offloader's user should prefetch each copy
        one use ahead (memory.offload_prefetch; read by checkpoint_offload.py). disk_dir: where `to_host(t,
        disk=True)` writes; disk_layers: how many layer inputs of each forward its user sends there
        (memory.offload_disk_layers; read by checkpoint_offload.py)."""
        if disk_layers and disk_dir is None:
            raise ValueError(f"disk_layers={disk_layers} needs disk_dir (memory.offload_disk_dir)")
        self.disk_dir, self.disk_layers = disk_dir, disk_layers
        self.ledger = HostLedger()
        self.pool = None if pool_bytes is None else self._make_pool(pool_bytes, pin)
        if self.pool is not None:
            self.ledger.reserve(self.pool.nbytes)
        self.prefetch_ahead = prefetch_ahead
        self._stream = None  # CUDA side stream for device->host copies, made on first use
        self._h2d_stream = None  # CUDA side stream for prefetched host->device copies, made on first use

    def _make_pool(self, nbytes: int, pin: bool):
        return HostPool(nbytes, pin=pin)

    @property
    def live_bytes(self) -> int:
        return self.ledger.live_bytes

    @property
    def peak_bytes(self) -> int:
        return self.ledger.peak_bytes

    @property
    def reserved_peak_bytes(self) -> int:
        return self.ledger.reserved_peak_bytes

    @property
    def pool_bytes(self) -> int:
        return 0 if self.pool is None else self.pool.nbytes

    def reset_peak(self) -> None:
        self.ledger.peak_bytes = self.ledger.live_bytes
        self.ledger.reserved_peak_bytes = self.ledger.reserved_bytes

    def to_host(self, t: torch.Tensor, disk: bool = False) -> HostCopy:
        """t's copy in host memory, or with `disk` in a file of the disk tier."""
        if disk:
            return self._to_disk(t)
        nbytes = storage_bytes(t)
        slot, host = self._take(nbytes, t.dtype, t.shape)
        if _is_fake(t):  # shapes only (planning): a fake copy; a pool range is still taken above
            with _disable_current_modes():
                host = t.detach().clone(memory_format=torch.contiguous_format)
            pinned, event = False, None
        elif t.device.type == "cuda":
            host, pinned, event = self._cuda_to_host(t, nbytes, host, slot)
        else:
            with _disable_current_modes():  # host memory is not device memory: hide it from dispatch-mode trackers
                if host is None:
                    host = t.detach().clone(memory_format=torch.contiguous_format)
                else:
                    host.copy_(t.detach())
            pinned, event = False, None
        reserved = 0 if slot is not None else pinned_block_bytes(nbytes) if pinned else nbytes
        return self._register(HostCopy(host, t.shape, t.dtype, t.device, nbytes, pinned, event, slot), reserved)

    def to_device(self, copy: HostCopy) -> torch.Tensor:
        if copy.disk is not None and copy.prefetched is None:
            out, _ = self._from_disk(copy, prefetch=False)
            return out
        if copy.prefetched is not None:
            (out, event), copy.prefetched = copy.prefetched, None
            if event is not None:  # CUDA: the prefetch stream's copy is done before the current stream reads it
                stream = torch.cuda.current_stream(copy.device)
                stream.wait_event(event)
                out.record_stream(stream)  # allocated on the prefetch stream, read and freed on this one
            return out
        self.ledger.returned_bytes += copy.nbytes
        if _on_real_cuda(copy):
            return self._cuda_to_device(copy)
        return self._plain_to_device(copy)

    def prefetch(self, copy: HostCopy) -> None:
        """Start bringing `copy` back to its device now; the next `to_device(copy)` returns that tensor. The
        device tensor exists from now on (a tracker counts it from here). A second call before the use is a no-op."""
        if copy.prefetched is not None:
            return
        if copy.disk is not None:
            copy.prefetched = self._from_disk(copy, prefetch=True)
            return
        self.ledger.returned_bytes += copy.nbytes
        if _on_real_cuda(copy):
            copy.prefetched = self._cuda_prefetch(copy)
        else:
            copy.prefetched = (self._plain_to_device(copy), None)

    def _plain_to_device(self, copy: HostCopy) -> torch.Tensor:
        return copy.host.clone()  # a new device-side tensor: counted by a tracker like any activation

    # --- disk tier ----------------------------------------------------------------------------------------------
    def _to_disk(self, t: torch.Tensor) -> HostCopy:
        nbytes = storage_bytes(t)
        copy = HostCopy(None, t.shape, t.dtype, t.device, nbytes)
        copy.disk = (self._write_disk(t),)
        self.ledger.disk_add(nbytes)
        weakref.finalize(copy, self._release_disk, nbytes, copy.disk[0])
        return copy

    def _write_disk(self, t: torch.Tensor) -> DiskFile | None:
        """A file holding t's bytes (None for a fake tensor: planning)."""
        if self.disk_dir is None:
            raise ValueError("to_host(disk=True) needs the offloader's disk_dir (memory.offload_disk_dir)")
        if _is_fake(t):
            return None
        f = DiskFile(self.disk_dir)
        if t.device.type == "cuda":  # staged through a pool range (or pinned / pageable memory beside the pool)
            staged = self.to_host(t)
            if staged.event is not None:
                staged.event.synchronize()
            f.write(staged.host)
            del staged  # its range goes back to the pool
        else:
            with _disable_current_modes():
                f.write(t.detach().contiguous())
        return f

    def _release_disk(self, nbytes: int, f: DiskFile | None) -> None:
        self.ledger.disk_live_bytes -= nbytes
        if f is not None:
            f.close()

    def _from_disk(self, copy: HostCopy, prefetch: bool):
        """A disk copy back on its device: (tensor, CUDA event when prefetched on the side stream, else None)."""
        self.ledger.returned_bytes += copy.nbytes
        self.ledger.disk_read_bytes += copy.nbytes
        f = copy.disk[0]
        if f is None:  # planning: shapes only
            return torch.empty(copy.shape, dtype=copy.dtype, device=copy.device), None
        if copy.device.type != "cuda":
            out = torch.empty(copy.shape, dtype=copy.dtype, device=copy.device)  # counted like any device tensor
            with _disable_current_modes():
                f.read_into(out)
            return out, None
        slot, host = self._take(copy.nbytes, copy.dtype, copy.shape)
        pinned = slot is not None and self.pool.pinned
        if host is None:
            host = torch.empty(copy.shape, dtype=copy.dtype, device="cpu")
        f.read_into(host)
        staged = self._register(HostCopy(host, copy.shape, copy.dtype, copy.device, copy.nbytes, pinned, None, slot),
                                0 if slot is not None else copy.nbytes)
        if prefetch:
            return self._cuda_prefetch(staged)
        return self._cuda_to_device(staged), None  # the range is fenced until this copy is done

    def _take(self, nbytes: int, dtype: torch.dtype, shape):
        """(pool range, tensor over it) for a copy of a tensor of `dtype`/`shape`, or (None, None): no pool, or no
        room in it."""
        if self.pool is None:
            return None, None
        got = self.pool.take(nbytes, dtype, shape)
        if got is None:
            self.ledger.pool_misses += 1
            if self.ledger.pool_misses == 1:
                log.warning(f"host offload pool ({_size(self.pool.nbytes)}, {self.ledger.live_copies} "
                            f"copies alive) has no room for a {tuple(shape)} {dtype} tensor: it and any later "
                            f"misses go to pageable memory beside the pool (the pool's plan, "
                            f"host_budget.offload_pool_bytes, missed them)")
            return None, None
        return got

    def _register(self, copy: HostCopy, reserved: int) -> HostCopy:
        self.ledger.add(copy.nbytes, reserved)
        weakref.finalize(copy, self._release, copy.nbytes, reserved, copy.slot)
        return copy

    def _release(self, nbytes: int, reserved: int, slot: Range | None) -> None:
        self.ledger.free(nbytes, reserved)
        if slot is not None:
            self.pool.give(slot)

    # --- CUDA (unverified here) ---------------------------------------------------------------------------------
    def _cuda_to_host(self, t: torch.Tensor, nbytes: int, host: torch.Tensor | None, slot: Range | None):
        if host is not None:  # a pool range
            pinned = self.pool.pinned
        elif self.pool is None:  # unpooled: torch's caching host allocator, else pageable
            try:
                host, pinned = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True), True
            except RuntimeError:  # pinned memory exhausted
                host, pinned = None, False
        else:  # the pool had no room (logged): pageable beside it
            pinned = False
        if host is None:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=t.device)
        self._stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully written
        if slot is not None:
            for ev in self.pool.fences_over(slot):  # device reads of this range's previous tensors are done
                self._stream.wait_event(ev)
        with torch.cuda.stream(self._stream):
            host.copy_(t, non_blocking=pinned)
            event = torch.cuda.Event()
            event.record(self._stream)
        t.record_stream(self._stream)  # the allocator must not reuse t's memory before the copy is done
        return host, pinned, event

    def _cuda_to_device(self, copy: HostCopy) -> torch.Tensor:
        stream = torch.cuda.current_stream(copy.device)
        if copy.event is not None:
            stream.wait_event(copy.event)
        out = copy.host.to(copy.device, non_blocking=copy.pinned)
        if copy.slot is not None and copy.pinned:  # the range is not to be rewritten before this read is done
            done = torch.cuda.Event()
            done.record(stream)
            copy.slot.fences.append(done)
        return out

    def _cuda_prefetch(self, copy: HostCopy):
        """The copy back on the prefetch stream: (device tensor, event recorded after it)."""
        if self._h2d_stream is None:
            self._h2d_stream = torch.cuda.Stream(device=copy.device)
        stream = self._h2d_stream
        stream.wait_stream(torch.cuda.current_stream(copy.device))  # in order with the work issued so far
        if copy.event is not None:
            stream.wait_event(copy.event)  # the device->host copy is done
        with torch.cuda.stream(stream):
            out = copy.host.to(copy.device, non_blocking=copy.pinned)
            done = torch.cuda.Event()
            done.record(stream)
        if copy.slot is not None and copy.pinned:
            copy.slot.fences.append(done)
        return out, done


class SimulatedHostOffloader(HostOffloader):
    """Same ledger and pool allocator, no data: for memory planning (fake tensors, meta shapes). Round trips lose
    the values."""

    def _make_pool(self, nbytes: int, pin: bool):
        return _OffsetsOnly(nbytes)

    def to_host(self, t: torch.Tensor, disk: bool = False) -> HostCopy:
        if disk:
            return self._to_disk(t)
        nbytes = storage_bytes(t)
        slot, _ = self._take(nbytes, t.dtype, t.shape)
        return self._register(HostCopy(None, t.shape, t.dtype, t.device, nbytes, slot=slot),
                              0 if slot is not None else nbytes)

    def _write_disk(self, t: torch.Tensor) -> None:
        return None

    def _plain_to_device(self, copy: HostCopy) -> torch.Tensor:
        return torch.empty(copy.shape, dtype=copy.dtype, device=copy.device)
