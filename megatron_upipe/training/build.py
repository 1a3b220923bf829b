"""Everything one run needs, built once and held in a `TrainState` that the loop and checkpointing share.

Order: tokenizer -> where the weights come from (checkpoint.dir's latest, else checkpoint.load) -> the host memory
check -> datasets and the training iterator (its DataLoader workers fork here, before anything is pinned: data.py)
-> model (this pipeline stage, the UPipe/Ulysses spec from parallel.cp_strategy; the offloader's pinned pool) ->
initial weights when checkpoint.load is a converted HF checkpoint or an HF directory -> DDP or Megatron-FSDP ->
optimizer and schedule -> resume from a training checkpoint -> metrics sinks.

checkpoint.load of a converted checkpoint (tools/convert_hf_llama.py hf-to-mcore) or of an HF directory loads
weights only, into the plain GPTModel right after it is built and before it is wrapped (so every layout and both
wrappers take them; dist_checkpointing reshards, an HF directory is converted per rank in memory); the optimizer and
LR schedule start fresh. Its model must match the run's model.* (RoPE fields excepted) and its vocabulary the run's,
checked before the model is allocated (megatron_upipe/checkpoint/sources.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_upipe.checkpoint.sources import CONVERTED, TRAINING, Source, classify_source, weights_mismatch
from megatron_upipe.config import Config, Plan
from megatron_upipe.data.tokenizers import Tokenizer
from megatron_upipe.memory_switches.host_budget import host_memory_refusal, offload_pool_bytes
from megatron_upipe.memory_switches.offload import HostOffloader
from megatron_upipe.memory_switches.optimizer_parking import ParkedStates, for_optimizer
from megatron_upipe.models.llama import LlamaStage, build_llama, llama_transformer_config
from megatron_upipe.models.presets import LlamaArch
from megatron_upipe.training import checkpointing
from megatron_upipe.training.checkpoint_guard import superseded_checkpoints
from megatron_upipe.training.data import (RunData, build_run_data, build_run_tokenizer, model_vocab_size,
                                          start_train_batches)
from megatron_upipe.training.metrics import MetricsLogger, NullLogger, model_flops_per_token
from megatron_upipe.training.optim import (UnsupportedOnThisMachine, build_optimizer, check_distributed_optimizer,
                                           wrap_model)
from megatron_upipe.training.setup import Groups


@dataclass
class TrainState:
    config: Config
    plan: Plan
    groups: Groups
    tokenizer: Tokenizer
    stage: LlamaStage
    ddp: object  # megatron-core DistributedDataParallel around this stage
    optimizer: object
    scheduler: object
    data: RunData
    logger: object = field(default_factory=NullLogger)
    step: int = 0  # optimizer steps done (skipped non-finite steps included)
    consumed_samples: int = 0  # over all DP ranks
    resumed_from: Path | None = None
    last_saved_step: int | None = None
    notes: list[str] = field(default_factory=list)  # start-up lines for the log (weights loaded, RoPE changed)
    # checkpoint.overwrite=true: the old run's checkpoints in checkpoint.dir, removed after this run's first save
    superseded: list[str] = field(default_factory=list)
    # memory.offload_optimizer_states: the optimizer's own storages, parked on the host during each forward/backward
    parked: ParkedStates | None = None

    @property
    def model(self):
        return self.stage.model

    @property
    def flops_per_token(self) -> float:
        return model_flops_per_token(self.plan.arch, self.plan.seq_length, self.stage.padded_vocab_size)

    def meta(self) -> dict:
        """What a checkpoint records about the run (see checkpointing.py)."""
        return {
            "step": self.step, "consumed_samples": self.consumed_samples,
            "model": {**dataclasses.asdict(self.plan.arch), "vocab_size": self.stage.vocab_size},
            "tokenizer": self.tokenizer.fingerprint().to_dict(),
            "layout": dataclasses.asdict(self.groups.layout),
            "config": dataclasses.asdict(self.config),
        }


def use_bf16(config: Config) -> bool:
    return torch.cuda.is_available() if config.train.bf16 == "auto" else bool(config.train.bf16)


def resume_source(config: Config) -> Source | None:
    """checkpoint.dir's latest checkpoint unless resume=false, else checkpoint.load (a training checkpoint, a
    converted HF checkpoint or an HF directory), else None (fresh start)."""
    c = config.checkpoint
    if c.dir is not None and c.resume is not False:
        found = checkpointing.resume_checkpoint(c.dir)  # every rank: verified, past corrupt checkpoints
        if found is not None:
            return Source(TRAINING, found)
        if c.resume is True:
            raise checkpointing.CheckpointError(f"checkpoint.resume=true but {c.dir} holds no complete checkpoint")
    if c.load is not None:
        return classify_source(c.load)
    return None


def check_initial_weights(source: Source, config: Config, vocab: int) -> str | None:
    """Refuse (CheckpointError) a converted/HF source whose model or vocabulary differs from the run's; returns the
    RoPE note, if any."""
    try:
        problem, note = weights_mismatch(source, config, vocab)
    except (OSError, ValueError) as e:
        raise checkpointing.CheckpointError(f"checkpoint.load={source.path}: {' '.join(str(e).split())}") from None
    if problem is not None:
        raise checkpointing.CheckpointError(problem)
    return note


def load_initial_weights(stage: LlamaStage, source: Source, pg) -> None:
    """A converted checkpoint (dist_checkpointing, resharded) or an HF directory (converted per rank) into this
    rank's unwrapped stage; every rank calls it."""
    if source.kind == CONVERTED:
        from megatron_upipe.checkpoint.mcore_io import load_mcore_checkpoint

        load_mcore_checkpoint(stage.model, source.path)
    else:
        from megatron_upipe.checkpoint.hf_import import load_hf_dir_into_stage

        load_hf_dir_into_stage(stage, source.path, pg)


