"""The async env interface (``asyncsample.AsyncEnv``), its checks and the test envs."""

from __future__ import annotations

import asyncio
from typing import Any

import async_envs
import gymnasium as gym
import numpy as np
import pytest
from async_envs import (
    CountingAsyncEnv,
    CountingEnv,
    DuckAsyncEnv,
    FailingAsyncEnv,
    HangingAsyncEnv,
    RandomLengthAsyncEnv,
    RandomLengthEnv,
)

from asyncsample.async_env import (
    AsyncEnv,
    check_async_env,
    check_blocking_env,
    close_env,
    is_async_env,
)


async def run_episode(env: Any, seed: int | None = None) -> list[Any]:
    """Every (obs, reward, terminated, truncated, info) of one episode, action 1 throughout."""
    obs, info = await env.reset(seed=seed)
    out: list[Any] = [(obs, info)]
    while True:
        step = await env.step(1)
        out.append(step)
        if step[2] or step[3]:
            return out


def run_sync_episode(env: gym.Env[Any, Any], seed: int | None = None) -> list[Any]:
    obs, info = env.reset(seed=seed)
    out: list[Any] = [(obs, info)]
    while True:
        step = env.step(1)
        out.append(step)
        if step[2] or step[3]:
            return out


def same(a: Any, b: Any) -> bool:
    """Deep equality over tuples, dicts and arrays."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


class Bare(AsyncEnv[int, int]):
    """The least an AsyncEnv subclass writes."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Discrete(3)
        self.action_space = gym.spaces.Discrete(2)

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[int, dict[str, Any]]:
        await super().reset(seed=seed)
        return int(self.np_random.integers(3)), {}


# --- the interface -----------------------------------------------------------------------------


async def test_seeding_follows_gymnasium() -> None:
    a: AsyncEnv[Any, Any] = AsyncEnv()
    b = Bare()
    await a.reset(seed=7)
    await b.reset(seed=7)
    assert a.np_random_seed == b.np_random_seed == 7
    first = a.np_random.random()
    # A later reset without a seed continues the generator, as gymnasium's does.
    ref = gym.Env()
    ref.reset(seed=7)
    assert ref.np_random.random() == first
    await a.reset()
    assert a.np_random.random() == ref.np_random.random()


async def test_unseeded_generator_and_setter() -> None:
    env = Bare()
    assert isinstance(env.np_random, np.random.Generator)
    assert env.np_random_seed >= 0
    env.np_random = np.random.default_rng(1)
    assert env.np_random_seed == -1


async def test_defaults_match_gymnasium_env() -> None:
    env = Bare()
    ref = gym.Env()
    assert env.metadata == ref.metadata
    assert env.spec is None and env.render_mode is None
    assert env.unwrapped is env
    assert str(env) == "<Bare instance>"
    with pytest.raises(NotImplementedError, match="step"):
        await env.step(0)
    assert await env.close() is None
    async with Bare() as entered:
        assert isinstance(entered, Bare)


def test_is_async_env() -> None:
    assert is_async_env(Bare())
    assert is_async_env(CountingAsyncEnv())
    assert is_async_env(DuckAsyncEnv())
    assert not is_async_env(CountingEnv())
    assert not is_async_env(gym.make("CartPole-v1"))
    assert not is_async_env(object())

    class NoSpaces:
        async def reset(self) -> None: ...

        async def step(self, action: Any) -> None: ...

    assert not is_async_env(NoSpaces())


def test_check_async_env_accepts() -> None:
    check_async_env(CountingAsyncEnv(), "env")
    check_async_env(DuckAsyncEnv(), "env")


def test_check_async_env_refuses_a_blocking_env() -> None:
    env = gym.make("CartPole-v1")
    with pytest.raises(TypeError) as info:
        check_async_env(env.unwrapped, "env")
    message = str(info.value)
    assert message.startswith("env: backend='asyncio' needs envs whose reset/step are coroutines")
    assert "CartPoleEnv, a blocking gymnasium.Env" in message
    assert "backend='thread'" in message
    env.close()


def test_check_async_env_refuses_half_async_and_non_envs() -> None:
    class HalfAsync:
        observation_space = gym.spaces.Discrete(2)
        action_space = gym.spaces.Discrete(2)

        async def reset(self) -> None: ...

        def step(self, action: Any) -> None: ...

    with pytest.raises(TypeError, match=r"HalfAsync, a blocking env \(step not async def\)"):
        check_async_env(HalfAsync(), "env")
    with pytest.raises(TypeError, match=r"env: backend='asyncio' needs an env .* got int"):
        check_async_env(3, "env")


