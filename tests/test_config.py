"""The config tree: precedence, error messages, the shipped configs, the validation rules and the entry point."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_upipe.config import Config, ConfigError, check_paths, load_config, to_yaml, validate
from megatron_upipe.config.loader import known_keys
from megatron_upipe.config.schema import CheckpointConfig, ParallelConfig, TrainConfig
from megatron_upipe.config.validate import resolve_heads_per_stage

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
TINY = str(ROOT / "examples" / "configs" / "tiny_cpu.yaml")

REQUIRED_KEYS = """model.preset parallel.tp parallel.pp parallel.cp parallel.cp_strategy parallel.upipe_heads_per_stage
train.seq_length train.micro_batch_size train.global_batch_size train.steps train.lr train.seed data.path
data.tokenizer checkpoint.dir checkpoint.interval log.metrics_file""".split()


def errors_of(fn, *args) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    return str(e.value)


def test_required_keys_exist():
    assert set(REQUIRED_KEYS) <= set(known_keys())


def test_precedence_defaults_yaml_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 1e-3\n  steps: 7\nparallel:\n  cp: 2\n  cp_strategy: upipe\n")
    c = load_config(str(f), ["train.lr=2e-3", "train.seed=5"])
    assert c.train.lr == 2e-3 and isinstance(c.train.lr, float)  # override beats YAML; 1e-3 read as a float
    assert c.train.steps == 7  # YAML beats default
    assert c.train.min_lr == TrainConfig().min_lr == 3e-5  # default kept
    assert (c.parallel.cp, c.parallel.cp_strategy, c.train.seed) == (2, "upipe", 5)
    assert load_config(None, []) == Config()
    assert load_config(str(f), ["train.steps=9", "train.steps=11"]).train.steps == 11  # the last override wins


def test_yaml_scalar_rules_in_overrides():
    c = load_config(None, ["checkpoint.dir=", "data.split=[98, 2, 0]", "train.bf16=true", "log.wandb_mode=online",
                           "data.path=a=b", "train.clip_grad=0"])
    assert c.checkpoint.dir is None
    assert c.data.split == [98.0, 2.0, 0.0]
    assert c.train.bf16 is True and c.train.clip_grad == 0.0
    assert c.log.wandb_mode == "online" and c.data.path == "a=b"
    assert load_config(None, ["checkpoint.resume=auto"]).checkpoint.resume == "auto"
    assert load_config(None, ["checkpoint.resume=false", "checkpoint.dir=x"]).checkpoint.resume is False


def test_unknown_keys_suggest_the_closest(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  seq_len: 1024\n")
    msg = errors_of(load_config, str(f), ["paralel.cp=2", "foo.bar=1", "train.qqqqqqqq=1"])
    assert f"unknown config key 'train.seq_len' (in {f}); did you mean 'train.seq_length'?" in msg
    assert "unknown config key 'paralel.cp' (on the command line); did you mean 'parallel.cp'?" in msg
    assert "sections are ['model', 'parallel'" in msg  # no close match: list the sections
    assert "keys of train: ['train.seq_length'" in msg
    assert "did you mean 'ulysses'?" in errors_of(load_config, None, ["parallel.cp_strategy=ulyses", "parallel.cp=2"])


@pytest.mark.parametrize("override, expected", [
    ("train.steps=1.5", "train.steps=1.5: expected int, got float"),
    ("train.steps=true", "train.steps=true: expected int, got bool"),
    ("train.lr=fast", "train.lr='fast': expected float, got str"),
    ("parallel.sequence_parallel=1", "parallel.sequence_parallel=1: expected bool, got int"),
    ("log.wandb_project=123", "quote it to pass a string"),
    ("data.split=abc", "data.split='abc': expected list of float, got str"),
    ("data.split=[1, x, 0]", "expected list of float"),
    ("train.bf16=maybe", "train.bf16='maybe': expected bool or one of auto"),
    ("parallel.cp={a: 1}", "expected int, got mapping"),
    ("train.seq_length=", "train.seq_length=null: expected int, got null"),
    ("train.lr", "is not of the form section.key=value"),
])
def test_type_errors(override, expected):
    assert expected in errors_of(load_config, None, [override])


def test_dataclasses_check_their_own_fields():
    assert "parallel.cp=2 needs a context-parallel algorithm" in errors_of(ParallelConfig, 1, 1, 2)
    assert "train.lr='3e-4': expected float" in errors_of(lambda: TrainConfig(lr="3e-4"))  # strict in Python
    assert "checkpoint.dir is null" in errors_of(lambda: CheckpointConfig(interval=10))
    with pytest.raises(Exception):  # frozen: nothing rewrites what the user asked for
        Config().train.lr = 1.0  # type: ignore[misc]


def test_print_config_round_trips(tmp_path):
    c = load_config(TINY, ["train.lr=2.5e-3", "data.split=[90, 10, 0]", "checkpoint.resume=true"])
    f = tmp_path / "resolved.yaml"
    f.write_text(to_yaml(c))
    assert load_config(str(f)) == c
    assert yaml.safe_load(to_yaml(c))["parallel"]["cp_strategy"] == "upipe"


def _intended_world_size(path: Path) -> int:
    m = re.search(r"^# world_size: (\d+)$", path.read_text(), re.MULTILINE)
    assert m, f"{path.name} must state its intended world size in a '# world_size: N' line"
    return int(m.group(1))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate_at_their_world_size(path):
    config = load_config(str(path))
    plan = validate(config, _intended_world_size(path))
    check_paths(config)  # the tiny config's data and tokenizer are committed under data/
    assert plan.dp * config.parallel.model_parallel_size == plan.world_size
    assert plan.warnings == ()
    if config.parallel.cp_strategy == "upipe":
        assert plan.heads_per_stage is not None and plan.local_heads % plan.heads_per_stage == 0


def test_shipped_configs_are_the_intended_ones():
    names = {p.name for p in CONFIGS}
    assert {"tiny_cpu.yaml", "llama3_8b_upipe_8xh100.yaml", "qwen3_32b_upipe_16xh100.yaml"} <= names
    big = validate(load_config(str(ROOT / "examples/configs/llama3_8b_upipe_8xh100.yaml")), 8)
    assert (big.seq_length, big.heads_per_stage, big.upipe_stages, big.vocab_size) == (5242880, 8, 4, 128256)
    qwen = validate(load_config(str(ROOT / "examples/configs/qwen3_32b_upipe_16xh100.yaml")), 16)
    assert (qwen.dp, qwen.heads_per_stage, qwen.upipe_stages, qwen.local_kv_heads) == (1, 16, 4, 8)
    assert "global batch 1 = micro-batch 1 x dp 1 x 1" in qwen.summary()
    tiny = validate(load_config(TINY), 2)
    assert (tiny.heads_per_stage, tiny.num_microbatches, tiny.seq_per_cp_rank) == (2, 4, 128)


BAD = [  # (overrides on tiny_cpu.yaml, world size, expected substring)
    ([], 3, "world size 3 is not divisible by parallel.tp·pp·cp = 1·1·2 = 2"),
    ([], 0, "world size 0 must be a positive integer"),
    (["parallel.dp=2"], 2, "parallel.dp=2 but world size 2 / (tp·pp·cp = 2) = 1"),
    (["parallel.tp=3"], 6, "model.num_attention_heads=8 is not divisible by parallel.tp=3"),
    (["model.preset=tiny-gqa", "parallel.tp=4"], 8,
     "model.num_query_groups=2 (KV heads) is not divisible by parallel.tp=4"),
    (["parallel.cp=3", "train.seq_length=258"], 3, "not divisible by the context-parallel size 3"),
    (["parallel.tp=2", "parallel.cp=8", "train.seq_length=512"], 16,
     "parallel.cp: parallel.cp_strategy=upipe with 4 query"),
    (["parallel.upipe_heads_per_stage=3"], 2, "legal heads_per_stage values for these shapes: [2, 4, 8]"),
    (["parallel.upipe_heads_per_stage=16"], 2, "heads_per_stage=16"),
    (["train.seq_length=255"], 2, "train.seq_length=255 must be a multiple of 2 (cp)"),
    (["parallel.tp=4", "parallel.sequence_parallel=true", "train.seq_length=260"], 8,
     "train.seq_length=260 must be a multiple of 8 (cp, times tp under sequence parallel)"),
    (["parallel.cp_strategy=a2a", "train.seq_length=258"], 2, "must be a multiple of 4 (2·cp zigzag chunks)"),
    (["model.preset=tiny-gqa", "parallel.cp=4", "parallel.cp_strategy=a2a"], 4, "a2a splits the 8 query and 2 KV"),
    (["train.global_batch_size=3"], 2,
     "train.global_batch_size=3 is not a multiple of train.micro_batch_size·dp = 2·1"),
    (["parallel.pp=3"], 6, "parallel.pp=3 must divide model.num_layers=2"),
    (["parallel.cp_strategy=none"], 2, "parallel.cp=2 needs a context-parallel algorithm"),
    (["parallel.cp_strategy=p2p"], 2, "parallel.cp_strategy=p2p"),  # TE missing, or TE on gloo
    (["parallel.sequence_parallel=true"], 2, "parallel.sequence_parallel=true needs parallel.tp > 1"),
    (["parallel.cp_strategy=ulysses", "parallel.upipe_heads_per_stage=2"], 2,
     "parallel.upipe_heads_per_stage=2 is only used"),
    (["train.min_lr=0.1"], 2, "train.min_lr=0.1 must be in [0, train.lr=0.003]"),
    (["train.lr=0"], 2, "train.lr=0.0 must be positive"),
    (["train.warmup_steps=200"], 2, "train.warmup_steps=200 must be below the decay horizon 200"),
    (["checkpoint.interval=-1"], 2, "checkpoint.interval=-1 must be >= 0"),
    (["checkpoint.dir=null"], 2, "checkpoint.interval=100 saves checkpoints but checkpoint.dir is null"),
    (["data.tokenizer=null"], 2, "data.path=data/corpus_text_document is a tokenized dataset: set data.tokenizer"),
    (["data.path=mock", "data.tokenizer=null"], 2, "the vocabulary size is unknown"),
    (["data.split=[1, 0, 0]"], 2, "leaves no validation data"),
    (["model.num_query_groups=3"], 2, "not a multiple of num_query_groups=3"),
    (["model.num_layers=0"], 2, "model.num_layers=0 must be positive"),
    (["model.preset=llama-9b"], 2, "model.preset='llama-9b' is unknown"),
    (["memory.offload_checkpoints=true"], 2, "memory.offload_checkpoints=true offloads the layer inputs that full"),
    (["memory.offload_prefetch=true"], 2, "but memory.offload_checkpoints=false: set memory.offload_checkpoints=true"),
    (["memory.recompute_layers=1"], 2, "memory.recompute_layers=1 limits full recompute, but memory.recompute=none"),
    (["memory.recompute=full", "memory.recompute_layers=3"], 2,
     "memory.recompute_layers=3 exceeds the 2 layers of a pipeline stage: give at most 2"),
    (["memory.shard_model_states=true", "parallel.cp=1", "parallel.pp=2", "train.global_batch_size=2"], 2,
     "memory.shard_model_states=true is not combined with parallel.pp=2"),
    (["model.tie_embeddings=true", "memory.shard_model_states=true"], 2, "set memory.fsdp_embedding_unit=false"),
    (["memory.fsdp_grads_dtype=bf16"], 2, "but memory.shard_model_states=false: set memory.shard_model_states=true"),
    (["memory.fsdp_grads_dtype=bf16", "memory.shard_model_states=true"], 2,
     "memory.fsdp_grads_dtype=bf16 would round the gradients of float32 training (train.bf16=false)"),
    (["parallel.cp_strategy=ulysses", "parallel.upipe_heads_per_stage=null", "memory.upipe_overlap=true"], 2,
     "memory.upipe_overlap=true pipelines UPipe's head stages (Ulysses has one stage): set parallel.cp_strategy=upipe"),
    # hybrid a2a x ring (parallel.cp_ring)
    (["parallel.cp_ring=3"], 2, "parallel.cp_ring=3 must divide parallel.cp=2"),
    (["parallel.cp_ring=2", "parallel.cp_strategy=a2a"], 2, "parallel.cp_ring=2 runs a ring over UPipe/Ulysses"),
    (["parallel.cp_ring=2", "train.seq_length=258"], 2,
     "train.seq_length=258 must be a multiple of 4 (2·cp: two zigzag chunks per ring rank"),
    (["parallel.cp_ring=2", "memory.upipe_overlap=true"], 2, "memory.upipe_overlap=true is not implemented with "
                                                              "parallel.cp_ring=2"),
    (["memory.ring_overlap=true"], 2, "memory.ring_overlap=true overlaps the ring's P2P passes"),
    (["parallel.cp_ring=2", "data.document_mask=true", "train.micro_batch_size=1"], 2,
     "data.document_mask=true is not implemented with parallel.cp_ring=2"),
    (["parallel.cp=32", "parallel.cp_ring=2", "train.seq_length=1024"], 32,
     "per TP rank (tp=1) and all-to-all size cp/cp_ring = 16"),
]


def test_cp_ring_counts_heads_over_the_all_to_all_group():
    """16 CP ranks cannot share the tiny model's 8 query heads in one all-to-all, but 2 rings of 8 can."""
    msg = errors_of(lambda: validate(load_config(TINY, ["parallel.cp=16", "train.seq_length=512"]), 16))
    assert "and cp=16" in msg
    plan = validate(load_config(TINY, ["parallel.cp=16", "parallel.cp_ring=2", "train.seq_length=512"]), 16)
    assert plan.seq_per_cp_rank == 32 and plan.local_heads % plan.heads_per_stage == 0


