"""attention.ring: causal ring attention over 1, 2 and 4 gloo ranks (zigzag chunks of attention.layout), forward and
backward, against float64 full-sequence attention written here (GQA included), with unit-scale logits."""

from __future__ import annotations

import pytest
import torch

from tests.dist_helper import run_on_ranks

B, H, HK, D = 2, 4, 2, 8
# relative (norm) error against the reference on the same dtype-rounded inputs: a few roundings of unit-scale values
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _reference(q, k, v, dout):
    """float64 causal attention of the full sequence [b, h, N, d] with GQA, and its gradients."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ ke.transpose(-1, -2) * q.shape[-1] ** -0.5  # [b, h, N, N]
    N = q.shape[2]
    s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ ve
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))


def _job(rank, world_size, N, dtype):
    from megatron_upipe.attention.kernels import KERNELS
    from megatron_upipe.attention.layout import local_positions
    from megatron_upipe.attention.ring import ring_attention_backward, ring_attention_forward

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, h, N, D, generator=gen, dtype=torch.float64).to(dtype).double()
                     for h in (H, HK, HK, H))  # rounded to dtype: the reference sees what the ring sees
    ref = _reference(q, k, v, dout)
    pos = local_positions(N, 0, 1, rank, world_size)  # this ring rank's tokens
    local = [t[:, :, pos].to(dtype).contiguous() for t in (q, k, v, dout)]
    group = torch.distributed.group.WORLD
    out, lse, blocks = ring_attention_forward(*local[:3], group, KERNELS["cpu_flash"], D ** -0.5)
    dq, dk, dv = ring_attention_backward(local[3], *local[:3], out, lse, blocks, group, KERNELS["cpu_flash"],
                                         D ** -0.5)
    errs = [((got.double() - r[:, :, pos]).norm() / r[:, :, pos].norm()).item()
            for got, r in zip((out, dq, dk, dv), ref)]
    # The passes are in place and in pieces: tiny pieces (uneven splits of every tensor) give the same bits, and the
    # caller's k and v are left as they were.
    kept = [t.clone() for t in local[1:3]]
    out2, lse2, blocks2 = ring_attention_forward(*local[:3], group, KERNELS["cpu_flash"], D ** -0.5, piece_bytes=100)
    grads2 = ring_attention_backward(local[3], *local[:3], out2, lse2, blocks2, group, KERNELS["cpu_flash"],
                                     D ** -0.5, piece_bytes=100)
    assert all(torch.equal(a, b) for a, b in zip((out, dq, dk, dv), (out2, *grads2)))
    assert all(torch.equal(a, b) for a, b in zip(kept, local[1:3]))
    # Overlapped passes (whole buffers in flight during the blocks): the same bits, the caller's k and v untouched.
    in_flight, restore = _count_passes_in_flight()
    try:
        out3, lse3, blocks3 = ring_attention_forward(*local[:3], group, KERNELS["cpu_flash"], D ** -0.5, overlap=True)
        grads3 = ring_attention_backward(local[3], *local[:3], out3, lse3, blocks3, group, KERNELS["cpu_flash"],
                                         D ** -0.5, overlap=True)
    finally:
        restore()
    assert all(torch.equal(a, b) for a, b in zip((out, dq, dk, dv), (out3, *grads3)))
    assert all(torch.equal(a, b) for a, b in zip(kept, local[1:3]))
    return errs, [t.dtype for t in (out, dq, dk, dv)], len(blocks), in_flight


def _count_passes_in_flight():
    """Patches ring.py (in this worker process) to record, per kernel call, how many P2P passes were in flight;
    returns (the record, a function that undoes the patch)."""
    from megatron_upipe.attention import ring

    originals = (ring._Passing, ring.kernel_forward, ring.kernel_backward)

    def restore():
        ring._Passing, ring.kernel_forward, ring.kernel_backward = originals

    seen, alive = {"fwd": [], "bwd": []}, set()

    class Passing(ring._Passing):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            alive.add(id(self))

        def arrived(self):
            alive.discard(id(self))
            return super().arrived()

    def counted(name, fn):
        def call(*a, **kw):
            seen[name].append(len(alive))
            return fn(*a, **kw)
        return call

    ring._Passing = Passing
    ring.kernel_forward = counted("fwd", ring.kernel_forward)
    ring.kernel_backward = counted("bwd", ring.kernel_backward)
    return seen, restore


ERRORS: dict = {}  # (R, dtype) -> worst error over ranks, printed by the last case (pytest -s) for the notes


RINGS = [(1, 40), (2, 40), (4, 48)]  # (R, N): local lengths 40, 20, 12, not powers of two
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def _dtypes_job(rank, world_size, N):
    return {str(dtype): _job(rank, world_size, N, dtype) for dtype in DTYPES}


@pytest.fixture(scope="module")
def rings():
    """R -> dtype name -> each rank's results: every dtype of a ring size in one world of R ranks (one spawn)."""
    out = {}
    for R, N in RINGS:
        per_rank = run_on_ranks(_dtypes_job, R, N)
        out[R] = {name: [per[name] for per in per_rank] for name in per_rank[0]}
    return out


@pytest.mark.parametrize("R, N", RINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_attention_equals_full_attention(rings, R, N, dtype):
    from megatron_upipe.attention.ring import block_pairs

    results = rings[R][str(dtype)]
    for rank, (errs, dtypes, blocks, in_flight) in enumerate(results):
        assert max(errs) < TOL[dtype], (rank, errs)
        assert dtypes == [dtype] * 4
        # kernel calls per rank: the 2R(2R+1)/2 (query chunk, key chunk <= it) blocks shared evenly by the R ranks
        assert blocks == 2 * R + 1
        # overlap: every forward block but the last step's computes with the next K/V in flight (the last step's
        # blocks: rank r's own query chunks against src = r + 1, one block); every backward block with the next
        # K/V or the last step's dK/dV in flight
        last_step = len(block_pairs(rank, (rank + 1) % R, R))
        assert in_flight["fwd"] == [1] * (blocks - last_step) + [0] * last_step if R > 1 else [0] * blocks
        assert all(n >= 1 for n in in_flight["bwd"]) if R > 1 else in_flight["bwd"] == [0] * blocks
        ERRORS[(R, str(dtype))] = max(ERRORS.get((R, str(dtype)), 0.0), max(errs))
    print(ERRORS)


def test_block_pairs_cover_the_causal_triangle_once():
    from megatron_upipe.attention.ring import block_pairs

    for R in (1, 2, 3, 4):
        seen = {}
        for r in range(R):
            for src in range(R):
                for i, j, causal in block_pairs(r, src, R):
                    qc, kc = (r, 2 * R - 1 - r)[i], (src, 2 * R - 1 - src)[j]
                    assert (qc, kc) not in seen
                    seen[(qc, kc)] = causal
        chunks = 2 * R
        assert set(seen) == {(a, c) for a in range(chunks) for c in range(a + 1)}  # every (query, key<=query) chunk
        assert all(causal == (a == c) for (a, c), causal in seen.items())
        per_rank = [sum(len(block_pairs(r, s, R)) for s in range(R)) for r in range(R)]
        assert len(set(per_rank)) == 1, per_rank  # the same number of blocks on every rank: balanced
