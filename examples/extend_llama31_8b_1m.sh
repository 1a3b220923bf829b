#!/bin/bash
# Extend a pretrained HF Llama-3.1-8B to 1M tokens on one node of 8 GPUs: HF in -> continued pretraining with
# UPipe -> HF out. Every step is one of the project's tools; each step is skipped when its output exists.
#
#   HF_DIR=/models/Llama-3.1-8B CORPUS=/data/long_docs.jsonl bash examples/extend_llama31_8b_1m.sh [key=value ...]
#
# Environment:
#   HF_DIR      local HF Llama-3.1-8B directory (config.json, *.safetensors, tokenizer.json); nothing is downloaded
#   CORPUS      JSON lines with one document per line under "text" (JSON_KEY to change), long documents preferred
#   WORK        where the converted weights, token files and the run go (default: runs/llama31_8b_1m)
#   CONFIG      the training recipe (default: examples/configs/llama3.1_8b_extend_1m_8xh100.yaml)
#   WORKERS     tokenizer processes (default: 16); NPROC_PER_NODE, VENV, PYTHON: as examples/torchrun_single_node.sh
# Arguments are config overrides for the training step (e.g. train.steps=100). The steps:
#   1. tools/convert_hf_llama.py hf-to-mcore: HF weights -> $WORK/hf_converted (loads into any tp/pp/cp layout)
#   2. tools/preprocess_data.py with the model's own HF tokenizer -> $WORK/data/corpus_text_document.{bin,idx}
#   3. examples/torchrun_single_node.sh with checkpoint.load=$WORK/hf_converted (weights only: optimizer and LR
#      schedule start fresh), data.path / data.tokenizer set to the above, checkpoints in $WORK/checkpoints
#   4. tools/convert_hf_llama.py mcore-to-hf of the last checkpoint -> $WORK/hf_extended (transformers loads it)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ "$VENV" != none ] && [ -f "$VENV/bin/activate" ]; then source "$VENV/bin/activate"; fi
PYTHON=${PYTHON:-python}
: "${HF_DIR:?set HF_DIR to a local HF Llama-3.1-8B directory}"
: "${CORPUS:?set CORPUS to a JSON-lines corpus (one document per line)}"
if [ ! -f "$HF_DIR/config.json" ]; then
  echo "error: HF_DIR=$HF_DIR has no config.json: give a local HF model directory" >&2
  exit 2
fi
if [ ! -f "$CORPUS" ]; then
  echo "error: CORPUS=$CORPUS is not a file" >&2
  exit 2
fi
WORK=${WORK:-runs/llama31_8b_1m}
CONFIG=${CONFIG:-examples/configs/llama3.1_8b_extend_1m_8xh100.yaml}
mkdir -p "$WORK/data"

if [ ! -f "$WORK/hf_converted/upipe_model.json" ]; then
  "$PYTHON" tools/convert_hf_llama.py hf-to-mcore --hf "$HF_DIR" --out "$WORK/hf_converted"
fi
if [ ! -f "$WORK/data/corpus_text_document.idx" ]; then
  "$PYTHON" tools/preprocess_data.py --input "$CORPUS" --json-key "${JSON_KEY:-text}" --tokenizer "$HF_DIR" \
    --output-prefix "$WORK/data/corpus" --workers "${WORKERS:-16}"
fi
RUN_DIR="$WORK/run" CONFIG="$CONFIG" bash examples/torchrun_single_node.sh \
  "data.path=$WORK/data/corpus_text_document" "data.tokenizer=$HF_DIR" "checkpoint.load=$WORK/hf_converted" \
  "checkpoint.dir=$WORK/checkpoints" "$@"
"$PYTHON" tools/convert_hf_llama.py mcore-to-hf --ckpt "$WORK/checkpoints" --out "$WORK/hf_extended"
