"""The worker layer on its own: garage's VecWorker and FragmentWorker behaviour."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from envs import GridWorldEnv, ScriptedAgent

from asyncsample import EnvSpec, FragmentWorker, StepType, VecWorker, Worker, WorkerFactory
from asyncsample.backends import HostSpec
from asyncsample.backends.local import LocalHost
from asyncsample.seeding import worker_seeds

MAX_LEN = 9


async def attached(worker: Worker, maps: list[str]) -> Worker:
    env = GridWorldEnv()
    spec = EnvSpec(env.observation_space, env.action_space, MAX_LEN)
    host = LocalHost(HostSpec(0, worker.n_envs, env.observation_space, env.action_space, MAX_LEN))
    _, seeds = worker_seeds(0, 1, worker.n_envs)
    sources = [functools.partial(GridWorldEnv, m) for m in maps]
    await worker.attach(host, spec, ScriptedAgent(), sources, seeds[0])
    return worker


async def test_vec_worker_rollout_returns_the_first_completions() -> None:
    worker = await attached(
        VecWorker(seed=0, max_episode_length=MAX_LEN, worker_number=0, n_envs=5), ["4x4"] * 5
    )
    for _ in range(2):
        batch = await worker.rollout()
        # Five identical envs finish together on step 6.
        assert batch.lengths.tolist() == [6] * 5
        assert batch.episode_infos["env"].tolist() == [0, 1, 2, 3, 4]
        assert np.var(batch.actions) > 0
    await worker.shutdown()


async def test_vec_worker_rollout_mixed_maps() -> None:
    worker = await attached(
        VecWorker(seed=0, max_episode_length=MAX_LEN, worker_number=0, n_envs=3),
        ["hole_first", "4x4", "no_goal"],
    )
    batch = await worker.rollout()
    # The hole ends the first env's episode on the first step (action 2 = right, into H).
    assert batch.lengths.tolist() == [1]
    assert StepType(batch.step_types[0]) == StepType.TERMINAL


@pytest.mark.parametrize("timesteps_per_call", [1, 2])
async def test_fragment_worker_rollout(timesteps_per_call: int) -> None:
    worker = await attached(
        FragmentWorker(
            seed=0,
            max_episode_length=MAX_LEN,
            worker_number=0,
            n_envs=5,
            timesteps_per_call=timesteps_per_call,
        ),
        ["4x4"] * 5,
    )
    n_calls = math.ceil(9 / timesteps_per_call)
    observed: list[list[int]] = [[] for _ in range(5)]
    for i in range(n_calls):
        batch = await worker.rollout()
        assert batch.n_transitions == 5 * timesteps_per_call
        if timesteps_per_call * (i + 1) < 6:
            assert StepType.TERMINAL not in [StepType(t) for t in batch.step_types]
        for ep in batch.split():
            observed[int(ep.episode_infos["env"][0])].extend(ep.observations.tolist())
    for obs in observed:
        assert obs[:6] == [0, 1, 2, 6, 10, 14]


def test_worker_factory_builds_workers_with_args() -> None:
    factory = WorkerFactory(
        max_episode_length=7,
        seed=3,
        n_workers=2,
        worker_class=FragmentWorker,
        worker_args={"n_envs": 4, "timesteps_per_call": 3},
    )
    worker = factory(1)
    assert isinstance(worker, FragmentWorker)
    assert (worker.worker_number, worker.n_envs, worker.timesteps_per_call) == (1, 4, 3)
    with pytest.raises(ValueError, match="not picklable"):
        import pickle

        pickle.dumps(worker)
