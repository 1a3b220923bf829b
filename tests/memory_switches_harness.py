"""Test harness for megatron_upipe.memory_switches: a tiny Llama trained on gloo ranks with the memory switches.

Like tests/llama_harness.run_layout (same HF-named weights, global batch, megatron-core schedule, finalize_model_grads
and optimizer), plus: megatron-core full recompute, host offload of the checkpointed layer inputs, and fully sharded
model states (Megatron-FSDP + distributed optimizer) instead of DDP. Device memory is measured with the
storage-tracking PeakMemoryTracker over each forward-backward (parameters, gradient buffers and optimizer states are
made before it starts, so it sees activations, recompute and gradient temporaries); host memory with the
offloader's ledger.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class MemoryRunResult:
    losses: list[float]
    grads: dict | None  # HF name -> full first-step gradient (not gathered when sharded); numpy if portable()
    device_peak: list[int]  # per step: tracked peak bytes of the forward-backward
    device_after_forward: int  # first step: tracked live bytes right after the model's forward
    host_after_forward: int  # first step: offloader ledger right after the model's forward
    host_peak: int
    host_end: int  # after the last step (0: every host copy was freed)
    state_bytes: dict[str, int] = field(default_factory=dict)  # this rank's persistent model/optimizer state bytes
    param_dtypes: tuple = ()  # dtypes of the compute parameters
    host_reserved: tuple = ()  # per step: host bytes the offloader holds after it (a pool: all of it, always)
    pool_misses: int = 0  # copies that found no room in the offloader's pool
    grad_norms: tuple = ()  # per step: the global gradient norm the optimizer computed (before clipping)
    disk: tuple = ()  # the offloader's disk tier: (peak bytes, bytes alive at the end, bytes written, bytes read)
    parked: tuple = ()  # per step with park_optimizer: (bytes parked, their device bytes during the first forward)
    final_params: dict | None = None  # after the last step, numpy: name -> parameter (sharded: this rank's buffers)


def portable(result: MemoryRunResult) -> MemoryRunResult:
    """Gradients as numpy arrays: pickled by value, so a rank may exit before the parent reads its result (torch
    tensors cross the spawn queue as shared-memory handles that die with the sending process)."""
    grads = None if result.grads is None else {k: v.numpy() for k, v in result.grads.items()}
    return dataclasses.replace(result, grads=grads)


def run_memory_layout(layout, arch, hf_sd, tokens: torch.Tensor, *, steps: int = 1, lr: float = 1e-3,
                      recompute: bool = False, offload=False, shard: bool = False,
                      bf16: bool = False, num_microbatches: int = 1,
                      grads_dtype: torch.dtype = torch.float32, park_optimizer: bool = False) -> MemoryRunResult:
    """recompute: True (every layer) or N (the first N layers of each stage, memory.recompute_layers); offload: True
    (an unpooled HostOffloader) or a function of the pp rank returning the offloader; grads_dtype: Megatron-FSDP's
    gradient buffers (with shard); park_optimizer: memory.offload_optimizer_states (the optimizer's own storages on the
    host during each forward-backward)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_upipe.checkpoint.hf_convert import load_hf_into_model
    from megatron_upipe.cp_batch import split_batch
    from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker
    from megatron_upipe.memory_switches.offload import HostOffloader
    from megatron_upipe.memory_switches.optimizer_parking import for_optimizer, parked
    from megatron_upipe.memory_switches.sharding import (fsdp_buffer_bytes, fsdp_state_tensors, optimizer_state_bytes,
                                                         wrap_fully_sharded)
    from megatron_upipe.models.llama import build_llama, llama_transformer_config
    from megatron_upipe.parallel import destroy_parallel, initialize_parallel
    from tests.llama_harness import _gather_stage, _loss_func

    vocab = hf_sd["model.embed_tokens.weight"].shape[0]
    pg = initialize_parallel(layout)
    try:
        dtype = torch.bfloat16 if bf16 else torch.float32
        config = llama_transformer_config(arch, layout, dtype=dtype, recompute_granularity="full" if recompute else None,
                                          recompute_layers=None if isinstance(recompute, bool) else recompute)
        stage = build_llama(arch, layout, pg, vocab_size=vocab, config=config,
                            offloader=offload(pg.pp.rank()) if callable(offload) else
                            HostOffloader() if offload else None)
        offloader = stage.offloader
        offset = get_transformer_layer_offset(config, pp_rank=pg.pp.rank())
        load_hf_into_model(stage.model, hf_sd, arch, stage.padded_vocab_size, tp_group=pg.tp, layer_offset=offset)
        module = Float16Module(config, stage.model) if bf16 else stage.model
        if shard:
            wrapped = wrap_fully_sharded(module, config, pg, grads_dtype=grads_dtype)
        else:
            wrapped = DistributedDataParallel(
                config, DistributedDataParallelConfig(overlap_grad_reduce=False, grad_reduce_in_fp32=True), module)
        config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=1.0, bf16=bf16, params_dtype=dtype,
            use_distributed_optimizer=shard), [wrapped])
        config.grad_scale_func = optimizer.scale_loss
        parking = for_optimizer(wrapped, stage.model, optimizer) if park_optimizer else None

        B, N = tokens.shape[0], tokens.shape[1] - 1
        dp_rank, dp = pg.dp.rank(), pg.dp.size()
        rows = tokens[dp_rank * (B // dp):(dp_rank + 1) * (B // dp)]  # [B/dp, N+1]
        batch = {"tokens": rows[:, :-1], "labels": rows[:, 1:],
                 "position_ids": torch.arange(N).unsqueeze(0).expand(rows.shape[0], -1)}
        batch = split_batch(batch, stage.plan.sequence_split, pg.cp)  # [B/dp, N/C] each
        M = num_microbatches
        mbs = B // dp // M
        micro = [{k: v[i * mbs:(i + 1) * mbs] for k, v in batch.items()} for i in range(M)]  # [B/(dp·M), N/C]

        probe: dict[str, int] = {}

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            if not probe:  # free unreachable reference cycles first: when Python's cyclic GC ran is not the model's
                gc.collect()
            probe.setdefault("device", tracker.live_bytes)
            probe.setdefault("host", offloader.live_bytes if offloader else 0)
            probe.setdefault("parked", parking.device_bytes if parking else 0)
            return out, _loss_func

        forward_backward = get_forward_backward_func()
        losses, grads, peaks, reserved, norms, parks = [], None, [], [], [], []
        for step in range(steps):
            wrapped.zero_grad_buffer()
            optimizer.zero_grad()
            probe.pop("parked", None)
            with parked(parking), PeakMemoryTracker() as tracker:
                out = forward_backward(forward_step_func=forward_step, data_iterator=iter(micro), model=[wrapped],
                                       num_microbatches=M, seq_length=N, micro_batch_size=mbs, forward_only=False)
                parks.append((parking.parked_bytes, probe["parked"]) if parking else (0, 0))
            peaks.append(tracker.peak_bytes)
            # the last pipeline stage holds the M micro-batch losses (equal token counts): sum over pp, mean over dp·cp
            local = torch.tensor([sum(o["lm loss"].item() for o in out) / M if out else 0.0])
            dist.all_reduce(local, group=pg.pp)
            dist.all_reduce(local, group=pg.dp_cp)
            losses.append(local.item() / pg.dp_cp.size())
            if step == 0 and not shard:
                grads = _gather_stage([(n, p.main_grad) for n, p in stage.model.named_parameters()], arch, vocab,
                                      pg, offset)
            _, grad_norm, _ = optimizer.step()
            norms.append(float(grad_norm))
            reserved.append(offloader.ledger.reserved_bytes if offloader else 0)
        state = optimizer_state_bytes(optimizer)
        if shard:
            state.update({f"buffer_{k}": v for k, v in fsdp_buffer_bytes(wrapped).items()})
        dtypes = tuple(sorted({str(p.dtype) for p in stage.model.parameters()}))
        if shard:  # this rank's shards of the compute and fp32 main weights (the modules' own are freed buckets)
            final = {f"{kind} {i}": t.detach().float().clone().numpy()
                     for i, (kind, t) in enumerate(fsdp_state_tensors(wrapped)) if kind in ("params", "main_params")}
        else:
            final = {n: p.detach().float().clone().numpy() for n, p in stage.model.named_parameters()}

        return MemoryRunResult(losses, grads, peaks, probe["device"], probe["host"],
                               offloader.peak_bytes if offloader else 0, offloader.live_bytes if offloader else 0,
                               state, dtypes, tuple(reserved), offloader.ledger.pool_misses if offloader else 0,
                               tuple(norms), _disk(offloader), tuple(parks), final)
    finally:
        destroy_parallel()


def _disk(offloader) -> tuple:
    if offloader is None:
        return ()
    led = offloader.ledger
    return led.disk_peak_bytes, led.disk_live_bytes, led.disk_written_bytes, led.disk_read_bytes
