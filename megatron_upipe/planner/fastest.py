"""The fastest stack that fits: U, pipelined stages and the memory switches chosen for one length.

A stack is the config as given with three things chosen: UPipe's U (`parallel.upipe_heads_per_stage`), pipelined
stages (`memory.upipe_overlap`: serial, true or "outputs") and a rung of one of two memory ladders. Each rung keeps
the switches of the one before it and adds one that saves device memory and costs time (L = layers per pipeline
stage; partial recompute at N = L/4, L/2, 3L/4 where that keeps two layers at least, megatron-core's block method,
memory.recompute_layers):

    on device                                   offloaded
    0 activations kept (no recompute, no        0 recompute N = L/4, its inputs offloaded (prefetched), tiles,
      tiles, no offload, unsharded states)        ZeRO-3
    1 + ZeRO-3 (skipped with pipeline           1 N = L/2, offloaded     2 N = 3L/4, offloaded
      parallelism)                              3 full recompute, offloaded (prefetched)
    2 + tiled MLP and chunked loss (the         4 full recompute, offloaded, not prefetched (one input less on
      config's counts when > 1, else 8, 16)       the device)
    3 + recompute N = L/4   4 N = L/2   5 N = 3L/4
    6 + full recompute

Why ladders and not every combination: on a ladder the planner's device peak falls rung by rung and the step-time
model's time rises rung by rung (each adds recomputed FLOPs or exposed copies, or overlapped collectives; a partial
rung keeps two layers at least: with one kept layer a tiny model's peak can exceed full recompute's), so for a given
U and overlap the first rung that fits is the fastest that fits, found by bisection. The offloaded ladder holds less
on the device than the on-device one at the same N, for the same time (its copies back are prefetched) but host
memory; it is searched only below the N the on-device ladder needed. The most frugal stack of all (the offloaded
ladder's last rung at the smallest U, serial) is planned first: if it does not fit, nothing does. Across U: a
smaller U plans less attention memory; with serial stages it is never faster at the same rung
(tests/test_step_time.py), so after U fits at rung r a smaller U is tried only below r; with pipelined stages at r
or below. The smallest U holds the least at every rung: where a rung does not fit at a larger U serially, it is
planned at the smallest U too, and if it does not fit there, neither it nor any rung below it is planned at another
U or overlap. Where the most frugal stack's peak and the layer inputs it offloads exceed the device (long contexts),
the on-device ladder's last rung (full recompute, inputs kept) is planned at the smallest U before anything else: if
it does not fit, that ladder is not searched. Pipelined stages hold one more stage's buffers than serial ones
(drained outputs one stage's result), so at a U and ladder they are tried only from the lowest rung whose device
peak fits serially, and only if they can win: every variant does the same work, so a variant's time at that rung is
the serial candidate's counted work priced with its overlap (or another variant's planned at that U and rung), and
if that is no faster than the fastest stack found so far, no rung of it is. Every
candidate tried is a full planner estimate (device and host, with the margins given), priced by the step-time model;
the fastest that fits wins (ties: on the device, the lower rung, then the larger U). Simulations are shared across
the candidates of one search (planner/depth.py `simulations`): the partial-recompute rungs of one ladder, U and
overlap extrapolate from the same three shallow models, so only the first of them simulates.

Layouts (`search_layouts`, the CLI's `--tp-sizes` and `--ring-sizes`): each tensor-parallel size t and ring size r
is the config on the same GPUs with parallel.tp = t, the context-parallel size what t leaves (cp x tp kept),
parallel.cp_ring = r (all-to-all groups of cp / r ranks) and sequence parallelism for t > 1, searched as above (with
a ring, serial stages only: pipelined stages are not implemented with it); the fastest of the layouts wins (the
step-time model prices TP's collectives and the ring's P2P passes on the critical path). Each layout repeats the
search's simulations, so by default only the config's own layout is searched.

Not searched: pipeline parallel sizes (pipeline bubbles are not priced), memory.ring_overlap, other partial depths
than the quarters, memory.offload_optimizer_states and the disk tier, Megatron-FSDP's unit size (no term of the
step-time model depends on it) and `memory.attention_grad_accum`, which changes the numerics. They stay as the
config has them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

from megatron_upipe.attention import legal_heads_per_stage
from megatron_upipe.config import ConfigError, validate
from megatron_upipe.memory_switches.host_budget import OFFLOAD_POOL
from megatron_upipe.planner.estimate import GIB, ConfigSource, Estimate, estimate, overlap_pricing, step_time
from megatron_upipe.planner.step_time import Hardware, StepTime, causal_pairs

DEFAULT_MLP_CHUNKS, DEFAULT_LOSS_CHUNKS = 8, 16


@dataclass(frozen=True)
class Rung:
    name: str
    overrides: tuple[str, ...]  # memory.* settings, on top of the config as given
    recomputed: int  # layers of a stage recomputed


ON_DEVICE, OFFLOADED = "on device", "offloaded"


def ladders(source: ConfigSource, world_size: int) -> dict[str, tuple[Rung, ...]]:
    """The two memory ladders of `source`'s config (module docstring)."""
    config = source.load()
    m, pp = config.memory, config.parallel.pp
    L = validate(config, world_size).arch.num_layers // pp
    tiles = (f"memory.mlp_chunks={m.mlp_chunks if m.mlp_chunks > 1 else DEFAULT_MLP_CHUNKS}",
             f"memory.loss_chunks={m.loss_chunks if m.loss_chunks > 1 else DEFAULT_LOSS_CHUNKS}")
    plain = ("memory.recompute=none", "memory.recompute_layers=null", "memory.offload_checkpoints=false",
             "memory.offload_prefetch=false", "memory.mlp_chunks=1", "memory.loss_chunks=1",
             "memory.shard_model_states=false")
    partial = sorted(n for n in {L * i // 4 for i in (1, 2, 3)} if 0 < n <= L - 2)  # two layers kept at least
    kept = [Rung("activations kept", plain, 0)]
    if pp == 1:  # Megatron-FSDP is not combined with pipeline parallelism
        kept.append(Rung("+ ZeRO-3", (*kept[-1].overrides, "memory.shard_model_states=true"), 0))
    kept.append(Rung("+ tiled MLP and chunked loss", (*kept[-1].overrides, *tiles), 0))
    base = kept[-1].overrides
    device = [*kept, *(Rung(f"+ recompute {n} of {L} layers", (*base, "memory.recompute=full",
                                                                f"memory.recompute_layers={n}"), n) for n in partial),
              Rung("+ full recompute", (*base, "memory.recompute=full"), L)]
    off = (*base, "memory.recompute=full", "memory.offload_checkpoints=true", "memory.offload_prefetch=true")
    offloaded = [*(Rung(f"recompute {n} of {L} layers, inputs offloaded", (*off, f"memory.recompute_layers={n}"), n)
                   for n in partial),
                 Rung("full recompute, inputs offloaded", off, L),
                 Rung("full recompute, inputs offloaded, not prefetched", (*off, "memory.offload_prefetch=false"), L)]
    return {name: tuple(Rung(r.name, _settled(r.overrides), r.recomputed) for r in rungs)
            for name, rungs in ((ON_DEVICE, device), (OFFLOADED, offloaded))}


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
    ladder: str  # ON_DEVICE or OFFLOADED ("" for the config as given)
    rung: int
    heads_per_stage: int | None
    overlap: bool | str  # memory.upipe_overlap: False, "outputs" or True
    estimate: Estimate
    time: StepTime

    @property
    def seconds(self) -> float:
        return self.time.seconds

    def figures(self, mfu: float) -> dict:
        e = self.estimate
        return {"overrides": list(self.overrides), "fits": e.fits, "peak_bytes": e.peak_bytes,
                "host_bytes_per_node": e.host_bytes_per_node, "step_time_s": self.seconds,
                "tokens_per_s_per_gpu": self.time.tokens_per_s_per_gpu, "mfu": mfu}


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
        return {**self.best.figures(self.mfu(self.best)), "ladder": self.best.ladder, "rung": self.best.rung,
                "baseline": self.baseline.figures(self.mfu(self.baseline)),
                "tried": [{**c.figures(self.mfu(c)), "ladder": c.ladder, "rung": c.rung} for c in self.tried]}


@dataclass(frozen=True)
class _Planning:
    """What every stack planned for one choice shares: the config, the world, the length, the device, the prices."""

    source: ConfigSource
    world_size: int
    vocab_size: int
    seq_length: int
    gpu_mem_bytes: int
    margins: object
    hw: Hardware
    jobs: int
    memo: dict = field(default_factory=dict)  # the simulations made so far (planner/depth.py simulations)

    @cached_property
    def config(self):
        return self.source.load([f"train.seq_length={self.seq_length}"])

    def candidate(self, U: int | None, overlap: bool | str, ladder: str, r: int, rung: Rung) -> Candidate:
        """The config with `rung` at UPipe's `U` (None: the config's own non-UPipe strategy), planned and priced."""
        extra = (*rung.overrides, f"memory.upipe_overlap={str(overlap).lower()}")
        strategy = f"upipe:{U}" if U is not None else self.config.parallel.cp_strategy
        est = self._estimate(ConfigSource(self.source.path, (*self.source.overrides, *extra)), strategy)
        chosen = (*extra, *([f"parallel.upipe_heads_per_stage={U}"] if U is not None else []))
        return Candidate(chosen, ladder, r, U, overlap, est, step_time(est, self.world_size, self.hw))

    def priced_as(self, c: Candidate, overlap: bool | str) -> StepTime:
        """The step time of candidate c's counted work with memory.upipe_overlap = `overlap` (every variant does
        the same work; only what hides differs), without planning that variant's memory."""
        config = self.source.load([*c.overrides, f"memory.upipe_overlap={str(overlap).lower()}",
                                   f"train.seq_length={self.seq_length}"])
        fields = overlap_pricing(config, validate(config, self.world_size), overlap)
        return step_time(dataclasses.replace(c.estimate, **fields), self.world_size, self.hw)

    def baseline(self) -> Candidate:
        """The config as given (U unset or auto: the smallest legal, as the planner plans it)."""
        config = self.config
        plan = validate(config, self.world_size)
        strategy = config.parallel.cp_strategy
        if strategy == "upipe":
            strategy = f"upipe:{plan.heads_per_stage}" if plan.heads_per_stage else "upipe"
        est = self._estimate(self.source, strategy)
        return Candidate((), "", -1, plan.heads_per_stage, config.memory.upipe_overlap, est,
                         step_time(est, self.world_size, self.hw))

    def most_frugal(self, chains: dict[str, tuple[Rung, ...]], U: int | None, what: str) -> Candidate:
        """The offloaded ladder's last rung at `U`, serial: the least memory of all; ConfigError naming `what` (the
        CLI option) when even it does not fit."""
        c = self.candidate(U, False, OFFLOADED, len(chains[OFFLOADED]) - 1, chains[OFFLOADED][-1])
        if not c.estimate.fits:
            raise ConfigError(
                f"--{what}: no stack fits {self.gpu_mem_bytes / GIB:.2f} GiB per GPU at "
                f"train.seq_length={self.seq_length}: the most frugal ({', '.join(c.overrides)}) plans "
                f"{c.estimate.peak_bytes / GIB:.2f} GiB{'' if c.estimate.host_fits else ' and exceeds the host memory'}; "
                f"shorten train.seq_length or use more GPUs")
        return c

    def result(self, best: Candidate, tried: tuple[Candidate, ...]) -> Fastest:
        return Fastest(best, self.baseline(), tried,
                       model_flops_per_step(self.source, self.world_size, self.vocab_size, self.seq_length),
                       self.world_size, self.hw)

    def _estimate(self, source: ConfigSource, strategy: str) -> Estimate:
        return estimate(source, self.world_size, self.vocab_size, strategy, self.seq_length, self.gpu_mem_bytes,
                        self.margins, jobs=self.jobs, memo=self.memo)


def _legal_u(config, world_size: int) -> list[int | None]:
    """UPipe's legal U, largest first ([None] for another strategy)."""
    if config.parallel.cp_strategy != "upipe":
        return [None]
    plan = validate(config, world_size)
    return sorted(legal_heads_per_stage(plan.local_heads, plan.local_kv_heads, config.parallel.cp_a2a), reverse=True)


def longest_stack(source: ConfigSource, world_size: int, vocab_size: int, seq_length: int, gpu_mem_bytes: int,
                  margins, hw: Hardware, jobs: int = 1) -> Fastest:
    """The most frugal stack of `source` (the offloaded ladder's last rung, the smallest legal U, serial stages):
    what reaches the longest context; ConfigError when even it does not fit at `seq_length`."""
    p = _Planning(source, world_size, vocab_size, seq_length, gpu_mem_bytes, margins, hw, jobs)
    c = p.most_frugal(ladders(source, world_size), _legal_u(p.config, world_size)[-1], "longest")
    return p.result(c, (c,))


def search_fastest(source: ConfigSource, world_size: int, vocab_size: int, seq_length: int, gpu_mem_bytes: int,
                   margins, hw: Hardware, jobs: int = 1, log=None) -> Fastest:
    """The fastest stack of `source` that fits at `seq_length` (module docstring); ConfigError when none does."""
    p = _Planning(source, world_size, vocab_size, seq_length, gpu_mem_bytes, margins, hw, jobs)
    chains = ladders(source, world_size)
    legal = _legal_u(p.config, world_size)
    one_stage = validate(p.config, world_size).local_heads
    layers = chains[ON_DEVICE][-1].recomputed  # per pipeline stage (full recompute's rung recomputes them all)
    seen: dict[tuple, Candidate] = {}

    def run(U: int | None, overlap: bool | str, chain: str, r: int) -> Candidate:
        key = (U, overlap, chain, r)
        if key not in seen:
            c = seen[key] = p.candidate(U, overlap, chain, r, chains[chain][r])
            if log is not None:
                est = c.estimate
                verdict = "fits" if est.fits else \
                    "device fits, host does not" if est.peak_bytes <= gpu_mem_bytes else "does not fit"
                log(f"  U={U} overlap={overlap} {chain} {r} ({chains[chain][r].name}): {est.peak_bytes / GIB:.2f} GiB, "
                    f"{verdict}, {c.seconds:.2f} s/step")
        return seen[key]

    floor: dict[tuple, int] = {}  # (U, ladder) -> the lowest rung whose device peak can fit with serial stages
    smallest = legal[-1]
    out_everywhere = {name: -1 for name in chains}  # ladder -> the highest rung the smallest U does not fit serially

    def fits_device(c: Candidate) -> bool:
        return c.estimate.peak_bytes <= gpu_mem_bytes

    def out_at_every_u(chain: str, r: int) -> bool:
        """Whether rung r of `chain` does not fit at the smallest U serially (planned now if it was not), and so at
        no U and no overlap; then it and the rungs below it are marked out."""
        if fits_device(run(smallest, False, chain, r)):
            return False
        out_everywhere[chain] = max(out_everywhere[chain], r)
        return True

    def first_fit(U, overlap, chain: str, hi: int) -> Candidate | None:
        """The lowest rung of `chain` in [0, hi] whose device peak fits (bisection: the peak falls rung by rung), if
        it also fits the host. Pipelined stages hold one more stage's buffers than serial ones at the same U and rung,
        so they start at the serial floor. Below the ladder's top (hi capped by a larger U's choice) rung hi is
        planned first: the rung a larger U needed is usually just too much for a smaller one, and if hi does not fit,
        no rung below it does. A rung that does not fit at a larger U serially is planned at the smallest U too: the
        smallest U holds the least at every rung, so if it does not fit there, that rung and those below it fit at
        no U and no overlap, and the U between are not planned there."""
        lo, top, found = max(floor.get((U, chain), 0) if overlap else 0, out_everywhere[chain] + 1), hi, None
        top_first = hi < len(chains[chain]) - 1
        probe = not overlap and U != smallest
        while lo <= hi:
            mid, top_first = hi if top_first else (lo + hi) // 2, False
            c = run(U, overlap, chain, mid)
            if fits_device(c):
                found, hi = c, mid - 1
                continue
            if probe:
                out_at_every_u(chain, mid)
            lo = max(mid, out_everywhere[chain]) + 1
        if not overlap:
            floor[(U, chain)] = found.rung if found is not None else top + 1
        return found if found is not None and found.estimate.fits else None

    def shares_simulations(U, chain: str, r: int) -> bool:
        """Whether planning rung r serially at U costs no new simulation: a partial-recompute rung, where another
        partial-recompute rung of the same ladder and U has been planned serially (they extrapolate from the same
        shallow models, planner/depth.py)."""
        def partial(i: int) -> bool:
            return 0 < chains[chain][i].recomputed < layers

        return partial(r) and any(partial(i) and (U, False, chain, i) in seen for i in range(len(chains[chain])))

    def can_win(U, overlap, chain: str, hi: int) -> bool:
        """Whether a pipelined variant at (U, chain), searched up to rung hi, can beat the fastest stack found so
        far: it fits at the serial floor at best, and its time there is the serial candidate's work priced with
        its overlap (times rise rung by rung). The work is that of any variant planned at that U and rung; where
        none is (the serial search stopped at a larger U's rung), the serial floor rung is planned now when that
        costs no new simulation; otherwise the variant is searched."""
        f = floor.get((U, chain))
        if f is None or not fitting:
            return True
        if f > hi:  # first_fit would search an empty range
            return False
        same_work = next((seen[k] for k in ((U, o, chain, f) for o in (False, True, "outputs")) if k in seen), None)
        if same_work is None and not shares_simulations(U, chain, f):
            return True
        same_work = same_work or run(U, False, chain, f)
        return p.priced_as(same_work, overlap).seconds < min(c.seconds for c in fitting)

    frugal = seen[(smallest, False, OFFLOADED, len(chains[OFFLOADED]) - 1)] = \
        p.most_frugal(chains, smallest, "fastest")
    if frugal.estimate.peak_bytes + frugal.estimate.host_breakdown.get(OFFLOAD_POOL, 0) > gpu_mem_bytes:
        # the inputs it offloads would not fit beside it: full recompute on the device (the on-device ladder's
        # least) is planned at the smallest U first, and if it does not fit, no rung of that ladder is planned
        out_at_every_u(ON_DEVICE, len(chains[ON_DEVICE]) - 1)
    fitting: list[Candidate] = []
    serial_only = legal == [None] or p.config.parallel.cp_ring > 1  # the ring's stages run serially
    for overlap in ((False,) if serial_only else (False, True, "outputs")):
        hi = {name: len(rungs) - 1 for name, rungs in chains.items()}
        for U in legal:
            if overlap and U == one_stage:  # one stage: nothing to pipeline
                continue
            on_device = first_fit(U, overlap, ON_DEVICE, hi[ON_DEVICE]) \
                if not overlap or can_win(U, overlap, ON_DEVICE, hi[ON_DEVICE]) else None
            # offloaded: worth planning only where it recomputes fewer layers than the on-device choice
            need = chains[ON_DEVICE][on_device.rung].recomputed if on_device is not None else None
            top = hi[OFFLOADED] if need is None else \
                min(hi[OFFLOADED], sum(r.recomputed < need for r in chains[OFFLOADED]) - 1)
            offloaded = first_fit(U, overlap, OFFLOADED, top) \
                if not overlap or can_win(U, overlap, OFFLOADED, top) else None
            for name, c in ((ON_DEVICE, on_device), (OFFLOADED, offloaded)):
                if c is not None:
                    fitting.append(c)
                    hi[name] = c.rung if overlap else c.rung - 1
            if max(hi.values()) < 0:
                break
    best = min(fitting, key=lambda c: (c.seconds, c.ladder == OFFLOADED, c.rung, -(c.heads_per_stage or 0)))
    return p.result(best, tuple(seen.values()))


def layout_overrides(config, tp: int, ring: int | None = None) -> tuple[str, ...]:
    """The parallel.* overrides that run `config` with tensor-parallel size `tp` (and `ring` ranks of the hybrid
    ring, parallel.cp_ring; None: the config's) on the same GPUs: cp x tp kept, sequence parallelism for tp > 1;
    ConfigError when tp does not divide cp x tp or the ring the cp that leaves."""
    p = config.parallel
    ring = p.cp_ring if ring is None else ring
    if (p.cp * p.tp) % tp:
        raise ConfigError(f"--tp-sizes {tp}: it does not divide parallel.cp x parallel.tp = {p.cp * p.tp}; give "
                          f"divisors of it")
    cp = p.cp * p.tp // tp
    if cp % ring:
        raise ConfigError(f"--ring-sizes {ring}: it does not divide parallel.cp = {cp} (with tp {tp}); give divisors "
                          f"of it")
    return (f"parallel.tp={tp}", f"parallel.cp={cp}", f"parallel.cp_ring={ring}",
            f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}")


def search_layouts(source: ConfigSource, world_size: int, vocab_size: int, seq_length: int, gpu_mem_bytes: int,
                   margins, hw: Hardware, tp_sizes: tuple[int, ...], ring_sizes: tuple[int, ...] | None = None,
                   jobs: int = 1, log=None) -> Fastest:
    """The fastest stack that fits over tensor-parallel sizes and ring sizes (module docstring; ring_sizes None:
    the config's): each layout searched by `search_fastest`, the fastest best wins; every candidate's overrides
    start with its layout's. ConfigError when no layout has a stack that fits (naming each layout's reason)."""
    config = source.load()
    found, reasons = [], []
    for tp, ring in ((t, r) for t in tp_sizes for r in (ring_sizes or (config.parallel.cp_ring,))):
        try:
            layout = layout_overrides(config, tp, ring)
            f = search_fastest(ConfigSource(source.path, (*source.overrides, *layout)), world_size, vocab_size,
                               seq_length, gpu_mem_bytes, margins, hw, jobs=jobs, log=log)
        except ConfigError as e:
            reasons.append(f"tp={tp} cp_ring={ring}: {' '.join(str(e).split())}")
            if log is not None:
                log(f"  {reasons[-1]}")
            continue
        found.append((layout, f))
    if not found:
        raise ConfigError("--fastest: no layout searched has a stack that fits: " + "; ".join(reasons))

    def laid(c: Candidate, layout) -> Candidate:
        return dataclasses.replace(c, overrides=(*layout, *c.overrides))

    layout, best = min(found, key=lambda lf: lf[1].best.seconds)
    own = [f for lay, f in found if lay == layout_overrides(config, config.parallel.tp)]  # the config's layout
    baseline = own[0].baseline if own else _Planning(source, world_size, vocab_size, seq_length, gpu_mem_bytes,
                                                      margins, hw, jobs).baseline()
    return dataclasses.replace(best, best=laid(best.best, layout), baseline=baseline,
                               tried=tuple(laid(c, lay) for lay, f in found for c in f.tried))
