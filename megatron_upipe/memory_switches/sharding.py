"""Model states fully sharded over the data- and context-parallel ranks (ZeRO-3) with Megatron-FSDP.

`wrap_fully_sharded(model, tconfig, pg_collection)` replaces megatron-core's DistributedDataParallel: it wraps the
stage in megatron-core's `FullyShardedDataParallel` (Megatron-FSDP) with `data_parallel_sharding_strategy=
"optim_grads_params"` over `pg_collection.dp_cp`. Each rank then persistently holds 1/(dp·cp) of
- the compute parameters (bf16 in bf16 runs; each TransformerLayer is all-gathered just before its forward and its
  recompute/backward, and freed after),
- the fp32 main parameters, the fp32 main gradients (reduce-scattered after backward) and Adam's two moments
  (megatron-core's DistributedOptimizer over the FSDP buffers: build it with `use_distributed_optimizer=True`).
The schedules, `finalize_model_grads` and `get_megatron_optimizer` take the wrapper exactly as they take DDP.

Why Megatron-FSDP and not torch FSDP2: megatron-core's `TorchFullyShardedDataParallel` builds its DeviceMesh with a
hard-coded "cuda" device, so on a CPU machine `fully_shard` refuses the (CPU) parameters: "AssertionError: Expects
the parameter to already be moved to device cuda:0 but got cpu". Megatron-FSDP takes an explicit device and runs on
gloo once gradient_reduce_div_fusion is off (its fused divide uses ReduceOp.PREMUL_SUM: "RuntimeError: Cannot use
ReduceOp.PREMUL_SUM with Gloo"); it is also what megatron-core's optimizer and checkpointing know.

Unsharded buffers (beyond the shards): a unit's compute weights are all-gathered into a bucket for its forward and
again for its backward (with the next units prefetched), and its gradients go to an unsharded fp32 bucket that
waits in a reduce-scatter queue. megatron-core's defaults keep finished buckets queued up to max(1e9 elements,
2 layers) and prefetch at least 5e8 elements (Llama3-8B, 218M elements a layer: 4 queued gradient buckets, 3
prefetched layers), and put the parameters outside the TransformerLayer units (embedding, LM head, final norm) in
one group, gathered for the whole step, whose fp32 gradient bucket waits from the LM head's backward to the
embedding's. `communication_unit="layer"` (just under one layer) and `embedding_unit=True` bound them: the planner's
6M-token Llama3-8B recipe (cp8) holds 12.37 GiB of these buckets at its peak with megatron-core's defaults, 4.56 GiB
with both (peak 74.96 -> 67.15 GiB before margins; each alone: 70.90 / 70.64). Losses and gradients are DDP's
(tests/test_planner_fsdp.py).

Shapes: buffers are flat; parameters become DTensors whose local part is this rank's slice of the flat buffer
(uneven: a small tensor may live entirely on one rank). Pipeline parallelism is not combined with it here (untested).

Padding: each flat buffer is padded to a multiple of dp·cp x its chunk size (and parameters are aligned to chunks),
so some elements of a rank's shard back no parameter (in the tests' tiny model: only in the last rank's). Megatron-FSDP
allocates the persistent buffers with torch.empty and never writes those elements: they held whatever the
allocator last left there, which went into checkpoints and made two bit-identical training states compare unequal
(torch.equal is False on a NaN bit pattern, identical or not). Nothing reads them (parameters, the optimizer's
DTensors and the all-gathers' consumers see only the parameters' slices; filled with NaN they change no loss and no
weight: tests/test_fsdp_checkpoint.py), so `wrap_fully_sharded` zeroes them once (`zero_buffer_padding`), and they
stay zero. The gradient buffer's padding is not state (zeroed every step) and is left alone.

Checkpoints: megatron-core's dist_checkpointing refuses this optimizer ("NotImplementedError: sharding_type
fully_sharded_model_space is not supported with Megatron FSDP"); its "fsdp_dtensor" format goes through
torch.distributed.checkpoint and needs Megatron-LM's preprocessing of uneven DTensors, and ranks hold different
optimizer-state keys (a parameter whose local shard is empty gets no Adam state), which a naive torch DCP save does
not survive (it hung on gloo). So training/checkpointing.py saves these runs in its own "fsdp_per_rank" format:
each rank torch.saves, with no collective, what it owns (its slices of the compute and fp32 main parameter buffers,
the local parts of Adam's moments and its step counts by parameter name, the LR schedule). Exact resume, but only
into the same tp/pp/cp/dp layout (checked against the checkpoint's recorded layout before any tensor is read); a
checkpoint is neither resharded nor converted to or from dist_checkpointing.
"""

