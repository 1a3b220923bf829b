"""The optimizer's own tensors parked on the host during the forward/backward (memory.offload_optimizer_states,
memory_switches/optimizer_parking.py).

One 2-rank gloo job, tiny Llama (GQA), 3 Adam steps (clipping on), each stack with and without parking:
megatron-core DDP in float32 (the optimizer's own storages: Adam's moments) and Megatron-FSDP in bf16 (the fp32 main
weight buffers and the moments). Checked: losses, gradient norms and every final weight equal bit for bit (the step
runs on the very bytes it left); during the first forward the parked storages hold no device bytes; what is parked
is the optimizer's main weights and moments as megatron-core reports them (sharding.optimizer_state_bytes and
fsdp_buffer_bytes; moments
from the second step on: Adam makes them in its first); the host plan's term (host_budget.optimizer_states_bytes)
against the host buffers the run allocated. The planner against real runs with it: tests/test_planner_fsdp.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_upipe.config import load_config, validate
from tests.dist_helper import run_on_ranks

VOCAB, BATCH, SEQ, STEPS, WORLD = 256, 4, 32, 3, 2
STACKS = {"ddp-fp32": (False, False), "fsdp-bf16": (True, True)}  # name -> (Megatron-FSDP, bf16)


def _job(rank, world_size):
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.parallel import ParallelLayout
    from tests.llama_harness import random_hf_state_dict
    from tests.memory_switches_harness import portable, run_memory_layout

    arch = get_preset("tiny-gqa")
    hf_sd = random_hf_state_dict(arch, VOCAB, seed=0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return {(name, park): portable(run_memory_layout(ParallelLayout(dp=WORLD), arch, hf_sd, tokens, steps=STEPS,
                                                     shard=shard, bf16=bf16, park_optimizer=park))
            for name, (shard, bf16) in STACKS.items() for park in (False, True)}


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_job, WORLD)


@pytest.mark.parametrize("name", STACKS)
def test_training_is_bit_identical(results, name):
    for per_rank in results:
        plain, parked = per_rank[(name, False)], per_rank[(name, True)]
        assert all(b < a for a, b in zip(plain.losses, plain.losses[1:])), plain.losses  # it trains
        assert parked.losses == plain.losses and parked.grad_norms == plain.grad_norms
        assert set(parked.final_params) == set(plain.final_params) and plain.final_params
        for key, weight in plain.final_params.items():
            assert np.array_equal(parked.final_params[key], weight), key


@pytest.mark.parametrize("name", STACKS)
def test_what_is_parked_is_the_optimizer_states(results, name):
    for per_rank in results:
        r = per_rank[(name, True)]
        assert r.parked and all(during_forward == 0 for _, during_forward in r.parked)  # nothing left on the device
        s = r.state_bytes  # after the last step: the optimizer's tensors (local shards)
        # Megatron-FSDP: its fp32 main weight buffer, padding included; float32 DDP: Adam updates the parameters
        main = s["buffer_main_params"] if name == "fsdp-bf16" else 0
        moments = s["exp_avg"] + s["exp_avg_sq"]
        assert moments > 0 and (main > 0) == (name == "fsdp-bf16")
        assert r.parked[0][0] == main  # the first step: no moments yet
        assert all(parked == main + moments for parked, _ in r.parked[1:])
        assert all(p == (0, 0) for p in per_rank[(name, False)].parked)  # without it, nothing

@pytest.mark.parametrize("name", STACKS)
def test_host_plan_counts_the_parked_bytes(results, name):
    """The host plan's term (before anything runs) against what the run parked on rank 0, Megatron-FSDP's bucket
    padding aside: its main weight buffer is padded to whole chunks per rank, which the term does not count."""
    from megatron_upipe.memory_switches.host_budget import optimizer_states_bytes

    shard, bf16 = STACKS[name]
    config = load_config(None, [f"model.vocab_size={VOCAB}", "data.path=mock", "model.preset=tiny-gqa",
                                f"train.seq_length={SEQ}", "train.micro_batch_size=1",
                                f"train.global_batch_size={BATCH}", f"memory.shard_model_states={str(shard).lower()}",
                                "memory.offload_optimizer_states=true"])
    planned = optimizer_states_bytes(config, validate(config, WORLD), VOCAB, 2 if bf16 else 4)
    parked = results[0][(name, True)].parked[-1][0]
    if shard:
        assert planned <= parked <= planned * 1.02, (planned, parked)
    else:
        assert planned == parked
