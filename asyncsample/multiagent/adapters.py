"""Adapters between PettingZoo's ``ParallelEnv`` and its async twin, both ways.

* :class:`AsyncParallelAdapter` makes a blocking ``ParallelEnv`` the async twin, so one code
  path (the reference loop, and later the sampler's hosts) awaits every multi-agent env.
* :class:`BlockingParallelAdapter` makes an async twin a blocking ``ParallelEnv`` that runs its
  coroutines on an event loop of its own: the shape PettingZoo's own checks
  (``pettingzoo.test.parallel_api_test``) and synchronous code expect.

Spaces pass through as the same objects (PettingZoo requires ``observation_space(agent)`` to
return the same object at every call, so that seeding an action space sticks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import gymnasium as gym

from asyncsample.async_env import close_env
from asyncsample.errors import ParallelEnvError
from asyncsample.multiagent.checks import ParallelEnvSpec, check_parallel_env
from asyncsample.multiagent.protocols import AgentID, JointReset, JointStep

__all__ = ["AsyncParallelAdapter", "BlockingParallelAdapter", "as_async_parallel_env"]

_T = TypeVar("_T")


class _Facade:
    """The members both adapters read through from the env they wrap."""

    env: Any

    @property
    def possible_agents(self) -> list[AgentID]:
        """The wrapped env's ``possible_agents``."""
        return list(self.env.possible_agents)

    @property
    def agents(self) -> list[AgentID]:
        """The wrapped env's live agents (``env.agents``)."""
        return list(self.env.agents)

    @property
    def num_agents(self) -> int:
        """How many agents are live."""
        return len(self.env.agents)

    @property
    def max_num_agents(self) -> int:
        """How many agents the env can have."""
        return len(self.env.possible_agents)

    @property
    def metadata(self) -> dict[str, Any]:
        """The wrapped env's ``metadata`` (an empty dict when it has none)."""
        return dict(getattr(self.env, "metadata", {}))

    @property
    def render_mode(self) -> str | None:
        """The wrapped env's ``render_mode``, if any."""
        return getattr(self.env, "render_mode", None)

    @property
    def unwrapped(self) -> Any:
        """The innermost env (the wrapped env's own ``unwrapped``, else the wrapped env)."""
        return getattr(self.env, "unwrapped", self.env)

    @property
    def state_space(self) -> gym.Space[Any]:
        """The wrapped env's ``state_space`` (an AttributeError where it has none)."""
        return self.env.state_space  # type: ignore[no-any-return]

    def observation_space(self, agent: AgentID) -> gym.Space[Any]:
        """The wrapped env's observation space of ``agent`` (the same object)."""
        return self.env.observation_space(agent)  # type: ignore[no-any-return]

    def action_space(self, agent: AgentID) -> gym.Space[Any]:
        """The wrapped env's action space of ``agent`` (the same object)."""
        return self.env.action_space(agent)  # type: ignore[no-any-return]

    def __str__(self) -> str:
        return f"<{type(self).__name__}{self.env}>"


class AsyncParallelAdapter(_Facade):
    """A blocking PettingZoo ``ParallelEnv`` as the async twin (coroutine ``reset``/``step``).

    By default each call runs the env's method in the calling thread, which the event loop
    waits on: right for cheap envs. With ``executor``, it runs there instead (a thread pool, for
    an env whose step blocks on I/O or releases the GIL), and the loop stays free.

    Args:
        env: the ParallelEnv to wrap.
        executor: where the env's ``reset``/``step``/``close`` run; ``None`` runs them inline.

    Attributes:
        env: the wrapped env.
        spec: its :class:`~asyncsample.multiagent.ParallelEnvSpec`.

    Raises:
        ParallelEnvError: ``env`` is not a blocking ParallelEnv (an async twin needs no
            adapter; anything else fails :func:`~asyncsample.multiagent.check_parallel_env`).
    """

    def __init__(self, env: Any, *, executor: concurrent.futures.Executor | None = None) -> None:
        spec = check_parallel_env(env, "env")
        if spec.is_async:
            raise ParallelEnvError(
                f"env: expected a blocking ParallelEnv to adapt; got {type(env).__name__}, "
                "whose reset/step are already coroutines: use it as it is"
            )
        self.env = env
        self.spec: ParallelEnvSpec = spec
        self._executor = executor
        self._closed = False

    async def _call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        if self._executor is None:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> JointReset:
        """``env.reset(seed=seed, options=options)``."""
        return await self._call(self.env.reset, seed=seed, options=options)

    async def step(self, actions: Mapping[AgentID, Any]) -> JointStep:
        """``env.step(actions)``."""
        return await self._call(self.env.step, actions)

    async def close(self) -> None:
        """Close the wrapped env (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        close = getattr(self.env, "close", None)
        if callable(close):
            await self._call(close)

    def render(self) -> Any:
        """The wrapped env's ``render()`` (blocking: rendering is not a step)."""
        return self.env.render()

    def state(self) -> Any:
        """The wrapped env's global ``state()``, where it has one."""
        return self.env.state()


