"""What used to fail only after training had started is refused at start-up and by --dry-run, before any process
group or model: one line naming the setting and the fix, exit 2 (issue #24).

  outputs   checkpoint.dir, log.metrics_file, log.tensorboard_dir that cannot be written (config/outputs.py)
  data      a broken .bin/.idx pair: empty, truncated, random, or ids beyond the vocabulary (data/index_check.py)
  tools     preprocess_data.py on a corpus without documents; estimate_memory.py --json/--plot that cannot be written

pretrain_llama.py runs in-process (`main(argv)`, tests/test_cli_errors.py's helpers) on copies of the shipped dataset
in tmp_path, corrupted one way per case; one case also runs as a real process.
"""

from __future__ import annotations

import atexit
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import pretrain_llama
from megatron_upipe.config import load_config
from megatron_upipe.config.outputs import cache_dir_of
from megatron_upipe.data.index_check import HEADER_BYTES, read_header
from tests.test_cli_errors import call, environ, one_error_line, tool  # noqa: F401 (environ: a fixture)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "configs" / "tiny_cpu.yaml")
SHIPPED = ROOT / "data" / "corpus_text_document"
DRY = ["--config", TINY, "--dry-run", "--world-size", "2"]
REBUILD = "re-run tools/preprocess_data.py --tokenizer data/tokenizer/spm.model to rebuild the pair"


