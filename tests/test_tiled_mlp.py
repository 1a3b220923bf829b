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
    from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker
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
    from megatron_upipe.parallel import ParallelLayout
    from tests.llama_harness import random_setup, run_layout

    arch, hf_sd, tokens = random_setup(ARCH, VOCAB, BATCH, SEQ)
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


# ---- single process: config, spec swap, refusals, the tiled RMSNorm ----

def test_config_switches():
    from megatron_upipe.config import ConfigError, load_config

    config = load_config(None, ["memory.mlp_chunks=8", "memory.loss_chunks=16"])
    assert (config.memory.mlp_chunks, config.memory.loss_chunks) == (8, 16)
    assert (load_config(None).memory.mlp_chunks, load_config(None).memory.loss_chunks) == (1, 1)  # off
    for key in ("mlp_chunks", "loss_chunks"):
        with pytest.raises(ConfigError, match=f"memory.{key}=0 must be positive"):
            load_config(None, [f"memory.{key}=0"])


@pytest.mark.parametrize("layout_kw", [dict(), dict(tp=2, sequence_parallel=True, cp=2, cp_strategy="upipe")])
def test_spec_swaps_mlp_and_norms_only(layout_kw):
    from megatron_upipe.models.llama import llama_transformer_config
    from megatron_upipe.models.norm import RMSNorm
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.models.spec import build_cp_plan
    from megatron_upipe.models.tiled_mlp import TiledMLP, with_tiled_mlp_block
    from megatron_upipe.models.tiled_norm import TiledRMSNorm
    from megatron_upipe.parallel import ParallelLayout

    layout = ParallelLayout(**layout_kw)
    block = build_cp_plan(llama_transformer_config(get_preset(ARCH), layout), layout).block_spec
    tiled = with_tiled_mlp_block(block, 4)
    assert len(tiled.layer_specs) == len(block.layer_specs) == 2
    assert tiled.layer_norm.func is TiledRMSNorm and tiled.layer_norm.keywords == {"chunks": 4}
    for old, new in zip(block.layer_specs, tiled.layer_specs):
        assert new.submodules.mlp.func.__self__ is TiledMLP and new.submodules.mlp.keywords["chunks"] == 4
        assert new.submodules.mlp.keywords["submodules"] is old.submodules.mlp.keywords["submodules"]
        assert new.submodules.input_layernorm.func is TiledRMSNorm
        assert new.submodules.pre_mlp_layernorm.func is TiledRMSNorm
        assert new.submodules.self_attention is old.submodules.self_attention  # attention untouched
        assert old.submodules.pre_mlp_layernorm is RMSNorm  # the plan's spec is not modified
    assert block.layer_norm is RMSNorm


def test_refuses_other_mlp_specs():
    from functools import partial

    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from megatron_upipe.models.tiled_mlp import with_tiled_mlp

    class NormFusedFc1:  # stands in for TE's LayerNormColumnParallelLinear
        pass

    mlp = partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(NormFusedFc1, RowParallelLinear))
    spec = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(mlp=mlp))
    with pytest.raises(ValueError, match="set memory.mlp_chunks=1"):
        with_tiled_mlp(spec, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_rms_norm_equals_rms_norm_and_saves_only_its_input(dtype):
    """Same output and gradients as norm.RMSNorm; after forward it holds its output and rstd, not the plain
    norm's float32 input copy and normalised tensor; the backward peak shrinks with the tiles."""
    from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker
    from megatron_upipe.models.llama import llama_transformer_config
    from megatron_upipe.models.norm import RMSNorm
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.models.tiled_norm import TiledRMSNorm
    from megatron_upipe.parallel import ParallelLayout
    from tests.llama_harness import rel_err

    s, b, d = 1024, 1, 64
    config = llama_transformer_config(get_preset(ARCH).replace(hidden_size=d), ParallelLayout(), dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(s, b, d, generator=gen).to(dtype)
    dy = torch.randn(s, b, d, generator=gen).to(dtype)
    results = {}
    for name, norm in (("plain", RMSNorm(config, d)), ("tiled1", TiledRMSNorm(config, d, chunks=1)),
                       ("tiled8", TiledRMSNorm(config, d, chunks=8))):
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(1)))
        xi = x.clone().requires_grad_()
        with PeakMemoryTracker() as mem:
            y = norm(xi)
            after_forward = mem.live_bytes
            y.backward(dy)
        results[name] = (y.detach(), xi.grad, norm.weight.grad, after_forward, mem.peak_bytes)
    ref = results["plain"]
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    sbd, rstd = s * b * d * x.element_size(), s * b * 4
    for name in ("tiled1", "tiled8"):
        y, dx, dw, after_forward, peak = results[name]
        assert y.dtype == ref[0].dtype and rel_err(y, ref[0]) < tol and rel_err(dx, ref[1]) < tol
        assert rel_err(dw, ref[2]) < (1e-5 if dtype == torch.float32 else 1e-2)
        assert after_forward <= sbd + rstd + 64  # its output and rstd
    fp32_copy = 0 if dtype == torch.float32 else s * b * d * 4  # x.float() is x itself in float32
    assert ref[3] >= 2 * sbd + fp32_copy  # the plain norm: output, normalised x, float32 copy of x
    assert results["tiled8"][4] < results["tiled1"][4] and results["tiled8"][4] < ref[4] / 2
