"""HF in -> training -> HF out: pretrain_llama.py initialised from converted / HF checkpoints, and the export of its
training checkpoints (tools/convert_hf_llama.py mcore-to-hf), on CPU with gloo.

Two tiny HF models in the shape of the `tiny` preset (2 layers, D 64, 8 query / 4 KV heads, d 8, FFN 128, vocab
4096 = the shipped sentencepiece tokenizer's; random weights, norm weights ~1 ± 0.2), built with transformers:
a LlamaForCausalLM and a Qwen3ForCausalLM (QK-norm, tied embeddings). One single-process job converts both
(hf-to-mcore, library calls); one 2-rank job then runs pretrain_llama.main():
  llama       checkpoint.load=converted Llama, cp=2 UPipe, model.rotary_base=20000 (a RoPE change: logged, allowed),
              3 steps, saved at step 3;
  qwen3       checkpoint.load=converted Qwen3, cp=2 UPipe, 3 steps, saved;
  qwen3-hf    checkpoint.load=the HF directory itself (converted per rank in memory): the same 3 losses bit for bit;
  fsdp        checkpoint.load=converted Llama, dp=2 with memory.shard_model_states=true (Megatron-FSDP; the weights
              go into the plain GPTModel before it is wrapped), mock data, 3 steps; at the step-3 save the full
              parameters are gathered with Megatron-FSDP's own uneven-DTensor gather as the reference;
  old-meta    resumes the llama step-3 checkpoint whose train_state.json lost the newer model fields (qkv_bias,
              qk_norm, tie_embeddings, rope_scaling), as an older version wrote it.
After each of llama / qwen3 the job loads the step-3 checkpoint into a cp=2 UPipe model and computes the loss on a
fixed batch; the exported HF model (transformers) gives the same loss within 2e-6 (float32 on both sides, loss
~8.3: 2e-6 is ~2 float32 ulps of it; the models differ only in summation order and attention kernels over 2 layers;
measured 8.7e-9 for the Llama, 1.9e-8 for the Qwen3). The fsdp
export (the CLI, relaunching dp=2 on CPU) equals the reference tensor for tensor. Refusals go through
`pretrain_llama.py --dry-run` (exit 2, one line): another model shape, another family feature, another vocabulary,
a directory that is no checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_helper import run_on_ranks
from tests.train_harness import DATA, ROOT, SMALL, TINY, losses, run_main

VOCAB, SEQ = 4096, 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, head_dim=8, max_position_embeddings=2048, rms_norm_eps=1e-5)
BASE = [*SMALL, "train.steps=3", "train.lr=1e-3"]
QWEN3 = ["model.qk_norm=true", "model.tie_embeddings=true"]
FSDP = ["parallel.cp=1", "parallel.cp_strategy=none", "memory.shard_model_states=true", "data.path=mock",
        "data.tokenizer=null", f"model.vocab_size={VOCAB}"]


def _make_hf(family: str, path: Path) -> None:
    import transformers

    cfg, cls = ((transformers.LlamaConfig(**SHAPE), transformers.LlamaForCausalLM) if family == "llama" else
                (transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True), transformers.Qwen3ForCausalLM))
    torch.manual_seed(0)
    model = cls(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')


def _convert(rank, world_size, root):
    from megatron_upipe.checkpoint.hf_import import convert_hf_to_mcore

    return [convert_hf_to_mcore(Path(root) / f / "hf", Path(root) / f / "ckpt", progress=False)
            for f in ("llama", "qwen3")]


def _our_loss(ckpt: Path, tokens: torch.Tensor) -> float:
    """The per-token mean loss of checkpoint `ckpt`'s model on tokens [b, s+1], under cp=2 UPipe (2 ranks)."""
    import torch.distributed as dist

    from megatron_upipe.checkpoint.mcore_io import load_mcore_checkpoint
    from megatron_upipe.cp_batch import split_batch
    from megatron_upipe.models.llama import build_llama
    from megatron_upipe.models.presets import LlamaArch
    from megatron_upipe.parallel import ParallelLayout, destroy_parallel, initialize_parallel

    model = json.loads((ckpt / "train_state.json").read_text())["model"]
    layout = ParallelLayout(cp=2, cp_strategy="upipe")
    pg = initialize_parallel(layout)
    try:
        stage = build_llama(LlamaArch.from_dict(model), layout, pg, vocab_size=model["vocab_size"])
        load_mcore_checkpoint(stage.model, ckpt)
        stage.model.eval()
        s = tokens.shape[1] - 1
        batch = split_batch({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                             "position_ids": torch.arange(s).expand(tokens.shape[0], -1)}, stage.plan.sequence_split,
                            pg.cp)  # [b, s/C] each
        with torch.no_grad():
            per_token = stage.model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s/C]
        total = torch.tensor([per_token.double().sum().item(), per_token.numel()], dtype=torch.float64)
        dist.all_reduce(total, group=pg.cp)
        return (total[0] / total[1]).item()
    finally:
        destroy_parallel()


