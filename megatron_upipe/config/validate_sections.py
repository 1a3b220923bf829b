"""validate.py's cross-field checks, one function per concern, in the order `validate` calls them.

Each appends its problems (each naming the setting(s) and the fix) to `errors`, and its advice to `warnings`, in
a fixed order, and returns what it derives for the Plan. None of them changes the Config. Like validate.py, this
module imports no torch: `resolve_heads_per_stage` asks the attention package's schedule (pure Python) lazily.
"""

from __future__ import annotations

import math

from megatron_upipe.models.presets import LlamaArch

from .fieldtypes import show
from .schema import TE_CP_STRATEGIES, Config


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


def check_world(config: Config, world_size: int, errors: list[str]) -> int:
    """world size = dp · tp · pp · cp: dp (0 when the world size does not divide)."""
    p = config.parallel
    if world_size % p.model_parallel_size:
        errors.append(f"world size {world_size} is not divisible by parallel.tp·pp·cp = {p.tp}·{p.pp}·{p.cp} = "
                      f"{p.model_parallel_size}: change tp/pp/cp or the number of processes")
        return 0
    dp = world_size // p.model_parallel_size
    if p.dp is not None and p.dp != dp:
        errors.append(f"parallel.dp={p.dp} but world size {world_size} / (tp·pp·cp = {p.model_parallel_size}) "
                      f"= {dp}: set parallel.dp={dp} or null (derived), or change the world size")
    return dp


def check_heads(config: Config, arch: LlamaArch, errors: list[str]) -> tuple[int, int, int | None]:
    """Heads vs tp and cp: (query heads per TP rank, KV heads per TP rank, UPipe U or None)."""
    p = config.parallel
    H, G = arch.num_attention_heads, arch.num_query_groups
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
    return local_h, local_g, U


def check_cp_strategy(config: Config, errors: list[str]) -> None:
    """The context-parallel implementation and the memory/model options that only some of them have (whether
    TransformerEngine is installed is machine.py's question)."""
    p, d = config.parallel, config.data
    if p.cp_strategy in TE_CP_STRATEGIES and config.dist.backend == "gloo":
        errors.append(f"parallel.cp_strategy={p.cp_strategy} (TransformerEngine) needs CUDA and NCCL: set "
                      f"dist.backend=nccl/auto or cp_strategy=upipe/ulysses")
    overlap = config.memory.upipe_overlap
    if overlap and p.cp_strategy != "upipe":
        errors.append(f"memory.upipe_overlap={show(overlap)} pipelines UPipe's head stages (Ulysses has one stage): "
                      f"set parallel.cp_strategy=upipe or memory.upipe_overlap=false (cp_strategy={p.cp_strategy})")
    if p.cp_ring > 1 and overlap:
        errors.append(f"memory.upipe_overlap={show(overlap)} is not implemented with parallel.cp_ring={p.cp_ring} "
                      f"(the ring's stages run serially): set memory.upipe_overlap=false or parallel.cp_ring=1")
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


def check_seq_length(config: Config, errors: list[str]) -> None:
    """Sequence length vs cp (and tp under sequence parallel)."""
    p, t = config.parallel, config.train
    multiple = _seq_multiple(config)
    if t.seq_length % multiple:
        why = ("2·cp zigzag chunks" if p.cp_strategy in TE_CP_STRATEGIES else
               "2·cp: two zigzag chunks per ring rank, split over the all-to-all group" if p.cp_ring > 1 else "cp")
        why += ", times tp under sequence parallel" if p.sequence_parallel else ""
        errors.append(f"train.seq_length={t.seq_length} must be a multiple of {multiple} ({why}): e.g. "
                      f"{max(multiple, t.seq_length // multiple * multiple)}")


def check_batch(config: Config, dp: int, errors: list[str]) -> tuple[int | None, int]:
    """Batch sizes (dp 0: not known): (global batch size, micro-batches per step; 0 when not known)."""
    t = config.train
    gbs, n_micro = t.global_batch_size, 0
    if dp:
        per_step = t.micro_batch_size * dp
        gbs = gbs if gbs is not None else per_step
        if gbs % per_step:
            errors.append(f"train.global_batch_size={gbs} is not a multiple of train.micro_batch_size·dp = "
                          f"{t.micro_batch_size}·{dp} = {per_step}: use a multiple of {per_step}")
        n_micro = gbs // per_step
    return gbs, n_micro


