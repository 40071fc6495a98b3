"""A sampler's calls on a multi-agent env: quotas of agent rows over calls of joint steps.

The sampler's engine counts joint env steps; a multi-agent call's quota counts agent
transitions (rows). :class:`JointCalls` asks the engine for the joint steps it expects to give
the rows still missing (from the rows per joint step seen so far), and asks again, with what is
still missing, until the quota is in: ``obtain_samples`` and ``obtain_fragments`` return at
least ``num_samples`` rows, as they return at least ``num_samples`` transitions of a
single-agent env. ``obtain_exact_episodes`` counts env episodes and takes one engine call.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from asyncsample._memory import BatchMemory
from asyncsample.batch import EnvSpec, EpisodeBatch
from asyncsample.multiagent.joint import MultiAgentBatch, live_rows, split_joint
from asyncsample.multiagent.policies import PolicyGroups, PolicyMapping, group_policies
from asyncsample.multiagent.slots import SlotSpace

__all__ = ["JointCalls", "joint_calls"]

#: An engine call: ``(mode, quota, agent_update, env_update, fraction) -> batch``.
EngineCall = Callable[..., Awaitable[EpisodeBatch]]


class JointCalls:
    """Calls of a sampler whose env is a multi-agent env (module docstring).

    Args:
        groups: the env's agents grouped by policy.
        slots: the env's ``possible_agents``.
    """

    def __init__(
        self, groups: PolicyGroups, slots: Sequence[Any], memory: BatchMemory | None = None
    ) -> None:
        self.groups = groups
        self.slots = tuple(slots)
        self.memory = memory  # the rows' big columns, on memory earlier batches let go
        # Rows per joint step, as seen so far (at first: every slot live, the most).
        self._rows = float(len(self.slots))

    def split(self, joint: EpisodeBatch) -> MultiAgentBatch:
        """The agent rows of a batch of joint steps."""
        return split_joint(joint, self.groups, self.slots, self.memory)

    def steps_for(self, rows: int) -> int:
        """The joint steps expected to give ``rows`` agent rows (rows per step seen so far)."""
        return max(1, math.ceil(rows / self._rows))

    async def rows_of_rounds(
        self, rounds: AsyncIterator[EpisodeBatch], rows: int
    ) -> AsyncIterator[MultiAgentBatch]:
        """A stream's rounds of joint steps, joined until they hold ``rows`` agent rows each."""
        parts: list[EpisodeBatch] = []
        held = 0
        async for joint in rounds:
            parts.append(joint)
            held += live_rows(joint)
            if held >= rows:
                yield self.split(parts[0] if len(parts) == 1 else EpisodeBatch.concatenate(*parts))
                parts, held = [], 0

    async def call(
        self,
        engine: EngineCall,
        mode: str,
        quota: int,
        agent_update: Any,
        env_update: Any,
        fraction: float = 1.0,
    ) -> MultiAgentBatch:
        """One sampler call: ``quota`` rows (``mode`` ``"samples"``/``"fragments"``) or
        ``quota`` env episodes per worker (``"episodes"``)."""
        if mode == "episodes":
            return self.split(await engine(mode, quota, agent_update, env_update, fraction))
        parts: list[EpisodeBatch] = []
        missing = quota
        while missing > 0:
            steps = self.steps_for(missing)
            joint = await engine(mode, steps, agent_update, env_update, fraction)
            agent_update = env_update = None  # applied by the first call
            parts.append(joint)
            rows = live_rows(joint)
            if joint.n_transitions:
                self._rows = max(rows / joint.n_transitions, 1e-3)
            missing -= rows
        return self.split(parts[0] if len(parts) == 1 else EpisodeBatch.concatenate(*parts))


def joint_calls(
    spec: EnvSpec, policy_mapping: PolicyMapping, memory: BatchMemory | None = None
) -> JointCalls | None:
    """The multi-agent calls of a sampler whose env has ``spec``; ``None`` for a single-agent
    env (then a ``policy_mapping`` is refused). ``memory``: the sampler's batch memory.

    Raises:
        ValueError: a ``policy_mapping`` for a single-agent env.
        PolicyMappingError: the mapping does not fit the env.
    """
    space = spec.observation_space
    if not isinstance(space, SlotSpace):
        if policy_mapping is not None:
            raise ValueError(
                "policy_mapping: only for a multi-agent env (a PettingZoo ParallelEnv factory, "
                f"or its async twin); this env's observation space is {space}"
            )
        return None
    agent_spec = space.agent_spec
    return JointCalls(
        group_policies(agent_spec, policy_mapping), agent_spec.possible_agents, memory
    )
