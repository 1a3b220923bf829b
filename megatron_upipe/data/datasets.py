"""GPT datasets through megatron-core's BlendedMegatronDatasetBuilder, and the resumable micro-batch iterator.

Shapes: b = micro-batch size, s = seq_length. A micro-batch is a dict of stacked samples:
  tokens, labels, position_ids  [b, s] int64;  loss_mask [b, s] float32;  attention_mask [b, 1, s, s] bool (only
  with `create_attention_mask=True`; megatron-core's local attention builds its own causal mask otherwise);
  dataset_id [b] int64 (only from a weighted blend: which prefix each sample came from).

Data order. megatron's GPTDataset already shuffles (a seeded shuffle index over fixed-length samples that pack and
split documents, over as many epochs as `num_samples` needs), so sample i of the dataset is fixed by (data, seed,
seq_length, split, num_samples). Training reads it in order: global batch g is samples
[g*b*D, (g+1)*b*D) and DP rank r takes its slice [r*b, (r+1)*b) (Megatron-LM's pretraining sampler). A run that
stopped after `consumed_samples` (counted over all DP ranks) resumes at exactly the next global batch.

Distributed state: nothing is required. Without a process group every process builds its own index. With one
(gloo or NCCL), rank 0 builds the index cache first and the others load it after a barrier, so `cache_dir`
must be a directory all ranks see (normally `<run dir>/data_cache`). The cache never goes into the repository.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from megatron_upipe.data.tokenizers import Tokenizer

MOCK = "mock"
Blend = tuple[list[str], list[float] | None]  # megatron-core's (prefixes, weights or None)


def parse_data_path(data_path: Sequence[str]) -> Blend | None:
    """`["mock"]` -> None (mock data); `[prefix, ...]` -> unweighted; `[w1, prefix1, w2, prefix2, ...]` -> weighted."""
    items = [str(x) for x in data_path]
    if not items:
        raise ValueError("data_path is empty: give index prefixes (e.g. data/corpus_text_document) or 'mock'")
    if items == [MOCK]:
        return None
    if MOCK in items:
        raise ValueError(f"'mock' cannot be blended with real data: {items}")

    def is_number(x: str) -> bool:
        try:
            float(x)
            return True
        except ValueError:
            return False

    if not is_number(items[0]):
        if any(is_number(x) for x in items):
            raise ValueError(f"data_path mixes weights and prefixes: {items}; use [w1, p1, w2, p2, ...]")
        return items, None
    if len(items) % 2:
        raise ValueError(f"weighted data_path needs weight/prefix pairs: {items}")
    weights, prefixes = [float(w) for w in items[0::2]], items[1::2]
    if any(is_number(p) for p in prefixes) or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"bad weighted data_path {items}: weights must be >= 0 (not all 0), then a prefix")
    return prefixes, weights


@dataclass(frozen=True)
class GPTDataConfig:
    data_path: tuple[str, ...]  # see parse_data_path
    seq_length: int
    seed: int = 1234
    split: str | tuple[float, float, float] = "98,2,0"  # train,valid,test weights over documents; not for mock
    create_attention_mask: bool = False
    eod_mask_loss: bool = False  # zero the loss on predicting the end-of-document token
    reset_position_ids: bool = False  # position ids restart after every end-of-document token (packed documents)

    def __post_init__(self) -> None:
        if self.seq_length < 1:
            raise ValueError(f"seq_length={self.seq_length} must be >= 1")
        weights = self.split_weights  # validates
        if len(weights) != 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"split={self.split!r} must be three non-negative weights (train, valid, test), "
                             "not all zero")
        blend = parse_data_path(self.data_path)  # validates
        if blend is not None:
            for prefix in blend[0]:
                for ext in (".bin", ".idx"):
                    if not Path(prefix + ext).is_file():
                        raise FileNotFoundError(f"indexed dataset file not found: {prefix + ext} "
                                                "(make it with tools/preprocess_data.py)")

    @property
    def split_weights(self) -> list[float]:
        parts = self.split.replace("/", ",").split(",") if isinstance(self.split, str) else self.split
        try:
            return [float(w) for w in parts]
        except ValueError:
            raise ValueError(f"split={self.split!r} is not three comma-separated numbers") from None

    @property
    def is_mock(self) -> bool:
        return parse_data_path(self.data_path) is None


@dataclass(frozen=True)
class GPTDatasets:
    train: torch.utils.data.Dataset | None
    valid: torch.utils.data.Dataset | None
    test: torch.utils.data.Dataset | None


def build_gpt_datasets(
    config: GPTDataConfig,
    tokenizer: Tokenizer,
    num_samples: tuple[int | None, int | None, int | None],
    cache_dir: str | Path,
    is_built_on_rank: Callable[[], bool] = lambda: True,
) -> GPTDatasets:
    """Train/valid/test datasets with at least `num_samples` samples each (None: one pass over that split's
    documents; a split of weight 0 gives None). Call it on every rank when a process group exists."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    from megatron_upipe.data.gpt_dataset import GPTDatasetMaskCopy, MockGPTDatasetMaskCopy

    blend = parse_data_path(config.data_path)
    sizes = list(num_samples)
    if len(sizes) != 3:
        raise ValueError(f"num_samples={num_samples} must give (train, valid, test)")
    if blend is not None and blend[1] is not None:  # megatron needs a size for every split of a weighted blend
        for i, weight in enumerate(config.split_weights):
            if sizes[i] is None and weight > 0:
                raise ValueError(f"a weighted data_path needs a sample count for split {i} (split={config.split!r})")
            sizes[i] = 0 if sizes[i] is None else sizes[i]
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    mcore_config = GPTDatasetConfig(
        random_seed=config.seed,
        sequence_length=config.seq_length,
        blend=blend,
        split=None if blend is None else ",".join(str(w) for w in config.split_weights),
        path_to_cache=str(cache_dir),
        tokenizer=tokenizer,
        reset_position_ids=config.reset_position_ids,
        reset_attention_mask=False,
        eod_mask_loss=config.eod_mask_loss,
        create_attention_mask=config.create_attention_mask,
    )
    # megatron's classes with a loss-mask cache the first sample served cannot alter (see data/gpt_dataset.py)
    cls = MockGPTDatasetMaskCopy if blend is None else GPTDatasetMaskCopy
    train, valid, test = BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, mcore_config).build()
    return GPTDatasets(train, valid, test)


