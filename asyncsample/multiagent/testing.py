"""Multi-agent envs of the project's own, whose agents die and join at known steps.

:class:`RosterEnv` (a blocking PettingZoo-style ``ParallelEnv``) and :class:`AsyncRosterEnv`
(its async twin) follow a :class:`Schedule`: each agent joins at a known step and leaves,
terminated or truncated, at a known step, so a test knows which rows each agent must get. The
agents differ in spaces and in how they give action masks:

============ =========================================== ================= ====================
agent        observation                                 action            action mask
============ =========================================== ================= ====================
``scout_0``  ``Box(-10, 10, (3,), float32)``              ``Discrete(3)``   in its info
``scout_1``  ``Box(-10, 10, (3,), float32)``              ``Discrete(3)``   in its info
``tank_0``   ``Dict(observation=Box(2,), action_mask=)``  ``Discrete(4)``   in its observation
``medic_0``  ``Box(-1, 1, (5,), float64)``                ``Box(-1, 1, (2,))`` none
============ =========================================== ================= ====================

Observations come from the env's ``np_random`` (seeded by ``reset(seed=...)``) and the agents'
last actions, rewards from the actions (a masked-out action costs -1), so equal seeds and
actions give equal steps, and an action that does not reach the env shows. The env checks that
exactly the live agents act, each with an action of its space. PettingZoo is not needed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.utils import seeding

from asyncsample.multiagent.protocols import JointReset, JointStep

__all__ = ["DEFAULT_SCHEDULE", "AsyncRosterEnv", "RosterEnv", "Schedule"]

_AGENTS = ("scout_0", "scout_1", "tank_0", "medic_0")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When each agent joins and leaves an episode, by joint step (``step()`` calls, from 1).

    Attributes:
        joins: each agent's join step: 0 means it is live from ``reset``; ``j >= 1`` means it
            first appears in the observations of step ``j`` and acts from step ``j + 1``.
        leaves: each agent's last step and how it ends there (``"terminated"`` or
            ``"truncated"``); an agent acts on steps ``join + 1 .. leave``.

    Raises:
        ValueError: an agent without both, a leave not after its join, an unknown ending, or a
            step before the last at which no agent would be live (the episode would end early).
    """

    joins: Mapping[str, int]
    leaves: Mapping[str, tuple[int, str]]

    def __post_init__(self) -> None:
        if set(self.joins) != set(self.leaves):
            raise ValueError(
                f"schedule: joins and leaves must name the same agents; got {sorted(self.joins)} "
                f"and {sorted(self.leaves)}"
            )
        for agent, join in self.joins.items():
            leave, how = self.leaves[agent]
            if not 0 <= join < leave:
                raise ValueError(
                    f"schedule: agent {agent!r} must leave after it joins; joins at {join}, "
                    f"leaves at {leave}"
                )
            if how not in ("terminated", "truncated"):
                raise ValueError(
                    f"schedule: agent {agent!r} ends 'terminated' or 'truncated'; got {how!r}"
                )
        if not any(j == 0 for j in self.joins.values()):
            raise ValueError("schedule: at least one agent must be live from reset (join 0)")
        for step in range(1, self.length):
            if not self.live_after(step):
                raise ValueError(
                    f"schedule: no agent is live after step {step}, before the last step "
                    f"{self.length}: the episode would end there"
                )

    @property
    def length(self) -> int:
        """The episode's joint steps (the last leave)."""
        return max(leave for leave, _ in self.leaves.values())

    def live_after(self, step: int) -> list[str]:
        """The agents live after ``step`` joint steps (0: after ``reset``)."""
        return [a for a in self.joins if self.joins[a] <= step < self.leaves[a][0]]

    def env_steps(self, agent: str) -> range:
        """The joint steps (from 0, as the rows' ``env_steps``) at which ``agent`` acts."""
        return range(self.joins[agent], self.leaves[agent][0])


#: scout_1 dies (terminated) on step 2; medic_0 joins on step 3 and acts from step 4; tank_0 is
#: truncated on step 5; scout_0 terminated on step 7; medic_0 terminated on step 8, which ends
#: the episode: 2 + 7 + 5 + 5 = 19 rows per episode.
DEFAULT_SCHEDULE = Schedule(
    joins={"scout_0": 0, "scout_1": 0, "tank_0": 0, "medic_0": 3},
    leaves={
        "scout_0": (7, "terminated"),
        "scout_1": (2, "terminated"),
        "tank_0": (5, "truncated"),
        "medic_0": (8, "terminated"),
    },
)