class BlockingParallelAdapter(_Facade):
    """An async ParallelEnv twin as a blocking PettingZoo ``ParallelEnv``.

    Its calls run the twin's coroutines to completion on an event loop of its own (made by
    ``loop_factory`` at the first call, closed by :meth:`close`), so it cannot be used from a
    thread whose event loop is running (a ``RuntimeError`` says so): there, await the twin
    itself.

    Args:
        env: the async twin to wrap.
        loop_factory: makes the adapter's event loop (``uvloop.new_event_loop``, say); ``None``
            gives asyncio's default loop.

    Attributes:
        env: the wrapped env.
        spec: its :class:`~asyncsample.multiagent.ParallelEnvSpec`.

    Raises:
        ParallelEnvError: ``env`` is not an async twin (a blocking ParallelEnv needs no
            adapter; anything else fails :func:`~asyncsample.multiagent.check_parallel_env`).
    """

    def __init__(
        self,
        env: Any,
        *,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    ) -> None:
        spec = check_parallel_env(env, "env")
        if not spec.is_async:
            raise ParallelEnvError(
                f"env: expected an async ParallelEnv (async def reset/step) to adapt; got "
                f"{type(env).__name__}, a blocking one: use it as it is"
            )
        self.env = env
        self.spec: ParallelEnvSpec = spec
        self._loop_factory = loop_factory
        self._runner: asyncio.Runner | None = None
        self._closed = False

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if self._closed:
            coro.close()
            raise RuntimeError(f"{type(self).__name__}: the env is closed")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise RuntimeError(
                f"{type(self).__name__} cannot be called from a running event loop (it runs "
                "one of its own): await the async env it wraps instead"
            )
        if self._runner is None:
            self._runner = asyncio.Runner(loop_factory=self._loop_factory)
        return self._runner.run(coro)

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> JointReset:
        """Run ``env.reset(seed=seed, options=options)`` to completion."""
        result: JointReset = self._run(self.env.reset(seed=seed, options=options))
        return result

    def step(self, actions: Mapping[AgentID, Any]) -> JointStep:
        """Run ``env.step(actions)`` to completion."""
        result: JointStep = self._run(self.env.step(actions))
        return result

    def close(self) -> None:
        """Close the wrapped env and the adapter's event loop (once; later calls do nothing)."""
        if self._closed:
            return
        try:
            self._run(close_env(self.env))
        finally:
            self._closed = True
            if self._runner is not None:
                self._runner.close()
                self._runner = None

    def render(self) -> Any:
        """The wrapped env's ``render()``, awaited when it is a coroutine function."""
        result = self.env.render()
        return self._run(result) if asyncio.iscoroutine(result) else result

    def state(self) -> Any:
        """The wrapped env's global ``state()``, awaited when it is a coroutine function."""
        result = self.env.state()
        return self._run(result) if asyncio.iscoroutine(result) else result

    def __enter__(self) -> BlockingParallelAdapter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def as_async_parallel_env(env: Any, *, name: str = "env") -> Any:
    """``env`` itself if it is the async twin, else ``env`` in an :class:`AsyncParallelAdapter`.

    Args:
        env: a ParallelEnv or its async twin.
        name: the argument's name, for the messages.

    Raises:
        ParallelEnvError: ``env`` is neither (see
            :func:`~asyncsample.multiagent.check_parallel_env`).
    """
    if check_parallel_env(env, name).is_async:
        return env
    return AsyncParallelAdapter(env)
