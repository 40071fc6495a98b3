"""Text episodes at scale: what recording strings costs against 4 floats (issue 49's targets).

Run from the repository root::

    asyncsample bench text_envs            # 10,000 concurrent episodes, two 60 s cells
    asyncsample bench text_envs --quick    # 200 episodes, short steps (a smoke run)
    python -m benchmarks.text_envs --episodes 10000 --seconds 60 --out /tmp/text

Two cells, each in a fresh process, with the async-env study's latency model
(:mod:`benchmarks.latency_envs`: mean 50 ms, 1% of the steps 20x longer, +-20% jitter) and
episodes of 200 steps, ``N`` episodes open at once on ``process`` hosts (one per core,
``inference="batched"``, 100 envs per worker):

- ``numeric``: :class:`~benchmarks.latency_envs.AsyncLatencyEnv`, ``Box(4,)`` observations and
  ``Discrete(2)`` actions;
- ``text``: :class:`AsyncTextLatencyEnv`, the same env speaking text: a 1 KB prompt at reset,
  a 200-character tool output after each step, 200-character replies as actions (``Text``
  spaces), so every step moves 400 characters each way between host and caller.

Per cell, as the numeric study measures ours: a stream of complete episodes, then one of
fragments, on the same sampler (batches of about a second of steps at the ideal rate, dropped
once yielded); after each one's warm-up, the env steps counted where they happen over a window;
the better stream's steps/s, and the memory per open episode at its window's end (growth of the
process tree's RSS over the one before the sampler started, / N). A third run of the text cell
profiles the caller (``cProfile``) and counts what the lanes' reply messages carried: messages,
rows and columns by kind (``t``: utf-8 bytes and offsets, ``a``: one array and offsets, ``o``:
objects pickled one by one, the fallback that must stay at zero).

Targets: text steps/s >= 0.8 x numeric; text memory per open episode <= 2 x numeric + the
episode's own text (the prompt, one tool output and one reply: 1,424 bytes). Results:
``benchmarks/results/text_envs/`` (``results.json``, ``results.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces

from benchmarks.latency_envs import AsyncLatencyEnv, LatencyModel, shared_count
from benchmarks.report import write_own_results

RESULTS = Path(__file__).resolve().parent / "results" / "text_envs"

PROMPT_CHARS = 1024
OUTPUT_CHARS = 200
EPISODE_STEPS = 200
#: The text an open episode holds itself: its prompt, a tool output and a reply (ascii bytes).
OWN_TEXT_BYTES = PROMPT_CHARS + 2 * OUTPUT_CHARS

_WORDS = "the quick brown fox jumps over a lazy dog while tools answer calls ".split()


def _text(rng: np.random.Generator, chars: int) -> str:
    words = rng.choice(_WORDS, size=chars // 3)
    return " ".join(words.tolist())[:chars].ljust(chars, ".")


class AsyncTextLatencyEnv(AsyncLatencyEnv):
    """:class:`~benchmarks.latency_envs.AsyncLatencyEnv` speaking text: a 1 KB prompt at reset,
    a 200-character tool output after each step (one of a few drawn per env), ``Text``
    observations and actions."""

    def __init__(
        self,
        latency: LatencyModel | None = None,
        episode_length: int = EPISODE_STEPS,
        counter_dir: str | None = None,
    ) -> None:
        super().__init__(latency, episode_length, counter_dir)
        self.observation_space = spaces.Text(PROMPT_CHARS, charset=_CHARSET)
        self.action_space = spaces.Text(OUTPUT_CHARS, charset=_CHARSET)
        rng = np.random.default_rng(len(_WORDS))
        self._prompt = _text(rng, PROMPT_CHARS)
        self._outputs = [_text(rng, OUTPUT_CHARS) for _ in range(8)]

    def _begin(self, seed: int | None) -> tuple[Any, dict[str, Any]]:  # type: ignore[override]
        super()._begin(seed)
        return self._prompt, {}

    def _advance(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:  # type: ignore[override]
        self._t += 1
        obs = self._outputs[self._t % len(self._outputs)]
        return obs, float(len(action)), False, self._t >= self.episode_length, {}


_CHARSET = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .")


class ReplyAgent:
    """Answers every observation with the same 200-character reply (no model: the study
    measures the sampler)."""

    def __init__(self) -> None:
        self.reply = _text(np.random.default_rng(0), OUTPUT_CHARS)

    def get_actions(self, observations: Any) -> tuple[list[str], dict[str, Any]]:
        return [self.reply] * len(observations), {}


class ZeroAgent:
    """Action 0 for every env."""

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, Any]]:
        return np.zeros(len(observations), dtype=np.int64), {}


def make_env(kind: str, mean: float, episode_length: int, counter_dir: str | None = None) -> Any:
    """The cell's env, counting its steps in ``counter_dir`` (module level: pickled by
    reference into the hosts)."""
    latency = LatencyModel(mean=mean)
    if kind == "text":
        return AsyncTextLatencyEnv(latency, episode_length, counter_dir)
    return AsyncLatencyEnv(latency, episode_length, counter_dir)


def _tree_rss() -> int:
    import psutil

    me = psutil.Process()
    total = int(me.memory_info().rss)
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += int(child.memory_info().rss)
    return total


class _Carried:
    """Counts what the lanes' packed reply messages carried (patched into the link)."""

    def __init__(self) -> None:
        self.messages = 0
        self.rows = 0
        self.columns: collections.Counter[str] = collections.Counter()

    def wrap(self, unpack: Any) -> Any:
        def counted(message: tuple[Any, ...]) -> Any:
            self.messages += 1
            for packed in (message[3], message[4]):
                self.rows += packed[1]
                self.columns.update(c[0] for c in packed[2])
            return unpack(message)

        return counted


