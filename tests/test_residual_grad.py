"""memory.residual_grad_in_place: the tiled pre-MLP norm forms the residual's gradient in place (models/tiled_norm.py).

The reference is autograd's own sum of the two gradients of the layer's mid-point h (the residual path's and the
pre-MLP norm's), as the plain path forms it. Checked:
- the norm alone, bf16 and float32, inside h -> (norm -> an element-wise consumer) + h: the gradients of h's input
  and of the norm weight are bit-identical (torch.equal) to the plain path, also when only one of the two paths
  carries a gradient; the tracked backward peak is lower (in bf16 by one [s, b, D] tensor);
- the model: the tiny Llama with a tiled MLP, UPipe over cp 2 with full recompute, one Adam step on 2 gloo ranks:
  loss, every gradient and every updated parameter bit-identical with the switch on and off (megatron-core's
  TransformerLayer takes the norm's (output, residual) pair);
- the switch refuses mlp_chunks=1 in one line.
The planner against a real run with the switch on is a case of tests/test_planner.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_helper import run_on_ranks

S, B, D, TILES = 96, 2, 48, 5


def _norm_path(x0, w0, W, g, dtype, in_place: bool, paths=("norm", "residual")):
    """Gradients (dx, dw) and the tracked backward peak of h = 1.5 x; out = [h] + [silu(norm(h)) * W] (an
    element-wise consumer: the norm's backward is the backward's peak)."""
    from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker
    from megatron_upipe.models.tiled_norm import tiled_rms_norm

    x = x0.to(dtype).requires_grad_()
    w = w0.to(dtype).requires_grad_()
    h = x * 1.5  # [S, B, D], a non-leaf as the layer's mid-point is
    if in_place:
        y, r = tiled_rms_norm(h, w, 1e-5, TILES, residual=True)
    else:
        y, r = tiled_rms_norm(h, w, 1e-5, TILES), h
    parts = []
    if "residual" in paths:
        parts.append(r)
    if "norm" in paths:
        parts.append(torch.nn.functional.silu(y) * W.to(dtype))
    out = sum(parts)
    del y, r, h, parts
    with PeakMemoryTracker() as mem:
        out.backward(g.to(dtype, copy=True))  # a tensor of its own: the in-place sum writes into it
    return x.grad, w.grad, mem.peak_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_forms_the_residual_gradient_in_place_bit_identical(dtype):
    gen = torch.Generator().manual_seed(0)
    x0, g = torch.randn(S, B, D, generator=gen), torch.randn(S, B, D, generator=gen)
    w0, W = 1 + 0.1 * torch.randn(D, generator=gen), torch.randn(D, generator=gen)
    for paths in (("norm", "residual"), ("norm",), ("residual",)):
        dx0, dw0, plain_peak = _norm_path(x0, w0, W, g, dtype, False, paths)
        dx1, dw1, peak = _norm_path(x0, w0, W, g, dtype, True, paths)
        assert torch.equal(dx0, dx1), (dtype, paths)
        assert (dw0 is None and dw1 is None) or torch.equal(dw0, dw1), (dtype, paths)
        if len(paths) == 2:
            # the norm's whole dx [S, B, D] is gone; in float32 the consumer's backward (before the norm's) is
            # then the peak, a tile's temporaries short of a whole tensor above it
            saved = S * B * D * dtype.itemsize if dtype == torch.bfloat16 else 1
            assert plain_peak - peak >= saved, (plain_peak, peak)


def _model_job(rank, world_size):
    from megatron_upipe.parallel import ParallelLayout
    from tests.llama_harness import random_setup, run_layout

    arch, hf_sd, tokens = random_setup("tiny-gqa", 256, 2, 32)
    layout = ParallelLayout(cp=2, cp_strategy="upipe")
    return [run_layout(layout, arch, hf_sd, tokens, steps=1, recompute_granularity="full", mlp_chunks=3,
                       residual_grad_in_place=on) for on in (False, True)]


def test_model_step_bit_identical_with_the_switch():
    for off, on in run_on_ranks(_model_job, 2):
        assert off.losses == on.losses
        assert off.grads.keys() == on.grads.keys() and off.params.keys() == on.params.keys()
        for name in off.grads:
            assert torch.equal(off.grads[name], on.grads[name]), name
        for name in off.params:
            assert torch.equal(off.params[name], on.params[name]), name


def test_switch_needs_the_tiled_norm():
    from megatron_upipe.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["memory.residual_grad_in_place=true", "memory.mlp_chunks=1"])
    assert "\n" not in str(e.value) and "memory.mlp_chunks > 1" in str(e.value)
