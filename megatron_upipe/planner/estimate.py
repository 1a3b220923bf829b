"""From a simulated step to a per-GPU verdict: kernel workspace, stated margins, fit, and the longest context.

Device peak = max(tracked step peak, tracked peak at the attention op + attention-kernel workspace), then
fragmentation on top, then the CUDA context and NCCL buffers (outside PyTorch's allocator), against the GPU's
reported capacity (devices.py says where each capacity and margin comes from). Every term is a named entry of the
breakdown so a reader can see what decides the verdict. A plan fits when the device and the host fit: host memory
per rank and per node (the offload pool as simulated, checkpoint-save staging, stated margins; see
memory_switches/host_budget.py) against memory.host_mem_gib per node.

Strategies are named `none`, `ulysses`, `upipe` (smallest legal U) or `upipe:U`. `none` means no context
parallelism (cp = 1, the spare ranks become data parallel); it runs our attention op with C = 1, i.e. flash
attention with its explicit backward, so it is compared on the same kernels as the others.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from megatron_upipe.attention.schedule import make_schedule
from megatron_upipe.config import Config, load_config, validate
from megatron_upipe.memory_switches.host_budget import PLANNER_HOST_GIB, PLANNER_RANKS_PER_NODE, HostPlan, plan_host_memory
from megatron_upipe.planner.devices import GIB, Margins
from megatron_upipe.planner.depth import simulate_deep
from megatron_upipe.planner.simulate import StepMemory, planned_kernel_name
from megatron_upipe.planner.step_time import Hardware, StepTime, predict

CONTEXT_STEP = 128 * 1024  # --max-context searches multiples of 128K tokens


def flash_workspace_bytes(config: Config, world_size: int) -> int:
    """Scratch of one flash-attention backward call (flash-attn 2 layout), per rank, for this config's stage.

    dq accumulator in fp32 [b, N, m, d], softmax row statistic fp32 [b, m, N], and, when the call's query heads
    outnumber its KV heads, dK/dV expanded to the query heads in bf16 (2 x [b, N, m, d]) inside a GQA-native
    kernel (a kernel without native GQA gets K/V and dK/dV expanded by our op, where the tracker already counts
    them). m and the KV heads of one call follow the UPipe schedule (m = U / C; Ulysses: all local heads), C
    being the all-to-all size. Under hybrid a2a x ring (parallel.cp_ring = R) each call is one zigzag chunk of
    N/(2R) queries against one chunk of keys, so N/(2R) replaces N.
    """
    from megatron_upipe.attention.kernels import planning_kernel

    plan = validate(config, world_size)
    H, G, C, R = plan.local_heads, plan.local_kv_heads, config.parallel.cp_a2a, config.parallel.cp_ring
    U = plan.heads_per_stage if config.parallel.cp_strategy == "upipe" else H
    sched = make_schedule(H, G, C, U)
    m, w = sched.q_per_rank, sched.stages[0].kv_slots[1] - sched.stages[0].kv_slots[0]
    b, N, d = plan.micro_batch_size, plan.seq_length // (2 * R if R > 1 else 1), plan.arch.kv_channels
    dq_accum = b * N * m * d * 4
    stats = b * m * N * 4
    name = planned_kernel_name(config)
    native = name == "cpu_flash" or planning_kernel(name).native_gqa
    expanded = 2 * b * N * m * d * 2 if m > w and native else 0
    return dq_accum + stats + expanded


@dataclass(frozen=True)
class ConfigSource:
    """A config file plus overrides; `load(extra)` resolves it with more overrides on top (later ones win)."""

    path: str | None
    overrides: tuple[str, ...] = ()

    def load(self, extra: list[str] = ()) -> Config:
        return load_config(self.path, [*self.overrides, *extra])


@dataclass(frozen=True)
class Estimate:
    strategy: str
    seq_length: int
    peak_bytes: int  # device bytes per GPU, workspace and margins included
    fits: bool  # device and host
    breakdown: dict[str, int]
    host_bytes: int  # host memory per rank: offload pool, checkpoint staging, process margin (host_breakdown)
    gpu_mem_bytes: int
    tracked_bytes: int = 0  # the simulated step's live-tensor peak (what a tracker or max_memory_allocated sees)
    device_bytes: int = 0  # tracked, with the attention workspace where it lands: before margins
    named: tuple = ()  # (category, allocation site, bytes) of the large storages alive at the deciding peak
    host_breakdown: dict = field(default_factory=dict)  # per rank, by name (memory_switches/host_budget.py)
    host_bytes_per_node: int = 0  # per rank x ranks per node + the OS margin
    host_mem_bytes: int = 0  # host RAM per node it is checked against
    host_fits: bool = True
    work: dict = field(default_factory=dict)  # the step's FLOPs and collective bytes (planner/step_time.py)
    tokens_per_step: int = 0  # global batch x sequence length
    overlap_stages: int = 0  # UPipe stages per layer when memory.upipe_overlap=true pipelines them, else 0
    drained_stages: tuple = (0, 0)  # (UPipe stages, KV rounds) per layer with memory.upipe_overlap=outputs
    ring_overlap: bool = False  # memory.ring_overlap: the hybrid ring's P2P passes during its blocks
    offload_prefetch: bool = False  # memory.offload_prefetch: the offloaded inputs come back a layer ahead

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def strategy_overrides(strategy: str, cp: int) -> list[str]:
    """Config overrides that select `strategy` (see the module docstring)."""
    name, _, u = strategy.partition(":")
    if name == "none":
        return ["parallel.cp=1", "parallel.cp_ring=1", "parallel.cp_strategy=ulysses",
                "parallel.upipe_heads_per_stage=null"]
    if name == "ulysses":
        return [f"parallel.cp={cp}", "parallel.cp_strategy=ulysses", "parallel.upipe_heads_per_stage=null"]
    if name == "upipe":
        return [f"parallel.cp={cp}", "parallel.cp_strategy=upipe",
                f"parallel.upipe_heads_per_stage={u if u else 'null'}"]
    raise ValueError(f"strategy {strategy!r} is not one the planner simulates: use none, ulysses, upipe or upipe:U "
                     f"(--strategies)")


def strategy_config(source: ConfigSource, strategy: str, seq_length: int) -> Config:
    """The config that `estimate` simulates for `strategy` at `seq_length` (ConfigError/ValueError if none)."""
    extra = strategy_overrides(strategy, source.load().parallel.cp) + [f"train.seq_length={seq_length}"]
    if strategy == "none":  # the spare ranks become data parallel, with the global batch following
        extra += ["parallel.dp=null", "train.global_batch_size=null"]
    return source.load(extra)


def estimate(source: ConfigSource, world_size: int, vocab_size: int, strategy: str, seq_length: int,
             gpu_mem_bytes: int, margins: Margins = Margins(), named_bytes: int = 0, jobs: int = 1,
             memo: dict | None = None) -> Estimate:
    """The verdict for `strategy` at `seq_length` (see the module docstring); jobs > 1 runs the depth
    extrapolation's simulations side by side; `memo` keeps simulations for the next estimate (depth.simulations)."""
    cfg = strategy_config(source, strategy, seq_length)
    step: StepMemory = simulate_deep(cfg, world_size, vocab_size, named_bytes, jobs=jobs,
                                     memo=memo)  # shallow, extrapolated
    workspace = flash_workspace_bytes(cfg, world_size)
    breakdown = dict(step.breakdown)
    at_attention = step.attention_peak_bytes + workspace
    if at_attention > step.peak_bytes:  # the peak moves into the attention backward
        breakdown = {**(step.attention_peak_breakdown or {}), "workspace": workspace}
        device, named = at_attention, step.attention_peak_named
    else:
        device, named = step.peak_bytes, step.peak_named
    if step.states_back_bytes > device:  # memory.offload_optimizer_states: the parked states back after the backward
        breakdown, device, named = dict(step.states_back_breakdown or {}), step.states_back_bytes, ()
    named_margins = margins.named(device)
    breakdown.update(named_margins)
    total = device + sum(named_margins.values())
    host = plan_host(cfg, world_size, vocab_size, step)
    plan = validate(cfg, world_size)
    return Estimate(strategy, seq_length, total, total <= gpu_mem_bytes and host.fits, breakdown, host.per_rank_bytes,
                    gpu_mem_bytes, step.peak_bytes, device, named, host.breakdown, host.per_node_bytes,
                    host.host_mem_bytes, host.fits, dict(step.work or {}), plan.tokens_per_step,
                    ring_overlap=cfg.memory.ring_overlap, offload_prefetch=cfg.memory.offload_prefetch,
                    **overlap_pricing(cfg, plan, cfg.memory.upipe_overlap))