def _recording_save(record: dict):
    """checkpointing.save_checkpoint that first assembles a Megatron-FSDP run's full (fp32 main) parameters from the
    optimizer's uneven DTensors and megatron-core's chunk metadata (independent of the exporter's buffer offsets)."""
    import torch.distributed as dist
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata

    from megatron_upipe.checkpoint.hf_convert import stage_to_hf
    from megatron_upipe.memory_switches.sharding import is_fully_sharded
    from megatron_upipe.training import checkpointing

    orig = checkpointing.save_checkpoint

    def save(state, root, keep_last=None, before_publish=None):
        if is_fully_sharded(state.ddp):
            full = {}
            for name, p in state.ddp.param_and_grad_buffer.optimizer_named_parameters:
                chunk = gather_and_compute_chunk_metadata(p)  # this rank's offsets in the global tensor
                parts = [None] * dist.get_world_size()
                dist.all_gather_object(parts, (chunk.offsets, p.to_local().detach().clone()))  # dp2: the world
                t = torch.full(tuple(p.shape), float("nan"), dtype=parts[0][1].dtype)
                for offsets, local in parts:
                    t[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))] = local
                full[name.removeprefix("module.")] = t
            record[state.step] = stage_to_hf(full.items(), state.plan.arch, state.stage.vocab_size, tp_group=None,
                                             layer_offset=0)
        return orig(state, root, keep_last, before_publish)

    checkpointing.save_checkpoint = save
    return lambda: setattr(checkpointing, "save_checkpoint", orig)


def _train(rank, world_size, root, tokens):
    import torch.distributed as dist

    root = Path(root)
    out, ours, record = {}, {}, {}

    def run(name, *overrides):
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code, err = run_main(*BASE, f"log.metrics_file={root}/{name}.jsonl", *overrides)
        out[name] = (code, err, stdout.getvalue())

    run("llama", f"checkpoint.load={root}/llama/ckpt", f"checkpoint.dir={root}/runs/llama", "model.rotary_base=20000")
    ours["llama"] = _our_loss(root / "runs" / "llama" / "iter_0000003", tokens)
    run("qwen3", f"checkpoint.load={root}/qwen3/ckpt", f"checkpoint.dir={root}/runs/qwen3", *QWEN3)
    ours["qwen3"] = _our_loss(root / "runs" / "qwen3" / "iter_0000003", tokens)
    run("qwen3-hf", f"checkpoint.load={root}/qwen3/hf", *QWEN3)
    undo = _recording_save(record)
    try:
        run("fsdp", f"checkpoint.load={root}/llama/ckpt", f"checkpoint.dir={root}/runs/fsdp", *FSDP)
    finally:
        undo()
    if rank == 0:  # an older train_state.json: without the model fields added since
        shutil.copytree(root / "runs" / "llama" / "iter_0000003", root / "old" / "iter_0000003")
        meta_file = root / "old" / "iter_0000003" / "train_state.json"
        meta = json.loads(meta_file.read_text())
        for key in ("qkv_bias", "qk_norm", "tie_embeddings", "rope_scaling"):
            del meta["model"][key]
        meta_file.write_text(json.dumps(meta))
    dist.barrier()
    run("old-meta", f"checkpoint.load={root}/old/iter_0000003", "train.steps=4", "model.rotary_base=20000")
    return out, ours, record


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_train")
    for family in ("llama", "qwen3"):
        _make_hf(family, root / family / "hf")
    conversions = run_on_ranks(_convert, 1, str(root))[0]
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(5))
    per_rank = run_on_ranks(_train, 2, str(root), tokens)
    for rank, (out, _, _) in enumerate(per_rank):
        for name, (code, err, _) in out.items():
            assert code == 0, f"rank {rank}, run {name}: exit {code}\n{err[-3000:]}"
    return root, tokens, conversions, per_rank


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "convert_hf_llama.py"), *args], capture_output=True,
                          text=True, cwd=ROOT)


