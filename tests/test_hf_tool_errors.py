"""The tools' console (issue #24): no known third-party noise, an HF export that carries the run's tokenizer and says
how much it wrote, and damaged inputs refused in one line.

Quiet: tools/convert_hf_llama.py (both directions), tools/estimate_memory.py (tiny_cpu.yaml at 128 tokens with
Megatron-FSDP) and tools/preprocess_data.py (a two-document corpus) run as real subprocesses, and their stderr holds
none of the messages they printed before megatron_upipe/console.py's filter reached them (`NOISY`: each named by
its emitter; a new, unrelated warning does not fail this test). In-process, the tools' filter still lets our own
warnings and unlisted third-party ones through, and the training job's keeps showing the tools-only entries.
Tokenizer: a one-step, one-rank training run of the tiny Llama on the shipped sentencepiece tokenizer is exported;
`transformers.AutoTokenizer` loads the export and encodes sentences (spaces, digits, bytes, special-token text) to
the ids of our SentencePieceTokenizer, with the same eos and pad; the summary gives the bytes of the files written.
Damaged: a truncated, garbage or empty model.safetensors, a garbage weight index or config.json (hf-to-mcore), and
a truncated or garbage .distcp / .metadata in that training checkpoint, with and without its manifest (mcore-to-hf),
each end in exit 2 and one line naming the file and the fix, without a traceback and before --out is created.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.dist_helper import run_on_ranks
from tests.test_cli_errors import one_error_line, tool
from tests.test_hf_convert import ROPE, make_hf
from tests.train_harness import ROOT, SMALL, run_main

SPM = ROOT / "data" / "tokenizer" / "spm.model"
# What the tools printed on stderr before they called quiet_third_party(): emitter -> the message's words.
NOISY = {
    "torch.utils.cpp_extension": r"No CUDA runtime is found",
    "megatron.core (optimizer, norms: import time)": r"(Transformer Engine and Apex are|Apex is) not installed",
    "megatron.core.transformer.transformer_config": r"full scope is deprecated",
    "megatron.core.models.gpt.gpt_model": r"GPTModel IS DEPRECATED",
    "megatron.core.models.mimo": r"MimoModelConfig is experimental",
    "megatron.core...megatron_fsdp": r"Megatron-FSDP is using device cpu",
    "megatron.core.dist_checkpointing": r"MCore's async save is deprecated",
    "torch.distributed.checkpoint": r"assuming the intent is to load in a single process|The argument order of load "
                                    r"has been changed|we are deprecating ShardedTensor",
    "torch.distributed.c10d_logger": r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is "
                                     r"deprecated",
}
SENTENCES = ["Hello world, this is a test.", "  two leading spaces,   runs\n\nand new lines\tand a tab",
             "digits 12345 and 3.14159", "bytes: héllo wörld 日本語 🙂", "special-token text <s> and </s> stays text", ""]


def assert_quiet(err: str) -> None:
    noise = [f"{emitter}: {line}" for line in err.splitlines() for emitter, words in NOISY.items()
             if re.search(words, line)]
    assert not noise, "\n".join(noise)


def _run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_quiet(proc.stderr)
    return proc


def _size_words(directory: Path) -> str:
    from megatron_upipe.checkpoint.hf_io import directory_bytes, size_words

    return size_words(directory_bytes(directory))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "llama"
    make_hf("llama", {"rope_parameters": ROPE["default"]}).save_pretrained(path)
    return path


def _train_one_step(rank, world_size, root):
    with contextlib.redirect_stdout(io.StringIO()):
        return run_main(*SMALL, "parallel.cp=1", "train.steps=1", "train.warmup_steps=0", "train.global_batch_size=1",
                        f"checkpoint.dir={root}/run", "checkpoint.interval=1", f"log.metrics_file={root}/m.jsonl")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A training run of tiny_cpu.yaml's Llama on the shipped sentencepiece tokenizer, saved after one step."""
    root = tmp_path_factory.mktemp("trained")
    code, err = run_on_ranks(_train_one_step, 1, str(root))[0]
    assert code == 0, err[-3000:]
    return root / "run"


# ----------------------------------------------------------------------------- quiet tools
def test_hf_to_mcore_is_quiet_and_reports_the_bytes_it_wrote(hf_dir, tmp_path):
    out = tmp_path / "ckpt"
    proc = _run("tools/convert_hf_llama.py", "hf-to-mcore", "--hf", str(hf_dir), "--out", str(out))
    assert f"float32, {_size_words(out)}; tokenizer files:" in proc.stdout, proc.stdout


