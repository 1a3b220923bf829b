"""RMSNorm for our layer specs (HF Llama's formula), usable with sequence parallelism.

megatron-core's local `WrappedTorchNorm` refuses sequence parallelism; with SP every tensor-parallel rank sees a
different slice of the sequence, so the weight gradient is partial. Marking the weight `sequence_parallel=True`
makes megatron-core's `finalize_model_grads` all-reduce it over the TP group, which is all SP needs.
Computes in float32 and casts back like `transformers`' `LlamaRMSNorm`.

A norm can be `deferred` to its consumer (the UPipe/Ulysses attention op applies the layer's input norm itself,
tile by tile, see models/upipe_attention.py): its forward then passes x through and the consumer reads `weight`
and `eps`. The parameter stays here, so state dicts and checkpoints do not change.
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
        self.deferred = False  # True: the consumer applies this norm (forward is the identity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, h] -> [s, b, h]
        if self.deferred:
            return x
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
