"""Metrics off against on inside one process, in alternating blocks (``ab --blocks N``).

Separate runs of one workload spread 5-10% on a shared 2-core VM (the load and the CPU's speed
move between runs): more than the 2% budget of the metrics (issue 36), so runs alone cannot tell
it. Here each workload runs in one fresh process that holds two copies of it side by side, one
without metrics and one with ``metrics=CollectorRegistry()``, and steps them in short blocks
that alternate (off then on, then on then off, ...), so a drift of the machine's speed falls on
both alike. A block is as many calls (``obtain_fragments`` of a tenth of the workload's
transitions, or vector steps) as take about ``BLOCK_SECONDS`` on the first copy's warm-up.

Reported per workload: the median of the pairs' on/off ratios of steps/s with its 95% confidence
interval (from the order statistics: no assumption on how the ratios spread) and a verdict
against the budget; the median block rate of each copy; the main process's CPU per step of each
(``time.process_time``, every thread of it). Only the main process: the copies' env hosts are
its children alike, and the hosts' side of the metrics rides on replies the hosts send anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["BLOCK_SECONDS", "BUDGET", "median_interval", "run_workload", "verdict"]

REPO_ROOT = Path(__file__).resolve().parent.parent

#: About how long one block runs: long enough for a few of the workload's calls, short enough
#: for dozens of pairs in seconds.
BLOCK_SECONDS = 0.25

#: Metrics on may cost at most this fraction of the steps/s (issue 36: no more than 2% slower).
BUDGET = 0.98


def median_interval(ratios: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A confidence interval for the median of ``ratios`` at ``level``: the ``j``-th smallest
    and largest, ``j`` the largest with ``P(Binomial(n, 1/2) < j) <= (1 - level) / 2``; ``None``
    when there are too few for ``level`` (at 95%, fewer than 6)."""
    xs, n = sorted(ratios), len(ratios)
    tail, below, j = (1 - level) / 2, 0.0, 0
    while j < n // 2:
        below += math.comb(n, j) / 2**n  # P(Binomial < j + 1)
        if below > tail:
            break
        j += 1
    return (xs[j - 1], xs[n - j]) if j else None


def verdict(interval: tuple[float, float] | None, budget: float = BUDGET) -> str:
    """``"within budget"`` when the interval's low end is at least ``budget``, ``"over budget"``
    when its high end is under it, ``"too few pairs"`` without an interval, else
    ``"unresolved"`` (more pairs, or a quieter machine)."""
    if interval is None:
        return "too few pairs"
    low, high = interval
    if low >= budget:
        return "within budget"
    if high < budget:
        return "over budget"
    return "unresolved"


def run_workload(
    tree: Path, workload: tuple[str, str, int, int, int, bool, int], pairs: int
) -> dict[str, Any]:
    """One fresh process running ``workload`` of :data:`benchmarks.ab.WORKLOADS` from the
    asyncsample in ``tree``, off and on alternating for ``pairs`` pairs of blocks."""
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_NUM_THREADS": "1"}
    spec = json.dumps({"workload": list(workload), "pairs": pairs, "root": str(REPO_ROOT)})
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), spec],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=str(Path(os.sep, "tmp")),  # not a checkout: the tree's asyncsample must win
    )
    if done.returncode != 0:
        raise RuntimeError(f"blocks failed on {tree}: {done.stderr.strip().splitlines()[-3:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result.pop("module")).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the blocks on {tree} imported another asyncsample")
    counted, on_steps = result["metrics_steps"], result["steps"]["on"]
    if not 0 < counted <= 1.1 * on_steps:  # the off copy's steps (as many) count nowhere
        raise RuntimeError(f"metrics counted {counted} steps, the on copy made {on_steps}")
    blocks = result["blocks"]
    ratios = [on["rate"] / off["rate"] for off, on in zip(blocks["off"], blocks["on"])]
    interval = median_interval(ratios)

    def cpu_us(side: str) -> float:
        return 1e6 * sum(b["cpu"] for b in blocks[side]) / sum(b["steps"] for b in blocks[side])

    return {
        "off_steps_per_s": statistics.median(b["rate"] for b in blocks["off"]),
        "on_steps_per_s": statistics.median(b["rate"] for b in blocks["on"]),
        "ratio": statistics.median(ratios),
        "interval": None if interval is None else list(interval),
        "verdict": verdict(interval),
        "pair_ratios": ratios,
        "off_main_cpu_us": cpu_us("off"),
        "on_main_cpu_us": cpu_us("on"),
        **result,
    }


# -- the child: both copies in one process -----------------------------------------------------


