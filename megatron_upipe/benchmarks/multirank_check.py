"""The multi-rank attention ops with C ranks as threads of one process (one GPU, or the CPU), against float64.

Legend: C ranks, A all-to-all (UPipe/Ulysses) group size, R ring size (C = A·R; global rank = ring rank·A + a2a
rank), N global tokens, H / G query / KV heads, d head dim, D model dim, U heads per stage (summed over A).

The lent GPU is one device with no network, so several ranks can only be threads of one process sharing it:
torch's threaded process group (`torch.testing._internal.distributed.multi_threaded_pg`). Each rank is a thread
that joins a thread-local c10d world; a collective waits for every rank's thread, then group rank 0's thread does
all the copies (on CUDA: on the ranks' shared default stream, so the order of the copies and the ranks' kernels
is the host's). What it has and lacks, and what `ThreadedGroup` adds here:

- collectives: all_to_all_single, alltoall, allreduce, allgather, broadcast, scatter, gather, reduce_scatter,
  barrier. No send / recv, so no batch_isend_irecv (the ring's passes, attention/ring.py): `ThreadedGroup` adds
  them as a mailbox: isend queues a copy of the tensor at once, irecv fills its buffer with NaN and takes the
  message (matched by source, destination and tag, in order) when its work is waited for.
- every work it returns is already complete (async_op changes nothing). Here an all_to_all_single started with
  async_op=True fills its output with NaN and delivers at wait(): an op that reads a receive buffer before waiting
  (a missing wait) computes with NaN, and the case fails.

`run_threaded(C, fn)` runs fn(rank, C) on C such ranks. `run_checks` runs the cases of `plan`: for each C, the
a2a-only layout (A = C) and the hybrid a2a x ring layouts (A·R = C, R > 1), every rank computes its tokens
(attention.layout.local_positions) of UPipe (every legal U) and Ulysses, with and without packed documents
(cu_seqlens, a2a only: the ring takes none), forward and backward; out and dx of its tokens and the weight
gradients (summed over the ranks) are compared with `reference_attention` in float64 on the same dtype-rounded
inputs, as relative norms (max over ranks). Overlap cases (UPipe's pipelined stages, `overlap=True`; the ring's
overlapped passes, `ring_overlap=True`) must also equal the serial op bit for bit on every rank.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from megatron_upipe.attention import api
from megatron_upipe.attention.kernels import KERNELS, select_kernel
from megatron_upipe.attention.layout import local_positions
from megatron_upipe.attention.reference import reference_attention, rope_angles
from megatron_upipe.attention.schedule import legal_heads_per_stage

# relative (norm) error against float64 on the same dtype-rounded inputs (tests/test_hybrid_attention.py's TOL)
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
BACKEND = "upipe_threaded"
TORCH_PG = "torch.testing._internal.distributed.multi_threaded_pg"


# ------------------------------------------------------------------------------------------- threaded group
def _mtpg():
    from torch.testing._internal.distributed import multi_threaded_pg

    return multi_threaded_pg


class _Work(dist.Work):
    """A work whose wait() runs `deliver` once (None: already complete)."""

    def __init__(self, deliver=None) -> None:
        super().__init__()
        self._deliver = deliver

    def wait(self, timeout=None) -> bool:
        deliver, self._deliver = self._deliver, None
        if deliver is not None:
            deliver()
        return True


def _poison(tensors) -> None:
    for t in tensors:
        t.detach().fill_(float("nan") if t.is_floating_point() else -1)


def _threaded_group_class():
    """ProcessLocalGroup plus late-delivered async all-to-alls and mailbox P2P (see the module docstring)."""
    base = _mtpg().ProcessLocalGroup

    class ThreadedGroup(base):
        _mail: dict = {}  # (group name, source, destination, tag) -> queued messages (lists of tensors)
        _mail_cv = threading.Condition()
        p2p_timeout_s = 120.0
        _batch = None  # P2P works since _start_coalescing (torch's batch_isend_irecv on CUDA in older versions)

        def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                              opts=dist.AllToAllOptions()):
            if not getattr(opts, "asyncOp", False):
                return super().all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)
            arrived = torch.empty_like(output)
            super().all_to_all_single(arrived, input, output_split_sizes, input_split_sizes, opts)
            _poison([output])  # until wait()
            return _Work(lambda: output.detach().copy_(arrived))

        def _p2p(self, work):
            if self._batch is not None:
                self._batch.append(work)
            return work

        def send(self, tensors, dst, tag=0):
            with ThreadedGroup._mail_cv:
                ThreadedGroup._mail.setdefault((self.pg_name, self._rank, dst, tag), deque()).append(
                    [t.detach().clone() for t in tensors])
                ThreadedGroup._mail_cv.notify_all()
            return self._p2p(_Work())

        def recv(self, tensors, src, tag=0):
            key = (self.pg_name, src, self._rank, tag)
            _poison(tensors)  # until wait()

            def deliver():
                cv, mail = ThreadedGroup._mail_cv, ThreadedGroup._mail
                with cv:
                    if not cv.wait_for(lambda: mail.get(key) or base._terminate.is_set(), self.p2p_timeout_s):
                        raise RuntimeError(f"recv from group rank {src} (tag {tag}): nothing arrived in "
                                           f"{self.p2p_timeout_s:.0f} s")
                    if base._terminate.is_set():
                        raise RuntimeError("another rank failed")
                    got = mail[key].popleft()
                for t, g in zip(tensors, got):
                    t.detach().copy_(g)
            return self._p2p(_Work(deliver))

        def _start_coalescing(self, device):
            self._batch = []

        def _end_coalescing(self, device):
            works, self._batch = self._batch, None
            return _Work(lambda: [w.wait() for w in works])

        @classmethod
        def reset_mail(cls) -> None:
            with cls._mail_cv:
                cls._mail = {}

    return ThreadedGroup


_GROUP_CLASS = None
_LEFTOVER: list[threading.Thread] = []  # ranks still running after their world timed out


def _register():
    global _GROUP_CLASS
    if _GROUP_CLASS is None:
        from torch.distributed.distributed_c10d import _store_based_barrier

        _GROUP_CLASS = _threaded_group_class()

        def create(prefix_store, rank, world_size, timeout):
            pg = _GROUP_CLASS(rank, world_size)
            _store_based_barrier(rank, prefix_store, "", world_size, timeout)
            return pg

        dist.Backend.register_backend(BACKEND, create, devices=["cpu", "cuda"])
    return _GROUP_CLASS


def threaded_pg_facts() -> dict:
    """What torch's threaded group implements (read from its class) and what this module adds."""
    base = _mtpg().ProcessLocalGroup
    names = ("all_to_all_single", "alltoall", "allreduce", "allgather", "broadcast", "scatter", "gather",
             "reduce_scatter", "barrier", "send", "recv")
    has = {n: n in vars(base) for n in names}
    return {"module": TORCH_PG, "torch": torch.__version__, "implements": sorted(n for n, v in has.items() if v),
            "lacks": sorted(n for n, v in has.items() if not v),
            "added_here": "send/recv (so batch_isend_irecv) as a mailbox; async all_to_all_single delivered at "
                          "wait() with NaN in the output until then",
            "late_delivery": hasattr(dist.AllToAllOptions(), "asyncOp"),  # False: this torch hides async_op
            "streams": "the ranks' threads share the device's default stream; group rank 0's thread does every "
                       "copy once all ranks joined: it cannot show a missing CUDA stream wait (NCCL's comm "
                       "stream), only a missing work.wait()"}


