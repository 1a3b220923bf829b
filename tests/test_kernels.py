"""Local attention kernels: each available one against the float64 reference (forward and explicit backward), and
the flash-attn / TransformerEngine adapters across those libraries' versions.

On this project's CPU machines only `cpu_flash` runs for real; the CUDA kernels (PyTorch SDPA ops, flash-attn,
TransformerEngine) are exercised by the same test wherever CUDA and the package are present. The library adapters
are checked here against stand-in modules injected into sys.modules: each has the exact parameter list of one
release's entry point (read from flash_attn/flash_attn_interface.py and TE's cpp_extensions/fused_attn.py at
the release tags) and computes attention with aten's CPU flash kernel, so a wrong argument, a wrong result index
or a wrong layout fails against the float64 reference.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
from typing import List, Optional, Tuple

import pytest
import torch

from megatron_upipe.attention import kernel_libraries as libs
from megatron_upipe.attention import kernels as K
from megatron_upipe.attention.kernels import (
    KERNELS, KernelCall, kernel_backward, kernel_forward, planning_kernel, select_kernel,
)

_aten = torch.ops.aten
CUDA = torch.device("cuda")  # selection only: nothing here touches a GPU


def _available(name: str) -> bool:
    k = KERNELS[name]
    if k.device_type == "cuda" and not torch.cuda.is_available():
        return False
    return k.unsupported_reason(k.device_type, k.dtypes[0], 64) is None


def _reference(q, k, v, causal, scale):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ vv, (q, k, v)


def _check_against_reference(kernel, device, dtype, tol, hq=4, hkv=2):
    gen = torch.Generator().manual_seed(0)
    b, n, d = 2, 37, 16
    # sequence-first buffers viewed as [b, h, N, d], as the stage loop passes them
    q, k, v, do = (torch.randn(n, b, h, d, generator=gen).to(device, dtype).permute(1, 2, 0, 3)
                   for h in (hq, hkv, hkv, hq))
    for causal in (True, False):
        out, lse, aux = kernel_forward(kernel, q, k, v, causal, 0.3)
        dq, dk, dv = kernel_backward(kernel, do, q, k, v, out, lse, aux, causal, 0.3)
        ref, ins = _reference(q.cpu(), k.cpu(), v.cpu(), causal, 0.3)
        grads = torch.autograd.grad(ref, ins, do.cpu().double())
        for got, want in zip((out, dq, dk, dv), (ref, *grads)):
            assert got.shape == want.shape
            err = ((got.cpu().double() - want).norm() / want.norm()).item()
            assert err < tol, (kernel.name, causal, err)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_matches_reference(name):
    if not _available(name):
        k = KERNELS[name]
        pytest.skip(k.unsupported_reason(k.device_type, k.dtypes[0], 64) or f"{name} needs {k.device_type}")
    kernel = KERNELS[name]
    dtype = torch.float32 if torch.float32 in kernel.dtypes else torch.bfloat16
    _check_against_reference(kernel, torch.device(kernel.device_type), dtype, 1e-5 if dtype == torch.float32 else 2e-2)


def test_expanded_gqa_path_matches_reference():
    """The K/V expansion and dK/dV sum-back (kernels without native GQA, sdpa_efficient) on CPU."""
    assert not KERNELS["sdpa_efficient"].native_gqa
    expanding = dataclasses.replace(KERNELS["cpu_flash"], native_gqa=False)
    _check_against_reference(expanding, torch.device("cpu"), torch.float64, 1e-12, hq=6, hkv=2)


def test_auto_selection_on_cpu_is_cpu_flash():
    assert select_kernel(torch.device("cpu"), torch.float32, 64).name == "cpu_flash"
    assert select_kernel(torch.device("cpu"), torch.bfloat16, 128, "cpu_flash").name == "cpu_flash"


def test_gqa_native_kernels():
    # flash-attn 2 (also inside aten's flash op), cuDNN's graph and TE take hkv < hq; aten's efficient op does not
    assert {n for n, k in KERNELS.items() if k.native_gqa} == {"cpu_flash", "te_fused", "flash_attn", "sdpa_flash",
                                                               "sdpa_cudnn"}


# ------------------------------------------------------------------------- stand-in library modules
def _cpu_attention(q, k, v, causal, scale):
    """[b, h, N, d] views -> (out, lse [b, hq, N]) by aten's CPU flash kernel (GQA native)."""
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_attention_backward(dout, q, k, v, out, lse, causal, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _bhnd(*ts):  # [b, N, h, d] <-> [b, h, N, d]
    return [t.transpose(1, 2) for t in ts]


@pytest.fixture
def fresh(monkeypatch):
    """Forget cached library probes and logged messages; hide the real flash-attn and TE (where installed) so only
    the stand-ins a test installs exist; undo it all afterwards."""
    libs.flash_attn_api.cache_clear()
    libs.te_api.cache_clear()
    libs.te_fused_backend.cache_clear()
    K._log_once.cache_clear()
    for name in list(sys.modules):
        if name.startswith(("flash_attn.", "transformer_engine.")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # "not installed" until a test installs a stand-in
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    yield monkeypatch
    libs.flash_attn_api.cache_clear()
    libs.te_api.cache_clear()
    libs.te_fused_backend.cache_clear()
    K._log_once.cache_clear()


def _install(monkeypatch, modules: dict[str, dict]):
    for name, attrs in modules.items():
        mod = types.ModuleType(name)
        for k, v in attrs.items():
            setattr(mod, k, v)
        monkeypatch.setitem(sys.modules, name, mod)


# flash-attn 2.5.x (flash_attn_interface.py at v2.5.9): window_size tuple, 8-tuple result
def _fa25_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    assert dropout_p == 0.0 and tuple(window_size) == (-1, -1) and alibi_slopes is None and not return_softmax
    out, lse = _cpu_attention(*_bhnd(q, k, v), causal, softmax_scale)
    (out,) = _bhnd(out)
    return out, q, k, v, out, lse, None, torch.tensor([7, 0])


def _fa25_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, deterministic, rng_state=None):
    assert rng_state.tolist() == [7, 0], "the forward's rng_state must come back"
    grads = _cpu_attention_backward(*_bhnd(dout, q, k, v, out), softmax_lse, causal, softmax_scale)
    for buf, g in zip((dq, dk, dv), _bhnd(*grads)):
        buf.copy_(g)
    return dq, dk, dv, None


# flash-attn 2.6.x (v2.6.3): softcap after window_size
def _fa26_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    assert softcap == 0.0
    return _fa25_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax)


