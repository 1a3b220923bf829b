"""Pretrain a Llama-architecture model with UPipe context parallelism on megatron-core.

    pretrain_llama.py --config FILE [section.key=value ...] [--print-config]
        [--dry-run [--world-size N] [--check-machine]] [--status-file PATH]

The config is dataclass defaults < FILE < overrides (megatron_upipe/config). `--print-config` prints the resolved
config as YAML and exits; `--dry-run` validates it against the world size (WORLD_SIZE, or --world-size N for
planning on a login node) and the files it reads, prints the derived plan, builds nothing and exits 0. It judges the
config, not this machine: what this machine lacks for it (CUDA for NCCL, TransformerEngine, ...) is printed as
"on this machine" warnings, refused (exit 2) with --check-machine, and refused by every real start before any
process group or allocation. Started without torchrun (no WORLD_SIZE/RANK), the job runs as one process.
Relative paths in a config are relative to the working directory: launch from the repository root.

Launch:
    # CPU, 2 ranks on gloo
    torchrun --nproc-per-node 2 pretrain_llama.py --config examples/configs/tiny_cpu.yaml
    # CPU, one process (no torchrun)
    python pretrain_llama.py --config examples/configs/tiny_cpu.yaml parallel.cp=1
    # one node, 8 GPUs
    torchrun --nproc-per-node 8 pretrain_llama.py --config examples/configs/llama3_8b_upipe_8xh100.yaml
    # two nodes under Slurm, one torchrun per node
    srun --nodes 2 --ntasks-per-node 1 bash -c 'torchrun --nnodes 2 --nproc-per-node 8 \\
        --rdzv-id $SLURM_JOB_ID --rdzv-backend c10d --rdzv-endpoint $(scontrol show hostnames \\
        $SLURM_JOB_NODELIST | head -n1):29500 pretrain_llama.py --config examples/configs/qwen3_32b_upipe_16xh100.yaml'
    # plan a run without launching it
    python pretrain_llama.py --config examples/configs/qwen3_32b_upipe_16xh100.yaml --dry-run --world-size 16

Exit status: 0 on success; 2 for a configuration error or what this machine lacks for it (one line per problem, the
same on every rank) or an unusable checkpoint (another model shape or tokenizer, none where checkpoint.resume=true);
3 when train.nan_policy=stop met a non-finite loss or gradient (the message names the step); 4 when another rank
died or did not answer within dist.timeout_s; 5 when SIGTERM, SIGUSR1 or Ctrl-C stopped the run at a step boundary
after saving a checkpoint (checkpoint.save_on_signal; relaunch the same command to resume); 6 when a checkpoint could
not be saved (too little free space, or the writer failed, e.g. a full disk; one line, the same on every rank): the
partial save is removed and `latest` names the previous checkpoint (checkpoint.on_save_error=stop, or a failed final
or on-signal save; free space and relaunch to resume); 130 after a second Ctrl-C (or one outside the training loop):
stopped at once, nothing saved.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_upipe.cli import ArgumentParser
from megatron_upipe.config import (
    Config, ConfigError, Plan, check_outputs, check_paths, load_config, machine_problems, to_yaml, validate,
)
from megatron_upipe.training.auto_heads import plans_heads, resolve_auto_heads
from megatron_upipe.training.auto_stack import plans_stack, resolve_auto_stack
from megatron_upipe.training.checkpoint_guard import acquire_checkpoint_lock, overwrite_refusal
from megatron_upipe.training.helpers import die_with_parent

die_with_parent(__name__)  # in a helper this job spawns (megatron-core's checkpoint writer): die with the rank

PROG = "pretrain_llama.py"
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config file (omit to start from the defaults)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. parallel.cp=8 train.lr=1e-4")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--dry-run", action="store_true", help="validate everything, build nothing, exit 0")
    p.add_argument("--world-size", type=int, help="with --dry-run: plan for N processes instead of WORLD_SIZE")
    p.add_argument("--status-file", metavar="PATH", help="write the job's exit status (a number) to PATH at the end "
                   "(global rank 0): the launchers' way past torchrun's own exit code")
    p.add_argument("--check-machine", action="store_true", help="with --dry-run: also refuse (exit 2) what this "
                   "machine cannot run for all N ranks on it (one node), as the real start would")
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


def single_process_env(config: Config) -> dict[str, str]:
    """Started without torchrun: the env:// rendezvous of a world of one (what torchrun would set), or a ConfigError
    when the config needs more ranks or torchrun's variables are only partly set."""
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if not missing:
        return {}
    if len(missing) < len(TORCHRUN_VARS) and os.environ.get("WORLD_SIZE", "1") != "1":
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} unset: launch with "
                          f"torchrun --nproc-per-node N pretrain_llama.py ..., which sets them all")
    p = config.parallel
    ranks = p.model_parallel_size * (p.dp or 1)
    if ranks > 1:
        raise ConfigError(f"this config needs {ranks} ranks (parallel.tp·pp·cp = {p.tp}·{p.pp}·{p.cp}, dp "
                          f"{p.dp or 1}) but pretrain_llama.py was started without torchrun (one process): launch "
                          f"torchrun --nproc-per-node {ranks} pretrain_llama.py ..., or set parallel.cp=1 (and tp, pp)")
    import socket

    with socket.socket() as s:  # a free port for the one-process rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return {k: v for k, v in defaults.items() if k not in os.environ}


