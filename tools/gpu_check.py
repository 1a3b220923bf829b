#!/usr/bin/env python
"""The one short GPU check, run by tools/gpu_check.sh on a lent GPU (at most 8 minutes on one GPU).

1. kernels: which CUDA attention kernels this machine can run (library versions, or why not), each one against
   the float64 reference at the kernel interface (GQA heads, sequence-first views as the stage loop passes them);
2. numerics: UPipe (U = 1, 4) and Ulysses through every usable kernel at C = 1, bf16 (H 8, H_kv 2, d 128, D 512,
   N 1024): the natural-weight API, and grouped views of one fused QKV weight with W_O and the fused input RMSNorm
   in both grad_accum modes, against float64 reference attention (attention/reference.py) + RMSNorm + W_O;
3. memory: one Llama3-8B attention layer (H 32, H_kv 8, d 128, D 4096, C = 1) forward + backward, UPipe U = 8,
   16 and Ulysses, at three lengths for the automatically chosen kernel (the middle one for the others):
   torch.cuda.max_memory_allocated vs the tracked peak (PeakMemoryTracker, what the planner simulates) vs the
   closed-form model (memory_accounting/attention_model.py); measured - tracked is the kernel's workspace, fitted per kernel
   as constant + bytes per element of the call's query block [b, N, m, d];
4. length-independent terms: CUDA context and library handles (device memory used minus torch's reserved pool),
   a one-rank NCCL communicator, allocator fragmentation (reserved vs allocated peaks, expandable_segments);
5. speed constants of the step-time model: bf16 GEMM TFLOP/s at Llama3-8B's shapes, and one layer's attention
   fwd+bwd at 128K (C = 1) for Ulysses and UPipe U = 1 and 16 with its TFLOP/s (the kernel cost of staging).
Writes gpu_check.json (everything) and gpu_calibration.json into --out, and prints a table. Exit status 0 when
every numerics check passes and no tracked peak exceeds the model; 1 otherwise; 2 without a CUDA device.
`--dry-run` prints the plan (kernels, shapes, lengths, the model's peaks) on any machine, without a GPU.

gpu_calibration.json, the planner's calibration (megatron_upipe/planner/devices.py `read_calibration` reads it
from examples/plans/gpu_calibration.json: review the numbers, then merge the entry into that file):
    {"<GPU name as in planner.devices.GPUS, e.g. h200; else the device name as a slug>": {
        "device": str,                  # torch.cuda.get_device_name()
        "total_bytes": int,             # torch.cuda.mem_get_info()[1], what the driver reports
        "cuda_context_bytes": int,      # used device memory outside torch's allocator, after every kernel ran
        "fragmentation": float,         # max over the memory runs of reserved peak / allocated peak - 1
        "nccl_one_rank_bytes": int,     # a one-rank NCCL communicator after all_reduce + all_to_all (a floor:
                                        # peers and channels of a multi-GPU job add more; not measurable here)
        "workspace": {"<kernel>": {"constant_bytes": int, "bytes_per_q_element": float}},
        "measured_with": {"torch": str, "cuda": str, "cudnn": int, "kernels": {name: str}, "lengths": [int],
                          "date": str, "tool": "tools/gpu_check.py"}}}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_upipe.attention import api  # noqa: E402
from megatron_upipe.attention.kernels import (  # noqa: E402
    KERNELS, KernelCall, kernel_backward, kernel_forward, select_kernel,
)
from megatron_upipe.attention.reference import reference_attention, rope_angles  # noqa: E402
from megatron_upipe.attention.schedule import make_schedule  # noqa: E402
from megatron_upipe.memory_accounting.attention_model import AttentionShape, attention_memory  # noqa: E402

CUDA_KERNELS = [n for n, k in KERNELS.items() if k.device_type == "cuda"]
TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-10}
LLAMA = dict(H=32, G=8, d=128, D=4096)  # Llama3-8B attention
MEMORY_CASES = (("upipe", 8), ("upipe", 16), ("ulysses", None))


@dataclass(frozen=True)
class NumericsShape:
    H: int = 8
    G: int = 2
    d: int = 128
    D: int = 512
    N: int = 1024
    b: int = 1


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.detach().double().cpu() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


# ----------------------------------------------------------------------------------------------- kernels
def kernel_status(device: torch.device, dtype: torch.dtype, names=CUDA_KERNELS, call: KernelCall | None = None):
    """{name: (usable, library version or the reason it cannot run)} as the op's selection sees it."""
    out = {}
    for name in names:
        k = KERNELS[name]
        try:
            select_kernel(device, dtype, LLAMA["d"], name, call=call)
            api_ = k.library() if k.library is not None else None
            out[name] = (True, api_.describe() if api_ is not None else f"torch {torch.__version__}")
        except ValueError as e:
            out[name] = (False, str(e))
    return out