def run_threaded(world_size: int, fn, *args, timeout_s: float = 300.0) -> list:
    """[fn(rank, world_size, *args) for each rank], the ranks being threads on the threaded group (the default
    group of each thread's c10d world). A rank's exception (others blocked in a collective are released) or a
    rank still running after timeout_s raises RuntimeError with the rank's traceback."""
    if any(t.is_alive() for t in _LEFTOVER):
        raise RuntimeError("ranks of an earlier world are still running (timed out): the threaded group is theirs")
    group_class = _register()
    mtpg = _mtpg()
    multithreading, excepthook = torch._C._is_multithreading_enabled(), sys.excepthook
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    mtpg._install_threaded_pg()
    store = dist.HashStore()
    results: list = [None] * world_size
    failures: dict[int, list[str]] = {}

    def worker(rank):
        try:
            dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=store)
            results[rank] = fn(rank, world_size, *args)
        except BaseException as e:  # noqa: BLE001 - reported below; the other ranks are released
            failures.setdefault(rank, []).append(traceback.format_exc())
            mtpg.ProcessLocalGroup.exception_handle(e)
            with group_class._mail_cv:
                group_class._mail_cv.notify_all()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True, name=f"rank{r}") for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for r, t in enumerate(threads):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                failures.setdefault(r, []).insert(0, f"still running after {timeout_s:.0f} s (a collective or "
                                                     f"a recv that never completes)")
                mtpg.ProcessLocalGroup.exception_handle(TimeoutError())  # wakes the ranks waiting in one
        for t in threads:
            t.join(5.0)
        _LEFTOVER[:] = [t for t in threads if t.is_alive()]
    finally:
        mtpg.ProcessLocalGroup.reset()
        group_class.reset_mail()
        mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        torch._C._set_multithreading_enabled(multithreading)
        sys.excepthook = excepthook  # each rank's init_process_group wrapped it in a "[rank r]:" prefix
    if failures:
        raise RuntimeError("\n".join(f"rank {r}: " + "\n".join(msgs) for r, msgs in sorted(failures.items())))
    return results


