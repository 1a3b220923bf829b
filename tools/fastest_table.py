#!/usr/bin/env python
"""The fastest stack that fits, per length, beside three fixed stacks: a table, a plot and the JSON behind them.

    python tools/fastest_table.py [--config examples/configs/llama3_8b_upipe_8xh100.yaml] [--world-size 8]
        [--lengths 131072 524288 1048576 2097152 4194304] [--out examples/plans/fastest_llama3_8b_8xh100]

For each length, with the planner and the step-time model (H100 constants; predictions, not measurements):
- UPipe's fastest stack that fits (`tools/estimate_memory.py --fastest`) and, under `baseline`, the config's own
  stack (for the long recipes: full recompute, offload, tiles, ZeRO-3) at that length;
- Ulysses' fastest stack that fits (the same search with parallel.cp_strategy=ulysses);
- an ALST-like stack: Ulysses with full recompute, offloaded layer inputs, a tiled MLP and loss and ZeRO-3
  (ALST: Ulysses + activation checkpoint offload + tiled MLP on DeepSpeed ZeRO-3).
Writes OUT.json, OUT.md (the table) and OUT.png. Several minutes per length on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from megatron_upipe.cli import ArgumentParser, positive_int  # noqa: E402

ALST = ["parallel.cp_strategy=ulysses", "parallel.upipe_heads_per_stage=null", "memory.recompute=full",
        "memory.offload_checkpoints=true", "memory.offload_prefetch=false", "memory.mlp_chunks=32",
        "memory.loss_chunks=256", "memory.shard_model_states=true", "memory.upipe_overlap=false"]


def _estimate(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "estimate_memory.py"), *args, "--json",
                               out], capture_output=True, text=True)
        if proc.returncode == 2:
            return {"refused": proc.stderr.strip().splitlines()[-1]}
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        with open(out) as f:
            return json.load(f)


def _fixed(config: str, world: int, n: int, overrides: list[str]) -> dict:
    """One stack's plan and time at n tokens, in --fastest's figures."""
    got = _estimate(["--config", config, "--world-size", str(world), *overrides, f"train.seq_length={n}"])
    if "refused" in got:
        return got
    (r,) = got["results"]
    t = r.get("step_time") or {}
    return {"overrides": overrides, "fits": r["fits"], "peak_bytes": r["peak_bytes"],
            "host_bytes_per_node": r["host_bytes_per_node"], "step_time_s": t.get("seconds"),
            "tokens_per_s_per_gpu": t.get("tokens_per_s_per_gpu")}


def main(argv=None) -> int:
    p = ArgumentParser(prog="fastest_table.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/configs/llama3_8b_upipe_8xh100.yaml")
    p.add_argument("--world-size", type=positive_int, default=8)
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[131072, 524288, 1048576, 2097152, 4194304])
    p.add_argument("--out", default="examples/plans/fastest_llama3_8b_8xh100")
    a = p.parse_args(argv)
    rows = []
    for n in a.lengths:
        base = ["--config", a.config, "--world-size", str(a.world_size), "--fastest", "--seq-length", str(n)]
        row = {"tokens": n, "upipe": _estimate(base), "ulysses": _estimate(base + ["parallel.cp_strategy=ulysses",
                                                                                   "parallel.upipe_heads_per_stage=null"]),
               "alst_like": _fixed(a.config, a.world_size, n, ALST)}
        rows.append(row)
        print(json.dumps({"tokens": n, **{k: (v.get("tokens_per_s_per_gpu") if "refused" not in v else "refused")
                                           for k, v in row.items() if k != "tokens"}}), flush=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"config": a.config, "world_size": a.world_size, "rows": rows}, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(table(rows))
    plot(rows, a.out + ".png", f"{os.path.basename(a.config)} on {a.world_size} x H100 (step-time model)")
    return 0


def _cell(d: dict | None) -> str:
    if d is None or "refused" in d or not d.get("fits"):
        return "does not fit"
    return f"{d['tokens_per_s_per_gpu']:,.0f} ({d['peak_bytes'] / 2**30:.1f} GiB)"


def _stack(d: dict) -> str:
    if "refused" in d:
        return "nothing fits"
    o = {k: v for k, _, v in (x.partition("=") for x in d["overrides"])}
    parts = [f"U={o['parallel.upipe_heads_per_stage']}" if "parallel.upipe_heads_per_stage" in o else "Ulysses"]
    parts.append({"true": "pipelined", "outputs": "outputs drained"}.get(o.get("memory.upipe_overlap"), ""))
    if o.get("memory.recompute") == "full" and o.get("memory.recompute_layers", "null") != "null":
        parts.append(f"recompute {o['memory.recompute_layers']} layers")
    else:
        parts.append({"none": "no recompute", "full": "full recompute"}.get(o.get("memory.recompute"), ""))
    if o.get("memory.offload_checkpoints") == "true":
        parts.append("offload" + (" (prefetched)" if o.get("memory.offload_prefetch") == "true" else ""))
    if o.get("memory.mlp_chunks", "1") != "1":
        parts.append("tiles")
    if o.get("memory.shard_model_states") == "true":
        parts.append("ZeRO-3")
    return ", ".join(p for p in parts if p)


def table(rows: list[dict]) -> str:
    lines = ["| tokens | UPipe fastest: stack | tokens/s/GPU (GiB) | MFU | the recipe's stack | Ulysses fastest | "
             "ALST-like |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        u = r["upipe"]
        mfu = f"{u['mfu']:.1%}" if "refused" not in u else "-"
        lines.append(f"| {r['tokens']:,} | {_stack(u)} | {_cell(u)} | {mfu} | {_cell(u.get('baseline'))} | "
                     f"{_cell(r['ulysses'])}{'' if 'refused' in r['ulysses'] else ': ' + _stack(r['ulysses'])} | "
                     f"{_cell(r['alst_like'])} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    series = {"UPipe fastest": lambda r: r["upipe"], "recipe's stack": lambda r: r["upipe"].get("baseline"),
              "Ulysses fastest": lambda r: r["ulysses"], "ALST-like": lambda r: r["alst_like"]}
    for name, get in series.items():
        pts = [(r["tokens"] / 2**20, get(r)["tokens_per_s_per_gpu"]) for r in rows
               if get(r) and "refused" not in get(r) and get(r).get("fits")]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per sequence (M)")
    ax.set_ylabel("tokens/s per GPU (predicted)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
