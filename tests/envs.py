"""Small deterministic envs and agents for the tests (garage's fixtures, in our words)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import gymnasium as gym
import numpy as np

MAPS = {
    # S start, F floor, H hole (terminates, reward 0), G goal (terminates, reward 1)
    "4x4": ["SFFF", "FHFH", "FFFH", "HFFG"],
    "hole_first": ["SHFF", "FFFF", "FFFF", "FFFG"],  # action 2 falls in at once: 1-step episodes
    "no_goal": ["SFFF", "FFFF", "FFFF", "FFFF"],  # never terminates
}
# Actions: 0 left, 1 down, 2 right, 3 up.
MOVES = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}
# Reaches the goal of the 4x4 map in 6 steps: cells 0 1 2 6 10 14 -> 15.
SCRIPT = [2, 2, 1, 0, 3, 1, 1, 1, 2, 2, 1, 1, 1, 2, 2, 1]


def first_to_claim(flag: str) -> bool:
    """Create ``flag``; true for the one caller (in any process) that created it."""
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class GridWorldEnv(gym.Env):
    """A deterministic grid world; the observation is the cell index."""

    def __init__(self, desc: str = "4x4") -> None:
        self.desc = MAPS[desc]
        self.n_rows, self.n_cols = len(self.desc), len(self.desc[0])
        self.observation_space = gym.spaces.Discrete(self.n_rows * self.n_cols)
        self.action_space = gym.spaces.Discrete(4)
        self.state = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.state = 0
        return self.state, {}

    def step(self, action: Any):
        r, c = divmod(self.state, self.n_cols)
        dr, dc = MOVES[int(action)]
        r = min(max(r + dr, 0), self.n_rows - 1)
        c = min(max(c + dc, 0), self.n_cols - 1)
        self.state = r * self.n_cols + c
        cell = self.desc[r][c]
        return self.state, float(cell == "G"), cell in "HG", False, {}


class ScriptedAgent:
    """Acts ``script[observation]``: on the 4x4 map every episode is the same 6 steps."""

    def __init__(self, script: list[int] = SCRIPT) -> None:
        self.script = np.asarray(script)

    def get_actions(self, observations: np.ndarray):
        return self.script[np.asarray(observations)], {}


class ConstantAgent:
    """Always the same action; records it in an agent info."""

    def __init__(self, action: int) -> None:
        self.action = action

    def get_actions(self, observations: np.ndarray):
        n = len(observations)
        return np.full(n, self.action), {"action_copy": np.full(n, self.action)}


class AsyncScriptedAgent(ScriptedAgent):
    """The scripted agent behind an ``async def`` get_actions that yields to the loop."""

    async def get_actions(self, observations: np.ndarray):  # type: ignore[override]
        await asyncio.sleep(0)
        return super().get_actions(observations)


class ParamAgent(ScriptedAgent):
    """A scripted agent whose script is its parameter vector."""

    def get_param_values(self) -> np.ndarray:
        return self.script.copy()

    def set_param_values(self, params: Any) -> None:
        self.script = np.asarray(params)


class NoisyParamAgent(ParamAgent):
    """A ParamAgent that acts at random half of the time, from its own seeded generator."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = np.random.default_rng(seed)

    def get_actions(self, observations: np.ndarray):
        actions, infos = super().get_actions(observations)
        noise = self.rng.integers(0, 4, len(actions))
        return np.where(self.rng.random(len(actions)) < 0.5, noise, actions), infos

    def seed(self, seed: int) -> None:  # the hook inference="host" calls on its copies
        self.rng = np.random.default_rng(seed)


class LevelAgent:
    """Acts its one parameter, ``level``, whatever it observes (a ``Discrete(2)`` action)."""

    def __init__(self, level: int = 0) -> None:
        self.level = np.asarray(level)

    def get_actions(self, observations: Any):
        return np.full(len(observations), int(self.level)), {}

    def get_param_values(self) -> dict[str, np.ndarray]:
        return {"level": self.level.copy()}

    def set_param_values(self, params: dict[str, Any]) -> None:
        self.level = np.asarray(params["level"])


class PointEnv(gym.Env):
    """A point moving towards a goal; ``set_task`` changes the goal (garage's PointEnv)."""

    def __init__(self, goal: tuple[float, float] = (1.0, 1.0)) -> None:
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float64)
        self.action_space = gym.spaces.Box(-0.1, 0.1, (2,), np.float64)
        self.goal = np.asarray(goal, dtype=np.float64)
        self.point = np.zeros(2)

    def set_task(self, task: dict[str, Any]) -> None:
        self.goal = np.asarray(task["goal"], dtype=np.float64)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.point = np.zeros(2)
        return self.point.copy(), {"goal": self.goal.copy()}

    def step(self, action: Any):
        self.point = self.point + np.clip(action, -0.1, 0.1)
        dist = float(np.linalg.norm(self.point - self.goal))
        return self.point.copy(), -dist, dist < 0.1, False, {"task": {"goal": self.goal.copy()}}


