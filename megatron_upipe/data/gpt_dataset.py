"""megatron-core's GPTDataset and MockGPTDataset with a loss-mask cache that the first sample cannot change.

megatron-core 0.19.2's `GPTDataset.__getitem__` computes the loss mask of the first sample it serves, stores that
tensor itself as `cached_loss_mask` (the masks are cacheable without reset_position_ids / reset_attention_mask /
eod_mask_loss), and only then zeroes, in place, the positions whose label is the pad id: it writes those zeros into
the cache. Every later sample starts from a clone of the cache, so it loses the loss on whatever positions the
first sample had pad labels at (NVIDIA/Megatron-LM issue 1711). What a sample's loss counts then depends on which
sample the process served first, and a resumed run serves another one first: its loss curve leaves the
uninterrupted run's. Real text never holds the pad id (the tokenizer never emits it; padding only ends a short last
sample), but mock data counts through every id (document = 1, 2, 3, ..., eod), so with the shipped sentencepiece
tokenizer (pad 3) the 3rd token of each document start is a pad label.

Here the cache stores a copy: it stays all ones, and every sample's mask is its own (zero exactly where its own
label is the pad id), whatever was read before. The subclasses change nothing else.
"""

from __future__ import annotations

from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset


class _LossMaskCacheCopy:
    """`cached_loss_mask` stores a clone of what megatron assigns (before it masks the pad labels in place)."""

    @property
    def cached_loss_mask(self):
        return self.__dict__.get("_cached_loss_mask_copy")

    @cached_loss_mask.setter
    def cached_loss_mask(self, mask) -> None:
        self.__dict__["_cached_loss_mask_copy"] = None if mask is None else mask.clone()


class GPTDatasetMaskCopy(_LossMaskCacheCopy, GPTDataset):
    """megatron-core's GPTDataset over an indexed dataset, with the loss-mask cache fixed (see the module)."""


class MockGPTDatasetMaskCopy(_LossMaskCacheCopy, MockGPTDataset):
    """megatron-core's MockGPTDataset, with the loss-mask cache fixed (see the module)."""
