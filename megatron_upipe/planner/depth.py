"""A deep model's step from two shallow simulations: every memory term is affine in the number of layers.

The layers of a Llama are identical, and so is what one more layer adds to rank 0's step: its parameters,
gradients and optimizer states (device), its offloaded input (host), and nothing else at the deciding moments —
the activation peak happens inside one layer's recomputed forward/backward, whatever the depth (with
memory.offload_optimizer_states the moment the parked states come back is a second line, `states_back_bytes`,
extrapolated on its own: the planner takes the larger of the two at the planned depth). So with
stage depths a < b (layers per pipeline stage) simulated, a quantity q at depth L is
q(b) + (L - b) * (q(b) - q(a)) / (b - a). Holds only from the depth at which the per-layer pattern is
periodic: megatron-core's DDP buckets of ~40M elements (several per 8B layer) are; a sharded wrapper whose queue or
prefetch spans k layers needs a > k (`base_depth`). tests/test_planner_depth.py checks the extrapolation against
the full simulation; the tuple of named buffers is the deeper simulation's (named buffers of one more layer's
model states are not listed).

With memory.recompute_layers = N < L (megatron-core's block method: the first N layers of a stage recomputed, the
other K = L - N keeping their activations) the layers are of two kinds, and a quantity is affine in each count: N
inputs held (device or host) and K layers' activations, all alive when the backward starts in the kept layers.
Three simulations, at (N, K) = (a, 2), (a + 1, 2) and (a, 3), give q(N, K) = q(a, 2) + (N - a) * dN + (K - 2) * dK.
Two kept layers at least, so that the peak sits in the kept layers in all three (with one, the recomputed layer's
own backward can be as large).

The disk tier (memory.offload_disk_layers = n) is not a per-layer quantity: the first n layer inputs of each forward
go to files instead of the host pool, and the device sees no difference (tests/test_offload_recompute.py). A deep
step with it is extrapolated from shallow simulations without it (whose depth may be below n), then the pool is
n layer inputs smaller and n are written and read per micro-batch (`_with_disk`; tests/test_disk_tier.py checks it
against the full simulation).

Legend: L layers per stage of the planned config (model.num_layers / parallel.pp).
"""

from __future__ import annotations

import dataclasses

from megatron_upipe.config import Config, validate
from megatron_upipe.planner.simulate import StepMemory, preload, simulate_step
from megatron_upipe.planner.workers import run_all

_LINEAR_INTS = ("peak_bytes", "host_peak_bytes", "model_state_bytes", "num_parameters", "attention_peak_bytes",
                "states_back_bytes")
_LINEAR_DICTS = ("breakdown", "attention_peak_breakdown", "work",  # work: FLOPs and bytes grow by a layer's
                 "states_back_breakdown")


def layers_per_stage(config: Config, world_size: int) -> int:
    return validate(config, world_size).arch.num_layers // config.parallel.pp


