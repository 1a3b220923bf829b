"""Packed documents: the document boundaries of one sample, and each token's position inside its document.

megatron-core's GPTDataset packs documents into fixed-length samples; with `reset_position_ids` the position ids
restart at 0 on the token after every end-of-document token. With `data.document_mask=true` those restarts are
the document boundaries: `cu_seqlens_from_positions` turns a sample's position ids [N] into the cumulative
document lengths cu_seqlens (int32 [n_docs + 1] = [0, l1, l1 + l2, ..., N]: megatron's THD `cu_seqlens`, which
the UPipe/Ulysses op takes for the global sequence), and `document_positions` gives the in-document positions of
a contiguous range of tokens (a context-parallel rank's share) from cu_seqlens alone, for its RoPE angles.
`packed_seq_params` wraps one sample's cu_seqlens as megatron-core's THD PackedSeqParams, with a per-micro-batch
cache so that every attention layer shares one tensor of RoPE angles (see `DocumentPackedSeqParams`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams


def cu_seqlens_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids [N] (restarting at 0 at each document start) -> cu_seqlens int32 [n_docs + 1]."""
    if position_ids.dim() != 1:
        raise ValueError(f"position_ids must be one sample's [N]; got shape {tuple(position_ids.shape)}")
    n = position_ids.shape[0]
    starts = torch.nonzero(position_ids == 0).flatten()  # [n_docs]: where a document begins
    if starts.numel() == 0 or starts[0] != 0:  # a sample may begin inside a document: that is its first one
        starts = torch.cat([starts.new_zeros(1), starts])
    return torch.cat([starts, starts.new_full((1,), n)]).to(torch.int32)  # [n_docs + 1]


def document_positions(cu_seqlens: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """In-document positions of global tokens [start, start + length) -> int64 [length]."""
    tokens = torch.arange(start, start + length, device=cu_seqlens.device)  # [length] global indices
    cu = cu_seqlens.to(torch.int64)
    doc = torch.searchsorted(cu, tokens, right=True) - 1  # [length]: the document of each token
    return tokens - cu[doc]


@dataclass
class DocumentPackedSeqParams(PackedSeqParams):
    """megatron-core's THD PackedSeqParams of one micro-batch, plus `cache`: what every attention layer of the
    micro-batch needs and the first one makes, shared by the others and by the recomputed forward — the RoPE angles
    of this rank's in-document positions ([s/C, 1, 1, rot_dim]: one angle tensor, as an unpacked micro-batch holds,
    instead of one per layer or a table of the longest document's rows) and the op's document boundaries on the
    device (one host->device copy per micro-batch instead of one per layer call)."""

    cache: dict = field(default_factory=dict, repr=False, compare=False)

    def cached(self, key, make):
        """The value cached under `key`, made by `make()` on first use."""
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


def packed_seq_params(cu_seqlens: torch.Tensor) -> DocumentPackedSeqParams:
    """THD PackedSeqParams for one sample's document boundaries cu_seqlens [n_docs + 1] (kept where they are: on
    the host in training); the longest document is megatron's max_seqlen."""
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return DocumentPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                   max_seqlen_q=longest, max_seqlen_kv=longest)