class NoisyEnv(gym.Env):
    """Episodes whose length and rewards come from the env's own seeded ``np_random``."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = gym.spaces.Discrete(3)
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), {"start": self.t}

    def step(self, action: Any):
        self.t += 1
        obs = self.np_random.uniform(-1, 1, 3).astype(np.float32)
        done = bool(self.np_random.random() < 0.08)
        return obs, float(action) + float(obs[0]), done, False, {"t": self.t}


class DictObsEnv(gym.Env):
    """NoisyEnv with a dict observation ``{"pos": Box(3), "t": Discrete(1000)}``."""

    def __init__(self) -> None:
        self.inner = NoisyEnv()
        self.observation_space = gym.spaces.Dict(
            {"pos": self.inner.observation_space, "t": gym.spaces.Discrete(1000)}
        )
        self.action_space = self.inner.action_space

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        obs, info = self.inner.reset(seed=seed)
        return {"pos": obs, "t": 0}, info

    def step(self, action: Any) -> Any:
        obs, r, term, trunc, info = self.inner.step(action)
        return {"pos": obs, "t": min(self.inner.t, 999)}, r, term, trunc, info


class FailingEnv(NoisyEnv):
    """Raises once in ``step`` (or ``reset``) at its ``fail_at``-th call.

    ``flag`` is a file path: the first env to reach ``fail_at`` creates it and raises; envs that
    find it already there (rebuilt ones, in any process) carry on.
    """

    def __init__(self, flag: str, fail_at: int = 5, where: str = "step") -> None:
        super().__init__()
        self.flag = flag
        self.fail_at = fail_at
        self.where = where
        self.calls = 0

    def _tick(self, where: str) -> None:
        if where == self.where:
            self.calls += 1
            if self.calls == self.fail_at and first_to_claim(self.flag):
                raise RuntimeError(f"injected failure in {where}")

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self._tick("reset")
        return super().reset(seed=seed, options=options)

    def step(self, action: Any):
        self._tick("step")
        return super().step(action)


class AlwaysFailingEnv(NoisyEnv):
    """Raises in every ``step``."""

    def step(self, action: Any):
        raise ValueError("this env always fails")


class BadShapeEnv(NoisyEnv):
    """Returns observations of the wrong shape from ``step``."""

    def step(self, action: Any):
        _, r, term, trunc, info = super().step(action)
        return np.zeros(5, np.float32), r, term, trunc, info


class SleepyEnv(NoisyEnv):
    """Each step sleeps ``delay`` seconds (blocking, as a slow simulator would)."""

    def __init__(self, delay: float = 0.001) -> None:
        super().__init__()
        self.delay = delay

    def step(self, action: Any):
        time.sleep(self.delay)
        return super().step(action)


class KillSelfEnv(NoisyEnv):
    """SIGKILLs its own process at its ``kill_at``-th step (a segfault or the OOM killer).

    With a ``flag`` path it does so only once (the first env to get there creates the file).
    """

    def __init__(self, kill_at: int = 20, flag: str | None = None) -> None:
        super().__init__()
        self.kill_at = kill_at
        self.flag = flag
        self.steps = 0

    def step(self, action: Any):
        self.steps += 1
        if self.steps == self.kill_at and (self.flag is None or first_to_claim(self.flag)):
            os.kill(os.getpid(), 9)
        return super().step(action)


class HangingEnv(NoisyEnv):
    """Hangs (sleeps ``seconds``) in its ``hang_at``-th step; once if given a ``flag`` path.

    With a ``hanging`` path it creates that file as it starts to hang, so a test can wait until
    the env hangs instead of sleeping and hoping.
    """

    def __init__(
        self,
        hang_at: int = 10,
        seconds: float = 3600.0,
        flag: str | None = None,
        hanging: str | None = None,
    ) -> None:
        super().__init__()
        self.hang_at = hang_at
        self.seconds = seconds
        self.flag = flag
        self.hanging = hanging
        self.steps = 0

    def step(self, action: Any):
        self.steps += 1
        if self.steps == self.hang_at and (self.flag is None or first_to_claim(self.flag)):
            if self.hanging is not None:
                open(self.hanging, "a").close()
            time.sleep(self.seconds)
        return super().step(action)


class SignallingAgent:
    """Always action 0; sets ``event`` at its ``after``-th call (and every call after).

    A test awaits ``event`` to know a call is under way, instead of sleeping and hoping. Clear it
    to wait for the next call.
    """

    def __init__(self, after: int = 1) -> None:
        self.event = asyncio.Event()
        self.after = after
        self.calls = 0

    def get_actions(self, observations: np.ndarray):
        self.calls += 1
        if self.calls >= self.after:
            self.event.set()
        n = len(observations)
        return np.zeros(n, dtype=np.int64), {}