def _fa26_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                   softcap, alibi_slopes, deterministic, rng_state=None):
    return _fa25_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                          alibi_slopes, deterministic, rng_state)


# flash-attn 2.7-2.8 (v2.8.3): torch custom ops, split window, 4-tuple result, backward returns softmax_d only
@torch.library.custom_op("upipe_test_fa27::fwd", mutates_args=())
def _fa27_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                  causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                  alibi_slopes: Optional[torch.Tensor], return_softmax: bool
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert (window_size_left, window_size_right, softcap, return_softmax) == (-1, -1, 0.0, False)
    out, lse = _cpu_attention(*_bhnd(q, k, v), causal, softmax_scale)
    return _bhnd(out)[0].contiguous(), lse.contiguous(), torch.empty(0), torch.tensor([7, 0])


@torch.library.custom_op("upipe_test_fa27::bwd", mutates_args=("dq", "dk", "dv"))
def _fa27_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                   dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
                   window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                   deterministic: bool, rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    _fa25_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, (-1, -1), None,
                   deterministic, rng_state)
    return torch.empty(0)


FLASH_ATTN_RELEASES = {"2.5.9": (_fa25_forward, _fa25_backward), "2.6.3": (_fa26_forward, _fa26_backward),
                       "2.8.3": (_fa27_forward, _fa27_backward)}


def _install_flash_attn(monkeypatch, version, fwd, bwd):
    _install(monkeypatch, {"flash_attn": {"__version__": version, "__path__": []},
                           "flash_attn.flash_attn_interface": {"_flash_attn_forward": fwd,
                                                               "_flash_attn_backward": bwd}})


@pytest.mark.parametrize("version", sorted(FLASH_ATTN_RELEASES))
def test_flash_attn_adapter_for_each_release(fresh, version):
    _install_flash_attn(fresh, version, *FLASH_ATTN_RELEASES[version])
    api = libs.flash_attn_api()
    assert isinstance(api, libs.FlashAttnAPI), api
    assert api.lse_index == (1 if version >= "2.7" else 5)
    _check_against_reference(KERNELS["flash_attn"], torch.device("cpu"), torch.float32, 1e-5)
    assert select_kernel(CUDA, torch.bfloat16, 128).name == "flash_attn"  # no TE here: first in auto order


def _fa_unknown_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, sink_tokens, return_softmax):
    raise AssertionError("must not be called")


def test_flash_attn_with_an_unknown_signature_falls_back_with_a_reason(fresh, caplog):
    _install_flash_attn(fresh, "2.9.0", _fa_unknown_forward, _fa25_backward)
    with caplog.at_level(logging.INFO, logger="megatron_upipe.attention.kernels"):
        chosen = select_kernel(CUDA, torch.bfloat16, 128)
        select_kernel(CUDA, torch.bfloat16, 128)
    assert chosen.name == "sdpa_flash"
    why = [r.getMessage() for r in caplog.records if "not using flash_attn" in r.getMessage()]
    assert len(why) == 1 and "sink_tokens" in why[0] and "2.9.0" in why[0], why  # logged once, with the reason
    with pytest.raises(ValueError, match="flash_attn.*sink_tokens.*choose another attention kernel"):
        select_kernel(CUDA, torch.bfloat16, 128, "flash_attn")


def test_flash_attn_with_broken_kernels_or_another_major_falls_back(fresh):
    _install(fresh, {"flash_attn": {"__version__": "2.7.4", "__path__": []}})
    fresh.setitem(sys.modules, "flash_attn.flash_attn_interface", None)  # import fails like an ABI-broken wheel
    reason = KERNELS["flash_attn"].unsupported_reason("cuda", torch.bfloat16, 128)
    assert "2.7.4" in reason and "cannot be loaded" in reason and "reinstall" in reason
    assert select_kernel(CUDA, torch.bfloat16, 128).name == "sdpa_flash"
    libs.flash_attn_api.cache_clear()
    _install_flash_attn(fresh, "1.0.9", _fa25_forward, _fa25_backward)
    assert "supports flash-attn 2.x" in KERNELS["flash_attn"].unsupported_reason("cuda", torch.bfloat16, 128)


