"""Independent reference: plain full-sequence attention in float64, no chunking, no communication, no kernels.

Used by the tests and by tools/bench_attention.py to check the distributed ops. Explicit softmax over the full
[N, N] score matrix, GQA by repeating KV heads, megatron-core's rotate-half RoPE.
Legend: N global tokens, b batch, D model dim, H / G query / KV heads, d head dim.
"""

from __future__ import annotations

import math

import torch


def rope_angles(seq_len: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    """megatron-core RotaryEmbedding-format angles [N, 1, 1, rot_dim] (float64)."""
    inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    f = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)  # [N, rot/2]
    return torch.cat([f, f], -1).view(seq_len, 1, 1, rot_dim)


def _rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    rot = freqs.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    x1, x2 = x[..., : rot // 2], x[..., rot // 2:]
    rotated = torch.cat([-x2, x1], -1)
    return torch.cat([x * torch.cos(freqs) + rotated * torch.sin(freqs), rest], -1)


def reference_attention(x, w_q, w_k, w_v, num_heads, num_kv_heads, rotary_pos_emb=None, causal=True, softmax_scale=None):
    """x [N, b, D] (the whole sequence), natural-order weights -> [N, b, H·d], computed in float64."""
    x, w_q, w_k, w_v = (t.double() for t in (x, w_q, w_k, w_v))
    N, b, _ = x.shape
    H, G = num_heads, num_kv_heads
    d = w_q.shape[0] // H
    q = (x @ w_q.t()).view(N, b, H, d)  # [N, b, H, d]
    k = (x @ w_k.t()).view(N, b, G, d)  # [N, b, G, d]
    v = (x @ w_v.t()).view(N, b, G, d)
    if rotary_pos_emb is not None:
        q, k = _rope(q, rotary_pos_emb.double()), _rope(k, rotary_pos_emb.double())
    k, v = k.repeat_interleave(H // G, dim=2), v.repeat_interleave(H // G, dim=2)  # [N, b, H, d]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    scores = torch.einsum("ibhd,jbhd->bhij", q, k) * scale  # [b, H, N, N]
    if causal:
        mask = torch.ones(N, N, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bhij,jbhd->ibhd", p, v).reshape(N, b, H * d)  # [N, b, H·d]
