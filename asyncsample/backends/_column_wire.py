"""Text and ragged rows across processes: one buffer per column per message.

The step buffers of a space with ``Text`` or ``Sequence`` leaves hold those leaves as
``object`` rows (:mod:`asyncsample._leaves`), which shared memory cannot hold. A message that
carries such rows carries each leaf as one column: the strings' utf-8 bytes end to end and
their offsets, or a ragged leaf's items end to end (one array) and their offsets, so pickling
a message costs a few buffers per leaf, never one object per row. The fixed-size leaves keep
their shared memory (the lockstep hosts) or travel as one stacked array per leaf (the lanes).
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from asyncsample import _leaves
from asyncsample._info_cells import COLUMNS
from asyncsample._tree import Tree, stack_rows, tree_leaves
from asyncsample.backends.base import HostSpec, StepRun
from asyncsample.env_group import StepBuffers, StepInfos

__all__ = [
    "PACKED",
    "RunColumns",
    "RunFrame",
    "StepReplies",
    "pack_column",
    "object_rows",
    "outgoing_rows",
    "pack_block",
    "pack_chunk",
    "pack_columns",
    "pack_replies",
    "pack_requests",
    "pack_rows",
    "pack_runs",
    "read_reset_reply",
    "read_step_reply",
    "step_replies",
    "unpack_column",
    "unpack_block_into",
    "unpack_chunk",
    "unpack_columns_into",
    "unpack_replies",
    "unpack_requests",
    "unpack_rows",
]

#: The first item of a lane-reply batch whose rows travel packed (:func:`pack_replies`).
PACKED = "columns"

Column = tuple[Any, ...]


def _object_array(items: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    for k, item in enumerate(items):
        out[k] = item
    return out


def pack_column(rows: Sequence[Any] | np.ndarray) -> Column:
    """One leaf's ``rows`` as one column: ``("t", utf-8 bytes, offsets)`` for strings,
    ``("a", items, offsets)`` for arrays of one dtype and item shape (ragged rows, or fixed
    rows stacked), else ``("o", rows)`` (whatever else a leaf holds, pickled as it is)."""
    items = list(rows)
    if not items:
        return ("o", items)
    first = items[0]
    if type(first) is str and all(type(r) is str for r in items):
        encoded = [r.encode("utf-8") for r in items]
        offsets = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        return ("t", b"".join(encoded), offsets)
    if isinstance(first, np.ndarray) and first.ndim >= 1:
        dtype, item = first.dtype, first.shape[1:]
        if all(
            isinstance(r, np.ndarray) and r.ndim >= 1 and r.dtype == dtype and r.shape[1:] == item
            for r in items
        ):
            offsets = np.zeros(len(items) + 1, dtype=np.int64)
            np.cumsum([len(r) for r in items], out=offsets[1:])
            return ("a", np.concatenate(items, axis=0), offsets)
    return ("o", items)


def unpack_column(column: Column) -> list[Any]:
    """The rows :func:`pack_column` packed (strings, arrays, or what it kept as it was)."""
    kind = column[0]
    if kind == "t":
        data, offsets = column[1], column[2].tolist()
        return [data[a:b].decode("utf-8") for a, b in itertools.pairwise(offsets)]
    if kind == "a":
        values, offsets = column[1], column[2].tolist()
        return [values[a:b] for a, b in itertools.pairwise(offsets)]
    return list(column[1])


def pack_columns(tree: Tree) -> list[Column]:
    """The ``object`` leaves of a buffer ``tree`` (every row), one column each, in leaf order."""
    return [pack_column(leaf) for leaf in tree_leaves(tree) if leaf.dtype == object]


def unpack_columns_into(tree: Tree, columns: list[Column]) -> None:
    """Write :func:`pack_columns`' ``columns`` into the ``object`` leaves of ``tree``."""
    leaves = [leaf for leaf in tree_leaves(tree) if leaf.dtype == object]
    for leaf, column in zip(leaves, columns, strict=True):
        leaf[:] = _object_array(unpack_column(column))


def pack_block(tree: Tree, stop: int) -> list[Column]:
    """The ``object`` leaves of records ``tree`` (``(rows, n_envs)`` each), rows ``:stop``,
    one column each (row-major)."""
    return [
        pack_column(leaf[:stop].reshape(-1)) for leaf in tree_leaves(tree) if leaf.dtype == object
    ]


def unpack_block_into(tree: Tree, stop: int, columns: list[Column]) -> None:
    """Write :func:`pack_block`'s ``columns`` into rows ``:stop`` of ``tree``'s object leaves."""
    leaves = [leaf for leaf in tree_leaves(tree) if leaf.dtype == object]
    for leaf, column in zip(leaves, columns, strict=True):
        block = leaf[:stop]
        block.reshape(-1)[:] = _object_array(unpack_column(column))


