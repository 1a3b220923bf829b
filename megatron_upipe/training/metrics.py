"""Per-step metrics: model FLOPs and MFU, peak memory, and the sinks (console, JSON lines, tensorboard, wandb).

Model FLOPs of one training token (forward + backward = 3 x forward; recomputation is not counted, as for MFU):
  per layer  2·D·(H+2G)·d  (q, k, v projections)  +  2·H·d·D  (output projection)  +  2·3·D·F  (SwiGLU MLP)
             + 2·N·H·d  (causal attention: QK^T and PV, 2·2·N·H·d for full attention, halved by the causal mask)
  once       2·D·V  (output layer; the embedding lookup is free)
with D hidden, H query heads, G KV heads, d head dim, F FFN size, N sequence length, V padded vocabulary.
MFU = achieved model FLOP/s per device / the device's dense bf16 peak (table below); null on CPU or an unknown GPU.
peak_mem_bytes: `torch.cuda.max_memory_allocated` on GPU; on CPU the process's peak RSS (`ru_maxrss`, coarse: it
includes the Python runtime and libraries), marked by `peak_mem_kind`. The maximum over ranks is reported.

Where records go (rank 0 only: the loss and gradient norm are reduced over every rank, pipeline stages included,
so rank 0 holds them): `log.metrics_file` gets one JSON line per step (`"kind": "train"`) and one per evaluation
(`"kind": "eval"`), NaN written as null; tensorboard and wandb (offline by default) get the same scalars as
`train/...` and `eval/...`; the console gets one line every `log.interval` steps, every evaluation and every
skipped step, and an end-of-run summary. A resumed run first drops the metrics file's records of steps after its
checkpoint (the killed run's, `drop_records_after`), then appends: the file holds one curve.

Console step line (the fields of Megatron-LM's `iteration 10/200 | consumed samples | elapsed time per iteration`):
  step 10/200 | consumed samples 80 | 512.3 ms/step | loss 7.3466 | lr 1.884e-03 | grad norm 0.755 |
  1749 tok/s/GPU | 0.004 TFLOP/s/GPU | MFU n/a | peak RSS 0.92 GiB | ETA 0:01:37
ms/step is this step's wall time; the ETA is the steps left times the mean step time of this process, its first
step excluded (it includes one-off set-up work) once a later one exists. Every memory figure names what it is
(`MEMORY_LABELS`): "peak alloc" (torch.cuda.max_memory_allocated), "peak RSS" (CPU: the process's resident set,
Python and libraries included), "peak tracked" (tensors a PeakMemoryTracker sees, the planner's unit), "planner
predicted" (the memory planner's figure for this config).
"""

from __future__ import annotations

import json
import math
import os
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


# What each `*_kind` of a memory figure is called wherever it is printed.
MEMORY_LABELS = {"cuda_max_allocated": "peak alloc", "cpu_peak_rss": "peak RSS", "tracked": "peak tracked"}


def memory_label(kind: str) -> str:
    return MEMORY_LABELS.get(kind, f"peak {kind}")