def memory_switches(config: Config, plan: Plan, bf16: bool, offloader_cls=HostOffloader, pp_rank: int = 0) -> dict:
    """build_llama's keyword arguments for the memory.* switches (also the memory planner's, which passes a
    SimulatedHostOffloader). The offloader's host pool holds exactly the layer inputs of pipeline stage `pp_rank`
    alive at once (memory_switches/host_budget.py)."""
    m = config.memory
    pool = offload_pool_bytes(config, plan, 2 if bf16 else 4, pp_rank)
    return {"mlp_chunks": m.mlp_chunks, "loss_chunks": m.loss_chunks, "attention_grad_accum": m.attention_grad_accum,
            "upipe_overlap": m.upipe_overlap, "ring_overlap": m.ring_overlap,
            "residual_grad_in_place": m.residual_grad_in_place,
            "offloader": offloader_cls(pool_bytes=pool, prefetch_ahead=m.offload_prefetch,
                                       disk_dir=m.offload_disk_dir, disk_layers=m.offload_disk_layers)
            if m.offload_checkpoints else None}


def build_stage(config: Config, plan: Plan, groups: Groups, vocab: int, arch: LlamaArch | None = None) -> LlamaStage:
    """This rank's model stage as the run builds it (dtype, recompute, memory switches); `arch` defaults to the
    plan's (the exporter passes the checkpoint's)."""
    recompute = None if config.memory.recompute == "none" else config.memory.recompute
    arch = arch if arch is not None else plan.arch
    tconfig = llama_transformer_config(arch, groups.layout, dtype=torch.bfloat16 if use_bf16(config) else
                                       torch.float32, init_method_std=config.model.init_method_std,
                                       recompute_granularity=recompute,
                                       recompute_layers=config.memory.recompute_layers)
    stage = build_llama(arch, groups.layout, groups.pg, vocab_size=vocab, config=tconfig,
                        attention_kernel=config.model.attention_kernel, kernel_device=groups.device,
                        **memory_switches(config, plan, use_bf16(config), pp_rank=groups.pg.pp.rank()))
    if groups.device.type == "cuda":  # as Megatron-LM's get_model: megatron-core makes its linear layers' weights on
        stage.model.cuda(groups.device)  # the GPU, but the local spec's norms (torch modules) are made on the CPU
    return stage


def build_state(config: Config, plan: Plan, groups: Groups) -> TrainState:
    check_distributed_optimizer(config)
    tokenizer = build_run_tokenizer(config, plan)
    vocab = model_vocab_size(tokenizer, config)
    source = resume_source(config)
    notes = []
    if source is not None and source.kind != TRAINING:  # before anything is allocated
        notes.append(check_initial_weights(source, config, vocab))
    refusal = host_memory_refusal(config, plan, vocab, bf16=use_bf16(config), device=groups.device,
                                  world_size=groups.world_size, notes=notes)
    if refusal is not None:  # before the model and the host pool are allocated
        raise UnsupportedOnThisMachine(refusal)
    resumed = checkpointing.read_meta(source.path)["consumed_samples"] if source and source.kind == TRAINING else 0
    batches = start_train_batches(config, plan, tokenizer, groups.pg, resumed)  # data workers fork before pinning
    stage = build_stage(config, plan, groups, vocab)
    if source is not None and source.kind != TRAINING:  # weights only, into the unwrapped model
        load_initial_weights(stage, source, groups.pg)
        notes.append(f"loaded weights only from {source.path} ({source.words}): optimizer and schedule start fresh")
    ddp = wrap_model(stage.model, stage.config, config)
    optimizer, scheduler = build_optimizer(ddp, stage.config, config)
    data = build_run_data(config, plan, tokenizer, groups.pg, stage.plan.sequence_split, groups.device,
                          stage.plan.cp_ring, batches)
    state = TrainState(config, plan, groups, tokenizer, stage, ddp, optimizer, scheduler, data)
    if config.memory.offload_optimizer_states:
        state.parked = for_optimizer(ddp, stage.model, optimizer, pin=groups.device.type == "cuda")
    state.notes += [n for n in notes if n is not None]
    state.superseded = superseded_checkpoints(config)
    if state.superseded:
        state.notes.append(f"checkpoint.overwrite=true: {len(state.superseded)} checkpoint(s) of an earlier run in "
                           f"{config.checkpoint.dir} are removed once this run's first checkpoint is saved")
    if source is not None and source.kind == TRAINING:
        meta = checkpointing.load_checkpoint(state, source.path)
        state.step, state.consumed_samples, state.resumed_from = meta["step"], meta["consumed_samples"], source.path
        state.last_saved_step = meta["step"] if source.path.parent == Path(config.checkpoint.dir or "") else None
    if groups.rank == 0:
        state.logger = MetricsLogger(config.log, dataclasses.asdict(config), state.step)
        for note in state.notes:
            state.logger.message(note)
    return state
