"""Local (single-rank, full-sequence) attention kernels behind one interface with an explicit backward.

UPipe's backward calls a kernel's *backward* with the saved (out, lse) instead of recomputing attention, so every
kernel here exposes both halves:

    fwd(q, k, v, causal, scale) -> (out, lse, aux)
    bwd(dout, q, k, v, out, lse, aux, causal, scale) -> (dq, dk, dv)

Layout at this interface: q, out, dout [b, hq, N, d]; k, v [b, hkv, N, d] (hq a multiple of hkv: GQA); lse
float32 (float64 for float64 inputs on CPU), shaped as the kernel makes it. Callers pass permuted views of
sequence-first buffers ([N, b, h, d] memory). `aux` is whatever small extra state a kernel's backward needs (RNG
state, cumulative lengths), opaque to callers. Every bwd rebuilds the probabilities from the `lse` it is given,
never from a copy of the forward's kept in aux: ring attention (ring.py) passes each block the *merged* lse of the
whole row. TE's aux holds its forward's softmax Stats, which its backward reads, so te_fused puts `lse` in their
place (varlen_kernels.te_aux).

Kernels: `cpu_flash` (aten's CPU flash attention, every float dtype); on CUDA `te_fused` (TransformerEngine's
cuDNN fused attention), `flash_attn` (Dao-AILab flash-attn 2), `sdpa_flash`, `sdpa_cudnn`, `sdpa_efficient`
(PyTorch's fused SDPA ops). The libraries' version differences live in kernel_libraries.py. GQA: te_fused,
flash_attn, sdpa_flash (flash-attn 2's kernel inside aten) and sdpa_cudnn (cuDNN's graph takes K/V with their own
head count) take hkv < hq natively; sdpa_efficient does not (its backward returns dK/dV with the query's heads),
so K/V are expanded to the query heads for it and dK/dV summed back, which the memory model counts.

`select_kernel` picks one automatically (te_fused, flash_attn, sdpa_flash, sdpa_efficient, cpu_flash: the first
whose device, dtype and head dim fit, whose library imports with a known signature and, with a `KernelCall`, whose
own check accepts the call's shape) and logs the choice and each fallback's reason once.
`planning_kernel(name)` is the planner's CPU stand-in for a GPU kernel: it allocates what that kernel allocates
(tests/test_cuda_contracts.py checks it against the kernels' meta functions on fake CUDA tensors).

Packed documents (cu_seqlens, varlen.py): `kernel_forward` / `kernel_backward` with `docs` call a kernel's
`varlen_fwd(q, k, v, docs, causal, scale)` / `varlen_bwd(dout, q, k, v, out, lse, aux, docs, causal, scale)`, same
layouts (b = 1): cpu_flash per group of equal-length documents (varlen.py), the CUDA kernels through their varlen
entry points (varlen_kernels.py; sdpa_cudnn has none). A `KernelCall` with `varlen` set makes selection skip, with
the reason logged, every kernel without a usable varlen path.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import torch

from . import kernel_libraries as libs
from . import varlen_kernels as vk
from .varlen import cpu_varlen_backward, cpu_varlen_forward

log = logging.getLogger(__name__)

_aten = torch.ops.aten


@dataclass(frozen=True)
class KernelCall:
    """The shape of one kernel call of the op: what a kernel's own support check needs."""

    batch: int
    q_heads: int  # per call (m per rank in a UPipe stage)
    kv_heads: int  # per call, before any expansion
    seq_len: int  # N
    causal: bool = True
    varlen: tuple[int, int] | None = None  # packed documents (cu_seqlens): (their count, the longest's length)


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
    library: Callable[[], Any] | None = None  # the library's API, or a str: why it cannot be used
    shape_check: Callable[[KernelCall, torch.dtype, int], str | None] | None = None
    # packed documents: the calls (None: no varlen path, for the reason `no_varlen`) and, for a library, why its
    # installed version's varlen entry points cannot be used (None: they can)
    varlen_fwd: Callable[..., tuple[torch.Tensor, torch.Tensor, Any]] | None = None
    varlen_bwd: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    varlen_library: Callable[[], str | None] | None = None
    no_varlen: str = ""

    def unsupported_reason(self, device_type: str, dtype: torch.dtype, head_dim: int,
                           call: KernelCall | None = None) -> str | None:
        if device_type != self.device_type:
            return f"kernel {self.name!r} runs on {self.device_type}, the tensors are on {device_type}"
        if dtype not in self.dtypes:
            return f"kernel {self.name!r} does not support dtype {dtype} (supports {list(self.dtypes)})"
        if head_dim > self.max_head_dim or head_dim % self.head_dim_multiple:
            return (
                f"kernel {self.name!r} does not support head dim {head_dim} (needs <= {self.max_head_dim} and a "
                f"multiple of {self.head_dim_multiple}); choose another kernel or head dim"
            )
        api = self.library() if self.library is not None else None
        if isinstance(api, str):
            return f"kernel {self.name!r} is unavailable: {api}"
        if call is not None and call.varlen is not None:
            if self.varlen_fwd is None:
                return f"kernel {self.name!r} has no variable-length (cu_seqlens) path: {self.no_varlen}"
            why = self.varlen_library() if self.varlen_library is not None else None
            if why:
                return f"kernel {self.name!r} cannot take cu_seqlens: {why}"
        if call is not None and self.shape_check is not None:
            return self.shape_check(call, dtype, head_dim)
        return None


