"""Every command the docs show still works: the code blocks and code spans of README.md and docs/*.md (but the
generated docs/config_reference.md), the header comments of the recipes (examples/configs/*.yaml, examples/slurm/*.sbatch, examples/*.sh) and pretrain_llama.py's docstring.

- `pretrain_llama.py ...`: run in-process as `main(argv + --dry-run)` at the world size its context gives (an
  explicit --world-size, else torchrun's --nproc-per-node x --nnodes, else 1 for a plain `python`, else the
  config's `# world_size:` line); `--print-config` commands run as they are.
- `tools/*.py ...`: the tool's own argparse must accept the command's arguments (the tool is stopped right after
  parsing, so nothing runs), and `--help` must exit 0.
- `python -c "..."` snippets: run, exit 0 and print something.
- shell recipes: `bash -n`; where the script takes config overrides, its config (CONFIG=..., else the script's
  default) dry-runs with the command's overrides at the script's world size.
- every `section.key` the docs (README.md, docs/*.md, recipe headers) mention is a key of the schema, and every
  repository path in a command exists.
Synopsis placeholders are filled: `[...]` groups are dropped, FILE/CFG become tiny_cpu.yaml, N the context's size.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_upipe.config import schema

ROOT = Path(__file__).resolve().parents[1]
TINY = "examples/configs/tiny_cpu.yaml"
RECIPE_FILES = sorted([*(ROOT / "examples" / "configs").glob("*.yaml"), *(ROOT / "examples" / "slurm").glob("*.sbatch"),
                       *(ROOT / "examples").glob("*.sh")])
LAUNCHERS = {"python", "python3", ".venv/bin/python", "torchrun", ".venv/bin/torchrun", "bash", "sbatch", "srun",
             "pretrain_llama.py"}
NOT_CHECKED = ("docker ", "pip ", ".venv/bin/python -m pytest", "python -m pytest")  # need a registry, GPU or tree
PLACEHOLDERS = {"FILE": TINY, "CFG": TINY}
SHELL_STOP = {"|", "&&", ";", "||", ">", "(or"}
# the README is the front door; the depth moved to these pages (config_reference.md is generated from the schema)
DOC_FILES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "config_reference.md")]


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    text: str

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def _join_continuations(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for n, line in lines:
        if out and out[-1][1].endswith("\\"):
            out[-1] = (out[-1][0], out[-1][1][:-1].rstrip() + " " + line.strip())
        else:
            out.append((n, line.strip()))
    return out


def _is_command(text: str) -> bool:
    words = [w for w in text.split() if not re.fullmatch(r"[A-Z_]+=\S*", w)]  # leading VAR=value assignments
    return bool(words) and (words[0] in LAUNCHERS or words[0].startswith(("tools/", "examples/"))
                            and words[0].endswith((".py", ".sh", ".sbatch")))


def doc_commands(path: Path) -> list[Command]:
    """Commands in a markdown page's fenced or indented code blocks and its code spans."""
    rel = path.relative_to(ROOT).as_posix()
    text = path.read_text()
    lines = text.splitlines()
    found, block, fenced = [], [], False
    for n, line in enumerate([*lines, ""], 1):  # the blank line ends a code block that ends the page
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") and (not lines[n - 2].strip() or block):
            block.append((n, line))
            continue
        found += [Command(f"{rel}:{m}", t) for m, t in _join_continuations(block) if _is_command(t)]
        block = []
    for m in re.finditer(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL)):
        span = " ".join(m.group(1).split())
        if _is_command(span):
            found.append(Command(f"{rel}:{text[:m.start()].count(chr(10)) + 1}", span))
    return found


def readme_commands() -> list[Command]:
    return [c for p in DOC_FILES for c in doc_commands(p)]


def header_commands(path: Path) -> list[Command]:
    """Indented command lines of a file's leading comment block (a shell script's after its #! line); an unindented
    comment line is prose, even when it starts with a script's name."""
    lines = path.read_text().splitlines()
    header = []
    for n, line in enumerate(lines, 1):
        if n == 1 and line.startswith("#!"):
            continue
        if not line.startswith("#") or line.startswith("#SBATCH"):
            break
        header.append((n, line[1:]))
    rel = path.relative_to(ROOT)
    return [Command(f"{rel}:{n}", t) for n, t in _join_continuations(header)
            if _is_command(t) and header[[k for k, _ in header].index(n)][1].startswith("  ")]


def docstring_commands() -> list[Command]:
    path = ROOT / "pretrain_llama.py"
    doc = path.read_text().split('"""')[1].replace("\\\\\n", "\\\n")
    lines = [(n, line) for n, line in enumerate(doc.splitlines(), 1) if line.startswith("    ")]
    return [Command(f"pretrain_llama.py:{n}", t) for n, t in _join_continuations(lines) if _is_command(t)]


def all_commands() -> list[Command]:
    return readme_commands() + [c for p in RECIPE_FILES for c in header_commands(p)] + docstring_commands()