def test_check_async_env_refuses_missing_or_wrong_spaces() -> None:
    env = Bare()
    del env.action_space
    with pytest.raises(TypeError, match="needs a gymnasium space as action_space; Bare has none"):
        check_async_env(env, "make_env")
    env = Bare()
    env.observation_space = (3,)  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"Bare.observation_space must be a gymnasium.*got tuple"):
        check_async_env(env, "make_env")


def test_check_blocking_env() -> None:
    check_blocking_env(CountingEnv(), "env", "thread")
    with pytest.raises(TypeError, match=r"backend='thread' .* CountingAsyncEnv, an async env"):
        check_blocking_env(CountingAsyncEnv(), "env", "thread")


async def test_close_env_awaits_or_calls() -> None:
    a, d = CountingAsyncEnv(), DuckAsyncEnv()
    await close_env(a)
    await close_env(d)
    await close_env(object())  # no close at all: nothing to do
    assert a.closed and d.closed


# --- the test envs -----------------------------------------------------------------------------


async def test_counting_env() -> None:
    env = CountingAsyncEnv(length=4)
    steps = await run_episode(env, seed=3)
    assert len(steps) == 5
    assert [float(s[0][0]) for s in steps[1:]] == [1, 2, 3, 4]
    assert all(s[1] == 1.0 for s in steps[1:])
    assert env.observation_space.contains(steps[-1][0])
    await env.close()


async def test_random_length_env_is_seeded_and_matches_its_twin() -> None:
    for seed in (0, 1, 2):
        a = await run_episode(RandomLengthAsyncEnv(2, 9, latency=(0.0, 0.001)), seed)
        b = await run_episode(RandomLengthAsyncEnv(2, 9, latency=(0.0, 0.001)), seed)
        c = run_sync_episode(RandomLengthEnv(2, 9, latency=(0.0, 0.001)), seed)
        assert same(a, b) and same(a, c)
        assert 2 <= len(a) - 1 <= 9
    lengths = {len(await run_episode(RandomLengthAsyncEnv(1, 30), s)) for s in range(10)}
    assert len(lengths) > 3


async def test_duck_env_matches_counting_env() -> None:
    assert same(await run_episode(DuckAsyncEnv(5), 4), await run_episode(CountingAsyncEnv(5), 4))


async def test_latency_is_awaited_not_blocking() -> None:
    envs = [CountingAsyncEnv(length=2, latency=0.05) for _ in range(20)]
    for env in envs:
        await env.reset(seed=0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await asyncio.gather(*(env.step(0) for env in envs))
    assert loop.time() - t0 < 0.5  # 20 x 50 ms would be 1 s in sequence


async def test_failing_env() -> None:
    env = FailingAsyncEnv(fail_at=3)
    await env.reset(seed=0)
    await env.step(0)
    await env.step(0)
    with pytest.raises(RuntimeError, match="step 3"):
        await env.step(0)
    await env.step(0)  # only the third step fails


async def test_hanging_env_is_cancellable() -> None:
    env = HangingAsyncEnv(hang_at=2)
    await env.reset(seed=0)
    await env.step(0)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await env.step(0)
    assert env.hung and env.cancelled
    await env.step(0)


async def test_factories_record_and_switch() -> None:
    factory = async_envs.failing(fail_at=1, times=1, length=2)
    first, second = factory(), factory()
    assert isinstance(first, FailingAsyncEnv) and type(second) is CountingAsyncEnv
    assert factory.made == [first, second]
    hang = async_envs.hanging(hang_at=1, times=2)
    assert [type(hang()).__name__ for _ in range(3)] == [
        "HangingAsyncEnv",
        "HangingAsyncEnv",
        "CountingAsyncEnv",
    ]
    before = async_envs.open_envs()
    env = async_envs.counting(3)()
    assert async_envs.open_envs() == before + 1
    await env.close()
    assert async_envs.open_envs() == before
    assert isinstance(async_envs.blocking_counting()(), CountingEnv)
    assert isinstance(async_envs.duck()(), DuckAsyncEnv)
    assert isinstance(async_envs.random_length()(), RandomLengthAsyncEnv)
