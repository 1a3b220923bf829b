"""The fastest stack that fits: U, pipelined stages and the memory switches chosen for one length.

A stack is the config as given with three things chosen: UPipe's U (`parallel.upipe_heads_per_stage`), pipelined
stages (`memory.upipe_overlap`) and a rung of the memory ladder below. Each rung keeps the switches of the one
before it and adds one that saves device memory and costs time:

    0 activations kept   recompute none, no tiles, no offload, model states as the config has them unsharded
    1 + ZeRO-3           memory.shard_model_states (Megatron-FSDP; skipped with pipeline parallelism)
    2 + tiles            memory.mlp_chunks / loss_chunks (the config's counts when > 1, else 8 and 16)
    3 + full recompute   memory.recompute=full
    4 + offload          memory.offload_checkpoints with memory.offload_prefetch (the copy back hidden)
    5 + offload, serial  memory.offload_prefetch=false (one layer input less on the device)

Why a ladder and not every combination: the planner's device peak falls rung by rung and the step-time model's
time rises rung by rung (each adds recomputed FLOPs or exposed copies, or overlapped collectives); both are
monotonic by construction, so for a given U and overlap the first rung that fits is the fastest that fits, found
by bisection (about log2(6) simulations instead of 6); the most frugal stack of all (the last rung at the smallest
U, serial) is planned first, and if it does not fit nothing does. Across U: a smaller U plans less attention memory; with
serial stages it is never faster at the same rung (tests/test_step_time.py), so after U fits at rung r a smaller U
is tried only below r; with pipelined stages at rung r or below. Every candidate tried is a full planner estimate
(device and host, with the margins given), priced by the step-time model; the fastest that fits wins (ties: the
lower rung, then the larger U).

Not searched (the step-time model cannot price them yet, so a choice among them would be a guess): tensor and
pipeline parallel sizes and the ring split (TP's sequence-parallel collectives sit on the critical path, which the
model treats as overlapped), partial recompute or offload of some layers, and `memory.attention_grad_accum`, which
changes the numerics. They stay as the config has them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_upipe.attention import legal_heads_per_stage
from megatron_upipe.config import ConfigError, validate
from megatron_upipe.planner.estimate import GIB, ConfigSource, Estimate, estimate, step_time
from megatron_upipe.planner.step_time import Hardware, StepTime, causal_pairs

DEFAULT_MLP_CHUNKS, DEFAULT_LOSS_CHUNKS = 8, 16


@dataclass(frozen=True)
class Rung:
    name: str
    overrides: tuple[str, ...]  # memory.* settings, on top of the config as given


def ladder(source: ConfigSource) -> tuple[Rung, ...]:
    """The memory ladder of `source`'s config (module docstring)."""
    m, pp = source.load().memory, source.load().parallel.pp
    tiles = (f"memory.mlp_chunks={m.mlp_chunks if m.mlp_chunks > 1 else DEFAULT_MLP_CHUNKS}",
             f"memory.loss_chunks={m.loss_chunks if m.loss_chunks > 1 else DEFAULT_LOSS_CHUNKS}")
    plain = ("memory.recompute=none", "memory.offload_checkpoints=false", "memory.offload_prefetch=false",
             "memory.mlp_chunks=1", "memory.loss_chunks=1", "memory.shard_model_states=false")
    rungs = [Rung("activations kept", plain)]
    if pp == 1:  # Megatron-FSDP is not combined with pipeline parallelism
        rungs.append(Rung("+ ZeRO-3", (*rungs[-1].overrides, "memory.shard_model_states=true")))
    rungs.append(Rung("+ tiled MLP and chunked loss", (*rungs[-1].overrides, *tiles)))
    rungs.append(Rung("+ full recompute", (*rungs[-1].overrides, "memory.recompute=full")))
    rungs.append(Rung("+ offloaded layer inputs, prefetched", (*rungs[-1].overrides, "memory.offload_checkpoints=true",
                                                              "memory.offload_prefetch=true")))
    rungs.append(Rung("+ offloaded layer inputs, not prefetched", (*rungs[-1].overrides,
                                                                  "memory.offload_prefetch=false")))
    return tuple(Rung(r.name, _settled(r.overrides)) for r in rungs)


def _settled(overrides: tuple[str, ...]) -> tuple[str, ...]:
    """One `section.key=value` per key, the last given (in the order the keys first appear)."""
    last: dict[str, str] = {}
    for o in overrides:
        key, _, value = o.partition("=")
        last[key] = value
    return tuple(f"{k}={v}" for k, v in last.items())


