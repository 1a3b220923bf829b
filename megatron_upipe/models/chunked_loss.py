"""Chunked LM head + vocab-parallel cross-entropy: the [s, b, V/t] logits never exist whole.

Legend: s_l tokens of this rank's hidden states ([s/C], or [s/(C·t)] under sequence parallelism), s/C tokens of
the loss (every TP rank returns the loss of all its CP share, like megatron), T tokens of one chunk (t·T after
the SP gather), b batch, D hidden size, V/t this TP rank's share of the (padded) vocabulary.

Forward, per chunk: gather the hidden chunk over TP (SP only), logits = h @ W^T, then megatron-core's own
vocab-parallel cross-entropy math (`VocabParallelCrossEntropy`, float32, max and sum-exp all-reduced over TP).
Saved for backward: the hidden states, W, the labels and per token the float32 max and sum-exp ([s/C, b] each).
Backward, per chunk: recompute the logits, softmax = exp(logits - max) / sum_exp (no collective), subtract the
target's one-hot on the rank owning it, scale by the loss gradient, cast to the logits' dtype (as autograd does
in megatron's path), accumulate dW (float32 for low-precision weights) and dh (reduce-scattered per chunk with
SP, all-reduced once without: ColumnParallelLinear's input gradient).

`ChunkedLossGPTModel` is megatron-core's GPTModel whose forward with labels routes the final hidden states
through this op via GPTModel's `output_processor` hook; without labels it returns logits as before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.utils import VocabUtility

from megatron_upipe.models.seq_tiles import (
    accumulate_matmul,
    gather_tile,
    grad_accumulator,
    reduce_scatter_tile,
    tile_bounds,
    tp_size,
)


def _chunk_view(x: torch.Tensor, start: int, end: int, t: int, sp: bool) -> torch.Tensor:
    """View of the rows of x [s/C, b] that the (SP-gathered) chunk [start, end) holds: [T, b], or [t, T, b]."""
    if not sp:
        return x[start:end]
    return x.view(t, x.shape[0] // t, *x.shape[1:])[:, start:end]  # [s/C, b] -> [t, s_l, b] -> [t, T, b]


def _chunk_rows(x: torch.Tensor, start: int, end: int, t: int, sp: bool) -> torch.Tensor:
    """Those rows in the chunk's token order (rank-major with SP): [T, b] or [t·T, b] (a copy with SP)."""
    v = _chunk_view(x, start, end, t, sp)
    return v.flatten(0, 1) if sp else v  # [t, T, b] -> [t·T, b]


