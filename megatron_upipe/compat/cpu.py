"""Run megatron-core 0.19.2 on a machine without a GPU (torch.distributed gloo): the one CPU adaptation module.

`install_cpu_patches()` is a no-op when `torch.cuda.is_available()`; otherwise it patches, once (idempotent), the
few places where megatron-core assumes CUDA. megatron-core's own files are never edited: every patch replaces a
torch (or one megatron-core RNG helper) attribute at run time, so the whole stack - GPTModel, DDP, optimizer,
pipeline schedules, dist_checkpointing - runs unchanged on CPU. What is patched and why:

1. Device placement. megatron-core creates tensors with `device=torch.cuda.current_device()` or `device="cuda"`
   (rotary embedding, causal mask, DDP buffers, optimizer, clip_grads, schedules), calls `.cuda()` /
   `.to("cuda")` and `pin_memory`. `torch.cuda.current_device()` returns 0 and the torch factory functions,
   `Tensor.to/.cuda/.pin_memory` and `Module.cuda` map any CUDA device (or a bare device index) to "cpu".
   A TorchFunctionMode is not enough: modes are not active in autograd's backward thread (recompute).
2. CUDA RNG. megatron's RNG tracker keeps "CUDA" generator states and forks them around tensor-parallel
   regions. The CPU default generator stands in for the CUDA one: `torch.cuda.{get,set}_rng_state`,
   `torch.cuda.manual_seed` and megatron's `tensor_parallel.random._{get,set}_cuda_rng_state` act on it. So
   `model_parallel_cuda_manual_seed(seed)` also seeds the CPU generator (on GPU, `torch.cuda.manual_seed` is a
   silent no-op on CPU and the caller must seed the CPU generator itself).
3. `Tensor.type()` without arguments reports CPU tensors as `torch.cuda.*Tensor`, because the optimizer and grad
   clipping assert `param.grad.type() == 'torch.cuda.FloatTensor'`.
4. Streams, events, `synchronize`, `empty_cache` and memory statistics become no-op stand-ins.
5. Megatron-FSDP's coalesced parameter all-gathers complete inside their coalescing block on gloo
   (compat/fsdp.py `gathers_complete_in_block`): issued asynchronously there, they crashed ranks now and then.

Not patched here (handled where it belongs): megatron's local norm refuses sequence parallelism; our spec uses
`megatron_upipe.models.norm.RMSNorm`, whose weight is marked `sequence_parallel` (GPU or CPU alike). Loading a
*distributed-optimizer* checkpoint needs TE or apex inside megatron-core and fails on this stack; use the plain
optimizer on CPU (its checkpoint resumes exactly).
"""

from __future__ import annotations

import contextlib
import functools

import torch

_INSTALLED = False

_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "randperm", "as_tensor",
    "eye", "linspace", "empty_strided", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
    "randn_like",
)


def cpu_patches_active() -> bool:
    return _INSTALLED


def _cpu_device(device):
    """Any CUDA device, or a bare index (megatron passes `torch.cuda.current_device()`), becomes "cpu"."""
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    wrapper.__wrapped_by_megatron_upipe__ = True
    return wrapper


def _patch_devices() -> None:
    for name in _FACTORIES:
        setattr(torch, name, _wrap_factory(getattr(torch, name)))

    orig_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if args and not isinstance(args[0], (torch.dtype, torch.Tensor)):
            args = (_cpu_device(args[0]),) + args[1:]
        return orig_to(self, *args, **kwargs)

    torch.Tensor.to = to
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: 0
    torch.cuda.set_device = lambda *a, **k: None


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
        if not hasattr(mrandom, name):
            raise RuntimeError(
                f"megatron.core.tensor_parallel.random.{name} is gone in this megatron-core version: update "
                f"megatron_upipe/compat/cpu.py (tested with megatron-core 0.19.2)"
            )
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def _patch_tensor_type() -> None:
    orig_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = orig_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return orig_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


class _NoOpStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpEvent()

    def synchronize(self):
        pass


class _NoOpEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _patch_streams() -> None:
    torch.cuda.Stream = _NoOpStream
    torch.cuda.Event = _NoOpEvent
    torch.cuda.current_stream = lambda *a, **k: _NoOpStream()
    torch.cuda.default_stream = lambda *a, **k: _NoOpStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.set_stream = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    torch.cuda.memory_stats = lambda *a, **k: {}


def install_cpu_patches(force: bool = False) -> bool:
    """Patch the CUDA assumptions listed in the module docstring; returns whether the patches are active.

    Does nothing on a machine with a GPU unless `force`: then the process is patched as on a machine without one
    and `torch.cuda.is_available()` reports False from here on. That is for a process that only plans (the memory
    planner simulates its GPU on fake tensors along the CPU path, the path CI tests, whatever this machine has);
    never for one that trains. Idempotent. Call it before building megatron-core objects
    (`megatron_upipe.parallel.initialize_parallel` does)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if torch.cuda.is_available():
        if not force:
            return False
        torch.cuda.is_available = lambda: False
        torch.cuda.device_count = lambda: 0
    _patch_devices()
    _patch_rng()
    _patch_tensor_type()
    _patch_streams()
    from megatron_upipe.compat.fsdp import gathers_complete_in_block

    gathers_complete_in_block()
    _INSTALLED = True
    return True
