"""Megatron-FSDP (megatron-core 0.19.2, megatron/core/distributed/fsdp/) for the memory planner and the tracker.

Two narrow run-time adaptations, each a context manager that restores what it replaced; megatron-core's files are
never edited.

`fake_tensor_fsdp()`: what stops Megatron-FSDP under FakeTensorMode + torch's fake process group, found by running
it (everything else - bucketing, DTensor shards, hooks, all-gather / reduce-scatter pipelines, the no-op CUDA
streams of compat/cpu.py - runs unchanged on fake tensors):
1. `MegatronFSDP.__init__` calls `module.to(device)`. torch moves a fake parameter with `swap_tensors`, which refuses
   any tensor that has a weakref, and fake tensors always have one ("_apply(): Couldn't swap
   VocabParallelEmbedding.weight ... Cannot swap t1 because it has weakref associated with it"; a plain nn.Linear
   fails the same way). Here the module is already on that device, so `.to` to the device its tensors are on is
   made the no-op it is meant to be.
2. The uneven-DTensor check of every parameter shard (`uneven_dtensor.gather_and_compute_chunk_metadata`) gathers
   shard shapes with `dist.all_gather_object`, which pickles into tensors and reads their sizes with `.item()`
   ("DataDependentOutputException: aten._local_scalar_dense"). The fake world's ranks are symmetric, so each rank's
   object is taken to be rank 0's (only checkpoint metadata depends on it; Megatron-FSDP itself skips the boundary
   check under the fake backend). `broadcast_object_list` (TP RNG sync, source rank 0) keeps rank 0's objects.
3. The all-gather / reduce-scatter buckets are issued inside torch's `_coalescing_manager`, whose coalesced c10d
   ops have no fake implementation; they are issued one by one (same buffers, same memory).

`gathers_complete_in_block()` (CPU runs only: compat/cpu.py installs it): Megatron-FSDP issues each unit's
parameter all-gathers, prefetches included, inside `_coalescing_manager(dp_group, async_ops=True)` and waits for them
before the unit computes. On gloo, runs with that asynchronous coalesced all-gather crashed a rank now and then (heap
corruption or SIGSEGV), measured on a tiny 2-rank run with memory.shard_model_states=true: 1 run in 20 with fresh
processes each; 5 of 7 series of runs in one process pair, after 4 to 24 runs; DDP: none in 30. With `async_ops=False`
forced on that module's coalescing manager (the collectives complete when the block ends, and the handle
Megatron-FSDP keeps waits on nothing), none of 44 runs crashed (2 series of 22 in one process pair, same load). The
root cause was not found: valgrind saw no invalid access in one run (its serialised threads change the timing), and
the same coalesced asynchronous all-gather in plain torch ran 20,000 times without harm. On a GPU (NCCL) nothing
changes: the overlap is kept.

`storage_resizes(on_resize)`: Megatron-FSDP frees and re-allocates its unsharded buckets by resizing their storage
in place (`param_and_grad_buffer._free_storage` / `_alloc_storage`: `storage._resize_(0)` and back), which no
dispatch mode sees: a storage-counting tracker would keep a freed bucket alive, and miss a re-allocated one. The
two functions are wrapped to call `on_resize(tensor)` after each resize, on real and fake tensors alike (on a GPU,
`torch.cuda.max_memory_allocated` sees these resizes itself).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
import torch.distributed as dist

_PGB = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"


def _fsdp_buffer_module():
    import importlib

    return importlib.import_module(_PGB)


@contextmanager
def _replaced(owner, name: str, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield original
    finally:
        setattr(owner, name, original)


class _Works:
    """Stands in for the coalescing manager's handle: waits on the collectives issued inside it."""

    def __init__(self) -> None:
        self.works: list = []

    def wait(self) -> None:
        for w in self.works:
            if w is not None:
                w.wait()


@contextmanager
def one_by_one_collectives(module):
    """`module._coalescing_manager` (megatron-core's DDP or Megatron-FSDP buffer module) issues its collectives
    one by one."""
    @contextmanager
    def one_by_one(group=None, device=None, async_ops=False):
        yield _Works()

    with _replaced(module, "_coalescing_manager", one_by_one):
        yield


@contextmanager
def symmetric_object_collectives():
    """Object collectives in a fake world of symmetric ranks: every rank's object is rank 0's."""
    def all_gather_object(object_list, obj, group=None):
        object_list[:] = [obj] * len(object_list)

    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
        return None  # rank 0 is the source and keeps its objects

    with _replaced(dist, "all_gather_object", all_gather_object), \
            _replaced(dist, "broadcast_object_list", broadcast_object_list):
        yield


def _on_device(module: torch.nn.Module, device) -> bool:
    device = torch.device(device)
    return all(t.device == device for t in [*module.parameters(), *module.buffers()])


@contextmanager
def fake_tensor_fsdp():
    """Build and run Megatron-FSDP on fake tensors under the fake process group (points 1-3 of the docstring)."""
    original_to = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device = kwargs.get("device", args[0] if len(args) == 1 and not kwargs else None)
        if isinstance(device, (str, torch.device)) and _on_device(self, device):
            return self
        return original_to(self, *args, **kwargs)

    with _replaced(torch.nn.Module, "to", to), symmetric_object_collectives(), \
            one_by_one_collectives(_fsdp_buffer_module()):
        yield


def gathers_complete_in_block() -> None:
    """Megatron-FSDP's coalescing manager with `async_ops=False` always (see the module docstring); idempotent."""
    pgb = _fsdp_buffer_module()
    real = pgb._coalescing_manager
    if getattr(real, "__completes_in_block__", False):
        return

    def coalescing_manager(group=None, device=None, async_ops=False):
        return real(group, device, async_ops=False)

    coalescing_manager.__completes_in_block__ = True
    pgb._coalescing_manager = coalescing_manager


@contextmanager
def storage_resizes(on_resize: Callable[[torch.Tensor], None]):
    """Call `on_resize(tensor)` after each storage resize of Megatron-FSDP's bucket allocators."""
    pgb = _fsdp_buffer_module()
    alloc, free = pgb._alloc_storage, pgb._free_storage

    def alloc_storage(tensor, size):
        alloc(tensor, size)
        on_resize(tensor)

    def free_storage(tensor):
        free(tensor)
        on_resize(tensor)

    with _replaced(pgb, "_alloc_storage", alloc_storage), _replaced(pgb, "_free_storage", free_storage):
        yield


def steady_state(fsdp_model) -> None:
    """Put a freshly built Megatron-FSDP model into the state its first backward leaves, so that a tracked first
    step behaves as every later one. That backward marks every module PRE_BACKWARD and its post-backward hooks set
    the FSDP units back to IDLE; the modules outside the units (embedding, final norm, LM head) stay PRE_BACKWARD
    for the rest of the run, which turns off their forward prefetch. So only the run's first micro-batch prefetches
    from there (at the final norm: every layer released after its forward is all-gathered again, up to
    megatron-core's prefetch size, and stays into the backward); it runs without Adam's moments."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import TrainingState

    inner = fsdp_model.module  # MegatronFSDP
    units = tuple(inner.fsdp_unit_modules)
    in_units = {id(m) for unit in inner.module.modules() if isinstance(unit, units) for m in unit.modules()}
    for m in inner.module.modules():
        if not hasattr(m, "_training_state"):
            raise RuntimeError("Megatron-FSDP modules carry no _training_state: update megatron_upipe/compat/fsdp.py "
                               "(tested with megatron-core 0.19.2)")
        m._training_state = TrainingState.IDLE if id(m) in in_units else TrainingState.PRE_BACKWARD
