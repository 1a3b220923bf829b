# GPU image: NGC PyTorch (CUDA, cuDNN, NCCL, torch, TransformerEngine, apex) plus megatron_upipe.
#
#   docker build -t megatron_upipe .
#   docker run --gpus all --ipc=host --rm -v $PWD/runs:/workspace/megatron_upipe/runs megatron_upipe \
#     bash examples/torchrun_single_node.sh
#   # Slurm with pyxis/enroot: the batch script resolves the config on the host (.venv or PYTHON), srun runs here:
#   SRUN_EXTRA_ARGS="--container-image=IMAGE --container-mounts=$PWD:/workspace/megatron_upipe" \
#     sbatch examples/slurm/llama3_8b_upipe_8xh100.sbatch
#
# megatron-core 0.19.2 needs Python >= 3.12: any NGC PyTorch 25.01 or newer; choose one whose CUDA your driver runs
# (--build-arg BASE_IMAGE=...). Untested here: no registry access where this was written.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.04-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/megatron_upipe

# The base image's torch, TransformerEngine, apex, triton and numpy stay: megatron-core goes in without its
# dependencies, and nothing else here depends on torch. This layer survives code edits.
RUN pip install --no-cache-dir --no-deps megatron-core==0.19.2 \
 && pip install --no-cache-dir "packaging>=24.2" einops psutil pyyaml tqdm sentencepiece tokenizers tensorboard wandb

COPY . .
# Editable, so a checkout mounted over /workspace/megatron_upipe is the code that runs. The dry run needs no GPU.
RUN pip install --no-cache-dir --no-deps -e . \
 && python pretrain_llama.py --config examples/configs/llama3_8b_upipe_8xh100.yaml --dry-run --world-size 8

ENV PYTHONUNBUFFERED=1
