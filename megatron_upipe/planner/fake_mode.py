"""The planner's fake-tensor mode: torch's FakeTensorMode, with bookkeeping kept real and the tracker fed in-line.

One Python dispatch mode does what three stacked ones did (FakeTensorMode, a mode keeping real-input ops real, and
the storage tracker): every op of a simulated step passes through Python once instead of three times, and half of
the ops the modes see are metadata queries C++ makes of a fake tensor (`prim.device`, sizes, strides), which pass
straight through. What the tracker sees is unchanged: the outputs of each op that enters the mode stack (not the
ops FakeTensorMode runs inside its own decompositions), whether it ran on fake or on real tensors.

- Real inputs stay real: an op whose tensor inputs are all real (none fake) runs for real, and so do integer
  `arange`s made outside a tracked step. megatron-core compares CPU RNG states with `.item()`
  (tensor_parallel.random.fork) and Megatron-FSDP checks its device-mesh ranks with `.tolist()` while it is built,
  which fake tensors cannot answer. Such tensors are small and the tracker counts them all the same. Inside a
  tracked step integer `arange`s are fake (same bytes): a real one meeting fake tensors would be converted to a fake
  copy at every use, the costliest thing FakeTensorMode does.
- FakeTensorMode's cache key describes each fake tensor argument by its metadata; for a dense one of this mode
  (no constant, no symbolic sizes) the key holds the same facts, gathered without building torch's TensorMetadata
  (a third of the time a cached op took): dtype, sizes, strides, device, layout, storage offset and bytes,
  requires_grad, quantized/conj/neg/inference flags; the memory format it leaves out follows from sizes and
  strides. Storage offset and bytes are left out too for an op whose outputs are new tensors or a plain in-place op
  (`placement_matters`): what it returns does not depend on where its inputs sit in their storage, so one cache
  entry serves every tile of a tiled loop (a third fewer cache misses). Any other argument is described as torch
  describes it.
- An `out=` op whose out tensor already has the result's shape, dtype and device returns it as the real op would,
  its result's metadata taken from the functional overload (FakeTensorMode's cache answers that; it does not cache
  ops writing into a keyword argument). Any other out= op, which would resize its out tensor, runs as before.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS, FakeTensor, FakeTensorMode

from megatron_upipe.memory_accounting.tracker import tensors_in

# Metadata queries C++ code makes of a fake tensor (prim.device, sizes, strides, storage offset), answered by
# FakeTensorMode's own handlers: no tensor in, none out, no memory
QUERIES = dict(_DISPATCH_META_HANDLERS)


@functools.cache
def functional_overload(func):
    """The overload of func's op without its single `out` argument (mm.out -> mm.default, mul.out -> mul.Tensor),
    or None."""
    schema = func._schema
    if [a.name for a in schema.arguments if a.is_out] != ["out"] or len(schema.returns) != 1:
        return None
    want = [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments if not a.is_out]
    packet = func._overloadpacket
    for name in packet.overloads():
        other = getattr(packet, name)
        s = other._schema
        if (not s.is_mutable and len(s.returns) == 1
                and [(a.name, str(a.type), a.kwarg_only) for a in s.arguments] == want):
            return other
    return None


@functools.cache
def placement_matters(func) -> bool:
    """Whether an input's storage offset and size can matter to what func returns: they cannot when its outputs are
    new tensors, nor for a plain in-place op (it returns its first argument, written in place; FakeTensorMode's cache
    entry says so); they can for a view (its output's offset is the input's), an out= op and an op that changes its
    argument's sizes or storage (`inplace_view`: resize_, set_, t_)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not isinstance(func, torch._ops.OpOverload):
        return True
    returns = [r.alias_info for r in schema.returns]
    if not schema.is_mutable and not any(returns):
        return False
    first = schema.arguments[0].alias_info if schema.arguments else None
    in_place = (first is not None and first.is_write and len(returns) == 1 and returns[0] is not None
                and set(returns[0].before_set) == set(first.before_set)
                and not any(a.is_out for a in schema.arguments) and torch.Tag.inplace_view not in func.tags
                and not func.is_view)
    return not in_place


