"""What this machine must have for a config to run here: CUDA for NCCL and the GPU-only paths, the optional packages.

Kept apart from `validate` (which judges the config alone, so a CPU login node can dry-run a GPU recipe).
pretrain_llama.py refuses these problems at the real start, on every rank, before any process group, allocation or
collective; `--dry-run` prints them as warnings ("on this machine: ..."), or refuses them with `--check-machine`.

`machine_problems(config, local_ranks)` returns one line per problem, each naming the setting and the fix. torch is
imported (to count GPUs) only when a setting depends on CUDA, or when `local_ranks` asks for the GPU count.
"""

from __future__ import annotations

import importlib.util
from functools import cache

from .schema import TE_CP_STRATEGIES, Config


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@cache
def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _kernel_problem(config: Config, gpus: int) -> str | None:
    """An explicitly named model.attention_kernel that cannot run on this machine's device and dtype."""
    import torch

    from megatron_upipe.attention.kernels import KERNELS

    name = config.model.attention_kernel
    device = "cuda" if gpus else "cpu"  # where training/setup.py puts the model
    bf16 = gpus > 0 if config.train.bf16 == "auto" else config.train.bf16
    reason = KERNELS[name].unsupported_reason(device, torch.bfloat16 if bf16 else torch.float32,
                                              config.model.arch().kv_channels)
    if reason is None:
        return None
    return f"model.attention_kernel={name}: {reason}: set model.attention_kernel=auto"


def machine_problems(config: Config, local_ranks: int | None = None) -> list[str]:
    """What stops `config` from running here; `local_ranks` (ranks on this node) also checks the GPU count."""
    p, m, backend = config.parallel, config.model, config.dist.backend
    problems: list[str] = []

    # optional packages
    te = p.cp_strategy in TE_CP_STRATEGIES
    if te and not _importable("transformer_engine"):
        problems.append(f"parallel.cp_strategy={p.cp_strategy} runs inside TransformerEngine, which is not "
                        f"importable: install transformer-engine[pytorch] or set parallel.cp_strategy=upipe/ulysses")
    if m.attention_kernel == "flash_attn" and not _importable("flash_attn"):
        problems.append("model.attention_kernel=flash_attn but the flash-attn package is not importable: install "
                        "flash-attn or set model.attention_kernel=auto")
    if config.log.wandb and not _importable("wandb"):
        problems.append("log.wandb=true but wandb is not importable: pip install wandb, or set log.wandb=false")
    if config.log.tensorboard_dir is not None and not _importable("tensorboard"):
        problems.append("log.tensorboard_dir is set but tensorboard is not importable: pip install tensorboard, or "
                        "set log.tensorboard_dir=null")

    # CUDA
    needs_cuda = backend == "nccl" or te or config.train.distributed_optimizer
    if not (needs_cuda or m.attention_kernel != "auto" or local_ranks is not None):
        return problems
    gpus = _gpu_count()
    if gpus == 0:
        if backend == "nccl":
            problems.append("dist.backend=nccl needs CUDA GPUs and this machine has none: set dist.backend=gloo "
                            "(or auto) to run on CPU")
        if te:
            problems.append(f"parallel.cp_strategy={p.cp_strategy} (TransformerEngine) needs CUDA GPUs and this "
                            f"machine has none: set parallel.cp_strategy=upipe or ulysses to run on CPU")
        if config.train.distributed_optimizer:
            problems.append("train.distributed_optimizer=true is not supported on CPU (megatron-core 0.19 cannot load "
                            "its checkpoints without TransformerEngine or apex): set train.distributed_optimizer=false")
    elif local_ranks is not None and backend != "gloo" and local_ranks > gpus:
        problems.append(f"{local_ranks} ranks on this node (torchrun --nproc-per-node) but {gpus} GPU(s) visible: "
                        f"use --nproc-per-node {gpus} or fewer (check CUDA_VISIBLE_DEVICES), or dist.backend=gloo")
    if m.attention_kernel != "auto":
        kernel = _kernel_problem(config, gpus)
        if kernel:
            problems.append(kernel)
    return problems
