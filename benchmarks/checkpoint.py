"""What a checkpoint of many async episodes in flight costs: time and bytes (issue 51).

Usage::

    python -m benchmarks.checkpoint            # 10,000 episodes in flight (100 x 100) on process
    python -m benchmarks.checkpoint --quick    # 100 episodes (10 x 10), 1 ms steps: a smoke run

The env is the async latency env of :mod:`benchmarks.latency_envs` (4 float observations, a step
that awaits a heavy-tailed latency, mean 50 ms, 100-step episodes), run as async envs in the env
hosts' event loops (``backend="process"``, one host per core), with the built-in random agent.
One ``obtain_fragments`` call takes every env ``--steps`` steps into its episode, so every
episode is in flight; then, for each way an episode in flight comes back:

- ``replay``: the env source wrapped in :class:`asyncsample.Replayable`;
- ``snapshot``: the env has ``get_state``/``set_state`` (:class:`SnapshotLatencyEnv`);
- ``drop``: neither (dropped at resume, counted and warned about);

it times ``await sampler.checkpoint()``, ``state.save(path)`` (and its bytes), ``SamplerState.load``
and the start of a sampler built with ``resume=state`` (the envs built, the episodes brought
back), beside the start of a fresh sampler of the same shape. Results: ``--out`` (default
``benchmarks/results/checkpoint/``), ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np

from asyncsample import Replayable, Sampler, SamplerState
from benchmarks import latency_envs
from benchmarks.latency_envs import AsyncLatencyEnv, LatencyModel
from benchmarks.report import write_own_results

__all__ = ["WAYS", "SnapshotLatencyEnv", "main", "measure"]

# The env hosts cannot import this checkout's benchmarks package by name: ship it by value.
cloudpickle.register_pickle_by_value(latency_envs)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: The ways an episode in flight comes back, one measurement each.
WAYS = ("replay", "snapshot", "drop")


class SnapshotLatencyEnv(AsyncLatencyEnv):
    """The async latency env with ``get_state``/``set_state`` (the snapshot protocol)."""

    def get_state(self) -> dict[str, Any]:
        return {
            "t": self._t,
            "block": self._block,
            "next": self._next,
            "rng": self.np_random.bit_generator.state,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self._t, self._block, self._next = state["t"], state["block"], state["next"]
        self.np_random.bit_generator.state = state["rng"]


def _latency_env(mean: float) -> AsyncLatencyEnv:
    return AsyncLatencyEnv(LatencyModel(mean))


def _snapshot_env(mean: float) -> SnapshotLatencyEnv:
    return SnapshotLatencyEnv(LatencyModel(mean))


def _source(way: str, mean: float) -> Any:
    if way == "snapshot":
        return functools.partial(_snapshot_env, mean)
    factory = functools.partial(_latency_env, mean)
    return Replayable(factory) if way == "replay" else factory


def _sampler(way: str, workers: int, envs: int, mean: float, **kwargs: Any) -> Sampler:
    return Sampler(
        _source(way, mean),
        n_workers=workers,
        envs_per_worker=envs,
        backend="process",
        n_processes=os.cpu_count() or 1,
        seed=0,
        fixed_shares=True,  # every env exactly --steps into its episode, none inside a step
        inference="per_worker",  # the agent in the caller, as the study's results were taken
        **kwargs,
    )


async def measure(way: str, workers: int, envs: int, steps: int, mean: float) -> dict[str, Any]:
    """One way's numbers (see the module doc)."""
    gc.collect()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "sampler.state"
        sampler = _sampler(way, workers, envs, mean)
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(sampler.aclose)
            began = time.perf_counter()
            await sampler.start()
            fresh_start = time.perf_counter() - began
            began = time.perf_counter()
            await sampler.obtain_fragments(workers * envs * steps)
            sampling = time.perf_counter() - began
            began = time.perf_counter()
            state = await sampler.checkpoint()
            capture = time.perf_counter() - began
        began = time.perf_counter()
        size = state.save(path)
        save = time.perf_counter() - began
        began = time.perf_counter()
        loaded = SamplerState.load(path)
        load = time.perf_counter() - began
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "drop": the warning is the point
        resumed = _sampler(way, workers, envs, mean, resume=loaded)
        try:
            began = time.perf_counter()
            await resumed.start()
            resume_start = time.perf_counter() - began
            report = resumed.resumed
        finally:
            await resumed.aclose()
    counts = state.counts()
    in_flight = counts["snapshot"] + counts["replay"] + counts["drop"]
    return {
        "way": way,
        "workers": workers,
        "envs_per_worker": envs,
        "steps_into_episode": steps,
        "mean_latency_s": mean,
        "counts": counts,
        "in_flight": in_flight,
        "sampling_s": sampling,
        "checkpoint_s": capture,
        "bytes": size,
        "bytes_per_episode": size / max(in_flight, 1),
        "save_s": save,
        "load_s": load,
        "fresh_start_s": fresh_start,
        "resumed_start_s": resume_start,
        "resumed": None if report is None else vars(report),
    }


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| way | in flight | checkpoint() s | bytes | bytes/episode | save s | load s | "
        "fresh start s | resumed start s | came back |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        back = r["resumed"] or {}
        came = f"{back.get('replay', 0)} replayed, {back.get('snapshot', 0)} snapshot, "
        came += f"{back.get('dropped', 0)} dropped"
        lines.append(
            f"| {r['way']} | {r['in_flight']:,} | {r['checkpoint_s']:.3f} | {r['bytes']:,} | "
            f"{r['bytes_per_episode']:,.0f} | {r['save_s']:.3f} | {r['load_s']:.3f} | "
            f"{r['fresh_start_s']:.2f} | {r['resumed_start_s']:.2f} | {came} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every way; write the table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint", description=__doc__)
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--envs", type=int, default=100, help="envs per worker")
    parser.add_argument("--steps", type=int, default=10, help="steps into each episode")
    parser.add_argument("--latency", type=float, default=latency_envs.MEAN_LATENCY_S)
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--quick", action="store_true", help="10 x 10 envs, 3 steps, 1 ms")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "checkpoint"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.envs, args.steps, args.latency = 10, 10, 3, 0.001
    rows = [
        asyncio.run(measure(way, args.workers, args.envs, args.steps, args.latency))
        for way in args.ways
    ]
    result = {
        "study": "checkpoint",
        "command": "python -m benchmarks.checkpoint " + " ".join(argv or sys.argv[1:]),
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "numpy": np.__version__,
        "rows": rows,
    }
    title = (
        f"Checkpoint of {args.workers * args.envs:,} async episodes in flight on process "
        f"({args.workers} workers x {args.envs} envs, {args.steps} steps in, "
        f"{args.latency * 1000:g} ms mean step)"
    )
    write_own_results(args.out, result, f"# {title}\n\n{_table(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
