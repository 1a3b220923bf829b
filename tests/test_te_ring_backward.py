"""te_fused's backward uses the softmax statistics it is given (issue 23).

Ring attention (attention/ring.py) hands each block's kernel backward the *merged* log-sum-exp of the whole row.
TransformerEngine's fused_attn_bwd rebuilds the probabilities from aux_ctx_tensors[0] (the forward's softmax
Stats), so the adapter must put that lse there instead of the block's own Stats (TE's own ring attention,
context_parallel.py, passes [softmax_lse, rng_state] the same way).

TE is not installed here. A stand-in `transformer_engine` package (modules in sys.modules, as tests/test_kernels.py
installs them, found by kernel_libraries.te_api's own import) implements fused_attn_fwd / fused_attn_bwd in plain
torch with TE 2.9's signature and its documented contract (cpp_extensions/fused_attn.py, F16_arbitrary_seqlen):
the forward returns (out, [Stats, rng_state]) with Stats = log-sum-exp of the scaled logits per query row, [b, h, sq,
1] for sbhd and [T, h, 1] for thd (cuDNN >= 9.6); the backward reads the statistics from aux_ctx_tensors[0] only:
P = exp(scale·QKᵀ - Stats), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)), dQ = scale·dS K, dK = scale·dSᵀ Q.
Stats are float32 as TE's, except float64 for float64 inputs: TE has no float64 kernels, and float32 statistics
would round the probabilities at 1e-7 and hide what is checked here.

Checks, float64, against float64 attention of the whole sequence written here (relative norm error under 1e-10:
the same arithmetic in float64, whose roundings of unit-scale values add up to ~1e-15 over these few-dozen-term sums):
1. a ring of 2 gloo ranks (one spawn), GQA: outputs and dq, dk, dv of each rank's zigzag tokens. With the block's
   own Stats (before the fix) out matched (2e-16) but dq, dk, dv were off by 257%, 183%, 93% (rank 0) and 237%,
   388%, 179% (rank 1); with the merged lse all are under 5e-16.
2. one rank, no ring: the fixed-length call (causal and full) and the thd call of packed documents, each backward
   given the forward's own Stats, and the UPipe op through autograd (its saved lse) with te_fused.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from tests.dist_helper import run_on_ranks

B, H, HK, D = 2, 4, 2, 8
TOL = 1e-10
RNG_STATE = (7, 0)  # the stand-in's [seed, offset]: must come back in aux_ctx_tensors[1]


# --------------------------------------------------------------------------- TransformerEngine stand-in
def _attention(q, k, v, causal, scale):
    """Plain float attention: q [b, h, n, d], k/v [b, hk, n, d] -> (out [b, h, n, d], lse [b, h, n])."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [b, hk, n, d] -> [b, h, n, d]
    s = q @ k.transpose(-1, -2) * scale  # [b, h, n, n]
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)  # [b, h, n]
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def _attention_backward(do, q, k, v, o, lse, causal, scale):
    """dq, dk, dv of `_attention` from the statistics `lse` [b, h, n] (not recomputed: as cuDNN's backward)."""
    b, hk, n, d = k.shape
    rep = q.shape[1] // hk
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [b, hk, n, d] -> [b, h, n, d]
    s = q @ ke.transpose(-1, -2) * scale  # [b, h, n, n]
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))  # [b, h, n, n]
    dv = p.transpose(-1, -2) @ do  # [b, h, n, d]
    ds = p * (do @ ve.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    dq, dk = ds @ ke * scale, ds.transpose(-1, -2) @ q * scale
    fold = (b, hk, rep, n, d)
    return dq, dk.view(fold).sum(2), dv.view(fold).sum(2)  # [b, h, n, d] -> [b, hk, n, d]


def _stats_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _docs_of(cu):
    return list(zip(cu[:-1].tolist(), cu[1:].tolist()))


def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype,
                   fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                   page_table_k=None, page_table_v=None, s_quantizer=None, o_quantizer=None, attn_scale=None,
                   dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
                   attn_mask_type="padding", window_size=(-1, -1), rng_gen=None):
    assert is_training and fake_dtype == q.dtype and fused_attention_backend == "F16_arbitrary_seqlen"
    assert all(t.is_contiguous() for t in (q, k, v)), "TE derives strides from the layout"
    causal = attn_mask_type in ("causal", "padding_causal")
    rng = torch.tensor(RNG_STATE, dtype=torch.int64)
    if qkv_layout == "thd_thd_thd":  # q [T, h, d]: per document; Stats [T, h, 1]
        out, stats = torch.empty_like(q), torch.empty(q.shape[0], q.shape[1], 1, dtype=_stats_dtype(q.dtype))
        for a, z in _docs_of(cu_seqlens_q):
            o, lse = _attention(*(t[a:z].transpose(0, 1)[None] for t in (q, k, v)), causal, attn_scale)
            out[a:z] = o[0].transpose(0, 1)  # [1, h, L, d] -> [L, h, d]
            stats[a:z, :, 0] = lse[0].t()  # [1, h, L] -> [L, h]
        return out, (stats, rng)
    assert qkv_layout == "sbhd_sbhd_sbhd"
    o, lse = _attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), causal, attn_scale)  # [N, b, h, d] -> bhnd
    stats = lse.unsqueeze(-1).to(_stats_dtype(q.dtype))  # [b, h, N] -> Stats [b, h, N, 1]
    return o.permute(2, 0, 1, 3).contiguous(), (stats, rng)  # [b, h, N, d] -> [N, b, h, d]


