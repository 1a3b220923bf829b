"""UPipe vs Ulysses attention benchmark: check numerics first, then measure peak memory and time side by side.

One call of `run_rank` per CP rank (gloo on CPU, NCCL on GPU). For every strategy (Ulysses, then UPipe at each
requested U) it
  1. checks out / dx / dW against the float64 full-sequence reference at a small check length;
  2. tracks the forward + backward peak of live tensors on rank 0 (and `torch.cuda.max_memory_allocated` on GPU)
     and evaluates the closed-form model for the same shape;
  3. times forward + backward, interleaving the strategies round-robin in every repetition so machine noise
     hits them alike, and reports medians and ratios against Ulysses from that one run.
With `doc_len` (CLI --docs) every strategy also runs on the same N tokens packed as documents of about doc_len
tokens (lengths uniform in [doc_len/2, 3·doc_len/2], seeded; cu_seqlens), checked against the reference with the
block-diagonal mask at the check length (documents of min(doc_len, check length / 8) tokens), measured and timed in
the same round-robin, and reported next to the one causal sequence (time and peak ratios "docs / 1 seq").
On gloo, tracked peaks can exceed the model by up to two all-to-all buffers now and then: gloo's worker thread
drops its references to a collective's tensors asynchronously, so a buffer may outlive its last Python use for a
moment (a real effect, not a tracker error; the model is validated on the fake process group in the tests).
With `overlap` (CLI --overlap) every UPipe U also runs with pipelined stages ("upipe+ov": the next stage's
all-to-alls in flight during this stage's kernel), checked, measured and timed in the same round-robin (the
closed-form model does not cover it: "-"). Every strategy reports the bytes this rank sends to other ranks in the
all-to-alls of one forward and of one backward (a step under full recompute sends the forward's twice).
With `ring` = R > 1 (CLI --ring) the C ranks run hybrid a2a x ring: all-to-all groups of A = C/R consecutive ranks
and a ring of R of them (each stage's attention is causal ring attention, attention/ring.py), tokens placed by
attention.layout.cp_rank_positions; U is counted over A, the numerics check compares each rank's positions, the
P2P bytes of the ring's passes are reported beside the all-to-all bytes, and the closed-form model does not cover
it. `ring_overlap` (CLI --ring-overlap) also runs every strategy with the ring's passes overlapped ("+rov").
Legend: N global tokens, C ranks, s = N / C, b batch, D model dim, H / G heads, d head dim, U heads per stage.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from megatron_upipe.attention import legal_heads_per_stage, make_schedule, ulysses_attention, upipe_attention
from megatron_upipe.attention.layout import cp_rank_positions
from megatron_upipe.attention.reference import reference_attention, rope_angles
from megatron_upipe.memory_accounting.attention_model import AttentionShape, attention_memory
from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64, "float16": torch.float16}
# relative-norm tolerance of the numerics check against the float64 reference
CHECK_TOL = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


@dataclass(frozen=True)
class BenchConfig:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 64
    hidden: int | None = None  # None: num_heads * head_dim
    seq_len: int = 2048
    batch: int = 1
    heads_per_stage: tuple[int, ...] = ()  # () = every legal U
    dtype: str = "float32"
    check_seq_len: int = 256
    warmup: int = 1
    iters: int = 3
    doc_len: int | None = None  # also run packed documents of about this many tokens (None: one sequence only)
    overlap: bool = False  # also run every UPipe U with pipelined stages ("upipe+ov")
    ring: int = 1  # R: hybrid a2a x ring over the C ranks (all-to-all groups of C/R); 1 = one all-to-all group
    ring_overlap: bool = False  # also run every strategy with the ring's P2P passes overlapped ("+rov")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {sorted(DTYPES)}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("iters must be >= 1 and warmup >= 0")
        if self.doc_len is not None and not 2 <= self.doc_len <= self.seq_len // 2:
            raise ValueError(f"doc_len={self.doc_len} must be between 2 and seq_len / 2 = {self.seq_len // 2} "
                             f"(documents of about doc_len tokens, at least two of them)")
        if self.ring > 1 and (self.doc_len is not None or self.overlap):
            raise ValueError(f"ring={self.ring}: ring attention runs one causal sequence with serial stages; drop the "
                             f"packed documents / pipelined stages")
        if self.ring_overlap and self.ring == 1:
            raise ValueError("ring_overlap overlaps the passes of a ring: give ring > 1")

    @property
    def model_dim(self) -> int:
        return self.hidden or self.num_heads * self.head_dim


@dataclass
class StrategyResult:
    strategy: str  # "ulysses", "upipe", "upipe+ov" (pipelined stages); "+rov": the ring's passes overlapped
    heads_per_stage: int
    stages: int
    max_rel_err: float
    tracked_peak_bytes: int
    model_peak_bytes: int | None  # closed-form model (None: not modelled, upipe+ov)
    cuda_peak_bytes: int | None
    times_s: list[float] = field(default_factory=list)
    documents: int = 1  # 1: one causal sequence; more: packed documents (cu_seqlens)
    fwd_sent_bytes: int = 0  # bytes this rank sends to the other ranks in one forward's all-to-alls
    bwd_sent_bytes: int = 0  # ... in one backward's
    fwd_p2p_bytes: int = 0  # bytes this rank sends in one forward's P2P passes (hybrid a2a x ring)
    bwd_p2p_bytes: int = 0  # ... in one backward's

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _inputs(cfg: BenchConfig, N: int, seed: int, device, dtype):
    gen = torch.Generator().manual_seed(seed)
    D, H, G, d = cfg.model_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = torch.randn(N, cfg.batch, D, generator=gen)
    ws = [torch.randn(n * d, D, generator=gen) / D ** 0.5 for n in (H, G, G)]
    dout = torch.randn(N, cfg.batch, H * d, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (x, *ws, dout)]


def documents(N: int, doc_len: int, seed: int = 0) -> torch.Tensor:
    """cu_seqlens (int32, CPU) of N tokens in documents of uniformly random length in [doc_len/2, 3·doc_len/2]
    (at least 1), the last one cut to fit."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = max(1, doc_len // 2), max(1, doc_len // 2) + doc_len
    lengths: list[int] = []
    while sum(lengths) < N:
        lengths.append(min(int(torch.randint(lo, hi + 1, (1,), generator=gen)), N - sum(lengths)))
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


