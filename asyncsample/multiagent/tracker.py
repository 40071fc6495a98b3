"""The row tracker: joint steps of multi-agent envs in, per-agent rows out.

:class:`RowTracker` keeps, for each of ``n_envs`` envs, which agents are live, which are done,
each agent's step in its segment and the env's step and episode, in numpy arrays of shape
``(n_envs, n_agents)`` (an agent's column is its slot in ``possible_agents``). Fed one joint
step of an env (or several envs' steps at once, as a ready batch will carry them:
:meth:`RowTracker.apply`), it returns that step's rows grouped by policy
(:class:`~asyncsample.multiagent.AgentRows`) and says which envs' episodes ended. The rules:

* The agents in ``reset``'s observations are live: each starts a segment.
* On a step, every live agent must get an action, and only live agents may get one; each gets
  one row (its observation before the step, its action, reward, observation after, flags, info).
* An agent terminated or truncated on a step ends its segment with that row; it gets no more
  rows, and may not come back in the same episode (PettingZoo's rule: no revival).
* An agent that first appears in a step's observations has joined: its segment starts with that
  observation, and its first row comes from the next step. Whatever else the step gave it (a
  reward) belongs to no transition of its and is not recorded.
* The env's episode ends when no agent is live (PettingZoo: ``env.agents`` is empty), or when
  it reaches ``max_episode_length`` joint steps (every live agent's last row is then truncated);
  the env must then be reset before it is stepped again.

The agents' next observations, grouped by policy for one call each, come from
:meth:`RowTracker.requests`, with each agent's action mask: the ``"action_mask"`` entry of its
observation (a ``Dict`` observation) or else of its info, as PettingZoo's envs give it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from asyncsample._tree import tree_index
from asyncsample.errors import AgentStepError
from asyncsample.multiagent.checks import ParallelEnvSpec
from asyncsample.multiagent.policies import PolicyGroups, PolicyMapping, group_policies
from asyncsample.multiagent.protocols import AgentID, PolicyID
from asyncsample.multiagent.rows import AgentRows, agent_id_column, stack_tree

__all__ = ["ActRequest", "JointTransition", "RowTracker", "StepOutcome", "action_mask_of"]

#: The key of an action mask in an agent's observation (a dict) or info.
ACTION_MASK = "action_mask"


def action_mask_of(observation: Any, info: Mapping[str, Any] | None) -> np.ndarray | None:
    """The action mask of an agent: its observation's ``"action_mask"`` entry when the
    observation is a dict that has one, else its info's, else ``None``; as a ``bool`` array."""
    if isinstance(observation, Mapping) and ACTION_MASK in observation:
        return np.asarray(observation[ACTION_MASK], dtype=bool)
    if info is not None and ACTION_MASK in info:
        return np.asarray(info[ACTION_MASK], dtype=bool)
    return None


