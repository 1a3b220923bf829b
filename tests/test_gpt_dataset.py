"""A sample's loss mask does not depend on which sample the dataset served first (megatron_upipe/data/gpt_dataset.py).

Mock data with the shipped sentencepiece tokenizer (pad id 3, vocabulary 4096): a mock document is the ids
1, 2, ..., L-1 (L < 4096) then eod (2), so every sample holding a document start has a pad label, and no label is 0
but the pad labels megatron maps to 0. The right loss mask is then known without megatron's code: 1 exactly where
the label is not 0. megatron-core 0.19.2's GPTDataset, serving a sample with a pad label first, wrote that zero
into the loss-mask cache every later sample starts from.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_upipe.data.datasets import GPTDataConfig, build_gpt_datasets
from megatron_upipe.data.tokenizers import build_tokenizer

SPM = Path(__file__).resolve().parents[1] / "data" / "tokenizer" / "spm.model"


def test_a_samples_loss_mask_does_not_depend_on_the_sample_served_first(tmp_path):
    tokenizer = build_tokenizer(SPM)
    assert (tokenizer.pad, tokenizer.eod, tokenizer.vocab_size) == (3, 2, 4096)
    config = GPTDataConfig(data_path=("mock",), seq_length=64, seed=1234)

    def fresh():  # a dataset that has served nothing yet (the index comes from the cache after the first build)
        return build_gpt_datasets(config, tokenizer, (None, None, None), tmp_path).train

    probe = range(48)
    served = {0: fresh()}  # by the sample it served first; sample 0 has no pad label
    labels = {i: served[0][i]["labels"] for i in probe}
    padded = [i for i in probe if (labels[i] == 0).any()]
    assert len(padded) >= 3 and padded[0] > 0, padded  # the other samples can catch a bad cache
    for first in padded[:2]:  # fresh datasets that serve a sample with a pad label first
        served[first] = fresh()
        served[first][first]
    for first, dataset in served.items():
        for i in probe:
            sample = dataset[i]
            assert torch.equal(sample["labels"], labels[i])
            assert torch.equal(sample["loss_mask"], (labels[i] != 0).float()), (first, i)
