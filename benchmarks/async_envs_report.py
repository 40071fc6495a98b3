"""The ``async_envs`` study's report: the tables, the targets (issues 23 and 33), the chart."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from benchmarks import fmt
from benchmarks.async_envs_cells import CONTENDERS, HOST_CONTENDERS, CellSpec
from benchmarks.latency_envs import MEAN_LATENCY_S

__all__ = ["HEADER", "best_rows", "markdown", "targets", "write_chart"]

#: What a cell that did not measure shows (refused by the sampler, peer not installed).
NOT_AVAILABLE = ("refused", "unavailable")


def level_of(rec: dict[str, Any]) -> tuple[int, float]:
    """A record's level: (episodes in flight, mean latency)."""
    return rec["spec"]["n_episodes"], rec["spec"]["mean"]


def _ok(rec: dict[str, Any] | None) -> bool:
    return rec is not None and rec.get("status") == "ok"


def best_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (level, contender): ours' better layout (highest steps/s; lowest CPU per
    step for the zero-latency env), or the failed run when none finished."""
    best: dict[tuple[int, float, str], dict[str, Any]] = {}
    for rec in records:
        key = (*level_of(rec), rec["spec"]["contender"])
        old = best.get(key)
        if old is None or _better(rec, old):
            best[key] = rec
    order = {c: i for i, c in enumerate(CONTENDERS)}
    return sorted(
        best.values(),
        key=lambda r: (
            r["spec"]["mean"] == 0,
            r["spec"]["n_episodes"],
            order.get(r["spec"]["contender"], 99),
        ),
    )


def _better(new: dict[str, Any], old: dict[str, Any]) -> bool:
    if not _ok(new):
        return False
    if not _ok(old):
        return True
    if new["spec"]["contender"] == "ours-asyncio-zero":
        return bool((new["cpu_us_per_step"] or math.inf) < (old["cpu_us_per_step"] or math.inf))
    return bool((new["steps_per_s"] or 0) > (old["steps_per_s"] or 0))


def ceilings(records: list[dict[str, Any]]) -> dict[tuple[int, float], float]:
    """The ceiling's steps/s per level."""
    return {
        level_of(r): r["steps_per_s"]
        for r in records
        if r["spec"]["contender"] == "ceiling" and _ok(r) and r.get("steps_per_s")
    }


def level_name(spec: dict[str, Any], base_mean: float) -> str:
    """``"10,000"``, with the mean latency when it is not the run's ``base_mean``."""
    n = f"{spec['n_episodes']:,}"
    if spec["mean"] <= 0:
        return f"{n} (no latency)"
    return n if spec["mean"] == base_mean else f"{n} ({spec['mean'] * 1e3:g} ms)"


def _row(rec: dict[str, Any], ceiling: dict[tuple[int, float], float], base: float) -> list[str]:
    spec = rec["spec"]
    layout = rec["layout"] + (f", {rec['stream']} stream" if rec.get("stream") else "")
    head = [level_name(spec, base), f"`{spec['contender']}`", layout]
    if not _ok(rec):
        status = rec.get("status")
        note = str(rec.get("note", ""))
        if status == "refused":  # the sampler's message, once, under Notes
            text = "not available: refused by the sampler (see the notes)"
        else:
            text = (note if status in NOT_AVAILABLE else f"{status}: {note}")[:160]
        return head + [text] + ["-"] * (len(HEADER) - 4)
    lag = rec.get("lag") or {}
    per_ep = rec.get("bytes_per_episode")
    top = ceiling.get(level_of(rec))
    return [
        *head,
        fmt.k(rec["steps_per_s"]),
        fmt.pct(rec["ratio_to_ideal"]),
        fmt.pct(rec["steps_per_s"] / top if top and rec["steps_per_s"] else None),
        f"{fmt.f(lag.get('p50_ms'))} / {fmt.f(lag.get('p99_ms'))}",
        f"{fmt.f(rec['cpu_us_per_step'], '{:.1f}')} / "
        f"{fmt.f(rec.get('host_cpu_us_per_step'), '{:.1f}')}",
        fmt.f(None if per_ep is None else per_ep / 1024, "{:.1f}"),
        f"{fmt.f(rec['call_p50_s'])} / {fmt.f(rec['call_p99_s'])}",
        f"{fmt.f(rec['timeout_call_p50_s'])} / {fmt.f(rec['timeout_call_p99_s'])}",
    ]