class _Child:
    """The workload's two copies (metrics off, on) in this process, stepped block by block."""

    def __init__(self, workload: list[Any], pairs: int) -> None:
        import benchmarks.envs  # noqa: F401  (registers the benchmark envs)

        self.face, env_id, self.workers, self.envs, self.procs, policy, n = workload
        self.lanes = self.face in ("asyncio", "asyncio-batched", "thread")
        if self.lanes:
            from benchmarks.async_envs import make_env

            env_id = functools.partial(make_env, self.face == "thread", mean=float(env_id))
        self.env_id, self.policy, self.pairs = env_id, policy, pairs
        self.call = max(n // 10, self.workers * self.envs)  # transitions per sampler call
        self.blocks: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
        self.steps = {"off": 0, "on": 0}  # every step of each copy, warm-ups included
        self.calls = 0  # per block, set from the off copy's warm-up

    def agents(self) -> Any:
        """A fresh set of the workload's agents (each copy its own, seeded alike)."""
        import gymnasium as gym

        from benchmarks.policies import MLPAgent

        probe = self.env_id() if self.lanes else gym.make(self.env_id)
        if not self.policy:
            if self.face in ("batched", "asyncio-batched"):
                from asyncsample import RandomAgent

                return RandomAgent(probe.action_space, seed=0)
            return None
        made = [
            MLPAgent(probe.observation_space, probe.action_space, seed=w)
            for w in range(self.workers)
        ]
        return made[0] if self.face in ("batched", "asyncio-batched", "vector") else made

    def record(self, side: str, steps: int, wall: float, cpu: float) -> float:
        """Count a block's steps; keep it (its rate) unless it is a warm-up; its seconds."""
        self.steps[side] += steps
        if self.calls:
            self.blocks[side].append({"steps": steps, "rate": steps / wall, "cpu": cpu})
        return wall

    def order(self) -> list[str]:
        """The copies' turns: off, on; then on, off; ... (``pairs`` pairs)."""
        return [s for p in range(self.pairs) for s in (("off", "on"), ("on", "off"))[p % 2]]

    def vector(self, registry: Any) -> None:
        from asyncsample import VectorEnv

        n_envs = self.workers * self.envs
        copies, acts, obs = {}, {}, {}
        for side in ("off", "on"):
            kw = {"metrics": registry} if side == "on" else {}
            venv = VectorEnv(self.env_id, n_envs, n_processes=self.procs, **kw)
            copies[side] = venv
            obs[side] = venv.reset(seed=0)[0]
            venv.action_space.seed(0)
            agent = self.agents()
            acts[side] = agent.act if agent else (lambda o, v=venv: v.action_space.sample())
        try:

            def block(side: str, steps: int) -> tuple[int, float, float]:
                venv, act, o = copies[side], acts[side], obs[side]
                cpu0, t0 = time.process_time(), time.perf_counter()
                for _ in range(steps):
                    o = venv.step(act(o))[0]
                obs[side] = o
                return steps * n_envs, time.perf_counter() - t0, time.process_time() - cpu0

            warm = max(self.call // n_envs, 1)
            walls = [self.record(side, *block(side, warm)) for side in ("off", "on")]
            self.calls = max(1, round(BLOCK_SECONDS * warm / walls[0]))
            for side in self.order():
                self.record(side, *block(side, self.calls))
        finally:
            for venv in copies.values():
                venv.close()

    async def sampler(self, registry: Any) -> None:
        from asyncsample import Sampler

        inference = {"batched": "batched", "host": "host", "asyncio-batched": "batched"}.get(
            self.face, "per_worker"
        )
        where = {"backend": self.face.split("-")[0]} if self.lanes else {"n_processes": self.procs}
        async with contextlib.AsyncExitStack() as stack:
            copies = {}
            for side in ("off", "on"):
                kw = {"metrics": registry} if side == "on" else {}
                copies[side] = await stack.enter_async_context(
                    Sampler(
                        self.env_id,
                        self.agents(),
                        n_workers=self.workers,
                        envs_per_worker=self.envs,
                        seed=0,
                        inference=inference,
                        **where,
                        **kw,
                    )
                )

            async def block(side: str, calls: int) -> tuple[int, float, float]:
                cpu0, t0, done = time.process_time(), time.perf_counter(), 0
                for _ in range(calls):
                    done += (await copies[side].obtain_fragments(self.call)).n_transitions
                return done, time.perf_counter() - t0, time.process_time() - cpu0

            walls = [self.record(side, *await block(side, 1)) for side in ("off", "on")]
            self.calls = max(1, round(BLOCK_SECONDS / walls[0]))
            for side in self.order():
                self.record(side, *await block(side, self.calls))

    def run(self) -> dict[str, Any]:
        from prometheus_client import CollectorRegistry, generate_latest

        if self.face == "host-stream":
            raise SystemExit("ab --blocks: the stream workloads are not supported")
        registry = CollectorRegistry()
        if self.face == "vector":
            self.vector(registry)
        else:
            asyncio.run(self.sampler(registry))
        text = generate_latest(registry).decode()
        counted = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("asyncsample_env_steps_total{")
        )
        import asyncsample

        return {
            "blocks": self.blocks,
            "calls_per_block": self.calls,
            "steps": self.steps,
            "metrics_steps": counted,
            "module": asyncsample.__file__,
        }


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    sys.path.append(_spec["root"])  # after PYTHONPATH: asyncsample comes from the tree
    print(json.dumps(_Child(_spec["workload"], _spec["pairs"]).run()))
