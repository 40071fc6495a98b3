"""Small async envs for the tests of ``backend="asyncio"`` and of the async wrappers.

Every env draws its randomness from its own seeded ``np_random``, so a fixed seed gives the same
episodes however the steps of different envs interleave. Each async env has a blocking twin
(:class:`CountingEnv`, :class:`RandomLengthEnv`) built on the same logic, for ``backend="thread"``
and for comparing the async wrappers with gymnasium's.

Factories (:class:`EnvFactory`) record the envs they built, so a test can check rebuilds and
closes (``made`` includes the env the sampler builds to read the spaces, first); :func:`open_envs`
counts the test envs not closed yet.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from asyncsample.async_env import AsyncEnv

#: The test envs (async and blocking) built and not closed yet.
_OPEN: set[object] = set()

#: A latency: none, a fixed number of seconds, or a (low, high) range drawn from ``np_random``.
Latency = float | tuple[float, float] | None


def open_envs() -> int:
    """How many test envs are built and not closed."""
    return len(_OPEN)


class _Episode:
    """The logic every env here shares: a counter that ends at a length drawn per episode.

    The observation is ``[t, u]``: the step count and a uniform draw from the env's ``np_random``
    (so seeds show in the data). The reward is the action taken; an episode terminates after
    ``length`` steps, ``length`` drawn from ``np_random`` in ``[lo, hi]`` at each reset.
    """

    observation_space = gym.spaces.Box(0.0, np.inf, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, lo: int, hi: int, latency: Latency) -> None:
        if not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= lo <= hi, got {lo}, {hi}")
        self.lo, self.hi, self.latency = lo, hi, latency
        self.t = 0
        self.length = lo
        self.steps_taken = 0  # over the env's life, every episode

    def begin(self, rng: np.random.Generator) -> tuple[np.ndarray, dict[str, Any]]:
        self.t = 0
        self.length = int(rng.integers(self.lo, self.hi + 1))
        return self._obs(rng), {"length": self.length}

    def advance(
        self, rng: np.random.Generator, action: Any
    ) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        self.steps_taken += 1
        return self._obs(rng), float(action), self.t >= self.length, False, {"t": self.t}

    def delay(self, rng: np.random.Generator) -> float:
        """Seconds this step waits (drawn before the step, from the same generator)."""
        if self.latency is None:
            return 0.0
        if isinstance(self.latency, tuple):
            return float(rng.uniform(*self.latency))
        return float(self.latency)

    def _obs(self, rng: np.random.Generator) -> np.ndarray:
        return np.array([self.t, rng.random()], dtype=np.float32)


class RandomLengthAsyncEnv(AsyncEnv[np.ndarray, Any]):
    """Episodes of ``lo`` to ``hi`` steps; each step awaits its latency (see :class:`_Episode`).

    A latency of 0 or ``None`` still yields to the loop once per step (``asyncio.sleep(0)``).
    """

    def __init__(self, lo: int = 1, hi: int = 20, latency: Latency = None) -> None:
        self.logic = _Episode(lo, hi, latency)
        self.observation_space = _Episode.observation_space
        self.action_space = _Episode.action_space
        self.closed = False
        _OPEN.add(self)

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        await super().reset(seed=seed)
        await asyncio.sleep(0)
        return self.logic.begin(self.np_random)

    async def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        await asyncio.sleep(self.logic.delay(self.np_random))
        return self.logic.advance(self.np_random, action)

    async def close(self) -> None:
        self.closed = True
        _OPEN.discard(self)


class CountingAsyncEnv(RandomLengthAsyncEnv):
    """Every episode is ``length`` steps; each step awaits ``latency`` seconds."""

    def __init__(self, length: int = 10, latency: float = 0.0) -> None:
        super().__init__(length, length, latency)


class Budget:
    """How many more times the envs sharing it may misbehave (``None``: without limit).

    Shared by the envs of one factory, and spent when an env actually misbehaves (not when it is
    built), so the env the sampler builds only to read the spaces does not use it up.
    """

    def __init__(self, times: int | None) -> None:
        self.left = times

    def take(self) -> bool:
        """Spend one misbehaviour; false when none is left."""
        if self.left is None:
            return True
        if self.left <= 0:
            return False
        self.left -= 1
        return True


class _Misbehaving(CountingAsyncEnv):
    """A counting env that misbehaves (:meth:`misbehave`) on its ``at``-th step (counted over
    its life, from 1), while ``budget`` allows (by default always)."""

    def __init__(self, at: int, length: int, latency: float, budget: Budget | None) -> None:
        super().__init__(length, latency)
        self.at = at
        self.budget = budget or Budget(None)

    async def misbehave(self) -> None:
        raise NotImplementedError

    async def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.logic.steps_taken + 1 == self.at and self.budget.take():
            self.logic.steps_taken += 1
            await self.misbehave()
        return await super().step(action)


class FailingAsyncEnv(_Misbehaving):
    """Raises ``RuntimeError`` on its ``fail_at``-th step (see :class:`_Misbehaving`)."""

    def __init__(
        self, fail_at: int = 3, length: int = 10, latency: float = 0.0, budget: Budget | None = None
    ) -> None:
        super().__init__(fail_at, length, latency, budget)
        self.fail_at = fail_at
        self.failed = False

    async def misbehave(self) -> None:
        self.failed = True
        await asyncio.sleep(0)
        raise RuntimeError(f"FailingAsyncEnv failed on its step {self.fail_at}")


class HangingAsyncEnv(_Misbehaving):
    """Awaits forever on its ``hang_at``-th step (see :class:`_Misbehaving`).

    The wait is cancellable; ``hung`` says the env reached it and ``cancelled`` that it was
    cancelled there.
    """

    def __init__(
        self, hang_at: int = 3, length: int = 10, latency: float = 0.0, budget: Budget | None = None
    ) -> None:
        super().__init__(hang_at, length, latency, budget)
        self.hang_at = hang_at
        self.hung = False
        self.cancelled = False

    async def misbehave(self) -> None:
        self.hung = True
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class DuckAsyncEnv:
    """Not an :class:`AsyncEnv`: coroutine ``reset``/``step``, the two spaces, a plain ``close``.

    Behaves as :class:`CountingAsyncEnv` (seeded by its first ``reset``).
    """

    def __init__(self, length: int = 10) -> None:
        self.logic = _Episode(length, length, None)
        self.observation_space = _Episode.observation_space
        self.action_space = _Episode.action_space
        self.rng = np.random.default_rng()
        self.closed = False
        _OPEN.add(self)

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        await asyncio.sleep(0)
        return self.logic.begin(self.rng)

    async def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        await asyncio.sleep(0)
        return self.logic.advance(self.rng, action)

    def close(self) -> None:
        self.closed = True
        _OPEN.discard(self)


class RandomLengthEnv(gym.Env[np.ndarray, Any]):
    """The blocking twin of :class:`RandomLengthAsyncEnv`: same seed, same episodes.

    A latency blocks in ``time.sleep`` (for ``backend="thread"``).
    """

    def __init__(self, lo: int = 1, hi: int = 20, latency: Latency = None) -> None:
        self.logic = _Episode(lo, hi, latency)
        self.observation_space = _Episode.observation_space
        self.action_space = _Episode.action_space
        self.closed = False
        _OPEN.add(self)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return self.logic.begin(self.np_random)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        delay = self.logic.delay(self.np_random)
        if delay > 0:
            time.sleep(delay)
        return self.logic.advance(self.np_random, action)

    def close(self) -> None:
        self.closed = True
        _OPEN.discard(self)


class CountingEnv(RandomLengthEnv):
    """The blocking twin of :class:`CountingAsyncEnv`."""

    def __init__(self, length: int = 10, latency: float = 0.0) -> None:
        super().__init__(length, length, latency)


class GatedAsyncEnv(CountingAsyncEnv):
    """A :class:`CountingAsyncEnv` whose steps wait until the file ``gate`` exists (any
    process sees it: the test opens the gate with :func:`helpers.touch`)."""

    def __init__(self, gate: str, length: int = 1000) -> None:
        super().__init__(length)
        self.gate = gate

    async def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        while not os.path.exists(self.gate):
            await asyncio.sleep(0.005)
        return await super().step(action)


class GatedEnv(CountingEnv):
    """The blocking twin of :class:`GatedAsyncEnv` (its step waits in its thread)."""

    def __init__(self, gate: str, length: int = 1000) -> None:
        super().__init__(length)
        self.gate = gate

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        while not os.path.exists(self.gate):
            time.sleep(0.005)
        return super().step(action)


class EnvFactory:
    """A zero-argument env factory that records what it built.

    Args:
        build: makes the env number ``i`` (0 for the first built by this factory).
    """

    def __init__(self, build: Callable[[int], Any]) -> None:
        self.build = build
        self.made: list[Any] = []

    def __call__(self) -> Any:
        env = self.build(len(self.made))
        self.made.append(env)
        return env

    def __getstate__(self) -> dict[str, Any]:
        # A copy sent to an env host records its own builds: the envs this one built (in the
        # caller, e.g. a placement probe on a busy machine) stay here, and may not pickle.
        return {"build": self.build, "made": []}


def counting(length: int = 10, latency: float = 0.0) -> EnvFactory:
    """Builds :class:`CountingAsyncEnv`."""
    return EnvFactory(lambda i: CountingAsyncEnv(length, latency))


def random_length(lo: int = 1, hi: int = 20, latency: Latency = None) -> EnvFactory:
    """Builds :class:`RandomLengthAsyncEnv`."""
    return EnvFactory(lambda i: RandomLengthAsyncEnv(lo, hi, latency))


def failing(
    fail_at: int = 3, times: int | None = 1, length: int = 10, latency: float = 0.0
) -> EnvFactory:
    """Builds :class:`FailingAsyncEnv`: the first ``times`` envs to reach their ``fail_at``-th
    step fail there (``None``: every env does); the others behave as :class:`CountingAsyncEnv`."""
    budget = Budget(times)
    return EnvFactory(lambda i: FailingAsyncEnv(fail_at, length, latency, budget))


def hanging(
    hang_at: int = 3, times: int | None = 1, length: int = 10, latency: float = 0.0
) -> EnvFactory:
    """Builds :class:`HangingAsyncEnv`: the first ``times`` envs to reach their ``hang_at``-th
    step hang there (``None``: every env does); the others behave as :class:`CountingAsyncEnv`."""
    budget = Budget(times)
    return EnvFactory(lambda i: HangingAsyncEnv(hang_at, length, latency, budget))


def duck(length: int = 10) -> EnvFactory:
    """Builds :class:`DuckAsyncEnv` (the duck-typed async env)."""
    return EnvFactory(lambda i: DuckAsyncEnv(length))


def blocking_counting(length: int = 10, latency: float = 0.0) -> EnvFactory:
    """Builds :class:`CountingEnv` (blocking; for ``backend="thread"``)."""
    return EnvFactory(lambda i: CountingEnv(length, latency))


#: What a :class:`FaultyAsyncEnv` or :class:`FaultyEnv` does on its misbehaving step.
FAULTS = ("raise", "cancel", "hang", "reward", "info")


def _misbehaving_result(kind: str, result: tuple[Any, ...]) -> tuple[Any, ...]:
    obs, reward, terminated, truncated, info = result
    if kind == "reward":
        return obs, [reward], terminated, truncated, info  # a list: not a number
    return obs, reward, terminated, truncated, [info]  # an info that is a list


class FaultyAsyncEnv(CountingAsyncEnv):
    """A counting env whose ``at``-th step (over its life) misbehaves as ``kind`` says
    (:data:`FAULTS`; ``None``: never), while ``budget`` allows: raise ``RuntimeError``, raise
    ``CancelledError`` itself, hang (cancellably), or return a malformed reward or info."""

    def __init__(
        self, kind: str | None, at: int = 3, length: int = 10, budget: Budget | None = None
    ) -> None:
        super().__init__(length)
        self.kind, self.at, self.budget = kind, at, budget or Budget(None)
        self.resets = 0
        self.misbehaved = False  # whether it did

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        self.resets += 1
        return await super().reset(seed=seed, options=options)

    async def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        kind = self.kind
        if kind and self.logic.steps_taken + 1 == self.at and self.budget.take():
            self.misbehaved = True
            if kind == "raise":
                raise RuntimeError("FaultyAsyncEnv raised")
            if kind == "cancel":
                raise asyncio.CancelledError("the env's own request was cancelled")
            if kind == "hang":
                await asyncio.Event().wait()
            if kind in ("reward", "info"):
                return _misbehaving_result(kind, await super().step(action))  # type: ignore[return-value]
        return await super().step(action)


class FaultyEnv(CountingEnv):
    """The blocking twin of :class:`FaultyAsyncEnv` (``"hang"`` blocks its thread ``hang``
    seconds; ``"cancel"`` raises ``asyncio.CancelledError`` from the thread)."""

    def __init__(
        self,
        kind: str | None,
        at: int = 3,
        length: int = 10,
        budget: Budget | None = None,
        hang: float = 1.0,
    ) -> None:
        super().__init__(length)
        self.kind, self.at, self.budget, self.hang = kind, at, budget or Budget(None), hang
        self.resets = 0
        self.misbehaved = False  # whether it did

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        self.resets += 1
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        kind = self.kind
        if kind and self.logic.steps_taken + 1 == self.at and self.budget.take():
            self.misbehaved = True
            if kind == "raise":
                raise RuntimeError("FaultyEnv raised")
            if kind == "cancel":
                raise asyncio.CancelledError("the env's own request was cancelled")
            if kind == "hang":
                time.sleep(self.hang)
            if kind in ("reward", "info"):
                return _misbehaving_result(kind, super().step(action))  # type: ignore[return-value]
        return super().step(action)


def faulty(
    backend: str, kind: str, slot: int, n_envs: int, times: int | None = 1, length: int = 10
) -> EnvFactory:
    """Envs for ``backend`` (``"thread"``: blocking, else async) where only the env of worker
    slot ``slot`` (of ``n_envs``, one worker) and its rebuilds misbehave, ``times`` times in
    all. The factory builds the probe first (index 0), then the worker's envs in order (in an
    env host, which builds no probe and each rebuild from a fresh copy of the factory: the env
    of slot ``slot + 1`` misbehaves once per host, its rebuilds do not)."""
    budget = Budget(times)
    cls: Any = FaultyEnv if backend == "thread" else FaultyAsyncEnv

    def build(j: int) -> Any:
        bad = j == 1 + slot or j > n_envs  # the slot's env, and every env built after
        return cls(kind if bad else None, 3, length, budget)

    return EnvFactory(build)
