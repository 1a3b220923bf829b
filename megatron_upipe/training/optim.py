"""megatron-core's DDP wrapper, optimizer (Adam) and LR schedule for one pipeline stage.

The schedule is megatron-core's `OptimizerParamScheduler` counted in optimizer steps: linear warmup from 0 over
`train.warmup_steps` (or `train.warmup_fraction` of the decay horizon), then `train.lr_decay_style` (cosine by
default) down to `train.min_lr` at `train.lr_decay_steps` (default `train.steps`). It is advanced *before* each
optimizer step, so step k (1-based) runs at the LR of position k: the first step does not waste itself at LR 0. On
resume the schedule's settings come from the checkpoint (megatron-core's `use_checkpoint_opt_param_scheduler`), so
a changed train.steps / lr / warmup does not bend the curve of a resumed run, unless `checkpoint.scheduler=config`
(schedule.py; the run logs which schedule is in effect).

The distributed optimizer (ZeRO-1 over dp x cp) is used when `train.distributed_optimizer=true`. megatron-core
cannot *load* its checkpoints without TransformerEngine or apex, neither of which exists on CPU: there the option is
refused (`build_optimizer` raises) instead of writing checkpoints that cannot be resumed.
"""

from __future__ import annotations

import torch

from megatron_upipe.config import Config


class UnsupportedOnThisMachine(ValueError):
    pass


def check_distributed_optimizer(config: Config) -> None:
    if config.train.distributed_optimizer and not torch.cuda.is_available():
        raise UnsupportedOnThisMachine(
            "train.distributed_optimizer=true is not supported on CPU: megatron-core 0.19 cannot load a distributed-"
            "optimizer checkpoint without TransformerEngine or apex (both need CUDA), so the run could not be "
            "resumed. Set train.distributed_optimizer=false (the plain optimizer resumes exactly).")


def wrap_model(model, tconfig, config: Config, *, float16_module: bool = True):
    """Float16Module (bf16 runs) + megatron-core DDP, or Megatron-FSDP (ZeRO-3) with memory.shard_model_states;
    returns the module the schedules and optimizer take.

    float16_module=False skips the Float16Module (the memory planner: its parameters are already built in bf16,
    and fake-tensor parameters cannot be swapped by its cast; it only casts the [b, s] loss output to fp32)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    module = Float16Module(tconfig, model) if tconfig.bf16 and float16_module else model
    if config.memory.shard_model_states:  # ZeRO-3 over dp x cp (Megatron-FSDP), see megatron_upipe.memory_switches
        from megatron_upipe.memory_switches.sharding import wrap_fully_sharded

        if config.memory.fsdp_grads_dtype == "bf16" and not tconfig.bf16:
            raise ValueError("memory.fsdp_grads_dtype=bf16 needs bf16 training, but this run computes in float32 "
                             "(train.bf16=auto on a device without bf16): set train.bf16=true or "
                             "memory.fsdp_grads_dtype=fp32")
        ddp = wrap_fully_sharded(module, tconfig, communication_unit=config.memory.fsdp_communication_unit,
                                 embedding_unit=config.memory.fsdp_embedding_unit,
                                 grads_dtype=torch.bfloat16 if config.memory.fsdp_grads_dtype == "bf16" else torch.float32)
    else:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=config.train.distributed_optimizer,
        )
        ddp = DistributedDataParallel(tconfig, ddp_config, module)
    tconfig.finalize_model_grads_func = finalize_model_grads  # grad all-reduce over dp x cp, embedding/pp sync
    return ddp


def build_optimizer(ddp, tconfig, config: Config, *, planning: bool = False):
    """(optimizer, scheduler) for the DDP-wrapped stage. planning=True is the memory planner's build of the GPU
    configuration on a CPU machine under a fake process group: the distributed optimizer is allowed (the planner
    never saves a checkpoint) and megatron's auxiliary gloo groups are not used (a fake group cannot make them)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_upipe.training.schedule import build_scheduler

    if not planning:
        check_distributed_optimizer(config)
    t = config.train
    opt_config = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad, bf16=tconfig.bf16,
        params_dtype=tconfig.params_dtype,
        use_distributed_optimizer=t.distributed_optimizer or config.memory.shard_model_states,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=not planning)
    tconfig.grad_scale_func = optimizer.scale_loss  # 1.0 for fp32 / bf16 (no loss scaling)
    return optimizer, build_scheduler(optimizer, config)


def current_lr(optimizer) -> float:
    lr = optimizer.param_groups[0]["lr"]
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)