@dataclass(frozen=True)
class Groups:
    """The op's groups on this rank: the all-to-all group (None on one rank), the ring (None without one), and
    every rank's group for the weight-gradient sums (None on one rank)."""

    a2a: dist.ProcessGroup | None
    ring: dist.ProcessGroup | None
    world: dist.ProcessGroup | None


def make_groups(cfg: BenchConfig, group, C: int) -> Groups:
    """One all-to-all group of the C ranks, or (ring > 1) groups of A = C/R consecutive ranks and rings of R of
    them (CP rank = ring rank·A + a2a rank, as attention.layout.cp_rank_positions); every rank creates every group."""
    if cfg.ring == 1:
        return Groups(group, None, group)
    A, me = C // cfg.ring, dist.get_rank(group)
    a2a = [dist.new_group([r * A + a for a in range(A)]) for r in range(cfg.ring)][me // A]
    ring = [dist.new_group([r * A + a for r in range(cfg.ring)]) for a in range(A)][me % A]
    return Groups(a2a, ring, group)


def _call(strategy, U, x, ws, cfg, groups: Groups, freqs, cu=None):
    kw = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, cp_group=groups.a2a, rotary_pos_emb=freqs,
              cu_seqlens=cu)
    if groups.ring is not None:
        kw.update(ring_group=groups.ring, ring_overlap=strategy.endswith("+rov"))
    if strategy.startswith("ulysses"):
        return ulysses_attention(x, *ws, **kw)
    return upipe_attention(x, *ws, heads_per_stage=U, overlap=strategy == "upipe+ov", **kw)


