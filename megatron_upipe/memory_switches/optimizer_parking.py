"""The optimizer's own tensors parked in host memory while the forward/backward runs
(`memory.offload_optimizer_states`).

Adam's two moments and, in 16-bit training, the fp32 main weights are read and written by the optimizer step only:
from the end of one step's update to the start of the next one's, nothing else touches them (the forward and
backward read the compute weights and write the gradient buffers; a checkpoint save, an evaluation and a resume run
between steps, while they are on the device). So `ParkedStates` copies each of their storages to host memory when
the forward/backward begins, frees the device storage in place (`untyped_storage().resize_(0)`: the tensors, their
views and the optimizer's references stay valid, only their bytes go), and at its end re-allocates the storage and
copies the bytes back, before the gradients are clipped and the step updates. The step then runs on the device on
the very bytes it left: the same results bit for bit. What is parked is each storage the optimizer holds that no
compute weight and no gradient buffer shares (megatron-core DDP's fp32 main shards, Megatron-FSDP's fp32 main
weight buffers, the optimizer state's tensors); the compute weights and gradients stay.

Device: the parked bytes are absent from the forward/backward's peak and come back after it (the activations are
freed by then), which the planner simulates the same way. Host: one buffer per storage, allocated at its first
parking and kept (pinned in place with cudaHostRegister when a CUDA device is present, as the offload pool is), so
the host holds exactly the parked bytes for the whole run (`host_budget.optimizer_states_bytes`). Time: every step
copies the parked bytes to the host and back on the current stream, in order with the step's kernels (no
synchronisation: the host buffers are only read by the copies back; the device block freed is reused by later
allocations of the same stream only, after the copy); the step-time model prices both directions at the host link's
bandwidth, on the critical path. Adam's moments exist from the first optimizer step on, so the first step parks
only the main weights.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from megatron_upipe.memory_switches.pinned_pool import _pin, _unpin
from megatron_upipe.memory_switches.sharding import fsdp_state_tensors, is_fully_sharded, local_part

log = logging.getLogger(__name__)


def torch_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron-core's (possibly chained, possibly wrapping) optimizer."""
    return [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of t's whole storage in t's dtype ([storage bytes / element size])."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)


def optimizer_own_tensors(optimizer, keep: Iterable[torch.Tensor], extra: Iterable[torch.Tensor] = ()
                          ) -> list[torch.Tensor]:
    """One whole-storage view per storage that only the optimizer holds: its parameters' local tensors (fp32 main
    weights in 16-bit training) and its state's tensors, plus `extra`, minus every storage one of `keep` (the
    compute weights and gradient buffers) lives in."""
    shared = {local_part(t).untyped_storage()._cdata for t in keep}
    found: dict[int, torch.Tensor] = {}
    candidates = list(extra)
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                candidates.append(p)
                candidates += [v for v in inner.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.dim()]
    for t in candidates:
        local = local_part(t)
        key = local.untyped_storage()._cdata
        if key not in shared and key not in found and local.untyped_storage().nbytes():
            found[key] = _whole(local)
    return list(found.values())


class ParkedStates:
    """Parks the storages `tensors()` names in host memory (module docstring). `copy=False` only frees and
    re-allocates them (the planner's simulation on fake tensors: no bytes to keep); `on_resize(t)` is called after
    each storage changes size (a memory tracker following them)."""

    def __init__(self, tensors: Callable[[], list[torch.Tensor]], *, copy: bool = True, pin: bool = False) -> None:
        self.tensors, self.copy = tensors, copy
        self._host: dict[int, torch.Tensor] = {}  # storage key -> its host buffer (uint8, the storage's bytes)
        self.pinned = pin  # until a pinning fails (then every buffer is pageable and copies are synchronous)
        self._parked: list[tuple[torch.Tensor, int]] = []  # (whole-storage view, bytes) parked now

    def _host_buffer(self, key: int, nbytes: int) -> torch.Tensor:
        """The host buffer of storage `key` (made at its first parking), pinned in place if it can be."""
        buffer = self._host.get(key)
        if buffer is None or buffer.numel() != nbytes:
            with _disable_current_modes():  # host memory: never seen by a device tracker, never a fake tensor
                buffer = self._host[key] = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
            why = _pin(buffer) if self.pinned else None
            if self.pinned and why is None:
                weakref.finalize(self, _unpin, buffer)  # unregistered before it is freed
            elif self.pinned:
                self.pinned = False
                log.warning(f"host buffers of the parked optimizer states are pageable: {why}; their copies are "
                            f"synchronous")
        return buffer

    @property
    def parked_bytes(self) -> int:
        """Bytes parked now (0 when on the device)."""
        return sum(n for _, n in self._parked)

    @property
    def device_bytes(self) -> int:
        """Bytes the parked storages hold on the device now (0 while parked)."""
        return sum(t.untyped_storage().nbytes() for t, _ in self._parked)

    def park(self, on_resize: Callable[[torch.Tensor], None] | None = None) -> int:
        """Copy each storage to the host and free it on the device; returns the bytes parked."""
        if self._parked:
            raise RuntimeError("optimizer states are parked already: unpark them before parking again")
        for t in self.tensors():
            nbytes = t.untyped_storage().nbytes()
            if self.copy:
                host = self._host_buffer(t.untyped_storage()._cdata, nbytes)
                host.view(t.dtype).copy_(t, non_blocking=self.pinned)
            t.untyped_storage().resize_(0)
            self._parked.append((t, nbytes))
            if on_resize is not None:
                on_resize(t)
        return self.parked_bytes

    def unpark(self, on_resize: Callable[[torch.Tensor], None] | None = None) -> None:
        """Re-allocate each parked storage on the device and copy its bytes back."""
        parked, self._parked = self._parked, []
        for t, nbytes in parked:
            t.untyped_storage().resize_(nbytes)
            if on_resize is not None:
                on_resize(t)
            if self.copy:
                t.copy_(self._host[t.untyped_storage()._cdata].view(t.dtype), non_blocking=self.pinned)


def compute_tensors(wrapped, model: torch.nn.Module) -> list[torch.Tensor]:
    """What the forward/backward reads or writes of the model states, never parked: megatron-core DDP's parameters
    and gradient buffers; Megatron-FSDP's compute-weight shards and gradient buffers (its modules' parameters point
    at the fp32 main weight buffer until the first optimizer step, at the compute weights after it: the main weights
    are the optimizer's either way)."""
    if is_fully_sharded(wrapped):
        return [t for kind, t in fsdp_state_tensors(wrapped) if kind in ("params", "main_grads")]
    buffers = [*getattr(wrapped, "buffers", []), *getattr(wrapped, "expert_parallel_buffers", [])]
    return [*model.parameters(), *(b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None)]


def for_optimizer(wrapped, model: torch.nn.Module, optimizer, *, copy: bool = True, pin: bool = False,
                  extra: Iterable[torch.Tensor] = ()) -> ParkedStates:
    """The ParkedStates of `optimizer` over the wrapped stage (`model` its unwrapped module): the storages are found
    again at each parking, so Adam's moments join once its first step has made them."""
    keep = compute_tensors(wrapped, model)
    extra = list(extra)
    if is_fully_sharded(wrapped):  # the fp32 main weight buffers
        extra += [t for kind, t in fsdp_state_tensors(wrapped) if kind == "main_params"]
    return ParkedStates(lambda: optimizer_own_tensors(optimizer, keep, extra), copy=copy, pin=pin)


@contextmanager
def parked(states: ParkedStates | None, on_resize: Callable[[torch.Tensor], None] | None = None):
    """`states` parked inside the block (nothing when None), back on the device when it ends, raised or not."""
    if states is None:
        yield
        return
    states.park(on_resize)
    try:
        yield
    finally:
        states.unpark(on_resize)
