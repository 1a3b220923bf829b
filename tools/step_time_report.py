#!/usr/bin/env python
"""Calibrate the step-time model on the paper's Ulysses throughput and predict UPipe's, without refitting.

    python tools/step_time_report.py [--config examples/configs/llama3_8b_upipe_8xh100.yaml] [--json OUT.json]

For Llama3-8B on 8 x H100 (the paper's stack: full recompute with offloaded layer inputs, tiled MLP, chunked loss,
ZeRO-3; our 5M recipe), the planner simulates each length of the paper's table for Ulysses (128K-3M) and UPipe
U = 8 (128K-5M) and counts each step's FLOPs and all-to-all bytes (megatron_upipe/planner/step_time.py). The GEMM
and attention efficiencies are fitted to the paper's Ulysses column (2320, 1504, 879, 475, 246, 162 tokens/s per
GPU); the link constants are the stated ones. The fitted model then predicts UPipe at every length, printed beside
the paper's UPipe column (2281, 1487, 867, 473, 246, 166, 126, 98). About 3 minutes on 2 cores (14 simulations).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_upipe.cli import fail  # noqa: E402
from megatron_upipe.config import ConfigError, validate  # noqa: E402
from megatron_upipe.planner.devices import margins_for, resolve_gpu  # noqa: E402
from megatron_upipe.planner.estimate import ConfigSource, estimate, step_time  # noqa: E402
from megatron_upipe.planner.step_time import HARDWARE, calibrate  # noqa: E402
from megatron_upipe.planner.workers import default_jobs  # noqa: E402

PROG = "step_time_report.py"
K, M = 1024, 1024 * 1024
LENGTHS = [128 * K, 256 * K, 512 * K, 1 * M, 2 * M, 3 * M, 4 * M, 5 * M]
PAPER = {  # tokens/s per GPU, Llama3-8B, 8 x H100 (the paper's throughput table)
    "ulysses": [2320, 1504, 879, 475, 246, 162, None, None],
    "upipe:8": [2281, 1487, 867, 473, 246, 166, 126, 98],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/configs/llama3_8b_upipe_8xh100.yaml")
    p.add_argument("--json", default=None, help="write the counts, the fit and the predictions here")
    p.add_argument("--jobs", type=int, default=default_jobs())
    a = p.parse_args(argv)
    try:
        source = ConfigSource(a.config, ())
        config = source.load()
        world = config.parallel.cp * config.parallel.tp * config.parallel.pp
        plan = validate(config, world)
        if (plan.arch.num_layers, plan.arch.hidden_size, plan.arch.num_attention_heads, world) != (32, 4096, 32, 8):
            raise ConfigError(f"--config {a.config}: the paper's table is Llama3-8B on 8 GPUs; this config is "
                              f"L{plan.arch.num_layers} D{plan.arch.hidden_size} H{plan.arch.num_attention_heads} "
                              f"on {world}")
    except (ConfigError, ValueError) as e:
        return fail(PROG, e)
    gpu = resolve_gpu("h100-80gb")
    margins = margins_for(gpu, world)
    hw = HARDWARE["h100-80gb"]
    vocab = plan.arch.vocab_size or 128256
    rows = {}
    for strategy, paper in PAPER.items():
        for n, tps in zip(LENGTHS, paper):
            if tps is None:
                continue
            est = estimate(source, world, vocab, strategy, n, gpu.total_bytes, margins, jobs=a.jobs)
            rows[(strategy, n)] = (est, tps)
            print(f"  simulated {strategy:>8} @ {n:>8}: GEMM {est.work.get('flops:gemm', 0) / 1e12:9.0f}, attention "
                  f"{est.work.get('flops:attention', 0) / 1e12:10.0f} TFLOP per GPU, all-to-all "
                  f"{est.work.get('bytes:alltoall:nvlink', 0) / 2**30:7.1f} GiB in "
                  f"{est.work.get('calls:alltoall:nvlink', 0)} calls; {est.peak_bytes / 2**30:.1f} GiB "
                  f"{'fits' if est.fits else 'does not fit'}", flush=True)
    samples = [(est.work, n / (world * tps)) for (s, n), (est, tps) in rows.items() if s == "ulysses"]
    fitted = calibrate(samples, hw)
    print(f"\nfitted on the paper's Ulysses column ({len(samples)} lengths): GEMM efficiency "
          f"{fitted.gemm_efficiency:.3f} ({fitted.gemm_efficiency * fitted.peak_flops / 1e12:.0f} TFLOP/s), attention "
          f"efficiency {fitted.attention_efficiency:.3f} ({fitted.attention_efficiency * fitted.peak_flops / 1e12:.0f} "
          f"TFLOP/s); stated links: NVLink {hw.nvlink_bytes_per_s / 1e9:.0f} GB/s per GPU, {hw.latency_s * 1e6:.0f} us "
          f"per call\n")
    table = []
    print("| tokens | Ulysses paper | Ulysses model (fit) | UPipe U=8 paper | UPipe U=8 model (predicted) | model / paper |")
    print("|---|---|---|---|---|---|")
    for i, n in enumerate(LENGTHS):
        out = {"tokens": n}
        for strategy in PAPER:
            if (strategy, n) in rows:
                est, tps = rows[(strategy, n)]
                t = step_time(est, world, fitted)
                out[strategy] = {"paper": tps, "model": t.tokens_per_s_per_gpu, "seconds": t.seconds,
                                 "parts": t.parts, "work": est.work, "fits": est.fits}
        table.append(out)
        u, p_ = out.get("ulysses"), out["upipe:8"]
        u_paper, u_model = (u["paper"], f"{u['model']:.0f}") if u else ("OOM", "-")
        print(f"| {n:,} | {u_paper} | {u_model} | {p_['paper']} | {p_['model']:.0f} | "
              f"{p_['model'] / p_['paper']:.3f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": a.config, "hardware": {**fitted.__dict__}, "stated": {**hw.__dict__},
                       "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    from megatron_upipe.console import quiet_third_party

    quiet_third_party(cuda=False, tool=True)  # the known-harmless notices only (megatron-core is imported in main())
    sys.exit(main())
