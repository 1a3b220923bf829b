#!/usr/bin/env python
"""One short GPU check (run by tools/gpu_check.sh on a lent GPU; CI never has one).

1. Numerics: every CUDA attention kernel available, and UPipe/Ulysses through it (C = 1, bf16), against the
   float64 reference at a small length.
2. Memory: one UPipe layer (smallest U and two more) and one Ulysses layer, forward + backward, at a few
   lengths: `torch.cuda.max_memory_allocated` against the closed-form model of the tracked buffers. The excess is
   the attention kernels' workspace, which the tracker cannot see; it is written as the calibration JSON
   (bytes per element of the stage's [b, N, m, d] query block) that the planner's workspace term can be checked
   against.
Prints a table last; writes gpu_check.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_upipe.attention import KERNELS, legal_heads_per_stage, make_schedule  # noqa: E402
from megatron_upipe.attention.api import ulysses_attention, upipe_attention  # noqa: E402
from megatron_upipe.attention.reference import reference_attention, rope_angles  # noqa: E402
from megatron_upipe.memory.attention_model import AttentionShape, attention_memory  # noqa: E402


def numerics(kernels: list[str]) -> list[dict]:
    H, G, d, D, N = 8, 2, 128, 512, 1024
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 1, D, generator=gen)
    ws = [torch.randn(n * d, D, generator=gen) / D ** 0.5 for n in (H, G, G)]
    dout = torch.randn(N, 1, H * d, generator=gen)
    freqs = rope_angles(N, d)
    ref_in = [t.double().requires_grad_() for t in (x, *ws)]
    ref = reference_attention(*ref_in, H, G, freqs)
    ref_g = torch.autograd.grad(ref, ref_in, dout.double())
    rows = []
    for name in kernels:
        for strategy in ("upipe", "ulysses"):
            ins = [t.cuda().bfloat16().requires_grad_() for t in (x, *ws)]
            kw = dict(num_heads=H, num_kv_heads=G, cp_group=None, rotary_pos_emb=freqs.cuda(), kernel=name)
            out = upipe_attention(*ins, heads_per_stage=2, **kw) if strategy == "upipe" else ulysses_attention(*ins, **kw)
            grads = torch.autograd.grad(out, ins, dout.cuda().bfloat16())
            errs = [((a.double().cpu() - b).norm() / b.norm()).item() for a, b in zip((out, *grads), (ref, *ref_g))]
            rows.append({"kernel": name, "strategy": strategy, "max_rel_err": max(errs), "ok": max(errs) < 3e-2})
    return rows


def memory(kernel: str, lengths: list[int]) -> list[dict]:
    H, G, d, D = 32, 8, 128, 4096  # Llama3-8B attention, one GPU (C = 1)
    rows = []
    for N in lengths:
        shape = AttentionShape(N, 1, D, H, G, d, 1, 2)
        for strategy, U in [("ulysses", None)] + [("upipe", u) for u in legal_heads_per_stage(H, G, 1)[:3]]:
            x = torch.randn(N, 1, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            ws = [(torch.randn(n * d, D, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_() for n in (H, G, G)]
            dout = torch.randn(N, 1, H * d, device="cuda", dtype=torch.bfloat16)
            freqs = rope_angles(N, d).cuda()
            kw = dict(num_heads=H, num_kv_heads=G, cp_group=None, rotary_pos_emb=freqs, kernel=kernel)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            out = upipe_attention(x, *ws, heads_per_stage=U, **kw) if U else ulysses_attention(x, *ws, **kw)
            grads = torch.autograd.grad(out, [x, *ws], dout)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            measured = torch.cuda.max_memory_allocated() - base
            del out, grads
            model = attention_memory(shape, U, ulysses=U is None)
            sched = make_schedule(H, G, 1, U or H)
            q_block = N * sched.q_per_rank * d  # elements of one stage's [b, N, m, d]
            rows.append({"kernel": kernel, "strategy": strategy, "U": U or H, "N": N, "measured_bytes": measured,
                         "model_bytes": model.peak_bytes, "excess_bytes": measured - model.peak_bytes,
                         "excess_bytes_per_q_element": (measured - model.peak_bytes) / q_block, "seconds": seconds})
            del x, ws, dout
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--lengths", type=int, nargs="*", default=[65536, 131072, 262144])
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    kernels = [k for k, v in KERNELS.items() if v.device_type == "cuda"]
    usable = []
    for k in kernels:
        try:
            from megatron_upipe.attention.kernels import select_kernel

            select_kernel(torch.device("cuda"), torch.bfloat16, 128, k)
            usable.append(k)
        except ValueError as e:
            print(f"skip kernel {k}: {e}")
    num = numerics(usable)
    mem = memory("flash_attn" if "flash_attn" in usable else "sdpa_flash", a.lengths)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "numerics": num, "memory": mem}
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"{'kernel':>14} {'strategy':>8} {'rel err':>9} ok")
    for r in num:
        print(f"{r['kernel']:>14} {r['strategy']:>8} {r['max_rel_err']:>9.2e} {r['ok']}")
    print(f"{'strategy':>8} {'U':>3} {'N':>7} {'measured GiB':>12} {'model GiB':>9} {'excess/q-elem':>13} {'s':>6}")
    for r in mem:
        print(f"{r['strategy']:>8} {r['U']:>3} {r['N']:>7} {r['measured_bytes'] / 2**30:>12.2f} "
              f"{r['model_bytes'] / 2**30:>9.2f} {r['excess_bytes_per_q_element']:>13.2f} {r['seconds']:>6.2f}")
    return 0 if all(r["ok"] for r in num) else 1


if __name__ == "__main__":
    sys.exit(main())
