"""The CUDA kernels' variable-length (packed documents, cu_seqlens) calls behind kernels.py's interface, and the
planner's allocation stand-ins for them.

    varlen_fwd(q, k, v, docs, causal, scale) -> (out, lse, aux)
    varlen_bwd(dout, q, k, v, out, lse, aux, docs, causal, scale) -> (dq, dk, dv)

Layout at this interface as for the fixed-length calls: q, out, dout [1, hq, N, d], k, v [1, hkv, N, d], views of
sequence-first buffers [N, 1, h, d] (b = 1 with documents); `docs` a varlen.Documents (int32 cu_seqlens on the
device, the longest document). The kernels take packed documents as [total = N, h, d] ("thd"), which is that same
memory: `_thd` is a view, no copy.

  sdpa_flash      aten._flash_attention_forward / _backward with cum_seq_q/k: PyTorch's own flash-attn 2 varlen
                  path (the one nested-tensor SDPA uses); lse [hq, N] float32; GQA native.
  sdpa_efficient  aten._efficient_attention_forward / _backward with cu_seqlens_q/k and [1, N, h, d] inputs (the
                  xformers-style block-diagonal call); lse [n, hq, longest document rounded up to 32] float32,
                  padded per document (n·longest can exceed N many times over: counted by its stand-in); K/V
                  expanded to the query heads (no native GQA), as for the fixed-length call.
  flash_attn      flash-attn 2's _flash_attn_varlen_forward / _backward (kernel_libraries.py binds them by
                  signature); lse [hq, N] (>= 2.6) or [n, hq, longest] (<= 2.5).
  te_fused        TransformerEngine's fused_attn_fwd / _bwd with qkv_layout thd_thd_thd and a padding(_causal) mask
                  (kernel_libraries.py); q, k, v, out, dout made dense [N, h, d] (TE derives strides from the layout);
                  Stats [N, hq, 1] with cuDNN >= 9.6, [n, hq, longest, 1] before. The backward's `lse` goes in as
                  the Stats (`te_aux`, shared with kernels.py's fixed-length call).
  sdpa_cudnn      none: aten's cuDNN op has a ragged call but no meta kernel to contract-check it, so it is skipped
                  for cu_seqlens (the automatic choice moves on with that reason).

Unverified on a GPU (none here): the SDPA calls are contract-checked on fake CUDA tensors against aten's meta kernels
(tests/test_cuda_contracts.py), flash-attn and TE through stand-in modules with each release's signature
(tests/test_kernels.py); none of these calls has run on a GPU.

The planning stand-ins allocate what each call allocates at this interface (out, lse, rng state; TE's dense copies;
gradients), kernel-internal workspace excluded, as kernels.py's fixed-length stand-ins do. flash_attn is planned
with the >= 2.6 lse and te_fused with cuDNN >= 9.6's [N, hq, 1] Stats (the current releases); the padded layouts of
older releases are larger when documents differ in length.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import kernel_libraries as libs

_aten = torch.ops.aten

NO_VARLEN = {"sdpa_cudnn": "aten's cuDNN attention has no meta kernel for its ragged call, so this adapter has no "
                           "checked varlen path; use te_fused, flash_attn, sdpa_flash or sdpa_efficient"}


def _thd(t: torch.Tensor) -> torch.Tensor:
    return t[0].transpose(0, 1)  # [1, h, N, d] view -> [N, h, d] view (b = 1: the same memory)


def _bhnd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).unsqueeze(0)  # [N, h, d] -> [1, h, N, d] view


def _mask_type(causal: bool) -> int:
    return 1 if causal else 0  # efficient attention's custom_mask_type: 1 = causal from the top left, 0 = none


# ------------------------------------------------------------------------------------------- SDPA flash
def _sdpa_flash_fwd(q, k, v, docs, causal, scale):
    cu, n = docs.cu_seqlens, docs.max_len
    out, lse, seed, offset, _ = _aten._flash_attention_forward(_thd(q), _thd(k), _thd(v), cu, cu, n, n, 0.0, causal,
                                                               False, scale=scale)  # out [N, hq, d], lse [hq, N]
    return _bhnd(out), lse, (seed, offset)


def _sdpa_flash_bwd(dout, q, k, v, out, lse, aux, docs, causal, scale):
    cu, n = docs.cu_seqlens, docs.max_len
    seed, offset = aux
    grads = _aten._flash_attention_backward(_thd(dout), _thd(q), _thd(k), _thd(v), _thd(out), lse, cu, cu, n, n, 0.0,
                                            causal, seed, offset, scale=scale)
    return tuple(_bhnd(g) for g in grads)


# --------------------------------------------------------------------------------------- SDPA efficient
def _bnhd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # [1, h, N, d] view <-> [1, N, h, d] view


def _sdpa_eff_fwd(q, k, v, docs, causal, scale):
    cu, n = docs.cu_seqlens, docs.max_len
    out, lse, seed, offset, _, _ = _aten._efficient_attention_forward(
        _bnhd(q), _bnhd(k), _bnhd(v), None, cu, cu, n, n, 0.0, _mask_type(causal), True, scale=scale
    )  # out [1, N, hq, d], lse [n_docs, hq, ceil32(n)]
    return _bnhd(out), lse, (seed, offset)


def _sdpa_eff_bwd(dout, q, k, v, out, lse, aux, docs, causal, scale):
    cu, n = docs.cu_seqlens, docs.max_len
    seed, offset = aux
    dq, dk, dv, _ = _aten._efficient_attention_backward(
        _bnhd(dout), _bnhd(q), _bnhd(k), _bnhd(v), None, _bnhd(out), cu, cu, n, n, lse, 0.0, seed, offset,
        _mask_type(causal), False, scale=scale)
    return _bnhd(dq), _bnhd(dk), _bnhd(dv)


# ----------------------------------------------------------------------------------------- flash-attn 2
def _fa_fwd(q, k, v, docs, causal, scale):
    out, lse, rng = libs.flash_attn_varlen_forward(libs.flash_attn_api(), _thd(q), _thd(k), _thd(v), docs.cu_seqlens,
                                                   docs.max_len, causal, scale)
    return _bhnd(out), lse, rng


def _fa_bwd(dout, q, k, v, out, lse, aux, docs, causal, scale):
    grads = libs.flash_attn_varlen_backward(libs.flash_attn_api(), *(_thd(t) for t in (dout, q, k, v, out)), lse, aux,
                                            docs.cu_seqlens, docs.max_len, causal, scale)
    return tuple(_bhnd(g) for g in grads)


def flash_attn_varlen_reason() -> str | None:
    api = libs.flash_attn_api()
    if isinstance(api, str):
        return api
    return api.varlen if isinstance(api.varlen, str) else None


# ------------------------------------------------------------------------------------- TransformerEngine
def _dense_thd(t: torch.Tensor) -> torch.Tensor:
    return _thd(t).contiguous()  # TE derives strides from the layout: dense [N, h, d] (a copy only for KV slices)


def _te_docs(docs):
    return docs.cu_seqlens, docs.count, docs.max_len


def _te_fwd(q, k, v, docs, causal, scale):
    out, aux, _ = libs.te_forward(libs.te_api(), *(_dense_thd(t) for t in (q, k, v)), causal, scale, _te_docs(docs))
    return _bhnd(out), aux[0], aux  # aux[0]: softmax Stats


def te_aux(lse: torch.Tensor, aux: list) -> list:
    """TE's aux_ctx_tensors for a backward with softmax statistics `lse`: fused_attn_bwd rebuilds the probabilities
    from aux_ctx_tensors[0], the Stats of the forward (F16_arbitrary_seqlen: float32 [b, hq, N, 1]; thd [T, hq, 1]
    or [n, hq, longest, 1]), so `lse` takes their place, in their shape and dtype; the rest (rng_state) stays. TE's
    own ring attention (context_parallel.py) hands its backward the merged lse the same way, [softmax_lse,
    rng_state]. The forward's own Stats (or a tensor like them: no copy) pass through as they are."""
    stats = aux[0]
    if tuple(lse.shape) not in (tuple(stats.shape), tuple(stats.shape[:-1])):
        raise ValueError(f"te_fused backward: lse {tuple(lse.shape)} is not laid out like the forward's softmax Stats "
                         f"{tuple(stats.shape)}")
    rows = lse.reshape(stats.shape)  # [..., N] (or Stats' shape) -> Stats' [..., N, 1] (a view when dense)
    return [rows.to(stats.dtype).contiguous(), *aux[1:]]


