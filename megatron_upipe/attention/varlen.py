"""Packed sequences with document masking: the documents' boundaries (checked, normalised) and exact variable-length
attention on CPU.

Legend: N global tokens of the packed sequence (micro-batch b = 1), n documents, L one document's length, k the
documents of one length, h heads, d head dim.

cu_seqlens [n + 1] int32 = (0, l_1, l_1 + l_2, ..., N): document i is global tokens [cu[i], cu[i + 1]). Attention is
causal (with causal=False: full) inside each document and absent across documents. After the seq->head all-to-all
every rank holds whole sequences for its heads, so each stage's kernel takes the global boundaries as they are and
documents may straddle CP shards. Empty documents (repeated boundaries) are allowed and dropped: they hold no token.

`documents(...)` checks cu_seqlens (one-line ValueErrors, from arguments every rank shares) and returns a
`Documents` (host boundaries: the CUDA kernels' max_seqlen, the CPU kernel's grouping; the int32 copy on x's device
that the CUDA kernels take), or None for a single document: that is plain causal attention and takes the very same
code path, so its results equal the fixed-length op's bit for bit. Making a Documents copies the boundaries to the
device (from pageable memory: the host waits for the stream), so a caller that runs many ops on one packed
sequence (the model: every layer, and the recomputed forward) makes it once and passes it as cu_seqlens;
`documents` checks it against the call and returns it as it is, with its device copy and CPU groups.

CPU kernel (`cpu_varlen_forward` / `cpu_varlen_backward`): aten's CPU flash attention and its backward (the
fixed-length kernel's own ops, lse in, lse out: backward recomputes nothing), one call per distinct document length
with the k documents of that length batched as [k, h, L, d] (gathered by index_select, results scattered back by
index_copy_; a length held by one document is sliced, no copy), at most GROUP_TOKENS tokens per call (or one
document, if longer) so that the gathered copies stay small whatever the documents. Work is Σ L_i², never N²; the
calls are at most the distinct lengths (fewer than sqrt(2N)) plus N / GROUP_TOKENS, never one per document or
token. out [1, h, N, d] and lse [1, h, N] have the fixed-length kernel's layouts (memory [N, 1, h, d] and
[1, N, h]); beyond the fixed-length kernel's buffers a call holds its gathered inputs and its outputs (at most
GROUP_TOKENS tokens, or one document, each).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

_aten = torch.ops.aten
GROUP_TOKENS = 16384  # most tokens in one CPU kernel call of equal-length documents (unless one document is longer)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


@dataclass(frozen=True, eq=False)
class _Group:
    """The k documents of one length L: starts[i] is document i's first token; `index` [k·L] their tokens (int64,
    None when k == 1: a slice)."""

    length: int
    starts: tuple[int, ...]
    index: torch.Tensor | None

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """[1, h, N, *r] (any strides) -> [k, h, L, *r]: a slice for one document, else a gathered copy."""
        if self.index is None:
            return t.narrow(2, self.starts[0], self.length)  # [1, h, L, *r] view
        k, L = len(self.starts), self.length
        g = t[0].movedim(1, 0).index_select(0, self.index)  # [N, h, *r] view -> [k·L, h, *r]
        return g.view(k, L, *g.shape[1:]).movedim(1, 2)  # [k·L, h, *r] -> [k, L, h, *r] -> [k, h, L, *r]

    def put(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Write src [k, h, L, *r] into its documents' tokens of dst [1, h, N, *r]."""
        if self.index is None:
            dst.narrow(2, self.starts[0], self.length).copy_(src)
            return
        rows = src.movedim(2, 1).reshape(-1, *src.shape[1:2], *src.shape[3:])  # [k, L, h, *r] -> [k·L, h, *r]
        dst[0].movedim(1, 0).index_copy_(0, self.index, rows)  # into the [N, h, *r] view of dst


