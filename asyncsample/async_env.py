"""Envs whose ``reset``, ``step`` and ``close`` are coroutines (for ``backend="asyncio"``), in
gymnasium's ``Env`` shape: thousands of I/O-bound envs can wait at once in one event loop."""

from __future__ import annotations

import copy
import inspect
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Generic, SupportsFloat, TypeVar, cast

import gymnasium as gym
import numpy as np
from gymnasium.error import ResetNeeded
from gymnasium.utils import seeding

if TYPE_CHECKING:
    from gymnasium.envs.registration import EnvSpec as GymEnvSpec

__all__ = [
    "ActType",
    "AsyncEnv",
    "ObsType",
    "check_async_env",
    "check_blocking_env",
    "AsyncRecordEpisodeStatistics",
    "AsyncTimeLimit",
    "AsyncWrapper",
    "close_env",
    "is_async_env",
    "time_limit",
]

ObsType = TypeVar("ObsType")
ActType = TypeVar("ActType")

_SPACES = ("observation_space", "action_space")


class AsyncEnv(Generic[ObsType, ActType]):
    """gymnasium's ``Env`` with coroutine ``reset``, ``step`` and ``close``.

    Subclasses set the two spaces in ``__init__`` and implement ``step`` and ``reset``, which
    begins with ``await super().reset(seed=seed)`` to seed ``np_random`` as gymnasium does. The
    attributes (spaces, ``metadata``, ``spec``, ``render_mode``) mean what they do there.
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
        """Start a new episode: ``(observation, info)``; this base only seeds ``np_random`` (when
        ``seed`` is given, else the generator goes on), as gymnasium's does."""
        if seed is not None:
            self._np_random, self._np_random_seed = seeding.np_random(seed)
        return None  # type: ignore[return-value]  # gymnasium's base reset returns nothing too

    async def step(
        self, action: ActType
    ) -> tuple[ObsType, SupportsFloat, bool, bool, dict[str, Any]]:
        """Advance the episode by one action: ``(obs, reward, terminated, truncated, info)``."""
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
        self._np_random = value
        self._np_random_seed = -1

    @property
    def np_random_seed(self) -> int:
        """The seed ``np_random`` was made from (-1 for a generator set directly)."""
        if self._np_random_seed is None:
            self._np_random, self._np_random_seed = seeding.np_random()
        return self._np_random_seed

    def has_wrapper_attr(self, name: str) -> bool:
        """Whether this env, or an env it wraps, has the attribute ``name`` (gymnasium's)."""
        return hasattr(self, name)

    def get_wrapper_attr(self, name: str) -> Any:
        """The attribute ``name`` of the outermost env that has it (gymnasium's)."""
        return getattr(self, name)

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
    """Whether ``obj`` is an :class:`AsyncEnv`, or has coroutine ``reset`` and ``step`` and the
    two spaces (duck typing, as the sampler accepts it)."""
    return isinstance(obj, AsyncEnv) or (
        _is_coroutine_method(obj, "reset")
        and _is_coroutine_method(obj, "step")
        and all(hasattr(obj, space) for space in _SPACES)
    )


