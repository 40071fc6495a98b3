"""inference="host" with a torch policy against SyncVectorEnv driving the same policy.

``python -m benchmarks.host_policy``: the MLP of :mod:`benchmarks.policies` (64x64 tanh, one torch
thread) on CartPole-v1 and HalfCheetah-v5 with 8 and 32 envs. SyncVectorEnv steps the envs and
calls the policy in one process; asyncsample runs a copy of the policy in each of its 2 env hosts
(the better of two layouts). Writes ``benchmarks/results/host_policy.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import gymnasium as gym

from asyncsample import Sampler
from benchmarks.policies import MLPAgent

#: (env id, envs, asyncsample layouts as (workers, envs per worker))
CASES = [
    ("CartPole-v1", 8, [(2, 4), (4, 2)]),
    ("CartPole-v1", 32, [(2, 16), (4, 8)]),
    ("HalfCheetah-v5", 8, [(2, 4), (4, 2)]),
    ("HalfCheetah-v5", 32, [(2, 16), (4, 8)]),
]


def sync_rate(env_id: str, n: int, seconds: float = 4.0) -> float:
    """Agent steps/s of SyncVectorEnv with the MLP choosing every action."""
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make(env_id)] * n, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    agent = MLPAgent(envs.single_observation_space, envs.single_action_space, seed=0)
    obs, _ = envs.reset(seed=0)
    for _ in range(50):
        obs, *_ = envs.step(agent.get_actions(obs)[0])
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        obs, *_ = envs.step(agent.get_actions(obs)[0])
        steps += n
    envs.close()
    return steps / (time.perf_counter() - start)


async def host_rate(env_id: str, workers: int, envs: int, seconds: float = 4.0) -> float:
    """Agent steps/s of asyncsample with the MLP inside its 2 env hosts."""
    probe = gym.make(env_id)
    agent = MLPAgent(probe.observation_space, probe.action_space, seed=0)
    async with Sampler(
        env_id,
        agent,
        n_workers=workers,
        envs_per_worker=envs,
        n_processes=2,
        seed=0,
        inference="host",
    ) as sampler:
        await sampler.obtain_fragments(workers * envs * 64)
        start, steps = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            steps += (await sampler.obtain_fragments(workers * envs * 128)).n_transitions
        return steps / (time.perf_counter() - start)


def main() -> None:
    """Run every case and write the results."""
    out: list[dict[str, Any]] = []
    for env_id, n, layouts in CASES:
        sync = sync_rate(env_id, n)
        rate, layout = max((asyncio.run(host_rate(env_id, w, k)), f"{w}x{k}") for w, k in layouts)
        row = {
            "env": env_id,
            "envs": n,
            "sync": round(sync),
            "host": round(rate),
            "layout": layout,
            "ratio": round(rate / sync, 2),
            "load": os.getloadavg()[0],
        }
        print(json.dumps(row), flush=True)
        out.append(row)
    path = Path(__file__).resolve().parent / "results" / "host_policy.json"
    path.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