HEADER = [
    "episodes",
    "contender",
    "layout",
    "steps/s",
    "% ideal",
    "% ceiling",
    "loop lag p50 / p99 ms",
    "CPU us/step caller / hosts",
    "KiB/episode",
    "call p50 / p99 s",
    "with episode_timeout p50 / p99 s",
]


def fragment_rows(records: list[dict[str, Any]], base: float) -> list[list[str]]:
    """Ours' consecutive ``obtain_fragments`` calls beside the stream, per level (best layout
    of the calls)."""
    best: dict[tuple[int, float, str], dict[str, Any]] = {}
    for rec in records:
        calls = rec.get("fragment_calls") or {}
        if not _ok(rec) or not calls.get("steps_per_s"):
            continue
        key = (*level_of(rec), rec["spec"]["contender"])
        old = best.get(key)
        if old is None or calls["steps_per_s"] > old["fragment_calls"]["steps_per_s"]:
            best[key] = rec
    rows = []
    for rec in best_rows(list(best.values())):
        calls = rec["fragment_calls"]
        lag = calls.get("lag") or {}
        rows.append([
            level_name(rec["spec"], base), f"`{rec['spec']['contender']}`", rec["layout"],
            f"{calls.get('chunk', 0):,}",
            f"{fmt.k(calls['steps_per_s'])} ({fmt.pct(calls['ratio_to_ideal'])})",
            f"{fmt.k(rec['steps_per_s'])} ({fmt.pct(rec['ratio_to_ideal'])}, {rec['stream']})",
            f"{fmt.f(lag.get('p50_ms'))} / {fmt.f(lag.get('p99_ms'))}",
        ])  # fmt: skip
    return rows


FRAGMENT_HEADER = [
    "episodes",
    "contender",
    "layout",
    "steps per call",
    "fragment calls: steps/s (% ideal)",
    "stream: steps/s (% ideal)",
    "calls' loop lag p50 / p99 ms",
]