def _spaces() -> tuple[dict[str, gym.Space[Any]], dict[str, gym.Space[Any]]]:
    scout = gym.spaces.Box(-10.0, 10.0, (3,), np.float32)
    observation: dict[str, gym.Space[Any]] = {
        "scout_0": scout,
        "scout_1": gym.spaces.Box(-10.0, 10.0, (3,), np.float32),
        "tank_0": gym.spaces.Dict(
            {
                "observation": gym.spaces.Box(-10.0, 10.0, (2,), np.float32),
                "action_mask": gym.spaces.MultiBinary(4),
            }
        ),
        "medic_0": gym.spaces.Box(-1.0, 1.0, (5,), np.float64),
    }
    action: dict[str, gym.Space[Any]] = {
        "scout_0": gym.spaces.Discrete(3),
        "scout_1": gym.spaces.Discrete(3),
        "tank_0": gym.spaces.Discrete(4),
        "medic_0": gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
    }
    return observation, action


class _Roster:
    """The logic both envs share; they differ only in whether ``reset``/``step`` await."""

    metadata: dict[str, Any] = {"name": "roster_v0", "render_modes": [], "is_parallelizable": True}  # noqa: RUF012
    render_mode: str | None = None

    def __init__(
        self, schedule: Schedule = DEFAULT_SCHEDULE, *, max_cycles: int | None = None
    ) -> None:
        unknown = set(schedule.joins) - set(_AGENTS)
        if unknown:
            raise ValueError(f"schedule: unknown agents {sorted(unknown)}; agents: {_AGENTS}")
        self.schedule = schedule
        self.max_cycles = max_cycles
        self.possible_agents: list[str] = [a for a in _AGENTS if a in schedule.joins]
        self.observation_spaces, self.action_spaces = _spaces()
        self.agents: list[str] = []
        self.steps = 0
        self.resets = 0
        self.closed = False
        self._np_random: np.random.Generator | None = None
        self._last_action: dict[str, float] = {}

    @property
    def unwrapped(self) -> _Roster:
        """The env itself (PettingZoo's ``unwrapped``)."""
        return self

    @property
    def np_random(self) -> np.random.Generator:
        """The env's generator (seeded by ``reset(seed=...)``, else from OS entropy)."""
        if self._np_random is None:
            self._np_random, _ = seeding.np_random()
        return self._np_random

    def observation_space(self, agent: str) -> gym.Space[Any]:
        """The observation space of ``agent`` (the same object at every call)."""
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> gym.Space[Any]:
        """The action space of ``agent`` (the same object at every call)."""
        return self.action_spaces[agent]

    def render(self) -> None:
        """Nothing to render."""

    def _mask(self, agent: str) -> np.ndarray:
        """The agent's action mask at the current step: one action forbidden in turn."""
        n = int(self.action_spaces[agent].n)  # type: ignore[attr-defined]
        mask = np.ones(n, dtype=np.int8)
        mask[(self.steps + self.possible_agents.index(agent)) % n] = 0
        return mask

    def _observe(self, agent: str) -> Any:
        rng = self.np_random
        last = self._last_action.get(agent, 0.0)
        if agent.startswith("scout"):
            noise = rng.uniform(-1.0, 1.0, 2)
            return np.array([self.steps, last, noise.sum()], dtype=np.float32)
        if agent == "tank_0":
            obs = np.array([last, rng.uniform(-5.0, 5.0)], dtype=np.float32)
            return {"observation": obs, "action_mask": self._mask(agent)}
        return np.clip(rng.normal(last, 0.3, 5), -1.0, 1.0)

    def _info(self, agent: str) -> dict[str, Any]:
        info: dict[str, Any] = {"step": self.steps}
        if agent.startswith("scout"):
            info["action_mask"] = self._mask(agent)
        return info

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> JointReset:
        del options  # accepted, unused (PettingZoo's test passes some)
        if seed is not None:
            self._np_random, _ = seeding.np_random(seed)
        self.steps = 0
        self.resets += 1
        self._last_action = {}
        self.agents = [a for a in self.possible_agents if a in self.schedule.live_after(0)]
        return {a: self._observe(a) for a in self.agents}, {a: self._info(a) for a in self.agents}

    def _check_actions(self, actions: Mapping[str, Any]) -> None:
        extra = [a for a in actions if a not in self.agents]
        missing = [a for a in self.agents if a not in actions]
        if extra or missing:
            raise ValueError(
                f"roster step {self.steps + 1}: actions must be for the live agents "
                f"{self.agents}; extra: {extra}, missing: {missing}"
            )
        for agent, action in actions.items():
            if not self.action_spaces[agent].contains(action):
                raise ValueError(
                    f"roster step {self.steps + 1}: {action!r} is not in {agent}'s action space "
                    f"{self.action_spaces[agent]}"
                )

    def _reward(self, agent: str, action: Any) -> float:
        if agent == "medic_0":
            return -float(np.square(np.asarray(action, dtype=np.float64)).sum())
        allowed = bool(self._mask(agent)[int(action)])
        return (1.0 + 0.1 * int(action)) if allowed else -1.0

    def _step(self, actions: Mapping[str, Any]) -> JointStep:
        if not self.agents:
            raise RuntimeError("roster: step() after the episode ended; call reset() first")
        self._check_actions(actions)
        rewards = {a: self._reward(a, actions[a]) for a in self.agents}
        for agent, action in actions.items():
            self._last_action[agent] = float(np.asarray(action, dtype=np.float64).ravel()[0])
        self.steps += 1
        acted = list(self.agents)
        cut = self.max_cycles is not None and self.steps >= self.max_cycles
        joining = [
            a for a in self.possible_agents if self.schedule.joins[a] == self.steps and not cut
        ]
        terminations = dict.fromkeys(acted + joining, False)
        truncations = dict.fromkeys(acted + joining, False)
        for agent in acted:
            leave, how = self.schedule.leaves[agent]
            if leave == self.steps:
                (terminations if how == "terminated" else truncations)[agent] = True
            elif cut:
                truncations[agent] = True
        rewards.update(dict.fromkeys(joining, 0.0))
        listed = [a for a in self.possible_agents if a in acted or a in joining]
        observations = {a: self._observe(a) for a in listed}
        infos = {a: {**self._info(a), "last_action": self._last_action.get(a)} for a in listed}
        self.agents = [a for a in listed if not (terminations[a] or truncations[a])]
        return observations, rewards, terminations, truncations, infos


