"""Envs that wait: thousands of concurrent I/O-bound episodes (issues 23 and 33).

Run from the repository root::

    asyncsample bench async_envs            # 100, 1,000, 10,000 episodes of 50 ms, 50,000 of 1 s
    asyncsample bench async_envs --quick    # 10 and 100 episodes, tiny durations (a smoke run)
    python -m benchmarks.async_envs --levels 1000 --contenders pool-32 ours-asyncio

The env's step *waits* (an HTTP call, a sandbox, a simulator behind a socket): a latency drawn
from the env's own seeded RNG, mean 50 ms, 1% of the steps 20x longer than the others (and a
+-20% jitter on every step): :mod:`benchmarks.latency_envs`, blocking (``time.sleep``) and async
(``await asyncio.sleep``) on the same RNG stream. Beside the 50 ms levels, 50,000 episodes of
1 s mean latency (``--big``) for the contenders that can hold them (the ceiling, plain asyncio,
ours).

Contenders, each cell in a fresh process (:func:`benchmarks._runner.run_fresh`; the cells are
:mod:`benchmarks.async_envs_cells`):

- ``ceiling``: ``plain-asyncio`` in as many processes as cores (``N / cores`` episodes each),
  timed in one window, steps summed: the machine's ceiling for async envs.
- ``plain-asyncio``: the async env with nothing between it and the loop: one task per env
  awaiting ``env.step``, one process.
- ``gym-async``: gymnasium's ``AsyncVectorEnv`` of the blocking env, one process per env, at
  most 64 envs (above 64 episodes it runs 64 and the table says so); no event loop.
- ``pool-32``, ``pool-256``: a ``concurrent.futures.ThreadPoolExecutor`` of 32 / 256 threads
  stepping N blocking envs, driven as the LLM-agent stacks drive theirs: one asyncio task per
  env, each awaiting ``loop.run_in_executor(pool, env.step, action)``.
- ``torchrl-asyncio``: TorchRL's ``AsyncEnvPool(backend="asyncio")``, where the installed
  TorchRL has it (0.14.1 raises ``NotImplementedError``: recorded as not available).
- ``ours-thread``: ``Sampler(backend="thread")`` on the blocking env (``max_concurrency``
  threads, 256 by default).
- ``ours-asyncio``: ``Sampler(backend="asyncio")`` on the async env.
- ``ours-process-per_worker``, ``ours-process-batched``, ``ours-process-host``,
  ``ours-ray-batched``, ``ours-ray-host``: ``Sampler(async_env_factory,
  backend="process"|"ray", inference=...)`` with ``cores`` env hosts (issue 33); ``host``: the
  agent's copies act in the hosts. A cell the sampler refuses records the refusal
  (``refused: ...``) and the tables show it as not available.
- ``ours-asyncio-zero``: the async env with no latency at all (1,000 episodes): the per-step
  CPU cost of the asyncio path itself.

Ours run with one shared seeded ``RandomAgent`` (``inference="batched"`` unless the contender
names another) in two layouts, one env per worker and 100 envs per worker (``n_workers x
envs_per_worker`` = N; only the second at the ``--big`` level); the table shows the better, a
second table both.

Per cell: env steps/s, counted as the steps happen (for ours the better of a ``stream`` of
complete episodes and one of fragments on the same sampler, for the peers their envs' own
loop), against the ideal (N / mean latency) and the ceiling of the same level; consecutive
``obtain_fragments`` calls' steps/s beside the stream's (ours); the event-loop lag p50/p99 (a
probe task sleeps 1 ms and records how late it wakes); the CPU per step of the caller
(``time.process_time``) and of its child processes (env hosts, loops; psutil); the memory per
open episode (growth of the RSS of the process tree / N); and the duration of a call of N
episodes' worth of steps (``obtain_samples(N * 100)`` a few times; for the peers, every env
running one episode) with its p50/p99, for ours also with ``episode_timeout`` at 3x the mean
episode duration. Results: ``benchmarks/results/async_envs/`` (``results.json``,
``results.md``, ``async_envs.png``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import async_envs_cells, async_envs_run
from benchmarks.async_envs_cells import (
    CONTENDERS,
    HOST_CONTENDERS,
    MAX_PROCESS_ENVS,
    CellResult,
    CellSpec,
)
from benchmarks.async_envs_report import NOT_AVAILABLE, best_rows, markdown, targets, write_chart
from benchmarks.async_envs_run import outcome_of, run_cell, run_file
from benchmarks.latency_envs import (
    EPISODE_LENGTH,
    TAIL_PROBABILITY,
    AsyncLatencyEnv,
    LatencyModel,
    SleepLatencyEnv,
    make_env,
)
from benchmarks.runs import LagProbe

RESULTS = Path(__file__).resolve().parent / "results" / "async_envs"

#: Envs per worker of ours' second layout (the first is one env per worker).
WIDE_ENVS_PER_WORKER = 100
#: The contenders that can hold the ``--big`` level (tens of thousands of episodes).
BIG_CONTENDERS = ("ceiling", "plain-asyncio", "ours-asyncio", *HOST_CONTENDERS)

__all__ = [
    "BIG_CONTENDERS",
    "CONTENDERS",
    "MAX_PROCESS_ENVS",
    "AsyncLatencyEnv",
    "CellResult",
    "CellSpec",
    "HOST_CONTENDERS",
    "LagProbe",
    "LatencyModel",
    "Plan",
    "SleepLatencyEnv",
    "async_envs_cells",
    "async_envs_run",
    "best_rows",
    "cells",
    "main",
    "make_env",
    "outcome_of",
    "run_cell",
    "targets",
]


# --------------------------------------------------------------------------------------------
# The plan


@dataclass
class Plan:
    """The study's settings (from the command line).

    Attributes:
        levels: Episodes in flight of the ``spec`` latency.
        contenders: The contenders to run.
        spec: :class:`CellSpec` fields common to every cell.
        zero_episodes: Episodes of ``ours-asyncio-zero``.
        thread_pool: ``ours-thread``'s ``max_concurrency`` (at most N).
        timeout: Seconds before a cell's process is killed.
        big: Episodes in flight of the big level (none: no big level).
        big_mean: Mean step latency of the big level, seconds.
        quick: A smoke run: ``process``/``ray`` cells in one layout only.
    """

    levels: list[int]
    contenders: list[str]
    spec: dict[str, Any]
    zero_episodes: int = 1000
    thread_pool: int = 256
    timeout: float = 300.0
    big: list[int] = field(default_factory=list)
    big_mean: float = 1.0
    quick: bool = False


def cells(plan: Plan) -> Iterator[CellSpec]:
    """Every run of the plan, level by level, then the big level, then the zero-latency cell."""
    base = plan.spec
    for n in plan.levels:
        yield from _level(plan, n, base, wide_only=False)
    # The big level: steps of ``big_mean``; warm-up and timed phase long enough for a few steps;
    # rates and memory only (a call of N episodes would last minutes).
    big = base | {
        "mean": plan.big_mean,
        "calls": 0,
        "warmup_s": max(base.get("warmup_s", 2.0), 3 * plan.big_mean),
        "seconds": max(base.get("seconds", 5.0), 8 * plan.big_mean),
    }
    for n in plan.big:
        yield from _level(plan, n, big, wide_only=True)
    if "ours-asyncio-zero" in plan.contenders:
        zero = base | {"mean": 0.0, "calls": 0, "fragment_calls": False}
        for w, e in _layouts(plan.zero_episodes):
            yield CellSpec("ours-asyncio-zero", plan.zero_episodes, w, e, **zero)


def _level(plan: Plan, n: int, base: dict[str, Any], wide_only: bool) -> Iterator[CellSpec]:
    """The cells of one level: every contender of the plan (only the big ones when
    ``wide_only``, and ours in the wide layout only)."""
    for contender in plan.contenders:
        if contender == "ours-asyncio-zero" or (wide_only and contender not in BIG_CONTENDERS):
            continue
        if contender.startswith("ours-"):
            layouts = _layouts(n)
            if wide_only or (plan.quick and contender in HOST_CONTENDERS):
                layouts = layouts[-1:]  # a quick run: one layout of the host cells is enough
            for w, e in layouts:
                threads = min(plan.thread_pool, n) if contender == "ours-thread" else 0
                yield CellSpec(contender, n, w, e, threads, **base)
        elif contender.startswith("pool-"):
            yield CellSpec(contender, n, threads=int(contender.split("-")[1]), **base)
        else:
            yield CellSpec(contender, n, **base)


def _layouts(n: int) -> list[tuple[int, int]]:
    """Ours' layouts of N episodes: one env per worker, and 100 envs per worker (N / 10 below
    200 episodes, at least 2)."""
    wide = WIDE_ENVS_PER_WORKER if n >= 2 * WIDE_ENVS_PER_WORKER else max(2, n // 10)
    layouts = [(n, 1)]
    if wide > 1 and n % wide == 0:
        layouts.append((n // wide, wide))
    return layouts


def execute(plan: Plan, out: Path, in_process: bool = False) -> list[dict[str, Any]]:
    """Run every cell (each in a fresh process unless ``in_process``); return the records."""
    from benchmarks._runner import run_fresh

    specs = list(cells(plan))
    records: list[dict[str, Any]] = []
    log = out / "runs.jsonl"
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix="asyncsample-aiobench-") as tmp:
        for i, spec in enumerate(specs, 1):
            print(
                f"[{i}/{len(specs)}] {spec.contender} N={spec.n_episodes} ({spec.layout})",
                file=sys.stderr,
                flush=True,
            )
            fields = dataclasses.asdict(spec)
            t0 = time.perf_counter()
            if in_process:
                outcome = outcome_of(spec)
            else:
                outcome = run_fresh(
                    ["-m", "benchmarks.async_envs", "--child"], fields, plan.timeout, Path(tmp)
                )
            wall = time.perf_counter() - t0  # the cell's length, start-up included
            record = {"spec": fields, "layout": spec.layout, "wall_s": wall, **outcome}
            if outcome.get("status") != "ok":  # refused, unavailable, error, timeout
                print(f"  {outcome.get('status')}: {outcome.get('note')}", file=sys.stderr)
            records.append(record)
            with log.open("a") as f:
                f.write(json.dumps(record, default=str) + "\n")
    return records


# --------------------------------------------------------------------------------------------
# Command line


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, Plan]:
    """The command line, and the plan it asks for."""
    p = argparse.ArgumentParser(
        prog="asyncsample bench async_envs", description=__doc__.split("\n\n", 1)[0]
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="10 and 100 episodes, 20 ms steps, 20-step episodes, 1 s runs",
    )
    p.add_argument(
        "--levels", type=int, nargs="+", help="episodes in flight (default 100 1000 10000)"
    )
    p.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=CONTENDERS)
    p.add_argument("--latency-ms", type=float, help="mean step latency (default 50; quick 20)")
    p.add_argument(
        "--tail", type=float, help="share of the steps in the tail (default 0.01; 0: no tail)"
    )
    p.add_argument("--episode-length", type=int, help="steps per episode (default 100; quick 20)")
    p.add_argument("--seconds", type=float, help="timed phase per run (default 5; quick 1)")
    p.add_argument("--warmup", type=float, help="warm-up per run, seconds (default 2; quick 0.5)")
    p.add_argument("--calls", type=int, help="timed calls per run (default 5; quick 2)")
    p.add_argument(
        "--call-limit", type=float, help="longest expected call, s (default 20; quick 5)"
    )
    p.add_argument(
        "--big",
        type=int,
        nargs="*",
        help="episodes in flight of the big level, at --big-latency-ms (default 50000; quick "
        "200; none when --levels is given; '--big' alone: none)",
    )
    p.add_argument(
        "--big-latency-ms",
        type=float,
        help="mean step latency of the big level (default 1000; quick 100)",
    )
    p.add_argument(
        "--no-fragment-calls",
        action="store_true",
        help="skip ours' consecutive obtain_fragments calls (timed after the streams)",
    )
    p.add_argument(
        "--cores",
        type=int,
        default=0,
        help="processes of the ceiling and env hosts of ours' process/ray (default: every core)",
    )
    p.add_argument(
        "--zero-episodes",
        type=int,
        default=1000,
        help="episodes of the zero-latency cell (default 1000)",
    )
    p.add_argument(
        "--gc-threshold",
        type=int,
        nargs=3,
        metavar=("GEN0", "GEN1", "GEN2"),
        help="the cyclic collector's thresholds in every contender's processes (the ceiling's "
        "loops, plain asyncio, ours' caller; default: Python's own, as users run it)",
    )
    p.add_argument("--threads", type=int, default=256, help="ours-thread's max_concurrency")
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    p.add_argument(
        "--streams",
        nargs="+",
        choices=["episodes", "fragments"],
        default=["episodes", "fragments"],
        help="ours' steps/s from these streams (the better counts; default both)",
    )
    p.add_argument(
        "--chunk",
        type=float,
        default=1.0,
        help="ours' stream batches, in seconds of steps at the ideal rate (default 1)",
    )
    p.add_argument(
        "--fraction",
        type=float,
        default=1.0,
        help="ours' stream's fraction_samples (default 1.0)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is killed")
    p.add_argument(
        "--in-process", action="store_true", help="run the cells in this process (tests, debugging)"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--render",
        type=Path,
        metavar="RESULTS_JSON",
        help="only re-write results.md and the chart from an existing results.json (to --out)",
    )
    args = p.parse_args(argv)
    q = args.quick

    def pick(value: Any, full: Any, quick: Any) -> Any:
        return value if value is not None else (quick if q else full)

    spec = {
        "mean": pick(args.latency_ms, 50.0, 20.0) / 1e3,
        "tail_probability": pick(args.tail, TAIL_PROBABILITY, TAIL_PROBABILITY),
        "episode_length": pick(args.episode_length, EPISODE_LENGTH, 20),
        "seconds": pick(args.seconds, 5.0, 1.0),
        "warmup_s": pick(args.warmup, 2.0, 0.5),
        "calls": pick(args.calls, 5, 2),
        "call_limit_s": pick(args.call_limit, 20.0, 5.0),
        "loop": args.loop,
        "streams": list(dict.fromkeys(args.streams)),
        "chunk_s": args.chunk,
        "fraction": args.fraction,
        "fragment_calls": not args.no_fragment_calls,
        "cores": args.cores,
        "gc_threshold": list(args.gc_threshold or []),
    }
    if args.loop == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            spec["loop"] = "asyncio"
    levels = pick(args.levels, [100, 1000, 10_000], [10, 100])
    zero = args.zero_episodes if not q or args.zero_episodes != 1000 else 100
    big = args.big if args.big is not None else [] if args.levels else [200] if q else [50_000]
    big_mean = pick(args.big_latency_ms, 1000.0, 100.0) / 1e3
    plan = Plan(
        levels, list(args.contenders), spec, zero, args.threads, args.timeout, big, big_mean, q
    )
    return args, plan


def _default_budget(args: argparse.Namespace) -> bool:
    """Whether the run used the study's default budget (no --quick, no override of it)."""
    budget = (
        "levels",
        "latency_ms",
        "tail",
        "episode_length",
        "seconds",
        "warmup",
        "calls",
        "call_limit",
        "big",
        "big_latency_ms",
    )
    return not args.quick and all(getattr(args, name) is None for name in budget)


