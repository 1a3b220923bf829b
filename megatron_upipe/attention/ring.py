"""Causal ring attention over a ring group, for one call in head layout (the building block of UPipe x ring).

Legend: R ring size, r this rank's index in the ring, n tokens per zigzag chunk, S = 2n local tokens (chunk r, then
chunk 2R-1-r: layout.local_positions), b batch, h query heads, hk KV heads, d head dim.

Forward: R steps. At step s this rank holds the K/V of ring rank src = r - s (passed one hop along the ring after
each step, by P2P) and attends its two query chunks to src's two key chunks: a key chunk before the query chunk is
fully visible, the same chunk is causal, a later one is skipped. Each block's output and log-sum-exp (the kernel's
own) are merged into float32 accumulators (float64 for float64 inputs) by their log-sum-exp (online softmax).
Backward: the kernel's backward per block with the *merged* output and log-sum-exp (the probabilities of the whole
row, so each block's dq/dk/dv is its exact share; no forward recompute): every kernel's backward rebuilds the
probabilities from the lse it is given (kernels.py; TE's in place of its forward's Stats). dq accumulates here;
dK/dV travel with the K/V they belong to and one more hop brings them home. Every pass is in place, in pieces
(`_pass_along`), so the received K/V and dK/dV never exist beside a second full copy.

Overlap (`overlap=True`, training: memory.ring_overlap): the passes run while the blocks compute instead of between
steps. Forward: the K/V for step s+1 travel during step s's blocks. Backward: the same for K/V, and the dK/dV of
step s travel during step s+1's kernel backwards, whose dk/dv are kept aside until the dK/dV they add to have
arrived and are then added in the serial order, so results equal the serial passes bit for bit. Costs whole receive
buffers instead of one piece of scratch: one more K/V copy in forward; in backward one more K/V and one more dK/dV
(float32) copy, plus the step's block dk/dv (at most 1.5 K/V copies in the input dtype).

Used by the UPipe/Ulysses op with `ring_group` (training: parallel.cp_ring). Checked against float64 full attention
in tests/test_ring.py on the CPU kernel and in tests/test_te_ring_backward.py on te_fused over a TransformerEngine
stand-in; the CUDA kernels' log-sum-exp layouts ([b, h, S], [b, h, S, 1], or padded rows) are adapted here but not
run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .kernels import AttentionKernel, kernel_backward, kernel_forward


def block_pairs(r: int, src: int, R: int) -> list[tuple[int, int, bool]]:
    """(query chunk slot, key chunk slot, causal) of the blocks rank r computes against ring rank src's K/V."""
    mine, theirs = (r, 2 * R - 1 - r), (src, 2 * R - 1 - src)
    return [(i, j, kc == qc) for i, qc in enumerate(mine) for j, kc in enumerate(theirs) if kc <= qc]


PIECE_BYTES = 256 * 2**20  # ring exchanges move their buffers in pieces of at most this many bytes (all tensors)


def _neighbours(group) -> tuple[int, int]:
    """Global ranks of the next (r + 1) and previous (r - 1) ring ranks."""
    R, r = group.size(), group.rank()
    return dist.get_global_rank(group, (r + 1) % R), dist.get_global_rank(group, (r - 1) % R)


