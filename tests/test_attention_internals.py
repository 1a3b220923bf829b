"""Internals of the UPipe/Ulysses op that the numerics tests do not see.

1. `megatron_upipe.attention` is pure torch: with megatron-core unimportable, the op with the fused input norm
   (norm_w) runs and equals RMSNorm's formula + float64 reference attention.
2. The stage/round index tensors are made once per (schedule, device): a second forward + backward makes no
   tensor from host data (no host-to-device copy, nothing that breaks CUDA-graph capture).
3. lse, kernel aux and Ulysses' head tensors are saved with save_for_backward: two backward passes with
   retain_graph=True both match the float64 reference, and saved-tensor hooks (activation offload) see them.
   (That Ulysses' head tensors still die stage by stage inside backward is checked by test_memory_model.py: the
   tracked Ulysses peaks match the closed-form model to 1%; keeping them to the end of the node is 5% off.)
4. With 16-bit inputs and grad_accum='fp32', dx is accumulated in float32 for real (`accumulate_mm`): one final
   rounding of the exact sum of the products (CPU: upcast operands; CUDA: cuBLAS float32-output addmm, checked
   under fake CUDA), and no farther from the float64 reference than the old product-rounded-first sum.
5. model.attention_kernel reaches the op: the schema offers every kernel, the layer spec binds the name (and
   refuses an unknown one, a CUDA kernel for a CPU run, or a name for megatron-core's attention), and in a tiny
   model the named kernel is the one select_kernel is asked for and the one every stage runs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _max_rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (both promoted to float64)."""
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


# --- 1. pure torch --------------------------------------------------------------------------------------------------

_NO_MEGATRON = textwrap.dedent("""
    import sys
    sys.modules["megatron"] = None  # any `import megatron...` now raises ImportError
    import torch
    from megatron_upipe.attention import upipe_attention_grouped
    from megatron_upipe.attention.reference import reference_attention, rope_angles

    gen = torch.Generator().manual_seed(0)
    s, b, D, G, g, d = 6, 2, 16, 2, 2, 8
    x = torch.randn(s, b, D, generator=gen, dtype=torch.float64, requires_grad=True)
    w_q = (torch.randn(G, g, d, D, generator=gen, dtype=torch.float64) * 0.3).requires_grad_()
    w_k = (torch.randn(G, d, D, generator=gen, dtype=torch.float64) * 0.3).requires_grad_()
    w_v = (torch.randn(G, d, D, generator=gen, dtype=torch.float64) * 0.3).requires_grad_()
    norm_w = (1 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64)).requires_grad_()
    freqs = rope_angles(s, d)
    out = upipe_attention_grouped(x, w_q, w_k, w_v, cp_group=None, heads_per_stage=2, rotary_pos_emb=freqs,
                                  norm_w=norm_w, norm_eps=1e-5, norm_tile_rows=5)
    xf = x.float()  # RMSNorm's formula (models/norm.py): normalise in float32, cast back, then the weight
    xn = norm_w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    ref = reference_attention(xn, w_q.reshape(G * g * d, D), w_k.reshape(G * d, D), w_v.reshape(G * d, D),
                              G * g, G, freqs)
    dout = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ins = [x, norm_w, w_q, w_k, w_v]
    got = [out] + list(torch.autograd.grad(out, ins, dout))
    want = [ref] + list(torch.autograd.grad(ref, ins, dout))
    err = max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(got, want))
    assert not any(m.startswith("megatron.") or m == "megatron" for m in sys.modules if sys.modules[m] is not None)
    print(f"ERR {err:.3e}")
""")