def targets(records: list[dict[str, Any]]) -> list[str]:
    """The issues' targets (33, then 23), each with the measured value and whether it is met."""
    rows = {(*level_of(r), r["spec"]["contender"]): r for r in best_rows(records)}
    big = sorted({level_of(r) for r in records if r["spec"]["mean"] > MEAN_LATENCY_S})

    def ok(n: int, contender: str, mean: float = MEAN_LATENCY_S) -> dict[str, Any] | None:
        rec = rows.get((n, mean, contender))
        return rec if _ok(rec) else None

    def why(n: int, contenders: tuple[str, ...], mean: float = MEAN_LATENCY_S) -> str:
        """Why nothing was measured: the first not-available note, or "not run"."""
        for c in contenders:
            rec = rows.get((n, mean, c))
            if rec is not None:
                return str(rec.get("note") or rec.get("status"))[:90]
        return "not run"

    lines: list[str] = []

    def check(name: str, value: float | None, goal: str, met: bool | None, why: str = "") -> None:
        verdict = ("not measured" + (f" ({why})" if why else "")) if met is None else (
            "met" if met else "NOT met")  # fmt: skip
        lines.append(f"| {name} | {goal} | {fmt.f(value)} | {verdict} |")

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    hosts = tuple(HOST_CONTENDERS)
    top = ceilings(records).get((10_000, MEAN_LATENCY_S))
    placed = [r for c in hosts if (r := ok(10_000, c))]
    best = max(placed, key=lambda r: r["steps_per_s"] or 0, default=None)
    share = ratio(best["steps_per_s"], top) if best else None
    missing = why(10_000, hosts) if not best else ""
    check("10,000: best process/ray layout / ceiling", share, ">= 0.8",
          None if share is None else share >= 0.8, missing)  # fmt: skip
    lag = ((best or {}).get("lag") or {}).get("p99_ms")
    check("10,000: that layout's caller loop lag p99 (ms)", lag, "< 20",
          None if lag is None else lag < 20, missing)  # fmt: skip
    ours, plain = ok(10_000, "ours-asyncio"), ok(10_000, "plain-asyncio")
    lane = ratio(ours["steps_per_s"], plain["steps_per_s"]) if ours and plain else None
    check("10,000: asyncio / plain asyncio (one process)", lane, ">= 0.5",
          None if lane is None else lane >= 0.5)  # fmt: skip
    rec = ok(1000, "ours-asyncio")
    calls = (rec or {}).get("fragment_calls") or {}
    frag = calls.get("ratio_to_ideal")
    check("1,000: consecutive obtain_fragments calls / ideal", frag, ">= 0.8",
          None if frag is None else frag >= 0.8)  # fmt: skip
    for n, mean in big:
        name = f"{n:,} of {mean:g} s"
        mine = [r for c in ("ours-asyncio", *hosts) if (r := ok(n, c, mean))]
        best_big = max(mine, key=lambda r: r["steps_per_s"] or 0, default=None)
        value = (best_big or {}).get("ratio_to_ideal")
        check(f"{name}: best of ours / ideal", value, ">= 0.9",
              None if value is None else value >= 0.9)  # fmt: skip
        plain_big = ok(n, "plain-asyncio", mean)
        mem = (
            ratio(best_big.get("bytes_per_episode"), plain_big.get("bytes_per_episode"))
            if best_big and plain_big
            else None
        )
        check(f"{name}: memory per open episode / plain asyncio's", mem, "<= 2",
              None if mem is None else mem <= 2)  # fmt: skip
    split = ("ours-process-per_worker", "ours-process-batched", "ours-ray-batched")
    cpus = [r["cpu_us_per_step"] for c in split if (r := ok(10_000, c)) and r["cpu_us_per_step"]]
    cpu = min(cpus) if cpus else None
    check("10,000: per_worker/batched in hosts, caller CPU per step (us)", cpu, "<= 10",
          None if cpu is None else cpu <= 10, why(10_000, split) if not cpus else "")  # fmt: skip
    issue33 = ["| target | goal | measured | verdict |", "|---|---|---|---|", *lines, ""]
    lines = []

    for n, goal in ((1000, 0.9), (10_000, 0.8)):
        rec = ok(n, "ours-asyncio")
        value = rec["ratio_to_ideal"] if rec else None
        check(f"asyncio at {n:,}: share of the ideal", value, f">= {goal}",
              None if value is None else value >= goal)  # fmt: skip
    ours, pool = ok(1000, "ours-asyncio"), ok(1000, "pool-32")
    speedup = ratio(ours["steps_per_s"], pool["steps_per_s"]) if ours and pool else None
    check("asyncio / 32-thread pool at 1,000", speedup, ">= 10",
          None if speedup is None else speedup >= 10)  # fmt: skip
    lags: dict[int, list[float]] = {}
    for r in records:
        p99 = (r.get("lag") or {}).get("p99_ms")
        if _ok(r) and r["spec"]["contender"] == "ours-asyncio" and p99 is not None:
            if r["spec"]["mean"] == MEAN_LATENCY_S:
                lags.setdefault(r["spec"]["n_episodes"], []).append(p99)
    for n, level_lags in sorted(lags.items()):
        worst = max(level_lags)
        check(f"asyncio at {n:,}: worst loop lag p99 (ms), every layout", worst, "< 20",
              worst < 20)  # fmt: skip
    spreads = [
        r["timeout_call_p99_s"] / r["timeout_call_p50_s"]
        for r in rows.values()
        if _ok(r) and r["spec"]["contender"] == "ours-asyncio" and r.get("timeout_call_p50_s")
    ]
    spread = max(spreads) if spreads else None
    check("asyncio with episode_timeout: call p99 / p50 (worst level)", spread, "<= 1.5",
          None if spread is None else spread <= 1.5)  # fmt: skip
    zero = [r for r in rows.values() if r["spec"]["contender"] == "ours-asyncio-zero" and _ok(r)]
    cpu = zero[0]["cpu_us_per_step"] if zero else None
    n_zero = zero[0]["spec"]["n_episodes"] if zero else 1000
    check(f"zero-latency asyncio at {n_zero:,}: main-process CPU per step (us)", cpu, "<= 20",
          None if cpu is None else cpu <= 20)  # fmt: skip
    issue23 = ["| target | goal | measured | verdict |", "|---|---|---|---|", *lines, ""]
    return ["## Targets (issue 33)", "", *issue33, "## Targets (issue 23)", "", *issue23]


