"""UPipe stages pipelined (op.overlap="stages", memory.upipe_overlap=true): communication of neighbouring stages in
flight during each stage's kernel, the same results as upipe_serial.py bit for bit, one more stage of buffers alive
(its inputs, send and receive). The bounded variant, only each stage's result in flight during the next stage's
projections (op.overlap="outputs"), is upipe_serial.py's loop with `drain`.

Legend: s local tokens, N = C·s global tokens, b micro-batch, H query heads, d head dim, U = C·m heads per stage,
n_kv resident KV heads per rank in a KV round (schedule.py); upipe_passes.py and upipe_stages.py hold the steps.

While stage i's kernel runs, stage i+1's projections have gone out in their seq->head all-to-alls (started with
async_op) and stage i-1's result is coming back (forward: its output; backward: its dq). Each stage waits for its
inputs before its kernel, finishes stage i-1's result after launching stage i+1, and (backward) adds a round's
last dq into dx before the round's dK/dV, so that every sum is formed in the serial order.
"""

from __future__ import annotations

from .comm import head_to_seq
from .upipe_passes import BackwardPass, ForwardPass
from .upipe_stages import _ready, _settle, round_ends


def pipelined_forward(fw: ForwardPass):
    """(out [s, b, H·d], lse per stage, kernel aux per stage, [])."""
    op, n = fw.op, len(fw.op.schedule.stages)
    k_head = v_head = None
    nxt = fw.project(0, async_op=True)
    draining = None  # the previous stage's output all-to-all in flight, with its stage index
    for i in range(n):
        (kv, q), nxt = nxt, None
        if kv is not None:
            k_head = v_head = None  # the previous round's last kernel has run
            k_head, v_head = _ready(kv[0]), _ready(kv[1])  # [N, b, n_kv, d] each
        q_head = _ready(q)  # [N, b, m, d]
        del kv, q
        if i + 1 < n:
            nxt = fw.project(i + 1, async_op=True)  # in flight during this stage's kernel
        if draining is not None:
            fw.write_out(*draining)  # the previous stage's output: its all-to-all ran during the projections above
            draining = None
        o = fw.attend(i, q_head, k_head, v_head)  # [b, m, N, d]
        nxt = _settle(nxt)  # the next stage's inputs have arrived (on CUDA: the stream waits): send buffers freed
        del q_head
        draining = (i, head_to_seq(o.permute(2, 0, 1, 3), op.group, async_op=True))  # [N, b, m, d] -> [C, s, b, m, d]
        del o
    fw.write_out(*draining)
    return fw.result()


def _launch(bw: BackwardPass, i: int):
    """Stage i's W_Q rows and inputs in head layout, their all-to-alls started: (w_rows, kv, q, q_pre, o, do)."""
    w_rows, kv, q, q_pre, o = bw.recompute(i, async_op=True)
    return w_rows, kv, q, q_pre, o, bw.dout(i, async_op=True)


def pipelined_backward(bw: BackwardPass):
    """(dx, dw_norm, dw_q, dw_k, dw_v, dw_o, db_q, db_k, db_v, dq_norm_w, dk_norm_w): `BackwardPass.result`."""
    op, n = bw.op, len(bw.op.schedule.stages)
    k_head = v_head = None
    nxt = _launch(bw, 0)
    draining = None  # the previous stage's dq all-to-all in flight, with what finish_dq needs
    for i, st in enumerate(op.schedule.stages):
        (w_rows, kv, q, q_pre, o, do), nxt = nxt, None
        if kv is not None:
            k_head = v_head = None  # the previous round's last kernel has run
            k_head, v_head = _ready(kv[0]), _ready(kv[1])  # [N, b, n_kv, d] each
        q_head, o_head = _ready(q), _ready(o)  # [N, b, m, d] each
        do_head = _ready(do)  # [N, b, m, d]
        del kv, q, o, do
        if st.new_round:
            bw.new_round()  # dK, dV [N, b, n_kv, d] of the round
        if i + 1 < n:
            nxt = _launch(bw, i + 1)  # in flight during this stage's kernel
        if draining is not None:  # the previous stage's dq (its all-to-all ran during the projections above)
            bw.finish_sent_dq(*draining)
            draining = None
        dq, dk, dv = bw.attend(i, do_head, q_head, k_head, v_head, o_head)  # [b, m, N, d], [b, a1-a0, N, d] x 2
        nxt = _settle(nxt)  # the next stage's inputs have arrived (on CUDA: the stream waits): send buffers freed
        del q_head, o_head, do_head
        bw.add_kv_grads(i, dk, dv)
        del dk, dv
        draining = (i, head_to_seq(dq.permute(2, 0, 1, 3), op.group, async_op=True),  # [C, s, b, m, d] in flight
                    q_pre, w_rows)
        del dq, q_pre, w_rows
        if round_ends(op.schedule, i):  # dx adds this stage's dq before the round's dK/dV, as the serial order does
            bw.finish_sent_dq(*draining)
            draining = None
            k_head = v_head = None
            bw.finish_round(i)  # the round's dK, dV back into dx, dW_K, dW_V
    return bw.result()
