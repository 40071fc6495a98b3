"""Batches for a fixed seed stay bit-for-bit what they were before the engine was restructured.

The digests below were computed on main at 95afb8f (before the one-engine restructure) by this
very module (``python tests/test_digest.py`` prints them). Every field of every batch is hashed:
dtypes, shapes and bytes of observations, actions, rewards, step types, lengths, last
observations, env, agent and episode infos. A change to any rule of an episode (where a call
stops, how a piece is cut, which env is reset when) changes a digest.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sys
from typing import Any

import cloudpickle
import envs
import numpy as np
import pytest

from asyncsample import EpisodeBatch, Sampler

#: "env/agent" -> digest of the scenario's batches, computed at 95afb8f (the same for every
#: backend and inference mode).
EXPECTED: dict[str, str] = {
    "cartpole/random": "eef1c2563f218566b97c30a3fc65c3297b4b1903f30e8a9378d543ebaa1622c5",
    "cartpole/policy": "45fb17881e522c8cb53db20dfe76b0ad328adb582569a193ce91488341945d1b",
    "noisy/random": "6a42f058d61453332697cac797d1b4827547c22b6af61c97ff2394be1e83f769",
    "noisy/policy": "515fe1fde2a05ed4e763a850330042793b005b3db7aee61980a636bd0a860f66",
    "dict/random": "0000670f8616bf5c4f06917e0073e914df81220e168332bcf185d9a23f247f0b",
    "dict/policy": "f47ccd43cf53f99ac81a3b5e0f600b48c64d0e6ff19be61cbd576fa59e46193b",
}


def _feed(h: Any, value: Any) -> None:
    """Hash ``value`` (arrays, dicts, tuples, scalars) with its structure, dtypes and shapes."""
    if isinstance(value, dict):
        h.update(b"{")
        for key in sorted(value):
            h.update(repr(key).encode())
            _feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, tuple | list):
        h.update(b"(")
        for item in value:
            _feed(h, item)
        h.update(b")")
    elif isinstance(value, np.ndarray):
        if value.dtype == object:
            items = value.ravel()
            value = np.array([int(v) if hasattr(v, "__index__") else repr(v) for v in items])
        h.update(f"{value.dtype.str}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    else:
        h.update(repr(value).encode())


def batch_digest(batch: EpisodeBatch, h: Any) -> None:
    for name in (
        "observations",
        "last_observations",
        "actions",
        "rewards",
        "step_types",
        "lengths",
        "env_infos",
        "agent_infos",
        "episode_infos",
    ):
        h.update(name.encode())
        _feed(h, getattr(batch, name))


class ObsAgent:
    """A deterministic policy of the observation, with agent infos."""

    def __init__(self, n_actions: int) -> None:
        self.n_actions = n_actions

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        obs = observations["pos"] if isinstance(observations, dict) else observations
        score = np.abs(np.asarray(obs, dtype=np.float64)).sum(axis=1)
        actions = (score * 1000).astype(np.int64) % self.n_actions
        return actions, {"score": score.astype(np.float32), "logp": -score}


def _agent(name: str, agent: str) -> Any:
    if agent == "random":
        return None
    return ObsAgent(2 if name == "cartpole" else 3)


def _env(name: str) -> Any:
    return {"cartpole": "CartPole-v1", "noisy": envs.NoisyEnv, "dict": envs.DictObsEnv}[name]


async def scenario(name: str, agent: str, inference: str, backend: str) -> str:
    """Run every call mode on one sampler and digest what came back."""
    h = hashlib.sha256()
    async with Sampler(
        _env(name),
        _agent(name, agent),
        n_workers=3,
        envs_per_worker=2,
        n_processes=2,
        max_episode_length=40,
        seed=123,
        backend=backend,
        inference=inference,
    ) as sampler:
        batch_digest(await sampler.obtain_samples(257), h)
        batch_digest(await sampler.obtain_exact_episodes(3), h)
        batch_digest(await sampler.obtain_fragments(101), h)
        batch_digest(await sampler.obtain_fragments(101), h)
        update = None if agent == "random" else _agent(name, agent)  # bumps the agent version
        batch_digest(await sampler.obtain_samples(150, agent_update=update), h)
        async with contextlib.aclosing(sampler.stream(120, fragments=True)) as it:
            n = 0
            async for batch in it:
                batch_digest(batch, h)
                n += 1
                if n == 2:
                    break
        h.update(str(sampler.total_env_steps).encode())
    return h.hexdigest()


SCENARIOS = [
    (env, agent, inference, backend)
    for env in ("cartpole", "noisy", "dict")
    for agent, inference, backend in (
        ("random", "per_worker", "local"),
        ("random", "per_worker", "process"),
        ("random", "host", "process"),
        ("policy", "per_worker", "local"),
        ("policy", "per_worker", "process"),
        ("policy", "batched", "local"),
        ("policy", "batched", "process"),
        ("policy", "host", "process"),
    )
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("env", "agent", "inference", "backend"), SCENARIOS)
async def test_batches_are_bit_for_bit_as_before(
    env: str, agent: str, inference: str, backend: str
) -> None:
    # Every backend and inference mode gives the same batches, so the digest is per env and agent.
    assert await scenario(env, agent, inference, backend) == EXPECTED[f"{env}/{agent}"]


if __name__ == "__main__":
    cloudpickle.register_pickle_by_value(envs)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    for env, agent, inference, backend in SCENARIOS:
        digest = asyncio.run(scenario(env, agent, inference, backend))
        print(f'    "{env}/{agent}/{inference}/{backend}": "{digest}",', file=sys.stdout)
