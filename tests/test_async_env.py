"""The async env interface (``asyncsample.AsyncEnv``), its checks and the test envs."""

from __future__ import annotations

import asyncio
import contextlib
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

from asyncsample import Sampler
from asyncsample.async_env import (
    AsyncEnv,
    AsyncRecordEpisodeStatistics,
    AsyncTimeLimit,
    AsyncWrapper,
    check_async_env,
    check_blocking_env,
    close_env,
    is_async_env,
    time_limit,
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


async def test_latency_is_awaited_not_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 20 steps' latencies are waited at once (in sequence: one at a time)."""
    envs = [CountingAsyncEnv(length=2, latency=0.05) for _ in range(20)]
    for env in envs:
        await env.reset(seed=0)
    sleep, waiting, peak = asyncio.sleep, [0], [0]

    async def counted(delay: float, result: Any = None) -> Any:
        waiting[0] += 1
        peak[0] = max(peak[0], waiting[0])
        try:
            return await sleep(delay, result)
        finally:
            waiting[0] -= 1

    monkeypatch.setattr(asyncio, "sleep", counted)
    await asyncio.gather(*(env.step(0) for env in envs))
    assert peak[0] == 20


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


async def test_factories_record_and_spend_their_budget_on_misbehaving() -> None:
    factory = async_envs.failing(fail_at=2, times=1, length=5)
    probe, first, second = factory(), factory(), factory()
    assert factory.made == [probe, first, second]
    for env in (first, second):
        await env.reset(seed=0)
        await env.step(0)
    with pytest.raises(RuntimeError, match="step 2"):
        await first.step(0)
    await second.step(0)  # the budget (one failure) is spent
    assert first.failed and not second.failed and not probe.failed
    hang = async_envs.hanging(hang_at=1, times=2)
    envs = [hang() for _ in range(3)]
    for env in envs:
        await env.reset(seed=0)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.01):
                await env.step(0)
    assert [env.hung for env in envs] == [True, True, False]
    assert [env.cancelled for env in envs] == [True, True, False]
    before = async_envs.open_envs()
    env = async_envs.counting(3)()
    assert async_envs.open_envs() == before + 1
    await env.close()
    assert async_envs.open_envs() == before
    assert isinstance(async_envs.blocking_counting()(), CountingEnv)
    assert isinstance(async_envs.duck()(), DuckAsyncEnv)
    assert isinstance(async_envs.random_length()(), RandomLengthAsyncEnv)


# --- the wrappers, against gymnasium's on the blocking twins -------------------------------------


async def run_episodes(env: Any, seed: int, n: int, actions_seed: int = 0) -> list[Any]:
    """``n`` episodes (the first reset seeded), actions drawn from a seeded action space."""
    space = gym.spaces.Discrete(2, seed=actions_seed)
    out: list[Any] = []
    for i in range(n):
        out.append(await env.reset(seed=seed if i == 0 else None))
        while True:
            step = await env.step(space.sample())
            out.append(step)
            if step[2] or step[3]:
                break
    return out


def run_sync_episodes(
    env: gym.Env[Any, Any], seed: int, n: int, actions_seed: int = 0
) -> list[Any]:
    space = gym.spaces.Discrete(2, seed=actions_seed)
    out: list[Any] = []
    for i in range(n):
        out.append(env.reset(seed=seed if i == 0 else None))
        while True:
            step = env.step(space.sample())
            out.append(step)
            if step[2] or step[3]:
                break
    return out


def without_time(steps: list[Any]) -> list[Any]:
    """The steps with the wall-clock ``t`` of episode statistics taken out."""
    out = []
    for step in steps:
        info = step[-1]
        if "episode" in info:
            assert isinstance(info["episode"]["t"], float) and info["episode"]["t"] >= 0
            info = {**info, "episode": {k: v for k, v in info["episode"].items() if k != "t"}}
        out.append((*step[:-1], info))
    return out