def _te_bwd(dout, q, k, v, out, lse, aux, docs, causal, scale):
    grads = libs.te_backward(libs.te_api(), *(_dense_thd(t) for t in (dout, q, k, v, out)), te_aux(lse, aux), causal,
                             scale, _te_docs(docs))
    return tuple(_bhnd(g) for g in grads[:3])


VARLEN: dict[str, tuple[Callable, Callable]] = {
    "sdpa_flash": (_sdpa_flash_fwd, _sdpa_flash_bwd),
    "sdpa_efficient": (_sdpa_eff_fwd, _sdpa_eff_bwd),
    "flash_attn": (_fa_fwd, _fa_bwd),
    "te_fused": (_te_fwd, _te_bwd),
}


# ------------------------------------------------------------------------------------ planning stand-ins
def _f32(*shape: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, device=like.device)


def _rng(like: torch.Tensor, *shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.int64, device=like.device)


def _plan_like_thd(dout, q, k, v, out, lse, aux, docs, causal, scale):  # sdpa_flash, flash_attn
    return tuple(_bhnd(torch.empty_like(_thd(t))) for t in (q, k, v))


def _plan_sdpa_flash_fwd(q, k, v, docs, causal, scale):
    hq, n = q.shape[1], q.shape[2]
    return _bhnd(torch.empty_like(_thd(q))), _f32(hq, n, like=q), (_rng(q, 2), _rng(q))


