"""One forward or backward call of the UPipe op: its inputs, index tensors and accumulators, and the stage steps
the serial (upipe_serial.py) and pipelined (upipe_pipelined.py) stage loops run in their own order (pure torch).

Legend as in upipe_stages.py: s local tokens, N = C·s global tokens, b micro-batch, D model dim, H query heads,
G KV heads, g = H / G, d head dim, U = C·m heads per stage, n_kv resident KV heads per rank in a KV round.

Weights are grouped by KV head: w_q [G, g, d, D], w_k, w_v [G, d, D]; biases b_q [G, g, d], b_k, b_v [G, d];
QK-norm weights q_norm_w, k_norm_w [d]; rope = (cos, sin) [s, rot/2] or None. A stage's W_Q rows are gathered
with the schedule's indices (stage_rows: (group, j) per head), a round's W_K/W_V rows with its KV head ids.
"""

from __future__ import annotations

import torch

from .comm import seq_to_head
from .qk_norm import head_norm_backward
from .upipe_indices import _stage_indices, ordered_index_add_
from .upipe_rows import _acc_dtype, _norm_backward, _Rows, accumulate_mm
from .upipe_stages import (StageOp, _bias_rows, _dout_heads, _gather_heads, _heads_to_rows, _pre_norm, _project_kv,
                           _project_to_heads, _ready, _seq_to_rows, attention_backward, attention_forward)


class _Pass:
    """What forward and backward share: the inputs, the rows [s·b, D] they project from and the index tensors."""

    def __init__(self, x, w_q, w_k, w_v, rope, op: StageOp, norm_w, rstd, b_q, b_k, b_v, q_norm_w, k_norm_w):
        sched = op.schedule
        self.op, self.sched, self.rope, self.norm_w = op, sched, rope, norm_w
        self.s, self.b, self.D = x.shape
        self.C, self.m, self.n_kv = sched.cp_size, sched.q_per_rank, sched.kv_per_rank
        self.H, self.d = sched.num_heads, w_q.shape[2]
        self.w_q, self.w_k, self.w_v, self.b_q, self.b_k, self.b_v = w_q, w_k, w_v, b_q, b_k, b_v
        self.q_norm_w, self.k_norm_w = q_norm_w, k_norm_w
        s, b = self.s, self.b
        # [s, b, D] -> [s·b, D] rows (normalised on the fly when the input norm is fused)
        self.xin = _Rows(x.reshape(s * b, self.D), norm_w, rstd, op.norm_tile_rows)
        self.stage_heads, self.stage_rows, self.round_kv, self.round_groups = _stage_indices(sched, x)

    def project_kv(self, i: int, async_op: bool = False):
        """The K and V [N, b, n_kv, d] of stage i's KV round (InFlights with async_op)."""
        kv = self.round_kv[self.sched.stages[i].round_index]  # [C·n_kv] KV head ids
        return _project_kv(self.xin, self.w_k, self.w_v, self.b_k, self.b_v, self.k_norm_w, kv, self.rope, self.s,
                           self.b, self.op, async_op)

    def project_q(self, i: int, w_rows, keep_pre: bool = False, async_op: bool = False):
        """Stage i's q [N, b, m, d] (an InFlight with async_op) from its W_Q rows [U, d, D], and its pre-norm
        projection (p [s·b, U·d], rstd [s·b, U, 1]) when keep_pre and QK-norm, else None."""
        return _project_to_heads(self.xin, w_rows, self.rope, self.s, self.b, self.C, self.m, self.op,
                                 _bias_rows(self.b_q, self.stage_rows[i]), self.q_norm_w, keep_pre=keep_pre,
                                 async_op=async_op)


class ForwardPass(_Pass):
    """A forward call: out [s, b, H·d] filled stage by stage (natural head order), each stage's lse and kernel aux,
    and with op.save_heads (Ulysses) the head-layout (q, k, v, out) of each stage."""

    def __init__(self, x, *inputs) -> None:
        super().__init__(x, *inputs)
        s, b, H, d = self.s, self.b, self.H, self.d
        self.out = torch.empty((s, b, H * d), dtype=x.dtype, device=x.device)  # [s, b, H·d]
        self.out_shbd = self.out.view(s, b, H, d)  # [s, b, H·d] -> [s, b, H, d]
        self.lses, self.auxes, self.saved = [], [], []

    def project(self, i: int, async_op: bool = False):
        """Stage i's inputs in head layout: ((K, V) [N, b, n_kv, d] at a round's first stage, else None; q
        [N, b, m, d]), their all-to-alls started (InFlights with async_op)."""
        kv = self.project_kv(i, async_op) if self.sched.stages[i].new_round else None
        gi, ji = self.stage_rows[i]
        q, _ = self.project_q(i, self.w_q[gi, ji], async_op=async_op)  # [N, b, m, d]
        return kv, q

    def attend(self, i: int, q_head, k_head, v_head) -> torch.Tensor:
        """Stage i's attention: o [b, m, N, d]; its lse and aux are kept for backward."""
        o, lse, aux = attention_forward(self.op, self.sched.stages[i], q_head, k_head, v_head)
        self.lses.append(lse)
        self.auxes.append(aux)
        return o

    def write_out(self, i: int, o_seq) -> None:
        """Stage i's output [C, s, b, m, d] (rank j's heads for my tokens; or an InFlight of it) into its head slots
        of out."""
        o_seq = _ready(o_seq)
        heads, m = self.stage_heads[i], self.m
        for j in range(self.C):
            self.out_shbd.index_copy_(2, heads[j * m:(j + 1) * m], o_seq[j])

    def result(self):
        return self.out, self.lses, self.auxes, self.saved


