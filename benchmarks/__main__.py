"""Command line of the benchmarks: ``asyncsample bench --list | STUDY [--quick] [...]``.

``python -m benchmarks`` is the same. A plan study (see :mod:`benchmarks.studies`) runs its
configs with a progress bar, each run in a fresh process, then writes ``results.json``,
``results.md`` and its charts to ``benchmarks/results/STUDY`` (or ``--out``); a script study
runs its module's ``main``.
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

from benchmarks import report, studies, suite


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


#: The settings field that holds a group's envs (``--envs`` sets it; ``envs`` for the others).
ENV_FIELDS = {
    "policy": "policy_envs",
    "vector": "vector_envs",
    "host": "host_envs",
    "real": "real_envs",
    "sweep": "sweep_envs",
    "ray": "ray_envs",
}


#: The settings field that holds a group's asyncsample layouts (``--layouts`` sets it).
LAYOUT_FIELDS = {"main": "layouts", "big": "big_layouts", "host": "host_layouts",
                 "ray": "ray_layouts"}  # fmt: skip


def _layout(text: str) -> tuple[int, int]:
    """``"4x8"`` -> ``(4, 8)``."""
    try:
        w, k = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is WxK, e.g. 4x8, not {text!r}") from None
    return w, k


def build_parser(study: studies.Study | None = None) -> argparse.ArgumentParser:
    """The argument parser of one plan study (also what ``asyncsample bench STUDY`` parses)."""
    name = study.name if study else "STUDY"
    parser = argparse.ArgumentParser(
        prog=f"asyncsample bench {name}",
        description=study.measures if study else "Run one benchmark study.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="the CI budget: tiny runs (a smoke test, seconds)"
    )
    parser.add_argument("--plan", action="store_true", help="print the runs and exit")
    parser.add_argument(
        "--envs",
        nargs="+",
        choices=suite.KNOWN_ENVS,
        metavar="ENV",
        help=f"envs to run (default: the study's; any of {', '.join(suite.KNOWN_ENVS)})",
    )
    parser.add_argument(
        "--contenders",
        nargs="+",
        choices=suite.ALL_CONTENDERS,
        metavar="NAME",
        help=f"contenders to run (default: the study's; any of {', '.join(suite.ALL_CONTENDERS)})",
    )
    parser.add_argument(
        "--groups",
        nargs="+",
        choices=suite.GROUPS + suite.EXTRA_GROUPS,
        metavar="GROUP",
        help="groups to run (default: the study's)",
    )
    parser.add_argument("--repeats", type=int, help="runs per config (default: the study's)")
    parser.add_argument(
        "--out",
        type=Path,
        default=study.out() if study else None,
        help="output directory (default: benchmarks/results/STUDY)",
    )
    parser.add_argument("--timeout", type=float, help="seconds before a run is killed")
    parser.add_argument(
        "--layouts",
        nargs="+",
        type=_layout,
        metavar="WxK",
        help="asyncsample layouts (workers x envs per worker) of the study's main, big, host or "
        "ray group, e.g. --layouts 2x4 4x2",
    )
    parser.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="asyncsample env hosts (process backend) or actors (Ray; default 2). On a Ray "
        "cluster: RAY_ADDRESS=auto asyncsample bench ray --contenders asyncsample-ray "
        "--layouts 64x32 --processes 32",
    )
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


def settings_from_args(study: studies.Study, args: argparse.Namespace) -> suite.Settings:
    """The settings of ``study`` with the arguments' overrides."""
    overrides: dict[str, Any] = {"cores": _cores()}
    if args.envs:  # the envs of every group the study runs
        envs = list(dict.fromkeys(args.envs))
        overrides["envs"] = envs
        for group in args.groups or study.groups:
            if group in ENV_FIELDS:
                overrides[ENV_FIELDS[group]] = envs
    if args.contenders:
        overrides["contenders"] = list(dict.fromkeys(args.contenders))
        overrides["explicit"] = True
    if args.groups:
        overrides["groups"] = list(dict.fromkeys(args.groups))
    if args.repeats is not None:
        if args.repeats < 1:
            raise SystemExit("--repeats must be >= 1")
        overrides["repeats"] = args.repeats
    if args.timeout is not None:
        overrides["timeout"] = args.timeout
    if args.layouts:
        for group in args.groups or study.groups:
            if group in LAYOUT_FIELDS:
                overrides[LAYOUT_FIELDS[group]] = list(args.layouts)
    if args.processes is not None:
        overrides["n_processes"] = args.processes
    overrides["retry_disturbed"] = max(0, args.retry_disturbed)
    overrides["max_foreign"] = args.max_foreign
    settings: suite.Settings = studies.settings_for(study, args.quick, **overrides)
    return settings


