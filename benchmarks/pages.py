"""Copy the studies' figures into the README and the docs, each naming its results file.

``asyncsample bench --pages`` rewrites the marked blocks of :data:`PAGES` from the results files
the studies wrote, so the pages cannot disagree with them or with each other:

``<!-- studies -->`` ... ``<!-- /studies -->``
    The table of studies (:data:`benchmarks.studies.STUDIES`): the command, what it measures,
    and its last result (a link to ``benchmarks/results/STUDY/results.md`` and its date), or
    "awaits a quiet run" with the file of the earlier run.
``<!-- results: STUDY#HEADING -->`` ... ``<!-- /results -->``
    The section ``HEADING`` of ``benchmarks/results/STUDY/results.md`` (its text and tables, and
    its subsections with their headings in bold), under a line that names the file and the date
    of the run; or a line saying it awaits a quiet run and which command writes it.

Run it after the studies (``asyncsample bench all``); ``--check`` says whether a page is out of
date without writing it (the test suite runs it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.studies import RESULTS, STUDIES, get

__all__ = ["PAGES", "render", "update"]

REPO = RESULTS.parent.parent
#: The pages whose blocks are rewritten (relative to the repository).
PAGES = ["README.md", "benchmarks/README.md", "docs/performance.md", "docs/vector.md"]

_BLOCK = re.compile(
    r"(?P<open><!-- (?P<kind>studies|results)(?:: (?P<arg>[^>]*?))? -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- /(?P=kind) -->)",
    re.S,
)
_HEADING = re.compile(r"^(#+) (.*)$")


def _link(page: Path, target: Path) -> str:
    """A markdown link from ``page`` to ``target``; a code path on a docs page (mkdocs builds
    only ``docs/``, so a link out of it would not resolve)."""
    rel = Path("benchmarks", "results", target.relative_to(RESULTS))
    if page.parent == REPO / "docs":
        return f"`{rel}`"
    return f"[{rel}]({Path(*(['..'] * len(page.parent.relative_to(REPO).parts)), rel)})"


def _date(study: str) -> str | None:
    """The date of the study's last run (from its results.json), or None.

    A plan study's results.json names its study: one without the name was written before the
    framework (the policy workload's first runs) and is not the study's last result; nor is a
    ``--quick`` smoke run.
    """
    try:
        results = json.loads((RESULTS / study / "results.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(results, dict) or results.get("study", study) != study:
        return None
    if get(study).is_plan and "study" not in results:
        return None
    if (results.get("settings") or {}).get("quick"):  # a smoke run is not a measurement
        return None
    date = (results.get("machine") or {}).get("date") or results.get("date") or ""
    return str(date)[:10] or "date unknown"


def studies_table(page: Path) -> str:
    """The table of studies, with each study's last result file (or the earlier one)."""
    rows = ["| study | command | what it measures | last result |", "|---|---|---|---|"]
    for study in STUDIES:
        command = f"`asyncsample bench {study.name}" + (
            " --a OLD_TREE`" if study.name == "ab" else "`"
        )
        out = RESULTS / study.name / "results.md"
        date = _date(study.name)
        if date and out.exists():
            last = f"{_link(page, out)} ({date})"
        else:
            last = "awaits a quiet run"
            if study.before:
                before = ", ".join(_link(page, RESULTS / b) for b in study.before)
                last += f" (before the framework: {before})"
        rows.append(f"| {study.name} | {command} | {study.measures} | {last} |")
    return "\n".join(rows) + "\n"


def section(text: str, heading: str) -> str | None:
    """The body of ``heading`` in a results.md (subsections included, their headings bold)."""
    lines = text.splitlines()
    start = level = None
    for i, line in enumerate(lines):
        m = _HEADING.match(line)
        if m and m.group(2).strip() == heading:
            start, level = i + 1, len(m.group(1))
            break
    if start is None or level is None:
        return None
    out: list[str] = []
    for line in lines[start:]:
        m = _HEADING.match(line)
        if m and len(m.group(1)) <= level:
            break
        out.append(f"**{m.group(2)}**" if m else line)
    return "\n".join(out).strip() + "\n"


def results_block(page: Path, arg: str) -> str:
    """The text of one ``results: STUDY#HEADING`` block."""
    study, _, heading = arg.partition("#")
    path = RESULTS / study / "results.md"
    body = section(path.read_text(), heading) if path.exists() and _date(study) else None
    if body is None:
        return (
            f"*Awaits a quiet run: `asyncsample bench {study}` writes this table "
            f"({heading!r}) to {_link(page, path)}.*\n"
        )
    return f"From {_link(page, path)} (run of {_date(study)}):\n\n{body}"


def render(page: Path, text: str) -> str:
    """``text`` of ``page`` with every block rewritten."""

    def fill(m: re.Match[str]) -> str:
        if m.group("kind") == "studies":
            body = studies_table(page)
        else:
            body = results_block(page, m.group("arg") or "")
        return f"{m.group('open')}{body}{m.group('close')}"

    return _BLOCK.sub(fill, text)


def update(check: bool = False) -> list[Path]:
    """Rewrite the blocks of every page of :data:`PAGES`.

    Args:
        check: Only report the pages that are out of date; write nothing.

    Returns:
        The pages that changed (or, with ``check``, would change).
    """
    changed = []
    for name in PAGES:
        page = REPO / name
        text = page.read_text()
        new = render(page, text)
        if new != text:
            changed.append(page)
            if not check:
                page.write_text(new)
    return changed
