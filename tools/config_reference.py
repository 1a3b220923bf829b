#!/usr/bin/env python
"""Write the reference of every config key (docs/config_reference.md), generated from the schema.

    python tools/config_reference.py            # rewrite docs/config_reference.md
    python tools/config_reference.py --check    # exit 1 if the committed file differs from the generated one
    python tools/config_reference.py --out -    # print it

Descriptions are the fields' comments in megatron_upipe/config/schema.py (or their metadata["help"]); library code:
megatron_upipe/config/reference.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_upipe.config.reference import all_docs, render_markdown  # noqa: E402

DEFAULT_OUT = ROOT / "docs" / "config_reference.md"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output file, or - for stdout (default: %(default)s)")
    p.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = p.parse_args(argv)
    missing = [d.key for docs in all_docs().values() for d in docs if not d.help]
    if missing:
        print(f"config_reference.py: no description for {', '.join(missing)}: add a comment above the field in "
              f"megatron_upipe/config/schema.py (or metadata={{'help': ...}})", file=sys.stderr)
        return 1
    text = render_markdown()
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    if args.check:
        if not out.is_file() or out.read_text() != text:
            print(f"config_reference.py: {os.path.relpath(out)} is stale: run python tools/config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {os.path.relpath(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