def check_pipeline(config: Config, arch: LlamaArch, n_micro: int, errors: list[str], warnings: list[str]) -> None:
    """Pipeline stages vs layers and micro-batches."""
    p = config.parallel
    if arch.num_layers % p.pp:
        errors.append(f"parallel.pp={p.pp} must divide model.num_layers={arch.num_layers} (equal stages): choose "
                      f"pp from {[k for k in range(1, arch.num_layers + 1) if arch.num_layers % k == 0]}")
    elif p.pp > 1 and 0 < n_micro < p.pp:
        warnings.append(f"parallel.pp={p.pp} with only {n_micro} micro-batch(es) per step leaves the pipeline "
                        f"mostly idle: raise train.global_batch_size")
    disk = config.memory.offload_disk_layers
    if disk and p.pp > 1:
        errors.append(f"memory.offload_disk_layers={disk} is planned for one pipeline stage (each forward's first "
                      f"layers go to disk while the pool is empty), but parallel.pp={p.pp}: set "
                      f"memory.offload_disk_layers=0 or parallel.pp=1")
    offloaded = min(arch.num_layers // p.pp, config.memory.recompute_layers or arch.num_layers)
    if disk > offloaded:
        errors.append(f"memory.offload_disk_layers={disk} exceeds the {offloaded} layer inputs a rank offloads: set "
                      f"it to {offloaded} or less")
    n = config.memory.recompute_layers
    if n is not None and not arch.num_layers % p.pp and n > arch.num_layers // p.pp:
        errors.append(f"memory.recompute_layers={n} exceeds the {arch.num_layers // p.pp} layers of a pipeline stage: "
                      f"give at most {arch.num_layers // p.pp}, or null for every layer")


def check_data(config: Config, arch: LlamaArch, errors: list[str]) -> int | None:
    """Vocabulary and data, packed documents: the vocabulary size (None: the tokenizer's)."""
    p, t, m, d = config.parallel, config.train, config.model, config.data
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
    return vocab


def check_sharding(config: Config, arch: LlamaArch, dp: int, errors: list[str], warnings: list[str]) -> None:
    """Fully sharded model states (memory_switches.sharding)."""
    p, t, mem = config.parallel, config.train, config.memory
    if mem.fsdp_grads_dtype == "bf16" and not mem.shard_model_states:
        errors.append("memory.fsdp_grads_dtype=bf16 sets Megatron-FSDP's gradient dtype, but "
                      "memory.shard_model_states=false: set memory.shard_model_states=true or "
                      "memory.fsdp_grads_dtype=fp32")
    if mem.fsdp_grads_dtype == "bf16" and t.bf16 is False:
        errors.append("memory.fsdp_grads_dtype=bf16 would round the gradients of float32 training (train.bf16=false): "
                      "set train.bf16=true or memory.fsdp_grads_dtype=fp32")
    if mem.shard_model_states:
        if arch.tie_embeddings and mem.fsdp_embedding_unit:
            errors.append("tied embeddings (model.tie_embeddings or the preset) with memory.fsdp_embedding_unit=true: "
                          "the embedding's own Megatron-FSDP unit is released after its forward, but the tied LM head needs its weight "
                          "again at the end: set memory.fsdp_embedding_unit=false (one group of embedding, LM head "
                          "and final norm, gathered for the whole step)")
        if p.pp > 1:
            errors.append(f"memory.shard_model_states=true is not combined with parallel.pp={p.pp} (untested): set "
                          f"parallel.pp=1 or memory.shard_model_states=false")
        if dp and dp * p.cp == 1:
            warnings.append("memory.shard_model_states=true with dp·cp = 1: there is nothing to shard over")
        # Checkpoints are saved per rank ("fsdp_per_rank", training/checkpointing.py) and load only into the same
        # tp/pp/cp/dp layout: checked when a checkpoint is loaded, against the layout it recorded.


def check_schedule(config: Config, warnings: list[str]) -> None:
    """The learning-rate schedule and checkpoint interval (warnings only)."""
    t = config.train
    if t.warmup_steps is not None and t.warmup_fraction:
        warnings.append(f"train.warmup_steps={t.warmup_steps} is used; train.warmup_fraction={t.warmup_fraction} "
                        f"applies only when train.warmup_steps=null")
    if config.checkpoint.interval > t.steps:
        warnings.append(f"checkpoint.interval={config.checkpoint.interval} > train.steps={t.steps}: no periodic "
                        f"checkpoint will be written")