def overlap_pricing(cfg: Config, plan, overlap: bool | str) -> dict:
    """The Estimate fields that tell the step-time model how UPipe's stages overlap with memory.upipe_overlap =
    `overlap` (overlap_stages, drained_stages); the work itself is the same for every variant."""
    if cfg.parallel.cp_strategy != "upipe" or not overlap:
        return {"overlap_stages": 0, "drained_stages": (0, 0)}
    if overlap is True:
        return {"overlap_stages": plan.upipe_stages, "drained_stages": (0, 0)}
    sched = make_schedule(plan.local_heads, plan.local_kv_heads, cfg.parallel.cp_a2a, plan.heads_per_stage)
    return {"overlap_stages": 0, "drained_stages": (len(sched.stages), len(sched.round_kv_heads))}


def step_time(est: Estimate, world_size: int, hw: Hardware) -> StepTime:
    """The step-time model's prediction for an estimate's counted work on `hw` (planner/step_time.py)."""
    return predict(est.work, hw, est.tokens_per_step, world_size, overlap_stages=est.overlap_stages,
                   drained_stages=tuple(est.drained_stages), ring_overlap=est.ring_overlap,
                   offload_prefetch=est.offload_prefetch)


def format_time(est: Estimate, world_size: int, hw: Hardware) -> str:
    t = step_time(est, world_size, hw)
    parts = ", ".join(f"{k} {v:.2f}" for k, v in t.parts.items() if v)
    return (f"{est.strategy} @ {est.seq_length}: {t.seconds:.2f} s/step, {t.tokens_per_s_per_gpu:.0f} tokens/s per "
            f"GPU on {hw.name} (s: {parts}; GEMM {est.work.get('flops:gemm', 0) / 1e12:.0f} and attention "
            f"{est.work.get('flops:attention', 0) / 1e12:.0f} TFLOP per GPU)")


