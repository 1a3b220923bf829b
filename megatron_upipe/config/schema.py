"""The typed configuration tree of pretrain_llama.py: one frozen dataclass per section.

Precedence: these defaults < the YAML file < `section.key=value` command-line overrides (see loader.py).
Each section checks its own fields in `__post_init__` (types, ranges, choices, rules inside the section) and
never rewrites what the user asked for; values that follow from several sections and the world size (dp, the
resolved UPipe stage size, the number of micro-batches, ...) are derived in validate.py into a separate `Plan`.
This module imports neither torch nor megatron-core.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_type_hints

from megatron_upipe.models.presets import PRESETS, LlamaArch, RopeScaling, get_preset

from .fieldtypes import ConfigError, coerce, matches, type_name

CpStrategy = Literal["none", "ulysses", "upipe", "p2p", "a2a", "a2a+p2p"]
TE_CP_STRATEGIES = ("p2p", "a2a", "a2a+p2p")  # megatron-core's cp_comm_type values, implemented inside TE


def _check_types(obj: object) -> None:
    """Every field has its annotated type (an int is accepted for a float); raise all mismatches at once."""
    name = obj.section  # type: ignore[attr-defined]
    hints = get_type_hints(type(obj))
    problems = []
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if not matches(value, hints[f.name]):
            try:  # reuse the loader's message (with its did-you-mean hint)
                coerce(value, hints[f.name], f"{name}.{f.name}")
                problems.append(f"{name}.{f.name}={value!r}: expected {type_name(hints[f.name])}")
            except ConfigError as e:
                problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))


def _refuse(rules: list[tuple[bool, str]]) -> None:
    """Raise one ConfigError with the message of every (bad, message) rule that is bad."""
    problems = [msg for bad, msg in rules if bad]
    if problems:
        raise ConfigError("\n".join(problems))


def _positive(obj: object, *names: str) -> list[tuple[bool, str]]:
    sec = obj.section  # type: ignore[attr-defined]
    return [
        (isinstance(v, (int, float)) and v <= 0, f"{sec}.{n}={v} must be positive")
        for n in names
        for v in [getattr(obj, n)]
        if v is not None
    ]


@dataclass(frozen=True)
class ModelConfig:
    section: ClassVar[str] = "model"
    preset: str = "tiny"  # a name from megatron_upipe.models.presets
    # Overrides of the preset's shape; null = the preset's value.
    num_layers: int | None = None  # transformer layers L
    hidden_size: int | None = None  # model width D
    num_attention_heads: int | None = None  # query heads H
    num_query_groups: int | None = None  # KV heads
    ffn_hidden_size: int | None = None  # SwiGLU MLP inner size
    kv_channels: int | None = None  # head dim
    rotary_base: float | None = None  # RoPE theta (e.g. raised for a long-context extension)
    norm_epsilon: float | None = None  # RMSNorm epsilon
    max_position_embeddings: int | None = None  # megatron-core's max_sequence_length of the model
    qkv_bias: bool | None = None  # biases on the q, k, v projections (Qwen2/2.5); null = the preset's
    qk_norm: bool | None = None  # RMSNorm of every q and k head before RoPE (Qwen3); null = the preset's
    tie_embeddings: bool | None = None  # LM head = input embedding (Llama 3.2 1B/3B); null = the preset's
    # RoPE scaling: preset (the preset's, with the rope_* fields below changing it), none, or linear | llama3 |
    # yarn built from the rope_* fields (models/rope_scaling.py). dynamic (NTK, inference-only) is refused.
    rope_scaling: Literal["preset", "none", "linear", "llama3", "yarn", "dynamic"] = "preset"
    rope_scaling_factor: float | None = None  # context extension factor of the scaling
    rope_original_max_position_embeddings: int | None = None  # llama3/yarn: the pretraining context length
    rope_low_freq_factor: float | None = None  # llama3 (default 1)
    rope_high_freq_factor: float | None = None  # llama3 (default 4)
    rope_beta_fast: float | None = None  # yarn (default 32)
    rope_beta_slow: float | None = None  # yarn (default 1)
    rope_attention_factor: float | None = None  # yarn's cos/sin factor; null = 0.1·ln(factor) + 1
    vocab_size: int | None = None  # null = the tokenizer's (else the preset's)
    make_vocab_size_divisible_by: int = 128  # the embedding is padded to a multiple of this x tp
    init_method_std: float = 0.02  # std of the normal weight initialisation
    # Local attention kernel: auto, or a name from megatron_upipe/attention/kernels.py KERNELS.
    attention_kernel: Literal["auto", "flash_attn", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "te_fused",
                              "cpu_flash"] = "auto"

    OVERRIDES: ClassVar[tuple[str, ...]] = (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
        "kv_channels", "rotary_base", "norm_epsilon", "max_position_embeddings", "qkv_bias", "qk_norm",
        "tie_embeddings",
    )
    # model.rope_<x> -> RopeScaling field <x>
    ROPE_FIELDS: ClassVar[dict[str, str]] = {
        "rope_scaling_factor": "factor", "rope_original_max_position_embeddings": "original_max_position_embeddings",
        "rope_low_freq_factor": "low_freq_factor", "rope_high_freq_factor": "high_freq_factor",
        "rope_beta_fast": "beta_fast", "rope_beta_slow": "beta_slow", "rope_attention_factor": "attention_factor",
    }

    def __post_init__(self) -> None:
        _check_types(self)
        _refuse([
            (self.preset not in PRESETS, f"model.preset={self.preset!r} is unknown; choose one of {sorted(PRESETS)}"),
            *_positive(self, *self.OVERRIDES, *self.ROPE_FIELDS, "vocab_size", "make_vocab_size_divisible_by",
                       "init_method_std"),
        ])
        self.arch()  # the overridden shape must be a consistent Llama block

    def _rope_scaling(self, preset: RopeScaling | None) -> RopeScaling | None:
        given = {f: getattr(self, k) for k, f in self.ROPE_FIELDS.items() if getattr(self, k) is not None}
        if self.rope_scaling == "dynamic":
            raise ConfigError("model.rope_scaling=dynamic: dynamic NTK scaling changes RoPE with the length at "
                              "inference time and is not trained; for long-context training use llama3, yarn or "
                              "linear (or raise model.rotary_base)")
        if self.rope_scaling == "none":
            if given:
                names = ", ".join("model." + k for k in self.ROPE_FIELDS if getattr(self, k) is not None)
                raise ConfigError(f"model.rope_scaling=none but {names} set: remove them or choose a scaling")
            return None
        if self.rope_scaling == "preset":
            if preset is None:
                if given:
                    raise ConfigError(f"model.preset={self.preset!r} has no RoPE scaling to change: set "
                                      f"model.rope_scaling to linear, llama3 or yarn")
                return None
            return dataclasses.replace(preset, **given)
        base = preset if preset is not None and preset.kind == self.rope_scaling else None
        if base is not None:
            return dataclasses.replace(base, **given)
        if "factor" not in given:
            raise ConfigError(f"model.rope_scaling={self.rope_scaling} needs model.rope_scaling_factor")
        factor = given.pop("factor")
        try:
            return RopeScaling(self.rope_scaling, factor, **given)
        except ValueError as e:
            raise ConfigError(f"model.rope_scaling={self.rope_scaling}: {e} (the model.rope_* fields)") from None

    def arch(self) -> LlamaArch:
        """The preset with this section's overrides applied (vocab_size stays the preset's; see Plan.vocab)."""
        changes = {k: getattr(self, k) for k in self.OVERRIDES if getattr(self, k) is not None}
        try:
            preset = get_preset(self.preset)
            changes["rope_scaling"] = self._rope_scaling(preset.rope_scaling)
            return preset.replace(**changes)
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"model (preset {self.preset!r} with overrides {changes}): {e}") from None


@dataclass(frozen=True)
class ParallelConfig:
    section: ClassVar[str] = "parallel"
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    cp: int = 1  # context parallel
    dp: int | None = None  # data parallel; null = world_size / (tp*pp*cp), else it must equal that
    # none | ulysses | upipe | TE's p2p, a2a, a2a+p2p. Allowed with cp=1 (one code path for cp sweeps; UPipe's
    # head stages still cut attention memory there).
    cp_strategy: CpStrategy = "none"
    # U: heads per stage, counted over the cp ranks, out of the heads local to one TP rank. auto = at start-up the
    # memory planner picks the fastest legal U whose plan fits the device (memory.plan_gpu) and the host at
    # train.seq_length (with serial stages the largest that fits), and prints its choice and why. null (default):
    # the training job does the same as auto, except that with nothing to plan against (memory.plan_gpu=local on a
    # machine without a GPU) it takes the smallest legal U and says so; the planner and library callers read null
    # as the smallest legal U.
    upipe_heads_per_stage: int | Literal["auto"] | None = None
    sequence_parallel: bool = False  # megatron sequence parallelism inside the TP group (needs tp > 1)
    # R, hybrid context parallelism: cp = A x R. Each UPipe/Ulysses all-to-all runs inside a group of A = cp/cp_ring
    # consecutive CP ranks (keep tp·A GPUs inside one node), and each stage's attention is a causal ring over the
    # R groups (zigzag token layout). 1 = one all-to-all group of cp ranks. U is then counted over the A ranks.
    cp_ring: int = 1

    def __post_init__(self) -> None:
        _check_types(self)
        _refuse([
            *_positive(self, "tp", "pp", "cp", "dp", "upipe_heads_per_stage", "cp_ring"),
            (self.cp_ring > 1 and self.cp % self.cp_ring != 0,
             f"parallel.cp_ring={self.cp_ring} must divide parallel.cp={self.cp} (cp = all-to-all size x ring size): "
             f"e.g. parallel.cp={self.cp_ring * max(1, self.cp // self.cp_ring)}"),
            (self.cp_ring > 1 and self.cp_strategy not in ("ulysses", "upipe"),
             f"parallel.cp_ring={self.cp_ring} runs a ring over UPipe/Ulysses all-to-all groups: set "
             f"parallel.cp_strategy=upipe (or ulysses), or parallel.cp_ring=1 (got cp_strategy={self.cp_strategy})"),
            (self.cp > 1 and self.cp_strategy == "none",
             f"parallel.cp={self.cp} needs a context-parallel algorithm: set parallel.cp_strategy to upipe "
             f"(or ulysses, p2p, a2a, a2a+p2p), or parallel.cp=1"),
            (self.upipe_heads_per_stage is not None and self.cp_strategy != "upipe",
             f"parallel.upipe_heads_per_stage={self.upipe_heads_per_stage} is only used by "
             f"parallel.cp_strategy=upipe (got {self.cp_strategy}): remove it or set cp_strategy=upipe"),
            # Refused rather than silently switched off (megatron-LM's habit): tp=1 has nothing to shard.
            (self.sequence_parallel and self.tp == 1,
             "parallel.sequence_parallel=true needs parallel.tp > 1 (it shards activations over the TP group): "
             "set parallel.sequence_parallel=false or parallel.tp > 1"),
        ])

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def cp_a2a(self) -> int:
        """A: the UPipe/Ulysses all-to-all group size (cp = A x cp_ring)."""
        return self.cp // self.cp_ring  # __post_init__ refuses a cp_ring that does not divide cp


@dataclass(frozen=True)
class TrainConfig:
    section: ClassVar[str] = "train"
    seq_length: int = 4096  # global tokens per sequence (before the cp split)
    micro_batch_size: int = 1  # sequences per forward/backward on one DP rank
    global_batch_size: int | None = None  # null = micro_batch_size x dp (no gradient accumulation)
    steps: int = 1000  # optimizer steps of the whole run (a resumed run continues to it)
    lr: float = 3.0e-4  # peak learning rate (after warmup)
    min_lr: float = 3.0e-5  # learning rate at the end of the decay
    warmup_steps: int | None = None  # LR warmup in optimizer steps; null = train.warmup_fraction of the decay horizon
    warmup_fraction: float = 0.0  # used when warmup_steps is null: floor(fraction x decay horizon), in [0, 1)
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"  # from lr to min_lr after the warmup
    lr_decay_steps: int | None = None  # null = steps
    weight_decay: float = 0.1  # Adam weight decay (decoupled, as AdamW)
    adam_beta1: float = 0.9  # Adam first-moment decay
    adam_beta2: float = 0.95  # Adam second-moment decay
    adam_eps: float = 1.0e-8  # Adam denominator epsilon
    clip_grad: float = 1.0  # max global grad norm; 0 = no clipping
    bf16: bool | Literal["auto"] = "auto"  # auto = bf16 where the device supports it, else fp32
    seed: int = 1234  # random seed of the weight initialisation and of the data order
    eval_interval: int = 1000  # steps between evaluations; 0 = never
    eval_iters: int = 10  # global batches of the validation split per evaluation
    nan_policy: Literal["stop", "skip"] = "stop"  # on a non-finite loss/grad: stop the run or skip the step
    distributed_optimizer: bool = False  # shard optimizer state over dp x cp (ZeRO-1)
    # Save and stop (exit 5) before a step that would end after this many minutes since training started (Megatron-LM's
    # --exit-duration-in-mins); under Slurm the job's end time is honoured too (training/deadline.py). null = none.
    exit_duration_mins: float | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        decay = self.decay_steps
        _refuse([
            *_positive(self, "seq_length", "micro_batch_size", "global_batch_size", "steps", "lr", "lr_decay_steps",
                       "adam_eps", "eval_iters", "exit_duration_mins"),
            (self.seed < 0, f"train.seed={self.seed} must be >= 0"),
            (not 0 <= self.min_lr <= self.lr,
             f"train.min_lr={self.min_lr} must be in [0, train.lr={self.lr}]: lower train.min_lr"),
            (self.warmup_steps is not None and self.warmup_steps < 0,
             f"train.warmup_steps={self.warmup_steps} must be >= 0"),
            (self.warmup_steps is not None and self.warmup_steps >= decay > 0,
             f"train.warmup_steps={self.warmup_steps} must be below the decay horizon {decay} (train.lr_decay_steps, "
             f"else train.steps): lower it, or set train.warmup_steps=null and train.warmup_fraction (e.g. 0.1)"),
            (not 0 <= self.warmup_fraction < 1,
             f"train.warmup_fraction={self.warmup_fraction} must be in [0, 1) (a share of the decay horizon)"),
            (self.weight_decay < 0, f"train.weight_decay={self.weight_decay} must be >= 0"),
            (not 0 <= self.adam_beta1 < 1, f"train.adam_beta1={self.adam_beta1} must be in [0, 1)"),
            (not 0 <= self.adam_beta2 < 1, f"train.adam_beta2={self.adam_beta2} must be in [0, 1)"),
            (self.clip_grad < 0, f"train.clip_grad={self.clip_grad} must be >= 0 (0 = no clipping)"),
            (self.eval_interval < 0, f"train.eval_interval={self.eval_interval} must be >= 0 (0 = never)"),
        ])

    @property
    def decay_steps(self) -> int:
        return self.lr_decay_steps if self.lr_decay_steps is not None else self.steps

    @property
    def lr_warmup_steps(self) -> int:
        """Optimizer steps of linear warmup: train.warmup_steps, else floor(train.warmup_fraction x decay_steps)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return min(math.floor(self.warmup_fraction * self.decay_steps + 1e-9), self.decay_steps - 1)


