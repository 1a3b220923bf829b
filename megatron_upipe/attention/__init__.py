"""Ulysses-style context-parallel attention ops: UPipe (headwise-chunked) and the plain Ulysses baseline.

Pure torch + torch.distributed; this package never imports training code. Modules, in import order:
schedule (which heads go where per stage), comm (all-to-all resharding), rope, kernels (local attention with an
explicit backward), upipe (the stage loop for UPipe and, with one stage, Ulysses), api (checked public functions).
"""

from .api import ulysses_attention, ulysses_attention_grouped, upipe_attention, upipe_attention_grouped
from .kernels import KERNELS, select_kernel
from .schedule import UPipeSchedule, legal_heads_per_stage, make_schedule

__all__ = [
    "upipe_attention",
    "ulysses_attention",
    "upipe_attention_grouped",
    "ulysses_attention_grouped",
    "legal_heads_per_stage",
    "make_schedule",
    "UPipeSchedule",
    "select_kernel",
    "KERNELS",
]