@contextmanager
def count_sent_bytes(counter: dict, key: str):
    """Adds to counter[key] the bytes this rank sends to other ranks in every all_to_all_single inside the block
    (the send buffer's bytes times (C - 1) / C: equal chunks, one of them to itself), and to counter[key + "_p2p"]
    those its P2P sends (batch_isend_irecv: the ring's passes) carry."""
    real = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        C = dist.get_world_size(group)
        counter[key] = counter.get(key, 0) + input.numel() * input.element_size() * (C - 1) // C
        return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    def counted_p2p(ops):  # the ring's passes: what this rank's isends carry
        counter[key + "_p2p"] = counter.get(key + "_p2p", 0) + sum(
            op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real_p2p(ops)

    real_p2p = dist.batch_isend_irecv
    dist.all_to_all_single, dist.batch_isend_irecv = counted, counted_p2p
    try:
        yield counter
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = real, real_p2p


def _fwd_bwd(strategy, U, x, ws, dout, cfg, groups: Groups, freqs, cu=None):
    out = _call(strategy, U, x, ws, cfg, groups, freqs, cu)
    return out, torch.autograd.grad(out, [x, *ws], dout)


def _check(strategy, U, cfg, groups: Groups, rank, C, device, dtype, with_docs: bool = False) -> float:
    N = cfg.check_seq_len
    cu = documents(N, max(2, min(cfg.doc_len, N // 8)), seed=1) if with_docs else None
    x, wq, wk, wv, dout = _inputs(cfg, N, 1, device, dtype)
    freqs = rope_angles(N, cfg.head_dim).to(device)
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (x, wq, wk, wv)]
    ref = reference_attention(*ref_in, cfg.num_heads, cfg.num_kv_heads, freqs.cpu(), cu_seqlens=cu)
    ref_g = torch.autograd.grad(ref, ref_in, dout.double().cpu())
    sl = cp_rank_positions(N, rank, C, cfg.ring)  # [s] this rank's positions (contiguous without a ring)
    xs = x[sl.to(device)].clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in (wq, wk, wv)]
    out, grads = _fwd_bwd(strategy, U, xs, ws, dout[sl.to(device)], cfg, groups, freqs, cu)
    dws = [g.clone() for g in grads[1:]]
    if groups.world is not None:
        for g in dws:
            dist.all_reduce(g, group=groups.world)
    errs = [_rel(out.cpu(), ref[sl]), _rel(grads[0].cpu(), ref_g[0][sl])]
    errs += [_rel(g.cpu(), r) for g, r in zip(dws, ref_g[1:])]
    return max(errs)


def strategies(cfg: BenchConfig, C: int) -> list[tuple[str, int]]:
    A = C // cfg.ring  # the all-to-all group, over which U is counted
    us = list(cfg.heads_per_stage) or legal_heads_per_stage(cfg.num_heads, cfg.num_kv_heads, A)
    for u in us:
        make_schedule(cfg.num_heads, cfg.num_kv_heads, A, u)  # raises a clear error for an illegal U
    variants = ("", "+ov") if cfg.overlap else ("", "+rov") if cfg.ring_overlap else ("",)
    return [("ulysses" + v, cfg.num_heads) for v in variants if v != "+ov"] + [
        ("upipe" + v, u) for u in us for v in variants]


def check(cfg: BenchConfig, C: int) -> list[tuple[str, int]]:
    """The (strategy, U) pairs to run on C ranks; a ValueError naming the value for a shape that cannot run (called
    by the CLI before it spawns any rank, and by every rank)."""
    if C % cfg.ring:
        raise ValueError(f"ring={cfg.ring} must divide the C={C} ranks (all-to-all groups of C/ring)")
    parts = C if cfg.ring == 1 else 2 * C  # ring: two zigzag chunks per ring rank, split over its group
    if cfg.seq_len % parts or cfg.check_seq_len % parts:
        raise ValueError(f"seq_len={cfg.seq_len} and check_seq_len={cfg.check_seq_len} must be multiples of "
                         f"{'C' if cfg.ring == 1 else '2·C'}={parts}")
    if cfg.doc_len is not None and cfg.batch != 1:
        raise ValueError(f"packed documents (doc_len={cfg.doc_len}) need batch 1; got batch={cfg.batch}")
    return strategies(cfg, C)


def run_rank(cfg: BenchConfig, group, rank: int, C: int, device: torch.device) -> list[StrategyResult]:
    dtype = DTYPES[cfg.dtype]
    plan = check(cfg, C)
    groups = make_groups(cfg, group, C) if group is not None else Groups(None, None, None)
    A = C // cfg.ring
    shape = AttentionShape(cfg.seq_len, cfg.batch, cfg.model_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           C, torch.tensor([], dtype=dtype).element_size())
    cu = documents(cfg.seq_len, cfg.doc_len) if cfg.doc_len else None
    results, cus = [], []
    for strategy, U in plan:
        for layout in (None, cu) if cu is not None else (None,):
            err = _check(strategy, U, cfg, groups, rank, C, device, dtype, with_docs=layout is not None)
            if not err <= CHECK_TOL[cfg.dtype]:
                raise AssertionError(f"{strategy} U={U}{' with documents' if layout is not None else ''}: relative "
                                     f"error {err:.3e} against the float64 reference exceeds "
                                     f"{CHECK_TOL[cfg.dtype]:.0e}; refusing to time a wrong kernel")
            model = None if strategy == "upipe+ov" or cfg.ring > 1 else \
                attention_memory(shape, U, ulysses=strategy == "ulysses").peak_bytes  # one sequence's (no documents)
            sched = make_schedule(cfg.num_heads, cfg.num_kv_heads, A, U)
            results.append(StrategyResult(strategy, U, sched.num_stages, err, 0, model, None,
                                          documents=1 if layout is None else len(layout) - 1))
            cus.append(layout)

    s = cfg.seq_len // C
    x, wq, wk, wv, dout = _inputs(cfg, s, 2 + rank, device, dtype)
    x.requires_grad_()
    ws = [w.requires_grad_() for w in (wq, wk, wv)]
    freqs = rope_angles(cfg.seq_len, cfg.head_dim).to(device)
    for res, layout in zip(results, cus):  # memory, one strategy at a time
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        sent: dict[str, int] = {}
        with PeakMemoryTracker() as mem:
            with count_sent_bytes(sent, "fwd"):
                out = _call(res.strategy, res.heads_per_stage, x, ws, cfg, groups, freqs, layout)
            with count_sent_bytes(sent, "bwd"):
                grads = torch.autograd.grad(out, [x, *ws], dout)
            del out, grads
        res.tracked_peak_bytes = mem.peak_bytes
        res.fwd_sent_bytes, res.bwd_sent_bytes = sent.get("fwd", 0), sent.get("bwd", 0)
        res.fwd_p2p_bytes, res.bwd_p2p_bytes = sent.get("fwd_p2p", 0), sent.get("bwd_p2p", 0)
        if device.type == "cuda":
            torch.cuda.synchronize()
            res.cuda_peak_bytes = torch.cuda.max_memory_allocated() - base
    for it in range(cfg.warmup + cfg.iters):  # time, round-robin over strategies
        for res, layout in zip(results, cus):
            if group is not None:
                dist.barrier(group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out, grads = _fwd_bwd(res.strategy, res.heads_per_stage, x, ws, dout, cfg, groups, freqs, layout)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            del out, grads
            if it >= cfg.warmup:
                res.times_s.append(elapsed)
    return results


def report(cfg: BenchConfig, C: int, device: str, results: list[StrategyResult]) -> tuple[str, dict]:
    """A table and its JSON. Ratios "/uly" are against Ulysses on the same layout (one sequence, or the same
    documents); with documents, "docs/1seq" compares each run with the same strategy on one causal sequence."""
    uly = {r.documents: r for r in results if r.strategy == "ulysses"}
    one = {(r.strategy, r.heads_per_stage): r for r in results if r.documents == 1}
    docs, ring = cfg.doc_len is not None, cfg.ring > 1
    lines = [
        f"attention benchmark: H={cfg.num_heads} H_kv={cfg.num_kv_heads} d={cfg.head_dim} D={cfg.model_dim} "
        f"N={cfg.seq_len} b={cfg.batch} C={C} {cfg.dtype} on {device}; numerics checked at N={cfg.check_seq_len}"
        + (f"; packed documents of about {cfg.doc_len} tokens vs one causal sequence" if docs else "")
        + (f"; hybrid: all-to-all groups of {C // cfg.ring} x a ring of {cfg.ring}" if ring else ""),
        f"{'strategy':>11} {'U':>4} {'stages':>6} " + (f"{'docs':>6} " if docs else "")
        + f"{'rel err':>9} {'peak MiB':>9} {'model MiB':>9} {'peak/uly':>8} {'ms (median)':>11} {'time/uly':>8}"
        + f" {'sent fwd MiB':>12} {'sent bwd MiB':>12}"
        + (f" {'p2p fwd MiB':>11} {'p2p bwd MiB':>11}" if ring else "")
        + (f" {'peak docs/1seq':>14} {'time docs/1seq':>14}" if docs else ""),
    ]
    rows = []
    for r in results:
        base, single = uly[r.documents], one[(r.strategy, r.heads_per_stage)]
        row = asdict(r) | {"median_s": r.median_s,
                           "peak_ratio_vs_ulysses": r.tracked_peak_bytes / base.tracked_peak_bytes,
                           "time_ratio_vs_ulysses": r.median_s / base.median_s}
        line = (f"{r.strategy:>11} {r.heads_per_stage:>4} {r.stages:>6} " + (f"{r.documents:>6} " if docs else "")
                + f"{r.max_rel_err:>9.2e} {r.tracked_peak_bytes / 2**20:>9.2f} "
                + (f"{r.model_peak_bytes / 2**20:>9.2f} " if r.model_peak_bytes is not None else f"{'-':>9} ")
                + f"{row['peak_ratio_vs_ulysses']:>8.3f} {r.median_s * 1e3:>11.1f} {row['time_ratio_vs_ulysses']:>8.3f}"
                f" {r.fwd_sent_bytes / 2**20:>12.2f} {r.bwd_sent_bytes / 2**20:>12.2f}")
        if ring:
            line += f" {r.fwd_p2p_bytes / 2**20:>11.2f} {r.bwd_p2p_bytes / 2**20:>11.2f}"
        if r.documents > 1:
            row |= {"peak_ratio_vs_one_sequence": r.tracked_peak_bytes / single.tracked_peak_bytes,
                    "time_ratio_vs_one_sequence": r.median_s / single.median_s}
            line += f" {row['peak_ratio_vs_one_sequence']:>14.3f} {row['time_ratio_vs_one_sequence']:>14.3f}"
        lines.append(line)
        rows.append(row)
    data = {"config": asdict(cfg) | {"cp": C, "device": device}, "results": rows}
    return "\n".join(lines), data
