"""The training job's console lines about third-party libraries: the optional-kernels line, and (re-exported from
megatron_upipe/console.py, where the tools use it too) the quieting of known-harmless third-party messages.

What the silenced TransformerEngine/apex fallback warnings said (megatron-core uses its torch implementations of the
optimizer, multi-tensor ops and norms) is printed once, by rank 0, as `optional_kernels_line()`.
"""

from __future__ import annotations

import importlib.util

from megatron_upipe.console import (  # noqa: F401 (the training job's import path)
    KNOWN_LOG_RECORDS, KNOWN_WARNINGS, MEGATRON_LOGGERS, KnownLogRecord, KnownWarning, quiet_third_party,
)

OPTIONAL_KERNELS = (("transformer_engine", "TransformerEngine"), ("apex", "apex"), ("flash_attn", "flash-attn"))


def optional_kernels_line() -> str:
    """Which optional GPU libraries this process can import (found on the path, not imported)."""
    found = {label: importlib.util.find_spec(module) is not None for module, label in OPTIONAL_KERNELS}
    parts = ", ".join(f"{label} {'yes' if ok else 'no'}" for label, ok in found.items())
    missing = not (found["TransformerEngine"] or found["apex"])
    return f"optional kernels: {parts}" + (" (megatron-core uses its torch optimizer, multi-tensor ops and norms)"
                                           if missing else "")
