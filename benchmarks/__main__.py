"""Command line of the benchmark suite: ``python -m benchmarks [--quick] [...]``.

Runs every contender on every env (see ``benchmarks.suite``) with a progress bar, then
writes ``results.json``, ``results.md``, ``throughput.png`` and ``scaling.png`` to ``--out``
(and ``policy.png`` for ``--groups policy``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import report, suite


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used by ``asyncsample bench``)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark asyncsample against gymnasium, SB3, tianshou and EnvPool.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny runs of everything (a smoke test, seconds)"
    )
    parser.add_argument(
        "--envs",
        nargs="+",
        choices=suite.ALL_ENVS,
        metavar="ENV",
        help=f"envs to run (default: all of {', '.join(suite.ALL_ENVS)})",
    )
    parser.add_argument(
        "--contenders",
        nargs="+",
        choices=suite.ALL_CONTENDERS,
        metavar="NAME",
        help=f"contenders to run (default: all of {', '.join(suite.ALL_CONTENDERS)})",
    )
    parser.add_argument(
        "--groups",
        nargs="+",
        choices=suite.GROUPS + suite.EXTRA_GROUPS,
        metavar="GROUP",
        help=f"parts of the suite to run (default: all of {', '.join(suite.GROUPS)}; "
        f"only when named: {', '.join(suite.EXTRA_GROUPS)})",
    )
    parser.add_argument("--repeats", type=int, help="runs per config (default 3; --quick: 1)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results",
        help="output directory (default: benchmarks/results)",
    )
    parser.add_argument("--timeout", type=float, help="seconds before a run is killed")
    parser.add_argument(
        "--retry-disturbed",
        type=int,
        default=0,
        metavar="N",
        help="re-run a run up to N times when other processes took more than --max-foreign "
        "cores during it (for shared machines; default 0)",
    )
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.25,
        metavar="CORES",
        help="cores other processes may use before a run counts as disturbed (default 0.25)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--render",
        type=Path,
        metavar="RESULTS_JSON",
        help="only re-write results.md and the charts from an existing results.json (to --out)",
    )
    return parser


def settings_from_args(args: argparse.Namespace) -> suite.Settings:
    """Turn parsed arguments into :class:`~benchmarks.suite.Settings`."""
    overrides: dict[str, Any] = {"cores": _cores()}
    if args.envs:
        overrides["envs"] = list(dict.fromkeys(args.envs))
    if args.contenders:
        overrides["contenders"] = list(dict.fromkeys(args.contenders))
        overrides["explicit"] = True
    if args.groups:
        overrides["groups"] = list(dict.fromkeys(["ideal", *args.groups]))
    if args.repeats is not None:
        if args.repeats < 1:
            raise SystemExit("--repeats must be >= 1")
        overrides["repeats"] = args.repeats
    if args.timeout is not None:
        overrides["timeout"] = args.timeout
    overrides["retry_disturbed"] = max(0, args.retry_disturbed)
    overrides["max_foreign"] = args.max_foreign
    if args.quick:
        return suite.Settings.quick_settings(**overrides)
    settings = suite.Settings()
    for key, value in overrides.items():
        setattr(settings, key, value)
    return settings


def _write_reports(
    out: Path,
    results: dict[str, Any],
    settings: suite.Settings,
    groups: dict[str, list[suite.Config]],
) -> list[Path]:
    """Write results.md and the charts; return the charts written."""
    full = results | {"_settings": settings, "_groups": groups}
    report.write_markdown(out / "results.md", full)
    return report.draw_charts(report.write_plots, out, full)


def render(results_json: Path, out: Path) -> int:
    """Re-write the markdown and the charts of an earlier run from the runs in its results.json."""
    results = json.loads(results_json.read_text())
    fields = {f.name for f in dataclasses.fields(suite.Settings)}
    settings = suite.Settings(**{k: v for k, v in results["settings"].items() if k in fields})
    settings.layouts = [(int(w), int(k)) for w, k in settings.layouts]
    settings.big_layouts = [(int(w), int(k)) for w, k in settings.big_layouts]
    settings.policy_layouts = {
        int(n): [(int(w), int(k)) for w, k in layouts]
        for n, layouts in settings.policy_layouts.items()
    }
    groups = suite.plan(settings)
    results["summary"] = suite.aggregate(results["runs"], settings.max_foreign)
    results["derived"] = suite.derive(results["summary"], groups, settings)
    pngs = _write_reports(out, results, settings, groups)
    print(f"wrote {out / 'results.md'}" + "".join(f", {p}" for p in pngs), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the suite.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        0 when every run finished or was skipped; 1 when a run failed (the results are
        written either way).
    """
    args = build_parser().parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.render is not None:
        return render(args.render, out)
    settings = settings_from_args(args)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="asyncsample-bench-") as tmp:
        log = out / "runs.jsonl"
        log.write_text("")
        records = suite.execute(settings, Path(tmp), progress=not args.no_progress, log=log)
    elapsed = time.perf_counter() - t0
    groups = suite.plan(settings)
    summary = suite.aggregate(records, settings.max_foreign)
    derived = suite.derive(summary, groups, settings)
    results: dict[str, Any] = {
        "machine": report.machine_info(),
        "settings": settings.to_dict(),
        "elapsed_s": elapsed,
        "groups": {g: [c.key for c in cfgs] for g, cfgs in groups.items()},
        "summary": summary,
        "derived": derived,
        "runs": records,
    }
    report.write_json(out / "results.json", results)
    (out / "runs.jsonl").unlink(missing_ok=True)  # results.json holds every run now
    pngs = _write_reports(out, results, settings, groups)
    errors = [r for r in records if r.get("status") in ("error", "timeout")]
    skipped = {r["key"] for r in records if r.get("status") == "skipped"}
    print(
        f"{len(records)} runs in {elapsed:.0f} s ({len(skipped)} configs skipped, "
        f"{len(errors)} runs failed); wrote {out / 'results.json'}, {out / 'results.md'}"
        + "".join(f", {p}" for p in pngs),
        file=sys.stderr,
    )
    for rec in errors:
        print(f"  failed: {rec['label']} on {rec['env']}: {rec.get('note')}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