def _hf_loss(hf_dir: Path, tokens: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits  # [b, s, V]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), tokens[:, 1:].flatten()).item()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_converted_weights_train_and_export_to_hf_with_the_same_loss(job, family, tmp_path):
    root, tokens, conversions, per_rank = job
    out, ours, _ = per_rank[0]
    _, _, stdout = out[family]
    ckpt = root / "runs" / family
    assert f"loaded weights only from {root}/{family}/ckpt (converted HF checkpoint): optimizer and schedule start " \
           f"fresh" in stdout
    assert "RoPE changed from the checkpoint: " in stdout  # max_position_embeddings 2048 -> the preset's
    if family == "llama":
        assert "rotary_base 10000.0 -> 20000.0" in stdout
    assert sorted(losses(root / f"{family}.jsonl")) == [1, 2, 3]  # a fresh schedule: steps 1-3
    proc = _cli("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith(f"wrote HF {family} model, {21 if family == 'llama' else 24} tensors, ")
    assert "tokenizer tokenizer.model, tokenizer_config.json from data.tokenizer=" in summary  # the run's spm model
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_theta"] == (20000.0 if family == "llama" else 10000.0)
    hf = _hf_loss(tmp_path / "hf", tokens)
    assert abs(hf - ours[family]) <= 2e-6, (hf, ours[family])


def test_hf_directory_loads_like_its_converted_checkpoint(job):
    root, _, _, per_rank = job
    assert losses(root / "qwen3-hf.jsonl") == losses(root / "qwen3.jsonl")  # bit for bit
    assert "(HF model directory): optimizer and schedule start fresh" in per_rank[0][0]["qwen3-hf"][2]


def test_fsdp_checkpoint_exports_the_parameters_at_save_time(job, tmp_path):
    from safetensors.torch import load_file

    root, _, _, per_rank = job
    record = per_rank[0][2][3]
    assert sorted(losses(root / "fsdp.jsonl")) == [1, 2, 3]
    assert json.loads((root / "runs" / "fsdp" / "iter_0000003" / "train_state.json").read_text())["format"] == \
        "fsdp_per_rank"
    proc = _cli("mcore-to-hf", "--ckpt", str(root / "runs" / "fsdp"), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # mock data (no data.tokenizer): the tokenizer files of the checkpoint the run started from
    assert "tokenizer tokenizer_config.json, generation_config.json from checkpoint.load=" in proc.stdout
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == record.keys()
    for name, t in record.items():
        assert torch.equal(exported[name], t), name
    start = load_file(root / "llama" / "hf" / "model.safetensors")
    assert not torch.equal(exported["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])


def test_old_checkpoint_meta_still_resumes(job):
    root, _, _, per_rank = job
    assert sorted(losses(root / "old-meta.jsonl")) == [4]
    assert "RoPE changed" not in per_rank[0][0]["old-meta"][2]


# ----------------------------------------------------------------------------- refusals at start-up
def _dry_run(*overrides: str) -> tuple[int, str]:
    import pretrain_llama

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = pretrain_llama.main(["--dry-run", "--world-size", "2", "--config", TINY, *DATA, *BASE, *overrides])
    return code, err.getvalue()


def test_mismatched_checkpoint_load_is_refused_before_anything_is_built(job, tmp_path, monkeypatch):
    root, *_ = job
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    llama, qwen3 = f"checkpoint.load={root}/llama/ckpt", f"checkpoint.load={root}/qwen3/hf"
    (tmp_path / "empty").mkdir()
    cases = [
        ([llama, "model.num_layers=4"], "model.num_layers: checkpoint 2 != config 4"),
        ([qwen3], "model.qk_norm: checkpoint True != config False"),
        ([llama, "model.vocab_size=4224"], "model.vocab_size: checkpoint 4096 != config 4224"),
        ([f"checkpoint.load={tmp_path / 'empty'}"], "is not a checkpoint: no train_state.json or `latest` file"),
    ]
    for overrides, expected in cases:
        code, err = _dry_run(*overrides)
        lines = [line for line in err.splitlines() if line.startswith("pretrain_llama.py: ")]
        assert code == 2 and len(lines) == 1 and expected in lines[0], (overrides, err)
        assert "refusing to load it" in lines[0] or "not a checkpoint" in lines[0]
    code, err = _dry_run(llama, "model.rotary_base=500000", "model.max_position_embeddings=8192")
    assert code == 0, err  # RoPE fields may change (long-context extension)


def test_check_compatible_reads_old_metadata_and_tolerates_rope_changes():
    import dataclasses

    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.training.checkpointing import CheckpointError, check_compatible

    arch = get_preset("tiny").replace(vocab_size=VOCAB)
    run = {"model": dataclasses.asdict(arch), "tokenizer": {"sha256": "a"}}
    old = {k: v for k, v in run["model"].items() if k not in ("qkv_bias", "qk_norm", "tie_embeddings",
                                                               "rope_scaling")}
    assert check_compatible({"model": old, "tokenizer": {"sha256": "a"}}, run, Path("x")) is None
    longer = {**run["model"], "rotary_base": 5e5, "rope_scaling": {"kind": "linear", "factor": 4.0}}
    note = check_compatible({"model": run["model"], "tokenizer": {"sha256": "a"}}, {**run, "model": longer}, Path("x"))
    assert note == "RoPE changed from the checkpoint: rotary_base 10000.0 -> 500000.0, rope_scaling none -> " \
                   "linear(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, beta_fast=32.0, beta_slow=1.0, " \
                   "truncate=True)"
    with pytest.raises(CheckpointError, match="model.qk_norm: checkpoint False != config True"):
        check_compatible({"model": old, "tokenizer": {"sha256": "a"}},
                         {**run, "model": {**run["model"], "qk_norm": True}}, Path("x"))


def test_tokenizer_of_an_export_comes_from_the_run(tmp_path):
    from megatron_upipe.checkpoint.hf_export import ExportSource, tokenizer_source
    from megatron_upipe.models.presets import get_preset

    arch = get_preset("tiny").replace(vocab_size=VOCAB)
    (tmp_path / "tokenizer.json").write_text("{}")

    def source(spec, load=None):
        config = {"data": {"tokenizer": None if spec is None else str(spec)}, "checkpoint": {"load": load}}
        return tokenizer_source(ExportSource("dist_checkpointing", Path("x"), arch, VOCAB, {"config": config}))

    for spec in (tmp_path, tmp_path / "tokenizer.json"):  # an HF tokenizer directory, or its tokenizer.json
        assert source(spec) == (tmp_path, f"from data.tokenizer={spec}")
    spm = ROOT / "data" / "tokenizer" / "spm.model"
    assert source(spm, load=str(tmp_path)) == (None, f"data.tokenizer={spm} is not an HF tokenizer directory or "
                                                     f"tokenizer.json found from here")  # never another tokenizer
    assert source(None, load=str(tmp_path)) == (tmp_path, f"from checkpoint.load={tmp_path}")
    assert source(None) == (None, "the run recorded no HF tokenizer")
