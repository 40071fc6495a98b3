"""Write the results: ``results.json``, ``results.md`` and the PNG charts."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from benchmarks.contenders import CONTENDERS
from benchmarks.fmt import cores as _cores
from benchmarks.fmt import f as _f
from benchmarks.fmt import k as _k
from benchmarks.fmt import mb as _mb
from benchmarks.fmt import pct as _pct
from benchmarks.fmt import table as _table
from benchmarks.fmt import x as _x
from benchmarks.suite import Config, Settings

__all__ = [
    "CHARTS_SKIPPED",
    "command_line",
    "draw_charts",
    "machine_info",
    "provenance",
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


def command_line(head: str | None = None, args: Sequence[str] | None = None) -> str:
    """The command that ran a study, as a user types it, without its ``--out`` (a path).

    Args:
        head: The command's name (``asyncsample bench async_envs``); default: from ``sys.argv[0]``
            (``asyncsample``, ``python -m benchmarks`` or ``python -m benchmarks.MODULE``).
        args: Its arguments (default: ``sys.argv[1:]``).
    """
    if head is None:
        prog = Path(sys.argv[0])
        if prog.name == "__main__.py":
            head = f"python -m {prog.parent.name}"
        elif prog.suffix == ".py":
            head = f"python -m {prog.parent.name}.{prog.stem}"
        else:
            head = prog.name
    shown: list[str] = []
    skip = False
    for arg in sys.argv[1:] if args is None else args:
        if skip or arg.startswith("--out="):
            skip = False
            continue
        if arg == "--out":
            skip = True
            continue
        shown.append(arg)
    return " ".join([head, *shown])


def _commit() -> str | None:
    """The checkout's commit (``+ uncommitted changes`` when its code differs), or None."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "asyncsample", "benchmarks/*.py")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + (" + uncommitted changes" if dirty else "")


def provenance() -> dict[str, Any]:
    """What a results file says of its run: the command, the commit, the date and the machine."""
    machine = machine_info()
    return {
        "command": command_line(),
        "commit": _commit(),
        "date": machine["date"],
        "machine": machine,
    }


