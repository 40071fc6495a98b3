"""Envs whose ``reset``, ``step`` and ``close`` are coroutines.

An I/O-bound env (a step that calls an HTTP service, a sandbox, a simulator behind a socket)
spends its step waiting. Written as a coroutine, thousands of such envs can wait at once in one
event loop, where a blocking env would need a thread or a process each. :class:`AsyncEnv` keeps
gymnasium's ``Env`` shape (spaces, ``metadata``, ``spec``, ``np_random``, the same return tuples),
so the only change for the env's author is ``async def`` and ``await``.

The sampler's ``backend="asyncio"`` accepts an :class:`AsyncEnv`, or any object that passes
:func:`is_async_env` (coroutine ``reset``/``step`` and the two spaces); :func:`check_async_env`
says clearly what is wrong with anything else.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Generic, SupportsFloat, TypeVar

import gymnasium as gym
import numpy as np
from gymnasium.utils import seeding

if TYPE_CHECKING:
    from gymnasium.envs.registration import EnvSpec as GymEnvSpec

__all__ = [
    "ActType",
    "AsyncEnv",
    "ObsType",
    "check_async_env",
    "check_blocking_env",
    "close_env",
    "is_async_env",
]

ObsType = TypeVar("ObsType")
ActType = TypeVar("ActType")

_SPACES = ("observation_space", "action_space")


class AsyncEnv(Generic[ObsType, ActType]):
    """gymnasium's ``Env`` with coroutine ``reset``, ``step`` and ``close``.

    Subclasses set ``observation_space`` and ``action_space`` in ``__init__`` and implement
    ``step`` and ``reset``; ``reset`` should begin with ``await super().reset(seed=seed)`` so that
    ``np_random`` is seeded as gymnasium seeds it. Everything else means what it means on
    ``gymnasium.Env``: a ``seed`` is given to the first ``reset`` only, later resets continue the
    same generator, and an env's randomness should come from ``np_random`` so that a fixed seed
    gives the same episodes however the steps interleave with other envs'.

    Attributes:
        observation_space: the space of the observations ``reset`` and ``step`` return.
        action_space: the space of the actions ``step`` takes.
        metadata: free-form facts about the env (gymnasium's ``render_modes``, ``render_fps``).
        spec: gymnasium's ``EnvSpec`` if the env was made from a registered id, else ``None``.
        render_mode: the render mode the env was made with, if any.
    """

    observation_space: gym.Space[ObsType]
    action_space: gym.Space[ActType]
    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (gymnasium's shape)
    spec: GymEnvSpec | None = None
    render_mode: str | None = None

    _np_random: np.random.Generator | None = None
    _np_random_seed: int | None = None

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[ObsType, dict[str, Any]]:
        """Start a new episode and return its first observation and an info dict.

        This base implementation only seeds ``np_random`` (when ``seed`` is given), as
        ``gymnasium.Env.reset`` does; subclasses call it first, then build their observation.

        Args:
            seed: seeds ``np_random`` (and sets ``np_random_seed``); ``None`` keeps the generator.
            options: env-specific reset options.

        Returns:
            ``(observation, info)`` in a subclass; the base returns nothing useful.
        """
        if seed is not None:
            self._np_random, self._np_random_seed = seeding.np_random(seed)
        return None  # type: ignore[return-value]  # gymnasium's base reset returns nothing too

    async def step(
        self, action: ActType
    ) -> tuple[ObsType, SupportsFloat, bool, bool, dict[str, Any]]:
        """Advance the episode by one action.

        Args:
            action: an element of ``action_space``.

        Returns:
            ``(observation, reward, terminated, truncated, info)``, as gymnasium's ``step``.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement `async def step`")

    async def close(self) -> None:
        """Release what the env holds (connections, sessions). Idempotent; a no-op here."""

    @property
    def unwrapped(self) -> AsyncEnv[Any, Any]:
        """The innermost env, below every :class:`~asyncsample.AsyncWrapper`."""
        return self

    @property
    def np_random(self) -> np.random.Generator:
        """The env's random generator: seeded by ``reset(seed=...)``, else from OS entropy."""
        if self._np_random is None:
            self._np_random, self._np_random_seed = seeding.np_random()
        return self._np_random

    @np_random.setter
    def np_random(self, value: np.random.Generator) -> None:
        # A generator set by hand has no known seed: gymnasium reports -1 for it.
        self._np_random = value
        self._np_random_seed = -1

    @property
    def np_random_seed(self) -> int:
        """The seed ``np_random`` was made from (-1 for a generator set directly)."""
        if self._np_random_seed is None:
            self._np_random, self._np_random_seed = seeding.np_random()
        return self._np_random_seed

    async def __aenter__(self) -> AsyncEnv[ObsType, ActType]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __str__(self) -> str:
        if self.spec is None:
            return f"<{type(self).__name__} instance>"
        return f"<{type(self).__name__}<{self.spec.id}>>"


def _is_coroutine_method(obj: object, name: str) -> bool:
    return inspect.iscoroutinefunction(getattr(obj, name, None))


def is_async_env(obj: object) -> bool:
    """Whether ``obj`` can be stepped as an async env.

    True for an :class:`AsyncEnv`, and for any object whose ``reset`` and ``step`` are coroutine
    functions and that has ``observation_space`` and ``action_space`` (duck typing, as the
    sampler accepts it).
    """
    if isinstance(obj, AsyncEnv):
        return True
    return (
        _is_coroutine_method(obj, "reset")
        and _is_coroutine_method(obj, "step")
        and all(hasattr(obj, space) for space in _SPACES)
    )


def _describe(obj: object) -> str:
    return type(obj).__name__


def check_async_env(obj: object, name: str) -> None:
    """Refuse, before any work, what cannot be stepped as an async env.

    Args:
        obj: what an env factory returned.
        name: the argument it came from, for the message (``"env"``).

    Raises:
        TypeError: ``obj`` is a blocking env (with advice on the backend to use), lacks
            coroutine ``reset``/``step``, or lacks a gymnasium space.
    """
    kind = _describe(obj)
    if not (_is_coroutine_method(obj, "reset") and _is_coroutine_method(obj, "step")):
        if isinstance(obj, gym.Env) or (
            callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None))
        ):
            what = "a blocking gymnasium.Env" if isinstance(obj, gym.Env) else "a blocking env"
            blocking = [m for m in ("reset", "step") if not _is_coroutine_method(obj, m)]
            raise TypeError(
                f"{name}: backend='asyncio' needs envs whose reset/step are coroutines (an "
                f"asyncsample.AsyncEnv); got {kind}, {what} ({' and '.join(blocking)} not "
                "async def): use backend='thread' (or 'process') for it"
            )
        raise TypeError(
            f"{name}: backend='asyncio' needs an env (an asyncsample.AsyncEnv, or an object with "
            f"async def reset/step and observation_space/action_space); got {kind}"
        )
    for space in _SPACES:
        value = getattr(obj, space, None)
        if value is None:
            raise TypeError(
                f"{name}: an async env needs a gymnasium space as {space}; {kind} has none "
                "(set it in __init__)"
            )
        if not isinstance(value, gym.Space):
            raise TypeError(
                f"{name}: {kind}.{space} must be a gymnasium.spaces.Space; got "
                f"{type(value).__name__}"
            )


def check_blocking_env(obj: object, name: str, backend: str) -> None:
    """Refuse an async env on a backend that calls ``reset``/``step`` without awaiting them.

    Args:
        obj: what an env factory returned.
        name: the argument it came from, for the message.
        backend: the sampler's backend, for the message.

    Raises:
        TypeError: ``obj`` is an async env.
    """
    if is_async_env(obj):
        raise TypeError(
            f"{name}: backend={backend!r} steps blocking gymnasium envs; got {_describe(obj)}, "
            "an async env (coroutine reset/step): use backend='asyncio' for it"
        )


async def close_env(env: object) -> None:
    """Close an async env however it spells ``close``.

    :class:`AsyncEnv` has ``async def close``; a duck-typed env may have a plain ``close`` or
    none at all. Both are allowed, so the sampler closes through this.
    """
    close = getattr(env, "close", None)
    if close is None:
        return
    result = close()
    if inspect.isawaitable(result):
        await result
