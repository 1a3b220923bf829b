"""Run a function on N gloo ranks in their own processes and surface any rank's failure.

`run_on_ranks(fn, world_size, *args)` starts `world_size` processes (forked from a fork server that has imported
torch and megatron-core once; the caller's environment and working directory are set in each), initialises a gloo
process group in each (the rendezvous store is the caller's), calls `fn(rank, world_size, *args)` and returns the
list of per-rank return values (they must be picklable). An exception on any rank is re-raised in the parent with
that rank's traceback; a rank that hangs past `timeout_s` fails the test instead of hanging CI, and a rank that dies
without a word (a signal, a C-level abort) fails it as soon as it is seen dead, with its exit code, instead of after
`timeout_s`. A forked rank's output goes where the fork server's goes: a test that reads it (capfd) asks for
start_method="spawn".

A rank's result is flushed into the pipe before it tears its process group down, so what the rank computed reaches
the parent whatever its teardown does.

Results travel as bytes (torch.save in the rank, torch.load in the parent): a tensor put on a torch
multiprocessing queue as is travels as a shared-memory handle that the parent can only open while the sending
rank is still alive, so a rank that exits before a slow (loaded) parent reads its result would otherwise fail
with "FileNotFoundError: No such file or directory".
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import random
import signal
import socket
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp
from torch.distributed import TCPStore


def free_port() -> int:
    """A TCP port free now, in 20000-28999: below the kernel's ephemeral range (32768-60999 by default), so no
    other process gets it by bind(0) or as an outgoing connection's port before the launcher binds it (a port taken
    with bind(0) did get taken so in a CI run, and a torchrun rendezvous failed), and away from the fixed ports some
    tests use (23456, 295xx)."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, 29000)
        if port == 23456:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port in 20000-28999")


def _worker(fn, rank, world_size, port, args, queue, here):
    import torch
    import torch.distributed as dist

    env, cwd = here
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)  # the parent's (run_on_ranks)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        message = (rank, True, buf.getvalue())
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        message = (rank, False, traceback.format_exc())
    try:
        queue.put(message)
        queue.close()
        queue.join_thread()  # in the pipe now, before the teardown below runs
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dead_without_result(procs, results: dict[int, Any]) -> str:
    """'rank r: exit code c (SIGNAME)' for each exited rank that sent nothing (a result sent is read before this is
    asked: the queue was empty for a second and the rank flushed before exiting)."""
    dead = []
    for rank, p in enumerate(procs):
        if rank not in results and p.exitcode is not None:
            name = f" ({signal.Signals(-p.exitcode).name})" if p.exitcode < 0 else ""
            dead.append(f"rank {rank}: exit code {p.exitcode}{name}")
    return ", ".join(dead)


def _load(payload: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)


# What the fork server imports once, so that a rank forked from it starts with them (about 5 s of CPU per rank
# otherwise). Not megatron.core's distributed / optimizer / pipeline_parallel packages: with them imported there,
# a rank that forks again (the planner's side-by-side simulations) gets children whose autograd threads abort on
# torch's OpenMP pool ("Invalid thread pool!").
PRELOAD = ["torch", "megatron.core", "megatron.core.models.gpt"]


def _context(start_method: str):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0,
                 start_method: str = "forkserver") -> list[Any]:
    """See the module docstring. start_method "spawn": every rank a fresh interpreter (for a rank that forks)."""
    ctx = _context(start_method)
    queue = ctx.Queue()
    # The rendezvous store is this process's, on a port the OS picks as it binds: a free_port() that rank 0 binds
    # later can be taken in between (by a test running beside this one), and the ranks failed with EADDRINUSE.
    server = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = server.port
    here = (dict(os.environ), os.getcwd())  # a forked rank has the fork server's; a test may have changed them
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue, here))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout_s
    seen_dead = ""
    try:
        while len(results) < world_size and not failures:
            try:
                rank, ok, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                # dead twice in a row: a rank that flushed its result just before dying is read in between
                previous, seen_dead = seen_dead, _dead_without_result(procs, results)
                if seen_dead and seen_dead == previous:
                    failures.append(f"rank(s) died without a result: {seen_dead}; got {sorted(results)}")
                elif time.monotonic() > deadline:
                    failures.append(f"timed out after {timeout_s}s waiting for ranks; got {sorted(results)}")
                continue
            if ok:
                results[rank] = _load(payload)
            else:
                failures.append(f"rank {rank} failed:\n{payload}")  # the others may now wait in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
            if p.is_alive():
                p.terminate()
                p.join()
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world_size)]


def without_communication(fn, *args):
    """fn(*args) with torch.distributed.all_to_all_single replaced by a function that raises: the argument checks
    under test must refuse a call before any rank communicates (else one rank's error hangs the others)."""
    import torch.distributed as dist

    def forbidden(*a, **k):
        raise RuntimeError("communication attempted before validation")

    real, dist.all_to_all_single = dist.all_to_all_single, forbidden
    try:
        return fn(*args)
    finally:
        dist.all_to_all_single = real