def _pass_along(tensors: list[torch.Tensor], group, piece_bytes: int = PIECE_BYTES) -> None:
    """Each (contiguous) tensor replaced in place by the previous ring rank's (from r - 1) while its own goes one
    hop on (to r + 1), in pieces: piece i of every tensor is sent and piece i of the previous rank's received into a
    scratch buffer, then copied over piece i (already sent). Only one piece set of scratch is alive instead of a
    second copy of every tensor (at 10M tokens on 2x8 GPUs the backward's K, V, dK, dV: 7.5 GiB)."""
    nxt, prv = _neighbours(group)
    flat = [t.view(-1) for t in tensors]  # [numel] views (the tensors are contiguous)
    total = sum(t.numel() * t.element_size() for t in tensors)
    n = max(1, -(-total // piece_bytes))  # pieces per tensor
    split = [f.tensor_split(n) for f in flat]  # per tensor: n contiguous [numel / n] views
    for i in range(n):
        pieces = [parts[i] for parts in split]
        scratch = [torch.empty_like(p) for p in pieces]
        ops = [dist.P2POp(dist.isend, p, nxt, group) for p in pieces]
        ops += [dist.P2POp(dist.irecv, t, prv, group) for t in scratch]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for p, t in zip(pieces, scratch):
            p.copy_(t)


class _Passing:
    """Whole (contiguous) tensors on their way one hop along the ring, and the previous rank's arriving into new
    buffers, while the caller computes (overlap): `arrived()` waits and returns them. `tag` keeps two passes in
    flight at once apart (gloo matches a receive to a send by peer and tag)."""

    def __init__(self, tensors: list[torch.Tensor], group, tag: int) -> None:
        nxt, prv = _neighbours(group)
        self.sending = tensors  # kept alive until the sends complete
        self.received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, nxt, group, tag=tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, prv, group, tag=tag) for t in self.received]
        self.works = dist.batch_isend_irecv(ops)

    def arrived(self) -> list[torch.Tensor]:
        for work in self.works:  # on CUDA: the current stream waits for NCCL's
            work.wait()
        self.sending = self.works = None
        return self.received


_KV, _DKV = 0, 1  # tags of the two passes that can be in flight together in the overlapped backward


def _contiguous(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies in the contiguous layout (the caller's k, v are strided views; the passes need whole buffers)."""
    return [t.clone(memory_format=torch.contiguous_format) for t in tensors]


def _next_kv(kv: list[torch.Tensor], step: int, R: int, group) -> _Passing | None:
    """Overlap: the K/V held at `step` on their way to the next rank (copies at step 0: the caller's k, v are
    strided views); None at the last step, which needs no pass."""
    return _Passing(_contiguous(kv) if step == 0 else kv, group, _KV) if step < R - 1 else None


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(lse: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's log-sum-exp as [b, h, n] in `dtype`: [b, h, n, 1] squeezed, rows padded past n dropped."""
    return (lse[..., 0] if lse.dim() == 4 else lse)[:, :, :n].to(dtype)


def _as_kernel(rows: torch.Tensor, like: tuple[torch.Size, torch.dtype]) -> torch.Tensor:
    """[b, h, n] rows in the layout and dtype of a kernel's log-sum-exp (`like`: the block's own forward's)."""
    shape, dtype = like
    t = rows.unsqueeze(-1) if len(shape) == 4 else rows
    if shape[2] > rows.shape[2]:  # padded rows (sdpa_efficient): never read for these queries
        t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 3) + (0, shape[2] - rows.shape[2]))
    return t.to(dtype).contiguous()


def ring_attention_forward(q, k, v, group, kernel: AttentionKernel, scale: float, piece_bytes: int = PIECE_BYTES,
                           overlap: bool = False):
    """(out [b, h, S, d] in q's dtype, lse [b, h, S] (float32; float64 for float64 inputs), blocks: what the
    backward needs per block) for the local zigzag tokens q [b, h, S, d], k/v [b, hk, S, d] of this ring rank;
    causal attention over the whole ring. overlap: the next K/V travel while this step's blocks compute."""
    R, r = group.size(), group.rank()
    b, h, S, d = q.shape
    if S % 2:
        raise ValueError(f"ring attention holds two zigzag chunks per rank: the local length {S} must be even")
    n = S // 2
    acc = _accumulator(q.dtype)
    out = torch.zeros(b, h, S, d, dtype=acc, device=q.device)  # [b, h, S, d] merged
    lse = torch.full((b, h, S), float("-inf"), dtype=acc, device=q.device)  # [b, h, S]
    kv, blocks = [k, v], []  # the K/V held now; passed on from copies (k, v are the caller's)
    for step in range(R):
        src = (r - step) % R
        passing = _next_kv(kv, step, R, group) if overlap else None
        for i, j, causal in block_pairs(r, src, R):
            rows, cols = slice(i * n, (i + 1) * n), slice(j * n, (j + 1) * n)
            o, block_lse, aux = kernel_forward(kernel, q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal,
                                               scale)
            part = _rows(block_lse, n, acc)  # [b, h, n]
            merged = torch.logaddexp(lse[:, :, rows], part)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).unsqueeze(-1)
                               + o.to(acc) * torch.exp(part - merged).unsqueeze(-1))
            lse[:, :, rows] = merged
            blocks.append((aux, (block_lse.shape, block_lse.dtype)))
        if passing is not None:
            kv = passing.arrived()
        elif step < R - 1:
            if step == 0:
                kv = _contiguous(kv)
            _pass_along(kv, group, piece_bytes)
    return out.to(q.dtype), lse, blocks


