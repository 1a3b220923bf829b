"""Start-up quieting of known-harmless third-party messages, in this one place, and the line that replaces them.

`quiet_third_party()` is called once per process by the entry point, before megatron-core is imported (several of
these messages are emitted at import time). Each entry below names the emitter, a regex on the message and why it is
harmless here; nothing else is filtered, so our own warnings, third-party messages not listed and errors still print.
Entries marked `cpu_only` are harmless only in a CPU run (on a GPU they carry advice) and stay visible with CUDA.
Not filtered on purpose: torch's FutureWarnings for `all_gather_into_tensor` / `reduce_scatter_tensor` (renamed
`*_single`): they are attributed to torch's wrapper whoever calls it, and our models/seq_tiles.py is one caller.
Python warnings are matched by category + emitting module + message (`warnings.filterwarnings`); logging records by
logger + message (a `logging.Filter` on that logger, so its other records still print). megatron-core's loggers are
held at WARNING, so its INFO chatter stays out even where something lowers the root logger's level.

What the silenced TransformerEngine/apex fallback warnings said (megatron-core uses its torch implementations of the
optimizer, multi-tensor ops and norms) is printed once, by rank 0, as `optional_kernels_line()`.
"""

from __future__ import annotations

import importlib.util
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
    # On resume: megatron-core's torch_dist load strategy calls torch.distributed.checkpoint.load itself.
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
)

KNOWN_LOG_RECORDS = (
    KnownLogRecord("torch.utils.cpp_extension", r"No CUDA runtime is found",
                   "CPU machines only: CUDA_HOME is for building C++/CUDA extensions, which this project never does"),
    KnownLogRecord("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED",
                   "GPTModel is megatron-core 0.19.2's supported decoder; the stage is built on it on purpose"),
    KnownLogRecord("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated",
                   "printed on every save, async or not; checkpoints here are saved synchronously"),
    KnownLogRecord("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
                   r"Megatron-FSDP is using device cpu instead of the current device cuda",
                   "on CPU the model lives on cpu while compat/cpu.py reports current device 0", cpu_only=True),
)

MEGATRON_LOGGERS = ("megatron.core",)


class _DropMessages(logging.Filter):
    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(p.search(text) for p in self.patterns)


def quiet_third_party(cuda: bool | None = None) -> None:
    """Install the filters above (idempotent: a second call adds nothing). `cuda`: whether this process trains on
    CUDA (default: torch.cuda.is_available()); the `cpu_only` entries are installed only without it."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    for w in KNOWN_WARNINGS:
        if not (w.cpu_only and cuda):
            warnings.filterwarnings("ignore", message=w.message, category=w.category, module=w.module)
    by_logger: dict[str, list[str]] = {}
    for r in KNOWN_LOG_RECORDS:
        if not (r.cpu_only and cuda):
            by_logger.setdefault(r.logger, []).append(r.message)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(patterns))
    for name in MEGATRON_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET or logger.level < logging.WARNING:
            logger.setLevel(logging.WARNING)


OPTIONAL_KERNELS = (("transformer_engine", "TransformerEngine"), ("apex", "apex"), ("flash_attn", "flash-attn"))


def optional_kernels_line() -> str:
    """Which optional GPU libraries this process can import (found on the path, not imported)."""
    found = {label: importlib.util.find_spec(module) is not None for module, label in OPTIONAL_KERNELS}
    parts = ", ".join(f"{label} {'yes' if ok else 'no'}" for label, ok in found.items())
    missing = not (found["TransformerEngine"] or found["apex"])
    return f"optional kernels: {parts}" + (" (megatron-core uses its torch optimizer, multi-tensor ops and norms)"
                                           if missing else "")