def model_flops_per_step(source: ConfigSource, world_size: int, vocab_size: int, seq_length: int) -> float:
    """The model's FLOPs in one training step, all GPUs (MFU's numerator): 6 x the matmul parameters x tokens (the
    LM head included, the embedding lookup not) + causal attention 12 x heads x head dim x (query, key) pairs per
    layer and sequence (forward 4, backward 8); recomputation and the tiles' repeats not counted."""
    plan = validate(source.load([f"train.seq_length={seq_length}"]), world_size)
    a = plan.arch
    D, H, G, d, F = a.hidden_size, a.num_attention_heads, a.num_query_groups, a.kv_channels, a.ffn_hidden_size
    matmul_params = a.num_layers * (D * H * d + 2 * D * G * d + H * d * D + 3 * D * F) + D * vocab_size
    sequences = plan.global_batch_size
    attention = 12 * H * d * causal_pairs(seq_length, seq_length) * a.num_layers * sequences
    return 6 * matmul_params * seq_length * sequences + attention


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]  # what to add to the config (section.key=value)
    rung: int
    heads_per_stage: int | None
    overlap: bool
    estimate: Estimate
    time: StepTime | None

    @property
    def seconds(self) -> float:
        return float("inf") if self.time is None else self.time.seconds

    def figures(self, mfu: float | None) -> dict:
        e = self.estimate
        return {"overrides": list(self.overrides), "fits": e.fits, "peak_bytes": e.peak_bytes,
                "host_bytes_per_node": e.host_bytes_per_node, "step_time_s": self.seconds,
                "tokens_per_s_per_gpu": None if self.time is None else self.time.tokens_per_s_per_gpu, "mfu": mfu}


@dataclass(frozen=True)
class Fastest:
    best: Candidate
    baseline: Candidate
    tried: tuple[Candidate, ...]
    model_flops: float  # per step, all GPUs
    world_size: int
    hw: Hardware

    def mfu(self, c: Candidate) -> float:
        return self.model_flops / self.world_size / (c.seconds * self.hw.peak_flops)

    def to_dict(self) -> dict:
        return {**self.best.figures(self.mfu(self.best)), "rung": self.best.rung,
                "baseline": self.baseline.figures(self.mfu(self.baseline)),
                "tried": [{**c.figures(self.mfu(c)), "rung": c.rung} for c in self.tried]}


def longest_stack(source: ConfigSource, world_size: int, vocab_size: int, seq_length: int, gpu_mem_bytes: int,
                  margins, hw: Hardware, jobs: int = 1) -> Fastest:
    """The most frugal stack of `source` (the ladder's last rung, the smallest legal U, serial stages): what reaches
    the longest context; ConfigError when even it does not fit at `seq_length`."""
    config = source.load([f"train.seq_length={seq_length}"])
    plan = validate(config, world_size)
    rung = ladder(source)[-1]
    upipe = config.parallel.cp_strategy == "upipe"
    U = min(legal_heads_per_stage(plan.local_heads, plan.local_kv_heads, config.parallel.cp_a2a)) if upipe else None
    chosen = (*rung.overrides, "memory.upipe_overlap=false", *([f"parallel.upipe_heads_per_stage={U}"] if upipe else []))
    strategy = f"upipe:{U}" if upipe else config.parallel.cp_strategy
    est = estimate(ConfigSource(source.path, (*source.overrides, *chosen)), world_size, vocab_size, strategy,
                   seq_length, gpu_mem_bytes, margins, jobs=jobs)
    if not est.fits:
        raise ConfigError(
            f"--longest: the most frugal stack ({', '.join(chosen)}) does not fit {gpu_mem_bytes / GIB:.2f} GiB per GPU "
            f"at train.seq_length={seq_length}: it plans {est.peak_bytes / GIB:.2f} GiB"
            f"{'' if est.host_fits else ' and exceeds the host memory'}; shorten train.seq_length or use more GPUs")
    c = Candidate(chosen, len(ladder(source)) - 1, U, False, est, step_time(est, world_size, hw))
    return Fastest(c, _baseline(source, world_size, vocab_size, seq_length, gpu_mem_bytes, margins, hw, jobs), (c,),
                   model_flops_per_step(source, world_size, vocab_size, seq_length), world_size, hw)