def test_not_installed_is_a_reason_not_an_error(fresh):
    assert libs.flash_attn_api() == "the flash-attn package is not installed"
    assert libs.te_api() == "the transformer_engine package is not installed"
    assert select_kernel(CUDA, torch.float16, 64).name == "sdpa_flash"
    with pytest.raises(ValueError, match="te_fused.*transformer_engine package is not installed"):
        select_kernel(CUDA, torch.float16, 64, "te_fused")


# -------------------------------------------------------------------- TransformerEngine stand-ins
TE_DTYPE = {torch.bfloat16: "kBFloat16", torch.float16: "kFloat16", torch.float32: "kFloat32"}
CALLS: list[tuple[str, dict]] = []


def _te_attention(kw):
    """sbhd q, k, v -> (out, [Stats [b, h, N, 1], rng]); thd (packed documents) -> (out [T, h, d], [Stats [T, h, 1]
    (cuDNN >= 9.6's ragged stats), rng]), per document."""
    causal, scale = _check_te_common(kw), kw["attn_scale"]
    q, k, v = kw["q"], kw["k"], kw["v"]
    if kw["qkv_layout"] == "thd_thd_thd":
        out, lse = _per_document_attention(q, k, v, kw["cu_seqlens_q"], causal, scale)
        return out, [lse.t().unsqueeze(-1).contiguous(), torch.tensor([3, 0])]
    out, lse = _cpu_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), causal, scale)
    return out.permute(2, 0, 1, 3).contiguous(), [lse.unsqueeze(-1), torch.tensor([3, 0])]


def _te_attention_backward(kw):
    causal, scale, aux = _check_te_common(kw), kw["attn_scale"], kw["aux_ctx_tensors"]
    assert aux[1].tolist() == [3, 0]
    q, k, v, o, d_o = kw["q"], kw["k"], kw["v"], kw["o"], kw["d_o"]
    if kw["qkv_layout"] == "thd_thd_thd":
        assert aux[0].shape == (q.shape[0], q.shape[1], 1), "the forward's [T, h, 1] Stats must come back"
        return _per_document_backward(d_o, q, k, v, o, aux[0][..., 0].t(), kw["cu_seqlens_q"], causal, scale)
    grads = _cpu_attention_backward(*(t.permute(1, 2, 0, 3) for t in (d_o, q, k, v, o)), aux[0].squeeze(-1), causal,
                                    scale)
    return [g.permute(2, 0, 1, 3).contiguous() for g in grads]


def _check_te_common(kw):
    """The call's arguments, for separate sbhd q, k, v or thd q, k, v of packed documents; whether it is causal."""
    q = kw["q"]
    for t in ("q", "k", "v", "o", "d_o"):
        if t in kw:
            assert kw[t].is_contiguous(), f"TE derives strides from the layout: {t} must be dense sbhd / thd"
    assert kw["attn_bias_type"] == "no_bias" and kw["dropout"] == 0.0
    assert kw["fused_attention_backend"] == "F16_arbitrary_seqlen"
    if kw["qkv_layout"] == "thd_thd_thd":  # packed documents: ragged inputs need a padding mask
        cu = kw["cu_seqlens_q"]
        assert q.dim() == 3 and cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == q.shape[0]
        assert kw["cu_seqlens_kv"] is cu and kw["cu_seqlens_q_padded"] is cu and kw["cu_seqlens_kv_padded"] is cu
        assert kw["max_seqlen_q"] == kw["max_seqlen_kv"] == int(cu.diff().max())
        causal = kw["attn_mask_type"] == "padding_causal"
        assert kw["attn_mask_type"] in ("padding_causal", "padding")
        fmt, layout = "thd", "thd_thd_thd"
    else:
        assert kw["qkv_layout"] == "sbhd_sbhd_sbhd"
        n, b = q.shape[0], q.shape[1]
        assert kw["max_seqlen_q"] == kw["max_seqlen_kv"] == n
        assert kw["cu_seqlens_q"].tolist() == list(range(0, (b + 1) * n, n))
        assert kw.get("cu_seqlens_q_padded") is None and kw.get("cu_seqlens_kv_padded") is None
        causal = kw["attn_mask_type"] == "causal"
        assert kw["attn_mask_type"] in ("causal", "no_mask")
        fmt, layout = "sbhd", "sbhd_sbhd_sbhd"
    for name, want in (("o_format", fmt), ("do_format", fmt), ("dqkv_layout", layout)):
        assert kw.get(name, want) == want, (name, kw[name])
    assert tuple(kw["window_size"]) == ((-1, 0) if causal else (-1, -1))
    return causal