@pytest.mark.parametrize("overrides, world_size, expected", BAD, ids=[r[2][:40] for r in BAD])
def test_bad_configs_are_refused(overrides, world_size, expected):
    msg = errors_of(lambda: validate(load_config(TINY, overrides), world_size))
    assert expected in msg


def test_all_problems_reported_at_once():
    msg = errors_of(lambda: validate(load_config(TINY, ["train.seq_length=255", "parallel.dp=2"]), 2))
    assert msg.startswith("2 problem(s)") and "train.seq_length=255" in msg and "parallel.dp=2" in msg


def test_validate_derives_without_rewriting():
    c = load_config(TINY, ["train.global_batch_size=null", "parallel.upipe_heads_per_stage=null"])
    plan = validate(c, 4)  # dp 2
    assert (plan.dp, plan.global_batch_size, plan.num_microbatches, plan.heads_per_stage) == (2, 4, 1, 2)
    assert c.train.global_batch_size is None and c.parallel.dp is None and c.parallel.upipe_heads_per_stage is None
    assert validate(load_config(TINY, ["parallel.upipe_heads_per_stage=8"]), 2).upipe_stages == 1
    one = validate(load_config(TINY, ["parallel.cp=1"]), 1)  # UPipe without CP: stages of one head
    assert (one.heads_per_stage, one.upipe_stages) == (1, 8)
    pp = validate(load_config(TINY, ["parallel.pp=2", "train.global_batch_size=2"]), 4)
    assert "mostly idle" in pp.warnings[0]


