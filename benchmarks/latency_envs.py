"""The latency envs of the ``async_envs`` study: a step that *waits*, blocking or awaited.

A latency drawn from the env's own seeded RNG (mean 50 ms, 1% of the steps 20x longer, +-20%
jitter on every step, so the envs do not march in step; or, with ``sigma``, a lognormal spread
of that mean instead of the jitter: the ``seam`` study's env), written twice on the same RNG stream:
:class:`SleepLatencyEnv` (``time.sleep``) and :class:`AsyncLatencyEnv` (``await asyncio.sleep``).
Box(4,) observations, Discrete(2) actions, episodes of 100 steps (truncated by the env itself).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from asyncsample import AsyncEnv

__all__ = [
    "EPISODE_LENGTH",
    "JITTER",
    "MEAN_LATENCY_S",
    "TAIL_FACTOR",
    "TAIL_PROBABILITY",
    "AsyncLatencyEnv",
    "LatencyModel",
    "SleepLatencyEnv",
    "make_env",
    "shared_count",
]

#: Default latency model and episode of the study (issue 23).
MEAN_LATENCY_S = 0.050
TAIL_PROBABILITY = 0.01
TAIL_FACTOR = 20.0
JITTER = 0.2
EPISODE_LENGTH = 100


@dataclass(frozen=True)
class LatencyModel:
    """A heavy-tailed step latency: most steps take ``base``, a few ``tail_factor`` x longer.

    A step's latency is ``base * (tail_factor if tail else 1) * uniform(1 - jitter, 1 + jitter)``
    with ``tail`` true with probability ``tail_probability``; ``base`` is chosen so that the
    mean is ``mean`` exactly. With ``sigma > 0`` the spread is lognormal instead of uniform:
    ``exp(sigma * z - sigma**2 / 2)`` with ``z`` standard normal (mean 1, so the mean stays
    ``mean``), a heavier tail of its own on top of the ``tail_factor`` steps.

    Attributes:
        mean: Mean latency in seconds (0: no wait at all).
        tail_probability: Share of the steps in the tail.
        tail_factor: How much longer a tail step is than an ordinary one.
        jitter: Relative spread of every step (uniform), so envs drift apart as real ones do.
        sigma: Lognormal spread of every step (the log's standard deviation); 0: the uniform
            ``jitter`` instead.
    """

    mean: float = MEAN_LATENCY_S
    tail_probability: float = TAIL_PROBABILITY
    tail_factor: float = TAIL_FACTOR
    jitter: float = JITTER
    sigma: float = 0.0

    @property
    def base(self) -> float:
        """The latency of an ordinary (not tail) step, before its jitter."""
        return self.mean / (1.0 - self.tail_probability + self.tail_probability * self.tail_factor)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` latencies (seconds) from ``rng``; zeros when the mean is zero."""
        if self.mean <= 0:
            return np.zeros(n)
        u = rng.random((2, n))
        scale = np.where(u[0] < self.tail_probability, self.tail_factor, 1.0)
        if self.sigma > 0:
            spread = np.exp(self.sigma * rng.standard_normal(n) - self.sigma**2 / 2)
            return self.base * scale * spread
        return self.base * scale * (1.0 - self.jitter + 2.0 * self.jitter * u[1])


_COUNT_LOCK = threading.Lock()

#: Steps taken by every latency env of this process, in a list: a class attribute rebound at
#: each step (``_LatencyCore.steps_taken += 1``) invalidated the env class's attribute cache,
#: so every lookup on an env walked its classes' dicts again, which nearly doubled a step
#: of zero latency (1,379 against 741 ns, measured alone on 2026-12-02), in every contender.
_STEPS_TAKEN = [0]

_SHARED: dict[str, np.ndarray] = {}
"""Per counter directory, this process's shared step counter (see :func:`shared_count`)."""


def _shared_counter(directory: str) -> np.ndarray:
    """This process's step counter in ``directory``: one int64 in a file named by its pid, so
    envs in other processes (env hosts, Ray actors) count where the caller can read them."""
    counter = _SHARED.get(directory)
    if counter is None:
        path = os.path.join(directory, str(os.getpid()))
        mapped = np.memmap(path, dtype=np.int64, mode="w+", shape=(1,))
        # A plain ndarray view of the mapping (kept alive as its base): ``np.memmap`` indexes in
        # Python, a cost per step that the plain loops, which count in a local, do not pay.
        counter = _SHARED[directory] = mapped.view(np.ndarray)
    return counter


def shared_count(directory: str) -> int:
    """The steps counted in ``directory`` by every process's latency envs so far."""
    total = 0
    for name in os.listdir(directory):
        total += int(np.fromfile(os.path.join(directory, name), dtype=np.int64, count=1)[0])
    return total


class _LatencyCore:
    """What both latency envs share: spaces, the latency stream and the episode.

    Latencies are drawn from the env's ``np_random`` (seeded by its base class's ``reset``, as
    gymnasium seeds it) in blocks, one generator call per 256 steps rather than two per step;
    the two envs see the same latencies for the same seed.
    """

    np_random: np.random.Generator  # the base class's (gymnasium.Env or AsyncEnv)

    _BLOCK = 256

    @staticmethod
    def count() -> int:
        """Steps taken so far by the latency envs of this process (what the timed phases
        count)."""
        return _STEPS_TAKEN[0]

    def __init__(
        self,
        latency: LatencyModel | None = None,
        episode_length: int = EPISODE_LENGTH,
        counter_dir: str | None = None,
    ) -> None:
        latency = latency or LatencyModel()
        # Envs in other processes also count their steps in a shared file (shared_count).
        self._shared = None if counter_dir is None else _shared_counter(counter_dir)
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.latency = latency
        self.episode_length = episode_length
        self._block = np.zeros(0)
        self._next = 0
        self._t = 0

    def _begin(self, seed: int | None) -> tuple[np.ndarray, dict[str, Any]]:
        """Start an episode, after the base class's ``reset`` seeded ``np_random``."""
        if seed is not None:  # a new generator: latencies drawn from the old one are void
            self._block = np.zeros(0)
            self._next = 0
        self._t = 0
        return np.zeros(4, dtype=np.float32), {}

    def _wait(self) -> float:
        """The next step's latency (seconds)."""
        if self.latency.mean <= 0:
            return 0.0
        if self._next >= len(self._block):
            self._block = self.latency.draw(self.np_random, self._BLOCK)
            self._next = 0
        wait = float(self._block[self._next])
        self._next += 1
        return wait

    def _advance(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        obs = np.zeros(4, dtype=np.float32)
        obs[0] = self._t / self.episode_length
        obs[1] = float(action)
        return obs, 1.0, False, self._t >= self.episode_length, {}


class SleepLatencyEnv(_LatencyCore, gym.Env[np.ndarray, np.int64]):
    """The blocking env: its step sleeps (``time.sleep``) a latency of :class:`LatencyModel`.

    Args:
        latency: The latency model (default: mean 50 ms, 1% of steps 20x longer).
        episode_length: Steps per episode (the last one is truncated).
    """

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start an episode (instantly: only steps wait)."""
        super().reset(seed=seed)
        return self._begin(seed)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Wait the step's latency (blocking the thread), then advance the episode."""
        wait = self._wait()
        if wait > 0:
            time.sleep(wait)
        with _COUNT_LOCK:  # steps of threads: an unlocked += could lose a count
            _STEPS_TAKEN[0] += 1
        return self._advance(action)


class AsyncLatencyEnv(_LatencyCore, AsyncEnv[np.ndarray, np.int64]):
    """The async env: its step awaits ``asyncio.sleep`` of a latency of :class:`LatencyModel`.

    With a zero mean the step returns without awaiting anything (the asyncio path's own cost).

    Args:
        latency: The latency model (default: mean 50 ms, 1% of steps 20x longer).
        episode_length: Steps per episode (the last one is truncated).
    """

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start an episode (instantly: only steps wait)."""
        await super().reset(seed=seed)
        return self._begin(seed)

    async def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Await the step's latency, then advance the episode."""
        wait = self._wait()
        if wait > 0:
            await asyncio.sleep(wait)
        _STEPS_TAKEN[0] += 1
        if self._shared is not None:
            self._shared[0] += 1
        return self._advance(action)


def make_env(
    blocking: bool,
    mean: float = MEAN_LATENCY_S,
    tail_probability: float = TAIL_PROBABILITY,
    tail_factor: float = TAIL_FACTOR,
    jitter: float = JITTER,
    episode_length: int = EPISODE_LENGTH,
    counter_dir: str | None = None,
    sigma: float = 0.0,
) -> SleepLatencyEnv | AsyncLatencyEnv:
    """A :class:`SleepLatencyEnv` (``blocking``) or an :class:`AsyncLatencyEnv` (counting its
    steps in ``counter_dir`` too, if given: :func:`shared_count`).

    Module level, so ``functools.partial(make_env, ...)`` pickles by reference for subprocesses.
    """
    cls = SleepLatencyEnv if blocking else AsyncLatencyEnv
    return cls(
        LatencyModel(mean, tail_probability, tail_factor, jitter, sigma),
        episode_length,
        counter_dir,
    )
