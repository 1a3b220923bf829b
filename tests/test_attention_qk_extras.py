"""QKV bias (Qwen2/2.5) and QK-norm (Qwen3) inside the UPipe/Ulysses op, against the float64 reference.

On 1, 2 and 4 gloo ranks (all cases of one cp size in one launch), every rank builds the same global inputs from a
seed, runs the op on its contiguous shard and compares its shard of out and dx, plus the all-reduced gradients of
every weight, bias and norm weight, with `reference_attention` (plain full-sequence float64 attention, whose bias
and QK-norm are written independently of the op's). Cases: MHA, GQA and KV replication (G < C); every legal U in
float64; bias only, norm only, both; float64 / float32 / bfloat16; UPipe and Ulysses; grad_accum fp32 and input;
with W_O and the input RMSNorm fused as well. Errors are ‖got − ref‖ / ‖ref‖ per tensor, tolerances those of
test_attention_numerics.py (TOL, justified there; the QK-norm runs in float32 for 16-bit inputs as HF's does, and
in float64 for float64 inputs, so float64 stays at rounding level).

Inputs are well scaled: x ~ N(0, 1), weight rows ~ N(0, 1/D) times a per-row factor in [0.5, 1.5), biases
~ N(0, 0.25), norm weights in [0.5, 1.5) per channel: projections and attention logits q·k/sqrt(d) are O(1), and
every row, bias and norm channel differs, so a wrong row mapping cannot cancel out.

One exception to ‖ref‖ as the error scale: the K bias's gradient Σ_tokens dk_t nearly cancels (softmax is
invariant to a shift common to all keys: exactly so for the channels RoPE leaves alone, without QK-norm), so its
bfloat16 error relative to its own small norm reaches ~5e-2 though each summand is as accurate as dK's; it is
measured against the summands' scale ‖Σ_t |dk_t|‖ (from the reference's per-token b_k gradients) instead.
"""

from __future__ import annotations

import pytest
import torch

from megatron_upipe.attention import api, legal_heads_per_stage
from megatron_upipe.attention.reference import reference_attention, rope_angles
from tests.dist_helper import run_on_ranks, without_communication
from tests.test_attention_numerics import assert_case_errors

# (H, G, d, local tokens, rot_dim): MHA, GQA g=4 (replicated KV heads at C=4), GQA g=4 with one KV head
# (replicated at C=2 and 4) and partial RoPE.
CASES = [(4, 4, 8, 3, 8), (8, 2, 8, 3, 8), (4, 1, 8, 5, 4)]
B, D = 2, 24
EXTRAS = {"bias": (True, False), "norm": (False, True), "both": (True, True)}
EPS = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _inputs(seed, N, H, G, d, dtype):
    """Natural-order x [N, b, D], w_q [H·d, D], w_k, w_v [G·d, D], b_q [H·d], b_k, b_v [G·d], q/k norm weights
    [d], w_o [D, H·d], input norm weight [D], dout [N, b, H·d] and dy [N, b, D], rounded to dtype."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def rows(n):  # [n, D] weight rows ~ N(0, 1/D) x a per-row factor in [0.5, 1.5)
        return rnd(n, D) / D ** 0.5 * (0.5 + torch.rand(n, 1, generator=gen, dtype=torch.float64))

    t = dict(x=rnd(N, B, D), w_q=rows(H * d), w_k=rows(G * d), w_v=rows(G * d), b_q=0.5 * rnd(H * d),
             b_k=0.5 * rnd(G * d), b_v=0.5 * rnd(G * d),
             q_norm_w=0.5 + torch.rand(d, generator=gen, dtype=torch.float64),
             k_norm_w=0.5 + torch.rand(d, generator=gen, dtype=torch.float64),
             w_o=rnd(D, H * d) / (H * d) ** 0.5, norm_w=0.5 + torch.rand(D, generator=gen, dtype=torch.float64),
             dout=rnd(N, B, H * d), dy=rnd(N, B, D))
    return {k: v.to(dtype) for k, v in t.items()}


def _reference(t, H, G, freqs, bias, norm, fused):
    """float64 reference on the dtype-rounded inputs: (out, {name: gradient}) for the inputs the case uses, and
    the scale db_k's error is measured against (see `_errors`), or None without biases."""
    names = ["x", "w_q", "w_k", "w_v"] + (["b_q", "b_k", "b_v"] if bias else []) + \
        (["q_norm_w", "k_norm_w"] if norm else []) + (["w_o", "norm_w"] if fused else [])
    ins = {n: t[n].double().requires_grad_() for n in names}
    x = ins["x"]
    if fused:  # input RMSNorm in float64
        x = ins["norm_w"] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    extra = {n: ins.get(n) for n in ("b_q", "b_k", "b_v", "q_norm_w", "k_norm_w")}
    wrt = list(ins.values())
    if bias:  # b_k broadcast per token [N, b, G·d], so that its per-token gradients come out too
        extra["b_k"] = ins["b_k"].expand(*t["x"].shape[:2], ins["b_k"].shape[0])
        wrt.append(extra["b_k"])
    out = reference_attention(x, ins["w_q"], ins["w_k"], ins["w_v"], H, G, freqs, True, **extra, qk_norm_eps=EPS)
    if fused:
        out = out @ ins["w_o"].t()  # [N, b, H·d] @ [H·d, D]
    grad_out = t["dy" if fused else "dout"].double()
    grads = torch.autograd.grad(out, wrt, grad_out)
    bk_scale = grads[-1].abs().sum((0, 1)).norm().item() if bias else None  # ‖Σ_tokens |d b_k per token|‖
    return out, dict(zip(names, grads)), bk_scale


