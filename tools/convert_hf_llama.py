"""Convert Llama checkpoints between HF transformers and megatron_upipe (megatron-core dist_checkpointing).

    python tools/convert_hf_llama.py hf-to-mcore --hf /path/to/hf_llama --out /path/to/ckpt
    python tools/convert_hf_llama.py mcore-to-hf --ckpt /path/to/ckpt --out /path/to/hf_llama

Runs in one process (CPU is fine). The megatron checkpoint loads under any TP/PP/CP layout; it carries
`upipe_model.json` (the LlamaArch and vocab size) so the reverse direction needs no other input. --hf is a local
directory (never a Hub name: nothing is downloaded), --out a new or empty directory; bad input ends in one line,
exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_upipe.checkpoint.hf_convert import META_FILE, convert_hf_to_mcore, convert_mcore_to_hf  # noqa: E402
from megatron_upipe.cli import ArgumentParser, fail  # noqa: E402

PROG = "convert_hf_llama.py"


def input_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the directories given, checked before any weight is read."""
    if args.direction == "hf-to-mcore":
        config = Path(args.hf) / "config.json"
        if not config.is_file():
            return f"--hf {args.hf}: no config.json there: give a local HF Llama directory (save_pretrained output)"
        try:
            model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError) as e:
            return f"--hf {args.hf}: config.json is unreadable: {e}"
        if model_type != "llama":
            return f"--hf {args.hf}: model_type {model_type!r} is not 'llama': only LlamaForCausalLM converts"
    elif not (Path(args.ckpt) / META_FILE).is_file():
        return (f"--ckpt {args.ckpt}: no {META_FILE} there: give a directory written by hf-to-mcore (a training "
                f"checkpoint's iter_XXXXXXX directory is not one)")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        return f"--out {args.out} exists and is not an empty directory: give a new or empty directory"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF LlamaForCausalLM directory -> megatron-core checkpoint")
    a.add_argument("--hf", required=True)
    a.add_argument("--out", required=True)
    b = sub.add_parser("mcore-to-hf", help="megatron-core checkpoint -> HF LlamaForCausalLM directory")
    b.add_argument("--ckpt", required=True)
    b.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    problem = input_problem(args)
    if problem:
        return fail(PROG, problem)
    try:
        if args.direction == "hf-to-mcore":
            convert_hf_to_mcore(args.hf, args.out)
        else:
            convert_mcore_to_hf(args.ckpt, args.out)
    except ValueError as e:  # an HF config this converter does not support (tied embeddings, biases, RoPE scaling)
        return fail(PROG, f"{args.direction}: {e}")
    except OSError as e:  # e.g. a --hf directory without weights
        return fail(PROG, f"{args.direction}: {' '.join(str(e).split())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
