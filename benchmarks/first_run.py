"""A new user's first comparison: the README's run against the loop they already know.

The README's run is ``Sampler("CartPole-v1", n_workers=4, envs_per_worker=8)`` with every
default (the built-in random agent, the ``process`` backend, ``inference="auto"``), sampled as
``asyncsample run`` samples it: consecutive ``obtain_fragments`` calls. The loop a user knows is
``SyncVectorEnv(32)`` stepped with ``envs.action_space.sample()``; the machine's ceiling is that
loop split over as many processes as cores, side by side (``SyncVectorEnv(32 / cores)`` each).
The sampler also runs with each explicit mode, so the default's choice can be checked against
them (issue 53). ``--calls`` runs the sampler's cells at other call sizes too: a call waits for
its slowest host and the hosts wait between calls (the lockstep contract), so larger calls leave
them idle less; each of the sampler's cells says how many cores its hosts and the caller used
(CPU time a second of wall time).

Each cell runs in a fresh interpreter, one after the other, for ``--seconds`` after
``--warmup``; ``--rounds`` times over, the cells in turn in each round. A shared machine's speed
drifts from minute to minute, so the ratios are each round's own (a cell against the loops of
its round), then the median of the rounds: a cell that ran in a slow minute is rated against the
loops of that minute. Run it as ``asyncsample bench first_run`` (or ``python -m
benchmarks.first_run``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncsample.cli import RUN_STEPS, call_size
from benchmarks.report import write_own_results
from benchmarks.runs import LagProbe

__all__ = ["CELLS", "main"]

ENV_ID = "CartPole-v1"
N_ENVS = 32
WORKERS, ENVS_PER_WORKER = 4, 8
#: ``asyncsample run``'s call size for its default steps (CartPole's 16-byte observations are far
#: below its cap on a call's bytes).
CALL = call_size(RUN_STEPS, N_ENVS, None)
#: cell -> ``Sampler(inference=...)`` (``None``: a gymnasium loop).
CELLS: dict[str, str | None] = {
    "sync": None,
    "ceiling": None,
    "ours-default": "auto",
    "ours-per_worker": "per_worker",
    "ours-host": "host",
    "ours-batched": "batched",
}
RESULTS = Path(__file__).resolve().parent / "results" / "first_run"


def _sync_loop(n_envs: int, seed: int, warmup: float, seconds: float, start: Any) -> float:
    """``SyncVectorEnv(n_envs)`` with ``action_space.sample()`` per step; its steps/s."""
    import gymnasium as gym

    envs = gym.vector.SyncVectorEnv([lambda: gym.make(ENV_ID)] * n_envs)
    try:
        envs.reset(seed=seed)
        envs.action_space.seed(seed)
        until = time.perf_counter() + warmup
        while time.perf_counter() < until:
            envs.step(envs.action_space.sample())
        if start is not None:
            start.wait()
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(64):
                envs.step(envs.action_space.sample())
            steps += 64 * n_envs
        return steps / (time.perf_counter() - t0)
    finally:
        envs.close()


def _ceiling_part(
    n_envs: int, seed: int, warmup: float, seconds: float, start: Any, out: Any
) -> None:
    out.put(_sync_loop(n_envs, seed, warmup, seconds, start))


def _ceiling(warmup: float, seconds: float) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(cores), ctx.Queue()
    procs = [
        ctx.Process(
            target=_ceiling_part, args=(N_ENVS // cores, 100 * k, warmup, seconds, start, out)
        )
        for k in range(cores)
    ]
    for p in procs:
        p.start()
    rates = [out.get(timeout=warmup + seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    return {"steps_per_s": sum(rates), "layout": f"{cores} x SyncVectorEnv({N_ENVS // cores})"}


async def _ours(
    inference: str, warmup: float, seconds: float, host_nice: int | None = None, call: int = CALL
) -> dict[str, Any]:
    import psutil

    from asyncsample import RandomAgent, Sampler

    kwargs: dict[str, Any] = {} if inference == "auto" else {"inference": inference}
    if host_nice is not None:
        kwargs["backend_options"] = {"host_nice": host_nice}
    agent = None
    if inference == "batched":  # one agent shared by the workers: the built-in one, seeded
        import gymnasium as gym

        agent = RandomAgent(gym.make(ENV_ID).action_space, seed=0)
    async with Sampler(
        ENV_ID, agent, n_workers=WORKERS, envs_per_worker=ENVS_PER_WORKER, seed=0, **kwargs
    ) as sampler:
        until = time.perf_counter() + warmup
        while time.perf_counter() < until:
            await sampler.obtain_fragments(call)
        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]  # the caller, then the env hosts
        cpu = [sum(p.cpu_times()[:2]) for p in procs]
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            steps += (await sampler.obtain_fragments(call)).n_transitions
        wall = time.perf_counter() - t0
        rate = steps / wall
        cores = [(sum(p.cpu_times()[:2]) - c) / wall for p, c in zip(procs, cpu)]
        # Then the loop's lag, in a window of its own (the probe's wake-ups cost CPU).
        probe = LagProbe()
        probe.start()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds / 2:
            await sampler.obtain_fragments(call)
        await probe.stop()
        return {
            "steps_per_s": rate,
            "layout": f"{WORKERS}x{ENVS_PER_WORKER}, inference {sampler.inference.describe()}",
            "call": call,
            "cores": {"caller": cores[0], "hosts": sum(cores[1:])},
            "lag": probe.summary(),
        }


def run_cell(
    name: str, warmup: float, seconds: float, host_nice: int | None = None, call: int = CALL
) -> dict[str, Any]:
    """One cell's numbers, in this interpreter."""
    if name == "sync":
        rate = _sync_loop(N_ENVS, 0, warmup, seconds, None)
        return {"steps_per_s": rate, "layout": f"SyncVectorEnv({N_ENVS})"}
    if name == "ceiling":
        return _ceiling(warmup, seconds)
    inference = CELLS[name]
    assert inference is not None
    return asyncio.run(_ours(inference, warmup, seconds, host_nice, call))