def _run_op(t, H, G, d, s, rank, group, freqs, U, strategy, bias, norm, fused, grad_accum):
    """The op on this rank's shard: (out shard, {name: gradient}) with weight-like gradients in natural layout."""
    sl = slice(rank * s, (rank + 1) * s)
    names = ["w_q", "w_k", "w_v"] + (["b_q", "b_k", "b_v"] if bias else []) + \
        (["q_norm_w", "k_norm_w"] if norm else []) + (["w_o", "norm_w"] if fused else [])
    leaves = {"x": t["x"][sl].clone().requires_grad_(), **{n: t[n].clone().requires_grad_() for n in names}}
    kw = dict(cp_group=group, rotary_pos_emb=freqs, qk_norm_eps=EPS)
    kw.update({n: leaves[n] for n in names if n not in ("w_q", "w_k", "w_v")})
    if fused:  # grouped API (the model's layout), with W_O and the input norm fused
        g = H // G
        gw = (leaves["w_q"].view(G, g, d, D), leaves["w_k"].view(G, d, D), leaves["w_v"].view(G, d, D))
        for n, shape in (("b_q", (G, g, d)), ("b_k", (G, d)), ("b_v", (G, d))):
            if n in kw:
                kw[n] = kw[n].view(shape)  # [n·d] -> grouped
        kw["grad_accum"] = grad_accum
        out = (api.upipe_attention_grouped(leaves["x"], *gw, heads_per_stage=U, **kw) if strategy == "upipe"
               else api.ulysses_attention_grouped(leaves["x"], *gw, **kw))
        grad_out = t["dy"][sl]
    else:  # natural API
        assert grad_accum == "fp32"
        kw.update(num_heads=H, num_kv_heads=G)
        w = (leaves["w_q"], leaves["w_k"], leaves["w_v"])
        out = (api.upipe_attention(leaves["x"], *w, heads_per_stage=U, **kw) if strategy == "upipe"
               else api.ulysses_attention(leaves["x"], *w, **kw))
        grad_out = t["dout"][sl]
    grads = dict(zip(leaves, torch.autograd.grad(out, list(leaves.values()), grad_out)))
    for n in names:  # each rank holds its tokens' share of every parameter's gradient
        grads[n] = grads[n].clone()
        assert grads[n].dtype == t[n].dtype and grads[n].shape == leaves[n].shape, n
        if group is not None:
            torch.distributed.all_reduce(grads[n], group=group)
    return out, grads


def _plan(C):
    """(case index, U or None, dtype, strategy, extras, fused, grad_accum) for cp size C."""
    plan = []
    f64, f32, bf16 = torch.float64, torch.float32, torch.bfloat16
    for ci, (H, G, *_rest) in enumerate(CASES):
        if H % C:
            continue
        legal = legal_heads_per_stage(H, G, C)
        u0 = legal[0]
        plan += [(ci, U, f64, "upipe", "both", False, "fp32") for U in legal]
        plan += [(ci, None, f64, "ulysses", "both", False, "fp32")]
        plan += [(ci, u0, f64, "upipe", ex, False, "fp32") for ex in ("bias", "norm")]
        for dt in (f32, bf16):
            for ex in EXTRAS:
                plan += [(ci, u0, dt, "upipe", ex, False, "fp32"), (ci, None, dt, "ulysses", ex, False, "fp32")]
        for strategy, U in (("upipe", u0), ("ulysses", None)):
            for dt, acc in ((f32, "fp32"), (bf16, "fp32"), (bf16, "input")):
                plan.append((ci, U, dt, strategy, "both", True, acc))
    return plan