# ---------------------------------------------------------------------------------------------- CPU flash
def _cpu_fwd(q, k, v, causal, scale):
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


# ---------------------------------------------------------------------------------- CUDA SDPA fused ops
def _sdpa_flash_fwd(q, k, v, causal, scale):  # lse [b, hq, N]
    out, lse, cq, ck, mq, mk, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse, (cq, ck, mq, mk, seed, offset)


def _sdpa_flash_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    cq, ck, mq, mk, seed, offset = aux
    return _aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale
    )


def _sdpa_eff_fwd(q, k, v, causal, scale):  # lse [b, hq, N rounded up to a multiple of 32]
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse, (seed, offset)


def _sdpa_eff_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    seed, offset = aux
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


def _sdpa_cudnn_fwd(q, k, v, causal, scale):  # lse [b, hq, N, 1]
    out, lse, cq, ck, mq, mk, seed, offset, _ = _aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return out, lse, (cq, ck, mq, mk, seed, offset)


def _sdpa_cudnn_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    cq, ck, mq, mk, seed, offset = aux
    return _aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, causal, scale=scale
    )


# ------------------------------------------------------------------------- flash-attn 2 (optional, CUDA)
# flash-attn works in [b, N, h, d] (any strides with a contiguous last dim): transposed views, no copies.
def _fa_fwd(q, k, v, causal, scale):
    out, lse, rng = libs.flash_attn_forward(libs.flash_attn_api(), *(t.transpose(1, 2) for t in (q, k, v)), causal,
                                            scale)  # out [b, N, hq, d], lse [b, hq, N]
    return out.transpose(1, 2), lse, rng


