"""Cross-section checks of a Config against the world size, and the values derived from them (a Plan).

`validate(config, world_size)` is a pure function of its arguments, so every rank reaches the same verdict before
any allocation or communication, and a login node can judge a GPU recipe. It reports every problem at once, each
naming the setting(s) and the fix. It never changes the Config: derived values go into the Plan. Its checks, one
function per concern, are validate_sections.py's.
`check_paths(config)` separately checks the files the config reads: they exist, data.path is a whole indexed dataset
whose ids fit the vocabulary, data.tokenizer loads as a tokenizer, model.vocab_size holds its vocabulary, and a
converted/HF checkpoint.load fits model.* and the vocabulary (run at start-up and by --dry-run); outputs.py's
`check_outputs(config)` that every place the run writes can be written. What this machine must have (CUDA, optional
packages) is machine.py's `machine_problems`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_upipe.models.presets import LlamaArch

from .fieldtypes import ConfigError
from .schema import Config
from .validate_sections import (check_batch, check_cp_strategy, check_data, check_heads, check_pipeline,
                                check_schedule, check_seq_length, check_sharding, check_world)
from .validate_sections import resolve_heads_per_stage  # noqa: F401 (named here by tests and callers)


@dataclass(frozen=True)
class Plan:
    """What follows from the config and the world size; the config itself stays as the user wrote it."""

    world_size: int
    dp: int
    global_batch_size: int
    num_microbatches: int  # gradient-accumulation steps per optimizer step
    arch: LlamaArch  # the preset with model.* overrides
    vocab_size: int | None  # None: the tokenizer's, known once it is loaded
    local_heads: int  # query heads per TP rank
    local_kv_heads: int  # KV heads per TP rank
    heads_per_stage: int | None  # UPipe U (resolved from parallel.upipe_heads_per_stage), else None
    seq_length: int
    seq_per_cp_rank: int
    warnings: tuple[str, ...] = ()
    heads_per_stage_auto: bool = False  # upipe_heads_per_stage=auto, not resolved yet (heads_per_stage is None)

    @property
    def upipe_stages(self) -> int | None:
        return None if self.heads_per_stage is None else self.local_heads // self.heads_per_stage

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // (self.dp * self.num_microbatches)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_length

    def summary(self) -> str:
        a = self.arch
        lines = [
            f"world {self.world_size} = dp {self.dp} x (tp·pp·cp {self.world_size // self.dp})",
            f"model: L{a.num_layers} D{a.hidden_size} H{a.num_attention_heads}/kv{a.num_query_groups} d{a.kv_channels}"
            f" ffn{a.ffn_hidden_size}, vocab {self.vocab_size or 'from tokenizer'}" + _features(a),
            f"heads per TP rank: {self.local_heads} q / {self.local_kv_heads} kv",
            f"global batch {self.global_batch_size} = micro-batch {self.micro_batch_size} x dp {self.dp}"
            f" x {self.num_microbatches} accumulation step(s)",
            f"tokens per step {self.tokens_per_step}, per CP rank per sequence {self.seq_per_cp_rank}",
        ]
        if self.heads_per_stage is not None:
            lines.append(f"upipe: {self.heads_per_stage} heads per stage (over the cp ranks), "
                         f"{self.upipe_stages} stages")
        elif self.heads_per_stage_auto:
            lines.append("upipe: heads per stage chosen by the memory planner at start-up (auto)")
        return "\n".join(lines + [f"warning: {w}" for w in self.warnings])


def _features(a: LlamaArch) -> str:
    """', qkv bias, qk-norm, tied embeddings, RoPE θ 500000 llama3 x8 (8192)' (the family features present)."""
    words = [w for on, w in ((a.qkv_bias, "qkv bias"), (a.qk_norm, "qk-norm"), (a.tie_embeddings, "tied embeddings"))
             if on]
    rope = f"RoPE θ {a.rotary_base:g}"
    if a.rope_scaling is not None:
        sc = a.rope_scaling
        rope += f" {sc.kind} x{sc.factor:g}" + (f" of {sc.original_max_position_embeddings}"
                                               if sc.original_max_position_embeddings else "")
    return ", " + ", ".join(words + [rope])


def validate(config: Config, world_size: int) -> Plan:
    """Every cross-section inconsistency, refused with one ConfigError; else the derived Plan.

    One check per concern (validate_sections.py), in this order, so the problems are listed in this order."""
    p, t = config.parallel, config.train
    arch = config.model.arch()
    errors: list[str] = []
    warnings: list[str] = []
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size {world_size!r} must be a positive integer (WORLD_SIZE or --world-size)")
    dp = check_world(config, world_size, errors)
    local_h, local_g, U = check_heads(config, arch, errors)
    check_cp_strategy(config, errors)
    check_seq_length(config, errors)
    gbs, n_micro = check_batch(config, dp, errors)
    check_pipeline(config, arch, n_micro, errors, warnings)
    vocab = check_data(config, arch, errors)
    check_sharding(config, arch, dp, errors, warnings)
    check_schedule(config, warnings)
    if errors:
        raise_all(errors, f"{len(errors)} problem(s) with this configuration at world size {world_size}:")
    return Plan(world_size, dp, gbs, n_micro, arch, vocab, local_h, local_g, U, t.seq_length,
                t.seq_length // p.cp, tuple(warnings),
                heads_per_stage_auto=p.cp_strategy == "upipe" and p.upipe_heads_per_stage == "auto")


def raise_all(problems: list[str], header: str) -> None:
    """One ConfigError: a single problem as its own line, several under `header` as a list."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    raise ConfigError(header + "\n- " + "\n- ".join(problems))