def _plan_fa_fwd(q, k, v, docs, causal, scale):
    hq, n = q.shape[1], q.shape[2]
    return _bhnd(torch.empty_like(_thd(q))), _f32(hq, n, like=q), _rng(q, 2)


def _plan_sdpa_eff_fwd(q, k, v, docs, causal, scale):
    _, hq, n, d = q.shape
    out = torch.empty((1, n, hq, d), dtype=q.dtype, device=q.device)  # [1, N, hq, d]
    return _bnhd(out), _f32(docs.count, hq, -(-docs.max_len // 32) * 32, like=q), (_rng(q), _rng(q))


def _plan_sdpa_eff_bwd(dout, q, k, v, out, lse, aux, docs, causal, scale):
    return tuple(_bnhd(torch.empty_like(_bnhd(t))) for t in (q, k, v))


def _plan_te_fwd(q, k, v, docs, causal, scale):
    dense = [_dense_thd(t) for t in (q, k, v)]  # the adapter's dense copies (none when the views are dense)
    stats = _f32(q.shape[2], q.shape[1], 1, like=q)  # [N, hq, 1]
    return _bhnd(torch.empty_like(dense[0])), stats, [stats, _rng(q, 2)]


def _plan_te_bwd(dout, q, k, v, out, lse, aux, docs, causal, scale):
    dense = [_dense_thd(t) for t in (dout, q, k, v, out)]
    return tuple(_bhnd(torch.empty_like(t)) for t in dense[1:4])


VARLEN_PLANS: dict[str, tuple[Callable, Callable]] = {
    "sdpa_flash": (_plan_sdpa_flash_fwd, _plan_like_thd),
    "sdpa_efficient": (_plan_sdpa_eff_fwd, _plan_sdpa_eff_bwd),
    "flash_attn": (_plan_fa_fwd, _plan_like_thd),
    "te_fused": (_plan_te_fwd, _plan_te_bwd),
}
