"""Tokenizer, datasets and micro-batch iterators of a run.

Every rank reads the micro-batches of its DP rank (TP and PP peers read the same ones; CP peers too) and keeps
its CP rank's share of each sequence (`megatron_upipe.cp_batch`, the split the layer spec asks for). Shapes:
micro-batch [b, s] from the dataset -> [b, s/C] after the split (tokens, labels, loss_mask, position_ids); with
data.document_mask also the sample's `cu_seqlens` [n_docs + 1] (whole, from its reset position ids).

Sample counts: train = train.steps x global batch, read in an order that does not depend on train.steps
(`megatron_upipe.data.sample_order`: megatron's dataset is built for one epoch, read again in a seeded order per
epoch), so a run extended by raising train.steps reads the same samples for the steps the shorter run planned;
valid = train.eval_iters x global batch, and every evaluation reads the same first eval_iters global batches of the
validation split (comparable eval losses, and nothing to resume). The index cache goes to `cache_dir(config)`.

No fork after pinning: with data.num_workers > 0 the DataLoader forks its worker processes when its iterator is
made. build_state makes the training iterator (`start_train_batches`, from the resumed sample count) before the
model and the offloader's pinned host pool exist, and the loop takes that one (`RunData.train_iterator`): a fork
from a rank holding a pinned pool of hundreds of GiB copies its page tables into every worker, and the kernel may
copy DMA-pinned pages into the child outright. The validation iterator loads in the training process (no workers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from megatron_upipe.config import Config, Plan
from megatron_upipe.cp_batch import split_batch
from megatron_upipe.data.datasets import GPTDataConfig, build_gpt_datasets, micro_batches
from megatron_upipe.data.packing import cu_seqlens_from_positions
from megatron_upipe.data.sample_order import EpochOrder
from megatron_upipe.data.tokenizers import ByteTokenizer, Tokenizer, build_tokenizer

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def build_run_tokenizer(config: Config, plan: Plan) -> Tokenizer:
    if config.data.tokenizer is not None:
        return build_tokenizer(config.data.tokenizer)
    return ByteTokenizer(max(plan.vocab_size, 258))  # mock data: only the vocabulary size matters


def model_vocab_size(tokenizer: Tokenizer, config: Config) -> int:
    v = config.model.vocab_size
    if v is None:
        return tokenizer.vocab_size
    if config.data.tokenizer is not None and v < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={v} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size} "
                         f"in {config.data.tokenizer}): set model.vocab_size=null")
    return v


def cache_dir(config: Config) -> Path:
    """`<run dir>/data_cache`, the run dir being the parent of checkpoint.dir, else of log.metrics_file."""
    anchor = config.checkpoint.dir or config.log.metrics_file
    return (Path(anchor).parent if anchor else Path("runs")) / "data_cache"


@dataclass
class StartedBatches:
    """The datasets and the training micro-batches' iterator from `consumed_samples`, made before anything is pinned
    (the module docstring): its DataLoader workers, if any, already run."""

    train: object
    valid: object | None
    consumed_samples: int
    iterator: Iterator[dict]


@dataclass
class RunData:
    train: object
    valid: object | None
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    split: str  # "contiguous" / "zigzag"
    cp_group: object
    num_workers: int = 0  # data.num_workers: DataLoader worker processes (the order does not depend on it)
    device: torch.device = torch.device("cpu")  # where the model runs
    document_mask: bool = False  # data.document_mask: add each sample's cu_seqlens (micro-batch 1)
    cp_ring: int = 1  # parallel.cp_ring: the contiguous split is zigzag over a ring of that many a2a groups
    started: StartedBatches | None = None  # the training iterator made before the pinned pool (build_state)

    def train_iterator(self, consumed_samples: int) -> Iterator[dict]:
        """The started iterator (once) when there is one, else a new one (tests and tools that pin nothing)."""
        started, self.started = self.started, None
        if started is None:
            return self._split(micro_batches(self.train, self.micro_batch_size, self.dp_rank, self.dp_size,
                                             consumed_samples, self.num_workers))
        if started.consumed_samples != consumed_samples:
            raise RuntimeError(f"the training batches were started at sample {started.consumed_samples} but the run "
                               f"resumes at {consumed_samples}: a new iterator now would fork after pinning")
        return self._split(started.iterator)

    def valid_iterator(self) -> Iterator[dict]:
        return self._split(micro_batches(self.valid, self.micro_batch_size, self.dp_rank, self.dp_size, 0))

    def _split(self, it: Iterator[dict]) -> Iterator[dict]:
        for batch in it:  # [b, s] -> [b, s/C]
            local = split_batch({k: batch[k] for k in BATCH_KEYS}, self.split, self.cp_group, self.cp_ring)
            local = {k: v.to(self.device, non_blocking=True) for k, v in local.items()}
            if self.document_mask:  # the whole sample's document boundaries, the same on every CP rank; kept on
                # the host, where the attention op reads them (on a GPU each layer would otherwise synchronise)
                local["cu_seqlens"] = cu_seqlens_from_positions(batch["position_ids"][0])  # [1, s] -> [n_docs + 1]
            yield local


def build_run_datasets(config: Config, plan: Plan, tokenizer: Tokenizer) -> tuple[EpochOrder, object | None]:
    """(train, valid): train.steps x global batch training samples in the steps-independent order, and the
    validation samples of train.eval_iters global batches (None when train.eval_interval=0)."""
    t = config.train
    data_config = GPTDataConfig(data_path=(config.data.path,), seq_length=t.seq_length, seed=t.seed,
                                split=tuple(config.data.split), reset_position_ids=config.data.document_mask,
                                eod_mask_loss=config.data.eod_mask_loss)
    n_valid = t.eval_iters * plan.global_batch_size if t.eval_interval > 0 else None
    # Training split: None = megatron's dataset over one epoch of the training documents (data.path is one prefix
    # or mock; a weighted blend, which megatron sizes by sample count, is not expressible in the config).
    sets = build_gpt_datasets(data_config, tokenizer, (None, n_valid, None), cache_dir(config))
    if sets.train is None:
        raise ValueError(f"data.split={config.data.split} gives the training split no documents: raise its first "
                         f"weight")
    if t.eval_interval > 0 and (sets.valid is None or len(sets.valid) < n_valid):
        raise ValueError(f"train.eval_iters={t.eval_iters} x global batch {plan.global_batch_size} needs {n_valid} "
                         f"validation samples; data.split={config.data.split} gives "
                         f"{0 if sets.valid is None else len(sets.valid)}")
    return EpochOrder(sets.train, t.steps * plan.global_batch_size, t.seed), sets.valid


def start_train_batches(config: Config, plan: Plan, tokenizer: Tokenizer, pg,
                        consumed_samples: int) -> StartedBatches:
    """The datasets and the training iterator from `consumed_samples`: its workers are forked now (call it before
    anything is pinned)."""
    train, valid = build_run_datasets(config, plan, tokenizer)
    it = micro_batches(train, plan.micro_batch_size, pg.dp.rank(), pg.dp.size(), consumed_samples,
                       config.data.num_workers)
    return StartedBatches(train, valid, consumed_samples, it)


def build_run_data(config: Config, plan: Plan, tokenizer: Tokenizer, pg, split: str,
                   device: torch.device = torch.device("cpu"), cp_ring: int = 1,
                   started: StartedBatches | None = None) -> RunData:
    """The run's data; `started`: its datasets and training iterator, made earlier by `start_train_batches`."""
    train, valid = (started.train, started.valid) if started else build_run_datasets(config, plan, tokenizer)
    return RunData(train, valid, plan.micro_batch_size, pg.dp.rank(), pg.dp.size(), split, pg.cp,
                   config.data.num_workers, device, config.data.document_mask, cp_ring, started)
