"""Local (single-rank, full-sequence) attention kernels behind one interface with an explicit backward.

UPipe's backward calls a kernel's *backward* with the saved (out, lse) instead of recomputing attention, so every
kernel here exposes both halves:

    fwd(q, k, v, causal, scale) -> (out, lse, aux)
    bwd(dout, q, k, v, out, lse, aux, causal, scale) -> (dq, dk, dv)

Layout at this interface: q, out, dout [b, hq, N, d]; k, v [b, hkv, N, d] (hq a multiple of hkv: GQA); lse
[b, hq, N] float32 (float64 for float64 inputs on CPU). Callers pass permuted views of sequence-first buffers
([N, b, h, d] memory); the CPU kernel keeps that memory layout for `out`. `aux` is whatever small extra state a
kernel's backward needs (RNG offsets, cumulative lengths), opaque to callers.

Kernels: `cpu_flash` (aten's CPU flash attention, every float dtype), on CUDA `sdpa_flash`, `sdpa_efficient`,
`sdpa_cudnn` (PyTorch's fused SDPA ops), `flash_attn` (Dao-AILab flash-attn, when installed) and `te_fused`
(TransformerEngine's cuDNN fused attention, when installed; by name only). Kernels without native GQA get K/V
expanded to the query heads and their gradients summed back. `select_kernel` picks one automatically
(flash_attn, then sdpa_flash, sdpa_efficient, cpu_flash; overridable by name) and logs the choice once per
(kernel, device, dtype).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

_aten = torch.ops.aten


@dataclass(frozen=True)
class AttentionKernel:
    name: str
    device_type: str  # "cpu" or "cuda"
    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int
    head_dim_multiple: int
    native_gqa: bool
    fwd: Callable[..., tuple[torch.Tensor, torch.Tensor, Any]]
    bwd: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    def unsupported_reason(self, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
        if device_type != self.device_type:
            return f"kernel {self.name!r} runs on {self.device_type}, the tensors are on {device_type}"
        if dtype not in self.dtypes:
            return f"kernel {self.name!r} does not support dtype {dtype} (supports {list(self.dtypes)})"
        if head_dim > self.max_head_dim or head_dim % self.head_dim_multiple:
            return (
                f"kernel {self.name!r} does not support head dim {head_dim} (needs <= {self.max_head_dim} and a "
                f"multiple of {self.head_dim_multiple}); choose another kernel or head dim"
            )
        return None


# ---------------------------------------------------------------------------------------------- CPU flash
def _cpu_fwd(q, k, v, causal, scale):
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


# ---------------------------------------------------------------------------------- CUDA SDPA fused ops
def _sdpa_flash_fwd(q, k, v, causal, scale):
    out, lse, cq, ck, mq, mk, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse, (cq, ck, mq, mk, seed, offset)


def _sdpa_flash_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    cq, ck, mq, mk, seed, offset = aux
    return _aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale
    )


def _sdpa_eff_fwd(q, k, v, causal, scale):
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse, (seed, offset)


def _sdpa_eff_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    seed, offset = aux
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


def _sdpa_cudnn_fwd(q, k, v, causal, scale):
    out, lse, cq, ck, mq, mk, seed, offset, _ = _aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return out, lse, (cq, ck, mq, mk, seed, offset)


def _sdpa_cudnn_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    cq, ck, mq, mk, seed, offset = aux
    return _aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, causal, scale=scale
    )


# ------------------------------------------------------------------------- flash-attn (optional, CUDA)
# flash-attn works in [b, N, h, d]; its private _flash_attn_forward/_backward are the only entry points that
# return the softmax lse and accept it back. Unverified in this workplace (no GPU in CI): see tests/test_kernels.py.
def _fa_fwd(q, k, v, causal, scale):
    from flash_attn.flash_attn_interface import _flash_attn_forward

    res = _flash_attn_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, scale, causal=causal,
        window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
    )
    out, lse, rng = res[0], res[1], res[-1]
    return out.transpose(1, 2), lse, rng


def _fa_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    from flash_attn.flash_attn_interface import _flash_attn_backward

    dq, dk, dv = (torch.empty_like(t.transpose(1, 2)) for t in (q, k, v))
    _flash_attn_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), lse,
        dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None, False, rng_state=aux,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ------------------------------------------------------------- TransformerEngine fused attention (optional)
# TE's cuDNN fused attention in "sbhd" layout, which is our head-layout buffers' memory order. Its Python
# wrappers (transformer_engine.pytorch.cpp_extensions.fused_attn_fwd/_bwd, TE 2.x) are called by keyword; the
# softmax statistics (lse) are aux[0], the RNG state aux[1]. Opt-in by name only (kernel="te_fused"): unverified
# in this workplace, which has neither CUDA nor TE (see tests/test_kernels.py).
def _te_fwd(q, k, v, causal, scale):
    from transformer_engine.pytorch.cpp_extensions import fused_attn_fwd
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend

    b, _, n, _ = q.shape
    cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=q.device)
    out, aux = fused_attn_fwd(
        is_training=True, max_seqlen_q=n, max_seqlen_kv=n, cu_seqlens_q=cu, cu_seqlens_kv=cu,
        q=q.permute(2, 0, 1, 3), k=k.permute(2, 0, 1, 3), v=v.permute(2, 0, 1, 3), fake_dtype=q.dtype,
        fused_attention_backend=FusedAttnBackend["F16_arbitrary_seqlen"], attn_scale=scale,
        qkv_layout="sbhd_sbhd_sbhd", attn_mask_type="causal" if causal else "no_mask",
    )  # out [N, b, h, d]
    return out.permute(1, 2, 0, 3), aux[0], (cu, list(aux))


def _te_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    from transformer_engine.pytorch.cpp_extensions import fused_attn_bwd
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend
    from transformer_engine.pytorch.constants import TE_DType

    cu, aux_tensors = aux
    n = q.shape[2]
    sbhd = (t.permute(2, 0, 1, 3) for t in (q, k, v, out, dout))
    dq, dk, dv, *_ = fused_attn_bwd(
        n, n, cu, cu, *sbhd, fake_dtype=q.dtype, dqkv_dtype=TE_DType[q.dtype], aux_ctx_tensors=aux_tensors,
        fused_attention_backend=FusedAttnBackend["F16_arbitrary_seqlen"], attn_scale=scale,
        qkv_layout="sbhd_sbhd_sbhd", attn_mask_type="causal" if causal else "no_mask",
    )
    return dq.permute(1, 2, 0, 3), dk.permute(1, 2, 0, 3), dv.permute(1, 2, 0, 3)


_HALF = (torch.float16, torch.bfloat16)
KERNELS: dict[str, AttentionKernel] = {
    k.name: k
    for k in (
        AttentionKernel("cpu_flash", "cpu", (torch.float32, torch.float64, torch.bfloat16, torch.float16),
                        1 << 30, 1, True, _cpu_fwd, _cpu_bwd),
        AttentionKernel("flash_attn", "cuda", _HALF, 256, 8, True, _fa_fwd, _fa_bwd),
        AttentionKernel("sdpa_cudnn", "cuda", _HALF, 128, 8, False, _sdpa_cudnn_fwd, _sdpa_cudnn_bwd),
        AttentionKernel("sdpa_flash", "cuda", _HALF, 256, 8, False, _sdpa_flash_fwd, _sdpa_flash_bwd),
        AttentionKernel("sdpa_efficient", "cuda", _HALF + (torch.float32,), 512, 8, False, _sdpa_eff_fwd, _sdpa_eff_bwd),
        AttentionKernel("te_fused", "cuda", _HALF, 256, 8, True, _te_fwd, _te_bwd),
    )
}
_AUTO_ORDER = ("flash_attn", "sdpa_flash", "sdpa_efficient", "cpu_flash")


_PACKAGES = {"flash_attn": "flash_attn", "te_fused": "transformer_engine"}


def _installed(name: str) -> bool:
    return name not in _PACKAGES or importlib.util.find_spec(_PACKAGES[name]) is not None


def select_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, name: str | None = None) -> AttentionKernel:
    """The kernel to use for these inputs: `name` if given (validated), else the first suitable in auto order."""
    if name is not None:
        if name not in KERNELS:
            raise ValueError(f"attention kernel {name!r} is unknown; choose one of {sorted(KERNELS)}")
        kernel = KERNELS[name]
        reason = kernel.unsupported_reason(device.type, dtype, head_dim)
        if reason is None and not _installed(name):
            reason = f"kernel {name!r} needs the {_PACKAGES[name]} package, which is not installed"
        if reason:
            raise ValueError(reason)
    else:
        candidates = [KERNELS[n] for n in _AUTO_ORDER if _installed(n)]
        usable = [k for k in candidates if k.unsupported_reason(device.type, dtype, head_dim) is None]
        if not usable:
            reasons = "; ".join(k.unsupported_reason(device.type, dtype, head_dim) for k in candidates)
            raise ValueError(f"no attention kernel supports these inputs: {reasons}")
        kernel = usable[0]
    _report_once(kernel.name, device.type, str(dtype))
    return kernel


@lru_cache(maxsize=None)
def _report_once(name: str, device_type: str, dtype: str) -> None:
    log.info("megatron_upipe attention kernel: %s (%s, %s)", name, device_type, dtype)


def kernel_forward(kernel: AttentionKernel, q, k, v, causal: bool, scale: float):
    """(out, lse, aux) for q [b, hq, N, d], k/v [b, hkv, N, d]; expands K/V for kernels without native GQA."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and not kernel.native_gqa:
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    return kernel.fwd(q, k, v, causal, scale)


def kernel_backward(kernel: AttentionKernel, dout, q, k, v, out, lse, aux, causal: bool, scale: float):
    """(dq, dk, dv) with dk/dv shaped like k/v [b, hkv, N, d]."""
    hkv = k.shape[1]
    rep = q.shape[1] // hkv
    if rep > 1 and not kernel.native_gqa:
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
        dq, dk, dv = kernel.bwd(dout, q, k, v, out, lse, aux, causal, scale)
        b, _, n, d = dk.shape
        return dq, dk.view(b, hkv, rep, n, d).sum(2), dv.view(b, hkv, rep, n, d).sum(2)
    return kernel.bwd(dout, q, k, v, out, lse, aux, causal, scale)
