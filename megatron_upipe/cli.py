"""Command-line conventions of pretrain_llama.py and tools/: bad input ends in one line naming the option, exit 2.

`ArgumentParser` reports argparse's own errors (a missing option, a number that is not one, an unknown choice) as
`PROG: error: argument --workers: must be >= 1, got 0 (see --help)`, without the usage block; `fail` prints a
tool's own refusal the same way. `positive_int` / `non_negative_int` are argparse types for counts.
"""

from __future__ import annotations

import argparse
import sys

EXIT_BAD_INPUT = 2


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints the whole usage block first
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def fail(prog: str, message: object) -> int:
    """Print `PROG: error: MESSAGE` to stderr and return the exit status for bad input."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def _int(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    return _int(text, 0)