_TOKENIZER_KINDS = "a sentencepiece .model file, a tokenizer.json, or a directory holding a tokenizer.json"


def check_paths(config: Config) -> None:
    """The files the config reads exist, data.tokenizer loads and model.vocab_size holds its vocabulary (checked at
    start-up and by --dry-run, identically on every rank of a shared file system)."""
    problems = []
    d, c, m = config.data, config.checkpoint, config.model
    if d.path != "mock":
        absent = [ext for ext in (".bin", ".idx") if not Path(d.path + ext).is_file()]
        if absent:
            problems.append(f"data.path={d.path}: {' and '.join(d.path + ext for ext in absent)} not found: give the "
                            f"prefix tools/preprocess_data.py printed, or data.path=mock data.tokenizer=null "
                            f"model.vocab_size=N for synthetic data")
        else:
            problems += _dataset_problems(d.path, d.tokenizer, m.vocab_size)
    if d.tokenizer is not None:
        if not Path(d.tokenizer).exists():
            problems.append(f"data.tokenizer={d.tokenizer} does not exist: give {_TOKENIZER_KINDS}")
        else:
            problems += _tokenizer_problems(d.tokenizer, m.vocab_size)
    if c.load is not None and not Path(c.load).exists():
        problems.append(f"checkpoint.load={c.load} does not exist: give a checkpoint directory (or a directory with a "
                        f"`latest` file), or set checkpoint.load=null")
    if c.load is not None and Path(c.load).exists():  # a converted/HF checkpoint.load must fit model.* and the vocab
        from megatron_upipe.checkpoint.sources import initial_weights_problems

        problems += initial_weights_problems(config, _tokenizer_vocab(d.tokenizer))
    if c.resume is True and c.dir is not None and not Path(c.dir).is_dir():
        problems.append(f"checkpoint.resume=true but checkpoint.dir={c.dir} does not exist: point checkpoint.dir at "
                        f"an existing run, or set checkpoint.resume=auto to start fresh")
    if problems:
        raise_all(problems, "the files this configuration reads:")


def _dataset_problems(prefix: str, tokenizer: str | None, vocab_size: int | None) -> list[str]:
    """The .bin/.idx pair is a whole indexed dataset with token ids inside the tokenizer's vocabulary, else
    model.vocab_size (a cheap look: megatron_upipe/data/index_check.py)."""
    from megatron_upipe.data.index_check import dataset_problem

    problem = dataset_problem(prefix, _tokenizer_vocab(tokenizer) or vocab_size)
    if problem is None:
        return []
    rebuild = "tools/preprocess_data.py" + (f" --tokenizer {tokenizer}" if tokenizer else "")
    return [f"data.path={prefix}: {problem}: re-run {rebuild} to rebuild the pair"]


def _tokenizer_vocab(spec: str | None) -> int | None:
    from megatron_upipe.data.tokenizers import build_tokenizer

    try:
        return None if spec is None else build_tokenizer(spec).vocab_size
    except (OSError, ValueError):  # reported by _tokenizer_problems
        return None


def _tokenizer_problems(spec: str, vocab_size: int | None) -> list[str]:
    """data.tokenizer must load (sentencepiece/tokenizers only: no torch), and model.vocab_size must cover it."""
    from megatron_upipe.data.tokenizers import build_tokenizer

    try:
        tokenizer = build_tokenizer(spec)
    except (OSError, ValueError) as e:  # FileNotFoundError for a directory without tokenizer.json
        reason = " ".join(str(e).split())  # sentencepiece's messages span lines
        return [f"data.tokenizer={spec} is not a usable tokenizer ({reason}): give {_TOKENIZER_KINDS}"]
    if vocab_size is not None and vocab_size < tokenizer.vocab_size:
        return [f"model.vocab_size={vocab_size} is smaller than the vocabulary of data.tokenizer={spec} "
                f"({tokenizer.vocab_size} ids): set model.vocab_size=null (the tokenizer's) or at least "
                f"{tokenizer.vocab_size}"]
    return []
