"""Independent reference: plain full-sequence attention in float64, no chunking, no communication, no kernels.

Used by the tests and by tools/bench_attention.py to check the distributed ops. Explicit softmax over the full
[N, N] score matrix, GQA by repeating KV heads, megatron-core's rotate-half RoPE; optional QKV biases and QK-norm
(RMSNorm over the head dim before RoPE, as HF Qwen3), also in float64; optional packed documents (cu_seqlens): a
block-diagonal mask over the full [N, N] scores, built from each token's document id.
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


def _rms_heads(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last (head) dim, float64: [N, b, h, d] -> [N, b, h, d]."""
    return weight.double() * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)


def reference_attention(x, w_q, w_k, w_v, num_heads, num_kv_heads, rotary_pos_emb=None, causal=True, softmax_scale=None,
                        b_q=None, b_k=None, b_v=None, q_norm_w=None, k_norm_w=None, qk_norm_eps=1e-6,
                        cu_seqlens=None):
    """x [N, b, D] (the whole sequence), natural-order weights -> [N, b, H·d], computed in float64.

    b_q [H·d], b_k, b_v [G·d]: projection biases (natural order); q_norm_w, k_norm_w [d]: QK-norm weights.
    cu_seqlens [n + 1] (0, ..., N): token i attends to token j only if both are in the same document (and, causal,
    j <= i)."""
    x, w_q, w_k, w_v = (t.double() for t in (x, w_q, w_k, w_v))
    N, b, _ = x.shape
    H, G = num_heads, num_kv_heads
    d = w_q.shape[0] // H
    q, k, v = x @ w_q.t(), x @ w_k.t(), x @ w_v.t()  # [N, b, H·d], [N, b, G·d] x2
    if b_q is not None:
        q, k, v = q + b_q.double(), k + b_k.double(), v + b_v.double()
    q, k, v = q.view(N, b, H, d), k.view(N, b, G, d), v.view(N, b, G, d)  # [N, b, heads, d]
    if q_norm_w is not None:
        q, k = _rms_heads(q, q_norm_w, qk_norm_eps), _rms_heads(k, k_norm_w, qk_norm_eps)
    if rotary_pos_emb is not None:
        q, k = _rope(q, rotary_pos_emb.double()), _rope(k, rotary_pos_emb.double())
    k, v = k.repeat_interleave(H // G, dim=2), v.repeat_interleave(H // G, dim=2)  # [N, b, H, d]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    scores = torch.einsum("ibhd,jbhd->bhij", q, k) * scale  # [b, H, N, N]
    hidden = torch.zeros(N, N, dtype=torch.bool)  # [N, N] True: masked out
    if causal:
        hidden |= torch.ones(N, N, dtype=torch.bool).triu(1)
    if cu_seqlens is not None:
        bounds = cu_seqlens.cpu().long()
        doc = torch.repeat_interleave(torch.arange(bounds.numel() - 1), bounds.diff())  # [N] document of each token
        hidden |= doc[:, None] != doc[None, :]
    if hidden.any():
        scores = scores.masked_fill(hidden, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bhij,jbhd->ibhd", p, v).reshape(N, b, H * d)  # [N, b, H·d]
