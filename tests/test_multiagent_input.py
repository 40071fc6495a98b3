"""The multi-agent input layer: telling a ParallelEnv (and its async twin) apart, checking a
user's env or factory with errors that name the argument, and the adapters both ways.

Every async test runs under asyncio's default loop and uvloop in the default run
(``both_loops``); the blocking adapter's tests are parametrised over both loops' factories.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import uvloop

from asyncsample import AsyncEnv
from asyncsample._tree import tree_equal
from asyncsample.errors import AsyncSampleError, ParallelEnvError
from asyncsample.multiagent import (
    AsyncParallelAdapter,
    BlockingParallelAdapter,
    RandomActions,
    Turn,
    action_mask_of,
    as_async_parallel_env,
    check_parallel_env,
    check_parallel_env_factory,
    is_async_parallel_env,
    is_parallel_env,
)
from asyncsample.multiagent.testing import AsyncRosterEnv, RosterEnv

pytestmark = [pytest.mark.both_loops, pytest.mark.timeout(60)]

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


# --- detection ------------------------------------------------------------------------------


class SingleAgentAsync(AsyncEnv[int, int]):
    def __init__(self) -> None:
        self.observation_space = gym.spaces.Discrete(2)
        self.action_space = gym.spaces.Discrete(2)


def test_the_kinds_are_told_apart() -> None:
    assert is_parallel_env(RosterEnv()) and not is_async_parallel_env(RosterEnv())
    assert is_parallel_env(AsyncRosterEnv()) and is_async_parallel_env(AsyncRosterEnv())
    for other in (gym.make("CartPole-v1"), SingleAgentAsync(), object(), RosterEnv):
        assert not is_parallel_env(other), other


def test_check_describes_the_env() -> None:
    env = RosterEnv()
    spec = check_parallel_env(env)
    assert spec.possible_agents == ("scout_0", "scout_1", "tank_0", "medic_0")
    assert not spec.is_async and check_parallel_env(AsyncRosterEnv()).is_async
    for agent in spec.possible_agents:
        assert spec.observation_spaces[agent] is env.observation_space(agent)
        assert spec.action_spaces[agent] is env.action_space(agent)
    assert [spec.index(a) for a in spec.possible_agents] == [0, 1, 2, 3]
    with pytest.raises(KeyError):
        spec.index("nobody")


class Duck:
    """A ParallelEnv by its members, each replaceable by a test."""

    def __init__(self, **members: Any) -> None:
        self.possible_agents = ["a", "b"]
        self.agents: list[str] = []
        self._space = gym.spaces.Discrete(2)
        for name, value in members.items():
            setattr(self, name, value)

    def observation_space(self, agent: str) -> gym.Space[Any]:
        return self._space

    def action_space(self, agent: str) -> gym.Space[Any]:
        return self._space

    def reset(self, seed: int | None = None, options: Any = None) -> Any:
        return {}, {}

    def step(self, actions: Any) -> Any:
        return {}, {}, {}, {}, {}


class AEC:
    """PettingZoo's AEC shape: one agent at a time."""

    possible_agents = ("a",)
    agent_selection = "a"

    def last(self) -> Any:
        return None

    def reset(self, seed: int | None = None, options: Any = None) -> None: ...

    def step(self, action: Any) -> None: ...

    def observation_space(self, agent: str) -> gym.Space[Any]:
        return gym.spaces.Discrete(2)

    def action_space(self, agent: str) -> gym.Space[Any]:
        return gym.spaces.Discrete(2)


class HalfAsync(Duck):
    async def reset(self, seed: int | None = None, options: Any = None) -> Any:  # type: ignore[override]
        return {}, {}


def _raises(agent: str) -> gym.Space[Any]:
    raise LookupError(f"no space for {agent}")