def cell_key(name: str, call: int) -> str:
    """The results' key of cell ``name`` at calls of ``call`` steps (the name itself at
    :data:`CALL`, ``asyncsample run``'s)."""
    return name if call == CALL or CELLS[name] is None else f"{name}, calls of {call:,}"


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per cell over ``rounds`` (each a round's numbers per cell): its steps/s (median, min and
    max), its lag p99 and the cores it used (medians), and its ratios to the round's
    SyncVectorEnv and ceiling (each round's own: ``vs_sync``, ``of_ceiling``, as median, min and
    max) where they ran."""
    rows: dict[str, dict[str, Any]] = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        rates = [run["steps_per_s"] for run in runs]
        row: dict[str, Any] = {
            "layout": runs[0]["layout"],
            "steps_per_s": statistics.median(rates),
            "min": min(rates),
            "max": max(rates),
        }
        lags = [run["lag"]["p99_ms"] for run in runs if run.get("lag", {}).get("p99_ms")]
        if lags:
            row["lag"] = {"p99_ms": statistics.median(lags)}
        if "call" in runs[0]:
            row["call"] = runs[0]["call"]
        if "cores" in runs[0]:
            row["cores"] = {k: statistics.median(run["cores"][k] for run in runs)
                            for k in runs[0]["cores"]}  # fmt: skip
        for key, peer in (("vs_sync", "sync"), ("of_ceiling", "ceiling")):
            ratios = [r[name]["steps_per_s"] / r[peer]["steps_per_s"] for r in rounds if peer in r]
            if ratios:
                row[key] = {"median": statistics.median(ratios), "min": min(ratios),
                            "max": max(ratios)}  # fmt: skip
        rows[name] = row
    return rows


def _ratio(row: dict[str, Any], key: str, unit: str) -> str:
    """A cell's ratio ``key``: the median of the rounds, with their range if more than one."""
    ratio = row.get(key)
    if ratio is None:
        return "-"
    if ratio["min"] == ratio["max"]:
        return f"{ratio['median']:.2f}{unit}"
    return f"{ratio['median']:.2f}{unit} [{ratio['min']:.2f}-{ratio['max']:.2f}]"


def _rate(row: dict[str, Any]) -> str:
    """A cell's steps/s: the median of the rounds, with their range if more than one."""
    if row["min"] == row["max"]:
        return f"{row['steps_per_s']:,.0f}"
    return f"{row['steps_per_s']:,.0f} [{row['min']:,.0f}-{row['max']:,.0f}]"


