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
