"""All-to-all resharding between sequence-sharded and head-sharded layouts (one job: move bytes).

Legend: C ranks in the context-parallel group, s = N / C local tokens, b micro-batch, h heads, d head dim.
Sequence-sharded: rank r holds global tokens [r*s, (r+1)*s) for all h heads being moved.
Head-sharded: rank r holds all N tokens for its h / C heads.

Both directions use `all_to_all_single` on contiguous buffers whose leading dimension is the rank chunk, so
no extra copy is needed around the collective; with C == 1 they return their input unchanged.

With `async_op=True` they return an `InFlight` at once: the collective runs in the background (NCCL: on its
communication stream, ordered after the work already queued on the current stream; gloo: on its worker threads)
and `wait()` gives the received tensor (NCCL: the current stream waits for it). The InFlight keeps the send buffer
alive until then. Every rank of the group must start its collectives in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class InFlight:
    """An all-to-all started with async_op=True; `wait()` -> the received tensor (once; then it holds nothing)."""

    def __init__(self, recv: torch.Tensor, work=None, send: torch.Tensor | None = None, shape=None) -> None:
        self._recv, self._work, self._send, self._shape = recv, work, send, shape

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        recv = self._recv if self._shape is None else self._recv.view(self._shape)
        self._recv = self._work = self._send = None
        return recv


def _all_to_all(send: torch.Tensor, group, async_op: bool, shape=None):
    """recv [C, ...] with chunk i from rank i (viewed as `shape` if given), or an InFlight of it."""
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    if async_op:
        return InFlight(recv, work, send, shape)
    return recv if shape is None else recv.view(shape)


def seq_to_head(send: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """[C, s, b, h/C, d] (chunk j = the heads destined for rank j) -> [N, b, h/C, d] (global token order)."""
    C, s = send.shape[0], send.shape[1]
    send = send.contiguous()
    if C == 1:
        out = send.view(s, *send.shape[2:])
        return InFlight(out) if async_op else out
    # recv [C, s, b, h/C, d] (chunk i = rank i's tokens of my heads) viewed as [N, b, h/C, d]
    return _all_to_all(send, group, async_op, (C * s, *send.shape[2:]))


def head_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """[N, b, h/C, d] (my heads, all tokens) -> [C, s, b, h/C, d] (chunk i = rank i's heads for my tokens)."""
    C = group_size(group)
    send = x.contiguous().view(C, x.shape[0] // C, *x.shape[1:])  # [C, s, b, h/C, d]: chunk j = rank j's tokens
    if C == 1:
        return InFlight(send) if async_op else send
    return _all_to_all(send, group, async_op)
