"""Pipelined UPipe stages (overlap=True, memory.upipe_overlap): the same results as the serial op bit for bit, the
collectives really in flight together, and the memory bound of one more stage of buffers.

On 2 and 4 gloo ranks, for every legal U of MHA, GQA and KV-replicating head counts, float64 (2 ranks)/float32/bfloat16,
with and without the extras the model uses (fused input norm, output projection, QKV bias, QK-norm, bf16
accumulation, packed documents), the pipelined op's output and every gradient equal the serial op's
(torch.equal). Ulysses is one stage: nothing to pipeline (its op takes no overlap argument). The serial op itself
is checked against float64 references in test_attention_numerics.py,
test_attention_qk_extras.py and test_attention_varlen.py; here one float64 case is also checked against a plain
causal GQA attention written in this file.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from megatron_upipe.attention import legal_heads_per_stage, upipe_attention_grouped
from tests.dist_helper import run_on_ranks

HEADS = [(8, 8), (8, 2), (16, 4), (8, 1)]  # (H, G): MHA, GQA, GQA with rounds, one KV head (replicated for C > 1)
d, D, s_local = 8, 32, 6


def _inputs(seed, N, H, G, dtype, b=1):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    g = H // G
    return dict(
        x=rnd(N, b, D), w_q=rnd(G, g, d, D, scale=D ** -0.5), w_k=rnd(G, d, D, scale=D ** -0.5),
        w_v=rnd(G, d, D, scale=D ** -0.5), w_o=rnd(D, H * d, scale=(H * d) ** -0.5), norm_w=1 + rnd(D, scale=0.1),
        b_q=rnd(G, g, d, scale=0.1), b_k=rnd(G, d, scale=0.1), b_v=rnd(G, d, scale=0.1),
        q_norm_w=1 + rnd(d, scale=0.1), k_norm_w=1 + rnd(d, scale=0.1),
        dout=rnd(N, b, H * d), dy=rnd(N, b, D), rope=torch.randn(N, 1, 1, d // 2, generator=gen,
                                                                 dtype=torch.float64).repeat(1, 1, 1, 2),
    )  # rope: angles [N, 1, 1, d] as megatron's table holds them (each frequency twice)


VARIANTS = {  # name -> (tensors passed besides x, w_q, w_k, w_v; extra keyword arguments)
    "plain": ((), {}),
    "norm+w_o": (("norm_w", "w_o"), {}),
    "bias+qk_norm": (("b_q", "b_k", "b_v", "q_norm_w", "k_norm_w"), {}),
    "docs": ((), {"cu_seqlens": "docs"}),
    "all, bf16 accumulation": (("norm_w", "w_o", "b_q", "b_k", "b_v", "q_norm_w", "k_norm_w"), {"grad_accum": "input"}),
}


def _run(rank, C, group, t, names, kw, overlap, U):
    """Output and gradients of this rank's shard (weight gradients all-reduced over the group)."""
    s = t["x"].shape[0] // C
    sl = slice(rank * s, (rank + 1) * s)
    ins = {"x": t["x"][sl].clone().requires_grad_()}
    for n in ("w_q", "w_k", "w_v", *names):
        ins[n] = t[n].clone().requires_grad_()
    kw = dict(kw)
    if kw.get("cu_seqlens") == "docs":  # documents of 5, 1 and the rest: boundaries inside and across shards
        N = t["x"].shape[0]
        kw["cu_seqlens"] = torch.tensor([0, 5, 6, N], dtype=torch.int32)
    x = ins.pop("x")
    out = upipe_attention_grouped(x, cp_group=group, heads_per_stage=U, rotary_pos_emb=t["rope"][sl],
                                  overlap=overlap, **ins, **kw)
    grad_out = (t["dy"] if "w_o" in names else t["dout"])[sl]
    leaves = [x, *ins.values()]
    grads = torch.autograd.grad(out, leaves, grad_out)
    reduced = [grads[0]]
    for g in grads[1:]:
        g = g.clone()
        if group is not None:
            torch.distributed.all_reduce(g, group=group)
        reduced.append(g)
    return [out.detach(), *reduced]


