"""Rank 0's training step at full scale, without memory: fake tensors, a fake process group, the real code.

`simulate_step(config, world_size)` builds the model, wrapper (megatron-core DDP, or Megatron-FSDP with
memory.shard_model_states) and optimizer of pipeline stage 0 exactly as `pretrain_llama.py` does (same builders),
under fake tensors (fake_mode.py: torch's FakeTensorMode, with bookkeeping kept real and the tracker fed by it) and
torch's fake process group of `world_size` ranks (compat/fsdp.py: what Megatron-FSDP
needs there), then runs a steady-state training step inside a storage tracker: Adam's moments exist (as after the
first update), Megatron-FSDP is in the state its first backward leaves (compat.fsdp.steady_state) and megatron-core's
forward/backward schedule runs over every micro-batch. The update itself is not
run (it reads the gradient norm with .item(), which fake tensors cannot answer); with a fused Adam
(TransformerEngine/apex on GPU) it allocates no full-size temporaries. The model states made during the build are registered
with the tracker as such; everything the step allocates is attributed by the Python stack at allocation time.

Categories: params, grads, optimizer (fp32 main weights and Adam moments), checkpoints (transformer-layer inputs
alive: the recompute checkpoints), attention, mlp, loss (LM head, cross-entropy), norms, embedding, Megatron-FSDP's
unsharded buckets ("fsdp: gathered params", "fsdp: grad buckets": its all-gathered compute weights and the fp32
gradient buckets waiting for their reduce-scatter; sharded model states count as params/grads/optimizer), other.
Host memory (offloaded checkpoints) comes from the offloader's ledger. Kernel workspaces the tracker cannot see
are added by the caller (estimate.py). Must run in a process without a process group.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_upipe.config import Config, validate
from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker
from megatron_upipe.memory_switches.optimizer_parking import torch_optimizers
from megatron_upipe.memory_switches.sharding import local_part
from megatron_upipe.planner.fake_mode import PlannerFakeMode
from megatron_upipe.planner.step_time import WorkCounter

FSDP_GATHERED = "fsdp: gathered params"
FSDP_GRAD_BUCKETS = "fsdp: grad buckets"
# (path fragment, category), matched against "file:function" of the allocating call's frames, innermost outwards.
_STACK_RULES = (
    ("megatron_upipe/attention/", "attention"),
    ("megatron_upipe/models/upipe_attention.py", "attention"),
    ("megatron/core/transformer/attention.py", "attention"),
    ("megatron_upipe/models/tiled_mlp.py", "mlp"),
    ("megatron/core/transformer/mlp.py", "mlp"),
    ("megatron_upipe/models/chunked_loss.py", "loss"),
    ("cross_entropy.py", "loss"),
    ("megatron/core/models/gpt/gpt_model.py", "loss"),
    ("megatron_upipe/models/norm.py", "norms"),
    ("megatron_upipe/models/tiled_norm.py", "norms"),
    ("language_model_embedding.py", "embedding"),
    ("megatron/core/optimizer/", "optimizer"),
    # Megatron-FSDP's just-in-time buckets (fragments "file:function"): unsharded compute weights all-gathered for
    # a forward/backward, unsharded fp32 gradient buckets waiting for their reduce-scatter
    ("megatron_fsdp/param_and_grad_buffer.py:async_bucket_gather", FSDP_GATHERED),
    ("megatron_fsdp/param_and_grad_buffer.py:main_grad_getter", FSDP_GRAD_BUCKETS),
    ("megatron_fsdp/param_and_grad_buffer.py:_bucket_group_gradient_reduce", FSDP_GRAD_BUCKETS),
)
CATEGORIES = ("params", "grads", "optimizer", "checkpoints", "attention", "mlp", "loss", "norms", "embedding",
              FSDP_GATHERED, FSDP_GRAD_BUCKETS, "other")


def classify_by_stack(_func) -> str:
    frame = sys._getframe(2)
    while frame is not None:
        where = f"{frame.f_code.co_filename}:{frame.f_code.co_name}"
        for fragment, category in _STACK_RULES:
            if fragment in where:
                return category
        frame = frame.f_back
    return "other"


@dataclass(frozen=True)
class StepMemory:
    peak_bytes: int  # device: model states + activations at the step's peak (no workspace, no margins)
    breakdown: dict[str, int]  # category -> bytes alive at the peak
    host_peak_bytes: int  # offloaded checkpoints: the offloader's host pool as allocated
    model_state_bytes: int
    seq_length: int
    num_parameters: int  # this rank's stage
    attention_peak_bytes: int = 0  # most bytes alive at an allocation of the attention op
    attention_peak_breakdown: dict | None = None
    peak_named: tuple = ()  # (category, allocation site, bytes) of the large storages alive at the peak
    attention_peak_named: tuple = ()
    # the forward/backward schedule's work, counted on the fake run (planner/step_time.py WorkCounter.totals):
    # FLOPs, collective bytes and calls; empty for a step on real tensors
    work: dict | None = None
    # memory.offload_optimizer_states: bytes alive when the parked states are back on the device after the backward
    # (a peak of its own, not in peak_bytes: the planner takes the larger) and what they are by category
    states_back_bytes: int = 0
    states_back_breakdown: dict | None = None


def _layout(config: Config, plan):
    from megatron_upipe.training.setup import layout_of  # the training job's, so both run the same layout

    return layout_of(config, plan)


def _retag_layer_inputs(model, tracker: PeakMemoryTracker):
    """Forward pre-hooks: each transformer layer's input storage is counted as a checkpoint from then on."""
    handles = []
    for name, module in model.named_modules():
        if type(module).__name__ == "TransformerLayer":
            def pre(mod, args, kwargs):
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                if isinstance(hidden, torch.Tensor):
                    tracker.retag(hidden, "checkpoints")
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    return handles


