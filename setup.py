"""Packaging for megatron_upipe (see README.md for why each dependency is there)."""

from setuptools import find_packages, setup

setup(
    name="megatron_upipe",
    version="0.1.0",
    description="UPipe (Untied Ulysses) headwise-chunked context parallelism for megatron-core",
    packages=find_packages(include=["megatron_upipe", "megatron_upipe.*"]),
    python_requires=">=3.12",
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.19.2",
        # megatron-core 0.19.2 imports these at run time without declaring them.
        "triton; platform_system == 'Linux'",
        "einops",
        "psutil",
        "numpy",
        "pyyaml",
        "tqdm",
        "sentencepiece",
        "tokenizers",
        "safetensors",  # HF checkpoints: tools/convert_hf_llama.py and checkpoint.load=HF_DIR
        "tensorboard",
        "matplotlib",  # the memory planner's plot
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3", "transformers>=4.45"],  # xdist: two workers on 2 cores
        "wandb": ["wandb"],
        "gpu": ["flash-attn"],
        "te": ["transformer-engine[pytorch]"],
    },
)
