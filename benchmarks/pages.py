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

``<!-- summary: NAME -->`` ... ``<!-- /summary -->``
    A table of chosen rows of the studies' tables (:data:`SUMMARIES`): the README's "how fast
    against what you would use otherwise" and docs/vector.md's table, each row naming its file.

It also writes ``benchmarks/results/README.md``, the index of the results: every study's folder
(and the named variants inside it), what it measures, the command, commit, date and machine of
its run, and its headline figures.

Run it after the studies (``asyncsample bench all``); ``--check`` says whether a page is out of
date without writing it (the test suite runs it). :func:`figures` lists the figures of a page
that its cited results file does not hold (``tests/test_figures.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.studies import RESULTS, STUDIES, get

__all__ = ["INDEX", "PAGES", "SUMMARIES", "figures", "index", "render", "update"]

REPO = RESULTS.parent.parent
#: The pages whose blocks are rewritten (relative to the repository).
PAGES = ["README.md", "benchmarks/README.md", "docs/performance.md", "docs/vector.md"]
#: The index of the results folder, written whole.
INDEX = Path("benchmarks", "results", "README.md")

_BLOCK = re.compile(
    r"(?P<open><!-- (?P<kind>studies|results|summary)(?:: (?P<arg>[^>]*?))? -->\n)"
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
    date = (
        (results.get("machine") or {}).get("date")
        or results.get("date")
        or (results.get("provenance") or {}).get("date")  # report.write_own_results
        or ""
    )
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
        elif m.group("kind") == "summary":
            body = summary_block(page, m.group("arg") or "")
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
    path = REPO / INDEX
    new = index()
    if not path.exists() or path.read_text() != new:
        changed.append(path)
        if not check:
            path.write_text(new)
    return changed


# --------------------------------------------------------------------------------------------
# The studies' tables, read back from their results.md


@dataclass(frozen=True)
class Table:
    """One markdown table of a results.md: the heading above it, its header and its rows."""

    heading: str
    header: list[str]
    rows: list[list[str]]

    def column(self, row: list[str], name: str) -> str:
        """The cell of ``row`` in the column ``name`` ("" when the table has no such column)."""
        return row[self.header.index(name)] if name in self.header else ""

    def row(self, contender: str) -> list[str] | None:
        """The row whose first cell is ``contender``; or, for a name ending in ``*``, the first
        row that starts with it (the tables are sorted fastest first: the best such row)."""
        for r in self.rows:
            if r[0] == contender or (contender.endswith("*") and r[0].startswith(contender[:-1])):
                return r
        return None


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str) -> list[Table]:
    """Every table of a results.md, each under the last heading above it (bold subsection
    titles count as headings, as :func:`section` writes them)."""
    out: list[Table] = []
    heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _HEADING.match(line)
        if m:
            heading = m.group(2).strip()
        elif line.startswith("**") and line.endswith("**"):
            heading = line.strip("*")
        elif line.startswith("|") and i + 1 < len(lines) and set(lines[i + 1]) <= set("|-: "):
            header, rows = _cells(line), []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out.append(Table(heading, header, rows))
            continue
        i += 1
    return out


def _results(folder: str) -> tuple[dict[str, Any], list[Table]] | None:
    """A results folder's results.json and tables; None without them."""
    path = RESULTS / folder
    try:
        results = json.loads((path / "results.json").read_text())
        text = (path / "results.md").read_text()
    except (OSError, ValueError):
        return None
    return results, tables(text)


# --------------------------------------------------------------------------------------------
# Summaries: chosen rows of the studies' tables


@dataclass(frozen=True)
class Pick:
    """A summary row: ``contender`` (a row name, or a prefix ending in ``*``: the best such row)
    in the table under ``heading`` of ``study``'s results, shown as ``label``."""

    study: str
    heading: str
    contender: str
    label: str
    column: str = ""
    """For a table of contenders x envs (the throughput study's): the env's column; its ratios
    come from the "Ratios" table below it (x SyncVectorEnv / % of the ceiling / % of ideal)."""


#: The summary tables: their rows and the columns they show (header -> the study table's column).
SUMMARIES: dict[str, tuple[list[Pick], dict[str, str]]] = {
    "readme": (
        [
            Pick(
                "vector",
                "CartPole-v1, 8 envs",
                "asyncsample VectorEnv",
                "CartPole-v1 (a cheap env: about 10 us a step), 8 envs, random actions",
            ),
            Pick(
                "vector",
                "FixedCost-v0, 8 envs",
                "asyncsample VectorEnv",
                "an env costing 200 us of CPU a step, 8 envs, random actions",
            ),
            Pick(
                "vector",
                "CartPole-v1, 64 envs",
                "asyncsample VectorEnv",
                "CartPole-v1, 64 envs, random actions",
            ),
            Pick(
                "throughput",
                "Throughput, 8 envs",
                "asyncsample process (best layout)",
                "CartPole-v1, 8 envs, the sampler's calls (random agent)",
                "CartPole-v1",
            ),
            Pick(
                "throughput",
                "Throughput, 8 envs",
                "asyncsample process (best layout)",
                "an env costing 200 us a step, 8 envs, the sampler's calls",
                "FixedCost-v0",
            ),
            Pick(
                "policy",
                "CartPole-v1, 8 envs, MLP policy",
                "asyncsample*",
                "CartPole-v1, 8 envs, a torch MLP policy",
            ),
            Pick(
                "policy",
                "HalfCheetah-v5, 32 envs, MLP policy",
                "asyncsample*",
                "HalfCheetah-v5 (MuJoCo), 32 envs, a torch MLP policy",
            ),
            Pick(
                "real_envs",
                "Pong-v5, 8 envs",
                "asyncsample*",
                "Pong-v5 (Atari), 8 envs, random actions",
            ),
        ],
        {
            "asyncsample": "contender",
            "steps/s": "steps/s",
            "x `SyncVectorEnv` (your loop)": "x sync",
            "x `AsyncVectorEnv`": "x async",
            "% ceiling": "% ceiling",
        },
    ),
    "vector": (
        [
            Pick("vector", f"{env}, {n} envs", "asyncsample VectorEnv", f"{env}, {n} envs")
            for env, n in (
                ("CartPole-v1", 8),
                ("FixedCost-v0", 8),
                ("Image-v0", 8),
                ("CartPole-v1", 64),
            )
        ],
        {
            "`VectorEnv` steps/s": "steps/s",
            "x `SyncVectorEnv`": "x sync",
            "x `AsyncVectorEnv(shared_memory=True)`": "x async",
            "% ceiling": "% ceiling",
        },
    ),
}


def _picked(found: list[Table], pick: Pick) -> dict[str, str] | None:
    """The cells of ``pick``'s row by column name (None when the file lacks the row)."""
    table = next((t for t in found if t.heading == pick.heading), None)
    row = table.row(pick.contender) if table else None
    if table is None or row is None:
        return None
    if not pick.column:
        return dict(zip(table.header, row, strict=False))
    ratios = next((t for t in found if t.heading.startswith("Ratios: x SyncVectorEnv")), None)
    ratio_row = ratios.row(pick.contender) if ratios else None
    parts = ratios.column(ratio_row, pick.column).split(" / ") if ratios and ratio_row else []
    return {
        "contender": row[0],
        "steps/s": table.column(row, pick.column),
        "x sync": parts[0] if parts else "",
        "% ceiling": parts[1] if len(parts) > 1 else "",
    }


def summary_block(page: Path, name: str) -> str:
    """The summary table ``name`` of :data:`SUMMARIES`, each row naming its results file."""
    picks, columns = SUMMARIES[name]
    rows = ["| workload | " + " | ".join(columns) + " | from |", "|---" * (len(columns) + 2) + "|"]
    for pick in picks:
        found = _results(pick.study) if _date(pick.study) else None
        values = _picked(found[1], pick) if found else None
        if values is None:
            cells = ["-"] * len(columns)
            source = f"awaits a quiet run: `asyncsample bench {pick.study}`"
        else:
            cells = [values.get(c) or "-" for c in columns.values()]
            source = f"{_link(page, RESULTS / pick.study / 'results.md')} ({_date(pick.study)})"
        rows.append(f"| {pick.label} | " + " | ".join(cells) + f" | {source} |")
    return "\n".join(rows) + "\n"


# --------------------------------------------------------------------------------------------
# The index of benchmarks/results


#: What each folder that is not a study's own holds (a named variant, or a profile's results).
FOLDERS: dict[str, str] = {
    "ab": "the latest A/B: two source trees (B/A), or the Prometheus metrics off against on "
    "(on/off), the same workloads interleaved in one run",
    "ab/150-pairs": "metrics off against on (2026-11-28, the A/B then in ab/, see ad2f25c): its "
    "four noisier workloads again, 150 pairs each",
    "ab/6-repeats": "fa9dcee against aec9e7d (2026-12-03, blocking envs since issue 48 started): "
    "the two workloads whose pairs disagreed most, again with 6 repeats of twice the transitions",
    "ab/face-halfcheetah": "fa9dcee against aec9e7d (2026-12-03): the gymnasium face on "
    "HalfCheetah-v5 x4 in its default placement, the path of the clients study's HalfCheetah "
    "cells",
    "async_envs/hosts": "the async envs in the env hosts' event loops (process, Ray) at 1,000, "
    "10,000 and 50,000 episodes",
    "async_envs/big-chunk-10": "the 50,000-episode level of 1 s steps with batches and calls of "
    "ten steps per env (`--chunk 10`): ours on process hosts with inference='host' against the "
    "ceiling and plain asyncio",
    "async_envs/gc-threshold": "10,000 episodes with the collector's threshold raised in every "
    "contender's processes",
    "seam/gc-freeze": "the seam study with gc.freeze() at the start of each cell's process (what "
    "imports left is out of the collector's full walks)",
    "seam/gc-threshold": "the seam study's asyncio cells and plain asyncio in one process with "
    "the cyclic collector's thresholds raised (gc.set_threshold(100000, 10, 10)) in each cell's "
    "process",
    "seam/loop-lag": "the seam study's paced asyncio cell with loop_lag 1 ms, calls of 30 steps "
    "per env and the collector's thresholds raised, against plain asyncio in one process with "
    "the same thresholds",
    "seam/workers-4": "the seam study with 4 workers of 2,500 envs in place of 100 of 100 (fewer, "
    "larger ready batches per worker), without the tail cells and the profile",
    "frames": "raw-frame Pong (PongRaw-v5) with inference='host' against the two-loop ceiling "
    "in one run, and the CPU per step of each side (`benchmarks/frames.py`, issue 53)",
    "handoff": "a request's round trip to another process alone: a byte over a socket pair "
    "against a counter in shared memory (`benchmarks/handoff.py`)",
    "host/pinning": "the host study with the sampler's hosts pinned one per CPU",
    "multiagent": "64 Pistonball envs (PettingZoo, 20 agents each), random and MLP agents: ours "
    "in each inference mode against the two-loop ceiling, PufferLib's emulation in each vector "
    "config and RLlib (`benchmarks/multiagent.py`, issue 52)",
    "lockstep_phases": "a profile of the clients study's cells: each phase of a lockstep step "
    "timed inside the CleanRL loop (HalfCheetah-v5, 4 envs)",
    "lockstep_phases/cartpole-8": "the same profile on CartPole-v1 with 8 envs",
    "real_envs/raw-frames": "raw-frame Pong and HalfCheetah observed through 84x84 and 256x256 "
    "renders, random agent",
    "vector/pinning/pinned": "FixedCost-v0 x8, VectorEnv's hosts pinned one per CPU",
    "vector/pinning/unpinned": "the same, unpinned",
}


def _folders() -> Iterator[str]:
    """Every folder of benchmarks/results with a results.json, studies first, in order."""
    names = [s.name for s in STUDIES]
    found = sorted(str(p.parent.relative_to(RESULTS)) for p in RESULTS.rglob("results.json"))
    top = sorted(
        {f.split("/")[0] for f in found},
        key=lambda f: (names.index(f) if f in names else len(names), f),
    )
    for t in top:
        yield from (f for f in found if f == t or f.startswith(t + "/"))


def _provenance(results: dict[str, Any]) -> dict[str, Any]:
    """The command, commit, date and machine of a run, from its results.json."""
    prov = dict(results.get("provenance") or {})
    machine = prov.get("machine") or results.get("machine") or {}
    if not prov.get("date"):
        prov["date"] = machine.get("date") or results.get("date")
    prov.setdefault("command", results.get("command"))
    prov["machine"] = machine
    return prov


def _command(folder: str, command: str | None) -> str:
    """The command that wrote ``folder``: a variant's names its ``--out`` (a study's own folder is
    its default)."""
    if not command:
        return "not recorded"
    if "/" in folder or folder not in {s.name for s in STUDIES}:
        return f"{command} --out benchmarks/results/{folder}"
    return command


def _machine(machine: dict[str, Any]) -> str:
    cores = machine.get("cpu_affinity") or machine.get("cpu_count") or machine.get("cpus")
    cores = cores or machine.get("cores")
    model = machine.get("cpu_model") or machine.get("cpu") or ""
    model = re.sub(r"\(R\)|\(TM\)| Processor| \d+-Core.*", "", model).strip()
    parts = [
        f"{cores} cores" if cores else "",
        model,
        f"Python {machine['python']}" if machine.get("python") else "",
    ]
    return ", ".join(p for p in parts if p) or "-"


_PEERS = {"x sync": "SyncVectorEnv", "x async": "AsyncVectorEnv", "x EnvPool": "EnvPool"}


def _best_rows(found: list[Table]) -> list[str]:
    """A plan study's headline: per table of contenders, its best asyncsample row against the
    peers."""
    out = []
    for t in found:
        row = t.row("asyncsample*") if "steps/s" in t.header and "ratios" not in t.heading else None
        if row is None:
            continue
        ratios = ", ".join(
            f"{t.column(row, c)} {peer}"
            for c, peer in _PEERS.items()
            if t.column(row, c) not in ("", "-")
        )
        out.append(
            f"{t.heading}: {row[0]} {t.column(row, 'steps/s').split(' [')[0]} steps/s"
            f" ({t.column(row, '% ceiling')} of the ceiling"
            + (f"; {ratios}" if ratios else "")
            + ")"
        )
    return out


#: The headline of a script study's first table: one line per row it keeps.
_ROW_LINES: dict[str, tuple[Callable[[Table, list[str]], str], Callable[[list[str]], bool]]] = {
    "clients": (
        lambda t, r: f"{r[0]}, {r[1]} x{r[2]}: ours (default) {t.column(r, 'ours (default)')}",
        lambda r: True,
    ),
    "ab": (
        lambda t, r: (
            f"{r[0]}: "
            + (
                f"B/A {t.column(r, 'B/A')}"
                if "B/A" in t.header
                else f"on/off {t.column(r, 'on/off')}"
            )
            + f" ({t.column(r, 'verdict')})"
        ),
        lambda r: True,
    ),
    "async_envs": (
        lambda t, r: (
            f"{r[0]} episodes: {r[1]} {t.column(r, 'steps/s')} steps/s"
            f" ({t.column(r, '% ideal')} of the ideal)"
        ),
        lambda r: r[1].startswith("`ours-") and "zero" not in r[1],
    ),
    "hostloop": (
        lambda t, r: (
            f"{r[0]} x{r[1]} per slot: own {t.column(r, 'own us per env step')} us per "
            f"env step ({t.column(r, 'own share of a slot-step')} of a slot-step)"
        ),
        lambda r: True,
    ),
    "frames": (
        lambda t, r: (
            f"{r[0]}: {t.column(r, 'steps/s')} steps/s, {t.column(r, 'of the ceiling')} of the "
            f"ceiling; CPU us/step: caller {t.column(r, 'caller CPU us/step')}, hosts (loops) "
            f"{t.column(r, 'hosts (loops) CPU us/step')}"
        ),
        lambda r: True,
    ),
    "handoff": (
        lambda t, r: (
            f"{r[0]} env steps a request, {r[1]} between requests: socket {r[2]} us, "
            f"shared memory {r[3]} us"
        ),
        lambda r: r[0] == "0",
    ),
}


_MET = {"yes": "met", "no": "not met"}


def headline(folder: str, found: list[Table]) -> list[str]:
    """The figures a user looks for first in ``folder``'s results, one line each."""
    study = folder.split("/")[0]
    if study in ("vector", "policy", "real_envs", "host"):
        return _best_rows(found)
    if study == "scaling" and found:
        t = found[0]
        last = t.rows[-1]
        return [f"{last[0]} envs: " + ", ".join(f"{h} {c}" for h, c in zip(t.header[1:], last[1:]))]
    if study == "multiagent":
        return [
            f"{t.heading}: "
            + "; ".join(f"{r[0]} {r[1]} ({_MET.get(r[-1], r[-1])})" for r in t.rows)
            for t in found
            if t.heading.startswith("Targets")
        ]
    if study in _ROW_LINES and found:
        line, keep = _ROW_LINES[study]
        return [line(found[0], r) for r in found[0].rows if keep(r)]
    if study in ("chaos", "soak"):
        text = (RESULTS / folder / "results.md").read_text()
        checks = re.findall(r"All checks: \w+\.", text)
        lost = [r for r in found[0].rows if "lost" in r[0]] if found else []
        return [" ".join(checks)] + [f"{r[0]}: {', '.join(r[1:])}" for r in lost]
    return [f"a profile: {', '.join(t.heading for t in found)} (tables in its results.md)"]


def index() -> str:
    """The text of ``benchmarks/results/README.md``."""
    described = {s.name: s.measures for s in STUDIES}
    lines = [
        "# Benchmark results",
        "",
        "One folder per study, holding its latest results: `results.json` (every run's numbers, "
        "the settings, and its `provenance`: the command, commit, date and machine), "
        "`results.md` (the tables) and its charts. A named subfolder holds the latest run of a "
        "variant the docs cite. Earlier and superseded runs live in git history: "
        "`git log --stat -- benchmarks/results` lists them. How each study measures: "
        "[benchmarks/README.md](../README.md).",
        "",
        "Written by `asyncsample bench --pages` from the results files (do not edit): run a "
        "study (`asyncsample bench STUDY`), then `asyncsample bench --pages`.",
        "",
    ]
    awaiting = [s.name for s in STUDIES]
    for folder in _folders():
        found = _results(folder)
        if found is None:
            continue
        results, tabs = found
        study = folder.split("/")[0]
        if folder in awaiting:
            awaiting.remove(folder)
        prov = _provenance(results)
        commit = prov.get("commit") or (
            f"not recorded; the file came in with {prov['recorded_in_commit']}"
            if prov.get("recorded_in_commit")
            else "not recorded"
        )
        what = FOLDERS.get(folder) or described.get(folder) or described.get(study, "")
        if (results.get("settings") or {}).get("quick"):
            what += " (a smaller budget than the study's default: see its command)"
        lines += [
            f"## [{folder}]({folder}/results.md)",
            "",
            f"{what}." if what else "",
            "",
            f"- command: `{_command(folder, prov.get('command'))}`",
            f"- commit: {commit}",
            f"- date: {str(prov.get('date') or 'not recorded')[:16].replace('T', ' ')}",
            f"- machine: {_machine(prov['machine'])}",
            "- headline:",
            *[f"  - {h}" for h in headline(folder, tabs) if h],
            "",
        ]
    if awaiting:
        lines += ["## Awaiting a quiet run", ""]
        lines += [
            f"- `{n}`: `asyncsample bench {n}`: {described[n]}" for n in awaiting if n != "ab"
        ]
        lines.append("")
    return "\n".join(
        line for i, line in enumerate(lines) if not (line == "" and i and lines[i - 1] == "")
    )


# --------------------------------------------------------------------------------------------
# Figures: every figure of a page in the results file it cites

#: A figure: a number with a unit of the tables (x, k, M, %), or a range of two (``0.78-0.81x``).
_FIGURE = re.compile(
    r"(?<![\w.\-/])(\d[\d,]*(?:\.\d+)?)(?:(x|k|M|%)?-(\d[\d,]*(?:\.\d+)?))?(x|k|M|%)(?![\w/])"
)
_CITE = re.compile(r"benchmarks/results/[\w./-]*")
_HISTORY = re.compile(r"\b(?:commit|in|at|of) [0-9a-f]{7}\b")


def _chunks(text: str) -> Iterator[tuple[int, str, str]]:
    """The page's chunks (paragraphs, list items, tables, generated blocks) with their line and
    the section heading they are under; code blocks are left out."""
    heading, buf, start, fence, block = "", [], 0, False, False
    for n, line in enumerate([*text.splitlines(), ""], 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        if re.match(r"<!-- (studies|results|summary)", line):
            block = True
        if block:
            buf.append(line)
            start = start or n
            if re.match(r"<!-- /(studies|results|summary) -->", line):
                block = False
                yield start, heading, "\n".join(buf)
                buf, start = [], 0
            continue
        m = _HEADING.match(line)
        if m or not line.strip() or re.match(r"\s*[-*] |\d+\. ", line):
            if buf:
                yield start, heading, "\n".join(buf)
            buf, start = [], 0
            if m:
                heading = m.group(2)
                continue
        if line.strip():
            buf.append(line)
            start = start or n


def _figures_in(chunk: str) -> Iterator[str]:
    for m in _FIGURE.finditer(chunk):
        first, unit1, second, unit = m.groups()
        if second is None:
            yield first + unit
        else:  # "974-1.09k": a count below a thousand has no k; "0.78-0.81x": both are ratios
            yield first + (unit1 or ("" if unit in "kM" else unit))
            yield second + unit


def figures(page: Path, strict: bool = True) -> list[str]:
    """The figures of ``page`` that the results file its chunk cites does not hold.

    A chunk (a paragraph, list item, table or generated block) cites the results files it
    names; a chunk that names none cites those of the chunk before it under the same heading
    (a table under the sentence that names its file).

    Args:
        page: The page.
        strict: A figure in a chunk that cites no file in the tree is a problem too (README.md,
            docs/performance.md); else such a chunk, or one that names the commit holding its
            run (``in be2cf2b``), is not checked.

    Returns:
        One line per problem: the page's line, the figure and the file that lacks it.
    """
    problems = []
    last: tuple[str, list[str]] = ("", [])
    for line, heading, chunk in _chunks(page.read_text()):
        if chunk.startswith("<!-- studies"):
            continue
        cited = _CITE.findall(chunk)
        if not strict and not cited and _HISTORY.search(chunk):
            last = (heading, [])
            continue  # figures of a run in git history, named by its commit
        if not cited and last[0] == heading:
            cited = last[1]
        if cited:
            last = (heading, cited)
        found = list(_figures_in(chunk))
        if not found:
            continue
        if not cited:
            if strict:
                problems.extend(f"{page.name}:{line}: {f} cites no results file" for f in found)
            continue
        texts = []
        for c in cited:
            path = REPO / c.rstrip(".")
            if path.is_dir():
                path = path / "results.md"
            if path.suffix == ".json":
                path = path.with_name("results.md")
            texts.append(path.read_text() if path.exists() else "")
        if not any(texts):
            problems.append(f"{page.name}:{line}: cites {', '.join(cited)}, not in the tree")
            continue
        held = "\n".join(texts)
        problems.extend(
            f"{page.name}:{line}: {f} is not in {', '.join(cited)}"
            for f in found
            if not re.search(rf"(?<![\d.]){re.escape(f)}", held)
        )
    return problems
