"""flash-attn 2 and TransformerEngine fused attention, across their versions, for kernels.py's explicit fwd/bwd.

Both libraries hand out the softmax statistics (lse) only through low-level entry points whose signatures changed
between releases (read from their sources, flash_attn/flash_attn_interface.py and
transformer_engine/pytorch/cpp_extensions/fused_attn.py, at each release tag):

flash-attn `flash_attn.flash_attn_interface._flash_attn_forward / _flash_attn_backward`, tensors [b, N, h, d]:
  2.0-2.5  (q, k, v, dropout_p, softmax_scale, causal, window_size (2.3+), alibi_slopes (2.4+), return_softmax)
           -> (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state); the backward takes (dout, q, k, v, out,
           softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
           rng_state) and writes dq, dk, dv
  2.6      softcap after window_size, in both
  2.7-2.8  torch custom ops; window_size split into window_size_left / window_size_right; the forward returns
           (out, softmax_lse, S_dmask, rng_state), the backward softmax_d only (dq, dk, dv still written in place)
  varlen   `_flash_attn_varlen_forward / _backward` (packed documents, tensors [total, h, d]): the same parameters
           plus cu_seqlens_q/k (int32 [n + 1]) and max_seqlen_q/k, block_table (required in 2.5), leftpad_k and
           seqused_k (2.6+), zero_tensors (2.7+); same result tuples. softmax_lse is [n, h, max_seqlen_q] (padded)
           up to 2.5 and [h, total] from 2.6 (flash_api.cpp's "unpadded_lse", introduced with softcap)
TransformerEngine `transformer_engine.pytorch.cpp_extensions.fused_attn.fused_attn_fwd / fused_attn_bwd`, sbhd:
  1.x      qkv_dtype (a TE DType) where 2.x takes fake_dtype (a torch dtype); the backward also dqkv_dtype
  2.0-2.14 fused_attn_bwd(..., fake_dtype, dqkv_dtype, aux_ctx_tensors, fused_attention_backend, ...)
  2.15+    no dqkv_dtype; new o_format / do_format / dqkv_layout whose defaults ("sbhd", "sbh3d") must be
           overridden for separate sbhd q, k, v
  thd      packed documents: qkv_layout "thd_thd_thd" (dense [total, h, d] each), o/do format "thd",
           attn_mask_type "padding_causal" / "padding" (TE requires a padding mask for ragged inputs),
           cu_seqlens_q/kv [n + 1] int32, cu_seqlens_q/kv_padded = the same (no padding between documents, as
           TE's DotProductAttention sets them), max_seqlen = the longest document. Softmax stats [total, h, 1] with
           cuDNN >= 9.6 (not sm120), [n, h, max_seqlen, 1] before (fused_attn_f16_arbitrary_seqlen.cu)
Each `*_api()` reads the installed version (importlib.metadata), imports the entry points (an ABI-broken wheel
fails here, at selection, not in the first step), reads their parameter names with `inspect.signature`, and the
calls pass by keyword exactly the parameters the installed version takes. A required parameter this module does
not know makes the library unusable, with that reason. Whether TE's fused backend supports a call's shape is TE's
own answer (`get_attention_backend`, which ends in `tex.get_fused_attn_backend`).

Unverified on a GPU here (no GPU, neither library installed): tests/test_kernels.py drives both adapters (fixed
length and varlen / thd) through stand-in modules with each version's signature; tools/gpu_check.sh runs the
fixed-length ones for real where they are installed. The varlen / thd calls have never run on a GPU.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import re
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _major(version: str) -> int:
    m = re.match(r"\s*(\d+)", version)
    return int(m.group(1)) if m else -1


def _parameters(fn: Callable) -> dict[str, inspect.Parameter]:
    # torch.library.custom_op (flash-attn >= 2.7) wraps the Python function; its own signature is (*args, **kwargs)
    target = getattr(fn, "_init_fn", fn)
    return dict(inspect.signature(target).parameters)


def _keywords(what: str, fn: Callable, known: set[str]) -> tuple[str, ...] | str:
    """The parameters of `fn` to pass by keyword (those in `known`), or why it cannot be called."""
    params = _parameters(fn)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        return f"{what} has a (*args, **kwargs) signature, so its parameters cannot be checked"
    unknown = [n for n, p in params.items() if p.default is p.empty and n not in known]
    if unknown:
        return f"{what} requires parameters this version of megatron_upipe does not know: {unknown}"
    return tuple(n for n in params if n in known)


def _import_root(module: str, package_label: str, version: str | None):
    """Import `module` (the library's root package); None if it is not installed, else the module or a reason."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return None
        return f"{package_label} {version or '?'} is installed but cannot be imported ({_first_line(e)})"
    except Exception as e:  # noqa: BLE001 - an ABI-broken wheel raises ImportError/OSError/RuntimeError
        return f"{package_label} {version or '?'} is installed but cannot be imported ({_first_line(e)})"


# ------------------------------------------------------------------------------------------------ flash-attn
_FA_CONSTANTS: dict[str, Any] = dict(
    dropout_p=0.0, window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
    return_softmax=False, deterministic=False,
)
_FA_FWD_KNOWN = set(_FA_CONSTANTS) | {"q", "k", "v", "softmax_scale", "causal"}
_FA_BWD_KNOWN = set(_FA_CONSTANTS) | {"dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale",
                                      "causal", "rng_state"}
_FA_VARLEN_CONSTANTS: dict[str, Any] = dict(block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False)
_FA_LENGTHS = {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
_FA_VARLEN_FWD_KNOWN = _FA_FWD_KNOWN | set(_FA_VARLEN_CONSTANTS) | _FA_LENGTHS
_FA_VARLEN_BWD_KNOWN = _FA_BWD_KNOWN | {"zero_tensors"} | _FA_LENGTHS


@dataclass(frozen=True, eq=False)
class FlashAttnVarlen:
    forward: Callable
    backward: Callable
    forward_args: tuple[str, ...]
    backward_args: tuple[str, ...]
    padded_lse: bool  # softmax_lse [n, h, max_seqlen] (<= 2.5) rather than [h, total] (>= 2.6)


@dataclass(frozen=True, eq=False)  # hashed by identity (lru_cache keys)
class FlashAttnAPI:
    version: str
    forward: Callable
    backward: Callable
    forward_args: tuple[str, ...]
    backward_args: tuple[str, ...]
    lse_index: int  # softmax_lse's place in the forward's result: 1 (>= 2.7) or 5 (<= 2.6); rng_state is last
    varlen: FlashAttnVarlen | str = "no variable-length entry points"  # or why they cannot be used

    def describe(self) -> str:
        return f"flash-attn {self.version} ({'>= 2.7' if self.lse_index == 1 else '<= 2.6'} entry points)"


@functools.lru_cache(maxsize=None)
def flash_attn_api() -> FlashAttnAPI | str:
    """The installed flash-attn's entry points, or why it cannot be used (cached: the environment's fact)."""
    version = _dist_version("flash_attn", "flash-attn")
    root = _import_root("flash_attn", "flash-attn", version)
    if root is None:
        return "the flash-attn package is not installed"
    if isinstance(root, str):
        return root + "; reinstall a flash-attn wheel built for this torch and CUDA"
    version = version or str(getattr(root, "__version__", "?"))
    if _major(version) != 2:
        return f"flash-attn {version} is installed; megatron_upipe supports flash-attn 2.x"
    try:
        fai = importlib.import_module("flash_attn.flash_attn_interface")
        fwd, bwd = fai._flash_attn_forward, fai._flash_attn_backward
    except Exception as e:  # noqa: BLE001 - flash_attn_2_cuda fails to load here when the wheel's ABI is wrong
        return (f"flash-attn {version} is installed but its kernels cannot be loaded ({_first_line(e)}); reinstall "
                f"a wheel built for this torch and CUDA")
    fwd_args = _keywords(f"flash-attn {version} _flash_attn_forward", fwd, _FA_FWD_KNOWN)
    bwd_args = _keywords(f"flash-attn {version} _flash_attn_backward", bwd, _FA_BWD_KNOWN)
    for args in (fwd_args, bwd_args):
        if isinstance(args, str):
            return args
    if "window_size_left" in fwd_args:
        lse_index = 1
    elif "window_size" in fwd_args or "return_softmax" in fwd_args:
        lse_index = 5
    else:
        return f"flash-attn {version}: _flash_attn_forward{tuple(fwd_args)} matches no known release"
    return FlashAttnAPI(version, fwd, bwd, fwd_args, bwd_args, lse_index, _flash_attn_varlen(fai, version))


def _flash_attn_varlen(fai, version: str) -> FlashAttnVarlen | str:
    """The varlen entry points of an installed flash-attn whose fixed-length ones work, or why they cannot be used."""
    fwd, bwd = (getattr(fai, f"_flash_attn_varlen_{n}", None) for n in ("forward", "backward"))
    if fwd is None or bwd is None:
        return f"flash-attn {version} has no _flash_attn_varlen_forward/_backward"
    fwd_args = _keywords(f"flash-attn {version} _flash_attn_varlen_forward", fwd, _FA_VARLEN_FWD_KNOWN)
    bwd_args = _keywords(f"flash-attn {version} _flash_attn_varlen_backward", bwd, _FA_VARLEN_BWD_KNOWN)
    for args in (fwd_args, bwd_args):
        if isinstance(args, str):
            return args
    missing = _FA_LENGTHS - set(fwd_args)
    if missing:
        return f"flash-attn {version} _flash_attn_varlen_forward takes no {sorted(missing)}"
    return FlashAttnVarlen(fwd, bwd, fwd_args, bwd_args, padded_lse="softcap" not in fwd_args)


def flash_attn_forward(api: FlashAttnAPI, q, k, v, causal: bool, scale: float):
    """q [b, N, hq, d], k/v [b, N, hkv, d] (last dim contiguous) -> (out [b, N, hq, d], lse [b, hq, N], rng)."""
    values = dict(_FA_CONSTANTS, q=q, k=k, v=v, softmax_scale=scale, causal=causal)
    res = api.forward(**{n: values[n] for n in api.forward_args})
    return res[0], res[api.lse_index], res[-1]


def flash_attn_backward(api: FlashAttnAPI, dout, q, k, v, out, lse, rng, causal: bool, scale: float):
    """Gradients (dq, dk, dv) laid out like q, k, v, written by flash-attn into buffers allocated here."""
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    values = dict(_FA_CONSTANTS, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                  softmax_scale=scale, causal=causal, rng_state=rng)
    api.backward(**{n: values[n] for n in api.backward_args})
    return dq, dk, dv


def flash_attn_varlen_forward(api: FlashAttnAPI, q, k, v, cu_seqlens, max_seqlen: int, causal: bool, scale: float):
    """Packed documents: q [N, hq, d], k/v [N, hkv, d] (last dim contiguous), cu_seqlens int32 [n + 1] on q's device
    -> (out [N, hq, d], lse ([hq, N]; [n, hq, max_seqlen] up to 2.5), rng)."""
    vl = api.varlen
    values = dict(_FA_CONSTANTS, **_FA_VARLEN_CONSTANTS, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens,
                  cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, softmax_scale=scale,
                  causal=causal)
    res = vl.forward(**{n: values[n] for n in vl.forward_args})
    return res[0], res[api.lse_index], res[-1]


def flash_attn_varlen_backward(api: FlashAttnAPI, dout, q, k, v, out, lse, rng, cu_seqlens, max_seqlen: int,
                               causal: bool, scale: float):
    """(dq, dk, dv) laid out like q, k, v ([N, h, d]), written by flash-attn into buffers allocated here."""
    vl = api.varlen
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    values = dict(_FA_CONSTANTS, **_FA_VARLEN_CONSTANTS, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq,
                  dk=dk, dv=dv, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                  max_seqlen_k=max_seqlen, softmax_scale=scale, causal=causal, rng_state=rng)
    vl.backward(**{n: values[n] for n in vl.backward_args})
    return dq, dk, dv


# ---------------------------------------------------------------------------------------- TransformerEngine
_TE_LAYOUT = "sbhd_sbhd_sbhd"
_TE_THD_LAYOUT = "thd_thd_thd"
_TE_FWD_KNOWN = {"is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v",
                 "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                 "fake_dtype", "qkv_dtype", "fused_attention_backend", "attn_scale", "dropout", "qkv_layout",
                 "o_format", "attn_bias_type", "attn_mask_type", "window_size"}
_TE_BWD_KNOWN = (_TE_FWD_KNOWN - {"is_training"}) | {"o", "d_o", "dqkv_dtype", "aux_ctx_tensors", "do_format",
                                                     "dqkv_layout"}


@dataclass(frozen=True, eq=False)  # hashed by identity (lru_cache keys)
class TEAPI:
    version: str
    forward: Callable
    backward: Callable
    forward_args: tuple[str, ...]
    backward_args: tuple[str, ...]
    te_dtype: Any  # torch dtype -> TE DType (transformer_engine.pytorch.constants.TE_DType)
    get_attention_backend: Callable
    attention_params: type  # TE's AttentionParams dataclass

    def describe(self) -> str:
        return f"TransformerEngine {self.version}"


def _te_backend_query():
    """(get_attention_backend, AttentionParams): in attention/dot_product_attention/utils.py since TE 2.4, in the
    single attention.py module before."""
    for module in ("transformer_engine.pytorch.attention.dot_product_attention.utils",
                   "transformer_engine.pytorch.attention"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        if hasattr(mod, "get_attention_backend") and hasattr(mod, "AttentionParams"):
            return mod.get_attention_backend, mod.AttentionParams
    raise ImportError("no get_attention_backend/AttentionParams in transformer_engine.pytorch.attention")


@functools.lru_cache(maxsize=None)
def te_api() -> TEAPI | str:
    """The installed TransformerEngine's fused-attention entry points, or why they cannot be used (cached)."""
    version = _dist_version("transformer_engine", "transformer-engine", "transformer_engine_torch")
    root = _import_root("transformer_engine", "TransformerEngine", version)
    if root is None:
        return "the transformer_engine package is not installed"
    if isinstance(root, str):
        return root
    version = version or str(getattr(root, "__version__", "?"))
    try:
        fa = importlib.import_module("transformer_engine.pytorch.cpp_extensions.fused_attn")
        te_dtype = importlib.import_module("transformer_engine.pytorch.constants").TE_DType
        query, params_cls = _te_backend_query()
        fwd, bwd = fa.fused_attn_fwd, fa.fused_attn_bwd
    except Exception as e:  # noqa: BLE001 - a TE build that does not match torch/CUDA fails here
        return f"TransformerEngine {version}: fused attention cannot be imported ({_first_line(e)})"
    fwd_args = _keywords(f"TransformerEngine {version} fused_attn_fwd", fwd, _TE_FWD_KNOWN)
    bwd_args = _keywords(f"TransformerEngine {version} fused_attn_bwd", bwd, _TE_BWD_KNOWN)
    for args in (fwd_args, bwd_args):
        if isinstance(args, str):
            return args
    return TEAPI(version, fwd, bwd, fwd_args, bwd_args, te_dtype, query, params_cls)


def _te_mask(causal: bool, thd: bool = False) -> tuple[str, tuple[int, int]]:
    # TE's DotProductAttention pairs the causal mask with window (-1, 0), no mask with (-1, -1); ragged (thd) inputs
    # need the padding variants
    if thd:
        return ("padding_causal", (-1, 0)) if causal else ("padding", (-1, -1))
    return ("causal", (-1, 0)) if causal else ("no_mask", (-1, -1))


@functools.lru_cache(maxsize=256)
def te_fused_backend(api: TEAPI, batch: int, q_heads: int, kv_heads: int, seq_len: int, head_dim: int, causal: bool,
                     dtype: torch.dtype, thd: bool = False):
    """(TE's fused-attention sub-backend for this call (sbhd q, k, v, no bias, no dropout; with thd, packed
    documents: batch = their count, seq_len = the longest), None) or (None, why there is none)."""
    mask, window = _te_mask(causal, thd)
    layout = _TE_THD_LAYOUT if thd else _TE_LAYOUT
    wanted = dict(qkv_type=torch.Tensor, qkv_dtype=dtype, qkv_layout=layout, batch_size=batch, num_heads=q_heads,
                  num_gqa_groups=kv_heads, max_seqlen_q=seq_len, max_seqlen_kv=seq_len, head_dim_qk=head_dim,
                  head_dim_v=head_dim, head_dim=head_dim, attn_mask_type=mask, window_size=window,
                  bottom_right_diagonal=False, attention_dropout=0.0, is_training=True, fp8=False,
                  pad_between_seqs=False)
    names = {f.name for f in fields(api.attention_params)}
    try:
        result = api.get_attention_backend(api.attention_params(**{k: v for k, v in wanted.items() if k in names}))
    except Exception as e:  # noqa: BLE001 - reported as the reason to fall back
        return None, f"{api.describe()}: get_attention_backend failed ({_first_line(e)})"
    # (use_flash, [flash_backend,] use_fused, fused_backend, use_unfused, available_backends): available_backends
    # [flash, fused, unfused] says what supports the inputs before TE's own preference between flash and fused
    backend, available = result[-3], result[-1]
    if not available[1] or backend is None:
        what = f"{batch} documents of up to {seq_len} tokens (thd)" if thd else f"b={batch}, N={seq_len}"
        return None, (f"{api.describe()} has no fused attention backend for {what}, heads {q_heads}/{kv_heads}, "
                      f"d={head_dim}, {dtype}, {mask} (its get_attention_backend; NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 "
                      f"shows why)")
    return backend, None


def _te_call_values(api: TEAPI, q, k, v, causal: bool, scale: float, docs=None) -> dict[str, Any]:
    """Keyword values of a fused_attn_fwd/bwd call: sbhd q, k, v, or with docs = (cu_seqlens int32 [n + 1] on q's
    device, n, longest document) thd q, k, v of packed documents."""
    if docs is None:
        n, b = q.shape[0], q.shape[1]
        backend, why_not = te_fused_backend(api, b, q.shape[2], k.shape[2], n, q.shape[3], causal, q.dtype)
        cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=q.device)  # [b + 1] offsets (no padding)
        layout, fmt, max_len, padded = _TE_LAYOUT, "sbhd", n, None
    else:
        cu, count, max_len = docs
        backend, why_not = te_fused_backend(api, count, q.shape[1], k.shape[1], max_len, q.shape[2], causal, q.dtype,
                                            thd=True)
        layout, fmt, padded = _TE_THD_LAYOUT, "thd", cu  # no padding between documents: offsets = cu_seqlens
    if why_not:
        raise RuntimeError(why_not)
    mask, window = _te_mask(causal, docs is not None)
    return dict(max_seqlen_q=max_len, max_seqlen_kv=max_len, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded, q=q, k=k, v=v,
                fake_dtype=q.dtype, qkv_dtype=api.te_dtype[q.dtype], dqkv_dtype=api.te_dtype[q.dtype],
                fused_attention_backend=backend, attn_scale=scale, dropout=0.0, qkv_layout=layout,
                o_format=fmt, do_format=fmt, dqkv_layout=layout, attn_bias_type="no_bias",
                attn_mask_type=mask, window_size=window)


def te_forward(api: TEAPI, q, k, v, causal: bool, scale: float, docs=None):
    """q [N, b, hq, d], k/v [N, b, hkv, d], contiguous -> (out [N, b, hq, d], aux list: [Stats [b, hq, N, 1]
    float32, rng_state, ...], cu_seqlens). With docs (see `_te_call_values`): q [N, hq, d], k/v [N, hkv, d]
    contiguous (thd) -> out [N, hq, d], Stats [N, hq, 1] (cuDNN >= 9.6) or [n, hq, longest, 1]."""
    values = dict(_te_call_values(api, q, k, v, causal, scale, docs), is_training=True)
    res = api.forward(**{n: values[n] for n in api.forward_args})
    return res[0], list(res[1]), values["cu_seqlens_q"]


def te_backward(api: TEAPI, dout, q, k, v, out, aux: list, causal: bool, scale: float, docs=None):
    """(dq, dk, dv) in sbhd (with docs: thd), like q, k, v."""
    values = dict(_te_call_values(api, q, k, v, causal, scale, docs), o=out, d_o=dout, aux_ctx_tensors=aux)
    res = api.backward(**{n: values[n] for n in api.backward_args})
    return res[0], res[1], res[2]
