"""Raw frames with ``inference="host"`` against the machine's ceiling, in one run (issue 53).

The workload of issue 53's third target: ``PongRaw-v5`` (``gymnasium.make("ALE/Pong-v5")``,
210x160x3 uint8 frames, 100 KB each) sampled by ``Sampler(..., backend="process",
inference="host")``, 2 workers x 4 envs over 2 env hosts, the built-in random agent, in
consecutive ``obtain_fragments`` calls of 256 steps per env; against the ceiling of
:mod:`benchmarks.ceiling`: the same env stepped by a plain loop with pre-drawn actions in as many
processes as cores, side by side (the rate is the sum of the loops' own rates). A ``plain`` cell
runs one such loop alone: the env's own CPU per step.

Each cell runs in a fresh interpreter for ``--seconds`` after ``--warmup``; the repeats
interleave the cells (ceiling, host, ceiling, host...) so that each ratio pairs runs made back to
back. Besides steps/s, the CPU per step of the caller and of its env hosts, and of the
ceiling's loops (:class:`~benchmarks.contenders.CpuAccount`, as every study counts it): the
hosts' cost per step beyond the env's is ``hosts CPU - ceiling CPU``. Run it as
``python -m benchmarks.frames``; writes ``benchmarks/results/frames/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.report import write_own_results

__all__ = ["CELLS", "main"]

ENV_ID = "benchmarks.envs:PongRaw-v5"
WORKERS, ENVS_PER_WORKER, PROCESSES = 2, 4, 2
#: Steps per env of each ``obtain_fragments`` call (the ``real_envs`` study's raw-frame calls).
CALL_STEPS = 256
CELLS = ("ceiling", "host", "plain")
RESULTS = Path(__file__).resolve().parent / "results" / "frames"
#: The issue's goal for host / ceiling.
GOAL = 0.9
#: Cores other processes may take during a run before its pair counts as disturbed (the
#: real_envs study's mark).
DISTURBED = 0.25


def _plain(warmup: float, seconds: float) -> dict[str, Any]:
    """One env in a plain ``env.step`` loop with pre-drawn actions (the ceiling's loop, alone);
    its steps/s and CPU microseconds per step."""
    from benchmarks.ceiling import _random_loop

    class _Go:  # the loop's start barrier, with nobody else to wait for
        def wait(self) -> None:
            pass

    spec = _spec(warmup, seconds)
    cpu0 = time.process_time()
    done, wall = _random_loop(spec, spec.seed, spec.warmup // spec.cores, 1, _Go())
    cpu = time.process_time() - cpu0  # warm-up included: a rough figure, the rate is exact
    return {"steps_per_s": done / wall, "cpu_us": 1e6 * cpu / (done + spec.warmup // spec.cores)}


def _spec(warmup: float, seconds: float) -> Any:
    """The ceiling's :class:`~benchmarks.contenders.RunSpec` for this workload: time-bound (a
    few transitions, ``seconds`` long), ``warmup`` seconds of steps first (about)."""
    from benchmarks.runs import RunSpec

    cores = len(os.sched_getaffinity(0))
    return RunSpec(
        contender="ceiling",
        env="PongRaw-v5",
        env_id=ENV_ID,
        n_envs=WORKERS * ENVS_PER_WORKER,
        n_transitions=1,
        warmup=max(1, int(warmup * 2_000)) * cores,  # loops of about 2,000 steps/s each
        min_seconds=seconds,
        cores=cores,
    )


def _ceiling(warmup: float, seconds: float) -> dict[str, Any]:
    """:func:`benchmarks.ceiling.ceiling` (the ceiling of every study) on this workload."""
    from benchmarks.ceiling import ceiling

    spec = _spec(warmup, seconds)
    result = ceiling(spec)
    cpu = result.cpu or {}
    cores = cpu.get("own_cores")
    return {
        "steps_per_s": result.rate,
        # the loops' CPU over the timed phase (its wall time: about their seconds)
        "cpu_us": 1e6 * cores * result.seconds / result.transitions if cores else None,
        "others_cores": cpu.get("foreign_cores"),
        "layout": f"{spec.cores} plain single-env loops, one process each (benchmarks.ceiling)",
    }


async def _host(warmup: float, seconds: float) -> dict[str, Any]:
    import benchmarks.envs  # noqa: F401
    from asyncsample import Sampler
    from benchmarks.runs import CpuAccount

    call = CALL_STEPS * WORKERS * ENVS_PER_WORKER
    async with Sampler(
        ENV_ID,
        n_workers=WORKERS,
        envs_per_worker=ENVS_PER_WORKER,
        n_processes=PROCESSES,
        backend="process",
        inference="host",
        seed=0,
    ) as sampler:
        until = time.perf_counter() + warmup
        while time.perf_counter() < until:
            await sampler.obtain_fragments(call)
        account = CpuAccount()  # this process tree (the caller, its hosts) and the others
        account.start()
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            steps += (await sampler.obtain_fragments(call)).n_transitions
        wall = time.perf_counter() - t0
        account.stop()
        cpu = account.result or {}
        return {
            "steps_per_s": steps / wall,
            "main_cpu_us": 1e6 * cpu.get("main_cores", 0.0) * wall / steps,
            "hosts_cpu_us": 1e6 * cpu.get("host_cores", 0.0) * wall / steps,
            "others_cores": cpu.get("foreign_cores"),
            "layout": f"{WORKERS}x{ENVS_PER_WORKER} over {PROCESSES} hosts, calls of "
            f"{CALL_STEPS} steps per env",
        }


def run_cell(name: str, warmup: float, seconds: float) -> dict[str, Any]:
    """One cell's numbers, in this interpreter."""
    if name == "ceiling":
        return _ceiling(warmup, seconds)
    if name == "plain":
        return {**_plain(warmup, seconds), "layout": "one plain single-env loop"}
    return asyncio.run(_host(warmup, seconds))


