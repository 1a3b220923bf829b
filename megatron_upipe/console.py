"""Start-up quieting of known-harmless third-party messages, for the training job and the tools, in this one place.

`quiet_third_party()` is called once per process by each entry point (pretrain_llama.py, tools/convert_hf_llama.py,
tools/estimate_memory.py, tools/preprocess_data.py, and the export's relaunched ranks), before megatron-core is
imported (several of these messages are emitted at import time). Each entry below names the emitter, a regex on the
message and why it is harmless here; nothing else is filtered, so our own warnings, third-party messages not listed
and errors still print.
Entries marked `cpu_only` are harmless only in a process that computes on CPU (on a GPU they carry advice) and stay
visible in a training job with CUDA; the tools compute on CPU (the planner simulates on fake tensors, the
conversions run on CPU), so they pass cuda=False.
Entries marked `tools_only` are hidden in the tools (tool=True) but not in the training job: torch's FutureWarnings
for `all_gather_into_tensor` / `reduce_scatter_tensor` (renamed `*_single`) are attributed to torch's wrapper
whoever calls it, and our models/seq_tiles.py is one caller, so the training job keeps showing them as a to-do;
the planner's simulations print them once per simulation, which says nothing about the plan.
Python warnings are matched by category + emitting module + message (`warnings.filterwarnings`); logging records by
logger + message (a `logging.Filter` on that logger, so its other records still print). megatron-core's loggers are
held at WARNING, so its INFO chatter stays out even where something lowers the root logger's level.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownWarning:
    category: type[Warning]
    module: str  # regex on the emitting module's __name__ (matched from its start)
    message: str  # regex on the message (matched from its start)
    why: str
    cpu_only: bool = False  # harmless only without CUDA (on a GPU it says something real)
    tools_only: bool = False  # hidden in the tools, shown by the training job


@dataclass(frozen=True)
class KnownLogRecord:
    logger: str
    message: str  # regex searched in the formatted message
    why: str
    cpu_only: bool = False


KNOWN_WARNINGS = (
    KnownWarning(UserWarning, r"megatron\.core\.", r"(Transformer Engine and Apex are|Apex is) not installed",
                 "import-time notice of megatron-core's torch fallbacks; said once by optional_kernels_line()"),
    KnownWarning(UserWarning, r"megatron\.core\.transformer\.transformer_config", r"full scope is deprecated",
                 "megatron-core 0.19.2 warns on its own default cuda_graph_modules='full'; CUDA graphs are off here"),
    KnownWarning(UserWarning, r"megatron\.core\.models\.mimo\.", r"MimoModelConfig is experimental",
                 "import-time notice of a multimodal class this project never uses"),
    # On resume and export: megatron-core's torch_dist load strategy calls torch.distributed.checkpoint.load itself.
    KnownWarning(UserWarning, r"torch\.distributed\.checkpoint\.",
                 r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a "
                 r"single process", "megatron-core loads with no_dist=True on purpose: each rank reads its own shards"),
    KnownWarning(UserWarning, r"torch\.distributed\.checkpoint\.", r"The argument order of load has been changed",
                 "megatron-core passes the storage reader positionally; torch maps it to the keyword"),
    KnownWarning(FutureWarning, r"torch\.distributed\.checkpoint\.",
                 r"Please use DTensor instead and we are deprecating ShardedTensor",
                 "megatron-core 0.19.2's torch_dist checkpoint format is built on ShardedTensor"),
    KnownWarning(UserWarning, r"megatron\.core\.tensor_parallel\.layers",
                 r"When using sequence parallelism it is recommended to set the environment variable "
                 r"CUDA_DEVICE_MAX_CONNECTIONS", "advice about CUDA streams, which a CPU run does not have",
                 cpu_only=True),
    KnownWarning(FutureWarning, r"torch\.distributed\.c10d_logger",
                 r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
                 "a rename notice, printed by each of the planner's simulations (Megatron-FSDP's calls on the fake "
                 "process group); the training job shows it", tools_only=True),
)

KNOWN_LOG_RECORDS = (
    KnownLogRecord("torch.utils.cpp_extension", r"No CUDA runtime is found",
                   "CPU machines only: CUDA_HOME is for building C++/CUDA extensions, which this project never does"),
    KnownLogRecord("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED",
                   "GPTModel is megatron-core 0.19.2's supported decoder; the stage is built on it on purpose (the "
                   "planner and the conversions build it too, once per simulation or conversion)"),
    KnownLogRecord("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated",
                   "printed on every save, async or not; checkpoints here are saved synchronously"),
    KnownLogRecord("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
                   r"Megatron-FSDP is using device cpu instead of the current device cuda",
                   "on CPU the model lives on cpu while compat/cpu.py (and the planner's fake CUDA) reports current "
                   "device 0", cpu_only=True),
)

MEGATRON_LOGGERS = ("megatron.core",)


class _DropMessages(logging.Filter):
    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(p.search(text) for p in self.patterns)


def quiet_third_party(cuda: bool | None = None, *, tool: bool = False) -> None:
    """Install the filters above (idempotent: a second call replaces the logging filters it made, adds nothing).
    `cuda`: whether this process computes on CUDA (default: torch.cuda.is_available()); the `cpu_only` entries are
    installed only without it. `tool`: a tool, not the training job (adds the `tools_only` entries)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    for w in KNOWN_WARNINGS:
        if not (w.cpu_only and cuda) and (tool or not w.tools_only):
            warnings.filterwarnings("ignore", message=w.message, category=w.category, module=w.module)
    by_logger: dict[str, list[str]] = {}
    for r in KNOWN_LOG_RECORDS:
        if not (r.cpu_only and cuda):
            by_logger.setdefault(r.logger, []).append(r.message)
    for name in {r.logger for r in KNOWN_LOG_RECORDS}:  # the last call's `cuda` decides: earlier filters go
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _DropMessages)]:
            logger.removeFilter(old)
        if name in by_logger:
            logger.addFilter(_DropMessages(by_logger[name]))
    for name in MEGATRON_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET or logger.level < logging.WARNING:
            logger.setLevel(logging.WARNING)