def plan_host(cfg: Config, world_size: int, vocab_size: int, step: StepMemory) -> HostPlan:
    """Host memory of the plan (memory_switches/host_budget.py) with the offload pool as the simulated offloader
    allocated it; PLANNER_RANKS_PER_NODE ranks per node (fewer if the world is smaller), memory.host_mem_gib per
    node, else PLANNER_HOST_GIB."""
    host = plan_host_memory(cfg, validate(cfg, world_size), vocab_size, bf16=cfg.train.bf16 is not False, cuda=True,
                            ranks_per_node=min(world_size, PLANNER_RANKS_PER_NODE),
                            host_mem_bytes=int(PLANNER_HOST_GIB * GIB),
                            capacity_source=f"memory.host_mem_gib unset: the planner assumes {PLANNER_HOST_GIB:g}, a "
                                            "DGX H100/H200 node's MemTotal derived from its 2,048 GiB, not measured")
    return dataclasses.replace(host, offload_pool_bytes=step.host_peak_bytes)


def max_context(source: ConfigSource, world_size: int, vocab_size: int, strategy: str, gpu_mem_bytes: int,
                margins: Margins = Margins(), limit: int = 64 * 1024 * 1024, log=print,
                jobs: int = 1) -> tuple[int, list[Estimate]]:
    """Longest multiple of 128K tokens that fits (0 if none), and every estimate made.

    Peak memory grows with the sequence length, almost linearly (every activation term is linear in it; the
    deciding moment may switch, which bends the line upwards). So: simulate 128K and 2M, aim where the line through
    them meets the GPU's memory, gallop up from there until a length does not fit, then narrow the bracket by false
    position (aim with the line through its ends, check the step above a fitting aim). The answer is proven by
    simulations on both sides (it fits, 128K more does not): usually four to six in all."""
    seen: list[Estimate] = []
    memo: dict[int, Estimate] = {}

    def peak(k: int) -> Estimate:
        if k not in memo:
            est = estimate(source, world_size, vocab_size, strategy, k * CONTEXT_STEP, gpu_mem_bytes, margins,
                           jobs=jobs)
            memo[k] = est
            seen.append(est)
            log(f"  {strategy:>10} {k * CONTEXT_STEP:>10} tokens: {est.peak_bytes / GIB:7.1f} GiB "
                f"{'fits' if est.fits else 'does not fit'}")
        return memo[k]

    def fits(k: int) -> bool:
        return peak(k).fits

    top = max(1, limit // CONTEXT_STEP)
    if not fits(1):
        return 0, seen
    if top == 1:
        return CONTEXT_STEP, seen

    def aim(a: int, b: int) -> int:
        """Where the line through the simulated lengths a < b meets the GPU memory (in 128K steps)."""
        slope = (peak(b).peak_bytes - peak(a).peak_bytes) / (b - a)
        return top if slope <= 0 else a + int((gpu_mem_bytes - peak(a).peak_bytes) // slope)

    probe = min(top, 16)
    lo, hi = (probe, None) if fits(probe) else (1, probe)  # lo fits; hi does not (None: none found yet)
    if hi is None:  # gallop up from the aimed length until a length does not fit (or the limit)
        k, step = min(top, max(lo + 1, aim(1, lo))), 1
        while hi is None:
            if fits(k):
                lo, step = k, step * 2
                if k == top:
                    return top * CONTEXT_STEP, seen
                k = min(top, k + step)
            else:
                hi = k
    while hi - lo > 1:  # false position: aim inside the bracket, then check the step above a fitting aim
        k = min(max(aim(lo, hi), lo + 1), hi - 1)
        if not fits(k):
            hi = k
            continue
        lo = k
        if lo + 1 < hi:
            if fits(lo + 1):
                lo += 1
            else:
                hi = lo + 1
    return lo * CONTEXT_STEP, seen


def write_json(path: str, max_ctx: dict[str, int], results: list[Estimate], extra: dict | None = None,
               world_size: int = 1, hw: Hardware | None = None) -> None:
    with open(path, "w") as f:
        json.dump((extra or {}) | {"max_context": max_ctx, "results": [
            {"strategy": r.strategy, "seq_length": r.seq_length, "peak_bytes": r.peak_bytes, "fits": r.fits,
             "breakdown": r.breakdown, "host_bytes": r.host_bytes, "host_breakdown": r.host_breakdown,
             "host_bytes_per_node": r.host_bytes_per_node, "host_mem_bytes": r.host_mem_bytes,
             "host_fits": r.host_fits, "tracked_bytes": r.tracked_bytes,
             "device_bytes": r.device_bytes, "work": r.work, "tokens_per_step": r.tokens_per_step,
             **({"step_time": step_time(r, world_size, hw).to_dict()} if hw is not None else {})}
            for r in results]}, f, indent=1)


def plot(path: str, results: list[Estimate], gpu_mem_bytes: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.strategy for r in results):
        pts = sorted((r.seq_length, r.peak_bytes) for r in results if r.strategy == name)
        ax.plot([p[0] / 2**20 for p in pts], [p[1] / GIB for p in pts], marker="o", label=name)
    ax.axhline(gpu_mem_bytes / GIB, color="black", linestyle="--", label="HBM")
    ax.set_xlabel("context length (M tokens)")
    ax.set_ylabel("peak memory per GPU (GiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_named(est: Estimate) -> str:
    """The large buffers alive at the deciding peak, grouped by category and allocation site, largest first."""
    groups: dict[tuple[str, str], list[int]] = {}
    for category, site, nbytes in est.named:
        groups.setdefault((category, site), []).append(nbytes)
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    return "\n".join(f"    {sum(b) / GIB:7.2f} GiB  {len(b):3d} x {max(b) / GIB:6.2f}  {c:<12} {site}"
                     for (c, site), b in rows)


def format_breakdown(est: Estimate) -> str:
    parts = [f"{k} {v / GIB:.2f}" for k, v in sorted(est.breakdown.items(), key=lambda kv: -kv[1]) if v]
    host = (f"; host {est.host_bytes / GIB:.2f} GiB per rank ("
            + ", ".join(f"{k} {v / GIB:.2f}" for k, v in est.host_breakdown.items() if v)
            + f"), {est.host_bytes_per_node / GIB:.1f} GiB per node of {est.host_mem_bytes / GIB:.0f}"
            + ("" if est.host_fits else " - host does NOT fit")) if est.host_bytes else ""
    return f"{est.strategy} @ {est.seq_length}: {est.peak_bytes / GIB:.2f} GiB ({', '.join(parts)}){host}"

