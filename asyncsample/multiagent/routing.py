"""One agent for the joint steps of slot envs: each policy's agent acts for its own agents.

``Sampler(agent={policy_id: agent}, policy_mapping=...)`` puts the agents in a
:class:`PolicyAgents`, which the sampler runs where it runs any agent (in the caller, batched or
per worker, or copied into the env hosts with ``inference="host"``). Given the joint
observations of a worker's envs (or of all of them), it calls each policy's agent once, on the
stacked observations of that policy's live agents across envs and slots (slot by slot, envs
in order within each), and scatters the actions back into the slots. An agent whose ``get_actions``
takes an ``action_masks`` keyword gets the Discrete agents' masks, ``(rows, n)`` bool, from the
agents' observations or infos.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from asyncsample._memory import BatchMemory
from asyncsample._tree import tree_index, tree_map
from asyncsample.agent import distinct
from asyncsample.multiagent.policies import PolicyGroups, PolicyMapping, group_policies
from asyncsample.multiagent.protocols import PolicyID
from asyncsample.multiagent.rows import gather_slots
from asyncsample.multiagent.slots import SlotSpace
from asyncsample.multiagent.tracker import ACTION_MASK

__all__ = ["PolicyAgents", "bind_agents"]


def _fill(space: gym.Space[Any], n: int) -> Any:
    """``n`` placeholder actions of ``space`` for absent agents (ignored by the env, but within
    the space so that the sampler's range check passes)."""
    if isinstance(space, gym.spaces.Dict):
        return {k: _fill(s, n) for k, s in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        return tuple(_fill(s, n) for s in space.spaces)
    if isinstance(space, gym.spaces.Discrete):
        return np.full(n, space.start, dtype=space.dtype)
    if isinstance(space, gym.spaces.Box):
        zero = np.clip(np.zeros(space.shape, dtype=space.dtype), space.low, space.high)
        return np.broadcast_to(zero, (n, *space.shape)).copy()
    return np.zeros((n, *(space.shape or ())), dtype=space.dtype)


class PolicyAgents:
    """The agents of a multi-agent env's policies as one :class:`~asyncsample.Agent`.

    Args:
        agents: the agent of each policy id.
        policy_mapping: agent id -> policy id (a callable or a dict); ``None``: every agent is
            policy ``"default"``.

    Raises:
        TypeError: ``agents`` is not a non-empty mapping of agents.
    """

    def __init__(self, agents: Mapping[PolicyID, Any], policy_mapping: PolicyMapping = None):
        if not isinstance(agents, Mapping) or not agents:
            raise TypeError(
                "agent: expected a non-empty dict {policy_id: agent} for a multi-agent env, "
                f"got {type(agents).__name__} {agents!r:.80}"
            )
        for policy, agent in agents.items():
            if not callable(getattr(agent, "get_actions", None)):
                raise TypeError(
                    f"agent[{policy!r}]: expected an agent with get_actions(observations), "
                    f"got {type(agent).__name__}"
                )
        self.agents = dict(agents)
        self.policy_mapping = policy_mapping
        self.groups: PolicyGroups | None = None
        self._slots: dict[PolicyID, np.ndarray] = {}
        self._masked: dict[PolicyID, bool] = {}
        self._memory = BatchMemory(keep=2)  # the policies' stacked observations, call after call
        self._action_spaces: list[gym.Space[Any]] | None = None

    def bind_env_spec(self, spec: Any) -> None:
        """Learn the env's agents and spaces from the sampler's env spec (before any call).

        Raises:
            PolicyMappingError: the mapping does not fit the env.
            ValueError: a policy of the mapping has no agent, or the env is not multi-agent.
        """
        space = spec.observation_space
        if not isinstance(space, SlotSpace):
            raise ValueError(
                "agent: a dict of agents is for a multi-agent env (a PettingZoo ParallelEnv "
                f"factory); this env's observation space is {space}"
            )
        agent_spec = space.agent_spec
        groups = group_policies(agent_spec, self.policy_mapping)
        missing = [p for p in groups.policies if p not in self.agents]
        if missing:
            raise ValueError(
                f"agent: no agent for policies {missing} (policy_mapping gives "
                f"{dict(groups.policy_of)}); got agents for {list(self.agents)}"
            )
        self.groups = groups
        self._action_spaces = list(spec.action_space.spaces)
        self._slots = {
            p: np.asarray([agent_spec.index(a) for a in agents], dtype=np.int64)
            for p, agents in groups.agents_of.items()
        }
        self._masked = {
            p: isinstance(groups.action_spaces[p], gym.spaces.Discrete)
            and _takes_masks(self.agents[p])
            for p in groups.policies
        }

    def get_actions(self, observations: Any) -> Any:
        """Every slot's action for a batch of joint observations; each policy's agent info
        ``key`` under ``"{policy}/{key}"``, ``(envs, agents of the policy, ...)`` (zeros where
        absent)."""
        if self.groups is None or self._action_spaces is None:
            raise RuntimeError("PolicyAgents.get_actions before bind_env_spec")
        live = np.asarray(observations["live"], dtype=bool)
        n_envs = live.shape[0]
        calls: list[tuple[PolicyID, np.ndarray, np.ndarray, Any]] = []
        for policy, slots in self._slots.items():
            j, env_rows = np.nonzero(live[:, slots].T)  # slot by slot: a block each
            if not env_rows.size:
                continue
            per_slot = [observations["agents"][k] for k in slots.tolist()]
            obs = gather_slots(per_slot, env_rows, j, self._memory, view=True)
            agent = self.agents[policy]
            if self._masked[policy] and ACTION_MASK in observations:
                n = int(self.groups.action_spaces[policy].n)  # type: ignore[attr-defined]
                masks = observations[ACTION_MASK][env_rows, slots[j], :n].astype(bool)
                out = agent.get_actions(obs, action_masks=masks)
            else:
                out = agent.get_actions(obs)
            calls.append((policy, env_rows, j, out))
        if any(inspect.isawaitable(out) for *_, out in calls):
            return self._gather(calls, n_envs)
        return self._scatter(calls, n_envs)

    async def _gather(self, calls: list[Any], n_envs: int) -> Any:
        outs = await asyncio.gather(*(out for *_, out in calls if inspect.isawaitable(out)))
        awaited = iter(outs)
        done = [
            (p, e, j, next(awaited) if inspect.isawaitable(out) else out) for p, e, j, out in calls
        ]
        return self._scatter(done, n_envs)

    def _scatter(self, calls: list[Any], n_envs: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        assert self._action_spaces is not None
        actions = [_fill(space, n_envs) for space in self._action_spaces]
        infos: dict[str, Any] = {}
        for policy, env_rows, j, (acts, agent_infos) in calls:
            slots = self._slots[policy]
            for k, slot in enumerate(slots.tolist()):
                pick = j == k
                if pick.any():
                    actions[slot] = _put(actions[slot], env_rows[pick], tree_index(acts, pick))
            for key, value in (agent_infos or {}).items():
                infos[f"{policy}/{key}"] = _spread(value, env_rows, j, n_envs, len(slots))
        return tuple(actions), infos

    def reset(self, do_resets: Any = None) -> None:
        """Reset each policy's agent that has a ``reset``."""
        for agent in self.agents.values():
            reset = getattr(agent, "reset", None)
            if callable(reset):
                reset(do_resets)

    def get_param_values(self) -> dict[PolicyID, Any]:
        """Each policy's parameters (of the agents that have ``get_param_values``)."""
        return {
            p: a.get_param_values()
            for p, a in self.agents.items()
            if callable(getattr(a, "get_param_values", None))
        }

    def set_param_values(self, params: Mapping[PolicyID, Any]) -> None:
        """Set the parameters of the policies named in ``params``."""
        for policy, values in params.items():
            self.agents[policy].set_param_values(values)


def _takes_masks(agent: Any) -> bool:
    try:
        parameters = inspect.signature(agent.get_actions).parameters
    except (TypeError, ValueError):
        return False
    return "action_masks" in parameters


def _put(target: Any, rows: np.ndarray, values: Any) -> Any:
    def put(leaf: np.ndarray, value: Any) -> np.ndarray:
        leaf[rows] = value
        return leaf

    return tree_map(put, target, values)


def _spread(leaf: Any, env_rows: np.ndarray, j: np.ndarray, n_envs: int, width: int) -> Any:
    values = np.asarray(leaf)
    out = np.zeros((n_envs, width, *values.shape[1:]), dtype=values.dtype)
    out[env_rows, j] = values
    return out


def bind_agents(agents: Sequence[Any], spec: Any) -> None:
    """Tell each :class:`PolicyAgents` among ``agents`` the sampler's env spec."""
    for agent in distinct(agents):
        if isinstance(agent, PolicyAgents):
            agent.bind_env_spec(spec)