# ------------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Problem:
    """One global attention problem (b = 1); docs: packed documents (cu_seqlens) instead of one sequence."""

    H: int
    G: int
    d: int
    D: int
    N: int
    docs: bool = False


@dataclass(frozen=True)
class Case:
    problem: Problem
    strategy: str  # "upipe" or "ulysses"
    U: int | None  # heads per stage over the a2a group (None: Ulysses)
    A: int
    R: int
    dtype: torch.dtype
    kernel: str | None  # None: the op's automatic choice
    overlap: bool = False  # also run the overlapped op (UPipe stages, or the ring's passes when R > 1)

    @property
    def name(self) -> str:
        p = self.problem
        return (f"C={self.A * self.R} a2a {self.A}" + (f" x ring {self.R}" if self.R > 1 else "")
                + f" {self.strategy}" + (f" U={self.U}" if self.U else "") + f" H={p.H} G={p.G}"
                + (" docs" if p.docs else "") + (" overlap" if self.overlap else "")
                + f" {str(self.dtype).replace('torch.', '')} {self.kernel or 'auto'}")


def layouts(C: int) -> list[tuple[int, int]]:
    """(A, R) of C ranks: all-to-all only, then every ring of R > 1 with A >= 2."""
    return [(C, 1)] + [(C // R, R) for R in range(2, C // 2 + 1) if C % R == 0]


def plan(C: int, dtype: torch.dtype, kernel: str | None, main: Problem, replicated: Problem,
         full: bool = True) -> list[Case]:
    """The cases at C ranks. full: every legal U of `main` (GQA), Ulysses, `replicated` (fewer KV heads than
    ranks), packed documents, UPipe's overlapped stages for every U with more than one stage, every hybrid layout
    with the smallest U and Ulysses, and the ring's overlapped passes. Not full: the smallest U and Ulysses of
    `main` on the a2a layout and on the first hybrid layout."""
    cases = []
    for A, R in layouts(C) if full else layouts(C)[:2]:
        legal = legal_heads_per_stage(main.H, main.G, A)
        if R == 1:
            for U in legal if full else legal[:1]:
                cases.append(Case(main, "upipe", U, A, R, dtype, kernel))
            cases.append(Case(main, "ulysses", None, A, R, dtype, kernel))
            if not full:
                continue
            rep_legal = legal_heads_per_stage(replicated.H, replicated.G, A)
            cases += [Case(replicated, "upipe", rep_legal[0], A, R, dtype, kernel),
                      Case(replicated, "ulysses", None, A, R, dtype, kernel)]
            docs = replace(main, docs=True)
            cases += [Case(docs, "upipe", legal[0], A, R, dtype, kernel),
                      Case(docs, "ulysses", None, A, R, dtype, kernel),
                      Case(docs, "upipe", legal[0], A, R, dtype, kernel, overlap=True)]
            cases += [Case(main, "upipe", U, A, R, dtype, kernel, overlap=True) for U in legal if U < main.H]
        else:
            cases += [Case(main, "upipe", legal[0], A, R, dtype, kernel), Case(main, "ulysses", None, A, R, dtype,
                                                                                 kernel)]
            if full:
                cases.append(Case(main, "upipe", legal[0], A, R, dtype, kernel, overlap=True))
    return cases


# -------------------------------------------------------------------------------------- inputs, reference
def _cu_seqlens(N: int) -> torch.Tensor:
    """Documents of 1, 0 (empty), then 3, 7, 2, 5, ... tokens: short ones, straddling every shard boundary."""
    lengths, pattern = [1, 0], (3, 7, 2, 5, 11, 1)
    while sum(lengths) < N:
        lengths.append(min(pattern[len(lengths) % len(pattern)], N - sum(lengths)))
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)


def inputs(p: Problem, dtype: torch.dtype, seed: int = 0) -> dict:
    """Global tensors rounded to dtype (CPU): x [N, 1, D], w_q [H·d, D], w_k, w_v [G·d, D] (unit-scale logits,
    per-row factors so a wrong row mapping cannot cancel), dout [N, 1, H·d], rope angles, cu_seqlens or None."""
    gen = torch.Generator().manual_seed(seed)

    def rows(n):
        return (torch.randn(n, p.D, generator=gen, dtype=torch.float64) * p.D ** -0.5
                * (0.5 + torch.rand(n, 1, generator=gen, dtype=torch.float64)))

    t = dict(x=torch.randn(p.N, 1, p.D, generator=gen, dtype=torch.float64), w_q=rows(p.H * p.d),
             w_k=rows(p.G * p.d), w_v=rows(p.G * p.d), dout=torch.randn(p.N, 1, p.H * p.d, generator=gen,
                                                                        dtype=torch.float64))
    t = {k: v.to(dtype) for k, v in t.items()}
    t["rope"] = rope_angles(p.N, p.d)
    t["cu_seqlens"] = _cu_seqlens(p.N) if p.docs else None
    return t


def reference(p: Problem, t: dict) -> dict:
    """float64 full-sequence attention on the dtype-rounded inputs: out and the gradients of x, w_q, w_k, w_v."""
    ins = [t[n].double().requires_grad_() for n in ("x", "w_q", "w_k", "w_v")]
    out = reference_attention(*ins, p.H, p.G, t["rope"], True, cu_seqlens=t["cu_seqlens"])
    grads = torch.autograd.grad(out, ins, t["dout"].double())
    return dict(zip(("out", "dx", "dw_q", "dw_k", "dw_v"), (out.detach(), *grads)))


def worst(values) -> float:
    """max that NaN wins (Python's max keeps whichever comes first)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.detach().double().cpu() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


# ------------------------------------------------------------------------------------------------ one rank
def hybrid_groups(A: int, R: int) -> tuple:
    """(a2a group, ring group, a2a rank, ring rank) of this process for A x R ranks: global rank = ring rank · A +
    a2a rank, so each a2a group is A consecutive ranks (one node on Slurm) and each ring group takes one rank from
    every node. Every rank creates every group, in the same order (a collective)."""
    me, mine = dist.get_rank(), {}
    for r in range(R):
        g = dist.new_group([r * A + a for a in range(A)])
        if me // A == r:
            mine["a2a"] = g
    for a in range(A):
        g = dist.new_group([r * A + a for r in range(R)])
        if me % A == a:
            mine["ring"] = g
    return mine["a2a"], mine["ring"], me % A, me // A


def _groups(C: int) -> dict:
    """{(A, R): (a2a group, ring group or None, a2a rank, ring rank)} of this rank for every layout of C ranks;
    every rank creates every group in the same order."""
    me, out = dist.get_rank(), {}
    for A, R in layouts(C):
        out[(A, R)] = (dist.group.WORLD, None, me, 0) if R == 1 else hybrid_groups(A, R)
    return out


def _run_op(case: Case, t: dict, groups: dict, device, overlap: bool):
    """This rank's (out, dx, dw_q, dw_k, dw_v) of the op, the weight gradients still this rank's share."""
    p, (a2a, ring, a, r) = case.problem, groups[(case.A, case.R)]
    pos = local_positions(p.N, a, case.A, r, case.R)
    x = t["x"][pos].to(device).requires_grad_()
    ws = [t[n].to(device).requires_grad_() for n in ("w_q", "w_k", "w_v")]
    kw = dict(num_heads=p.H, num_kv_heads=p.G, cp_group=a2a, rotary_pos_emb=t["rope"].to(device),
              kernel=case.kernel, cu_seqlens=t["cu_seqlens"])
    if case.R > 1:
        kw.update(ring_group=ring, ring_overlap=overlap)
    elif overlap:
        kw["overlap"] = True
    y = (api.ulysses_attention(x, *ws, **kw) if case.strategy == "ulysses" else
         api.upipe_attention(x, *ws, heads_per_stage=case.U, **kw))
    grads = torch.autograd.grad(y, [x, *ws], t["dout"][pos].to(device))
    return [y.detach(), *grads], pos


def _rank_errors(case: Case, got: list, pos, ref: dict) -> dict:
    dws = [g.double() for g in got[2:]]
    for g in dws:  # each rank holds its tokens' share of the weight gradients
        dist.all_reduce(g)
    errs = {"out": _rel(got[0], ref["out"][pos]), "dx": _rel(got[1], ref["dx"][pos])}
    errs.update({n: _rel(g, ref[n]) for n, g in zip(("dw_q", "dw_k", "dw_v"), dws)})
    return errs


def _rank_job(rank: int, C: int, cases: list, data: dict, device) -> list[dict]:
    groups = _groups(C)
    rows = []
    for case in cases:
        t, ref = data[(case.problem, case.dtype)]
        t0 = time.perf_counter()
        row = {}
        try:
            got, pos = _run_op(case, t, groups, device, False)
            if case.overlap:
                overlapped, _ = _run_op(case, t, groups, device, True)
                diffs = [(a.double() - b.double()).abs().max().item() if a.shape == b.shape else math.inf
                         for a, b in zip(overlapped, got)]
                row["bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(overlapped, got))
                row["max_abs_diff"] = worst(diffs)
                got = overlapped
            row["errors"] = _rank_errors(case, got, pos, ref)
            if device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - one case failing must not hide the others (all ranks fail alike)
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
    return rows


def _merge(case: Case, per_rank: list[dict]) -> dict:
    """One JSON row: the case, its errors (max over ranks), ok."""
    row = {"case": case.name, "C": case.A * case.R, "A": case.A, "R": case.R, "strategy": case.strategy,
           "U": case.U or case.problem.H, "H": case.problem.H, "G": case.problem.G, "N": case.problem.N,
           "docs": case.problem.docs, "overlap": case.overlap, "dtype": str(case.dtype).replace("torch.", ""),
           "kernel": case.kernel or "auto", "tol": TOL[case.dtype], "seconds": max(r["seconds"] for r in per_rank)}
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors:
        return {**row, "ok": False, "error": errors[0]}
    errs = {n: worst(r["errors"][n] for r in per_rank) for n in per_rank[0]["errors"]}
    row.update(errors=errs, max_rel_err=worst(errs.values()))
    ok = all(e <= TOL[case.dtype] for e in errs.values())  # NaN fails
    if case.overlap:
        row["bitwise_equal"] = all(r["bitwise_equal"] for r in per_rank)
        row["max_abs_diff"] = worst(r["max_abs_diff"] for r in per_rank)
        ok = ok and row["bitwise_equal"]
    return {**row, "ok": ok}


def _data(cases: list[Case], cache: dict | None = None) -> dict:
    """{(problem, dtype): (inputs, float64 reference)} of `cases`, each computed once (kept in `cache` if given)."""
    data = {} if cache is None else cache
    for case in cases:
        key = (case.problem, case.dtype)
        if key not in data:
            t = inputs(*key)
            data[key] = (t, reference(case.problem, t))
    return data


def check_world(C: int, cases: list[Case], device, timeout_s: float = 300.0, cache: dict | None = None) -> list[dict]:
    """Run `cases` on C threaded ranks (one world); `cache` keeps inputs and references for the next world."""
    data = _data(cases, cache)
    try:
        per_rank = run_threaded(C, _rank_job, cases, data, device, timeout_s=timeout_s)
    except RuntimeError as e:
        why = str(e) if len(str(e)) < 2000 else f"{str(e)[:500]} ... {str(e)[-1500:]}"
        return [{"case": c.name, "C": C, "ok": False, "error": f"the world of {C} ranks failed: {why}"} for c in cases]
    return [_merge(case, [rows[i] for rows in per_rank]) for i, case in enumerate(cases)]


def check_one_rank(cases: list[Case], device) -> list[dict]:
    """`cases` (A = R = 1) in this process on its default group of one rank (already initialised: NCCL on a GPU,
    where the overlapped op's works are NCCL's; gloo on the CPU)."""
    rows = _rank_job(0, 1, cases, _data(cases), device)
    return [_merge(case, [row]) for case, row in zip(cases, rows)]


def inflight_check(group, device, numel: int = 1 << 22, repeats: int = 8) -> dict:
    """comm.py's asynchronous all-to-all (`_all_to_all`, which the op's InFlights wrap; with one rank the op itself
    never calls it) on `group`: the caller's send buffer dropped and memory churned (new allocations, a GEMM queued)
    before wait(); what arrives must equal what was sent, every time."""
    from megatron_upipe.attention.comm import _all_to_all

    equal = []
    for i in range(repeats):
        send = torch.randn(1, numel, device=device)  # [C = 1, numel]
        expect = send.clone()
        flight = _all_to_all(send, group, True)
        del send  # the InFlight keeps it until wait()
        churn = [torch.full((1, numel), float(i), device=device) for _ in range(2)]
        a = torch.randn(1024, 1024, device=device)
        churn.append(a @ a)
        equal.append(torch.equal(flight.wait(), expect))
        del churn
    return {"repeats": repeats, "numel": numel, "ok": all(equal)}


# ------------------------------------------------------------------------------------------------ the check
@dataclass(frozen=True)
class Setup:
    """What runs: the main (GQA) and replicated-KV problems, the C values, and (kernel, dtype) pairs: the first
    gets the full plan, the others the reduced one at the smallest C."""

    main: Problem
    replicated: Problem
    cps: tuple[int, ...]
    kernels: tuple[tuple[str | None, torch.dtype], ...]


def cpu_setup() -> Setup:
    """The --dry-run: tiny shapes on the CPU kernel, float64 (full plan) and float32 (reduced)."""
    return Setup(Problem(16, 4, 8, 32, 32), Problem(8, 2, 8, 32, 32), (4, 8),
                 (("cpu_flash", torch.float64), ("cpu_flash", torch.float32)))


def gpu_setup(device: torch.device) -> tuple[Setup, list[dict]]:
    """bf16 on the automatic kernel (full plan), then every other usable CUDA kernel in bf16 and sdpa_efficient in
    float32 (reduced plan); plus the kernels that cannot run here and why."""
    main = Problem(16, 4, 64, 256, 1024)
    kernels, not_run = [(None, torch.bfloat16)], []
    auto = select_kernel(device, torch.bfloat16, main.d).name
    for name, k in KERNELS.items():
        if k.device_type != "cuda":
            continue
        for dtype in (torch.bfloat16, torch.float32):
            if dtype not in k.dtypes or (name, dtype) == (auto, torch.bfloat16):
                continue
            try:
                select_kernel(device, dtype, main.d, name)
                kernels.append((name, dtype))
            except ValueError as e:
                if dtype == torch.bfloat16:
                    not_run.append({"part": f"kernel {name}", "why": str(e)})
    return Setup(main, Problem(8, 2, 64, 256, 1024), (4, 8), tuple(kernels)), not_run


def run_checks(device: torch.device, setup: Setup, budget_s: float = math.inf, save=None) -> dict:
    """Every world of `setup`: {"threaded_pg": facts, "cases": rows, "skipped": [...], "seconds"}. save(report)
    is called after each world (a run killed at its time limit keeps what it finished)."""
    t_start = time.perf_counter()
    auto = {dt: select_kernel(device, dt, setup.main.d).name for k, dt in setup.kernels if k is None}
    report = {"device": str(device), "threaded_pg": threaded_pg_facts(), "auto_kernel": {str(k): v for k, v in
                                                                                         auto.items()},
              "setup": {"main": asdict(setup.main), "replicated": asdict(setup.replicated), "cps": setup.cps,
                        "kernels": [[k or "auto", str(dt)] for k, dt in setup.kernels]},
              "cases": [], "skipped": []}
    worlds = [(C, plan(C, dt, k, setup.main, setup.replicated, full=True)) for C in setup.cps
              for k, dt in setup.kernels[:1]]
    worlds += [(setup.cps[0], plan(setup.cps[0], dt, k, setup.main, setup.replicated, full=False))
               for k, dt in setup.kernels[1:]]
    cache: dict = {}
    for C, cases in worlds:
        if time.perf_counter() - t_start > budget_s:
            report["skipped"] += [{"case": c.name, "why": "time budget"} for c in cases]
            continue
        left = budget_s - (time.perf_counter() - t_start)
        report["cases"] += check_world(C, cases, device, min(300.0, max(30.0, left + 30.0)), cache)
        report["seconds"] = time.perf_counter() - t_start
        if save is not None:
            save(report)
    report["seconds"] = time.perf_counter() - t_start
    report["ok"] = bool(report["cases"]) and all(r["ok"] for r in report["cases"])
    return report