def _disturbed(runs: dict[str, list[dict[str, Any]]]) -> list[bool]:
    """Per repeat, whether other processes took more than :data:`DISTURBED` cores during its
    ceiling or host run."""
    return [
        max(c.get("others_cores") or 0.0, h.get("others_cores") or 0.0) > DISTURBED
        for c, h in zip(runs.get("ceiling", []), runs.get("host", []))
    ]


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _cell(runs: list[dict[str, Any]], *keys: str, digits: int = 1) -> str:
    """The median of the first of ``keys`` the runs have, or ``-``."""
    for key in keys:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            return f"{statistics.median(values):.{digits}f}"
    return "-"


def _markdown(
    runs: dict[str, list[dict[str, Any]]], pairs: list[float], meta: dict[str, Any]
) -> str:
    lines = [
        "# Raw frames: inference='host' against the ceiling (`python -m benchmarks.frames`)",
        "",
        f"`Sampler('PongRaw-v5', n_workers={WORKERS}, envs_per_worker={ENVS_PER_WORKER}, "
        f"n_processes={PROCESSES}, backend='process', inference='host')` with the built-in "
        f"random agent, consecutive `obtain_fragments` calls of {CALL_STEPS} steps per env, "
        "against the ceiling: the same env stepped by a plain loop with pre-drawn actions in "
        "one process per core, side by side (`plain`: one such loop alone). Each cell in a fresh "
        f"interpreter, {meta['warmup']:g} s of warm-up, then a {meta['seconds']:g} s window; "
        f"{meta['repeats']} interleaved repeats, medians. Commit `{meta['commit']}`, "
        f"{meta['cores']} cores, load average {meta['load'][0]:.1f}-{meta['load'][1]:.1f} "
        "during the run.",
        "",
        "CPU per step: the caller's and its env hosts' (the ceiling: its loops'); `others`: "
        "the cores other processes on the machine used meanwhile (a disturbed run when well "
        "above 0).",
        "",
        "| cell | layout | steps/s | of the ceiling | caller CPU us/step | hosts (loops) CPU "
        "us/step | others (cores) |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    ceiling = _median(runs["ceiling"], "steps_per_s") if runs.get("ceiling") else None
    for name, cell in runs.items():
        rate = _median(cell, "steps_per_s")
        share = f"{rate / ceiling:.2f}" if ceiling else "-"
        lines.append(
            f"| {name} | {cell[0]['layout']} | {rate:,.0f} | {share} | "
            f"{_cell(cell, 'main_cpu_us')} | {_cell(cell, 'hosts_cpu_us', 'cpu_us')} | "
            f"{_cell(cell, 'others_cores', digits=2)} |"
        )
    if pairs:
        quiet = [r for r, bad in zip(pairs, _disturbed(runs)) if not bad] or pairs
        value = statistics.median(quiet)
        shown = " ".join(f"{r:.2f}{' !' if bad else ''}" for r, bad in zip(pairs, _disturbed(runs)))
        lines += [
            "",
            "## Target (issue 53, item 3)",
            "",
            f"Per repeat, `!`: a pair where other processes took more than {DISTURBED} cores "
            "during either run; the value is the median of the other pairs (of all when every "
            "pair was disturbed).",
            "",
            "| target | value | per repeat | goal | met |",
            "|---|--:|---|--:|---|",
            f"| host / ceiling | {value:.2f} | {shown} | >= {GOAL} | "
            f"{'yes' if value >= GOAL else 'no'} |",
        ]
    if runs.get("host") and runs.get("ceiling") and runs["ceiling"][0].get("cpu_us"):
        env_us = _median(runs["ceiling"], "cpu_us")
        host_us = _median(runs["host"], "hosts_cpu_us")
        main_us = _median(runs["host"], "main_cpu_us")
        lines += [
            "",
            f"CPU per step beyond the env's own ({env_us:.1f} us in the ceiling's loops): "
            f"{host_us - env_us:.1f} us in the env hosts, {main_us:.1f} us in the caller.",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.frames", description=__doc__)
    parser.add_argument("--cells", nargs="+", choices=CELLS, default=["ceiling", "host"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=float, help="seconds before each window (3)")
    parser.add_argument("--seconds", type=float, help="each cell's window (8)")
    parser.add_argument("--quick", action="store_true", help="short windows, one repeat")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 3.0)
    args.seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 8.0)
    if args.quick:
        args.repeats = 1
    if args.cell:  # a cell in this fresh interpreter: its numbers as JSON on stdout
        print(json.dumps(run_cell(args.cell, args.warmup, args.seconds)))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {}
    load = [os.getloadavg()[0]]
    root = Path(__file__).resolve().parent.parent
    for _ in range(args.repeats):
        for name in args.cells:
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.frames", "--cell", name,
                 "--warmup", str(args.warmup), "--seconds", str(args.seconds)],
                capture_output=True, text=True, check=False, timeout=600, cwd=root,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                return 1
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["load"] = os.getloadavg()[0]
            load.append(row["load"])
            runs.setdefault(name, []).append(row)
            print(f"frames: {name} {row['steps_per_s']:,.0f} steps/s", file=sys.stderr, flush=True)
    pairs = [
        h["steps_per_s"] / c["steps_per_s"]
        for c, h in zip(runs.get("ceiling", []), runs.get("host", []))
    ]
    from benchmarks.report import _commit

    meta = {
        "warmup": args.warmup,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "commit": _commit(),
        "cores": os.cpu_count(),
        "load": [min(load), max(load)],
    }
    result = {"study": "frames", **meta, "host_over_ceiling": pairs, "runs": runs}
    write_own_results(args.out, result, _markdown(runs, pairs, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
