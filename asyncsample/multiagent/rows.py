"""Agents as rows: one policy's agent transitions as numpy columns.

A row is one agent's transition on one joint step of one env. Its key is ``(env, agent,
episode)``: the env's index, the agent's id and the env's episode index (counted per env from
0); the rows of one key, ordered by ``agent_steps``, are that agent's segment of that episode,
its own episode in the sense of :class:`~asyncsample.EpisodeBatch` (see ``docs/multiagent.md``).
Rows are grouped by policy, because only the agents of one policy share their spaces (and so
can be stacked). :class:`AgentRows` holds one group; the row tracker
(:mod:`asyncsample.multiagent.tracker`) makes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np

from asyncsample._infos import concat_infos, stack_infos
from asyncsample._memory import BatchMemory, adjacent_rows
from asyncsample._tree import stack_rows, tree_concat, tree_index, tree_leaves, tree_map
from asyncsample.batch import StepType
from asyncsample.columns import text_array
from asyncsample.multiagent.protocols import AgentID, PolicyID

__all__ = ["AgentRows", "RowKey", "agent_id_column", "stack_tree"]

RowKey: TypeAlias = tuple[int, AgentID, int]
"""A segment's key: ``(env, agent_id, episode)``."""

_INT_COLUMNS = ("envs", "agent_slots", "episodes", "env_steps", "agent_steps")
_ROW_COLUMNS = (*_INT_COLUMNS, "agent_ids", "rewards", "terminations", "truncations")


def stack_tree(rows: Sequence[Any]) -> Any:
    """Rows of one space's values (arrays, scalars, dicts and tuples of them) stacked leaf by
    leaf along a new leading axis."""
    return tree_map(lambda *leaves: stack_rows(leaves), *rows)


def gather_slots(
    trees: Sequence[Any],
    rows: np.ndarray,
    which: np.ndarray,
    memory: BatchMemory | None = None,
    view: bool = False,
) -> Any:
    """Row ``rows[i]`` of tree ``trees[which[i]]`` for every ``i``: the rows of several slots'
    columns (trees of one space, stacked over steps or envs) in one new tree.

    Rows ordered by slot (``which`` sorted) are copied once, each slot's straight into its
    block of the output (``np.take`` into a slice: a memcpy per row, what big observations
    need); other orders take a masked gather per slot. ``memory``: where big outputs are
    made, else ``np.empty``. ``view``: when the rows are every row of every tree in order and
    a leaf's trees lie end to end in memory (the leaves of a batch put together by
    :func:`~asyncsample._assembly.assemble`), that leaf is a view of them, not a copy."""
    bounds = np.searchsorted(which, np.arange(len(trees) + 1)) if _sorted(which) else None
    every = view and bounds is not None and _every_row(trees, rows, bounds)
    empty = np.empty if memory is None else memory.empty

    def leaf(*leaves: np.ndarray) -> np.ndarray:
        if every:
            whole = adjacent_rows(leaves)
            if whole is not None:
                return whole
        out = empty((len(rows), *leaves[0].shape[1:]), leaves[0].dtype)
        for k, array in enumerate(leaves):
            if bounds is not None:
                a, b = int(bounds[k]), int(bounds[k + 1])
                if b > a:
                    # mode="clip": unbuffered (rows are valid indices), 2x "raise"'s speed
                    np.take(array, rows[a:b], axis=0, out=out[a:b], mode="clip")
            else:
                pick = which == k
                out[pick] = array[rows[pick]]
        return out

    return tree_map(leaf, *trees)


def _every_row(trees: Sequence[Any], rows: np.ndarray, bounds: np.ndarray) -> bool:
    """Whether ``rows`` (split by slot at ``bounds``) are ``0..n-1`` of every tree in turn."""
    lengths = [len(tree_leaves(t)[0]) for t in trees]
    if any(int(bounds[k + 1] - bounds[k]) != n for k, n in enumerate(lengths)):
        return False
    expected = np.arange(len(rows)) - np.repeat(bounds[:-1], lengths)
    return bool(np.array_equal(rows, expected))