def test_upipe_legality_comes_from_the_schedule():
    from megatron_upipe.attention.schedule import legal_heads_per_stage

    for heads, kv, cp in [(8, 4, 2), (32, 8, 8), (64, 8, 16), (8, 2, 4)]:
        legal = legal_heads_per_stage(heads, kv, cp)
        assert resolve_heads_per_stage(heads, kv, cp, None) == legal[0]
        assert [resolve_heads_per_stage(heads, kv, cp, u) for u in legal] == legal
    with pytest.raises(ValueError, match="legal heads_per_stage"):
        resolve_heads_per_stage(32, 8, 8, 12)


def test_choices_match_the_layer_spec():
    from typing import get_args

    from megatron_upipe.config.schema import CpStrategy
    from megatron_upipe.parallel import CP_STRATEGIES  # imports torch, not megatron-core

    assert get_args(CpStrategy) == CP_STRATEGIES


def test_paths_are_checked():
    msg = errors_of(check_paths, load_config(TINY, ["data.path=data/nope", "checkpoint.load=/no/such/ckpt"]))
    assert msg.startswith("the files this configuration reads:\n- ")  # several problems: one line each
    assert "data.path=data/nope: data/nope.bin and data/nope.idx not found" in msg
    assert "checkpoint.load=/no/such/ckpt does not exist" in msg