def _put_rows(x: torch.Tensor, value: torch.Tensor, start: int, end: int, t: int, sp: bool) -> None:
    """x[chunk rows] = value ([T, b] or [t·T, b] in the chunk's token order)."""
    view = _chunk_view(x, start, end, t, sp)
    view.copy_(value.view(view.shape))  # [t·T, b] -> [t, T, b] with SP


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunks, group, sequence_parallel):
        # hidden [s_l, b, D], weight [V/t, D], labels [s/C, b] -> loss [s/C, b] float32
        t = tp_size(group)
        sp = sequence_parallel and t > 1
        rank = dist.get_rank(group) if group is not None else 0
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(weight.shape[0], rank, t)
        loss = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)  # [s/C, b]
        logits_max = torch.empty_like(loss)  # [s/C, b]
        sum_exp = torch.empty_like(loss)  # [s/C, b]
        for start, end in tile_bounds(hidden.shape[0], chunks):
            h = gather_tile(hidden[start:end], group, sp)  # [T, b, D] -> [t·T, b, D] with SP
            target = _chunk_rows(labels, start, end, t, sp)  # [t·T, b]
            logits32, mx = VocabParallelCrossEntropy.calculate_logits_max(F.linear(h, weight))  # [t·T, b, V/t]
            if t > 1:
                dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
            _, _, predicted, sum_exp_c, exp_logits = VocabParallelCrossEntropy.calculate_predicted_logits(
                logits32, target, mx, vocab_start, vocab_end
            )
            if t > 1:
                dist.all_reduce(predicted, group=group)
                dist.all_reduce(sum_exp_c, group=group)
            del exp_logits, logits32
            _put_rows(loss, torch.log(sum_exp_c) - predicted, start, end, t, sp)  # megatron's loss
            _put_rows(logits_max, mx, start, end, t, sp)
            _put_rows(sum_exp, sum_exp_c, start, end, t, sp)
        ctx.save_for_backward(hidden, weight, labels, logits_max, sum_exp)
        ctx.chunks, ctx.group, ctx.sp = chunks, group, sp
        ctx.vocab_range = (vocab_start, vocab_end)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        hidden, weight, labels, logits_max, sum_exp = ctx.saved_tensors
        dloss = dloss.contiguous()  # [s/C, b]
        group, sp = ctx.group, ctx.sp
        t = tp_size(group)
        vocab_start, vocab_end = ctx.vocab_range
        dweight = grad_accumulator(weight)  # [V/t, D]
        dhidden = torch.empty_like(hidden)  # [s_l, b, D]
        for start, end in tile_bounds(hidden.shape[0], ctx.chunks):
            h = gather_tile(hidden[start:end], group, sp)  # [t·T, b, D]
            target = _chunk_rows(labels, start, end, t, sp)  # [t·T, b]
            mx = _chunk_rows(logits_max, start, end, t, sp)  # [t·T, b]
            logits32 = F.linear(h, weight).float()  # [t·T, b, V/t], recomputed
            sum_exp_c = _chunk_rows(sum_exp, start, end, t, sp)  # [t·T, b]
            # [t·T, b] -> [t·T, b, 1] broadcasts; megatron's operation order
            softmax = logits32.sub_(mx.unsqueeze(-1)).exp_().div_(sum_exp_c.unsqueeze(-1))
            target_mask = (target < vocab_start) | (target >= vocab_end)
            masked_target = (target - vocab_start).masked_fill_(target_mask, 0)  # [t·T, b]
            grad2d, arange, update, grad = VocabParallelCrossEntropy.prepare_gradient_calculation_operands(
                softmax, target_mask
            )
            grad = VocabParallelCrossEntropy.calculate_gradients(
                grad2d, arange, masked_target.view(-1), update, grad,  # [t·T, b] -> [t·T·b]
                _chunk_rows(dloss, start, end, t, sp),
            ).to(weight.dtype)  # [t·T, b, V/t], dlogits
            del softmax, grad2d
            accumulate_matmul(dweight, grad.flatten(0, 1).t(), h.flatten(0, 1))  # [V/t, t·T·b] @ [t·T·b, D]
            dh = grad @ weight  # [t·T, b, D], partial sums over TP
            del grad
            if sp:
                reduce_scatter_tile(dh, group, out=dhidden[start:end])  # [t·T, b, D] -> [T, b, D]
            else:
                dhidden[start:end] = dh
        if not sp and t > 1:
            dist.all_reduce(dhidden, group=group)
        return dhidden, dweight.to(weight.dtype), None, None, None, None


def chunked_lm_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunks: int, tp_group=None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """Per-token cross-entropy of the vocab-parallel LM head, in `chunks` sequence chunks.

    hidden [s_l, b, D] (SP-sharded when `sequence_parallel`), weight [V/t, D], labels [s/C, b] (sequence-first);
    returns loss [s/C, b] float32, equal to vocab_parallel_cross_entropy(output_layer(hidden), labels).
    """
    return _ChunkedLMLoss.apply(hidden, weight, labels, chunks, tp_group, sequence_parallel)


class ChunkedLossGPTModel(GPTModel):
    """GPTModel whose training forward (with labels) computes the loss with `chunked_lm_loss`."""

    def __init__(self, *args, loss_chunks: int, **kwargs) -> None:
        if loss_chunks < 1:
            raise ValueError(f"loss_chunks={loss_chunks} must be positive")
        super().__init__(*args, **kwargs)
        if self.config.mtp_num_layers or self.config.use_mup:
            raise ValueError("memory.loss_chunks > 1 supports neither multi-token prediction nor MuP logit scaling")
        self.loss_chunks = loss_chunks

    def forward(self, *args, labels=None, output_processor=None, **kwargs):
        if labels is not None and output_processor is None:
            output_processor = self._chunked_loss
        return super().forward(*args, labels=labels, output_processor=output_processor, **kwargs)

    def _chunked_loss(self, *, hidden_states, output_layer, output_weight, labels, **_) -> torch.Tensor:
        weight = output_weight if output_weight is not None else output_layer.weight
        loss = chunked_lm_loss(
            hidden_states, weight, labels.transpose(0, 1).contiguous(),  # [b, s/C] -> [s/C, b]
            chunks=self.loss_chunks, tp_group=self.pg_collection.tp,
            sequence_parallel=output_layer.sequence_parallel,
        )  # [s/C, b]
        return loss.transpose(0, 1).contiguous()  # [s/C, b] -> [b, s/C], like compute_language_model_loss