def _run_plan(rank, world_size):
    group = torch.distributed.group.WORLD if world_size > 1 else None
    results = []
    for i, (ci, U, dtype, strategy, ex, fused, acc) in enumerate(_plan(world_size)):
        H, G, d, s, rot = CASES[ci]
        N = s * world_size
        t = _inputs(2000 + i, N, H, G, d, dtype)
        freqs = rope_angles(N, rot)
        bias, norm = EXTRAS[ex]
        ref, ref_grads, bk_scale = _reference(t, H, G, freqs, bias, norm, fused)
        out, grads = _run_op(t, H, G, d, s, rank, group, freqs, U, strategy, bias, norm, fused, acc)
        sl = slice(rank * s, (rank + 1) * s)
        assert out.dtype == dtype
        errs = {"out": _rel(out, ref[sl]), "dx": _rel(grads["x"], ref_grads["x"][sl])}
        errs.update({n: _rel(grads[n].reshape(ref_grads[n].shape), ref_grads[n]) for n in ref_grads if n != "x"})
        if bias:  # db_k = Σ_tokens dk nearly cancels: measure it against its summands' scale, not its own norm
            errs["b_k"] = (grads["b_k"].double() - ref_grads["b_k"]).norm().item() / bk_scale
        results.append(((CASES[ci], U, str(dtype), strategy, ex, "fused" if fused else "plain", acc), errs))
    return results


def test_single_rank_matches_reference():
    plan = _plan(1)
    assert len(plan) > 60
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: 1 thread is ~10x faster than 2 on a loaded 2-core machine
    try:
        results = _run_plan(0, 1)
    finally:
        torch.set_num_threads(threads)
    assert_case_errors(results, plan, 1)


def _on_two_ranks(rank, world_size):
    """One launch for both 2-rank tests (spawning ranks costs seconds): the argument checks, then the numerics."""
    return without_communication(_bad_inputs, rank), _run_plan(rank, world_size)


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(_on_two_ranks, 2)


def test_two_ranks_match_reference(two_ranks):
    plan = _plan(2)
    assert any(CASES[ci][1] < 2 for ci, *_ in plan)  # KV replication is among the cases
    for _, results in two_ranks:
        assert_case_errors(results, plan, 2)


def test_four_ranks_match_reference():
    plan = _plan(4)
    assert any(CASES[ci][1] < 4 for ci, *_ in plan)
    for results in run_on_ranks(_run_plan, 4):
        assert_case_errors(results, plan, 4)


def test_without_the_new_arguments_nothing_changes():
    """Passing every new argument as None (qk_norm_eps changed too) gives the same bits as omitting them, for
    UPipe (4 stages) and Ulysses, float32 and bfloat16: the op then runs exactly the code it ran before."""
    H, G, d, s = 8, 2, 8, 6
    for dtype in (torch.float32, torch.bfloat16):
        t = _inputs(5, s, H, G, d, dtype)
        for fn, kw in ((api.upipe_attention, dict(heads_per_stage=2)), (api.ulysses_attention, {})):
            res = []
            for extra in ({}, dict(b_q=None, b_k=None, b_v=None, q_norm_w=None, k_norm_w=None, qk_norm_eps=0.5)):
                ins = [t[n].clone().requires_grad_() for n in ("x", "w_q", "w_k", "w_v")]
                out = fn(*ins, num_heads=H, num_kv_heads=G, cp_group=None, rotary_pos_emb=rope_angles(s, d),
                         **kw, **extra)
                res.append([out, *torch.autograd.grad(out, ins, t["dout"])])
            assert all(torch.equal(a, b) for a, b in zip(*res)), (dtype, fn.__name__)


