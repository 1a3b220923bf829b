"""Convert Llama checkpoints between HF transformers and megatron_upipe (megatron-core dist_checkpointing).

    python tools/convert_hf_llama.py hf-to-mcore --hf /path/to/hf_llama --out /path/to/ckpt
    python tools/convert_hf_llama.py mcore-to-hf --ckpt /path/to/ckpt --out /path/to/hf_llama

Runs in one process (CPU is fine). The megatron checkpoint loads under any TP/PP/CP layout; it carries
`upipe_model.json` (the LlamaArch and vocab size) so the reverse direction needs no other input.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_upipe.checkpoint.hf_convert import convert_hf_to_mcore, convert_mcore_to_hf  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF LlamaForCausalLM directory -> megatron-core checkpoint")
    a.add_argument("--hf", required=True)
    a.add_argument("--out", required=True)
    b = sub.add_parser("mcore-to-hf", help="megatron-core checkpoint -> HF LlamaForCausalLM directory")
    b.add_argument("--ckpt", required=True)
    b.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.direction == "hf-to-mcore":
        convert_hf_to_mcore(args.hf, args.out)
    else:
        convert_mcore_to_hf(args.ckpt, args.out)


if __name__ == "__main__":
    main()