# TE 2.9 (fused_attn.py at v2.9): fake_dtype, dqkv_dtype required in the backward
def _te29_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype,
              fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
              page_table_k=None, page_table_v=None, s_quantizer=None, o_quantizer=None, attn_scale=None, dropout=0.0,
              fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias", attn_mask_type="padding",
              softmax_type="vanilla", window_size=(-1, -1), rng_gen=None, softmax_offset=None,
              return_max_logit=False):
    kw = dict(locals())
    CALLS.append(("fwd", kw))
    assert is_training and fake_dtype == q.dtype
    return _te_attention(kw)


def _te29_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, dqkv_dtype,
              aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
              s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, attn_scale=None, dropout=0.0,
              fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias", attn_mask_type="padding",
              softmax_type="vanilla", window_size=(-1, -1), deterministic=False):
    kw = dict(locals())
    CALLS.append(("bwd", kw))
    assert fake_dtype == q.dtype and dqkv_dtype == TE_DTYPE[q.dtype]
    return _te_attention_backward(kw)


# TE 2.15+ (v2.18): no dqkv_dtype; o_format, do_format and dqkv_layout with defaults wrong for separate sbhd tensors
def _te218_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype,
               fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
               page_table_k=None, page_table_v=None, s_quantizer=None, o_quantizer=None, attn_scale=None, dropout=0.0,
               fast_zero_fill=True, qkv_layout="sbh3d", o_format="sbhd", qkv_scale_inv_format=None,
               attn_bias_type="no_bias", attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
               bottom_right_diagonal=None, rng_gen=None, softmax_offset=None, return_max_logit=False,
               cuda_graph=False):
    kw = dict(locals())
    CALLS.append(("fwd", kw))
    assert bottom_right_diagonal is None
    return _te_attention(kw)


def _te218_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype,
               aux_ctx_tensors: List[torch.Tensor], fused_attention_backend, cu_seqlens_q_padded=None,
               cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, attn_scale=None,
               dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d", o_format="sbhd", do_format="sbhd",
               dqkv_layout="sbh3d", qkv_scale_inv_format=None, do_scale_inv_format=None, attn_bias_type="no_bias",
               attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1), bottom_right_diagonal=None,
               deterministic=False, cuda_graph=False):
    kw = dict(locals())
    CALLS.append(("bwd", kw))
    return _te_attention_backward(kw)


# TE 1.11: qkv_dtype (a TE DType) instead of fake_dtype
def _te111_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, qkv_dtype,
               fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
               d_scale_qkv=None, d_scale_qkv_offset=0, d_scale_s=None, d_scale_s_offset=0, q_scale_s=None,
               q_scale_s_offset=0, q_scale_o=None, q_scale_o_offset=0, amax_s=None, amax_s_offset=0, amax_o=None,
               amax_o_offset=0, attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d",
               attn_bias_type="no_bias", attn_mask_type="padding", window_size=(-1, -1), rng_gen=None):
    kw = dict(locals())
    CALLS.append(("fwd", kw))
    assert qkv_dtype == TE_DTYPE[q.dtype]
    return _te_attention(kw)


def _te111_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, qkv_dtype, dqkv_dtype,
               aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
               d_scale_qkv=None, d_scale_s=None, d_scale_o=None, d_scale_do=None, d_scale_dp=None, q_scale_s=None,
               q_scale_dp=None, q_scale_dqkv=None, amax_dp=None, amax_dqkv=None, attn_scale=None, dropout=0.0,
               fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias", attn_mask_type="padding",
               window_size=(-1, -1), deterministic=False):
    kw = dict(locals())
    CALLS.append(("bwd", kw))
    assert qkv_dtype == dqkv_dtype == TE_DTYPE[q.dtype]
    return _te_attention_backward(kw)


TE_RELEASES = {"1.11.0": (_te111_fwd, _te111_bwd), "2.9.0": (_te29_fwd, _te29_bwd),
               "2.18.0": (_te218_fwd, _te218_bwd)}


@dataclasses.dataclass
class _AttentionParams:  # TE 2.18's AttentionParams fields this adapter sets (and a few it leaves alone)
    qkv_type: type = torch.Tensor
    qkv_dtype: torch.dtype = torch.bfloat16
    qkv_layout: str = "sbh3d"
    batch_size: int = 1
    num_heads: int = 16
    num_gqa_groups: int = 16
    max_seqlen_q: int = 128
    max_seqlen_kv: int = 128
    head_dim_qk: int = 64
    head_dim_v: int = 64
    attn_mask_type: str = "no_mask"
    window_size: tuple | None = None
    attention_dropout: float = 0.0
    context_parallel: bool = False
    is_training: bool = True
    fp8: bool = False
    fp8_meta: dict | None = None


def _install_te(monkeypatch, version, fwd, bwd, fused_ok=lambda p: True):
    queried = []

    def get_attention_backend(params):
        queried.append(params)
        assert params.qkv_layout in ("sbhd_sbhd_sbhd", "thd_thd_thd") and not params.fp8
        ok = fused_ok(params)
        # TE >= 2.4: (use_flash, flash_backend, use_fused, fused_backend, use_unfused, available_backends)
        return False, None, ok, "F16_arbitrary_seqlen" if ok else None, not ok, [False, ok, True]

    base = "transformer_engine.pytorch"
    _install(monkeypatch, {
        "transformer_engine": {"__version__": version, "__path__": []},
        base: {"__path__": []},
        f"{base}.cpp_extensions": {"__path__": []},
        f"{base}.cpp_extensions.fused_attn": {"fused_attn_fwd": fwd, "fused_attn_bwd": bwd},
        f"{base}.constants": {"TE_DType": TE_DTYPE},
        f"{base}.attention": {"__path__": []},
        f"{base}.attention.dot_product_attention": {"__path__": []},
        f"{base}.attention.dot_product_attention.utils": {"get_attention_backend": get_attention_backend,
                                                          "AttentionParams": _AttentionParams},
    })
    return queried