@pytest.mark.parametrize("limit", [1, 4, 9, 30])
async def test_time_limit_matches_gymnasium(limit: int) -> None:
    # Lengths 3..12 against limits below, inside and above them (9: some episodes terminate on
    # the very step the limit truncates them, as gymnasium reports both flags then).
    for seed in range(4):
        ours = AsyncTimeLimit(RandomLengthAsyncEnv(3, 12), limit)
        ref = gym.wrappers.TimeLimit(RandomLengthEnv(3, 12), limit)
        a, b = await run_episodes(ours, seed, 6), run_sync_episodes(ref, seed, 6)
        assert same(a, b)


async def test_time_limit_terminated_and_truncated_together() -> None:
    ours = AsyncTimeLimit(CountingAsyncEnv(5), 5)
    ref = gym.wrappers.TimeLimit(CountingEnv(5), 5)
    a, b = await run_episodes(ours, 0, 2), run_sync_episodes(ref, 0, 2)
    assert same(a, b)
    assert a[5][2] and a[5][3]


async def test_record_episode_statistics_matches_gymnasium() -> None:
    ours = AsyncRecordEpisodeStatistics(RandomLengthAsyncEnv(1, 15), buffer_length=5)
    ref = gym.wrappers.RecordEpisodeStatistics(RandomLengthEnv(1, 15), buffer_length=5)
    a, b = await run_episodes(ours, 3, 12), run_sync_episodes(ref, 3, 12)
    assert same(without_time(a), without_time(b))
    assert sum("episode" in s[-1] for s in a) == 12
    assert ours.episode_count == ref.episode_count == 12
    assert list(ours.return_queue) == list(ref.return_queue)
    assert list(ours.length_queue) == list(ref.length_queue)
    assert len(ours.time_queue) == 5


async def test_stacked_wrappers_match_gymnasium() -> None:
    ours = AsyncRecordEpisodeStatistics(AsyncTimeLimit(RandomLengthAsyncEnv(2, 20), 8))
    ref = gym.wrappers.RecordEpisodeStatistics(gym.wrappers.TimeLimit(RandomLengthEnv(2, 20), 8))
    a, b = await run_episodes(ours, 5, 10), run_sync_episodes(ref, 5, 10)
    assert same(without_time(a), without_time(b))
    assert any(s[3] for s in a if len(s) == 5)  # some episodes were truncated


async def test_episode_time_counts_awaited_latency() -> None:
    env = AsyncRecordEpisodeStatistics(CountingAsyncEnv(3, latency=0.02))
    steps = await run_episodes(env, 0, 1)
    assert steps[-1][-1]["episode"]["t"] >= 0.05


async def test_wrapper_forwards() -> None:
    inner = Bare()
    inner.metadata = {"render_modes": ["ansi"], "render_fps": 4}
    env = AsyncRecordEpisodeStatistics(AsyncTimeLimit(inner, 7))
    assert env.observation_space is inner.observation_space
    assert env.action_space is inner.action_space
    assert env.metadata == inner.metadata
    assert env.spec is None and env.render_mode is None
    assert env.unwrapped is inner
    assert str(env) == "<AsyncRecordEpisodeStatistics<AsyncTimeLimit<Bare instance>>>"
    assert repr(env) == str(env)
    await env.reset(seed=11)  # seeding through the layers seeds the innermost env
    assert env.np_random_seed == inner.np_random_seed == 11
    assert env.np_random is inner.np_random
    generator = np.random.default_rng(0)
    env.np_random = generator
    assert inner.np_random is generator
    assert env.get_wrapper_attr("max_episode_steps") == 7
    assert env.has_wrapper_attr("max_episode_steps")
    assert not env.has_wrapper_attr("no_such_thing")
    with pytest.raises(AttributeError, match="no_such_thing"):
        env.get_wrapper_attr("no_such_thing")
    assert time_limit(env) == 7
    assert time_limit(AsyncTimeLimit(AsyncTimeLimit(inner, 9), 20)) == 9
    assert time_limit(inner) is None and time_limit(AsyncWrapper(inner)) is None
    # Every layer reports the stack's limit, where the sampler reads it.
    assert env.max_episode_steps == 7 and AsyncWrapper(inner).max_episode_steps is None
    assert AsyncWrapper(AsyncTimeLimit(AsyncTimeLimit(inner, 9), 20)).max_episode_steps == 9


async def test_wrapper_can_set_its_own_spaces_and_metadata() -> None:
    inner = Bare()
    env = AsyncWrapper(inner)
    env.observation_space = gym.spaces.Discrete(9)
    env.action_space = gym.spaces.Discrete(5)
    env.metadata = {"render_modes": ["rgb_array"]}
    assert env.observation_space.n == 9 and env.action_space.n == 5  # type: ignore[attr-defined]
    assert inner.observation_space.n == 3  # type: ignore[attr-defined]
    assert inner.metadata == {"render_modes": []}


async def test_time_limit_spec_like_gymnasium() -> None:
    inner = Bare()
    inner.spec = gym.spec("CartPole-v1")
    env = AsyncTimeLimit(inner, 12)
    assert env.spec is not None and env.spec.max_episode_steps == 12
    assert inner.spec.max_episode_steps == 500  # the wrapped env's spec is not changed
    assert str(inner) == "<Bare<CartPole-v1>>"


async def test_wrappers_on_a_duck_env() -> None:
    inner = DuckAsyncEnv(4)
    env = AsyncRecordEpisodeStatistics(AsyncTimeLimit(inner, 3))  # type: ignore[arg-type]
    steps = await run_episodes(env, 0, 1)
    assert steps[-1][3] and steps[-1][-1]["episode"]["l"] == 3
    assert env.unwrapped is inner
    await env.close()
    assert inner.closed


async def test_wrapper_refusals() -> None:
    with pytest.raises(TypeError, match="AsyncWrapper needs envs whose reset/step are coroutines"):
        AsyncWrapper(CountingEnv())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gymnasium's wrappers"):
        AsyncTimeLimit(CountingEnv(), 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_episode_steps: expected an int >= 1, got 0"):
        AsyncTimeLimit(CountingAsyncEnv(), 0)
    with pytest.raises(TypeError, match="max_episode_steps: expected an int >= 1, got float"):
        AsyncTimeLimit(CountingAsyncEnv(), 1.5)  # type: ignore[arg-type]
    with pytest.raises(gym.error.ResetNeeded):
        await AsyncTimeLimit(CountingAsyncEnv(), 3).step(0)

    class Clashing(CountingAsyncEnv):
        async def step(self, action: Any) -> Any:
            obs, r, term, trunc, info = await super().step(action)
            return obs, r, term, trunc, {**info, "episode": 1}

    env = AsyncRecordEpisodeStatistics(Clashing(1))
    await env.reset(seed=0)
    with pytest.raises(ValueError, match="already has the key 'episode'"):
        await env.step(0)


async def test_wrapper_closes_the_env() -> None:
    inner = CountingAsyncEnv()
    async with AsyncTimeLimit(inner, 3):
        pass
    assert inner.closed


def test_public_names() -> None:
    import asyncsample

    for name in (
        "AsyncEnv",
        "AsyncWrapper",
        "AsyncTimeLimit",
        "AsyncRecordEpisodeStatistics",
        "is_async_env",
    ):
        assert name in asyncsample.__all__
        assert getattr(asyncsample, name) is getattr(asyncsample.async_env, name)


# --- the wrappers under the sampler ---------------------------------------------------------


def async_stack() -> AsyncRecordEpisodeStatistics[Any, Any]:
    return AsyncRecordEpisodeStatistics(AsyncTimeLimit(RandomLengthAsyncEnv(2, 20), 8))


def gym_stack() -> gym.Env[Any, Any]:
    return gym.wrappers.RecordEpisodeStatistics(gym.wrappers.TimeLimit(RandomLengthEnv(2, 20), 8))


def assert_same_batches(a: Any, b: Any) -> None:
    """Equal batches, but for the wall-clock seconds of the episode statistics."""
    for field in ("observations", "actions", "rewards", "lengths", "step_types", "agent_versions"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    ea, eb = dict(a.episode_infos), dict(b.episode_infos)
    sa, sb = ea.pop("episode"), eb.pop("episode")
    assert same(ea, eb) and same(a.env_infos, b.env_infos)
    assert same({k: sa[k] for k in "rl"}, {k: sb[k] for k in "rl"})


def _two_limits(tight_inside: bool, asynchronous: bool) -> Any:
    """A stack of two time limits, 4 and 9 steps, over 20-step episodes."""
    wrap: Any = AsyncTimeLimit if asynchronous else gym.wrappers.TimeLimit
    env: Any = CountingAsyncEnv(20) if asynchronous else CountingEnv(20)
    inner, outer = (4, 9) if tight_inside else (9, 4)
    return wrap(wrap(env, inner), outer)


@pytest.mark.parametrize("tight_inside", [True, False], ids=["tight-inside", "tight-outside"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["blocking", "async"])
async def test_the_tightest_of_two_time_limits_is_read_and_truncates(
    asynchronous: bool, tight_inside: bool
) -> None:
    env = _two_limits(tight_inside, asynchronous)
    assert time_limit(env) == 4  # the outermost would say 9 where the tight one is inside
    episodes = await run_episodes(env, 0, 1) if asynchronous else run_sync_episodes(env, 0, 1)
    assert len(episodes) == 4 + 1 and episodes[-1][3]  # the reset, then truncated at step 4
    backend = "asyncio" if asynchronous else "local"
    async with Sampler(lambda: _two_limits(tight_inside, asynchronous), backend=backend) as s:
        assert s.env_spec.max_episode_length == 4


class ObservationAgent:
    """Acts on its input alone (the built-in RandomAgent draws for whichever envs are ready
    together, which on ``thread`` depends on the threads' timing)."""

    def get_actions(self, observations: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        return (np.asarray(observations)[:, 1] > 0.5).astype(np.int64), {}


@pytest.mark.timeout(60)
async def test_wrappers_under_the_asyncio_backend_match_gymnasiums_under_thread() -> None:
    options: dict[str, Any] = {"n_workers": 2, "envs_per_worker": 3, "seed": 5}
    options["agent"] = ObservationAgent()
    async with Sampler(async_stack, backend="asyncio", **options) as sampler:
        assert sampler.env_spec.max_episode_length == 8  # read through the statistics wrapper
        ours = await sampler.obtain_exact_episodes(5)
    async with Sampler(gym_stack, backend="thread", **options) as sampler:
        assert sampler.env_spec.max_episode_length == 8
        ref = await sampler.obtain_exact_episodes(5)
    assert_same_batches(ours, ref)
    stats = ours.episode_infos["episode"]
    assert np.array_equal(stats["l"], ours.lengths)
    starts = np.concatenate([[0], ours.lengths.cumsum()[:-1]])
    assert np.allclose(stats["r"], np.add.reduceat(ours.rewards, starts))
    assert (ours.lengths <= 8).all() and (ours.lengths == 8).any()


@pytest.mark.parametrize("backend", ["local", "thread"])
def test_blocking_backends_name_an_async_env(backend: str) -> None:
    """An async env on a backend that steps blocking envs is refused with what to use
    (``process`` takes async envs: tests/test_hosted_async_envs.py)."""
    with pytest.raises(ValueError, match=r"CountingAsyncEnv, an async env .* backend='asyncio'"):
        Sampler(CountingAsyncEnv, backend=backend)
