"""Training and evaluation steps on megatron-core's pipeline schedules, and the loop with its side duties.

The forward/backward pass itself is megatron_upipe/step.py (shared with the memory planner): megatron's schedule
divides each micro-batch's loss sum by its token count and by the number of micro-batches, and DDP averages over
dp x cp: the gradient of the global per-token mean when micro-batches hold equal numbers of
unmasked tokens (the shipped data: no loss mask); with a mask that zeroes tokens (mock data's padding) each
micro-batch's mean weighs the same. The reported loss is always the exact per-token mean over the global batch.

One step: schedule LR -> forward/backward over all micro-batches (gradient accumulation, pipeline schedule of
parallel.pp) -> global loss and gradient norm -> NaN policy (failures.py) -> optimizer step (clipping inside).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_upipe.config import to_yaml
from megatron_upipe.memory_switches.optimizer_parking import parked
from megatron_upipe.step import forward_backward, forward_step
from megatron_upipe.training import checkpointing, memory_check
from megatron_upipe.training.console import optional_kernels_line
from megatron_upipe.training.failures import as_distributed_failure, check_step
from megatron_upipe.training.metrics import device_peak_flops, peak_memory, step_record
from megatron_upipe.training.optim import current_lr
from megatron_upipe.training.schedule import schedule_line
from megatron_upipe.training import deadline
from megatron_upipe.training.agree import largest_on_any_rank
from megatron_upipe.training.signals import StopOnSignal, StoppedBySignal


_forward_step = forward_step  # looked up at call time (tests poison it to inject a non-finite loss)


def _global_loss(reports: list[dict], pg, device: torch.device) -> tuple[float, int]:
    """Per-token mean over the global batch (the last pipeline stage holds the reports; others add zeros).
    Reduced on `device` (NCCL reduces CUDA tensors only)."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for r in reports:
        sums += r["lm loss"].double().to(device)
    dist.all_reduce(sums, group=pg.pp)
    dist.all_reduce(sums, group=pg.dp_cp)
    total, count = sums.tolist()
    return total / count if count > 0 else float("nan"), int(count)


def _forward_backward(state, data_iterator, forward_only: bool) -> list[dict]:
    p = state.plan
    return forward_backward(state.ddp, data_iterator, num_microbatches=p.num_microbatches,
                            seq_length=p.seq_length, micro_batch_size=p.micro_batch_size,
                            forward_only=forward_only, forward_step_func=_forward_step)


def train_step(state, data_iterator, around_forward_backward=None) -> dict:
    """One optimizer step (state.step + 1); returns loss, lr, grad_norm, skipped. Raises NonFiniteError (stop).
    `around_forward_backward`: a context manager entered around the forward/backward schedule (memory check; its
    `on_resize`, if any, follows the storages memory.offload_optimizer_states frees and re-allocates in it)."""
    step = state.step + 1
    state.ddp.zero_grad_buffer()
    state.optimizer.zero_grad()
    state.scheduler.step(1)  # the LR of step `step`
    around = around_forward_backward or nullcontext()
    with around, parked(state.parked, getattr(around, "on_resize", None)):  # the optimizer's storages on the host
        reports = _forward_backward(state, data_iterator, forward_only=False)
    loss, _ = _global_loss(reports, state.groups.pg, state.groups.device)
    state.optimizer.prepare_grads()
    grad_norm = float(state.optimizer.get_grad_norm())  # global, before clipping
    update = check_step(step, loss, grad_norm, state.config.train.nan_policy)
    if update:
        state.optimizer.step()  # clips to train.clip_grad and updates
    else:
        state.ddp.zero_grad_buffer()
        state.optimizer.zero_grad()
    return {"loss": loss, "lr": current_lr(state.optimizer), "grad_norm": grad_norm, "skipped": not update}


@torch.no_grad()
def evaluate(state) -> dict:
    """Mean loss over the first train.eval_iters global batches of the validation split."""
    state.ddp.eval()
    it = state.data.valid_iterator()
    sums = [0.0, 0]
    try:
        for _ in range(state.config.train.eval_iters):
            reports = _forward_backward(state, it, forward_only=True)
            loss, count = _global_loss(reports, state.groups.pg, state.groups.device)
            sums[0] += loss * count
            sums[1] += count
    finally:
        state.ddp.train()
    return {"step": state.step, "loss": sums[0] / max(sums[1], 1), "tokens": sums[1]}