def _tokens(text: str) -> list[str]:
    """shlex tokens, `bash -c '...'` bodies expanded in place, [optional] groups dropped, prose after a command cut."""
    out = []
    for tok in shlex.split(text):
        if " " in tok and ("pretrain_llama.py" in tok or "torchrun" in tok):
            out += _tokens(tok)
        else:
            out.append(tok)
    merged = []  # a $(...) substitution is one word, whatever it holds
    for tok in out:
        if merged and merged[-1].count("$(") > merged[-1].count(")"):
            merged[-1] += " " + tok
        else:
            merged.append(tok)
    kept, depth = [], 0
    for tok in merged:
        if tok in SHELL_STOP or tok.startswith("#"):
            break
        depth += tok.count("[") if tok.startswith("[") else 0
        if depth == 0:
            kept.append(tok)
        depth -= tok.count("]") if depth else 0
    return kept


def _value(tokens: list[str], flag: str) -> str | None:
    return tokens[tokens.index(flag) + 1] if flag in tokens and tokens.index(flag) + 1 < len(tokens) else None


def _header_world_size(config: str | None) -> int | None:
    if config is None or not (ROOT / config).is_file():
        return None
    m = re.search(r"^# world_size: (\d+)$", (ROOT / config).read_text(), re.MULTILINE)
    return int(m.group(1)) if m else None


def _run_quietly(fn, *args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = fn(*args)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue() + err.getvalue()


def dry_run_pretrain(tokens: list[str]) -> tuple[list[str], int, str]:
    import pretrain_llama

    i = tokens.index("pretrain_llama.py")
    args = [PLACEHOLDERS.get(t, t) for t in tokens[i + 1:]]
    launcher = tokens[:i]
    world = _value(args, "--world-size")
    if world is None or not world.isdigit():
        nproc, nnodes = _value(launcher, "--nproc-per-node"), _value(launcher, "--nnodes") or "1"
        if any(t.endswith("torchrun") for t in launcher) and nproc and nproc.isdigit():
            world = str(int(nproc) * int(nnodes))
        elif launcher and launcher[-1].endswith(("python", "python3")):
            world = "1"
        else:
            world = str(_header_world_size(_value(args, "--config")) or 1)
        args = [a for a in args if a != "--world-size" and a != "N"]
    args = [("1" if a == "N" else a) for a in args]
    if "--print-config" not in args:
        args += [] if "--dry-run" in args else ["--dry-run"]
        args += [] if "--world-size" in args else ["--world-size", world]
    code, out = _run_quietly(pretrain_llama.main, args)
    return args, code, out


class _Parsed(Exception):
    pass


def parse_tool(script: Path, args: list[str], monkeypatch) -> tuple[object, str]:
    """Run the tool's __main__ until its argparse has parsed `args`; returns the namespace (or the exit code)."""
    real = argparse.ArgumentParser.parse_args

    def stop_after_parsing(self, argv=None, namespace=None):
        raise _Parsed(real(self, argv, namespace))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop_after_parsing)
        m.setattr(sys, "argv", [str(script), *args])
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(script), run_name="__main__")
                result = "ran past its argument parser"
            except _Parsed as p:
                result = p.args[0]
            except SystemExit as e:
                result = e.code
    return result, out.getvalue() + err.getvalue()


def _script_config(script: Path, env: dict[str, str]) -> str | None:
    if "CONFIG" in env:
        return env["CONFIG"]
    text = script.read_text()
    m = re.search(r"^CONFIG=\$\{CONFIG:-(\S+)\}$", text, re.MULTILINE) or re.search(r"--config (\S+\.yaml)", text)
    return m.group(1) if m else None


def _script_world_size(script: Path, env: dict[str, str], config: str) -> int:
    nodes = re.search(r"^#SBATCH --nodes=(\d+)$", script.read_text(), re.MULTILINE)
    if "NPROC_PER_NODE" in env:
        return int(env["NPROC_PER_NODE"]) * (int(nodes.group(1)) if nodes else 1)
    return _header_world_size(config) or 1


COMMANDS = all_commands()


def test_the_docs_show_commands_of_every_kind():
    texts = [c.text for c in COMMANDS]
    assert len(COMMANDS) >= 25
    for needle in ("pretrain_llama.py", "tools/estimate_memory.py", "examples/run_cpu_demo.sh", ".sbatch",
                   "examples/torchrun_single_node.sh", "tools/convert_hf_llama.py"):
        assert any(needle in t for t in texts), needle
    assert {c.where.split(":")[0] for c in COMMANDS} >= {"README.md", "pretrain_llama.py",
                                                        "examples/configs/tiny_cpu.yaml",
                                                        "examples/slurm/llama3_8b_upipe_8xh100.sbatch",
                                                        "docs/recipes.md", "docs/training.md", "docs/checkpoints.md",
                                                        "docs/data.md", "docs/memory.md", "docs/planner.md",
                                                        "docs/parallelism.md"}
    readme = [c.text for c in COMMANDS if c.where.startswith("README.md:")]  # the front door's own commands
    for needle in ("bash examples/run_cpu_demo.sh", "bash tools/test.sh", "tools/estimate_memory.py", ".sbatch",
                   "examples/torchrun_single_node.sh", "--dry-run"):
        assert any(needle in t for t in readme), needle


