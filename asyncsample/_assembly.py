"""Cut episodes out of the workers' time-major step records into one batch, in one copy.

Each worker describes its episodes as a :class:`Plan` (which rows, in which order);
:func:`assemble` allocates each field once and gathers every worker's rows straight into it.
Info keys are sorted by the rule of :class:`~asyncsample.batch.EpisodeBatch`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncsample._leaves import leaf_spaces, to_columns
from asyncsample._memory import BatchMemory
from asyncsample._tree import Tree, stack_rows, tree_leaves, tree_map
from asyncsample.batch import (
    MISSING,
    EnvSpec,
    EpisodeBatch,
    StepType,
    fill_value,
    filled,
    key_rows,
    mask_key,
    stack_column,
    stack_infos,
)
from asyncsample.columns import infer_column

__all__ = ["ASSEMBLE_IN_THREAD_BYTES", "BatchMemory", "Plan", "assemble", "assemble_off_loop"]


@dataclass
class Plan:
    """Where one worker's episodes of a call lie in its step records.

    Attributes:
        obs, actions, rewards, agent_infos: the worker's records, shape ``(rows, n_envs, ...)``.
        versions: the agent version of every step, ``(rows, n_envs)``.
        env_infos: non-empty env infos by row (a list over envs), if any step had one.
        like_obs, like_actions: arrays of the right dtype and trailing shape (for empty plans).
        rows, envs: for every transition of the batch, in order, its row and env.
        lengths, step_types: per episode and per transition.
        last_observations: per episode, the observation after its last step.
        episode_infos: per episode, its info dict.
        agent_info_masks: per agent info key absent on some of the plan's rows, a boolean
            ``(rows, n_envs)`` array, true where present.
    """

    obs: Tree
    actions: Tree
    rewards: np.ndarray | None
    agent_infos: dict[str, np.ndarray]
    env_infos: dict[int, list[dict[str, Any]]]
    like_obs: Tree
    like_actions: Tree
    rows: np.ndarray
    envs: np.ndarray
    lengths: np.ndarray
    step_types: np.ndarray
    last_observations: list[Tree] = field(default_factory=list)
    episode_infos: list[dict[str, Any]] = field(default_factory=list)
    agent_info_masks: dict[str, np.ndarray] = field(default_factory=dict)
    versions: np.ndarray | None = None

    @property
    def n_envs(self) -> int:
        """Envs per row of the records."""
        return len(tree_leaves(self.like_obs)[0])


def _flat_rows(record: np.ndarray) -> tuple[np.ndarray, int]:
    """``record`` (rows x envs x ...) as one axis of env rows, a view, and how many env rows
    one row is apart in it: ``n_envs``, or more when the rows are spaced out (a worker's rows of
    a step arena shared by several workers, see :func:`asyncsample.backends._slot.step_arenas`)
    and the rows between belong to the same memory."""
    rows, envs = record.shape[:2]
    step, env_step = record.strides[:2]
    if (
        rows
        and record[0].flags.c_contiguous
        and env_step > 0
        and step % env_step == 0
        and step > envs * env_step
    ):
        per_row = step // env_step
        shape = ((rows - 1) * per_row + envs, *record.shape[2:])
        return np.lib.stride_tricks.as_strided(record, shape, record.strides[1:]), per_row
    return record.reshape(-1, *record.shape[2:]), envs


def _gather(
    plans: list[Plan], records: list[Any], like: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """One field of the batch: every plan's rows of ``records`` (shaped like ``like``), into
    ``out`` if given."""
    total = sum(len(p.rows) for p in plans)
    if out is None:
        out = np.empty((total, *like.shape[1:]), dtype=like.dtype)
    start = 0
    for plan, record in zip(plans, records):
        n = len(plan.rows)
        if n:
            flat, per_row = _flat_rows(record)
            np.take(
                flat,
                plan.rows * per_row + plan.envs,
                axis=0,
                out=out[start : start + n],
                mode="clip",  # indices are valid; "raise" would buffer the whole copy
            )
        start += n
    return out


def assemble(
    env_spec: EnvSpec, plans: list[Plan], memory: BatchMemory | None = None
) -> EpisodeBatch:
    """The episodes of all ``plans``, in order, as one batch (observations in ``memory``)."""
    live = [p for p in plans if len(p.rows)] or plans[:1]
    pieces_last = [o for p in plans for o in p.last_observations]
    obs_outs, last_outs = _observation_memory(live, pieces_last, memory)

    def field_of(name: str, like: str, outs: list[Any] | None = None) -> Tree:
        records = [getattr(p, name) for p in live]
        first = getattr(live[0], like)
        if any(r is None for r in records):
            return tree_map(lambda x: np.zeros((0, *x.shape[1:]), x.dtype), first)
        into = iter(outs or [None] * len(tree_leaves(first)))
        return tree_map(
            lambda x, *leaves: _gather(live, list(leaves), x, next(into)), first, *records
        )

    def column(name: str, empty: np.ndarray) -> np.ndarray:
        records = [getattr(p, name) for p in live]
        if any(r is None for r in records):
            return empty
        return _gather(live, records, records[0][0])

    obs_leaves = leaf_spaces(env_spec.observation_space)
    observations = to_columns(field_of("obs", "like_obs", obs_outs), obs_leaves)
    actions = to_columns(field_of("actions", "like_actions"), leaf_spaces(env_spec.action_space))
    rewards = column("rewards", np.zeros(0))
    versions = column("versions", np.zeros(len(rewards), dtype=np.int64))
    step_types = np.concatenate([p.step_types for p in plans])
    lengths = np.concatenate([p.lengths for p in plans])
    ends = np.cumsum(lengths) - 1
    is_last = np.zeros(len(step_types), dtype=bool)
    is_last[ends[np.isin(step_types[ends], (StepType.TERMINAL, StepType.TIMEOUT))]] = True
    pieces_info = [i for p in plans for i in p.episode_infos]
    if pieces_info:
        episode_infos = stack_infos(pieces_info)
    else:
        episode_infos = {k: np.zeros(0, np.int64) for k in ("worker", "env", "agent_version")}
    env_infos = info_columns(_env_infos(live, is_last, ends, episode_infos))
    agent_infos = info_columns(_agent_infos(live, is_last, ends, episode_infos))
    if pieces_last:
        last_observations = _stack_into(pieces_last, last_outs)
    else:
        last_observations = tree_map(
            lambda x: np.zeros((0, *x.shape[1:]), x.dtype), plans[0].like_obs
        )
    last_observations = to_columns(last_observations, obs_leaves)
    return EpisodeBatch(
        env_spec=env_spec,
        episode_infos=info_columns(episode_infos),
        observations=observations,
        last_observations=last_observations,
        actions=actions,
        rewards=rewards,
        env_infos=env_infos,
        agent_infos=agent_infos,
        step_types=step_types,
        lengths=lengths,
        agent_versions=versions,
    )


def _observation_memory(
    plans: list[Plan], last: list[Tree], memory: BatchMemory | None
) -> tuple[list[Any] | None, list[Any] | None]:
    """Where a batch's observations and last observations go: one block of ``memory`` for
    both (a batch holds one block; the leaves of each lie end to end), or ``None`` each."""
    if memory is None:
        return None, None
    total = sum(len(p.rows) for p in plans)
    obs = [((total, *x.shape[1:]), x.dtype) for x in tree_leaves(plans[0].like_obs)]
    ends = [] if not last else [(np.shape(x), np.asarray(x).dtype) for x in tree_leaves(last[0])]
    outs = memory.empty_many(obs + [((len(last), *shape), dtype) for shape, dtype in ends])
    return outs[: len(obs)], outs[len(obs) :]


def _stack_into(rows: list[Tree], outs: list[Any] | None) -> Tree:
    """Trees of rows (one per episode) stacked leaf by leaf, the fixed-size leaves into
    ``outs`` (arrays in :func:`tree_leaves` order) when given."""
    into = iter(outs or [None] * len(tree_leaves(rows[0])))

    def leaf(*xs: Any) -> Any:
        out = next(into)
        if out is None or isinstance(xs[0], str) or out.dtype.hasobject:
            return stack_rows(xs)
        try:
            return np.stack(xs, out=out)
        except ValueError:  # rows of different shapes: a Sequence leaf
            return stack_rows(xs)

    return tree_map(leaf, rows[0], *rows[1:])


def info_columns(infos: dict[str, Any]) -> dict[str, Any]:
    """Info arrays of strings as text columns, of arrays of varying length as ragged ones
    (:func:`asyncsample.columns.infer_column`), nested dicts key by key."""
    return {
        k: info_columns(v) if isinstance(v, dict) else infer_column(v) for k, v in infos.items()
    }


def _episode_level(key: str, episode_infos: dict[str, Any]) -> bool:
    """Whether ``key`` may move to ``episode_infos`` (its name is not taken there)."""
    return key not in episode_infos and mask_key(key) not in episode_infos


def _env_infos(
    live: list[Plan], is_last: np.ndarray, ends: np.ndarray, episode_infos: dict[str, Any]
) -> dict[str, Any]:
    """The batch's env infos; keys found only on last steps are added to ``episode_infos``."""
    if not any(p.env_infos for p in live):
        return {}
    per_step = [
        p.env_infos[t][e] if t in p.env_infos else {}
        for p in live
        for t, e in zip(p.rows.tolist(), p.envs.tolist())
    ]
    first = per_step[0].keys()
    if all(d.keys() == first for d in per_step):  # the common case: every key on every step
        return stack_infos(per_step)
    rows_of = key_rows(per_step)
    step_keys = []
    for key, rows in rows_of.items():
        if rows is not None and _episode_level(key, episode_infos) and is_last[rows].all():
            values, mask = stack_column([per_step[j].get(key, MISSING) for j in ends.tolist()])
            episode_infos[key] = values
            if mask is not None:
                episode_infos[mask_key(key)] = mask
        else:
            step_keys.append(key)
    return stack_infos(per_step, keys=step_keys, rows=rows_of)