def test_qk_norm_is_hf_qwen3_rmsnorm():
    """head_norm gives HF Qwen3RMSNorm's bits in bfloat16 and float32 (same operations, same order), and
    head_norm_backward its autograd gradients (input: within one bf16 rounding, measured max 1 ulp; weight:
    float32-level, the op sums in float32 where autograd rounds the per-row products first)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from megatron_upipe.attention.qk_norm import head_norm, head_norm_backward, head_rstd

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        p = (3 * torch.randn(64, 4, 16, generator=gen)).to(dtype)  # [T, h, d]
        hf = Qwen3RMSNorm(16, eps=EPS).to(dtype)
        with torch.no_grad():
            hf.weight.copy_(0.5 + torch.rand(16, generator=gen))
        rstd = head_rstd(p, EPS)
        assert rstd.dtype == torch.float32
        y = head_norm(p, hf.weight.detach(), rstd)
        p_leaf = p.clone().requires_grad_()
        y_hf = hf(p_leaf)
        assert torch.equal(y, y_hf), dtype
        dy = torch.randn(p.shape, generator=gen).to(dtype)
        dp_hf, dw_hf = torch.autograd.grad(y_hf, [p_leaf, hf.weight], dy)
        dw = torch.zeros(16)
        dp = head_norm_backward(p, hf.weight.detach(), rstd, dy, dw)
        assert dp.dtype == dtype
        tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
        assert _rel(dp, dp_hf) < tol and _rel(dw, dw_hf) < tol, (dtype, _rel(dp, dp_hf), _rel(dw, dw_hf))


def _bad(H=8, G=2, d=8, s=4, dtype=torch.float32):
    x = torch.randn(s, 1, D, dtype=dtype)
    w = [torch.randn(n * d, D, dtype=dtype) for n in (H, G, G)]
    ex = dict(b_q=torch.zeros(H * d, dtype=dtype), b_k=torch.zeros(G * d, dtype=dtype),
              b_v=torch.zeros(G * d, dtype=dtype), q_norm_w=torch.ones(d, dtype=dtype),
              k_norm_w=torch.ones(d, dtype=dtype))
    return x, w, ex


BAD = [
    ("bias without b_k, b_v", lambda ex: {"b_q": ex["b_q"]}, ["b_q, b_k and b_v must be given together", "['b_q']"]),
    ("q norm without k norm", lambda ex: {"q_norm_w": ex["q_norm_w"]}, ["q_norm_w and k_norm_w", "together"]),
    ("b_q of the wrong length", lambda ex: {**ex, "b_q": torch.zeros(60)}, ["b_q must be [num_heads*d] = [64]"]),
    ("b_v of the wrong length", lambda ex: {**ex, "b_v": torch.zeros(8)}, ["b_v must be [num_kv_heads*d] = [16]"]),
    ("k norm over D, not d", lambda ex: {**ex, "k_norm_w": torch.ones(D)}, ["k_norm_w must be [8]", "(24,)"]),
    ("bias dtype", lambda ex: {**ex, "b_k": ex["b_k"].double()}, ["b_k must be [2, 8]", "torch.float32",
                                                                   "torch.float64"]),
    ("norm dtype", lambda ex: {**ex, "q_norm_w": ex["q_norm_w"].bfloat16()}, ["q_norm_w must be [8]",
                                                                               "torch.bfloat16"]),
    ("eps not positive", lambda ex: {**ex, "qk_norm_eps": 0.0}, ["qk_norm_eps=0.0", "positive"]),
]


def _bad_inputs(rank):
    torch.manual_seed(rank)
    x, w, ex = _bad()
    n = 0
    for desc, build, expected in BAD:
        for fn, kw in ((api.upipe_attention, dict(heads_per_stage=2)), (api.ulysses_attention, {})):
            with pytest.raises(ValueError) as info:
                fn(x, *w, num_heads=8, num_kv_heads=2, cp_group=torch.distributed.group.WORLD, **kw, **build(ex))
            missing = [e for e in expected if e not in str(info.value)]
            assert not missing, f"{desc}: {missing} not in {str(info.value)!r}"
            n += 1
    # grouped API: grouped shapes are named
    G, g, d = 2, 4, 8
    gw = (w[0].view(G, g, d, D), w[1].view(G, d, D), w[2].view(G, d, D))
    for bad, expected in (({"b_q": torch.zeros(G * g * d)}, "b_q must be [2, 4, 8]"),
                          ({"b_k": torch.zeros(G, g, d)}, "b_k must be [2, 8]")):
        grouped = {"b_q": ex["b_q"].view(G, g, d), "b_k": ex["b_k"].view(G, d), "b_v": ex["b_v"].view(G, d), **bad}
        with pytest.raises(ValueError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            api.upipe_attention_grouped(x, *gw, cp_group=torch.distributed.group.WORLD, **grouped)
        n += 1
    return n


def test_bad_arguments_raise_before_communication_on_every_rank(two_ranks):
    """Each bad argument raises a ValueError naming it and the expected shape/dtype, on both ranks, with the
    all-to-all replaced by a function that fails if reached."""
    assert [count for count, _ in two_ranks] == [2 * len(BAD) + 2] * 2
