"""Cross-section checks of a Config against the world size, and the values derived from them (a Plan).

`validate(config, world_size)` is a pure function of its arguments, so every rank reaches the same verdict before
any allocation or communication, and a login node can judge a GPU recipe. It reports every problem at once, each
naming the setting(s) and the fix. It never changes the Config: derived values go into the Plan.
`check_paths(config)` separately checks the files the config reads: they exist, data.path is a whole indexed dataset
whose ids fit the vocabulary, data.tokenizer loads as a tokenizer, model.vocab_size holds its vocabulary, and a
converted/HF checkpoint.load fits model.* and the vocabulary (run at start-up and by --dry-run); outputs.py's
`check_outputs(config)` that every place the run writes can be written. What this machine must have (CUDA, optional
packages) is machine.py's `machine_problems`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megatron_upipe.models.presets import LlamaArch

from .fieldtypes import ConfigError
from .schema import TE_CP_STRATEGIES, Config


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


def resolve_heads_per_stage(num_heads: int, num_kv_heads: int, cp: int, requested: int | None) -> int:
    """U for these TP-local head counts (requested, or the smallest legal); ValueError says why not.

    The single place the config asks the attention package; imported here, not at module level, so importing
    the config stays free of torch (megatron_upipe.attention's __init__ imports the torch ops).
    """
    from megatron_upipe.attention.schedule import make_schedule

    return make_schedule(num_heads, num_kv_heads, cp, requested).heads_per_stage


def _seq_multiple(config: Config) -> int:
    """train.seq_length must be a multiple of this: split over cp (then tp under sequence parallel)."""
    p = config.parallel
    zigzag = (p.cp_strategy in TE_CP_STRATEGIES and p.cp > 1) or p.cp_ring > 1
    chunks = 2 * p.cp if zigzag else p.cp  # zigzag (TE's, or a ring of all-to-all groups): 2·cp chunks
    return math.lcm(chunks, p.cp * (p.tp if p.sequence_parallel else 1))


def validate(config: Config, world_size: int) -> Plan:
    """Every cross-section inconsistency, refused with one ConfigError; else the derived Plan."""
    p, t, m, d = config.parallel, config.train, config.model, config.data
    arch = m.arch()
    H, G = arch.num_attention_heads, arch.num_query_groups
    errors: list[str] = []
    warnings: list[str] = []
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size {world_size!r} must be a positive integer (WORLD_SIZE or --world-size)")

    # world size = dp · tp · pp · cp
    dp = 0
    if world_size % p.model_parallel_size:
        errors.append(f"world size {world_size} is not divisible by parallel.tp·pp·cp = {p.tp}·{p.pp}·{p.cp} = "
                      f"{p.model_parallel_size}: change tp/pp/cp or the number of processes")
    else:
        dp = world_size // p.model_parallel_size
        if p.dp is not None and p.dp != dp:
            errors.append(f"parallel.dp={p.dp} but world size {world_size} / (tp·pp·cp = {p.model_parallel_size}) "
                          f"= {dp}: set parallel.dp={dp} or null (derived), or change the world size")

    # heads vs tp and cp
    local_h, local_g = H // p.tp, G // p.tp
    if H % p.tp:
        errors.append(f"model.num_attention_heads={H} is not divisible by parallel.tp={p.tp}: choose tp dividing {H}")
    if G % p.tp:
        errors.append(f"model.num_query_groups={G} (KV heads) is not divisible by parallel.tp={p.tp}: choose tp "
                      f"dividing {G}")
    U = None
    if not (H % p.tp or G % p.tp) and p.cp_strategy == "a2a" and (local_h % p.cp or local_g % p.cp):
        errors.append(f"parallel.cp={p.cp}: TransformerEngine's a2a splits the {local_h} query and {local_g} KV heads "
                      f"per TP rank over the cp ranks without KV replication: choose cp dividing both, or upipe")
    if not (H % p.tp or G % p.tp) and p.cp_strategy in ("ulysses", "upipe"):
        requested = p.upipe_heads_per_stage if p.cp_strategy == "upipe" else local_h
        try:  # auto: some legal U must exist (the smallest is checked); the planner picks one at start-up
            U = resolve_heads_per_stage(local_h, local_g, p.cp_a2a, None if requested == "auto" else requested)
        except ValueError as e:
            key = "parallel.upipe_heads_per_stage" if p.upipe_heads_per_stage is not None else "parallel.cp"
            a2a = f"all-to-all size cp/cp_ring = {p.cp_a2a}" if p.cp_ring > 1 else f"cp={p.cp}"
            errors.append(f"{key}: parallel.cp_strategy={p.cp_strategy} with {local_h} query / {local_g} KV heads "
                          f"per TP rank (tp={p.tp}) and {a2a}: {e}")
        U = U if p.cp_strategy == "upipe" and requested != "auto" else None

    # context-parallel implementation (whether TransformerEngine is installed is machine.py's question)
    if p.cp_strategy in TE_CP_STRATEGIES and config.dist.backend == "gloo":
        errors.append(f"parallel.cp_strategy={p.cp_strategy} (TransformerEngine) needs CUDA and NCCL: set "
                      f"dist.backend=nccl/auto or cp_strategy=upipe/ulysses")
    if config.memory.upipe_overlap and p.cp_strategy != "upipe":
        errors.append(f"memory.upipe_overlap=true pipelines UPipe's head stages (Ulysses has one stage): set "
                      f"parallel.cp_strategy=upipe or memory.upipe_overlap=false (cp_strategy={p.cp_strategy})")
    if p.cp_ring > 1 and config.memory.upipe_overlap:
        errors.append(f"memory.upipe_overlap=true is not implemented with parallel.cp_ring={p.cp_ring} (the ring's "
                      f"stages run serially): set memory.upipe_overlap=false or parallel.cp_ring=1")
    if p.cp_ring == 1 and config.memory.ring_overlap:
        errors.append("memory.ring_overlap=true overlaps the ring's P2P passes of hybrid a2a x ring: set "
                      "parallel.cp_ring > 1 or memory.ring_overlap=false")
    if p.cp_ring > 1 and d.document_mask:
        errors.append(f"data.document_mask=true is not implemented with parallel.cp_ring={p.cp_ring} (ring attention "
                      f"is causal over one whole sequence): set data.document_mask=false or parallel.cp_ring=1")
    if config.memory.attention_grad_accum != "fp32" and p.cp_strategy not in ("ulysses", "upipe"):
        errors.append(f"memory.attention_grad_accum={config.memory.attention_grad_accum} applies to the UPipe/Ulysses "
                      f"attention op only: set parallel.cp_strategy=upipe/ulysses or memory.attention_grad_accum=fp32")
    kernel = config.model.attention_kernel
    if kernel != "auto" and p.cp_strategy not in ("ulysses", "upipe"):
        errors.append(f"model.attention_kernel={kernel} applies to parallel.cp_strategy upipe/ulysses only "
                      f"(megatron-core's attention picks its own kernel): set model.attention_kernel=auto")
    elif kernel not in ("auto", "cpu_flash") and config.dist.backend == "gloo":
        errors.append(f"model.attention_kernel={kernel} is a CUDA kernel but dist.backend=gloo runs on CPU: set "
                      f"model.attention_kernel=auto or cpu_flash")
    elif kernel == "cpu_flash" and config.dist.backend == "nccl":
        errors.append("model.attention_kernel=cpu_flash runs on CPU but dist.backend=nccl runs on GPUs: set "
                      "model.attention_kernel=auto or a CUDA kernel")

    # sequence length vs cp (and tp under sequence parallel)
    multiple = _seq_multiple(config)
    if t.seq_length % multiple:
        why = ("2·cp zigzag chunks" if p.cp_strategy in TE_CP_STRATEGIES else
               "2·cp: two zigzag chunks per ring rank, split over the all-to-all group" if p.cp_ring > 1 else "cp")
        why += ", times tp under sequence parallel" if p.sequence_parallel else ""
        errors.append(f"train.seq_length={t.seq_length} must be a multiple of {multiple} ({why}): e.g. "
                      f"{max(multiple, t.seq_length // multiple * multiple)}")

    # batch sizes
    gbs, n_micro = t.global_batch_size, 0
    if dp:
        per_step = t.micro_batch_size * dp
        gbs = gbs if gbs is not None else per_step
        if gbs % per_step:
            errors.append(f"train.global_batch_size={gbs} is not a multiple of train.micro_batch_size·dp = "
                          f"{t.micro_batch_size}·{dp} = {per_step}: use a multiple of {per_step}")
        n_micro = gbs // per_step

    # pipeline
    if arch.num_layers % p.pp:
        errors.append(f"parallel.pp={p.pp} must divide model.num_layers={arch.num_layers} (equal stages): choose "
                      f"pp from {[k for k in range(1, arch.num_layers + 1) if arch.num_layers % k == 0]}")
    elif p.pp > 1 and 0 < n_micro < p.pp:
        warnings.append(f"parallel.pp={p.pp} with only {n_micro} micro-batch(es) per step leaves the pipeline "
                        f"mostly idle: raise train.global_batch_size")

    # vocabulary and data
    vocab = m.vocab_size if m.vocab_size is not None else (None if d.tokenizer else arch.vocab_size)
    if vocab is None and d.tokenizer is None:
        errors.append(f"the vocabulary size is unknown: model.preset={m.preset} has none and data.tokenizer is "
                      f"null; set model.vocab_size or data.tokenizer")
    if d.path != "mock" and d.tokenizer is None:
        errors.append(f"data.path={d.path} is a tokenized dataset: set data.tokenizer to the tokenizer that made it")
    if t.eval_interval > 0 and d.path != "mock" and d.split[1] == 0:
        errors.append(f"train.eval_interval={t.eval_interval} but data.split={d.split} leaves no validation data: "
                      f"give the second weight a share, or set train.eval_interval=0")

    if d.document_mask and p.cp_strategy not in ("ulysses", "upipe"):
        errors.append(f"data.document_mask=true is implemented in the UPipe/Ulysses attention op: set "
                      f"parallel.cp_strategy=upipe (also at cp=1) or ulysses, not {p.cp_strategy}")
    if d.document_mask and t.micro_batch_size != 1:
        errors.append(f"data.document_mask=true packs one sample per micro-batch (its document boundaries are one "
                      f"cu_seqlens, as megatron's THD format): set train.micro_batch_size=1 (got "
                      f"{t.micro_batch_size}) and raise train.global_batch_size for more samples per step")

    # fully sharded model states (memory_stack.sharding)
    if config.memory.fsdp_grads_dtype == "bf16" and not config.memory.shard_model_states:
        errors.append("memory.fsdp_grads_dtype=bf16 sets Megatron-FSDP's gradient dtype, but "
                      "memory.shard_model_states=false: set memory.shard_model_states=true or "
                      "memory.fsdp_grads_dtype=fp32")
    if config.memory.fsdp_grads_dtype == "bf16" and t.bf16 is False:
        errors.append("memory.fsdp_grads_dtype=bf16 would round the gradients of float32 training (train.bf16=false): "
                      "set train.bf16=true or memory.fsdp_grads_dtype=fp32")
    if config.memory.shard_model_states:
        if arch.tie_embeddings and config.memory.fsdp_embedding_unit:
            errors.append("tied embeddings (model.tie_embeddings or the preset) with memory.fsdp_embedding_unit=true: the embedding's own "
                          "Megatron-FSDP unit is released after its forward, but the tied LM head needs its weight "
                          "again at the end: set memory.fsdp_embedding_unit=false (one group of embedding, LM head "
                          "and final norm, gathered for the whole step)")
        if p.pp > 1:
            errors.append(f"memory.shard_model_states=true is not combined with parallel.pp={p.pp} (untested): set "
                          f"parallel.pp=1 or memory.shard_model_states=false")
        if dp and dp * p.cp == 1:
            warnings.append("memory.shard_model_states=true with dp·cp = 1: there is nothing to shard over")
        # Checkpoints are saved per rank ("fsdp_per_rank", training/checkpointing.py) and load only into the same
        # tp/pp/cp/dp layout: checked when a checkpoint is loaded, against the layout it recorded.

    # schedule, checkpoints
    if t.warmup_steps is not None and t.warmup_fraction:
        warnings.append(f"train.warmup_steps={t.warmup_steps} is used; train.warmup_fraction={t.warmup_fraction} "
                        f"applies only when train.warmup_steps=null")
    if config.checkpoint.interval > t.steps:
        warnings.append(f"checkpoint.interval={config.checkpoint.interval} > train.steps={t.steps}: no periodic "
                        f"checkpoint will be written")

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
