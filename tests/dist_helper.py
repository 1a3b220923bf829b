"""Run a function on N gloo ranks in spawned processes and surface any rank's failure.

`run_on_ranks(fn, world_size, *args)` starts `world_size` processes, initialises a gloo process group on a
free localhost port in each, calls `fn(rank, world_size, *args)` and returns the list of per-rank return values
(they must be picklable). An exception on any rank is re-raised in the parent with that rank's traceback; a rank
that hangs past `timeout_s` fails the test instead of hanging CI.

Results travel as bytes (torch.save in the rank, torch.load in the parent): a tensor put on a torch
multiprocessing queue as is travels as a shared-memory handle that the parent can only open while the sending
rank is still alive, so a rank that exits before a slow (loaded) parent reads its result would otherwise fail
with "FileNotFoundError: No such file or directory".
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _load(payload: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout_s)
            if ok:
                results[rank] = _load(payload)
            else:
                failures.append(f"rank {rank} failed:\n{payload}")
                break  # the other ranks may now be blocked in a collective
    except Exception as exc:  # queue.Empty on timeout
        failures.append(f"timed out after {timeout_s}s waiting for ranks ({exc!r}); got {sorted(results)}")
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