def print_plan(study: studies.Study, settings: suite.Settings, verbose: bool) -> None:
    """Print the study's runs (with ``verbose``, each config) and its estimated length."""
    groups = suite.plan(settings)
    configs = suite.unique_configs(groups)
    runs, seconds = studies.estimate_seconds(settings)
    skipped = [c for c in configs if suite.pre_skip(c, settings) is not None]
    print(
        f"{study.name}: groups {', '.join(g for g in groups if groups[g])}; "
        f"{len(configs) - len(skipped)} configs x {settings.repeats} repeats = {runs} runs "
        f"({len(skipped)} configs skipped); about {seconds / 60:.1f} min on a quiet 2-core "
        "machine (rough)",
        file=sys.stderr,
        flush=True,
    )
    if verbose:
        for cfg in configs:
            why = suite.pre_skip(cfg, settings)
            print(f"  {cfg.env:<15} n={cfg.n_envs:<3} {cfg.label}"
                  + (f"  (skipped: {why})" if why else ""), file=sys.stderr)  # fmt: skip


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
    settings.host_layouts = [(int(w), int(k)) for w, k in settings.host_layouts]
    settings.ray_layouts = [(int(w), int(k)) for w, k in settings.ray_layouts]
    w, k = settings.straggler_layout
    settings.straggler_layout = (int(w), int(k))
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


def run_plan(study: studies.Study, argv: list[str]) -> int:
    """Run a plan study: its runs in fresh processes, then results.json, results.md, charts.

    Returns:
        0 when every run finished or was skipped; 1 when a run failed (the results are
        written either way).
    """
    args = build_parser(study).parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.render is not None:
        return render(args.render, out)
    settings = settings_from_args(study, args)
    print_plan(study, settings, verbose=args.plan)
    if args.plan:
        return 0
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
        "study": study.name,
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
        f"{study.name}: {len(records)} runs in {elapsed:.0f} s ({len(skipped)} configs skipped, "
        f"{len(errors)} runs failed); wrote {out / 'results.json'}, {out / 'results.md'}"
        + "".join(f", {p}" for p in pngs),
        file=sys.stderr,
    )
    for rec in errors:
        print(f"  failed: {rec['label']} on {rec['env']}: {rec.get('note')}", file=sys.stderr)
    return 1 if errors else 0


def run_script_study(study: studies.Study, argv: list[str]) -> int:
    """Run a script study: ``--quick``, ``--out`` and ``--repeats`` mapped, the rest passed on."""
    parser = argparse.ArgumentParser(prog=f"asyncsample bench {study.name}", add_help=False)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=study.out())
    parser.add_argument("--repeats", type=int)
    args, extra = parser.parse_known_args(argv)
    if args.repeats is not None:
        flag = {"ab": "--repeats"}.get(study.name)
        if flag is None:
            print(f"{study.name} has no repeats: --repeats ignored", file=sys.stderr)
        else:
            extra = [flag, str(args.repeats), *extra]
    args.out.mkdir(parents=True, exist_ok=True)
    return studies.run_script(study, args.quick, args.out, extra)


USAGE = """usage: asyncsample bench --list | STUDY [--quick] [--repeats N] [--plan] [...] | all
       asyncsample bench --pages [--check]

Runs one benchmark study; it writes benchmarks/results/STUDY/{results.json,results.md,*.png}.
`asyncsample bench STUDY -h` shows a study's options; `all [--quick]` runs every study but `ab`.
`--pages` copies the studies' tables into the README and docs/performance.md (the blocks marked
there), each naming its results file; `--pages --check` only says whether a page is out of date.
"""


def main(argv: list[str] | None = None) -> int:
    """``asyncsample bench``: list the studies, run one, or run them all.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        0 when done; 1 when a run failed (the results are written either way); 2 for a usage
        error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\nstudies (default budget on a quiet 2-core machine):\n" + studies.listing())
        return 0 if argv else 2
    if argv[0] == "--list":
        print(studies.listing())
        return 0
    if argv[0] == "--pages":
        from benchmarks import pages

        check = "--check" in argv[1:]
        changed = pages.update(check=check)
        for page in changed:
            print(f"{'out of date' if check else 'updated'}: {page}", file=sys.stderr)
        return 1 if check and changed else 0
    name, rest = argv[0], argv[1:]
    if name == "all":
        return run_all(rest)
    try:
        study = studies.get(name)
    except KeyError as exc:
        print(f"asyncsample bench: error: {exc.args[0]}", file=sys.stderr)
        return 2
    return run_study(study, rest)


def run_all(argv: list[str]) -> int:
    """Every study but ``ab`` in turn, each to its own results directory; then ``--pages``.

    Only ``--quick``, ``--repeats N`` and ``--no-progress`` apply to all of them.
    """
    parser = argparse.ArgumentParser(prog="asyncsample bench all")
    parser.add_argument("--quick", action="store_true", help="every study at its CI budget")
    parser.add_argument("--repeats", type=int, help="runs per config in every study")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    common = ["--quick"] if args.quick else []
    if args.repeats is not None:
        common += ["--repeats", str(args.repeats)]
    chosen = [s for s in studies.STUDIES if s.name != "ab"]
    total = sum(studies.estimate_minutes(s, args.quick) for s in chosen)
    print(f"all: {len(chosen)} studies, about {total:.0f} min (rough)", file=sys.stderr)
    codes = []
    for study in chosen:
        extra = ["--no-progress"] if args.no_progress and study.is_plan else []
        codes.append(run_study(study, [*common, *extra]))
    if not args.quick:  # the pages quote the new results files
        from benchmarks import pages

        for page in pages.update():
            print(f"updated: {page}", file=sys.stderr)
    return max(codes, default=0)


def run_study(study: studies.Study, argv: list[str]) -> int:
    """Run ``study`` with its arguments."""
    return run_plan(study, argv) if study.is_plan else run_script_study(study, argv)


if __name__ == "__main__":
    sys.exit(main())
