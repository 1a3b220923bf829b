"""Model states fully sharded over data x context parallel ranks (Megatron-FSDP, memory_switches.sharding).

One 4-rank gloo job, tiny Llama (GQA), 3 Adam steps (grad clipping on) on the same global batch, every layout
loading the same HF-named weights:
- dp4 with megatron-core DDP and the plain optimizer (reference; it equals the single-process model, see
  test_llama_layouts), dp4 fully sharded, dp2 x cp2 UPipe fully sharded, and dp2 x cp2 UPipe fully sharded with
  full recompute + host offload of the layer inputs (the paper's memory stack), all float32;
- dp4 fully sharded in bf16 (bf16 compute parameters, fp32 main parameters / gradients / Adam states), and the
  same with bf16 gradient buffers and reduce-scatter (memory.fsdp_grads_dtype=bf16).
Checked: the float32 losses equal the reference's at every step (rtol 1e-5); the bf16 losses within 2e-2 (and
bf16 gradients within 1e-2 of fp32 gradients' losses); each rank persistently holds about 1/4 of the model's
parameters, fp32 main parameters, gradients (bf16: half the bytes) and Adam moments (sum over ranks >= the model,
every rank <= 1/4 plus bucket padding), while the DDP reference holds all of it.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_helper import run_on_ranks

VOCAB, BATCH, SEQ, STEPS, WORLD = 256, 4, 32, 3, 4
VARIANTS = {  # name -> (layout kwargs, shard, recompute+offload, bf16)
    "dp4-ddp": (dict(dp=4), False, False, False),
    "dp4-sharded": (dict(dp=4), True, False, False),
    "dp2xcp2-upipe-sharded": (dict(dp=2, cp=2, cp_strategy="upipe"), True, False, False),
    "dp2xcp2-upipe-sharded+recompute+offload": (dict(dp=2, cp=2, cp_strategy="upipe"), True, True, False),
    "dp4-sharded-bf16": (dict(dp=4), True, False, True),
    "dp4-sharded-bf16-bf16grads": (dict(dp=4), True, False, True),
}
BF16_GRADS = {"dp4-sharded-bf16-bf16grads"}  # memory.fsdp_grads_dtype=bf16


def _job(rank, world_size):
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.parallel import ParallelLayout
    from tests.llama_harness import random_hf_state_dict
    from tests.memory_switches_harness import portable, run_memory_layout

    arch = get_preset("tiny-gqa")
    hf_sd = random_hf_state_dict(arch, VOCAB, seed=0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return {
        name: portable(run_memory_layout(ParallelLayout(**kw), arch, hf_sd, tokens, steps=STEPS, shard=shard,
                                         recompute=ro, offload=ro, bf16=bf16,
                                         grads_dtype=torch.bfloat16 if name in BF16_GRADS else torch.float32))
        for name, (kw, shard, ro, bf16) in VARIANTS.items()
    }


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_job, WORLD)


def _num_params() -> int:
    from megatron_upipe.models.llama import padded_vocab_size
    from megatron_upipe.models.presets import get_preset

    a = get_preset("tiny-gqa")
    D, F, d = a.hidden_size, a.ffn_hidden_size, a.kv_channels
    qkv = (a.num_attention_heads + 2 * a.num_query_groups) * d * D
    layer = qkv + a.num_attention_heads * d * D + 3 * F * D + 2 * D
    return a.num_layers * layer + D + 2 * padded_vocab_size(VOCAB, 1) * D


def test_losses_equal_unsharded(results):
    ref = results[0]["dp4-ddp"].losses
    assert all(b < a for a, b in zip(ref, ref[1:])), f"reference does not train: {ref}"
    for per_rank in results:
        for name, (_, _, _, bf16) in VARIANTS.items():
            r = per_rank[name]
            assert len(r.losses) == STEPS
            tol = dict(rtol=2e-2, atol=0) if bf16 else dict(rtol=1e-5, atol=1e-6)
            assert torch.allclose(torch.tensor(r.losses), torch.tensor(ref), **tol), (name, r.losses, ref)
        fp32_grads, bf16_grads = per_rank["dp4-sharded-bf16"], per_rank["dp4-sharded-bf16-bf16grads"]
        assert fp32_grads.losses[0] == bf16_grads.losses[0]  # the same forward; the dtype shows from the first update
        assert torch.allclose(torch.tensor(bf16_grads.losses), torch.tensor(fp32_grads.losses), rtol=1e-2, atol=0), \
            (bf16_grads.losses, fp32_grads.losses)
        # the first step's gradients (same forward, same backward in bf16 compute) differ only by the bf16 rounding
        # of the gradient buffers and their reduce-scatter: their global norm within a few bf16 units (2^-8) ...
        n32, n16 = fp32_grads.grad_norms[0], bf16_grads.grad_norms[0]
        assert abs(n16 - n32) <= 4 * 2**-8 * n32, (n16, n32)
        assert n16 != n32  # ... and not equal: the switch took effect


def test_each_rank_holds_a_quarter_of_the_states(results):
    P = _num_params()
    full = 4 * P  # float32 bytes of one copy of the model
    ddp = [per_rank["dp4-ddp"].state_bytes for per_rank in results]
    for s in ddp:  # unsharded: every rank updates the whole model and keeps both Adam moments of it
        assert s == {"main_params": full, "exp_avg": full, "exp_avg_sq": full}
    for name, (_, shard, _, bf16) in VARIANTS.items():
        if not shard:
            continue
        states = [per_rank[name].state_bytes for per_rank in results]
        expected = {"exp_avg": full, "exp_avg_sq": full, "main_params": full, "buffer_main_params": full,
                    "buffer_main_grads": (2 if name in BF16_GRADS else 4) * P, "buffer_params": (2 if bf16 else 4) * P}
        for key, total in expected.items():
            per = [s[key] for s in states]
            assert sum(per) >= total, (name, key, per, total)  # nothing is lost
            # ~1/N each: a rank's shard is a quarter of the flat buffers, padded to their alignment
            assert max(per) <= total / WORLD * 1.25, (name, key, per, total)
        dtypes = results[0][name].param_dtypes
        assert dtypes == (("torch.bfloat16",) if bf16 else ("torch.float32",)), (name, dtypes)
