"""Llama-architecture model shapes: the presets users name with `model.preset`.

Only shapes live here (no torch, no megatron-core), so configs, validation and the memory planner can use them
without building anything. Every preset is a Llama block: RMSNorm, SwiGLU MLP, RoPE, GQA, untied embeddings.
`vocab_size=None` means "take it from the tokenizer".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}; pick a group count that divides the head count"
            )

    def replace(self, **changes) -> "LlamaArch":
        return dataclasses.replace(self, **changes)

    def num_parameters(self, vocab_size: int | None = None) -> int:
        """Parameter count (untied input and output embeddings, no biases)."""
        vocab = vocab_size if vocab_size is not None else self.vocab_size
        if vocab is None:
            raise ValueError("vocab_size is unknown: pass the tokenizer's vocabulary size")
        d, h, g = self.kv_channels, self.num_attention_heads, self.num_query_groups
        attn = self.hidden_size * (h + 2 * g) * d + h * d * self.hidden_size
        mlp = 3 * self.hidden_size * self.ffn_hidden_size
        norms = 2 * self.hidden_size
        return self.num_layers * (attn + mlp + norms) + self.hidden_size + 2 * vocab * self.hidden_size


PRESETS: dict[str, LlamaArch] = {
    # The paper's models (arXiv 2602.21196, random init, Llama architecture).
    "llama3-8b": LlamaArch(32, 4096, 32, 8, 14336, 128, 128256, 500000.0),
    "llama3-70b": LlamaArch(80, 8192, 64, 8, 28672, 128, 128256, 500000.0),
    "qwen3-32b": LlamaArch(64, 5120, 64, 8, 25600, 128, 128256, 1000000.0, norm_epsilon=1e-6),
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
