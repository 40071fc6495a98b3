"""Checks of what an agent returns: the output's form, its agent infos, and its actions (against
the space, for all of a worker's envs in a few numpy operations, not one ``contains`` each)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from asyncsample._tree import Tree, tree_leaves, tree_map
from asyncsample.columns import RaggedArray, column_rows, is_variable_space, object_rows

__all__ = [
    "ARRAY_SPACES",
    "AgentOutputCheck",
    "Check",
    "action_rows",
    "check_actions",
    "info_rows",
    "make_action_check",
    "object_cell",
    "row_value",
]

# Returns the indices of the envs whose action is outside the space (empty when all fit).
Check = Callable[[Any], np.ndarray]


def _rows_bad(bad: np.ndarray) -> np.ndarray:
    return np.flatnonzero(bad.reshape(len(bad), -1).any(axis=1))


def _not_integral(a: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        return np.zeros(a.shape, dtype=bool)
    bad: np.ndarray = ~np.isfinite(a) | (np.floor(a) != a)
    return bad


_NONE = np.zeros(0, dtype=np.int64)

#: Up to this many discrete actions, their bounds are read as Python ints (0.25 us for 4 rows,
#: 0.5 us for 16, against 1.6 us for numpy's min and max; even at about 64).
_FEW = 32


def make_action_check(space: gym.Space[Any]) -> Check | None:
    """A check for the stacked actions of ``space`` (``None``: cannot); 2 reductions if all fit."""
    if isinstance(space, gym.spaces.Box):
        low, high = space.low, space.high
        scalar = np.all(low == low.flat[0]) and np.all(high == high.flat[0])
        lo, hi = (low.flat[0], high.flat[0]) if scalar else (low, high)

        def box(a: np.ndarray) -> np.ndarray:
            if scalar and a.size and lo <= a.min() and a.max() <= hi:  # NaN fails both
                return _NONE
            return _rows_bad(~((a >= low) & (a <= high)))

        return box
    if isinstance(space, gym.spaces.Discrete):
        start, stop = int(space.start), int(space.start + space.n)

        def discrete(a: np.ndarray) -> np.ndarray:
            if a.dtype.kind in "iu" and a.size:
                if a.size <= _FEW:  # a few rows: as Python ints (see _FEW)
                    values = a.ravel().tolist()
                    if start <= min(values) and max(values) < stop:
                        return _NONE
                elif start <= a.min() and a.max() < stop:
                    return _NONE
            return _rows_bad(_not_integral(a) | (a < start) | (a >= stop))

        return discrete
    if isinstance(space, gym.spaces.MultiDiscrete):
        lo, hi = space.start, space.start + space.nvec
        return lambda a: _rows_bad(_not_integral(a) | (a < lo) | (a >= hi))
    if isinstance(space, gym.spaces.MultiBinary):
        return lambda a: _rows_bad((a != 0) & (a != 1))
    if isinstance(space, gym.spaces.Dict):
        checks = {k: make_action_check(s) for k, s in space.spaces.items()}
        return lambda a: _union([c(a[k]) for k, c in checks.items() if c is not None])
    if isinstance(space, gym.spaces.Tuple):
        parts = [make_action_check(s) for s in space.spaces]
        return lambda a: _union([c(a[i]) for i, c in enumerate(parts) if c is not None])
    return None


def check_actions(
    actions: Tree,
    expected: Tree,
    *,
    worker: int,
    action_space: gym.Space[Any],
    values: Check | None,
    hint: str = "",
    rows: str | Callable[[], str] | None = None,
) -> Tree:
    """``actions`` as arrays shaped like ``expected`` (a worker's action buffers), checked: one
    per env (or per row ``rows`` describes: a callable is called only for the message), the
    space's shape, and the values with ``values``
    (``None`` for trusted agents); a ``ValueError`` names the worker (and the env)."""
    actions = action_rows(actions, action_space)
    if isinstance(expected, np.ndarray):
        pairs = [] if actions.shape == expected.shape else [(actions, expected)]
    else:
        pairs = list(zip(tree_leaves(actions), tree_leaves(expected)))
    for got, want in pairs:
        if got.shape != want.shape:
            n = len(want)
            if got.ndim == 0 or got.shape[0] != n:
                count = "a scalar" if got.ndim == 0 else f"{got.shape[0]} actions"
                if rows is not None:
                    raise ValueError(
                        f"action: the agent must return one action per row it was given "
                        f"({rows() if callable(rows) else rows}), got {count}"
                    )
                raise ValueError(
                    f"action: the agent of worker {worker} must return exactly "
                    f"envs_per_worker ({n}) actions, got {count}"
                )
            raise ValueError(
                f"action: the agent of worker {worker} returned actions of shape "
                f"{got.shape[1:]} per env, but the action space {action_space} has shape "
                f"{want.shape[1:]}"
            )
    if values is not None:
        bad = values(actions)
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"action: the agent of worker {worker} returned an action outside the action "
                f"space {action_space} for env {i}: {tree_map(lambda a: a[i], actions)!r}.{hint}"
            )
    return actions


#: The spaces whose stacked actions are one array of rows (checked by ``make_action_check``).
ARRAY_SPACES = frozenset(
    {gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary}
)


def action_rows(actions: Tree, space: gym.Space[Any]) -> Tree:
    """Stacked ``actions`` of ``space`` as arrays (:func:`numpy.asarray` leaf by leaf); a
    ``Text`` or ``Sequence`` leaf as a 1-D ``object`` array of one row per env, whatever form
    the agent gave it in (a list, an array of strings, a
    :class:`~asyncsample.columns.RaggedArray`). A tree that does not fit ``space`` is left to
    the shape checks."""
    if type(actions) is np.ndarray and type(space) in ARRAY_SPACES:
        return actions  # the common case, told by exact types: an agent's array of rows
    if isinstance(space, gym.spaces.Dict) and isinstance(actions, dict):
        if set(actions) == set(space.spaces):
            return {k: action_rows(actions[k], space.spaces[k]) for k in actions}
    elif isinstance(space, gym.spaces.Tuple) and isinstance(actions, tuple):
        if len(actions) == len(space.spaces):
            return tuple(action_rows(a, s) for a, s in zip(actions, space.spaces))
    elif is_variable_space(space):
        return _as_rows(actions)
    return tree_map(np.asarray, actions)


def _as_rows(actions: Any) -> np.ndarray:
    if isinstance(actions, RaggedArray):
        return column_rows(actions)
    if isinstance(actions, np.ndarray) and actions.dtype == object and actions.ndim == 1:
        return actions
    scalar = isinstance(actions, np.ndarray) and actions.ndim == 0
    if scalar or not isinstance(actions, (list, tuple, np.ndarray)):
        return np.asarray(actions, dtype=object)  # a scalar: refused by the shape check
    if isinstance(actions, np.ndarray) and actions.dtype.kind in "TU":
        return object_rows(actions.tolist())
    return object_rows(list(actions))


def object_cell(value: Any) -> np.ndarray:
    """A 0-d ``object`` array holding ``value``: one env's row of an ``object`` column (a
    string, a ragged row) that keeps saying it is one object, not an array of numbers."""
    cell = np.empty((), dtype=object)
    cell[()] = value
    return cell


def row_value(column: np.ndarray, j: int) -> Any:
    """Row ``j`` of an info column, an ``object`` column's as an :func:`object_cell`."""
    return object_cell(column[j]) if column.dtype == object else column[j]


