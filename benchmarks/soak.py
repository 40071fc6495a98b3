"""Soak benchmark: sample for minutes while envs raise, get SIGKILLed and hang at random.

Every returned episode is checked step by step: the env's observation carries the step index, so
a missing, repeated or foreign transition shows up as a gap. Reports steps/s, faults injected and
survived, transitions lost from completed episodes (must be 0), and memory of every process.

Run: ``python -m benchmarks.soak --minutes 3`` (writes ``benchmarks/results/soak/results.json``
and ``.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import psutil
import uvloop

from asyncsample import EpisodeBatch, Sampler, StepType

RESULTS = Path(__file__).resolve().parent / "results"


class FaultyEnv(gym.Env):  # type: ignore[type-arg]
    """An env whose observation is ``[step index, episode id]``; it injects faults at random.

    Faults are drawn from a generator of its own (seeded from the OS: each rebuilt env differs),
    so the episode data stays a pure function of the step index. Each fault is logged to a file
    (one line, appended) before it happens, so the benchmark can count them.
    """

    def __init__(self, log: str, p_raise: float, p_kill: float, p_hang: float) -> None:
        self.observation_space = gym.spaces.Box(0, np.inf, (2,), np.float64)
        self.action_space = gym.spaces.Discrete(2)
        self.log = log
        self.p = np.cumsum([p_raise, p_kill, p_hang])
        self.faults = np.random.default_rng()
        self.t = 0
        self.episode = 0.0

    def _record(self, kind: str) -> None:
        with open(self.log, "a") as f:
            f.write(kind + "\n")

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.t = 0
        self.episode = float(self.np_random.integers(1 << 30))
        return np.array([0.0, self.episode]), {}

    def step(self, action: Any):
        u = self.faults.random()
        if u < self.p[0]:
            self._record("raise")
            raise RuntimeError("injected env exception")
        if u < self.p[1]:
            self._record("kill")
            os.kill(os.getpid(), 9)
        if u < self.p[2]:
            self._record("hang")
            time.sleep(3600)
        time.sleep(0.0001)  # a 100 us step
        self.t += 1
        done = bool(self.np_random.random() < 0.02)
        return np.array([float(self.t), self.episode]), 1.0, done, False, {}


def check_batch(batch: EpisodeBatch) -> int:
    """Transitions that are missing or foreign in the batch's episodes (0 when all is well)."""
    lost = 0
    for i, steps in enumerate(batch.episode_slices):
        obs = batch.observations[steps]
        last = batch.last_observations[i]
        expected = np.arange(len(obs))
        lost += int(np.sum(obs[:, 0] != expected))
        lost += int(np.sum(obs[:, 1] != obs[0, 1]))
        lost += int(last[0] != len(obs)) + int(last[1] != obs[0, 1])
        types = batch.step_types[steps]
        if StepType(types[-1]) not in (StepType.TERMINAL, StepType.TIMEOUT):
            lost += len(obs)
    return lost


def memory() -> dict[str, float]:
    """RSS in MiB of this process and of each live child, by pid."""
    me = psutil.Process()
    out = {f"main {me.pid}": me.memory_info().rss / 2**20}
    for child in me.children(recursive=True):
        try:
            out[f"child {child.pid}"] = child.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return out


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Sample until ``args.minutes`` have passed; return the figures."""
    log = tempfile.NamedTemporaryFile(prefix="asyncsample-soak-", delete=False).name

    def factory() -> gym.Env:  # type: ignore[type-arg]
        return FaultyEnv(log, args.p_raise, args.p_kill, args.p_hang)

    sampler = Sampler(
        factory,
        n_workers=args.workers,
        envs_per_worker=args.envs_per_worker,
        n_processes=2,
        max_episode_length=200,
        step_timeout=args.step_timeout,
        max_restarts=1000,
        seed=0,
    )
    steps = lost = calls = 0
    short = 0
    async with sampler:
        await sampler.obtain_samples(1000)
        mem_start = memory()
        start = time.perf_counter()
        deadline = start + args.minutes * 60
        while time.perf_counter() < deadline:
            batch = await sampler.obtain_samples(args.batch)
            calls += 1
            steps += batch.n_transitions
            lost += check_batch(batch)
            short += int(batch.n_transitions < args.batch)
        elapsed = time.perf_counter() - start
        mem_end = memory()
        restarts = sampler.restarts
    with open(log) as f:
        faults = [line.strip() for line in f]
    os.unlink(log)
    main_key = next(k for k in mem_start if k.startswith("main"))
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seconds": elapsed,
        "calls": calls,
        "transitions": steps,
        "steps_per_second": steps / elapsed,
        "faults_injected": {k: faults.count(k) for k in ("raise", "kill", "hang")},
        "restarts": restarts,
        "transitions_lost": lost,
        "calls_short_of_quota": short,
        "memory_mib_start": mem_start,
        "memory_mib_end": mem_end,
        "main_rss_growth_mib": mem_end[main_key] - mem_start[main_key],
    }


def table(result: dict[str, Any]) -> str:
    """A markdown summary."""
    f = result["faults_injected"]
    rows = [
        ("duration", f"{result['seconds']:.0f} s, {result['calls']} calls"),
        ("transitions", f"{result['transitions']:,} ({result['steps_per_second']:,.0f} steps/s)"),
        ("faults injected", f"{f['raise']} exceptions, {f['kill']} SIGKILLs, {f['hang']} hangs"),
        ("restarts", str(result["restarts"])),
        ("transitions lost from completed episodes", str(result["transitions_lost"])),
        ("calls short of their quota", str(result["calls_short_of_quota"])),
        ("main process RSS growth", f"{result['main_rss_growth_mib']:+.1f} MiB"),
        (
            "env-host RSS at the end",
            ", ".join(
                f"{v:.0f} MiB" for k, v in result["memory_mib_end"].items() if k.startswith("child")
            ),
        ),
    ]
    return "\n".join(["| soak | result |", "| --- | --- |"] + [f"| {a} | {b} |" for a, b in rows])


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--envs-per-worker", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4000)
    parser.add_argument("--p-raise", type=float, default=2e-4)
    parser.add_argument("--p-kill", type=float, default=5e-5)
    parser.add_argument("--p-hang", type=float, default=2e-5)
    parser.add_argument("--step-timeout", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak" / "results.json")
    args = parser.parse_args(argv)
    result = uvloop.run(soak(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    md = table(result)
    args.out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0 if result["transitions_lost"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