def step_record(step: int, loss: float, lr: float, grad_norm: float | None, seconds: float, tokens: int,
                world_size: int, flops_per_token: float, peak_flops: float | None, peak_mem: int, mem_kind: str,
                skipped: bool, total_steps: int | None = None, consumed_samples: int | None = None) -> dict:
    """One JSON-lines record of a training step."""
    tps = tokens / seconds / world_size
    tflops = tps * flops_per_token / 1e12
    return {
        "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": seconds,
        "tokens_per_sec_per_gpu": tps, "tflops_per_gpu": tflops,
        "mfu": None if peak_flops is None else tflops * 1e12 / peak_flops,
        "peak_mem_bytes": peak_mem, "peak_mem_kind": mem_kind, "skipped": skipped, "time": time.time(),
        "total_steps": total_steps, "consumed_samples": consumed_samples,
    }


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class RunTotals:
    """What the end-of-run summary reports, gathered from the records as they are logged."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_step = self.last_step = self.total_steps = None
        self.first_step_s, self.later_s, self.later_n, self.skipped = None, 0.0, 0, 0
        self.final_loss, self.best_eval, self.peak, self.memory_check, self.checkpoint = None, None, None, None, None

    def add(self, r: dict, kind: str) -> None:
        if kind == "train":
            self.first_step = r["step"] if self.first_step is None else self.first_step
            self.last_step, self.total_steps = r["step"], r.get("total_steps") or self.total_steps
            if self.first_step_s is None:
                self.first_step_s = r["step_time_s"]
            else:
                self.later_s, self.later_n = self.later_s + r["step_time_s"], self.later_n + 1
            self.skipped += bool(r["skipped"])
            self.final_loss = r["loss"]
            if self.peak is None or r["peak_mem_bytes"] >= self.peak[0]:
                self.peak = (r["peak_mem_bytes"], r["peak_mem_kind"])
        elif kind == "eval" and math.isfinite(r["loss"]) and (self.best_eval is None or r["loss"] < self.best_eval[0]):
            self.best_eval = (r["loss"], r["step"])
        elif kind == "memory":
            self.memory_check = r

    def mean_step_s(self) -> float | None:
        """Mean step time of this process, its first step excluded (unless it is the only one)."""
        return self.later_s / self.later_n if self.later_n else self.first_step_s

    def eta_s(self, step: int) -> float | None:
        mean = self.mean_step_s()
        return None if mean is None or self.total_steps is None else mean * max(self.total_steps - step, 0)

    def summary_lines(self) -> list[str]:
        if self.last_step is None:
            return ["run summary: no step was run (already at train.steps)"] + (
                [f"  checkpoint       {self.checkpoint}"] if self.checkpoint else [])
        n = self.last_step - self.first_step + 1
        mean = self.mean_step_s()
        excluded = (f"steps {self.first_step + 1}-{self.last_step}; the first, {1e3 * self.first_step_s:.1f} ms, "
                    f"excluded") if self.later_n else "one step"
        lines = ["run summary",
                 f"  steps            {self.last_step}/{self.total_steps} ({n} this run, {self.skipped} skipped)",
                 f"  wall time        {format_duration(time.perf_counter() - self.start)} (after the build)",
                 f"  mean step time   {1e3 * mean:.1f} ms ({excluded})",
                 f"  final loss       {self.final_loss:.4f}",
                 "  best eval loss   " + ("n/a (no evaluation)" if self.best_eval is None else
                                         f"{self.best_eval[0]:.4f} (step {self.best_eval[1]})"),
                 f"  peak memory      {memory_label(self.peak[1])} {self.peak[0] / 2**30:.2f} GiB (max over ranks)"]
        if self.memory_check is not None:
            m = self.memory_check
            lines.append(f"  memory check     step {m['step']}: {memory_label(m['measured_kind'])} "
                         f"{m['measured_peak_bytes'] / 2**20:.2f} MiB vs planner predicted "
                         f"{m['predicted_peak_bytes'] / 2**20:.2f} MiB")
        lines.append(f"  checkpoint       {self.checkpoint or 'none saved'}")
        return lines


def _json_value(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v  # JSON has no NaN


def drop_records_after(path: Path, step: int) -> int:
    """Rewrite the metrics file `path` (atomically) without the records of steps after `step`: a run resumed from
    the checkpoint of `step` logs those steps again, and the file keeps one curve (as tensorboard's purge_step).
    Returns how many records were dropped; a line that is not a JSON record (a torn last line) is dropped too."""
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            keep = not isinstance(record.get("step"), int) or record["step"] <= step
        except (ValueError, AttributeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


class MetricsLogger:
    """Writes records to the console (every log.interval steps), the metrics file, tensorboard and wandb, and the
    end-of-run summary. Only one rank (the caller decides which) makes one; the others use `NullLogger`."""

    def __init__(self, log_config, run_config: dict, resumed_step: int):
        self.cfg = log_config
        self.totals = RunTotals()
        self.file = None
        if log_config.metrics_file:
            path = Path(log_config.metrics_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            if resumed_step and path.is_file():
                drop_records_after(path, resumed_step)
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
        self.totals.add(record, kind)
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
            print(f"{self._step(r['step'])} | eval loss {r['loss']:.4f} over {r['tokens']} tokens", flush=True)
            return
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        gn = "n/a" if r["grad_norm"] is None else f"{r['grad_norm']:.3f}"
        samples = "" if r.get("consumed_samples") is None else f" | consumed samples {r['consumed_samples']}"
        eta = self.totals.eta_s(r["step"])
        print(f"{self._step(r['step'])}{samples} | {1e3 * r['step_time_s']:.1f} ms/step | loss {r['loss']:.4f} | "
              f"lr {r['lr']:.3e} | grad norm {gn} | {r['tokens_per_sec_per_gpu']:.0f} tok/s/GPU | "
              f"{r['tflops_per_gpu']:.3f} TFLOP/s/GPU | MFU {mfu} | "
              f"{memory_label(r['peak_mem_kind'])} {r['peak_mem_bytes'] / 2**30:.2f} GiB"
              + ("" if eta is None else f" | ETA {format_duration(eta)}")
              + (" | SKIPPED (non-finite)" if r["skipped"] else ""), flush=True)

    def _step(self, step: int) -> str:
        total = self.totals.total_steps
        return f"step {step:6d}" if total is None else f"step {step:{len(str(total))}d}/{total}"

    def message(self, text: str) -> None:
        print(text, flush=True)

    def checkpoint(self, step: int, path) -> None:
        self.totals.checkpoint = path
        print(f"{self._step(step)} | saved checkpoint {path}", flush=True)

    def summary(self) -> None:
        print("\n".join(self.totals.summary_lines()), flush=True)

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

    def checkpoint(self, step: int, path) -> None:
        pass

    def summary(self) -> None:
        pass

    def close(self) -> None:
        pass
