"""UPipe stages run one after another: the paper's algorithm as written (and plain Ulysses as its one stage).

Legend: s local tokens, N = C·s global tokens, b micro-batch, H query heads, d head dim, U = C·m heads per stage,
n_kv resident KV heads per rank in a KV round (schedule.py); upipe_passes.py and upipe_stages.py hold the steps.

Forward, stage by stage: at the first stage of a KV round project K/V for the round's heads and all-to-all them
(resident for the round); project the stage's q and all-to-all it; attention (packed documents: the kernel's
`docs`); all-to-all the output back into the stage's head slots of out. Backward, stage by stage: recompute K/V
(per round), q and the stage's slice of out, all-to-all the stage's slice of dout, the kernel's backward, dq back
into dx and dW_Q; at a round's end its summed dK/dV back into dx, dW_K, dW_V. With op.save_heads (Ulysses) the
forward keeps q, k, v and out in head layout and backward uses them instead of recomputing.

With `drain` (memory.upipe_overlap=outputs) each stage's result all-to-all (forward: its output; backward: its dq)
is started asynchronously and finished after the next stage's projections and input all-to-alls, before its
kernel; a KV round's last dq is finished at once (dx adds it before the round's dK/dV, as the serial order does).
Same results bit for bit; one stage's result in flight more (send and receive, [s, b, U, d] each, and in backward
its pre-norm q and W_Q rows).
"""

from __future__ import annotations

from .comm import head_to_seq
from .upipe_passes import BackwardPass, ForwardPass
from .upipe_stages import round_ends


def serial_forward(fw: ForwardPass, drain: bool = False):
    """(out [s, b, H·d], lse per stage, kernel aux per stage, saved heads per stage (Ulysses) or [])."""
    op = fw.op
    k_head = v_head = None
    sent = None  # (stage, its output all-to-all: done, or in flight with `drain`)
    for i, st in enumerate(op.schedule.stages):
        if st.new_round:
            k_head = v_head = None  # free the previous round's K/V before projecting the next
        kv, q_head = fw.project(i)  # (K, V) [N, b, n_kv, d] each at a round's first stage, else None; q [N, b, m, d]
        if kv is not None:
            k_head, v_head = kv
        del kv
        if sent is not None:  # drain: the previous stage's output, whose all-to-all ran during the projections above
            fw.write_out(*sent)
            sent = None
        o = fw.attend(i, q_head, k_head, v_head)  # [b, m, N, d]
        if op.save_heads:
            fw.saved.append((q_head, k_head, v_head, o))
        del q_head
        sent = (i, head_to_seq(o.permute(2, 0, 1, 3), op.group, async_op=drain))  # [N, b, m, d] -> [C, s, b, m, d]
        del o
        if not drain:
            fw.write_out(*sent)
            sent = None
    if sent is not None:
        fw.write_out(*sent)
    return fw.result()


def serial_backward(bw: BackwardPass, drain: bool = False):
    """(dx, dw_norm, dw_q, dw_k, dw_v, dw_o, db_q, db_k, db_v, dq_norm_w, dk_norm_w): `BackwardPass.result`."""
    op = bw.op
    k_head = v_head = None
    sent = None  # drain: (stage, its dq all-to-all in flight, and what finish_dq needs)
    for i, st in enumerate(op.schedule.stages):
        if op.save_heads:  # Ulysses: the forward's head-layout tensors
            q_head, k_head, v_head, o_head = bw.saved_heads()  # [N, b, m, d], [N, b, n_kv, d] x 2, [N, b, m, d]
        elif st.new_round:
            k_head = v_head = None  # free the previous round's K/V before recomputing the next
        w_rows, kv, q, q_pre, o = bw.recompute(i)  # W_Q rows [U, d, D]; UPipe: K/V, q, out in head layout
        if st.new_round:
            bw.new_round()  # dK, dV [N, b, n_kv, d] of the round
        do_head = bw.dout(i)  # [N, b, m, d]
        if kv is not None:
            k_head, v_head = kv  # [N, b, n_kv, d] each
        if q is not None:
            q_head, o_head = q, o  # [N, b, m, d] each
        del kv, q, o
        if sent is not None:  # drain: the previous stage's dq, whose all-to-all ran during the recomputation above
            bw.finish_sent_dq(*sent)
            sent = None
        dq, dk, dv = bw.attend(i, do_head, q_head, k_head, v_head, o_head)  # [b, m, N, d], [b, a1-a0, N, d] x 2
        del q_head, o_head, do_head
        bw.add_kv_grads(i, dk, dv)
        del dk, dv
        if drain:  # [b, m, N, d] -> [N, b, m, d] -> all-to-all in flight -> [C, s, b, m, d]
            sent = (i, head_to_seq(dq.permute(2, 0, 1, 3), op.group, async_op=True), q_pre, w_rows)
            del dq, q_pre, w_rows
            if round_ends(op.schedule, i):
                bw.finish_sent_dq(*sent)
                sent = None
        else:
            rows = bw.dq_rows(dq)  # [b, m, N, d] -> [N, b, m, d] -> all-to-all -> inverse RoPE -> [s·b, U·d]
            del dq
            bw.finish_dq(i, rows, q_pre, w_rows)  # into dx, dW_Q
            del rows, q_pre, w_rows
        if round_ends(op.schedule, i):
            k_head = v_head = None
            bw.finish_round(i)  # the round's dK, dV back into dx, dW_K, dW_V
    return bw.result()
