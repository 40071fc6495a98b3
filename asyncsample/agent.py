"""The Agent protocol (garage's vectorised Policy) and the built-in :class:`RandomAgent`."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from typing import Any, Protocol, runtime_checkable

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import batch_space

from asyncsample._tree import Tree

__all__ = ["Agent", "AgentOutput", "AgentParams", "AgentUpdate", "RandomAgent", "get_actions"]

AgentOutput = tuple[Tree, dict[str, np.ndarray]]
"""What ``get_actions`` returns: one action per env, and a dict of per-env agent infos."""

AgentParams = dict[str, Any] | tuple[Any, ...] | np.ndarray
"""Parameters for ``set_param_values`` (what ``get_param_values`` returned)."""


@runtime_checkable
class Agent(Protocol):
    """What a worker asks for actions.

    ``get_actions`` receives the stacked observations of one worker's envs (leading axis
    ``envs_per_worker``) and returns one action per env and a dict of per-env agent infos. It may
    be ``async def``; the worker awaits it. Optional methods, used when present:
    ``reset(do_resets)``, ``get_param_values()`` and ``set_param_values(params)``.
    """

    def get_actions(self, observations: Tree) -> AgentOutput | Awaitable[AgentOutput]:
        """Actions and agent infos for a batch of observations."""
        ...


async def get_actions(agent: Agent, observations: Tree) -> AgentOutput:
    """Call ``agent.get_actions``, awaiting it when it is a coroutine."""
    result = agent.get_actions(observations)
    if type(result) is not tuple and inspect.isawaitable(result):
        result = await result
    return result


AgentUpdate = AgentParams | Agent | None
"""One worker's agent update: parameters, a new agent, or ``None`` (keep the agent)."""


class RandomAgent:
    """Samples actions uniformly from ``action_space``, one per env, from its own seeded RNG.

    Args:
        action_space: the action space of one env.
        seed: seed of the agent's generator (``None`` draws one from the OS).
    """

    def __init__(self, action_space: gym.Space[Any], seed: int | None = None) -> None:
        self.action_space = action_space
        self._rng = np.random.default_rng(seed)
        self._batched: dict[int, gym.Space[Any]] = {}
        self._sample = self._direct_sampler(action_space)

    def _direct_sampler(self, space: gym.Space[Any]) -> Any:
        """One generator call for the common spaces (gymnasium's sample() costs ~20 us)."""
        rng = self._rng
        if isinstance(space, gym.spaces.Discrete):
            start, k = int(space.start), int(space.n)
            # floor(U * k) for U uniform in [0, 1): 2x faster than rng.integers for small n.
            return lambda n: (rng.random(n) * k).astype(np.int64) + start  # type: ignore
        if (
            isinstance(space, gym.spaces.Box)
            and space.is_bounded("both")
            and np.issubdtype(space.dtype, np.floating)
        ):
            low, high, dtype = space.low, space.high, space.dtype
            shape = space.shape
            return lambda n: rng.uniform(low, high, size=(n, *shape)).astype(dtype, copy=False)
        return None

    def _space(self, n: int) -> gym.Space[Any]:
        space = self._batched.get(n)
        if space is None:
            # A batched space samples all envs in one numpy call where a per-env loop would
            # take n; each batch size gets its own seed drawn from the agent's generator.
            space = batch_space(self.action_space, n)
            space.seed(int(self._rng.integers(2**32)))
            self._batched[n] = space
        return space

    def get_actions(self, observations: Tree) -> AgentOutput:
        """Uniform random actions for every row of ``observations``; no agent infos."""
        leaf = observations
        while isinstance(leaf, (dict, tuple)):
            leaf = next(iter(leaf.values())) if isinstance(leaf, dict) else leaf[0]
        if self._sample is not None:
            return self._sample(len(leaf)), {}
        return self._space(len(leaf)).sample(), {}

    def reset(self, do_resets: Any = None) -> None:
        """Nothing to reset: the agent is stateless."""