def object_rows(spec: HostSpec) -> bool:
    """Whether the step buffers of ``spec`` hold ``object`` rows (``Text``/``Sequence`` leaves
    of a sampler's spaces), which travel packed here instead of through shared memory."""
    return spec.columns and (
        _leaves.has_variable(spec.observation_space) or _leaves.has_variable(spec.action_space)
    )


def outgoing_rows(tree: Tree) -> Any:
    """The rows a request or reply carries of buffers not in shared memory: a list (a space
    without fixed-size rows) as it is, else the ``object`` leaves packed (:func:`pack_columns`)."""
    return tree if isinstance(tree, list) else pack_columns(tree)


def _store_rows(tree: Tree, rows: Any) -> None:
    if isinstance(tree, list):
        tree[:] = rows
    else:
        unpack_columns_into(tree, rows)


def read_reset_reply(obs: Tree, payload: bytes) -> dict[int, dict[str, object]]:
    """A reset reply's infos; rows it carries (``(infos, rows)``) written into ``obs``."""
    if not payload:
        return {}
    loaded = pickle.loads(payload)
    if type(loaded) is not tuple:
        infos: dict[int, dict[str, object]] = loaded
        return infos
    infos, rows = loaded
    _store_rows(obs, rows)
    return infos


def read_step_reply(buffers: StepBuffers, payload: bytes) -> StepInfos:
    """What a step reply's ``payload`` says (its infos may be in the buffers' info cells); the
    rows it carries go to the buffers (a list's observations, or the ``object`` leaves of the
    observations and final observations)."""
    if not payload:
        return StepInfos(None, {})
    if payload == COLUMNS:
        assert buffers.infos is not None  # a host writes its cells only where there are some
        return StepInfos(buffers.infos.read(), {})
    parts = pickle.loads(payload)
    if len(parts) > 3:
        if isinstance(buffers.obs, list):
            buffers.obs[:] = parts[3]
        else:
            unpack_columns_into(buffers.obs, parts[3][0])
            unpack_columns_into(buffers.final_obs, parts[3][1])
    return StepInfos(*parts[:3])


def pack_chunk(chunk: Any, current_obs: Tree, steps: int) -> tuple[list[Column], ...]:
    """What a chunk reply carries of ``object`` rows: the chunk's observation rows (and its
    spare row), final observations and actions of ``steps`` steps, and the current
    observations."""
    return (
        pack_block(chunk.obs, steps + 1),
        pack_block(chunk.final_obs, steps),
        pack_block(chunk.actions, steps),
        pack_columns(current_obs),
    )


def unpack_chunk(chunk: Any, current_obs: Tree, steps: int, columns: Any) -> None:
    """Write what :func:`pack_chunk` packed into the caller's ``chunk`` set and observations."""
    obs, final_obs, actions, current = columns
    unpack_block_into(chunk.obs, steps + 1, obs)
    unpack_block_into(chunk.final_obs, steps, final_obs)
    unpack_block_into(chunk.actions, steps, actions)
    unpack_columns_into(current_obs, current)


