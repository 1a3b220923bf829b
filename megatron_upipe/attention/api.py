"""Public functional API of the attention package: argument checks, then UPipe or the Ulysses baseline.

Every check runs before any communication and depends only on arguments every rank shares (shapes, head
counts, the group size), so a bad call raises the same ValueError on every rank instead of hanging a collective.

Legend: s local tokens (rank r of cp_group holds global tokens [r·s, (r+1)·s)), N = C·s, b batch, D model dim,
H query heads, G KV heads, g = H / G, d head dim.

Packed sequences: every function takes `cu_seqlens`, int32 [n_docs + 1] = (0, l1, l1+l2, ..., N), the cumulative
document lengths of the GLOBAL sequence (the same tensor on every CP rank; on the CPU, or on x's device at the cost
of a device sync, since the op reads the boundaries on the host), with micro-batch b = 1. Each call copies them to
x's device; a caller with many calls on one sequence (layers, recompute) passes instead the `varlen.Documents` that
`varlen.documents(cu_seqlens, N, 1, x.device)` made once, which every call reuses without a copy. Attention is
then causal (causal=False: full) inside each document only; documents may straddle CP shards; empty documents are
allowed (they hold no token). One document ([0, N]) is plain attention and gives the fixed-length results bit for
bit. RoPE is unchanged: pass the angles of the positions you want (with position ids reset per document,
per-document positions), as [N, 1, 1, rot] or this rank's rows [s, 1, 1, rot]; each row's angle is applied to its
token.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .comm import group_size
from .kernels import select_kernel, stage_call
from .rope import rope_cos_sin
from .schedule import make_schedule
from .upipe import StageOp, UPipeFunction
from .upipe_stages import OVERLAPS
from .varlen import documents

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_grouped(x, w_q, w_k, w_v, rotary_pos_emb, C: int, R: int = 1) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [s, b, D] (sequence first); got shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"x has dtype {x.dtype}; use float16, bfloat16, float32 or float64")
    s, _, D = x.shape
    if w_q.dim() != 4 or w_k.dim() != 3 or w_v.dim() != 3:
        raise ValueError(
            f"grouped weights must be w_q [G, g, d, D], w_k/w_v [G, d, D]; got {tuple(w_q.shape)}, "
            f"{tuple(w_k.shape)}, {tuple(w_v.shape)}"
        )
    G, _, d, Dq = w_q.shape
    if Dq != D or w_k.shape != (G, d, D) or w_v.shape != (G, d, D):
        raise ValueError(
            f"weight shapes do not match x [s, b, D={D}] and w_q [G={G}, g, d={d}, D]: w_q {tuple(w_q.shape)}, "
            f"w_k {tuple(w_k.shape)}, w_v {tuple(w_v.shape)}; w_k and w_v must be [{G}, {d}, {D}]"
        )
    for name, w in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v)):
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"{name} is {w.dtype} on {w.device} but x is {x.dtype} on {x.device}; cast one of them")
    if rotary_pos_emb is not None:
        N = s * C * R
        if rotary_pos_emb.shape[0] not in (N, s) or rotary_pos_emb.dim() != 4:
            raise ValueError(
                f"rotary_pos_emb must be [N, 1, 1, rot_dim] for all N = {C * R} ranks x {s} local tokens = {N} global "
                f"positions (megatron-core RotaryEmbedding output, not sliced per CP rank) or [{s}, 1, 1, rot_dim] "
                f"for this rank's contiguous positions; got {tuple(rotary_pos_emb.shape)}. If the global sequence "
                f"length is not a multiple of the cp size, pad it or change the cp size"
            )
        rot = rotary_pos_emb.shape[-1]
        if rot % 2 or rot > d:
            raise ValueError(f"rotary_pos_emb has rot_dim={rot}; it must be even and at most the head dim {d}")


def _check_qk_extras(x, w_q, b_q, b_k, b_v, q_norm_w, k_norm_w, qk_norm_eps) -> None:
    """Projection biases (all three or none) and QK-norm weights (both or none) in the grouped layout."""
    G, g, d = w_q.shape[0], w_q.shape[1], w_q.shape[2]
    biases = {"b_q": b_q, "b_k": b_k, "b_v": b_v}
    given = [n for n, t in biases.items() if t is not None]
    if given and len(given) != 3:
        raise ValueError(f"b_q, b_k and b_v must be given together (QKV bias) or not at all; got only {given}")
    norms = {"q_norm_w": q_norm_w, "k_norm_w": k_norm_w}
    given_n = [n for n, t in norms.items() if t is not None]
    if given_n and len(given_n) != 2:
        raise ValueError(f"q_norm_w and k_norm_w must be given together (QK-norm) or not at all; got only {given_n}")
    want = {"b_q": (G, g, d), "b_k": (G, d), "b_v": (G, d), "q_norm_w": (d,), "k_norm_w": (d,)}
    for name, t in {**biases, **norms}.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want[name] or t.dtype != x.dtype \
                or t.device != x.device:
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be {list(want[name])} (G={G}, g={g}, d={d} from w_q) in {x.dtype} on "
                             f"{x.device}, like x; got {got}")
    if given_n and not (isinstance(qk_norm_eps, (int, float)) and math.isfinite(qk_norm_eps) and qk_norm_eps > 0):
        raise ValueError(f"qk_norm_eps={qk_norm_eps!r} must be a positive float (Qwen3: 1e-6)")


def _zigzag_rows(rows: torch.Tensor, a: int, C: int, r: int, R: int) -> torch.Tensor:
    """The rows of `rows` [N, ...] at `layout.local_positions(N, a, C, r, R)` (R > 1), cut from rows itself: no host
    index copied to its device (a blocking copy per call). Ring rank r's group holds 2n tokens, chunk r then chunk
    2R-1-r (n = N/(2R) each); a2a rank a holds its tokens [a·s, (a+1)·s) of them (s = N/(C·R)): one or two runs."""
    N = rows.shape[0]
    n, s = N // (2 * R), N // (C * R)
    runs = []
    for first, chunk in ((0, r), (n, 2 * R - 1 - r)):  # group tokens [first, first + n) are `chunk`'s
        lo, hi = max(a * s, first), min((a + 1) * s, first + n)
        if lo < hi:
            runs.append(rows[chunk * n + lo - first:chunk * n + hi - first])  # [hi - lo, ...] view
    return runs[0] if len(runs) == 1 else torch.cat(runs)  # [s, ...]


def _prepare(x, w_q, w_k, w_v, cp_group, heads_per_stage, rotary_pos_emb, causal, softmax_scale, kernel,
             ulysses: bool = False, grad_accum: str = "fp32", w_o=None, norm_w=None, norm_eps: float = 1e-5,
             norm_tile_rows: int = 32768, b_q=None, b_k=None, b_v=None, q_norm_w=None, k_norm_w=None,
             qk_norm_eps: float = 1e-6, cu_seqlens=None, overlap: bool | str = False, ring_group=None,
             ring_overlap: bool = False):
    if norm_tile_rows < 1:
        raise ValueError(f"norm_tile_rows={norm_tile_rows} must be positive")
    if grad_accum not in ("fp32", "input"):
        raise ValueError(f"grad_accum={grad_accum!r}: use 'fp32' or 'input' (the activations' dtype)")
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap={overlap!r}: use False, True (= 'stages') or 'outputs'")
    given, overlap = overlap, OVERLAPS[overlap]
    C, R = group_size(cp_group), group_size(ring_group)
    _check_grouped(x, w_q, w_k, w_v, rotary_pos_emb, C, R)
    if ring_group is not None:
        problems = [why for bad, why in ((not causal, "causal=False"), (cu_seqlens is not None, "cu_seqlens"),
                                         (overlap != "none", f"overlap={given!r}")) if bad]
        if problems:
            raise ValueError(f"ring_group: ring attention here is causal over one sequence without pipelined stages; "
                             f"drop {', '.join(problems)} or ring_group")
        if (x.shape[0] * C) % 2:
            raise ValueError(f"ring_group: each a2a group holds two zigzag chunks of its {x.shape[0] * C} tokens, "
                             f"which must be even")
    elif ring_overlap:
        raise ValueError("ring_overlap=True overlaps the ring's P2P passes: it needs ring_group (or drop ring_overlap)")
    if w_o is not None and (w_o.shape != (x.shape[-1], w_q.shape[0] * w_q.shape[1] * w_q.shape[2])
                            or w_o.dtype != x.dtype):
        raise ValueError(f"w_o must be [D, G·g·d] = [{x.shape[-1]}, {w_q.shape[0] * w_q.shape[1] * w_q.shape[2]}] "
                         f"in {x.dtype}; got {tuple(w_o.shape)} {w_o.dtype}")
    for name, w in (("w_o", w_o), ("norm_w", norm_w)):
        if w is not None and w.device != x.device:
            raise ValueError(f"{name} is on {w.device} but x is on {x.device}; move one of them")
    if norm_w is not None and (norm_w.shape != (x.shape[-1],) or norm_w.dtype != x.dtype):
        raise ValueError(f"norm_w must be [D] = [{x.shape[-1]}] in {x.dtype}; got {tuple(norm_w.shape)} "
                         f"{norm_w.dtype}")
    _check_qk_extras(x, w_q, b_q, b_k, b_v, q_norm_w, k_norm_w, qk_norm_eps)
    G, g, d = w_q.shape[0], w_q.shape[1], w_q.shape[2]
    schedule = make_schedule(G * g, G, C, G * g if ulysses else heads_per_stage)
    docs = None if cu_seqlens is None else documents(cu_seqlens, x.shape[0] * C, x.shape[1], x.device)
    chosen = select_kernel(x.device, x.dtype, d, kernel,
                           call=stage_call(schedule, x.shape[1], x.shape[0] * C, causal, docs))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    rank = 0 if cp_group is None else dist.get_rank(cp_group)
    op = StageOp(schedule, cp_group, rank, chosen, causal, scale, save_heads=ulysses,
                 accumulate_fp32=grad_accum == "fp32", norm_eps=norm_eps, norm_tile_rows=norm_tile_rows,
                 qk_norm_eps=float(qk_norm_eps), docs=docs, overlap=overlap, ring=ring_group,
                 ring_overlap=bool(ring_overlap))
    if rotary_pos_emb is not None and rotary_pos_emb.shape[0] != x.shape[0]:  # all N rows: keep this rank's
        if ring_group is None:  # contiguous: a view
            rotary_pos_emb = rotary_pos_emb[rank * x.shape[0]:(rank + 1) * x.shape[0]]  # [N, ...] -> [s, ...]
        else:  # zigzag over the ring (layout.py)
            rotary_pos_emb = _zigzag_rows(rotary_pos_emb, rank, C, dist.get_rank(ring_group), R)  # [N, ...] -> [s, ...]
    rope = None if rotary_pos_emb is None else rope_cos_sin(rotary_pos_emb, x.dtype)  # [s, rot/2] each
    return op, rope


def upipe_attention_grouped(
    x, w_q, w_k, w_v, *, cp_group, heads_per_stage=None, rotary_pos_emb=None, causal=True, softmax_scale=None,
    kernel: str | None = None, grad_accum: str = "fp32", w_o=None, norm_w=None, norm_eps: float = 1e-5,
    norm_tile_rows: int = 32768, b_q=None, b_k=None, b_v=None, q_norm_w=None, k_norm_w=None,
    qk_norm_eps: float = 1e-6, cu_seqlens=None, overlap: bool | str = False, ring_group=None,
    ring_overlap: bool = False,
):
    """UPipe with weights grouped by KV head: w_q [G, g, d, D], w_k/w_v [G, d, D] -> [s, b, G·g·d].

    This is the layout of megatron-core's fused `linear_qkv.weight.view(G, g + 2, d, D)` sliced into q, k, v
    (views, no copy). grad_accum: 'fp32' (default) accumulates dx and dK/dV over stages in float32 for 16-bit
    inputs, each rounded once at the end (dx's GEMMs add into the float32 buffer without a 16-bit product; see
    upipe.py); 'input' in the input dtype (smaller, one rounding per stage). w_o [D, G·g·d]: the output projection,
    fused so that backward never builds the [s, b, G·g·d] gradient whole; the result is then [s, b, D] (this
    rank's partial sums under tensor parallelism). norm_w [D] (eps norm_eps): the input RMSNorm, fused so that
    RMSNorm(x) is never whole (x is then the norm's input; gradients flow to x and norm_w), regenerated
    norm_tile_rows rows at a time.

    b_q [G, g, d], b_k, b_v [G, d] (all three or none): the QKV projection biases (Qwen2/2.5), in the weights'
    grouped layout (`linear_qkv.bias.view(G, g + 2, d)` sliced [:, :g], [:, g], [:, g + 1]). q_norm_w, k_norm_w
    [d] (both or none, eps qk_norm_eps): QK-norm (Qwen3's q_norm / k_norm, megatron-core's qk_layernorm), an
    RMSNorm over the head dim of every q and k head after the projection (+ bias) and before RoPE, HF's formula.
    All of them are applied stage by stage to the stage's heads only; gradients flow to each of them.
    See `upipe_attention` for the others (cu_seqlens: packed documents, see the module docstring; overlap:
    pipelined stages).
    """
    op, rope = _prepare(x, w_q, w_k, w_v, cp_group, heads_per_stage, rotary_pos_emb, causal, softmax_scale, kernel,
                        grad_accum=grad_accum, w_o=w_o, norm_w=norm_w, norm_eps=norm_eps,
                        norm_tile_rows=norm_tile_rows, b_q=b_q, b_k=b_k, b_v=b_v, q_norm_w=q_norm_w,
                        k_norm_w=k_norm_w, qk_norm_eps=qk_norm_eps, cu_seqlens=cu_seqlens, overlap=overlap,
                        ring_group=ring_group, ring_overlap=ring_overlap)
    cos, sin = rope if rope is not None else (None, None)
    return UPipeFunction.apply(x, w_q, w_k, w_v, w_o, norm_w, b_q, b_k, b_v, q_norm_w, k_norm_w, cos, sin, op)


def ulysses_attention_grouped(
    x, w_q, w_k, w_v, *, cp_group, rotary_pos_emb=None, causal=True, softmax_scale=None, kernel: str | None = None,
    grad_accum: str = "fp32", w_o=None, norm_w=None, norm_eps: float = 1e-5, norm_tile_rows: int = 32768,
    b_q=None, b_k=None, b_v=None, q_norm_w=None, k_norm_w=None, qk_norm_eps: float = 1e-6, cu_seqlens=None,
    ring_group=None, ring_overlap: bool = False,
):
    """Plain Ulysses with grouped weights (see `upipe_attention_grouped`): one stage of all H heads whose q, k, v
    and out stay in head layout for backward, as DeepSpeed's DistributedAttention over flash attention keeps them.
    It shares UPipe's projection, bias, QK-norm, RoPE and all-to-all code, so the two differ only in what they keep
    alive (the kept q and k are normalised and rotated; QK-norm's backward recomputes their pre-norm projection)."""
    op, rope = _prepare(x, w_q, w_k, w_v, cp_group, None, rotary_pos_emb, causal, softmax_scale, kernel, ulysses=True,
                        grad_accum=grad_accum, w_o=w_o, norm_w=norm_w, norm_eps=norm_eps,
                        norm_tile_rows=norm_tile_rows, b_q=b_q, b_k=b_k, b_v=b_v, q_norm_w=q_norm_w,
                        k_norm_w=k_norm_w, qk_norm_eps=qk_norm_eps, cu_seqlens=cu_seqlens, ring_group=ring_group,
                        ring_overlap=ring_overlap)
    cos, sin = rope if rope is not None else (None, None)
    return UPipeFunction.apply(x, w_q, w_k, w_v, w_o, norm_w, b_q, b_k, b_v, q_norm_w, k_norm_w, cos, sin, op)


def _group_weights(x, w_q, w_k, w_v, num_heads: int, num_kv_heads: int):
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}; fix the head counts"
        )
    D = x.shape[-1]
    if w_q.dim() != 2 or w_q.shape[0] % num_heads or w_q.shape[1] != D:
        raise ValueError(f"w_q must be [num_heads*d, D] = [{num_heads}*d, {D}]; got {tuple(w_q.shape)}")
    d = w_q.shape[0] // num_heads
    if w_k.shape != (num_kv_heads * d, D) or w_v.shape != (num_kv_heads * d, D):
        raise ValueError(
            f"w_k and w_v must be [num_kv_heads*d, D] = [{num_kv_heads * d}, {D}] (d={d} from w_q); got "
            f"{tuple(w_k.shape)} and {tuple(w_v.shape)}"
        )
    g = num_heads // num_kv_heads
    return w_q.reshape(num_kv_heads, g, d, D), w_k.reshape(num_kv_heads, d, D), w_v.reshape(num_kv_heads, d, D)


def _group_biases(w_q, b_q, b_k, b_v, num_heads: int, num_kv_heads: int):
    """Natural-order biases b_q [H·d], b_k, b_v [G·d] -> grouped [G, g, d], [G, d], [G, d] (views), like
    `_group_weights`; None stays None (`_prepare` checks that all three or none are given)."""
    d = w_q.shape[0] // num_heads
    g = num_heads // num_kv_heads
    out = []
    for name, t, n, shape in (("b_q", b_q, num_heads, (num_kv_heads, g, d)), ("b_k", b_k, num_kv_heads,
                              (num_kv_heads, d)), ("b_v", b_v, num_kv_heads, (num_kv_heads, d))):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (n * d,)):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be [{'num_heads' if n == num_heads else 'num_kv_heads'}*d] = "
                             f"[{n * d}] (d={d} from w_q); got {got}")
        out.append(None if t is None else t.reshape(shape))  # [n·d] -> grouped
    return out


