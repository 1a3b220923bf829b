"""GPT datasets from the shipped index (and mock data), and the resumable per-DP-rank micro-batch iterator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_upipe.data.datasets import (
    GPTDataConfig,
    MicroBatchSampler,
    build_gpt_datasets,
    micro_batches,
    parse_data_path,
)
from megatron_upipe.data.tokenizers import ByteTokenizer, build_tokenizer
from tests.dist_helper import run_on_ranks

REPO = Path(__file__).resolve().parents[1]
PREFIX = str(REPO / "data" / "corpus_text_document")
SPM = REPO / "data" / "tokenizer" / "spm.model"
SEQ = 64


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(SPM)


@pytest.fixture(scope="module")
def corpus(tokenizer, tmp_path_factory):
    config = GPTDataConfig(data_path=(PREFIX,), seq_length=SEQ, seed=7, split="90,10,0")
    return build_gpt_datasets(config, tokenizer, (1000, 40, None), tmp_path_factory.mktemp("cache"))


def _tokens(batches) -> list[torch.Tensor]:
    return [b["tokens"] for b in batches]


def test_parse_data_path():
    assert parse_data_path(["mock"]) is None
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.7", "a", "3", "b"]) == (["a", "b"], [0.7, 3.0])
    for bad in ([], ["0.5", "a", "b"], ["a", "0.5"], ["mock", "a"], ["-1", "a"], ["0.5", "1"]):
        with pytest.raises(ValueError):
            parse_data_path(bad)
    with pytest.raises(FileNotFoundError, match="preprocess_data"):
        GPTDataConfig(data_path=("/nonexistent/prefix",), seq_length=8)
    assert GPTDataConfig(data_path=(PREFIX,), seq_length=8, split=(969, 30, 1)).split_weights == [969, 30, 1]
    for bad_split in ("98,2", "a,b,c", "0,0,0", (1, -1, 0)):
        with pytest.raises(ValueError, match="split"):
            GPTDataConfig(data_path=(PREFIX,), seq_length=8, split=bad_split)


def test_samples_have_the_right_shape_and_come_from_the_index(corpus, tokenizer):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    train, valid = corpus.train, corpus.valid
    assert corpus.test is None
    assert len(train) >= 1000 and len(valid) >= 40
    # documents are split, not shared: 90% / 10% of the 1262 documents
    assert len(set(train.indices) & set(valid.indices)) == 0
    assert len(train.indices) + len(valid.indices) == 1262

    index = IndexedDataset(PREFIX)
    epoch_stream = np.concatenate([index[int(d)] for d in train.document_index]).astype(np.int32).tobytes()
    for i in range(0, len(train), len(train) // 25):
        sample = train[i]
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert all(v.shape == (SEQ,) for v in sample.values())
        assert sample["tokens"].dtype == sample["labels"].dtype == sample["position_ids"].dtype == torch.int64
        assert sample["loss_mask"].dtype == torch.float32 and bool((sample["loss_mask"] == 1).all())
        assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
        assert torch.equal(sample["position_ids"], torch.arange(SEQ))
        assert int(sample["tokens"].max()) < tokenizer.vocab_size
        # the SEQ+1 tokens of the sample are a contiguous stretch of the (shuffled) documents, eod included
        text = torch.cat([sample["tokens"], sample["labels"][-1:]]).numpy().astype(np.int32).tobytes()
        at = epoch_stream.find(text)
        assert at >= 0 and at % 4 == 0


def test_builds_are_deterministic_and_seeded(corpus, tokenizer, tmp_path):
    config = GPTDataConfig(data_path=(PREFIX,), seq_length=SEQ, seed=7, split="90,10,0")
    again = build_gpt_datasets(config, tokenizer, (1000, 40, None), tmp_path / "other_cache")
    assert any((tmp_path / "other_cache").iterdir())  # index caches go where they are told...
    assert not (REPO / "data" / "cache").exists()  # ...and never into the repository
    for i in (0, 1, 17, 999):
        assert torch.equal(again.train[i]["tokens"], corpus.train[i]["tokens"])
    assert torch.equal(again.valid[5]["tokens"], corpus.valid[5]["tokens"])

    reseeded = build_gpt_datasets(GPTDataConfig(data_path=(PREFIX,), seq_length=SEQ, seed=8, split="90,10,0"),
                                  tokenizer, (1000, 40, None), tmp_path / "other_cache")
    assert not all(torch.equal(reseeded.train[i]["tokens"], corpus.train[i]["tokens"]) for i in range(8))


def test_resuming_reproduces_the_tail_on_every_dp_rank(corpus):
    mbs, dp = 2, 3
    step = mbs * dp
    fresh = {r: _tokens(micro_batches(corpus.train, mbs, r, dp)) for r in range(dp)}
    assert all(len(fresh[r]) == len(corpus.train) // step for r in range(dp))
    assert all(b.shape == (mbs, SEQ) for b in fresh[0])
    for k in (1, 7, len(fresh[0]) - 1):
        for r in range(dp):
            resumed = _tokens(micro_batches(corpus.train, mbs, r, dp, consumed_samples=k * step))
            assert len(resumed) == len(fresh[r]) - k
            assert all(torch.equal(a, b) for a, b in zip(resumed, fresh[r][k:]))

    # the DP ranks' micro-batches tile the global batch: rank r holds samples [r*mbs, (r+1)*mbs) of it
    whole = _tokens(micro_batches(corpus.train, step, 0, 1))
    for g in (0, 5):
        assert torch.equal(torch.cat([fresh[r][g] for r in range(dp)]), whole[g])
        assert torch.equal(whole[g][0], corpus.train[g * step]["tokens"])

    # loader worker processes do not change the data or its order
    with_workers = _tokens(micro_batches(corpus.train, mbs, 1, dp, consumed_samples=4 * step, num_workers=2))
    assert all(torch.equal(a, b) for a, b in zip(with_workers, fresh[1][4:], strict=True))


def test_sampler_rejects_inconsistent_positions():
    with pytest.raises(ValueError, match="multiple of"):
        MicroBatchSampler(100, micro_batch_size=2, dp_rank=0, dp_size=2, consumed_samples=6)
    with pytest.raises(ValueError, match="dp_rank"):
        MicroBatchSampler(100, micro_batch_size=2, dp_rank=2, dp_size=2)
    assert list(MicroBatchSampler(10, 2, 1, 2, consumed_samples=4)) == [[6, 7]]  # 8, 9 form no whole global batch
    assert len(MicroBatchSampler(10, 2, 0, 2, consumed_samples=12)) == 0


def test_mock_data(tmp_path):
    config = GPTDataConfig(data_path=("mock",), seq_length=32, create_attention_mask=True)
    assert config.is_mock
    tokenizer = ByteTokenizer(vocab_size=300)  # mock data needs no tokenizer file, only a vocabulary size
    mock = build_gpt_datasets(config, tokenizer, (64, 8, 8), tmp_path)
    again = build_gpt_datasets(config, tokenizer, (64, 8, 8), tmp_path / "again")
    assert len(mock.train) >= 64 and mock.valid is not None and mock.test is not None
    batch = next(micro_batches(mock.train, 4))
    assert batch["tokens"].shape == (4, 32) and batch["tokens"].dtype == torch.int64
    assert batch["attention_mask"].shape == (4, 1, 32, 32) and batch["attention_mask"].dtype == torch.bool
    assert int(batch["tokens"].max()) < tokenizer.vocab_size
    assert torch.equal(batch["tokens"], next(micro_batches(again.train, 4))["tokens"])


def test_weighted_blend(tokenizer, tmp_path):
    config = GPTDataConfig(data_path=("1", PREFIX, "3", PREFIX), seq_length=SEQ, split="90,10,0")
    blend = build_gpt_datasets(config, tokenizer, (200, 20, None), tmp_path)
    assert type(blend.train).__name__ == "BlendedDataset" and len(blend.train) == 200 and len(blend.valid) == 20
    assert int(np.bincount(blend.train.dataset_index).argmax()) == 1  # the 3-weighted copy is drawn ~3x as often
    assert next(micro_batches(blend.train, 4))["tokens"].shape == (4, SEQ)
    with pytest.raises(ValueError, match="sample count"):
        build_gpt_datasets(config, tokenizer, (200, None, None), tmp_path)


def _rank_batches(rank: int, world_size: int, cache_dir: str) -> list[np.ndarray]:
    tokenizer = build_tokenizer(SPM)
    config = GPTDataConfig(data_path=(PREFIX,), seq_length=SEQ, seed=7, split="90,10,0")
    datasets = build_gpt_datasets(config, tokenizer, (1000, 40, None), cache_dir)  # rank 0 first, then the rest
    batches = _tokens(b for _, b in zip(range(5), micro_batches(datasets.train, 2, rank, world_size, 8)))
    return [t.numpy() for t in batches]  # plain arrays: a tensor would travel as shared memory that dies with the rank


def test_gloo_ranks_share_one_cache_and_tile_the_global_batch(corpus, tmp_path):
    per_rank = run_on_ranks(_rank_batches, 2, str(tmp_path / "shared_cache"), timeout_s=120)
    whole = _tokens(b for _, b in zip(range(5), micro_batches(corpus.train, 4, 0, 1, 8)))
    assert len(per_rank[0]) == len(per_rank[1]) == 5
    for g in range(5):
        assert np.array_equal(np.concatenate([per_rank[0][g], per_rank[1][g]]), whole[g].numpy())