def _structure(tree: Tree) -> Any:
    """The dict/tuple structure of ``tree`` with its leaves left out (``None``)."""
    if isinstance(tree, Mapping):
        return {k: _structure(v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_structure(v) for v in tree)
    return None


def _build(structure: Any, leaves: list[Any], at: list[int]) -> Tree:
    if isinstance(structure, dict):
        return {k: _build(v, leaves, at) for k, v in structure.items()}
    if isinstance(structure, tuple):
        return tuple(_build(v, leaves, at) for v in structure)
    value = leaves[at[0]]
    at[0] += 1
    return value


def pack_rows(rows: Sequence[Tree]) -> tuple[Any, int, list[Column]]:
    """Rows of one structure (observations, each a dict/tuple tree or a leaf) as one column
    per leaf: ``(structure, n_rows, columns)``."""
    if not rows:
        return (None, 0, [])
    structure = _structure(rows[0])
    per_row = [tree_leaves(r) for r in rows]
    n_leaves = len(per_row[0])
    columns = [pack_column([leaves[j] for leaves in per_row]) for j in range(n_leaves)]
    return (structure, len(rows), columns)


def unpack_rows(packed: tuple[Any, int, list[Column]]) -> list[Tree]:
    """The rows :func:`pack_rows` packed."""
    structure, n, columns = packed
    if not n:
        return []
    by_leaf = [unpack_column(c) for c in columns]
    if structure is None:
        return by_leaf[0]
    return [_build(structure, [leaf[k] for leaf in by_leaf], [0]) for k in range(n)]


def pack_requests(out: list[tuple[Any, ...]], step: int) -> tuple[Any, ...] | None:
    """A batch of lane requests with the actions of its ``step`` requests (their field 4, where
    not ``None``) packed into columns (:func:`pack_rows`); ``None`` when none carries one."""
    at = [k for k, r in enumerate(out) if r[0] == step and r[4] is not None]
    if not at:
        return None
    actions = pack_rows([out[k][4] for k in at])
    slim = list(out)
    for k in at:
        r = slim[k]
        slim[k] = (*r[:4], None, *r[5:])
    return (PACKED, slim, at, actions)


def unpack_requests(message: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """The lane requests :func:`pack_requests` packed, each with its action again."""
    _, slim, at, actions = message
    out = list(slim)
    for k, action in zip(at, unpack_rows(actions), strict=True):
        r = out[k]
        out[k] = (*r[:4], action, *r[5:])
    return out


def pack_replies(out: list[tuple[int, int, Any]], ok: int) -> tuple[Any, ...]:
    """A batch of lane replies ``(key, status, value)`` whose successful values are
    ``(outcome, observation row, final observation row or None)``, with the rows of the whole
    batch packed into columns (:func:`pack_rows`)."""
    slim: list[tuple[int, int, Any]] = []
    rows: list[Tree] = []
    finals: list[Tree] = []
    final_at: list[int] = []
    for key, status, value in out:
        if status == ok:
            outcome, row, final = value
            if final is not None:
                final_at.append(len(rows))
                finals.append(final)
            rows.append(row)
            slim.append((key, status, outcome))
        else:
            slim.append((key, status, value))
    return (PACKED, ok, slim, pack_rows(rows), pack_rows(finals), final_at)


def unpack_replies(message: tuple[Any, ...]) -> list[tuple[int, int, Any]]:
    """The lane replies :func:`pack_replies` packed, each with its rows again."""
    _, ok, slim, packed_rows, packed_finals, final_at = message
    rows = unpack_rows(packed_rows)
    finals: list[Any] = [None] * len(rows)
    for k, final in zip(final_at, unpack_rows(packed_finals), strict=True):
        finals[k] = final
    out: list[tuple[int, int, Any]] = []
    r = 0
    for key, status, value in slim:
        if status == ok:
            out.append((key, status, (value, rows[r], finals[r])))
            r += 1
        else:
            out.append((key, status, value))
    return out


class RunFrame(NamedTuple):
    """A batch of lane replies with runs of steps (:class:`~asyncsample.backends.base.StepRun`)
    of plain numeric rows: every run's steps in columns of the frame, in run order (a numpy
    array, or a run object, pickled per run cost the caller more than the rest of its run).

    Attributes:
        others: the replies that are not runs, as they are.
        keys, lengths, versions: per run, its request's key, its steps and its agent version.
        rewards: every step's reward (float64 bytes); ``flags``: per run, terminated and
            truncated (a byte each).
        obs, actions: every step's row, as ``(bytes, dtype, shape)``.
        infos, agent_infos: ``(run, step, info)`` where not empty.
    """

    others: list[tuple[int, int, Any]]
    keys: list[int]
    lengths: list[int]
    versions: list[int]
    rewards: bytes
    flags: bytes
    obs: tuple[bytes, str, tuple[int, ...]]
    actions: tuple[bytes, str, tuple[int, ...]]
    infos: list[tuple[int, int, dict[str, Any]]]
    agent_infos: list[tuple[int, int, dict[str, Any]]]


class StepReplies(NamedTuple):
    """A batch of lane replies whose step replies travel in columns, grouped by worker slot: a
    tuple per step, pickled by the host and read by the caller one by one, cost both sides more
    than the rest of a step's path.

    Attributes:
        rest: the batch's other replies, as a host sends them when it has no step replies (a
            list, a :class:`RunFrame` or packed rows).
        keys, envs: per step reply, its request's key and env (``int64`` bytes), slot by slot.
        slots: per worker slot, in the columns' order, ``(slot, replies, odd)``: ``odd`` holds
            ``(index within the slot's replies, status, value)`` of each reply that is not a
            success of no value (an error, or the step's infos).
    """

    rest: Any
    keys: bytes
    envs: bytes
    slots: list[tuple[int, int, list[tuple[int, int, Any]]]]


def step_replies(
    rest: Any, by_slot: Mapping[int, tuple[list[int], list[int], list[tuple[int, int, Any]]]]
) -> StepReplies:
    """A :class:`StepReplies` of ``rest`` and step replies ``by_slot`` (keys, envs, odd)."""
    total = sum(len(keys) for keys, _, _ in by_slot.values())

    def column(field: int) -> bytes:
        items = itertools.chain.from_iterable(c[field] for c in by_slot.values())
        return np.fromiter(items, dtype=np.int64, count=total).tobytes()

    slots = [(slot, len(keys), odd) for slot, (keys, _, odd) in by_slot.items()]
    return StepReplies(rest, column(0), column(1), slots)


def _numeric(rows: Any) -> bool:
    """Whether a run's rows are a block of plain numbers (its column travels as raw bytes)."""
    return type(rows) is np.ndarray and rows.dtype.kind in "biuf"


def _stacked(rows: Any) -> Any:
    return rows if type(rows) is np.ndarray else stack_rows(rows)


def _raw(blocks: list[np.ndarray]) -> tuple[bytes, str, tuple[int, ...]]:
    column = np.concatenate(blocks)
    return column.tobytes(), column.dtype.str, column.shape


def pack_runs(out: list[tuple[int, int, Any]]) -> list[tuple[int, int, Any]] | RunFrame:
    """``out`` as it is without runs (their rows stacked per run where they are not plain
    numbers); else a :class:`RunFrame` of it."""
    runs = [reply for reply in out if type(reply[2]) is StepRun]
    if not runs:
        return out
    first = runs[0][2]
    if not (_numeric(first.obs) and _numeric(first.actions)):  # (one space per sampler)
        for _, _, run in runs:
            run.obs, run.actions = _stacked(run.obs), _stacked(run.actions)
        return out
    raw_obs = _raw([run.obs for _, _, run in runs])
    raw_actions = _raw([run.actions for _, _, run in runs])
    flags = bytearray()
    infos: list[tuple[int, int, dict[str, Any]]] = []
    agent_infos: list[tuple[int, int, dict[str, Any]]] = []
    for r, (_, _, run) in enumerate(runs):
        flags += bytes((run.terminated, run.truncated))
        infos.extend((r, j, info) for j, info in run.infos)
        agent_infos.extend((r, j, info) for j, info in run.agent_infos)
    return RunFrame(
        [reply for reply in out if type(reply[2]) is not StepRun],
        [key for key, _, _ in runs],
        [len(run.rewards) for _, _, run in runs],
        [run.version for _, _, run in runs],
        np.array([r for _, _, run in runs for r in run.rewards], dtype=np.float64).tobytes(),
        bytes(flags),
        raw_obs,
        raw_actions,
        infos,
        agent_infos,
    )


class RunColumns:
    """The runs of a :class:`RunFrame`, read: its columns as arrays (views of the frame's bytes),
    each run's place in them, and its infos by run. A caller applies a worker's runs in one
    pass over these columns (:meth:`asyncsample._env_runs.RunStepper.take_runs`), or takes one
    run as a :class:`~asyncsample.backends.base.StepRun` (:meth:`run`).

    Attributes:
        keys: per run, its request's key.
        lengths, starts, versions: per run, its steps, its first step's index in the columns
            and its agent version.
        terminated, truncated: per run, its last step's flags.
        obs, actions, rewards: every step's row, run after run.
        infos, agent_infos: by run, ``(step, info)`` where not empty.
    """

    def __init__(self, frame: RunFrame) -> None:
        self.keys = frame.keys
        self.lengths = np.array(frame.lengths, dtype=np.int64)
        self.starts = np.cumsum(self.lengths) - self.lengths
        self.versions = np.array(frame.versions, dtype=np.int64)
        flags = np.frombuffer(frame.flags, dtype=np.uint8).reshape(-1, 2).astype(bool)
        self.terminated, self.truncated = flags[:, 0], flags[:, 1]
        self.obs, self.actions = _column(frame.obs), _column(frame.actions)
        self.rewards = np.frombuffer(frame.rewards, dtype=np.float64)
        self.infos = _by_run(frame.infos)
        self.agent_infos = _by_run(frame.agent_infos)

    def run(self, r: int) -> StepRun:
        """Run ``r`` on its own (its rows views of the columns)."""
        at = int(self.starts[r])
        end = at + int(self.lengths[r])
        return StepRun(
            self.obs[at:end],
            self.actions[at:end],
            self.rewards[at:end].tolist(),
            self.infos.get(r, []),
            self.agent_infos.get(r, []),
            bool(self.terminated[r]),
            bool(self.truncated[r]),
            int(self.versions[r]),
        )


def _column(raw: tuple[bytes, str, tuple[int, ...]]) -> np.ndarray:
    return np.frombuffer(raw[0], dtype=raw[1]).reshape(raw[2])


def _by_run(
    entries: list[tuple[int, int, dict[str, Any]]],
) -> dict[int, list[tuple[int, dict[str, Any]]]]:
    out: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for r, j, info in entries:
        out.setdefault(r, []).append((j, info))
    return out