@dataclass(frozen=True)
class DataConfig:
    section: ClassVar[str] = "data"
    path: str = "mock"  # preprocessed dataset prefix (<path>.bin/.idx), or mock for synthetic tokens
    # A sentencepiece .model, an HF tokenizer.json or a directory holding one; null only with mock data.
    tokenizer: str | None = None
    split: list[float] = field(default_factory=lambda: [969.0, 30.0, 1.0])  # train, valid, test weights
    num_workers: int = 2  # DataLoader worker processes per rank (0 = load in the training process)
    # Packed documents attend only to themselves: position ids restart after every end-of-document token
    # (megatron's reset_position_ids) and each sample's document boundaries (cu_seqlens) reach every UPipe/Ulysses
    # layer, whose attention is causal inside each document (megatron_upipe/data/packing.py). Needs
    # parallel.cp_strategy upipe or ulysses and train.micro_batch_size=1.
    document_mask: bool = False
    eod_mask_loss: bool = False  # no loss on the end-of-document token's position (megatron's eod_mask_loss)

    def __post_init__(self) -> None:
        _check_types(self)
        _refuse([
            (self.path == "", "data.path is empty: give a preprocessed dataset prefix or mock"),
            (len(self.split) != 3 or any(w < 0 for w in self.split) or sum(self.split) <= 0,
             f"data.split={self.split} must be three non-negative weights (train, valid, test), not all zero"),
            (self.num_workers < 0, f"data.num_workers={self.num_workers} must be >= 0"),
        ])


