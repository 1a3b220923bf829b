"""Helpers for the training-job tests: run pretrain_llama.main() on spawned gloo ranks and read its metrics.

Every run uses the shipped corpus and tokenizer (absolute paths, so the working directory does not matter) and the
tiny Llama of examples/configs/tiny_cpu.yaml, shrunk to a few short steps.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "configs" / "tiny_cpu.yaml")
DATA = [f"data.path={ROOT / 'data' / 'corpus_text_document'}", f"data.tokenizer={ROOT / 'data' / 'tokenizer' / 'spm.model'}"]
# Short sequences and few steps; no evaluation, checkpoints or console lines unless a test asks for them.
SMALL = ["train.seq_length=64", "train.micro_batch_size=1", "train.global_batch_size=4", "train.warmup_steps=1",
         "train.eval_interval=0", "checkpoint.dir=null", "checkpoint.interval=0", "log.interval=1000",
         "memory.plan_check=false"]


def run_main(*overrides: str) -> tuple[int, str]:
    """pretrain_llama.main() on this rank with tiny_cpu.yaml + DATA + overrides; returns (exit code, stderr)."""
    import pretrain_llama

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = pretrain_llama.main(["--config", TINY, *DATA, *overrides])
    return code, err.getvalue()


def read_metrics(path: str | Path, kind: str = "train") -> list[dict]:
    return [r for r in map(json.loads, Path(path).read_text().splitlines()) if r["kind"] == kind]


def losses(path: str | Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(path)}


def processes_with(token: str) -> list[int]:
    """Pids of the live processes whose environment carries `token` (the ones a launch started)."""
    pids = []
    for env_file in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if token.encode() in env_file.read_bytes():
                pids.append(int(env_file.parent.name))
    return [p for p in pids if p != os.getpid()]


def pretrain_error_line(err: str) -> str:
    """The one line pretrain_llama.py says in `err` (its warnings and the one-process notice aside), no traceback
    (third-party import noise aside)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("pretrain_llama.py: ")
             and not line.startswith(("pretrain_llama.py: warning:", "pretrain_llama.py: no torchrun"))]
    assert len(lines) == 1, repr(err)
    return lines[0]
