#!/usr/bin/env bash
# The one prepared script for a lent GPU (device tool): parts run one after another, each under its own time limit
# (seconds, below; override by environment, 0 skips a part) so one failing part leaves the others' results. The
# limits add up to 480 s = 8 minutes on one H100/H200 (training counted twice); measured on the lent H200: part 1
# 73 s, part 5 2 x ~95 s; parts 2-4 and 6 have not run on a GPU yet.
# 1. tools/gpu_check.py (GPU_CHECK_S=110): which CUDA attention kernels run here and their numerics against the
#    float64 reference (kernel interface; UPipe/Ulysses with the natural API and with grouped views + W_O + fused
#    input norm in both grad_accum modes), bf16 GEMM rates, the kernel cost of staging (one Llama3-8B layer fwd+bwd
#    at 128K, C = 1: Ulysses vs UPipe U = 1 and U = 16), one layer's peak memory at three lengths (measured vs
#    tracked vs the memory model) and the length-independent terms (CUDA context, one-rank NCCL, fragmentation) as
#    a calibration file for the planner. See tools/gpu_check.py.
# 2. multi-rank ops on real CUDA kernels (GPU_MULTIRANK_S=60): C = 4 and 8 ranks as threads of one process on this
#    GPU (torch's threaded process group; P2P and late-delivered async all-to-alls added): UPipe at every legal U,
#    Ulysses, KV replication, packed documents, hybrid a2a x ring, overlapped stages and ring passes (bit for bit
#    against the serial op), forward and backward, against float64. tools/gpu_check_multirank.py threaded.
# 3. the overlapped op on a real NCCL communicator of world size 1 (GPU_ONE_RANK_S=20; TORCH_NCCL_DESYNC_DEBUG,
#    TORCH_NCCL_NAN_CHECK): comm.py's async all-to-all, and overlap=True at C = 1 bit for bit against serial.
# 4. part 3's smallest case under compute-sanitizer memcheck, if installed (GPU_SANITIZER_S=35).
# 5. a training run on this one GPU (killed at GPU_TRAIN_S=105, each of two runs): tools/gpu_check_train.yaml
#    (four Llama3-8B layers at 128K tokens with the long recipes' memory stack, checkpoints offloaded on side
#    streams with CUDA_LAUNCH_BLOCKING=0, UPipe at cp=1, memory.plan_check), then the same with Ulysses: the
#    planner's prediction beside torch.cuda.max_memory_allocated, and the step times;
# 6. the pytest tests that run only where CUDA is (GPU_PYTEST_S=45; tests/test_gpu_training.py, the CUDA kernels
#    of test_kernels.py).
# Results so far: docs/gpu_results.md.
#   bash tools/gpu_check.sh [gpu_check.py options]     # results in $OUT (or .): gpu_check.json,
#                                                     # gpu_calibration.json, gpu_multirank.json (parts 2-4),
#                                                     # train_*.log, train_*_metrics.jsonl, pytest_gpu.log
#   bash tools/gpu_check.sh --dry-run                  # any machine, CI: part 1's plan, parts 2 and 3 on the CPU
# Nothing is downloaded: the device machine has no network. It needs a Python with torch (CUDA); megatron-core for
# part 5 comes from the Python's packages or from wheels carried in .whl/ (installed into /tmp/site); flash-attn and
# TransformerEngine are checked when importable.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True CUDA_LAUNCH_BLOCKING=0
OUT="${OUT:-.}"
mkdir -p "$OUT"
GPU_CHECK_S=${GPU_CHECK_S:-110}
GPU_MULTIRANK_S=${GPU_MULTIRANK_S:-60}
GPU_ONE_RANK_S=${GPU_ONE_RANK_S:-20}
GPU_SANITIZER_S=${GPU_SANITIZER_S:-35}
GPU_TRAIN_S=${GPU_TRAIN_S:-105}
GPU_PYTEST_S=${GPU_PYTEST_S:-45}