def info_rows(value: Any) -> np.ndarray:
    """An agent info value as an array of one row per env: text (a list of ``str``, an array of
    strings) and ragged rows (a list of arrays of different lengths, a
    :class:`~asyncsample.columns.RaggedArray`) as a 1-D ``object`` array of rows, recorded as
    columns (:func:`asyncsample.columns.infer_column`).

    Raises:
        ValueError: nested lists that are neither rectangular nor rows of arrays.
    """
    if isinstance(value, RaggedArray):
        return column_rows(value)
    if isinstance(value, np.ndarray):
        return object_rows(value.tolist()) if value.dtype.kind in "TU" else value
    rows = isinstance(value, (list, tuple)) and value
    if rows and isinstance(value[0], (list, tuple, np.ndarray)):
        return object_rows([np.asarray(v) for v in value])  # rows: ragged, whatever lengths
    array = np.asarray(value)
    if array.dtype.kind == "U" and array.ndim == 1:
        return object_rows(array.tolist())
    return array


def _union(bad: list[np.ndarray]) -> np.ndarray:
    return np.unique(np.concatenate(bad)) if bad else _NONE


class AgentOutputCheck:
    """Checks what a worker's agent returned: an ``(actions, agent_infos)`` tuple, the infos a
    dict (or ``None``) of ``n_envs`` rows each, every key keeping its dtype kind and per-row
    shape while the agent stays the same object (see :meth:`forget`)."""

    def __init__(self, worker: int, n_envs: int) -> None:
        self.worker = worker
        self.n_envs = n_envs
        self._seen: dict[str, tuple[str, tuple[int, ...]]] = {}

    def forget(self) -> None:
        """Forget the kinds and shapes seen so far (the agent was replaced)."""
        self._seen = {}

    def output(self, output: object) -> tuple[Any, dict[str, np.ndarray]]:
        """``(actions, agent_infos)`` of ``output``, the infos as checked arrays."""
        if type(output) is not tuple or len(output) != 2:
            raise ValueError(
                f"agent output: the agent of worker {self.worker} must return an (actions, "
                f"agent_infos) tuple, got {_describe(output)}"
            )
        actions, infos = output
        if not infos and (infos is None or isinstance(infos, dict)):
            return actions, {}
        return actions, self.infos(infos)

    def infos(self, infos: object) -> dict[str, np.ndarray]:
        """The agent infos as arrays of ``n_envs`` rows, checked against the earlier steps."""
        if not isinstance(infos, dict):
            raise ValueError(
                f"agent_infos: the agent of worker {self.worker} must return a dict of per-env "
                f"arrays (or None) as agent infos, got {_describe(infos)}"
            )
        out: dict[str, np.ndarray] = {}
        for key, value in infos.items():
            if not isinstance(key, str):
                raise ValueError(
                    f"agent_infos: the agent of worker {self.worker} returned a non-string key "
                    f"{key!r}; agent info keys must be str"
                )
            try:
                array = info_rows(value)
            except ValueError as exc:  # ragged nested lists
                raise ValueError(
                    f"agent_infos[{key!r}]: the agent of worker {self.worker} returned a value "
                    f"that is not array-like ({exc})"
                ) from None
            if array.ndim == 0 or array.shape[0] != self.n_envs:
                got = "a scalar" if array.ndim == 0 else f"{array.shape[0]} rows"
                raise ValueError(
                    f"agent_infos[{key!r}]: the agent of worker {self.worker} must return one "
                    f"row per env, a leading length of envs_per_worker ({self.n_envs}); got "
                    f"{got} (shape {array.shape})"
                )
            sig = (array.dtype.kind, array.shape[1:])
            known = self._seen.setdefault(key, sig)
            if known != sig:
                raise ValueError(
                    f"agent_infos[{key!r}]: the agent of worker {self.worker} changed this key "
                    f"between steps: it had dtype kind {known[0]!r} and per-env shape "
                    f"{known[1]}, now dtype {array.dtype} (kind {sig[0]!r}) and per-env shape "
                    f"{sig[1]}. A key must keep its dtype kind and shape while the agent is the "
                    f"same object"
                )
            out[key] = array
        return out


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"a numpy array of shape {value.shape}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of length {len(value)}"
    return f"{type(value).__name__} {value!r:.80}"
