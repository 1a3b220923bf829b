"""UPipe and Ulysses against the float64 single-process reference, on 1, 2 and 4 gloo ranks.

Every rank builds the same global inputs from a seed, runs the distributed op on its contiguous shard, and
compares its shard of the output and of dx, plus the (all-reduced) weight gradients, with the reference.
Errors are ‖got − ref‖ / ‖ref‖ per tensor; tolerances per dtype are below.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_upipe.attention import legal_heads_per_stage, ulysses_attention, upipe_attention
from megatron_upipe.attention.reference import reference_attention, rope_angles
from tests.dist_helper import run_on_ranks

# Relative-norm tolerances (measured maxima over all cases: 3e-15, 1.1e-6, 1.3e-2). float64: pure rounding;
# float32: CPU flash attention accumulates in float32;
# bfloat16: 8-bit mantissa inputs and outputs (the reference sees the same bf16-rounded inputs).
TOL = {torch.float64: 1e-12, torch.float32: 5e-6, torch.bfloat16: 3e-2}


def assert_case_errors(results, plan, C) -> None:
    """results: (case description, {tensor: relative error}) per case of `plan`, whose third field is the dtype;
    every error must be within TOL of its dtype. Prints the worst error per dtype (pytest -s shows it)."""
    failures, worst = [], {}
    assert len(results) == len(plan)
    for (desc, errs), (_, _, dtype, *_r) in zip(results, plan):
        for name, e in errs.items():
            worst[str(dtype)] = max(worst.get(str(dtype), 0.0), e)
            if not e <= TOL[dtype]:
                failures.append(f"{desc} {name}: rel err {e:.3e} > {TOL[dtype]:.0e}")
    print(f"C={C}: {len(plan)} cases; worst rel err per dtype: "
          + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())))
    assert not failures, "\n".join(failures)

# (H, G, d, local tokens, rot_dim, causal): MHA, GQA g=2/4/8, KV heads fewer than some cp sizes, partial RoPE,
# no RoPE, non-causal; local lengths 3 and 5 make N = 3·C, 5·C (not powers of two).
CASES = [
    (8, 8, 8, 5, 8, True),
    (8, 4, 8, 3, 8, True),
    (8, 2, 8, 5, 4, True),
    (16, 2, 8, 3, 8, True),
    (8, 1, 8, 3, 8, True),
    (4, 2, 6, 5, None, False),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _inputs(seed, N, b, D, H, G, d, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, b, D, generator=gen, dtype=torch.float64)
    # non-uniform weights: per-row scales so a wrong row mapping cannot cancel out
    ws = [torch.randn(n * d, D, generator=gen, dtype=torch.float64) * torch.rand(n * d, 1, generator=gen, dtype=torch.float64) * 0.6
          for n in (H, G, G)]
    dout = torch.randn(N, b, H * d, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (x, *ws, dout)]


def _check_case(rank, C, group, case, U, dtype, strategy, seed):
    H, G, d, s, rot, causal = case
    b, D = 2, 24
    N = s * C
    x, wq, wk, wv, dout = _inputs(seed, N, b, D, H, G, d, dtype)
    freqs = rope_angles(N, rot) if rot else None
    # reference in float64 on the same (dtype-rounded) inputs
    ref_in = [t.double().requires_grad_() for t in (x, wq, wk, wv)]
    ref = reference_attention(*ref_in, H, G, freqs, causal)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    sl = slice(rank * s, (rank + 1) * s)
    xs = x[sl].clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in (wq, wk, wv)]
    kwargs = dict(num_heads=H, num_kv_heads=G, cp_group=group, rotary_pos_emb=freqs, causal=causal)
    if strategy == "upipe":
        out = upipe_attention(xs, *ws, heads_per_stage=U, **kwargs)
    else:
        out = ulysses_attention(xs, *ws, **kwargs)
    grads = torch.autograd.grad(out, [xs, *ws], dout[sl])
    dws = [g.clone() for g in grads[1:]]
    if group is not None:
        for g in dws:  # each rank holds its tokens' share of the weight gradient
            torch.distributed.all_reduce(g, group=group)
    errs = {
        "out": _rel(out, ref[sl]),
        "dx": _rel(grads[0], ref_grads[0][sl]),
        "dw_q": _rel(dws[0], ref_grads[1]),
        "dw_k": _rel(dws[1], ref_grads[2]),
        "dw_v": _rel(dws[2], ref_grads[3]),
    }
    assert out.dtype == dtype and out.shape == (s, b, H * d)
    return errs


def _plan(C):
    plan = []
    for ci, case in enumerate(CASES):
        H, G = case[0], case[1]
        if H % C:
            continue
        for U in legal_heads_per_stage(H, G, C):
            plan.append((ci, U, torch.float64, "upipe"))
        plan.append((ci, None, torch.float64, "ulysses"))
        smallest = legal_heads_per_stage(H, G, C)[0]
        for dt in (torch.float32, torch.bfloat16):
            plan.append((ci, smallest, dt, "upipe"))
            plan.append((ci, None, dt, "ulysses"))
    return plan


class _IndexAdds(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts index_add calls, and those whose index repeats (summed with atomics in no fixed order on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = self.repeated = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.index_add.default, torch.ops.aten.index_add_.default):
            self.calls += 1
            index = args[2]
            self.repeated += int(index.unique().numel() != index.numel())
        return func(*args, **(kwargs or {}))


def _run_plan(rank, world_size, count_index_adds=False):
    group = torch.distributed.group.WORLD if world_size > 1 else None
    results = []
    adds = _IndexAdds()
    for i, (ci, U, dtype, strategy) in enumerate(_plan(world_size)):
        with adds if count_index_adds else contextlib.nullcontext():
            errs = _check_case(rank, world_size, group, CASES[ci], U, dtype, strategy, seed=1000 + i)
        results.append(((CASES[ci], U, str(dtype), strategy), errs))
    return (results, (adds.calls, adds.repeated)) if count_index_adds else results


def _assert_results(results, plan):
    failures = []
    for (desc, errs), (_, _, dtype, _) in zip(results, plan):
        for name, e in errs.items():
            if not e <= TOL[dtype]:
                failures.append(f"{desc} {name}: rel err {e:.3e} > {TOL[dtype]:.0e}")
    assert not failures, "\n".join(failures)


def test_single_rank_matches_reference():
    plan = _plan(1)
    assert len(plan) > 20
    _assert_results(_run_plan(0, 1), plan)


@pytest.mark.parametrize("world_size", [2, 4])
def test_distributed_matches_reference(world_size):
    """Also: the weight gradients' replica sums (KV heads fewer than cp ranks: C·n_kv > G) never give index_add a
    repeated index, whose sum CUDA makes with atomics in no fixed order (attention/upipe.py ordered_index_add_)."""
    plan = _plan(world_size)
    per_rank = run_on_ranks(_run_plan, world_size, True)
    for results, (calls, repeated) in per_rank:
        _assert_results(results, plan)
        assert calls > 0 and repeated == 0, (calls, repeated)


def test_upipe_equals_ulysses_every_u():
    """Same inputs, float32: every legal U gives Ulysses' output and gradients (C = 1, many stages)."""
    H, G, d, N, b, D = 16, 4, 8, 11, 1, 32
    x, wq, wk, wv, dout = _inputs(7, N, b, D, H, G, d, torch.float32)
    freqs = rope_angles(N, d)

    def run(fn, **kw):
        ins = [t.clone().requires_grad_() for t in (x, wq, wk, wv)]
        out = fn(*ins, num_heads=H, num_kv_heads=G, cp_group=None, rotary_pos_emb=freqs, **kw)
        return [out, *torch.autograd.grad(out, ins, dout)]

    base = run(ulysses_attention)
    for U in legal_heads_per_stage(H, G, 1):
        for a, bb in zip(run(upipe_attention, heads_per_stage=U), base):
            assert _rel(a, bb) < 1e-5, U
