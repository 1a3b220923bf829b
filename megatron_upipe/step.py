"""One forward/backward pass over megatron-core's pipeline schedules: the step the training job runs and the
memory planner simulates (both call `forward_backward`; neither owns it).

Legend: b micro-batch size, s sequence length, C context-parallel size. `forward_step` feeds one micro-batch
([b, s/C] per rank after the CP split) to the model, which returns the per-token loss [b, s/C]; `loss_func`
returns (sum, token count, report), so megatron's schedule divides by the count and by the number of
micro-batches and DDP averages over dp x cp. A batch is a dict of tokens, labels, position_ids, loss_mask, and
with packed documents (data.document_mask) the sample's cu_seqlens, passed to the model as megatron's THD
PackedSeqParams.
"""

from __future__ import annotations

from functools import partial

import torch

from megatron_upipe.data.packing import packed_seq_params


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """(masked loss sum, unmasked token count, {"lm loss": [sum, count]}) of one micro-batch."""
    mask = loss_mask.float()  # [b, s/C]
    total = (per_token_loss.float() * mask).sum()
    count = mask.sum()
    return total, count.to(torch.int), {"lm loss": torch.stack([total.detach(), count.detach()])}


def forward_step(data_iterator, model):
    """megatron-core's forward_step_func: the next micro-batch through the model, and its loss function."""
    batch = next(data_iterator)
    packed = {"packed_seq_params": packed_seq_params(batch["cu_seqlens"])} if "cu_seqlens" in batch else {}
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], **packed)  # [b, s/C] loss
    return out, partial(loss_func, batch["loss_mask"])


def forward_backward(model, data_iterator, *, num_microbatches: int, seq_length: int, micro_batch_size: int,
                     forward_only: bool, forward_step_func=forward_step) -> list[dict]:
    """Forward (and backward unless forward_only) over `num_microbatches` micro-batches with the pipeline schedule
    of the current parallel layout; returns the last stage's per-micro-batch loss reports (empty elsewhere).
    `model` is the wrapped stage (DDP / Megatron-FSDP); `seq_length` is the full sequence (the schedule divides
    by CP itself)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=[model],
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
