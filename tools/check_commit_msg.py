#!/usr/bin/env python
"""Check commit messages: a subject of at most 72 characters, then a blank line, then the body.

    python tools/check_commit_msg.py .git/COMMIT_EDITMSG      # one message (the commit-msg hook's argument)
    python tools/check_commit_msg.py --range origin/main..HEAD  # every commit of a range
    ln -s ../../tools/check_commit_msg.py .git/hooks/commit-msg # check each commit as it is made

Lines starting with '#' (git's comments) are ignored. Exit 1 with one line per problem. History before this check
existed is not rewritten: check ranges that start after it (CONTRIBUTING.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

MAX_SUBJECT = 72
PROG = "check_commit_msg.py"


def problems(message: str) -> list[str]:
    """What is wrong with one commit message (empty: nothing)."""
    lines = [line for line in message.splitlines() if not line.startswith("#")]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines or not lines[0].strip():
        return ["the subject (first line) is empty"]
    found = []
    subject = lines[0]
    if len(subject) > MAX_SUBJECT:
        found.append(f"the subject is {len(subject)} characters, more than {MAX_SUBJECT}: move the detail into the "
                     f"body")
    if subject.rstrip() != subject or subject.endswith("."):
        found.append("the subject ends with a space or a full stop")
    if len(lines) > 1 and lines[1].strip():
        found.append("the second line must be blank (subject, blank line, body)")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", nargs="?", help="a file holding one commit message")
    p.add_argument("--range", help="a git revision range, e.g. origin/main..HEAD")
    a = p.parse_args(argv)
    if (a.file is None) == (a.range is None):
        print(f"{PROG}: give a message file or --range REV..REV", file=sys.stderr)
        return 2
    if a.file is not None:
        messages = {a.file: open(a.file, encoding="utf-8").read()}
    else:
        out = subprocess.run(["git", "log", "--format=%H%x00%B%x01", a.range], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{PROG}: git log {a.range}: {out.stderr.strip()}", file=sys.stderr)
            return 2
        messages = dict(entry.strip("\n").split("\0", 1) for entry in out.stdout.split("\x01") if entry.strip())
    bad = [f"{PROG}: {name[:12]}: {problem}" for name, text in messages.items() for problem in problems(text)]
    print("\n".join(bad), file=sys.stderr) if bad else None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
