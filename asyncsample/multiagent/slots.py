"""A multi-agent env as one env of fixed agent slots: how every backend steps it.

PufferLib's emulation and SuperSuit's vector wrappers give each possible agent a fixed slot and
mark the agents present with a mask. :class:`SlotEnv` (a PettingZoo ``ParallelEnv``) and
:class:`AsyncSlotEnv` (its async twin) do that at the seam between the sampler and the env: each
joint step is one step of a gymnasium env whose observation is every slot's observation (zeros
for an agent that is absent), the mask of the live agents and the Discrete agents' action masks;
whose action is every slot's action (those of absent agents are ignored); and whose info carries
each agent's reward, ``terminated``/``truncated`` flags and step counts as columns. So a
multi-agent env runs on every backend, in the hosts and in the caller, with the hosts' checks,
fault isolation, seeding and zero-copy buffers of single-agent envs; the caller then turns the
joint steps into agent rows (:mod:`asyncsample.multiagent.joint`) in a few numpy passes.

The rules of agents as rows are the :class:`~asyncsample.multiagent.RowTracker`'s: a live agent
acts on every step; one terminated or truncated is done for the rest of the env's episode; one
that appears in a step's observations has joined (its reward on that step belongs to no row);
the env's episode ends when no agent is live. An env that breaks them raises
:class:`~asyncsample.errors.AgentStepError` naming the env's step and the agent, which the
sampler treats as that env's fault.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from asyncsample.async_env import AsyncEnv
from asyncsample.errors import AgentStepError
from asyncsample.multiagent.checks import (
    ParallelEnvSpec,
    check_parallel_env,
    is_async_parallel_env,
    is_parallel_env,
)
from asyncsample.multiagent.protocols import AgentID
from asyncsample.multiagent.tracker import ACTION_MASK

__all__ = ["AsyncSlotEnv", "SlotEnv", "SlotSpace", "as_slot_env"]

#: The info keys of a joint step: each a ``(n_slots,)`` column.
REWARDS, TERMINATED, TRUNCATED, AGENT_STEPS = (
    "agent_rewards",
    "agent_terminated",
    "agent_truncated",
    "agent_steps",
)
#: The info key of the joint step's index in the env's episode (before the step).
ENV_STEP = "env_step"
#: The info key of the agents' own infos (only agents with a non-empty one; absent if none).
AGENT_INFOS = "agent_infos"


class SlotSpace(gym.spaces.Dict):
    """The joint observation space of a :class:`SlotEnv`: ``"agents"`` (a ``Tuple`` of each
    slot's space), ``"live"`` (``MultiBinary(n_slots)``) and, if any agent's action space is
    ``Discrete``, ``"action_mask"`` (``(n_slots, max_n)`` int8; all ones where the env gives
    none). It keeps the env's :class:`~asyncsample.multiagent.ParallelEnvSpec` as ``agent_spec``
    so that the caller can tell a multi-agent env and map slots to agents."""

    def __init__(self, spec: ParallelEnvSpec) -> None:
        agents = spec.possible_agents
        spaces: dict[str, gym.Space[Any]] = {
            "agents": gym.spaces.Tuple([spec.observation_spaces[a] for a in agents]),
            "live": gym.spaces.MultiBinary(len(agents)),
        }
        widths = [_discrete_n(spec.action_spaces[a]) for a in agents]
        if any(widths):
            spaces[ACTION_MASK] = gym.spaces.MultiBinary((len(agents), max(widths)))
        super().__init__(spaces)
        self.agent_spec = spec

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SlotSpace)
            and super().__eq__(other)
            and self.agent_spec.possible_agents == other.agent_spec.possible_agents
        )

    __hash__ = None  # type: ignore[assignment]  # gymnasium's Dict is unhashable too


def _discrete_n(space: gym.Space[Any]) -> int:
    return int(space.n) if isinstance(space, gym.spaces.Discrete) else 0


def _zeros(space: gym.Space[Any]) -> Any:
    """An absent agent's observation: zeros of ``space``'s shape and dtype (a tree for
    ``Dict``/``Tuple`` spaces)."""
    if isinstance(space, gym.spaces.Dict):
        return {k: _zeros(s) for k, s in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        return tuple(_zeros(s) for s in space.spaces)
    if isinstance(space, gym.spaces.Discrete):
        return np.asarray(space.start, dtype=space.dtype)
    return np.zeros(tuple(space.shape or ()), dtype=space.dtype)


class _Slots:
    """The state and rules shared by the blocking and the async slot env."""

    observation_space: gym.Space[Any]
    action_space: gym.Space[Any]

    def __init__(self, env: Any, spec: ParallelEnvSpec) -> None:
        self.env = env
        self.agent_spec = spec
        self.observation_space = SlotSpace(spec)
        self.action_space = gym.spaces.Tuple([spec.action_spaces[a] for a in spec.possible_agents])
        self.metadata = dict(getattr(env, "metadata", None) or {"render_modes": []})
        self.render_mode = getattr(env, "render_mode", None)
        n = len(spec.possible_agents)
        self._n = n
        self._zeros = [_zeros(spec.observation_spaces[a]) for a in spec.possible_agents]
        self._live = np.zeros(n, dtype=bool)
        self._finished = np.zeros(n, dtype=bool)
        self._steps = np.zeros(n, dtype=np.int64)
        self._env_step = 0
        self._episode = -1
        self._obs: list[Any] = list(self._zeros)
        widths = [_discrete_n(spec.action_spaces[a]) for a in spec.possible_agents]
        self._mask = np.ones((n, max(widths)), dtype=np.int8) if any(widths) else None

    def _where(self) -> str:
        return f"episode {self._episode}, step {self._env_step}"

    def _slot(self, agent: AgentID, where: str) -> int:
        try:
            return self.agent_spec.index(agent)
        except (KeyError, TypeError):
            raise AgentStepError(
                f"{self._where()}: {where} hold agent {agent!r}, which is not one of the env's "
                f"possible_agents {list(self.agent_spec.possible_agents)}",
                env=0,
                agent=agent,
            ) from None

    def _observe(self, slot: int, obs: Any, info: Any) -> None:
        self._obs[slot] = obs
        if self._mask is not None:
            mask = None
            if isinstance(obs, Mapping) and ACTION_MASK in obs:
                mask = obs[ACTION_MASK]
            elif isinstance(info, Mapping) and ACTION_MASK in info:
                mask = info[ACTION_MASK]
            row = self._mask[slot]
            row[:] = 1
            if mask is not None:
                flat = np.asarray(mask, dtype=np.int8).reshape(-1)
                row[: flat.shape[0]] = flat

    def _joint_obs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"agents": tuple(self._obs), "live": self._live.astype(np.int8)}
        if self._mask is not None:
            out[ACTION_MASK] = self._mask.copy()
        return out

    def _after_reset(self, result: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        observations, infos = result
        if not isinstance(observations, Mapping) or not observations:
            raise AgentStepError(
                f"reset returned {type(observations).__name__} {observations!r:.80} as the "
                "observations: expected a non-empty dict keyed by agent id",
                env=0,
            )
        slots = {a: self._slot(a, "reset's observations") for a in observations}
        self._episode += 1
        self._env_step = 0
        self._live[:] = False
        self._finished[:] = False
        self._steps[:] = 0
        self._obs = list(self._zeros)
        for agent, obs in observations.items():
            self._live[slots[agent]] = True
            self._observe(slots[agent], obs, _info(infos, agent))
        return self._joint_obs(), _agent_infos(infos)

    def _actions(self, actions: Any) -> dict[AgentID, Any]:
        agents = self.agent_spec.possible_agents
        return {agents[s]: actions[s] for s in np.flatnonzero(self._live).tolist()}

    def _after_step(self, result: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        observations, rewards, terminations, truncations, infos = result
        spec, n = self.agent_spec, self._n
        agents = spec.possible_agents
        acted = np.flatnonzero(self._live).tolist()
        reward_col = np.zeros(n, dtype=np.float64)
        term_col = np.zeros(n, dtype=bool)
        trunc_col = np.zeros(n, dtype=bool)
        for slot in acted:
            agent = agents[slot]
            try:
                reward_col[slot] = rewards[agent]
                term_col[slot] = bool(terminations[agent])
                trunc_col[slot] = bool(truncations[agent])
                obs = observations[agent]
            except KeyError as exc:
                raise AgentStepError(
                    f"{self._where()}: live agent {agent!r} is missing from the step's "
                    f"{_missing(exc, observations, rewards, terminations, truncations)}",
                    env=0,
                    agent=agent,
                ) from None
            self._obs[slot] = obs
        info = {
            REWARDS: reward_col,
            TERMINATED: term_col,
            TRUNCATED: trunc_col,
            AGENT_STEPS: self._steps.copy(),
            ENV_STEP: self._env_step,
        }
        done = term_col | trunc_col
        self._steps[acted] += 1
        self._live[done] = False
        self._finished[done] = True
        for slot in acted:
            if not done[slot]:
                self._observe(slot, self._obs[slot], _info(infos, agents[slot]))
        for agent, obs in observations.items():
            slot = self._slot(agent, "the step's observations")
            if self._live[slot] or done[slot]:
                continue
            if self._finished[slot]:
                raise AgentStepError(
                    f"{self._where()}: agent {agent!r} is back after it was done in this "
                    "episode (an agent cannot be revived)",
                    env=0,
                    agent=agent,
                )
            if bool(terminations.get(agent, False)) or bool(truncations.get(agent, False)):
                self._finished[slot] = True  # joined and done at once: no segment
                continue
            self._live[slot] = True
            self._steps[slot] = 0
            self._observe(slot, obs, _info(infos, agent))
        for slot in np.flatnonzero(~self._live).tolist():
            if not done[slot]:
                self._obs[slot] = self._zeros[slot]
        extra = _agent_infos(infos)
        if extra:
            info.update(extra)
        self._env_step += 1
        ended = not self._live.any()
        terminated = ended and bool(term_col.any())
        return (
            self._joint_obs(),
            float(reward_col.sum()),
            terminated,
            ended and not terminated,
            info,
        )

    @property
    def unwrapped(self) -> Any:
        return self

    def render(self) -> Any:
        return self.env.render()

    def __str__(self) -> str:
        return f"<{type(self).__name__}{self.env}>"


def _info(infos: Any, agent: AgentID) -> Any:
    return infos.get(agent) if isinstance(infos, Mapping) else None


def _agent_infos(infos: Any) -> dict[str, Any]:
    """The agents' own infos beyond their action masks, under one key (``{}`` if none)."""
    if not isinstance(infos, Mapping):
        return {}
    kept = {}
    for agent, info in infos.items():
        if isinstance(info, Mapping) and info:
            rest = {k: v for k, v in info.items() if k != ACTION_MASK}
            if rest:
                kept[agent] = rest
    return {AGENT_INFOS: kept} if kept else {}


def _missing(exc: KeyError, *dicts: Mapping[Any, Any]) -> str:
    names = ("observations", "rewards", "terminations", "truncations")
    agent = exc.args[0] if exc.args else None
    return next((n for n, d in zip(names, dicts, strict=True) if agent not in d), "results")


class SlotEnv(_Slots, gym.Env[dict[str, Any], tuple[Any, ...]]):
    """A PettingZoo ``ParallelEnv`` as a gymnasium env of fixed agent slots (module docstring).

    Args:
        env: the multi-agent env.
    """

    def __init__(self, env: Any) -> None:
        _Slots.__init__(self, env, check_parallel_env(env))

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Reset the env; the joint observation and the agents' infos."""
        return self._after_reset(self.env.reset(seed=seed, options=options))

    def step(
        self, action: tuple[Any, ...]
    ) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """One joint step: the live agents' actions from their slots of ``action``."""
        return self._after_step(self.env.step(self._actions(action)))

    def close(self) -> None:
        """Close the env."""
        self.env.close()


class AsyncSlotEnv(_Slots, AsyncEnv[dict[str, Any], tuple[Any, ...]]):
    """The async twin of :class:`SlotEnv`: for an env whose ``reset``/``step`` are coroutines
    over agent dicts."""

    def __init__(self, env: Any) -> None:
        _Slots.__init__(self, env, check_parallel_env(env))

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Reset the env; the joint observation and the agents' infos."""
        return self._after_reset(await self.env.reset(seed=seed, options=options))

    async def step(
        self, action: tuple[Any, ...]
    ) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """One joint step: the live agents' actions from their slots of ``action``."""
        return self._after_step(await self.env.step(self._actions(action)))

    async def close(self) -> None:
        """Close the env (awaited if its ``close`` is a coroutine)."""
        result = self.env.close()
        if hasattr(result, "__await__"):
            await result


def as_slot_env(obj: Any) -> Any:
    """``obj`` as the sampler steps it: a multi-agent env (a ``ParallelEnv``, or its async
    twin) in a :class:`SlotEnv` (or :class:`AsyncSlotEnv`); anything else unchanged."""
    if isinstance(obj, (gym.Env, AsyncEnv, _Slots)):
        return obj
    if is_async_parallel_env(obj):
        return AsyncSlotEnv(obj)
    if is_parallel_env(obj):
        return SlotEnv(obj)
    return obj
