"""The planner's one fake-tensor mode (planner/fake_mode.py) tracks what FakeTensorMode under a tracker mode did,
and the forked workers (planner/workers.py) return what a serial run returns."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from megatron_upipe.planner.fake_mode import _DENSE, PlannerFakeMode, functional_overload
from megatron_upipe.planner.simulate import StorageTracker, classify_by_stack
from megatron_upipe.planner.workers import run_all

aten = torch.ops.aten


def test_functional_overload_drops_the_out_argument():
    assert functional_overload(aten.mm.out) is aten.mm.default
    assert functional_overload(aten.mul.out) is aten.mul.Tensor
    assert functional_overload(aten.addmm.out) is aten.addmm.default
    assert functional_overload(aten.index_select.out) is aten.index_select.default
    assert functional_overload(aten.add_.Tensor) is None  # in place, no out argument
    assert functional_overload(aten.max.dim_max) is None  # two out arguments


def _workload():
    """A small step touching every rule: parameters, matmuls, out= ops (one into a wrongly sized buffer, which the
    op resizes), views, an integer arange used as an index, dtype casts, ops FakeTensorMode decomposes into
    allocating ops (layer norm, cross-entropy, index_copy_), a backward."""
    w1 = torch.nn.Parameter(torch.randn(64, 32))
    w2 = torch.nn.Parameter(torch.randn(16, 64))
    x = torch.randn(128, 32)
    h = torch.nn.functional.linear(x, w1).float()  # [128, 64]
    buf = torch.empty(128, 16)
    torch.mm(h.detach(), w2.detach().t(), out=buf)  # right shape: written in place
    small = torch.empty(3)
    torch.mul(h[:, :16].detach(), 2.0, out=small)  # wrong shape: resized to [128, 16]
    rows = torch.arange(0, 128)
    picked = h[rows, rows % 64]  # integer index tensors meet a fake tensor
    y = torch.nn.functional.silu(h) @ w2.t() + buf + small
    y = torch.nn.functional.layer_norm(y, (16,)).index_copy(0, torch.tensor([1, 5]), y[:2] * 3)
    ce = torch.nn.functional.cross_entropy(y, rows % 16)
    loss = y.square().mean() + picked.sum() + torch.rsqrt(y.abs() + 1).reshape(-1)[:10].sum() + ce
    loss.backward()
    return small.shape


def _track_with(stack):
    mem = StorageTracker(classify=classify_by_stack)
    mem.timeline = []  # every allocation and free: (op, bytes, live bytes after)
    with stack(mem):
        shape = _workload()
    return shape, mem.peak_bytes, dict(mem.peak_breakdown), mem.live_bytes, mem.timeline


class _RealInputsStayReal(TorchDispatchMode):
    """The mode the planner stacked between FakeTensorMode and the tracker before: ops on real tensors only, and
    integer aranges, run for real."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        integer_arange = (func._schema.name == "aten::arange" and not tensors
                          and (kwargs.get("dtype") is None or not kwargs["dtype"].is_floating_point)
                          and all(isinstance(a, int) for a in args))
        if integer_arange or (tensors and not any(isinstance(t, FakeTensor) for t in tensors)):
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def test_the_planner_mode_tracks_what_three_stacked_modes_did():
    from contextlib import contextmanager

    @contextmanager
    def three_modes(mem):  # FakeTensorMode, real inputs kept real, the tracker: as the planner stacked them before
        with FakeTensorMode(allow_non_fake_inputs=True), _RealInputsStayReal(), mem:
            yield

    @contextmanager
    def one_mode(mem):
        with PlannerFakeMode() as fake, fake.tracking(mem):
            yield

    before, after = _track_with(three_modes), _track_with(one_mode)
    assert after == before
    assert before[0] == (128, 16) and before[1] > 128 * 64 * 4 and len(before[4]) > 50


def test_out_ops_return_their_out_tensor_or_resize_it():
    with PlannerFakeMode():
        a, b = torch.empty(8, 4), torch.empty(4, 6)
        out = torch.empty(8, 6)
        assert torch.mm(a, b, out=out) is out and out.shape == (8, 6)
        wrong = torch.empty(2)
        assert torch.mm(a, b, out=wrong).shape == (8, 6)
        assert isinstance(out, FakeTensor)
        with pytest.raises(RuntimeError):  # shape errors still raised
            torch.mm(a, a, out=out)


def test_real_inputs_stay_real_and_integer_aranges_are_real_outside_a_tracked_step():
    real = torch.ones(3)
    with PlannerFakeMode() as fake:
        assert not isinstance(real * 2, FakeTensor)
        assert torch.arange(4).tolist() == [0, 1, 2, 3]
        assert isinstance(torch.arange(4.0), FakeTensor)
        assert isinstance(torch.zeros(4), FakeTensor)
        with fake.tracking(StorageTracker()):
            assert isinstance(torch.arange(4), FakeTensor)


def _square(x):
    if x < 0:
        raise ValueError(f"negative {x}")
    return x * x