def _load() -> str:
    import os

    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def render(results_json: Path, out: Path) -> int:
    """Re-write results.md and the chart of an earlier run from its results.json."""
    from benchmarks import report

    results = json.loads(results_json.read_text())
    (out / "results.md").write_text(markdown(results))
    report.draw_charts(write_chart, out, results)
    print(f"wrote {out / 'results.md'}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the study; write results.json, results.md and the chart to ``--out``.

    Returns:
        0 when every run finished (or was refused, or its peer is not installed), 1 when one
        failed (the results are written either way).
    """
    from benchmarks import report

    argv = list(sys.argv[1:] if argv is None else argv)
    args, plan = parse(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.render is not None:
        return render(args.render, out)
    load_before = _load()
    t0 = time.perf_counter()
    records = execute(plan, out, in_process=args.in_process)
    results: dict[str, Any] = {
        "study": "async_envs",
        "command": report.command_line("asyncsample bench async_envs", argv),
        "machine": report.machine_info(),
        "plan": dataclasses.asdict(plan),
        # The pages (benchmarks/pages.py) cite only a run of the default budget; --quick or any
        # budget override makes this a smoke run.
        "settings": {"quick": not _default_budget(args), "budget": plan.spec},
        "elapsed_s": time.perf_counter() - t0,
        "load_before": load_before,
        "load_after": _load(),
        "runs": records,
    }
    report.write_json(out / "results.json", results)
    (out / "runs.jsonl").unlink(missing_ok=True)
    (out / "results.md").write_text(markdown(results))
    charts = report.draw_charts(write_chart, out, results)
    failed = [r for r in records if r.get("status") not in ("ok", *NOT_AVAILABLE)]
    print(
        f"async_envs: {len(records)} runs in {results['elapsed_s']:.0f} s, {len(failed)} failed; "
        f"wrote {out / 'results.json'}, {out / 'results.md'}" + "".join(f", {p}" for p in charts),
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(run_file(sys.argv[2], sys.argv[3]))
    sys.exit(main())