def ring_attention_backward(dout, q, k, v, out, lse, blocks, group, kernel: AttentionKernel, scale: float,
                            piece_bytes: int = PIECE_BYTES, overlap: bool = False):
    """(dq, dk, dv) in the inputs' dtypes for this rank's q [b, h, S, d] and its own k/v [b, hk, S, d].
    overlap: the next K/V and the previous step's dK/dV travel while this step's kernel backwards run."""
    R, r = group.size(), group.rank()
    n, acc = q.shape[2] // 2, _accumulator(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = [k, v]
    dkv = [torch.zeros(k.shape, dtype=acc, device=k.device),  # of the K/V held now (src's)
           torch.zeros(v.shape, dtype=acc, device=v.device)]
    block = iter(blocks)
    dkv_passing = None  # overlap: the dK/dV of the last step, on their way to the next rank
    for step in range(R):
        src = (r - step) % R
        kv_passing = _next_kv(kv, step, R, group) if overlap else None
        kv_grads = []  # overlap: (key chunk, dk, dv) of each block, added once src's dK/dV have arrived
        for i, j, causal in block_pairs(r, src, R):
            rows, cols = slice(i * n, (i + 1) * n), slice(j * n, (j + 1) * n)
            aux, like = next(block)
            dqi, dkj, dvj = kernel_backward(kernel, dout[:, :, rows].contiguous(), q[:, :, rows], kv[0][:, :, cols],
                                            kv[1][:, :, cols], out[:, :, rows].contiguous(),
                                            _as_kernel(lse[:, :, rows], like), aux, causal, scale)
            dq[:, :, rows] += dqi.to(acc)
            kv_grads.append((cols, dkj, dvj))
            if not overlap:
                _add_kv_grads(dkv, kv_grads)
        if overlap:
            if dkv_passing is not None:
                dkv = dkv_passing.arrived()  # src's dK/dV, summed so far by the ranks before this one
            _add_kv_grads(dkv, kv_grads)  # in the serial order
            dkv_passing = _Passing(dkv, group, _DKV) if R > 1 else None  # during the next step (or: home)
            if kv_passing is not None:
                kv = kv_passing.arrived()
        elif step < R - 1:
            if step == 0:
                kv = _contiguous(kv)  # k, v are the caller's: copies, exchanged in place from here on
            _pass_along(kv + dkv, group, piece_bytes)  # K/V and their dK/dV so far, in one exchange
    if dkv_passing is not None:  # the dK/dV sent at the last step: one hop home
        kv = None
        dkv = dkv_passing.arrived()
    elif R > 1:  # the dK/dV held now are those of ring rank r + 1: one more hop home
        kv = None  # not needed any more: freed before the last exchange
        _pass_along(dkv, group, piece_bytes)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _add_kv_grads(dkv: list[torch.Tensor], kv_grads: list) -> None:
    """dK/dV (float32 or float64 accumulators [b, hk, S, d]) += each block's dk, dv [b, hk, n, d] at its key chunk,
    in the order the blocks ran; the list is emptied."""
    for cols, dkj, dvj in kv_grads:
        dkv[0][:, :, cols] += dkj.to(dkv[0].dtype)
        dkv[1][:, :, cols] += dvj.to(dkv[1].dtype)
    kv_grads.clear()
