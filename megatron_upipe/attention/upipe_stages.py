"""The steps of one UPipe stage, shared by the serial and the pipelined stage loops (pure torch).

Legend (sequence first, as in megatron-core): s local tokens, N = C·s global tokens, b micro-batch, D model dim,
H query heads, G = H_kv KV heads, d head dim, U heads per stage over the C ranks, m = U / C per rank, n_kv resident
KV heads per rank in one KV round (schedule.py), R heads of one projection (U for q, C·n_kv for K or V).

The paper's stage, as functions: project the stage's heads from the input rows and rotate them straight into the
all-to-all send buffer [C, s, b, h, d] (`_project_to_heads`, `_project_kv`), all-to-all seq->head to [N, b, h, d],
run the local attention kernel on [b, h, N, d] (`attention_forward`; packed documents are only its `docs`
argument), all-to-all the output back. Backward: the same projections recomputed, the stage's slices of out and
dout gathered into send buffers (`_gather_heads`, `_dout_heads`), the kernel's backward (`attention_backward`),
and the gradients all-to-all'd back through inverse RoPE into rows [s·b, R·d] (`_heads_to_rows`). Every
all-to-all may be started with async_op (an `InFlight`, `_ready` waits for it). The per-call state and the
accumulation of gradients are upipe_passes.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import InFlight, head_to_seq, seq_to_head
from .kernels import AttentionKernel, kernel_backward, kernel_forward
from .qk_norm import head_norm, head_rstd
from .ring import ring_attention_backward, ring_attention_forward
from .rope import rotate_into
from .schedule import Stage, UPipeSchedule
from .upipe_rows import _Rows
from .varlen import Documents


# The values `overlap` takes in the op's API (bool or name) -> StageOp.overlap
OVERLAPS = {False: "none", True: "stages", "none": "none", "stages": "stages", "outputs": "outputs"}


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
    # rounded once at the end (see upipe.py's docstring), or in the input dtype (half the bytes of the two
    # largest backward buffers; one rounding per addition): memory.attention_grad_accum.
    accumulate_fp32: bool = True
    norm_eps: float = 1e-5  # of the fused input RMSNorm, when its weight is passed
    norm_tile_rows: int = 32768  # rows of RMSNorm(x) regenerated at a time (float32 temporaries [T, D])
    qk_norm_eps: float = 1e-6  # of the per-head q/k RMSNorm (QK-norm), when its weights are passed
    docs: Documents | None = None  # packed documents (cu_seqlens): attention inside each; None: one sequence
    # Pipelined stages (memory.upipe_overlap, upipe_pipelined.py), same results bit for bit: "stages" = the next
    # stage's all-to-alls in flight while this stage's kernel runs and the previous stage's result all-to-all drains
    # (one more stage of buffers); "outputs" = only each stage's result in flight, during the next stage's
    # projections (one stage's result buffers more); "none" = serial.
    overlap: str = "none"
    # Hybrid UPipe x ring: each stage's attention runs as causal ring attention over this group (ring.py) on the
    # a2a group's zigzag tokens (layout.local_positions); None: one kernel call on the group's whole sequence.
    ring: dist.ProcessGroup | None = None
    ring_overlap: bool = False  # the ring's P2P passes during its block computation (ring.py; memory.ring_overlap)


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


def _project_kv(rows_in: _Rows, w_k, w_v, b_k, b_v, k_norm_w, kv, rope, s, b, op: StageOp, async_op: bool = False):
    """A KV round's K and V in head layout [N, b, n_kv, d] each (InFlights of them with async_op): the rows kv
    [C·n_kv] of w_k / w_v (+ biases), K with QK-norm and RoPE."""
    C, n_kv = op.schedule.cp_size, op.schedule.kv_per_rank
    return (_project_to_heads(rows_in, w_k[kv], rope, s, b, C, n_kv, op, _bias_rows(b_k, kv), k_norm_w,
                              async_op=async_op)[0],
            _project_to_heads(rows_in, w_v[kv], None, s, b, C, n_kv, op, _bias_rows(b_v, kv),
                              async_op=async_op)[0])


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
        rows = rows.view(s * b, C * h * d)  # [s, b, C, h, d] -> [s·b, C·h·d]
    return rows


def _gather_heads(buf_shbd, heads: torch.Tensor, C: int) -> torch.Tensor:
    """Stage slice of a [s, b, H, d] buffer -> send buffer [C, s, b, m, d] (heads rank-major)."""
    s, b, _, d = buf_shbd.shape
    m = heads.numel() // C
    send = torch.empty((C, s, b, m, d), dtype=buf_shbd.dtype, device=buf_shbd.device)  # [C, s, b, m, d]
    for j in range(C):
        torch.index_select(buf_shbd, 2, heads[j * m:(j + 1) * m], out=send[j])
    return send


def _dout_heads(dy2, w_o, heads: torch.Tensor, s: int, b: int, C: int, d: int) -> torch.Tensor:
    """Stage slice of dout = dy @ W_O, never building dout: dy2 [s·b, D], w_o [D, H·d] -> send [C, s, b, m, d]."""
    D = w_o.shape[0]
    m = heads.numel() // C
    w_heads = w_o.view(D, -1, d)  # [D, H·d] -> [D, H, d]
    send = torch.empty((C, s, b, m, d), dtype=dy2.dtype, device=dy2.device)  # [C, s, b, m, d]
    for j in range(C):
        cols = w_heads.index_select(1, heads[j * m:(j + 1) * m]).view(D, m * d)  # [D, m·d] (small copy)
        torch.mm(dy2, cols, out=send[j].view(s * b, m * d))  # [s·b, D] @ [D, m·d]
    return send


def _bias_rows(bias, index):
    """A stage's (or round's) bias rows, gathered like its weight rows: b[index] -> [R, d], or None."""
    return None if bias is None else bias[index]


def attention_forward(op: StageOp, st: Stage, q_head, k_head, v_head):
    """The stage's local attention on its q [N, b, m, d] and the round's resident K/V [N, b, n_kv, d] (the stage's
    KV slots): (o [b, m, N, d], lse, aux), one kernel call (inside each packed document when op.docs is given), or
    causal ring attention over op.ring (N: the a2a group's zigzag tokens)."""
    a0, a1 = st.kv_slots
    qkv = (q_head.permute(1, 2, 0, 3), k_head[:, :, a0:a1].permute(1, 2, 0, 3),
           v_head[:, :, a0:a1].permute(1, 2, 0, 3))  # [b, m, N, d], [b, a1-a0, N, d] x 2
    if op.ring is None:
        return kernel_forward(op.kernel, *qkv, op.causal, op.scale, docs=op.docs)
    return ring_attention_forward(*qkv, op.ring, op.kernel, op.scale, overlap=op.ring_overlap)


def attention_backward(op: StageOp, st: Stage, do_head, q_head, k_head, v_head, o_head, lse, aux):
    """The kernel's backward from the forward's lse (no attention recompute), head-layout inputs [N, b, ·, d]:
    (dq [b, m, N, d], dk [b, a1-a0, N, d], dv [b, a1-a0, N, d]) for the stage's KV slots [a0, a1)."""
    a0, a1 = st.kv_slots
    args = (do_head.permute(1, 2, 0, 3), q_head.permute(1, 2, 0, 3), k_head[:, :, a0:a1].permute(1, 2, 0, 3),
            v_head[:, :, a0:a1].permute(1, 2, 0, 3), o_head.permute(1, 2, 0, 3), lse, aux)
    if op.ring is None:
        return kernel_backward(op.kernel, *args, op.causal, op.scale, docs=op.docs)
    return ring_attention_backward(*args, op.ring, op.kernel, op.scale, overlap=op.ring_overlap)


def round_ends(sched: UPipeSchedule, i: int) -> bool:
    """Stage i is the last of its KV round."""
    return i + 1 == len(sched.stages) or sched.stages[i + 1].new_round


def _ready(t):
    """A tensor, or the tensor an all-to-all in flight delivers."""
    return t.wait() if isinstance(t, InFlight) else t


def _settle(obj):
    """obj (None, or nested tuples of tensors, InFlights and None) with every InFlight replaced by its tensor."""
    if isinstance(obj, tuple):
        return tuple(_settle(o) for o in obj)
    return _ready(obj)