def _baseline(source: ConfigSource, world_size: int, vocab_size: int, seq_length: int, gpu_mem_bytes: int, margins,
              hw: Hardware, jobs: int) -> Candidate:
    """The config as given at `seq_length` (U unset or auto: the smallest legal, as the planner plans it)."""
    config = source.load([f"train.seq_length={seq_length}"])
    plan = validate(config, world_size)
    if config.parallel.cp_strategy == "upipe":
        strategy = f"upipe:{plan.heads_per_stage}" if plan.heads_per_stage else "upipe"
    else:
        strategy = config.parallel.cp_strategy
    est = estimate(source, world_size, vocab_size, strategy, seq_length, gpu_mem_bytes, margins, jobs=jobs)
    return Candidate((), -1, plan.heads_per_stage, config.memory.upipe_overlap, est, step_time(est, world_size, hw))


def search_fastest(source: ConfigSource, world_size: int, vocab_size: int, seq_length: int, gpu_mem_bytes: int,
                   margins, hw: Hardware, jobs: int = 1, log=None) -> Fastest:
    """The fastest stack of `source` that fits at `seq_length` (module docstring); ConfigError when none does."""
    config = source.load([f"train.seq_length={seq_length}"])
    plan = validate(config, world_size)
    rungs = ladder(source)
    upipe = config.parallel.cp_strategy == "upipe"
    legal = sorted(legal_heads_per_stage(plan.local_heads, plan.local_kv_heads, config.parallel.cp_a2a),
                   reverse=True) if upipe else [None]
    seen: dict[tuple, Candidate] = {}

    def run(U: int | None, overlap: bool, r: int) -> Candidate:
        key = (U, overlap, r)
        if key not in seen:
            extra = (*rungs[r].overrides, f"memory.upipe_overlap={str(overlap).lower()}")
            strategy = f"upipe:{U}" if upipe else config.parallel.cp_strategy
            est = estimate(ConfigSource(source.path, (*source.overrides, *extra)), world_size, vocab_size, strategy,
                           seq_length, gpu_mem_bytes, margins, jobs=jobs)
            chosen = (*extra, *([f"parallel.upipe_heads_per_stage={U}"] if upipe else []))
            seen[key] = Candidate(chosen, r, U, overlap, est, step_time(est, world_size, hw))
            if log is not None:
                c = seen[key]
                log(f"  U={U} overlap={overlap} rung {r} ({rungs[r].name}): {est.peak_bytes / GIB:.2f} GiB, "
                    f"{'fits' if est.fits else 'device fits, host does not' if est.peak_bytes <= gpu_mem_bytes else 'does not fit'}"
                    f", {c.seconds:.2f} s/step")
        return seen[key]

    def first_fit(U, overlap, hi: int) -> Candidate | None:
        """The lowest rung in [0, hi] whose device peak fits (bisection: the peak falls rung by rung), if it also
        fits the host."""
        lo, found = 0, None
        while lo <= hi:
            mid = (lo + hi) // 2
            c = run(U, overlap, mid)
            if c.estimate.peak_bytes <= gpu_mem_bytes:
                found, hi = c, mid - 1
            else:
                lo = mid + 1
        return found if found is not None and found.estimate.fits else None

    frugal = run(legal[-1], False, len(rungs) - 1)  # the least memory of all: if it does not fit, nothing does
    if not frugal.estimate.fits:
        raise ConfigError(
            f"--fastest: no stack fits {gpu_mem_bytes / GIB:.2f} GiB per GPU at train.seq_length={seq_length}: the "
            f"most frugal ({', '.join(frugal.overrides)}) plans {frugal.estimate.peak_bytes / GIB:.2f} GiB"
            f"{'' if frugal.estimate.host_fits else ' and exceeds the host memory'}; shorten train.seq_length or "
            f"use more GPUs")
    fitting: list[Candidate] = []
    for overlap in ((False, True) if upipe else (False,)):
        hi = len(rungs) - 1
        for U in legal:
            if overlap and U == plan.local_heads:  # one stage: nothing to pipeline
                continue
            c = first_fit(U, overlap, hi)
            if c is None:
                continue
            fitting.append(c)
            hi = c.rung if overlap else c.rung - 1
            if hi < 0:
                break
    baseline = _baseline(source, world_size, vocab_size, seq_length, gpu_mem_bytes, margins, hw, jobs)
    best = min(fitting, key=lambda c: (c.seconds, c.rung, -(c.heads_per_stage or 0)))
    return Fastest(best, baseline, tuple(seen.values()),
                   model_flops_per_step(source, world_size, vocab_size, seq_length), world_size, hw)