def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, dqkv_dtype,
                   aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                   s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, attn_scale=None, dropout=0.0,
                   fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias", attn_mask_type="padding",
                   window_size=(-1, -1), deterministic=False):
    assert fake_dtype == q.dtype and fused_attention_backend == "F16_arbitrary_seqlen"
    assert all(t.is_contiguous() for t in (q, k, v, o, d_o)), "TE derives strides from the layout"
    stats, rng = aux_ctx_tensors  # TE: [softmax Stats, rng_state]; the Stats are what the probabilities come from
    assert tuple(rng.tolist()) == RNG_STATE, "the forward's rng_state must come back as aux_ctx_tensors[1]"
    assert stats.dtype == _stats_dtype(q.dtype) and stats.is_contiguous()
    causal = attn_mask_type in ("causal", "padding_causal")
    if qkv_layout == "thd_thd_thd":
        assert stats.shape == (q.shape[0], q.shape[1], 1)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        for a, z in _docs_of(cu_seqlens_q):
            part = _attention_backward(*(t[a:z].transpose(0, 1)[None] for t in (d_o, q, k, v, o)),
                                       stats[a:z, :, 0].t()[None], causal, attn_scale)  # [L, h, 1] -> [1, h, L]
            for g, p in zip(grads, part):
                g[a:z] = p[0].transpose(0, 1)  # [1, h, L, d] -> [L, h, d]
        return (*grads, None)
    n, b, h, _ = q.shape
    assert stats.shape == (b, h, n, 1)
    grads = _attention_backward(*(t.permute(1, 2, 0, 3) for t in (d_o, q, k, v, o)), stats[..., 0], causal,
                                attn_scale)
    return (*(g.permute(2, 0, 1, 3).contiguous() for g in grads), None)  # [b, h, N, d] -> [N, b, h, d]


@dataclasses.dataclass
class AttentionParams:  # the fields of TE's AttentionParams the stand-in backend query looks at
    qkv_layout: str = "sbhd_sbhd_sbhd"
    qkv_dtype: torch.dtype = torch.bfloat16
    attn_mask_type: str = "causal"


def get_attention_backend(params):
    assert params.qkv_layout in ("sbhd_sbhd_sbhd", "thd_thd_thd")
    # TE >= 2.4: (use_flash, flash_backend, use_fused, fused_backend, use_unfused, available_backends)
    return False, None, True, "F16_arbitrary_seqlen", False, [False, True, True]


TE_DTYPE = {torch.float64: "kFloat64", torch.float32: "kFloat32", torch.bfloat16: "kBFloat16"}