_NOT_SITES = ("megatron_upipe/compat/", "megatron_upipe/memory_accounting/tracker.py",
              "megatron_upipe/planner/fake_mode.py")


def allocation_site() -> str:
    """'file.py:line function' of the innermost frame in megatron_upipe or megatron-core (the CPU shims of
    megatron_upipe.compat and the tracking machinery skipped), else the autograd engine."""
    frame = sys._getframe(3)
    while frame is not None:
        name = frame.f_code.co_filename
        if ("megatron_upipe/" in name or "megatron/core/" in name) and not any(part in name for part in _NOT_SITES):
            return f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "autograd engine"


class StorageTracker(PeakMemoryTracker):
    """A PeakMemoryTracker that also follows in-place storage resizes (`resized`, fed by compat.fsdp.storage_resizes:
    Megatron-FSDP frees and re-allocates its unsharded buckets that way) and can count one storage under several
    categories (`track_split`: Megatron-FSDP keeps the fp32 main weights and main gradients in one buffer)."""

    def __init__(self, classify=None) -> None:
        super().__init__(classify=classify)
        self._bytes: dict[int, int] = {}  # storage key -> bytes counted now
        self._split: dict[int, dict[str, int]] = {}  # storage key -> bytes counted under other categories

    def _free(self, key: int, nbytes: int) -> None:
        nbytes = self._bytes.pop(key, nbytes)
        primary = self._seen.get(key, "all")
        for category, part in self._split.pop(key, {}).items():
            self.live_by_category[category] -= part
            self.live_by_category[primary] += part
        super()._free(key, nbytes)

    def track(self, t, name="external", category=None) -> None:
        st = t.untyped_storage()
        new = st._cdata not in self._seen
        super().track(t, name, category)
        if new:
            self._bytes[st._cdata] = st.nbytes()

    def track_split(self, t, split: dict[str, int]) -> None:
        """Count t's storage (if new) under split's categories: the first takes what the others leave."""
        key = t.untyped_storage()._cdata
        if key in self._seen:
            return
        primary, *_ = split
        rest = {c: b for c, b in split.items() if c != primary and b}
        self.track(t, category=primary)
        for category, part in rest.items():
            self.live_by_category[primary] -= part
            self.live_by_category[category] += part
        self._split[key] = rest
        if self.classify is not None and self.peak_bytes == self.live_bytes:
            self.peak_breakdown = {k: v for k, v in self.live_by_category.items() if v}

    def resized(self, t) -> None:
        """t's storage changed size in place: count its new size (a storage first seen now is tracked now)."""
        st = t.untyped_storage()
        key, now = st._cdata, st.nbytes()
        if key not in self._seen:
            if now:
                self.track(t)
            return
        delta, self._bytes[key] = now - self._bytes[key], now
        self.live_bytes += delta
        self.live_by_category[self._seen[key]] += delta
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            if self.classify is not None:
                self.peak_breakdown = {k: v for k, v in self.live_by_category.items() if v}


