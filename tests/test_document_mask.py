"""Packed documents (data.document_mask): the model trained on a packed sequence equals the same documents trained
one per sequence, and the data pipeline finds the boundaries megatron-core's dataset resets its positions at.

Model test (gloo, float32, tiny GQA Llama, 4 ranks): one sequence of N = 64 tokens packs documents of 13, 24, 1
and 26 tokens (a document of length 1; boundaries at 13, 37, 38, which cross the cp2 shard boundary at 32 and the
cp2 × tp2 sequence-parallel quarter at 16/48). Under cp2 UPipe, tp2+SP × cp2 UPipe, pp2 (UPipe at cp 1) and cp2 Ulysses it
runs with cu_seqlens (megatron's THD PackedSeqParams); the reference runs every document alone as its own
sequence through megatron-core's own attention (cp_strategy none, one rank's layout): the same (input, label)
pairs, so the packed run's mean loss is the length-weighted mean of the documents' losses, and so are its
gradients. Tolerances as tests/test_llama_layouts.py (float32: loss rel 1e-5, every gradient's relative norm
error 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_helper import run_on_ranks

VOCAB, DOCS = 256, (13, 24, 1, 26)
LAYOUTS = {
    "cp2 upipe": dict(cp=2, dp=2, cp_strategy="upipe"),
    "tp2+SP×cp2 upipe": dict(tp=2, sequence_parallel=True, cp=2, cp_strategy="upipe"),
    "pp2 upipe": dict(pp=2, dp=2, cp_strategy="upipe"),
    "cp2 ulysses": dict(cp=2, dp=2, cp_strategy="ulysses"),
}


def _job(rank, world_size):
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.parallel import ParallelLayout
    from tests.llama_harness import random_hf_state_dict, rel_err, run_layout

    arch = get_preset("tiny-gqa")
    hf_sd = random_hf_state_dict(arch, VOCAB, seed=0)
    N = sum(DOCS)
    tokens = torch.randint(0, VOCAB, (1, N + 1), generator=torch.Generator().manual_seed(3))  # [1, N + 1]
    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)

    # reference: each document alone (its inputs and labels are the packed sequence's), megatron's attention
    ref_loss, ref_grads = 0.0, {}
    for a, z in zip(cu[:-1].tolist(), cu[1:].tolist()):
        doc = tokens[:, a:z + 1].expand(world_size, -1)  # [dp, len + 1]: every DP rank the same row
        res = run_layout(ParallelLayout(dp=world_size), arch, hf_sd, doc, steps=1)
        w = (z - a) / N
        ref_loss += w * res.losses[0]
        for k, g in res.grads.items():
            ref_grads[k] = ref_grads.get(k, 0) + w * g

    table = {}
    for name, kw in LAYOUTS.items():
        layout = ParallelLayout(**kw)
        rows = tokens.expand(layout.dp, -1)  # [dp, N + 1]: every DP rank the same packed sequence
        res = run_layout(layout, arch, hf_sd, rows, steps=1, cu_seqlens=cu)
        table[name] = (abs(res.losses[0] - ref_loss) / ref_loss,
                       max(rel_err(res.grads[k], ref_grads[k]) for k in ref_grads))
    # one document spanning the whole sequence is plain causal attention
    whole = run_layout(ParallelLayout(cp=2, dp=2, cp_strategy="upipe"), arch, hf_sd, tokens.expand(2, -1), steps=1,
                       cu_seqlens=torch.tensor([0, N], dtype=torch.int32))
    plain = run_layout(ParallelLayout(cp=2, dp=2, cp_strategy="upipe"), arch, hf_sd, tokens.expand(2, -1), steps=1)
    table["one document = causal"] = (abs(whole.losses[0] - plain.losses[0]),
                                      max(rel_err(whole.grads[k], plain.grads[k]) for k in plain.grads))
    return table


def test_packed_documents_equal_one_document_per_sequence():
    table = run_on_ranks(_job, 4)[0]
    for name, (loss_err, grad_err) in table.items():
        if name == "one document = causal":
            assert loss_err == 0 and grad_err == 0, (name, loss_err, grad_err)
        else:
            assert loss_err <= 1e-5 and grad_err <= 1e-5, (name, loss_err, grad_err)


def test_boundaries_are_where_megatron_resets_positions(tmp_path):
    """On the shipped corpus, with reset_position_ids, cu_seqlens starts a document right after every EOD token and
    document_positions reproduces megatron's position ids for any contiguous token range."""
    from pathlib import Path

    from megatron_upipe.data.datasets import GPTDataConfig, build_gpt_datasets
    from megatron_upipe.data.packing import cu_seqlens_from_positions, document_positions
    from megatron_upipe.data.tokenizers import build_tokenizer

    root = Path(__file__).resolve().parents[1]
    tok = build_tokenizer(str(root / "data/tokenizer/spm.model"))
    config = GPTDataConfig(data_path=(str(root / "data/corpus_text_document"),), seq_length=512,
                           split=(1.0, 0.0, 0.0), reset_position_ids=True)
    train = build_gpt_datasets(config, tok, (None, None, None), tmp_path).train
    docs_seen = 0
    for i in range(8):
        sample = train[i]
        tokens, positions = torch.as_tensor(sample["tokens"]), torch.as_tensor(sample["position_ids"])
        cu = cu_seqlens_from_positions(positions)
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == tokens.numel()
        eod = torch.nonzero(tokens[:-1] == tok.eod).flatten() + 1  # a document starts after each EOD token
        assert torch.equal(cu[1:-1].long(), eod), (cu, eod)
        for start, length in ((0, 512), (128, 128), (300, 17)):
            assert torch.equal(document_positions(cu, start, length), positions[start:start + length].long())
        docs_seen += cu.numel() - 1
    assert docs_seen > 8  # the samples did pack several documents