@pytest.mark.parametrize("overrides, expected", [
    (["data.tokenizer=README.md"], "data.tokenizer=README.md is not a usable tokenizer (cannot load sentencepiece"),
    (["data.tokenizer=data"], "data.tokenizer=data is not a usable tokenizer (tokenizer.json not found"),
    (["data.tokenizer=no/such.model"], "data.tokenizer=no/such.model does not exist: give a sentencepiece .model"),
    (["model.vocab_size=100"], "model.vocab_size=100 is smaller than the vocabulary of data.tokenizer="
                               "data/tokenizer/spm.model (4096 ids): set model.vocab_size=null"),
    (["checkpoint.resume=true", "checkpoint.dir=/no/such/run"], "checkpoint.resume=true but checkpoint.dir=/no/such"),
])
def test_the_tokenizer_is_loaded_and_covered_by_the_vocabulary(overrides, expected):
    """What used to pass --dry-run and fail in the build, with a traceback per rank: one line now."""
    msg = errors_of(check_paths, load_config(TINY, overrides))
    assert msg.startswith(expected) and "\n" not in msg, msg
    check_paths(load_config(TINY, ["model.vocab_size=4096"]))  # equal is enough (the tokenizer's own size)


def test_warmup_as_a_fraction_of_the_decay_horizon():
    """tiny_cpu.yaml warms up over 10% of the run, so a short demo (train.steps=20) keeps a valid schedule."""
    def warmup(*overrides):
        return load_config(TINY, list(overrides)).train.lr_warmup_steps

    assert (warmup(), warmup("train.steps=20"), warmup("train.steps=3"), warmup("train.steps=1")) == (20, 2, 0, 0)
    assert warmup("train.lr_decay_steps=50") == 5  # the decay horizon, not train.steps
    assert warmup("train.steps=100", "train.warmup_fraction=0.29") == 29  # 0.29·100 is 28.999... in binary
    c = load_config(TINY, ["train.warmup_steps=5"])  # given steps win over the file's fraction, with a warning
    assert (c.train.lr_warmup_steps, c.train.warmup_fraction) == (5, 0.1)
    assert "train.warmup_fraction=0.1 applies only when train.warmup_steps=null" in validate(c, 2).warnings[0]
    assert TrainConfig().lr_warmup_steps == 0 and TrainConfig().warmup_steps is None
    assert "must be in [0, 1)" in errors_of(load_config, TINY, ["train.warmup_fraction=1"])
    assert "set train.warmup_steps=null and train.warmup_fraction" in errors_of(
        load_config, TINY, ["train.steps=20", "train.warmup_steps=20"])


