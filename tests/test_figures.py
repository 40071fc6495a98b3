"""Every figure the README and the performance pages quote is in the results file it cites.

``benchmarks.pages.figures`` reads a page chunk by chunk (paragraph, list item, table, generated
block): each figure (a number with a unit of the tables: ``2.48x``, ``86.4k``, ``90%``, or a range
of them) must appear in the ``benchmarks/results/...`` file the chunk names (or the chunk just
before it under the same heading names). On README.md and docs/performance.md a figure in a
chunk that names no file in the tree fails too; on docs/vector.md only the chunks that name a
file in the tree are held to it (the rest name the commit that holds their run).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import pages

STRICT = ["README.md", "docs/performance.md"]


@pytest.mark.parametrize("page", [*STRICT, "docs/vector.md"])
def test_every_quoted_figure_is_in_its_results_file(page: str) -> None:
    problems = pages.figures(pages.REPO / page, strict=page in STRICT)
    assert problems == [], "\n".join(problems)


def test_a_figure_missing_from_its_file_or_without_a_file_fails(tmp_path: Path) -> None:
    """The check itself: a figure the cited file lacks, a figure with no file, a range whose end
    is missing, and a table under the sentence naming its file."""
    page = tmp_path / "page.md"
    page.write_text(
        "## Speed\n\n"
        # Figures every run of the study has (the ceiling's 100%, SyncVectorEnv's 1.00x), so that
        # a new run of it leaves this test alone.
        "From `benchmarks/results/vector/results.md`: 100% of the ceiling, 1.00x and 9.99x.\n\n"
        "| a | b |\n|---|---|\n| 1.00x | 987.65x |\n\n"
        "## Other\n\n"
        "A claim of 3.5x with no file.\n\n"
        "From `benchmarks/results/vector/results.md`: 1.00-9.98x.\n\n"
        "```python\nprint('2.5x in code is not a figure')\n```\n"
    )
    problems = pages.figures(page, strict=True)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "9.99x is not in benchmarks/results/vector/results.md",
        "987.65x is not in benchmarks/results/vector/results.md",
        "3.5x cites no results file",
        "9.98x is not in benchmarks/results/vector/results.md",
    ]
    assert pages.figures(page, strict=False) == [
        p for p in problems if "cites no results file" not in p
    ]


def test_a_chunk_citing_a_file_gone_from_the_tree_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Stepped 2.9x (`benchmarks/results/results.md`).\n")
    assert pages.figures(page) == [
        "page.md:1: cites benchmarks/results/results.md, not in the tree"
    ]


def test_the_index_names_every_results_folder_and_nothing_is_loose() -> None:
    """benchmarks/results holds folders only (and its README), each indexed by the README."""
    results = pages.RESULTS
    loose = [p.name for p in results.iterdir() if p.is_file() and p.name != "README.md"]
    assert loose == []
    index = (results / "README.md").read_text()
    for path in results.rglob("results.json"):
        folder = path.parent.relative_to(results).as_posix()
        assert f"## [{folder}]({folder}/results.md)" in index, folder
    assert index == pages.index()


def test_a_summary_row_comes_from_its_study_or_awaits_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A summary row copies its cells from the study's table (a throughput cell and its ratios
    from the table below it), names the file and its date; a study not run awaits its run."""
    import json

    study = tmp_path / "throughput"
    study.mkdir()
    (study / "results.json").write_text(
        json.dumps({"study": "throughput", "machine": {"date": "2026-12-01T03:00:00+00:00"}})
    )
    (study / "results.md").write_text(
        "## Throughput, 8 envs\n\n| contender | CartPole-v1 | FixedCost-v0 |\n|---|---|---|\n"
        "| asyncsample process (best layout) | 22.3k (2x4) | 6.90k (2x4) |\n\n"
        "### Ratios: x SyncVectorEnv / % of the ceiling / % of ideal\n\n"
        "| contender | CartPole-v1 | FixedCost-v0 |\n|---|---|---|\n"
        "| asyncsample process (best layout) | 0.47x / 10% / 17% | 1.45x / 71% / 70% |\n"
    )
    monkeypatch.setattr(pages, "RESULTS", tmp_path)
    block = pages.summary_block(pages.REPO / "README.md", "readme")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in block.splitlines()}
    cartpole = rows["CartPole-v1, 8 envs, the sampler's calls (random agent)"]
    assert "| 22.3k (2x4) | 0.47x | - | 10% |" in cartpole and "(2026-12-01)" in cartpole
    costly = rows["an env costing 200 us a step, 8 envs, the sampler's calls"]
    assert "| 6.90k (2x4) | 1.45x | - | 71% |" in costly
    vector = rows["CartPole-v1, 64 envs, random actions"]
    assert "awaits a quiet run: `asyncsample bench vector`" in vector
