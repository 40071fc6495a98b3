"""Chunks of steps run inside an env host by the host's own copy of the agent (inference="host").

The main process sends one request per chunk (:class:`ChunkRequest`); the host asks its agent for
actions and steps the worker's envs up to ``steps`` times, writing every step's records (the
observation acted on, actions, rewards, flags, final observations of ended episodes) into the
worker's :class:`ChunkBuffers` (shared memory for the ``process`` backend) and replying with a
small :class:`ChunkReply` (agent infos and env infos, pickled only when there are any). The worker
then turns the chunk into the same recorder rows per-step stepping makes (see
:mod:`asyncsample.inference.host`).

The host stops a chunk exactly where per-step stepping would stop the call, so no quota is
overshot: the request carries a copy of the worker's :class:`~asyncsample._engine.StopRule` and
the host applies it before every step and at every episode end, as the worker does.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from asyncsample._action_check import AgentOutputCheck, check_actions, make_action_check
from asyncsample._engine import StopRule
from asyncsample._recorder import put_row, row_of
from asyncsample._tree import Tree, tree_leaves, tree_map
from asyncsample.agent import RandomAgent
from asyncsample.backends._transport import round_trips
from asyncsample.backends.base import agent_note
from asyncsample.env_group import EnvFailure, EnvFailureError, EnvGroup, StepBuffers

__all__ = [
    "ChunkBuffers",
    "ChunkReply",
    "ChunkRequest",
    "ChunkRunner",
    "chunk_capacity",
]

#: Default longest chunk, in worker steps (an agent update waits at most this long to apply).
DEFAULT_CHUNK_STEPS = 64
#: Shared memory a worker's chunk buffers may take at most; long rows get shorter chunks.
CHUNK_BYTES = 8 << 20


@dataclass
class ChunkBuffers:
    """The records of one chunk: every array has leading axes ``(capacity, n_envs)``.

    Attributes:
        obs: the observation each env's action was chosen for, per step.
        final_obs: at a step where an env's episode ended, its true last observation (other
            rows are stale).
        actions, rewards, terminated, truncated: per step, as in
            :class:`~asyncsample.env_group.StepBuffers`.
        capacity: the most steps one chunk can hold.
        progress: one ``int64`` the host bumps after every step of a chunk, never reset (shared
            memory in a process host): the main process reads it to judge each step against
            ``step_timeout`` while the chunk runs.
    """

    obs: Tree
    final_obs: Tree
    actions: Tree
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    capacity: int
    progress: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))

    @classmethod
    def from_flat(
        cls, flat: StepBuffers, capacity: int, n_envs: int, counter: Any = None
    ) -> ChunkBuffers:
        """View step buffers allocated for ``capacity * n_envs`` envs as chunk buffers;
        ``counter``: the memory of the step counter (one ``int64``; default: a local one)."""

        def shape(a: np.ndarray) -> np.ndarray:
            return a.reshape(capacity, n_envs, *a.shape[1:])

        return cls(
            obs=tree_map(shape, flat.obs),
            final_obs=tree_map(shape, flat.final_obs),
            actions=tree_map(shape, flat.actions),
            rewards=shape(flat.rewards),
            terminated=shape(flat.terminated),
            truncated=shape(flat.truncated),
            capacity=capacity,
            progress=np.zeros(1, np.int64) if counter is None else np.frombuffer(counter, np.int64),
        )


def chunk_capacity(
    observation_space: gym.Space[Any], action_space: gym.Space[Any], n_envs: int, steps: int
) -> int:
    """How many steps a worker's chunk buffers hold: ``steps``, fewer if a row is large."""
    probe = StepBuffers.allocate(observation_space, action_space, 1)
    row = sum(a.nbytes for a in tree_leaves(probe.obs)) * 2 + sum(
        a.nbytes for a in tree_leaves(probe.actions)
    )
    row = (row + 10) * n_envs
    return int(max(1, min(steps, CHUNK_BYTES // max(row, 1))))


@dataclass
class ChunkRequest:
    """What the worker asks its host to run.

    Attributes:
        rule: where the worker's part of the call stops (a copy the host may consume).
        steps: the most worker steps to run (at most the chunk capacity).
        counts: per env, rows of its current episode already recorded by the worker.
        active: per env, whether it is stepped.
    """

    rule: StopRule
    steps: int
    counts: np.ndarray
    active: np.ndarray


@dataclass
class ChunkReply:
    """What a host answers for a chunk, besides the shared buffers.

    Attributes:
        steps: worker steps run (the first ``steps`` rows of the chunk buffers are valid).
        agent_infos: per step, the agent infos: either one dict of arrays stacked over the steps
            (every step had the same keys), or a list of ``(step, infos)`` for the steps with any.
        step_infos: by step, ``(env_infos, reset_infos)`` where either is non-empty.
    """

    steps: int
    agent_infos: dict[str, np.ndarray] | list[tuple[int, dict[str, np.ndarray]]] = field(
        default_factory=list
    )
    step_infos: dict[int, tuple[list[dict[str, Any]] | None, dict[int, dict[str, Any]]]] = field(
        default_factory=dict
    )

    def infos_at(self, step: int) -> dict[str, np.ndarray]:
        """The agent infos of ``step``."""
        infos = self.agent_infos
        if isinstance(infos, dict):
            return {k: v[step] for k, v in infos.items()}
        for j, value in infos:  # short lists: only steps with infos are listed
            if j == step:
                return value
        return {}


class AgentFailure(Exception):
    """What an agent raised inside a host, when that exception cannot be pickled."""


def agent_error(exc: Exception, worker: int) -> BaseException:
    """The error to report for ``exc``, raised by the agent of ``worker`` inside its host.

    The original exception itself when it survives pickling (the caller then finds it as the
    ``WorkerError``'s ``__cause__``, as for env errors), marked with a note saying where it was
    raised; else an :class:`AgentFailure` that describes it in text.
    """
    note = agent_note(worker)
    if round_trips(exc):
        if note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)
        return exc
    return AgentFailure(f"{note}: {type(exc).__name__}: {exc}")


class ChunkRunner:
    """One worker slot's agent copy and chunk loop inside an env host.

    Args:
        group: the slot's envs.
        chunk: the slot's chunk buffers.
        action_space: the env's action space (actions are checked against it).
    """

    def __init__(self, group: EnvGroup, chunk: ChunkBuffers, action_space: gym.Space[Any]) -> None:
        self.group = group
        self.chunk = chunk
        self.action_space = action_space
        self.agent: Any = None
        self._output_check = AgentOutputCheck(group.worker, group.n_envs)
        self._action_check = make_action_check(action_space)
        self._trusted = False

    # -- agent ----------------------------------------------------------------------------------

    def install(self, blob: bytes) -> None:
        """Install the agent in ``blob``: ``pickle((cloudpickled agent, seed))``; an agent with
        a ``seed(int)`` method is seeded."""
        agent_blob, seed = pickle.loads(blob)
        agent = pickle.loads(agent_blob)
        seeder = getattr(agent, "seed", None)
        if seed is not None and callable(seeder):
            self._guard(seeder, int(seed))
        self.agent = agent
        self._output_check.forget()
        self._trusted = type(agent) is RandomAgent and agent.action_space == self.action_space

    def set_params(self, blob: bytes) -> None:
        """``agent.set_param_values(params)`` with the parameters pickled in ``blob``."""
        params = pickle.loads(blob)
        setter = getattr(self.agent, "set_param_values", None)
        if setter is None:
            raise TypeError(
                f"agent_update is a parameter set but the agent of worker {self.group.worker} has "
                "no set_param_values"
            )
        self._guard(setter, params)

    def reset_agent(self, mask: np.ndarray) -> None:
        """``agent.reset(mask)``, where the agent has it (episodes start in ``mask``)."""
        reset = getattr(self.agent, "reset", None)
        if reset is not None and mask.any():
            self._guard(reset, mask.copy())

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            error = agent_error(exc, self.group.worker)
            failure = EnvFailure(None, error, traceback.format_exc(), retry=False)
            raise EnvFailureError(failure) from exc

    def _actions(self, observations: Tree) -> tuple[Tree, dict[str, np.ndarray]]:
        result = self.agent.get_actions(observations)
        actions, infos = self._output_check.output(result)
        return self._check_actions(actions), infos

    def _check_actions(self, actions: Tree) -> Tree:
        return check_actions(
            actions,
            self.group.buffers.actions,
            worker=self.group.worker,
            action_space=self.action_space,
            values=None if self._trusted else self._action_check,
        )

    # -- the chunk ------------------------------------------------------------------------------

    def run(self, request: ChunkRequest) -> ChunkReply:
        """Run up to ``request.steps`` worker steps; see the module docstring for where it stops."""
        if self.agent is None:
            raise RuntimeError(f"worker {self.group.worker}: no agent installed in its env host")
        group, chunk = self.group, self.chunk
        buf = group.buffers
        rule = request.rule.copy()
        active = request.active.copy()
        everyone = bool(active.all())
        counts = request.counts.astype(np.int64, copy=True)
        progress = chunk.progress
        infos_per_step: list[dict[str, np.ndarray]] = []
        step_infos: dict[int, tuple[list[dict[str, Any]] | None, dict[int, dict[str, Any]]]] = {}
        steps = 0
        for j in range(min(request.steps, chunk.capacity)):
            if not rule.more(active):
                break
            put_row(chunk.obs, j, buf.obs)
            observations = row_of(chunk.obs, j)
            actions, infos = self._guard(self._actions, observations)
            put_row(chunk.actions, j, actions)
            put_row(buf.actions, Ellipsis, actions)
            infos_per_step.append(infos)
            result = group.step(active)
            progress[0] += 1  # a step ended: the main process judges the next from now
            if result.env_infos is not None or result.reset_infos:
                step_infos[j] = (result.env_infos, result.reset_infos)
            chunk.rewards[j] = buf.rewards
            chunk.terminated[j] = buf.terminated
            chunk.truncated[j] = buf.truncated
            steps = j + 1
            rule.took(1)
            counts += 1
            done = buf.terminated | buf.truncated
            if not everyone:
                done &= active
            if not done.any():
                continue
            index = np.flatnonzero(done)

            def put_final(
                dst: np.ndarray, src: np.ndarray, j: int = j, index: np.ndarray = index
            ) -> None:
                dst[j, index] = src[index]

            tree_map(put_final, chunk.final_obs, buf.final_obs)
            if rule.ended(index, int(counts[index].sum()), active):
                everyone = False
            counts[index] = 0
            self.reset_agent(done)
        return ChunkReply(steps, _pack_infos(infos_per_step), step_infos)


def _pack_infos(
    per_step: list[dict[str, np.ndarray]],
) -> dict[str, np.ndarray] | list[tuple[int, dict[str, np.ndarray]]]:
    """Stack the agent infos when every step has the same keys and shapes; else list them."""
    if not per_step or not per_step[0]:
        return [(j, infos) for j, infos in enumerate(per_step) if infos]
    keys = per_step[0].keys()
    first = per_step[0]
    if all(
        infos.keys() == keys
        and all(infos[k].shape == first[k].shape and infos[k].dtype == first[k].dtype for k in keys)
        for infos in per_step
    ):
        return {k: np.stack([infos[k] for infos in per_step]) for k in keys}
    return [(j, infos) for j, infos in enumerate(per_step) if infos]