def markdown(results: dict[str, Any]) -> str:
    """The study's report: set-up, the table (best layout), targets, every run, notes."""
    spec = CellSpec("", 0, **results["plan"]["spec"])
    cfg = dataclasses.asdict(spec)
    records = results["runs"]
    model = spec.latency()
    plan = results["plan"]
    big = plan.get("big") or []
    top = ceilings(records)
    lines = [
        "# Envs that wait: thousands of concurrent episodes (`asyncsample bench async_envs`)",
        "",
        f"`{results['command']}`",
        "",
        f"Each step waits {model.mean * 1e3:g} ms on average: {model.base * 1e3:.1f} ms, "
        f"{model.tail_probability:.0%} of the steps {model.tail_factor:g}x longer, "
        f"+-{model.jitter:.0%} jitter, drawn from the env's seeded RNG; episodes of "
        f"{cfg['episode_length']} steps. The ideal is N / mean latency; the ceiling is "
        f"`plain-asyncio` in {spec.n_cores} processes side by side, timed in one window. Timed "
        f"phase {cfg['seconds']:g} s after {cfg['warmup_s']:g} s of warm-up; {cfg['calls']} calls "
        f"of N x {cfg['episode_length']} steps for the call durations (p99 of few calls is "
        f"about their max); `episode_timeout` = {cfg['timeout_factor']:g}x the mean episode "
        f"duration. Event loop: {cfg['loop']}. Cyclic collector: "
        + (
            f"thresholds {tuple(cfg['gc_threshold'])} in every contender's processes"
            if cfg.get("gc_threshold")
            else "Python's defaults in the contenders' processes"
        )
        + " (ours' env hosts set their own)."
        + (
            f" Big level: {', '.join(f'{n:,}' for n in big)} episodes of "
            f"{plan.get('big_mean', 1.0) * 1e3:g} ms mean latency (same tail), ceiling, plain "
            "asyncio and ours only, ours in the wide layout only."
            if big
            else ""
        ),
        "",
        f"Machine: {results['machine'].get('cpu_affinity')} cores "
        f"({results['machine'].get('cpu_model')}), load before `{results['load_before']}`, "
        f"after `{results['load_after']}` (a shared machine: see the load).",
        "",
        "## Best layout per contender",
        "",
        *fmt.table(HEADER, [_row(r, top, spec.mean) for r in best_rows(records)]),
        "## Consecutive `obtain_fragments` calls beside the stream",
        "",
        *fmt.table(FRAGMENT_HEADER, fragment_rows(records, spec.mean)),
        *targets(records),
        "## Every run",
        "",
        *fmt.table(HEADER, [_row(r, top, spec.mean) for r in records]),
        "## Notes",
        "",
        "- `ceiling`: the CPU is its loops' (hosts column); its lag is the worse loop's. "
        "`% ceiling` is a cell's steps/s over the ceiling's at the same level.",
        "- `ours-process-*`, `ours-ray-batched`: async envs in the env hosts (issue 33); "
        '"not available: refused" is the sampler\'s refusal today, recorded by the cell. '
        "Their steps are counted from the batches delivered (the envs step in the hosts).",
        '- `torchrl-asyncio`: TorchRL\'s `AsyncEnvPool(backend="asyncio")`, where the '
        "installed TorchRL has it (see its row's note).",
        "- `gym-async` runs at most 64 envs (a process per env); its ratio is against the "
        "cell's ideal. It has no event loop (a blocking call): no lag; its call is "
        f"{cfg['episode_length']} lockstep steps.",
        "- `pool-N`: one asyncio task per env awaiting `loop.run_in_executor`; its call is "
        "every env running one episode. A call whose length at the measured rate would pass "
        f"{cfg['call_limit_s']:g} s is skipped.",
        f"- Ours: steps/s from a stream of each kind in {cfg['streams']} on one sampler "
        f"(batches of {cfg['chunk_s']:g} s of steps at the ideal rate; the better one counts, "
        "see `stream` and `streams` in results.json), counted as the env steps happen; calls "
        "are `obtain_samples(N x episode length)`. Fragment calls: `obtain_fragments(chunk)` "
        "again and again on the same sampler, after the streams.",
        "- CPU us/step: caller: `time.process_time()` of the main process over the timed phase "
        "/ steps, less the lag probe's own CPU (measured on the idle loop; "
        "`cpu_us_per_step_raw` in results.json keeps it); hosts: the CPU of its child "
        "processes (psutil; env hosts, the ceiling's loops, gymnasium's env processes). "
        "KiB/episode: growth of the RSS of the process tree (RSS double-counts shared pages "
        "of child processes) / envs.",
        "- Loop lag: a task sleeping 1 ms records how late it wakes; on an idle loop it reads "
        "the timer's granularity (`idle_lag` in results.json).",
    ]
    refusals: dict[str, list[str]] = {}
    for rec in records:
        if rec.get("status") == "refused":
            names = refusals.setdefault(str(rec.get("note")), [])
            if rec["spec"]["contender"] not in names:
                names.append(rec["spec"]["contender"])
    for note, names in refusals.items():
        lines.append(f"- {', '.join(f'`{n}`' for n in names)}: {note}")
    for rec in records:
        for note in rec.get("notes") or []:
            lines.append(f"- `{rec['spec']['contender']}` N={rec['spec']['n_episodes']}: {note}")
    return "\n".join(lines) + "\n"