def check_async_env(
    obj: object,
    name: str,
    *,
    needed_by: str = "backend='asyncio'",
    advice: str = "use backend='thread' (or 'process') for it",
) -> None:
    """Raise a ``TypeError`` naming ``name`` and ``needed_by`` if ``obj`` is not an async env
    (with ``advice`` for a blocking one) or lacks a gymnasium space."""
    kind = type(obj).__name__
    if not (_is_coroutine_method(obj, "reset") and _is_coroutine_method(obj, "step")):
        if isinstance(obj, gym.Env) or (
            callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None))
        ):
            what = "a blocking gymnasium.Env" if isinstance(obj, gym.Env) else "a blocking env"
            blocking = [m for m in ("reset", "step") if not _is_coroutine_method(obj, m)]
            raise TypeError(
                f"{name}: {needed_by} needs envs whose reset/step are coroutines (an "
                f"asyncsample.AsyncEnv); got {kind}, {what} ({' and '.join(blocking)} not "
                f"async def): {advice}"
            )
        raise TypeError(
            f"{name}: {needed_by} needs an env (an asyncsample.AsyncEnv, or an object with "
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


def check_blocking_env(obj: object, name: str, backend: str | None = None) -> None:
    """Refuse (``TypeError``) an async env on a backend that does not await ``reset``/``step``."""
    if is_async_env(obj):
        which = "this backend" if backend is None else f"backend={backend!r}"
        raise TypeError(
            f"{name}: {which} steps blocking gymnasium envs; got {type(obj).__name__}, "
            "an async env (coroutine reset/step): sample it with "
            "asyncsample.Sampler(..., backend='asyncio'), which awaits its reset and step "
            "(the vector-env faces, asyncsample.VectorEnv and the SB3 face, take blocking "
            "envs only)"
        )


async def close_env(env: object) -> None:
    """Close an env whose ``close`` is a coroutine, a plain function, or absent."""
    close = getattr(env, "close", None)
    if close is None:
        return
    result = close()
    if inspect.isawaitable(result):
        await result


def _own_or_wrapped(name: str, default: Any = None) -> Any:
    """A wrapper's property ``name``: the value set on the wrapper, else the wrapped env's."""
    own = "_own_" + name

    def get(self: AsyncWrapper[Any, Any]) -> Any:
        value = self.__dict__.get(own)
        return getattr(self.env, name, default) if value is None else value

    def set_(self: AsyncWrapper[Any, Any], value: Any) -> None:
        self.__dict__[own] = value

    return property(get, set_, doc=f"The wrapped env's {name}, unless this wrapper sets its own.")


class AsyncWrapper(AsyncEnv[ObsType, ActType]):
    """gymnasium's ``Wrapper`` for async envs: forwards what a subclass does not override.

    Raises:
        TypeError: ``env`` is not an async env (:func:`is_async_env`).
    """

    def __init__(self, env: AsyncEnv[ObsType, ActType]) -> None:
        check_async_env(
            env, "env", needed_by=type(self).__name__, advice="use gymnasium's wrappers for it"
        )
        self.env = env

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[ObsType, dict[str, Any]]:
        """Reset the wrapped env."""
        return await self.env.reset(seed=seed, options=options)

    async def step(
        self, action: ActType
    ) -> tuple[ObsType, SupportsFloat, bool, bool, dict[str, Any]]:
        """Step the wrapped env."""
        return await self.env.step(action)

    async def close(self) -> None:
        """Close the wrapped env."""
        await close_env(self.env)

    # Annotated with what an instance reads (the factory returns a property).
    observation_space: gym.Space[ObsType] = _own_or_wrapped("observation_space")
    action_space: gym.Space[ActType] = _own_or_wrapped("action_space")
    metadata: dict[str, Any] = _own_or_wrapped("metadata", {})

    @property
    def spec(self) -> GymEnvSpec | None:  # type: ignore[override]
        """The wrapped env's spec."""
        return getattr(self.env, "spec", None)

    @property
    def render_mode(self) -> str | None:  # type: ignore[override]
        """The wrapped env's render mode."""
        return getattr(self.env, "render_mode", None)

    @property
    def np_random(self) -> np.random.Generator:
        """The wrapped env's generator (setting it sets the wrapped env's)."""
        return self.env.np_random

    @np_random.setter
    def np_random(self, value: np.random.Generator) -> None:
        self.env.np_random = value

    @property
    def np_random_seed(self) -> int:
        """The wrapped env's seed."""
        return self.env.np_random_seed

    @property
    def unwrapped(self) -> AsyncEnv[Any, Any]:
        """The innermost env."""
        return cast("AsyncEnv[Any, Any]", getattr(self.env, "unwrapped", self.env))

    @property
    def max_episode_steps(self) -> int | None:
        """The tightest :class:`AsyncTimeLimit` in this stack (``None``: none)."""
        return time_limit(self)

    def has_wrapper_attr(self, name: str) -> bool:
        """Whether this wrapper or an env below it has the attribute ``name``."""
        if hasattr(self, name):
            return True
        below = getattr(self.env, "has_wrapper_attr", None)
        return bool(below(name)) if below is not None else hasattr(self.env, name)

    def get_wrapper_attr(self, name: str) -> Any:
        """The attribute ``name`` of the outermost layer that has it (``AttributeError``: none)."""
        if hasattr(self, name):
            return getattr(self, name)
        below = getattr(self.env, "get_wrapper_attr", None)
        if below is not None:
            return below(name)
        try:
            return getattr(self.env, name)
        except AttributeError:
            raise AttributeError(
                f"{self} and the envs it wraps have no attribute {name!r}"
            ) from None

    def __str__(self) -> str:
        return f"<{type(self).__name__}{self.env}>"

    def __repr__(self) -> str:
        return str(self)


class AsyncTimeLimit(AsyncWrapper[ObsType, ActType]):
    """Truncates episodes after ``max_episode_steps`` steps (gymnasium's ``TimeLimit``).

    Raises:
        TypeError: ``max_episode_steps`` is not an int.
        ValueError: ``max_episode_steps`` is below 1.
    """

    def __init__(self, env: AsyncEnv[ObsType, ActType], max_episode_steps: int) -> None:
        limit = max_episode_steps
        if not isinstance(limit, (int, np.integer)) or isinstance(limit, bool):
            raise TypeError(f"max_episode_steps: expected an int >= 1, got {type(limit).__name__}")
        if limit < 1:
            raise ValueError(f"max_episode_steps: expected an int >= 1, got {limit}")
        super().__init__(env)
        self._max_episode_steps = int(limit)
        self._elapsed_steps: int | None = None

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[ObsType, dict[str, Any]]:
        """Reset the env and the step count."""
        self._elapsed_steps = 0
        return await self.env.reset(seed=seed, options=options)

    async def step(
        self, action: ActType
    ) -> tuple[ObsType, SupportsFloat, bool, bool, dict[str, Any]]:
        """Step the env, truncating at the limit (``ResetNeeded`` before the first ``reset``)."""
        if self._elapsed_steps is None:
            raise ResetNeeded("AsyncTimeLimit: call reset() before step()")
        obs, reward, terminated, truncated, info = await self.env.step(action)
        self._elapsed_steps += 1
        if self._elapsed_steps >= self._max_episode_steps:
            truncated = True
        return obs, reward, terminated, truncated, info

    @property
    def spec(self) -> GymEnvSpec | None:  # type: ignore[override]
        """The wrapped env's spec with this limit as ``max_episode_steps`` (``None`` if none)."""
        spec: GymEnvSpec | None = getattr(self.env, "spec", None)
        if spec is None:
            return None
        spec = copy.deepcopy(spec)
        spec.max_episode_steps = self._max_episode_steps
        return spec


class AsyncRecordEpisodeStatistics(AsyncWrapper[ObsType, ActType]):
    """Adds ``{"r": return, "l": length, "t": seconds}`` as ``info[stats_key]`` on an episode's
    last step (gymnasium's ``RecordEpisodeStatistics``); the last ``buffer_length`` episodes'
    figures stay in ``return_queue``, ``length_queue`` and ``time_queue``."""

    def __init__(
        self,
        env: AsyncEnv[ObsType, ActType],
        buffer_length: int = 100,
        stats_key: str = "episode",
    ) -> None:
        super().__init__(env)
        self._stats_key = stats_key
        self.episode_count = 0
        self.episode_start_time = -1.0
        self.episode_returns = 0.0
        self.episode_lengths = 0
        self.time_queue: deque[float] = deque(maxlen=buffer_length)
        self.return_queue: deque[float] = deque(maxlen=buffer_length)
        self.length_queue: deque[int] = deque(maxlen=buffer_length)

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[ObsType, dict[str, Any]]:
        """Reset the env and start counting a new episode."""
        obs, info = await self.env.reset(seed=seed, options=options)
        self.episode_start_time = time.perf_counter()
        self.episode_returns = 0.0
        self.episode_lengths = 0
        return obs, info

    async def step(
        self, action: ActType
    ) -> tuple[ObsType, SupportsFloat, bool, bool, dict[str, Any]]:
        """Step the env and count (``ValueError`` if the env's own info has ``stats_key``)."""
        obs, reward, terminated, truncated, info = await self.env.step(action)
        self.episode_returns += float(reward)
        self.episode_lengths += 1
        if terminated or truncated:
            if self._stats_key in info:
                raise ValueError(
                    f"AsyncRecordEpisodeStatistics: the env's info already has the key "
                    f"{self._stats_key!r}; pass another stats_key"
                )
            seconds = round(time.perf_counter() - self.episode_start_time, 6)
            info[self._stats_key] = {
                "r": self.episode_returns,
                "l": self.episode_lengths,
                "t": seconds,
            }
            self.time_queue.append(seconds)
            self.return_queue.append(self.episode_returns)
            self.length_queue.append(self.episode_lengths)
            self.episode_count += 1
            self.episode_start_time = time.perf_counter()
        return obs, reward, terminated, truncated, info


def time_limit(env: object) -> int | None:
    """The tightest ``TimeLimit`` or :class:`AsyncTimeLimit` in ``env``'s wrapper stack (``None``:
    none); not the outermost, since the smallest limit truncates first wherever it stands."""
    limits = []
    while isinstance(env, gym.Wrapper | AsyncWrapper):
        if isinstance(env, gym.wrappers.TimeLimit | AsyncTimeLimit):
            limits.append(int(env._max_episode_steps))
        env = env.env
    return min(limits, default=None)