BAD_ENVS: dict[str, tuple[Callable[[], object], list[str]]] = {
    "single-agent": (lambda: gym.make("CartPole-v1"), ["single-agent", "CartPole"]),
    "single-agent async": (lambda: SingleAgentAsync(), ["single-agent", "SingleAgentAsync"]),
    "aec": (lambda: AEC(), ["AEC", "aec_to_parallel"]),
    "half async": (lambda: HalfAsync(), ["reset is a coroutine", "step is not", "HalfAsync"]),
    "no step": (lambda: Duck(step=None), ["no step", "Duck"]),
    "no possible_agents": (lambda: _without_agents(), ["no possible_agents"]),
    "agents a string": (lambda: Duck(possible_agents="ab"), ["list of agent ids", "str"]),
    "no agents": (lambda: Duck(possible_agents=[]), ["at least one agent"]),
    "twice": (lambda: Duck(possible_agents=["a", "a"]), ["'a' more than once"]),
    "unhashable": (lambda: Duck(possible_agents=[["a"]]), ["hashable", "list"]),
    "space not a space": (
        lambda: Duck(observation_space=lambda agent: (0, 1)),
        ["observation_space('a') must return a gymnasium.spaces.Space", "tuple"],
    ),
    "space raises": (
        lambda: Duck(action_space=_raises),
        ["action_space('a') raised LookupError", "no space for a"],
    ),
}


def _without_agents() -> Duck:
    duck = Duck()
    del duck.possible_agents
    return duck


@pytest.mark.parametrize("case", list(BAD_ENVS))
def test_a_bad_env_is_named_with_what_was_expected_and_given(case: str) -> None:
    make, words = BAD_ENVS[case]
    with pytest.raises(ParallelEnvError) as caught:
        check_parallel_env(make(), "my_env")
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, AsyncSampleError)
    text = str(caught.value)
    assert text.startswith("my_env: "), text
    for word in words:
        assert word in text, (word, text)


def test_the_older_spaces_dicts_are_read_too() -> None:
    space = gym.spaces.Discrete(3)
    duck = Duck(observation_space=None, observation_spaces={"a": space, "b": space})
    assert check_parallel_env(duck).observation_spaces == {"a": space, "b": space}


def test_a_factory_is_checked() -> None:
    env, spec = check_parallel_env_factory(RosterEnv, "env_fn")
    assert isinstance(env, RosterEnv) and spec.possible_agents[0] == "scout_0"


def _broken_factory() -> Any:
    raise OSError("no simulator")


async def _async_factory() -> Any:
    return RosterEnv()


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        (3, ["env_fn: expected a zero-argument callable", "got int"]),
        (RosterEnv(), ["got RosterEnv", "that is an env, not its factory"]),
        (_broken_factory, ["env_fn: the env factory _broken_factory raised OSError: no sim"]),
        (_async_factory, ["returned an awaitable", "plain function"]),
        (lambda: gym.make("CartPole-v1"), ["env_fn(): expected", "single-agent"]),
    ],
    ids=["not callable", "an env", "raises", "async factory", "single-agent"],
)
def test_a_bad_factory_is_named(factory: Any, words: list[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine was never awaited"
        with pytest.raises(ParallelEnvError) as caught:
            check_parallel_env_factory(factory, "env_fn")
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))
    if factory is _broken_factory:
        assert isinstance(caught.value.__cause__, OSError)


# --- AsyncParallelAdapter -------------------------------------------------------------------


def _actions(spec: Any, seed: int) -> RandomActions:
    return RandomActions(spec, seed)


def _turn(spec: Any, live: list[Any], obs: dict[Any, Any], infos: dict[Any, Any]) -> Turn:
    """The turn of the ``live`` agents, from the env's last observations and infos."""
    return Turn(
        spec=spec,
        episode=0,
        env_step=0,
        observations={a: obs[a] for a in live},
        action_masks={a: action_mask_of(obs[a], infos.get(a)) for a in live},
    )


class ThreadRecordingRoster(RosterEnv):
    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()

    def step(self, actions: Any) -> Any:
        self.threads.add(threading.get_ident())
        return super().step(actions)


