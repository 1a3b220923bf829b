"""Internals of the UPipe/Ulysses op that the numerics tests do not see.

1. `megatron_upipe.attention` is pure torch: with megatron-core unimportable, the op with the fused input norm
   (norm_w) runs and equals RMSNorm's formula + float64 reference attention.
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