def dry_run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = call(pretrain_llama.main, [*DRY, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _unwritable() -> Path | None:
    """An existing directory this process cannot create files in: /sys for root, else a read-only temp dir."""
    if os.geteuid() != 0:
        d = Path(tempfile.mkdtemp(prefix="readonly_"))
        d.chmod(0o555)
        atexit.register(d.rmdir)
        return d
    try:
        tempfile.TemporaryFile(dir="/sys").close()
    except OSError:
        return Path("/sys")
    return None


UNWRITABLE = _unwritable()
needs_unwritable = pytest.mark.skipif(UNWRITABLE is None, reason="no directory this process cannot write in")


# ---- outputs ----

OUTPUT_CASES = [  # (id, overrides given tmp_path and an existing file in it, what the line must say)
    ("ckpt-is-file", lambda t, f: [f"checkpoint.dir={f}"], "is a file, not a directory: give a writable directory"),
    ("ckpt-under-file", lambda t, f: [f"checkpoint.dir={f}/ckpt"], "ckpt cannot be created: {f} is a file"),
    ("metrics-is-dir", lambda t, f: [f"log.metrics_file={t}"], "is a directory: give a file path in a writable"),
    ("metrics-under-file", lambda t, f: [f"log.metrics_file={f}/m.jsonl"], "is a file, not a directory"),
    ("tensorboard-is-file", lambda t, f: [f"log.tensorboard_dir={f}"], "log.tensorboard_dir={f}: {f} is a file"),
]
UNWRITABLE_CASES = [  # (id, overrides given the unwritable directory, what the line must say)
    ("ckpt-unwritable", lambda u: [f"checkpoint.dir={u}"], "checkpoint.dir={u}: cannot write in {u} ("),
    ("ckpt-parent-unwritable", lambda u: [f"checkpoint.dir={u}/run/ckpt"], "{u}/run/ckpt cannot be created in {u} ("),
    ("metrics-unwritable", lambda u: [f"log.metrics_file={u}/m.jsonl"], "log.metrics_file={u}/m.jsonl: cannot write"),
    ("tensorboard-unwritable", lambda u: [f"log.tensorboard_dir={u}/tb"], "log.tensorboard_dir={u}/tb: {u}/tb cannot"),
]


@pytest.mark.parametrize("overrides, expected", [c[1:] for c in OUTPUT_CASES], ids=[c[0] for c in OUTPUT_CASES])
def test_unwritable_outputs_are_refused(overrides, expected, tmp_path, environ, capsys):
    f = tmp_path / "a_file"
    f.write_text("x")
    code, _, err = dry_run(overrides(tmp_path, f), capsys)
    assert code == 2
    line = one_error_line(err, "pretrain_llama.py")
    assert expected.format(f=f) in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"], "the check creates nothing"


@needs_unwritable
@pytest.mark.parametrize("overrides, expected", [c[1:] for c in UNWRITABLE_CASES], ids=[c[0] for c in UNWRITABLE_CASES])
def test_outputs_in_unwritable_directories_are_refused(overrides, expected, environ, capsys):
    code, _, err = dry_run(overrides(UNWRITABLE), capsys)
    assert code == 2
    line = one_error_line(err, "pretrain_llama.py")
    assert expected.format(u=UNWRITABLE) in line, line


def test_data_cache_goes_where_training_puts_it():
    from megatron_upipe.training.data import cache_dir

    for overrides in ([], ["checkpoint.dir=null", "checkpoint.interval=0"],
                      ["checkpoint.dir=null", "checkpoint.interval=0", "log.metrics_file=null"]):
        config = load_config(TINY, overrides)
        assert cache_dir_of(config)[0] == cache_dir(config)


def test_unwritable_data_cache_is_refused(tmp_path, environ, capsys, monkeypatch):
    """checkpoint.dir writable but not its parent, where the data index cache goes (stood in for by the probe)."""
    from megatron_upipe.config import outputs

    real = outputs.dir_problem
    monkeypatch.setattr(outputs, "dir_problem",
                        lambda p: "cannot write in it (stand-in)" if Path(p).name == "data_cache" else real(p))
    code, _, err = dry_run([f"checkpoint.dir={tmp_path}/ckpt"], capsys)
    assert code == 2
    line = one_error_line(err, "pretrain_llama.py")
    assert (f"the data index cache {tmp_path}/data_cache (next to checkpoint.dir): cannot write in it (stand-in): "
            f"point checkpoint.dir at a writable place") in line, line


# ---- the dataset ----

S, D = 1262, 1263  # the shipped index: sequences, document boundaries (one document per sequence)
LENGTHS, POINTERS, BOUNDS = HEADER_BYTES, HEADER_BYTES + 4 * S, HEADER_BYTES + 12 * S


def poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def randomise(path: Path) -> None:
    path.write_bytes(np.random.default_rng(0).integers(0, 256, path.stat().st_size, dtype=np.uint8).tobytes())


def no_documents(p: Path) -> None:  # what preprocess_data.py wrote for an empty corpus before issue #24
    Path(f"{p}.idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 0, 1) + struct.pack("<q", 0))
    Path(f"{p}.bin").write_bytes(b"")


DATASET_CASES = [  # (id, corruption of the copied prefix, what the line must say)
    ("empty-bin", lambda p: truncate(Path(f"{p}.bin"), 0), "corpus_text_document.bin is empty but"),
    ("empty-idx", lambda p: truncate(Path(f"{p}.idx"), 0), "corpus_text_document.idx is empty"),
    ("truncated-bin", lambda p: truncate(Path(f"{p}.bin"), 100_000),
     "corpus_text_document.bin is 100000 bytes but corpus_text_document.idx ends its last sequence at byte 710894"),
    ("truncated-idx", lambda p: truncate(Path(f"{p}.idx"), 20_000),
     "corpus_text_document.idx is 20000 bytes but its header lists 1262 sequences and 1263 document boundaries"),
    ("header-cut", lambda p: truncate(Path(f"{p}.idx"), 20), "shorter than the 34-byte header: truncated"),
    ("random-idx", lambda p: randomise(Path(f"{p}.idx")), "corpus_text_document.idx is not a megatron-core index"),
    ("zeroed-idx", lambda p: Path(f"{p}.idx").write_bytes(bytes(25282)), "is not a megatron-core index"),
    ("version", lambda p: poke(Path(f"{p}.idx"), 9, struct.pack("<Q", 2)), "has index version 2"),
    ("dtype-code", lambda p: poke(Path(f"{p}.idx"), 17, b"\x09"), "has dtype code 9, not one of megatron-core's"),
    ("float-dtype", lambda p: poke(Path(f"{p}.idx"), 17, b"\x07"), "holds float32 values, not token ids"),
    ("no-documents", no_documents, "corpus_text_document.idx holds no documents (0 sequences, 0 documents)"),
    ("bounds", lambda p: poke(Path(f"{p}.idx"), BOUNDS + 8 * (D - 1), struct.pack("<q", S - 1)),
     "document boundaries (0, 1 ... 1261, 1261) do not run from 0 to its 1262 sequences"),
    ("pointer", lambda p: poke(Path(f"{p}.idx"), POINTERS, struct.pack("<q", 10**9)),
     "sequence 0 (741 tokens at byte 1000000000) lies outside corpus_text_document.bin"),
    ("random-bin", lambda p: randomise(Path(f"{p}.bin")), "outside the vocabulary of 4096 ids"),
    ("ids-in-last-document", lambda p: poke(Path(f"{p}.bin"), 710894 - 4, np.array([4096, 2], np.uint16).tobytes()),
     "corpus_text_document.bin holds token id 4096 (in its last document), outside the vocabulary"),
]


@pytest.fixture
def dataset(tmp_path) -> Path:
    """A copy of the shipped .bin/.idx pair; returns its prefix."""
    for ext in (".bin", ".idx"):
        shutil.copy(f"{SHIPPED}{ext}", tmp_path / f"corpus_text_document{ext}")
    return tmp_path / "corpus_text_document"


def test_shipped_layout_is_the_one_the_cases_assume():
    h = read_header(f"{SHIPPED}.idx")
    assert (h.sequence_count, h.document_count, h.dtype) == (S, D, np.uint16)
    assert SHIPPED.with_suffix(".bin").stat().st_size == 710894
    from megatron.core.datasets.indexed_dataset import _IndexReader

    mcore = _IndexReader(f"{SHIPPED}.idx", multimodal=False)  # the reader training uses agrees on the header
    assert (mcore.sequence_count, mcore.document_count, mcore.dtype) == (S, D, np.uint16)
    assert mcore.sequence_lengths[0] == 741  # the "pointer" case's message


def test_valid_setups_pass(dataset, environ, capsys):
    for argv in ([], [f"data.path={dataset}"], [f"checkpoint.dir={dataset.parent}/ckpt",
                                                 f"log.metrics_file={dataset.parent}/new/m.jsonl"]):
        code, out, _ = dry_run(argv, capsys)
        assert code == 0 and "dry run: configuration is valid" in out, argv
    assert sorted(p.name for p in dataset.parent.iterdir()) == ["corpus_text_document.bin", "corpus_text_document.idx"]


@pytest.mark.parametrize("corrupt, expected", [c[1:] for c in DATASET_CASES], ids=[c[0] for c in DATASET_CASES])
def test_broken_dataset_is_refused(corrupt, expected, dataset, environ, capsys):
    corrupt(dataset)
    code, _, err = dry_run([f"data.path={dataset}"], capsys)
    assert code == 2
    line = one_error_line(err, "pretrain_llama.py")
    assert f"configuration error: data.path={dataset}: " in line and expected in line and line.endswith(REBUILD), line


def test_the_real_start_refuses_before_any_process_group(dataset, tmp_path, environ, capsys, monkeypatch):
    monkeypatch.setattr(pretrain_llama, "run_job", lambda *a: pytest.fail("run_job reached"))
    truncate(Path(f"{dataset}.bin"), 1000)
    one_rank = ["--config", TINY, "parallel.cp=1"]
    assert call(pretrain_llama.main, [*one_rank, f"data.path={dataset}"]) == 2
    assert "corpus_text_document.bin is 1000 bytes" in one_error_line(capsys.readouterr().err, "pretrain_llama.py")
    assert call(pretrain_llama.main, [*one_rank, f"checkpoint.dir={dataset}.idx"]) == 2
    assert "is a file, not a directory" in one_error_line(capsys.readouterr().err, "pretrain_llama.py")


def test_as_a_real_process(dataset):
    truncate(Path(f"{dataset}.idx"), 0)
    r = subprocess.run([sys.executable, "pretrain_llama.py", *DRY, f"data.path={dataset}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "corpus_text_document.idx is empty" in one_error_line(r.stderr, "pretrain_llama.py")


# ---- the tools ----

def test_preprocess_refuses_a_corpus_without_documents(tmp_path, capsys):
    main = tool("preprocess_data").main
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": "  "}\n\n')
    for name, skipped in (("empty.jsonl", 0), ("blank.jsonl", 1)):
        argv = ["--input", str(tmp_path / name), "--tokenizer", str(ROOT / "data" / "tokenizer" / "spm.model"),
                "--output-prefix", str(tmp_path / "out"), "--no-progress"]
        assert call(main, argv) == 2
        line = one_error_line(capsys.readouterr().err, "preprocess_data.py")
        assert f"no documents in the input ({skipped} whitespace-only skipped): nothing written" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.jsonl", "empty.jsonl"], "no dataset files"


def test_estimate_memory_refuses_unwritable_outputs_before_simulating(tmp_path, capsys, monkeypatch):
    module = tool("estimate_memory")
    monkeypatch.setattr(module, "ConfigSource", lambda *a: pytest.fail("simulation reached"))
    cases = [
        (["--json", str(tmp_path / "no" / "out.json")], f"--json {tmp_path}/no/out.json: directory {tmp_path}/no "
                                                        f"does not exist: give a file in an existing, writable"),
        (["--json", str(tmp_path)], f"--json {tmp_path}: {tmp_path} is a directory"),
        (["--plot", str(tmp_path / "no" / "p.png")], "directory"),
        (["--plot", str(tmp_path / "p.xyz")], "--plot {}: matplotlib cannot write .xyz files: use one of".format(
            tmp_path / "p.xyz")),
    ]
    if UNWRITABLE is not None:
        cases.append((["--json", f"{UNWRITABLE}/out.json"], f"cannot write in {UNWRITABLE} ("))
    for extra, expected in cases:
        assert call(module.main, ["--config", TINY, *extra]) == 2, extra
        line = one_error_line(capsys.readouterr().err, "estimate_memory.py")
        assert expected in line, (extra, line)
    assert not list(tmp_path.iterdir())
