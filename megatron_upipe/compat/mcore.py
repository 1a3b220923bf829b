"""megatron-core version guard.

The integration plugs into megatron-core through public APIs (layer specs, GPTModel, DDP, schedules,
dist_checkpointing) that changed between releases; the CPU adaptation also replaces two private RNG helpers of
`megatron.core.tensor_parallel.random`. Everything is tested against `TESTED_VERSION`; another version gets a
warning (not an error) so that users can try it. No other shims are needed for 0.19.2.
"""

from __future__ import annotations

import warnings

TESTED_VERSION = "0.19.2"


def megatron_core_version() -> str:
    from megatron.core import package_info

    return package_info.__version__.split("+")[0]  # "0.19.2+9248aae" -> "0.19.2"


def check_megatron_core_version() -> bool:
    """True when the installed megatron-core is the tested one; warns once otherwise."""
    version = megatron_core_version()
    if version != TESTED_VERSION:
        warnings.warn(
            f"megatron_upipe is tested with megatron-core {TESTED_VERSION}; found {version}. Layer specs and the CPU "
            f"adaptation may need updating (see megatron_upipe/compat/).",
            stacklevel=2,
        )
        return False
    return True
