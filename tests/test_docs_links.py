"""The docs hold together: every relative link in README.md and docs/*.md reaches an existing file (and, with
#anchor, an existing heading of that page, by GitHub's slugs), and every script the docs run (`pretrain_llama.py`,
`tools/*.py`) answers `--help`; a quoted `pretrain_llama.py ... --dry-run` command runs as given.

Commands come from the pages' code blocks and code spans (tests/test_readme_commands.py's collector, which also
checks each command's arguments); `--help` runs once per script, as a subprocess of .venv/bin/python, all scripts at
once; the dry runs run in-process through pretrain_llama.main.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from tests.test_readme_commands import _tokens, doc_commands

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = ROOT / ".venv" / "bin" / "python"
PYTHON = str(PYTHON) if PYTHON.exists() else sys.executable
PLACEHOLDER = re.compile(r"^(FILE|CFG|N|DIR|PREFIX|TOKENIZER)$|^\[|\.\.\.|<")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)


def _prose(text: str) -> str:
    """The page without fenced code, indented code blocks (4+ spaces after a blank line) and code spans: a link
    written there is not a link."""
    lines, out, in_block = FENCE.sub("", text).splitlines(), [], False
    for n, line in enumerate(lines):
        if line.startswith("    ") and (in_block or n == 0 or not lines[n - 1].strip()):
            in_block = True
            out.append("")
            continue
        in_block = in_block and not line.strip()
        out.append(line)
    return re.sub(r"`[^`\n]*`", "", "\n".join(out))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation and symbols dropped (but - and _),
    spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](link) -> text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "").lower()
    kept = [ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LNM"]
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text()
    seen: dict[str, int] = {}
    out = set(HTML_ANCHOR.findall(text))
    for m in HEADING.finditer(FENCE.sub("", text)):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[tuple[int, str]]:
    text = _prose(page.read_text())
    found = [(text[:m.start()].count("\n") + 1, m.group(1)) for m in LINK.finditer(text)]
    found += [(text[:m.start()].count("\n") + 1, m.group(1)) for m in REFERENCE.finditer(text)]
    return [(n, t) for n, t in found if t and not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", t)]  # http:, mailto:, ...


def broken_links(page: Path) -> list[str]:
    problems = []
    for line, target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}:{line}: ({target})"
        if not dest.exists():
            problems.append(f"{where}: no such file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
        elif anchor and dest.suffix != ".md":
            problems.append(f"{where}: an anchor into a file that is not a markdown page")
    return problems


def test_the_pages_exist_and_link_to_each_other():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/parallelism.md", "docs/memory.md", "docs/planner.md", "docs/recipes.md",
            "docs/checkpoints.md", "docs/data.md", "docs/training.md", "docs/dependencies.md",
            "docs/gpu_results.md", "docs/config_reference.md"} <= names
    readme_targets = {t.partition("#")[0] for _, t in links(ROOT / "README.md")}
    for page in PAGES[1:]:  # the README reaches every page
        assert f"docs/{page.name}" in readme_targets, f"README.md does not link docs/{page.name}"
    assert "CONTRIBUTING.md" in readme_targets
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200, "README.md is the front door: keep it short"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_reaches_a_file_and_heading(page):
    assert not broken_links(page), "\n".join(broken_links(page))


def test_the_link_check_fails_on_a_broken_link(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Beyond one node: a2a × ring (`parallel.cp_ring`)\n\n"
                                       "## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md) [ok](other.md#beyond-one-node-a2a--ring-parallelcp_ring) "
                    "[ok](other.md#twice-1) [ok](#page) [web](https://example.com/x.md) `[code](missing.md)`\n\n"
                    "    [indented code](missing.md)\n\n"
                    "[gone](missing.md) [bad anchor](other.md#nowhere)\n[ref]: gone_too.md\n")
    problems = broken_links(page)
    assert len(problems) == 3, problems
    assert "missing.md" in problems[0] and "#nowhere" in problems[1] and "gone_too.md" in problems[2]


def test_slugs_follow_github():
    assert slug("Fine-tuning a pretrained model (HF in → long-context training → HF out)") == \
        "fine-tuning-a-pretrained-model-hf-in--long-context-training--hf-out"
    assert slug("Choosing U (`parallel.upipe_heads_per_stage`)") == "choosing-u-parallelupipe_heads_per_stage"
    assert slug("Step time: a model beside the memory plan") == "step-time-a-model-beside-the-memory-plan"


# ---- commands ----------------------------------------------------------------------------------------------------

SCRIPT = re.compile(r"(?:\S*/)?(pretrain_llama\.py|tools/\w+\.py)")
COMMANDS = [c for page in PAGES for c in doc_commands(page) if SCRIPT.search(c.text)]


def _script(command) -> str | None:
    for tok in _tokens(command.text):
        m = SCRIPT.fullmatch(tok)
        if m:
            return m.group(1)
    return None


SCRIPTS = sorted({s for c in COMMANDS if (s := _script(c))})
DRY_RUNS = {}
for _c in COMMANDS:
    _toks = _tokens(_c.text)
    if "--dry-run" in _toks and _script(_c) == "pretrain_llama.py":
        _args = _toks[next(i for i, t in enumerate(_toks) if t.endswith("pretrain_llama.py")) + 1:]
        if not any(PLACEHOLDER.search(a) for a in _args):
            DRY_RUNS.setdefault(" ".join(_args), _c)


def test_the_docs_run_scripts_and_dry_runs():
    assert "pretrain_llama.py" in SCRIPTS and len(SCRIPTS) >= 6, SCRIPTS
    assert {"tools/estimate_memory.py", "tools/convert_hf_llama.py", "tools/preprocess_data.py",
            "tools/bench_attention.py"} <= set(SCRIPTS), SCRIPTS
    assert len(DRY_RUNS) >= 2, list(DRY_RUNS)


def test_every_script_the_docs_run_answers_help():
    missing = [s for s in SCRIPTS if not (ROOT / s).is_file()]
    assert not missing, f"the docs run scripts that do not exist: {missing}"
    procs = {s: subprocess.Popen([PYTHON, s, "--help"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True) for s in SCRIPTS}  # all at once: most of the time is importing torch
    failed = []
    for script, proc in procs.items():
        out, _ = proc.communicate(timeout=180)
        if proc.returncode != 0 or "usage:" not in out:
            failed.append(f"{script} --help: exit {proc.returncode}\n{out[-2000:]}")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("args", list(DRY_RUNS), ids=lambda a: f"{DRY_RUNS[a].where}")
def test_quoted_dry_runs_pass_as_given(args):
    import shlex

    import pretrain_llama

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = pretrain_llama.main(shlex.split(args))
        except SystemExit as e:
            code = e.code
    assert code == 0, f"{DRY_RUNS[args]}\n{out.getvalue()[-3000:]}"
    assert "dry run: configuration is valid" in out.getvalue(), out.getvalue()[-3000:]
