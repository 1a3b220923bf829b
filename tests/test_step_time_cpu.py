"""The step-time model against measured CPU time: calibrated on two stacks, it predicts two others.

The model (planner/step_time.py) prices the work the planner counts on its fake run: GEMM FLOPs at one rate,
attention-kernel FLOPs at another. On an H100 the rates are fitted to the paper's Ulysses column and then used for
UPipe; here the same is done on this CPU, where every step can be timed: a 2-layer `small` Llama (D 256, 8 heads,
4 KV heads, float32, one rank, cp 1: the attention op with C = 1, i.e. the CPU flash kernel with its explicit
backward) is timed at 512 and 2,048 tokens without recompute, `calibrate` fits the two rates to those times, and the
model then predicts the step at 1,024 tokens with full recompute (a third more forward work) and at 1,536 without:
within 12% of the measured time each. The bound: what the model leaves out on CPU (element-wise work, absorbed into
the GEMM rate, which recompute repeats only in part; the loss and the embedding) was a few percent in this test's
runs, and a model that did not count the recomputed forward would be 25-30% short.

Times are the CPU time of the calling thread (one intra-op thread, the autograd engine runs CPU work there),
minimum of three steps after a warm-up, so another process on the machine does not move them.
"""

from __future__ import annotations

import time

import pytest

from megatron_upipe.config import load_config, validate
from tests.dist_helper import run_on_ranks

VOCAB = 256
BASE = ["model.preset=small", "model.num_layers=2", "train.bf16=false", f"model.vocab_size={VOCAB}",
        "data.path=mock", "dist.backend=gloo", "train.micro_batch_size=1", "parallel.cp=1",
        "parallel.cp_strategy=ulysses", "model.attention_kernel=cpu_flash"]
CALIBRATION = {"512 tokens": ["train.seq_length=512"], "2048 tokens": ["train.seq_length=2048"]}
PREDICTED = {"1024 tokens, full recompute": ["train.seq_length=1024", "memory.recompute=full"],
             "1536 tokens": ["train.seq_length=1536"]}
TOLERANCE = 0.12


def _measured_seconds(config, repeats: int = 3) -> float:
    import torch

    from megatron_upipe.parallel import destroy_parallel, initialize_parallel
    from megatron_upipe.planner.simulate import _layout, build_rank, forward_backward_step, step_batch

    plan = validate(config, 1)
    layout = _layout(config, plan)
    pg = initialize_parallel(layout, seed=config.train.seed)
    try:
        _, ddp, _ = build_rank(config, plan, layout, pg, VOCAB, bf16=False, planning=False)
        batch = step_batch(config, plan)
        torch.manual_seed(0)
        batch["tokens"] = batch["labels"] = torch.randint(0, VOCAB, batch["tokens"].shape)
        forward_backward_step(ddp, plan, batch)  # warm-up
        times = []
        for _ in range(repeats):
            ddp.zero_grad_buffer()
            t0 = time.thread_time()
            forward_backward_step(ddp, plan, batch)
            times.append(time.thread_time() - t0)
        return min(times)
    finally:
        destroy_parallel()


def _measure_and_count(rank, world_size):
    import torch.distributed as dist

    from megatron_upipe.planner.simulate import simulate_step

    cases = {**CALIBRATION, **PREDICTED}
    measured = {name: _measured_seconds(load_config(None, BASE + over)) for name, over in cases.items()}
    dist.destroy_process_group()  # the planner makes its own fake one
    counted = {name: simulate_step(load_config(None, BASE + over), 1, VOCAB).work for name, over in cases.items()}
    return measured, counted


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(_measure_and_count, 1)[0]


def test_calibrated_on_two_lengths_the_model_predicts_recompute_and_a_third_length(runs):
    from megatron_upipe.planner.step_time import Hardware, calibrate, predict

    measured, counted = runs
    nominal = Hardware("this CPU", 1e12, 1e30, 1e30, 0.0, 1e30)  # no links: one rank, nothing offloaded
    cpu = calibrate([(counted[name], measured[name]) for name in CALIBRATION], nominal)
    for name in PREDICTED:
        plan = validate(load_config(None, BASE + PREDICTED[name]), 1)
        predicted = predict(counted[name], cpu, plan.tokens_per_step, 1).seconds
        err = predicted / measured[name] - 1
        assert abs(err) < TOLERANCE, (f"{name}: predicted {predicted:.3f} s, measured {measured[name]:.3f} s "
                                      f"({err:+.1%}); calibration {measured}")
