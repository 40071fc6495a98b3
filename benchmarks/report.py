"""Write the results: ``results.json``, ``results.md`` and the PNG charts."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from benchmarks.contenders import CONTENDERS
from benchmarks.fmt import cores as _cores
from benchmarks.fmt import k as _k
from benchmarks.fmt import mb as _mb
from benchmarks.fmt import pct as _pct
from benchmarks.fmt import table as _table
from benchmarks.fmt import x as _x
from benchmarks.suite import Config, Settings

__all__ = [
    "CHARTS_SKIPPED",
    "draw_charts",
    "machine_info",
    "write_json",
    "write_markdown",
    "write_plots",
]

#: What a run without matplotlib says instead of drawing its charts.
CHARTS_SKIPPED = (
    "charts skipped: matplotlib is not installed (pip install matplotlib, or the bench extra); "
    "the results and tables are written"
)

_VERSIONED = [
    "numpy",
    "gymnasium",
    "uvloop",
    "psutil",
    "asyncsample",
    "stable-baselines3",
    "tianshou",
    "envpool",
    "torch",
]


def machine_info() -> dict[str, Any]:
    """CPU, memory, OS, Python and library versions, and the date."""
    cpu_model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions: dict[str, str | None] = {}
    for dist in _VERSIONED:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count() or 1
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "cpu_model": cpu_model,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": versions,
    }


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON."""
    path.write_text(json.dumps(payload, indent=1, default=str))


# --------------------------------------------------------------------------------------------
# Markdown


def _cell(agg: dict[str, Any] | None) -> str:
    """``median [min-max]`` (``!`` when other processes disturbed a run), or why no number."""
    if agg is None:
        return "-"
    if agg["status"] == "ok":
        mark = " !" if agg.get("disturbed") else ""
        if len(agg["rates"]) == 1:
            return _k(agg["median"]) + mark
        return f"{_k(agg['median'])} [{_k(agg['min'])}-{_k(agg['max'])}]{mark}"
    return "skipped" if agg["status"] == "skipped" else "error"


def _cores_cell(agg: dict[str, Any] | None) -> str:
    if not agg or not agg.get("own_cores"):
        return "-"
    return f"{statistics.median(agg['own_cores']):.2f}"


def _rows_main(
    results: dict[str, Any], group: str, envs: list[str]
) -> list[tuple[str, list[Config | None]]]:
    """Rows of a contender x env matrix: asyncsample shown once, with its best layout."""
    configs: list[Config] = results["_groups"][group]
    best = results["derived"]["best_layout"]
    rows: dict[str, list[Config | None]] = {}
    for cfg in configs:
        idx = envs.index(cfg.env)
        if cfg.contender == "asyncsample":
            name = "asyncsample process (best layout)"
            slot = best.get(f"{cfg.env}|{cfg.n_envs}")
            taken = rows.get(name, [None] * len(envs))[idx] is not None
            if (slot is not None and slot["key"] != cfg.key) or (slot is None and taken):
                continue
        else:
            name = cfg.label
        rows.setdefault(name, [None] * len(envs))[idx] = cfg
    return list(rows.items())