def test_forked_workers_return_results_in_order_and_raise_errors():
    assert run_all(_square, [(3,), (4,), (5,)], jobs=2) == [9, 16, 25] == run_all(_square, [(3,), (4,), (5,)])
    with pytest.raises(ValueError, match="negative -1"):
        run_all(_square, [(2,), (-1,)], jobs=2)
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        run_all(_square, [(2,)], jobs=0)


def _variants():
    """Fake tensors of many layouts: sizes, strides, offsets, storage sizes, dtypes, flags."""
    base = torch.empty(4, 6)
    return [base, torch.empty(4, 6), base.t(), base[1:], base[:, 1:], base[:3], torch.empty(4, 6).t().t(),
            torch.empty(6, 4).t(), torch.empty(4, 6, dtype=torch.bfloat16), base.view(6, 4),
            torch.empty(4, 6, requires_grad=True), torch.empty(5, 6)[:4], base.expand(2, 4, 6)[0], base[1:4],
            torch.empty(4, 6, dtype=torch.complex64).conj(), torch.empty(1, 6).expand(4, 6), torch.empty(9, 6)[5:],
            torch.empty(4, 1, 3, 2).permute(0, 2, 3, 1).squeeze(-1), torch.empty(4, 6, device="meta")]


def test_cache_keys_tell_apart_what_torchs_keys_tell_apart():
    """The faster description of a dense fake tensor in FakeTensorMode's cache key: for an op whose output may
    alias an input (a view, in-place, out=), two tensors share it exactly when torch's own description
    (TensorMetadata) of them is equal; for any other op, when torch's is equal but for the storage offset and
    size."""
    from torch._subclasses.fake_tensor import _CacheKeyState, extract_tensor_metadata

    with PlannerFakeMode() as mode:
        variants = _variants()

    def keys(describe, placement_matters=True):
        out = []
        for t in variants:
            result, mode._placement_matters = [], placement_matters
            describe(mode, result, (t,), _CacheKeyState(None), [])
            out.append(tuple(result))
        return out

    ours, torchs = keys(PlannerFakeMode._prep_args_for_hash), keys(FakeTensorMode._prep_args_for_hash)
    assert ours[0][2] is _DENSE and len(set(torchs)) > 10  # the fast description was used; many differ
    placeless = keys(PlannerFakeMode._prep_args_for_hash, placement_matters=False)

    def without_placement(t):
        m = extract_tensor_metadata(t)
        m.storage_offset = m.storage_bytes = None
        return m

    for i in range(len(variants)):
        for j in range(len(variants)):
            assert (ours[i] == ours[j]) == (torchs[i] == torchs[j]), (i, j)
            assert (placeless[i] == placeless[j]) == (without_placement(variants[i]) == without_placement(variants[j]))
    assert len(set(placeless)) < len(set(ours))


@pytest.mark.parametrize("op", ["clone", "mul", "mm", "to_bf16", "sum", "empty_like", "add_out_of_place", "silu"])
def test_ops_not_aliasing_their_inputs_return_the_same_whatever_the_inputs_placement(op):
    """What lets the cache key leave out storage offsets and sizes for such ops: their output's metadata, taken
    from a cache entry of a tensor placed elsewhere, equals torch's uncached answer."""
    run = {"clone": lambda t: t.clone(), "mul": lambda t: t * 3, "mm": lambda t: t.mT @ t,
           "to_bf16": lambda t: t.to(torch.bfloat16), "sum": lambda t: t.sum(-1), "empty_like": torch.empty_like,
           "add_out_of_place": lambda t: torch.add(t, t), "silu": torch.nn.functional.silu}[op]

    def described(out):
        return (out.shape, out.stride(), out.dtype, out.device, out.requires_grad, out.storage_offset())

    with PlannerFakeMode():
        ours = [described(run(t)) for t in _variants()[:-1] if not t.is_complex()]
    uncached = FakeTensorMode(allow_non_fake_inputs=True)
    uncached.cache_enabled = False
    with uncached:
        torchs = [described(run(t)) for t in _variants()[:-1] if not t.is_complex()]
    assert ours == torchs


def test_views_of_tensors_placed_elsewhere_keep_their_own_offsets():
    """The other half: a view's cache entry must not serve an input at another storage offset; an in-place op
    returns its own argument."""
    def views():
        big = torch.empty(16, 6)
        out = []
        for part in (big[0:4], big[4:8], big[8:12]):  # same sizes and strides, different offsets
            for v in (part.view(-1), part.t(), part[1:], part.unsqueeze(0), part.as_strided((2, 3), (6, 1))):
                out.append((v.shape, v.stride(), v.storage_offset()))
            out.append((part.mul_(2) is part, part.copy_(big[12:16]) is part, part.add_(1).storage_offset()))
        return out

    with PlannerFakeMode():
        ours = views()
    uncached = FakeTensorMode()
    uncached.cache_enabled = False
    with uncached:
        assert ours == views()