async def _window(
    sampler: Any, kind: str, chunk: int, spec: dict[str, Any], counter_dir: str, profiler: Any
) -> tuple[float, int]:
    """Steps/s of one stream (``"episodes"`` or ``"fragments"``, batches of ``chunk`` steps
    dropped once yielded) over the window after the warm-up, counted where the envs step; and
    the process tree's RSS at the window's end."""

    async def consume() -> None:
        stream = sampler.stream(chunk, fragments=kind == "fragments")
        async with contextlib.aclosing(stream) as batches:
            async for _ in batches:
                pass

    task = asyncio.get_running_loop().create_task(consume())
    try:
        await asyncio.sleep(spec["warmup"])
        if profiler is not None:
            profiler.enable()
        c0, t0 = shared_count(counter_dir), time.perf_counter()
        await asyncio.sleep(spec["seconds"])
        steps, elapsed = shared_count(counter_dir) - c0, time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
        rss = _tree_rss()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return steps / elapsed, rss


async def _cell(spec: dict[str, Any]) -> dict[str, Any]:
    """One cell in this process: the better stream's steps/s (as the numeric study measures
    ours: a stream of complete episodes and one of fragments, batches of about a second of steps
    at the ideal rate) and the memory per open episode."""
    import functools

    from asyncsample import Sampler
    from asyncsample.backends import _lane_link

    n, per = spec["episodes"], spec["envs_per_worker"]
    carried = _Carried()
    if spec["profile"]:
        _lane_link.unpack_replies = carried.wrap(_lane_link.unpack_replies)  # type: ignore[attr-defined]
    counter_dir = tempfile.mkdtemp(prefix="text_envs_")
    factory = functools.partial(
        make_env, spec["kind"], spec["mean"], spec["episode_length"], counter_dir
    )
    agent = ReplyAgent() if spec["kind"] == "text" else ZeroAgent()
    rss0 = _tree_rss()
    sampler = Sampler(
        factory,
        agent,
        backend="process",
        n_workers=n // per,
        envs_per_worker=per,
        n_processes=spec["hosts"],
        inference="batched",
        seed=0,
    )
    chunk = max(n, int(n / spec["mean"])) if spec["mean"] > 0 else n
    profiler = cProfile.Profile() if spec["profile"] else None
    streams: dict[str, Any] = {}
    try:
        async with sampler:
            for kind in ("episodes",) if spec["profile"] else ("episodes", "fragments"):
                rate, rss = await _window(sampler, kind, chunk, spec, counter_dir, profiler)
                streams[kind] = {"steps_per_s": rate, "bytes_per_open_episode": (rss - rss0) / n}
    finally:
        shutil.rmtree(counter_dir, ignore_errors=True)
    best = max(streams, key=lambda k: streams[k]["steps_per_s"])
    out: dict[str, Any] = {
        "kind": spec["kind"],
        "episodes": n,
        "stream": best,
        **streams[best],
        "streams": streams,
    }
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
        out["profile"] = text.getvalue()
        out["messages"] = carried.messages
        out["rows_in_messages"] = carried.rows
        out["columns_by_kind"] = dict(carried.columns)
    return out


def _run_cell(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one cell in a fresh process; its result (or the error)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        root = Path(__file__).resolve().parent.parent
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.text_envs",
            "--cell",
            str(spec_path),
            str(out_path),
        ]
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, timeout=timeout, capture_output=True)
        except subprocess.TimeoutExpired:
            return {"kind": spec["kind"], "error": f"timed out after {timeout:.0f} s"}
        if not out_path.exists():
            tail = proc.stderr.decode(errors="replace")[-2000:]
            return {"kind": spec["kind"], "error": f"exit {proc.returncode}: {tail}"}
        result: dict[str, Any] = json.loads(out_path.read_text())
        return result


def _table(results: dict[str, Any]) -> str:
    """The markdown of the results."""
    cells = results["cells"]
    lines = [
        "# Text episodes against 4 floats",
        "",
        f"Command: `{results['command']}`",
        "",
        f"{results['episodes']:,} concurrent episodes of {results['episode_length']} steps, "
        f"mean step latency {results['mean_latency_s'] * 1000:g} ms (1% of steps 20x longer), "
        f"{results['hosts']} process hosts, inference='batched'; window {results['seconds']} s "
        f"after {results['warmup']} s of warm-up.",
        "",
        "| cell | steps/s | memory per open episode | better stream |",
        "|---|---:|---:|---|",
    ]
    for name in ("numeric", "text"):
        c = cells.get(name, {})
        if "error" in c:
            lines.append(f"| {name} | - | - | {c['error'][:120]} |")
        else:
            per_episode = c["bytes_per_open_episode"] / 1024
            rates = ", ".join(
                f"{k} {v['steps_per_s']:,.0f}/s" for k, v in c.get("streams", {}).items()
            )
            lines.append(
                f"| {name} | {c['steps_per_s']:,.0f} | {per_episode:,.1f} KiB | "
                f"{c.get('stream', '')} ({rates}) |"
            )
    t = results.get("targets", {})
    if t:
        lines += [
            "",
            "| target | value | goal | met |",
            "|---|---:|---:|---|",
            f"| text steps/s / numeric steps/s | {t['speed_ratio']:.2f} | >= 0.80 | "
            f"{'yes' if t['speed_met'] else 'no'} |",
            f"| text memory per open episode | {t['text_bytes'] / 1024:,.1f} KiB | <= "
            f"{t['memory_goal_bytes'] / 1024:,.1f} KiB (2 x numeric + {OWN_TEXT_BYTES:,} B) | "
            f"{'yes' if t['memory_met'] else 'no'} |",
        ]
    prof = cells.get("profile", {})
    if "columns_by_kind" in prof:
        lines += [
            "",
            "## What the reply messages carried (text cell, profiled)",
            "",
            f"{prof['messages']:,} packed messages, {prof['rows_in_messages']:,} rows; columns "
            f"by kind: {prof['columns_by_kind']} (`t`: one utf-8 buffer and offsets per leaf; "
            "`o`: objects pickled one by one, the fallback: none expected).",
            "",
            "## Profile of the caller (text cell, by own time)",
            "",
            "```",
            prof["profile"].strip(),
            "```",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the study; writes ``results.json`` and ``results.md`` to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cell", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--episodes", type=int, default=10_000)
    parser.add_argument("--episode-length", type=int, default=EPISODE_STEPS)
    parser.add_argument("--mean", type=float, default=0.050, help="mean step latency, seconds")
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--hosts", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--envs-per-worker", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="a smoke run: small and short")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.cell:
        spec = json.loads(Path(args.cell[0]).read_text())
        Path(args.cell[1]).write_text(json.dumps(asyncio.run(_cell(spec))))
        return 0
    if args.quick:
        args.episodes, args.episode_length, args.mean = 200, 20, 0.005
        args.seconds, args.warmup, args.envs_per_worker = 1.5, 1.0, 50
    per = min(args.envs_per_worker, args.episodes)
    base = {
        "episodes": args.episodes - args.episodes % per,
        "envs_per_worker": per,
        "episode_length": args.episode_length,
        "mean": args.mean,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "hosts": args.hosts,
        "profile": False,
    }
    timeout = 180 + 6 * (args.seconds + args.warmup)
    cells: dict[str, Any] = {}
    runs = [("numeric", "numeric", False), ("text", "text", False)]
    if not args.no_profile:
        runs.append(("profile", "text", True))
    for name, kind, profile in runs:
        print(f"text_envs: cell {name} ({base['episodes']:,} episodes)", flush=True)
        cells[name] = _run_cell({**base, "kind": kind, "profile": profile}, timeout)
    results: dict[str, Any] = {
        "command": "python -m benchmarks.text_envs "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "episodes": base["episodes"],
        "episode_length": args.episode_length,
        "mean_latency_s": args.mean,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "hosts": args.hosts,
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cells": cells,
    }
    numeric, text = cells["numeric"], cells["text"]
    if "error" not in numeric and "error" not in text and numeric["steps_per_s"] > 0:
        goal = 2 * numeric["bytes_per_open_episode"] + OWN_TEXT_BYTES
        results["targets"] = {
            "speed_ratio": text["steps_per_s"] / numeric["steps_per_s"],
            "speed_met": text["steps_per_s"] >= 0.8 * numeric["steps_per_s"],
            "text_bytes": text["bytes_per_open_episode"],
            "memory_goal_bytes": goal,
            "memory_met": text["bytes_per_open_episode"] <= goal,
        }
    write_own_results(args.out, results, _table(results))
    errors = [name for name, c in cells.items() if "error" in c]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