class _PlannerTracker(StorageTracker):
    """Also remembers the most bytes alive at any allocation made by the attention op: kernel workspace that the
    tracker cannot see (attention backward) adds to that moment, not to the step's peak elsewhere. Storages of at
    least `named_bytes` get a name (category, allocation site) and the named ones alive at both peaks are kept:
    the planner's answer to "which buffers decide the peak"."""

    def __init__(self, named_bytes: int = 0) -> None:
        super().__init__(classify=classify_by_stack)
        self.attention_peak_bytes = 0
        self.attention_peak_breakdown: dict[str, int] = {}
        self.named_bytes = named_bytes
        self._named: dict[int, tuple[str, str, int]] = {}  # storage key -> (category, site, bytes)
        self.peak_named: list[tuple[str, str, int]] = []
        self.attention_peak_named: list[tuple[str, str, int]] = []
        self._sites: dict[int, str] = {}  # allocation site of a storage resized in place (kept while it is empty)

    def _free(self, key: int, nbytes: int) -> None:
        self._named.pop(key, None)
        super()._free(key, nbytes)

    def track(self, t, name="external", category=None) -> None:
        st = t.untyped_storage()
        key, new = st._cdata, st._cdata not in self._seen
        peak_before = self.peak_bytes
        super().track(t, name, category)
        if new and self.named_bytes and st.nbytes() >= self.named_bytes:
            self._named[key] = (self._seen[key], allocation_site() if name != "external" or category is None
                                else f"model state ({category})", st.nbytes())
        if self.named_bytes and self.peak_bytes > peak_before:
            self.peak_named = list(self._named.values())
        if self._seen.get(key) == "attention" and self.live_bytes > self.attention_peak_bytes:
            self.attention_peak_bytes = self.live_bytes
            self.attention_peak_breakdown = {k: v for k, v in self.live_by_category.items() if v}
            if self.named_bytes:
                self.attention_peak_named = list(self._named.values())

    def retag(self, t, category: str) -> None:
        super().retag(t, category)
        key = t.untyped_storage()._cdata
        if key in self._named:
            self._named[key] = (category, *self._named[key][1:])

    def resized(self, t) -> None:
        st = t.untyped_storage()
        key, now, peak_before = st._cdata, st.nbytes(), self.peak_bytes
        known = key in self._seen
        super().resized(t)
        if not (self.named_bytes and known):
            return
        if key in self._named:
            self._sites[key] = self._named[key][1]
        if now < self.named_bytes:
            self._named.pop(key, None)
        else:
            self._named[key] = (self._seen[key], self._sites.get(key) or allocation_site(), now)
        if self.peak_bytes > peak_before:
            self.peak_named = list(self._named.values())


def build_rank(config: Config, plan, layout, pg, vocab_size: int, *, bf16: bool, planning: bool):
    """This rank's stage, wrapped model and optimizer, built as the training job builds them (on real or fake
    tensors alike): (stage, ddp, optimizer)."""
    from megatron_upipe.models.llama import build_llama, llama_transformer_config
    from megatron_upipe.training.optim import build_optimizer, wrap_model

    recompute = None if config.memory.recompute == "none" else config.memory.recompute
    tconfig = llama_transformer_config(plan.arch, layout, dtype=torch.bfloat16 if bf16 else torch.float32,
                                       init_method_std=config.model.init_method_std, recompute_granularity=recompute,
                                       recompute_layers=config.memory.recompute_layers)
    stage = build_llama(plan.arch, layout, pg, vocab_size=vocab_size, config=tconfig,
                        attention_kernel=_planned_kernel(config) if planning else config.model.attention_kernel,
                        **_memory_kwargs(config, plan, bf16))
    with _fake_world() if planning else nullcontext():
        ddp = wrap_model(stage.model, tconfig, config, float16_module=not planning)
        optimizer, _ = build_optimizer(ddp, tconfig, config, planning=planning)
    return stage, ddp, optimizer


