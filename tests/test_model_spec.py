"""Layout validation, the cp_strategy -> spec mapping's refusals, the CP batch split and vocab padding.

Single process, no process group: every check here fails before any collective would run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_upipe.cp_batch import split_sequence
from megatron_upipe.parallel import ParallelLayout


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=0), "positive integer"),
        (dict(cp=2), "cp_strategy other than 'none'"),
        (dict(cp=2, cp_strategy="ring"), "unknown"),
        (dict(sequence_parallel=True), "needs tp > 1"),
        (dict(cp=2, cp_strategy="upipe", upipe_heads_per_stage=0), "positive"),
    ],
)
def test_layout_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**kwargs)


def test_layout_world_size_and_name():
    layout = ParallelLayout(tp=2, pp=2, cp=4, dp=3, sequence_parallel=True, cp_strategy="upipe",
                            upipe_heads_per_stage=4)
    assert layout.world_size == 48
    assert layout.describe() == "tp2+sp-pp2-cp4:upipe(U=4)-dp3"


def _config(**layout_kwargs):
    from megatron_upipe.models.llama import llama_transformer_config
    from megatron_upipe.models.presets import get_preset

    layout = ParallelLayout(**layout_kwargs)
    return llama_transformer_config(get_preset("tiny-gqa"), layout), layout


@pytest.mark.skipif(torch.cuda.is_available(), reason="TE strategies may be available on a GPU machine")
@pytest.mark.parametrize("strategy", ["p2p", "a2a", "a2a+p2p"])
def test_te_strategy_without_te_is_a_clear_error(strategy):
    from megatron_upipe.models.spec import build_cp_plan

    config, layout = _config(cp=2, cp_strategy=strategy)
    with pytest.raises(ValueError, match="TransformerEngine's context parallelism"):
        build_cp_plan(config, layout)


def test_headwise_cp_refusals():
    from megatron_upipe.models.spec import build_cp_plan

    config, layout = _config(cp=2, cp_strategy="upipe")
    with pytest.raises(ValueError, match="add_bias_linear=False"):
        build_cp_plan(dataclasses.replace(config, add_bias_linear=True), layout)
    with pytest.raises(ValueError, match="L2 QK norms"):
        build_cp_plan(dataclasses.replace(config, qk_l2_norm=True), layout)
    config, layout = _config(tp=4, cp=2, cp_strategy="ulysses")  # 2 query groups over 4 TP ranks
    with pytest.raises(ValueError, match="num_query_groups=2 is not a multiple of tp=4"):
        build_cp_plan(config, layout)
    config, layout = _config(cp=2, cp_strategy="ulysses", upipe_heads_per_stage=2)
    with pytest.raises(ValueError, match="only applies to 'upipe'"):
        build_cp_plan(config, layout)


def test_sequence_splits():
    t = torch.arange(16).view(1, 16)  # [b, N]
    assert [split_sequence(t, "contiguous", r, 4).tolist() for r in range(4)] == [
        [list(range(4 * r, 4 * r + 4))] for r in range(4)
    ]
    # zigzag: 2C chunks, rank r keeps r and 2C-1-r (megatron-core's get_batch_on_this_cp_rank)
    assert split_sequence(t, "zigzag", 0, 4).tolist() == [[0, 1, 14, 15]]
    assert split_sequence(t, "zigzag", 3, 4).tolist() == [[6, 7, 8, 9]]
    with pytest.raises(ValueError, match="not a positive multiple of 8"):
        split_sequence(torch.zeros(1, 12), "zigzag", 0, 4)
    # a ring of 2 all-to-all groups of 2 (CP rank = ring rank·2 + a2a rank): chunks 0 and 3 to ring rank 0,
    # 1 and 2 to ring rank 1 (4 tokens each), each pair split contiguously over the group
    assert [split_sequence(t, "contiguous", r, 4, ring_size=2).tolist() for r in range(4)] == [
        [[0, 1, 2, 3]], [[12, 13, 14, 15]], [[4, 5, 6, 7]], [[8, 9, 10, 11]]]
    with pytest.raises(ValueError, match="ring_size=3 must divide the 4 CP ranks"):
        split_sequence(t, "contiguous", 0, 4, ring_size=3)


def test_padded_vocab_is_tp_invariant():
    from megatron_upipe.models.llama import padded_vocab_size

    assert {padded_vocab_size(128256, tp) for tp in (1, 2, 4, 8)} == {128256}
    assert {padded_vocab_size(250, tp) for tp in (1, 2, 4)} == {256}
    assert padded_vocab_size(100, 3) == 384


@pytest.mark.parametrize("preset", ["llama3-8b", "llama3-70b", "qwen3-32b-paper", "llama3.1-8b", "llama3.1-70b",
                                    "qwen3-8b", "qwen3-32b"])
def test_presets_translate_to_megatron_config(preset):
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.models.spec import build_cp_plan

    arch = get_preset(preset)
    layout = ParallelLayout(tp=8, cp=8, pp=2, sequence_parallel=True, cp_strategy="upipe")
    from megatron_upipe.models.llama import llama_transformer_config

    config = llama_transformer_config(arch, layout, dtype=torch.bfloat16)
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (
        arch.num_attention_heads, arch.num_query_groups, arch.kv_channels)
    assert config.gated_linear_unit and config.normalization == "RMSNorm" and not config.add_bias_linear
    assert config.layernorm_epsilon == arch.norm_epsilon and config.bf16
    assert (config.add_qkv_bias, config.qk_layernorm) == (arch.qkv_bias, arch.qk_norm)
    plan = build_cp_plan(config, layout, pp_rank=1)
    assert len(plan.block_spec.layer_specs) == arch.num_layers // 2
    assert plan.sequence_split == "contiguous" and plan.rope_rank_rows


def test_mcore_version_is_the_tested_one():
    from megatron_upipe.compat.mcore import check_megatron_core_version

    assert check_megatron_core_version()
