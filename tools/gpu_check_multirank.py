#!/usr/bin/env python
"""The multi-rank parts of the one prepared GPU check (tools/gpu_check.sh), each run as its own process.

  threaded   C = 4 and 8 ranks as threads of this process on the one GPU (torch's threaded process group, with
             P2P and late-delivered async all-to-alls added: megatron_upipe/benchmarks/multirank_check.py):
             UPipe at every legal U, Ulysses, KV replication, packed documents, hybrid a2a x ring layouts, UPipe's
             overlapped stages and the ring's overlapped passes (bit for bit against the serial op), forward and
             backward, against float64 full-sequence attention; bf16 on the automatic kernel, then every other
             usable CUDA kernel (and float32 on sdpa_efficient) on fewer cases.
  one-rank   a real NCCL communicator of world size 1 (TORCH_NCCL_DESYNC_DEBUG, TORCH_NCCL_NAN_CHECK,
             TORCH_DISTRIBUTED_DEBUG=DETAIL set unless given): comm.py's async all-to-all with its send buffer
             dropped and memory churned before wait(), and the op at C = 1 with overlap=True against the serial op
             bit for bit and float64. At C = 1 the op's all-to-alls return their input without calling NCCL, so
             this checks the pipelined stage order on real kernels; the C > 1 async path is in `threaded`.
  sanitizer  `one-rank --small` under compute-sanitizer memcheck (PYTORCH_NO_CUDA_MEMORY_CACHING=1, so a freed
             buffer is really freed), if compute-sanitizer is found; else recorded as not run.
Every part merges its section into --out/gpu_multirank.json (one file: the device tool brings back 8 files at most)
and exits 0 when its checks pass (or a part could not run, which the JSON says), 1 when one fails, 2 without CUDA.
`--dry-run` runs `threaded` and `one-rank` on the CPU instead (cpu_flash, float64 and float32, tiny shapes, gloo
for the one rank) in under 30 s: CI's proof of these code paths (tests/test_gpu_check_multirank.py).
  python tools/gpu_check_multirank.py threaded --out $OUT --budget-s 50
  python tools/gpu_check_multirank.py --dry-run --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from megatron_upipe.attention.schedule import legal_heads_per_stage  # noqa: E402
from megatron_upipe.benchmarks import multirank_check as mc  # noqa: E402

JSON_NAME = "gpu_multirank.json"
NCCL_ENV = {"TORCH_NCCL_DESYNC_DEBUG": "1", "TORCH_NCCL_NAN_CHECK": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "NCCL_DEBUG": "WARN"}
NOT_RUN = [  # item 7 (c)-(e) of issue #23: what this script does not run, and why
    {"part": "offload streams in a training step",
     "why": "not a separate part: gpu_check.sh's training part (tools/gpu_check_train.yaml, offload_checkpoints "
            "on its side streams) runs with CUDA_LAUNCH_BLOCKING=0 and checks loss and peak memory, not bits "
            "against offload off (no time left in the 8 minutes)"},
    {"part": "Megatron-FSDP on one rank", "why": "no time left in the 8 minutes for another training launch"},
    {"part": "TransformerEngine / flash-attn",
     "why": "run by `threaded` as kernels te_fused / flash_attn when importable; see threaded.not_run"},
]


def update_json(out_dir: str, key: str, value) -> None:
    """Set `key` of out_dir/gpu_multirank.json (created if missing), written whole through a temporary file."""
    path = os.path.join(out_dir, JSON_NAME)
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        report = {}
    report[key] = value
    report["not_run"] = NOT_RUN
    os.makedirs(out_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def threaded(out: str, device: torch.device, budget_s: float, key: str = "threaded") -> bool:
    if device.type == "cuda":
        setup, not_run = mc.gpu_setup(device)
    else:
        setup, not_run = mc.cpu_setup(), []

    def save(report):
        update_json(out, key, {**report, "not_run": not_run})

    report = mc.run_checks(device, setup, budget_s, save)
    save(report)
    print(f"{key}: {len(report['cases'])} cases in {report['seconds']:.1f} s, {len(report['skipped'])} skipped "
          f"(time budget), all ok: {report['ok']}")
    for r in report["cases"]:
        if not r["ok"] or r is report["cases"][0]:
            print(f"  {r['case']}: max rel err {r.get('max_rel_err')}, bitwise {r.get('bitwise_equal', '-')}, "
                  f"ok {r['ok']} {r.get('error', '')[:300]}")
    return report["ok"]


def one_rank_cases(device: torch.device, small: bool) -> list[mc.Case]:
    """UPipe at C = 1 with overlap, every U with more than one stage, plain and packed (the smallest U). small (for
    the sanitizer, where every kernel is slow): the largest such U (two stages) at a quarter of the length."""
    setup = mc.cpu_setup() if device.type == "cpu" else mc.gpu_setup(device)[0]
    main = setup.main if not small else replace(setup.main, N=setup.main.N // 4)
    dtype, kernel = setup.kernels[0][1], setup.kernels[0][0]
    us = [u for u in legal_heads_per_stage(main.H, main.G, 1) if u < main.H]
    us = us[-1:] if small else us
    cases = [mc.Case(main, "upipe", u, 1, 1, dtype, kernel, overlap=True) for u in us]
    return cases + [mc.Case(replace(main, docs=True), "upipe", us[0], 1, 1, dtype, kernel, overlap=True)]


def one_rank(out: str, device: torch.device, small: bool, key: str = "one_rank") -> bool:
    import torch.distributed as dist

    t0 = time.perf_counter()
    backend = "nccl" if device.type == "cuda" else "gloo"
    env = {}
    if backend == "nccl":
        for k, v in NCCL_ENV.items():
            env[k] = os.environ.setdefault(k, v)
        dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG is read when torch.distributed is imported
    env["CUDA_LAUNCH_BLOCKING"] = os.environ.get("CUDA_LAUNCH_BLOCKING", "")
    report = {"backend": backend, "world_size": 1, "env": env,
              "note": "at C = 1 the op's all-to-alls return their input without calling the backend (comm.py); "
                      "inflight checks comm's async all-to-all itself; the op's cases check the pipelined stage "
                      "order (overlap=True) bit for bit against the serial op"}
    try:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        report["inflight"] = mc.inflight_check(dist.group.WORLD, device, 1 << (16 if device.type == "cpu" else 24),
                                               repeats=4 if small else 8)
        report["cases"] = mc.check_one_rank(one_rank_cases(device, small), device)
        report["ok"] = report["inflight"]["ok"] and all(r["ok"] for r in report["cases"])
    except Exception as e:  # noqa: BLE001 - recorded
        report.update(ok=False, error=f"{type(e).__name__}: {e}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    report["seconds"] = time.perf_counter() - t0
    update_json(out, key, report)
    print(f"{key} ({backend}): inflight {report.get('inflight')}, {len(report.get('cases', []))} cases, ok "
          f"{report['ok']} {report.get('error', '')}")
    for r in report.get("cases", []):
        print(f"  {r['case']}: max rel err {r.get('max_rel_err')}, bitwise {r.get('bitwise_equal')}, ok {r['ok']}")
    return report["ok"]


def find_sanitizer() -> str | None:
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.access(p, os.X_OK)), None)


def sanitizer(out: str, timeout_s: float) -> bool:
    """`one-rank --small` under compute-sanitizer memcheck; the report says what it found (or why it did not run)."""
    exe = find_sanitizer()
    if exe is None:
        update_json(out, "sanitizer", {"ran": False, "why": "compute-sanitizer not found (PATH, /usr/local/cuda/bin)"})
        print("sanitizer: compute-sanitizer not found: not run")
        return True
    cmd = [exe, "--tool", "memcheck", "--leak-check", "no", "--report-api-errors", "no", "--error-exitcode", "9",
           "--print-limit", "20", sys.executable, os.path.abspath(__file__), "one-rank", "--small", "--out", out,
           "--key", "one_rank_sanitized"]
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        rc, text = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = None, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    counts = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
    found = rc == 9 or any(counts)  # memcheck's own verdict (the sanitized run's checks are in one_rank_sanitized)
    report = {"ran": True, "command": " ".join(cmd[:11]) + " ... one-rank --small", "rc": rc,
              "timed_out": rc is None, "memcheck_errors": sum(counts) if counts else None, "tail": text[-3000:],
              "seconds": time.perf_counter() - t0,
              "ok": None if rc is None and not found else not found}  # None: timed out before any verdict
    update_json(out, "sanitizer", report)
    print(f"sanitizer: rc {rc}, memcheck errors {report['memcheck_errors']}, {report['seconds']:.0f} s")
    return not found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("part", nargs="?", default="all", choices=["all", "threaded", "one-rank", "sanitizer"],
                   help="which part (default all; gpu_check.sh runs each as its own process)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help=f"directory of {JSON_NAME} (default $OUT or .)")
    p.add_argument("--budget-s", type=float, default=120.0, help="threaded: start no world after this many seconds")
    p.add_argument("--timeout-s", type=float, default=60.0, help="sanitizer: kill the sanitized run after this")
    p.add_argument("--small", action="store_true",
                   help="one-rank: two stages at a quarter of the length (for the sanitizer)")
    p.add_argument("--key", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="threaded and one-rank on the CPU (gloo), tiny shapes")
    a = p.parse_args(argv)
    if a.dry_run:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("gpu_check_multirank: no CUDA device visible; use --dry-run here", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    ok = True
    if a.part in ("all", "threaded"):
        ok &= threaded(a.out, device, a.budget_s)
    if a.part in ("all", "one-rank"):
        ok &= one_rank(a.out, device, a.small, a.key or "one_rank")
    if a.part in ("all", "sanitizer"):
        if a.dry_run:
            update_json(a.out, "sanitizer", {"ran": False, "why": "--dry-run"})
        else:
            ok &= sanitizer(a.out, a.timeout_s)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
