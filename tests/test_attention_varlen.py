"""Packed sequences with document masking (cu_seqlens) in the UPipe/Ulysses op, against the float64 reference.

On 1, 2 and 4 gloo ranks (all cases of one cp size in one launch), every rank builds the same global inputs and
document boundaries from a seed, runs the op on its contiguous shard with the global cu_seqlens, and compares its
shard of out and dx, plus the all-reduced gradients of every weight (and bias, QK-norm weight, W_O, input-norm
weight when given), with `reference_attention(..., cu_seqlens=...)`: plain full-sequence float64 attention whose
block-diagonal causal mask is built from each token's document id, independently of the op's per-length kernel
calls. RoPE uses per-document positions (position ids reset at every document start), passed as all N rows or as
this rank's s rows, alternately.

Documents: "mixed" has a document of length 1, an empty document (a repeated boundary) and documents straddling
every CP shard boundary (asserted); "tiny" packs N = 512 tokens into ~200 documents of 1-4 tokens. Cases: MHA, GQA
and KV replication (G < C), every legal U in float64, UPipe and Ulysses, float64 / float32 / bfloat16, QKV bias and
QK-norm, W_O and the input RMSNorm fused, one non-causal case (full attention inside each document). Tolerances are
test_attention_numerics.py's TOL (justified there: float64 rounding; float32 CPU flash accumulation; bf16 inputs
and outputs), with inputs well scaled as in test_attention_qk_extras.py; the K bias gradient, which nearly cancels,
is measured against its summands' scale as there.

Also: one document ([0, N]) gives the fixed-length op's bits (torch.equal, out and every gradient); empty documents
change nothing (torch.equal); bad cu_seqlens raise one-line ValueErrors naming the argument, before any
communication, on every rank.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_upipe.attention import api, legal_heads_per_stage
from megatron_upipe.attention.reference import reference_attention
from tests.dist_helper import run_on_ranks, without_communication
from tests.test_attention_numerics import assert_case_errors

# (H, G, d, local tokens, rot_dim): MHA; GQA g=4 (KV heads replicated at C=4); one KV head (replicated at C=2, 4)
# with partial RoPE. Local lengths 11, 9, 7 make N = 11·C, 9·C, 7·C.
CASES = [(4, 4, 8, 11, 8), (8, 2, 8, 9, 8), (4, 1, 8, 7, 4)]
D = 24
TINY_N = 512
EPS = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _documents(kind: str, N: int, seed: int, s: int = 0) -> torch.Tensor:
    """cu_seqlens int32 [n + 1] of N tokens. mixed: lengths 1..8, the first document of length 1, an empty one
    after it, no boundary at a multiple of s (every shard boundary falls inside a document); tiny: lengths 1..4."""
    gen = torch.Generator().manual_seed(seed)
    top = 7 if kind == "mixed" else 4
    lengths = [1] if kind == "mixed" else []
    while sum(lengths) < N:
        n = int(torch.randint(1, top + 1, (1,), generator=gen))
        if kind == "mixed" and (sum(lengths) + n) % s == 0:
            n += 1  # cross the shard boundary instead of ending on it
        lengths.append(min(n, N - sum(lengths)))
    if kind == "mixed":
        lengths.insert(1, 0)  # an empty document
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)


def _positions_reset(cu: torch.Tensor, N: int, rot: int) -> torch.Tensor:
    """RoPE angles [N, 1, 1, rot] (float64) of per-document positions: token i gets i - (its document's start)."""
    b = cu.long()
    starts = torch.repeat_interleave(b[:-1], b.diff())  # [N] start of each token's document
    pos = torch.arange(N, dtype=torch.float64) - starts
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    f = torch.outer(pos, inv)  # [N, rot/2]
    return torch.cat([f, f], -1).view(N, 1, 1, rot)


def _inputs(seed, N, H, G, d, dtype):
    """Natural-order tensors rounded to dtype (b = 1): x [N, 1, D], w_q [H·d, D], w_k, w_v [G·d, D], biases, QK-norm
    weights [d], w_o [D, H·d], norm_w [D], dout [N, 1, H·d], dy [N, 1, D]; well scaled (see the module doc)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def rows(n):  # [n, D] ~ N(0, 1/D) x a per-row factor in [0.5, 1.5)
        return rnd(n, D) / D ** 0.5 * (0.5 + torch.rand(n, 1, generator=gen, dtype=torch.float64))

    t = dict(x=rnd(N, 1, D), w_q=rows(H * d), w_k=rows(G * d), w_v=rows(G * d), b_q=0.5 * rnd(H * d),
             b_k=0.5 * rnd(G * d), b_v=0.5 * rnd(G * d),
             q_norm_w=0.5 + torch.rand(d, generator=gen, dtype=torch.float64),
             k_norm_w=0.5 + torch.rand(d, generator=gen, dtype=torch.float64), w_o=rnd(D, H * d) / (H * d) ** 0.5,
             norm_w=0.5 + torch.rand(D, generator=gen, dtype=torch.float64), dout=rnd(N, 1, H * d), dy=rnd(N, 1, D))
    return {k: v.to(dtype) for k, v in t.items()}


def _names(extras: bool, fused: bool) -> list[str]:
    return ["w_q", "w_k", "w_v"] + (["b_q", "b_k", "b_v", "q_norm_w", "k_norm_w"] if extras else []) + \
        (["w_o", "norm_w"] if fused else [])


def _reference(t, H, G, freqs, cu, causal, extras, fused):
    """float64 reference on the dtype-rounded inputs: (out, {name: gradient}, scale of db_k's error or None)."""
    names = ["x"] + _names(extras, fused)
    ins = {n: t[n].double().requires_grad_() for n in names}
    x = ins["x"]
    if fused:
        x = ins["norm_w"] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    extra = {n: ins.get(n) for n in ("b_q", "b_k", "b_v", "q_norm_w", "k_norm_w")}
    wrt = list(ins.values())
    if extras:  # b_k per token [N, 1, G·d], so that its per-token gradients come out too
        extra["b_k"] = ins["b_k"].expand(t["x"].shape[0], 1, ins["b_k"].shape[0])
        wrt.append(extra["b_k"])
    out = reference_attention(x, ins["w_q"], ins["w_k"], ins["w_v"], H, G, freqs, causal, **extra, qk_norm_eps=EPS,
                              cu_seqlens=cu)
    if fused:
        out = out @ ins["w_o"].t()  # [N, 1, H·d] @ [H·d, D]
    grads = torch.autograd.grad(out, wrt, t["dy" if fused else "dout"].double())
    bk_scale = grads[-1].abs().sum((0, 1)).norm().item() if extras else None
    return out, dict(zip(names, grads)), bk_scale


def _run_op(t, H, G, d, s, rank, group, rope, cu, U, strategy, causal, extras, fused, sum_grads=True):
    """The op on this rank's shard: (out, {name: gradient}) with weight-like gradients all-reduced, natural layout."""
    sl = slice(rank * s, (rank + 1) * s)
    names = _names(extras, fused)
    leaves = {"x": t["x"][sl].clone().requires_grad_(), **{n: t[n].clone().requires_grad_() for n in names}}
    kw = dict(cp_group=group, rotary_pos_emb=rope, causal=causal, qk_norm_eps=EPS)
    if cu is not None:
        kw["cu_seqlens"] = cu
    kw.update({n: leaves[n] for n in names if n not in ("w_q", "w_k", "w_v")})
    if fused:  # grouped API (the model's layout) with W_O and the input norm fused
        g = H // G
        w = (leaves["w_q"].view(G, g, d, D), leaves["w_k"].view(G, d, D), leaves["w_v"].view(G, d, D))
        for n, shape in (("b_q", (G, g, d)), ("b_k", (G, d)), ("b_v", (G, d))):
            if n in kw:
                kw[n] = kw[n].view(shape)  # [n·d] -> grouped
        out = (api.upipe_attention_grouped(leaves["x"], *w, heads_per_stage=U, **kw) if strategy == "upipe"
               else api.ulysses_attention_grouped(leaves["x"], *w, **kw))
        grad_out = t["dy"][sl]
    else:
        kw.update(num_heads=H, num_kv_heads=G)
        w = (leaves["w_q"], leaves["w_k"], leaves["w_v"])
        out = (api.upipe_attention(leaves["x"], *w, heads_per_stage=U, **kw) if strategy == "upipe"
               else api.ulysses_attention(leaves["x"], *w, **kw))
        grad_out = t["dout"][sl]
    grads = dict(zip(leaves, torch.autograd.grad(out, list(leaves.values()), grad_out)))
    for n in names:  # each rank holds its tokens' share of every parameter's gradient
        grads[n] = grads[n].clone()
        assert grads[n].dtype == t[n].dtype and grads[n].shape == leaves[n].shape, n
        if group is not None and sum_grads:
            torch.distributed.all_reduce(grads[n], group=group)
    return out, grads


def _plan(C):
    """(case index, U or None, dtype, strategy, documents, causal, extras, fused) for cp size C."""
    f64, f32, bf16 = torch.float64, torch.float32, torch.bfloat16
    plan = []
    for ci, (H, G, *_r) in enumerate(CASES):
        if H % C:
            continue
        legal = legal_heads_per_stage(H, G, C)
        u0 = legal[0]
        plan += [(ci, U, f64, "upipe", "mixed", True, False, False) for U in legal]
        plan += [(ci, None, f64, "ulysses", "mixed", True, False, False)]
        for dt in (f32, bf16):
            plan += [(ci, u0, dt, "upipe", "mixed", True, False, False),
                     (ci, None, dt, "ulysses", "mixed", True, False, False)]
        plan += [(ci, u0, f64, "upipe", "mixed", True, True, False)]  # QKV bias + QK-norm
        for dt in (f32, bf16):  # bias, QK-norm, W_O and the input norm (float32 statistics: not in float64)
            plan += [(ci, u0, dt, "upipe", "mixed", True, True, True)]
        plan += [(ci, None, bf16, "ulysses", "mixed", True, True, True)]
    plan += [(0, legal_heads_per_stage(4, 4, C)[0], torch.float64, "upipe", "mixed", False, False, False)]  # full
    # ~200 tiny documents in N = 512 (local lengths 512 / C)
    plan += [(1, legal_heads_per_stage(8, 2, C)[0], f32, "upipe", "tiny", True, False, False),
             (1, None, f64, "ulysses", "tiny", True, True, False), (1, None, bf16, "ulysses", "tiny", True, True, True)]
    return plan


def _crosses_shards(cu: torch.Tensor, s: int, C: int) -> bool:
    b = cu.tolist()
    return all(any(a < r * s < z for a, z in zip(b, b[1:])) for r in range(1, C))


def _run_plan(rank, world_size):
    group = torch.distributed.group.WORLD if world_size > 1 else None
    results = []
    for i, (ci, U, dtype, strategy, kind, causal, extras, fused) in enumerate(_plan(world_size)):
        H, G, d, s, rot = CASES[ci]
        N = TINY_N if kind == "tiny" else s * world_size
        s = N // world_size
        cu = _documents(kind, N, 100 + i, s)
        if kind == "mixed":
            assert _crosses_shards(cu, s, world_size) and 1 in cu.diff().tolist() and 0 in cu.diff().tolist()
        t = _inputs(3000 + i, N, H, G, d, dtype)
        freqs = _positions_reset(cu, N, rot)
        rope = freqs if i % 2 else freqs[rank * s:(rank + 1) * s]  # all N rows, or this rank's rows
        ref, ref_grads, bk_scale = _reference(t, H, G, freqs, cu, causal, extras, fused)
        out, grads = _run_op(t, H, G, d, s, rank, group, rope, cu, U, strategy, causal, extras, fused)
        sl = slice(rank * s, (rank + 1) * s)
        assert out.dtype == dtype
        errs = {"out": _rel(out, ref[sl]), "dx": _rel(grads["x"], ref_grads["x"][sl])}
        errs.update({n: _rel(grads[n].reshape(ref_grads[n].shape), ref_grads[n]) for n in ref_grads if n != "x"})
        if extras:  # db_k = Σ_tokens dk nearly cancels: against its summands' scale (test_attention_qk_extras.py)
            errs["b_k"] = (grads["b_k"].double() - ref_grads["b_k"]).norm().item() / bk_scale
        n_docs = int((cu.diff() > 0).sum())
        results.append(((CASES[ci], U, str(dtype), strategy, f"{n_docs} docs", "causal" if causal else "full",
                         "extras" if extras else "", "fused" if fused else ""), errs))
    return results, _single_document_is_plain(rank, world_size, group), _empty_documents_change_nothing(rank, group)


def _single_document_is_plain(rank, C, group) -> list[str]:
    """cu_seqlens = [0, N] gives the bits of the call without it (out and every gradient), UPipe and Ulysses,
    float32 and bfloat16, with bias, QK-norm, W_O and the input norm too."""
    H, G, d, s, rot = CASES[1]
    N = s * C
    freqs = _positions_reset(torch.tensor([0, N], dtype=torch.int32), N, rot)
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        t = _inputs(7, N, H, G, d, dtype)
        for strategy, U in (("upipe", legal_heads_per_stage(H, G, C)[0]), ("ulysses", None)):
            for extras, fused in ((False, False), (True, True)):
                runs = [_run_op(t, H, G, d, s, rank, group, freqs, cu, U, strategy, True, extras, fused, False)
                        for cu in (None, torch.tensor([0, N], dtype=torch.int32))]
                (o0, g0), (o1, g1) = runs
                if not (torch.equal(o0, o1) and all(torch.equal(g0[n], g1[n]) for n in g0)):
                    bad.append(f"{dtype} {strategy} extras={extras} fused={fused}")
    return bad


def _empty_documents_change_nothing(rank, group) -> bool:
    """Repeated boundaries (empty documents, at the start, inside and at the end) give the same bits as without."""
    C = 1 if group is None else torch.distributed.get_world_size(group)
    H, G, d, s, rot = CASES[1]
    N = s * C
    cu = _documents("tiny", N, 5)
    b = cu.tolist()
    padded = torch.tensor([0, 0] + b[1:3] + [b[2]] + b[3:] + [N], dtype=torch.int32)
    t = _inputs(9, N, H, G, d, torch.float32)
    freqs = _positions_reset(cu, N, rot)
    runs = [_run_op(t, H, G, d, s, rank, group, freqs, c, None, "ulysses", True, False, False, False)
            for c in (cu, padded)]
    (o0, g0), (o1, g1) = runs
    return torch.equal(o0, o1) and all(torch.equal(g0[n], g1[n]) for n in g0)


def _check_launch(per_rank, C):
    plan = _plan(C)
    assert any(p[4] == "tiny" for p in plan) and any(not p[5] for p in plan)
    for results, single_bad, empty_ok in per_rank:
        assert_case_errors(results, plan, C)
        assert not single_bad, f"one document differs from plain causal: {single_bad}"
        assert empty_ok


def test_single_rank_matches_reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster on a loaded 2-core machine
    try:
        _check_launch([_run_plan(0, 1)], 1)
    finally:
        torch.set_num_threads(threads)


def _on_two_ranks(rank, world_size):
    """One launch for both 2-rank tests (spawning ranks costs seconds): the argument checks, then the numerics."""
    return without_communication(_bad_inputs, rank), _run_plan(rank, world_size)


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(_on_two_ranks, 2)


def test_two_ranks_match_reference(two_ranks):
    assert any(CASES[ci][1] < 2 for ci, *_ in _plan(2))  # KV replication is among the cases
    _check_launch([r for _, r in two_ranks], 2)


def test_four_ranks_match_reference():
    assert any(CASES[ci][1] < 4 for ci, *_ in _plan(4))
    _check_launch(run_on_ranks(_run_plan, 4), 4)


# --------------------------------------------------------------------------------------------- bad input
def _cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


# (description, cu_seqlens for N = 8 (C = 2 ranks x 4 tokens), expected substrings); b = 1 unless given
BAD = [
    ("int64", _cu(0, 3, 8, dtype=torch.int64), ["cu_seqlens has dtype torch.int64", "torch.int32"]),
    ("a list", [0, 3, 8], ["cu_seqlens must be an int32 tensor", "list"]),
    ("2-D", _cu(0, 3, 8).view(1, 3), ["cu_seqlens must be 1-D", "(1, 3)"]),
    ("one entry", _cu(8), ["at least [0, N]", "(1,)"]),
    ("not starting at 0", _cu(1, 3, 8), ["must start at 0", "cu_seqlens[0]=1"]),
    ("decreasing", _cu(0, 5, 3, 8), ["non-decreasing", "cu_seqlens[2]=3 < cu_seqlens[1]=5"]),
    ("ending before N", _cu(0, 3, 7), ["ends at 7", "N = C·s = 8"]),
    ("ending after N", _cu(0, 3, 9), ["ends at 9", "N = C·s = 8"]),
]


def _bad_inputs(rank):
    torch.manual_seed(rank)
    H, G, d, s = 8, 2, 8, 4
    w = [torch.randn(n * d, D) for n in (H, G, G)]
    n = 0
    cases = [(desc, cu, exp, 1) for desc, cu, exp in BAD]
    cases.append(("micro-batch 2", _cu(0, 3, 8), ["micro-batch must be 1", "b=2"], 2))
    for desc, cu, expected, b in cases:
        x = torch.randn(s, b, D)
        for fn, kw in ((api.upipe_attention, dict(heads_per_stage=2)), (api.ulysses_attention, {})):
            with pytest.raises(ValueError) as info:
                fn(x, *w, num_heads=H, num_kv_heads=G, cp_group=torch.distributed.group.WORLD, cu_seqlens=cu, **kw)
            msg = str(info.value)
            missing = [e for e in expected if e not in msg]
            assert not missing and "\n" not in msg, f"{desc}: {missing} not in {msg!r}"
            n += 1
    # grouped API too
    gw = (w[0].view(G, H // G, d, D), w[1].view(G, d, D), w[2].view(G, d, D))
    with pytest.raises(ValueError, match="must start at 0"):
        api.upipe_attention_grouped(torch.randn(s, 1, D), *gw, cp_group=torch.distributed.group.WORLD,
                                    cu_seqlens=_cu(2, 8))
    return n + 1


def test_bad_cu_seqlens_raise_before_communication_on_every_rank(two_ranks):
    """Each bad cu_seqlens raises a one-line ValueError naming it and the fix, on both ranks, with the all-to-all
    replaced by a function that fails if reached."""
    assert [count for count, _ in two_ranks] == [2 * (len(BAD) + 1) + 1] * 2


def test_cu_seqlens_on_another_device_or_without_values_is_refused():
    """A cu_seqlens on another device than x (and not the CPU), or one whose values cannot be read (a fake tensor
    made inside FakeTensorMode), is refused with the fix."""
    H, G, d = 4, 2, 8
    x, w = torch.randn(6, 1, D), [torch.randn(n * d, D) for n in (H, G, G)]
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_cuda = torch.tensor([0, 2, 6], dtype=torch.int32, device="cuda")
        fake_cpu = torch.tensor([0, 2, 6], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"cu_seqlens is on cuda:0 but x is on cpu; pass it on the CPU"):
            api.ulysses_attention(x, *w, num_heads=H, num_kv_heads=G, cp_group=None, cu_seqlens=on_cuda)
        with pytest.raises(ValueError, match="values cannot be read.*pass a real CPU tensor"):
            api.ulysses_attention(x, *w, num_heads=H, num_kv_heads=G, cp_group=None, cu_seqlens=fake_cpu)
