"""Every Python code block of README.md and docs/*.md runs as a script.

The convention (pages added later follow it too):

- a block fenced ```` ```python ```` runs as a script, in a fresh ``python`` process in an
  empty directory, with a time limit;
- the line ``<!-- snippet: async -->`` right before the fence means the block uses top-level
  ``await`` / ``async with`` / ``async for`` (as in a notebook): the test runs it inside
  ``async def main()`` under ``asyncio.run(main())``;
- the line ``<!-- snippet: skip: REASON -->`` right before the fence means the block is not
  run; the reason is required (a skip without one fails).

The extractor is our own, some thirty lines: the libraries that do this (pytest-markdown-docs,
phmdoctest) mark blocks in the fence's info string or with their own comment syntax, and neither
wraps a notebook-style block in ``asyncio.run``; an info string would also show on GitHub.
Each block runs in a fresh interpreter, a second or more (many seconds for one that samples or
imports torch): they run in the slow pass (``python -m pytest -m slow``, which ``.ci/run`` runs);
the default run checks that every block is found and marked well.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: Seconds a snippet may take (a generous bound for a loaded 2-core machine: a hang fails).
TIME_LIMIT = 90

_MARK = re.compile(r"^<!-- snippet: (?P<kind>async|skip)(?::(?P<reason>.*?))? -->$")


@dataclass(frozen=True)
class Snippet:
    """One ```python block: where it is, its code, and how the test treats it."""

    page: str
    line: int
    code: str
    kind: str  # "script", "async" or "skip"
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def script(self) -> str:
        """The code as a script: an ``async`` block wrapped in ``asyncio.run(main())``."""
        if self.kind != "async":
            return self.code
        return (
            "import asyncio\n\n\nasync def main():\n"
            + textwrap.indent(self.code, "    ")
            + "\n\nasyncio.run(main())\n"
        )


def snippets(path: Path) -> list[Snippet]:
    """The ```python blocks of a markdown page, with the marks right before their fences."""
    lines = path.read_text().splitlines()
    out: list[Snippet] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        start = i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        mark = _MARK.match(lines[start - 1].strip()) if start else None
        kind = mark.group("kind") if mark else "script"
        reason = (mark.group("reason") or "").strip() if mark else ""
        code = textwrap.dedent("\n".join(lines[start + 1 : end])) + "\n"  # a list item's too
        page = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
        out.append(Snippet(page, start + 1, code, kind, reason))
        i = end + 1
    return out


ALL = [s for page in PAGES for s in snippets(page)]


def test_every_page_has_its_snippets_found() -> None:
    """The extractor sees the blocks (a page's count of ```python fences)."""
    for page in PAGES:
        fences = sum(1 for line in page.read_text().splitlines() if line.strip() == "```python")
        assert len(snippets(page)) == fences, page


def test_a_skip_names_its_reason() -> None:
    bare = [s.id for s in ALL if s.kind == "skip" and not s.reason]
    assert bare == [], f"<!-- snippet: skip: REASON --> needs a reason: {bare}"


def test_the_marks_are_read(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n<!-- snippet: async -->\n```python\nawait f()\n```\n\n"
        "<!-- snippet: skip: needs a GPU -->\n```python\nimport cuda\n```\n"
        "<!-- snippet: skip: -->\n```python\npass\n```\n"
    )
    found = [(s.kind, s.reason) for s in snippets(page)]
    assert found == [("script", ""), ("async", ""), ("skip", "needs a GPU"), ("skip", "")]
    wrapped = snippets(page)[1].script()
    assert "async def main():\n    await f()" in wrapped
    assert wrapped.endswith("asyncio.run(main())\n")


@pytest.mark.slow
@pytest.mark.parametrize("snippet", [pytest.param(s, id=s.id) for s in ALL if s.kind != "skip"])
def test_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    # SB3_LOGDIR: the folder SB3's logger makes (even when it writes no file) goes under
    # tmp_path, not /tmp/SB3-<date> (docs/vector.md's PPO.learn block).
    env = dict(os.environ, PYTHONPATH=path, SB3_LOGDIR=str(tmp_path / "sb3-logs"))
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(  # -X faulthandler: a crash prints each thread's Python stack
        [sys.executable, "-X", "faulthandler", "-c", snippet.script()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIME_LIMIT,
    )
    assert proc.returncode == 0, (
        f"{snippet.id} exited {proc.returncode}\n--- code\n{snippet.script()}\n"
        f"--- stderr\n{proc.stderr[-3000:]}"
    )
