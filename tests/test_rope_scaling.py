"""RoPE scaling (models/rope_scaling.py) against transformers' own functions, the config fields that set it, and
the model builder that applies it.

The reference is transformers' ROPE_INIT_FUNCTIONS (modeling_rope_utils.py) on a LlamaConfig: our inverse
frequencies must equal its float32 values to a few float32 ulps (both compute the same formula in float32; the
order of a division may differ: rel 1e-6), and yarn's logit scale must be its attention factor squared.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_upipe.config.fieldtypes import ConfigError
from megatron_upipe.config.loader import load_config
from megatron_upipe.models.presets import RopeScaling, get_preset
from megatron_upipe.models.rope_scaling import scaled_inv_freq

CASES = [  # (our RopeScaling, HF rope_parameters), head dims 128 and 16, θ of Llama 3.1 and Qwen3
    (RopeScaling("linear", 4.0), {"rope_type": "linear", "factor": 4.0}),
    (RopeScaling("llama3", 8.0, original_max_position_embeddings=8192, low_freq_factor=1.0, high_freq_factor=4.0),
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}),
    (RopeScaling("llama3", 32.0, original_max_position_embeddings=8192, low_freq_factor=2.0, high_freq_factor=8.0),
     {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
      "original_max_position_embeddings": 8192}),
    (RopeScaling("yarn", 4.0, original_max_position_embeddings=32768),
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    (RopeScaling("yarn", 16.0, original_max_position_embeddings=4096, beta_fast=16.0, beta_slow=2.0,
                 attention_factor=1.5, truncate=False),
     {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0,
      "beta_slow": 2.0, "attention_factor": 1.5, "truncate": False}),
]


@pytest.mark.parametrize("theta,head_dim", [(500000.0, 128), (1000000.0, 16)])
@pytest.mark.parametrize("ours,hf", CASES, ids=lambda c: getattr(c, "kind", None) or "")
def test_inv_freq_equals_transformers(ours, hf, theta, head_dim):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=131072, rope_parameters={**hf, "rope_theta": theta})
    ref, attention_factor = ROPE_INIT_FUNCTIONS[hf["rope_type"]](cfg, torch.device("cpu"))
    got = scaled_inv_freq(theta, head_dim, ours)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref.float(), rtol=1e-6, atol=0)
    assert not torch.equal(got, scaled_inv_freq(theta, head_dim, None))  # the scaling changed something
    assert math.isclose(ours.logit_scale, attention_factor ** 2, rel_tol=1e-12)


def test_config_fields_build_the_scaling():
    arch = load_config(None, ["model.preset=llama3.1-8b"]).model.arch()
    assert arch.rope_scaling == RopeScaling("llama3", 8.0, original_max_position_embeddings=8192)
    # extension: a larger factor and θ on top of the preset's llama3 scaling
    arch = load_config(None, ["model.preset=llama3.1-8b", "model.rope_scaling_factor=32",
                              "model.rotary_base=8e6"]).model.arch()
    assert (arch.rope_scaling.kind, arch.rope_scaling.factor, arch.rotary_base) == ("llama3", 32.0, 8e6)
    assert arch.rope_scaling.original_max_position_embeddings == 8192
    arch = load_config(None, ["model.preset=qwen3-8b", "model.rope_scaling=yarn", "model.rope_scaling_factor=4",
                              "model.rope_original_max_position_embeddings=32768"]).model.arch()
    assert arch.rope_scaling == RopeScaling("yarn", 4.0, original_max_position_embeddings=32768)
    assert load_config(None, ["model.preset=llama3.1-8b", "model.rope_scaling=none"]).model.arch().rope_scaling is None


@pytest.mark.parametrize("overrides,words", [
    (["model.rope_scaling=yarn"], "model.rope_scaling_factor"),
    (["model.rope_scaling=yarn", "model.rope_scaling_factor=4"], "original_max_position_embeddings"),
    (["model.rope_scaling_factor=4"], "model.rope_scaling to linear, llama3 or yarn"),
    (["model.rope_scaling=none", "model.rope_scaling_factor=4"], "model.rope_scaling_factor"),
    (["model.rope_scaling=dynamic"], "inference"),
    (["model.preset=llama3.1-8b", "model.rope_low_freq_factor=8"], "high_freq_factor"),
])
def test_bad_rope_settings_are_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_builder_applies_scaling_and_yarn_softmax_scale():
    from megatron_upipe.models.llama import llama_transformer_config
    from megatron_upipe.parallel import ParallelLayout

    sc = RopeScaling("yarn", 4.0, original_max_position_embeddings=64)
    arch = get_preset("tiny").replace(rope_scaling=sc)
    cfg = llama_transformer_config(arch, ParallelLayout())
    assert math.isclose(cfg.softmax_scale, sc.logit_scale / math.sqrt(arch.kv_channels), rel_tol=1e-12)
    assert llama_transformer_config(get_preset("tiny"), ParallelLayout()).softmax_scale is None
    llama3 = arch.replace(rope_scaling=RopeScaling("llama3", 8.0, original_max_position_embeddings=64))
    assert llama_transformer_config(llama3, ParallelLayout()).softmax_scale is None  # only yarn scales logits