@pytest.mark.parametrize("version", sorted(TE_RELEASES))
def test_te_adapter_passes_what_each_release_takes(fresh, version):
    queried = _install_te(fresh, version, *TE_RELEASES[version])
    CALLS.clear()
    _check_against_reference(KERNELS["te_fused"], torch.device("cpu"), torch.float32, 1e-5)
    # the (kv-sliced) views were made dense, and the kwargs matched each signature (else TypeError / assertion)
    assert [c for c, _ in CALLS] == ["fwd", "bwd"] * 2
    bwd = next(kw for c, kw in CALLS if c == "bwd")
    assert ("dqkv_dtype" in bwd) == (version != "2.18.0") and ("dqkv_layout" in bwd) == (version == "2.18.0")
    # TE's own backend check saw the call's real shape: GQA heads, not expanded
    p = queried[-1]
    assert (p.num_heads, p.num_gqa_groups, p.head_dim_qk, p.max_seqlen_q) == (4, 2, 16, 37)


def test_te_is_preferred_in_auto_order_when_it_supports_the_call(fresh):
    _install_te(fresh, "2.18.0", _te218_fwd, _te218_bwd, fused_ok=lambda p: p.max_seqlen_q >= 64)
    _install_flash_attn(fresh, "2.8.3", *FLASH_ATTN_RELEASES["2.8.3"])
    call = KernelCall(batch=1, q_heads=4, kv_heads=1, seq_len=131072)
    assert select_kernel(CUDA, torch.bfloat16, 128, call=call).name == "te_fused"
    # TE says no for this shape: the next kernel, with TE's reason
    short = KernelCall(batch=1, q_heads=4, kv_heads=1, seq_len=32)
    assert select_kernel(CUDA, torch.bfloat16, 128, call=short).name == "flash_attn"
    with pytest.raises(ValueError, match="TransformerEngine 2.18.0 has no fused attention backend.*N=32"):
        select_kernel(CUDA, torch.bfloat16, 128, "te_fused", call=short)