@dataclass(frozen=True)
class CheckpointConfig:
    section: ClassVar[str] = "checkpoint"
    dir: str | None = None  # where checkpoints are saved (and resumed from)
    interval: int = 0  # steps between periodic saves; 0 = none (the end-of-run save is save_final)
    # With checkpoint.dir: save when the run reaches train.steps (unless that step was just saved). Never saving at
    # all: interval=0, save_final=false, save_on_signal=false (or checkpoint.dir=null).
    save_final: bool = True
    # With checkpoint.dir: on SIGTERM, SIGUSR1 (pre-emption, Slurm's --signal=USR1@<seconds>) or Ctrl-C finish the
    # step, save, and exit with code 5 (training/signals.py). false: the signals keep their default action.
    save_on_signal: bool = True
    load: str | None = None  # initialise from this checkpoint when not resuming
    resume: bool | Literal["auto"] = "auto"  # auto = resume from dir if it holds a checkpoint; true = must
    # With resume=false: a checkpoint.dir that already holds checkpoints is refused at start-up unless this is true;
    # then the old checkpoints are removed once the new run has published its first one.
    overwrite: bool = False
    keep_last: int | None = None  # keep only the newest N checkpoints; null = keep all
    # The LR schedule (lr, min_lr, warmup, decay steps and style) after loading a checkpoint: "checkpoint" keeps the
    # one saved in it (Megatron-LM's --use-checkpoint-opt_param-scheduler), "config" takes this config's
    # (--override-opt_param-scheduler), e.g. to decay over a raised train.steps. The run logs which is in effect.
    scheduler: Literal["checkpoint", "config"] = "checkpoint"
    # Resuming from checkpoint.dir, each checkpoint is checked against the sizes and CRC-32s its manifest recorded at
    # save, before any tensor is read. A mismatch (or a `latest` that names nothing): "fallback" resumes from the
    # newest intact checkpoint instead, with a warning line naming the skipped one and why; "stop" refuses to start
    # (exit 2), naming the corrupt file. A checkpoint saved before manifests loads unverified.
    on_corrupt: Literal["fallback", "stop"] = "fallback"
    # A save that fails (less free space than the checkpoint needs, or the writer fails, e.g. the disk fills up):
    # nothing is published, the partial save is removed and `latest` keeps naming the previous checkpoint; "stop"
    # then ends the run (exit 6), "continue" logs one warning line and trains on, trying again at the next
    # checkpoint.interval. A failed final save, or save on a stop signal, always ends the run (exit 6).
    on_save_error: Literal["stop", "continue"] = "stop"

    def __post_init__(self) -> None:
        _check_types(self)
        _refuse([
            (self.interval < 0, f"checkpoint.interval={self.interval} must be >= 0 (0 = no periodic saves)"),
            (self.interval > 0 and self.dir is None,
             f"checkpoint.interval={self.interval} saves checkpoints but checkpoint.dir is null: set checkpoint.dir"),
            (self.resume is True and self.dir is None, "checkpoint.resume=true needs checkpoint.dir"),
            *_positive(self, "keep_last"),
        ])