def report(error: str, what: str = "configuration error") -> None:
    """One line for one problem (`pretrain_llama.py: configuration error: ...`), else a header and the list."""
    sep = ": " if "\n" not in error else "\n"
    print(f"{PROG}: {what}{sep}{error}", file=sys.stderr, flush=True)


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
    from megatron_upipe.training.checkpointing import EXIT_SAVE_FAILED, CheckpointError, SaveFailed
    from megatron_upipe.training.deadline import DeadlineTooShort
    from megatron_upipe.training.failures import DistributedFailure, NonFiniteError
    from megatron_upipe.training.optim import UnsupportedOnThisMachine
    from megatron_upipe.training.setup import teardown
    from megatron_upipe.training.signals import EXIT_STOPPED, StoppedBySignal

    from megatron_upipe.training.console import quiet_third_party

    quiet_third_party()  # known-harmless third-party warnings, before megatron-core is imported
    groups = setup_distributed(config, plan)
    state, code, lock = None, 0, None
    try:
        lock = acquire_checkpoint_lock(config, groups.rank)  # every rank: the same verdict, before anything is read
        state = build(config, plan, groups)
        train(config, plan, state)
    except (CheckpointError, UnsupportedOnThisMachine, NonFiniteError, DeadlineTooShort) as e:  # the same verdict
        print(f"pretrain_llama.py: rank {groups.rank}: {e}", file=sys.stderr, flush=True)
        code = 3 if isinstance(e, NonFiniteError) else 2
    except StoppedBySignal as e:  # every rank stopped after the same step, its checkpoint published
        if groups.rank == 0:
            print(f"pretrain_llama.py: {e}", file=sys.stderr, flush=True)
        code = EXIT_STOPPED
    except SaveFailed as e:  # every rank: the same line; nothing published, the partial save removed
        print(f"pretrain_llama.py: rank {groups.rank}: {e}; stopped (exit code {EXIT_SAVE_FAILED})", file=sys.stderr,
              flush=True)
        code = EXIT_SAVE_FAILED
    except DistributedFailure as e:  # peers are gone or hung: no collective clean-up
        print(f"pretrain_llama.py: {e}", file=sys.stderr, flush=True)
        return 4
    finally:
        if state is not None:
            state.logger.close()
        if lock is not None:
            lock.release()
    teardown(groups)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code = start(args)
    if args.status_file is not None and os.environ.get("RANK", "0") == "0":
        write_status(args.status_file, code)
    return code


def write_status(path: str, code: int) -> None:
    """The job's exit status in a file (written by global rank 0, atomically): launchers read it because torchrun
    itself exits 1 whenever a rank exits non-zero, and a batch script must tell "saved, resubmit" (5) apart."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{code}\n")
    os.replace(tmp, path)


def start(args: argparse.Namespace) -> int:
    """Everything of main() but the status file: check, plan, and run the job (or the dry run)."""
    try:
        if args.check_machine and not args.dry_run:
            raise ConfigError("--check-machine goes with --dry-run (a real start always checks the machine)")
        config = load_config(args.config, args.overrides)
        if args.print_config:
            print(to_yaml(config), end="")
            return 0
        world_size = world_size_of(args)
        env = {} if args.dry_run else single_process_env(config)
        os.environ.update(env)
        from megatron_upipe.training.node_env import job_env

        node = job_env(config, os.environ)  # the NCCL/CUDA variables the plan assumes (the user's values kept)
        if not args.dry_run:  # before anything touches CUDA (U's planning reads the GPU) or NCCL (the process group)
            os.environ.update(node.set)
        plan = validate(config, world_size)
        check_paths(config)
        check_outputs(config)  # checkpoint.dir, log.*, the data cache: writable (probed), before anything is built
        if (refusal := overwrite_refusal(config)) is not None:  # before anything is written into checkpoint.dir
            raise ConfigError(refusal)
        auto_note = None
        if plans_stack(config):  # memory.auto: every rank asks the planner for the stack (U included)
            config, auto_note = resolve_auto_stack(config, world_size, nvls=node.nvls)
            plan = validate(config, world_size)
        elif plans_heads(config):  # U auto or unset: every rank asks the planner (same answer, no collective)
            config, auto_note = resolve_auto_heads(config, world_size, nvls=node.nvls)
            plan = validate(config, world_size)
        if args.dry_run:  # --check-machine: all ranks on this node
            local_ranks = plan.world_size if args.check_machine else None
        else:  # torchrun's count of ranks on this node (GPUs are not counted against it without one)
            local = os.environ.get("LOCAL_WORLD_SIZE", "")
            local_ranks = int(local) if local.isdigit() else None
        on_this_machine = machine_problems(config, local_ranks)
    except ConfigError as e:
        report(str(e))
        return 2
    if args.dry_run:
        print(f"at a real start: {node.line}")
        if auto_note:
            print(auto_note)
        print(plan.summary())
        for problem in on_this_machine:
            print(f"{'error' if args.check_machine else 'warning'}: on this machine: {problem}", file=sys.stderr)
        if args.check_machine and on_this_machine:
            return 2
        print("dry run: configuration is valid; nothing was built")
        return 0
    if on_this_machine:
        for problem in on_this_machine:
            print(f"{PROG}: on this machine: {problem}", file=sys.stderr, flush=True)
        return 2
    if env:
        print(f"{PROG}: no torchrun environment: running as a single process (world size 1)", file=sys.stderr)
    if os.environ.get("RANK", "0") == "0":  # the same verdict on every rank: say it once
        print(f"{PROG}: {node.line}", flush=True)
        if auto_note:
            print(f"{PROG}: {auto_note}", flush=True)
        for warning in plan.warnings:
            print(f"{PROG}: warning: {warning}", file=sys.stderr)
    try:
        return run_job(config, plan)
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside the loop: at once, no save, no collective clean-up
        print(f"{PROG}: rank {os.environ.get('RANK', '0')}: interrupted (Ctrl-C): stopped without saving",
              file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
