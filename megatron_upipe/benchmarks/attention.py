"""UPipe vs Ulysses attention benchmark: check numerics first, then measure peak memory and time side by side.

One call of `run_rank` per CP rank (gloo on CPU, NCCL on GPU). For every strategy (Ulysses, then UPipe at each
requested U) it
  1. checks out / dx / dW against the float64 full-sequence reference at a small check length;
  2. tracks the forward + backward peak of live tensors on rank 0 (and `torch.cuda.max_memory_allocated` on GPU)
     and evaluates the closed-form model for the same shape;
  3. times forward + backward, interleaving the strategies round-robin in every repetition so machine noise
     hits them alike, and reports medians and ratios against Ulysses from that one run.
On gloo, tracked peaks can exceed the model by up to two all-to-all buffers now and then: gloo's worker thread
drops its references to a collective's tensors asynchronously, so a buffer may outlive its last Python use for a
moment (a real effect, not a tracker error; the model is validated on the fake process group in the tests).
Legend: N global tokens, C ranks, s = N / C, b batch, D model dim, H / G heads, d head dim, U heads per stage.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from megatron_upipe.attention import legal_heads_per_stage, make_schedule, ulysses_attention, upipe_attention
from megatron_upipe.attention.reference import reference_attention, rope_angles
from megatron_upipe.memory.attention_model import AttentionShape, attention_memory
from megatron_upipe.memory.tracker import PeakMemoryTracker

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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {sorted(DTYPES)}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("iters must be >= 1 and warmup >= 0")

    @property
    def model_dim(self) -> int:
        return self.hidden or self.num_heads * self.head_dim


@dataclass
class StrategyResult:
    strategy: str  # "ulysses" or "upipe"
    heads_per_stage: int
    stages: int
    max_rel_err: float
    tracked_peak_bytes: int
    model_peak_bytes: int
    cuda_peak_bytes: int | None
    times_s: list[float] = field(default_factory=list)

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


def _call(strategy, U, x, ws, cfg, group, freqs):
    kw = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, cp_group=group, rotary_pos_emb=freqs)
    if strategy == "ulysses":
        return ulysses_attention(x, *ws, **kw)
    return upipe_attention(x, *ws, heads_per_stage=U, **kw)


def _fwd_bwd(strategy, U, x, ws, dout, cfg, group, freqs):
    out = _call(strategy, U, x, ws, cfg, group, freqs)
    return out, torch.autograd.grad(out, [x, *ws], dout)


def _check(strategy, U, cfg, group, rank, C, device, dtype) -> float:
    N = cfg.check_seq_len
    s = N // C
    x, wq, wk, wv, dout = _inputs(cfg, N, 1, device, dtype)
    freqs = rope_angles(N, cfg.head_dim).to(device)
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (x, wq, wk, wv)]
    ref = reference_attention(*ref_in, cfg.num_heads, cfg.num_kv_heads, freqs.cpu())
    ref_g = torch.autograd.grad(ref, ref_in, dout.double().cpu())
    sl = slice(rank * s, (rank + 1) * s)
    xs = x[sl].clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in (wq, wk, wv)]
    out, grads = _fwd_bwd(strategy, U, xs, ws, dout[sl], cfg, group, freqs)
    dws = [g.clone() for g in grads[1:]]
    if group is not None:
        for g in dws:
            dist.all_reduce(g, group=group)
    errs = [_rel(out.cpu(), ref[sl]), _rel(grads[0].cpu(), ref_g[0][sl])]
    errs += [_rel(g.cpu(), r) for g, r in zip(dws, ref_g[1:])]
    return max(errs)


def strategies(cfg: BenchConfig, C: int) -> list[tuple[str, int]]:
    us = list(cfg.heads_per_stage) or legal_heads_per_stage(cfg.num_heads, cfg.num_kv_heads, C)
    for u in us:
        make_schedule(cfg.num_heads, cfg.num_kv_heads, C, u)  # raises a clear error for an illegal U
    return [("ulysses", cfg.num_heads)] + [("upipe", u) for u in us]


def check(cfg: BenchConfig, C: int) -> list[tuple[str, int]]:
    """The (strategy, U) pairs to run on C ranks; a ValueError naming the value for a shape that cannot run (called
    by the CLI before it spawns any rank, and by every rank)."""
    if cfg.seq_len % C or cfg.check_seq_len % C:
        raise ValueError(f"seq_len={cfg.seq_len} and check_seq_len={cfg.check_seq_len} must be multiples of C={C}")
    return strategies(cfg, C)


def run_rank(cfg: BenchConfig, group, rank: int, C: int, device: torch.device) -> list[StrategyResult]:
    dtype = DTYPES[cfg.dtype]
    plan = check(cfg, C)
    shape = AttentionShape(cfg.seq_len, cfg.batch, cfg.model_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           C, torch.tensor([], dtype=dtype).element_size())
    results = []
    for strategy, U in plan:
        err = _check(strategy, U, cfg, group, rank, C, device, dtype)
        if not err <= CHECK_TOL[cfg.dtype]:
            raise AssertionError(f"{strategy} U={U}: relative error {err:.3e} against the float64 reference "
                                 f"exceeds {CHECK_TOL[cfg.dtype]:.0e}; refusing to time a wrong kernel")
        model = attention_memory(shape, U, ulysses=strategy == "ulysses")
        sched = make_schedule(cfg.num_heads, cfg.num_kv_heads, C, U)
        results.append(StrategyResult(strategy, U, sched.num_stages, err, 0, model.peak_bytes, None))

    s = cfg.seq_len // C
    x, wq, wk, wv, dout = _inputs(cfg, s, 2 + rank, device, dtype)
    x.requires_grad_()
    ws = [w.requires_grad_() for w in (wq, wk, wv)]
    freqs = rope_angles(cfg.seq_len, cfg.head_dim).to(device)
    for res in results:  # memory, one strategy at a time
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with PeakMemoryTracker() as mem:
            out, grads = _fwd_bwd(res.strategy, res.heads_per_stage, x, ws, dout, cfg, group, freqs)
            del out, grads
        res.tracked_peak_bytes = mem.peak_bytes
        if device.type == "cuda":
            torch.cuda.synchronize()
            res.cuda_peak_bytes = torch.cuda.max_memory_allocated() - base
    for it in range(cfg.warmup + cfg.iters):  # time, round-robin over strategies
        for res in results:
            if group is not None:
                dist.barrier(group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out, grads = _fwd_bwd(res.strategy, res.heads_per_stage, x, ws, dout, cfg, group, freqs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            del out, grads
            if it >= cfg.warmup:
                res.times_s.append(elapsed)
    return results


def report(cfg: BenchConfig, C: int, device: str, results: list[StrategyResult]) -> tuple[str, dict]:
    base = results[0]
    lines = [
        f"attention benchmark: H={cfg.num_heads} H_kv={cfg.num_kv_heads} d={cfg.head_dim} D={cfg.model_dim} "
        f"N={cfg.seq_len} b={cfg.batch} C={C} {cfg.dtype} on {device}; numerics checked at N={cfg.check_seq_len}",
        f"{'strategy':>8} {'U':>4} {'stages':>6} {'rel err':>9} {'peak MiB':>9} {'model MiB':>9} {'peak/uly':>8} "
        f"{'ms (median)':>11} {'time/uly':>8}",
    ]
    for r in results:
        lines.append(
            f"{r.strategy:>8} {r.heads_per_stage:>4} {r.stages:>6} {r.max_rel_err:>9.2e} "
            f"{r.tracked_peak_bytes / 2**20:>9.2f} {r.model_peak_bytes / 2**20:>9.2f} "
            f"{r.tracked_peak_bytes / base.tracked_peak_bytes:>8.3f} {r.median_s * 1e3:>11.1f} "
            f"{r.median_s / base.median_s:>8.3f}"
        )
    data = {
        "config": asdict(cfg) | {"cp": C, "device": device},
        "results": [asdict(r) | {"median_s": r.median_s, "peak_ratio_vs_ulysses": r.tracked_peak_bytes / base.tracked_peak_bytes,
                                 "time_ratio_vs_ulysses": r.median_s / base.median_s} for r in results],
    }
    return "\n".join(lines), data
