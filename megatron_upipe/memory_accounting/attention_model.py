"""Closed-form peak memory of one UPipe / Ulysses attention op (forward + backward), per rank, in bytes.

Pure Python: the peak is the maximum over a short list of *phases* (moments of the stage loop in
attention/upipe.py), each a sum of named buffers. It predicts what `PeakMemoryTracker` measures around
`upipe_attention` / `ulysses_attention` + `autograd.grad` when the inputs (x, weights, RoPE angles, dout) exist
beforehand. Kernel-internal scratch is invisible to the tracker; pass `kernel_workspace` to model it on GPU.

Legend (bytes): e element size, a accumulator size (4 for 16-bit, else e), l lse element size; s = N / C local
tokens, b batch, D model dim, H / G query / KV heads, d head dim, U heads per stage, m = U / C, n KV heads resident
per rank in a round, w KV heads one stage attends to per rank.
  Xq  = s·b·U·d·e   one stage's q (or o, do, dq, or an all-to-all buffer of them), either layout
  Xkv = s·b·C·n·d·e one round's resident K (or V) in head layout, Akv its float32 accumulator
  Xw  = N·b·w·d·e   the kernel's dK (or dV) for one stage
  Wu  = U·d·D·e     the gathered W_Q rows of a stage;  Wkv = C·n·d·D·e the W_K (or W_V) rows of a round
  O   = s·b·H·d·e   the output buffer (saved; W_O needs it anyway);  L = b·(H/C)·N·l all stages' lse
  DX  = s·b·D·a, DW = (H + 2G)·d·D·e the gradients returned;  R = RoPE cos + sin tables of the s local positions
With C = 1 the all-to-alls are no-ops and their receive buffers vanish (rc = 0).
A kernel without native GQA (`native_gqa=False`, e.g. sdpa_efficient) gets a call's K/V expanded to its m query
heads (2 Xq, alive during the kernel) and returns dK/dV expanded too (2 Xq instead of 2 Xw) when m > w.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_upipe.attention.schedule import make_schedule


@dataclass(frozen=True)
class AttentionShape:
    seq_len: int  # N, global
    batch: int
    hidden: int  # D
    num_heads: int  # H (local to a TP rank)
    num_kv_heads: int  # G
    head_dim: int  # d
    cp: int  # C
    dtype_bytes: int = 2
    rotary_dim: int | None = None  # None: the whole head dim; 0: no RoPE

    def __post_init__(self) -> None:
        if self.seq_len % self.cp:
            raise ValueError(f"seq_len={self.seq_len} is not divisible by cp={self.cp}")


@dataclass(frozen=True)
class MemoryEstimate:
    peak_bytes: int
    phase: str  # where the peak is
    breakdown: dict[str, int] = field(default_factory=dict)  # named buffers alive at the peak


def _phase(name: str, **terms: int) -> MemoryEstimate:
    terms = {k: v for k, v in terms.items() if v}
    return MemoryEstimate(sum(terms.values()), name, terms)


def attention_memory(shape: AttentionShape, heads_per_stage: int | None = None, ulysses: bool = False,
                     kernel_workspace: int = 0, native_gqa: bool = True) -> MemoryEstimate:
    """Peak of forward + backward for UPipe (U = heads_per_stage, None = smallest legal) or plain Ulysses, with a
    kernel that takes GQA natively or (native_gqa=False) gets K/V expanded to the query heads."""
    H, G, C, d, D, b, N = (shape.num_heads, shape.num_kv_heads, shape.cp, shape.head_dim, shape.hidden,
                           shape.batch, shape.seq_len)
    sched = make_schedule(H, G, C, H if ulysses else heads_per_stage)
    e = shape.dtype_bytes
    a = 4 if e < 4 else e
    lse = 8 if e == 8 else 4
    rot = d if shape.rotary_dim is None else shape.rotary_dim
    s = N // C
    sb = s * b
    U, m, n, S = sched.heads_per_stage, sched.q_per_rank, sched.kv_per_rank, sched.num_stages
    w = sched.stages[0].kv_slots[1] - sched.stages[0].kv_slots[0]
    spr = S // len(sched.round_kv_heads)  # stages per KV round
    rc = 1 if C > 1 else 0
    Xq, Xkv, Xw = sb * U * d * e, sb * C * n * d * e, N * b * w * d * e
    kv_exp = 2 * Xq if not native_gqa and m > w else 0  # K/V expanded to the call's m query heads
    Akv = Xkv // e * a
    Wu, Wkv = U * d * D * e, C * n * d * D * e
    O, Ls, R = sb * H * d * e, b * m * N * lse, (2 * s * (rot // 2) * e if rot else 0)
    L = Ls * S
    DX, DW = sb * D * a, (H + 2 * G) * d * D * e
    ws = kernel_workspace
    lse_last = Ls * (S - 1)
    lse_round = Ls * (S - spr)

    phases = [
        # forward (last round / last stage: the saved lse list is longest there)
        _phase("fwd: project V of the last round", out=O, rope=R, lse=lse_round, k=Xkv, w_kv=Wkv, v_buffers=2 * Xkv),
        _phase("fwd: project q of the last stage", out=O, rope=R, lse=lse_last, kv=2 * Xkv, w_q_rows=Wu, q_buffers=2 * Xq),
        _phase("fwd: attention of the last stage", out=O, rope=R, lse=L, kv=2 * Xkv, q=Xq, o=Xq, workspace=ws,
               kv_expanded=kv_exp),
        _phase("fwd: output all-to-all of the last stage", out=O, rope=R, lse=L, kv=2 * Xkv, o=Xq, o_recv=rc * Xq,
               saved_q=Xq if ulysses else 0),
    ]
    base = dict(out=O, rope=R, lse=L, dx=DX, dw=DW)
    acc_before_q = 2 * Akv if spr > 1 else 0  # a later stage of a round finds the accumulators allocated
    if ulysses:  # q, k, v, o were kept by the forward; nothing is recomputed
        phases += [
            _phase("bwd: dK/dV accumulators", **base, w_q_rows=Wu, kv=2 * Xkv, q=Xq, o=Xq, dkv_acc=2 * Akv),
        ]
    else:
        phases += [
            _phase("bwd: recompute K", **base, w_q_rows=Wu, w_kv=Wkv, k_buffers=2 * Xkv),
            _phase("bwd: recompute V", **base, w_q_rows=Wu, k=Xkv, w_kv=Wkv, v_buffers=2 * Xkv),
            _phase("bwd: recompute q", **base, w_q_rows=Wu, kv=2 * Xkv, dkv_acc=acc_before_q, q_buffers=2 * Xq),
            _phase("bwd: gather out", **base, w_q_rows=Wu, kv=2 * Xkv, dkv_acc=acc_before_q, q=Xq, o_send=Xq,
                   o_recv=rc * Xq),
            _phase("bwd: dK/dV accumulators", **base, w_q_rows=Wu, kv=2 * Xkv, q=Xq, o=Xq, dkv_acc=2 * Akv),
        ]
    stage = dict(**base, w_q_rows=Wu, kv=2 * Xkv, dkv_acc=2 * Akv)
    # 16-bit: dx's float32 accumulation upcasts its GEMM operands on CPU (W rows [r, D] and min(s·b, D) gradient
    # rows, float32; upipe.accumulate_mm). CUDA accumulates into the float32 buffer directly: 0 there.
    def acc_upcast(r: int) -> int:
        return 4 * r * (D + min(sb, D)) if e < 4 else 0
    phases += [
        _phase("bwd: gather dout", **stage, q=Xq, o=Xq, do_send=Xq, do_recv=rc * Xq),
        _phase("bwd: attention backward", **stage, q=Xq, o=Xq, do=Xq, dq=Xq, dkv=0 if kv_exp else 2 * Xw,
               dkv_expanded=kv_exp, kv_expanded=kv_exp, workspace=ws),
        _phase("bwd: dq all-to-all and inverse RoPE", **stage, dq=Xq, dq_recv=rc * Xq, dq_rows=Xq),
        _phase("bwd: dx and dW_Q products", **stage, dq_rows=Xq, partial=max(acc_upcast(U * d), Wu)),
    ]
    to_dtype = Xkv if e < 4 else 0
    k_rows, v_rows = Xkv, Xkv if (rc or e < 4) else 0
    end = dict(out=O, rope=R, lse=L, dx=DX, dw=DW, dkv_acc=2 * Akv)
    phases += [
        _phase("bwd: dK all-to-all and inverse RoPE", **end, dk_cast=to_dtype, dk_recv=rc * Xkv, dk_rows=Xkv),
        _phase("bwd: dK products", **end, dk_rows=k_rows, w_kv=Wkv, partial=max(acc_upcast(C * n * d), Wkv)),
        _phase("bwd: dV all-to-all", **end, dv_cast=to_dtype, dv_recv=rc * Xkv, dv_rows=rc * Xkv),
        _phase("bwd: dV products", **end, dv_rows=v_rows, w_kv=Wkv, partial=max(acc_upcast(C * n * d), Wkv)),
        _phase("bwd: cast dx", out=O, rope=R, lse=L, dx=DX, dw=DW, dx_cast=sb * D * e if e < 4 else 0),
    ]
    return max(phases, key=lambda p: p.peak_bytes)


# Buffers whose size is one stage's heads (Xq or Wu): the part UPipe shrinks by U / H.
CHUNKED_TERMS = frozenset({
    "q", "o", "do", "dq", "q_buffers", "o_send", "o_recv", "do_send", "do_recv", "dq_recv", "dq_rows", "w_q_rows",
    "kv_expanded", "dkv_expanded",
})


def chunked_bytes(est: MemoryEstimate) -> int:
    """Bytes of the head-proportional (per-stage) buffers alive at the peak."""
    return sum(v for k, v in est.breakdown.items() if k in CHUNKED_TERMS)
