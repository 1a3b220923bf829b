"""memory.mlp_chunks: the sequence-tiled SwiGLU MLP equals megatron-core's MLP and keeps no [s, b, ffn] tensor.

One 2-rank gloo job (float32): the tiny Llama trained one Adam step with mlp_chunks=3 (tiles of unequal size)
equals the plain model of the same layout (loss rtol 1e-5, every gradient and updated parameter relative norm
error <= 1e-5) for tp1 (dp2), tp2 with and without sequence parallelism, and CP2 UPipe under full activation
recompute; then, on one TP rank, the tiled MLP module against megatron's MLP with the same weights (output, input
and weight gradients) and the tracked forward+backward peak with 1 and 8 tiles.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_helper import run_on_ranks

ARCH = "tiny-gqa"  # D=64, ffn 160, 2 layers
VOCAB, BATCH, SEQ, CHUNKS = 256, 2, 32, 3
PAIRS = [  # (layout, recompute): plain vs mlp_chunks=CHUNKS, same layout
    (dict(dp=2), None),
    (dict(tp=2, sequence_parallel=True), None),
    (dict(tp=2), None),
    (dict(cp=2, cp_strategy="upipe"), "full"),
]
MEM = dict(s=1024, b=1, hidden=32, ffn=256)  # module-level peak measurement, float32


def _mlps(config, pg, ffn: int, chunks: tuple[int, ...]):
    """megatron's MLP and TiledMLPs with the same weights (same parameter names)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from megatron_upipe.models.tiled_mlp import TiledMLP

    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    mods = {"plain": MLP(config, sub, tp_group=pg.tp, ffn_hidden_size=ffn)}
    for c in chunks:
        mods[f"tiled{c}"] = TiledMLP(config, sub, chunks=c, tp_group=pg.tp, ffn_hidden_size=ffn)
        mods[f"tiled{c}"].load_state_dict(mods["plain"].state_dict())  # strict: the same keys
    return mods


def _module_checks(rank) -> dict:
    """On a tp1 layout: tiled == megatron MLP, and the tracked peak with 1 vs 8 tiles."""
    from megatron_upipe.memory.tracker import PeakMemoryTracker
    from megatron_upipe.models.llama import llama_transformer_config
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.parallel import ParallelLayout, destroy_parallel, initialize_parallel
    from tests.llama_harness import rel_err

    layout = ParallelLayout(dp=2)
    pg = initialize_parallel(layout)
    try:
        s, b, h, ffn = MEM["s"], MEM["b"], MEM["hidden"], MEM["ffn"]
        arch = get_preset(ARCH).replace(hidden_size=h, ffn_hidden_size=ffn, num_attention_heads=4, kv_channels=8)
        config = llama_transformer_config(arch, layout)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(s, b, h, generator=gen)
        dy = torch.randn(s, b, h, generator=gen)
        out = {}
        for name, mod in _mlps(config, pg, ffn, (1, 8)).items():
            xi = x.clone().requires_grad_()
            with PeakMemoryTracker() as mem:
                y, bias = mod(xi)
                y.backward(dy)
            out[name] = dict(peak=mem.peak_bytes, y=y.detach(), dx=xi.grad, bias=bias,
                             grads={n: p.grad.clone() for n, p in mod.named_parameters()})
        ref = out["plain"]
        return {  # numbers only (tensors would travel through shared memory)
            name: dict(
                peak=r["peak"], bias_none=r["bias"] is None and ref["bias"] is None,
                y_err=rel_err(r["y"], ref["y"]), dx_err=rel_err(r["dx"], ref["dx"]),
                grad_err={k: rel_err(r["grads"][k], ref["grads"][k]) for k in ref["grads"]},
                same_names=r["grads"].keys() == ref["grads"].keys(),
            )
            for name, r in out.items()
        }
    finally:
        destroy_parallel()


def _job(rank, world_size):
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.parallel import ParallelLayout
    from tests.llama_harness import random_hf_state_dict, run_layout

    arch = get_preset(ARCH)
    hf_sd = random_hf_state_dict(arch, VOCAB, seed=0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    runs = {}
    for kw, recompute in PAIRS:
        layout = ParallelLayout(**kw)
        runs[layout.describe()] = tuple(
            run_layout(layout, arch, hf_sd, tokens, steps=1, recompute_granularity=recompute, mlp_chunks=c)
            for c in (1, CHUNKS)
        )
    return runs, _module_checks(rank)


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_job, 2)


def test_tiled_model_equals_plain_model(results):
    from tests.llama_harness import rel_err

    runs, _ = results[0]
    assert len(runs) == len(PAIRS)
    failures = []
    for name, (plain, tiled) in runs.items():
        if not torch.allclose(torch.tensor(tiled.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0):
            failures.append(f"{name}: loss {tiled.losses} != {plain.losses}")
        assert tiled.grads.keys() == plain.grads.keys() and any("mlp" in k for k in plain.grads)
        for key in plain.grads:
            if (e := rel_err(tiled.grads[key], plain.grads[key])) > 1e-5:
                failures.append(f"{name}: grad {key} rel err {e:.2e}")
            if (e := rel_err(tiled.params[key], plain.params[key])) > 1e-5:
                failures.append(f"{name}: param {key} rel err {e:.2e}")
    assert not failures, "\n".join(failures)


def test_tiled_module_equals_megatron_mlp(results):
    for _, mods in results:
        for name in ("tiled1", "tiled8"):
            got = mods[name]
            assert got["bias_none"] and got["same_names"], name
            assert got["y_err"] < 1e-6 and got["dx_err"] < 1e-6, (name, got)
            assert got["grad_err"].keys() == {"linear_fc1.weight", "linear_fc2.weight"}
            assert all(e < 1e-5 for e in got["grad_err"].values()), (name, got["grad_err"])


def test_tiled_peak_scales_with_tile_not_sequence(results):
    """Forward+backward peak (float32, input/weights made before tracking). Every live [s, b, ffn]-wide tensor
    of the untiled op shrinks 8x with 8 tiles; megatron's MLP also keeps fc1's and SwiGLU's outputs for backward."""
    s, b, ffn = MEM["s"], MEM["b"], MEM["ffn"]
    sbf = s * b * ffn * 4  # one [s, b, ffn] float32 tensor
    sbd = s * b * MEM["hidden"] * 4  # one [s, b, D] float32 tensor
    weights = 2 * 3 * ffn * MEM["hidden"] * 4  # fc1 + fc2 grads, float32 accumulators
    mods = results[0][1]
    p_plain, p1, p8 = mods["plain"]["peak"], mods["tiled1"]["peak"], mods["tiled8"]["peak"]
    # The untiled op holds several [s, b, ffn] tensors at its peak; 8 tiles remove 7/8 of each (at least 4 of them).
    assert p1 - p8 >= 4 * sbf * 7 / 8, (p1, p8, sbf)
    # With 8 tiles: output, dx, weight gradients and a handful of [s/8, b, ffn] tile tensors, nothing [s, b, ffn].
    assert p8 <= 2 * sbd + weights + 8 * sbf / 8, (p8, sbd, sbf)
    assert p_plain >= p1  # megatron's MLP saves fc1's output and the activation on top