def _sorted(values: np.ndarray) -> bool:
    return bool(values.size < 2 or (values[1:] >= values[:-1]).all())


def agent_id_column(ids: Sequence[AgentID]) -> np.ndarray:
    """A column of agent ids: a text column when every id is a ``str``, else ``object``."""
    if all(isinstance(i, str) for i in ids):
        return text_array(ids)
    out = np.empty(len(ids), dtype=object)
    out[:] = list(ids)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class AgentRows:
    """The agent transitions of one policy, one row per transition, as columns.

    Every column has one entry per row (a leading axis of length ``len(rows)``; the trees of
    ``Dict``/``Tuple`` spaces have it on every leaf).

    Attributes:
        policy: the policy id whose agents these are.
        envs: ``(R,) int64``, the env's index.
        agent_ids: ``(R,)`` the agent's id (a text column for string ids, else ``object``).
        agent_slots: ``(R,) int64``, the agent's index in the env's ``possible_agents``.
        episodes: ``(R,) int64``, the env's episode index (per env, from 0).
        env_steps: ``(R,) int64``, the joint step of the env's episode the row belongs to
            (from 0): rows of one env with equal ``(episodes, env_steps)`` are one joint step.
        agent_steps: ``(R,) int64``, the row's index in the agent's segment (from 0).
        observations: what the agent observed before acting.
        actions: the action it took.
        rewards: ``(R,) float64``, the reward it got for the step.
        next_observations: what it observed after the step (its last one, for the step that
            ended its segment).
        terminations: ``(R,) bool``, whether the agent was terminated on the step.
        truncations: ``(R,) bool``, whether it was truncated on the step.
        env_infos: the agent's info of the step, stacked per key (keys only some rows carry get
            a ``_key`` mask, as in :class:`~asyncsample.EpisodeBatch`).
        action_masks: ``(R, n) bool``, the action mask the agent acted under, or ``None`` when
            none of these agents had one (absent for some rows: all ``True`` there).
    """

    policy: PolicyID
    envs: np.ndarray
    agent_ids: np.ndarray
    agent_slots: np.ndarray
    episodes: np.ndarray
    env_steps: np.ndarray
    agent_steps: np.ndarray
    observations: Any
    actions: Any
    rewards: np.ndarray
    next_observations: Any
    terminations: np.ndarray
    truncations: np.ndarray
    env_infos: dict[str, Any]
    action_masks: np.ndarray | None

    def __len__(self) -> int:
        return len(self.envs)

    @property
    def step_types(self) -> np.ndarray:
        """``(R,) int8`` :class:`~asyncsample.StepType` of each row within its segment:
        ``TERMINAL`` or ``TIMEOUT`` for the row that ended it, else ``FIRST`` for its first
        row, else ``MID`` (a segment still open ends with ``FIRST`` or ``MID``)."""
        out = np.full(len(self), StepType.MID, dtype=np.int8)
        out[self.agent_steps == 0] = StepType.FIRST
        out[self.truncations] = StepType.TIMEOUT
        out[self.terminations] = StepType.TERMINAL
        return out

    @property
    def dones(self) -> np.ndarray:
        """``(R,) bool``: the row ended its agent's segment (terminated or truncated)."""
        dones: np.ndarray = np.logical_or(self.terminations, self.truncations)
        return dones

    def keys(self) -> list[RowKey]:
        """The ``(env, agent_id, episode)`` key of each row."""
        return list(
            zip(
                self.envs.tolist(),
                self.agent_ids.tolist(),
                self.episodes.tolist(),
                strict=True,
            )
        )

    def segments(self) -> dict[RowKey, np.ndarray]:
        """The row indices of each segment, by key, in the order of the segments' first rows;
        within a segment in ``agent_steps`` order."""
        out: dict[RowKey, list[int]] = {}
        for i, key in enumerate(self.keys()):
            out.setdefault(key, []).append(i)
        steps = self.agent_steps
        return {
            key: np.asarray(sorted(rows, key=lambda i: steps[i]), dtype=np.int64)
            for key, rows in out.items()
        }

    def select(self, index: Any) -> AgentRows:
        """The rows ``index`` picks: a boolean mask, integer indices in the order wanted, or a
        slice."""
        if not isinstance(index, slice):
            index = np.asarray(index)
        infos = {k: tree_index(v, index) for k, v in self.env_infos.items()}
        return dataclasses.replace(
            self,
            **{name: getattr(self, name)[index] for name in _ROW_COLUMNS},
            observations=tree_index(self.observations, index),
            actions=tree_index(self.actions, index),
            next_observations=tree_index(self.next_observations, index),
            env_infos=infos,
            action_masks=None if self.action_masks is None else self.action_masks[index],
        )

    def segment(self, env: int, agent: AgentID, episode: int) -> AgentRows:
        """The rows of one agent's segment, in ``agent_steps`` order (none if it has none)."""
        return self.select(self.segments().get((env, agent, episode), np.zeros(0, np.int64)))

    @classmethod
    def concatenate(cls, *rows: AgentRows) -> AgentRows:
        """The rows of ``rows`` one after the other (all of one policy).

        Raises:
            ValueError: no rows given, or rows of different policies.
        """
        if not rows:
            raise ValueError("AgentRows.concatenate needs at least one AgentRows")
        policies = {r.policy for r in rows}
        if len(policies) > 1:
            raise ValueError(
                f"AgentRows.concatenate joins rows of one policy; got policies {policies}"
            )
        if len(rows) == 1:
            return rows[0]
        masks = [r.action_masks for r in rows]
        if all(m is None for m in masks):
            action_masks = None
        else:
            like = next(m for m in masks if m is not None)
            action_masks = np.concatenate(
                [
                    np.ones((len(r), *like.shape[1:]), bool) if m is None else m
                    for r, m in zip(rows, masks, strict=True)
                ]
            )
        columns = {name: np.concatenate([getattr(r, name) for r in rows]) for name in _ROW_COLUMNS}
        if columns["agent_ids"].dtype != rows[0].agent_ids.dtype:  # text and object ids mixed
            columns["agent_ids"] = agent_id_column(columns["agent_ids"].tolist())
        return cls(
            policy=rows[0].policy,
            **columns,
            observations=tree_concat([r.observations for r in rows]),
            actions=tree_concat([r.actions for r in rows]),
            next_observations=tree_concat([r.next_observations for r in rows]),
            env_infos=concat_infos([r.env_infos for r in rows], [len(r) for r in rows]),
            action_masks=action_masks,
        )

    @classmethod
    def from_transitions(
        cls, policy: PolicyID, transitions: Sequence[Mapping[str, Any]]
    ) -> AgentRows:
        """Rows built from one dict per transition, with a key per column (``env_infos``: the
        agent's info dict; ``action_masks``: its mask or ``None``).

        Raises:
            ValueError: ``transitions`` is empty.
        """
        if not transitions:
            raise ValueError("AgentRows.from_transitions needs at least one transition")
        ints = {
            name: np.asarray([t[name] for t in transitions], dtype=np.int64)
            for name in _INT_COLUMNS
        }
        masks = [t["action_masks"] for t in transitions]
        action_masks = None
        if any(m is not None for m in masks):
            like = np.asarray(next(m for m in masks if m is not None), dtype=bool)
            action_masks = np.stack(
                [np.ones_like(like) if m is None else np.asarray(m, dtype=bool) for m in masks]
            )
        return cls(
            policy=policy,
            **ints,
            agent_ids=agent_id_column([t["agent_ids"] for t in transitions]),
            observations=stack_tree([t["observations"] for t in transitions]),
            actions=stack_tree([t["actions"] for t in transitions]),
            rewards=np.asarray([float(t["rewards"]) for t in transitions], dtype=np.float64),
            next_observations=stack_tree([t["next_observations"] for t in transitions]),
            terminations=np.asarray([bool(t["terminations"]) for t in transitions], dtype=bool),
            truncations=np.asarray([bool(t["truncations"]) for t in transitions], dtype=bool),
            env_infos=stack_infos([t["env_infos"] for t in transitions]),
            action_masks=action_masks,
        )
