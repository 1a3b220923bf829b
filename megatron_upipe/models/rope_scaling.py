"""RoPE inverse frequencies with the scalings of HF checkpoints (`linear`, Llama 3.1+'s `llama3`, `yarn`).

megatron-core's `RotaryEmbedding` computes `inv_freq = 1 / θ^(2i/rot)` (float32) and turns positions into angles
`outer(positions, inv_freq)`; the scalings only change `inv_freq`, so `apply_rope_scaling(rotary, arch)` replaces
that attribute (a plain tensor, not a buffer: state dicts are unchanged) on the model's rotary module. The formulas
are transformers' `_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters` and
`_compute_yarn_parameters` (modeling_rope_utils.py), written here so that training does not import transformers;
tests/test_rope_scaling.py compares them with transformers' own functions.

yarn also multiplies cos and sin by an attention factor f. With a full-width rotary (every family here) that is
q·k scaled by f², i.e. the softmax scale f²/√d: `LlamaArch.rope_scaling.logit_scale`, which the model builder puts
into megatron-core's `softmax_scale` (the UPipe/Ulysses op and megatron's attention both take it from there).
"""

from __future__ import annotations

import math

import torch

from megatron_upipe.models.presets import RopeScaling


def base_inv_freq(theta: float, rot_dim: int) -> torch.Tensor:
    """[rot_dim/2] float32: 1 / θ^(2i/rot_dim), as megatron-core's RotaryEmbedding and HF compute it."""
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).to(torch.float32) / rot_dim))


def _llama3(inv_freq: torch.Tensor, sc: RopeScaling) -> torch.Tensor:
    old = sc.original_max_position_embeddings
    low_wavelen, high_wavelen = old / sc.low_freq_factor, old / sc.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq)  # long wavelengths: / factor
    smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, rot_dim: int, sc: RopeScaling) -> torch.Tensor:
    orig = sc.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `orig`
        return (rot_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(sc.beta_fast), correction_dim(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = torch.clamp((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, rot_dim, 2).to(dtype=torch.float) / rot_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (sc.factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequencies unchanged), 0: interpolate (/ factor)
    return interpolation * (1 - keep) + extrapolation * keep


def scaled_inv_freq(theta: float, rot_dim: int, scaling: RopeScaling | None) -> torch.Tensor:
    """[rot_dim/2] float32 inverse frequencies of RoPE with base θ and the given scaling (None: plain RoPE)."""
    if scaling is None:
        return base_inv_freq(theta, rot_dim)
    if scaling.kind == "linear":
        return base_inv_freq(theta, rot_dim) / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(base_inv_freq(theta, rot_dim), scaling)
    return _yarn(theta, rot_dim, scaling)


def apply_rope_scaling(rotary: torch.nn.Module, theta: float, rot_dim: int, scaling: RopeScaling | None) -> None:
    """Give megatron-core's RotaryEmbedding `rotary` the scaled inverse frequencies (on its current device)."""
    if scaling is None:
        return
    rotary.inv_freq = scaled_inv_freq(theta, rot_dim, scaling).to(rotary.inv_freq.device)
