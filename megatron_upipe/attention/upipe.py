"""UPipe: Ulysses attention processed in stages of heads, with a memory-lean exact backward.

Legend (sequence first, as in megatron-core): s local tokens, N = C·s global tokens, b micro-batch, D model dim,
H query heads, G = H_kv KV heads, g = H / G, d head dim, U heads per stage over the C ranks, m = U / C per rank,
n_kv resident KV heads per rank in one KV round (see schedule.py).

Forward, per stage: project the stage's U query heads from x with gathered rows of W_Q ([s·b, U·d]), rotate them
straight into the all-to-all send buffer [C, s, b, m, d], all-to-all to [N, b, m, d], run the local attention
kernel (keeping its lse), all-to-all the output back to [C, s, b, m, d] and copy it into the stage's head slots of
the output buffer [s, b, H·d] (natural head order). K/V are projected and communicated only at the first stage of
a KV round and stay resident for the round. Only one stage's buffers are alive at a time.

Backward, saving only x, the weights (and biases, norm weights), the output buffer and per-stage lse: per round
recompute K/V, per stage recompute q, all-to-all the stage's slices of out and dout into head layout, call the kernel's backward (no
attention forward recompute), all-to-all dq back, undo RoPE, and accumulate dx and the weight-row gradients;
dK/dV accumulate over the round's stages and go back once per round.

Accumulation with 16-bit inputs (`accumulate_fp32`, memory.attention_grad_accum='fp32'): dx is a float32 buffer
that every stage's dq GEMM and every round's dK and dV GEMMs add into in float32 (`accumulate_mm`: cuBLAS with
float32 output on CUDA, float32 products of the upcast operands on CPU; no product is rounded to 16 bits) and
is rounded to the input dtype once, at the end (with the fused norm: once before the norm's backward, which gets
it in the input dtype exactly as norm-then-op does, and whose result is rounded once more). dK/dV sum the kernel's
per-stage gradients (16-bit, as the kernels return them) in float32 and are rounded once to 16 bits before their
all-to-all and GEMMs. The GEMMs' operands (dq, dK, dV, weights) are 16-bit. With `accumulate_fp32=False` both
accumulators are in the input dtype: one rounding per addition.

With the input RMSNorm passed in (`norm_w`, eps in StageOp), x is the layer input before the norm and the op
never holds RMSNorm(x) whole: every projection (and weight-gradient GEMM) regenerates the normalised rows tile by
tile from x and the saved per-token 1/rms, and backward turns the accumulated input gradient into the gradient of
x and of the norm weight tile by tile (norm_tiles.py, whose formulas models/tiled_norm.py uses too, so results
equal norm-then-op).

QKV bias (Qwen2/2.5: b_q [G, g, d], b_k, b_v [G, d]) and QK-norm (Qwen3: q_norm_w, k_norm_w [d], eps in StageOp):
each projection adds the bias rows of its own heads (gathered with the same schedule indices as its weight rows,
one addmm as F.linear) and normalises every q and k head over d (qk_norm.py, HF's formula) before RoPE. Backward
keeps no more than before: the gradient out of inverse RoPE goes through the norm's backward with the pre-norm
projection p [s·b, heads·d] and its rstd [s·b, heads, 1] float32, both per-stage temporaries (q's: kept from the
stage's recomputed projection; k's: recomputed once more when the round's dK is finished, since K is dropped by
then; Ulysses, which keeps only the normalised q/k in head layout, recomputes both). The bias gradients are the
column sums of the gradient w.r.t. p; they and the norm weights' gradients (summed over all heads, stages, rounds
and KV replicas) accumulate in float32 for 16-bit inputs and are rounded once at the end.

With the output projection W_O [D, H·d] passed in (`w_o`), the op returns out @ W_O^T [s, b, D] and its backward
never builds dout [s, b, H·d] whole: each stage's dout rows are dy @ W_O[:, stage heads], written straight into the
all-to-all send buffer, and dW_O = dy^T @ out is one GEMM (out is saved anyway).

Packed documents (cu_seqlens, varlen.py; b = 1): after the seq->head all-to-all every rank holds all N tokens of
its heads, so the only change is the kernel call: every stage's forward and backward kernel gets the global document
boundaries (op.docs) and attends inside each document. Projections, RoPE (per-token angles, whatever positions the
caller chose), all-to-alls and the backward are exactly the fixed-length ones.

Plain Ulysses is the same code with one stage of all H heads and `save_heads=True`: q, k, v and out stay alive
in head layout from forward to backward (what autograd over DeepSpeed's DistributedAttention + flash attention
keeps), so the baseline and UPipe differ only in what they keep, never in how they compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from .comm import InFlight, head_to_seq, seq_to_head
from .kernels import AttentionKernel, kernel_backward, kernel_forward
from .ring import ring_attention_backward, ring_attention_forward
from .norm_tiles import rms_tile, rms_tile_backward, rms_tile_rstd
from .qk_norm import head_norm, head_norm_backward, head_rstd
from .rope import rotate_into
from .schedule import UPipeSchedule
from .varlen import Documents


@dataclass(frozen=True)
class StageOp:
    """Everything the stage loop needs besides tensors (all validated by the caller)."""

    schedule: UPipeSchedule
    group: dist.ProcessGroup | None
    rank: int  # this rank's index in `group`
    kernel: AttentionKernel
    causal: bool
    scale: float
    # False: UPipe (recompute projections and all-to-alls in backward). True: plain Ulysses behaviour, keeping
    # q, k, v and out in head layout for backward like DeepSpeed's DistributedAttention over flash attention.
    save_heads: bool = False
    # 16-bit inputs: accumulate dx (over stages and rounds) and dK/dV (over a KV round's stages) in float32, each
    # rounded once at the end (see the module docstring), or in the input dtype (half the bytes of the two
    # largest backward buffers; one rounding per addition): memory.attention_grad_accum.
    accumulate_fp32: bool = True
    norm_eps: float = 1e-5  # of the fused input RMSNorm, when its weight is passed
    norm_tile_rows: int = 32768  # rows of RMSNorm(x) regenerated at a time (float32 temporaries [T, D])
    qk_norm_eps: float = 1e-6  # of the per-head q/k RMSNorm (QK-norm), when its weights are passed
    docs: Documents | None = None  # packed documents (cu_seqlens): attention inside each; None: one sequence
    # Pipelined stages (memory.upipe_overlap): the next stage's all-to-alls in flight while this stage's kernel
    # runs and the previous stage's result all-to-all drains; same results bit for bit, one more stage of buffers.
    overlap: bool = False
    # Hybrid UPipe x ring: each stage's attention runs as causal ring attention over this group (ring.py) on the
    # a2a group's zigzag tokens (layout.local_positions); None: one kernel call on the group's whole sequence.
    ring: dist.ProcessGroup | None = None
    ring_overlap: bool = False  # the ring's P2P passes during its block computation (ring.py; memory.ring_overlap)


def _acc_dtype(dtype: torch.dtype, fp32: bool) -> torch.dtype:
    return torch.float32 if fp32 and dtype in (torch.float16, torch.bfloat16) else dtype


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b ([n, k] @ [k, p] into [n, p]) with the sum kept in acc's dtype; a and b share one dtype.

    Same dtype: one addmm_. A float32 acc with 16-bit a, b: on CUDA, cuBLAS writes the product straight into the
    float32 buffer (torch.addmm(..., out_dtype=torch.float32, out=acc): float32 accumulation, no 16-bit product);
    on CPU, which has no such kernel, a and b are upcast to float32 (exactly) and multiplied in float32, a in
    row tiles of p rows so that the temporaries are two float32 [k, p]-sized blocks. Either way nothing is
    rounded to 16 bits: the only roundings are float32 ones.
    """
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        b_up = b.to(acc.dtype)  # [k, p]
        rows = max(1, b.shape[1])
        for r0 in range(0, a.shape[0], rows):
            acc[r0:r0 + rows].addmm_(a[r0:r0 + rows].to(acc.dtype), b_up)  # [T, k] @ [k, p]


