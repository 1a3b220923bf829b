"""Distributed start-up: the default process group (backend, timeout) and megatron-core's parallel groups.

`setup_distributed(config, plan)` is called once per job on every rank. It initialises torch.distributed from
torchrun's environment unless a process group already exists (tests spawn ranks themselves), builds megatron-core's
groups for the config's layout with `dist.timeout_s` on every collective, and returns `Groups`, which the rest of
the job passes down. `teardown(groups)` undoes it (the default group only when this module created it).

What the timeout enforces: every collective on the default group and on megatron's groups (gloo: each operation
fails after `dist.timeout_s`; NCCL: the watchdog aborts the communicator and the process). A rank that dies makes
its peers' next collective fail at once (connection closed); a rank that stops answering makes them fail after
the timeout; either way the error is raised on the surviving ranks (see failures.py) and torchrun stops the rest.
Not covered: all ranks hanging outside any collective at the same time.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_upipe.config import Config, Plan
from megatron_upipe.parallel import ParallelLayout, destroy_parallel, initialize_parallel


@dataclass
class Groups:
    layout: ParallelLayout
    pg: object  # megatron-core ProcessGroupCollection (tp, pp, cp, dp, dp_cp, mp, ...)
    rank: int
    world_size: int
    device: torch.device
    owns_default_group: bool  # this job called init_process_group (so teardown destroys it)
    cp_placement: str = ""  # where the CP groups sit on the nodes (cp_placement); "" without context parallelism


def node_of_this_rank() -> str:
    """torchrun's GROUP_RANK (its node's index in the rendezvous), else the host name."""
    return os.environ.get("GROUP_RANK") or socket.gethostname()


def cp_placement(layout: ParallelLayout, pg) -> str:
    """One line on where the context-parallel groups sit (a collective: call on every rank): whether every
    UPipe/Ulysses all-to-all group is inside one node and, for hybrid a2a x ring, how many nodes each ring spans.
    With parallel.cp_ring > 1 an all-to-all group that spans nodes is a warning: the layout is meant to keep the
    all-to-alls on NVLink (tp·cp/cp_ring ranks must fit in a node, and the node's rank count be a multiple)."""
    a2a, ring = (pg.hcp[0], pg.hcp[1]) if layout.cp_ring > 1 else (pg.cp, None)
    mine = (node_of_this_rank(), dist.get_process_group_ranks(a2a), [] if ring is None else
            dist.get_process_group_ranks(ring))
    every = [None] * dist.get_world_size()  # per global rank: (its node, its a2a group's ranks, its ring's ranks)
    dist.all_gather_object(every, mine)
    nodes = [node for node, _, _ in every]
    worst_a2a = max(len({nodes[r] for r in group}) for _, group, _ in every)
    worst_ring = max(len({nodes[r] for r in group}) for _, _, group in every)
    total = len(set(nodes))
    where = ("inside one node each" if worst_a2a == 1 else
             f"spanning up to {worst_a2a} nodes (their all-to-alls cross the inter-node link)")
    line = f"context parallel on {total} node(s): all-to-all groups of {layout.cp_a2a} ranks {where}"
    if ring is not None:
        line += f"; rings of {layout.cp_ring} across {worst_ring} node(s)"
        if worst_a2a > 1:
            line = (f"warning: {line}: parallel.cp_ring={layout.cp_ring} is meant to keep each all-to-all inside a "
                    f"node; make tp·cp/cp_ring = {layout.tp * layout.cp_a2a} ranks divide the ranks per node")
    return line


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("dist.backend=nccl needs CUDA GPUs; on this machine set dist.backend=gloo (or auto)")
    return backend


def layout_of(config: Config, plan: Plan) -> ParallelLayout:
    if plan.heads_per_stage_auto:
        raise RuntimeError("parallel.upipe_heads_per_stage=auto was not resolved before the job started (pretrain_llama "
                           "resolves it with training/auto_heads.py)")
    p = config.parallel
    return ParallelLayout(tp=p.tp, pp=p.pp, cp=p.cp, dp=plan.dp, sequence_parallel=p.sequence_parallel,
                          cp_strategy=p.cp_strategy, upipe_heads_per_stage=plan.heads_per_stage, cp_ring=p.cp_ring)


def setup_distributed(config: Config, plan: Plan) -> Groups:
    """Process group + megatron-core groups for `config`'s layout (call on every rank). The environment NCCL and
    CUDA read (NCCL_NVLS_ENABLE, PYTORCH_CUDA_ALLOC_CONF for memory.expandable_segments, ...) is set before this,
    before anything touches CUDA (pretrain_llama.py with training/node_env.py)."""
    timeout = timedelta(seconds=config.dist.timeout_s)
    owns = not dist.is_initialized()
    if owns:
        backend = resolve_backend(config.dist.backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timeout)
    if dist.get_world_size() != plan.world_size:
        raise RuntimeError(f"the config was validated for {plan.world_size} ranks but the job has "
                           f"{dist.get_world_size()}")
    layout = layout_of(config, plan)
    pg = initialize_parallel(layout, seed=config.train.seed, timeout_s=config.dist.timeout_s)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    placement = cp_placement(layout, pg) if layout.cp > 1 else ""
    return Groups(layout, pg, dist.get_rank(), dist.get_world_size(), device, owns, placement)


def teardown(groups: Groups) -> None:
    destroy_parallel()
    if groups.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