def test_machine_problems_are_apart_from_the_config(monkeypatch):
    """validate judges the config (a CPU login node can dry-run a GPU recipe); machine_problems judges this machine,
    with the GPU count faked both ways so the verdicts do not depend on where the test runs."""
    from megatron_upipe.config import machine

    def problems(gpus, overrides, local_ranks=None):
        monkeypatch.setattr(machine, "_gpu_count", lambda: gpus)
        c = load_config(TINY, overrides)
        validate(c, 2)  # a valid config either way
        return machine.machine_problems(c, local_ranks)

    assert problems(0, []) == [] and problems(0, ["model.attention_kernel=cpu_flash"]) == []
    (nccl,) = problems(0, ["dist.backend=nccl"])
    assert nccl.startswith("dist.backend=nccl needs CUDA GPUs and this machine has none: set dist.backend=gloo")
    assert problems(2, ["dist.backend=nccl"], local_ranks=2) == []
    (too_many,) = problems(2, ["dist.backend=auto"], local_ranks=8)
    assert too_many.startswith("8 ranks on this node (torchrun --nproc-per-node) but 2 GPU(s) visible")
    (kernel,) = problems(0, ["model.attention_kernel=sdpa_flash", "dist.backend=auto"])
    assert kernel.startswith("model.attention_kernel=sdpa_flash: kernel 'sdpa_flash' runs on cuda")
    (fp32,) = problems(2, ["model.attention_kernel=sdpa_flash", "train.bf16=false", "dist.backend=auto"])
    assert "does not support dtype torch.float32" in fp32 and fp32.endswith("set model.attention_kernel=auto")
    te = problems(0, ["parallel.cp_strategy=p2p", "dist.backend=auto"])
    assert any("(TransformerEngine) needs CUDA GPUs" in p for p in te)
    assert (machine._importable("transformer_engine")
            or any("TransformerEngine, which is not importable" in p for p in te))
    (zero1,) = problems(0, ["train.distributed_optimizer=true"])
    assert zero1.startswith("train.distributed_optimizer=true is not supported on CPU")