def kernel_numerics(names, device, dtype=torch.bfloat16, N=1000, d=128) -> list[dict]:
    """Each kernel at its interface vs float64: GQA 4/2 heads as sequence-first views, causal and not."""
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv = 2, 4, 2
    inputs = [torch.randn(N, b, h, d, generator=gen).to(dtype).permute(1, 2, 0, 3) for h in (hq, hkv, hkv, hq)]
    refs = {}
    for causal in (True, False):  # float64 reference on the dtype-rounded inputs, once per mask
        qq, kk, vv = (t.double().requires_grad_() for t in inputs[:3])
        s = (qq @ kk.repeat_interleave(hq // hkv, 1).transpose(-1, -2)) * d ** -0.5
        if causal:
            s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.softmax(s, -1) @ vv.repeat_interleave(hq // hkv, 1)
        refs[causal] = (ref.detach(), *torch.autograd.grad(ref, (qq, kk, vv), inputs[3].double()))
    rows = []
    for name in names:
        kernel = KERNELS[name] if isinstance(name, str) else name
        q, k, v, do = (t.to(device) for t in inputs)  # [b, h, N, d] views of [N, b, h, d]
        for causal in (True, False):
            try:
                out, lse, aux = kernel_forward(kernel, q, k, v, causal, d ** -0.5)
                dq, dk, dv = kernel_backward(kernel, do, q, k, v, out, lse, aux, causal, d ** -0.5)
                got = (out, dq, dk, dv)
                errs = [_rel(a, r) for a, r in zip(got, refs[causal])]
                shapes_ok = all(a.shape == r.shape for a, r in zip(got, refs[causal]))
                rows.append({"kernel": kernel.name, "causal": causal, "max_rel_err": max(errs), "errors": errs,
                             "ok": shapes_ok and max(errs) < TOL[dtype]})
            except Exception as e:  # noqa: BLE001 - one kernel failing must not hide the others
                rows.append({"kernel": kernel.name, "causal": causal, "ok": False, "error": f"{type(e).__name__}: {e}"})
    return rows


# --------------------------------------------------------------------------------------------- numerics
def _reference(x, norm_w, wq, wk, wv, w_o, sh: NumericsShape, freqs, eps):
    """float64: RMSNorm (when norm_w) -> reference attention -> W_O (when w_o)."""
    h = x
    if norm_w is not None:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w
    out = reference_attention(h, wq, wk, wv, sh.H, sh.G, freqs)  # [N, b, H·d]
    return out @ w_o.t() if w_o is not None else out


def op_numerics(names, device, dtype=torch.bfloat16, sh: NumericsShape = NumericsShape(), eps=1e-5) -> list[dict]:
    """UPipe/Ulysses at C = 1 through each kernel against the float64 reference (see the module docstring)."""
    gen = torch.Generator().manual_seed(1)
    H, G, d, D, N, b = sh.H, sh.G, sh.d, sh.D, sh.N, sh.b
    g = H // G
    x = torch.randn(N, b, D, generator=gen, dtype=torch.float64)
    wq, wk, wv = (torch.randn(n * d, D, generator=gen, dtype=torch.float64) * D ** -0.5 for n in (H, G, G))
    w_o = torch.randn(D, H * d, generator=gen, dtype=torch.float64) * (H * d) ** -0.5
    norm_w = 1 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64)
    freqs = rope_angles(N, d)
    cases = {}
    for variant in ("natural", "fused"):  # the float64 reference on the dtype-rounded inputs, once per variant
        fused = variant == "fused"
        ins = [t.to(dtype) for t in (x, wq, wk, wv)] + ([t.to(dtype) for t in (w_o, norm_w)] if fused else [])
        ref_in = [t.double().requires_grad_() for t in ins]
        ref = _reference(ref_in[0], ref_in[5] if fused else None, *ref_in[1:4], ref_in[4] if fused else None,
                         sh, freqs, eps)
        dy = torch.randn(ref.shape, generator=gen, dtype=torch.float64).to(dtype)
        cases[variant] = (ins, ref.detach(), dy, torch.autograd.grad(ref, ref_in, dy.double()))
    rows = []
    for kernel in names:  # names, or kernel objects
        for strategy, U in (("upipe", 1), ("upipe", 4), ("ulysses", None)):
            for variant, grad_accum in (("natural", "fp32"), ("fused", "fp32"), ("fused", "input")):
                ins, ref, dy, ref_grads = cases[variant]
                row = {"kernel": getattr(kernel, "name", kernel), "strategy": strategy, "U": U or H,
                       "variant": variant, "grad_accum": grad_accum}
                try:
                    dev = [t.to(device).requires_grad_() for t in ins]
                    rope = freqs.to(device)
                    if variant == "fused":  # grouped views of one fused QKV weight [G, g + 2, d, D], as the model
                        qkv = torch.cat([dev[1].detach().view(G, g, d, D), dev[2].detach().view(G, 1, d, D),
                                         dev[3].detach().view(G, 1, d, D)], 1).requires_grad_()
                        kw = dict(cp_group=None, rotary_pos_emb=rope, kernel=kernel, grad_accum=grad_accum,
                                  w_o=dev[4], norm_w=dev[5], norm_eps=eps)
                        views = (qkv[:, :g], qkv[:, g], qkv[:, g + 1])
                        out = (api.ulysses_attention_grouped(dev[0], *views, **kw) if U is None else
                               api.upipe_attention_grouped(dev[0], *views, heads_per_stage=U, **kw))
                        gx, gqkv, gwo, gnorm = torch.autograd.grad(out, [dev[0], qkv, dev[4], dev[5]], dy.to(device))
                        got = [gx, gqkv[:, :g].reshape(H * d, D), gqkv[:, g].reshape(G * d, D),
                               gqkv[:, g + 1].reshape(G * d, D), gwo, gnorm]
                    else:
                        kw = dict(num_heads=H, num_kv_heads=G, cp_group=None, rotary_pos_emb=rope, kernel=kernel)
                        out = (api.ulysses_attention(*dev, **kw) if U is None else
                               api.upipe_attention(*dev, heads_per_stage=U, **kw))
                        got = list(torch.autograd.grad(out, dev, dy.to(device)))
                    errs = [_rel(out, ref)] + [_rel(a, r) for a, r in zip(got, ref_grads)]
                    rows.append({**row, "max_rel_err": max(errs), "errors": errs, "ok": max(errs) < TOL[dtype]})
                except Exception as e:  # noqa: BLE001 - recorded, the other cases still run
                    rows.append({**row, "ok": False, "error": f"{type(e).__name__}: {e}"})
    return rows


# ---------------------------------------------------------------------------------------------- memory
def memory_case(N: int, strategy: str, U: int | None):
    """(AttentionShape, U for the model, per-call query heads m, KV heads w) of one Llama3-8B layer at C = 1."""
    H, G, d, D = LLAMA["H"], LLAMA["G"], LLAMA["d"], LLAMA["D"]
    sched = make_schedule(H, G, 1, H if strategy == "ulysses" else U)
    w = sched.stages[0].kv_slots[1] - sched.stages[0].kv_slots[0]
    return AttentionShape(N, 1, D, H, G, d, 1, 2), U, sched.q_per_rank, w


def model_peak(N: int, strategy: str, U: int | None, native_gqa: bool) -> int:
    shape, U, _, _ = memory_case(N, strategy, U)
    return attention_memory(shape, U, strategy == "ulysses", native_gqa=native_gqa).peak_bytes


def planner_workspace_formula(N: int, m: int, w: int, b: int = 1, d: int = 128) -> int:
    """planner/estimate.py `flash_workspace_bytes` for one call: fp32 dq accumulator [b, N, m, d], fp32 row
    statistic [b, m, N], and bf16 dK/dV expanded to the m query heads when m > w."""
    return b * N * m * d * 4 + b * m * N * 4 + (2 * b * N * m * d * 2 if m > w else 0)


def memory_run(kernel: str, N: int, strategy: str, U: int | None) -> dict:
    """One layer's forward + backward on the GPU: measured (allocator) vs tracked vs model bytes."""
    from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker

    H, G, d, D = LLAMA["H"], LLAMA["G"], LLAMA["d"], LLAMA["D"]
    shape, _, m, w = memory_case(N, strategy, U)
    x = torch.randn(N, 1, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ws = [(torch.randn(n * d, D, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_() for n in (H, G, G)]
    dout = torch.randn(N, 1, H * d, device="cuda", dtype=torch.bfloat16)
    freqs = rope_angles(N, d).cuda()
    kw = dict(num_heads=H, num_kv_heads=G, cp_group=None, rotary_pos_emb=freqs, kernel=kernel)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with PeakMemoryTracker() as mem:
        out = api.upipe_attention(x, *ws, heads_per_stage=U, **kw) if U else api.ulysses_attention(x, *ws, **kw)
        grads = torch.autograd.grad(out, [x, *ws], dout)
        del out, grads
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    stats = torch.cuda.memory_stats()
    measured = torch.cuda.max_memory_allocated() - base
    model = model_peak(N, strategy, U, KERNELS[kernel].native_gqa)
    return {"kernel": kernel, "strategy": strategy, "U": U or H, "N": N, "m": m, "w": w, "seconds": seconds,
            "measured_bytes": measured, "tracked_bytes": mem.peak_bytes, "model_bytes": model,
            "excess_bytes": measured - mem.peak_bytes, "q_elements": N * m * d,
            "planner_workspace_bytes": planner_workspace_formula(N, m, w),
            "reserved_peak_bytes": stats.get("reserved_bytes.all.peak", 0),
            "allocated_peak_bytes": stats.get("allocated_bytes.all.peak", 0),
            "ok": mem.peak_bytes <= 1.01 * model}


# ---------------------------------------------------------------------------------------------- stage timing
TIMING_CASES = (("ulysses", None), ("upipe", 1), ("upipe", 16))  # C = 1: U = C and U = H/2 of Llama3-8B


def median_cuda_seconds(run, iters: int) -> float:
    """Median of `iters` CUDA-event timings of run() after one warm-up; its result is freed after each timing."""
    times = []
    for it in range(1 + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = run()
        end.record()
        torch.cuda.synchronize()
        del result
        if it:
            times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def stage_timing(kernel: str, N: int = 131072, iters: int = 3) -> list[dict]:
    """The kernel cost of staging, isolated: one Llama3-8B layer's attention forward + backward at C = 1 (no
    communication) for Ulysses, UPipe U = C = 1 and U = H/2 = 16, median of `iters` CUDA-event timings after one
    warm-up, each with its ratio to Ulysses (measured in this one run)."""
    H, G, d, D = LLAMA["H"], LLAMA["G"], LLAMA["d"], LLAMA["D"]
    x = torch.randn(N, 1, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ws = [(torch.randn(n * d, D, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_() for n in (H, G, G)]
    dout = torch.randn(N, 1, H * d, device="cuda", dtype=torch.bfloat16)
    kw = dict(num_heads=H, num_kv_heads=G, cp_group=None, rotary_pos_emb=rope_angles(N, d).cuda(), kernel=kernel)

    def layer(U):  # one forward + backward; the result is dropped after timing
        out = api.upipe_attention(x, *ws, heads_per_stage=U, **kw) if U else api.ulysses_attention(x, *ws, **kw)
        return out, torch.autograd.grad(out, [x, *ws], dout)

    rows = [{"kernel": kernel, "strategy": strategy, "U": U or H, "N": N,
             "seconds": median_cuda_seconds(lambda: layer(U), iters)} for strategy, U in TIMING_CASES]
    base = rows[0]["seconds"]
    flops = layer_attention_flops(N)
    for r in rows:
        r["ratio_vs_ulysses"] = r["seconds"] / base
        r["flops"] = flops
        r["tflop_per_s"] = sum(flops.values()) / r["seconds"] / 1e12
    return rows


def layer_attention_flops(N: int) -> dict[str, float]:
    """FLOPs of one Llama3-8B attention layer's forward + backward at C = 1 (what stage_timing times): the causal
    kernel (forward 2·N²·H·d, i.e. two N×N×d products per head at half density; backward 2.5× forward: five
    products) and the Q/K/V projections (forward 2·N·D·(H + 2·H_kv)·d, backward twice that)."""
    H, G, d, D = LLAMA["H"], LLAMA["G"], LLAMA["d"], LLAMA["D"]
    fwd = 2.0 * N * N * H * d
    proj = 2.0 * N * D * (H + 2 * G) * d
    return {"attention_kernel": 3.5 * fwd, "qkv_projections": 3.0 * proj}


def gemm_rate(shapes=((131072, 4096, 14336), (131072, 14336, 4096), (131072, 4096, 6144)), iters: int = 5) -> list[dict]:
    """Achieved bf16 TFLOP/s of the MLP and fused-QKV GEMMs of Llama3-8B at 128K tokens ([M, K] @ [K, N]), median of
    `iters` CUDA-event timings after one warm-up: the compute constant of the step-time model."""
    rows = []
    for M, K, N in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        t = median_cuda_seconds(lambda: a @ b, iters)
        rows.append({"M": M, "K": K, "N": N, "seconds": t, "tflop_per_s": 2.0 * M * K * N / t / 1e12})
        del a, b
    torch.cuda.empty_cache()
    return rows


def fit_workspace(rows: list[dict]) -> dict[str, dict]:
    """Per kernel, least squares excess_bytes = constant + slope · q_elements over its memory runs."""
    out = {}
    for kernel in sorted({r["kernel"] for r in rows}):
        pts = [(r["q_elements"], r["excess_bytes"]) for r in rows if r["kernel"] == kernel]
        n = len(pts)
        mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
        var = sum((p[0] - mx) ** 2 for p in pts)
        slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / var if var else (my / mx if mx else 0.0)
        out[kernel] = {"constant_bytes": int(round(my - slope * mx)) if var else 0, "bytes_per_q_element": slope,
                       "runs": n}
    return out


def fragmentation(rows: list[dict]) -> float:
    """max over runs of reserved peak / allocated peak - 1 (the allocator's slack over live tensors)."""
    fr = [r["reserved_peak_bytes"] / r["allocated_peak_bytes"] - 1 for r in rows if r.get("allocated_peak_bytes")]
    return max(0.0, max(fr)) if fr else 0.0


# ------------------------------------------------------------------------------------ constant terms
def outside_allocator_bytes() -> int:
    """Device memory in use that torch's caching allocator does not hold (context, library handles, NCCL)."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def nccl_one_rank_bytes() -> dict:
    """Device memory a one-rank NCCL communicator adds once it has run an all_reduce and an all_to_all."""
    import torch.distributed as dist

    try:
        torch.cuda.synchronize()
        before = outside_allocator_bytes()
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        o = torch.empty_like(t)
        dist.all_to_all_single(o, t)
        torch.cuda.synchronize()
        after = outside_allocator_bytes()
        dist.destroy_process_group()
        return {"bytes": after - before}
    except Exception as e:  # noqa: BLE001 - recorded; the rest of the check does not depend on it
        return {"bytes": None, "error": f"{type(e).__name__}: {e}"}


def gpu_key(device_name: str, total_bytes: int) -> str:
    """The planner's name for this GPU (planner.devices.GPUS, matched by reported capacity within 0.5%), else
    the device name as a slug."""
    from megatron_upipe.planner.devices import GPUS

    near = [g.name for g in GPUS.values() if abs(g.total_bytes - total_bytes) <= 0.005 * g.total_bytes]
    return near[0] if len(near) == 1 else device_name.lower().replace(" ", "-")


def calibration_entry(device: str, total: int, context: int, frag: float, nccl: int | None, workspace: dict,
                      measured_with: dict) -> dict:
    return {gpu_key(device, total): {"device": device, "total_bytes": total, "cuda_context_bytes": int(context),
                                     "fragmentation": round(frag, 4), "nccl_one_rank_bytes": nccl,
                                     "workspace": workspace, "measured_with": measured_with}}


# ------------------------------------------------------------------------------------------------ main
def plan_text(lengths: list[int]) -> str:
    """What the check will run, with the model's peaks (works without a GPU)."""
    lines = ["gpu_check plan",
             f"kernels: {', '.join(CUDA_KERNELS)} (each if usable; the automatic choice gets all lengths)",
             f"numerics: {NumericsShape()} bf16, UPipe U=1,4 and Ulysses, natural API and fused (grouped views + "
             f"W_O + input norm, grad_accum fp32/input), tolerance {TOL[torch.bfloat16]}",
             f"memory: Llama3-8B layer {LLAMA} C=1 at N = {lengths}; model peaks (GiB, native GQA / expanded):"]
    for N in lengths:
        for strategy, U in MEMORY_CASES:
            nat, exp_ = (model_peak(N, strategy, U, g) / 2 ** 30 for g in (True, False))
            lines.append(f"  {strategy:>7} U={U or LLAMA['H']:>2} N={N:>7}: {nat:6.2f} / {exp_:6.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for gpu_check.json and "
                   "gpu_calibration.json (default $OUT or .)")
    p.add_argument("--lengths", type=int, nargs=3, default=[65536, 131072, 262144], metavar="N",
                   help="three sequence lengths for the memory runs (default 64K 128K 256K)")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting memory runs after this many "
                   "seconds (default 420; gpu_check.sh passes its part's time limit GPU_CHECK_S - 30)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the model's peaks; no GPU needed")
    a = p.parse_args(argv)
    if any(n <= 0 for n in a.lengths):
        p.error(f"--lengths {a.lengths}: the lengths must be positive")
    if a.dry_run:
        print(plan_text(a.lengths))
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); use --dry-run here",
              file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    os.makedirs(a.out, exist_ok=True)
    torch.ones(1, device="cuda")
    context_at_start = outside_allocator_bytes()
    cuda, dtype = torch.device("cuda"), torch.bfloat16
    N0 = a.lengths[0]
    call = KernelCall(1, *memory_case(N0, "upipe", 8)[2:], N0)  # one UPipe stage's call at the first length
    status = kernel_status(cuda, dtype, call=call)
    usable = [n for n, (ok, _) in status.items() if ok]
    report = {"device": torch.cuda.get_device_name(), "total_bytes": torch.cuda.mem_get_info()[1],
              "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
              "kernels": {n: {"usable": ok, "detail": why} for n, (ok, why) in status.items()}}

    def save() -> None:  # after every section: a run killed at its time limit still leaves what it measured
        report["seconds"] = time.perf_counter() - t_start
        with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)

    save()
    report["kernel_numerics"] = kernel_numerics(usable, cuda)
    save()
    report["numerics"] = op_numerics(usable, cuda)
    save()
    report["nccl_one_rank"] = nccl_one_rank_bytes()
    auto = select_kernel(cuda, dtype, LLAMA["d"], None, call=call).name
    report["auto_kernel"] = auto
    try:
        report["gemm"] = gemm_rate()
    except Exception as e:  # noqa: BLE001 - recorded; the rest goes ahead
        report["gemm"] = [{"error": f"{type(e).__name__}: {e}"}]
        torch.cuda.empty_cache()
    save()
    try:
        report["stage_timing"] = stage_timing(auto, a.lengths[1])
    except Exception as e:  # noqa: BLE001 - recorded; the memory runs still go ahead
        report["stage_timing"] = [{"kernel": auto, "error": f"{type(e).__name__}: {e}"}]
        torch.cuda.empty_cache()
    save()
    runs = [(auto, N, s, U) for N in a.lengths for s, U in MEMORY_CASES]
    runs += [(k, a.lengths[1], s, U) for k in usable if k != auto for s, U in MEMORY_CASES]
    mem_rows, skipped = [], []
    for kernel, N, strategy, U in runs:
        if time.perf_counter() - t_start > a.budget_s:
            skipped.append({"kernel": kernel, "N": N, "strategy": strategy, "U": U, "why": "time budget"})
            continue
        try:
            mem_rows.append(memory_run(kernel, N, strategy, U))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at the longest length: recorded
            skipped.append({"kernel": kernel, "N": N, "strategy": strategy, "U": U, "why": f"{type(e).__name__}: {e}"})
            torch.cuda.empty_cache()
        report["memory"], report["memory_skipped"] = mem_rows, skipped
        save()
    report["memory"], report["memory_skipped"] = mem_rows, skipped
    workspace = fit_workspace(mem_rows) if mem_rows else {}
    context = max(context_at_start, outside_allocator_bytes())
    report["constant_terms"] = {"cuda_context_bytes_at_start": context_at_start, "cuda_context_bytes": context,
                                "fragmentation": fragmentation(mem_rows), "workspace_fit": workspace}
    save()
    if mem_rows:
        measured_with = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                         "kernels": {n: d["detail"] for n, d in report["kernels"].items() if d["usable"]},
                         "lengths": a.lengths, "date": time.strftime("%Y-%m-%d"), "tool": "tools/gpu_check.py"}
        entry = calibration_entry(report["device"], report["total_bytes"], context, fragmentation(mem_rows),
                                  report["nccl_one_rank"]["bytes"], workspace, measured_with)
        with open(os.path.join(a.out, "gpu_calibration.json"), "w") as f:
            json.dump(entry, f, indent=1)
    print(summary(report))
    ok = all(r["ok"] for r in report["kernel_numerics"] + report["numerics"] + mem_rows)
    return 0 if ok and usable else 1


def summary(report: dict) -> str:
    lines = [f"{report['device']}: torch {report['torch']}, CUDA {report['cuda']}, cuDNN {report['cudnn']}; "
             f"auto kernel {report.get('auto_kernel')}"]
    for n, k in report["kernels"].items():
        lines.append(f"  {n:>14}: {'usable' if k['usable'] else 'no'} ({k['detail']})")
    lines.append(f"{'kernel':>14} {'case':>34} {'rel err':>9} ok")
    for r in report["kernel_numerics"]:
        lines.append(f"{r['kernel']:>14} {'kernel causal=' + str(r['causal']):>34} "
                     f"{r.get('max_rel_err', math.nan):>9.2e} {r['ok']} {r.get('error', '')}")
    for r in report["numerics"]:
        case = f"{r['strategy']} U={r['U']} {r['variant']} {r['grad_accum']}"
        lines.append(f"{r['kernel']:>14} {case:>34} {r.get('max_rel_err', math.nan):>9.2e} {r['ok']} "
                     f"{r.get('error', '')}")
    lines.append(f"{'kernel':>14} {'strategy':>8} {'U':>3} {'N':>7} {'measured':>9} {'tracked':>8} {'model':>8} "
                 f"{'excess/q':>8} {'s':>6} (GiB)")
    for r in report["memory"]:
        lines.append(f"{r['kernel']:>14} {r['strategy']:>8} {r['U']:>3} {r['N']:>7} {r['measured_bytes'] / 2**30:>9.2f} "
                     f"{r['tracked_bytes'] / 2**30:>8.2f} {r['model_bytes'] / 2**30:>8.2f} "
                     f"{r['excess_bytes'] / r['q_elements']:>8.2f} {r['seconds']:>6.2f}")
    for r in report["memory_skipped"]:
        lines.append(f"  skipped {r}")
    for r in report.get("gemm", []):
        lines.append(f"gemm {r}")
    for r in report.get("stage_timing", []):
        lines.append(f"stage timing {r}")
    c = report["constant_terms"]
    lines.append(f"context {c['cuda_context_bytes'] / 2**30:.2f} GiB, fragmentation {c['fragmentation']:.3f}, "
                 f"NCCL one rank {report['nccl_one_rank']}, {report['seconds']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
