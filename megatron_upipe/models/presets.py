"""Llama-family model shapes: the presets users name with `model.preset`.

Only shapes live here (no torch, no megatron-core), so configs, validation and the memory planner can use them
without building anything. Every preset is a Llama-style block (RMSNorm, SwiGLU MLP, RoPE, GQA) with the family
features HF checkpoints use: QKV biases (Qwen2/2.5), RMSNorm of each q and k head before RoPE (Qwen3's QK-norm),
tied input/output embeddings (Llama 3.2 1B/3B, small Qwens) and RoPE scaling (`RopeScaling`: Llama 3.1+'s
"llama3", "linear", "yarn"). `vocab_size=None` means "take it from the tokenizer".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

ROPE_SCALING_KINDS = ("linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as HF `rope_parameters` / `rope_scaling` define it (transformers'
    modeling_rope_utils; formulas in megatron_upipe/models/rope_scaling.py).

    linear: every frequency / factor. llama3 (Llama 3.1+): wavelengths above original/low_freq_factor divided by
    factor, below original/high_freq_factor kept, smooth in between. yarn: NTK-by-parts between beta_fast and
    beta_slow rotations over the original context, and cos/sin multiplied by `attention_factor` (default
    0.1·ln(factor) + 1), i.e. attention logits by its square.
    """

    kind: str  # one of ROPE_SCALING_KINDS
    factor: float
    original_max_position_embeddings: int | None = None  # llama3, yarn: the pretraining context
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None = 0.1·ln(factor) + 1 (HF's default)
    truncate: bool = True  # yarn: round the correction range to whole dimensions (HF's default)

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(f"RoPE scaling {self.kind!r} is unknown; choose one of {', '.join(ROPE_SCALING_KINDS)} "
                             f"(dynamic NTK is inference-only and is not trained)")
        if not self.factor > 0:
            raise ValueError(f"RoPE scaling factor={self.factor} must be positive")
        if self.kind in ("llama3", "yarn") and not (self.original_max_position_embeddings or 0) > 0:
            raise ValueError(f"RoPE scaling {self.kind!r} needs original_max_position_embeddings (the pretraining "
                             f"context, e.g. 8192 for Llama 3.1)")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(f"llama3 RoPE scaling needs high_freq_factor={self.high_freq_factor} > "
                             f"low_freq_factor={self.low_freq_factor} > 0")

    @property
    def logit_scale(self) -> float:
        """Factor on the attention logits: yarn's attention_factor squared (it multiplies cos and sin, so q and k
        with a full-width rotary); 1 otherwise."""
        if self.kind != "yarn":
            return 1.0
        f = self.attention_factor
        if f is None:
            f = 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0
        return f * f


@dataclass(frozen=True)
class LlamaArch:
    num_layers: int
    hidden_size: int  # D
    num_attention_heads: int  # H
    num_query_groups: int  # H_kv
    ffn_hidden_size: int
    kv_channels: int  # d, head dim; H*d may differ from D (qwen3-32b)
    vocab_size: int | None
    rotary_base: float
    norm_epsilon: float = 1e-5
    max_position_embeddings: int = 131072
    qkv_bias: bool = False  # biases of the q, k, v projections (Qwen2/2.5); none on W_O or the MLP
    qk_norm: bool = False  # RMSNorm over the head dim of every q and k head, before RoPE (Qwen3)
    tie_embeddings: bool = False  # the LM head is the input embedding
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}; pick a group count that divides the head count"
            )
        if isinstance(self.rope_scaling, dict):  # from JSON (checkpoint metadata)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    def replace(self, **changes) -> "LlamaArch":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaArch":
        """Inverse of dataclasses.asdict; fields an older file lacks take their defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown model fields {unknown} (a checkpoint of a newer megatron_upipe?)")
        return cls(**d)

    def num_parameters(self, vocab_size: int | None = None) -> int:
        """Parameter count (input and output embeddings counted once each unless tied)."""
        vocab = vocab_size if vocab_size is not None else self.vocab_size
        if vocab is None:
            raise ValueError("vocab_size is unknown: pass the tokenizer's vocabulary size")
        d, h, g = self.kv_channels, self.num_attention_heads, self.num_query_groups
        attn = self.hidden_size * (h + 2 * g) * d + h * d * self.hidden_size
        attn += (h + 2 * g) * d if self.qkv_bias else 0
        attn += 2 * d if self.qk_norm else 0
        mlp = 3 * self.hidden_size * self.ffn_hidden_size
        norms = 2 * self.hidden_size
        embeddings = (1 if self.tie_embeddings else 2) * vocab * self.hidden_size
        return self.num_layers * (attn + mlp + norms) + self.hidden_size + embeddings


_LLAMA31_ROPE = RopeScaling("llama3", 8.0, original_max_position_embeddings=8192, low_freq_factor=1.0,
                            high_freq_factor=4.0)

PRESETS: dict[str, LlamaArch] = {
    # The paper's models (arXiv 2602.21196, random init, Llama architecture). qwen3-32b-paper is the paper's
    # stand-in with Qwen3-32B's dims but Llama's block and vocabulary (no QK-norm): not the real Qwen3-32B.
    "llama3-8b": LlamaArch(32, 4096, 32, 8, 14336, 128, 128256, 500000.0),
    "llama3-70b": LlamaArch(80, 8192, 64, 8, 28672, 128, 128256, 500000.0),
    "qwen3-32b-paper": LlamaArch(64, 5120, 64, 8, 25600, 128, 128256, 1000000.0, norm_epsilon=1e-6),
    # Released models, as their HF config.json files define them (load their weights with
    # tools/convert_hf_llama.py hf-to-mcore and checkpoint.load).
    "llama3.1-8b": LlamaArch(32, 4096, 32, 8, 14336, 128, 128256, 500000.0, rope_scaling=_LLAMA31_ROPE),
    "llama3.1-70b": LlamaArch(80, 8192, 64, 8, 28672, 128, 128256, 500000.0, rope_scaling=_LLAMA31_ROPE),
    "qwen2.5-7b": LlamaArch(28, 3584, 28, 4, 18944, 128, 152064, 1000000.0, norm_epsilon=1e-6,
                            max_position_embeddings=32768, qkv_bias=True),
    "qwen3-8b": LlamaArch(36, 4096, 32, 8, 12288, 128, 151936, 1000000.0, norm_epsilon=1e-6,
                          max_position_embeddings=40960, qk_norm=True),
    "qwen3-32b": LlamaArch(64, 5120, 64, 8, 25600, 128, 151936, 1000000.0, norm_epsilon=1e-6,
                           max_position_embeddings=40960, qk_norm=True),
    # Tiny shapes for CPU tests and the demo (vocab from the tokenizer).
    "tiny": LlamaArch(2, 64, 8, 4, 128, 8, None, 10000.0),
    "tiny-gqa": LlamaArch(2, 64, 8, 2, 160, 8, None, 10000.0),
    "tiny-mha": LlamaArch(2, 64, 4, 4, 128, 16, None, 10000.0),
    "small": LlamaArch(4, 256, 8, 4, 688, 32, None, 10000.0),
}


def get_preset(name: str) -> LlamaArch:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"model.preset={name!r} is unknown; choose one of {sorted(PRESETS)}") from None
