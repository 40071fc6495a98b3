"""Batch data types: :class:`StepType`, :class:`EnvSpec` and :class:`EpisodeBatch`.

The layout is garage's (docs/contract.md, "The EpisodeBatch layout"); the info-key rule is
implemented in :mod:`asyncsample._infos` and the field checks in :mod:`asyncsample._batch_checks`.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import gymnasium
import numpy as np

from asyncsample._batch_checks import check_fields
from asyncsample._infos import (
    MISSING,
    as_info_arrays,
    concat_infos,
    fill_value,
    filled,
    key_rows,
    mask_key,
    stack_column,
    stack_infos,
)
from asyncsample._tree import tree_concat, tree_equal, tree_index, tree_leaves, tree_map
from asyncsample.columns import RaggedArray, is_text

# The info helpers live in ``_infos``; they stay importable from here, where they always were.
__all__ = [
    "MISSING",
    "EnvSpec",
    "EpisodeBatch",
    "StepType",
    "concat_infos",
    "fill_value",
    "filled",
    "key_rows",
    "mask_key",
    "stack_column",
    "stack_infos",
]

ArrayTree: TypeAlias = Any
"""A numpy array, or a dict/tuple of them (nested freely), each with a leading batch axis."""


class StepType(enum.IntEnum):
    """Where a transition sits in its episode.

    ``FIRST``: the first transition (unless also the last); ``TERMINAL``: the last one of an
    episode that ended in a terminal state; ``TIMEOUT``: the last one of an episode cut by a time
    limit; ``MID``: everything else (including the last transition of a fragment).
    """

    FIRST = 0
    MID = 1
    TERMINAL = 2
    TIMEOUT = 3

    @classmethod
    def get_step_type(cls, step_cnt: int, max_episode_length: int | None, done: bool) -> StepType:
        """The step type of the ``step_cnt``-th transition (from 1) of an episode; reaching
        ``max_episode_length`` gives ``TIMEOUT`` even when ``done`` is set, as in garage.

        Raises:
            ValueError: ``step_cnt`` is below 1.
        """
        if max_episode_length is not None and step_cnt >= max_episode_length:
            return cls.TIMEOUT
        if done:
            return cls.TERMINAL
        if step_cnt == 1:
            return cls.FIRST
        if step_cnt < 1:
            raise ValueError(
                f"Expect step_cnt to be >= 1, but got {step_cnt} instead. Did you forget to "
                "call `reset()`?"
            )
        return cls.MID


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """What a batch's observations and actions look like, and the episode time limit.

    Attributes:
        max_episode_length: the time limit the sampler enforces, or ``None``; padded views of
            an :class:`EpisodeBatch` pad to it.
    """

    observation_space: gymnasium.Space[Any]
    action_space: gymnasium.Space[Any]
    max_episode_length: int | None = None


def _pad(array: Any, lengths: np.ndarray, length: int, *, absent: bool = False) -> Any:
    """Scatter a flat ``(T, ...)`` array into ``(N, length, ...)``, padded with zeros (or the
    :func:`fill_value` with ``absent``, for masked info keys); a text column pads with ``""``,
    a ragged one (:class:`~asyncsample.columns.RaggedArray`) becomes one of ``N * length`` rows,
    episode-major, padded with empty rows."""
    if isinstance(array, RaggedArray):
        index = np.full(len(lengths) * length, len(array), dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        episode = np.repeat(np.arange(len(lengths)), lengths)
        position = np.arange(len(array)) - np.repeat(starts, lengths)
        index[episode * length + position] = np.arange(len(array))
        empty = RaggedArray(array.values[:0], np.zeros(2, dtype=np.int64))
        return RaggedArray.concatenate([array, empty]).take(index)
    if array.dtype == object and is_text(array):
        absent = False
        out = np.empty((len(lengths), length, *array.shape[1:]), dtype=object)
        out[...] = ""
        if array.shape[0]:
            episode = np.repeat(np.arange(len(lengths)), lengths)
            position = np.arange(array.shape[0]) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            out[episode, position] = array
        return out
    shape = (len(lengths), length, *array.shape[1:])
    out = filled(shape, array.dtype) if absent else np.zeros(shape, dtype=array.dtype)
    if array.shape[0]:
        episode = np.repeat(np.arange(len(lengths)), lengths)
        starts = np.cumsum(lengths) - lengths
        position = np.arange(array.shape[0]) - np.repeat(starts, lengths)
        out[episode, position] = array
    return out


def _as_leaf(value: Any) -> Any:
    """A path's leaf as a column: a ragged one as it is, else an array."""
    return value if isinstance(value, RaggedArray) else np.asarray(value)


