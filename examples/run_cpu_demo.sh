#!/usr/bin/env bash
# CPU demo: the tiny Llama of examples/configs/tiny_cpu.yaml on the shipped corpus, UPipe over cp=2, 2 gloo ranks.
# About 2 minutes on 2 cores; prints the loss every 10 steps (8.3 -> about 5.4) and the eval loss every 50.
#   bash examples/run_cpu_demo.sh                    # a run in runs/tiny_cpu_demo (resumed if it is there)
#   bash examples/run_cpu_demo.sh train.steps=400    # any section.key=value override; here: extend that run
#   RUN_DIR=runs/demo2 bash examples/run_cpu_demo.sh # a new run beside it
# A previous run is never deleted: its RUN_DIR is resumed from its latest checkpoint ("nothing to do" when it already
# reached train.steps); choose another RUN_DIR for a fresh one.
# On a fresh clone it first builds .venv with tools/setup_env.sh (Python >= 3.12; a few minutes, once).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/tiny_cpu_demo}

# The environment: .venv with torchrun, megatron-core and this checkout's package, else (re)build it.
venv_ok() {
  [ -x .venv/bin/torchrun ] && .venv/bin/python - "$PWD" <<'PY' 2>/dev/null
import importlib.util, os, sys
spec = importlib.util.find_spec("megatron_upipe")
ok = spec is not None and os.path.realpath(spec.origin).startswith(os.path.realpath(sys.argv[1]) + os.sep)
sys.exit(0 if ok and all(importlib.util.find_spec(m) for m in ("torch", "megatron.core", "sentencepiece")) else 1)
PY
}
if ! venv_ok; then
  echo "run_cpu_demo.sh: no usable .venv here: building it with tools/setup_env.sh (first run only)" >&2
  bash tools/setup_env.sh
fi

launch=( --nproc-per-node 2 --master-port "${MASTER_PORT:-29517}" )
config=( --config examples/configs/tiny_cpu.yaml )
run=( checkpoint.dir="$RUN_DIR/checkpoints" log.metrics_file="$RUN_DIR/metrics.jsonl" log.tensorboard_dir="$RUN_DIR/tb" )

# Refuse a bad override here, in one line, rather than on both ranks under torchrun.
.venv/bin/python pretrain_llama.py "${config[@]}" "${run[@]}" "$@" --dry-run --world-size 2 --check-machine >/dev/null

if [ -f "$RUN_DIR/checkpoints/latest" ]; then
  echo "run_cpu_demo.sh: $RUN_DIR holds a run: resuming it (set RUN_DIR for a new run)" >&2
fi
start=$(date +%s)
OMP_NUM_THREADS=1 .venv/bin/torchrun "${launch[@]}" pretrain_llama.py "${config[@]}" "${run[@]}" "$@"
echo "demo finished in $(( $(date +%s) - start )) s; metrics: $RUN_DIR/metrics.jsonl, tensorboard: $RUN_DIR/tb"
