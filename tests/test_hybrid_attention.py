"""Hybrid UPipe x ring (`ring_group=`): all-to-all inside each group of A ranks, causal ring attention across the R
groups, tokens placed by attention.layout.local_positions. Output and every gradient against float64 attention of
the whole sequence (attention/reference.py, plain softmax attention written for the tests), for a2a x ring layouts
2x2, 1x2, 2x1 (4 and 2 gloo ranks) and 4x2, 2x4 (8 ranks, all three dtypes in one job), MHA, GQA and KV
replication (one KV head on two a2a ranks), every legal U and Ulysses, with RoPE, float64 / float32 / bf16; global
lengths that are not powers of two. The ring's overlapped passes (ring_overlap) give the serial op's bits."""

from __future__ import annotations

import pytest
import torch

from tests.dist_helper import run_on_ranks

# relative (norm) error against the reference on the same dtype-rounded inputs; well-scaled inputs (unit logits)
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}
WORST: dict = {}  # dtype -> worst error over every case so far (pytest -s prints it)


def _groups(A: int, R: int):
    """(a2a group, ring group, a2a rank, ring rank) of this process (benchmarks/multirank_check.hybrid_groups)."""
    from megatron_upipe.benchmarks.multirank_check import hybrid_groups

    return hybrid_groups(A, R)


def _job(rank, world_size, A, R, H, G, N, dtype, strategies):
    from megatron_upipe.attention import api
    from megatron_upipe.attention.layout import local_positions
    from megatron_upipe.attention.reference import reference_attention, rope_angles

    a2a, ring, a, r = _groups(A, R)
    d, D, b = 8, 32, 1
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, b, D, generator=gen, dtype=torch.float64).to(dtype).double()
    wq, wk, wv = (torch.randn(n * d, D, generator=gen, dtype=torch.float64).to(dtype).double() * D ** -0.5
                  for n in (H, G, G))
    dy = torch.randn(N, b, H * d, generator=gen, dtype=torch.float64).to(dtype).double()
    freqs = rope_angles(N, d)
    ins = [t.clone().requires_grad_() for t in (x, wq, wk, wv)]
    ref = reference_attention(*ins, H, G, freqs)
    ref_grads = torch.autograd.grad(ref, ins, dy)
    pos = local_positions(N, a, A, r, R)
    out = {}
    for name in strategies:
        xs = x[pos].to(dtype).requires_grad_()
        ws = [w.to(dtype).requires_grad_() for w in (wq, wk, wv)]
        kw = dict(num_heads=H, num_kv_heads=G, cp_group=a2a, ring_group=ring, rotary_pos_emb=freqs.to(dtype))
        y = (api.ulysses_attention(xs, *ws, **kw) if name == "ulysses" else
             api.upipe_attention(xs, *ws, heads_per_stage=int(name.split(":")[1]), **kw))
        grads = torch.autograd.grad(y, [xs, *ws], dy[pos].to(dtype))
        dws = [g.double() for g in grads[1:]]
        for g in dws:  # weight gradients: this rank's share, summed over all ranks
            torch.distributed.all_reduce(g)
        errs = [((y.double() - ref[pos]).norm() / ref[pos].norm()).item(),
                ((grads[0].double() - ref_grads[0][pos]).norm() / ref_grads[0][pos].norm()).item()]
        errs += [((g - rg).norm() / rg.norm()).item() for g, rg in zip(dws, ref_grads[1:])]
        out[name] = errs
    return out


CASES = [  # (A, R, H, G, N, strategies)
    (2, 2, 8, 2, 72, ["upipe:2", "upipe:4", "upipe:8", "ulysses"]),  # GQA; U over the a2a group's 2 ranks
    (2, 2, 4, 1, 40, ["upipe:2", "ulysses"]),  # one KV head replicated on both a2a ranks
    (1, 2, 4, 2, 24, ["upipe:1", "upipe:2", "ulysses"]),  # ring only
    (2, 1, 4, 4, 24, ["upipe:2", "ulysses"]),  # all-to-all only (today's op through the same path), MHA
]


def _cases_job(rank, world_size, runs):
    """Every (case index, dtype) of `runs` that has this world size, one after another in one world."""
    return {(i, str(dtype)): _job(rank, world_size, *CASES[i][:5], dtype, CASES[i][5]) for i, dtype in runs}


@pytest.fixture(scope="module")
def case_results():
    """(case index, dtype name) -> each rank's errors: one spawned world per world size (4 and 2 ranks)."""
    out = {}
    for world in sorted({A * R for A, R, *_ in CASES}, reverse=True):
        runs = [(i, dtype) for i, (A, R, *_) in enumerate(CASES) if A * R == world for dtype in TOL]
        per_rank = run_on_ranks(_cases_job, world, runs)
        out.update({key: [per[key] for per in per_rank] for key in per_rank[0]})
    return out


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c[0]}x{c[1]}-H{c[2]}G{c[3]}-N{c[4]}" for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_hybrid_equals_full_attention(case_results, i, dtype):
    results = case_results[(i, str(dtype))]
    for rank, per in enumerate(results):
        for name, errs in per.items():
            assert max(errs) < TOL[dtype], (rank, name, errs)
            WORST[str(dtype)] = max(WORST.get(str(dtype), 0.0), max(errs))
    print(WORST)


