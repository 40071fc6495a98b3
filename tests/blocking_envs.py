"""Envs that block the thread they run in, for the tests of the watchdogs (``test_watchdog.py``).

Each env counts ``[t, u]`` (the step in its episode, a draw from its ``np_random``) for
``length`` steps. The first env (of any process) that reaches step ``at`` of its life and claims
the flag file ``flag`` blocks its thread there with ``time.sleep(seconds)`` (:data:`BLOCK_LINE`
is that line); every other step is healthy. ``hold``: from step ``at`` on, each step takes
``seconds`` instead (an async env awaits them, without blocking; a blocking env sleeps):
episodes held open.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import gymnasium as gym
import numpy as np

from asyncsample.async_env import AsyncEnv

SPACE = gym.spaces.Box(0.0, np.inf, (2,), np.float32)
ACTIONS = gym.spaces.Discrete(2)


def claim(flag: str) -> bool:
    """Whether this caller is the first to claim ``flag`` (a file; any process sees it)."""
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def block(seconds: float) -> None:
    """Block the calling thread (an env's synchronous call that takes too long)."""
    time.sleep(seconds)


#: The line of :func:`block` the watchdogs must name.
BLOCK_LINE = block.__code__.co_firstlineno + 2


class _Script:
    """What both envs share: the step counts and when a step blocks or holds (see the module)."""

    def __init__(
        self, flag: str, at: int = 3, seconds: float = 60.0, length: int = 5, hold: bool = False
    ) -> None:
        self.flag, self.at, self.seconds, self.length, self.hold = flag, at, seconds, length, hold
        self.t = 0
        self.steps = 0
        self.np_random: np.random.Generator

    def due(self) -> str | None:
        """Count a step; ``"hold"``, ``"block"`` or ``None`` (a healthy step)."""
        self.steps += 1
        if self.steps >= self.at and self.hold:
            return "hold"
        if self.steps == self.at and claim(self.flag):
            return "block"
        return None

    def first(self) -> tuple[np.ndarray, dict[str, Any]]:
        self.t = 0
        return self._obs(), {}

    def outcome(self) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        return self._obs(), 1.0, self.t >= self.length, False, {}

    def _obs(self) -> np.ndarray:
        return np.array([self.t, self.np_random.random()], dtype=np.float32)


class BlockingAsyncEnv(_Script, AsyncEnv[np.ndarray, Any]):
    """An async env whose step ``at`` (of its life) blocks its loop once (see the module)."""

    observation_space = SPACE
    action_space = ACTIONS

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        await super().reset(seed=seed)
        return self.first()

    async def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        due = self.due()
        await asyncio.sleep(0.001)
        if due == "hold":
            await asyncio.sleep(self.seconds)
        elif due == "block":
            block(self.seconds)
        return self.outcome()


class BlockingEnv(_Script, gym.Env[np.ndarray, Any]):
    """A blocking gymnasium env whose step ``at`` (of its life) blocks once (see the module)."""

    observation_space = SPACE
    action_space = ACTIONS

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return self.first()

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        due = self.due()
        if due is not None:  # a held episode sleeps as a block does
            block(self.seconds)
        return self.outcome()