def test_te_with_an_unknown_required_parameter_falls_back(fresh, caplog):
    def fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype,
            fused_attention_backend, qkv_scale_layout, attn_scale=None):
        raise AssertionError("must not be called")

    _install_te(fresh, "3.0.0", fwd, _te218_bwd)
    with caplog.at_level(logging.INFO, logger="megatron_upipe.attention.kernels"):
        assert select_kernel(CUDA, torch.bfloat16, 128).name == "sdpa_flash"
    assert any("not using te_fused" in r.getMessage() and "qkv_scale_layout" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------- planning stand-ins
@pytest.mark.parametrize("name", ["sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flash_attn", "te_fused"])
def test_planning_kernel_keeps_the_gpu_kernels_rules(name):
    plan, real = planning_kernel(name), KERNELS[name]
    assert (plan.device_type, plan.native_gqa, plan.dtypes, plan.max_head_dim) == (
        "cpu", real.native_gqa, real.dtypes, real.max_head_dim)
    assert select_kernel(torch.device("cpu"), torch.bfloat16, 128, plan) is plan
    with pytest.raises(ValueError, match="head dim 320"):
        select_kernel(torch.device("cpu"), torch.bfloat16, 320, planning_kernel("sdpa_cudnn"))
    assert planning_kernel("auto").name.startswith(K.PLAN_AUTO_AS)
    with pytest.raises(ValueError, match="no planning stand-in"):
        planning_kernel("cpu_flash")


def test_the_op_asks_te_about_its_own_stage_call_and_falls_back(fresh, caplog):
    """Through the public op (fake CUDA tensors): TE's backend query sees one stage's call (m query heads, its KV
    heads, all N tokens); TE refusing it makes the op run the next kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_upipe.attention import upipe_attention

    queried = _install_te(fresh, "2.18.0", _te218_fwd, _te218_bwd, fused_ok=lambda p: False)
    with FakeTensorMode(), caplog.at_level(logging.INFO, logger="megatron_upipe.attention.kernels"):
        mk = dict(device="cuda", dtype=torch.bfloat16)
        x = torch.empty(256, 1, 64, **mk)
        wq, wk, wv = torch.empty(8 * 16, 64, **mk), torch.empty(2 * 16, 64, **mk), torch.empty(2 * 16, 64, **mk)
        out = upipe_attention(x, wq, wk, wv, num_heads=8, num_kv_heads=2, cp_group=None, heads_per_stage=4)
        assert out.shape == (256, 1, 8 * 16) and out.device.type == "cuda"
    p = queried[-1]
    assert (p.batch_size, p.num_heads, p.num_gqa_groups, p.max_seqlen_q, p.attn_mask_type) == (1, 4, 1, 256, "causal")
    messages = [r.getMessage() for r in caplog.records]
    assert any("not using te_fused" in m and "no fused attention backend" in m for m in messages), messages
    assert any(m.startswith("megatron_upipe attention kernel: sdpa_flash") for m in messages), messages


# ------------------------------------------------------------------------ packed documents (cu_seqlens)
from megatron_upipe.attention import varlen as V  # noqa: E402

CU = [0, 1, 6, 7, 14, 15, 16, 21, 30, 37]  # 9 documents of N = 37 tokens: lengths 1, 5, 1, 7, 1, 1, 5, 9, 7


def _per_document_attention(q, k, v, cu, causal, scale):
    """Stand-in libraries' arithmetic, one CPU flash call per document: q [T, hq, d], k/v [T, hkv, d] ->
    (out [T, hq, d], lse [hq, T])."""
    out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for a, z in zip(cu.tolist(), cu.tolist()[1:]):
        o, l_ = _cpu_attention(*(t[a:z].transpose(0, 1).unsqueeze(0) for t in (q, k, v)), causal, scale)
        out[a:z], lse[:, a:z] = o[0].transpose(0, 1), l_[0]
    return out, lse


def _per_document_backward(dout, q, k, v, out, lse, cu, causal, scale):
    """lse [hq, T] -> [dq, dk, dv] shaped like q, k, v [T, h, d]."""
    grads = [torch.empty_like(t) for t in (q, k, v)]
    for a, z in zip(cu.tolist(), cu.tolist()[1:]):
        gs = _cpu_attention_backward(*(t[a:z].transpose(0, 1).unsqueeze(0) for t in (dout, q, k, v, out)),
                                     lse[:, a:z].unsqueeze(0).contiguous(), causal, scale)
        for buf, g in zip(grads, gs):
            buf[a:z] = g[0].transpose(0, 1)
    return grads


def _block_reference(q, k, v, cu, causal, scale):
    """float64 attention with a block-diagonal (causal) mask over the full [N, N] scores; q [1, hq, N, d]."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    hidden = doc[:, None] != doc[None, :]
    if causal:
        hidden |= torch.ones_like(hidden).triu(1)
    return torch.softmax(s.masked_fill(hidden, float("-inf")), -1) @ v.repeat_interleave(rep, 1), (q, k, v)


def _check_varlen_against_reference(kernel, dtype, tol, cu=CU, hq=4, hkv=2, d=16):
    gen = torch.Generator().manual_seed(1)
    n = cu[-1]
    docs = V.documents(torch.tensor(cu, dtype=torch.int32), n, 1, torch.device("cpu"))
    # sequence-first buffers [N, 1, h, d] viewed as [1, h, N, d], as the stage loop passes them
    q, k, v, do = (torch.randn(n, 1, h, d, generator=gen).to(dtype).permute(1, 2, 0, 3) for h in (hq, hkv, hkv, hq))
    for causal in (True, False):
        out, lse, aux = kernel_forward(kernel, q, k, v, causal, 0.3, docs=docs)
        dq, dk, dv = kernel_backward(kernel, do, q, k, v, out, lse, aux, causal, 0.3, docs=docs)
        ref, ins = _block_reference(q, k, v, cu, causal, 0.3)
        grads = torch.autograd.grad(ref, ins, do.double())
        for got, want in zip((out, dq, dk, dv), (ref, *grads)):
            assert got.shape == want.shape and got.dtype == dtype
            err = ((got.double() - want).norm() / want.norm()).item()
            assert err < tol, (kernel.name, causal, err)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_varlen_kernel_matches_block_diagonal_reference(dtype, tol):
    _check_varlen_against_reference(KERNELS["cpu_flash"], dtype, tol)
    # K/V expanded to the query heads (kernels without native GQA) on the varlen path too
    _check_varlen_against_reference(dataclasses.replace(KERNELS["cpu_flash"], native_gqa=False), dtype, tol, hq=6)


def test_cpu_varlen_work_is_the_sum_of_squared_document_lengths():
    """N = 512 in 200 documents of 1-4 tokens: one CPU flash call per distinct length (4, forward and backward),
    the documents of a length batched; Σ (rows x keys) over the calls is Σ L_i², not N²."""
    lengths = (torch.arange(200) % 4 + 1).tolist()
    lengths[-1] += 512 - sum(lengths)  # the last document takes the rest
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    docs = V.documents(cu, 512, 1, torch.device("cpu"))
    calls = []

    class Spy:  # records the [k, h, L, d] query of every aten call
        def __getattr__(self, name):
            op = getattr(_aten, name)

            def call(*args, **kwargs):
                calls.append((name, tuple(args[0].shape)))
                return op(*args, **kwargs)
            return call

    real, V._aten = V._aten, Spy()
    try:
        _check_varlen_against_reference(KERNELS["cpu_flash"], torch.float64, 1e-12, cu=cu.tolist(), d=8)
    finally:
        V._aten = real
    fwd = [shape for name, shape in calls if not name.endswith("backward")]
    bwd = [shape for name, shape in calls if name.endswith("backward")]
    distinct = len(set(lengths))
    assert len(fwd) == len(bwd) == 2 * distinct  # causal and full
    assert sum(k * L * L for k, _, L, _ in fwd[:distinct]) == sum(L * L for L in lengths) < 512 * 512 // 50
    assert sorted(k for k, *_ in fwd[:distinct]) == sorted(lengths.count(L) for L in set(lengths))


def test_cpu_varlen_calls_hold_at_most_group_tokens(monkeypatch):
    """Equal-length documents are batched at most GROUP_TOKENS tokens per call (a longer document alone), so the
    gathered copies stay bounded; results are unchanged (float64 against the block-diagonal reference)."""
    monkeypatch.setattr(V, "GROUP_TOKENS", 12)
    cu = [0, 4, 8, 12, 16, 20, 24, 28, 48, 52]  # eight documents of 4 tokens, one of 20
    docs = V.documents(torch.tensor(cu, dtype=torch.int32), 52, 1, torch.device("cpu"))
    assert [(g.length, len(g.starts)) for g in docs.cpu_groups] == [(4, 3), (4, 3), (4, 2), (20, 1)]
    _check_varlen_against_reference(KERNELS["cpu_flash"], torch.float64, 1e-12, cu=cu, d=8)


def test_varlen_selection_skips_kernels_without_it(fresh, caplog):
    """A call with packed documents: sdpa_cudnn has no varlen path; a flash-attn without varlen entry points is
    skipped for it (and still chosen without documents); a named kernel that cannot take them is refused."""
    _install_flash_attn(fresh, "2.8.3", *FLASH_ATTN_RELEASES["2.8.3"])  # fixed-length entry points only
    docs_call = KernelCall(batch=1, q_heads=4, kv_heads=1, seq_len=4096, varlen=(30, 700))
    with caplog.at_level(logging.INFO, logger="megatron_upipe.attention.kernels"):
        assert select_kernel(CUDA, torch.bfloat16, 128, call=docs_call).name == "sdpa_flash"
    assert select_kernel(CUDA, torch.bfloat16, 128).name == "flash_attn"
    why = [r.getMessage() for r in caplog.records if "not using flash_attn" in r.getMessage()]
    assert len(why) == 1 and "cannot take cu_seqlens" in why[0] and "_flash_attn_varlen_forward" in why[0], why
    with pytest.raises(ValueError, match="sdpa_cudnn.*no variable-length .cu_seqlens. path.*choose another"):
        select_kernel(CUDA, torch.bfloat16, 128, "sdpa_cudnn", call=docs_call)
    assert KERNELS["sdpa_cudnn"].unsupported_reason("cuda", torch.bfloat16, 128) is None  # fine without documents
    plan = planning_kernel("sdpa_cudnn")
    assert "no variable-length" in plan.unsupported_reason("cpu", torch.bfloat16, 128, docs_call)
    for name in ("sdpa_flash", "sdpa_efficient", "flash_attn", "te_fused"):
        assert planning_kernel(name).unsupported_reason("cpu", torch.bfloat16, 128, docs_call) is None


# flash-attn varlen entry points, each release's exact signature (flash_attn_interface.py at the tags)
def _fa_varlen_run(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, padded):
    assert cu_q is cu_k and cu_q.dtype == torch.int32 and q.dim() == 3 and q.stride(-1) == 1
    assert max_q == max_k == int(cu_q.diff().max())
    out, lse = _per_document_attention(q, k, v, cu_q, causal, scale)  # lse [h, T]
    if padded:  # <= 2.5: [n, h, max_seqlen_q], rows past a document's end unused
        n = cu_q.numel() - 1
        pad = torch.full((n, q.shape[1], max_q), float("nan"))
        for i, (a, z) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:])):
            pad[i, :, :z - a] = lse[:, a:z]
        lse = pad
    return out, lse


