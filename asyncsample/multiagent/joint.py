"""Joint steps of slot envs into agent rows: the sampler's batches of a multi-agent env.

The hosts step a multi-agent env as a :class:`~asyncsample.multiagent.slots.SlotEnv`, so a
sampler call first yields an :class:`~asyncsample.EpisodeBatch` of joint steps: one row per env
step, every slot's observation and action, the live mask, and each agent's reward, flags and
step counts as info columns. :func:`split_joint` turns it into one ``EpisodeBatch`` per policy
whose rows are agent transitions: a few numpy gathers per slot and leaf, no Python per row.

In a policy's batch each episode is one agent's segment (or, for fragments, the part of it
that this call holds): rows of one env's joint episode and one agent, in step order; segments
ordered by agent slot, then joint episode. Rows for absent agents (padding) never enter it. Besides
the usual fields a row has ``agent_ids``, ``env_steps`` (the joint step's index in the env's
episode) and ``agent_steps`` (its index in the agent's segment); each segment's
``episode_infos`` add ``agent_id`` and ``joint_episode`` (the index of the env's episode, or
fragment, in ``MultiAgentBatch.joint``). Rows of one joint step share ``joint_episode`` and
``env_steps``: that pair is how a trainer aligns them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from asyncsample._infos import concat_infos
from asyncsample._memory import BatchMemory
from asyncsample._tree import tree_index, tree_map
from asyncsample.batch import EnvSpec, EpisodeBatch, StepType
from asyncsample.multiagent.policies import PolicyGroups
from asyncsample.multiagent.protocols import PolicyID
from asyncsample.multiagent.rows import agent_id_column, gather_slots
from asyncsample.multiagent.slots import (
    AGENT_INFOS,
    AGENT_STEPS,
    ENV_STEP,
    REWARDS,
    TERMINATED,
    TRUNCATED,
)

__all__ = ["MultiAgentBatch", "split_joint"]


@dataclasses.dataclass(frozen=True, eq=False)
class MultiAgentBatch(Mapping[PolicyID, EpisodeBatch]):
    """What a sampler call returns for a multi-agent env: a batch of agent rows per policy.

    A mapping ``policy id -> EpisodeBatch`` (the policies that have rows, in the order of
    their first agent in ``possible_agents``).

    Attributes:
        batches: the rows of each policy (see the module docstring).
        joint: the joint steps they came from (one row per env step, every slot, the live mask
            in ``observations["live"]``), for alignment and debugging.
    """

    batches: dict[PolicyID, EpisodeBatch]
    joint: EpisodeBatch

    def __getitem__(self, policy: PolicyID) -> EpisodeBatch:
        return self.batches[policy]

    def __iter__(self) -> Iterator[PolicyID]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __repr__(self) -> str:
        parts = ", ".join(f"{p!r}: {b.n_transitions} rows" for p, b in self.batches.items())
        return f"MultiAgentBatch({{{parts}}}, env_steps={self.joint.n_transitions})"

    @property
    def n_transitions(self) -> int:
        """Agent transitions (rows) over every policy: what the quotas count."""
        return sum(b.n_transitions for b in self.batches.values())

    @property
    def n_env_steps(self) -> int:
        """Joint env steps the rows came from."""
        return self.joint.n_transitions

    @property
    def n_env_episodes(self) -> int:
        """Env episodes (or fragments of them) the rows came from."""
        return self.joint.n_episodes

    @classmethod
    def concatenate(cls, *batches: MultiAgentBatch) -> MultiAgentBatch:
        """Join batches end to end, policy by policy."""
        if not batches:
            raise ValueError("Please provide at least one MultiAgentBatch to concatenate")
        policies: dict[PolicyID, list[EpisodeBatch]] = {}
        for batch in batches:
            for policy, rows in batch.batches.items():
                policies.setdefault(policy, []).append(rows)
        return cls(
            {p: EpisodeBatch.concatenate(*parts) for p, parts in policies.items()},
            EpisodeBatch.concatenate(*(b.joint for b in batches)),
        )


def live_rows(joint: EpisodeBatch) -> int:
    """How many agent rows the joint steps of ``joint`` hold (its live slots)."""
    return int(np.count_nonzero(joint.observations["live"]))


def split_joint(
    joint: EpisodeBatch,
    groups: PolicyGroups,
    slots: Sequence[Any],
    memory: BatchMemory | None = None,
) -> MultiAgentBatch:
    """The agent rows of ``joint`` (joint steps of slot envs), one batch per policy.

    Args:
        joint: a sampler's batch of joint steps.
        groups: the agents of each policy and its spaces.
        slots: the env's ``possible_agents`` (a slot's index is its agent's).
        memory: where the big observation and action columns are made (memory the caller's
            earlier batches let go); ``None``: new memory. A policy whose agents are live on
            every joint step gets views of ``joint``'s observations where they lie end to end
            (as the sampler assembles them), no copy.
    """
    live = np.asarray(joint.observations["live"], dtype=bool)
    episode_of = np.repeat(np.arange(joint.n_episodes), joint.lengths)
    ends = np.cumsum(joint.lengths)
    index = {agent: i for i, agent in enumerate(slots)}
    batches: dict[PolicyID, EpisodeBatch] = {}
    for policy, agents in groups.agents_of.items():
        policy_slots = np.asarray([index[a] for a in agents], dtype=np.int64)
        t, j = np.nonzero(live[:, policy_slots])
        if not t.size:
            continue
        order = np.lexsort((t, episode_of[t], j))
        batches[policy] = _policy_rows(
            joint, groups, policy, policy_slots, t[order], j[order], episode_of, ends, slots, memory
        )
    return MultiAgentBatch(batches, joint)


def _policy_rows(
    joint: EpisodeBatch,
    groups: PolicyGroups,
    policy: PolicyID,
    policy_slots: np.ndarray,
    t: np.ndarray,
    j: np.ndarray,
    episode_of: np.ndarray,
    ends: np.ndarray,
    slots: Sequence[Any],
    memory: BatchMemory | None,
) -> EpisodeBatch:
    """The rows of one policy: ``t`` and ``j`` are each row's joint step and policy slot,
    ordered by slot, joint episode and step."""
    s = policy_slots[j]
    episodes = episode_of[t]
    starts = np.ones(len(t), dtype=bool)
    starts[1:] = (episodes[1:] != episodes[:-1]) | (j[1:] != j[:-1])
    first = np.flatnonzero(starts)
    lengths = np.diff(np.append(first, len(t)))
    last = first + lengths - 1
    infos = joint.env_infos
    terminated = infos[TERMINATED][t, s].astype(bool)
    truncated = infos[TRUNCATED][t, s].astype(bool) & ~terminated
    timeout = np.asarray(joint.step_types)[t].astype(np.int64) == StepType.TIMEOUT
    truncated |= timeout & ~terminated
    agent_steps = infos[AGENT_STEPS][t, s].astype(np.int64)
    step_types = np.full(len(t), StepType.MID, dtype=np.int8)
    step_types[agent_steps == 0] = StepType.FIRST
    step_types[truncated] = StepType.TIMEOUT
    step_types[terminated] = StepType.TERMINAL
    agents = joint.observations["agents"]
    per_slot = [agents[k] for k in policy_slots.tolist()]
    # The observation after each segment's last row: the next joint step's, or the last one.
    last_t, last_j = t[last], j[last]
    following = last_t + 1
    at_end = following == ends[episodes[last]]
    closing_slots = [joint.last_observations["agents"][k] for k in policy_slots.tolist()]
    if at_end.all():  # every segment runs to its joint episode's end (fragments, no deaths)
        after = gather_slots(closing_slots, episodes[last], last_j, memory, view=True)
    else:
        after = gather_slots(per_slot, np.where(at_end, 0, following), last_j, memory)
        if at_end.any():
            closing = gather_slots(closing_slots, episodes[last][at_end], last_j[at_end])
            after = tree_map(_put(at_end), after, closing)
    agent_ids = agent_id_column(list(slots))[s]
    episode_infos = {
        k: tree_index(v, episodes[first])
        for k, v in joint.episode_infos.items()
        if k not in (AGENT_INFOS, "_" + AGENT_INFOS)
    }
    episode_infos["agent_id"] = agent_ids[first]
    episode_infos["joint_episode"] = episodes[first]
    env_infos = _own_infos(infos.get(AGENT_INFOS), t, s, slots)
    prefix = f"{policy}/"
    own_infos = {k[len(prefix) :]: v for k, v in joint.agent_infos.items() if k.startswith(prefix)}
    return EpisodeBatch(
        env_spec=EnvSpec(
            groups.observation_spaces[policy],
            groups.action_spaces[policy],
            joint.env_spec.max_episode_length,
        ),
        episode_infos=episode_infos,
        observations=gather_slots(per_slot, t, j, memory, view=True),
        last_observations=after,
        actions=gather_slots([joint.actions[k] for k in policy_slots.tolist()], t, j, memory),
        rewards=infos[REWARDS][t, s].astype(np.float64),
        env_infos=env_infos,
        agent_infos=tree_map(lambda leaf: leaf[t, j], own_infos),
        step_types=step_types,
        lengths=lengths,
        agent_versions=None if joint.agent_versions is None else joint.agent_versions[t],
        agent_ids=agent_ids,
        env_steps=np.asarray(infos[ENV_STEP])[t].astype(np.int64),
        agent_steps=agent_steps,
    )


def _own_infos(own: Any, t: np.ndarray, s: np.ndarray, slots: Sequence[Any]) -> dict[str, Any]:
    """The agents' own infos of each row (``agent_infos[agent]`` at its joint step), by the
    info keys' rule: a key an agent lacks is filled and masked on its rows."""
    if not isinstance(own, Mapping) or not own:
        return {}
    parts: list[dict[str, Any]] = []
    picks: list[np.ndarray] = []
    for slot in np.unique(s).tolist():
        pick = np.flatnonzero(s == slot)
        sub = own.get(str(slots[slot]))
        parts.append({} if sub is None else tree_index(sub, t[pick]))
        picks.append(pick)
    joined = concat_infos(parts, [len(p) for p in picks], "env_infos")
    back = np.empty(len(t), dtype=np.int64)
    back[np.concatenate(picks)] = np.arange(len(t))
    picked: dict[str, Any] = tree_index(joined, back)
    return picked


def _put(mask: np.ndarray) -> Any:
    def put(base: np.ndarray, values: np.ndarray) -> np.ndarray:
        base[mask] = values  # ``base``: a gather's own new array
        return base

    return put