class RosterEnv(_Roster):
    """A blocking PettingZoo-style ``ParallelEnv`` that follows ``schedule`` (module docstring).

    Args:
        schedule: when each agent joins and leaves (agents it leaves out are not possible
            agents of the env).
        max_cycles: truncate every live agent at this joint step, or ``None``
            (``pettingzoo.test.parallel_api_test`` sets it).

    Attributes:
        steps: joint steps taken in the current episode.
        resets: ``reset`` calls so far.
        closed: whether ``close`` was called.
    """

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> JointReset:
        """Start an episode: the agents live from the start, their observations and infos."""
        return self._reset(seed, options)

    def step(self, actions: Mapping[str, Any]) -> JointStep:
        """One joint step of the live agents (exactly those must act)."""
        return self._step(actions)

    def close(self) -> None:
        """Mark the env closed."""
        self.closed = True


class AsyncRosterEnv(_Roster):
    """The async twin of :class:`RosterEnv`: the same steps, awaited.

    Args:
        schedule: as for :class:`RosterEnv`.
        max_cycles: as for :class:`RosterEnv`.
        delay: seconds each ``reset``/``step`` waits (``asyncio.sleep``) before answering; at 0
            it still yields to the event loop once.
    """

    def __init__(
        self,
        schedule: Schedule = DEFAULT_SCHEDULE,
        *,
        max_cycles: int | None = None,
        delay: float = 0.0,
    ) -> None:
        super().__init__(schedule, max_cycles=max_cycles)
        self.delay = delay

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> JointReset:
        """Start an episode: the agents live from the start, their observations and infos."""
        await asyncio.sleep(self.delay)
        return self._reset(seed, options)

    async def step(self, actions: Mapping[str, Any]) -> JointStep:
        """One joint step of the live agents (exactly those must act)."""
        await asyncio.sleep(self.delay)
        return self._step(actions)

    async def close(self) -> None:
        """Mark the env closed."""
        await asyncio.sleep(0)
        self.closed = True
