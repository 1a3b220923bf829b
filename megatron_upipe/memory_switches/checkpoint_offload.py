"""Full activation recompute with each checkpointed layer input kept in host memory until its backward.

megatron-core's full recompute (`recompute_granularity="full"`, method "uniform", one layer per chunk) runs every
`TransformerLayer` inside `tensor_parallel.checkpoint`: forward under `no_grad`, then `ctx.save_for_backward(
hidden_states [s/cp, b, D], <None...>, rotary_pos_emb, ...)`; backward restores the RNG state, re-runs the layer and
back-propagates. The only per-layer tensor kept between forward and backward is that layer input. This module
sends exactly that tensor to a `HostOffloader` and brings it back when the layer's backward unpacks it.

How, without touching megatron-core: forward hooks on the block and its layers, and a `saved_tensors_hooks` pair
pushed only for the instant megatron saves the checkpoint inputs:

    block pre-hook      training forward with grad enabled: arm
    layer pre-hook      (armed, grad disabled = inside the checkpoint) remember this layer's `hidden_states`
    layer post-hook     push the pack/unpack hooks
    save_for_backward   pack(hidden_states) -> offloader.to_host; pop the hooks (RoPE angles etc. are saved as usual)
    block post-hook     disarm (and pop the hooks if a save never came)

With the offloader's `prefetch_ahead` (memory.offload_prefetch), unpacking layer i's input also starts the copy back
of layer i-1's (the next backward's, in this block's forward): it travels while layer i recomputes and
back-propagates, at the cost of one more layer input [s/cp, b, D] alive on the device.

With the offloader's `disk_layers` = N (memory.offload_disk_layers), the first N layer inputs of each forward of the
block go to its disk tier instead (`to_host(t, disk=True)`): they stay offloaded longest.

A pack call that is not the remembered layer input means megatron-core changed what it saves: it raises instead of
offloading the wrong tensor. The recompute in backward runs with grad enabled and outside the armed window, so it is
untouched. Works the same on fake tensors (the memory planner) and with any offloader that has `to_host`/`to_device`.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks

from megatron_upipe.memory_switches.offload import HostOffloader
from megatron_upipe.memory_switches.recompute_output import require_per_layer_recompute


class CheckpointOffload:
    """Offloads the saved input of every checkpointed layer of one TransformerBlock; `remove()` undoes it."""

    def __init__(self, block: torch.nn.Module, offloader: HostOffloader) -> None:
        config = block.config
        require_per_layer_recompute(config, "offloading checkpointed layer inputs")
        if getattr(config, "distribute_saved_activations", False):
            raise ValueError("distribute_saved_activations replaces the saved input's data: not combinable with "
                             "offload")
        self.offloader = offloader
        self._armed = False
        self._pending: torch.Tensor | None = None  # the input of the layer being checkpointed now
        self._last = None  # weakref to the HostCopy of the previous layer's input in this block's forward
        self._packed = 0  # layer inputs offloaded in this block's forward so far
        self._hooks: saved_tensors_hooks | None = None  # pushed between a layer's end and megatron's save
        self._handles = [
            block.register_forward_pre_hook(self._block_pre),
            block.register_forward_hook(self._block_post, always_call=True),
        ]
        for layer in block.layers:
            self._handles += [
                layer.register_forward_pre_hook(self._layer_pre, with_kwargs=True),
                layer.register_forward_hook(self._layer_post),
            ]

    def remove(self) -> None:
        self._pop()
        for h in self._handles:
            h.remove()
        self._handles = []

    # --- module hooks -------------------------------------------------------------------------------------------
    def _block_pre(self, block, args) -> None:
        self._armed = block.training and torch.is_grad_enabled()
        self._pending, self._last, self._packed = None, None, 0

    def _block_post(self, block, args, output) -> None:
        self._pop()
        self._armed, self._pending, self._last = False, None, None

    def _layer_pre(self, layer, args, kwargs) -> None:
        self._pop()
        if self._armed and not torch.is_grad_enabled():  # inside megatron's checkpointed forward
            self._pending = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def _layer_post(self, layer, args, output) -> None:
        if self._armed and not torch.is_grad_enabled() and self._pending is not None and self._hooks is None:
            self._hooks = saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()

    # --- saved-tensor hooks (active only around megatron's save_for_backward) ------------------------------------
    def _pack(self, t: torch.Tensor):
        if t is not self._pending:
            self._pop()
            raise RuntimeError(
                "megatron-core's checkpoint saved a tensor other than the layer input first "
                f"(shape {tuple(t.shape)}); megatron_upipe.memory_switches.checkpoint_offload needs updating"
            )
        self._pending = None
        self._pop()  # the remaining saved tensors (RoPE angles, shared by all layers) stay where they are
        copy = self.offloader.to_host(t, disk=self._packed < getattr(self.offloader, "disk_layers", 0))
        self._packed += 1
        copy.before, self._last = self._last, weakref.ref(copy)
        return copy

    def _unpack(self, copy) -> torch.Tensor:
        out = self.offloader.to_device(copy)
        before = copy.before() if copy.before is not None else None
        if before is not None and self.offloader.prefetch_ahead:
            self.offloader.prefetch(before)
        return out

    def _pop(self) -> None:
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)


def attach_checkpoint_offload(model: torch.nn.Module, offloader: HostOffloader | None = None) -> HostOffloader:
    """Offload the checkpointed layer inputs of `model` (a GPTModel, or anything holding a `.decoder` block, possibly
    wrapped by DDP/FSDP/Float16Module as `.module`) to `offloader` (a new HostOffloader by default); returns it.

    The model's TransformerConfig must use megatron-core's full recompute of every layer (see CheckpointOffload)."""
    offloader = offloader if offloader is not None else HostOffloader()
    inner = model
    while not hasattr(inner, "decoder") and hasattr(inner, "module"):
        inner = inner.module
    if not hasattr(inner, "decoder"):
        raise TypeError(f"{type(model).__name__} holds no TransformerBlock `.decoder`")
    inner.decoder._checkpoint_offload = CheckpointOffload(inner.decoder, offloader)
    return offloader
