"""The shapes of a multi-agent env: PettingZoo's ``ParallelEnv`` and its async twin.

Both step every live agent at once with dicts keyed by agent id. The async twin has the same
members, but ``reset``, ``step`` and ``close`` are coroutines, so an env whose step waits on I/O
(a game server, a simulator behind a socket, a language model) never blocks the event loop.
Neither needs PettingZoo: any object of this shape is accepted (duck typing, as for
:class:`~asyncsample.AsyncEnv`). The two protocols are for type checkers; tell them apart at
run time with :func:`~asyncsample.multiagent.is_async_parallel_env` (whether ``reset`` and
``step`` are coroutine functions), which ``isinstance`` cannot do.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias

import gymnasium as gym

__all__ = [
    "AgentID",
    "AsyncParallelEnv",
    "JointReset",
    "JointStep",
    "ParallelEnvLike",
    "PolicyID",
]

AgentID: TypeAlias = Hashable
"""An agent's id: any hashable value; PettingZoo's envs use strings such as ``"piston_0"``."""

PolicyID: TypeAlias = Hashable
"""A policy's id, as a ``policy_mapping`` returns it."""

JointReset: TypeAlias = tuple[dict[Any, Any], dict[Any, dict[str, Any]]]
"""What ``reset`` returns: ``(observations, infos)``, each keyed by agent id."""

JointStep: TypeAlias = tuple[
    dict[Any, Any],
    dict[Any, float],
    dict[Any, bool],
    dict[Any, bool],
    dict[Any, dict[str, Any]],
]
"""What ``step`` returns: ``(observations, rewards, terminations, truncations, infos)``, each
keyed by agent id."""


class ParallelEnvLike(Protocol):
    """PettingZoo's ``ParallelEnv``, by its members (PettingZoo itself is not needed).

    Attributes:
        possible_agents: every agent id the env can ever have, in a fixed order.
        agents: the agents live now (PettingZoo's ``env.agents``).
    """

    @property
    def possible_agents(self) -> Sequence[AgentID]: ...

    @property
    def agents(self) -> Sequence[AgentID]: ...

    def observation_space(self, agent: AgentID) -> gym.Space[Any]:
        """The observation space of ``agent`` (the same object at every call)."""
        ...

    def action_space(self, agent: AgentID) -> gym.Space[Any]:
        """The action space of ``agent`` (the same object at every call)."""
        ...

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> JointReset:
        """Start an episode: the observations and infos of the agents live at its start."""
        ...

    def step(self, actions: Mapping[AgentID, Any]) -> JointStep:
        """Step every live agent with its action (one per live agent)."""
        ...

    def close(self) -> None:
        """Release what the env holds."""
        ...


class AsyncParallelEnv(Protocol):
    """The async twin of PettingZoo's ``ParallelEnv``: ``reset``, ``step`` and ``close`` are
    coroutines; the other members are those of :class:`ParallelEnvLike`.

    ``reset(seed, options)`` returns ``(observations, infos)``; ``step(actions)`` returns
    ``(observations, rewards, terminations, truncations, infos)``, every dict keyed by agent.
    An agent that is terminated or truncated on a step gets no action after it; an agent that
    first appears in a step's observations has joined and acts from the next step on.
    """

    @property
    def possible_agents(self) -> Sequence[AgentID]: ...

    @property
    def agents(self) -> Sequence[AgentID]: ...

    def observation_space(self, agent: AgentID) -> gym.Space[Any]:
        """The observation space of ``agent`` (the same object at every call)."""
        ...

    def action_space(self, agent: AgentID) -> gym.Space[Any]:
        """The action space of ``agent`` (the same object at every call)."""
        ...

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> JointReset:
        """Start an episode: the observations and infos of the agents live at its start."""
        ...

    async def step(self, actions: Mapping[AgentID, Any]) -> JointStep:
        """Step every live agent with its action (one per live agent)."""
        ...

    async def close(self) -> None:
        """Release what the env holds."""
        ...
