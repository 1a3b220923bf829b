"""Full recompute without keeping the recomputed layer's output: one [s/cp, b, D] tensor less at the peak.

megatron-core's full recompute (`tensor_parallel.checkpoint`) re-runs a layer in its backward and then calls
`torch.autograd.backward(outputs, grads)`. The recomputed output is only the root of that backward (autograd reads
its shape, never its values), yet it stays alive through the whole layer backward, which is where the step's peak
is at long context (6 GiB per rank for Llama3-8B at 6M tokens on 8 ranks).

A forward hook on each transformer layer replaces, during the recompute only (grad enabled and megatron-core's
`is_checkpointing()`), the layer's hidden-states output with `shape_only(output)`: a one-element tensor expanded to
the output's shape, whose backward hands the incoming gradient to the real output unchanged. The real output's
storage is freed when the layer returns. Numerically transparent (identity backward); the first, no-grad forward
(whose output is the next layer's input) is untouched.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.random import is_checkpointing


class _ShapeOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # x [s, b, D] -> a [s, b, D] expanded view of one element (no data kept)
        return x.new_zeros(()).expand(x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad


def shape_only(x: torch.Tensor) -> torch.Tensor:
    """Autograd stand-in of `x` with x's shape and grad_fn chain but no storage of x's size."""
    return _ShapeOnly.apply(x)


def _drop_output(layer, args, output):
    if not (torch.is_grad_enabled() and is_checkpointing()):
        return None
    if isinstance(output, tuple) and isinstance(output[0], torch.Tensor) and output[0].requires_grad:
        return (shape_only(output[0]), *output[1:])
    if isinstance(output, torch.Tensor) and output.requires_grad:
        return shape_only(output)
    return None


def require_per_layer_recompute(config, what: str) -> None:
    """ValueError naming `what` unless `config` (a TransformerConfig) runs megatron-core's full recompute with one
    layer per checkpoint, the setting the memory_switches hooks are written for: method "uniform" with one layer per
    chunk (every layer), or method "block" (the first recompute_num_layers layers, each in a checkpoint of its own;
    the others run plainly and the hooks leave them alone)."""
    one_each = config.recompute_method == "block" or (config.recompute_method == "uniform"
                                                      and config.recompute_num_layers == 1)
    if config.recompute_granularity != "full" or not one_each:
        raise ValueError(
            f"{what} needs megatron-core's full recompute of one layer per checkpoint "
            "(recompute_granularity='full' with recompute_method='uniform' and recompute_num_layers=1, or "
            f"recompute_method='block'); got {config.recompute_granularity!r}, {config.recompute_method!r}, "
            f"{config.recompute_num_layers!r}")


def drop_recomputed_outputs(model: torch.nn.Module, config) -> list:
    """Install the hook on every TransformerLayer of `model` (TransformerConfig `config`); returns the handles.

    Needs one layer per checkpoint (require_per_layer_recompute): inside a chunk of several layers an output is the
    next layer's input, whose values are read."""
    require_per_layer_recompute(config, "dropping recomputed layer outputs")
    return [m.register_forward_hook(_drop_output) for m in model.modules()
            if type(m).__name__ == "TransformerLayer"]