def step_batch(config: Config, plan) -> dict:
    """One micro-batch of this rank's shape: tokens and labels [b, s/cp] (zeros), positions, loss mask; with packed
    documents one document spanning the sequence."""
    b, s = plan.micro_batch_size, plan.seq_per_cp_rank
    tokens = torch.zeros(b, s, dtype=torch.long)
    batch = {"tokens": tokens, "labels": tokens, "position_ids": torch.arange(s).expand(b, s),
             "loss_mask": torch.ones(b, s)}
    if config.data.document_mask:  # packed documents: one spanning the sequence (the batch's positions are its)
        batch["cu_seqlens"] = torch.tensor([0, plan.seq_length], dtype=torch.int32)  # [2], on the host
    return batch


def forward_backward_step(ddp, plan, batch: dict) -> None:
    """The step's forward/backward schedule over plan.num_microbatches copies of `batch` (no optimizer step)."""
    from megatron_upipe.step import forward_backward

    forward_backward(ddp, iter([batch] * plan.num_microbatches), num_microbatches=plan.num_microbatches,
                     seq_length=plan.seq_length, micro_batch_size=plan.micro_batch_size, forward_only=False)


def measure_step(config: Config, plan, layout, pg, vocab_size: int, *, bf16: bool, planning: bool,
                 named_bytes: int = 0, fake: PlannerFakeMode | None = None) -> StepMemory:
    """Build this rank's stage as the training job does and track one step (on real or fake tensors alike; under
    `fake`, the running PlannerFakeMode, the tracker is fed by it)."""
    from megatron_upipe.compat.fsdp import steady_state
    from megatron_upipe.memory_switches.optimizer_parking import for_optimizer, parked
    from megatron_upipe.memory_switches.sharding import is_fully_sharded

    stage, ddp, optimizer = build_rank(config, plan, layout, pg, vocab_size, bf16=bf16, planning=planning)
    if is_fully_sharded(ddp):
        steady_state(ddp)  # as after the first backward: the run's first micro-batch alone prefetches more
    mem = _PlannerTracker(named_bytes)
    with tracked_step(mem, stage.model, ddp, optimizer, fake) as state_bytes:
        moments = _materialise_adam(mem, optimizer)  # alive through every step after the first
        state_bytes += sum(m.untyped_storage().nbytes() for m in moments)
        handles = _retag_layer_inputs(stage.model, mem)
        batch = step_batch(config, plan)
        counter = WorkCounter(tp_group=pg.tp.group_name if layout.tp > 1 else None)
        parking = for_optimizer(ddp, stage.model, optimizer, copy=fake is None, extra=moments) \
            if config.memory.offload_optimizer_states else None
        with parked(parking, mem.resized):  # freed before the forward, back after the backward
            with _fake_world() if planning else nullcontext(), fake.counting(counter) if fake else nullcontext():
                forward_backward_step(ddp, plan, batch)
            parked_bytes = parking.parked_bytes if parking else 0
            peak, breakdown = mem.peak_bytes, dict(mem.peak_breakdown)  # the forward/backward's
        back = (mem.live_bytes, {k: v for k, v in mem.live_by_category.items() if v}) if parking else (0, None)
        for h in handles:
            h.remove()
        del moments
    n_params = sum(p.numel() for p in stage.model.parameters())
    work = {**counter.totals, **_offload_work(stage)} if fake else None
    if work is not None and parking is not None:  # to the host before the forward and back after the backward
        work["bytes:optimizer_parking"] = 2 * parked_bytes
    step = StepMemory(peak, breakdown, _host_peak(stage), state_bytes, plan.seq_length,
                      n_params, mem.attention_peak_bytes, dict(mem.attention_peak_breakdown),
                      tuple(mem.peak_named), tuple(mem.attention_peak_named), work, *back)
    return step


def preload() -> None:
    """Import what a simulation imports on first use (before forking workers, which then need not)."""
    import megatron.core.distributed.param_and_grad_buffer  # noqa: F401
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    import megatron_upipe.attention.kernels  # noqa: F401
    import megatron_upipe.compat.fsdp as fsdp
    import megatron_upipe.memory_switches.offload  # noqa: F401
    import megatron_upipe.memory_switches.sharding  # noqa: F401
    import megatron_upipe.models.llama  # noqa: F401
    import megatron_upipe.parallel  # noqa: F401
    import megatron_upipe.step  # noqa: F401
    import megatron_upipe.training.build  # noqa: F401
    import megatron_upipe.training.optim  # noqa: F401

    fsdp._fsdp_buffer_module()
    _freeze_long_lived()  # the workers inherit it (and share these pages instead of copying them on collection)