from __future__ import annotations

import torch


def fsdp_ddp_config(*, use_gloo: bool | None = None, communication_unit: int | None = None,
                    grads_dtype: torch.dtype = torch.float32):
    """megatron-core DistributedDataParallelConfig for ZeRO-3 (fp32 main params; main grads, their buckets and
    reduce-scatter in `grads_dtype`: float32, or bfloat16 with memory.fsdp_grads_dtype=bf16).

    communication_unit: Megatron-FSDP's `suggested_communication_unit_size` in elements (None: megatron-core's
    default, max(1e9, 2 x the mean unit)). Its reduce-scatter queue keeps finished gradient buckets until they exceed
    this many elements, and each all-gather prefetches further units until at least half of it is added."""
    from megatron.core.distributed import DistributedDataParallelConfig

    if use_gloo is None:
        use_gloo = not torch.cuda.is_available()
    return DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=grads_dtype == torch.float32,
        megatron_fsdp_main_params_dtype=torch.float32,
        megatron_fsdp_main_grads_dtype=grads_dtype,
        overlap_grad_reduce=True,  # reduce-scatter launched during backward; finalize_model_grads waits for it
        overlap_param_gather=True,  # next layers' all-gathers prefetched (both checked on gloo: losses unchanged)
        gradient_reduce_div_fusion=not use_gloo,  # PREMUL_SUM does not exist on gloo
        suggested_communication_unit_size=communication_unit,
    )


def layer_elements(model: torch.nn.Module) -> int:
    """Elements of this stage's largest transformer layer (this rank's tensor-parallel part)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return max((sum(p.numel() for p in m.parameters()) for m in model.modules() if isinstance(m, TransformerLayer)),
               default=0)


def fsdp_units(embedding_unit: bool) -> list[type]:
    """Megatron-FSDP's unit modules: megatron-core's default (the transformer layers), plus the embedding."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [TransformerLayer, *([LanguageModelEmbedding] if embedding_unit else [])]


