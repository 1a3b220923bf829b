"""Full parameters of a per-rank Megatron-FSDP checkpoint ("fsdp_per_rank"), gathered by relaunching its layout.

Where a parameter lies in Megatron-FSDP's flat buffers depends on the model's parameter order, the FSDP units, chunk
alignment and the dp·cp size. Rather than re-deriving that, `gather_fsdp_checkpoint` starts the checkpoint's world
size of processes on this machine's CPU (gloo; CUDA hidden), and each one
  1. rebuilds the run's config from train_state.json (CPU-only settings overridden: gloo, attention_kernel=auto,
     mock data, no logging or checkpoint paths; train.bf16 from the saved buffers' dtype),
  2. builds and wraps its stage exactly as training does (training/build.py `build_stage`, optim.py `wrap_model`),
  3. loads its own file's model buffers (checkpointing.load_fsdp_model_buffers; the optimizer is not built),
  4. gathers each buffer of its dp·cp group on that group's first rank ([n/R] shard per rank -> the [n] bucket,
     rank r holding elements [r·n/R, (r+1)·n/R)), which cuts every parameter out at the offset Megatron-FSDP
     recorded (`item_index_map`),
  5. those first ranks (ranks 0..tp-1: one TP group) gather TP shards into HF names (hf_convert.stage_to_hf), and
     rank 0 writes them to a file the caller reads.
Weights: the compute buffer (the training dtype), or with `main=True` the fp32 main weights when the run kept them
(bf16 runs). Memory: ranks 0..tp-1 hold their TP shard of the whole model, rank 0 the whole model; the others
their shards only.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

CPU_OVERRIDES = ("dist.backend=gloo", "model.attention_kernel=auto", "data.path=mock", "data.tokenizer=null",
                 "data.num_workers=0", "checkpoint.dir=null", "checkpoint.load=null", "checkpoint.interval=0",
                 "checkpoint.resume=auto", "log.metrics_file=null", "log.tensorboard_dir=null", "log.wandb=false",
                 "memory.plan_check=false", "memory.offload_checkpoints=false", "memory.host_mem_gib=null",
                 "train.eval_interval=0")


def full_parameters(ddp, main: bool) -> dict[str, torch.Tensor] | None:
    """{name inside the wrapped module: this TP rank's full tensor} of a Megatron-FSDP stage on the first rank of
    its dp·cp group (None on the others); collective over each buffer's dp·cp group."""
    pgb = ddp.param_and_grad_buffer
    out, first_rank = {}, True
    for group in pgb.parameter_groups:
        buf = group.main_weight_buffer if main and group.main_weight_buffer is not None else group.model_weight_buffer
        bucket = buf.data
        if buf.is_data_distributed:
            shards = buf.data_parallel_group
            first = dist.get_global_rank(shards, 0)
            first_rank = dist.get_rank() == first
            parts = [torch.empty_like(buf.data) for _ in range(buf.dp_world_size)] if first_rank else None
            dist.gather(buf.data.contiguous(), parts, dst=first, group=shards)
            if not first_rank:
                continue
            bucket = torch.cat(parts)  # R x [n/R] -> [n]
        base = buf.bucket_index.global_data_index
        for item_id, param in enumerate(group.params):
            item = buf.item_index_map[item_id]
            start = item.global_data_index - base
            out[pgb.param_to_name[param]] = bucket[start:start + item.size].view(item.shape).clone()  # [n] -> shape
    return out if first_rank else None


def _gather_on_rank(ckpt: Path, meta: dict, main: bool) -> dict[str, torch.Tensor]:
    import yaml

    from megatron_upipe.checkpoint.hf_convert import stage_to_hf
    from megatron_upipe.config import load_config, validate
    from megatron_upipe.models.presets import LlamaArch
    from megatron_upipe.training.build import build_stage
    from megatron_upipe.training.checkpointing import load_fsdp_model_buffers, load_own_file
    from megatron_upipe.training.optim import wrap_model
    from megatron_upipe.training.setup import setup_distributed

    arch, vocab = LlamaArch.from_dict(meta["model"]), meta["model"]["vocab_size"]
    saved = load_own_file(ckpt / "fsdp" / "rank00000.pt", mmap=True)
    bf16 = any(t.dtype == torch.bfloat16 for bufs in saved["buffers"] for t in bufs.values())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(meta["config"]))
        config = load_config(str(path), [*CPU_OVERRIDES, f"model.vocab_size={vocab}",
                                         f"train.bf16={str(bf16).lower()}"])
    plan = validate(config, dist.get_world_size())
    groups = setup_distributed(config, plan)
    stage = build_stage(config, plan, groups, vocab, arch=arch)
    names = [n for n, _ in stage.model.named_parameters()]
    ddp = wrap_model(stage.model, stage.config, config)
    load_fsdp_model_buffers(ddp, ckpt)
    gathered = full_parameters(ddp, main)
    if gathered is None:  # not the first rank of its dp·cp group; the first ranks are exactly TP groups
        return {}
    full = {}
    for name, t in gathered.items():
        while name not in names and name.startswith("module."):  # Float16Module (bf16) around the GPTModel
            name = name.removeprefix("module.")
        full[name] = t
    missing = [n for n in names if n not in full]
    if missing:
        raise ValueError(f"the Megatron-FSDP buffers hold no {missing[0]} ({len(missing)} parameters missing)")
    return stage_to_hf([(n, full[n]) for n in names], arch, vocab, tp_group=groups.pg.tp, layer_offset=0)


def _worker(rank: int, world: int, port: int, ckpt: str, meta: dict, main: bool, result: str, queue) -> None:
    from megatron_upipe.console import quiet_third_party

    quiet_third_party(cuda=False, tool=True)  # a spawned child: the tool's filters, before megatron-core is imported
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        hf = _gather_on_rank(Path(ckpt), meta, main)
        if rank == 0:
            torch.save(hf, result)
        dist.barrier()
        queue.put((rank, None, None))
    except ValueError as e:  # CheckpointError / ConfigError: one line for the user
        queue.put((rank, "input", " ".join(str(e).split())))
    except BaseException:  # noqa: BLE001 - the parent shows the traceback
        queue.put((rank, "crash", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def gather_fsdp_checkpoint(ckpt: Path, meta: dict, world_size: int, *, main: bool) -> dict[str, torch.Tensor]:
    """HF-named full tensors of a per-rank FSDP checkpoint (see the module docstring); ValueError for a checkpoint
    that does not rebuild (one line), RuntimeError with a traceback for anything else."""
    import socket
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the children run on CPU with gloo, as on a login node
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "hf.pt")
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, str(ckpt), meta, main, result, queue))
                 for r in range(world_size)]
        try:
            for p in procs:
                p.start()
        finally:
            if hidden is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES")
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = hidden
        failure = None
        try:
            for _ in range(world_size):
                while True:
                    try:
                        rank, kind, message = queue.get(timeout=5)
                        break
                    except Exception:  # queue.Empty: is everyone still alive?
                        dead = [p for p in procs if p.exitcode not in (None, 0)]
                        if dead:
                            raise RuntimeError(f"an export process died (exit {dead[0].exitcode})") from None
                if kind is not None:
                    failure = (rank, kind, message)
                    break
        finally:
            for p in procs:
                p.join(timeout=None if failure is None else 2)
                if p.is_alive():
                    p.terminate()
                    p.join()
        if failure is not None:
            rank, kind, message = failure
            if kind == "input":
                raise ValueError(message)
            raise RuntimeError(f"export process {rank} failed:\n{message}")
        return torch.load(result, map_location="cpu", weights_only=True)
