"""Which policy acts for which agent: the ``policy_mapping`` (agent id -> policy id).

The rows of the agents one policy acts for are grouped, so that one call of that policy serves
all of them (across envs too). Agents of one policy must therefore share their observation and
action spaces; agents of different spaces need different policies.

``policy_mapping`` is a callable ``agent_id -> policy_id``, a mapping of every possible agent
to its policy id, or ``None``: every agent maps to :data:`DEFAULT_POLICY` (RLlib's convention
of one shared policy), which needs every agent to have the same spaces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeAlias

import gymnasium as gym

from asyncsample.errors import PolicyMappingError
from asyncsample.multiagent.checks import ParallelEnvSpec
from asyncsample.multiagent.protocols import AgentID, PolicyID

__all__ = ["DEFAULT_POLICY", "PolicyGroups", "PolicyMapping", "group_policies"]

#: The policy id of every agent when no ``policy_mapping`` is given.
DEFAULT_POLICY = "default"

PolicyMapping: TypeAlias = Callable[[AgentID], PolicyID] | Mapping[AgentID, PolicyID] | None
"""What ``policy_mapping`` may be: a callable, a mapping of every possible agent, or ``None``."""


@dataclasses.dataclass(frozen=True)
class PolicyGroups:
    """The possible agents of an env grouped by the policy that acts for them.

    Attributes:
        policy_of: the policy id of each possible agent.
        agents_of: the agents of each policy, in the env's order of ``possible_agents``; the
            policies in the order of their first agent there.
        observation_spaces: the observation space each policy sees (its agents').
        action_spaces: the action space each policy acts in (its agents').
    """

    policy_of: Mapping[AgentID, PolicyID]
    agents_of: Mapping[PolicyID, tuple[AgentID, ...]]
    observation_spaces: Mapping[PolicyID, gym.Space[Any]]
    action_spaces: Mapping[PolicyID, gym.Space[Any]]

    @property
    def policies(self) -> tuple[PolicyID, ...]:
        """Every policy id, in the order of :attr:`agents_of`."""
        return tuple(self.agents_of)


def _policy_ids(
    spec: ParallelEnvSpec, policy_mapping: PolicyMapping, name: str
) -> dict[AgentID, PolicyID]:
    agents = spec.possible_agents
    if policy_mapping is None:
        return dict.fromkeys(agents, DEFAULT_POLICY)
    if isinstance(policy_mapping, Mapping):
        missing = [a for a in agents if a not in policy_mapping]
        if missing:
            raise PolicyMappingError(
                f"{name}: a mapping must give a policy id for every possible agent; it has "
                f"none for {missing} (possible agents: {list(agents)})"
            )
        ids = {a: policy_mapping[a] for a in agents}
    elif callable(policy_mapping):
        ids = {}
        for agent in agents:
            try:
                ids[agent] = policy_mapping(agent)
            except Exception as exc:
                raise PolicyMappingError(
                    f"{name}: the policy mapping raised {type(exc).__name__} for agent "
                    f"{agent!r}: {exc}"
                ) from exc
    else:
        raise PolicyMappingError(
            f"{name}: expected a callable (agent id -> policy id), a mapping of every agent "
            f"to its policy id, or None; got {type(policy_mapping).__name__}"
        )
    for agent, policy in ids.items():
        if policy is None or not isinstance(policy, Hashable):
            raise PolicyMappingError(
                f"{name}: a policy id must be hashable and not None; agent {agent!r} got "
                f"{type(policy).__name__} {policy!r}"
            )
    return ids


def _same_spaces(
    spec: ParallelEnvSpec, agents: tuple[AgentID, ...], policy: PolicyID, name: str, default: bool
) -> None:
    first = agents[0]
    for kind, spaces in (
        ("observation", spec.observation_spaces),
        ("action", spec.action_spaces),
    ):
        for agent in agents[1:]:
            if spaces[agent] != spaces[first]:
                hint = (
                    " (with no policy_mapping every agent shares one policy: give one, e.g. "
                    "policy_mapping=lambda agent: agent for a policy per agent)"
                    if default
                    else ""
                )
                raise PolicyMappingError(
                    f"{name}: the agents of policy {policy!r} must share their {kind} space, "
                    f"so that one call acts for all of them; {first!r} has {spaces[first]} and "
                    f"{agent!r} has {spaces[agent]}{hint}"
                )


def group_policies(
    spec: ParallelEnvSpec, policy_mapping: PolicyMapping = None, name: str = "policy_mapping"
) -> PolicyGroups:
    """Group the env's possible agents by policy, checking the mapping against the env.

    Args:
        spec: the env's spec (:func:`~asyncsample.multiagent.check_parallel_env`).
        policy_mapping: see the module docstring.
        name: the argument's name, for the messages.

    Raises:
        PolicyMappingError: ``policy_mapping`` is of another type, leaves an agent out, raises,
            returns an unhashable id or ``None``, or groups agents of different spaces.
    """
    policy_of = _policy_ids(spec, policy_mapping, name)
    grouped: dict[PolicyID, list[AgentID]] = {}
    for agent in spec.possible_agents:
        grouped.setdefault(policy_of[agent], []).append(agent)
    agents_of = {policy: tuple(agents) for policy, agents in grouped.items()}
    for policy, agents in agents_of.items():
        _same_spaces(spec, agents, policy, name, default=policy_mapping is None)
    return PolicyGroups(
        policy_of=policy_of,
        agents_of=agents_of,
        observation_spaces={p: spec.observation_spaces[a[0]] for p, a in agents_of.items()},
        action_spaces={p: spec.action_spaces[a[0]] for p, a in agents_of.items()},
    )
