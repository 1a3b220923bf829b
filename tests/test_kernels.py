"""Local attention kernels: each available one against the float64 reference (forward and explicit backward).

On this project's CPU machines only `cpu_flash` runs; the CUDA kernels (PyTorch SDPA ops, flash-attn,
TransformerEngine) are exercised by the same test wherever CUDA and the package are present.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_upipe.attention.kernels import KERNELS, kernel_backward, kernel_forward, select_kernel

_PKG = {"flash_attn": "flash_attn", "te_fused": "transformer_engine"}


def _available(name: str) -> bool:
    k = KERNELS[name]
    if k.device_type == "cuda" and not torch.cuda.is_available():
        return False
    return name not in _PKG or importlib.util.find_spec(_PKG[name]) is not None


def _reference(q, k, v, causal, scale):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ vv, (q, k, v)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_matches_reference(name):
    if not _available(name):
        pytest.skip(f"{name} needs {KERNELS[name].device_type}" + (f" and {_PKG[name]}" if name in _PKG else ""))
    kernel = KERNELS[name]
    device = torch.device(kernel.device_type)
    dtype = torch.float32 if torch.float32 in kernel.dtypes else torch.bfloat16
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, n, d = 2, 4, 2, 37, 16
    # sequence-first buffers viewed as [b, h, N, d], as the stage loop passes them
    q, k, v, do = (torch.randn(n, b, h, d, generator=gen).to(device, dtype).permute(1, 2, 0, 3) for h in (hq, hkv, hkv, hq))
    for causal in (True, False):
        out, lse, aux = kernel_forward(kernel, q, k, v, causal, 0.3)
        dq, dk, dv = kernel_backward(kernel, do, q, k, v, out, lse, aux, causal, 0.3)
        ref, ins = _reference(q.cpu(), k.cpu(), v.cpu(), causal, 0.3)
        grads = torch.autograd.grad(ref, ins, do.cpu().double())
        for got, want in zip((out, dq, dk, dv), (ref, *grads)):
            assert got.shape == want.shape
            err = ((got.cpu().double() - want).norm() / want.norm()).item()
            assert err < tol, (name, causal, err)


def test_auto_selection_on_cpu_is_cpu_flash():
    assert select_kernel(torch.device("cpu"), torch.float32, 64).name == "cpu_flash"
    assert select_kernel(torch.device("cpu"), torch.bfloat16, 128, "cpu_flash").name == "cpu_flash"
