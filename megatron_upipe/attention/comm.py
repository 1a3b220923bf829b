"""All-to-all resharding between sequence-sharded and head-sharded layouts (one job: move bytes).

Legend: C ranks in the context-parallel group, s = N / C local tokens, b micro-batch, h heads, d head dim.
Sequence-sharded: rank r holds global tokens [r*s, (r+1)*s) for all h heads being moved.
Head-sharded: rank r holds all N tokens for its h / C heads.

Both directions use `all_to_all_single` on contiguous buffers whose leading dimension is the rank chunk, so
no extra copy is needed around the collective; with C == 1 they return their input unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def seq_to_head(send: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[C, s, b, h/C, d] (chunk j = the heads destined for rank j) -> [N, b, h/C, d] (global token order)."""
    C, s = send.shape[0], send.shape[1]
    send = send.contiguous()
    if C == 1:
        return send.view(s, *send.shape[2:])
    recv = torch.empty_like(send)  # [C, s, b, h/C, d]: chunk i = rank i's tokens of my heads
    dist.all_to_all_single(recv, send, group=group)
    return recv.view(C * s, *send.shape[2:])  # [N, b, h/C, d]


def head_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[N, b, h/C, d] (my heads, all tokens) -> [C, s, b, h/C, d] (chunk i = rank i's heads for my tokens)."""
    C = group_size(group)
    send = x.contiguous().view(C, x.shape[0] // C, *x.shape[1:])  # [C, s, b, h/C, d]: chunk j = rank j's tokens
    if C == 1:
        return send
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv

