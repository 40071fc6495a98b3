"""The reference loop: one env stepped by a plain loop, its rows as the tracker cuts them.

:func:`reference_rollout` is what every backend's multi-agent batches are to equal for a fixed
seed and the same actions: no workers, no hosts, no concurrency. It builds one env, resets it
with ``seed`` (later resets get no seed: gymnasium's convention, as the sampler's), asks
``actions_fn`` for the live agents' actions on each joint step, steps the env, and hands every
step to a :class:`~asyncsample.multiagent.RowTracker`; an env whose episode ended is reset
before the next step. A blocking ParallelEnv is awaited through
:class:`~asyncsample.multiagent.AsyncParallelAdapter`, so blocking and async envs take one path.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from asyncsample.async_env import close_env
from asyncsample.multiagent.adapters import as_async_parallel_env
from asyncsample.multiagent.checks import ParallelEnvSpec, check_parallel_env_factory
from asyncsample.multiagent.policies import PolicyMapping
from asyncsample.multiagent.protocols import AgentID, PolicyID
from asyncsample.multiagent.rows import AgentRows
from asyncsample.multiagent.tracker import RowTracker

__all__ = ["RandomActions", "Rollout", "Turn", "areference_rollout", "reference_rollout"]


@dataclasses.dataclass(frozen=True)
class Turn:
    """What an ``actions_fn`` is shown before a joint step.

    Attributes:
        spec: the env's spec (its agents' spaces).
        episode: the env's episode index (from 0).
        env_step: the joint step about to be taken in that episode (from 0).
        observations: the observation of each live agent (each needs an action).
        action_masks: each live agent's action mask, ``None`` where it has none.
    """

    spec: ParallelEnvSpec
    episode: int
    env_step: int
    observations: dict[AgentID, Any]
    action_masks: dict[AgentID, np.ndarray | None]


ActionsFn = Callable[[Turn], Mapping[AgentID, Any]]
"""Gives one action per live agent of a :class:`Turn`."""


@dataclasses.dataclass(frozen=True)
class Rollout:
    """What a reference rollout recorded.

    Attributes:
        spec: the env's spec.
        rows: every row, by policy (policies in the order of their first agent), each policy's
            rows in step order.
        joint_steps: the joint steps taken (``n_steps``).
        env_episodes: the env episodes that ended within them.
    """

    spec: ParallelEnvSpec
    rows: dict[PolicyID, AgentRows]
    joint_steps: int
    env_episodes: int


class RandomActions:
    """An ``actions_fn`` that samples each live agent's action space, seeded.

    Each agent samples its own copy of its action space, seeded from ``seed`` and its slot, so
    the actions depend only on ``seed`` and the turns. A ``Discrete`` agent with an action mask
    samples among the allowed actions only.

    Args:
        spec: the env's spec.
        seed: the seed of every agent's sampling.
    """

    def __init__(self, spec: ParallelEnvSpec, seed: int | None = 0) -> None:
        seeds = np.random.SeedSequence(seed).spawn(len(spec.possible_agents))
        self._spaces: dict[AgentID, gym.Space[Any]] = {}
        for agent, child in zip(spec.possible_agents, seeds, strict=True):
            space = copy.deepcopy(spec.action_spaces[agent])
            space.seed(int(child.generate_state(1)[0]))
            self._spaces[agent] = space

    def __call__(self, turn: Turn) -> dict[AgentID, Any]:
        """One sampled action per live agent of ``turn``."""
        actions: dict[AgentID, Any] = {}
        for agent in turn.observations:
            space, mask = self._spaces[agent], turn.action_masks.get(agent)
            if mask is not None and isinstance(space, gym.spaces.Discrete):
                actions[agent] = space.sample(mask=mask.astype(np.int8))
            else:
                actions[agent] = space.sample()
        return actions


async def areference_rollout(
    env_fn: Callable[[], Any],
    seed: int | None,
    actions_fn: ActionsFn,
    n_steps: int,
    *,
    policy_mapping: PolicyMapping = None,
    max_episode_length: int | None = None,
    options: dict[str, Any] | None = None,
) -> Rollout:
    """Step one env from ``env_fn`` for ``n_steps`` joint steps; return its rows.

    Args:
        env_fn: a zero-argument factory of a ParallelEnv or its async twin.
        seed: the first reset's seed (later resets get none).
        actions_fn: gives the live agents' actions for each joint step (:class:`Turn`).
        n_steps: how many joint steps to take (resets in between do not count).
        policy_mapping: agent id -> policy id, for grouping the rows.
        max_episode_length: the most joint steps of an episode (then its live agents are
            truncated and the env is reset), or ``None``.
        options: every reset's ``options``.

    Raises:
        ValueError: ``n_steps`` is not an int >= 0.
        ParallelEnvError: ``env_fn`` does not build a ParallelEnv.
        AgentStepError: the env (or ``actions_fn``) broke a rule of agents as rows.
    """
    if isinstance(n_steps, bool) or not isinstance(n_steps, int | np.integer) or n_steps < 0:
        raise ValueError(f"n_steps: expected an int >= 0; got {n_steps!r}")
    made, spec = check_parallel_env_factory(env_fn, "env_fn")
    env = as_async_parallel_env(made, name="env_fn()")
    try:
        tracker = RowTracker(
            spec, 1, policy_mapping=policy_mapping, max_episode_length=max_episode_length
        )
        parts: dict[PolicyID, list[AgentRows]] = {p: [] for p in tracker.groups.policies}
        ended = 0
        observations, infos = await env.reset(seed=seed, options=options)
        tracker.reset(0, observations, infos)
        for _ in range(n_steps):
            if not tracker.running[0]:
                observations, infos = await env.reset(seed=None, options=options)
                tracker.reset(0, observations, infos)
            turn = Turn(
                spec=spec,
                episode=int(tracker.episodes[0]),
                env_step=int(tracker.env_steps[0]),
                observations=tracker.observations(0),
                action_masks=tracker.action_masks(0),
            )
            actions = dict(actions_fn(turn))
            outcome = tracker.step(0, actions, *(await env.step(actions)))
            for policy, rows in outcome.rows.items():
                parts[policy].append(rows)
            ended += len(outcome.ended)
    finally:
        await close_env(env)
    by_policy = {p: AgentRows.concatenate(*chunks) for p, chunks in parts.items() if chunks}
    return Rollout(spec=spec, rows=by_policy, joint_steps=n_steps, env_episodes=ended)


def reference_rollout(
    env_fn: Callable[[], Any],
    seed: int | None,
    actions_fn: ActionsFn,
    n_steps: int,
    *,
    policy_mapping: PolicyMapping = None,
    max_episode_length: int | None = None,
    options: dict[str, Any] | None = None,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> Rollout:
    """:func:`areference_rollout` run to completion on an event loop of its own (made by
    ``loop_factory``, asyncio's default when ``None``); from a coroutine, await
    :func:`areference_rollout` instead.

    Raises:
        RuntimeError: called from a thread whose event loop is running.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "reference_rollout runs an event loop of its own and cannot be called from a "
            "running one: await areference_rollout(...) instead"
        )
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(
            areference_rollout(
                env_fn,
                seed,
                actions_fn,
                n_steps,
                policy_mapping=policy_mapping,
                max_episode_length=max_episode_length,
                options=options,
            )
        )
