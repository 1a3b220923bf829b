#!/usr/bin/env bash
# CPU demo: the tiny Llama of examples/configs/tiny_cpu.yaml on the shipped corpus, UPipe over cp=2, 2 gloo ranks.
# About 2 minutes on 2 cores; prints the loss every 10 steps (8.3 -> about 5.3) and the eval loss every 50.
#   bash examples/run_cpu_demo.sh                    # fresh run in runs/tiny_cpu_demo (removed first)
#   bash examples/run_cpu_demo.sh train.steps=50     # any section.key=value override
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/tiny_cpu_demo}
TORCHRUN=$([ -x .venv/bin/torchrun ] && echo .venv/bin/torchrun || echo torchrun)

launch=( --nproc-per-node 2 --master-port "${MASTER_PORT:-29517}" )
config=( --config examples/configs/tiny_cpu.yaml )
run=( checkpoint.dir="$RUN_DIR/checkpoints" log.metrics_file="$RUN_DIR/metrics.jsonl" log.tensorboard_dir="$RUN_DIR/tb" )

rm -rf "$RUN_DIR"
start=$(date +%s)
OMP_NUM_THREADS=1 "$TORCHRUN" "${launch[@]}" pretrain_llama.py "${config[@]}" "${run[@]}" "$@"
echo "demo finished in $(( $(date +%s) - start )) s; metrics: $RUN_DIR/metrics.jsonl, tensorboard: $RUN_DIR/tb"
