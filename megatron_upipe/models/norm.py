"""RMSNorm for our layer specs (HF Llama's formula), usable with sequence parallelism.

megatron-core's local `WrappedTorchNorm` refuses sequence parallelism; with SP every tensor-parallel rank sees a
different slice of the sequence, so the weight gradient is partial. Marking the weight `sequence_parallel=True`
makes megatron-core's `finalize_model_grads` all-reduce it over the TP group, which is all SP needs.
Computes in float32 and casts back like `transformers`' `LlamaRMSNorm`.
"""

from __future__ import annotations

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.Module):
    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, h] -> [s, b, h]
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