#: The optional ``(T,)`` columns of a batch, one entry per row.
ROW_COLUMNS = ("agent_versions", "agent_ids", "env_steps", "agent_steps")


def _row_column(name: str, values: Any) -> np.ndarray:
    """A path's row column as an array (integers for all but ``agent_ids``)."""
    return np.asarray(values) if name == "agent_ids" else np.asarray(values, dtype=np.int64)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class EpisodeBatch:
    """A batch of episodes laid end to end along one time axis (garage's layout).

    ``T`` is the number of transitions (``lengths.sum()``) and ``N`` the number of episodes.
    Fields are stored as given (no copies); construction validates them and raises
    ``ValueError`` naming the offending field. ``==`` is identity; :meth:`equals` compares
    contents.

    Info keys are never dropped (see [Info keys](contract.md#info-keys)): a key absent on some
    steps (or episodes) holds its fill value there (:func:`fill_value`: NaN for floats, ``None``
    for objects, else zero) and a boolean ``"_" + key`` mask, true where present (nested dicts
    key by key); a key only on episodes' last steps moves to ``episode_infos``.

    Attributes:
        env_spec: spaces of the observations and actions, and the episode time limit.
        episode_infos: per-episode info, a dict of ``(N, ...)`` arrays: the reset info,
            ``worker``, ``env``, ``agent_version``, and the keys only on episodes' last steps.
        observations: ``(T, ...)`` observation before each action (an array or dict/tuple tree).
        last_observations: ``(N, ...)`` observation after the last action of each episode.
        actions: ``(T, ...)`` actions (an array or dict/tuple tree).
        rewards: ``(T,)`` rewards.
        env_infos: per-step info from the env, dict of ``(T, ...)`` arrays (may nest dicts).
        agent_infos: per-step info from the agent, dict of ``(T, ...)`` arrays (may nest dicts).
        step_types: ``(T,)`` :class:`StepType` values (an object array of members or integers).
        lengths: ``(N,)`` integer length of each episode, each at least 1.
        agent_versions: ``(T,)`` the agent version each step was taken under, or ``None`` where
            unknown (a batch built by hand).
        agent_ids: multi-agent envs: ``(T,)`` the agent id of each row (``None`` for a
            single-agent env); each episode is then one agent's segment.
        env_steps: multi-agent envs: ``(T,)`` the index of the env's joint step each row is
            part of, counted from 0 in the env's episode (rows of one joint step share it).
        agent_steps: multi-agent envs: ``(T,)`` each row's index in its agent's segment.
    """

    env_spec: EnvSpec
    episode_infos: dict[str, Any]
    observations: ArrayTree
    last_observations: ArrayTree
    actions: ArrayTree
    rewards: np.ndarray
    env_infos: dict[str, Any]
    agent_infos: dict[str, Any]
    step_types: np.ndarray
    lengths: np.ndarray
    agent_versions: np.ndarray | None = None
    agent_ids: np.ndarray | None = None
    env_steps: np.ndarray | None = None
    agent_steps: np.ndarray | None = None

    def __post_init__(self) -> None:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        spec = fields.pop("env_spec")
        check_fields(StepType, spec.observation_space, spec.action_space, **fields)

    def __repr__(self) -> str:
        return (
            f"EpisodeBatch(n_episodes={self.n_episodes}, n_transitions={self.n_transitions}, "
            f"env_infos={list(self.env_infos)}, agent_infos={list(self.agent_infos)}, "
            f"episode_infos={list(self.episode_infos)})"
        )

    @property
    def n_transitions(self) -> int:
        """Number of transitions ``T`` in the batch."""
        return int(self.rewards.shape[0])

    @property
    def n_episodes(self) -> int:
        """Number of episodes (or fragments) ``N`` in the batch."""
        return int(self.lengths.shape[0])

    @property
    def episode_slices(self) -> list[slice]:
        """The slice of the time axis each episode occupies."""
        bounds = [0, *np.cumsum(self.lengths).tolist()]
        return [slice(a, b) for a, b in itertools.pairwise(bounds)]

    @property
    def episode_infos_by_episode(self) -> dict[str, Any]:
        """Per-episode info (the same object as :attr:`episode_infos`), leading dimension ``N``."""
        return self.episode_infos

    @property
    def episode_infos_by_step(self) -> dict[str, Any]:
        """Per-episode info repeated for every step of its episode, leading dimension ``T``."""
        by_step: dict[str, Any] = tree_map(
            lambda x: np.repeat(x, self.lengths, axis=0), self.episode_infos
        )
        return by_step

    @property
    def returns(self) -> np.ndarray:
        """Undiscounted return of each episode, ``(N,)`` float64."""
        if not self.n_episodes:
            return np.zeros(0, dtype=np.float64)
        starts = np.cumsum(self.lengths) - self.lengths
        return np.add.reduceat(self.rewards.astype(np.float64), starts)

    @property
    def next_observations(self) -> ArrayTree:
        """The observation after each action, ``(T, ...)``: the next step's, or the last one."""
        ends = np.cumsum(self.lengths) - 1
        n = self.n_transitions
        following = np.arange(1, n + 1)
        following[ends] = n + np.arange(self.n_episodes)  # the last observations, after obs

        def shift(obs: Any, last: Any) -> Any:
            if isinstance(obs, RaggedArray):
                return RaggedArray.concatenate([obs, last]).take(following)
            out = np.empty_like(obs)
            out[:-1] = obs[1:]
            out[ends] = last
            return out

        return tree_map(shift, self.observations, self.last_observations)

    @property
    def observations_list(self) -> list[ArrayTree]:
        """The observations of each episode, one entry per episode."""
        return [tree_index(self.observations, s) for s in self.episode_slices]

    @property
    def actions_list(self) -> list[ArrayTree]:
        """The actions of each episode, one entry per episode."""
        return [tree_index(self.actions, s) for s in self.episode_slices]

    def _padded_length(self) -> int:
        """The time limit, or the longest episode if longer or unlimited."""
        longest = int(self.lengths.max()) if self.n_episodes else 0
        limit = self.env_spec.max_episode_length
        if limit is None:
            return longest
        if longest > limit:
            warnings.warn(
                f"The longest episode ({longest} steps) exceeds max_episode_length ({limit}); "
                f"padding to {longest} instead",
                UserWarning,
                stacklevel=3,
            )
            return longest
        return int(limit)

    def _pad_tree(self, tree: ArrayTree) -> ArrayTree:
        length = self._padded_length()
        return tree_map(lambda x: _pad(x, self.lengths, length), tree)

    @property
    def padded_observations(self) -> ArrayTree:
        """Observations as ``(N, L, ...)``, zero after each episode's end."""
        return self._pad_tree(self.observations)

    @property
    def padded_actions(self) -> ArrayTree:
        """Actions as ``(N, L, ...)``, zero after each episode's end."""
        return self._pad_tree(self.actions)

    @property
    def padded_rewards(self) -> np.ndarray:
        """Rewards as ``(N, L)``, zero after each episode's end."""
        padded: np.ndarray = _pad(self.rewards, self.lengths, self._padded_length())
        return padded

    @property
    def padded_next_observations(self) -> ArrayTree:
        """Next observations as ``(N, L, ...)``, zero after each episode's end."""
        return self._pad_tree(self.next_observations)

    @property
    def padded_step_types(self) -> np.ndarray:
        """Step types as ``(N, L)`` (same dtype as :attr:`step_types`), zero-padded."""
        padded: np.ndarray = _pad(self.step_types, self.lengths, self._padded_length())
        return padded

    def _pad_infos(self, infos: Mapping[str, Any], absent: bool = False) -> dict[str, Any]:
        """Pad an info dict: masks with False, masked keys with their fill value, else zero."""
        length = self._padded_length()
        out: dict[str, Any] = {}
        for key, value in infos.items():
            masked = absent or mask_key(key) in infos
            if isinstance(value, Mapping):
                out[key] = self._pad_infos(value, masked)
            else:
                out[key] = _pad(value, self.lengths, length, absent=masked)
        return out

    @property
    def padded_agent_infos(self) -> dict[str, Any]:
        """Agent infos as ``(N, L, ...)``; a masked key pads with its fill value, its mask False."""
        return self._pad_infos(self.agent_infos)

    @property
    def padded_env_infos(self) -> dict[str, Any]:
        """Env infos with every array as ``(N, L, ...)``, padded like :attr:`padded_agent_infos`."""
        return self._pad_infos(self.env_infos)

    @property
    def valids(self) -> np.ndarray:
        """``(N, L)`` mask, one where a padded step is real (the dtype of :attr:`rewards`)."""
        padded: np.ndarray = _pad(np.ones_like(self.rewards), self.lengths, self._padded_length())
        return padded

    @classmethod
    def concatenate(cls, *batches: EpisodeBatch) -> EpisodeBatch:
        """Join batches end to end, episodes in argument order (the first batch's ``env_spec``).

        A key that some batches lack is filled there and masked; keys are not moved between
        ``episode_infos`` and ``env_infos``.

        Raises:
            ValueError: if no batch is given, or an info key is a dict in one batch and an array
                in another.
        """
        if not batches:
            raise ValueError("Please provide at least one EpisodeBatch to concatenate")
        steps = [b.n_transitions for b in batches]
        episodes = [b.n_episodes for b in batches]
        env_infos = concat_infos([b.env_infos for b in batches], steps, "env_infos")
        agent_infos = concat_infos([b.agent_infos for b in batches], steps, "agent_infos")
        episode_infos = concat_infos([b.episode_infos for b in batches], episodes, "episode_infos")
        return cls(
            env_spec=batches[0].env_spec,
            episode_infos=episode_infos,
            observations=tree_concat([b.observations for b in batches]),
            last_observations=tree_concat([b.last_observations for b in batches]),
            actions=tree_concat([b.actions for b in batches]),
            rewards=np.concatenate([b.rewards for b in batches]),
            env_infos=env_infos,
            agent_infos=agent_infos,
            step_types=np.concatenate([b.step_types for b in batches]),
            lengths=np.concatenate([b.lengths for b in batches]),
            **{
                name: (
                    None
                    if any(getattr(b, name) is None for b in batches)
                    else np.concatenate([getattr(b, name) for b in batches])
                )
                for name in ROW_COLUMNS
            },
        )

    def split(self) -> list[EpisodeBatch]:
        """One single-episode batch per episode, in order. The arrays are views into this one."""
        return [self._take(slice(i, i + 1), s) for i, s in enumerate(self.episode_slices)]

    def select(self, episodes: np.ndarray | Sequence[int]) -> EpisodeBatch:
        """A batch of the chosen episodes (a boolean mask or indices over episodes), in order."""
        chosen = np.asarray(episodes)
        if chosen.dtype == bool:
            chosen = np.flatnonzero(chosen)
        slices = self.episode_slices
        ranges = [np.arange(slices[i].start, slices[i].stop) for i in chosen.tolist()]
        steps = np.concatenate([*ranges, np.zeros(0, dtype=np.int64)])
        return self._take(chosen, steps)

    def _take(self, episodes: Any, steps: Any) -> EpisodeBatch:
        """The batch of ``episodes``, whose steps are ``steps`` (slices give views)."""
        return EpisodeBatch(
            env_spec=self.env_spec,
            episode_infos=tree_index(self.episode_infos, episodes),
            observations=tree_index(self.observations, steps),
            last_observations=tree_index(self.last_observations, episodes),
            actions=tree_index(self.actions, steps),
            rewards=self.rewards[steps],
            env_infos=tree_index(self.env_infos, steps),
            agent_infos=tree_index(self.agent_infos, steps),
            step_types=self.step_types[steps],
            lengths=self.lengths[episodes],
            **{
                name: None if (column := getattr(self, name)) is None else column[steps]
                for name in ROW_COLUMNS
            },
        )

    def to_list(self) -> list[dict[str, Any]]:
        """One dict per episode, in garage's path format (:meth:`from_list` turns it back).

        Keys: ``episode_infos``, ``observations``, ``next_observations``, ``actions``,
        ``rewards``, ``env_infos``, ``agent_infos``, ``step_types`` and, when the batch has them,
        ``agent_versions``, ``agent_ids``, ``env_steps`` and ``agent_steps``.
        """
        next_obs = self.next_observations
        paths = []
        for i, steps in enumerate(self.episode_slices):
            path = {
                "episode_infos": tree_index(self.episode_infos, i),
                "observations": tree_index(self.observations, steps),
                "next_observations": tree_index(next_obs, steps),
                "actions": tree_index(self.actions, steps),
                "rewards": self.rewards[steps],
                "env_infos": tree_index(self.env_infos, steps),
                "agent_infos": tree_index(self.agent_infos, steps),
                "step_types": self.step_types[steps],
            }
            for name in ROW_COLUMNS:
                if (column := getattr(self, name)) is not None:
                    path[name] = column[steps]
            paths.append(path)
        return paths

    @classmethod
    def from_list(cls, env_spec: EnvSpec, paths: Sequence[Mapping[str, Any]]) -> EpisodeBatch:
        """Build a batch from garage-style path dicts, one per episode.

        Each path needs ``observations``, ``actions`` and ``rewards``. With one more observation
        than rewards, the extra one is the last observation; else it is the last
        ``next_observations`` entry if present, else the last observation repeated. Step types
        come from ``step_types``, else from ``dones`` (:meth:`StepType.get_step_type`).
        ``env_infos``/``agent_infos`` (dicts of arrays or lists of per-step dicts),
        ``episode_infos`` and the row columns (``agent_versions``, ``agent_ids``, ``env_steps``,
        ``agent_steps``) are optional; keys only some paths carry are
        filled and masked as in :meth:`concatenate`.

        Raises:
            ValueError: if ``paths`` is empty or a path lacks step types and dones.
        """
        if not paths:
            raise ValueError("Please provide at least one path")
        lengths = np.asarray([len(p["rewards"]) for p in paths], dtype=np.int64)
        observations: list[ArrayTree] = []
        last_observations: list[ArrayTree] = []
        step_types: list[np.ndarray] = []
        for i, (path, length) in enumerate(zip(paths, lengths.tolist(), strict=True)):
            obs = tree_map(_as_leaf, path["observations"])
            next_obs = path.get("next_observations")
            if len(tree_leaves(obs)[0]) == length + 1:
                observations.append(tree_index(obs, slice(0, length)))
                last_observations.append(tree_index(obs, slice(length, length + 1)))
            else:
                observations.append(obs)
                source = obs if next_obs is None else tree_map(_as_leaf, next_obs)
                last_observations.append(tree_index(source, slice(-1, None)))
            if path.get("step_types") is not None:
                step_types.append(np.asarray(path["step_types"]))
            elif (dones := path.get("dones")) is not None:
                limit = env_spec.max_episode_length
                kinds = [StepType.get_step_type(t, limit, bool(d)) for t, d in enumerate(dones, 1)]
                step_types.append(np.array(kinds, dtype=object))
            else:
                raise ValueError(f"path {i} has neither 'step_types' nor 'dones'")
        env_infos, agent_infos = (
            concat_infos([as_info_arrays(p.get(k), k) for p in paths], lengths.tolist(), k)
            for k in ("env_infos", "agent_infos")
        )
        return cls(
            env_spec=env_spec,
            episode_infos=stack_infos([p.get("episode_infos") or {} for p in paths]),
            observations=tree_concat(observations),
            last_observations=tree_concat(last_observations),
            actions=tree_concat([tree_map(_as_leaf, p["actions"]) for p in paths]),
            rewards=np.concatenate([np.asarray(p["rewards"]) for p in paths]),
            env_infos=env_infos,
            agent_infos=agent_infos,
            step_types=np.concatenate(step_types),
            lengths=lengths,
            **{
                name: (
                    np.concatenate([_row_column(name, p[name]) for p in paths])
                    if all(p.get(name) is not None for p in paths)
                    else None
                )
                for name in ROW_COLUMNS
            },
        )

    def equals(self, other: object) -> bool:
        """Whether ``other`` is an EpisodeBatch with the same contents (NaN equals NaN).

        Arrays must match in shape, dtype and value, info dicts in key order, env specs in
        spaces and time limit.
        """
        if not isinstance(other, EpisodeBatch):
            return False
        a, b = self.env_spec, other.env_spec
        if a is not b and not (
            a.observation_space == b.observation_space
            and a.action_space == b.action_space
            and a.max_episode_length == b.max_episode_length
        ):
            return False
        return all(
            tree_equal(getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
            if f.name != "env_spec"
        )
