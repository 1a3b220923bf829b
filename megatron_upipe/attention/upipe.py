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

Modules, each importing only the ones before it: upipe_rows (the input rows, fused input norm, float32
accumulation), upipe_indices (the schedule's head ids as index tensors), upipe_stages (StageOp and the steps of
one stage: projection, all-to-all, kernel call), upipe_passes (one forward or backward call's state and its
stage steps), upipe_serial and upipe_pipelined (the two stage loops, forward and backward each), and this one:
the autograd.Function and `upipe_forward` / `upipe_backward`, which pick the loop (pipelined by op.overlap).

Tests that replace a piece of the stage code (a kernel spy, a broken all-to-all) do so in every module that holds
it: tests/upipe_seams.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from .upipe_indices import (_build_indices, _cached_indices, _stage_indices,  # noqa: F401 (named by tests)
                            ordered_index_add_, replica_groups)
from .upipe_passes import BackwardPass, ForwardPass
from .upipe_pipelined import pipelined_backward, pipelined_forward
from .upipe_rows import _norm_rstd, accumulate_mm  # noqa: F401 (accumulate_mm: named by tests)
from .upipe_serial import serial_backward, serial_forward
from .upipe_stages import (InFlight, StageOp, _ready, _settle, head_to_seq,  # noqa: F401 (named by tests)
                           kernel_backward, kernel_forward, seq_to_head)


def _loops(op: StageOp):
    """The (forward, backward) stage loops of op.overlap; Ulysses (op.save_heads) has one stage, nothing to overlap."""
    if op.save_heads or op.overlap == "none":
        return serial_forward, serial_backward
    if op.overlap == "stages":
        return pipelined_forward, pipelined_backward
    return partial(serial_forward, drain=True), partial(serial_backward, drain=True)  # "outputs"


def upipe_forward(x, w_q, w_k, w_v, rope, op: StageOp, norm_w=None, rstd=None, b_q=None, b_k=None, b_v=None,
                  q_norm_w=None, k_norm_w=None):
    """x [s, b, D]; w_q [G, g, d, D]; w_k, w_v [G, d, D]; rope = (cos, sin) of this rank's positions [s, rot/2]
    or None.

    norm_w [D] with rstd [s·b, 1]: x is the input of the fused RMSNorm (see the module docstring).
    b_q [G, g, d], b_k, b_v [G, d]: projection biases; q_norm_w, k_norm_w [d]: QK-norm weights (eps op.qk_norm_eps).
    Returns (out [s, b, H·d], lse per stage, kernel aux per stage, (q, k, v, out) head-layout tensors per stage
    when op.save_heads else []).
    """
    fw = ForwardPass(x, w_q, w_k, w_v, rope, op, norm_w, rstd, b_q, b_k, b_v, q_norm_w, k_norm_w)
    return _loops(op)[0](fw)


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
    bw = BackwardPass(dout, x, w_q, w_k, w_v, out, lses, auxes, saved, rope, op, needs_dw, w_o, norm_w, rstd, b_q,
                      b_k, b_v, q_norm_w, k_norm_w)
    return _loops(op)[1](bw)


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
