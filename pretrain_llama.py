"""Pretrain a Llama-architecture model with UPipe context parallelism on megatron-core.

    pretrain_llama.py --config FILE [section.key=value ...] [--print-config] [--dry-run [--world-size N]]

The config is dataclass defaults < FILE < overrides (megatron_upipe/config). `--print-config` prints the resolved
config as YAML and exits; `--dry-run` validates it against the world size (WORLD_SIZE, or --world-size N for
planning on a login node) and the files it names, prints the derived plan, builds nothing and exits 0.
Relative paths in a config are relative to the working directory: launch from the repository root.

Launch:
    # CPU, 2 ranks on gloo
    torchrun --nproc-per-node 2 pretrain_llama.py --config examples/configs/tiny_cpu.yaml
    # one node, 8 GPUs
    torchrun --nproc-per-node 8 pretrain_llama.py --config examples/configs/llama3_8b_upipe_8xh100.yaml
    # two nodes under Slurm, one torchrun per node
    srun --nodes 2 --ntasks-per-node 1 bash -c 'torchrun --nnodes 2 --nproc-per-node 8 \\
        --rdzv-id $SLURM_JOB_ID --rdzv-backend c10d --rdzv-endpoint $(scontrol show hostnames \\
        $SLURM_JOB_NODELIST | head -n1):29500 pretrain_llama.py --config examples/configs/qwen3_32b_upipe_16xh100.yaml'
    # plan a run without launching it
    python pretrain_llama.py --config examples/configs/qwen3_32b_upipe_16xh100.yaml --dry-run --world-size 16

Exit status: 0 on success; 2 for a configuration error (the same message on every rank) or an unusable checkpoint
(another model shape or tokenizer, none where checkpoint.resume=true); 3 when train.nan_policy=stop met a non-finite
loss or gradient (the message names the step); 4 when another rank died or did not answer within dist.timeout_s.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_upipe.config import Config, ConfigError, Plan, check_paths, load_config, to_yaml, validate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config file (omit to start from the defaults)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. parallel.cp=8 train.lr=1e-4")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--dry-run", action="store_true", help="validate everything, build nothing, exit 0")
    p.add_argument("--world-size", type=int, help="with --dry-run: plan for N processes instead of WORLD_SIZE")
    return p.parse_args(argv)


def world_size_of(args: argparse.Namespace) -> int:
    if args.world_size is not None:
        if not args.dry_run:
            raise ConfigError("--world-size is for planning with --dry-run; a real run takes WORLD_SIZE from torchrun")
        return args.world_size
    raw = os.environ.get("WORLD_SIZE", "1")
    if not raw.isdigit():
        raise ConfigError(f"WORLD_SIZE={raw!r} is not a positive integer")
    return int(raw)


def setup_distributed(config: Config, plan: Plan):
    """Initialise torch.distributed (dist.backend, dist.timeout_s) and the megatron-core process groups."""
    from megatron_upipe.training.setup import setup_distributed as setup

    return setup(config, plan)


def build(config: Config, plan: Plan, groups):
    """Tokenizer, datasets, model (the UPipe spec), optimizer and scheduler, checkpoint resume."""
    from megatron_upipe.training.build import build_state

    return build_state(config, plan, groups)


def train(config: Config, plan: Plan, state) -> None:
    """The training loop: steps, evaluation, logging, checkpoints."""
    from megatron_upipe.training.loop import run

    run(state)


def run_job(config: Config, plan: Plan) -> int:
    """set up -> build -> train -> tear down; a known failure is reported in one line per rank with its exit code."""
    from megatron_upipe.training.checkpointing import CheckpointError
    from megatron_upipe.training.failures import DistributedFailure, NonFiniteError
    from megatron_upipe.training.optim import UnsupportedOnThisMachine
    from megatron_upipe.training.setup import teardown

    from megatron_upipe.training.console import quiet_third_party

    quiet_third_party()  # known-harmless third-party warnings, before megatron-core is imported
    groups = setup_distributed(config, plan)
    state, code = None, 0
    try:
        state = build(config, plan, groups)
        train(config, plan, state)
    except (CheckpointError, UnsupportedOnThisMachine, NonFiniteError) as e:  # every rank reaches the same verdict
        print(f"pretrain_llama.py: rank {groups.rank}: {e}", file=sys.stderr, flush=True)
        code = 3 if isinstance(e, NonFiniteError) else 2
    except DistributedFailure as e:  # peers are gone or hung: no collective clean-up
        print(f"pretrain_llama.py: {e}", file=sys.stderr, flush=True)
        return 4
    finally:
        if state is not None:
            state.logger.close()
    teardown(groups)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        if args.print_config:
            print(to_yaml(config), end="")
            return 0
        plan = validate(config, world_size_of(args))
        check_paths(config)
    except ConfigError as e:
        print(f"pretrain_llama.py: configuration error\n{e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(plan.summary())
        print("dry run: configuration is valid; nothing was built")
        return 0
    for warning in plan.warnings:
        print(f"pretrain_llama.py: warning: {warning}", file=sys.stderr)
    return run_job(config, plan)


if __name__ == "__main__":
    sys.exit(main())