def _row_tiles(n: int, rows: int) -> list[tuple[int, int]]:
    """[start, end) ranges of `rows` rows (the last one shorter) covering n rows."""
    return [(a, min(n, a + rows)) for a in range(0, n, rows)]


class _Rows:
    """The op's input rows [s·b, D]: x itself, or RMSNorm(x) regenerated tile by tile (never whole)."""

    def __init__(self, x2: torch.Tensor, norm_w=None, rstd=None, tile_rows: int = 0) -> None:
        self.x2, self.norm_w, self.rstd = x2, norm_w, rstd  # x2 [s·b, D], rstd [s·b, 1] float32
        n = x2.shape[0]
        self.tiles = [(0, n)] if norm_w is None else _row_tiles(n, tile_rows)

    def tile(self, a: int, z: int) -> torch.Tensor:  # [z-a, D]
        return self.x2[a:z] if self.norm_w is None else rms_tile(self.x2[a:z], self.norm_w, self.rstd[a:z])

    def mm(self, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """rows @ w_t (+ bias): [s·b, D] @ [D, R] (+ [R]) -> [s·b, R]; with a bias one addmm, as F.linear."""
        if self.norm_w is None:
            return torch.mm(self.x2, w_t) if bias is None else torch.addmm(bias, self.x2, w_t)
        out = torch.empty((self.x2.shape[0], w_t.shape[1]), dtype=self.x2.dtype, device=self.x2.device)
        for a, z in self.tiles:
            if bias is None:
                torch.mm(self.tile(a, z), w_t, out=out[a:z])
            else:
                torch.addmm(bias, self.tile(a, z), w_t, out=out[a:z])
        return out

    def t_mm(self, g: torch.Tensor) -> torch.Tensor:
        """g^T @ rows: [s·b, R]^T @ [s·b, D] -> [R, D]: one GEMM, or with the norm the tiles' products accumulated
        in float32 for 16-bit inputs (`accumulate_mm`) and rounded once."""
        if self.norm_w is None:
            return torch.mm(g.t(), self.x2)
        acc = torch.zeros((g.shape[1], self.x2.shape[1]), dtype=_acc_dtype(g.dtype, True), device=g.device)
        for a, z in self.tiles:
            accumulate_mm(acc, g[a:z].t(), self.tile(a, z))  # [R, T] @ [T, D]
        return acc.to(g.dtype)


def _pre_norm(rows_in: _Rows, w_rows, bias_rows, norm_w, op: StageOp):
    """The heads' projection before QK-norm: p = rows [s·b, D] @ w_rows [R, d, D]^T (+ bias_rows [R, d]) ->
    [s·b, R·d], and with norm_w its per-head rstd [s·b, R, 1] (float32; float64 for float64), else None."""
    R, d = w_rows.shape[0], w_rows.shape[1]
    bias = None if bias_rows is None else bias_rows.reshape(R * d)  # [R, d] -> [R·d]
    p = rows_in.mm(w_rows.view(R * d, -1).t(), bias)  # [s·b, R·d]
    rstd = None if norm_w is None else head_rstd(p.view(p.shape[0], R, d), op.qk_norm_eps)  # [s·b, R, 1]
    return p, rstd


def _project_to_heads(rows_in: _Rows, w_rows, rope, s, b, C, h, op: StageOp, bias_rows=None, norm_w=None,
                      keep_pre: bool = False, async_op: bool = False):
    """rows [s·b, D] @ w_rows [C·h, d, D]^T (+ bias_rows [C·h, d]) -> QK-norm (norm_w [d]) -> RoPE -> all-to-all
    -> [N, b, h, d] (this rank's h heads; an InFlight of them with async_op). Returns (heads, pre): pre =
    (p [s·b, C·h·d], rstd [s·b, C·h, 1]), the pre-norm projection and its rstd, when keep_pre and norm_w is given
    (for the norm's backward), else None."""
    d = w_rows.shape[1]
    proj, rstd = _pre_norm(rows_in, w_rows, bias_rows, norm_w, op)  # [s·b, C·h·d], [s·b, C·h, 1] or None
    pre = None
    if norm_w is not None:
        pre = (proj, rstd) if keep_pre else None
        p3 = proj.view(s * b, C * h, d)  # [s·b, C·h·d] -> [s·b, C·h, d]
        proj = head_norm(p3, norm_w, rstd, out=None if keep_pre else p3).view(s * b, C * h * d)  # normalised
    src = proj.view(s, b, C, h, d)  # [s·b, C·h·d] -> [s, b, C, h, d]
    send = torch.empty((C, s, b, h, d), dtype=proj.dtype, device=proj.device)  # [C, s, b, h, d]
    dst = send.permute(1, 2, 0, 3, 4)  # [s, b, C, h, d] view of the send buffer
    if rope is None:
        dst.copy_(src)
    else:
        rotate_into(src, rope[0], rope[1], dst)
    del proj, src, dst
    return seq_to_head(send, op.group, async_op), pre  # [N, b, h, d]


def _project_kv(rows_in: _Rows, w_k, w_v, b_k, b_v, k_norm_w, kv, rope, s, b, op: StageOp):
    """A KV round's K and V in head layout [N, b, n_kv, d] each (InFlights of them with op.overlap): the rows kv
    [C·n_kv] of w_k / w_v (+ biases), K with QK-norm and RoPE."""
    C, n_kv = op.schedule.cp_size, op.schedule.kv_per_rank
    return (_project_to_heads(rows_in, w_k[kv], rope, s, b, C, n_kv, op, _bias_rows(b_k, kv), k_norm_w,
                              async_op=op.overlap)[0],
            _project_to_heads(rows_in, w_v[kv], None, s, b, C, n_kv, op, _bias_rows(b_v, kv),
                              async_op=op.overlap)[0])


def _heads_to_rows(g_head, rope, s, b, op: StageOp) -> torch.Tensor:
    """Gradient in head layout [N, b, h, d] -> all-to-all -> inverse RoPE -> [s·b, C·h·d] (rank-major heads)."""
    return _seq_to_rows(head_to_seq(g_head, op.group), rope, s, b)


def _seq_to_rows(recv, rope, s, b) -> torch.Tensor:
    """Received gradient [C, s, b, h, d] -> inverse RoPE -> [s·b, C·h·d] (rank-major heads)."""
    C, h, d = recv.shape[0], recv.shape[3], recv.shape[4]
    src = recv.permute(1, 2, 0, 3, 4)  # [s, b, C, h, d] view
    if rope is None:
        rows = src.reshape(s * b, C * h * d)  # [s·b, C·h·d] (copy: src is permuted)
    else:
        rows = torch.empty((s, b, C, h, d), dtype=recv.dtype, device=recv.device)  # [s, b, C, h, d]
        rotate_into(src, rope[0], rope[1], rows, inverse=True)
        rows = rows.view(s * b, C * h * d)
    return rows


def _gather_heads(buf_shbd, heads: torch.Tensor, C: int) -> torch.Tensor:
    """Stage slice of a [s, b, H, d] buffer -> send buffer [C, s, b, m, d] (heads rank-major)."""
    s, b, _, d = buf_shbd.shape
    m = heads.numel() // C
    send = torch.empty((C, s, b, m, d), dtype=buf_shbd.dtype, device=buf_shbd.device)
    for j in range(C):
        torch.index_select(buf_shbd, 2, heads[j * m:(j + 1) * m], out=send[j])
    return send


def replica_groups(kv_heads: tuple[int, ...]) -> tuple[tuple[list[int], list[int]], ...]:
    """A round's KV head ids [C·n_kv] (a head repeats when KV heads are replicated, C·n_kv > G) split into groups of
    distinct heads, by occurrence: group r holds (positions, heads) of every head's r-th occurrence, positions in
    increasing order. Summing the groups in turn adds each head's replicas in the order they appear."""
    groups: list[tuple[list[int], list[int]]] = []
    seen: dict[int, int] = {}
    for pos, head in enumerate(kv_heads):
        r = seen.get(head, 0)
        seen[head] = r + 1
        if r == len(groups):
            groups.append(([], []))
        groups[r][0].append(pos)
        groups[r][1].append(head)
    return tuple(groups)


def _build_indices(sched: UPipeSchedule, device: torch.device):
    """Index tensors per stage (query heads [U], and their W_Q rows as (group, j)) and per round (KV head ids
    [C·n_kv], and `replica_groups` as (positions, heads) tensors), rank-major: (stage_heads, stage_rows, round_kv,
    round_groups)."""
    g = sched.group_size
    with torch.inference_mode(False):  # usable outside inference mode too, when cached
        stage_heads = tuple(torch.tensor(st.q_heads, device=device) for st in sched.stages)  # host -> device
        round_kv = tuple(torch.tensor(kv, device=device) for kv in sched.round_kv_heads)
        round_groups = tuple(tuple((torch.tensor(pos, device=device), torch.tensor(heads, device=device))
                                   for pos, heads in replica_groups(kv)) for kv in sched.round_kv_heads)
        return stage_heads, tuple((h // g, h % g) for h in stage_heads), round_kv, round_groups


def ordered_index_add_(dst: torch.Tensor, groups, src: torch.Tensor) -> None:
    """dst.index_add_(0, kv, src) with each head's replicas summed in their order in kv: one index_add_ per group of
    distinct heads (`replica_groups`). index_add_ with repeated indices sums them with atomics in no fixed order on
    CUDA; with distinct indices every row gets one addition, so the result is the same on every run."""
    if len(groups) == 1:
        dst.index_add_(0, groups[0][1], src)
        return
    for pos, heads in groups:
        dst.index_add_(0, heads, src.index_select(0, pos))


@lru_cache(maxsize=64)
def _cached_indices(sched: UPipeSchedule, device: torch.device):
    return _build_indices(sched, device)


def _stage_indices(sched: UPipeSchedule, like: torch.Tensor):
    """`_build_indices` for `like`'s device, made once per (schedule, device) and reused by every later forward and
    backward: the host-to-device copies (a synchronisation each) stay out of the per-layer path and out of CUDA
    graph capture. The schedule is frozen and the index tensors are only read. Fake, meta and other tensor
    subclasses (simulation, tracing) get fresh ones: a cached tensor must not cross into or out of such a mode."""
    if type(like) is torch.Tensor and like.device.type != "meta":
        return _cached_indices(sched, like.device)
    return _build_indices(sched, like.device)


def _dout_heads(dy2, w_o, heads: torch.Tensor, s: int, b: int, C: int, d: int) -> torch.Tensor:
    """Stage slice of dout = dy @ W_O, never building dout: dy2 [s·b, D], w_o [D, H·d] -> send [C, s, b, m, d]."""
    D = w_o.shape[0]
    m = heads.numel() // C
    w_heads = w_o.view(D, -1, d)  # [D, H, d]
    send = torch.empty((C, s, b, m, d), dtype=dy2.dtype, device=dy2.device)  # [C, s, b, m, d]
    for j in range(C):
        cols = w_heads.index_select(1, heads[j * m:(j + 1) * m]).view(D, m * d)  # [D, m·d] (small copy)
        torch.mm(dy2, cols, out=send[j].view(s * b, m * d))  # [s·b, D] @ [D, m·d]
    return send


def _norm_rstd(x2: torch.Tensor, op: StageOp) -> torch.Tensor:
    """Per-token 1/rms of x2 [s·b, D] -> [s·b, 1] float32, tile by tile."""
    rstd = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x2.device)
    for a, z in _row_tiles(x2.shape[0], op.norm_tile_rows):
        rms_tile_rstd(x2[a:z], op.norm_eps, rstd[a:z])
    return rstd


def _bias_rows(bias, index):
    """A stage's (or round's) bias rows, gathered like its weight rows: b[index] -> [R, d], or None."""
    return None if bias is None else bias[index]


def upipe_forward(x, w_q, w_k, w_v, rope, op: StageOp, norm_w=None, rstd=None, b_q=None, b_k=None, b_v=None,
                  q_norm_w=None, k_norm_w=None):
    """x [s, b, D]; w_q [G, g, d, D]; w_k, w_v [G, d, D]; rope = (cos, sin) of this rank's positions [s, rot/2]
    or None.

    norm_w [D] with rstd [s·b, 1]: x is the input of the fused RMSNorm (see the module docstring).
    b_q [G, g, d], b_k, b_v [G, d]: projection biases; q_norm_w, k_norm_w [d]: QK-norm weights (eps op.qk_norm_eps).
    Returns (out [s, b, H·d], lse per stage, kernel aux per stage, (q, k, v, out) head-layout tensors per stage
    when op.save_heads else []).
    """
    sched = op.schedule
    s, b, D = x.shape
    C, m, n_kv = sched.cp_size, sched.q_per_rank, sched.kv_per_rank
    H, d = sched.num_heads, w_q.shape[2]
    xin = _Rows(x.reshape(s * b, D), norm_w, rstd, op.norm_tile_rows)  # [s·b, D] rows (normalised on the fly)
    stage_heads, stage_rows, round_kv, _ = _stage_indices(sched, x)
    out = torch.empty((s, b, H * d), dtype=x.dtype, device=x.device)  # [s, b, H·d]
    out_shbd = out.view(s, b, H, d)
    lses, auxes, saved = [], [], []
    ov = op.overlap

    def launch(i):  # stage i's projections, their seq->head all-to-alls started (async with ov): (K/V or None, q)
        st, (gi, ji) = sched.stages[i], stage_rows[i]
        kv_p = None
        if st.new_round:
            kv_p = _project_kv(xin, w_k, w_v, b_k, b_v, k_norm_w, round_kv[st.round_index], rope, s, b, op)
        q_p, _ = _project_to_heads(xin, w_q[gi, ji], rope, s, b, C, m, op, _bias_rows(b_q, (gi, ji)), q_norm_w,
                                   async_op=ov)  # [N, b, m, d]
        return kv_p, q_p

    def finish(o_seq, heads):  # a stage's output [C, s, b, m, d] (rank j's heads for my tokens) into out
        o_seq = _ready(o_seq)
        for j in range(C):
            out_shbd.index_copy_(2, heads[j * m:(j + 1) * m], o_seq[j])

    k_head = v_head = None
    nxt = launch(0) if ov else None
    draining = None  # ov: the previous stage's output all-to-all in flight, and its heads
    for i, (st, heads) in enumerate(zip(sched.stages, stage_heads)):
        if not ov and st.new_round:
            k_head = v_head = None  # free the previous round's K/V before projecting the next
        (kv_p, q_p), nxt = (nxt if ov else launch(i)), None
        if kv_p is not None:
            k_head = v_head = None  # ov: the previous round's last kernel has run
            k_head, v_head = _ready(kv_p[0]), _ready(kv_p[1])  # [N, b, n_kv, d] each
        q_head = _ready(q_p)  # [N, b, m, d]
        del kv_p, q_p
        if ov and i + 1 < len(sched.stages):
            nxt = launch(i + 1)  # in flight during this stage's kernel
        if draining is not None:
            finish(*draining)  # the previous stage's output: its all-to-all ran during the projections above
            draining = None
        a0, a1 = st.kv_slots
        qkv = (q_head.permute(1, 2, 0, 3), k_head[:, :, a0:a1].permute(1, 2, 0, 3),
               v_head[:, :, a0:a1].permute(1, 2, 0, 3))  # [b, m, N, d], [b, a1-a0, N, d] x 2
        if op.ring is None:
            o, lse, aux = kernel_forward(op.kernel, *qkv, op.causal, op.scale, docs=op.docs)  # o [b, m, N, d]
        else:  # N: the a2a group's zigzag tokens; causal over the whole ring
            o, lse, aux = ring_attention_forward(*qkv, op.ring, op.kernel, op.scale, overlap=op.ring_overlap)
        del qkv
        nxt = _settle(nxt)  # the next stage's inputs have arrived (on CUDA: the stream waits): send buffers freed
        if op.save_heads:
            saved.append((q_head, k_head, v_head, o))
        del q_head
        o_seq = head_to_seq(o.permute(2, 0, 1, 3), op.group, async_op=ov)  # [N, b, m, d] -> [C, s, b, m, d]
        del o
        if ov:
            draining = (o_seq, heads)
        else:
            finish(o_seq, heads)
        del o_seq
        lses.append(lse)
        auxes.append(aux)
    if draining is not None:
        finish(*draining)
    return out, lses, auxes, saved


def _ready(t):
    """A tensor, or the tensor an all-to-all in flight delivers."""
    return t.wait() if isinstance(t, InFlight) else t


def _settle(obj):
    """obj (None, or nested tuples of tensors, InFlights and None) with every InFlight replaced by its tensor."""
    if isinstance(obj, tuple):
        return tuple(_settle(o) for o in obj)
    return _ready(obj)


def upipe_backward(dout, x, w_q, w_k, w_v, out, lses, auxes, saved, rope, op: StageOp, needs_dw: bool = True,
                   w_o=None, norm_w=None, rstd=None, b_q=None, b_k=None, b_v=None, q_norm_w=None, k_norm_w=None):
    """Gradients given dout [s, b, H·d], or, with the output projection w_o [D, H·d], given dy [s, b, D] (the
    gradient of out @ w_o^T): (dx [s, b, D], dw_norm [D], dw_q [G, g, d, D], dw_k [G, d, D], dw_v [G, d, D],
    dw_o [D, H·d], db_q [G, g, d], db_k [G, d], db_v [G, d], dq_norm_w [d], dk_norm_w [d]), None for each input
    not given (and for all but dx when not needs_dw). With the fused input norm (norm_w [D], rstd [s·b, 1]) dx is
    the gradient of the norm's input.

    With QK-norm, the gradient out of inverse RoPE (w.r.t. the normalised heads) goes through the norm's backward
    (qk_norm.py) with the pre-norm projection p and its rstd: q's are kept from the stage's recomputed projection
    (UPipe) or recomputed after the kernel's backward (Ulysses, whose saved q is post-norm); k's are recomputed
    when the round's dK is finished (K/V themselves are dropped before that). The bias gradients are the column
    sums of the gradient w.r.t. p. The small gradients (biases, QK-norm weights) accumulate in float32 for 16-bit
    inputs whatever op.accumulate_fp32 says, and are rounded once at the end.

    `saved` holds the forward's head-layout (q, k, v, out) per stage when op.save_heads (Ulysses); the list is
    emptied as it is consumed so each stage's tensors die as early as they would under autograd."""
    sched = op.schedule
    s, b, D = x.shape
    C, m, n_kv = sched.cp_size, sched.q_per_rank, sched.kv_per_rank
    H, d = sched.num_heads, w_q.shape[2]
    dtype, acc = x.dtype, _acc_dtype(x.dtype, op.accumulate_fp32)
    xin = _Rows(x.reshape(s * b, D), norm_w, rstd, op.norm_tile_rows)  # [s·b, D] rows (normalised on the fly)
    stage_heads, stage_rows, round_kv, round_groups = _stage_indices(sched, x)
    out_shbd = out.view(s, b, H, d)
    if w_o is None:
        dout_shbd = dout.contiguous().view(s, b, H, d)
        dw_o = None
    else:
        dy2 = dout.reshape(s * b, D)  # [s·b, D]
        dw_o = torch.mm(dy2.t(), out.view(s * b, H * d)) if needs_dw else None  # [D, H·d]
    dx = torch.zeros((s * b, D), dtype=acc, device=x.device)  # [s·b, D]
    dw_q, dw_k, dw_v = (torch.zeros_like(w, memory_format=torch.contiguous_format) for w in (w_q, w_k, w_v)) if needs_dw else (None,) * 3
    small = _acc_dtype(dtype, True)  # bias and QK-norm weight gradients: float32 for 16-bit inputs

    def small_acc(t):  # [*] accumulator for the gradient of t, or None
        return torch.zeros(t.shape, dtype=small, device=x.device) if needs_dw and t is not None else None

    db_q, db_k, db_v, dqn_w, dkn_w = (small_acc(t) for t in (b_q, b_k, b_v, q_norm_w, k_norm_w))

    def add_input_grad(rows, w_rows):  # dx += rows [s·b, R] @ w_rows [R, D], summed in dx's dtype
        accumulate_mm(dx, rows, w_rows)

    def pre_norm_grad(rows, pre, nw, dnw):  # gradient w.r.t. normalised heads [s·b, R·d] -> w.r.t. p [s·b, R·d]
        if nw is None:
            return rows
        p, p_rstd = pre  # [s·b, R·d], [s·b, R, 1]
        R = p_rstd.shape[1]
        dp = head_norm_backward(p.view(s * b, R, d), nw, p_rstd, rows.view(s * b, R, d), dnw)  # [s·b, R, d]
        return dp.view(s * b, R * d)

    def finish_round(kv, groups, dk_acc, dv_acc):
        for g_acc, w, dw, rot, bias, nw, dnw, db in ((dk_acc, w_k, dw_k, rope, b_k, k_norm_w, dkn_w, db_k),
                                                      (dv_acc, w_v, dw_v, None, b_v, None, None, db_v)):
            rows = _heads_to_rows(g_acc.to(dtype), rot, s, b, op)  # [s·b, C·n_kv·d]
            w_rows = w[kv].view(C * n_kv * d, D)
            if nw is not None:  # K's pre-norm projection, recomputed: K itself is gone by now
                pre = _pre_norm(xin, w[kv], _bias_rows(bias, kv), nw, op)  # [s·b, C·n_kv·d], [s·b, C·n_kv, 1]
                rows = pre_norm_grad(rows, pre, nw, dnw)
                del pre
            if db is not None:  # replicas sum here
                ordered_index_add_(db, groups, rows.view(s * b, C * n_kv, d).sum(0, dtype=small))  # [C·n_kv, d]
            add_input_grad(rows, w_rows)
            if needs_dw:
                ordered_index_add_(dw, groups, xin.t_mm(rows).view(C * n_kv, d, D))  # replicas sum here, in order

    ov = op.overlap

    def launch(i):  # stage i's inputs in head layout, their all-to-alls started (async with ov); serial: with the
        st, heads, (gi, ji) = sched.stages[i], stage_heads[i], stage_rows[i]  # round's accumulators, as before
        kv_p = q_p = q_pre = o_p = accs = None
        w_rows = w_q[gi, ji]  # [U, d, D] (a gathered copy, kept until the stage's dq is added)
        if not op.save_heads:
            if st.new_round:
                kv_p = _project_kv(xin, w_k, w_v, b_k, b_v, k_norm_w, round_kv[st.round_index], rope, s, b, op)
            q_p, q_pre = _project_to_heads(xin, w_rows, rope, s, b, C, m, op, _bias_rows(b_q, (gi, ji)),
                                           q_norm_w, keep_pre=True, async_op=ov)  # [N, b, m, d]; pre-norm q
            o_p = seq_to_head(_gather_heads(out_shbd, heads, C), op.group, async_op=ov)  # [N, b, m, d]
        if st.new_round and not ov:
            accs = new_accs()
        do_send = _gather_heads(dout_shbd, heads, C) if w_o is None else _dout_heads(dy2, w_o, heads, s, b, C, d)
        do_p = seq_to_head(do_send, op.group, async_op=ov)  # [C, s, b, m, d] -> [N, b, m, d]
        return kv_p, q_p, q_pre, o_p, do_p, accs, w_rows

    def new_accs():  # dK, dV of a KV round: [N, b, n_kv, d] each, in the accumulation dtype
        return tuple(torch.zeros((C * s, b, n_kv, d), dtype=acc, device=x.device) for _ in range(2))

    def finish_dq(rows, q_pre, w_rows, gi, ji):  # a stage's dq rows [s·b, U·d] (inverse RoPE done) into dx, dW_Q
        if q_norm_w is not None:
            if q_pre is None:  # Ulysses keeps the normalised q only: recompute the pre-norm projection
                q_pre = _pre_norm(xin, w_rows, _bias_rows(b_q, (gi, ji)), q_norm_w, op)  # [s·b, U·d], [s·b, U, 1]
            rows = pre_norm_grad(rows, q_pre, q_norm_w, dqn_w)  # [s·b, U·d]
        del q_pre
        if db_q is not None:
            db_q[gi, ji] = rows.view(s * b, -1, d).sum(0, dtype=small)  # [U, d]
        add_input_grad(rows, w_rows.view(-1, D))
        if needs_dw:
            dw_q[gi, ji] = xin.t_mm(rows).view(-1, d, D)

    def drain(pending):  # ov: a stage's dq all-to-all in flight (dq_p, q_pre, w_rows, gi, ji) -> finish_dq
        finish_dq(_seq_to_rows(_ready(pending[0]), rope, s, b), *pending[1:])

    k_head = v_head = dk_acc = dv_acc = None
    nxt = launch(0) if ov else None
    draining = None  # ov: the previous stage's dq all-to-all in flight, with what finish_dq needs
    for idx, (st, heads, (gi, ji)) in enumerate(zip(sched.stages, stage_heads, stage_rows)):
        kv = round_kv[st.round_index]
        if op.save_heads:
            q_head, k_head, v_head, o_head = saved.pop(0)  # [N, b, m, d], [N, b, n_kv, d] x2, o [b, m, N, d]
            o_head = o_head.permute(2, 0, 1, 3)  # [N, b, m, d]
        elif st.new_round and not ov:
            k_head = v_head = None
        (kv_p, q_p, q_pre, o_p, do_p, accs, w_rows), nxt = (nxt if ov else launch(idx)), None
        if kv_p is not None:
            k_head = v_head = None  # ov: the previous round's last kernel has run
            k_head, v_head = _ready(kv_p[0]), _ready(kv_p[1])  # [N, b, n_kv, d] each
        if q_p is not None:
            q_head, o_head = _ready(q_p), _ready(o_p)  # [N, b, m, d] each
        do_head = _ready(do_p)  # [N, b, m, d]
        del kv_p, q_p, o_p, do_p
        if st.new_round:
            dk_acc, dv_acc = accs if accs is not None else new_accs()
        del accs
        if ov and idx + 1 < len(sched.stages):
            nxt = launch(idx + 1)  # in flight during this stage's kernel
        if draining is not None:  # the previous stage's dq (its all-to-all ran during the projections above)
            drain(draining)
            draining = None
        a0, a1 = st.kv_slots
        args = (do_head.permute(1, 2, 0, 3), q_head.permute(1, 2, 0, 3), k_head[:, :, a0:a1].permute(1, 2, 0, 3),
                v_head[:, :, a0:a1].permute(1, 2, 0, 3), o_head.permute(1, 2, 0, 3), lses[idx], auxes[idx])
        if op.ring is None:
            dq, dk, dv = kernel_backward(op.kernel, *args, op.causal, op.scale, docs=op.docs)
        else:
            dq, dk, dv = ring_attention_backward(*args, op.ring, op.kernel, op.scale, overlap=op.ring_overlap)
        del args  # dq [b, m, N, d]; dk, dv [b, a1-a0, N, d]
        nxt = _settle(nxt)  # the next stage's inputs have arrived (on CUDA: the stream waits): send buffers freed
        del q_head, o_head, do_head
        dk_acc[:, :, a0:a1] += dk.permute(2, 0, 1, 3)
        dv_acc[:, :, a0:a1] += dv.permute(2, 0, 1, 3)
        del dk, dv
        last_of_round = idx + 1 == len(sched.stages) or sched.stages[idx + 1].new_round
        if ov:
            dq_p = head_to_seq(dq.permute(2, 0, 1, 3), op.group, async_op=True)  # [C, s, b, U/C, d] in flight
            del dq
            draining = (dq_p, q_pre, w_rows, gi, ji)
            del dq_p, q_pre, w_rows
            if last_of_round:  # dx adds this stage's dq before the round's dK/dV, as the serial order does
                drain(draining)
                draining = None
        else:
            rows = _heads_to_rows(dq.permute(2, 0, 1, 3), rope, s, b, op)  # [s·b, U·d]
            del dq
            finish_dq(rows, q_pre, w_rows, gi, ji)
            del rows, q_pre, w_rows
        if last_of_round:
            k_head = v_head = None
            finish_round(kv, round_groups[st.round_index], dk_acc, dv_acc)
            dk_acc = dv_acc = None
    small_grads = tuple(None if a is None else a.to(t.dtype) for a, t in
                        ((db_q, b_q), (db_k, b_k), (db_v, b_v), (dqn_w, q_norm_w), (dkn_w, k_norm_w)))
    if norm_w is None:
        return (dx.view(s, b, D).to(dtype), None, dw_q, dw_k, dw_v, dw_o) + small_grads
    dx, dw_norm = _norm_backward(dx, xin, dtype)
    return (dx.view(s, b, D), dw_norm, dw_q, dw_k, dw_v, dw_o) + small_grads


def _norm_backward(dxn: torch.Tensor, xin: _Rows, dtype):
    """Gradient of the normalised rows dxn [s·b, D] (accumulator dtype) -> (dx [s·b, D] in x's dtype, dw_norm
    [D]), tile by tile; dx is written into dxn itself when that has x's dtype."""
    x2 = xin.x2
    dx = dxn if dxn.dtype == dtype else torch.empty(x2.shape, dtype=dtype, device=x2.device)  # [s·b, D]
    dw = torch.zeros(xin.norm_w.shape, dtype=_acc_dtype(dtype, True), device=x2.device)  # [D]
    for a, z in xin.tiles:  # dxn rounded to x's dtype first, as norm-then-op hands it to the norm: same bits
        dx[a:z] = rms_tile_backward(x2[a:z], xin.norm_w, xin.rstd[a:z], dxn[a:z].to(dtype), dw)
    return dx, dw.to(xin.norm_w.dtype)


def _split_tensors(obj, tensors: list):
    """obj (nested tuples/lists) with every tensor moved into `tensors` and replaced by its index there."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_split_tensors(o, tensors) for o in obj)
    return obj


def _join_tensors(obj, tensors):
    """Inverse of `_split_tensors`."""
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, (tuple, list)):
        return type(obj)(_join_tensors(o, tensors) for o in obj)
    return obj


@dataclass(frozen=True)
class _Slot:
    index: int


# x, w_q, w_k, w_v, w_o, norm_w, b_q, b_k, b_v, q_norm_w, k_norm_w, rstd, out, rope_cos, rope_sin
_N_FIXED = 15


class UPipeFunction(torch.autograd.Function):
    """(x, w_q, w_k, w_v, w_o, norm_w, b_q, b_k, b_v, q_norm_w, k_norm_w, cos, sin, op) -> out [s, b, H·d], or
    out @ w_o^T [s, b, D] with w_o; with norm_w, x is the input of the fused RMSNorm; b_q [G, g, d], b_k, b_v [G, d]
    are the projection biases and q_norm_w, k_norm_w [d] the QK-norm weights. Every optional input may be None; its
    gradient is then None.

    Every tensor backward needs goes through ctx.save_for_backward: the inputs, rstd, the output buffer, each
    stage's lse, the tensors inside the kernels' aux and, for Ulysses, the head-layout q, k, v, out. So saved-tensor
    hooks (activation offload) see them all and backward can run again with retain_graph=True; only non-tensor aux
    (ints, the layout of the aux) stays on ctx, with ctx.op (whose packed-document boundaries, op.docs, are a
few bytes of int32, not an activation). Backward then asks autograd to drop its references at once
    (ctx.maybe_clear_saved_tensors, a no-op when the graph is retained), so that Ulysses' head tensors still die
    stage by stage inside upipe_backward rather than at the end of the node."""

    @staticmethod
    def forward(ctx, x, w_q, w_k, w_v, w_o, norm_w, b_q, b_k, b_v, q_norm_w, k_norm_w, rope_cos, rope_sin,
                op: StageOp):
        rope = None if rope_cos is None else (rope_cos, rope_sin)
        rstd = None if norm_w is None else _norm_rstd(x.reshape(-1, x.shape[-1]), op)  # [s·b, 1] float32
        out, lses, auxes, saved = upipe_forward(x, w_q, w_k, w_v, rope, op, norm_w, rstd, b_q, b_k, b_v, q_norm_w,
                                                k_norm_w)
        aux_tensors: list[torch.Tensor] = []
        ctx.aux_layout = _split_tensors(auxes, aux_tensors)
        ctx.n_stages, ctx.n_aux, ctx.op = len(lses), len(aux_tensors), op
        heads = [t for stage in saved for t in stage]  # (q, k, v, o) per stage, Ulysses only
        ctx.save_for_backward(x, w_q, w_k, w_v, w_o, norm_w, b_q, b_k, b_v, q_norm_w, k_norm_w, rstd, out, rope_cos,
                              rope_sin, *lses, *aux_tensors, *heads)
        del saved, heads
        if w_o is None:
            return out
        s, b, _ = out.shape
        return torch.mm(out.view(s * b, -1), w_o.t()).view(s, b, w_o.shape[0])  # [s, b, H·d] -> [s, b, D]

    @staticmethod
    def backward(ctx, grad):
        tensors = list(ctx.saved_tensors)
        clear = getattr(ctx, "maybe_clear_saved_tensors", None)  # torch >= 2.2; without it, heads live to the end
        if clear is not None:
            clear()
        x, w_q, w_k, w_v, w_o, norm_w, b_q, b_k, b_v, q_norm_w, k_norm_w, rstd, out, rope_cos, rope_sin = \
            tensors[:_N_FIXED]
        S, A = ctx.n_stages, ctx.n_aux
        lses = tensors[_N_FIXED:_N_FIXED + S]
        auxes = _join_tensors(ctx.aux_layout, tensors[_N_FIXED + S:_N_FIXED + S + A])
        heads = tensors[_N_FIXED + S + A:]
        saved = [tuple(heads[i:i + 4]) for i in range(0, len(heads), 4)]  # consumed (and freed) stage by stage
        del tensors, heads
        rope = None if rope_cos is None else (rope_cos, rope_sin)
        needs_dw = any(ctx.needs_input_grad[1:11])
        dx, dw_norm, dw_q, dw_k, dw_v, dw_o, db_q, db_k, db_v, dq_norm_w, dk_norm_w = upipe_backward(
            grad, x, w_q, w_k, w_v, out, lses, auxes, saved, rope, ctx.op, needs_dw, w_o=w_o,
            norm_w=norm_w, rstd=rstd, b_q=b_q, b_k=b_k, b_v=b_v, q_norm_w=q_norm_w, k_norm_w=k_norm_w,
        )
        return dx, dw_q, dw_k, dw_v, dw_o, dw_norm, db_q, db_k, db_v, dq_norm_w, dk_norm_w, None, None, None