def write_markdown(path: Path, results: dict[str, Any]) -> None:
    """Write the markdown report.

    Args:
        path: Output file.
        results: The full results (with ``_groups`` holding :class:`Config` lists).
    """
    settings: Settings = results["_settings"]
    summary: dict[str, dict[str, Any]] = results["summary"]
    derived = results["derived"]
    groups: dict[str, list[Config]] = results["_groups"]
    machine = results["machine"]
    envs = list(settings.envs)
    ratios = derived["ratios"]
    lines: list[str] = ["# asyncsample benchmarks", ""]
    v = machine["versions"]
    lines += [
        f"{machine['date']} · {machine['cpu_affinity']} cores ({machine['cpu_model']}) · "
        f"Python {machine['python']} · numpy {v['numpy']} · gymnasium {v['gymnasium']} · "
        f"asyncsample {v['asyncsample'] or '(not installed)'}",
        "",
        f"Transitions per second (median [min-max] of {settings.repeats} runs, each in a fresh "
        f"process, warm-up excluded); every contender gets {settings.cores} cores and a random "
        f"agent. {settings.n_envs} env copies: asyncsample over {settings.n_processes} "
        f"processes, peers that need one process per env get {settings.n_envs}. "
        "Ideal = cores x a plain single-process `env.step` loop.",
        "",
    ]
    foreign = [f for agg in summary.values() for f in agg.get("foreign_cores") or []]
    if foreign:
        n_bad = sum(f > settings.max_foreign for f in foreign)
        lines += [
            f"Other processes on the machine used {statistics.mean(foreign):.2f} cores on "
            f"average during the timed phases (max {max(foreign):.2f}); {n_bad} of "
            f"{len(foreign)} runs had more than {settings.max_foreign} cores taken by others "
            "(marked `!`: a disturbed measurement).",
            "",
        ]

    if groups.get("main"):
        lines += [f"## Throughput, {settings.n_envs} envs", ""]
        header = ["contender", *envs]
        rows = []
        for name, cfgs in _rows_main(results, "main", envs):
            cells = []
            for cfg in cfgs:
                cell = _cell(summary.get(cfg.key)) if cfg else "-"
                if cfg and cfg.contender == "asyncsample" and cfg.layout:
                    cell += f" ({cfg.n_workers}x{cfg.envs_per_worker})"
                cells.append(cell)
            rows.append([name, *cells])
        ideal_row = ["ideal (cores x single loop)"]
        for env in envs:
            ideal_row.append(_k(derived["ideal"].get(env, {}).get("ideal_rate")))
        rows.append(ideal_row)
        lines += _table(header, rows)

        lines += ["### Ratios: x SyncVectorEnv / % of the ceiling / % of ideal", ""]
        rows = []
        for name, cfgs in _rows_main(results, "main", envs):
            cells = []
            for cfg in cfgs:
                r = ratios.get(cfg.key) if cfg else None
                cells.append(
                    f"{_x(r['vs_sync'])} / {_pct(r.get('vs_ceiling'))} / {_pct(r['vs_ideal'])}"
                    if r
                    else "-"
                )
            rows.append([name, *cells])
        lines += _table(["contender", *envs], rows)

        lines += [
            "### CPU cores used by each contender's processes (median over runs)",
            "",
        ]
        rows = []
        for name, cfgs in _rows_main(results, "main", envs):
            rows.append([name, *(_cores_cell(summary.get(c.key)) if c else "-" for c in cfgs)])
        lines += _table(["contender", *envs], rows)

        ours = [c for c in groups["main"] if c.contender == "asyncsample"]
        if ours:
            lines += [f"### asyncsample layouts ({settings.n_envs} envs, workers x envs/process)"]
            lines += [""]
            layouts = sorted({c.layout for c in ours}, key=lambda s: int(s.split("x")[0]))
            rows = []
            for layout in layouts:
                row = [layout]
                for env in envs:
                    cfg = next((c for c in ours if c.env == env and c.layout == layout), None)
                    row.append(_cell(summary.get(cfg.key)) if cfg else "-")
                rows.append(row)
            lines += _table(["layout (WxK/P)", *envs], rows)

    if groups.get("big"):
        lines += [f"## CartPole-v1, {settings.big_n_envs} envs", ""]
        rows = []
        for cfg in groups["big"]:
            r = ratios.get(cfg.key, {})
            rows.append(
                [
                    cfg.label,
                    _cell(summary.get(cfg.key)),
                    _x(r.get("vs_sync")),
                    _pct(r.get("vs_ceiling")),
                    _pct(r.get("vs_ideal")),
                ]
            )
        lines += _table(["contender", "steps/s", "x sync", "% ceiling", "% ideal"], rows)

    if groups.get("scaling"):
        lines += ["## Scaling: CartPole-v1 steps/s against the number of envs", ""]
        names: list[str] = []
        for cfg in groups["scaling"]:
            if cfg.contender not in names:
                names.append(cfg.contender)
        sizes = sorted({c.n_envs for c in groups["scaling"]})
        rows = []
        for n in sizes:
            row = [str(n)]
            for name in names:
                cfg = next(
                    (c for c in groups["scaling"] if c.contender == name and c.n_envs == n), None
                )
                row.append(_cell(summary.get(cfg.key)) if cfg else "-")
            rows.append(row)
        labels = [CONTENDERS[name][1] for name in names]
        if "asyncsample" in names:
            labels[names.index("asyncsample")] += (
                f" ({settings.scaling_workers} workers, P{settings.n_processes})"
            )
        lines += _table(["envs", *labels], rows)

    if derived["overhead"]:
        lines += [
            "## Overhead on NoOp-v0",
            "",
            "Per transition: wall time (1 / steps/s) and CPU budget (cores / steps/s); "
            "`added` = CPU budget minus the env's own step cost in a plain loop "
            f"({_us(derived['ideal'].get('NoOp-v0', {}).get('env_step_us'))} us). "
            "Per worker step: envs per worker / steps/s; round trip: workers x that "
            "(all workers in flight). With 1 worker the round trip is measured directly.",
            "",
        ]
        rows = []
        for o in derived["overhead"]:
            rows.append(
                [
                    o["label"],
                    str(o["n_envs"]),
                    _k(o["rate"]),
                    _us(o["us_per_transition"]),
                    _us(o["cpu_us_per_transition"]),
                    _us(o["added_cpu_us_per_transition"]),
                    _us(o["us_per_worker_step"]),
                    _us(o["round_trip_us"]),
                ]
            )
        header = [
            "contender",
            "envs",
            "steps/s",
            "us/transition",
            "CPU us/transition",
            "added CPU us",
            "us/worker step",
            "round trip us",
        ]
        lines += _table(header, rows)

    lag_rows = []
    for agg in summary.values():
        lag = agg.get("lag")
        if agg["contender"] in ("asyncsample", "asyncsample-local") and lag and lag.get("n"):
            idle = lag.get("idle") or {}
            lag_rows.append(
                [
                    agg["label"],
                    agg["env"],
                    str(agg["n_envs"]),
                    _ms(lag["p50_ms"]),
                    _ms(lag["p99_ms"]),
                    _ms(lag["max_ms"]),
                    str(lag["n"]),
                    _ms(idle.get("p99_ms")),
                ]
            )
    if lag_rows:
        lines += [
            "## Event-loop lag while sampling",
            "",
            "A task sleeps 1 ms in a loop during the timed phase of the instrumented run and "
            "records how late each wake-up is (ms). `idle p99`: the same probe before the "
            "sampler starts. The local backend steps envs in the loop's thread, so its lag is "
            "the length of a worker step.",
            "",
        ]
        header = ["contender", "env", "envs", "p50", "p99", "max", "wake-ups", "idle p99"]
        lines += _table(header, lag_rows)

    mem_rows = []
    for group in ("main", "big"):
        for cfg in groups.get(group, []):
            mem_agg = summary.get(cfg.key)
            mem = mem_agg.get("memory") if mem_agg else None
            if not mem:
                continue
            mem_rows.append(
                [
                    cfg.label,
                    cfg.env,
                    str(cfg.n_envs),
                    _mb(mem["main_rss"]),
                    _mb(mem["main_uss"]),
                    str(mem["n_children"]),
                    _mb(mem["children_rss_max"]),
                    _mb(mem["children_uss_sum"]),
                    _mb(mem.get("total_uss", mem.get("total_uss_peak"))),
                ]
            )
    if mem_rows:
        lines += [
            "## Memory (MiB: RSS peaks sampled during the timed phase, USS at its end)",
            "",
            "RSS counts shared pages in every process; USS (unique set size) is what each "
            "process alone holds, so `total USS` is the footprint of the whole contender. "
            "Children include helper processes (forkserver, resource tracker).",
            "",
        ]
        header = [
            "contender",
            "env",
            "envs",
            "main RSS",
            "main USS",
            "children",
            "max child RSS",
            "children USS",
            "total USS",
        ]
        lines += _table(header, mem_rows)

    if groups.get("policy"):
        lines += _policy_markdown(results)
    if groups.get("vector"):
        lines += [
            f"## asyncsample.VectorEnv against gymnasium's vector envs ({settings.n_envs} envs)",
            "",
            "Random actions, lockstep `step` (agent steps/s = vector steps x envs). The "
            f"ceiling: {settings.cores} plain single-env loops side by side, one process each.",
            "",
            *cell_tables(results, "vector"),
        ]
    if groups.get("host"):
        lines += [
            '## inference="host" with a random agent, every layout',
            "",
            "The built-in random agent runs inside the env hosts (`host`) or in the main "
            f"process (`per_worker`); calls of {settings.host_fragment_steps} steps per env; "
            f"the ceiling: {settings.cores} plain single-env loops side by side.",
            "",
            *cell_tables(results, "host"),
        ]

    main_targets = [t for t in derived["targets"] if not t.get("lower_is_better")]
    if any(t["value"] is not None for t in main_targets):
        lines += ["## Ratios against the goals (best asyncsample layout)", ""]
        rows = []
        for t in derived["targets"]:
            val = t["value"]
            if "%" in t["what"]:
                target, shown = f">= {_pct(t['target'])}", _pct(val)
            elif "ms" in t["what"]:
                target = f"< {t['target']:.0f} ms"
                shown = "-" if val is None else f"{val:.2f} ms"
            else:
                target, shown = f">= {t['target']:.1f}x", _x(val)
            met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
            rows.append([t["what"], target, shown, met])
        lines += _table(["target", "goal", "measured", ""], rows)

    notes: dict[tuple[str, str, str], list[str]] = {}
    for agg in summary.values():
        where = f"{agg['env']} x{agg['n_envs']}" + (f" {agg['layout']}" if agg["layout"] else "")
        name = CONTENDERS[agg["contender"]][1]
        kind = "note" if agg["status"] == "ok" else "skipped"
        for note in agg["notes"]:
            notes.setdefault((kind, name, note), []).append(where)
        for err in sorted(set(agg["errors"])):
            notes.setdefault(("ERROR", name, err), []).append(where)
    if notes:
        lines += ["## Notes", ""]
        for (kind, label, text), wheres in notes.items():
            lines.append(f"- {kind}: {label} ({', '.join(wheres)}): {text}")
        lines.append("")
    lines += [
        "Vector peers step in gymnasium's same-step autoreset mode (every step is a "
        "transition); tianshou resets done envs by id, as its Collector does; EnvPool's "
        "reset steps are not counted. The busy-waiting envs spin on CPU time "
        "(`time.thread_time`), so a pre-empted env process does not get its step for free.",
        "",
    ]
    path.write_text("\n".join(lines))