def test_export_carries_the_sentencepiece_tokenizer_of_the_run(run_dir, tmp_path):
    from transformers import AutoTokenizer

    from megatron_upipe.data.tokenizers import build_tokenizer

    out = tmp_path / "hf"
    proc = _run("tools/convert_hf_llama.py", "mcore-to-hf", "--ckpt", str(run_dir), "--out", str(out))
    line = proc.stdout.strip()
    assert line.startswith(f"wrote HF llama model, 21 tensors, {_size_words(out)} (float32; tokenizer "
                           f"tokenizer.model, tokenizer_config.json from data.tokenizer={SPM}), to {out}"), line
    assert (out / "tokenizer.model").read_bytes() == SPM.read_bytes()
    ours, theirs = build_tokenizer(SPM), AutoTokenizer.from_pretrained(out)
    for text in SENTENCES + [(ROOT / "README.md").read_text()[:2000]]:
        assert theirs(text)["input_ids"] == ours.tokenize(text), text  # no BOS added: as the training data
        assert theirs.decode(ours.tokenize(text)) == text
    assert (theirs.eos_token_id, theirs.pad_token_id, len(theirs)) == (ours.eod, ours.pad, ours.vocab_size)


def test_export_leaves_out_a_tokenizer_that_changed_since_the_run(run_dir, tmp_path):
    from megatron_upipe.checkpoint.hf_export import inspect_export_source, sentencepiece_source

    src = inspect_export_source(run_dir)
    assert sentencepiece_source(src) == (SPM, f"from data.tokenizer={SPM}")
    other = tmp_path / "spm.model"
    other.write_bytes(SPM.read_bytes() + b"\0")
    config = {**src.meta["config"], "data": {**src.meta["config"]["data"], "tokenizer": str(other)}}
    changed = dataclasses.replace(src, meta={**src.meta, "config": config})
    assert sentencepiece_source(changed) == (None, f"data.tokenizer={other} has changed since the run (its sha256 "
                                                   f"is not train_state.json's)")


def test_estimate_memory_is_quiet():
    proc = _run("tools/estimate_memory.py", "--config", "examples/configs/tiny_cpu.yaml", "train.seq_length=128",
                "memory.shard_model_states=true", "--jobs", "1")
    assert "fits: upipe @ 128" in proc.stdout, proc.stdout


def test_preprocess_data_is_quiet(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in SENTENCES[:2]))
    proc = _run("tools/preprocess_data.py", "--input", str(corpus), "--tokenizer", str(SPM), "--output-prefix",
                str(tmp_path / "out"), "--no-progress")
    assert "2 documents" in proc.stdout, proc.stdout


@pytest.fixture
def restore_logging():
    """quiet_third_party() adds filters to process-wide loggers; put them back after the test."""
    from megatron_upipe import console

    names = {r.logger for r in console.KNOWN_LOG_RECORDS} | set(console.MEGATRON_LOGGERS)
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).filters)) for n in names}
    yield
    for name, (level, filters) in saved.items():
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).filters[:] = filters


def test_the_tools_filter_hides_only_the_listed_messages(restore_logging):
    from megatron_upipe.console import quiet_third_party

    def shown(**kw) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quiet_third_party(**kw)
            for text, module, category in [
                ("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends", UserWarning),
                ("`torch.distributed.all_gather_into_tensor` is deprecated.", "torch.distributed.c10d_logger",
                 FutureWarning),
                ("Apex is not installed.", "megatron_upipe.models.norm", UserWarning),  # ours
                ("something new", "torch.distributed.c10d_logger", FutureWarning),  # not listed
            ]:
                warnings.warn_explicit(text, category, "f.py", 1, module=module)
        return [str(w.message)[:12] for w in seen]

    assert shown(cuda=False, tool=True) == ["Apex is not ", "something ne"]
    assert shown(cuda=False) == ["`torch.distr", "Apex is not ", "something ne"]  # the training job: a to-do


# ----------------------------------------------------------------------------- damaged inputs
def _refused(main, argv: list[str], capsys, prog: str = "convert_hf_llama.py") -> str:
    assert main(argv) == 2, argv
    return one_error_line(capsys.readouterr().err, prog)