def _integer_arange(func, args, kwargs) -> bool:
    return (func._schema.name == "aten::arange"
            and (kwargs.get("dtype") is None or not kwargs["dtype"].is_floating_point)
            and all(isinstance(a, int) for a in args))


class _DenseKey:
    """Marks a dense fake tensor's metadata in a cache key (no key torch builds contains it)."""


_DENSE = _DenseKey()


class PlannerFakeMode(FakeTensorMode):
    """FakeTensorMode(allow_non_fake_inputs=True) with the rules of the module docstring; `tracking(tracker)`
    feeds a PeakMemoryTracker (its `track_outputs`) with every op's outputs, as the tracker's own dispatch mode
    would, and `counting(counter)` shows a work counter every op."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self._tracker = None
        self._counter = None
        self._inside = 0  # > 0 while FakeTensorMode runs an op (its decompositions re-enter the mode)
        self._placement_matters = True  # of the op whose cache key is being built

    @contextmanager
    def _showing(self, slot: str, observer):
        setattr(self, slot, observer)
        try:
            yield observer
        finally:
            setattr(self, slot, None)

    def tracking(self, tracker):
        """Feed `tracker` (a PeakMemoryTracker) the outputs of every op that enters the mode."""
        return self._showing("_tracker", tracker)

    def counting(self, counter):
        """Show `counter` (planner/step_time.py WorkCounter: FLOPs, collective bytes) every op that enters the mode."""
        return self._showing("_counter", counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        query = QUERIES.get(func)
        if query is not None:
            return query(args)
        kwargs = kwargs or {}
        if self._inside:
            return super().__torch_dispatch__(func, types, args, kwargs)
        inputs = tensors_in((args, kwargs))
        if inputs:
            real = not any(isinstance(t, FakeTensor) for t in inputs)
        else:
            real = self._tracker is None and _integer_arange(func, args, kwargs)
        if real:
            out = func(*args, **kwargs)  # no mode below this one: runs for real
        else:
            self._inside += 1
            try:
                out = self._fake(func, types, args, kwargs)
            finally:
                self._inside -= 1
        if self._tracker is not None:
            self._tracker.track_outputs(func, inputs, out)
        if self._counter is not None:
            self._counter.count(func, args, kwargs)
        return out

    def _cache_key(self, state, func, args, kwargs):
        self._placement_matters = placement_matters(func)
        return super()._cache_key(state, func, args, kwargs)

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects):
        """FakeTensorMode's, with dense fake tensors of this mode described faster (see the module docstring)."""
        if self.shape_env is not None:
            return super()._prep_args_for_hash(result, args, state, id_hashed_objects)
        if isinstance(args, (list, tuple, dict)):
            result.append(type(args))
            result.append(f"length_{len(args)}")
        if isinstance(args, dict):
            self._prep_args_for_hash(result, args.keys(), state, id_hashed_objects)
            self._prep_args_for_hash(result, args.values(), state, id_hashed_objects)
            return None
        for arg in args:
            if (type(arg) is FakeTensor and arg.fake_mode is self and arg.constant is None
                    and arg.layout is torch.strided and not arg._has_symbolic_sizes_strides):
                result.append(_DENSE)
                result.append((arg.dtype, tuple(arg.shape), arg.stride(), arg.device,
                               (arg.storage_offset(), arg.untyped_storage().nbytes()) if self._placement_matters
                               else None, arg.requires_grad, arg.is_quantized, arg.is_conj(), arg.is_neg(),
                               arg.is_inference()))
            elif isinstance(arg, (list, tuple, dict)):
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)
        return None

    def _fake(self, func, types, args, kwargs):
        out = kwargs.get("out")
        functional = functional_overload(func) if isinstance(out, FakeTensor) else None
        if functional is not None:
            result = super().__torch_dispatch__(functional, types, args,
                                                {k: v for k, v in kwargs.items() if k != "out"})
            if (isinstance(result, FakeTensor) and result.shape == out.shape and result.dtype == out.dtype
                    and result.device == out.device):
                return out
        return super().__torch_dispatch__(func, types, args, kwargs)