@dataclass(frozen=True)
class LogConfig:
    section: ClassVar[str] = "log"
    interval: int = 10  # steps between log lines
    metrics_file: str | None = None  # JSON lines, one record per step and per evaluation (rank 0); null = none
    tensorboard_dir: str | None = None  # tensorboard event files (rank 0); null = none
    wandb: bool = False  # log to Weights & Biases (pip install -e .[wandb])
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"  # offline: files only, next to log.metrics_file
    wandb_project: str = "megatron_upipe"  # wandb project name
    wandb_run_name: str | None = None  # null = wandb picks one

    def __post_init__(self) -> None:
        _check_types(self)
        _refuse(_positive(self, "interval"))


@dataclass(frozen=True)
class DistConfig:
    section: ClassVar[str] = "dist"
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto = nccl with CUDA, else gloo
    timeout_s: int = 600  # collective timeout: a failed or hung rank ends the job after this long

    def __post_init__(self) -> None:
        _check_types(self)
        _refuse(_positive(self, "timeout_s"))


@dataclass(frozen=True)
class MemoryConfig:
    section: ClassVar[str] = "memory"
    recompute: Literal["none", "selective", "full"] = "none"  # megatron-core activation recompute granularity
    # With recompute=full: recompute only the first N transformer layers of each pipeline stage (megatron-core's
    # "block" method, one layer per checkpoint); the others keep their activations: faster, more memory. With
    # offload_checkpoints only those N inputs go to the host. null = every layer.
    recompute_layers: int | None = None
    expandable_segments: bool = True  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA init)
    # Sequence tiles of every layer's SwiGLU MLP, each tile's fc1/SwiGLU recomputed in backward, so no [s, b, ffn]
    # tensor is alive whole; any sequence length works (tiles differ by at most one token). 1 = off.
    mlp_chunks: int = 1
    # Sequence chunks of the LM head + vocab-parallel cross-entropy (logits recomputed per chunk in backward, the
    # [s, b, vocab/tp] logits never exist). 1 = off.
    loss_chunks: int = 1
    # With mlp_chunks > 1: the tiled pre-MLP norm hands the layer its residual and, in backward, adds its input
    # gradient into the residual path's gradient tile by tile, instead of autograd summing two [s/cp, b, D] tensors
    # (models/tiled_norm.py). Bit-identical; one [s/cp, b, D] tensor less in each layer's backward.
    residual_grad_in_place: bool = False
    # Keep each checkpointed layer input (the one tensor full recompute saves per layer) in host memory until that
    # layer's backward: pinned memory on CUDA, copied on a side stream (megatron_upipe.memory_switches). Needs
    # recompute=full.
    offload_checkpoints: bool = False
    # With offload_checkpoints: start copying layer i-1's input back to the device when layer i's backward begins (a
    # side stream on CUDA), so the copy overlaps layer i's recompute and backward instead of delaying layer i-1's.
    # Same results bit for bit; costs one more layer input [s/cp, b, D] on the device during the backward, which the
    # memory planner counts (6 GiB per GPU for Llama3-8B at 6M tokens on 8) and the step-time model prices.
    offload_prefetch: bool = False
    # With offload_checkpoints: the first N checkpointed layer inputs of each forward (the ones kept longest) go to
    # files under offload_disk_dir instead of host memory (a local NVMe volume, e.g. /raid on a DGX), read back at
    # their layer's backward (prefetched with offload_prefetch); the host pool shrinks by N layer inputs. Same
    # results bit for bit. The start-up check needs N layer inputs of free space there; the step-time model prices
    # the writes and reads on the critical path. 0 = off.
    offload_disk_layers: int = 0
    # The directory of that disk tier (each copy an unlinked temporary file: nothing is left when the job ends).
    offload_disk_dir: str | None = None
    # UPipe/Ulysses backward accumulates dx over head stages and dK/dV over a KV round in float32 ("fp32": one
    # rounding at the end, as one fused projection GEMM would) or in the activations' 16-bit dtype ("input": the two
    # largest attention-backward buffers at half size, one rounding per stage).
    attention_grad_accum: Literal["fp32", "input"] = "fp32"
    # UPipe's head stages pipelined, the same results bit for bit either way. true: while one stage's attention
    # kernel runs, the next stage's projections are in asynchronous all-to-alls and the previous stage's result
    # drains (forward and backward); costs the next stage's buffers in flight (send + receive). "outputs": only each
    # stage's result all-to-all (output, dq) drains, behind the next stage's projections and input all-to-alls;
    # costs one stage's result in flight ([s/cp, b, U, d] send + receive). The memory planner counts both, the
    # step-time model prices both (planner/step_time.py). false: stage after stage.
    upipe_overlap: bool | Literal["outputs"] = False
    # Hybrid a2a x ring (parallel.cp_ring > 1): the ring's P2P passes (the next K/V; in backward also the last step's
    # dK/dV) run while its blocks compute, instead of between steps. Same results bit for bit; costs whole receive
    # buffers instead of 256 MiB pieces (one more K/V copy in forward, one more K/V and float32 dK/dV copy in
    # backward, per stage), which the memory planner counts.
    ring_overlap: bool = False
    # The device a start-up plan checks against (parallel.upipe_heads_per_stage=auto): "local" (this GPU's reported
    # total; not on a machine without one), a planner GPU name (h100-80gb, h200, a100-80gb, ...) or usable GiB.
    plan_gpu: str | float = "local"
    # ZeRO-3: parameters, fp32 main parameters, gradients and Adam states sharded over the dp x cp ranks
    # (Megatron-FSDP; layers all-gathered just in time). Implies the sharded optimizer (train.distributed_optimizer
    # need not be set). Checkpoints are then saved per rank ("fsdp_per_rank") and resume only in the same tp/pp/cp/dp.
    shard_model_states: bool = False
    # Megatron-FSDP's unsharded buffers with shard_model_states. "layer": its communication unit just under one
    # transformer layer, so one finished layer's fp32 gradient bucket waits for its reduce-scatter while the next
    # fills, and one layer's weights are prefetched. "megatron": megatron-core's default, which queues finished
    # buckets up to max(1e9 elements, 2 layers) and prefetches 5e8 elements (several 8B layers of each).
    fsdp_communication_unit: Literal["layer", "megatron"] = "layer"
    # The embedding as a Megatron-FSDP unit of its own (all-gathered for its forward and backward only). false:
    # megatron-core's default, one group of embedding + LM head + final norm, gathered for the whole step, whose
    # fp32 gradient bucket lives from the LM head's backward to the embedding's. Changes the checkpoint's buffers.
    fsdp_embedding_unit: bool = True
    # With shard_model_states: Megatron-FSDP's gradient buffers (each layer's unsharded bucket, the reduce-scatter
    # and the gradient shard Adam reads) in float32 ("fp32": megatron-core's rule for bf16 training, the paper's
    # stack) or bfloat16 ("bf16": half their bytes, 3.8 GiB per GPU for the 32B dims on 16 GPUs; the reduce-scatter
    # sums in bf16, so each gradient element carries bf16 rounding before Adam, which still updates float32 main
    # weights). Needs bf16 training.
    fsdp_grads_dtype: Literal["fp32", "bf16"] = "fp32"
    # The optimizer's own tensors (Adam's two moments; the fp32 main weights in bf16 training) copied to host memory
    # when each step's forward/backward begins, their device storage freed, and copied back before the optimizer step
    # (memory_switches/optimizer_parking.py). The same results bit for bit; they leave the device peak and cost
    # their bytes in pinned host memory and two host copies a step, which the host check, the memory planner and
    # the step-time model count.
    offload_optimizer_states: bool = False
    # Log the memory planner's predicted peak beside the measured one: rank 0 runs tools/estimate_memory.py on the
    # resolved config at start-up (seconds on CPU, about a minute for an 8B model) and the run measures its second
    # step (torch.cuda.max_memory_allocated on GPU, the live-tensor tracker on CPU).
    plan_check: bool = False
    # Let the memory planner choose, at start-up, UPipe's U, pipelined stages and the memory switches above
    # (recompute, offload_checkpoints, offload_prefetch, mlp_chunks, loss_chunks, shard_model_states, upipe_overlap):
    # "fastest" = the fastest stack whose plan fits memory.plan_gpu at train.seq_length (tools/estimate_memory.py
    # --fastest), "longest" = the most frugal one (full recompute, offload, tiles, ZeRO-3, the smallest legal U:
    # what the long recipes set). Replaces those settings; logged with the predicted memory and time. "none": as set.
    auto: Literal["none", "fastest", "longest"] = "none"
    # Host RAM per node in GiB, checked at start-up against the planned host memory (offload pool, checkpoint staging,
    # stated margins; megatron_upipe/memory_switches/host_budget.py); it can lower, not raise, what the node gives at
    # start-up (the least of MemAvailable and the cgroup's room). null = what the node gives; the memory planner then
    # assumes 2010 (a DGX H100/H200 node's MemTotal, derived from its 2,048 GiB; host_budget.PLANNER_HOST_GIB).
    host_mem_gib: float | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        _refuse([
            *_positive(self, "mlp_chunks", "loss_chunks", "host_mem_gib", "recompute_layers"),
            (self.recompute_layers is not None and self.recompute != "full",
             f"memory.recompute_layers={self.recompute_layers} limits full recompute, but "
             f"memory.recompute={self.recompute}: set memory.recompute=full or memory.recompute_layers=null"),
            (self.offload_checkpoints and self.recompute != "full",
             f"memory.offload_checkpoints=true offloads the layer inputs that full recompute saves, but "
             f"memory.recompute={self.recompute}: set memory.recompute=full or memory.offload_checkpoints=false"),
            (self.residual_grad_in_place and self.mlp_chunks == 1,
             "memory.residual_grad_in_place=true works in the tiled pre-MLP norm, but memory.mlp_chunks=1: set "
             "memory.mlp_chunks > 1 (e.g. 8) or memory.residual_grad_in_place=false"),
            (self.offload_disk_layers < 0,
             f"memory.offload_disk_layers={self.offload_disk_layers} must be 0 (off) or positive"),
            (self.offload_disk_layers > 0 and not self.offload_checkpoints,
             f"memory.offload_disk_layers={self.offload_disk_layers} moves offloaded layer inputs to disk, but "
             "memory.offload_checkpoints=false: set memory.offload_checkpoints=true or memory.offload_disk_layers=0"),
            (self.offload_disk_layers > 0 and self.offload_disk_dir is None,
             f"memory.offload_disk_layers={self.offload_disk_layers} needs memory.offload_disk_dir: set it to a "
             "directory on a local disk (e.g. /raid/upipe) or memory.offload_disk_layers=0"),
            (self.offload_prefetch and not self.offload_checkpoints,
             "memory.offload_prefetch=true prefetches offloaded layer inputs, but memory.offload_checkpoints=false: "
             "set memory.offload_checkpoints=true or memory.offload_prefetch=false"),
        ])


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]