def _markdown(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    rounds = (
        f"{args.rounds} rounds, the cells in turn in each: steps/s as median [min-max] of the "
        "rounds, and each ratio the median [min-max] of the rounds' own ratios (a cell against "
        "the loops of its round). "
        if args.rounds > 1
        else ""
    )
    lines = [
        "# A new user's first run (`asyncsample bench first_run`)",
        "",
        f"`Sampler({ENV_ID!r}, n_workers={WORKERS}, envs_per_worker={ENVS_PER_WORKER})` with "
        f"every default, consecutive `obtain_fragments({CALL})` calls as `asyncsample run` "
        f"makes them{_other_calls(args.calls)}, against `SyncVectorEnv({N_ENVS})` stepped with "
        "`envs.action_space.sample()` and the ceiling (that loop split over every core, side "
        f"by side). {rounds}Each cell in a fresh interpreter, {args.warmup:g} s of warm-up, then a "
        f"{args.seconds:g} s window; ours then sample {args.seconds / 2:g} s more with a task "
        "in the caller's event loop that sleeps 1 ms in a loop (`lag`: how late its wake-ups "
        "are, p99)"
        + ("." if args.host_nice is None else f", the hosts at `host_nice={args.host_nice}`.")
        + " `cores`: the CPU time of ours a second of wall time, the env hosts' + the caller's "
        "(medians of the rounds).",
        "",
        "| cell | layout | steps/s | vs SyncVectorEnv(32) | of the ceiling | cores | lag p99 |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for name, row in rows.items():
        lag = row.get("lag", {}).get("p99_ms")
        lag_text = "-" if lag is None else f"{lag:.2f} ms"
        cores = row.get("cores")
        cores_text = "-" if cores is None else f"{cores['hosts']:.2f} + {cores['caller']:.2f}"
        lines.append(
            f"| {name} | {row['layout']} | {_rate(row)} | {_ratio(row, 'vs_sync', 'x')} | "
            f"{_ratio(row, 'of_ceiling', '')} | {cores_text} | {lag_text} |"
        )
    default = rows.get("ours-default", {})
    if "vs_sync" in default and "of_ceiling" in default:
        of_ceiling, vs_sync = default["of_ceiling"]["median"], default["vs_sync"]["median"]
        lines += [
            "",
            "## Targets (issue 53)",
            "",
            "| target | value | goal | met |",
            "|---|--:|--:|---|",
            f"| README run (defaults) / ceiling | {of_ceiling:.2f} | >= 0.9 | "
            f"{'yes' if of_ceiling >= 0.9 else 'no'} |",
            f"| README run (defaults) / SyncVectorEnv(32) | {vs_sync:.2f}x | >= 1.5x | "
            f"{'yes' if vs_sync >= 1.5 else 'no'} |",
        ]
    return "\n".join(lines)


def _other_calls(calls: list[int]) -> str:
    """How the markdown names the call sizes run besides :data:`CALL`."""
    others = [f"{n:,}" for n in calls if n != CALL]
    if not others:
        return ""
    return f" (and calls of {', '.join(others)} steps: the cells so named)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_run", description=__doc__)
    parser.add_argument("--cells", nargs="+", choices=list(CELLS), default=list(CELLS))
    parser.add_argument("--warmup", type=float, help="seconds before each window (3)")
    parser.add_argument("--seconds", type=float, help="each cell's window (6)")
    parser.add_argument("--quick", action="store_true", help="short windows, one round")
    parser.add_argument("--rounds", type=int, help="times every cell runs, in turn (3)")
    parser.add_argument(
        "--host-nice", type=int, help="the process backend's host_nice (default: its own)"
    )
    parser.add_argument(
        "--calls",
        type=int,
        nargs="+",
        default=[CALL],
        help=f"the sampler's call sizes, in steps ({CALL}: asyncsample run's)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    parser.add_argument("--call", type=int, default=CALL, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.calls):
        parser.error(f"--calls: expected sizes of at least 1 step, got {args.calls}")
    args.warmup = args.warmup if args.warmup is not None else (0.3 if args.quick else 3.0)
    args.seconds = args.seconds if args.seconds is not None else (0.5 if args.quick else 6.0)
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    if args.cell:  # a cell in this fresh interpreter: its numbers as JSON on stdout
        cell = run_cell(args.cell, args.warmup, args.seconds, args.host_nice, args.call)
        print(json.dumps(cell))
        return 0
    rounds: list[dict[str, dict[str, Any]]] = []
    nice = [] if args.host_nice is None else ["--host-nice", str(args.host_nice)]
    runs = [(name, call) for name in args.cells
            for call in (args.calls if CELLS[name] is not None else [CALL])]  # fmt: skip
    for k in range(args.rounds):
        rounds.append({})
        for name, call in runs:
            key = cell_key(name, call)
            print(f"first_run: round {k + 1}/{args.rounds}, {key}", file=sys.stderr, flush=True)
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.first_run", "--cell", name, "--call", str(call),
                 "--warmup", str(args.warmup), "--seconds", str(args.seconds), *nice],
                capture_output=True, text=True, check=False, timeout=600,
                cwd=Path(__file__).resolve().parent.parent,
            )  # fmt: skip
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                return 1
            rounds[k][key] = json.loads(done.stdout.strip().splitlines()[-1])
    rows = summarize(rounds)
    result = {
        "study": "first_run",
        "warmup": args.warmup,
        "seconds": args.seconds,
        "host_nice": args.host_nice,
        "calls": args.calls,
        "rows": rows,
        "rounds": rounds,
    }
    write_own_results(args.out, result, _markdown(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