def _job(rank, world_size):
    C = world_size
    group = torch.distributed.group.WORLD
    mismatches, checked = [], 0
    # float64 on 2 ranks only: the order of the adds is what can differ, and the 16-bit and float32 cases show it
    dtypes = (torch.float64, torch.float32, torch.bfloat16) if C == 2 else (torch.float32, torch.bfloat16)
    for H, G in HEADS:
        for dtype in dtypes:
            for vname, (names, kw) in VARIANTS.items():
                if kw.get("grad_accum") == "input" and dtype != torch.bfloat16:
                    continue
                t = _inputs(hash((H, G, str(dtype), vname)) % 1000, s_local * C, H, G, dtype)
                for U in legal_heads_per_stage(H, G, C):
                    serial = _run(rank, C, group, t, names, kw, False, U)
                    for overlap in ("stages", "outputs"):
                        piped = _run(rank, C, group, t, names, kw, overlap, U)
                        checked += 1
                        for i, (a, b) in enumerate(zip(piped, serial)):
                            if not torch.equal(a, b):
                                mismatches.append((H, G, str(dtype), vname, U, overlap, i,
                                                   (a.double() - b.double()).abs().max().item()))
    return checked, mismatches


def _two_rank_jobs(rank, world_size):
    return {"bits": _job(rank, world_size), "reference": _reference_job(rank, world_size),
            "inflight": _inflight_job(rank, world_size)}