@dataclass(frozen=True)
class MicroBatchSampler:
    """Index lists of the micro-batches one DP rank reads, from global batch `consumed_samples // (b*D)` on.

    Iterating yields lists of `micro_batch_size` dataset indices; an incomplete last global batch is dropped so
    every rank sees the same number of micro-batches."""

    total_samples: int
    micro_batch_size: int
    dp_rank: int = 0
    dp_size: int = 1
    consumed_samples: int = 0

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.dp_size < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} and dp_size={self.dp_size} must be >= 1")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={self.dp_rank} is outside [0, dp_size={self.dp_size})")
        step = self.micro_batch_size * self.dp_size
        if self.consumed_samples < 0 or self.consumed_samples % step:
            raise ValueError(f"consumed_samples={self.consumed_samples} must be a multiple of "
                             f"micro_batch_size*dp_size={step} (samples are consumed in whole global micro-batches)")

    def __len__(self) -> int:
        step = self.micro_batch_size * self.dp_size
        return max(0, (self.total_samples - self.consumed_samples) // step)

    def __iter__(self) -> Iterator[list[int]]:
        step, b = self.micro_batch_size * self.dp_size, self.micro_batch_size
        for start in range(self.consumed_samples, self.consumed_samples + len(self) * step, step):
            first = start + self.dp_rank * b
            yield list(range(first, first + b))


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack per key: [s] -> [b, s]; [1, s, s] -> [b, 1, s, s]; a blend's scalar dataset_id -> [b]."""
    return {k: torch.stack([torch.as_tensor(sample[k]) for sample in samples]) for k in samples[0]}


def micro_batches(
    dataset: torch.utils.data.Dataset,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    consumed_samples: int = 0,
    num_workers: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """The micro-batches DP rank `dp_rank` reads, resuming after `consumed_samples` (over all DP ranks).

    Deterministic: for a given dataset, the sequence from consumed_samples=k equals the sequence from 0 with its
    first k // (micro_batch_size*dp_size) micro-batches dropped, whatever `num_workers` is."""
    sampler = MicroBatchSampler(len(dataset), micro_batch_size, dp_rank, dp_size, consumed_samples)
    # Its own generator: making the iterator draws the workers' base seed from it, not from torch's global RNG, so
    # where the job makes it (before the model: training/data.py) changes neither the weights' initialisation nor
    # anything else random. The datasets draw nothing at fetch time, so the seed has no other effect.
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate,
        persistent_workers=False, pin_memory=False, generator=torch.Generator().manual_seed(0),
    )
    return iter(loader)
