"""tools/check_commit_msg.py: the commit format of CONTRIBUTING.md (subject <= 72 characters, blank line, body)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from check_commit_msg import problems  # noqa: E402


@pytest.mark.parametrize("message, expected", [
    ("Lock checkpoint.dir against a second run\n\nWhy and how.\n", []),
    ("Short subject\n", []),
    ("Subject\n# a git comment line\n\nBody\n", []),
    ("x" * 73 + "\n\nbody", ["the subject is 73 characters, more than 72"]),
    ("Subject\nbody right below\n", ["the second line must be blank"]),
    ("Subject ends with a stop.\n\nbody", ["ends with a space or a full stop"]),
    ("\n\nbody only", ["the subject (first line) is empty"]),
])
def test_messages(message, expected):
    found = problems(message)
    assert len(found) == len(expected) and all(e in f for e, f in zip(expected, found)), found


def test_the_cli_checks_a_message_file_as_a_commit_msg_hook(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("Add the lock\n\nBody.\n")
    bad.write_text("A subject that goes on and on and on, far past the seventy-two characters of the rule\n")
    tool = [sys.executable, str(ROOT / "tools" / "check_commit_msg.py")]
    assert subprocess.run([*tool, str(good)]).returncode == 0
    r = subprocess.run([*tool, str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and "more than 72" in r.stderr