def _fa_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    dq, dk, dv = libs.flash_attn_backward(libs.flash_attn_api(), *(t.transpose(1, 2) for t in (dout, q, k, v, out)),
                                          lse, aux, causal, scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ------------------------------------------------------------- TransformerEngine fused attention (optional)
# TE's "sbhd_sbhd_sbhd" layout is our head-layout buffers' memory order, but TE derives strides from the layout:
# each tensor must be dense [N, b, h, d] (a stage's slice of the resident KV heads is copied).
def _sbhd(t: torch.Tensor) -> torch.Tensor:
    return t.permute(2, 0, 1, 3).contiguous()  # [b, h, N, d] view -> dense [N, b, h, d] (no copy when it is)


def _te_fwd(q, k, v, causal, scale):
    out, aux, _ = libs.te_forward(libs.te_api(), _sbhd(q), _sbhd(k), _sbhd(v), causal, scale)  # out [N, b, hq, d]
    return out.permute(1, 2, 0, 3), aux[0], aux  # aux[0]: softmax Stats [b, hq, N, 1] float32


def _te_bwd(dout, q, k, v, out, lse, aux, causal, scale):  # TE reads the softmax Stats from aux[0]: lse goes there
    dq, dk, dv = libs.te_backward(libs.te_api(), *(_sbhd(t) for t in (dout, q, k, v, out)), vk.te_aux(lse, aux), causal,
                                  scale)
    return dq.permute(1, 2, 0, 3), dk.permute(1, 2, 0, 3), dv.permute(1, 2, 0, 3)


def _te_shape_check(call: KernelCall, dtype: torch.dtype, head_dim: int) -> str | None:
    api = libs.te_api()
    if call.varlen is not None:  # packed documents (thd): their count and the longest document
        return libs.te_fused_backend(api, call.varlen[0], call.q_heads, call.kv_heads, call.varlen[1], head_dim,
                                     call.causal, dtype, thd=True)[1]
    return libs.te_fused_backend(api, call.batch, call.q_heads, call.kv_heads, call.seq_len, head_dim, call.causal,
                                 dtype)[1]


def _varlen(name: str) -> dict[str, Any]:
    """The varlen fields of kernel `name`'s AttentionKernel."""
    fwd, bwd = vk.VARLEN.get(name, (None, None))
    return dict(varlen_fwd=fwd, varlen_bwd=bwd, no_varlen=vk.NO_VARLEN.get(name, ""),
                varlen_library=vk.flash_attn_varlen_reason if name == "flash_attn" else None)


_HALF = (torch.float16, torch.bfloat16)
KERNELS: dict[str, AttentionKernel] = {
    k.name: k
    for k in (
        AttentionKernel("cpu_flash", "cpu", (torch.float32, torch.float64, torch.bfloat16, torch.float16),
                        1 << 30, 1, True, _cpu_fwd, _cpu_bwd, varlen_fwd=cpu_varlen_forward,
                        varlen_bwd=cpu_varlen_backward),
        AttentionKernel("te_fused", "cuda", _HALF, 256, 8, True, _te_fwd, _te_bwd, libs.te_api, _te_shape_check,
                        **_varlen("te_fused")),
        AttentionKernel("flash_attn", "cuda", _HALF, 256, 8, True, _fa_fwd, _fa_bwd, libs.flash_attn_api,
                        **_varlen("flash_attn")),
        AttentionKernel("sdpa_flash", "cuda", _HALF, 256, 8, True, _sdpa_flash_fwd, _sdpa_flash_bwd,
                        **_varlen("sdpa_flash")),
        AttentionKernel("sdpa_cudnn", "cuda", _HALF, 128, 8, True, _sdpa_cudnn_fwd, _sdpa_cudnn_bwd,
                        **_varlen("sdpa_cudnn")),
        AttentionKernel("sdpa_efficient", "cuda", _HALF + (torch.float32,), 512, 8, False, _sdpa_eff_fwd, _sdpa_eff_bwd,
                        **_varlen("sdpa_efficient")),
    )
}
AUTO_ORDER = ("te_fused", "flash_attn", "sdpa_flash", "sdpa_efficient", "cpu_flash")


def stage_call(schedule, batch: int, seq_len: int, causal: bool, docs=None) -> KernelCall:
    """The kernel call of one stage of a UPipe schedule (attention/schedule.py): m query heads over the stage's
    KV slots, on all N tokens (packed documents: `docs`, a varlen.Documents, or None)."""
    a0, a1 = schedule.stages[0].kv_slots
    varlen = None if docs is None else (docs.count, docs.max_len)
    return KernelCall(batch, schedule.q_per_rank, a1 - a0, seq_len, causal, varlen)


def select_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, name: str | AttentionKernel | None = None,
                  call: KernelCall | None = None) -> AttentionKernel:
    """The kernel for these inputs: `name` (or a kernel object, e.g. a `planning_kernel`) if given, validated; else
    the first suitable one in AUTO_ORDER. `call` lets a kernel check the call's shape (TE's backend query)."""
    if name is not None:
        if isinstance(name, AttentionKernel):
            kernel = name
        elif name in KERNELS:
            kernel = KERNELS[name]
        else:
            raise ValueError(f"attention kernel {name!r} is unknown; choose one of {sorted(KERNELS)} or auto")
        reason = kernel.unsupported_reason(device.type, dtype, head_dim, call)
        if reason:
            raise ValueError(f"{reason}; choose another attention kernel or auto")
    else:
        reasons = []
        for candidate in (KERNELS[n] for n in AUTO_ORDER):
            if candidate.device_type != device.type:
                continue
            reason = candidate.unsupported_reason(device.type, dtype, head_dim, call)
            if reason is None:
                kernel = candidate
                break
            reasons.append(reason)
            _log_once(logging.INFO, f"megatron_upipe attention: not using {candidate.name}: {reason}")
        else:
            raise ValueError(f"no attention kernel supports these inputs: {'; '.join(reasons) or device.type}")
    api = kernel.library() if kernel.library is not None else None
    _log_once(logging.INFO, f"megatron_upipe attention kernel: {kernel.name} ({device.type}, {dtype}"
                            f"{', ' + api.describe() if api is not None else ''})")
    return kernel