def test_attention_package_runs_without_megatron_core():
    """The op with norm_w in a process where `import megatron` fails: no ModuleNotFoundError, and y and all five
    gradients equal RMSNorm's formula + float64 reference attention. The normalisation itself runs in float32 (as
    RMSNorm's), so agreement is float32-level: bound 1e-5 (measured ~2e-7)."""
    res = subprocess.run([sys.executable, "-c", _NO_MEGATRON], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    err = float(res.stdout.split("ERR")[-1])
    print(f"no-megatron op with norm_w vs float64 RMSNorm + reference: {err:.2e}")
    assert err < 1e-5


# --- 2. index tensors made once per (schedule, device) --------------------------------------------------------------

class _CountHostCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts tensors made from host data (`torch.tensor(...)` dispatches aten.lift_fresh)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _small_inputs(seed=0, dtype=torch.float64, s=8, b=2, D=16, G=2, g=4, d=8):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(s, b, D, generator=gen, dtype=torch.float64)
    w_q = torch.randn(G, g, d, D, generator=gen, dtype=torch.float64) * 0.3
    w_k = torch.randn(G, d, D, generator=gen, dtype=torch.float64) * 0.3
    w_v = torch.randn(G, d, D, generator=gen, dtype=torch.float64) * 0.3
    dout = torch.randn(s, b, G * g * d, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (x, w_q, w_k, w_v, dout)]


def test_index_tensors_are_built_once_per_schedule_and_device():
    """The stage/round index tensors come from a per-(schedule, device) cache: the same objects on every call, and
    a second forward + backward of UPipe (4 stages) and Ulysses makes no tensor from host data at all, while the
    first one after emptying the cache does (so the counter sees them)."""
    from megatron_upipe.attention import ulysses_attention_grouped, upipe_attention_grouped
    from megatron_upipe.attention import upipe
    from megatron_upipe.attention.schedule import make_schedule

    sched = make_schedule(8, 2, 1, 2)
    x = torch.zeros(1)
    first = upipe._stage_indices(sched, x)
    again = upipe._stage_indices(sched, x)
    assert all(a is b for a, b in zip(first[0] + first[2], again[0] + again[2]))
    assert [h.tolist() for h in first[0]] == [list(st.q_heads) for st in sched.stages]

    *ins, dout = _small_inputs()
    for fn, kw in ((upipe_attention_grouped, dict(heads_per_stage=2)), (ulysses_attention_grouped, {})):
        upipe._cached_indices.cache_clear()
        counts = []
        for _ in range(2):
            leaves = [t.clone().requires_grad_() for t in ins]
            with _CountHostCopies() as mode:
                out = fn(*leaves, cp_group=None, **kw)
                torch.autograd.grad(out, leaves, dout)
            counts.append(mode.count)
        print(f"{fn.__name__}: tensors made from host data, first and second forward + backward: {counts}")
        assert counts[0] > 0 and counts[1] == 0, counts  # the first call fills the cache (the counter sees it)


def test_replicas_are_summed_in_order_with_distinct_indices():
    """ordered_index_add_ equals adding each replica's rows in their order in kv (bit for bit, bf16 too), and each
    index_add_ it makes has distinct indices (one addition per row: the same result on every CUDA run)."""
    from megatron_upipe.attention.upipe import ordered_index_add_, replica_groups

    kv = (0, 0, 1, 1, 0, 1)  # C·n_kv = 6 positions over G = 2 heads, rank-major
    groups = replica_groups(kv)
    assert groups == (([0, 2], [0, 1]), ([1, 3], [0, 1]), ([4, 5], [0, 1]))
    assert replica_groups((0, 1, 2)) == (([0, 1, 2], [0, 1, 2]),)
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(3)
        src = torch.randn(6, 4, 5, generator=gen).to(dtype) * 1e3
        dst0 = torch.randn(2, 4, 5, generator=gen).to(dtype)
        expected = dst0.clone()
        for pos, head in enumerate(kv):
            expected[head] += src[pos]
        got = dst0.clone()
        seen = []
        real = torch.Tensor.index_add_

        def spy(self, dim, index, source):
            seen.append(index.tolist())
            return real(self, dim, index, source)

        torch.Tensor.index_add_ = spy
        try:
            ordered_index_add_(got, tuple((torch.tensor(p), torch.tensor(h)) for p, h in groups), src)
        finally:
            torch.Tensor.index_add_ = real
        assert torch.equal(got, expected), dtype
        assert seen == [[0, 1]] * 3


def test_index_cache_is_not_used_for_fake_tensors():
    """Fake (simulated) tensors get their own index tensors: a cached real tensor would leak into the fake mode."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from megatron_upipe.attention import upipe
    from megatron_upipe.attention.schedule import make_schedule

    sched = make_schedule(8, 2, 1, 2)
    real = upipe._stage_indices(sched, torch.zeros(1))
    with FakeTensorMode():
        fake = upipe._stage_indices(sched, torch.zeros(1))
    assert all(isinstance(t, FakeTensor) for t in fake[0] + fake[2])
    assert not any(isinstance(t, FakeTensor) for t in real[0] + real[2])


# --- 3. saved tensors go through save_for_backward --------------------------------------------------------------

def _reference_grads(x, w_q, w_k, w_v, w_o, norm_w, freqs, dy, eps=1e-5):
    """float64 reference: y = attention(RMSNorm(x)) @ w_o^T (RMSNorm's formula, normalising in float32) and the
    gradients of (x, w_q, w_k, w_v, w_o, norm_w)."""
    from megatron_upipe.attention.reference import reference_attention

    G, g, d, D = w_q.shape
    ins = [t.detach().clone().requires_grad_() for t in (x, w_q, w_k, w_v, w_o, norm_w)]
    xr, wq, wk, wv, wo, nw = ins
    xf = xr.float()
    xn = nw * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(xr.dtype)
    att = reference_attention(xn, wq.reshape(G * g * d, D), wk.reshape(G * d, D), wv.reshape(G * d, D), G * g, G,
                              freqs)
    y = att @ wo.t()  # [s, b, H·d] @ [H·d, D]
    return [y.detach(), *torch.autograd.grad(y, ins, dy)]


def _op_cases():
    from megatron_upipe.attention import ulysses_attention_grouped, upipe_attention_grouped

    return (("upipe", upipe_attention_grouped, dict(heads_per_stage=2)), ("ulysses", ulysses_attention_grouped, {}))


def _fused_inputs(seed=1):
    from megatron_upipe.attention.reference import rope_angles

    x, w_q, w_k, w_v, _ = _small_inputs(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    D, Hd = x.shape[-1], w_q.shape[0] * w_q.shape[1] * w_q.shape[2]
    w_o = torch.randn(D, Hd, generator=gen, dtype=torch.float64) * 0.2
    norm_w = 1 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    return [x, w_q, w_k, w_v, w_o, norm_w], rope_angles(x.shape[0], w_q.shape[2]), dy


# float64 op vs float64 reference; the fused norm normalises in float32 (RMSNorm's formula, in both), so the
# gradients agree to float32 level: bound 1e-5 (measured ~1e-7).
F64_NORM_TOL = 1e-5


def test_backward_twice_with_retain_graph():
    """UPipe (4 stages) and Ulysses with w_o and norm_w, float64: two backward passes over one graph with
    retain_graph=True both give the reference's gradients (the per-stage lse, kernel aux and Ulysses' head tensors
    survive the first backward)."""
    ins, freqs, dy = _fused_inputs()
    ref = _reference_grads(*ins, freqs, dy)
    for name, fn, kw in _op_cases():
        leaves = [t.clone().requires_grad_() for t in ins]
        x, w_q, w_k, w_v, w_o, norm_w = leaves
        y = fn(x, w_q, w_k, w_v, cp_group=None, rotary_pos_emb=freqs, w_o=w_o, norm_w=norm_w, **kw)
        first = torch.autograd.grad(y, leaves, dy, retain_graph=True)
        second = torch.autograd.grad(y, leaves, dy)
        for i, grads in enumerate((first, second)):
            errs = [_max_rel(a, r) for a, r in zip([y, *grads], ref)]
            print(f"{name} backward {i + 1}: max rel err vs float64 reference (y, dx, dw_q, dw_k, dw_v, dw_o, dnorm_w): "
                  + ", ".join(f"{e:.1e}" for e in errs))
            assert max(errs) < F64_NORM_TOL, (name, i, errs)


def test_saved_tensor_hooks_see_lse_and_head_tensors():
    """A saved_tensors_hooks pair that stores a copy at pack time and returns that copy at unpack (what activation
    offload does) sees every per-stage lse ([b, m, N]) and, for Ulysses, the head-layout q, k, v, out; gradients
    computed from the unpacked copies equal the float64 reference."""
    ins, freqs, dy = _fused_inputs(seed=2)
    ref = _reference_grads(*ins, freqs, dy)
    s, b, _ = ins[0].shape
    G, g, d, _ = ins[1].shape
    H = G * g
    for name, fn, kw in _op_cases():
        packed = []

        def pack(t):
            packed.append((tuple(t.shape), t.dtype))
            return t.detach().clone()

        leaves = [t.clone().requires_grad_() for t in ins]
        x, w_q, w_k, w_v, w_o, norm_w = leaves
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fn(x, w_q, w_k, w_v, cp_group=None, rotary_pos_emb=freqs, w_o=w_o, norm_w=norm_w, **kw)
        grads = torch.autograd.grad(y, leaves, dy)
        stages = H // kw.get("heads_per_stage", H)
        m = H // stages  # query heads per stage (cp = 1)
        lse = (b, m, s)
        assert sum(shape == lse for shape, _ in packed) == stages, (name, packed)
        if name == "ulysses":  # q [N, b, H, d], k and v [N, b, G, d], out [b, H, N, d]
            for shape in ((s, b, H, d), (s, b, G, d), (b, H, s, d)):
                assert shape in [p for p, _ in packed], (name, shape, packed)
        errs = [_max_rel(a, r) for a, r in zip([y, *grads], ref)]
        print(f"{name}: {len(packed)} tensors packed; max rel err through the hooks: {max(errs):.1e}")
        assert max(errs) < F64_NORM_TOL, (name, errs)


# --- 4. float32 accumulation of dx for 16-bit inputs --------------------------------------------------------------

BF16_ULP = 2.0 ** -8  # relative spacing of bfloat16 numbers just above a power of two


def _product_rounded_first(acc, a, b):
    """The accumulation the op did before (kept here to show what the tests can tell apart): each 16-bit GEMM's
    product is rounded to 16 bits, then added to the float32 buffer."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(torch.mm(a, b))


def test_accumulate_mm_is_float32_exact_on_cpu():
    """accumulate_mm(acc float32, a, b bfloat16) over 8 products equals the float64 sum of the exact products to
    float32 precision (bound 1e-6 of the largest entry; a bf16 x bf16 product is exact in float32, so only float32
    sums round), and its one final rounding to bf16 gives the correctly rounded float64 sum in >= 99.9% of the
    entries (measured 1e-7 and 100%; the rest would sit within float32 error of a rounding boundary). Rounding each
    product to bf16 first (the old way) is off by ~2e-3 and gets ~60% of the entries right."""
    from megatron_upipe.attention.upipe import accumulate_mm

    gen = torch.Generator().manual_seed(3)
    pairs = [(torch.randn(64, 48, generator=gen).bfloat16(), torch.randn(48, 40, generator=gen).bfloat16())
             for _ in range(8)]
    ref = sum(a.double() @ b.double() for a, b in pairs)  # [64, 40] float64
    res = {}
    for name, fn in (("accumulate_mm", accumulate_mm), ("product rounded first", _product_rounded_first)):
        acc = torch.zeros(64, 40)
        for a, b in pairs:
            fn(acc, a, b)
        res[name] = (_max_rel(acc, ref), (acc.bfloat16() == ref.bfloat16()).double().mean().item())
    print("; ".join(f"{k}: max rel err {e:.1e}, bf16 result correctly rounded in {f:.2%}" for k, (e, f) in res.items()))
    err, frac = res["accumulate_mm"]
    assert err < 1e-6 and frac >= 0.999, res
    assert res["product rounded first"][0] > 100 * err  # the test tells the two apart


def test_accumulate_mm_on_cuda_writes_float32_output_gemm_into_the_buffer():
    """Under fake CUDA tensors (no GPU needed) the CUDA branch is a single addmm with out_dtype=float32 and
    out= the accumulator: no 16-bit product tensor, no upcast copies."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_upipe.attention.upipe import accumulate_mm

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        acc = torch.zeros(64, 40, device="cuda")
        a = torch.empty(64, 48, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(48, 40, device="cuda", dtype=torch.bfloat16)
        with Record() as rec:
            accumulate_mm(acc, a, b)
    assert [c[0] for c in rec.calls] == [torch.ops.aten.addmm.dtype_out], rec.calls
    func, args, kwargs = rec.calls[0]
    assert args[0] is acc and kwargs["out"] is acc and args[3] == torch.float32


def _bf16_upipe_dx(seed, accumulate, H=16, G=4, d=8, s=64, b=2, D=256, U=2):
    """bf16 UPipe (C = 1, U = 2: 8 stages in 4 KV rounds, so dx sums 16 GEMM products) with `accumulate` as the
    op's accumulation: (dx bf16, the float64 reference's dx on the same bf16 inputs, the products' operands)."""
    from megatron_upipe.attention import upipe, upipe_attention_grouped
    from megatron_upipe.attention.reference import reference_attention, rope_angles

    gen = torch.Generator().manual_seed(seed)
    g = H // G
    x = torch.randn(s, b, D, generator=gen, dtype=torch.float64).bfloat16()
    w_q = (torch.randn(G, g, d, D, generator=gen, dtype=torch.float64) * 0.3).bfloat16()
    w_k = (torch.randn(G, d, D, generator=gen, dtype=torch.float64) * 0.3).bfloat16()
    w_v = (torch.randn(G, d, D, generator=gen, dtype=torch.float64) * 0.3).bfloat16()
    dout = torch.randn(s, b, H * d, generator=gen, dtype=torch.float64).bfloat16()
    freqs = rope_angles(s, d)
    ref_in = [x.double()] + [w.double().reshape(-1, D) for w in (w_q, w_k, w_v)]
    ref_in = [r.requires_grad_() for r in ref_in]
    ref_dx = torch.autograd.grad(reference_attention(*ref_in, H, G, freqs), ref_in, dout.double())[0]
    operands = []

    def spy(acc, a, b_):
        operands.append((a.clone(), b_.clone()))
        accumulate(acc, a, b_)

    from tests.upipe_seams import replaced

    with replaced(accumulate_mm=spy):
        ins = [t.clone().requires_grad_() for t in (x, w_q, w_k, w_v)]
        out = upipe_attention_grouped(*ins, cp_group=None, heads_per_stage=U, rotary_pos_emb=freqs)
        dx = torch.autograd.grad(out, ins, dout)[0]
    return dx, ref_dx, operands


def test_bf16_dx_is_one_rounding_of_the_float32_sum_and_no_farther_from_float64():
    """What it measures, bf16 inputs, grad_accum='fp32', 3 seeds:
    (a) the accumulation alone: dx equals the float64 sum of the 16 products of the op's own 16-bit GEMM operands
        (dq / dK / dV rows and W rows, recorded as the op passes them), rounded once to bf16, in >= 99.9% of its
        entries (measured 99.99-100%); rounding each product first (the old way) matches only ~61%;
    (b) against the float64 reference attention on the same bf16 inputs, the mean |dx error| is no larger than the
        old way's (measured ~6e-2 relative for both: the kernel's bf16 outputs and the forward's roundings dominate;
        bound: at most the old value + 0.1% of it)."""
    from megatron_upipe.attention.upipe import accumulate_mm

    for seed in range(3):
        res = {}
        for name, fn in (("fp32", accumulate_mm), ("old", _product_rounded_first)):
            dx, ref_dx, operands = _bf16_upipe_dx(seed, fn)
            assert len(operands) == 16
            exact = sum(a.double() @ w.double() for a, w in operands).view(dx.shape)  # [s·b, D] -> [s, b, D]
            frac = (dx == exact.bfloat16()).double().mean().item()
            mean_err = ((dx.double() - ref_dx).abs().mean() / ref_dx.abs().mean()).item()
            res[name] = (frac, mean_err)
        print(f"seed {seed}: dx == one rounding of the exact sum: fp32 {res['fp32'][0]:.2%}, old {res['old'][0]:.2%}; "
              f"mean rel err vs float64 reference: fp32 {res['fp32'][1]:.4e}, old {res['old'][1]:.4e}")
        assert res["fp32"][0] >= 0.999, res
        assert res["old"][0] < res["fp32"][0]
        assert res["fp32"][1] <= res["old"][1] * 1.001, res


# --- 5. model.attention_kernel reaches the op -------------------------------------------------------------------

def test_schema_offers_every_kernel():
    """model.attention_kernel accepts 'auto' and exactly the kernel names the op knows (te_fused included)."""
    import typing

    from megatron_upipe.attention.kernels import KERNELS
    from megatron_upipe.config.schema import ModelConfig

    allowed = set(typing.get_args(typing.get_type_hints(ModelConfig)["attention_kernel"]))
    assert allowed == {"auto", *KERNELS}
    assert ModelConfig(attention_kernel="te_fused").attention_kernel == "te_fused"


def _tiny_config(**layout_kwargs):
    from megatron_upipe.models.llama import llama_transformer_config
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.parallel import ParallelLayout

    layout = ParallelLayout(**layout_kwargs)
    return llama_transformer_config(get_preset("tiny-gqa"), layout), layout


def test_spec_binds_the_kernel_and_refuses_bad_choices_at_build_time():
    """build_cp_plan binds model.attention_kernel into the op of every layer (auto -> None: automatic), and refuses,
    before any parameter exists: an unknown name, a CUDA kernel for a CPU run (flash_attn, te_fused, sdpa_flash;
    the message names the setting and the device), and a named kernel for a strategy whose attention is
    megatron-core's."""
    import pytest

    from megatron_upipe.models.spec import build_cp_plan

    config, layout = _tiny_config(cp=2, cp_strategy="upipe")
    for name, bound in (("auto", None), ("cpu_flash", "cpu_flash")):
        plan = build_cp_plan(config, layout, attention_kernel=name, kernel_device="cpu")
        ops = [spec.submodules.self_attention.params["cp_attention"] for spec in plan.block_spec.layer_specs]
        assert ops and all(op.keywords["kernel"] == bound for op in ops), (name, [op.keywords for op in ops])
    with pytest.raises(ValueError, match="model.attention_kernel='bogus' is unknown"):
        build_cp_plan(config, layout, attention_kernel="bogus")
    for name in ("flash_attn", "te_fused", "sdpa_flash"):
        with pytest.raises(ValueError, match=f"model.attention_kernel={name}: kernel '{name}' runs on cuda, the "
                                             f"tensors are on cpu"):
            build_cp_plan(config, layout, attention_kernel=name, kernel_device="cpu")
    config, layout = _tiny_config()  # cp_strategy none: megatron-core's local attention
    with pytest.raises(ValueError, match="applies to cp_strategy 'ulysses' or 'upipe' only"):
        build_cp_plan(config, layout, attention_kernel="cpu_flash")


def _kernel_calls_in_model(rank, world_size, name):
    """Tiny-gqa Llama (cp = 1, UPipe) built with attention_kernel=name; one forward + backward. Returns the names
    select_kernel was asked for and the kernels the stage loop ran forward and backward, per call."""
    from megatron_upipe.attention import api, upipe
    from megatron_upipe.models.llama import build_llama
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.parallel import ParallelLayout, destroy_parallel, initialize_parallel

    layout = ParallelLayout(cp=1, cp_strategy="upipe")
    pg = initialize_parallel(layout)
    asked, fwd, bwd = [], [], []
    real = (api.select_kernel, upipe.kernel_forward, upipe.kernel_backward)

    def select_spy(device, dtype, head_dim, name=None, **kwargs):
        asked.append(name)
        return real[0](device, dtype, head_dim, name, **kwargs)

    def fwd_spy(kernel, *args, **kwargs):
        fwd.append(kernel.name)
        return real[1](kernel, *args, **kwargs)

    def bwd_spy(kernel, *args, **kwargs):
        bwd.append(kernel.name)
        return real[2](kernel, *args, **kwargs)

    from tests.upipe_seams import replaced

    api.select_kernel = select_spy
    try:
        with replaced(kernel_forward=fwd_spy, kernel_backward=bwd_spy):
            arch = get_preset("tiny-gqa")
            stage = build_llama(arch, layout, pg, vocab_size=128, attention_kernel=name, kernel_device="cpu")
            tokens = torch.randint(0, 128, (1, 17), generator=torch.Generator().manual_seed(0))
            loss = stage.model(tokens[:, :-1], torch.arange(16)[None], None, labels=tokens[:, 1:])  # [1, 16]
            loss.sum().backward()
            return asked, fwd, bwd, arch.num_layers
    finally:
        api.select_kernel = real[0]
        destroy_parallel()


def test_model_attention_kernel_is_the_kernel_called():
    """In a tiny model built with attention_kernel='cpu_flash', every layer's op asks select_kernel for
    'cpu_flash' by name, and every stage's forward and backward runs cpu_flash; with 'auto' it asks for None."""
    from tests.dist_helper import run_on_ranks

    for name, asked_for in (("cpu_flash", "cpu_flash"), ("auto", None)):
        asked, fwd, bwd, layers = run_on_ranks(_kernel_calls_in_model, 1, name)[0]
        print(f"attention_kernel={name}: select_kernel asked for {asked}; {len(fwd)} forward and {len(bwd)} backward "
              f"kernel calls, ran {sorted(set(fwd) | set(bwd))}")
        assert asked == [asked_for] * layers
        assert fwd and bwd and set(fwd) == set(bwd) == {"cpu_flash"} and len(fwd) == len(bwd)
