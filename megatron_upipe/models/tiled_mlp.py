"""Sequence-tiled SwiGLU MLP: no [s, b, ffn] tensor is ever alive whole, only one tile's.

Legend: s_l tokens of this rank ([s/C], or [s/(C·t)] under sequence parallelism), T tokens of one tile (t·T
after the SP gather), b batch, D hidden size, F ffn hidden size, t tensor-parallel size, F/t the local share.

`TiledMLP` is megatron-core's `MLP` (same `linear_fc1` ColumnParallelLinear [2F/t, D] with rows [gate; up],
same `linear_fc2` RowParallelLinear [D, F/t], same init, TP sharding and `sharded_state_dict`), with a forward
that runs `tiled_swiglu_mlp`: for each of `chunks` sequence tiles, gather the tile over TP (SP only), fc1,
SwiGLU, fc2, reduce-scatter the tile's partial sums (SP) into the output buffer; without SP the output is
all-reduced once (RowParallel semantics). The autograd Function saves only its input and the two weights.
Backward, per tile: re-gather x and dout, recompute fc1 and SwiGLU, accumulate dW2, dW1 (float32 accumulators
for low-precision weights) and write dx (reduce-scattered per tile with SP, all-reduced once without).
Transient memory is O(T·F/t) instead of O(s_l·F/t); the all-gather/reduce-scatter volume equals megatron's.
The layer spec swaps it in (`with_tiled_mlp`), so `memory.mlp_chunks` changes no parameter or checkpoint;
`with_tiled_mlp_block` also swaps the layers' RMSNorms for `TiledRMSNorm` (same weight, saves only its input).

The pre-MLP norm is not fused into the op: its output [s_l, b, D] (saved here as the op's input) is the one
[s_l, b, D] tensor fusion would remove, and fusing would either move the norm weight into the MLP (TE's
`linear_fc1.layer_norm_weight`, a different checkpoint and HF layout) or override TransformerLayer's private
pre-MLP-norm step, which also carries megatron's norm recompute and activation offload hooks.
"""

from __future__ import annotations

import copy
import dataclasses
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_upipe.models.norm import RMSNorm
from megatron_upipe.models.seq_tiles import (
    accumulate_matmul,
    gather_tile,
    grad_accumulator,
    reduce_scatter_tile,
    tile_bounds,
    tp_size,
)
from megatron_upipe.models.tiled_norm import TiledRMSNorm