class BackwardPass(_Pass):
    """A backward call given dout [s, b, H·d], or dy [s, b, D] with the fused output projection w_o [D, H·d]: the
    accumulators of every gradient (dx [s·b, D] and, for needs_dw, the weights'; the round's dK/dV [N, b, n_kv, d]),
    and the steps that recompute a stage's inputs and add its gradients. `saved` (Ulysses) is emptied stage by
    stage so that each stage's head tensors die as early as they would under autograd."""

    def __init__(self, dout, x, w_q, w_k, w_v, out, lses, auxes, saved, rope, op: StageOp, needs_dw: bool,
                 w_o, norm_w, rstd, b_q, b_k, b_v, q_norm_w, k_norm_w) -> None:
        super().__init__(x, w_q, w_k, w_v, rope, op, norm_w, rstd, b_q, b_k, b_v, q_norm_w, k_norm_w)
        s, b, D, H, d = self.s, self.b, self.D, self.H, self.d
        self.lses, self.auxes, self.saved, self.needs_dw, self.w_o = lses, auxes, saved, needs_dw, w_o
        self.dtype, self.acc = x.dtype, _acc_dtype(x.dtype, op.accumulate_fp32)
        self.out_shbd = out.view(s, b, H, d)  # [s, b, H·d] -> [s, b, H, d]
        if w_o is None:
            self.dout_shbd = dout.contiguous().view(s, b, H, d)  # [s, b, H·d] -> [s, b, H, d]
            self.dw_o = None
        else:
            self.dy2 = dout.reshape(s * b, D)  # [s, b, D] -> [s·b, D]
            self.dw_o = torch.mm(self.dy2.t(), out.view(s * b, H * d)) if needs_dw else None  # [D, H·d]
        self.dx = torch.zeros((s * b, D), dtype=self.acc, device=x.device)  # [s·b, D]
        self.dw_q, self.dw_k, self.dw_v = ((torch.zeros_like(w, memory_format=torch.contiguous_format)
                                            for w in (w_q, w_k, w_v)) if needs_dw else (None,) * 3)
        self.small = small = _acc_dtype(self.dtype, True)  # bias and QK-norm weight gradients: float32 for 16-bit

        def small_acc(t):  # [*] accumulator for the gradient of t, or None
            return torch.zeros(t.shape, dtype=small, device=x.device) if needs_dw and t is not None else None

        self.db_q, self.db_k, self.db_v, self.dqn_w, self.dkn_w = (small_acc(t)
                                                                   for t in (b_q, b_k, b_v, q_norm_w, k_norm_w))
        self.dk_acc = self.dv_acc = None

    def saved_heads(self):
        """Ulysses: the forward's q, k, v, out of the next stage, all [N, b, ·, d] (removed from `saved`)."""
        q_head, k_head, v_head, o_head = self.saved.pop(0)  # [N, b, m, d], [N, b, n_kv, d] x2, o [b, m, N, d]
        return q_head, k_head, v_head, o_head.permute(2, 0, 1, 3)  # o [b, m, N, d] -> [N, b, m, d]

    def recompute(self, i: int, async_op: bool = False):
        """Stage i's gathered W_Q rows [U, d, D] (kept until its dq is added) and, for UPipe, its recomputed inputs
        in head layout (None for each with op.save_heads): (K, V) [N, b, n_kv, d] at a round's first stage (else
        None), q [N, b, m, d] with its pre-norm projection (QK-norm; else None) and the stage's slice of out
        [N, b, m, d]; all-to-alls started (InFlights with async_op)."""
        st, heads, (gi, ji) = self.sched.stages[i], self.stage_heads[i], self.stage_rows[i]
        kv = q = q_pre = o = None
        w_rows = self.w_q[gi, ji]  # [U, d, D] (a gathered copy)
        if not self.op.save_heads:
            if st.new_round:
                kv = self.project_kv(i, async_op)
            q, q_pre = self.project_q(i, w_rows, keep_pre=True, async_op=async_op)  # [N, b, m, d]; pre-norm q
            o = seq_to_head(_gather_heads(self.out_shbd, heads, self.C), self.op.group,
                            async_op=async_op)  # [C, s, b, m, d] -> [N, b, m, d]
        return w_rows, kv, q, q_pre, o

    def dout(self, i: int, async_op: bool = False):
        """Stage i's slice of dout in head layout [N, b, m, d] (an InFlight with async_op)."""
        heads = self.stage_heads[i]
        send = (_gather_heads(self.dout_shbd, heads, self.C) if self.w_o is None else
                _dout_heads(self.dy2, self.w_o, heads, self.s, self.b, self.C, self.d))  # [C, s, b, m, d]
        return seq_to_head(send, self.op.group, async_op=async_op)  # [C, s, b, m, d] -> [N, b, m, d]

    def new_round(self) -> None:
        """dK, dV of a KV round: [N, b, n_kv, d] each, in the accumulation dtype."""
        self.dk_acc, self.dv_acc = (torch.zeros((self.C * self.s, self.b, self.n_kv, self.d), dtype=self.acc,
                                                device=self.dx.device) for _ in range(2))

    def attend(self, i: int, do_head, q_head, k_head, v_head, o_head):
        """Stage i's kernel backward: dq [b, m, N, d], dk, dv [b, a1-a0, N, d]."""
        return attention_backward(self.op, self.sched.stages[i], do_head, q_head, k_head, v_head, o_head,
                                  self.lses[i], self.auxes[i])

    def add_kv_grads(self, i: int, dk, dv) -> None:
        """dk, dv [b, a1-a0, N, d] into the round's dK, dV [N, b, n_kv, d] at stage i's KV slots."""
        a0, a1 = self.sched.stages[i].kv_slots
        self.dk_acc[:, :, a0:a1] += dk.permute(2, 0, 1, 3)
        self.dv_acc[:, :, a0:a1] += dv.permute(2, 0, 1, 3)

    def dq_rows(self, dq) -> torch.Tensor:
        """dq [b, m, N, d] -> all-to-all -> inverse RoPE -> [s·b, U·d]."""
        return _heads_to_rows(dq.permute(2, 0, 1, 3), self.rope, self.s, self.b, self.op)

    def finish_sent_dq(self, i: int, sent, q_pre, w_rows) -> None:
        """Stage i's dq back in sequence layout ([C, s, b, m, d], or the InFlight of its all-to-all) -> inverse
        RoPE -> [s·b, U·d] -> dx, dW_Q (`finish_dq`)."""
        self.finish_dq(i, _seq_to_rows(_ready(sent), self.rope, self.s, self.b), q_pre, w_rows)

    def _pre_norm_grad(self, rows, pre, nw, dnw):
        """Gradient w.r.t. the normalised heads [s·b, R·d] -> w.r.t. the pre-norm projection p [s·b, R·d]."""
        if nw is None:
            return rows
        s, b, d = self.s, self.b, self.d
        p, p_rstd = pre  # [s·b, R·d], [s·b, R, 1]
        R = p_rstd.shape[1]
        dp = head_norm_backward(p.view(s * b, R, d), nw, p_rstd, rows.view(s * b, R, d), dnw)  # [s·b, R, d]
        return dp.view(s * b, R * d)  # [s·b, R, d] -> [s·b, R·d]

    def finish_dq(self, i: int, rows, q_pre, w_rows) -> None:
        """Stage i's dq rows [s·b, U·d] (inverse RoPE done) into dx, dW_Q (and db_q, dq_norm_w)."""
        s, b, d, D = self.s, self.b, self.d, self.D
        gi, ji = self.stage_rows[i]
        if self.q_norm_w is not None:
            if q_pre is None:  # Ulysses keeps the normalised q only: recompute the pre-norm projection
                q_pre = _pre_norm(self.xin, w_rows, _bias_rows(self.b_q, (gi, ji)), self.q_norm_w,
                                  self.op)  # [s·b, U·d], [s·b, U, 1]
            rows = self._pre_norm_grad(rows, q_pre, self.q_norm_w, self.dqn_w)  # [s·b, U·d]
        del q_pre
        if self.db_q is not None:
            self.db_q[gi, ji] = rows.view(s * b, -1, d).sum(0, dtype=self.small)  # [s·b, U·d] -> [U, d]
        accumulate_mm(self.dx, rows, w_rows.view(-1, D))  # dx += [s·b, U·d] @ [U·d, D], summed in dx's dtype
        if self.needs_dw:
            self.dw_q[gi, ji] = self.xin.t_mm(rows).view(-1, d, D)  # [U·d, D] -> [U, d, D]

    def finish_round(self, i: int) -> None:
        """The round of stage i: its dK, dV all-to-all'd back through inverse RoPE (K) into dx, dW_K, dW_V (and the
        biases' and k_norm's gradients); replicated KV heads' gradients summed in order."""
        s, b, d, D, C, n_kv = self.s, self.b, self.d, self.D, self.C, self.n_kv
        r = self.sched.stages[i].round_index
        kv, groups = self.round_kv[r], self.round_groups[r]
        for g_acc, w, dw, rot, bias, nw, dnw, db in (
                (self.dk_acc, self.w_k, self.dw_k, self.rope, self.b_k, self.k_norm_w, self.dkn_w, self.db_k),
                (self.dv_acc, self.w_v, self.dw_v, None, self.b_v, None, None, self.db_v)):
            rows = _heads_to_rows(g_acc.to(self.dtype), rot, s, b, self.op)  # [s·b, C·n_kv·d]
            w_rows = w[kv].view(C * n_kv * d, D)  # [C·n_kv, d, D] -> [C·n_kv·d, D]
            if nw is not None:  # K's pre-norm projection, recomputed: K itself is gone by now
                pre = _pre_norm(self.xin, w[kv], _bias_rows(bias, kv), nw,
                                self.op)  # [s·b, C·n_kv·d], [s·b, C·n_kv, 1]
                rows = self._pre_norm_grad(rows, pre, nw, dnw)
                del pre
            if db is not None:  # replicas sum here
                ordered_index_add_(db, groups, rows.view(s * b, C * n_kv, d).sum(0, dtype=self.small))  # [C·n_kv, d]
            accumulate_mm(self.dx, rows, w_rows)  # dx += [s·b, C·n_kv·d] @ [C·n_kv·d, D]
            if self.needs_dw:
                ordered_index_add_(dw, groups, self.xin.t_mm(rows).view(C * n_kv, d, D))  # replicas sum in order
        self.dk_acc = self.dv_acc = None

    def result(self):
        """(dx [s, b, D], dw_norm [D], dw_q, dw_k, dw_v, dw_o, db_q, db_k, db_v, dq_norm_w, dk_norm_w), None for
        each input not given (and for all but dx when not needs_dw)."""
        small_grads = tuple(None if a is None else a.to(t.dtype) for a, t in
                            ((self.db_q, self.b_q), (self.db_k, self.b_k), (self.db_v, self.b_v),
                             (self.dqn_w, self.q_norm_w), (self.dkn_w, self.k_norm_w)))
        s, b, D = self.s, self.b, self.D
        if self.norm_w is None:
            dx, dw_norm = self.dx.view(s, b, D).to(self.dtype), None
            return (dx, dw_norm, self.dw_q, self.dw_k, self.dw_v, self.dw_o) + small_grads
        dx, dw_norm = _norm_backward(self.dx, self.xin, self.dtype)
        return (dx.view(s, b, D), dw_norm, self.dw_q, self.dw_k, self.dw_v, self.dw_o) + small_grads
