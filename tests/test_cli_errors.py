"""Bad input to every CLI ends in one line naming the option or setting and the fix, exit 2, no traceback.

pretrain_llama.py and the tools are called in-process through `main(argv)` where that is enough (one interpreter for
many cases); each CLI also runs once as a real subprocess, to check its script wiring. The launch scripts run
against recording fakes (tests/test_recipes.py's `Fakes`; a fake .venv for the CPU demo), so nothing trains here
except one single-process step of pretrain_llama.py started without torchrun.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pretrain_llama
from megatron_upipe.config import machine
from tests.test_recipes import SINGLE_NODE, Fakes

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "configs" / "tiny_cpu.yaml")
SPM = str(ROOT / "data" / "tokenizer" / "spm.model")


def one_error_line(err: str, prog: str) -> str:
    """The error line of `err`; there must be exactly one, and no traceback (third-party import noise aside)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(f"{prog}: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def environ(monkeypatch):
    """At the repository root (the configs' data paths are relative to it), without torchrun's variables, and
    os.environ restored afterwards (pretrain_llama.main sets the one-process rendezvous variables)."""
    monkeypatch.chdir(ROOT)
    saved = dict(os.environ)
    for var in pretrain_llama.TORCHRUN_VARS + ("LOCAL_WORLD_SIZE",):
        os.environ.pop(var, None)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def call(main, argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse errors exit from inside parse_args
        return e.code


# ---- pretrain_llama.py ----

DRY_RUN_REFUSED = [  # (overrides of tiny_cpu.yaml, what the line must say); all passed --dry-run before
    (["model.vocab_size=100"], "configuration error: model.vocab_size=100 is smaller than the vocabulary of "
                               "data.tokenizer=data/tokenizer/spm.model (4096 ids): set model.vocab_size=null"),
    (["data.tokenizer=README.md"], "configuration error: data.tokenizer=README.md is not a usable tokenizer"),
    (["data.tokenizer=data"], "configuration error: data.tokenizer=data is not a usable tokenizer (tokenizer.json"),
    (["train.steps=20", "train.warmup_steps=20"], "train.warmup_steps=20 must be below the decay horizon 20"),
    (["data.path=data/nope"], "configuration error: data.path=data/nope: data/nope.bin and data/nope.idx not found"),
    (["train.stesp=3"], "did you mean 'train.steps'?"),
]


@pytest.mark.parametrize("overrides, expected", DRY_RUN_REFUSED, ids=[c[0][-1] for c in DRY_RUN_REFUSED])
def test_pretrain_refuses_in_dry_run(overrides, expected, environ, capsys):
    assert call(pretrain_llama.main, ["--config", TINY, "--dry-run", "--world-size", "2", *overrides]) == 2
    line = one_error_line(capsys.readouterr().err, "pretrain_llama.py")
    assert expected in line, line


def test_short_demo_runs_keep_a_valid_schedule(environ, capsys):
    """run_cpu_demo.sh train.steps=20 and the single-node example's train.steps=3 pass (warmup_fraction)."""
    for steps in (20, 3, 1):
        argv = ["--config", TINY, "--dry-run", "--world-size", "2", f"train.steps={steps}"]
        assert call(pretrain_llama.main, argv) == 0
    assert "dry run: configuration is valid" in capsys.readouterr().out


def test_dry_run_judges_the_config_and_the_real_start_this_machine(environ, capsys, monkeypatch):
    """dist.backend=nccl without GPUs: a warning in --dry-run, refused with --check-machine and by the real start,
    in one line, before any process group (run_job is never reached)."""
    monkeypatch.setattr(machine, "_gpu_count", lambda: 0)  # this machine, whatever it is, has no GPU
    monkeypatch.setattr(pretrain_llama, "run_job", lambda *a: pytest.fail("run_job reached"))
    nccl = ["--config", TINY, "dist.backend=nccl"]
    fix = "dist.backend=nccl needs CUDA GPUs and this machine has none: set dist.backend=gloo"

    assert call(pretrain_llama.main, [*nccl, "--dry-run", "--world-size", "2"]) == 0
    out = capsys.readouterr()
    assert f"warning: on this machine: {fix}" in out.err and "configuration is valid" in out.out

    assert call(pretrain_llama.main, [*nccl, "--dry-run", "--world-size", "2", "--check-machine"]) == 2
    out = capsys.readouterr()
    assert f"error: on this machine: {fix}" in out.err and "configuration is valid" not in out.out

    assert call(pretrain_llama.main, [*nccl, "parallel.cp=1"]) == 2  # no torchrun: one process, then the machine
    assert fix in one_error_line(capsys.readouterr().err, "pretrain_llama.py")

    # Under torchrun (rank 0 of 8 on this node) with 2 GPUs: the GPU count is checked against LOCAL_WORLD_SIZE.
    monkeypatch.setattr(machine, "_gpu_count", lambda: 2)
    os.environ.update(WORLD_SIZE="8", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="8", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29999")
    assert call(pretrain_llama.main, ["--config", TINY, "dist.backend=auto"]) == 2
    assert ("8 ranks on this node (torchrun --nproc-per-node) but 2 GPU(s) visible: use --nproc-per-node 2"
            in one_error_line(capsys.readouterr().err, "pretrain_llama.py"))


def test_without_torchrun(environ, capsys, monkeypatch):
    monkeypatch.setattr(pretrain_llama, "run_job", lambda *a: pytest.fail("run_job reached"))
    assert call(pretrain_llama.main, ["--config", TINY]) == 2  # cp=2 needs two processes
    assert ("this config needs 2 ranks (parallel.tp·pp·cp = 1·1·2, dp 1) but pretrain_llama.py was started without "
            "torchrun (one process): launch torchrun --nproc-per-node 2") in capsys.readouterr().err
    os.environ["WORLD_SIZE"] = "2"  # half a torchrun environment
    assert call(pretrain_llama.main, ["--config", TINY]) == 2
    assert "WORLD_SIZE=2 but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT unset" in capsys.readouterr().err
    assert call(pretrain_llama.main, ["--config", TINY, "--check-machine"]) == 2
    assert "--check-machine goes with --dry-run" in capsys.readouterr().err
    assert call(pretrain_llama.main, ["--config", TINY, "--dry-run", "--world-size", "x"]) == 2
    line = one_error_line(capsys.readouterr().err, "pretrain_llama.py")
    assert "argument --world-size: invalid int value: 'x'" in line  # argparse, without its usage block


def test_pretrain_without_torchrun_runs_as_one_process(tmp_path):
    """The real CLI: a cp=2 config names torchrun in one line; a one-rank config trains as a single process."""
    env = {k: v for k, v in os.environ.items() if k not in pretrain_llama.TORCHRUN_VARS + ("LOCAL_WORLD_SIZE",)}
    base = [sys.executable, "pretrain_llama.py", "--config", TINY]
    refused = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "torchrun --nproc-per-node 2" in one_error_line(refused.stderr, "pretrain_llama.py")

    metrics = tmp_path / "metrics.jsonl"
    run = subprocess.run(
        [*base, "parallel.cp=1", "train.steps=2", "train.seq_length=64", "train.global_batch_size=2",
         "train.eval_interval=0", "checkpoint.dir=null", "checkpoint.interval=0", "memory.plan_check=false",
         f"log.metrics_file={metrics}", "log.tensorboard_dir=null"],
        cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "running as a single process (world size 1)" in run.stderr
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2]


# ---- the tools ----

def tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("inputs")
    (d / "ok.txt").write_text("a tiny corpus, " * 20)
    (d / "nokey.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    (d / "notjson.jsonl").write_text("not json\n")
    (d / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "empty").mkdir()
    (d / "hf_gpt2").mkdir()
    (d / "hf_gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    (d / "hf_noweights").mkdir()
    (d / "hf_noweights" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 300}))
    (d / "full").mkdir()
    (d / "full" / "x").write_text("x")
    return d


def test_preprocess_data_errors(corpus, tmp_path, capsys):
    main, out = tool("preprocess_data").main, str(tmp_path / "out")
    cases = [  # (argv, what the line must say)
        (["--input", str(corpus / "nope.jsonl")], "--input: input not found:"),
        (["--input", str(corpus / "empty")], "--input: no input files in"),
        (["--tokenizer", "nope.model"], "--tokenizer nope.model: tokenizer not found"),
        (["--tokenizer", str(ROOT / "README.md")], "README.md: cannot load sentencepiece model"),
        (["--workers", "0"], "argument --workers: must be >= 1, got 0"),
        (["--chunk-size", "many"], "argument --chunk-size: 'many' is not an integer"),
        (["--input", str(corpus / "nokey.jsonl")], "nokey.jsonl:2: no string field 'text' (set --json-key)"),
        (["--input", str(corpus / "notjson.jsonl")], "notjson.jsonl:1: not valid JSON"),
        (["--input", str(corpus / "latin1.txt")], "latin1.txt: not UTF-8 text"),
        (["--output-prefix", "/proc/no/such/dir/x"], "check --input and --output-prefix"),
    ]
    for extra, expected in cases:
        argv = {"--input": str(corpus / "ok.txt"), "--tokenizer": SPM, "--output-prefix": out, "--no-progress": None}
        argv.update(dict(zip(extra[::2], extra[1::2])))
        flat = [x for k, v in argv.items() for x in ([k] if v is None else [k, v])]
        assert call(main, flat) == 2, extra
        line = one_error_line(capsys.readouterr().err, "preprocess_data.py")
        assert expected in line, (extra, line)
    assert not list(tmp_path.glob("out*")), "a failed run leaves no dataset files"  # nokey.jsonl failed midway
    assert call(main, ["--input", str(corpus / "ok.txt"), "--tokenizer", SPM, "--output-prefix", out,
                       "--no-progress"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out_text_document.bin", "out_text_document.idx"]


def test_train_tokenizer_errors(corpus, tmp_path, capsys):
    main, prefix = tool("train_tokenizer").main, str(tmp_path / "tok" / "spm")
    cases = [
        (["--input", str(corpus / "nope")], "--input: input not found"),
        (["--vocab-size", "100"], "--vocab-size 100: vocab_size=100 leaves no room beyond the 256 byte pieces"),
        (["--vocab-size", "0"], "argument --vocab-size: must be >= 1, got 0"),
        (["--vocab-size", "5000"], "Vocabulary size too high (5000). Please set it to a value <="),
        (["--input", str(corpus / "nokey.jsonl"), "--vocab-size", "300"], "nokey.jsonl:2: no string field 'text'"),
        (["--input", str(corpus / "latin1.txt"), "--vocab-size", "300"], "latin1.txt: not UTF-8 text"),
        (["--model-type", "wordpiece"], "argument --model-type: invalid choice: 'wordpiece'"),
    ]
    for extra, expected in cases:
        argv = {"--input": str(corpus / "ok.txt"), "--model-prefix": prefix, **dict(zip(extra[::2], extra[1::2]))}
        assert call(main, [x for kv in argv.items() for x in kv]) == 2, extra
        line = one_error_line(capsys.readouterr().err, "train_tokenizer.py")
        assert expected in line, (extra, line)


def test_bench_attention_refuses_before_spawning(capsys):
    main = tool("bench_attention").main
    small = ["--heads", "8", "--kv-heads", "2", "--head-dim", "16", "--seq-len", "64", "--check-seq-len", "32"]
    cases = [
        (["--kv-heads", "3"], "num_heads=8 is not a multiple of num_kv_heads=3"),
        (["--cp", "3", "--seq-len", "96", "--check-seq-len", "48"],
         "num_heads=8 is not divisible by the context-parallel size 3"),
        (["--cp", "2", "--u", "3"], "heads_per_stage=3 is not a positive multiple of the cp size 2"),
        (["--cp", "2", "--seq-len", "65"], "seq_len=65 and check_seq_len=32 must be multiples of C=2"),
        (["--cp", "0"], "argument --cp: must be >= 1, got 0"),
        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    ]
    for extra, expected in cases:
        argv = dict(zip(small[::2], small[1::2]))
        argv.update(dict(zip(extra[::2], extra[1::2])))
        assert call(main, [x for kv in argv.items() for x in kv]) == 2, extra
        line = one_error_line(capsys.readouterr().err, "bench_attention.py")
        assert expected in line, (extra, line)


def test_estimate_memory_errors(capsys, monkeypatch):
    main = tool("estimate_memory").main
    cases = [
        (["--config", "nope.yaml"], "cannot read config file nope.yaml"),
        (["--config", TINY, "train.stesp=3"], "unknown config key 'train.stesp' (on the command line); did you mean"),
        (["--config", TINY, "--strategies", "p2p"], "strategy 'p2p' is not one the planner simulates"),
        (["--config", TINY, "parallel.cp_strategy=p2p", "dist.backend=auto"], "strategy 'p2p' is not one the planner"),
        (["--config", TINY, "--strategies", "upipe:3"], "heads_per_stage=3 is not a positive multiple of the cp size"),
        (["--config", TINY, "--world-size", "0"], "argument --world-size: must be >= 1, got 0"),
        (["--config", TINY, "--world-size", "3"], "world size 3 is not divisible by parallel.tp·pp·cp"),
        (["--config", TINY, "data.tokenizer=README.md"], "cannot load sentencepiece model README.md"),
        (["--config", TINY, "--fastest", "--gpu", "0.5"], "--fastest needs the step-time model's constants, which "
                                                          "0.5GiB has none of: name the GPU model"),
        (["--config", TINY, "--fastest", "--max-context"], "--fastest chooses the strategy and the length is given"),
        (["--config", TINY, "--seq-length", "4096"], "--seq-length and --speed go with --fastest or --longest"),
        (["--config", TINY, "--fastest", "--longest"], "--fastest and --longest choose different stacks: give one"),
        (["--config", TINY, "--fastest", "--seq-length", "1001"], "train.seq_length=1001 must be a multiple of 2"),
    ]
    monkeypatch.chdir(ROOT)
    for argv, expected in cases:
        assert call(main, argv) == 2, argv
        line = one_error_line(capsys.readouterr().err, "estimate_memory.py")
        assert expected in line, (argv, line)


def test_convert_hf_llama_errors(corpus, tmp_path, capsys):
    main, out = tool("convert_hf_llama").main, str(tmp_path / "out")
    cases = [
        (["hf-to-mcore", "--hf", str(corpus / "nope"), "--out", out], "no config.json there: give a local HF Llama"),
        (["hf-to-mcore", "--hf", str(corpus / "hf_gpt2"), "--out", out], "model_type 'gpt2' is not 'llama'"),
        (["mcore-to-hf", "--ckpt", str(corpus), "--out", out], "no upipe_model.json there"),
        (["hf-to-mcore", "--hf", str(corpus / "hf_noweights"), "--out", str(corpus / "full")],
         "exists and is not an empty directory"),
        (["hf-to-mcore", "--hf", str(corpus / "hf_noweights"), "--out", out], "no file named model.safetensors"),
        (["sideways"], "argument direction: invalid choice: 'sideways'"),
    ]
    for argv, expected in cases:
        assert call(main, argv) == 2, argv
        line = one_error_line(capsys.readouterr().err, "convert_hf_llama.py")
        assert expected in line, (argv, line)


def test_every_cli_as_a_real_process(corpus):
    """One bad input per script, run as users run it: exit 2, one error line, no traceback (started together)."""
    runs = {
        "pretrain_llama.py": ["pretrain_llama.py", "--config", TINY, "--dry-run", "model.vocab_size=100"],
        "preprocess_data.py": ["tools/preprocess_data.py", "--input", str(corpus / "nope"), "--tokenizer", SPM,
                               "--output-prefix", "x"],
        "train_tokenizer.py": ["tools/train_tokenizer.py", "--input", str(corpus / "ok.txt"), "--model-prefix", "x",
                               "--vocab-size", "100"],
        "bench_attention.py": ["tools/bench_attention.py", "--heads", "8", "--kv-heads", "3"],
        "estimate_memory.py": ["tools/estimate_memory.py", "--config", TINY, "--strategies", "p2p"],
        "convert_hf_llama.py": ["tools/convert_hf_llama.py", "mcore-to-hf", "--ckpt", str(corpus), "--out", "x"],
    }
    procs = {name: subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name, argv in runs.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, err)
        one_error_line(err, name)


# ---- the launch scripts ----

def test_single_node_example_on_cpu(tmp_path):
    """The README's example passes its pre-flight now (warmup_fraction); a refused config writes no run directory
    and starts no torchrun; no torchrun at all names tools/setup_env.sh."""
    fakes = Fakes(tmp_path)
    env = {"FAKE_GPUS": "0", "NPROC_PER_NODE": "2", "CONFIG": "examples/configs/tiny_cpu.yaml"}
    ok = fakes.run(SINGLE_NODE, "train.steps=3", RUN_DIR=str(tmp_path / "ok"), **env)
    assert ok.returncode == 0, ok.stderr
    assert len(fakes.calls("torchrun")) == 1 and (tmp_path / "ok" / "config.yaml").stat().st_size > 0

    for bad in (["train.warmup_steps=30"], ["dist.backend=nccl"]):  # a config error; a machine error (no GPU)
        r = fakes.run(SINGLE_NODE, "train.steps=3", *bad, RUN_DIR=str(tmp_path / "bad"), **env)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert bad[0].split("=")[0] in r.stderr
        assert not (tmp_path / "bad").exists() and len(fakes.calls("torchrun")) == 1

    r = subprocess.run(["bash", str(SINGLE_NODE)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "VENV": str(tmp_path / "no-venv"), "PYTHON": sys.executable,
                            "NPROC_PER_NODE": "2"})
    assert r.returncode == 2 and "bash tools/setup_env.sh" in r.stderr, r.stderr


FAKE_VENV_TOOL = """#!/bin/sh
echo "$(basename "$0") $*" >> "$DEMO_LOG"
"""
FAKE_SETUP = """#!/bin/sh
echo "setup_env.sh" >> "$DEMO_LOG"
mkdir -p .venv/bin
for t in python torchrun; do printf '%s' "$FAKE_VENV_TOOL" > .venv/bin/$t; chmod +x .venv/bin/$t; done
"""


def test_cpu_demo_builds_its_environment_on_a_fresh_clone(tmp_path):
    """run_cpu_demo.sh in a copy of the repository with a recording tools/setup_env.sh: without .venv it runs the
    set-up first, then the pre-flight dry run and torchrun from .venv; with a usable .venv it skips the set-up."""
    clone = tmp_path / "clone"
    (clone / "examples").mkdir(parents=True)
    (clone / "tools").mkdir()
    (clone / "examples" / "run_cpu_demo.sh").write_text((ROOT / "examples" / "run_cpu_demo.sh").read_text())
    (clone / "tools" / "setup_env.sh").write_text(FAKE_SETUP)
    log = tmp_path / "log"
    env = {"PATH": os.environ["PATH"], "DEMO_LOG": str(log), "FAKE_VENV_TOOL": FAKE_VENV_TOOL,
           "RUN_DIR": str(tmp_path / "run")}

    def demo(*overrides: str) -> list[str]:
        log.write_text("")
        r = subprocess.run(["bash", "examples/run_cpu_demo.sh", *overrides], cwd=clone, env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return log.read_text().splitlines()

    first = demo("train.steps=20")
    assert first[0] == "setup_env.sh"
    assert first[-2].startswith("python pretrain_llama.py --config examples/configs/tiny_cpu.yaml")
    assert first[-2].endswith("train.steps=20 --dry-run --world-size 2 --check-machine")
    assert first[-1].startswith("torchrun --nproc-per-node 2") and first[-1].endswith("train.steps=20")
    # The fake .venv's python answers the usability check too (exit 0), so the second run reuses it.
    assert "setup_env.sh" not in demo()
    # A run already in RUN_DIR is never deleted: the demo resumes it (train.steps=N extends it) and says so.
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_0000200").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("iter_0000200\n")
    (run / "metrics.jsonl").write_text("{}\n")
    r = subprocess.run(["bash", "examples/run_cpu_demo.sh", "train.steps=400"], cwd=clone, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"{run} holds a run: resuming it" in r.stderr
    assert (run / "checkpoints" / "iter_0000200").is_dir() and (run / "metrics.jsonl").read_text() == "{}\n"
