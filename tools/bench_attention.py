#!/usr/bin/env python
"""UPipe vs Ulysses attention: numerics vs float64 reference, tracked peak memory, time, side by side in one run.

    python tools/bench_attention.py --heads 32 --kv-heads 8 --head-dim 64 --seq-len 2048 --cp 4 --json out.json
    python tools/bench_attention.py --cp 2 --u 2 8 32 --dtype bfloat16
    python tools/bench_attention.py --cp 4 --seq-len 16384 --docs 256   # packed documents vs one causal sequence
    python tools/bench_attention.py --cp 4 --overlap                     # UPipe serial vs pipelined stages
    python tools/bench_attention.py --cp 4 --ring 2 --ring-overlap       # a2a 2 x ring 2: serial vs overlapped passes

Spawns --cp processes (gloo on CPU; NCCL when --cp GPUs are visible), prints a table on rank 0 and writes JSON.
Shapes that cannot run (heads vs KV heads vs --cp, an illegal --u, a length not divisible by --cp) are refused in
one line, exit 2, before any process starts. Library code: megatron_upipe/benchmarks/attention.py.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_upipe.benchmarks.attention import DTYPES, BenchConfig, check, report, run_rank  # noqa: E402
from megatron_upipe.cli import ArgumentParser, fail, non_negative_int, positive_int  # noqa: E402

PROG = "bench_attention.py"


def _worker(rank, C, port, cfg, json_path, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= C
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // C))
    if use_cuda:
        torch.cuda.set_device(rank)
    if C > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=C)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    try:
        results = run_rank(cfg, dist.group.WORLD if C > 1 else None, rank, C, device)
        if rank == 0:
            table, data = report(cfg, C, torch.cuda.get_device_name(rank) if use_cuda else "cpu", results)
            print(table, flush=True)
            if json_path:
                with open(json_path, "w") as f:
                    json.dump(data, f, indent=1)
        queue.put((rank, None))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        queue.put((rank, repr(exc)))
        raise
    finally:
        if C > 1:
            dist.destroy_process_group()


def main(argv=None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--hidden", type=positive_int, default=None, help="model dim D (default heads * head-dim)")
    p.add_argument("--seq-len", type=positive_int, default=2048, help="global sequence length N")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--cp", type=positive_int, default=2, help="context-parallel ranks C (processes)")
    p.add_argument("--u", type=positive_int, nargs="*", default=[], help="heads per stage to run (default: every "
                   "legal U)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--check-seq-len", type=positive_int, default=256)
    p.add_argument("--warmup", type=non_negative_int, default=1)
    p.add_argument("--iters", type=positive_int, default=3)
    p.add_argument("--docs", type=positive_int, default=None, metavar="MEAN_LEN",
                   help="also run the same N tokens packed as documents of about MEAN_LEN tokens (cu_seqlens), side "
                        "by side with one causal sequence (needs --batch 1)")
    p.add_argument("--overlap", action="store_true",
                   help="also run every UPipe U with pipelined stages (upipe+ov), side by side with the serial op")
    p.add_argument("--ring", type=positive_int, default=1,
                   help="hybrid a2a x ring: a ring of this many all-to-all groups of cp/ring ranks (U over cp/ring)")
    p.add_argument("--ring-overlap", action="store_true",
                   help="also run every strategy with the ring's P2P passes overlapped (+rov), side by side")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    try:
        cfg = BenchConfig(a.heads, a.kv_heads, a.head_dim, a.hidden, a.seq_len, a.batch, tuple(a.u), a.dtype,
                          a.check_seq_len, a.warmup, a.iters, a.docs, a.overlap, a.ring, a.ring_overlap)
        check(cfg, a.cp)
    except ValueError as e:
        return fail(PROG, f"{e} (--heads {a.heads} --kv-heads {a.kv_heads} --cp {a.cp} --seq-len {a.seq_len} "
                          f"--check-seq-len {a.check_seq_len}{' --u ' + ' '.join(map(str, a.u)) if a.u else ''}"
                          f"{f' --docs {a.docs} --batch {a.batch}' if a.docs else ''}"
                          f"{f' --ring {a.ring}' if a.ring > 1 else ''})")

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, a.cp, port, cfg, a.json, queue)) for r in range(a.cp)]
    for proc in procs:
        proc.start()
    errors = []
    for _ in procs:
        rank, err = queue.get()
        if err:
            errors.append(f"rank {rank}: {err}")
            break
    for proc in procs:
        proc.join(timeout=10 if not errors else 1)
        if proc.is_alive():
            proc.terminate()
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