def stand_in_modules() -> dict[str, types.ModuleType]:
    base = "transformer_engine.pytorch"
    attrs = {
        "transformer_engine": {"__version__": "2.9.0", "__path__": []},
        base: {"__path__": []},
        f"{base}.cpp_extensions": {"__path__": []},
        f"{base}.cpp_extensions.fused_attn": {"fused_attn_fwd": fused_attn_fwd, "fused_attn_bwd": fused_attn_bwd},
        f"{base}.constants": {"TE_DType": TE_DTYPE},
        f"{base}.attention": {"__path__": []},
        f"{base}.attention.dot_product_attention": {"__path__": []},
        f"{base}.attention.dot_product_attention.utils": {"get_attention_backend": get_attention_backend,
                                                          "AttentionParams": AttentionParams},
    }
    modules = {}
    for name, values in attrs.items():
        modules[name] = types.ModuleType(name)
        for k, v in values.items():
            setattr(modules[name], k, v)
    return modules


def _forget_probes():
    from megatron_upipe.attention import kernel_libraries as libs

    libs.te_api.cache_clear()
    libs.te_fused_backend.cache_clear()


# ------------------------------------------------------------------------------------------ reference
def _reference(q, k, v, dout, causal=True, cu=None):
    """float64 attention of the whole sequence [b, h, N, d] (GQA; cu: attention inside each document), and its
    gradients by autograd."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * q.shape[-1] ** -0.5  # [b, h, N, N]
    N = q.shape[2]
    hidden = torch.ones(N, N, dtype=torch.bool).triu(1) if causal else torch.zeros(N, N, dtype=torch.bool)
    if cu is not None:
        doc = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.long().diff())  # [N]: each token's document
        hidden |= doc[:, None] != doc[None, :]
    out = torch.softmax(s.masked_fill(hidden, float("-inf")), -1) @ v.repeat_interleave(rep, 1)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))


def _rel(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _inputs(N, seed=0, b=B):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, N, D, generator=gen, dtype=torch.float64) for h in (H, HK, HK, H)]  # q, k, v, dout


# ------------------------------------------------------------------------------------------------- ring
def _ring_job(rank, world_size, N):
    sys.modules.update(stand_in_modules())  # this spawned process: TE is the stand-in
    from megatron_upipe.attention.kernels import KERNELS
    from megatron_upipe.attention.layout import local_positions
    from megatron_upipe.attention.ring import ring_attention_backward, ring_attention_forward

    _forget_probes()
    q, k, v, dout = _inputs(N)
    ref = _reference(q, k, v, dout)
    pos = local_positions(N, 0, 1, rank, world_size)  # this ring rank's zigzag tokens
    local = [t[:, :, pos].contiguous() for t in (q, k, v, dout)]
    group, te = torch.distributed.group.WORLD, KERNELS["te_fused"]
    out, lse, blocks = ring_attention_forward(*local[:3], group, te, D ** -0.5)
    grads = ring_attention_backward(local[3], *local[:3], out, lse, blocks, group, te, D ** -0.5)
    return [_rel(got, r[:, :, pos]) for got, r in zip((out, *grads), ref)]


def test_te_ring_gradients_match_full_attention():
    per_rank = run_on_ranks(_ring_job, 2, 16)  # N = 16: zigzag chunks of 4 tokens
    assert max(max(errs) for errs in per_rank) < TOL, f"relative errors out, dq, dk, dv per rank: {per_rank}"


# ------------------------------------------------------------------------------------------ single rank
@pytest.fixture
def te_stand_in(monkeypatch):
    for name in [n for n in sys.modules if n.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, name)
    for name, mod in stand_in_modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    _forget_probes()
    yield
    _forget_probes()


def _views(t):
    return t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)  # [b, h, N, d] as a view of [N, b, h, d] memory


@pytest.mark.parametrize("causal", [True, False])
def test_te_fixed_length_backward_with_its_own_stats(te_stand_in, causal):
    from megatron_upipe.attention.kernels import KERNELS, kernel_backward, kernel_forward

    q, k, v, dout = _inputs(12, seed=1)
    ref = _reference(q, k, v, dout, causal)
    qv, kv, vv, dov = (_views(t) for t in (q, k, v, dout))
    out, lse, aux = kernel_forward(KERNELS["te_fused"], qv, kv, vv, causal, D ** -0.5)
    assert lse is aux[0] and lse.shape == (B, H, 12, 1)  # the forward's Stats are the lse the op keeps
    grads = kernel_backward(KERNELS["te_fused"], dov, qv, kv, vv, out, lse, aux, causal, D ** -0.5)
    errs = [_rel(g, r) for g, r in zip((out, *grads), ref)]
    assert max(errs) < TOL, errs


def test_te_packed_documents_backward_with_its_own_stats(te_stand_in):
    from megatron_upipe.attention.kernels import KERNELS, kernel_backward, kernel_forward
    from megatron_upipe.attention.varlen import documents

    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    docs = documents(cu, 16, 1, torch.device("cpu"))
    q, k, v, dout = _inputs(16, seed=2, b=1)
    ref = _reference(q, k, v, dout, cu=cu)
    qv, kv, vv, dov = (_views(t) for t in (q, k, v, dout))
    out, lse, aux = kernel_forward(KERNELS["te_fused"], qv, kv, vv, True, D ** -0.5, docs=docs)
    assert lse is aux[0] and lse.shape == (16, H, 1)  # thd Stats [T, h, 1]
    grads = kernel_backward(KERNELS["te_fused"], dov, qv, kv, vv, out, lse, aux, True, D ** -0.5, docs=docs)
    errs = [_rel(g, r) for g, r in zip((out, *grads), ref)]
    assert max(errs) < TOL, errs


def test_te_backward_refuses_an_lse_of_another_layout(te_stand_in):
    from megatron_upipe.attention.kernels import KERNELS, kernel_backward, kernel_forward

    q, k, v, dout = (_views(t) for t in _inputs(8, seed=3))
    out, lse, aux = kernel_forward(KERNELS["te_fused"], q, k, v, True, D ** -0.5)
    with pytest.raises(ValueError, match=r"lse \(2, 8, 4\) is not laid out like the forward's softmax Stats"):
        kernel_backward(KERNELS["te_fused"], dout, q, k, v, out, lse[..., 0].transpose(1, 2), aux, True, D ** -0.5)


def test_upipe_op_with_te_matches_reference(te_stand_in):
    """The op's own backward (lse and aux saved through autograd) with te_fused, one rank, GQA, two stages."""
    from megatron_upipe.attention.api import upipe_attention
    from megatron_upipe.attention.kernels import KERNELS
    from megatron_upipe.attention.reference import reference_attention

    te_cpu = dataclasses.replace(KERNELS["te_fused"], device_type="cpu", dtypes=(torch.float64,))
    gen = torch.Generator().manual_seed(4)
    N, Dm = 10, 16
    x = torch.randn(N, 1, Dm, generator=gen, dtype=torch.float64, requires_grad=True)
    w_q, w_k, w_v = (torch.randn(h * D, Dm, generator=gen, dtype=torch.float64, requires_grad=True) * Dm ** -0.5
                     for h in (H, HK, HK))
    ws = [w.detach().requires_grad_() for w in (w_q, w_k, w_v)]
    dy = torch.randn(N, 1, H * D, generator=gen, dtype=torch.float64)
    out = upipe_attention(x, *ws, num_heads=H, num_kv_heads=HK, cp_group=None, heads_per_stage=2, kernel=te_cpu)
    grads = torch.autograd.grad(out, (x, *ws), dy)
    x_ref = x.detach().requires_grad_()
    ws_ref = [w.detach().requires_grad_() for w in ws]
    ref = reference_attention(x_ref, *ws_ref, H, HK)
    ref_grads = torch.autograd.grad(ref, (x_ref, *ws_ref), dy)
    errs = [_rel(g, r) for g, r in zip((out, *grads), (ref, *ref_grads))]
    assert max(errs) < TOL, errs