def write_chart(out: Path, results: dict[str, Any]) -> list[Path]:
    """``async_envs.png``: steps/s per level and contender (log scale) against the ideal, and
    the event-loop lag p99 beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        r
        for r in best_rows(results["runs"])
        if r.get("status") == "ok" and r["spec"]["contender"] != "ours-asyncio-zero"
    ]
    if not rows:
        return []
    levels = sorted({r["spec"]["n_episodes"] for r in rows})
    contenders = [c for c in CONTENDERS if any(r["spec"]["contender"] == c for r in rows)]
    cell = {(r["spec"]["contender"], r["spec"]["n_episodes"]): r for r in rows}
    width = 0.8 / len(contenders)
    fig, (rate_ax, lag_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, value in (
        (rate_ax, lambda r: r["steps_per_s"]),
        (lag_ax, lambda r: (r.get("lag") or {}).get("p99_ms")),
    ):
        for j, c in enumerate(contenders):
            xs, ys = [], []
            for i, n in enumerate(levels):
                rec = cell.get((c, n))
                if rec is not None and value(rec) is not None:
                    xs.append(i + (j - (len(contenders) - 1) / 2) * width)
                    ys.append(value(rec))
            if ys:
                ax.bar(xs, ys, width, label=c, color=f"C{j}")
        ax.set_xticks(range(len(levels)), [f"{n:,} episodes" for n in levels])
    for i, n in enumerate(levels):
        ideal = next(r["ideal_steps_per_s"] for r in rows if r["spec"]["n_episodes"] == n)
        rate_ax.hlines(ideal, i - 0.45, i + 0.45, colors="k", linestyles="dashed",
                       label="ideal (N / mean latency)" if i == 0 else None)  # fmt: skip
    rate_ax.set_yscale("log")
    rate_ax.set_ylabel("env steps / s")
    mean_ms = results["plan"]["spec"].get("mean", MEAN_LATENCY_S) * 1e3
    rate_ax.set_title(f"steps/s against the ideal (steps wait {mean_ms:g} ms on average)")
    rate_ax.legend(fontsize=8)
    lag_ax.axhline(20, color="k", linestyle="dashed", label="target p99 (20 ms)")
    lag_ax.set_yscale("symlog", linthresh=1.0)  # from well under 1 ms to seconds
    lag_ax.set_ylabel("ms")
    lag_ax.set_title("event-loop lag p99 (gym-async has no loop)")
    lag_ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "async_envs.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
