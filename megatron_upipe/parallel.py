"""The parallel layout (TP, PP, CP, DP, the CP strategy) and the set-up of megatron-core's process groups.

`ParallelLayout` is a validated, frozen description of how a job is split; `initialize_parallel(layout)` builds
megatron-core's groups once and returns them as a `ProcessGroupCollection` that callers pass down explicitly
(model builder, attention, batch split). Rank order is megatron-core's default "tp-cp-ep-dp-pp".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Strategies understood by `megatron_upipe.models.spec.build_layer_spec`, the only place that acts on them.
CP_STRATEGIES = ("none", "ulysses", "upipe", "p2p", "a2a", "a2a+p2p")


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    cp_strategy: str = "none"
    upipe_heads_per_stage: int | None = None  # U summed over the all-to-all ranks; None = smallest legal value
    cp_ring: int = 1  # R: cp = A x R, all-to-all groups of A consecutive CP ranks, a ring of R of them (hybrid)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name}={value!r} must be a positive integer")
        if self.cp_strategy not in CP_STRATEGIES:
            raise ValueError(f"parallel.cp_strategy={self.cp_strategy!r} is unknown; choose one of {CP_STRATEGIES}")
        if self.cp > 1 and self.cp_strategy == "none":
            raise ValueError(f"parallel.cp={self.cp} needs a cp_strategy other than 'none' (e.g. 'upipe')")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=True needs tp > 1")
        if not isinstance(self.cp_ring, int) or self.cp_ring < 1 or self.cp % self.cp_ring:
            raise ValueError(f"parallel.cp_ring={self.cp_ring!r} must be a positive divisor of parallel.cp={self.cp}")
        if self.cp_ring > 1 and self.cp_strategy not in ("ulysses", "upipe"):
            raise ValueError(f"parallel.cp_ring={self.cp_ring} (hybrid all-to-all x ring) runs UPipe or Ulysses "
                             f"stages; cp_strategy={self.cp_strategy!r}: set cp_strategy=upipe or cp_ring=1")
        if self.upipe_heads_per_stage is not None and self.upipe_heads_per_stage < 1:
            raise ValueError(f"parallel.upipe_heads_per_stage={self.upipe_heads_per_stage} must be positive or None")

    @property
    def cp_a2a(self) -> int:
        """A: the all-to-all group size (cp = A x cp_ring)."""
        return self.cp // self.cp_ring

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def describe(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        u = f"(U={self.upipe_heads_per_stage})" if self.upipe_heads_per_stage else ""
        ring = f"({self.cp_a2a}x{self.cp_ring})" if self.cp_ring > 1 else ""
        return f"tp{self.tp}{sp}-pp{self.pp}-cp{self.cp}{ring}:{self.cp_strategy}{u}-dp{self.dp}"


def initialize_parallel(layout: ParallelLayout, seed: int = 1234, timeout_s: float | None = None,
                        gloo_groups: bool = True):
    """Initialise megatron-core's parallel state for `layout` on the already-initialised default process group.

    `gloo_groups=False` skips megatron's auxiliary gloo groups (the memory planner's fake process group cannot
    create them). Installs the CPU adaptation first when there is no GPU, seeds the CPU generator and megatron's RNG tracker,
    and returns megatron's `ProcessGroupCollection` (tp, pp, cp, dp, dp_cp, ...) to pass down explicitly.
    With `layout.cp_ring` = R > 1 the CP group of A·R ranks is also cut by megatron-core's hierarchical CP
    (`hierarchical_context_parallel_sizes=[A, R]`): `hcp[0]` is this rank's all-to-all group (A consecutive CP
    ranks: one node when tp·A GPUs fit in it), `hcp[1]` its ring (stride A), so CP rank = ring rank·A + a2a rank.
    `timeout_s` bounds every collective on megatron's groups (None: megatron-core's 30 minutes), so a dead or hung
    peer ends the job instead of blocking it. Call `destroy_parallel()` before initialising another layout in the
    same processes.
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_upipe.compat.cpu import install_cpu_patches
    from megatron_upipe.compat.mcore import check_megatron_core_version

    if not dist.is_initialized():
        raise RuntimeError("initialize torch.distributed (e.g. torchrun + init_process_group) before the layout")
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"layout {layout.describe()} needs {layout.world_size} ranks but the job has {dist.get_world_size()}"
        )
    check_megatron_core_version()
    install_cpu_patches()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        create_gloo_process_groups=gloo_groups,
        hierarchical_context_parallel_sizes=[layout.cp_a2a, layout.cp_ring] if layout.cp_ring > 1 else None,
        **({} if timeout_s is None else {"distributed_timeout_minutes": timeout_s / 60}),
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups()


def _megatron_groups(parallel_state) -> list:
    """Every process group megatron-core's parallel state holds (its module globals: groups, and lists or dicts of
    them), each once."""
    found: dict[int, dist.ProcessGroup] = {}
    for name, value in vars(parallel_state).items():
        if not name.startswith("_"):
            continue
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if isinstance(item, dist.ProcessGroup):
                found[id(item)] = item
    return list(found.values())


def destroy_parallel() -> None:
    """Undo `initialize_parallel`: megatron-core's state, and the process groups it created.

    megatron-core's `destroy_model_parallel` only forgets its groups (gloo ones aside); each one left alive keeps its
    gloo threads and sockets until the default group is destroyed, so a process that initialises layouts one after
    another (the tests, the planner) would pile them up (measured on one rank: 48 gloo run loops before this, 44
    after forgetting, 6 after destroying; tests/test_cpu_compat.py). The default group is the caller's and stays."""
    from megatron.core import parallel_state

    groups = [g for g in _megatron_groups(parallel_state) if g is not dist.group.WORLD]
    parallel_state.destroy_model_parallel()
    if not dist.is_initialized():
        return
    for g in groups:
        try:
            dist.destroy_process_group(g)
        except ValueError:  # "Invalid process group specified": one megatron-core destroyed itself (gloo)
            pass
