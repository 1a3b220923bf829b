"""A training split read for any number of samples, in an order that does not depend on that number.

megatron's GPTDataset shuffles over as many epochs as its `num_samples` needs (one document shuffle over all the
epochs, then one sample shuffle), so which sample comes i-th depends on the total: a run extended by raising
train.steps would read other samples for steps it had already planned, and a resumed run would not continue the
curve of the shorter one. Here the megatron dataset is built for one epoch (a size fixed by the data, the split and
seq_length, not by train.steps) and `EpochOrder` reads it over and over: epoch 0 in megatron's own shuffled order
(a run within one epoch reads exactly what megatron gives), epoch e >= 1 in a permutation of that epoch seeded by
(seed, e). Sample i is then a function of the data, seed, seq_length, split and i alone, so the first k samples are
the same for every length >= k.
"""

from __future__ import annotations

import numpy as np
import torch


class EpochOrder(torch.utils.data.Dataset):
    """`base` (one epoch, megatron's order) read for `num_samples` samples; see the module docstring."""

    def __init__(self, base, num_samples: int, seed: int):
        if len(base) == 0:
            raise ValueError("the training split holds no sample: give more documents or a larger train weight in "
                             "data.split")
        self.base, self.num_samples, self.seed = base, num_samples, seed
        self._perm: tuple[int, np.ndarray] | None = None  # the permutation of the epoch read last (one at a time)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def epoch_size(self) -> int:
        return len(self.base)

    def base_index(self, i: int) -> int:
        """The index into `base` of sample i."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} is outside [0, {self.num_samples})")
        epoch, j = divmod(i, len(self.base))
        if epoch == 0:
            return j
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.base)))
        return int(self._perm[1][j])

    def __getitem__(self, i: int):
        return self.base[self.base_index(int(i))]