# ---- the entry point, as a user runs it ----

def run_entry(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "pretrain_llama.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_entry_point_print_config_and_dry_run():
    out = run_entry("--config", TINY, "--print-config", "train.steps=30")
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["train"]["steps"] == 30 and printed["parallel"]["cp"] == 2

    out = run_entry("--config", TINY, "--dry-run", env={"WORLD_SIZE": "2"})
    assert out.returncode == 0, out.stderr
    assert "upipe: 2 heads per stage" in out.stdout and "nothing was built" in out.stdout

    out = run_entry("--config", TINY, "--dry-run", "--world-size", "4", "parallel.cp_stratgy=a2a")
    assert out.returncode == 2
    assert "did you mean 'parallel.cp_strategy'?" in out.stderr and "Traceback" not in out.stderr


def test_entry_point_refuses_the_distributed_optimizer_on_cpu():
    """Valid as a config, refused once the job sees there is no GPU (megatron-core could not resume it): exit 2.
    A real training run of the entry point is tests/test_train_smoke.py."""
    from tests.dist_helper import free_port

    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = run_entry("--config", TINY, "parallel.cp=1", "train.distributed_optimizer=true", "checkpoint.dir=null",
                    "checkpoint.interval=0", "log.metrics_file=null", env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "train.distributed_optimizer=true is not supported on CPU" in out.stderr and "Traceback" not in out.stderr
    out = run_entry("--config", TINY, "--world-size", "2")
    assert out.returncode == 2 and "--world-size is for planning with --dry-run" in out.stderr


def test_config_imports_neither_torch_nor_megatron():
    code = ("import sys, pretrain_llama, megatron_upipe.config; "
            "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("overrides, message", [
    (["model.attention_kernel=sdpa_flash", "parallel.cp_strategy=none", "parallel.cp=1"],
     "applies to parallel.cp_strategy upipe/ulysses only"),
    (["model.attention_kernel=flash_attn", "dist.backend=gloo"], "is a CUDA kernel but dist.backend=gloo"),
    (["model.attention_kernel=cpu_flash", "dist.backend=nccl"], "runs on CPU but dist.backend=nccl"),
])
def test_an_attention_kernel_that_cannot_serve_the_config_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config("examples/configs/tiny_cpu.yaml", overrides), 2)