def test_damaged_hf_files_are_refused_in_one_line(hf_dir, tmp_path, capsys):
    main = tool("convert_hf_llama").main
    weights = (hf_dir / "model.safetensors").read_bytes()
    out = tmp_path / "out"

    def variant(name: str, **files: bytes) -> Path:
        d = tmp_path / name
        shutil.copytree(hf_dir, d)
        for file, data in files.items():
            (d / file.replace("__", ".")).write_bytes(data)
        return d

    cases = [
        (variant("truncated", model__safetensors=weights[:len(weights) // 2]), "model.safetensors",
         "is not a readable safetensors file (Error while deserializing header: incomplete metadata"),
        (variant("garbage", model__safetensors=bytes(range(256)) * 8), "model.safetensors",
         "is not a readable safetensors file"),
        (variant("empty", model__safetensors=b""), "model.safetensors", "is not a readable safetensors file"),
        (variant("index", model__safetensors__index__json=b'{"weight_map": '), "model.safetensors.index.json",
         "is not a weight index (JSONDecodeError"),
        (variant("config", config__json=b"\x00garbage"), "config.json", "is not JSON ("),
    ]
    for d, file, words in cases:
        line = _refused(main, ["hf-to-mcore", "--hf", str(d), "--out", str(out)], capsys)
        assert f"{d / file} {words}" in line and "download or save the model again" in line, line
    assert not out.exists()


def _damaged_copy(run_dir: Path, root: Path, name: str, file: str, how: str, manifest: bool) -> Path:
    ckpt = root / name / "iter_0000001"
    shutil.copytree(run_dir / "iter_0000001", ckpt)
    (root / name / "latest").write_text("iter_0000001\n")
    path = ckpt / file
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if how == "truncated" else bytes(b ^ 0x5A for b in data))
    if not manifest:
        (ckpt / "manifest.json").unlink()
    return root / name


DAMAGED = [  # (file, how, with its manifest, what the line says after the file's path)
    ("__0_0.distcp", "truncated", True, r"has \d+ bytes, its manifest records \d+ \(truncated or overwritten\)"),
    ("__0_0.distcp", "garbage", True, r"has the size its manifest records but not its CRC-32 \(damaged or altered\)"),
    (".metadata", "truncated", True, r"has \d+ bytes, its manifest records \d+"),
    (".metadata", "garbage", True, r"does not read \(UnpicklingError: "),
    ("__0_0.distcp", "truncated", False, r"has \d+ bytes, its \.metadata needs \d+ \(truncated\)"),
    ("__0_0.distcp", "garbage", False, None),  # no manifest: the directory and its tensor files are named
    (".metadata", "truncated", False, r"does not read \(UnpicklingError: pickle data was truncated\)"),
    (".metadata", "garbage", False, r"does not read \("),
]


def _export_in_a_child(rank, world_size, argvs):
    """The tool's main() in a spawned process (the export builds a process group and a model): (exit, stderr)."""
    main, results = tool("convert_hf_llama").main, []
    for argv in argvs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            results.append((main(argv), err.getvalue()))
    return results


def test_damaged_training_checkpoint_is_refused_in_one_line(run_dir, tmp_path, capsys):
    """Found before any tensor is read, in this process; a garbage .distcp only when reading it fails (a spawned
    process)."""
    main = tool("convert_hf_llama").main
    out = tmp_path / "out"
    lines, in_child = {}, []
    for file, how, manifest, words in DAMAGED:
        name = f"{file.strip('._')}-{how}-{'manifest' if manifest else 'none'}"
        root = _damaged_copy(run_dir, tmp_path, name, file, how, manifest)
        argv = ["mcore-to-hf", "--ckpt", str(root), "--out", str(out)]
        if file.endswith(".distcp") and how == "garbage":
            in_child.append((root, file, words, argv))
        else:
            lines[root, file, words] = _refused(main, argv, capsys)
    for (root, file, words, _), (code, err) in zip(in_child, run_on_ranks(_export_in_a_child, 1,
                                                                           [c[3] for c in in_child])[0]):
        assert code == 2, err[-3000:]
        lines[root, file, words] = one_error_line(err, "convert_hf_llama.py")
    assert len(lines) == len(DAMAGED)
    for (root, file, words), line in lines.items():
        ckpt = root / "iter_0000001"
        if words is None:
            assert f"{ckpt}: its tensor files (__0_0.distcp) do not read (UnpicklingError: " in line, line
        else:
            assert re.search(re.escape(f"{ckpt / file} ") + words, line), line
        assert line.endswith(f"the checkpoint is damaged; export an earlier one ({root}/iter_XXXXXXX) or copy this "
                             f"one again from where it was saved"), line
    assert not out.exists()