def _with_provenance(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with a ``provenance`` entry first (kept when it has one)."""
    if "provenance" in payload:
        return payload
    return {"provenance": provenance(), **payload}


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON, with its :func:`provenance`."""
    path.write_text(json.dumps(_with_provenance(payload), indent=1, default=str))


def write_own_results(out: Path, result: dict[str, Any], markdown: str) -> None:
    """An own-runner study's ``results.json`` (with its :func:`provenance`) and ``results.md``
    in ``out``; prints the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_with_provenance(result), indent=2, default=str))
    (out / "results.md").write_text(markdown + "\n")
    print(markdown)


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


def _scaling_cpu(configs: list[Any], summary: dict[str, Any], sizes: list[int]) -> list[str]:
    """The main process's CPU per vector step of the lockstep contenders at each env count
    (issue 22: ``VectorEnv``'s step must cost the caller less than ``AsyncVectorEnv``'s)."""
    names = [
        n for n in ("sync", "async", "asyncsample-vector") if any(c.contender == n for c in configs)
    ]
    if not names:
        return []
    rows = []
    for n in sizes:
        row = [str(n)]
        for name in names:
            cfg = next((c for c in configs if c.contender == name and c.n_envs == n), None)
            s = summary.get(cfg.key) if cfg else None
            per_step = [
                cores / rate * n * 1e6
                for cores, rate in zip((s or {}).get("main_cores", []), (s or {}).get("rates", []))
                if rate
            ]
            row.append(f"{statistics.median(per_step):,.0f}" if per_step else "-")
        rows.append(row)
    return [
        "",
        "Main-process CPU per vector step (microseconds: the main process's cores / vector "
        "steps per second; lower is better). `SyncVectorEnv` steps every env in that process.",
        "",
        *_table(["envs", *(CONTENDERS[name][1] for name in names)], rows),
    ]


def _rows_main(
    results: dict[str, Any], group: str, envs: list[str]
) -> list[tuple[str, list[Config | None]]]:
    """Rows of a contender x env matrix: asyncsample shown once, with its best layout."""
    configs: list[Config] = _ceiling_first(results["_groups"][group])
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


def _ceiling_first(configs: list[Config]) -> list[Config]:
    """``configs`` with the ceiling's first (every table opens with what the machine gives)."""
    return sorted(configs, key=lambda c: c.contender != "ceiling")


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
        "Transitions per second ("
        + (
            f"median [min-max] of {settings.repeats - 1} uninstrumented runs, each in a fresh "
            "process, warm-up excluded; one more run per config carries the memory and "
            "loop-lag probes and is not counted, as its probes cost CPU"
            if settings.repeats > 1
            else "one run per config, in a fresh process, warm-up excluded, with the memory "
            "and loop-lag probes"
        )
        + f"); every contender gets {settings.cores} cores. The "
        f"ceiling: {settings.cores} independent loops side by side, one process each, in the "
        "same run (`% ceiling` in every table).",
        "",
    ]
    if groups.get("main"):
        lines += [
            f"Random agent. {settings.n_envs} env copies: asyncsample over "
            f"{settings.n_processes} processes, peers that need one process per env get "
            f"{settings.n_envs}. Ideal = cores x a plain single-process `env.step` loop.",
            "",
        ]
    foreign = [f for agg in summary.values() for f in agg.get("foreign_cores") or []]
    if foreign:
        n_bad = sum(f > settings.max_foreign for f in foreign)
        lines += [
            f"Other processes on the machine and the hypervisor's steal took "
            f"{statistics.mean(foreign):.2f} cores on "
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
        for cfg in _ceiling_first(groups["big"]):
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
        ceiling = next((c for c in groups["scaling"] if c.contender == "ceiling"), None)
        if ceiling is not None:  # one env per loop: the same ceiling beside every env count
            names.remove("ceiling")
            ceil = _k((summary.get(ceiling.key) or {}).get("median"))
            lines += [
                f"The ceiling ({settings.cores} plain single-env loops side by side): {ceil} "
                "steps/s; each cell: steps/s (% ceiling).",
                "",
            ]
        sizes = sorted({c.n_envs for c in groups["scaling"] if c.contender != "ceiling"})
        rows = []
        for n in sizes:
            row = [str(n)]
            for name in names:
                cfg = next(
                    (c for c in groups["scaling"] if c.contender == name and c.n_envs == n), None
                )
                pct = _pct((ratios.get(cfg.key) or {}).get("vs_ceiling")) if cfg else "-"
                row.append(f"{_cell(summary.get(cfg.key))} ({pct})" if cfg else "-")
            rows.append(row)
        labels = [CONTENDERS[name][1] for name in names]
        if "asyncsample" in names:
            labels[names.index("asyncsample")] += (
                f" ({settings.scaling_workers} workers, P{settings.n_processes})"
            )
        lines += _table(["envs", *labels], rows)
        lines += _scaling_cpu(groups["scaling"], summary, sizes)

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
        if agg["contender"] in ("asyncsample", "asyncsample-local", "asyncsample-ray") and (
            lag and lag.get("n")
        ):
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
    if groups.get("real"):
        lines += _real_markdown(results)
    if groups.get("sweep"):
        lines += _sweep_markdown(results)
    if groups.get("ray"):
        lines += [
            '## backend="ray" against backend="process"',
            "",
            "The same layout (workers x envs per worker over the same number of env hosts or Ray "
            f"actors), the built-in random agent, calls of {settings.ray_fragment_steps} steps per "
            "env; Ray started by the run (its start-up is not timed). `Image-v0`'s frames "
            "compress well, `NoiseImage-v0`'s not at all (the Ray backend compresses large "
            "observations). `x process`: against the process backend in the same layout.",
            "",
            *cell_tables(results, "ray"),
        ]
    if groups.get("stragglers"):
        lines += _stragglers_markdown(results)

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
        "`host` (a copy of the agent in each env host, chunks of steps per request), and "
        "`auto`, the default: the mode `Sampler` picks itself (which one is in the notes). "
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
    return lines + _targets_table(targets, "Policy workload: ratios against the goals")


def cells(results: dict[str, Any], group: str) -> dict[tuple[str, int, str], list[Config]]:
    """The configs of ``group`` by (env, env count, policy), each cell with its ceiling.

    A random agent's ceiling (one env per loop) stands beside every env count of its env.
    """
    configs: list[Config] = results["_groups"].get(group, [])
    out: dict[tuple[str, int, str], list[Config]] = {}
    for cfg in configs:
        if cfg.contender == "ceiling" and not cfg.policy:
            for other in configs:
                if other.env == cfg.env and other.contender != "ceiling" and not other.policy:
                    members = out.setdefault((cfg.env, other.n_envs, ""), [])
                    if cfg not in members:
                        members.append(cfg)
            continue
        out.setdefault((cfg.env, cfg.n_envs, cfg.policy), []).append(cfg)
    return out


#: Extra ratio columns of a group's cell tables: (header, key of the derived ratios).
EXTRA_RATIOS: dict[str, list[tuple[str, str]]] = {
    "real": [("x EnvPool", "vs_envpool")],
    "sweep": [("x EnvPool", "vs_envpool")],
    "ray": [("x process", "vs_process")],
    "stragglers": [("x fraction 1", "vs_full")],
}
POLICY_NAMES = {"mlp": "MLP policy", "cnn": "Nature-CNN policy"}


def cell_tables(results: dict[str, Any], group: str) -> list[str]:
    """One table per (env, env count, policy) cell of ``group``, the ceiling first, then by
    steps/s.

    Columns: steps/s (median [min-max]), % ceiling, x SyncVectorEnv and x AsyncVectorEnv (and
    the group's :data:`EXTRA_RATIOS`), the cores of the main process and of the rest of the
    contender's processes, and rows per agent call (asyncsample).
    """
    summary: dict[str, dict[str, Any]] = results["summary"]
    ratios = results["derived"]["ratios"]
    extra = EXTRA_RATIOS.get(group, [])

    def order(cfg: Config) -> tuple[int, float]:
        agg = summary.get(cfg.key) or {}
        return (0 if cfg.contender == "ceiling" else 1, -(agg.get("median") or 0.0))

    lines: list[str] = []
    for (env, n, policy), members in cells(results, group).items():
        rows = []
        for cfg in sorted(members, key=order):
            agg = summary.get(cfg.key)
            r = ratios.get(cfg.key) or {}
            notes = (agg or {}).get("notes", [])
            calls = next((x for x in notes if "per agent call" in x), "")
            rows.append(
                [
                    cfg.label,
                    _cell(agg),
                    _pct(r.get("vs_ceiling")),
                    _x(r.get("vs_sync")),
                    _x(r.get("vs_async")),
                    *(_x(r.get(key)) for _, key in extra),
                    _cores(_median((agg or {}).get("main_cores"))),
                    _cores(_median((agg or {}).get("host_cores"))),
                    calls.replace(" per agent call", ""),
                ]
            )
        agent = f", {POLICY_NAMES.get(policy, policy)}" if policy else ""
        lines += [f"### {env}, {n} envs{agent}", ""]
        header = [
            "contender",
            "steps/s",
            "% ceiling",
            "x sync",
            "x async",
            *(name for name, _ in extra),
            "main CPU",
            "others CPU",
            "per call",
        ]
        lines += _table(header, rows)
    return lines


def _targets_table(targets: list[dict[str, Any]], title: str) -> list[str]:
    """A table of ratio targets: what, goal, measured, by which config, met or not."""
    if not targets:
        return []
    rows = []
    for t in targets:
        met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        rows.append([t["what"], f">= {t['target']:.2f}x", _x(t["value"]), t.get("by") or "-", met])
    return [f"### {title}", "", *_table(["target", "goal", "measured", "by", ""], rows)]


def _real_markdown(results: dict[str, Any]) -> list[str]:
    """The ``real`` group: Atari and MuJoCo against EnvPool and the gymnasium peers."""
    settings: Settings = results["_settings"]
    lines = [
        "## Real envs: Atari and MuJoCo against EnvPool",
        "",
        "Atari: ale-py's game at `frameskip=1` under `AtariPreprocessing(noop_max=30, "
        "frame_skip=4, screen_size=84, grayscale_obs=True)` and `FrameStackObservation(4)` "
        "(`benchmarks.envs.make_atari`); EnvPool runs its own C++ port with the same settings "
        "(no fire reset, no sticky actions, no episodic life, no reward clipping), MuJoCo its "
        "own port too: the same task, not the same code. With a policy, the Nature-CNN "
        "(Atari) or the MLP 64x64 (MuJoCo) picks every action, one torch thread per process. "
        f"asyncsample: workers x envs per worker over {settings.n_processes} env hosts, calls "
        f"of {settings.real_fragment_steps} steps per env; EnvPool async: half the envs per "
        f"`recv`. The ceiling: {settings.cores} plain single-env loops side by side (random "
        f"agent) or {settings.cores} `SyncVectorEnv(n/{settings.cores})` + policy loops "
        "(policy; `% ceiling` against the larger of it and SyncVectorEnv). Steps are agent "
        "steps (4 frames each on Atari).",
        "",
        'Raw pixels (issue 35), random agent: `PongRaw-v5` is `gymnasium.make("ALE/Pong-v5")` '
        "with its defaults (210x160x3 uint8 frames, 100 KB each, frameskip 4, sticky actions "
        "0.25; EnvPool: its Pong at the same settings, frames channel-first); "
        "`HalfCheetahPixels84-v5` and `HalfCheetahPixels256-v5` observe HalfCheetah-v5 through "
        "its `rgb_array` renders (`benchmarks.envs.make_pixels`: Mesa's EGL, one rasteriser "
        "thread, where no GPU is present; EnvPool has no pixel MuJoCo)." + _raw_calls(settings),
        "",
        *cell_tables(results, "real"),
    ]
    return lines + _targets_table(results["derived"].get("real", {}).get("targets", []),
                                  "Real envs: ratios against the goals")  # fmt: skip


def _raw_calls(settings: Settings) -> str:
    """What calls the raw-pixel rows of ``settings`` run instead of ``real_fragment_steps``."""
    calls = {e: n for e, n in settings.raw_fragment_steps.items() if e in settings.real_envs}
    if not calls:
        return ""
    return (
        " asyncsample's calls there: "
        + ", ".join(f"{n} steps per env ({env})" for env, n in calls.items())
        + " (a render costs tens of ms: longer calls would make each run minutes long)."
    )


def _sweep_markdown(results: dict[str, Any]) -> list[str]:
    """The ``sweep`` group: steps/s, memory (PSS) and run length against the env count."""
    summary: dict[str, dict[str, Any]] = results["summary"]
    configs: list[Config] = results["_groups"]["sweep"]
    lines = [
        "## Sweep: 8 to 512 envs",
        "",
        "Random agent. `PSS` is the proportional set size of the contender's whole process "
        "tree at the end of the timed phase (shared pages split among the processes that map "
        "them, so it adds up to what the tree costs), from the instrumented run. `run s`: the "
        "wall time of the whole run process (start-up, warm-up, timed phase, close).",
        "",
    ]
    ratios = results["derived"]["ratios"]

    def series(cfg: Config) -> str:
        name = CONTENDERS[cfg.contender][1]
        if cfg.contender == "asyncsample":
            name += f" {cfg.inference or 'auto'}, {cfg.n_workers} workers"
        return name

    for env in dict.fromkeys(c.env for c in configs):
        mine = [c for c in configs if c.env == env and c.contender != "ceiling"]
        names = list(dict.fromkeys(series(c) for c in mine))
        sizes = sorted({c.n_envs for c in mine})
        by = {(series(c), c.n_envs): c for c in mine}

        def steps(cfg: Config) -> str:
            pct = _pct((ratios.get(cfg.key) or {}).get("vs_ceiling"))
            return f"{_cell(summary.get(cfg.key))} ({pct})"

        def pss(cfg: Config) -> str:
            return _mb(((summary.get(cfg.key) or {}).get("memory") or {}).get("total_pss"))

        def wall(cfg: Config) -> str:
            return _f(_median((summary.get(cfg.key) or {}).get("walls")), "{:.0f}")

        ceiling = next((c for c in configs if c.env == env and c.contender == "ceiling"), None)
        ceil = _k((summary.get(ceiling.key) or {}).get("median")) if ceiling else "-"
        for title, fmt in (("steps/s (% ceiling)", steps), ("PSS MiB", pss), ("run s", wall)):
            lines += [f"### {env}: {title}; the ceiling: {ceil} steps/s", ""]
            rows = [
                [str(n), *(fmt(by[(name, n)]) if (name, n) in by else "-" for name in names)]
                for n in sizes
            ]
            lines += _table(["envs", *names], rows)
    return lines


def _stragglers_markdown(results: dict[str, Any]) -> list[str]:
    """The ``stragglers`` group: steps/s by call and ``fraction_samples``."""
    settings: Settings = results["_settings"]
    w, k = settings.straggler_layout
    return [
        "## Stragglers: `fraction_samples` against the fixed per-worker split",
        "",
        f"{w} workers x {k} envs of `FixedCost-v0` over {settings.n_processes} env hosts; "
        f"worker 1's envs cost {settings.straggler_cost * 1e3:g} ms a step, the others' "
        f"200 us; episodes of {settings.straggler_episode_length} steps; calls of "
        f"{settings.straggler_steps} steps per env. `x fraction 1`: steps/s against the same "
        "call with `fraction_samples=1` (every worker its full share). The notes say in how "
        "many calls the guarantees held (every worker at its minimum, the call at its n).",
        "",
        *cell_tables(results, "stragglers"),
    ]


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

    for group in (
        "big",
        "overhead",
        "policy",
        "vector",
        "host",
        "real",
        "sweep",
        "ray",
        "stragglers",
    ):
        if groups.get(group):
            path = _cells_plot(out_dir, results, plt, group)
            if path is not None:
                written.append(path)

    if groups.get("scaling"):
        fig, ax = plt.subplots(figsize=(6.5, 4.4))
        by: dict[str, list[Config]] = {}
        for cfg in groups["scaling"]:
            by.setdefault(cfg.contender, []).append(cfg)
        for point in by.pop("ceiling", []):  # one env per loop: a line across every count
            agg = summary.get(point.key)
            if agg and agg["status"] == "ok":
                ax.axhline(agg["median"], color="C3", ls=":", lw=1.5, label="ceiling (loops)")
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
        sizes = sorted({c.n_envs for c in groups["scaling"] if c.contender != "ceiling"})
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


def _cells_plot(out_dir: Path, results: dict[str, Any], plt: Any, group: str) -> Path | None:
    """``GROUP.png``: steps/s of every contender of ``group``, one panel per cell (at most 8)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    settings: Settings = results["_settings"]
    summary = results["summary"]
    ok = {key for key, agg in summary.items() if agg["status"] == "ok"}
    panels = [(cell, members) for cell, members in cells(results, group).items()
              if any(c.key in ok for c in members)][:8]  # fmt: skip
    if not panels:
        return None
    cols = min(4, len(panels))
    rows_n = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.8 * cols + 1.5, 4.6 * rows_n), squeeze=False)
    colors = {"ceiling": "k", "sync": "C0", "async": "C1", "sb3": "C2", "envpool": "C8",
              "envpool-async": "C9", "asyncsample-ray": "C6"}  # fmt: skip
    modes = {"per_worker": "C3", "batched": "C4", "host": "C5", "auto": "C6"}
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, ((env, n, policy), members) in zip(axes.flat, panels, strict=False):
        names, meds, hues = [], [], []
        for cfg in members:
            agg = summary.get(cfg.key)
            if cfg.key not in ok or not agg:
                continue
            names.append(cfg.label.replace("gymnasium ", "").replace("asyncsample process ", ""))
            meds.append(agg["median"])
            hues.append(colors.get(cfg.contender) or modes.get(cfg.inference, "C7"))
        y = list(range(len(names)))
        ax.barh(y, meds, color=hues)
        ax.set_yticks(y, names, fontsize=6)
        for yi, m in zip(y, meds, strict=True):
            ax.text(m, yi, f" {_k(m)}", va="center", fontsize=6)
        ax.set_xlim(0, 1.3 * max(meds))
        agent = f", {POLICY_NAMES.get(policy, policy)}" if policy else ""
        ax.set_title(f"{env}, {n} envs{agent}", fontsize=9)
        ax.set_xlabel("transitions / s", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(4))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _k(v)))
        ax.invert_yaxis()
    fig.suptitle(
        f"{group}: steps/s on {settings.cores} cores (ceiling in black; asyncsample: inference "
        "mode, workers x envs/worker / processes)",
        fontsize=10,
    )
    fig.tight_layout()
    path = out_dir / f"{group}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
