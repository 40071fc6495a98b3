"""A pool of async envs across processes or a Ray cluster: envs whose step awaits a remote
service (here a simulated one: a heavy-tailed latency), thousands of episodes in flight, each
env host (a process, or a Ray actor) stepping its envs in its own event loop.

    python examples/async_env_pool.py --envs 2000                  # env-host processes
    python examples/async_env_pool.py --backend ray --envs 2000 --seconds 10

The default backend, ``process``, needs only the base install. ``--backend ray`` needs Ray
(``pip install 'asyncsample[ray]'``): with no ``RAY_ADDRESS`` a local Ray instance is started
(and shut down at the end); on a cluster, set ``RAY_ADDRESS`` and the same code spreads the
actors over its nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Any

import gymnasium as gym
import numpy as np

import asyncsample


class RemoteServiceEnv(asyncsample.AsyncEnv[np.ndarray, np.int64]):
    """An env whose step waits on a service: 20 ms on average, 1% of the steps 20 times longer
    (a slow request), drawn from its own seeded generator. Episodes of 50 steps; the reward is
    1 when the action matches the sign of the observation's first entry."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, latency: float = 0.02) -> None:
        self.latency = latency
        self.t = 0
        self.obs = np.zeros(4, np.float32)

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        await super().reset(seed=seed)
        self.t = 0
        self.obs = self.np_random.uniform(-1, 1, 4).astype(np.float32)
        return self.obs, {}

    async def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        slow = self.np_random.random() < 0.01
        await asyncio.sleep(self.latency * (20 if slow else 1) * self.np_random.uniform(0.8, 1.2))
        reward = float(int(action) == int(self.obs[0] > 0))
        self.t += 1
        self.obs = self.np_random.uniform(-1, 1, 4).astype(np.float32)
        return self.obs, reward, self.t >= 50, False, {}


async def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend",
        choices=["process", "ray", "asyncio"],
        default="process",
        help="process (default: env-host processes), ray (pip install 'asyncsample[ray]') or "
        "asyncio (every env in this process's event loop)",
    )
    parser.add_argument("--envs", type=int, default=1000, help="episodes in flight")
    parser.add_argument("--hosts", type=int, default=2, help="env-host processes or actors")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to sample")
    parser.add_argument("--latency", type=float, default=0.02, help="mean step latency, s")
    args = parser.parse_args(argv)
    workers = 4 * args.hosts  # a few workers per host, many envs each
    sampler = asyncsample.Sampler(
        lambda: RemoteServiceEnv(args.latency),
        n_workers=workers,
        envs_per_worker=max(1, args.envs // workers),
        backend=args.backend,
        n_processes=args.hosts,
        inference="batched",
        agent=asyncsample.RandomAgent(RemoteServiceEnv.action_space, seed=0),
        step_timeout=5.0,  # a request that hangs costs its own episode only
        max_episode_length=50,
        seed=0,
    )
    steps = episodes = 0
    async with sampler:
        start = time.perf_counter()
        async with contextlib.aclosing(sampler.stream(args.envs * 10)) as stream:
            async for batch in stream:
                steps += batch.n_transitions
                episodes += len(batch.lengths)
                if time.perf_counter() - start > args.seconds:
                    break
        seconds = time.perf_counter() - start
    rate = steps / seconds
    ideal = args.envs / args.latency
    print(
        f"{args.backend}: {steps:,} steps in {seconds:.1f} s, {rate:,.0f} steps/s "
        f"({rate / ideal:.0%} of {ideal:,.0f}, the envs' own limit), {episodes:,} episodes"
    )
    return {"steps": steps, "episodes": episodes, "steps_per_s": rate}


if __name__ == "__main__":
    asyncio.run(main())
