"""Convert checkpoints between HF transformers (Llama, Qwen2/2.5, Qwen3) and megatron_upipe.

    python tools/convert_hf_llama.py hf-to-mcore --hf /path/to/hf_model --out /path/to/ckpt
    python tools/convert_hf_llama.py mcore-to-hf --ckpt CKPT --out /path/to/hf_model [--dtype auto|float32|bfloat16]
        [--model-type llama|qwen2|qwen3]

hf-to-mcore reads a local HF directory (config.json + safetensors, sharded or not, or pytorch_model.bin; never a
Hub name: nothing is downloaded) of a LlamaForCausalLM (RoPE default/linear/llama3/yarn, tied or untied
embeddings), Qwen2ForCausalLM (q/k/v biases) or Qwen3ForCausalLM (QK-norm), and writes a megatron-core
dist_checkpointing checkpoint of the model only, with `upipe_model.json` (the model shape, vocabulary, dtype) and the
HF tokenizer files. Give it to pretrain_llama.py as `checkpoint.load=CKPT` with matching model.* settings (any
tp/pp/cp/dp layout, DDP or memory.shard_model_states=true): weights only, a fresh optimizer and LR schedule; the
RoPE settings may be changed for a long-context extension (model.rotary_base=..., model.rope_scaling=...).
Every tensor is mapped: one without a counterpart, a missing one, or an unsupported setting (another model_type,
dynamic/longrope RoPE, Llama biases, sliding windows) is refused, named, before any weight is read.

mcore-to-hf exports a converted checkpoint, or any training checkpoint (a run directory with `latest`, or an
iter_XXXXXXX directory): "dist_checkpointing" saved in any layout (the model part is loaded into one process), or
"fsdp_per_rank" (memory.shard_model_states=true: its layout is relaunched on this machine's CPU, one process per
saved rank, and gathered). The output loads with transformers' AutoModelForCausalLM.from_pretrained: config.json of
the family (qk_norm -> qwen3, qkv_bias -> qwen2, else llama; or --model-type), safetensors in the checkpoint's
dtype (--dtype float32 on a bf16 run: the fp32 main weights where the checkpoint keeps them, see
megatron_upipe/checkpoint/hf_export.py), and the tokenizer when known (the converted checkpoint's files, the run's
HF data.tokenizer, the run's sentencepiece .model as tokenizer.model + a LlamaTokenizer tokenizer_config.json, or
with mock data the files of the checkpoint.load it started from), which transformers' AutoTokenizer loads.

Runs on CPU. --out must be a new or empty directory. Bad input ends in one line, exit 2, before any weight is read:
also a damaged input (a truncated or garbage safetensors, .bin, .distcp or .metadata file), named with the fix. The
end is one summary line ("wrote HF qwen3 model, N tensors, 15.0 GiB, ... to DIR": the bytes written).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_upipe.checkpoint.hf_families import FAMILIES  # noqa: E402
from megatron_upipe.checkpoint.sources import META_FILE, TRAIN_META, CheckpointError, find_checkpoint  # noqa: E402
from megatron_upipe.cli import ArgumentParser, fail  # noqa: E402

PROG = "convert_hf_llama.py"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def input_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, checked before any weight is read (configs and file headers only)."""
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        return f"--out {args.out} exists and is not an empty directory: give a new or empty directory"
    if args.direction == "hf-to-mcore":
        if not (Path(args.hf) / "config.json").is_file():
            return (f"--hf {args.hf}: no config.json there: give a local HF Llama, Qwen2 or Qwen3 directory "
                    f"(save_pretrained output)")
        from megatron_upipe.checkpoint.hf_import import inspect_hf_dir

        try:
            inspect_hf_dir(args.hf)
        except (OSError, ValueError) as e:
            return f"--hf {args.hf}: {_one_line(e)}"
        return None
    ckpt = Path(args.ckpt)
    try:
        is_training = find_checkpoint(ckpt) is not None
    except CheckpointError as e:
        return f"--ckpt {args.ckpt}: {_one_line(e)}"
    if not is_training and not (ckpt / META_FILE).is_file():
        return (f"--ckpt {args.ckpt}: no {META_FILE} there (hf-to-mcore output), nor a {TRAIN_META} or `latest` "
                f"file (a training checkpoint): give one of those")
    from megatron_upipe.checkpoint.hf_export import inspect_export_source
    from megatron_upipe.checkpoint.hf_families import hf_config_dict

    try:
        src = inspect_export_source(ckpt)
        hf_config_dict(src.arch, src.vocab_size, args.model_type)
    except (OSError, ValueError) as e:
        return f"--ckpt {args.ckpt}: {_one_line(e)}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF Llama/Qwen2/Qwen3 directory -> megatron-core checkpoint")
    a.add_argument("--hf", required=True)
    a.add_argument("--out", required=True)
    b = sub.add_parser("mcore-to-hf", help="converted or training checkpoint -> HF directory")
    b.add_argument("--ckpt", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: the checkpoint's weights as they are")
    b.add_argument("--model-type", choices=tuple(FAMILIES), default=None,
                   help="the HF family (default: from the model: qk_norm -> qwen3, qkv_bias -> qwen2, else llama)")
    args = parser.parse_args(argv)
    problem = input_problem(args)
    if problem:
        return fail(PROG, problem)
    try:
        if args.direction == "hf-to-mcore":
            from megatron_upipe.checkpoint.hf_import import convert_hf_to_mcore

            summary = convert_hf_to_mcore(args.hf, args.out)
        else:
            from megatron_upipe.checkpoint.hf_export import convert_mcore_to_hf

            summary = convert_mcore_to_hf(args.ckpt, args.out, dtype=args.dtype, model_type=args.model_type)
    except (OSError, ValueError) as e:  # found while reading the weights (a tied head that is not, a bad shard)
        return fail(PROG, f"{args.direction}: {_one_line(e)}")
    print(summary, flush=True)
    return 0


if __name__ == "__main__":
    from megatron_upipe.console import quiet_third_party

    quiet_third_party(cuda=False, tool=True)  # known-harmless notices; megatron-core is imported in main()
    sys.exit(main())
