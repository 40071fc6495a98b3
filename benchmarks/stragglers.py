"""Stragglers at the call level: ``fraction_samples`` against the fixed per-worker split.

Run from the repository root::

    python -m benchmarks.stragglers            # about a minute on 2 cores
    python -m benchmarks.stragglers --quick    # a few seconds (a smoke run)

One sampler, ``n_workers`` workers of ``envs_per_worker`` envs on ``n_processes`` env hosts
(process backend, the built-in seeded random agent). Every env is ``FixedCost-v0`` from
:mod:`benchmarks.envs` (its step busy-waits on CPU time), but worker ``--slow-worker``'s envs
cost ``--slow-cost`` a step (2 ms) and the others' ``--fast-cost`` (200 us): a 10x straggler.
Episodes are truncated at ``--episode-length`` steps.

Each call is ``obtain_samples(n, fraction_samples=f)`` (and ``obtain_fragments`` likewise), for
every ``f`` in ``--fractions``, the fractions taking turns call by call so that a change in the
machine's load hits them alike. Per call it records the wall time, the transitions and the
per-worker transitions and waits from ``last_stats``, and checks the guarantees: every worker
at or above ``ceil(f * share)`` and the total at or above ``n``. The machine is shared: the load
average (``uptime``) before and after is recorded with the results, in
``benchmarks/results/stragglers/results.json`` and ``.md`` (the table is also printed).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym

from asyncsample import Sampler
from benchmarks.envs import FixedCostEnv, full_id

RESULTS = Path(__file__).parent / "results"


class SleepCostEnv(FixedCostEnv):
    """:class:`FixedCostEnv` whose step *waits* ``step_cost`` (``time.sleep``) instead of spinning.

    The latency of a remote simulator or of a busy node: the step takes time without using a
    core of this machine (``time.sleep`` adds some 50-100 us of its own to every step).
    """

    def _cost(self) -> None:
        time.sleep(self.step_cost)


def make_env(step_cost: float, clock: str) -> gym.Env[Any, Any]:
    """An env whose steps cost ``step_cost`` seconds: of CPU time (``clock="cpu"``, the
    ``FixedCost-v0`` benchmark env) or of waiting (``clock="sleep"``, :class:`SleepCostEnv`)."""
    if clock == "sleep":
        return SleepCostEnv(step_cost)
    return gym.make(full_id("FixedCost-v0"), step_cost=step_cost, clock=clock)


def uptime() -> str:
    """The output of ``uptime`` (load averages), or the load averages alone."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def minimums(n: int, n_workers: int, fraction: float) -> list[int]:
    """Each worker's minimum: ``ceil(fraction * share)`` (as the sampler computes it)."""
    shares = [n // n_workers + (w < n % n_workers) for w in range(n_workers)]
    return [math.ceil(round(fraction * s, 9)) for s in shares]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every scenario (clock, n_processes); return the raw records and a summary."""
    records: list[dict[str, Any]] = []
    for clock in args.clocks:
        for n_processes in args.n_processes:
            records += await run_scenario(args, clock, n_processes)
    return {"records": records, "summary": summarise(records, args)}


async def run_scenario(
    args: argparse.Namespace, clock: str, n_processes: int
) -> list[dict[str, Any]]:
    """Time every (call, fraction) pair on one sampler."""
    envs = [
        functools.partial(
            make_env, args.slow_cost if w == args.slow_worker else args.fast_cost, clock
        )
        for w in range(args.n_workers)
    ]
    records: list[dict[str, Any]] = []
    async with Sampler(
        envs,
        n_workers=args.n_workers,
        envs_per_worker=args.envs_per_worker,
        n_processes=n_processes,
        max_episode_length=args.episode_length,
        seed=0,
        backend="process",
    ) as sampler:
        for mode in args.modes:
            call = sampler.obtain_samples if mode == "samples" else sampler.obtain_fragments
            for f in args.fractions:  # warm-up: first steps, buffers
                await call(args.n, fraction_samples=f)
            for i in range(args.calls):
                for f in args.fractions:
                    start = time.perf_counter()
                    batch = await call(args.n, fraction_samples=f)
                    seconds = time.perf_counter() - start
                    stats = sampler.last_stats
                    assert stats is not None
                    mins = minimums(args.n, args.n_workers, f)
                    per_worker = list(stats.worker_transitions)
                    records.append(
                        {
                            "clock": clock,
                            "n_processes": n_processes,
                            "mode": mode,
                            "fraction": f,
                            "call": i,
                            "seconds": seconds,
                            "transitions": batch.n_transitions,
                            "worker_transitions": per_worker,
                            "worker_minimums": mins,
                            "worker_wait_seconds": list(stats.worker_wait_seconds),
                            "every_worker_at_minimum": all(
                                c >= m for c, m in zip(per_worker, mins)
                            ),
                            "total_at_least_n": batch.n_transitions >= args.n,
                        }
                    )
    return records


def summarise(records: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median seconds per call for each scenario and fraction, and the speed-up against 1.0."""
    rows: list[dict[str, Any]] = []
    scenarios = [(c, p, m) for c in args.clocks for p in args.n_processes for m in args.modes]
    for clock, n_processes, mode in scenarios:
        base = None
        first = len(rows)
        for f in args.fractions:
            mine = [
                r
                for r in records
                if (r["clock"], r["n_processes"], r["mode"], r["fraction"])
                == (clock, n_processes, mode, f)
            ]
            median = statistics.median(r["seconds"] for r in mine)
            if f == 1.0:
                base = median
            per_worker = [
                statistics.mean(r["worker_transitions"][w] for r in mine)
                for w in range(args.n_workers)
            ]
            waits = [
                statistics.mean(r["worker_wait_seconds"][w] for r in mine)
                for w in range(args.n_workers)
            ]
            rows.append(
                {
                    "clock": clock,
                    "n_processes": n_processes,
                    "mode": mode,
                    "fraction": f,
                    "calls": len(mine),
                    "median_seconds": median,
                    "min_seconds": min(r["seconds"] for r in mine),
                    "max_seconds": max(r["seconds"] for r in mine),
                    "mean_transitions": statistics.mean(r["transitions"] for r in mine),
                    "mean_worker_transitions": per_worker,
                    "mean_worker_wait_seconds": waits,
                    "worker_minimums": mine[0]["worker_minimums"],
                    "guarantees_held": all(
                        r["every_worker_at_minimum"] and r["total_at_least_n"] for r in mine
                    ),
                }
            )
        for row in rows[first:]:
            if base is not None:
                row["speedup_vs_1"] = base / row["median_seconds"]
    return rows


def markdown(result: dict[str, Any]) -> str:
    """The summary as a markdown table, with the set-up and the machine's load."""
    cfg = result["config"]
    lines = [
        "# Stragglers at the call level (`fraction_samples`)",
        "",
        f"`python -m benchmarks.stragglers {' '.join(cfg['argv'])}`".replace(" `", "`"),
        "",
        f"{cfg['n_workers']} workers x {cfg['envs_per_worker']} envs on `n_processes` env-host "
        f"processes (worker w on host w % n_processes); worker {cfg['slow_worker']}'s envs "
        f"cost {cfg['slow_cost'] * 1e3:g} ms a step, the others' {cfg['fast_cost'] * 1e6:g} us; "
        f"episodes of {cfg['episode_length']} steps; n = {cfg['n']} per call; "
        f"{cfg['calls']} timed calls per row (fractions interleaved), median shown. Cost "
        "`cpu`: the step spins on CPU time (`FixedCost-v0`); `sleep`: it waits "
        "(`time.sleep`, a remote simulator or a busy node: no core of this machine is used).",
        "",
        f"Load before: `{result['uptime_before']}`  ",
        f"Load after: `{result['uptime_after']}`  ",
        f"{result['machine']}",
        "",
        "| cost | n_processes | call | fraction_samples | s/call (median) | min..max "
        "| speed-up vs 1.0 | transitions | per-worker transitions (mean) | per-worker minimum "
        "| per-worker wait s (mean) | guarantees |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["summary"]:
        call = "obtain_samples" if r["mode"] == "samples" else "obtain_fragments"
        lines.append(
            f"| {r['clock']} | {r['n_processes']} | {call} | {r['fraction']:g} "
            f"| {r['median_seconds']:.3f} "
            f"| {r['min_seconds']:.3f}..{r['max_seconds']:.3f} "
            f"| {r.get('speedup_vs_1', float('nan')):.2f}x "
            f"| {r['mean_transitions']:.0f} "
            f"| {', '.join(f'{x:.0f}' for x in r['mean_worker_transitions'])} "
            f"| {', '.join(str(x) for x in r['worker_minimums'])} "
            f"| {', '.join(f'{x:.3f}' for x in r['mean_worker_wait_seconds'])} "
            f"| {'held' if r['guarantees_held'] else 'VIOLATED'} |"
        )
    for p in cfg["n_processes"]:
        mates = [
            w
            for w in range(cfg["n_workers"])
            if w != cfg["slow_worker"] and w % p == cfg["slow_worker"] % p
        ]
        if mates:
            lines += [
                "",
                f"With n_processes={p}, worker(s) {', '.join(map(str, mates))} share the slow "
                f"worker's env host, which serves its workers' steps one at a time: they are "
                "held up behind the slow worker's steps too, so fewer workers can fill in.",
            ]
    lines += [
        "",
        "Guarantees: in every timed call every worker returned at least "
        "`ceil(fraction_samples * share)` transitions and the call at least `n`. The wait of a "
        "worker is the time it sat idle between finishing its part and the end of the call. "
        "Below 1.0 the split between workers depends on timing.",
        "",
    ]
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--n", type=int, default=4000, help="num_samples per call")
    p.add_argument("--calls", type=int, default=5, help="timed calls per fraction")
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    p.add_argument("--modes", nargs="+", default=["samples"], choices=["samples", "fragments"])
    p.add_argument("--clocks", nargs="+", default=["cpu", "sleep"], choices=["cpu", "sleep"])
    p.add_argument("--n-workers", type=int, default=4)
    p.add_argument("--envs-per-worker", type=int, default=4)
    p.add_argument("--n-processes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--episode-length", type=int, default=10)
    p.add_argument("--slow-worker", type=int, default=1)
    p.add_argument("--slow-cost", type=float, default=2e-3, help="seconds per step")
    p.add_argument("--fast-cost", type=float, default=200e-6, help="seconds per step")
    p.add_argument("--quick", action="store_true", help="a smoke run: n=800, 1 call")
    p.add_argument(
        "--out", type=Path, default=RESULTS / "stragglers", help="directory of the results"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.calls = 800, 1
    if 1.0 not in args.fractions:
        args.fractions = [1.0, *args.fractions]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, write the JSON and markdown results, print the table."""
    args = parse(argv)
    before = uptime()
    result = asyncio.run(run(args))
    result["uptime_before"] = before
    result["uptime_after"] = uptime()
    result["machine"] = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    result["config"] = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
    } | {"argv": list(argv) if argv is not None else sys.argv[1:]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (args.out / "results.md").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