def _job_dtypes(rank, world_size, A, R, H, G, N, dtypes, strategies):
    return {str(dtype): _job(rank, world_size, A, R, H, G, N, dtype, strategies) for dtype in dtypes}


CASES_8 = [  # (A, R, H, G, N, strategies) on 8 ranks
    (4, 2, 8, 2, 80, ["upipe:4", "upipe:8", "ulysses"]),  # GQA, each KV head replicated on 2 of the 4 a2a ranks
    (2, 4, 8, 4, 48, ["upipe:2", "upipe:4", "upipe:8", "ulysses"]),  # GQA, a ring of 4
]


def _eight_ranks_job(rank, world_size):
    return [_job_dtypes(rank, world_size, *case[:5], list(TOL), case[5]) for case in CASES_8]


@pytest.fixture(scope="module")
def eight_rank_results():
    """Per case of CASES_8, each rank's errors per dtype: both cases in one world of 8 ranks."""
    per_rank = run_on_ranks(_eight_ranks_job, 8)
    return [[per[i] for per in per_rank] for i in range(len(CASES_8))]


@pytest.mark.parametrize("i", range(len(CASES_8)), ids=[f"{c[0]}x{c[1]}-H{c[2]}G{c[3]}-N{c[4]}" for c in CASES_8])
def test_hybrid_on_eight_ranks_equals_full_attention(eight_rank_results, i):
    dtypes = list(TOL)
    results = eight_rank_results[i]
    for rank, per_dtype in enumerate(results):
        for dtype in dtypes:
            for name, errs in per_dtype[str(dtype)].items():
                assert max(errs) < TOL[dtype], (rank, dtype, name, errs)
                WORST[str(dtype)] = max(WORST.get(str(dtype), 0.0), max(errs))
    print(WORST)


def _overlap_job(rank, world_size, A, R, H, G, N, strategies):
    """Per dtype and strategy: does ring_overlap=True give the serial op's output and gradients bit for bit?"""
    from megatron_upipe.attention import api
    from megatron_upipe.attention.layout import local_positions
    from megatron_upipe.attention.reference import rope_angles

    a2a, ring, a, r = _groups(A, R)
    d, D = 8, 32
    pos = local_positions(N, a, A, r, R)
    same = {}
    for dtype in TOL:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(N, 1, D, generator=gen, dtype=dtype)[pos]
        ws = [torch.randn(n * d, D, generator=gen, dtype=dtype) * D ** -0.5 for n in (H, G, G)]
        dy = torch.randn(N, 1, H * d, generator=gen, dtype=dtype)[pos]
        for name in strategies:
            runs = []
            for ring_overlap in (False, True):
                ins = [t.clone().requires_grad_() for t in (x, *ws)]
                kw = dict(num_heads=H, num_kv_heads=G, cp_group=a2a, ring_group=ring, ring_overlap=ring_overlap,
                          rotary_pos_emb=rope_angles(N, d).to(dtype))
                y = (api.ulysses_attention(*ins, **kw) if name == "ulysses" else
                     api.upipe_attention(*ins, heads_per_stage=int(name.split(":")[1]), **kw))
                runs.append([y, *torch.autograd.grad(y, ins, dy)])
            same[f"{dtype}/{name}"] = all(torch.equal(s, o) for s, o in zip(*runs))
    return same


def test_ring_overlap_equals_serial_passes_bit_for_bit():
    for per_rank in run_on_ranks(_overlap_job, 4, 2, 2, 8, 2, 72, ["upipe:2", "upipe:8", "ulysses"]):
        assert len(per_rank) == 9 and all(per_rank.values()), per_rank


def _refused(rank, world_size):
    from megatron_upipe.attention import api

    ring = torch.distributed.group.WORLD
    x = torch.randn(4, 1, 16)
    w = [torch.randn(n * 4, 16) for n in (2, 2, 2)]
    kw = dict(num_heads=2, num_kv_heads=2, cp_group=None, ring_group=ring)
    msgs = []
    for extra in (dict(causal=False), dict(overlap=True), dict(ring_group=None, ring_overlap=True)):
        try:
            api.upipe_attention(x, *w, **{**kw, **extra})
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_what_the_ring_does_not_do_is_refused_in_one_line():
    msgs = run_on_ranks(_refused, 2)[0]
    assert "drop causal=False or ring_group" in msgs[0] and "drop overlap=True or ring_group" in msgs[1], msgs
    assert msgs[2].startswith("ring_overlap=True") and "needs ring_group" in msgs[2], msgs