def with_depth(config: Config, depth: int, recompute_layers: int | None = None) -> Config:
    """`config` with `depth` layers per pipeline stage (and memory.recompute_layers as given)."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=depth * config.parallel.pp),
                               memory=dataclasses.replace(config.memory, recompute_layers=recompute_layers))


def extrapolate(shallow: StepMemory, deeper: StepMemory, a: int, b: int, depth: int) -> StepMemory:
    """The step at `depth` layers per stage from simulations at a < b layers (see the module docstring)."""
    if not 0 < a < b <= depth:
        raise ValueError(f"extrapolation needs 0 < a < b <= depth, got a={a}, b={b}, depth={depth}")

    def line(qa: int, qb: int) -> int:
        return qb + (depth - b) * (qb - qa) // (b - a)

    ints = {k: line(getattr(shallow, k), getattr(deeper, k)) for k in _LINEAR_INTS}
    dicts = {}
    for k in _LINEAR_DICTS:
        da, db = getattr(shallow, k) or {}, getattr(deeper, k) or {}
        dicts[k] = {c: line(da.get(c, 0), db.get(c, 0)) for c in {**da, **db}} if da or db else getattr(deeper, k)
    return dataclasses.replace(deeper, **ints, **dicts)


def extrapolate_two_kinds(base: StepMemory, more_recomputed: StepMemory, more_kept: StepMemory, a: int,
                          recomputed: int, kept: int) -> StepMemory:
    """The step with `recomputed` + `kept` layers per stage from simulations at (a, 2), (a + 1, 2) and (a, 3)
    (see the module docstring)."""
    if not (0 < a <= recomputed and 2 <= kept):
        raise ValueError(f"two-kind extrapolation needs 0 < a <= recomputed and kept >= 2, got a={a}, "
                         f"recomputed={recomputed}, kept={kept}")

    def plane(q0: int, qn: int, qk: int) -> int:
        return q0 + (recomputed - a) * (qn - q0) + (kept - 2) * (qk - q0)

    ints = {k: plane(getattr(base, k), getattr(more_recomputed, k), getattr(more_kept, k)) for k in _LINEAR_INTS}
    dicts = {}
    for k in _LINEAR_DICTS:
        d0, dn, dk = (getattr(x, k) or {} for x in (base, more_recomputed, more_kept))
        dicts[k] = {c: plane(d0.get(c, 0), dn.get(c, 0), dk.get(c, 0)) for c in {**d0, **dn, **dk}} \
            if d0 or dn or dk else getattr(more_kept, k)
    return dataclasses.replace(more_kept, **ints, **dicts)


def simulations(calls: list[tuple], jobs: int, memo: dict | None) -> list[StepMemory]:
    """simulate_step(*call) for each call, side by side in forked workers when jobs > 1 (workers.py). `memo` (kept
    by the caller across estimates, keyed by the call's repr) answers a call simulated before without simulating it
    again: the stacks of one search share shallow simulations (every partial-recompute rung of one ladder, U and
    overlap simulates the same three shallow models)."""
    memo = {} if memo is None else memo
    keys = [repr(call) for call in calls]
    todo = {k: call for k, call in zip(keys, calls) if k not in memo}
    if jobs > 1 and len(todo) > 1:
        preload()
    memo.update(zip(todo, run_all(simulate_step, list(todo.values()), jobs)))
    return [memo[k] for k in keys]


def simulate_deep(config: Config, world_size: int, vocab_size: int, named_bytes: int = 0,
                  base_depth: int = 2, jobs: int = 1, memo: dict | None = None) -> StepMemory:
    """simulate_step of `config`, from simulations at base_depth and base_depth + 1 layers per stage when the
    model is deeper than base_depth + 2 (else the full simulation); with jobs > 1 the two run side by side in
    forked workers (workers.py); `memo`: see `simulations`. With memory.recompute_layers below the stage's depth:
    three simulations of two kinds of layer (module docstring)."""
    depth = layers_per_stage(config, world_size)
    m = config.memory
    if m.offload_disk_layers and depth > base_depth + 2:  # extrapolated without the disk tier, then moved to it
        plain = dataclasses.replace(config, memory=dataclasses.replace(m, offload_disk_layers=0))
        return _with_disk(simulate_deep(plain, world_size, vocab_size, named_bytes, base_depth, jobs, memo), config,
                          plain, world_size)
    if m.recompute_layers is not None and m.recompute_layers < depth:
        return _simulate_two_kinds(config, world_size, vocab_size, named_bytes, base_depth, jobs, depth, memo)
    config = with_depth(config, depth)  # recompute_layers >= depth: every layer, as null
    if m.shard_model_states:  # Megatron-FSDP gathers the computing layer and prefetches one (fsdp_communication_unit
        base_depth = max(base_depth, 3)  # =layer): periodic from 3 layers
    a, b = base_depth, base_depth + 1
    # with megatron-core's communication unit (1e9 elements) it queues / prefetches a fixed number of elements:
    # several layers of a large model but every layer of a shallow one, never periodic from a shallow depth
    if depth <= b + 1 or (m.shard_model_states and m.fsdp_communication_unit == "megatron"):
        return simulations([(config, world_size, vocab_size, named_bytes)], jobs, memo)[0]
    shallow, deeper = simulations([(with_depth(config, a), world_size, vocab_size, 0),
                                   (with_depth(config, b), world_size, vocab_size, named_bytes)], jobs, memo)
    return extrapolate(shallow, deeper, a, b, depth)


def _with_disk(step: StepMemory, config: Config, plain: Config, world_size: int) -> StepMemory:
    """`step` (planned with `plain`, `config` without the disk tier) with memory.offload_disk_layers layer inputs
    moved to it: the pool and disk bytes as host_budget plans them, written and read once per micro-batch."""
    from megatron_upipe.memory_switches.host_budget import disk_bytes, offload_pool_bytes

    plan = validate(config, world_size)
    width = 2 if config.train.bf16 is not False else 4
    moved, work = disk_bytes(config, plan, width) * plan.num_microbatches, dict(step.work or {})
    work["bytes:disk_write"] = work.get("bytes:disk_write", 0) + moved
    work["bytes:disk_read"] = work.get("bytes:disk_read", 0) + moved
    pool_cut = offload_pool_bytes(plain, plan, width) - offload_pool_bytes(config, plan, width)
    return dataclasses.replace(step, host_peak_bytes=step.host_peak_bytes - pool_cut, work=work)


def _simulate_two_kinds(config: Config, world_size: int, vocab_size: int, named_bytes: int, base_depth: int,
                        jobs: int, depth: int, memo: dict | None) -> StepMemory:
    m = config.memory
    a = max(base_depth, 3) if m.shard_model_states else base_depth
    recomputed, kept = m.recompute_layers, depth - m.recompute_layers
    if recomputed < a or kept < 2 or depth <= a + 4:  # too shallow to extrapolate: simulate it whole
        return simulations([(config, world_size, vocab_size, named_bytes)], jobs, memo)[0]
    runs = [(with_depth(config, r + k, r), world_size, vocab_size, named_bytes if (r, k) == (a, 3) else 0)
            for r, k in ((a, 2), (a + 1, 2), (a, 3))]
    base, more_recomputed, more_kept = simulations(runs, jobs, memo)
    return extrapolate_two_kinds(base, more_recomputed, more_kept, a, recomputed, kept)