@pytest.mark.parametrize("executor", [False, True], ids=["inline", "executor"])
async def test_the_async_adapter_steps_as_the_env_does(executor: bool) -> None:
    plain, inner = RosterEnv(), ThreadRecordingRoster()
    pool = concurrent.futures.ThreadPoolExecutor(1) if executor else None
    adapter = AsyncParallelAdapter(inner, executor=pool)
    try:
        assert is_async_parallel_env(adapter)
        assert adapter.possible_agents == plain.possible_agents
        for agent in adapter.possible_agents:
            assert adapter.observation_space(agent) is inner.observation_space(agent)
            assert adapter.action_space(agent) is inner.action_space(agent)
        assert adapter.unwrapped is inner and adapter.metadata["name"] == "roster_v0"
        a_obs, a_infos = await adapter.reset(seed=3)
        p_obs, p_infos = plain.reset(seed=3)
        assert tree_equal(a_obs, p_obs) and tree_equal(a_infos, p_infos)
        choose = _actions(adapter.spec, 0)
        while adapter.agents:
            assert adapter.agents == plain.agents and adapter.num_agents == len(plain.agents)
            actions = choose(_turn(adapter.spec, adapter.agents, a_obs, a_infos))
            got = await adapter.step(actions)
            want = plain.step(actions)
            assert all(tree_equal(g, w) for g, w in zip(got, want, strict=True))
            a_obs, a_infos = got[0], got[4]
        on_loop_thread = inner.threads == {threading.get_ident()}
        assert on_loop_thread != executor
    finally:
        await adapter.close()
        await adapter.close()
        if pool is not None:
            pool.shutdown()
    assert inner.closed


def test_the_async_adapter_refuses_an_async_env() -> None:
    with pytest.raises(ParallelEnvError, match="already coroutines"):
        AsyncParallelAdapter(AsyncRosterEnv())


async def test_as_async_parallel_env_wraps_only_blocking_envs() -> None:
    twin = AsyncRosterEnv()
    assert as_async_parallel_env(twin) is twin
    wrapped = as_async_parallel_env(RosterEnv())
    assert isinstance(wrapped, AsyncParallelAdapter)
    with pytest.raises(ParallelEnvError, match=r"^env_fn: "):
        as_async_parallel_env(object(), name="env_fn")


# --- BlockingParallelAdapter ----------------------------------------------------------------


class LoopRecordingRoster(AsyncRosterEnv):
    def __init__(self) -> None:
        super().__init__()
        self.loops: set[type] = set()

    async def step(self, actions: Any) -> Any:
        self.loops.add(type(asyncio.get_running_loop()))
        return await super().step(actions)


@pytest.mark.parametrize("loop", list(LOOPS))
def test_the_blocking_adapter_steps_as_the_env_does(loop: str) -> None:
    plain, inner = RosterEnv(), LoopRecordingRoster()
    with BlockingParallelAdapter(inner, loop_factory=LOOPS[loop]) as adapter:
        assert not is_async_parallel_env(adapter) and is_parallel_env(adapter)
        b_obs, b_infos = adapter.reset(seed=5, options={"any": 1})
        p_obs, p_infos = plain.reset(seed=5)
        assert tree_equal(b_obs, p_obs) and tree_equal(b_infos, p_infos)
        choose = _actions(adapter.spec, 1)
        steps = 0
        while adapter.agents:
            actions = choose(_turn(adapter.spec, adapter.agents, b_obs, b_infos))
            got, want = adapter.step(actions), plain.step(actions)
            assert all(tree_equal(g, w) for g, w in zip(got, want, strict=True))
            b_obs, b_infos = got[0], got[4]
            steps += 1
        assert steps == 8
        assert adapter.observation_space("tank_0") is inner.observation_space("tank_0")
    assert inner.closed
    expected = uvloop.Loop if loop == "uvloop" else asyncio.new_event_loop().__class__
    assert inner.loops == {expected}
    adapter.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        adapter.reset()


async def test_the_blocking_adapter_refuses_a_running_loop() -> None:
    adapter = BlockingParallelAdapter(AsyncRosterEnv())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the coroutine it was given is closed, not leaked
        with pytest.raises(RuntimeError, match="await the async env"):
            adapter.reset(seed=0)


def test_the_blocking_adapter_refuses_a_blocking_env() -> None:
    with pytest.raises(ParallelEnvError, match="a blocking one"):
        BlockingParallelAdapter(RosterEnv())


@pytest.mark.parametrize("loop", list(LOOPS))
def test_both_adapters_round_trip_a_blocking_env(loop: str) -> None:
    inner = RosterEnv()
    face = BlockingParallelAdapter(AsyncParallelAdapter(inner), loop_factory=LOOPS[loop])
    try:
        obs, _ = face.reset(seed=0)
        assert set(obs) == {"scout_0", "scout_1", "tank_0"}
        assert face.unwrapped is inner
        assert isinstance(obs["tank_0"]["action_mask"], np.ndarray)
    finally:
        face.close()
    assert inner.closed
