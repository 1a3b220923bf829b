"""Per-step metrics: model FLOPs and MFU, peak memory, and the sinks (console, JSON lines, tensorboard, wandb).

Model FLOPs of one training token (forward + backward = 3 x forward; recomputation is not counted, as for MFU):
  per layer  2·D·(H+2G)·d  (q, k, v projections)  +  2·H·d·D  (output projection)  +  2·3·D·F  (SwiGLU MLP)
             + 2·N·H·d  (causal attention: QK^T and PV, 2·2·N·H·d for full attention, halved by the causal mask)
  once       2·D·V  (output layer; the embedding lookup is free)
with D hidden, H query heads, G KV heads, d head dim, F FFN size, N sequence length, V padded vocabulary.
MFU = achieved model FLOP/s per device / the device's dense bf16 peak (table below); null on CPU or an unknown GPU.
peak_mem_bytes: `torch.cuda.max_memory_allocated` on GPU; on CPU the process's peak RSS (`ru_maxrss`, coarse: it
includes the Python runtime and libraries), marked by `peak_mem_kind`. The maximum over ranks is reported.

Where records go (rank 0 only): `log.metrics_file` gets one JSON line per step (`"kind": "train"`) and one per
evaluation (`"kind": "eval"`), NaN written as null; tensorboard and wandb (offline by default) get the same scalars
as `train/...` and `eval/...`; the console gets one line every `log.interval` steps, every evaluation and every
skipped step. A resumed run appends to the metrics file: steps after its checkpoint appear again, the later record
being the resumed run's.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path

import torch

from megatron_upipe.models.presets import LlamaArch

# Dense bf16 peak FLOP/s per device (no sparsity), matched against torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12}


def model_flops_per_token(arch: LlamaArch, seq_length: int, padded_vocab: int) -> float:
    """Training FLOPs per token (see the module docstring)."""
    D, H, G, d, F = arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, arch.kv_channels, \
        arch.ffn_hidden_size
    per_layer = 2 * D * (H + 2 * G) * d + 2 * H * d * D + 2 * 3 * D * F + 2 * seq_length * H * d
    forward = arch.num_layers * per_layer + 2 * D * padded_vocab
    return 3.0 * forward


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "cpu_peak_rss"


def step_record(step: int, loss: float, lr: float, grad_norm: float | None, seconds: float, tokens: int,
                world_size: int, flops_per_token: float, peak_flops: float | None, peak_mem: int, mem_kind: str,
                skipped: bool) -> dict:
    """One JSON-lines record of a training step."""
    tps = tokens / seconds / world_size
    tflops = tps * flops_per_token / 1e12
    return {
        "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": seconds,
        "tokens_per_sec_per_gpu": tps, "tflops_per_gpu": tflops,
        "mfu": None if peak_flops is None else tflops * 1e12 / peak_flops,
        "peak_mem_bytes": peak_mem, "peak_mem_kind": mem_kind, "skipped": skipped, "time": time.time(),
    }


def _json_value(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v  # JSON has no NaN


class MetricsLogger:
    """Writes records to the console (every log.interval steps), the metrics file, tensorboard and wandb.
    Only one rank (the caller decides which) makes one; the others use `NullLogger`."""

    def __init__(self, log_config, run_config: dict, resumed_step: int):
        self.cfg = log_config
        self.file = None
        if log_config.metrics_file:
            path = Path(log_config.metrics_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("a", encoding="utf-8")
        self.tb = None
        if log_config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_config.tensorboard_dir, purge_step=resumed_step + 1 if resumed_step else None)
        self.wandb = None
        if log_config.wandb and log_config.wandb_mode != "disabled":
            import wandb

            run_dir = Path(log_config.metrics_file).parent if log_config.metrics_file else None  # else ./wandb
            self.wandb = wandb.init(project=log_config.wandb_project, name=log_config.wandb_run_name,
                                    mode=log_config.wandb_mode, config=run_config, resume="allow",
                                    dir=None if run_dir is None else str(run_dir))

    def log(self, record: dict, kind: str = "train") -> None:
        if self.file:
            safe = {k: _json_value(v) for k, v in record.items()}
            self.file.write(json.dumps({"kind": kind, **safe}) + "\n")
            self.file.flush()
        scalars = {f"{kind}/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and k not in
                   ("step", "time") and not isinstance(v, bool)}
        if self.tb:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, record["step"])
        if self.wandb:
            self.wandb.log(scalars, step=record["step"])
        if kind != "train" or record["step"] % self.cfg.interval == 0 or record.get("skipped"):
            self.console(record, kind)

    def console(self, r: dict, kind: str) -> None:
        if kind not in ("train", "eval"):  # other kinds (e.g. "memory") print their own line
            return
        if kind == "eval":
            print(f"step {r['step']:6d} | eval loss {r['loss']:.4f} over {r['tokens']} tokens", flush=True)
            return
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        gn = "n/a" if r["grad_norm"] is None else f"{r['grad_norm']:.3f}"
        print(f"step {r['step']:6d} | loss {r['loss']:.4f} | lr {r['lr']:.3e} | grad norm {gn} | "
              f"{r['tokens_per_sec_per_gpu']:.0f} tok/s/gpu | {r['tflops_per_gpu']:.3f} TFLOP/s/gpu | MFU {mfu} | "
              f"peak mem {r['peak_mem_bytes'] / 2**30:.2f} GiB" + (" | SKIPPED (non-finite)" if r["skipped"] else ""),
              flush=True)

    def message(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


class NullLogger:
    def log(self, record: dict, kind: str = "train") -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass
