"""Test harness: run a tiny Llama under one parallel layout on gloo ranks and report results in HF names.

Every layout loads the same HF-named weights (so initialisation differences between layouts do not matter),
trains on the same global batch with megatron-core's DDP, forward-backward schedule, finalize_model_grads and
optimizer, and returns (per step) the global loss, the first step's gradients and the final parameters, all
gathered over TP and named like HF `LlamaForCausalLM` so any layout compares with any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RunResult:
    losses: list[float]
    grads: dict[str, torch.Tensor]  # HF name -> full gradient after the first step's reduction
    params: dict[str, torch.Tensor]  # HF name -> full parameter after the last optimizer step
    qkv_forward_calls: int  # calls of linear_qkv.forward on this rank (UPipe/Ulysses must project per stage)


def random_hf_state_dict(arch, vocab_size: int, seed: int = 0, std: float = 0.05) -> dict[str, torch.Tensor]:
    """Random weights in HF LlamaForCausalLM names (norm weights around 1)."""
    from megatron_upipe.checkpoint.hf_convert import hf_config_from_arch

    gen = torch.Generator().manual_seed(seed)
    cfg = hf_config_from_arch(arch, vocab_size)
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    out = {}
    for k, shape in sorted(shapes.items()):
        if k.endswith("norm.weight") or k.endswith("layernorm.weight"):
            out[k] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            out[k] = std * torch.randn(shape, generator=gen)
    return out


def random_setup(preset: str, vocab_size: int, batch: int, seq: int):
    """(arch, HF-named random weights, token batch [batch, seq + 1]) shared by the layout-comparison tests."""
    from megatron_upipe.models.presets import get_preset

    arch = get_preset(preset)
    tokens = torch.randint(0, vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    return arch, random_hf_state_dict(arch, vocab_size, seed=0), tokens


def _loss_func(per_token_loss: torch.Tensor):
    # (sum over this rank's [b, s/C] tokens, token count, report): the schedule divides by the count and DDP
    # averages over dp×cp, which gives the global mean since every rank holds the same number of tokens.
    total = per_token_loss.float().sum()
    count = torch.tensor(per_token_loss.numel(), dtype=torch.int)
    return total, count, {"lm loss": (total / count).detach()}


def _forward_step(data_iterator, model):
    from megatron_upipe.data.packing import packed_seq_params

    batch = next(data_iterator)
    packed = {"packed_seq_params": packed_seq_params(batch["cu_seqlens"])} if "cu_seqlens" in batch else {}
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], **packed)
    return out, _loss_func


def run_layout(layout, arch, hf_sd, tokens: torch.Tensor, *, steps: int = 1, lr: float = 1e-3,
               clip_grad: float = 1.0, recompute_granularity: str | None = None, mlp_chunks: int = 1,
               loss_chunks: int = 1, cu_seqlens: torch.Tensor | None = None,
               residual_grad_in_place: bool = False) -> RunResult:
    """Called on every rank of a job of layout.world_size ranks; returns the same RunResult on every rank.
    cu_seqlens: the documents packed in each sequence (one row per DP rank), passed as megatron's THD
    PackedSeqParams; position ids then restart at each document."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_upipe.checkpoint.hf_convert import load_hf_into_model, stage_to_hf
    from megatron_upipe.cp_batch import split_batch
    from megatron_upipe.models.llama import build_llama, llama_transformer_config
    from megatron_upipe.parallel import destroy_parallel, initialize_parallel

    vocab = hf_sd["model.embed_tokens.weight"].shape[0]
    pg = initialize_parallel(layout)
    try:
        config = llama_transformer_config(arch, layout, recompute_granularity=recompute_granularity)
        stage = build_llama(arch, layout, pg, vocab_size=vocab, config=config, mlp_chunks=mlp_chunks,
                            loss_chunks=loss_chunks, residual_grad_in_place=residual_grad_in_place)
        config = stage.config
        offset = get_transformer_layer_offset(config, pp_rank=pg.pp.rank())
        load_hf_into_model(stage.model, hf_sd, arch, stage.padded_vocab_size, tp_group=pg.tp, layer_offset=offset)
        qkv_calls = [0]
        for name, module in stage.model.named_modules():
            if name.endswith("linear_qkv"):
                module.register_forward_hook(lambda *_: qkv_calls.__setitem__(0, qkv_calls[0] + 1))
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False),
            stage.model,
        )
        config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=clip_grad, bf16=False), [ddp]
        )

        B, N = tokens.shape[0], tokens.shape[1] - 1
        dp_rank, dp = pg.dp.rank(), pg.dp.size()
        rows = tokens[dp_rank * (B // dp):(dp_rank + 1) * (B // dp)]  # [B/dp, N+1]
        batch = {
            "tokens": rows[:, :-1], "labels": rows[:, 1:],
            "position_ids": torch.arange(N).unsqueeze(0).expand(rows.shape[0], -1),
        }
        if cu_seqlens is not None:
            from megatron_upipe.data.packing import document_positions

            batch["position_ids"] = document_positions(cu_seqlens, 0, N).unsqueeze(0)  # [1, N]
        batch = split_batch(batch, stage.plan.sequence_split, pg.cp, stage.plan.cp_ring)  # [B/dp, N/C] each
        if cu_seqlens is not None:
            batch["cu_seqlens"] = cu_seqlens

        forward_backward = get_forward_backward_func()
        losses, grads = [], None
        for step in range(steps):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            out = forward_backward(
                forward_step_func=_forward_step, data_iterator=iter([batch]), model=[ddp], num_microbatches=1,
                seq_length=N, micro_batch_size=B // dp, forward_only=False,
            )
            local = torch.tensor([out[0]["lm loss"].item() if out else 0.0])
            # The last pipeline stage holds the loss: sum over pp (others add 0), average over dp×cp.
            dist.all_reduce(local, group=pg.pp)
            dist.all_reduce(local, group=pg.dp_cp)
            losses.append(local.item() / pg.dp_cp.size())
            if step == 0:
                named = [(n, p.main_grad) for n, p in stage.model.named_parameters()]
                grads = _gather_stage(named, arch, vocab, pg, offset)
            optimizer.step()
        params = _gather_stage(list(stage.model.named_parameters()), arch, vocab, pg, offset)
        return RunResult(losses, grads, params, qkv_calls[0])
    finally:
        destroy_parallel()


def run_layouts(world_size: int, preset: str, vocab: int, batch: int, seq: int, steps: int,
                layouts: list[dict]) -> dict[str, tuple[object, RunResult]]:
    """On every rank of a job: the reference (dp = world size) and then each of `layouts`, all from the same random
    HF weights and token batch; {name: (ParallelLayout, RunResult)}, reference first. A layout is ParallelLayout's
    keyword arguments, plus optionally "run" (run_layout's keyword arguments) and "tag" (appended to the name,
    layout.describe())."""
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.parallel import ParallelLayout

    arch = get_preset(preset)
    hf_sd = random_hf_state_dict(arch, vocab, seed=0)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    results = {}
    for kw in [dict(dp=world_size)] + layouts:
        kw = dict(kw)
        run_kwargs, tag = kw.pop("run", {}), kw.pop("tag", "")
        layout = ParallelLayout(**kw)
        results[layout.describe() + tag] = (layout, run_layout(layout, arch, hf_sd, tokens, steps=steps, **run_kwargs))
    return results


def _gather_stage(named, arch, vocab, pg, offset) -> dict[str, torch.Tensor]:
    """HF-named full tensors of every pipeline stage, on every rank."""
    from megatron_upipe.checkpoint.hf_convert import stage_to_hf

    mine = {k: v.clone() for k, v in stage_to_hf(named, arch, vocab, tp_group=pg.tp, layer_offset=offset).items()}
    stages = [None] * pg.pp.size()
    dist.all_gather_object(stages, mine, group=pg.pp)
    return {k: v for s in stages for k, v in s.items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