@pytest.mark.parametrize("command", [c for c in COMMANDS if "pretrain_llama.py" in c.text
                                     and c.text != "pretrain_llama.py"], ids=str)  # not a bare mention
def test_pretrain_commands_dry_run(command):
    args, code, out = dry_run_pretrain(_tokens(command.text))
    assert code == 0, f"{command}\n  ran: pretrain_llama.py {' '.join(args)}\n{out}"
    if "--print-config" not in args:
        assert "dry run: configuration is valid" in out, out


@pytest.mark.parametrize("command", [c for c in COMMANDS if re.search(r"(^|\s)(\S*/)?tools/\w+\.py", c.text)
                                     and "pretrain_llama.py" not in c.text], ids=str)
def test_tool_commands_parse_and_have_help(command, monkeypatch):
    tokens = _tokens(command.text)
    i = next(k for k, t in enumerate(tokens) if re.fullmatch(r"(\S*/)?tools/\w+\.py", t))
    script, args = ROOT / "tools" / Path(tokens[i]).name, tokens[i + 1:]
    assert script.is_file(), command
    if args:  # a bare mention of the tool has no arguments to check
        result, out = parse_tool(script, args, monkeypatch)
        assert isinstance(result, argparse.Namespace), f"{command}\n  argparse said ({result}):\n{out}"
    subcommands = [a for a in args[:1] if not a.startswith("-")]
    code, out = parse_tool(script, [*subcommands, "--help"], monkeypatch)
    assert code == 0 and "usage:" in out, f"{command}: --help\n{out}"


SCRIPT = re.compile(r"(^|\s)((?:tools|examples)/\S+\.(?:sh|sbatch))(\s|$)")


@pytest.mark.parametrize("command", [c for c in COMMANDS if SCRIPT.search(c.text) and "pretrain_llama.py" not in
                                     c.text and not re.search(r"tools/\w+\.py", c.text)], ids=str)
def test_shell_recipe_commands_parse_and_their_overrides_dry_run(command):
    tokens = _tokens(command.text)
    env = dict(t.split("=", 1) for t in tokens if re.fullmatch(r"[A-Z_]+=\S*", t))
    i = next(k for k, t in enumerate(tokens) if SCRIPT.fullmatch(" " + t))
    script, overrides = ROOT / tokens[i], [t for t in tokens[i + 1:] if re.fullmatch(r"[a-z_]+\.[a-z_0-9]+=\S*", t)]
    assert script.is_file(), command
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, f"{script}: {check.stderr}"
    config = _script_config(script, env)
    if config is None or script.name == "test.sh":  # its arguments go to pytest, not to a config
        return
    args = ["pretrain_llama.py", "--config", config, *overrides, "--world-size",
            str(_script_world_size(script, env, config))]
    _, code, out = dry_run_pretrain(args)
    assert code == 0, f"{command}\n  ran: {' '.join(args)} --dry-run\n{out}"


@pytest.mark.parametrize("command", [c for c in COMMANDS if re.match(r"(\S*/)?python3? -c ", c.text)], ids=str)
def test_python_snippets_run(command):
    code = _tokens(command.text)[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip(), f"{command}: printed nothing"


def test_every_shell_recipe_parses():
    scripts = [*(ROOT / "examples").rglob("*.sh"), *(ROOT / "examples" / "slurm").glob("*.sbatch"),
               *(ROOT / "tools").rglob("*.sh")]
    assert len(scripts) >= 5
    for script in scripts:
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, f"{script}: {check.stderr}"


def test_every_command_is_checked_or_named_as_out_of_scope():
    checked = ("pretrain_llama.py", "tools/", "examples/")
    unchecked = [str(c) for c in COMMANDS if not any(k in c.text for k in checked)
                 and not re.match(r"(\S*/)?python3? -c ", c.text) and not c.text.startswith(NOT_CHECKED)]
    assert not unchecked, unchecked


KEY = re.compile(r"(?<![\w./-])(model|parallel|train|data|checkpoint|log|dist|memory)\.([a-z][a-z0-9_]*)\b(?!/)")
KEYS = {f"{s}.{f.name}" for s, cls in schema.SECTIONS.items() for f in dataclasses.fields(cls)}


def test_every_config_key_the_docs_name_exists():
    unknown = []
    for path in [*DOC_FILES, *RECIPE_FILES]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in KEY.finditer(line):
                if m.group(2) not in ("py", "yaml", "md") and m.group(0) not in KEYS:
                    unknown.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)}")
    assert not unknown, unknown


def test_every_repository_path_in_a_command_exists():
    missing = []
    for c in COMMANDS:
        for tok in _tokens(c.text):
            for part in tok.split("="):
                if re.fullmatch(r"(examples|tools|data|megatron_upipe|tests)/[\w./-]+", part) and \
                        not (ROOT / part).exists():
                    missing.append(f"{c}: {part}")
    assert not missing, missing