def _save(state, may_continue: bool = True) -> Path | None:
    """Save this step (every rank). A save that fails (checkpointing.SaveFailed, the same on every rank: too little
    free space or a writer error; nothing published, `latest` unchanged) is raised (pretrain_llama.py exits 6), or,
    with checkpoint.on_save_error=continue, logged in one warning line and training goes on (None; the next interval
    tries again), except for the final save and a save before a stop (`may_continue=False`), which always raise."""
    c, steps = state.config.checkpoint, state.config.train.steps
    try:
        path = checkpointing.save_checkpoint(state, c.dir, keep_last=c.keep_last)
    except checkpointing.SaveFailed as e:
        if not may_continue or c.on_save_error != "continue" or state.step >= steps:
            raise
        retry = (state.step // c.interval + 1) * c.interval if c.interval > 0 else steps
        retry = retry if retry < steps else steps if c.save_final else None
        state.logger.message(f"warning: step {state.step}: {e}; training goes on (checkpoint.on_save_error="
                             f"continue), " + (f"the next save is tried at step {retry}" if retry is not None else
                                               "no later save is scheduled"))
        return None
    state.last_saved_step = state.step
    if state.superseded:  # checkpoint.overwrite=true: the earlier run's checkpoints go once this one is published
        if state.groups.rank == 0:
            checkpointing.remove_checkpoints(Path(c.dir), [n for n in state.superseded if n != path.name])
        state.superseded = []
    state.logger.checkpoint(state.step, path)
    return path


def _stop(state, signum: int) -> None:
    """Every rank agreed on a stop signal after this step: save it (unless just saved) and raise StoppedBySignal."""
    c = state.config.checkpoint
    if c.dir is None:  # a deadline without checkpoint.dir: nothing to save into
        path = None
    elif state.last_saved_step != state.step:
        path = _save(state, may_continue=False)
    else:
        path = Path(c.dir) / checkpointing.checkpoint_name(state.step)
    raise StoppedBySignal(signum, state.step, state.config.train.steps, path)


def _predicted_step_s(predicted: dict | None, device: torch.device) -> float | None:
    """The step-time model's seconds per step from the start-up plan, on the GPU it was made for (an H100: the
    planner's default GPU); None elsewhere (CPU runs, other GPUs)."""
    if predicted is None or "step_time" not in predicted or device.type != "cuda":
        return None
    return predicted["step_time"]["seconds"] if "h100" in torch.cuda.get_device_name(device).lower() else None


def _job_deadline(state, predicted: dict | None) -> deadline.Deadline | None:
    """Rank 0 reads the job's deadline (training/deadline.py) and refuses a start that cannot save one step; every
    rank gets both through one broadcast (a collective)."""
    box = [None, None]
    if state.groups.rank == 0:
        at = deadline.job_deadline(state.config.train.exit_duration_mins, deadline.now())
        if at is not None:
            d = deadline.Deadline(at, _predicted_step_s(predicted, state.groups.device))
            box = [d, d.start_refusal(deadline.now())]
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise deadline.DeadlineTooShort(box[1])
    return box[0]


def run(state) -> None:
    """Train from state.step to train.steps with evaluation, metrics and checkpoints; with checkpoint.dir and
    checkpoint.save_on_signal, SIGTERM / SIGUSR1 / SIGINT stop it at a step boundary with a checkpoint (signals.py)."""
    c = state.config.checkpoint
    stop = StopOnSignal() if c.dir is not None and c.save_on_signal else None
    try:
        with stop or nullcontext():
            _run(state, stop)
    except Exception as exc:
        failure = as_distributed_failure(exc, state.groups.rank, state.step + 1, state.config.dist.timeout_s)
        if failure is not None:
            raise failure from exc
        raise


def _run(state, stop: StopOnSignal | None = None) -> None:
    cfg, plan, groups = state.config, state.plan, state.groups
    t, c = cfg.train, cfg.checkpoint
    log = state.logger
    log.message(plan.summary())
    log.message(f"parallel layout {groups.layout.describe()} | {state.stage.config.params_dtype} | "
                f"{sum(p.numel() for p in state.model.parameters())} parameters on rank 0's stage")
    if groups.cp_placement:
        log.message(groups.cp_placement)
    log.message(optional_kernels_line())
    if state.resumed_from is not None:
        log.message(f"resumed from {state.resumed_from} at step {state.step} ({state.consumed_samples} samples)")
        log.message(schedule_line(state.scheduler, cfg))
    if state.step >= t.steps:
        log.message(f"nothing to do: checkpoint at step {state.step} >= train.steps={t.steps}; raise train.steps to "
                    f"continue")
        return
    peak_flops = device_peak_flops(groups.device)
    predicted, measure_step = None, state.step + 2  # the run's second step: Adam's moments exist, as planned
    if cfg.memory.plan_check and groups.rank == 0:
        predicted = memory_check.predict(to_yaml(cfg), groups.world_size)
        if predicted is not None:
            log.message(memory_check.prediction_line(predicted))
    limit = _job_deadline(state, predicted)
    if limit is not None:
        log.message(limit.line(deadline.now()))
    data_iterator = state.data.train_iterator(state.consumed_samples)
    while state.step < t.steps:
        start = time.perf_counter()
        check = predicted is not None and state.step + 1 == measure_step
        measured = memory_check.MeasuredPeak(state, groups.device) if check else None
        result = train_step(state, data_iterator, measured)
        state.step += 1
        if check:
            record = memory_check.comparison(state.step, measured.result, predicted)
            log.log(record, kind="memory")
            log.message(memory_check.comparison_line(record))
        state.consumed_samples += plan.global_batch_size
        seconds = time.perf_counter() - start
        if limit is not None:
            limit.step_s.append(seconds)
        mem, mem_kind = peak_memory(groups.device)
        mem_t = torch.tensor([mem], dtype=torch.int64, device=groups.device)
        dist.all_reduce(mem_t, op=dist.ReduceOp.MAX)
        log.log(step_record(state.step, result["loss"], result["lr"], result["grad_norm"], seconds,
                            plan.tokens_per_step, groups.world_size, state.flops_per_token, peak_flops,
                            int(mem_t.item()), mem_kind, result["skipped"], t.steps, state.consumed_samples))
        final = state.step == t.steps
        if t.eval_interval > 0 and (state.step % t.eval_interval == 0 or final):
            log.log(evaluate(state), kind="eval")
        if c.dir is not None and ((c.interval > 0 and state.step % c.interval == 0) or (final and c.save_final)):
            save_start = time.perf_counter()
            _save(state)
            if limit is not None:
                limit.save_s.append(time.perf_counter() - save_start)
        if not final and (stop is not None or limit is not None):  # one collective for both verdicts
            signum, out_of_time = largest_on_any_rank(
                [stop.received if stop is not None else 0, limit is not None and limit.must_stop(deadline.now())],
                groups.device)
            if signum or out_of_time:
                _stop(state, signum)  # 0: another step and its save would pass the deadline: save this one, stop
    log.summary()
