"""Plain Ulysses attention (the baseline): every head at once, the way DeepSpeed's DistributedAttention does it.

Legend: s local tokens, N = C·s, b batch, D model dim, H / G query / KV heads, d head dim, ρ KV replication.
Project all heads ([s, b, H·d]), apply RoPE, all-to-all seq→head ([N, b, H/C, d]), attend, all-to-all back,
with autograd doing the backward: the attention node saves q, k, v, out (head layout) and lse, which is exactly
the memory UPipe avoids. KV heads are replicated ρ times when G·ρ is not a multiple of C (the same minimal ρ as
UPipe's schedule for U = H).
"""

from __future__ import annotations

import torch

from .comm import head_to_seq_autograd, seq_to_head_autograd
from .kernels import kernel_backward, kernel_forward
from .upipe import StageOp


class _LocalAttention(torch.autograd.Function):
    """Differentiable kernel call on head-layout tensors q [N, b, hq, d], k/v [N, b, hkv, d] -> [N, b, hq, d]."""

    @staticmethod
    def forward(ctx, q, k, v, op: StageOp):
        o, lse, aux = kernel_forward(op.kernel, q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                     op.causal, op.scale)  # o [b, hq, N, d]
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.aux, ctx.op = aux, op
        return o.permute(2, 0, 1, 3)  # [N, b, hq, d]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        op = ctx.op
        dq, dk, dv = kernel_backward(op.kernel, dout.permute(1, 2, 0, 3), q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                     v.permute(1, 2, 0, 3), o, lse, ctx.aux, op.causal, op.scale)
        return dq.permute(2, 0, 1, 3), dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3), None


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron-core's rotate-half RoPE, differentiable: t [s, b, h, d]; cos, sin [s, rot/2]."""
    half = cos.shape[-1]
    c = torch.cat([cos, cos], -1).view(cos.shape[0], 1, 1, 2 * half)  # [s, 1, 1, rot]
    sn = torch.cat([sin, sin], -1).view(sin.shape[0], 1, 1, 2 * half)
    rot, rest = t[..., :2 * half], t[..., 2 * half:]
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    out = rot * c + rotated * sn
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], -1)


def _to_heads(t: torch.Tensor, C: int, op: StageOp) -> torch.Tensor:
    """[s, b, h, d] -> [C, s, b, h/C, d] -> all-to-all -> [N, b, h/C, d]."""
    s, b, h, d = t.shape
    send = t.view(s, b, C, h // C, d).permute(2, 0, 1, 3, 4).contiguous()  # [C, s, b, h/C, d]
    return seq_to_head_autograd(send, op.group)


def ulysses_forward(x, w_q, w_k, w_v, rope, op: StageOp) -> torch.Tensor:
    """x [s, b, D]; w_q [G, g, d, D]; w_k, w_v [G, d, D] -> [s, b, H·d] (natural head order)."""
    sched = op.schedule
    s, b, D = x.shape
    C, H, G, d = sched.cp_size, sched.num_heads, sched.num_kv_heads, w_q.shape[2]
    rho = sched.kv_replication
    q = torch.nn.functional.linear(x, w_q.reshape(H * d, D)).view(s, b, H, d)  # [s, b, H, d]
    k = torch.nn.functional.linear(x, w_k.reshape(G * d, D)).view(s, b, G, d)  # [s, b, G, d]
    v = torch.nn.functional.linear(x, w_v.reshape(G * d, D)).view(s, b, G, d)
    if rope is not None:
        cos, sin = (t[op.rank * s:(op.rank + 1) * s] for t in rope)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    if rho > 1:  # replica e of KV head i sits at i·ρ + e, next to the query heads it serves
        k, v = (t.unsqueeze(3).expand(s, b, G, rho, d).reshape(s, b, G * rho, d) for t in (k, v))
    o = _LocalAttention.apply(_to_heads(q, C, op), _to_heads(k, C, op), _to_heads(v, C, op), op)  # [N, b, H/C, d]
    o_seq = head_to_seq_autograd(o, op.group)  # [C, s, b, H/C, d]
    return o_seq.permute(1, 2, 0, 3, 4).reshape(s, b, H * d)  # [s, b, H·d]