def _median(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def _policy_markdown(results: dict[str, Any]) -> list[str]:
    """The policy workload: steps/s, x SyncVectorEnv, CPU of main process and env hosts."""
    settings: Settings = results["_settings"]
    derived = results["derived"]
    lines = [
        "## Policy workload: a torch MLP drives every contender",
        "",
        "The same MLP (64x64 tanh, one torch thread per process, stochastic actions: "
        "Categorical on CartPole, Gaussian clipped to the box on HalfCheetah) picks every "
        "action, for every contender. asyncsample's inference modes: `per_worker` (one agent "
        "call per worker step), `batched` (the workers' calls merged into one, lockstep), "
        "`host` (a copy of the agent in each env host, chunks of steps per request). "
        f"Layouts are workers x envs per worker over {settings.n_processes} env-host "
        "processes; calls of "
        f"{settings.fragment_steps} steps per env. The ceiling: {settings.cores} "
        f"`SyncVectorEnv(n/{settings.cores})` + policy loops side by side, one process each; "
        "`% ceiling` is against the larger of it and SyncVectorEnv. TorchRL's collectors drive "
        "the same MLP as a `TensorDictModule`. CPU: cores used by the main process and by "
        "everything else the contender started, per second of wall time (median over runs).",
        "",
    ]
    lines += cell_tables(results, "policy")
    targets = derived.get("policy", {}).get("targets", [])
    if targets:
        lines += ["### Policy workload: ratios against the goals", ""]
        rows = []
        for t in targets:
            met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
            rows.append([t["what"], f">= {t['target']:.2f}x", _x(t["value"]), t["by"] or "-", met])
        lines += _table(["target", "goal", "measured", "by", ""], rows)
    return lines


def cell_tables(results: dict[str, Any], group: str) -> list[str]:
    """One table per (env, env count) cell of ``group``, the ceiling first, then by steps/s.

    Columns: steps/s (median [min-max]), % ceiling, x SyncVectorEnv and x AsyncVectorEnv, the
    cores of the main process and of the rest of the contender's processes, and rows per agent
    call (asyncsample).
    """
    summary: dict[str, dict[str, Any]] = results["summary"]
    ratios = results["derived"]["ratios"]
    configs: list[Config] = results["_groups"].get(group, [])
    cells: dict[tuple[str, int], list[Config]] = {}
    for cfg in configs:
        n = cfg.n_envs
        if cfg.contender == "ceiling" and not cfg.policy:
            # a random agent's ceiling (one env per loop) stands beside every env count
            for other in configs:
                if other.env == cfg.env and other.contender != "ceiling":
                    n = other.n_envs
                    cells.setdefault((cfg.env, n), [])
                    if cfg not in cells[(cfg.env, n)]:
                        cells[(cfg.env, n)].append(cfg)
            continue
        cells.setdefault((cfg.env, n), []).append(cfg)

    def order(cfg: Config) -> tuple[int, float]:
        agg = summary.get(cfg.key) or {}
        return (0 if cfg.contender == "ceiling" else 1, -(agg.get("median") or 0.0))

    lines: list[str] = []
    for (env, n), members in cells.items():
        rows = []
        for cfg in sorted(members, key=order):
            agg = summary.get(cfg.key)
            r = ratios.get(cfg.key) or {}
            calls = next((x for x in (agg or {}).get("notes", []) if "per agent call" in x), "")
            rows.append(
                [
                    cfg.label,
                    _cell(agg),
                    _pct(r.get("vs_ceiling")),
                    _x(r.get("vs_sync")),
                    _x(r.get("vs_async")),
                    _cores(_median((agg or {}).get("main_cores"))),
                    _cores(_median((agg or {}).get("host_cores"))),
                    calls.replace(" per agent call", ""),
                ]
            )
        lines += [f"### {env}, {n} envs", ""]
        header = [
            "contender",
            "steps/s",
            "% ceiling",
            "x sync",
            "x async",
            "main CPU",
            "others CPU",
            "per call",
        ]
        lines += _table(header, rows)
    return lines


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


# --------------------------------------------------------------------------------------------
# Charts


def draw_charts(
    draw: Callable[[Path, dict[str, Any]], list[Path]], out: Path, results: dict[str, Any]
) -> list[Path]:
    """Draw the charts of a run with ``draw``, or say on stderr that they were skipped.

    matplotlib is optional (a plain ``pip install`` has none): the measurements of a long run
    are worth more than its charts, so a missing matplotlib skips them instead of failing the
    run after it measured.

    Returns:
        The files written (none when matplotlib is missing).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(CHARTS_SKIPPED, file=sys.stderr)
        return []
    return draw(out, results)


def write_plots(out_dir: Path, results: dict[str, Any]) -> list[Path]:
    """Draw ``throughput.png`` (per env and contender) and ``scaling.png``.

    Args:
        out_dir: Directory for the PNGs.
        results: The full results (with ``_groups``).

    Returns:
        The files written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    settings: Settings = results["_settings"]
    summary = results["summary"]
    derived = results["derived"]
    groups: dict[str, list[Config]] = results["_groups"]
    written: list[Path] = []

    main_rows = _rows_main(results, "main", settings.envs) if groups.get("main") else []
    ok_keys = {key for key, agg in summary.items() if agg["status"] == "ok"}
    envs = [
        env
        for i, env in enumerate(settings.envs)
        if any(cfg is not None and cfg.key in ok_keys for cfg in (c[i] for _, c in main_rows))
    ]
    if main_rows and envs:
        fig, axes = plt.subplots(1, len(envs), figsize=(3.2 * len(envs) + 1.5, 4.6), squeeze=False)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for ax, env in zip(axes[0], envs, strict=True):
            idx = settings.envs.index(env)
            names, meds, lo, hi, cols = [], [], [], [], []
            for i, (name, cfgs) in enumerate(main_rows):
                cfg = cfgs[idx]
                agg = summary.get(cfg.key) if cfg else None
                if not agg or agg["status"] != "ok":
                    continue
                names.append(name.replace("gymnasium ", "").replace(" (best layout)", "*"))
                meds.append(agg["median"])
                lo.append(agg["median"] - agg["min"])
                hi.append(agg["max"] - agg["median"])
                cols.append(colors[i % len(colors)])
            y = list(range(len(names)))
            ax.barh(y, meds, xerr=[lo, hi], color=cols, capsize=2)
            ax.set_yticks(y, names, fontsize=7)
            top = max((m + h for m, h in zip(meds, hi, strict=True)), default=1.0)
            for yi, m, h in zip(y, meds, hi, strict=True):
                ax.text(m + h, yi, f"  {_k(m)}", va="center", fontsize=6)
            ideal = derived["ideal"].get(env, {}).get("ideal_rate")
            if ideal and ideal <= 2.5 * top:
                ax.axvline(ideal, color="k", ls="--", lw=1)
                ax.set_xlim(0, 1.25 * max(ideal, top))
            else:
                ax.set_xlim(0, 1.35 * top)
                if ideal:
                    ax.text(
                        0.98,
                        0.02,
                        f"ideal {_k(ideal)} ->",
                        transform=ax.transAxes,
                        ha="right",
                        va="bottom",
                        fontsize=7,
                    )
            ax.set_title(env, fontsize=9)
            ax.set_xlabel("transitions / s", fontsize=8)
            ax.tick_params(axis="x", labelsize=7)
            ax.xaxis.set_major_locator(MaxNLocator(4))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _k(v)))
            ax.invert_yaxis()
        fig.suptitle(
            f"Throughput, {settings.n_envs} envs, {settings.cores} cores "
            "(median, min-max; dashed: ideal = cores x single loop; *: best layout)",
            fontsize=10,
        )
        fig.tight_layout()
        path = out_dir / "throughput.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if groups.get("policy"):
        path = _policy_plot(out_dir, results, plt)
        if path is not None:
            written.append(path)

    if groups.get("scaling"):
        fig, ax = plt.subplots(figsize=(6.5, 4.4))
        by: dict[str, list[Config]] = {}
        for cfg in groups["scaling"]:
            by.setdefault(cfg.contender, []).append(cfg)
        for name, series in by.items():
            xs, ys, lo, hi = [], [], [], []
            for point in sorted(series, key=lambda c: c.n_envs):
                agg = summary.get(point.key)
                if agg and agg["status"] == "ok":
                    xs.append(point.n_envs)
                    ys.append(agg["median"])
                    lo.append(agg["median"] - agg["min"])
                    hi.append(agg["max"] - agg["median"])
            if xs:
                label = CONTENDERS[name][1]
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=label)
        ideal = derived["ideal"].get("CartPole-v1", {}).get("ideal_rate")
        if ideal:
            ax.axhline(ideal, color="k", ls="--", lw=1, label="ideal (cores x single loop)")
        ax.set_xscale("log", base=2)
        sizes = sorted({c.n_envs for c in groups["scaling"]})
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel("env copies")
        ax.set_ylabel("transitions / s")
        ax.set_title(f"CartPole-v1 scaling, {settings.cores} cores")
        ax.set_ylim(bottom=0, top=1.15 * ax.get_ylim()[1])
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _k(v)))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        path = out_dir / "scaling.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _policy_plot(out_dir: Path, results: dict[str, Any], plt: Any) -> Path | None:
    """``policy.png``: steps/s of every contender driven by the MLP, one panel per env and size."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    settings: Settings = results["_settings"]
    summary = results["summary"]
    configs: list[Config] = results["_groups"]["policy"]
    panels = [
        (env, n)
        for env in settings.policy_envs
        for n in settings.policy_n_envs
        if any(
            c.env == env and c.n_envs == n and summary.get(c.key, {}).get("status") == "ok"
            for c in configs
        )
    ]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 1.5, 5.2), squeeze=False)
    colors = {"sync": "C0", "async": "C1", "sb3": "C2"}
    modes = {"per_worker": "C3", "batched": "C4", "batched-threaded": "C5", "eager": "C6"}
    for ax, (env, n) in zip(axes[0], panels, strict=True):
        names, meds, cols = [], [], []
        for cfg in configs:
            agg = summary.get(cfg.key)
            if cfg.env != env or cfg.n_envs != n or not agg or agg["status"] != "ok":
                continue
            names.append(cfg.label.replace("gymnasium ", "").replace("asyncsample process ", ""))
            meds.append(agg["median"])
            cols.append(colors.get(cfg.contender) or modes.get(cfg.inference, "C7"))
        y = list(range(len(names)))
        ax.barh(y, meds, color=cols)
        ax.set_yticks(y, names, fontsize=6)
        for yi, m in zip(y, meds, strict=True):
            ax.text(m, yi, f" {_k(m)}", va="center", fontsize=6)
        ax.set_xlim(0, 1.3 * max(meds))
        ax.set_title(f"{env}, {n} envs", fontsize=9)
        ax.set_xlabel("transitions / s", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(4))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _k(v)))
        ax.invert_yaxis()
    fig.suptitle(
        f"Policy workload: torch MLP 64x64 drives every contender, {settings.cores} cores "
        "(asyncsample: inference mode, workers x envs/worker / processes)",
        fontsize=10,
    )
    fig.tight_layout()
    path = out_dir / "policy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