def wrap_fully_sharded(model: torch.nn.Module, tconfig, pg_collection=None, ddp_config=None, *,
                       communication_unit: str = "layer", embedding_unit: bool = True,
                       grads_dtype: torch.dtype = torch.float32):
    """This stage (a GPTModel, or Float16Module around it for bf16) fully sharded over pg_collection.dp_cp
    (None: megatron-core's initialised parallel state, as DistributedDataParallel uses).

    communication_unit="layer": Megatron-FSDP's communication unit just under one transformer layer, so that one
    finished layer's gradient bucket waits for its reduce-scatter while the next fills, and one layer is
    prefetched ("megatron": megatron-core's default, several layers of each). embedding_unit: the embedding is an
    FSDP unit of its own (gathered for its forward and backward only); else it shares the group outside the units
    with the LM head and the final norm, whose fp32 gradient bucket then waits for the embedding's gradient, at the
    end of the backward (memory.fsdp_communication_unit / memory.fsdp_embedding_unit). A given ddp_config is used as
    it is (communication_unit and grads_dtype ignored). grads_dtype: Megatron-FSDP's gradient buffers and
    reduce-scatter (memory.fsdp_grads_dtype).

    Call it where megatron-core's DistributedDataParallel would be built, before `get_megatron_optimizer(
    OptimizerConfig(..., use_distributed_optimizer=True), [wrapped])`."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    if communication_unit not in ("layer", "megatron"):
        raise ValueError(f"communication_unit={communication_unit!r}: use 'layer' or 'megatron'")
    if pg_collection is None:
        from megatron.core.process_groups_config import ProcessGroupCollection

        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    if pg_collection.pp.size() > 1:
        raise ValueError("fully sharded model states are not combined with pipeline parallelism here (untested): "
                         "use parallel.pp=1 or memory.shard_model_states=false")
    if ddp_config is None:
        unit = max(layer_elements(model) - 1, 1) if communication_unit == "layer" else None
        ddp_config = fsdp_ddp_config(communication_unit=unit, grads_dtype=grads_dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    wrapped = FullyShardedDataParallel(tconfig, ddp_config, model, fsdp_unit_modules=fsdp_units(embedding_unit),
                                       device=device, pg_collection=pg_collection)
    zero_buffer_padding(wrapped)  # allocated with torch.empty: whatever the allocator left (see the module docstring)
    return wrapped


PERSISTENT_BUFFERS = ("model_weight_buffer", "main_weight_buffer", "transpose_weight_buffer")  # state across steps


def buffer_padding(fsdp_model) -> list[dict[str, torch.Tensor]]:
    """Per Megatron-FSDP parameter group, {persistent buffer name: bool mask over this rank's flat buffer [n]}, True
    where the element backs no parameter (chunk alignment, and the padding of the last shard)."""
    out = []
    for group in fsdp_model.param_and_grad_buffer.parameter_groups:
        masks = {}
        for attr in PERSISTENT_BUFFERS:
            buf = getattr(group, attr, None)
            data = getattr(buf, "data", None) if buf is not None else None
            if data is None:
                continue
            pad = torch.ones(data.numel(), dtype=torch.bool, device=data.device)
            for item_id in range(len(buf.params)):
                item = buf.get_item(item_id)  # this rank's part of parameter item_id: a view into buf.data
                start = item.storage_offset() - data.storage_offset()
                pad[start:start + item.numel()] = False
            masks[attr] = pad
        out.append(masks)
    return out


@torch.no_grad()
def zero_buffer_padding(fsdp_model) -> int:
    """Zero the elements of this rank's persistent Megatron-FSDP buffers that back no parameter; returns how many."""
    n = 0
    for group, masks in zip(fsdp_model.param_and_grad_buffer.parameter_groups, buffer_padding(fsdp_model)):
        for attr, pad in masks.items():
            buf = getattr(group, attr)
            buf.data.masked_fill_(pad, 0)
            # counted from the (disjoint) items, not pad.sum(): the memory planner runs this on fake tensors
            n += buf.data.numel() - sum(buf.get_item(i).numel() for i in range(len(buf.params)))
    return n


def local_part(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor -> this rank's part


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def optimizer_state_bytes(optimizer) -> dict[str, int]:
    """This rank's optimizer-held bytes: {"main_params", "exp_avg", "exp_avg_sq"} (local shards of DTensors).

    Works for megatron-core's DistributedOptimizer (sharded or over FSDP) and its FP32/Float16 optimizers."""
    out = {"main_params": 0, "exp_avg": 0, "exp_avg_sq": 0}
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    for group in inner.param_groups:
        for p in group["params"]:
            out["main_params"] += _nbytes(local_part(p))
            state = inner.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    out[key] += _nbytes(local_part(state[key]))
    return out


def fsdp_buffer_bytes(fsdp_model) -> dict[str, int]:
    """This rank's persistent Megatron-FSDP buffers: {"params", "main_params", "main_grads"} in bytes."""
    names = {"params": "model_weight_buffer", "main_params": "main_weight_buffer", "main_grads": "main_grad_buffer"}
    out = dict.fromkeys(names, 0)
    for group in fsdp_model.param_and_grad_buffer.parameter_groups:
        for key, attr in names.items():
            buf = getattr(group, attr, None)
            out[key] += _nbytes(getattr(buf, "data", None)) if buf is not None else 0
    return out


def is_fully_sharded(wrapped) -> bool:
    """Whether the wrapped stage is Megatron-FSDP's (wrap_fully_sharded) rather than megatron-core's DDP."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    return isinstance(wrapped, FullyShardedDataParallel)


def fsdp_state_tensors(fsdp_model) -> list[tuple[str, torch.Tensor]]:
    """This rank's Megatron-FSDP tensors as (kind, tensor): the persistent shards - "params" (compute weights),
    "main_params" (fp32 main weights) and "main_grads" (fp32 gradients; these two are views of one buffer per
    dtype) - and the unsharded buckets allocated at this moment: "gathered_params" (all-gathered compute weights;
    the group of parameters outside the FSDP units stays gathered between steps) and "grad_buckets" (gradients
    waiting for their reduce-scatter)."""
    kinds = (("params", "model_weight_buffer", "gathered_params"),
             ("params", "transpose_weight_buffer", "gathered_params"),
             ("main_params", "main_weight_buffer", "main_params"),
             ("main_grads", "main_grad_buffer", "grad_buckets"))
    out, allocators = [], {}
    for group in fsdp_model.param_and_grad_buffer.parameter_groups:
        for kind, attr, bucket_kind in kinds:
            buf = getattr(group, attr, None)
            if buf is None:
                continue
            if getattr(buf, "data", None) is not None:
                out.append((kind, buf.data))
            allocators[id(buf.temporary_bucket_allocator)] = (bucket_kind, buf.temporary_bucket_allocator)
    for bucket_kind, allocator in allocators.values():
        out += [(bucket_kind, bucket.data) for bucket in allocator.buckets.values()]
    return out