def _swiglu(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, b, 2F/t] -> (gate, up, silu(gate)), each [T, b, F/t] (gate, up are views of h)."""
    gate, up = torch.chunk(h, 2, dim=-1)  # [T, b, 2F/t] -> 2 x [T, b, F/t]
    return gate, up, F.silu(gate)


class _TiledSwiGLUMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, chunks, group, sequence_parallel):
        # x [s_l, b, D], w1 [2F/t, D] rows [gate; up], w2 [D, F/t]
        t = tp_size(group)
        out = torch.empty_like(x)  # [s_l, b, D]
        for start, end in tile_bounds(x.shape[0], chunks):
            xt = gather_tile(x[start:end], group, sequence_parallel)  # [T, b, D] -> [t·T, b, D] with SP
            _, up, act = _swiglu(F.linear(xt, w1))  # [t·T, b, 2F/t] -> [t·T, b, F/t]
            y = F.linear(act.mul_(up), w2)  # [t·T, b, D], partial sums over TP
            if sequence_parallel and t > 1:
                reduce_scatter_tile(y, group, out=out[start:end])  # [t·T, b, D] -> [T, b, D]
            else:
                out[start:end] = y
        if not sequence_parallel and t > 1:
            dist.all_reduce(out, group=group)
        ctx.save_for_backward(x, w1, w2)
        ctx.chunks, ctx.group, ctx.sequence_parallel = chunks, group, sequence_parallel
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w1, w2 = ctx.saved_tensors
        group, sp = ctx.group, ctx.sequence_parallel
        t = tp_size(group)
        dw1, dw2 = grad_accumulator(w1), grad_accumulator(w2)  # [2F/t, D], [D, F/t]
        dx = torch.empty_like(x)  # [s_l, b, D]
        f = w2.shape[1]
        for start, end in tile_bounds(x.shape[0], ctx.chunks):
            xt = gather_tile(x[start:end], group, sp)  # [t·T, b, D]
            dyt = gather_tile(dout[start:end], group, sp)  # [t·T, b, D]: reduce-scatter's backward
            h = F.linear(xt, w1)  # [t·T, b, 2F/t], recomputed
            gate, up, act = _swiglu(h)
            a = act * up  # [t·T, b, F/t]
            accumulate_matmul(dw2, dyt.flatten(0, 1).t(), a.flatten(0, 1))  # [D, t·T·b] @ [t·T·b, F/t]
            del a
            da = dyt @ w2  # [t·T, b, F/t]
            dh = torch.empty_like(h)  # [t·T, b, 2F/t] rows [gate; up] like w1
            torch.mul(da, act, out=dh[..., f:])  # d up
            del act
            dh[..., :f] = torch.ops.aten.silu_backward(da.mul_(up), gate)  # d gate
            del h, gate, up, da
            accumulate_matmul(dw1, dh.flatten(0, 1).t(), xt.flatten(0, 1))  # [2F/t, t·T·b] @ [t·T·b, D]
            dxt = dh @ w1  # [t·T, b, D], partial sums over TP
            if sp and t > 1:
                reduce_scatter_tile(dxt, group, out=dx[start:end])  # [t·T, b, D] -> [T, b, D]
            else:
                dx[start:end] = dxt
        if not sp and t > 1:
            dist.all_reduce(dx, group=group)  # ColumnParallel's input gradient
        return dx, dw1.to(w1.dtype), dw2.to(w2.dtype), None, None, None


def tiled_swiglu_mlp(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *, chunks: int, tp_group=None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """fc2(silu(gate) * up) with [gate; up] = fc1(x), in `chunks` sequence tiles.

    x [s_l, b, D] (SP-sharded when `sequence_parallel`), w1 [2F/t, D] rows [gate; up], w2 [D, F/t];
    returns [s_l, b, D] reduced over `tp_group` exactly like Column/RowParallelLinear.
    """
    return _TiledSwiGLUMLP.apply(x, w1, w2, chunks, tp_group, sequence_parallel)


def check_tiled_mlp_supported(config: TransformerConfig) -> None:
    problems = []
    if not config.gated_linear_unit or config.activation_func is not F.silu:
        problems.append("a SwiGLU MLP (gated_linear_unit=True, activation_func=F.silu)")
    if config.add_bias_linear:
        problems.append("no linear biases (add_bias_linear=False)")
    if config.use_te_activation_func or config.activation_func_clamp_value is not None or config.glu_linear_offset:
        problems.append("no TE activation, clamp or GLU offset")
    if problems:
        raise ValueError("memory.mlp_chunks > 1 (tiled MLP) needs " + "; ".join(problems))


class TiledMLP(MLP):
    """megatron-core MLP whose forward runs `tiled_swiglu_mlp` over `chunks` sequence tiles."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, *, chunks: int, **kwargs) -> None:
        check_tiled_mlp_supported(config)
        if chunks < 1:
            raise ValueError(f"mlp chunks={chunks} must be positive")
        super().__init__(config, submodules, **kwargs)
        self.chunks = chunks

    @classmethod
    def as_mlp_submodule(cls, submodules, config, pg_collection, is_mtp_layer, is_expert=False, input_size=None,
                         ffn_hidden_size=None, name=None, *, chunks: int) -> "TiledMLP":
        if is_expert:
            raise ValueError("the tiled MLP is for dense layers, not MoE experts")
        return cls(config, submodules, chunks=chunks, tp_group=pg_collection.tp, input_size=input_size,
                   ffn_hidden_size=ffn_hidden_size if ffn_hidden_size is not None else config.ffn_hidden_size,
                   name=name)

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs):
        if per_token_scale is not None:
            raise NotImplementedError("the tiled MLP has no per-token scale (MoE only)")
        out = tiled_swiglu_mlp(
            hidden_states, self.linear_fc1.weight, self.linear_fc2.weight, chunks=self.chunks,
            tp_group=self.tp_group, sequence_parallel=self.linear_fc1.sequence_parallel,
        )  # [s_l, b, D]
        return out, None


def with_tiled_mlp(layer_spec: ModuleSpec, chunks: int) -> ModuleSpec:
    """A copy of a local-spec transformer layer whose MLP is `TiledMLP` (same linear_fc1/linear_fc2 builders)."""
    mlp = layer_spec.submodules.mlp
    sub = mlp.keywords.get("submodules") if isinstance(mlp, partial) else getattr(mlp, "submodules", None)
    if not (isinstance(sub, MLPSubmodules) and sub.linear_fc1 is ColumnParallelLinear
            and sub.linear_fc2 is RowParallelLinear):
        raise ValueError(
            "memory.mlp_chunks > 1 tiles megatron-core's local dense MLP (ColumnParallelLinear fc1, RowParallelLinear "
            f"fc2), as in the none/ulysses/upipe layer specs; this layer spec has {mlp!r} (TransformerEngine fuses "
            "the pre-MLP norm into fc1): set memory.mlp_chunks=1"
        )
    spec = copy.copy(layer_spec)
    spec.submodules = copy.copy(layer_spec.submodules)
    spec.submodules.mlp = partial(TiledMLP.as_mlp_submodule, submodules=sub, chunks=chunks)
    return spec


def with_tiled_mlp_block(block: TransformerBlockSubmodules, chunks: int,
                         residual_grad: bool = False) -> TransformerBlockSubmodules:
    """The block spec with every layer's MLP tiled into `chunks` sequence tiles, and its RMSNorms (input,
    pre-MLP, final) replaced by `TiledRMSNorm`, which saves only its input (see tiled_norm.py); with
    `residual_grad` (memory.residual_grad_in_place) the pre-MLP norm also hands the layer its residual and forms the
    residual's gradient in place."""
    norm = partial(TiledRMSNorm, chunks=chunks)
    layers = []
    for layer_spec in block.layer_specs:
        spec = with_tiled_mlp(layer_spec, chunks)
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            if getattr(spec.submodules, name) is RMSNorm:
                pre_mlp = residual_grad and name == "pre_mlp_layernorm"
                setattr(spec.submodules, name, partial(norm, residual_grad=pre_mlp))
        layers.append(spec)
    return dataclasses.replace(
        block, layer_specs=layers, layer_norm=norm if block.layer_norm is RMSNorm else block.layer_norm
    )