@pytest.mark.parametrize("overrides, message", [
    (["data.document_mask=true", "parallel.cp_strategy=none", "parallel.cp=1"], "parallel.cp_strategy=upipe"),
    (["data.document_mask=true"], "train.micro_batch_size=1"),
])
def test_document_mask_needs_the_op_and_micro_batch_1(overrides, message):
    from megatron_upipe.config import ConfigError, load_config, validate

    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    with pytest.raises(ConfigError, match=message):
        validate(load_config(str(root / "examples/configs/tiny_cpu.yaml"), overrides), 2)


def _rope_rows_job(rank, world_size):
    """In a spawned process: megatron's get_emb moves inv_freq to "cuda", which needs the CPU patches, and those
    must not leak into the test process (they change torch's factory functions for every later test)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_upipe.compat.cpu import install_cpu_patches
    from megatron_upipe.models.llama import RankRowsRotaryEmbedding
    from megatron_upipe.models.presets import RopeScaling
    from megatron_upipe.models.rope_scaling import apply_rope_scaling

    install_cpu_patches()
    rot, theta, n = 16, 500000.0, 70_000
    positions = torch.cat([torch.arange(5), torch.randint(0, n, (4000,), generator=torch.Generator().manual_seed(0)),
                           torch.tensor([n - 1])])
    results = {}
    for interleaved in (False, True):
        for scaling in (None, ("linear", 4.0), ("llama3", 8.0), ("yarn", 4.0), "interpolation"):
            inner = RotaryEmbedding(rot, 1.0, rotary_interleaved=interleaved, rotary_base=theta,
                                    seq_len_interpolation_factor=3.0 if scaling == "interpolation" else None)
            if isinstance(scaling, tuple):
                apply_rope_scaling(inner, theta, rot, RopeScaling(*scaling, original_max_position_embeddings=8192))
            table = inner.get_emb(n)  # [n, 1, 1, rot]
            wrapper = RankRowsRotaryEmbedding(inner, _OneRank())
            results[(interleaved, str(scaling))] = (torch.equal(wrapper.angles_at(positions), table[positions]),
                                                    tuple(wrapper(n, packed_seq=True).shape))
    return results


def test_rope_angles_of_positions_are_the_rows_of_megatrons_table():
    """Packed documents take the RoPE angles of in-document positions from RankRowsRotaryEmbedding.angles_at
    instead of a table of the longest document's rows: bit for bit those rows of megatron-core's get_emb, for
    every RoPE scaling, interleaved or not; and the rotary module makes no table for a packed batch."""
    results = run_on_ranks(_rope_rows_job, 1)[0]
    assert len(results) == 10
    for case, (equal, packed_shape) in results.items():
        assert equal, case
        assert packed_shape == (0, 1, 1, 16), case


class _OneRank:
    def size(self):
        return 1

    def rank(self):
        return 0