find_python() {  # $1: the Python test that must pass
  for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
    if [ -n "$cand" ] && "$cand" -c "$1" 2>/dev/null; then echo "$cand"; return 0; fi
  done
  return 1
}

if [ "${1:-}" = --dry-run ]; then  # no GPU: what part 1 would run, and parts 2-3 on the CPU (gloo, cpu_flash)
  PY=$(find_python 'import torch') || { echo "gpu_check.sh --dry-run: no Python with torch; set PYTHON" >&2; exit 2; }
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" tools/gpu_check.py "$@" || exit $?
  timeout 60 "$PY" tools/gpu_check_multirank.py --dry-run --out "$OUT"
  exit $?
fi

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
PY=$(find_python 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)') || {
  echo "gpu_check.sh: no Python with torch and a visible CUDA device (tried \$PYTHON, .venv/bin/python, python3);" \
    "set PYTHON" >&2
  exit 2
}
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_check.sh: $PY ($("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)'))"
"$PY" -c 'import megatron.core as m; print("megatron-core", m.__version__)' || echo "gpu_check.sh: no megatron-core"
echo "gpu_check.sh: time limits (s): check $GPU_CHECK_S, multirank $GPU_MULTIRANK_S, one-rank $GPU_ONE_RANK_S," \
  "sanitizer $GPU_SANITIZER_S, train 2 x $GPU_TRAIN_S, pytest $GPU_PYTEST_S"

rc=0
exec 3>&1  # part's verdict goes to the script's stdout even when the part's output goes to a log
part() {  # name, time limit (s), command...: run it under its limit (0: skipped), report its exit status
  local name=$1 limit=$2; shift 2
  [ "$limit" -gt 0 ] || { echo "$name: skipped (time limit 0)" >&3; return 0; }
  timeout "$limit" "$@"
  local prc=$?
  echo "$name: exit $prc$([ $prc -eq 124 ] && echo " (killed at its $limit s limit)")" >&3
  [ $prc -eq 0 ] || rc=1
}
# 1.
part gpu_check.py "$GPU_CHECK_S" "$PY" tools/gpu_check.py --out "$OUT" --budget-s "$(( GPU_CHECK_S - 30 ))" "$@"
# 2.-4. each its own process: the threaded process group and NCCL cannot share a process's default group
part multirank "$GPU_MULTIRANK_S" "$PY" tools/gpu_check_multirank.py threaded --out "$OUT" \
  --budget-s "$(( GPU_MULTIRANK_S - 15 ))"
part one-rank "$GPU_ONE_RANK_S" "$PY" tools/gpu_check_multirank.py one-rank --out "$OUT"
part sanitizer "$GPU_SANITIZER_S" "$PY" tools/gpu_check_multirank.py sanitizer --out "$OUT" \
  --timeout-s "$(( GPU_SANITIZER_S - 5 ))"

train() {  # 5. name, overrides...
  local name=$1; shift
  local dir="runs/gpu_check_train_$name"
  rm -rf "$dir"
  part "train $name" "$GPU_TRAIN_S" "$PY" -m torch.distributed.run --nproc-per-node 1 --master-port 29533 \
    pretrain_llama.py --config tools/gpu_check_train.yaml log.metrics_file="$dir/metrics.jsonl" "$@" \
    >"$OUT/train_$name.log" 2>&1
  tail -n 25 "$OUT/train_$name.log"
  cp "$dir/metrics.jsonl" "$OUT/train_${name}_metrics.jsonl" 2>/dev/null || true
}
if [ "$GPU_TRAIN_S" -gt 0 ]; then
  train upipe
  [ "${GPU_TRAIN_ULYSSES:-1}" = 0 ] || train ulysses parallel.cp_strategy=ulysses parallel.upipe_heads_per_stage=null
fi

# 6. the tests that run only where CUDA is
part "pytest (CUDA tests)" "$GPU_PYTEST_S" "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_training.py \
  tests/test_kernels.py >"$OUT/pytest_gpu.log" 2>&1
[ "$GPU_PYTEST_S" -gt 0 ] && tail -n 5 "$OUT/pytest_gpu.log"
exit $rc
