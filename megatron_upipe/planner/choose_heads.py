"""`parallel.upipe_heads_per_stage=auto`: the fastest legal U whose plan fits device and host.

U trades memory for speed: the head-proportional attention buffers scale with U/C, while every stage costs its own
kernel calls and all-to-all calls. The step-time model (step_time.py) prices exactly that: the same FLOPs at every U
and, for a smaller U, more all-to-all calls (and as many or more bytes), so with serial stages its time never falls
as U shrinks (tests/test_step_time.py checks it over every legal U), and the largest U that fits is the fastest that
fits: `choose_heads_per_stage` simulates the legal U values from the largest down with the memory planner
(`estimate`: device and host) and takes the first that fits. With pipelined stages (memory.upipe_overlap true or
"outputs") that no longer holds: all but one stage's all-to-all hides under the attention kernels (or its result
under the next stage's projections), so more stages can be faster; then every legal U is planned and the fitting U
with the most tokens/s by the model is taken (the largest on a tie, or when the GPU model has no stated speed
constants). If none fits, it says by how much the smallest misses.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_upipe.attention import legal_heads_per_stage
from megatron_upipe.config import ConfigError, validate
from megatron_upipe.planner.estimate import GIB, ConfigSource, Estimate, estimate, step_time
from megatron_upipe.planner.step_time import Hardware


@dataclass(frozen=True)
class HeadsChoice:
    heads_per_stage: int
    reason: str
    tried: tuple[tuple[int, int, bool], ...]  # (U, planned peak bytes per GPU, fits device and host), as simulated
    estimate: Estimate  # the chosen U's plan

    def to_dict(self) -> dict:
        return {"heads_per_stage": self.heads_per_stage, "reason": self.reason,
                "tried": [{"U": u, "peak_bytes": b, "fits": f} for u, b, f in self.tried]}


def choose_heads_per_stage(source: ConfigSource, world_size: int, vocab_size: int, gpu_mem_bytes: int, margins,
                           jobs: int = 1, gpu_name: str = "the GPU", hw: Hardware | None = None) -> HeadsChoice:
    """The fastest legal U of `source`'s UPipe layout whose plan fits (module docstring); ConfigError when none
    does."""
    config = source.load()
    plan = validate(config, world_size)
    legal = legal_heads_per_stage(plan.local_heads, plan.local_kv_heads, config.parallel.cp_a2a)
    seq = config.train.seq_length
    by_time = config.memory.upipe_overlap and hw is not None
    tried, fitting = [], []  # fitting: (tokens/s or 0, U, estimate)
    for U in sorted(legal, reverse=True):
        est = estimate(source, world_size, vocab_size, f"upipe:{U}", seq, gpu_mem_bytes, margins, jobs=jobs)
        tried.append((U, est.peak_bytes, est.fits))
        if est.fits:
            fitting.append((0.0 if hw is None else step_time(est, world_size, hw).tokens_per_s_per_gpu, U, est))
            if not by_time:
                break
    if not fitting:
        U, peak, _ = tried[-1]
        raise ConfigError(f"parallel.upipe_heads_per_stage=auto: no legal U ({', '.join(map(str, legal))}) fits "
                          f"{gpu_name} at train.seq_length={seq}: the smallest, U={U}, plans {peak / GIB:.2f} GiB of "
                          f"{gpu_mem_bytes / GIB:.2f} (or exceeds the host memory); shorten train.seq_length, add "
                          f"memory switches (memory.recompute=full, memory.offload_checkpoints, ...) or use more GPUs")
    speed, U, est = max(fitting, key=lambda f: (f[0], f[1]))  # the most tokens/s, then the largest U
    larger = [(u, b) for u, b, fits in tried if u > U and not fits]
    too_big = "" if not larger else \
        f"; larger U do not fit ({', '.join(f'U={u}: {b / GIB:.2f} GiB' for u, b in larger)})"
    host = f", host {est.host_bytes_per_node / GIB:.0f} of {est.host_mem_bytes / GIB:.0f} GiB per node" \
        if est.host_mem_bytes else ""
    n = plan.local_heads // U
    model = "" if hw is None else f"; step-time model: {speed:.0f} tokens/s per GPU"
    if by_time:
        others = ", ".join(f"U={u}: {t:.0f}" for t, u, _ in fitting if u != U)
        why = (f"the fastest legal U whose plan fits {gpu_name} at {seq} tokens by the step-time model with pipelined "
               f"stages{f' (others that fit, tokens/s per GPU: {others})' if others else ''}")
    else:
        why = f"the largest legal U whose plan fits {gpu_name} at {seq} tokens, the fastest that fits"
    return HeadsChoice(U, f"U={U} ({n} stage{'s' if n > 1 else ''}): {why} ({est.peak_bytes / GIB:.2f} of "
                          f"{gpu_mem_bytes / GIB:.2f} GiB{host}{model}){too_big}", tuple(tried), est)
