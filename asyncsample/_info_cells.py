"""Step infos of plain numbers through shared memory, with nothing pickled.

Many envs report the same keys at every step, each a number: MuJoCo's positions and reward
terms, ALE's lives and frame numbers. A process host writes such a step's infos into its slot's
:class:`InfoCells` (a row per env: a presence cell, then a float64 cell per key) and its reply
says only :data:`COLUMNS`; the caller rebuilds the same dicts (each key in its place, each value
of its own type) from the cells. The keys and the values' types, the *schema*, are written
pickled into the block's tail only when they change, under a version the caller checks, so a
restarted host or a lost reply can never leave the caller reading with a stale schema.

Anything else is pickled as before: a nested dict, an array, a string, an int a float64 cannot
hold exactly, envs whose keys differ (or come in another order), more keys than columns, an info
that is a subclass of dict.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["CELLS", "COLUMNS", "INFO_SPACE", "InfoCells", "columnar", "info_rows"]

#: Cells per env: its presence (1.0: its info is in the row), then one per key.
CELLS = 16
#: Rows of :data:`CELLS` float64 cells after the envs' rows: the schema's version, its length
#: and its pickle (4 KiB in all).
SCHEMA_ROWS = 32
#: The space :func:`info_rows` rows of a slot's block are made of (``make(INFO_SPACE, rows)``).
INFO_SPACE = gym.spaces.Box(-np.inf, np.inf, (CELLS,), np.float64)
#: A step reply whose infos are in the slot's cells.
COLUMNS = b"C"

#: Types a float64 cell holds exactly; a cell read back is ``kind(cell)``.
_FLOATS = frozenset({float, np.float64, np.float32, np.float16, bool, np.bool_})
#: Integer types: held exactly while within :data:`_EXACT_INT` of zero.
_INTS = frozenset({int, np.int64, np.int32, np.int16, np.int8, np.uint32, np.uint16, np.uint8})
_KINDS = _FLOATS | _INTS
_EXACT_INT = 2**53


def info_rows(n_envs: int) -> int:
    """The rows of a slot's block for ``n_envs`` envs (theirs, then the schema's)."""
    return n_envs + SCHEMA_ROWS


def columnar(info: Mapping[Any, Any]) -> bool:
    """Whether one info could travel in cells (a dict whose keys fit, each value a number of a
    type the cells hold; an int's size is checked per step)."""
    return (
        type(info) is dict and len(info) < CELLS and all(type(v) in _KINDS for v in info.values())
    )


class InfoCells:
    """One slot's info cells, as either side sees them (each side makes its own).

    Args:
        block: ``(info_rows(n_envs), CELLS)`` float64, shared by the host and the caller.
        n_envs: the slot's envs.
    """

    def __init__(self, block: np.ndarray, n_envs: int) -> None:
        self.n_envs = n_envs
        self.values = block[:n_envs]
        if not block.flags.c_contiguous:
            raise ValueError("InfoCells needs a C-contiguous block")
        tail = block[n_envs:].reshape(-1).view(np.uint8)
        self._head = tail[:16].view(np.int64)  # the schema's version, its pickle's length
        self._body = tail[16:]
        self._version = int(self._head[0])  # a restarted host goes on from the last one
        self._schema: tuple[tuple[Any, ...], tuple[type, ...]] | None = None

    # -- the host's side ------------------------------------------------------------------

    def write(self, env_infos: Sequence[Mapping[Any, Any]]) -> bool:
        """Write ``env_infos`` (one per env, empty where there is none) into the cells if they
        are columnar; whether they were (if not, the cells are left as they were)."""
        keys: tuple[Any, ...] | None = None
        kinds: tuple[type, ...] = ()
        present: list[int] = []
        table: list[tuple[Any, ...]] = []
        for i, info in enumerate(env_infos):
            if not info:
                continue
            if type(info) is not dict:  # a subclass comes back as itself only pickled
                return False
            row = tuple(info.values())
            if keys is None:
                keys = tuple(info)
                kinds = tuple(map(type, row))
                if len(keys) >= CELLS:
                    return False
            elif tuple(info) != keys or tuple(map(type, row)) != kinds:
                return False
            present.append(i)
            table.append(row)
        if keys is None:
            return False
        for k, kind in enumerate(kinds):
            if kind in _INTS:
                if any(not -_EXACT_INT <= row[k] <= _EXACT_INT for row in table):
                    return False
            elif kind not in _FLOATS:
                return False
        if (keys, kinds) != self._schema and not self._put_schema((keys, kinds)):
            return False
        values = self.values
        flags = [0.0] * self.n_envs
        end = 1 + len(keys)
        for i, row in zip(present, table):
            flags[i] = 1.0
            values[i, 1:end] = row
        values[:, 0] = flags
        return True

    def _put_schema(self, schema: tuple[tuple[Any, ...], tuple[type, ...]]) -> bool:
        try:
            data = pickle.dumps(schema, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # a key that does not pickle: the step is pickled (and fails) as before
            return False
        if len(data) > len(self._body):
            return False
        self._body[: len(data)] = np.frombuffer(data, np.uint8)
        self._head[1] = len(data)
        self._version += 1
        self._head[0] = self._version
        self._schema = schema
        return True

    # -- the caller's side ----------------------------------------------------------------

    def read(self) -> list[dict[Any, Any]]:
        """The infos the host wrote last (a new dict per env, empty where it had none)."""
        version = int(self._head[0])
        if version != self._version or self._schema is None:
            self._schema = pickle.loads(self._body[: int(self._head[1])].tobytes())
            self._version = version
        keys, kinds = self._schema
        rows = self.values[:, : 1 + len(keys)].tolist()
        return [
            dict(zip(keys, [kind(x) for kind, x in zip(kinds, cells)])) if present else {}
            for present, *cells in rows
        ]