def upipe_attention(
    x, w_q, w_k, w_v, *, num_heads, num_kv_heads, cp_group, heads_per_stage=None, rotary_pos_emb=None, causal=True,
    softmax_scale=None, kernel: str | None = None, b_q=None, b_k=None, b_v=None, q_norm_w=None, k_norm_w=None,
    qk_norm_eps: float = 1e-6, cu_seqlens=None, overlap: bool | str = False, ring_group=None,
    ring_overlap: bool = False,
):
    """UPipe attention of this rank's tokens.

    x [s, b, D]: this rank's shard (rank r of cp_group holds global tokens [r·s, (r+1)·s)).
    w_q [H·d, D], w_k, w_v [G·d, D]: natural head order (head i = rows i·d:(i+1)·d); query head i uses KV head
    i // (H / G). heads_per_stage: U summed over the C ranks (None: the smallest legal value; U = H is Ulysses).
    rotary_pos_emb [N, 1, 1, rot_dim]: angles of all N global positions (megatron-core RotaryEmbedding format),
    of which each rank applies its own, or [s, 1, 1, rot_dim]: the angles of this rank's positions only.
    softmax_scale defaults to 1/sqrt(d). kernel: a name from `kernels.KERNELS` or None for automatic choice.
    b_q [H·d], b_k, b_v [G·d] (all three or none): QKV projection biases, natural head order. q_norm_w, k_norm_w
    [d] (both or none): QK-norm weights, eps qk_norm_eps (see `upipe_attention_grouped`).
    cu_seqlens: int32 [n_docs + 1] cumulative document lengths of the global packed sequence (b must be 1):
    attention inside each document only (module docstring).
    overlap: pipelined stages, the same results bit for bit (upipe_pipelined.py). True or 'stages': while one
    stage's kernel runs, the next stage's projections have gone out in asynchronous all-to-alls and the previous
    stage's result comes back (forward and backward); at most one more stage of all-to-all buffers (and a KV
    round's K/V at a round boundary) alive. 'outputs': only each stage's result (output, dq) in flight, while the
    next stage's projections run; one stage's result buffers alive more. False: stage after stage.
    ring_group: hybrid UPipe x ring (cp_group is then the all-to-all group): rank (a, r) holds the tokens
    `layout.local_positions(N, a, C, r, R)` (N = s·C·R: zigzag chunks over the R ring ranks, contiguous inside the
    a2a group) and each stage's attention runs as causal ring attention over ring_group (ring.py).
    ring_overlap: the ring's P2P passes run while its blocks compute (same results bit for bit; whole receive
    buffers instead of pieces: ring.py).
    Returns [s, b, H·d]: the attention output of this rank's tokens, heads in natural order (input of W_O).
    Differentiable with respect to x, w_q, w_k, w_v and the biases and QK-norm weights given.
    """
    gq, gk, gv = _group_weights(x, w_q, w_k, w_v, num_heads, num_kv_heads)
    bq, bk, bv = _group_biases(w_q, b_q, b_k, b_v, num_heads, num_kv_heads)
    return upipe_attention_grouped(
        x, gq, gk, gv, cp_group=cp_group, heads_per_stage=heads_per_stage, rotary_pos_emb=rotary_pos_emb,
        causal=causal, softmax_scale=softmax_scale, kernel=kernel, b_q=bq, b_k=bk, b_v=bv, q_norm_w=q_norm_w,
        k_norm_w=k_norm_w, qk_norm_eps=qk_norm_eps, cu_seqlens=cu_seqlens, overlap=overlap, ring_group=ring_group,
        ring_overlap=ring_overlap,
    )


def ulysses_attention(
    x, w_q, w_k, w_v, *, num_heads, num_kv_heads, cp_group, rotary_pos_emb=None, causal=True, softmax_scale=None,
    kernel: str | None = None, b_q=None, b_k=None, b_v=None, q_norm_w=None, k_norm_w=None, qk_norm_eps: float = 1e-6,
    cu_seqlens=None, ring_group=None, ring_overlap: bool = False,
):
    """Plain Ulysses baseline; same arguments and result as `upipe_attention` without heads_per_stage."""
    gq, gk, gv = _group_weights(x, w_q, w_k, w_v, num_heads, num_kv_heads)
    bq, bk, bv = _group_biases(w_q, b_q, b_k, b_v, num_heads, num_kv_heads)
    return ulysses_attention_grouped(
        x, gq, gk, gv, cp_group=cp_group, rotary_pos_emb=rotary_pos_emb, causal=causal, softmax_scale=softmax_scale,
        kernel=kernel, b_q=bq, b_k=bk, b_v=bv, q_norm_w=q_norm_w, k_norm_w=k_norm_w, qk_norm_eps=qk_norm_eps,
        cu_seqlens=cu_seqlens, ring_group=ring_group, ring_overlap=ring_overlap,
    )