@lru_cache(maxsize=None)
def _log_once(level: int, message: str) -> None:
    log.log(level, message)


def _expand(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t.repeat_interleave(rep, dim=1)  # [b, hkv, N, d] -> [b, hkv·rep, N, d]


def _varlen_call(kernel: AttentionKernel, docs, which: str):
    """The kernel's fixed-length call (docs None) or its varlen call with docs bound."""
    if docs is None:
        return getattr(kernel, which)
    call = getattr(kernel, f"varlen_{which}")
    if call is None:
        raise ValueError(f"kernel {kernel.name!r} has no variable-length (cu_seqlens) path: {kernel.no_varlen}")
    if which == "fwd":
        return lambda q, k, v, causal, scale: call(q, k, v, docs, causal, scale)
    return lambda dout, q, k, v, out, lse, aux, causal, scale: call(dout, q, k, v, out, lse, aux, docs, causal, scale)


def kernel_forward(kernel: AttentionKernel, q, k, v, causal: bool, scale: float, docs=None):
    """(out, lse, aux) for q [b, hq, N, d], k/v [b, hkv, N, d]; expands K/V for kernels without native GQA. With
    docs (varlen.Documents; b = 1) attention stays inside each packed document."""
    fwd = _varlen_call(kernel, docs, "fwd")
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and not kernel.native_gqa:
        return fwd(q, _expand(k, rep), _expand(v, rep), causal, scale)
    return fwd(q, k, v, causal, scale)


def kernel_backward(kernel: AttentionKernel, dout, q, k, v, out, lse, aux, causal: bool, scale: float, docs=None):
    """(dq, dk, dv) with dk/dv shaped like k/v [b, hkv, N, d]. Without native GQA the expanded K/V die before the
    expanded dK/dV are summed back: the peak is 2 expanded inputs + 2 expanded gradients at the kernel's end."""
    bwd = _varlen_call(kernel, docs, "bwd")
    b, hkv, n, d = k.shape
    rep = q.shape[1] // hkv
    if rep == 1 or kernel.native_gqa:
        return bwd(dout, q, k, v, out, lse, aux, causal, scale)
    ke, ve = _expand(k, rep), _expand(v, rep)
    dq, dk, dv = bwd(dout, q, ke, ve, out, lse, aux, causal, scale)
    del ke, ve
    dk = dk.view(b, hkv, rep, n, d).sum(2)  # [b, hkv·rep, N, d] -> [b, hkv, N, d]
    dv = dv.view(b, hkv, rep, n, d).sum(2)
    return dq, dk, dv


# ------------------------------------------------------------------------------------ planning stand-ins
# What each GPU kernel allocates at this interface (its meta/fake function; TE per its fused_attn.py), made on the
# inputs' device without computing: the planner runs the op on fake CPU tensors and counts these.
def _lse(q, n_cols: int, *trailing: int) -> torch.Tensor:  # float32 [b, hq, n_cols, *trailing]
    return torch.empty((q.shape[0], q.shape[1], n_cols, *trailing), dtype=torch.float32, device=q.device)


def _rng(q, *shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.int64, device=q.device)


def _bnhd(like: torch.Tensor) -> torch.Tensor:  # like's [b, h, N, d] shape with [b, N, h, d] memory
    b, h, n, d = like.shape
    return torch.empty((b, n, h, d), dtype=like.dtype, device=like.device).transpose(1, 2)


def _plan_like_inputs(dout, q, k, v, out, lse, aux, causal, scale):  # sdpa_flash, sdpa_cudnn, flash_attn
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _plan_sdpa_flash_fwd(q, k, v, causal, scale):
    return torch.empty_like(q), _lse(q, q.shape[2]), (_rng(q, 2), _rng(q))


def _plan_sdpa_cudnn_fwd(q, k, v, causal, scale):
    return torch.empty_like(q), _lse(q, q.shape[2], 1), (_rng(q), _rng(q))


def _plan_sdpa_eff_fwd(q, k, v, causal, scale):
    return _bnhd(q), _lse(q, -(-q.shape[2] // 32) * 32), (_rng(q), _rng(q))


def _plan_sdpa_eff_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    return _bnhd(q), _bnhd(k), _bnhd(v)


def _plan_fa_fwd(q, k, v, causal, scale):
    return torch.empty_like(q), _lse(q, q.shape[2]), _rng(q, 2)


def _plan_te_fwd(q, k, v, causal, scale):
    dense = [_sbhd(t) for t in (q, k, v)]  # the adapter's dense copies (none when the views are dense)
    stats = _lse(q, q.shape[2], 1)
    return torch.empty_like(dense[0]).permute(1, 2, 0, 3), stats, [stats, _rng(q, 2)]


def _plan_te_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    dense = [_sbhd(t) for t in (dout, q, k, v, out)]
    return tuple(torch.empty_like(t).permute(1, 2, 0, 3) for t in dense[1:4])


_PLANS: dict[str, tuple[Callable, Callable]] = {
    "sdpa_flash": (_plan_sdpa_flash_fwd, _plan_like_inputs),
    "sdpa_cudnn": (_plan_sdpa_cudnn_fwd, _plan_like_inputs),
    "sdpa_efficient": (_plan_sdpa_eff_fwd, _plan_sdpa_eff_bwd),
    "flash_attn": (_plan_fa_fwd, _plan_like_inputs),
    "te_fused": (_plan_te_fwd, _plan_te_bwd),
}


PLAN_AUTO_AS = "sdpa_flash"  # "auto" is planned as sdpa_flash: te_fused and flash_attn allocate the same bytes


@torch.library.custom_op("upipe_plan::attention_work", mutates_args=())
def attention_work(q: torch.Tensor, k: torch.Tensor, causal: bool, backward: bool) -> None:
    """Marks one attention-kernel call of a planning stand-in (q [b, h, Nq, d], k [b, h_kv, Nk, d]) for the
    planner's work counter (planner/step_time.py), which sees the op and its shapes; computes nothing."""


@attention_work.register_fake
def _(q, k, causal, backward) -> None:
    return None


def _counted(fwd: Callable, bwd: Callable) -> tuple[Callable, Callable]:
    def counted_fwd(q, k, v, causal, scale):
        attention_work(q, k, causal, False)
        return fwd(q, k, v, causal, scale)

    def counted_bwd(dout, q, k, v, out, lse, aux, causal, scale):
        attention_work(q, k, causal, True)
        return bwd(dout, q, k, v, out, lse, aux, causal, scale)

    return counted_fwd, counted_bwd


def planning_kernel(name: str) -> AttentionKernel:
    """A CPU stand-in for GPU kernel `name` ("auto": PLAN_AUTO_AS) for the planner's fake-tensor step: the same
    dtype, head-dim and GQA behaviour (K/V expansion included) as `name`, and fwd/bwd (and, for packed documents,
    varlen fwd/bwd: varlen_kernels.py) that allocate what it allocates at this interface. Kernel-internal workspace
    is not included (the planner adds it)."""
    name = PLAN_AUTO_AS if name == "auto" else name
    if name not in _PLANS:
        raise ValueError(f"attention kernel {name!r} has no planning stand-in; plan one of {sorted(_PLANS)} or auto")
    fwd, bwd = _counted(*_PLANS[name])
    vfwd, vbwd = vk.VARLEN_PLANS.get(name, (None, None))
    return dataclasses.replace(KERNELS[name], name=f"{name} (planned)", device_type="cpu", fwd=fwd, bwd=bwd,
                               library=None, shape_check=None, varlen_fwd=vfwd, varlen_bwd=vbwd,
                               varlen_library=None)