def simulate_step(config: Config, world_size: int, vocab_size: int, named_bytes: int = 0) -> StepMemory:
    """Peak memory of rank 0 for one training step of `config` on `world_size` GPUs (bf16 unless train.bf16=false).
    Storages of at least `named_bytes` (0: none) are named by allocation site in the result."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_upipe.compat.cpu import install_cpu_patches
    from megatron_upipe.parallel import destroy_parallel, initialize_parallel

    if dist.is_initialized():
        raise RuntimeError("simulate_step needs a process without a process group (it creates a fake one)")
    _freeze_long_lived()
    # The same simulation on a GPU machine as on the CPU machines that test it: without this, megatron-core there
    # makes the linear weights as (fake) CUDA tensors and the local norms on the CPU, and its optimizer refuses them.
    install_cpu_patches(force=True)
    plan = validate(config, world_size)
    layout = _layout(config, plan)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        pg = initialize_parallel(layout, seed=config.train.seed, gloo_groups=False)
        with PlannerFakeMode() as fake:  # a GPU plan: train.bf16=auto means bf16 there
            return measure_step(config, plan, layout, pg, vocab_size, bf16=config.train.bf16 is not False,
                                planning=True, named_bytes=named_bytes, fake=fake)
    finally:
        destroy_parallel()
        dist.destroy_process_group()


def _freeze_long_lived() -> None:
    """At each simulation's start (and before workers fork: `preload`): collect, then move every object still alive
    (torch's, megatron-core's, the imports', the caller's and FakeTensorMode's caches from earlier simulations) to the
    garbage collector's permanent generation (gc.freeze). Megatron-FSDP calls gc.collect() each time it builds its
    buffers, and every full collection, its own and the automatic ones, would walk them again. Nine tiny-model
    estimates in one process took 14.8 s of CPU unfrozen and 11.8 s so, at the same peak RSS. (The check this
    replaced, freeze once while nothing is frozen, never froze: this Python 3.12 starts with 375 objects frozen.)
    The cycle collector never frees a frozen object (its reference count still does); only what is alive after a
    collection is frozen."""
    import gc

    gc.collect()
    gc.freeze()


@contextmanager
def _fake_world():
    """What megatron-core's wrappers need under fake tensors and the fake process group (compat.fsdp): object
    collectives of symmetric ranks, bucket collectives issued one by one (DDP's and Megatron-FSDP's buffers), and
    Megatron-FSDP's module.to of fake parameters skipped."""
    import megatron.core.distributed.param_and_grad_buffer as ddp_buffers

    from megatron_upipe.compat.fsdp import fake_tensor_fsdp, one_by_one_collectives

    with fake_tensor_fsdp(), one_by_one_collectives(ddp_buffers):
        yield


def planned_kernel_name(config: Config) -> str:
    """The attention kernel the run will call: on GPUs (dist.backend=nccl/auto) "auto" is kernels.PLAN_AUTO_AS, or
    sdpa_efficient for float32 (the first automatic kernel taking it); on CPU (gloo) cpu_flash."""
    from megatron_upipe.attention.kernels import PLAN_AUTO_AS

    name = config.model.attention_kernel
    if name != "auto":
        return name
    if config.dist.backend == "gloo":
        return "cpu_flash"
    return "sdpa_efficient" if config.train.bf16 is False else PLAN_AUTO_AS


def _planned_kernel(config: Config):
    """planned_kernel_name as the op's kernel: a CPU stand-in of a GPU kernel allocating what it allocates, or the
    CPU kernel itself. UPipe/Ulysses only: other strategies use megatron-core's attention."""
    from megatron_upipe.attention.kernels import planning_kernel

    if config.parallel.cp_strategy not in ("ulysses", "upipe"):
        return config.model.attention_kernel
    name = planned_kernel_name(config)
    return name if name == "cpu_flash" else planning_kernel(name)


def _memory_kwargs(config: Config, plan, bf16: bool) -> dict:
    """build_llama's memory switches, as the training job sets them (rank 0: pipeline stage 0), with host copies
    only counted."""
    from megatron_upipe.memory_switches.offload import SimulatedHostOffloader
    from megatron_upipe.training.build import memory_switches

    return memory_switches(config, plan, bf16, SimulatedHostOffloader)


def _offload_work(stage) -> dict:
    """The offloaded layer inputs' copies back to the device in the step (bytes:host_to_device) and the disk tier's
    writes and reads (bytes:disk_write, bytes:disk_read), for the step-time model; none without offload."""
    offloader = getattr(stage, "offloader", None)
    if offloader is None:
        return {}
    ledger = offloader.ledger
    return {"bytes:host_to_device": ledger.returned_bytes, "bytes:disk_write": ledger.disk_written_bytes,
            "bytes:disk_read": ledger.disk_read_bytes}


def _host_peak(stage) -> int:
    """Host bytes the offloader holds at most, as allocated: its whole pool (plus any copy that missed it)."""
    offloader = getattr(stage, "offloader", None)
    return 0 if offloader is None else offloader.reserved_peak_bytes


@contextmanager
def tracked_step(mem: StorageTracker, model, ddp, optimizer, fake: PlannerFakeMode | None = None):
    """`mem` running (as a dispatch mode, or fed by the running `fake` mode) with the model states registered and
    Megatron-FSDP's in-place storage resizes followed (what the planner's simulation and the training job's CPU
    memory check both track); yields the state bytes."""
    from megatron_upipe.compat.fsdp import storage_resizes

    with (mem if fake is None else fake.tracking(mem)), storage_resizes(mem.resized):
        yield register_model_states(mem, model, ddp, optimizer)


# Megatron-FSDP's tensors (memory_switches.sharding.fsdp_state_tensors kinds) -> breakdown categories
_FSDP_KINDS = {"params": "params", "main_params": "optimizer", "main_grads": "grads",
               "gathered_params": FSDP_GATHERED, "grad_buckets": FSDP_GRAD_BUCKETS}


def register_model_states(mem: StorageTracker, model, ddp, optimizer) -> int:
    """Count the stage's parameters, gradient buffers and optimizer tensors (made before tracking) as model
    states - megatron-core DDP's buffers, or Megatron-FSDP's sharded buffers and whichever unsharded buckets are
    allocated now; returns their bytes."""
    from megatron_upipe.memory_switches.sharding import fsdp_state_tensors, is_fully_sharded

    before = mem.live_bytes
    if is_fully_sharded(ddp):
        _register_fsdp_states(mem, fsdp_state_tensors(ddp))
    else:
        for buffer in ddp.buffers:
            if getattr(buffer, "param_data", None) is not None:
                mem.track(buffer.param_data, category="params")
            if getattr(buffer, "grad_data", None) is not None:
                mem.track(buffer.grad_data, category="grads")
        for p in model.parameters():
            mem.track(p, category="params")
            if getattr(p, "main_grad", None) is not None:
                mem.track(p.main_grad, category="grads")
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                # fp32 main weights (bf16 runs) or the params themselves
                mem.track(local_part(p), category="optimizer")
                for moment in inner.state.get(p, {}).values():  # Adam's moments, after the first step
                    if isinstance(moment, torch.Tensor) and moment.dim() > 0:
                        mem.track(local_part(moment), category="optimizer")
    return mem.live_bytes - before


def _register_fsdp_states(mem: StorageTracker, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Each storage once, its bytes split over the categories of the views into it (one fp32 buffer holds the
    main weights and the main gradients)."""
    storages: dict[int, tuple[torch.Tensor, dict[str, int]]] = {}
    for kind, t in tensors:
        category = _FSDP_KINDS[kind]
        _, split = storages.setdefault(t.untyped_storage()._cdata, (t, {}))
        split[category] = split.get(category, 0) + t.numel() * t.element_size()
    for t, split in storages.values():
        mem.track_split(t, split)


def _materialise_adam(mem: PeakMemoryTracker, optimizer) -> list[torch.Tensor]:
    """Adam's two fp32 moments per main parameter, as its first step creates them (the step itself reads a
    gradient norm with .item(), which fake tensors cannot give). The caller keeps them alive."""
    moments = []
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                for _ in range(2):
                    t = torch.zeros_like(local_part(p), dtype=torch.float32)
                    mem.retag(t, "optimizer")
                    moments.append(t)
    return moments