def _fa_varlen_grads(dout, q, k, v, out, lse, dq, dk, dv, cu_q, causal, scale, padded):
    if padded:
        assert lse.shape == (cu_q.numel() - 1, q.shape[1], int(cu_q.diff().max()))
        lse = torch.cat([lse[i, :, :z - a] for i, (a, z) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:]))], 1)
    assert lse.shape == (q.shape[1], q.shape[0])
    for buf, g in zip((dq, dk, dv), _per_document_backward(dout, q, k, v, out, lse, cu_q, causal, scale)):
        buf.copy_(g)


def _fa25_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                         causal, window_size, alibi_slopes, return_softmax, block_table):
    assert dropout_p == 0.0 and tuple(window_size) == (-1, -1) and alibi_slopes is None and block_table is None
    out, lse = _fa_varlen_run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                              True)
    return out, q, k, v, out, lse, None, torch.tensor([7, 0])


def _fa25_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                          rng_state=None):
    assert rng_state.tolist() == [7, 0] and cu_seqlens_k is cu_seqlens_q
    _fa_varlen_grads(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, causal, softmax_scale, True)
    return dq, dk, dv, None


def _fa26_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                         causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False,
                         block_table=None, leftpad_k=None, seqused_k=None):
    assert softcap == 0.0 and leftpad_k is None and seqused_k is None and block_table is None
    out, lse = _fa_varlen_run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                              False)
    return out, q, k, v, out, lse, None, torch.tensor([7, 0])