def _agent_infos(
    live: list[Plan], is_last: np.ndarray, ends: np.ndarray, episode_infos: dict[str, Any]
) -> dict[str, Any]:
    """The batch's agent infos; keys found only on last steps are added to ``episode_infos``."""
    keys = sorted({k for p in live for k in p.agent_infos})
    out: dict[str, Any] = {}
    for key in keys:
        if all(key in p.agent_infos and key not in p.agent_info_masks for p in live):
            records = [p.agent_infos[key] for p in live]
            out[key] = _gather(live, records, records[0][0])
            continue
        values: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        for p in live:
            record = p.agent_infos.get(key)
            if record is None:
                like = next(q.agent_infos[key] for q in live if key in q.agent_infos)
                values.append(filled((len(p.rows), *like.shape[2:]), like.dtype))
                masks.append(np.zeros(len(p.rows), dtype=bool))
                continue
            index = p.rows * p.n_envs + p.envs
            values.append(record.reshape(-1, *record.shape[2:])[index])
            mask = p.agent_info_masks.get(key)
            masks.append(
                np.ones(len(p.rows), dtype=bool) if mask is None else mask.reshape(-1)[index]
            )
        value = np.concatenate(values, axis=0)
        present = np.concatenate(masks)
        if not present.any():  # a key of an earlier call, absent from this batch
            continue
        if present.all():
            out[key] = value
            continue
        value[~present] = fill_value(value.dtype)
        if _episode_level(key, episode_infos) and not (present & ~is_last).any():
            episode_infos[key] = value[ends]
            episode_mask = present[ends]
            if not episode_mask.all():
                episode_infos[mask_key(key)] = episode_mask
        else:
            out[key] = value
            out[mask_key(key)] = present
    return out


#: What a row of a ``Text`` or ``Sequence`` leaf counts for in :data:`ASSEMBLE_IN_THREAD_BYTES`
#: (its columns are made from Python objects, under the GIL, wherever they are made).
_OBJECT_ROW_BYTES = 64

#: Batches larger than this are put together in a thread: numpy releases the GIL while it
#: copies, so the event loop keeps running (a 28 MB image batch takes ~10 ms to copy).
ASSEMBLE_IN_THREAD_BYTES = 1 << 20


async def assemble_off_loop(
    env_spec: EnvSpec, plans: list[Plan], memory: BatchMemory | None = None
) -> EpisodeBatch:
    """:func:`assemble`, off the event loop's thread when the batch is large."""
    size = sum(len(p.rows) for p in plans) * sum(
        _OBJECT_ROW_BYTES if leaf.dtype == object else leaf[0].nbytes
        for leaf in tree_leaves(plans[0].like_obs)
    )
    if size < ASSEMBLE_IN_THREAD_BYTES:
        return assemble(env_spec, plans, memory)
    fut = asyncio.get_running_loop().run_in_executor(None, assemble, env_spec, plans, memory)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        # The copy reads the workers' step records: let it finish before anything reuses them.
        await asyncio.wait({fut})
        raise
