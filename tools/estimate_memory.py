#!/usr/bin/env python
"""Memory planner: per-GPU peak of a training config at full scale, on a CPU machine, without allocating it.

    python tools/estimate_memory.py --config examples/configs/llama3_8b_upipe_8xh100.yaml [section.key=value ...]
        [--world-size 8] [--gpu h100-80gb|h200|...|GiB] [--strategies none,ulysses,upipe,upipe:16] [--max-context]
        [--json OUT.json] [--plot OUT.png] [--jobs N]
    python tools/estimate_memory.py --config C --fastest [--seq-length N] [--gpu ...] [--speed h100-80gb] [--json F]
        [--tp-sizes 1 2] [--ring-sizes 1 2]

Runs rank 0's real model code (build, DDP, optimizer states, one forward/backward step) under fake tensors and a
fake process group of the full world size, tracks the live tensors, adds the attention kernel's workspace and the
stated margins (CUDA context, NCCL, fragmentation), and prints a breakdown. Without --max-context it evaluates the
config's own train.seq_length for each strategy; with it, it finds the longest multiple of 128K tokens that fits.
For a GPU model with stated speed constants (h100-80gb, h200) each estimate also gets a `time:` line: the
step-time model's seconds per step and tokens/s per GPU from the FLOPs and collective bytes counted on the same
fake run (megatron_upipe/planner/step_time.py; calibrated by tools/step_time_report.py). Library code:
megatron_upipe/planner/. --fastest searches U, pipelined stages and the memory switches for the fastest stack
that fits at one length (megatron_upipe/planner/fastest.py) and prints the overrides that select it, beside the
config as given; its JSON has overrides, fits, peak_bytes, host_bytes_per_node, step_time_s,
tokens_per_s_per_gpu, mfu, the same under baseline, and every stack tried. --json and --plot must name a file in an
existing, writable directory (and --plot a format matplotlib writes): checked before anything is simulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_upipe.cli import ArgumentParser, fail, positive_int  # noqa: E402
from megatron_upipe.config import ConfigError, validate  # noqa: E402
from megatron_upipe.config.outputs import file_problem  # noqa: E402
from megatron_upipe.planner.devices import (  # noqa: E402
    DEFAULT_GPU, GIB, GPUS, NCCL_TOPOLOGIES, margins_for, resolve_gpu,
)
from megatron_upipe.planner.estimate import (  # noqa: E402
    ConfigSource, estimate, format_breakdown, format_named, format_time, max_context, plot, strategy_config, write_json,
)
from megatron_upipe.planner.choose_heads import choose_heads_per_stage  # noqa: E402
from megatron_upipe.planner.fastest import longest_stack, search_fastest, search_layouts  # noqa: E402
from megatron_upipe.planner.step_time import HARDWARE  # noqa: E402
from megatron_upipe.planner.workers import default_jobs  # noqa: E402

PROG = "estimate_memory.py"


def _vocab_size(config, plan) -> int:
    if config.model.vocab_size is not None:
        return config.model.vocab_size
    if plan.arch.vocab_size is not None:
        return plan.arch.vocab_size
    if config.data.tokenizer is not None:
        from megatron_upipe.data.tokenizers import build_tokenizer

        return build_tokenizer(config.data.tokenizer).vocab_size
    raise ConfigError("the vocabulary size is unknown: set model.vocab_size or data.tokenizer")


def _margins(a, gpu_model, world: int):
    """The GPU's margins for this job's topology, with any given on the command line in their place."""
    m = margins_for(gpu_model, world, a.nccl_topology)
    given = {k: v for k, v in (("cuda_context_bytes", a.cuda_context_gib), ("nccl_bytes", a.nccl_gib)) if v is not None}
    given = {k: int(v * GIB) for k, v in given.items()}
    if a.fragmentation is not None:
        given["fragmentation"] = a.fragmentation
    if any((v < 0 if k != "fragmentation" else not 0 <= v < 1) for k, v in given.items()):
        raise ValueError("--cuda-context-gib and --nccl-gib must be >= 0 and --fragmentation in [0, 1)")
    why = {f"{k.removesuffix('_bytes')}_why": "given on the command line" for k in given}
    return dataclasses.replace(m, **given, **why,
                               source=m.source + (", overridden: " + ", ".join(given) if given else ""))


def output_problem(option: str, path: str) -> str | None:
    """Why --json / --plot PATH could not be written after the simulation, or None."""
    reason = file_problem(path, make_dir=False)
    if reason:
        return f"{reason}: give a file in an existing, writable directory"
    if option == "--plot" and os.path.splitext(path)[1]:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            return "writing a plot needs matplotlib: pip install matplotlib"
        formats = FigureCanvasBase.get_supported_filetypes()
        if os.path.splitext(path)[1][1:].lower() not in formats:
            return f"matplotlib cannot write {os.path.splitext(path)[1]} files: use one of {', '.join(sorted(formats))}"
    return None


def main(argv=None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.add_argument("--world-size", type=positive_int, default=None, help="GPUs (default: the config's "
                   "'# world_size' comment or tp*pp*cp)")
    p.add_argument("--gpu", default=DEFAULT_GPU, help=f"GPU model ({', '.join(GPUS)}, local) or usable GiB per GPU; "
                   f"capacity is CUDA's total device memory (default {DEFAULT_GPU}: 79.18 GiB)")
    p.add_argument("--nccl-topology", default=None, choices=sorted(NCCL_TOPOLOGIES),
                   help="NCCL margin by topology (default: nvswitch for one node of 8, nvswitch-ib beyond)")
    p.add_argument("--strategies", default=None, help="comma list of none, ulysses, upipe, upipe:U "
                   "(default: the config's own strategy)")
    p.add_argument("--max-context", action="store_true", help="search the longest context that fits (128K steps)")
    p.add_argument("--max-tokens", type=positive_int, default=32 * 1024 * 1024, help="upper bound of the search")
    p.add_argument("--cuda-context-gib", type=float, default=None, help="override the CUDA-context margin")
    p.add_argument("--nccl-gib", type=float, default=None, help="override the topology's NCCL margin")
    p.add_argument("--fragmentation", type=float, default=None, help="override the fragmentation fraction")
    p.add_argument("--explain", type=float, default=None, metavar="MIB",
                   help="also list the buffers of at least MIB MiB alive at the deciding peak, by allocation site")
    p.add_argument("--jobs", type=positive_int, default=default_jobs(),
                   help="simulations run side by side, one process each (default: the CPUs available, at most 2)")
    p.add_argument("--fastest", action="store_true", help="search the fastest stack that fits (U, pipelined stages, "
                   "memory switches) at --seq-length")
    p.add_argument("--longest", action="store_true", help="plan the most frugal stack (what reaches the longest "
                   "context: the memory.auto=longest choice) at --seq-length, in --fastest's figures")
    p.add_argument("--tp-sizes", type=positive_int, nargs="+", default=None, help="with --fastest: also search "
                   "these tensor-parallel sizes on the same GPUs (cp x tp kept, sequence parallelism for tp > 1); "
                   "default: the config's layout only")
    p.add_argument("--ring-sizes", type=positive_int, nargs="+", default=None, help="with --fastest: also search "
                   "these hybrid ring sizes (parallel.cp_ring; all-to-all groups of cp / ring ranks); default: the "
                   "config's")
    p.add_argument("--seq-length", type=positive_int, default=None, help="tokens per sequence for --fastest "
                   "(default: the config's train.seq_length)")
    p.add_argument("--speed", default=None, choices=sorted(HARDWARE), help="the step-time model's constants for "
                   "--fastest when --gpu is given in GiB (default: --gpu's model)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)

    try:
        for option, path in (("--json", a.json), ("--plot", a.plot)):  # written at the end: refused before simulating
            if path is not None and (reason := output_problem(option, path)):
                raise ValueError(f"{option} {path}: {reason}")
        source = ConfigSource(a.config, tuple(a.overrides))
        config = source.load()
        p_ = config.parallel
        world = a.world_size or p_.tp * p_.pp * p_.cp * (p_.dp or 1)
        plan = validate(config, world)
        vocab = _vocab_size(config, plan)
        gpu_model = resolve_gpu(a.gpu)
        margins = _margins(a, gpu_model, world)
        hw = HARDWARE[a.speed] if a.speed else HARDWARE.get(gpu_model.name)  # the step-time model's constants
        if a.fastest and a.longest:
            raise ValueError("--fastest and --longest choose different stacks: give one")
        if (a.tp_sizes or a.ring_sizes) and not a.fastest:
            raise ValueError("--tp-sizes and --ring-sizes go with --fastest (the search over layouts)")
        if a.fastest or a.longest:
            _check_fastest(a, hw, gpu_model.name)
            validate(source.load([f"train.seq_length={a.seq_length or config.train.seq_length}"]), world)
        elif a.seq_length or a.speed:
            raise ValueError("--seq-length and --speed go with --fastest or --longest (for one length use "
                             "train.seq_length=N)")
        auto = not a.strategies and p_.cp_strategy == "upipe" and p_.upipe_heads_per_stage == "auto"
        strategies = a.strategies.split(",") if a.strategies else [] if auto else [
            p_.cp_strategy if p_.cp_strategy != "upipe" or p_.upipe_heads_per_stage is None
            else f"upipe:{p_.upipe_heads_per_stage}"]
        for strategy in strategies:  # a name the planner does not know, an illegal U: refused before simulating
            validate(strategy_config(source, strategy, config.train.seq_length), world)
    except (ConfigError, ValueError) as e:
        return fail(PROG, e)
    gpu = gpu_model.total_bytes
    print(f"planning {a.config} on {world} x {gpu_model.name} ({gpu / GIB:.2f} GiB: {gpu_model.source}): "
          f"{plan.arch}", flush=True)
    print(f"margins ({margins.source}): cuda context {margins.cuda_context_bytes / GIB:.2f} GiB, nccl "
          f"{margins.nccl_bytes / GIB:.2f} GiB, fragmentation {margins.fragmentation:.0%} of the live peak", flush=True)
    for name, why in margins.provenance().items():
        print(f"  margin {name}: {why}", flush=True)

    if a.fastest or a.longest:
        return _fastest(a, source, world, vocab, gpu, margins, hw, a.seq_length or config.train.seq_length)
    results, max_ctx, choice = [], {}, None
    if auto:  # upipe_heads_per_stage=auto: the largest legal U that fits, as the training job chooses it
        try:
            choice = choose_heads_per_stage(source, world, vocab, gpu, margins, jobs=a.jobs, gpu_name=gpu_model.name,
                                            hw=hw)
        except ConfigError as e:
            return fail(PROG, e)
        print(f"parallel.upipe_heads_per_stage=auto -> {choice.reason}", flush=True)
        strategies = [f"upipe:{choice.heads_per_stage}"]
        if not a.max_context and a.explain is None:
            results.append(choice.estimate)
            print("fits: " + format_breakdown(choice.estimate), flush=True)
            strategies = []
    for strategy in strategies:
        if a.max_context:
            tokens, seen = max_context(source, world, vocab, strategy, gpu, margins, a.max_tokens, jobs=a.jobs)
            max_ctx[strategy] = tokens
            results += seen
            fitting = [r for r in seen if r.seq_length == tokens]
            print(f"{strategy}: max context {tokens} tokens" + (f"\n  {format_breakdown(fitting[0])}" if fitting else ""),
                  flush=True)
        else:
            est = estimate(source, world, vocab, strategy, config.train.seq_length, gpu, margins,
                           named_bytes=int((a.explain or 0) * 2**20), jobs=a.jobs)
            results.append(est)
            print(("fits: " if est.fits else "does NOT fit: ") + format_breakdown(est), flush=True)
            if hw is not None:
                print("time: " + format_time(est, world, hw), flush=True)
            if a.explain is not None:
                print(format_named(est), flush=True)
    if a.max_context:
        print("\nmax context per strategy: " + ", ".join(f"{k} {v / 2**20:.3g}M" for k, v in max_ctx.items()))
    if a.json:
        write_json(a.json, max_ctx, results, {"heads_choice": choice.to_dict()} if choice is not None else None,
                   world, hw)
    if a.plot:
        plot(a.plot, results, gpu, f"{os.path.basename(a.config)}: {world} x {gpu_model.name} ({gpu / GIB:.2f} GiB)")
    return 0


def _choice(a) -> str:
    """"fastest" or "longest": which stack --fastest / --longest asks for."""
    return "fastest" if a.fastest else "longest"


def _check_fastest(a, hw, gpu_name: str) -> None:
    if a.max_context or a.strategies or a.plot or a.explain is not None:
        raise ValueError(f"--{_choice(a)} chooses the strategy and the length is given: drop --max-context, "
                         "--strategies, --plot and --explain")
    if hw is None:
        raise ValueError(f"--{_choice(a)} needs the step-time model's constants, which {gpu_name} has none of: name "
                         f"the GPU model ({', '.join(sorted(HARDWARE))}) or add --speed NAME")


def _fastest(a, source, world: int, vocab: int, gpu: int, margins, hw, seq: int) -> int:
    what = _choice(a)
    print(f"{'searching the fastest stack that fits' if a.fastest else 'planning the most frugal stack'} at {seq} "
          f"tokens (step-time model: {hw.name})", flush=True)
    start = time.monotonic()
    try:
        if a.fastest and (a.tp_sizes or a.ring_sizes):
            found = search_layouts(source, world, vocab, seq, gpu, margins, hw,
                                   tuple(a.tp_sizes or (source.load().parallel.tp,)),
                                   tuple(a.ring_sizes) if a.ring_sizes else None, jobs=a.jobs,
                                   log=lambda line: print(line, flush=True))
        elif a.fastest:
            found = search_fastest(source, world, vocab, seq, gpu, margins, hw, jobs=a.jobs,
                                   log=lambda line: print(line, flush=True))
        else:
            found = longest_stack(source, world, vocab, seq, gpu, margins, hw, jobs=a.jobs)
    except ConfigError as e:
        return fail(PROG, e)
    seconds = time.monotonic() - start
    print(f"planned {len(found.tried)} stacks in {seconds:.0f} s", flush=True)
    for label, c in ((what, found.best), ("config as given", found.baseline)):
        t = c.time
        print(f"{label}: {' '.join(c.overrides) or '(no overrides)'}\n  {'fits' if c.estimate.fits else 'does NOT fit'}"
              f" {c.estimate.peak_bytes / GIB:.2f} GiB per GPU, host {c.estimate.host_bytes_per_node / GIB:.0f} GiB per "
              f"node; {t.seconds:.4g} s/step, {t.tokens_per_s_per_gpu:.0f} tokens/s per GPU, MFU "
              f"{found.mfu(c):.1%} (step-time model)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": a.config, "config_overrides": list(a.overrides), "seq_length": seq, "choice": what,
                       "world_size": world, "gpu_bytes": gpu, "speed": hw.name, "search_seconds": seconds,
                       **found.to_dict()}, f, indent=1)
    return 0


if __name__ == "__main__":
    from megatron_upipe.console import quiet_third_party

    quiet_third_party(cuda=False, tool=True)  # known-harmless notices; megatron-core is imported in main()
    sys.exit(main())
