"""A failing env's error says where the env came from, on every backend and in the faces.

Envs defined in a test file, ``__main__`` or a notebook reach the env hosts pickled by value, and
cloudpickle (3.1.3 on) then writes ``<dynamic-code>`` as their code's file name: the remote
traceback names the failing function and the exception, not the file. The caller knows the
factory, so the message names it (module and qualified name). These checks hold whatever the
cloudpickle version: they read what the project writes, not the file names cloudpickle keeps.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from async_envs import RandomLengthAsyncEnv
from helpers import SamplerFactory

from asyncsample import NewEnvUpdate, SetTaskUpdate, VectorEnv, WorkerError
from asyncsample.env_update import describe_chain, describe_source

pytestmark = pytest.mark.timeout(120)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class BrokenStepEnv(gym.Env):  # type: ignore[type-arg]
    """Raises in its third step; defined here, so pickled by value."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, fail_at: int = 3) -> None:
        self.fail_at = fail_at
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action: Any) -> Any:
        self.t += 1
        if self.t == self.fail_at:
            raise ValueError("broken on purpose")
        return np.zeros(2, np.float32), 1.0, False, self.t >= 10, {}


class BrokenStepAsyncEnv(RandomLengthAsyncEnv):
    """The async twin: raises in its third step."""

    def __init__(self) -> None:
        super().__init__(10, 10)
        self.t = 0

    async def step(self, action: Any) -> Any:
        self.t += 1
        if self.t == 3:
            raise ValueError("broken on purpose")
        return await super().step(action)


FACTORY = f"{__name__}.BrokenStepEnv"


@pytest.fixture(params=["local", "process", "thread", "asyncio", "ray"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return str(request.param)


def check_names_origin(err: BaseException, factory: str, worker: int = 0) -> None:
    """The message names the worker, the env and its factory; the traceback is the env's."""
    assert isinstance(err, WorkerError)
    text = str(err)
    first = text.split("\n", 1)[0]
    assert first.startswith(f"worker {worker}, env 0: "), first
    assert first.endswith(f"ValueError: broken on purpose (env made by {factory})"), first
    assert err.factory == factory
    assert err.remote_traceback is not None
    assert "in step" in err.remote_traceback
    assert "ValueError: broken on purpose" in err.remote_traceback
    assert isinstance(err.__cause__, ValueError)


async def test_a_failing_env_names_its_factory(backend: str, make_sampler: SamplerFactory) -> None:
    env: Any = BrokenStepAsyncEnv if backend == "asyncio" else BrokenStepEnv
    factory = f"{__name__}.{env.__qualname__}"
    sampler = make_sampler(backend, env=env, n_workers=1, envs_per_worker=1, max_restarts=0)
    async with sampler:
        with pytest.raises(WorkerError) as info:
            await sampler.obtain_samples(20)
    check_names_origin(info.value, factory)


async def test_a_partial_factory_is_named_by_its_function(make_sampler: SamplerFactory) -> None:
    env = functools.partial(BrokenStepEnv, 2)
    sampler = make_sampler("process", env=env, n_workers=2, envs_per_worker=1, max_restarts=0)
    async with sampler:
        with pytest.raises(WorkerError) as info:
            await sampler.obtain_samples(20)
    check_names_origin(info.value, FACTORY, worker=info.value.worker)


async def test_an_env_update_names_the_new_factory(make_sampler: SamplerFactory) -> None:
    env = functools.partial(BrokenStepEnv, 10**9)
    async with make_sampler("process", env=env, n_workers=1, max_restarts=0) as s:
        await s.obtain_samples(10)
        with pytest.raises(WorkerError) as info:
            await s.obtain_samples(20, env_update=NewEnvUpdate(BrokenStepEnv))
    check_names_origin(info.value, FACTORY)


@pytest.mark.parametrize(
    "placement", [{"n_processes": 1}, {"n_processes": 0}, {"n_processes": 1, "caller_envs": 1}]
)
def test_the_vector_env_names_the_sub_env_factory(placement: dict[str, int]) -> None:
    env = VectorEnv([functools.partial(BrokenStepEnv, 10**9), BrokenStepEnv], **placement)
    try:
        env.reset(seed=0)
        env.step(np.zeros(2, np.int64))
        with pytest.raises(WorkerError) as info:
            env.step(np.zeros(2, np.int64))
            env.step(np.zeros(2, np.int64))
    finally:
        env.close()
    text = str(info.value)
    first = text.split("\n", 1)[0]
    assert first.startswith("sub-env 1 (env host "), first  # host 1 is the caller's, mixed
    assert first.endswith(f"): ValueError: broken on purpose (env made by {FACTORY})"), first


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("CartPole-v1", "gymnasium id 'CartPole-v1'"),
        (BrokenStepEnv, FACTORY),
        (functools.partial(functools.partial(BrokenStepEnv, 1)), FACTORY),
        (NewEnvUpdate(BrokenStepEnv), FACTORY),
        (describe_source, "asyncsample.env_update.describe_source"),
        (BrokenStepEnv(), f"a copy of a {FACTORY}"),
    ],
)
def test_describe_source(source: Any, expected: str) -> None:
    assert describe_source(source) == expected
    assert describe_chain(["CartPole-v1", source]) == expected


def test_describe_chain_starts_at_the_last_rebuild() -> None:
    update = SetTaskUpdate(BrokenStepEnv, 3)
    assert describe_chain([BrokenStepEnv, update]) == f"{FACTORY}, then {FACTORY} with task 3"
    assert describe_chain(["CartPole-v1", NewEnvUpdate(BrokenStepEnv), update]) == (
        f"{FACTORY}, then {FACTORY} with task 3"
    )