@pytest.fixture(scope="module")
def two_ranks():
    """The module's three jobs on 2 ranks, one after another in one world (one spawn): name -> per-rank results."""
    per_rank = run_on_ranks(_two_rank_jobs, 2)
    return {name: [per[name] for per in per_rank] for name in per_rank[0]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_pipelined_stages_equal_serial_bit_for_bit(two_ranks, world_size):
    for checked, mismatches in (two_ranks["bits"] if world_size == 2 else run_on_ranks(_job, world_size)):
        assert checked > 80 and not mismatches, mismatches[:10]


def _reference(x, w_q, w_k, w_v, angles):
    """float64 causal GQA attention with RoPE (rotate-half), all N tokens: [N, b, D] -> [N, b, H·d]."""
    N, b, _ = x.shape
    G, g = w_q.shape[0], w_q.shape[1]
    q = torch.einsum("nbe,hgde->nbhgd", x, w_q).reshape(N, b, G * g, d)
    k = torch.einsum("nbe,hde->nbhd", x, w_k)
    v = torch.einsum("nbe,hde->nbhd", x, w_v)

    def rot(t):  # angles [N, 1, 1, d]: megatron's layout (freqs repeated twice), rotate-half
        cos, sin = angles.cos(), angles.sin()
        t1, t2 = t[..., : d // 2], t[..., d // 2:]
        return t * cos + torch.cat([-t2, t1], dim=-1) * sin

    q, k = rot(q), rot(k)
    k = k.repeat_interleave(g, dim=2)
    v = v.repeat_interleave(g, dim=2)
    logits = torch.einsum("nbhd,mbhd->bhnm", q, k) / math.sqrt(d)
    mask = torch.ones(N, N, dtype=torch.bool).tril()
    p = logits.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhnm,mbhd->nbhd", p, v).reshape(N, b, G * g * d)


def _reference_job(rank, world_size):
    H, G, C = 16, 4, world_size
    t = _inputs(11, s_local * C, H, G, torch.float64)
    s = s_local
    sl = slice(rank * s, (rank + 1) * s)
    ins = [t[n].clone().requires_grad_() for n in ("x", "w_q", "w_k", "w_v")]
    ref = _reference(*ins, t["rope"])
    ref_grads = torch.autograd.grad(ref, ins, t["dout"])
    rels = []
    for overlap in ("stages", "outputs"):
        got = _run(rank, C, torch.distributed.group.WORLD, t, (), {}, overlap, legal_heads_per_stage(H, G, C)[0])
        rels += [((a - b).norm() / b.norm()).item() for a, b in
                 zip(got, [ref[sl].detach(), ref_grads[0][sl], *ref_grads[1:]])]
    return rels


def test_pipelined_stages_match_a_float64_reference(two_ranks):
    for rel in two_ranks["reference"]:
        assert max(rel) < 1e-12, rel


def _inflight_job(rank, world_size):
    """Per kernel call: how many all-to-alls were in flight (started with async_op, not yet waited for); and each
    variant's tracked peak memory."""
    import megatron_upipe.attention.upipe as upipe_mod
    from megatron_upipe.attention.schedule import make_schedule
    from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker

    dist = torch.distributed
    C, group = world_size, torch.distributed.group.WORLD
    state = {"open": 0, "async": 0, "sync": 0}
    real_a2a, real_fwd, real_bwd = dist.all_to_all_single, upipe_mod.kernel_forward, upipe_mod.kernel_backward

    def released(buffers, held):
        """Back only once gloo's worker thread has dropped its references to a blocking collective's buffers (their
        TensorImpl use counts back to what they were before the call). It drops them a moment after the work
        completes (1 in 5 blocking calls still held both when they returned, in a 2-rank check), and a send buffer
        that outlives its caller's last reference by that moment adds its bytes to what the caller allocates next:
        a serial peak once came out one B_q high in all three runs below."""
        deadline = time.monotonic() + 10.0
        while any(t._use_count() > n for t, n in zip(buffers, held)) and time.monotonic() < deadline:
            time.sleep(0.0002)

    class Counted:
        def __init__(self, work):
            self.work = work
            state["open"] += 1

        def wait(self):
            state["open"] -= 1
            return self.work.wait()

    def a2a(recv, send, *a, async_op=False, **k):
        state["async" if async_op else "sync"] += 1
        if async_op:
            return Counted(real_a2a(recv, send, *a, async_op=True, **k))
        synced.append(state["open"])
        held = (recv._use_count(), send._use_count())
        work = real_a2a(recv, send, *a, **k)
        released((recv, send), held)
        return work

    calls, synced = [], []  # (kernel kind, a2as open) per kernel call; a2as open at each blocking all-to-all

    def wrap(real, kind):
        def kernel(*a, **k):
            calls.append((kind, state["open"]))
            return real(*a, **k)
        return kernel

    from tests.upipe_seams import replaced

    dist.all_to_all_single = a2a
    spies = replaced(kernel_forward=wrap(real_fwd, "fwd"), kernel_backward=wrap(real_bwd, "bwd"))
    spies.__enter__()
    out = {}
    try:
        H, G = 16, 4
        for U in legal_heads_per_stage(H, G, C)[:2]:
            t = _inputs(3, 256 * C, H, G, torch.float32)
            for overlap in ("none", "stages", "outputs"):
                peaks = []
                for _ in range(3):  # the smallest of three is the op's: `released` covers blocking calls only, and
                    calls.clear()  # single runs beside two busy loops still read 256 bytes high 4 times in 60 and,
                    # once, pipelined stages' peak 36,864 bytes high (an asynchronous all-to-all's buffer)
                    synced.clear()
                    state.update({"async": 0, "sync": 0})
                    with PeakMemoryTracker() as mem:
                        _run(rank, C, group, t, (), {}, overlap, U)
                    peaks.append(mem.peak_bytes)
                out[(U, overlap)] = (list(calls), dict(state), min(peaks), list(synced))
            sched = make_schedule(H, G, C, U)
            N = 256 * C
            out[(U, "bytes")] = (N * sched.q_per_rank * d * 4, N * sched.kv_per_rank * d * 4, len(sched.stages),
                                 sum(st.new_round for st in sched.stages))
    finally:
        dist.all_to_all_single = real_a2a
        spies.__exit__(None, None, None)
    return out


def test_pipelined_collectives_are_in_flight_during_the_kernels_within_the_memory_bound(two_ranks):
    """With overlap every kernel but each pass's last runs while the next stage's all-to-alls are in flight (the
    serial op starts none asynchronously); the extra peak memory is at most what the next stage holds early:
    its inputs in flight, send and receive buffers (q, out and dout slices in backward, B_q bytes each; at a KV
    round's boundary K and V, B_kv each) and its gathered weight rows (W bytes, small): 6·B_q + 4·B_kv + 2·W."""
    for per_rank in two_ranks["inflight"]:
        for U in sorted({k[0] for k in per_rank}):
            B_q, B_kv, stages, rounds = per_rank[(U, "bytes")]
            serial_calls, serial_state, serial_peak, _ = per_rank[(U, "none")]
            calls, st, peak, _ = per_rank[(U, "stages")]
            assert stages >= 2
            assert serial_state["async"] == 0 and all(n == 0 for _, n in serial_calls)
            # every all-to-all asynchronous but each KV round's dK, dV (backward, once per round), all waited for
            assert st["sync"] == 2 * rounds and st["open"] == 0, st
            for kind in ("fwd", "bwd"):
                opens = [n for k, n in calls if k == kind]
                assert len(opens) == stages and all(n >= 1 for n in opens[:-1]), (kind, opens)
            W = U * d * D * 4  # the next stage's gathered W_Q rows [U, d, D] float32
            print(f"U={U}: overlap adds {peak - serial_peak} bytes to {serial_peak}; bound {6 * B_q + 4 * B_kv + 2 * W}")
            assert 0 < peak - serial_peak <= 6 * B_q + 4 * B_kv + 2 * W, (U, peak - serial_peak, B_q, B_kv, W)


def test_drained_outputs_are_in_flight_during_the_next_projections_within_the_memory_bound(two_ranks):
    """overlap='outputs': each stage's result all-to-all (forward: output, backward: dq) is started asynchronously
    and is still in flight while the next stage's inputs are projected and sent (blocking all-to-alls), but not
    during any kernel; a KV round's last dq is finished at once. The extra peak memory is at most one stage's
    result in flight, send and receive buffers (B_q bytes each), and its gathered W_Q rows (W bytes), and below
    what pipelined stages add."""
    for per_rank in two_ranks["inflight"]:
        for U in sorted({k[0] for k in per_rank}):
            B_q, B_kv, stages, rounds = per_rank[(U, "bytes")]
            _, _, serial_peak, serial_synced = per_rank[(U, "none")]
            _, _, stages_peak, _ = per_rank[(U, "stages")]
            calls, st, peak, synced = per_rank[(U, "outputs")]
            assert st["async"] == 2 * stages and st["open"] == 0, st  # one result per stage and pass, all waited for
            assert all(n == 0 for _, n in calls), calls  # nothing in flight during a kernel
            assert len(synced) + 2 * stages == len(serial_synced)  # serial's blocking all-to-alls but the results
            # blocking all-to-alls that ran while a previous result was in flight: in forward every one of the
            # stages after the first (q; K, V at a round's start), in backward those of every stage that does not
            # start a round (q, out, dout)
            assert sum(n == 1 for n in synced) >= (stages - 1) + 3 * (stages - rounds), synced
            W = U * d * D * 4
            print(f"U={U}: outputs adds {peak - serial_peak} bytes, stages {stages_peak - serial_peak}; "
                  f"bound {2 * B_q + W}")
            assert 0 < peak - serial_peak <= 2 * B_q + W, (U, peak - serial_peak, B_q, W)
            assert peak < stages_peak, (U, peak, stages_peak)