@dataclasses.dataclass(frozen=True)
class JointTransition:
    """One joint step of one env: the actions it was given and the five dicts it returned."""

    env: int
    actions: Mapping[AgentID, Any]
    observations: Mapping[AgentID, Any]
    rewards: Mapping[AgentID, Any]
    terminations: Mapping[AgentID, Any]
    truncations: Mapping[AgentID, Any]
    infos: Mapping[AgentID, Any]


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What joint steps gave: their rows by policy, and the envs whose episode they ended.

    Attributes:
        rows: the rows of each policy that had any, in the order of the policies.
        ended: ``int64`` indices of the envs whose episode ended (reset them before stepping).
    """

    rows: dict[PolicyID, AgentRows]
    ended: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class ActRequest:
    """The live agents of one policy awaiting actions, stacked for one call.

    Attributes:
        policy: the policy id.
        envs: ``(R,) int64``, each row's env.
        agent_ids: ``(R,)``, each row's agent.
        observations: the agents' current observations, stacked (leaf by leaf).
        action_masks: ``(R, n) bool`` masks, or ``None`` when none of the agents has one
            (absent for some rows: all ``True`` there).
    """

    policy: PolicyID
    envs: np.ndarray
    agent_ids: np.ndarray
    observations: Any
    action_masks: np.ndarray | None

    def __len__(self) -> int:
        return len(self.envs)

    def split(self, actions: Any) -> dict[int, dict[AgentID, Any]]:
        """One action per row (stacked leaf by leaf, rows in this request's order) as the
        actions dict of each env."""
        out: dict[int, dict[AgentID, Any]] = {}
        for i, (env, agent) in enumerate(
            zip(self.envs.tolist(), self.agent_ids.tolist(), strict=True)
        ):
            out.setdefault(env, {})[agent] = tree_index(actions, i)
        return out


class RowTracker:
    """Turns joint steps of ``n_envs`` envs of one kind into per-agent rows (module docstring).

    Args:
        spec: the envs' spec (:func:`~asyncsample.multiagent.check_parallel_env`).
        n_envs: how many envs it tracks (indices ``0 .. n_envs - 1``).
        policy_mapping: agent id -> policy id (see :mod:`asyncsample.multiagent.policies`).
        max_episode_length: the most joint steps an env's episode has, or ``None``.

    Attributes:
        spec: see Args.
        groups: the agents grouped by policy.
        live: ``(n_envs, n_agents) bool``, the agents with an open segment.
        finished: ``(n_envs, n_agents) bool``, the agents done in the env's current episode.
        agent_steps: ``(n_envs, n_agents) int64``, rows so far in each open segment.
        env_steps: ``(n_envs,) int64``, joint steps so far in each env's episode.
        episodes: ``(n_envs,) int64``, each env's episode index (-1 before its first reset).
        running: ``(n_envs,) bool``, whether the env is in an episode (reset, not yet ended).

    Raises:
        ValueError: ``n_envs`` below 1, or ``max_episode_length`` below 1.
        PolicyMappingError: ``policy_mapping`` does not fit the env.
    """

    def __init__(
        self,
        spec: ParallelEnvSpec,
        n_envs: int = 1,
        *,
        policy_mapping: PolicyMapping = None,
        max_episode_length: int | None = None,
    ) -> None:
        if isinstance(n_envs, bool) or not isinstance(n_envs, int | np.integer) or n_envs < 1:
            raise ValueError(f"n_envs: expected an int >= 1; got {n_envs!r}")
        if max_episode_length is not None and (
            isinstance(max_episode_length, bool) or max_episode_length < 1
        ):
            raise ValueError(
                f"max_episode_length: expected an int >= 1 or None; got {max_episode_length!r}"
            )
        self.spec = spec
        self.groups: PolicyGroups = group_policies(spec, policy_mapping)
        self.n_envs = int(n_envs)
        self.max_episode_length = max_episode_length
        shape = (self.n_envs, len(spec.possible_agents))
        self.live = np.zeros(shape, dtype=bool)
        self.finished = np.zeros(shape, dtype=bool)
        self.agent_steps = np.zeros(shape, dtype=np.int64)
        self.env_steps = np.zeros(self.n_envs, dtype=np.int64)
        self.episodes = np.full(self.n_envs, -1, dtype=np.int64)
        self.running = np.zeros(self.n_envs, dtype=bool)
        # The observation and action mask each live agent acts upon next, by env and slot.
        self._obs: list[dict[int, Any]] = [{} for _ in range(self.n_envs)]
        self._masks: list[dict[int, np.ndarray | None]] = [{} for _ in range(self.n_envs)]
        self._policy_slots = {
            p: [spec.index(a) for a in agents] for p, agents in self.groups.agents_of.items()
        }

    # --- reading the state -------------------------------------------------------------------

    def live_agents(self, env: int) -> list[AgentID]:
        """The live agents of env ``env``, in the order of ``possible_agents``."""
        return [self.spec.possible_agents[s] for s in np.flatnonzero(self.live[env])]

    def observations(self, env: int) -> dict[AgentID, Any]:
        """What each live agent of env ``env`` acts upon next."""
        return {self.spec.possible_agents[s]: obs for s, obs in sorted(self._obs[env].items())}

    def action_masks(self, env: int) -> dict[AgentID, np.ndarray | None]:
        """The action mask of each live agent of env ``env`` (``None``: no mask)."""
        return {self.spec.possible_agents[s]: m for s, m in sorted(self._masks[env].items())}

    def requests(self, envs: Iterable[int] | None = None) -> dict[PolicyID, ActRequest]:
        """The live agents of ``envs`` (default: every running env) awaiting actions, one
        :class:`ActRequest` per policy that has any: env by env, agents in slot order."""
        chosen = np.flatnonzero(self.running) if envs is None else np.asarray(list(envs))
        out: dict[PolicyID, ActRequest] = {}
        for policy, slots in self._policy_slots.items():
            pairs = [(int(e), s) for e in chosen for s in slots if self.live[e, s]]
            if not pairs:
                continue
            masks = [self._masks[e][s] for e, s in pairs]
            out[policy] = ActRequest(
                policy=policy,
                envs=np.asarray([e for e, _ in pairs], dtype=np.int64),
                agent_ids=agent_id_column([self.spec.possible_agents[s] for _, s in pairs]),
                observations=stack_tree([self._obs[e][s] for e, s in pairs]),
                action_masks=_stack_masks(masks),
            )
        return out

    # --- feeding it --------------------------------------------------------------------------

    def reset(
        self, env: int, observations: Mapping[AgentID, Any], infos: Mapping[AgentID, Any]
    ) -> None:
        """Start a new episode of env ``env`` from its ``reset`` result; an episode still
        running there is abandoned (its open segments get no more rows).

        Raises:
            AgentStepError: ``env`` is out of range, or the observations hold an agent the env
                never declared, or none at all; the tracker's state is then unchanged.
        """
        self._check_env(env)
        if not observations:
            raise AgentStepError(
                f"env {env}: reset returned no agent's observation (an episode needs at least "
                "one live agent)",
                env=env,
            )
        slots = {agent: self._slot(env, agent, "reset's observations") for agent in observations}
        self.live[env] = False
        self.finished[env] = False
        self.agent_steps[env] = 0
        self.env_steps[env] = 0
        self.episodes[env] += 1
        self.running[env] = True
        self._obs[env].clear()
        self._masks[env].clear()
        for agent, obs in observations.items():
            self._join(env, slots[agent], obs, _info(infos, agent))

    def step(
        self,
        env: int,
        actions: Mapping[AgentID, Any],
        observations: Mapping[AgentID, Any],
        rewards: Mapping[AgentID, Any],
        terminations: Mapping[AgentID, Any],
        truncations: Mapping[AgentID, Any],
        infos: Mapping[AgentID, Any],
    ) -> StepOutcome:
        """The rows of one joint step of env ``env`` (the module docstring's rules).

        Raises:
            AgentStepError: the step breaks a rule (the message names the env, the step, the
                agent and what is wrong); the tracker's state is then unchanged.
        """
        return self.apply(
            [JointTransition(env, actions, observations, rewards, terminations, truncations, infos)]
        )

    def apply(self, steps: Sequence[JointTransition]) -> StepOutcome:
        """The rows of several envs' joint steps (at most one step per env), grouped by policy:
        within a policy, step by step in the order given, agents in slot order.

        Raises:
            AgentStepError: a step breaks a rule; every step is checked before any is applied.
        """
        seen: set[int] = set()
        for step in steps:
            self._check_step(step)
            if step.env in seen:
                raise AgentStepError(
                    f"env {step.env}: two joint steps of one env in one batch", env=step.env
                )
            seen.add(step.env)
        by_policy: dict[PolicyID, list[dict[str, Any]]] = {p: [] for p in self._policy_slots}
        ended: list[int] = []
        for step in steps:
            if self._advance(step, by_policy):
                ended.append(step.env)
        rows = {
            policy: AgentRows.from_transitions(policy, transitions)
            for policy, transitions in by_policy.items()
            if transitions
        }
        return StepOutcome(rows, np.asarray(ended, dtype=np.int64))

    # --- the rules ---------------------------------------------------------------------------

    def _check_env(self, env: int) -> None:
        if isinstance(env, bool) or not isinstance(env, int | np.integer):
            raise AgentStepError(f"env: expected an int env index; got {env!r}", env=-1)
        if not 0 <= env < self.n_envs:
            raise AgentStepError(
                f"env {env}: out of range (this tracker has {self.n_envs} envs)", env=int(env)
            )

    def _where(self, env: int) -> str:
        return f"env {env}, episode {self.episodes[env]}, step {self.env_steps[env]}"

    def _slot(self, env: int, agent: AgentID, where: str) -> int:
        try:
            return self.spec.index(agent)
        except (KeyError, TypeError):
            raise AgentStepError(
                f"{self._where(env)}: {where} hold agent {agent!r}, which is not one of the "
                f"env's possible_agents {list(self.spec.possible_agents)}",
                env=env,
                agent=agent,
            ) from None

    def _check_step(self, step: JointTransition) -> None:
        env = step.env
        self._check_env(env)
        if not self.running[env]:
            state = "never reset" if self.episodes[env] < 0 else "its episode has ended"
            raise AgentStepError(
                f"env {env}: stepped while not in an episode ({state}): reset it first", env=env
            )
        live = set(self.live_agents(env))
        for agent in step.actions:
            if agent not in live:
                slot = self._slot(env, agent, "the actions")
                why = "is done" if self.finished[env, slot] else "has not joined"
                raise AgentStepError(
                    f"{self._where(env)}: an action for agent {agent!r}, which {why}: only "
                    "live agents act",
                    env=env,
                    agent=agent,
                )
        for agent in live:
            if agent not in step.actions:
                raise AgentStepError(
                    f"{self._where(env)}: no action for live agent {agent!r} (every live agent "
                    "acts on every step)",
                    env=env,
                    agent=agent,
                )
            for field in ("observations", "rewards", "terminations", "truncations"):
                if agent not in getattr(step, field):
                    raise AgentStepError(
                        f"{self._where(env)}: live agent {agent!r} is missing from the step's "
                        f"{field}",
                        env=env,
                        agent=agent,
                    )
        for agent in step.observations:
            if agent in live:
                continue
            slot = self._slot(env, agent, "the observations")
            if self.finished[env, slot]:
                raise AgentStepError(
                    f"{self._where(env)}: agent {agent!r} is back after it was done in this "
                    "episode (an agent cannot be revived)",
                    env=env,
                    agent=agent,
                )

    def _join(self, env: int, slot: int, obs: Any, info: Mapping[str, Any] | None) -> None:
        self.live[env, slot] = True
        self.agent_steps[env, slot] = 0
        self._obs[env][slot] = obs
        self._masks[env][slot] = action_mask_of(obs, info)

    def _advance(self, step: JointTransition, by_policy: dict[PolicyID, list[Any]]) -> bool:
        """Apply one checked step; return whether the env's episode ended."""
        env = step.env
        episode, env_step = int(self.episodes[env]), int(self.env_steps[env])
        capped = self.max_episode_length is not None and env_step + 1 >= self.max_episode_length
        policy_of = self.groups.policy_of
        agents = self.spec.possible_agents
        for slot in np.flatnonzero(self.live[env]).tolist():
            agent = agents[slot]
            terminated = bool(step.terminations[agent])
            truncated = bool(step.truncations[agent]) or (capped and not terminated)
            info = _info(step.infos, agent)
            next_obs = step.observations[agent]
            by_policy[policy_of[agent]].append(
                {
                    "envs": env,
                    "agent_ids": agent,
                    "agent_slots": slot,
                    "episodes": episode,
                    "env_steps": env_step,
                    "agent_steps": int(self.agent_steps[env, slot]),
                    "observations": self._obs[env][slot],
                    "actions": step.actions[agent],
                    "rewards": step.rewards[agent],
                    "next_observations": next_obs,
                    "terminations": terminated,
                    "truncations": truncated,
                    "env_infos": {} if info is None else dict(info),
                    "action_masks": self._masks[env][slot],
                }
            )
            self.agent_steps[env, slot] += 1
            if terminated or truncated:
                self.live[env, slot] = False
                self.finished[env, slot] = True
                del self._obs[env][slot], self._masks[env][slot]
            else:
                self._obs[env][slot] = next_obs
                self._masks[env][slot] = action_mask_of(next_obs, info)
        for agent, obs in step.observations.items():
            slot = self.spec.index(agent)
            if self.live[env, slot] or self.finished[env, slot] or capped:
                continue
            if bool(step.terminations.get(agent, False)) or bool(
                step.truncations.get(agent, False)
            ):
                self.finished[env, slot] = True  # joined and done at once: no segment
                continue
            self._join(env, slot, obs, _info(step.infos, agent))
        self.env_steps[env] += 1
        if not self.live[env].any():
            self.running[env] = False
            return True
        return False


def _info(infos: Mapping[AgentID, Any], agent: AgentID) -> Mapping[str, Any] | None:
    info = infos.get(agent) if isinstance(infos, Mapping) else None
    return info if isinstance(info, Mapping) else None


def _stack_masks(masks: Sequence[np.ndarray | None]) -> np.ndarray | None:
    present = [m for m in masks if m is not None]
    if not present:
        return None
    like = present[0]
    return np.stack([np.ones_like(like) if m is None else m for m in masks])