def _fa26_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          deterministic, rng_state=None):
    assert rng_state.tolist() == [7, 0] and softcap == 0.0
    _fa_varlen_grads(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, causal, softmax_scale, False)
    return dq, dk, dv, None


@torch.library.custom_op("upipe_test_fa27::varlen_fwd", mutates_args=())
def _fa27_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                         softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
                         softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                         return_softmax: bool = False, block_table: Optional[torch.Tensor] = None,
                         leftpad_k: Optional[torch.Tensor] = None,
                         seqused_k: Optional[torch.Tensor] = None, zero_tensors: bool = False
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert (window_size_left, window_size_right, softcap, return_softmax, zero_tensors) == (-1, -1, 0.0, False, False)
    out, lse = _fa_varlen_run(q, k, v, cu_seqlens_q, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                              False)
    return out.contiguous(), lse.contiguous(), torch.empty(0), torch.tensor([7, 0])


@torch.library.custom_op("upipe_test_fa27::varlen_bwd", mutates_args=("dq", "dk", "dv"))
def _fa27_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                          dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                          window_size_left: int, window_size_right: int, softcap: float,
                          alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                          rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False) -> torch.Tensor:
    assert rng_state.tolist() == [7, 0]
    _fa_varlen_grads(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, causal, softmax_scale, False)
    return torch.empty(0)


FA_VARLEN_RELEASES = {"2.5.9": (_fa25_varlen_forward, _fa25_varlen_backward),
                      "2.6.3": (_fa26_varlen_forward, _fa26_varlen_backward),
                      "2.8.3": (_fa27_varlen_forward, _fa27_varlen_backward)}


def _install_flash_attn_varlen(monkeypatch, version):
    fwd, bwd = FLASH_ATTN_RELEASES[version]
    vfwd, vbwd = FA_VARLEN_RELEASES[version]
    _install(monkeypatch, {"flash_attn": {"__version__": version, "__path__": []},
                           "flash_attn.flash_attn_interface": {
                               "_flash_attn_forward": fwd, "_flash_attn_backward": bwd,
                               "_flash_attn_varlen_forward": vfwd, "_flash_attn_varlen_backward": vbwd}})


@pytest.mark.parametrize("version", sorted(FA_VARLEN_RELEASES))
def test_flash_attn_varlen_adapter_for_each_release(fresh, version):
    """The varlen binding passes each release's parameters (an unknown or missing one fails its signature), reads
    lse at the release's index and hands it back in the release's layout ([n, h, max] up to 2.5, [h, T] after),
    against the float64 block-diagonal reference."""
    _install_flash_attn_varlen(fresh, version)
    api = libs.flash_attn_api()
    assert isinstance(api.varlen, libs.FlashAttnVarlen), api.varlen
    assert api.varlen.padded_lse == (version < "2.6")
    _check_varlen_against_reference(KERNELS["flash_attn"], torch.float32, 1e-5)
    docs_call = KernelCall(batch=1, q_heads=4, kv_heads=2, seq_len=37, varlen=(9, 9))
    assert select_kernel(CUDA, torch.bfloat16, 128, call=docs_call).name == "flash_attn"


def test_flash_attn_varlen_with_an_unknown_signature_is_a_reason(fresh):
    def vfwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
             sink_tokens):
        raise AssertionError("must not be called")

    _install(fresh, {"flash_attn": {"__version__": "2.9.0", "__path__": []},
                     "flash_attn.flash_attn_interface": {"_flash_attn_forward": _fa25_forward,
                                                         "_flash_attn_backward": _fa25_backward,
                                                         "_flash_attn_varlen_forward": vfwd,
                                                         "_flash_attn_varlen_backward": _fa25_varlen_backward}})
    reason = KERNELS["flash_attn"].unsupported_reason("cuda", torch.bfloat16, 128, KernelCall(1, 4, 1, 64,
                                                                                               varlen=(2, 40)))
    assert "cannot take cu_seqlens" in reason and "sink_tokens" in reason
    assert KERNELS["flash_attn"].unsupported_reason("cuda", torch.bfloat16, 128) is None


@pytest.mark.parametrize("version", sorted(TE_RELEASES))
def test_te_thd_adapter_passes_what_each_release_takes(fresh, version):
    """Packed documents through TE: thd_thd_thd, padding(_causal) mask, cu_seqlens (and the padded offsets, equal),
    the longest document as max_seqlen; TE's backend query asked about n documents of up to the longest."""
    queried = _install_te(fresh, version, *TE_RELEASES[version])
    CALLS.clear()
    _check_varlen_against_reference(KERNELS["te_fused"], torch.float32, 1e-5)
    assert [c for c, _ in CALLS] == ["fwd", "bwd"] * 2
    assert all(kw["qkv_layout"] == "thd_thd_thd" for _, kw in CALLS)
    p = queried[-1]
    assert (p.qkv_layout, p.batch_size, p.num_heads, p.num_gqa_groups, p.max_seqlen_q) == ("thd_thd_thd", 9, 4, 2, 9)
    assert p.attn_mask_type == "padding"  # the last call is the non-causal one