@dataclass(frozen=True, eq=False)  # compared and hashed by identity
class Documents:
    """Document boundaries of one packed sequence, empty documents dropped (at least two documents)."""

    bounds: tuple[int, ...]  # 0 = b_0 < b_1 < ... < b_n = N
    cu_seqlens: torch.Tensor  # int32 [n + 1] = bounds, on the op's device (what the CUDA kernels take)

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @cached_property
    def max_len(self) -> int:
        return max(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    @cached_property
    def cpu_groups(self) -> tuple[_Group, ...]:
        """The documents grouped by length (ascending), at most GROUP_TOKENS tokens (or one document) per group,
        with CPU gather indices; made once per Documents (every stage's forward and backward reuse them)."""
        by_length: dict[int, list[int]] = {}
        for a, z in zip(self.bounds, self.bounds[1:]):
            by_length.setdefault(z - a, []).append(a)
        groups = []
        for L in sorted(by_length):
            per_call = max(1, GROUP_TOKENS // L)
            for i in range(0, len(by_length[L]), per_call):
                st = by_length[L][i:i + per_call]
                index = None if len(st) == 1 else (torch.tensor(st)[:, None] + torch.arange(L)).reshape(-1)  # [k·L]
                groups.append(_Group(L, tuple(st), index))
        return tuple(groups)


def _check_batch(batch: int) -> None:
    if batch != 1:
        raise ValueError(f"cu_seqlens packs documents into one sequence, so the micro-batch must be 1; got b={batch}: "
                         f"concatenate the batch's sequences into one packed sequence [N, 1, D]")


def _reused(docs: Documents, total: int, batch: int, device: torch.device) -> Documents:
    """A Documents made earlier by `documents`, checked against this call: returned as it is (no copy)."""
    _check_batch(batch)
    if docs.total != total:
        raise ValueError(f"cu_seqlens (Documents) ends at {docs.total} but the packed sequence has N = C·s = {total} "
                         f"tokens; make the Documents for this sequence")
    if docs.cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens (Documents) holds its boundaries on {docs.cu_seqlens.device} but x is on "
                         f"{device}; make the Documents with x's device")
    return docs


def documents(cu_seqlens, total: int, batch: int, device: torch.device) -> Documents | None:
    """Check cu_seqlens for a packed sequence of `total` = N tokens and micro-batch `batch`; the normalised
    boundaries, or None when there is one document (plain causal attention). Reads the values on the host: pass
    cu_seqlens on the CPU to spare a CUDA tensor's device sync (the boundaries are copied to `device` here).
    cu_seqlens may also be a Documents made by this function for the same N and device: it is returned as it is,
    without a new copy (make it once per packed sequence, pass it to every op on it)."""
    if isinstance(cu_seqlens, Documents):
        return _reused(cu_seqlens, total, batch, device)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be an int32 tensor [n_docs + 1] = (0, l1, l1+l2, ..., N) or a Documents "
                         f"made by attention.varlen.documents; got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [n_docs + 1] with at least [0, N]; got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens has dtype {cu_seqlens.dtype}; it must be torch.int32 (flash-attn's and TE's "
                         f"dtype): pass cu_seqlens.to(torch.int32)")
    if cu_seqlens.device.type != "cpu" and cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but x is on {device}; pass it on the CPU (no device "
                         f"sync) or on x's device")
    _check_batch(batch)
    try:
        values = cu_seqlens.tolist()  # plain ints, read directly (also for a real tensor inside FakeTensorMode)
    except Exception as e:  # noqa: BLE001 - a fake or meta tensor has no values
        raise ValueError(f"cu_seqlens' values cannot be read ({_first_line(e)}); the op needs the document "
                         f"boundaries on the host: under FakeTensorMode pass a real CPU tensor made outside the "
                         f"mode") from None
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0; got cu_seqlens[0]={values[0]}")
    for i, (a, z) in enumerate(zip(values, values[1:]), 1):
        if z < a:
            raise ValueError(f"cu_seqlens must be non-decreasing (cumulative document lengths); got cu_seqlens[{i}]="
                             f"{z} < cu_seqlens[{i - 1}]={a}")
    if values[-1] != total:
        raise ValueError(f"cu_seqlens ends at {values[-1]} but the packed sequence has N = C·s = {total} tokens; its "
                         f"last entry must be N (pad the last document or the sequence)")
    bounds = [0] + [z for a, z in zip(values, values[1:]) if z > a]  # empty documents dropped
    if len(bounds) == 2:
        return None  # one document: plain causal attention
    if len(bounds) == len(values) and cu_seqlens.device == device:
        dev = cu_seqlens  # the caller's tensor as it is
    else:
        dev = torch.tensor(bounds, dtype=torch.int32, device=device)  # [n + 1]
    return Documents(tuple(bounds), dev)


# ------------------------------------------------------------------------------- CPU variable-length kernel
def cpu_varlen_forward(q, k, v, docs: Documents, causal: bool, scale: float):
    """q [1, hq, N, d], k/v [1, hkv, N, d] (views of sequence-first buffers) -> (out [1, hq, N, d], lse [1, hq, N]
    (float32; float64 for float64), None), per document."""
    _, hq, N, d = q.shape
    out = torch.empty((N, 1, hq, d), dtype=q.dtype, device=q.device).permute(1, 2, 0, 3)  # [1, hq, N, d] view
    lse = None
    for g in docs.cpu_groups:
        o, l_g = _aten._scaled_dot_product_flash_attention_for_cpu(g.take(q), g.take(k), g.take(v), 0.0, causal,
                                                                   scale=scale)  # [k, hq, L, d], [k, hq, L]
        if lse is None:
            lse = torch.empty((1, N, hq), dtype=l_g.dtype, device=q.device).transpose(1, 2)  # [1, hq, N] view
        g.put(out, o)
        g.put(lse, l_g)
    return out, lse, None


def cpu_varlen_backward(dout, q, k, v, out, lse, aux, docs: Documents, causal: bool, scale: float):
    """(dq, dk, dv) shaped like q, k, v, from the forward's out and lse (no attention recompute), per document."""
    _, hq, N, d = q.shape
    hkv = k.shape[1]
    dq = torch.empty((N, 1, hq, d), dtype=q.dtype, device=q.device).permute(1, 2, 0, 3)  # [1, hq, N, d] view
    dk, dv = (torch.empty((N, 1, hkv, d), dtype=q.dtype, device=q.device).permute(1, 2, 0, 3) for _ in range(2))
    for g in docs.cpu_groups:
        grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g.take(dout), g.take(q), g.take(k), g.take(v), g.take(out), g.take(lse), 0.0, causal, scale=scale)
        for dst, src in zip((dq, dk, dv), grads):
            g.put(dst, src)
    return dq, dk, dv
