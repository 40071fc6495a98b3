"""Gymnasium vector infos built a key at a time: what ``gymnasium.vector.VectorEnv._add_info``
builds from the per-step info dicts of a lockstep step, without its per-row work.

Added row by row, gymnasium's builder makes each key's array and mask at the first row that has
the key, then, for every row, looks every key up again and allocates a throw-away mask (its
``dict.get`` default). Envs that report the same keys at every step (ALE's lives and frame
numbers, MuJoCo's positions and reward terms) then pay a few numpy allocations per sub-env and
key. :func:`columns` builds the same dict (keys in the same order, the same dtypes, values and
masks) once per key, for the rows whose infos have the same keys; anything else is left to
gymnasium's builder (``None``).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import numpy as np

__all__ = ["columns"]

#: The types gymnasium gives an array of their own type: int, float, bool and numpy's numbers (a
#: set, one lookup per key; a subclass of ``np.number`` not listed is checked as gymnasium does).
_NUMBERS = frozenset(
    {int, float, bool, *(t for t in np.sctypeDict.values() if issubclass(t, np.number))}
)
_ALL_TRUE: dict[int, np.ndarray] = {}  # per num_envs: the mask of a key every sub-env has


def columns(num_envs: int, env_infos: Sequence[dict[str, Any]], rows: list[int]) -> Any:
    """The vector info ``gymnasium.vector.VectorEnv._add_info`` builds adding ``env_infos[i]``
    for each ``i`` of ``rows`` (ascending) in turn to an empty dict, or ``None`` when the rows'
    infos do not all have the first one's keys, or hold what gymnasium treats apart (a nested
    dict, ``final_obs``, a key starting with ``_``, which could meet a mask)."""
    if not rows:
        return {}
    first = env_infos[rows[0]]
    n = len(rows)
    table: Any
    if n == 1:  # one row (a single sub-env, or one with infos): its values, one per key
        table = zip(first.values())
    else:
        keys = first.keys()
        for i in rows:
            if env_infos[i].keys() != keys:
                return None
        if not keys:
            return {}
        if len(keys) == 1:
            (key,) = keys
            table = ([env_infos[i][key] for i in rows],)
        else:  # one pass over the rows: the values of every key, a column per key
            getter = itemgetter(*keys)
            table = zip(*[getter(env_infos[i]) for i in rows])
    full = n == num_envs
    if full:
        mask = _ALL_TRUE.get(num_envs)
        if mask is None:
            mask = _ALL_TRUE[num_envs] = np.ones(num_envs, dtype=np.bool_)
    else:
        mask = np.zeros(num_envs, dtype=np.bool_)
        mask[rows] = True
    infos: dict[str, Any] = {}
    for key, values in zip(first, table):
        if type(key) is not str or key[:1] == "_" or key == "final_obs":
            return None
        value = values[0]
        kind = type(value)
        array: np.ndarray
        if kind in _NUMBERS or issubclass(kind, np.number):
            alike = n == 1 or len(set(map(type, values))) == 1
            if full and alike:
                array = np.array(values, dtype=kind)
            else:
                array = np.zeros(num_envs, dtype=kind)
                if alike:
                    array[rows] = values
                else:  # as gymnasium assigns them, one by one
                    for i, v in zip(rows, values):
                        array[i] = v
        elif isinstance(value, dict):
            return None
        else:
            if isinstance(value, np.ndarray):
                array = np.zeros((num_envs, *value.shape), dtype=value.dtype)
            else:
                array = np.full(num_envs, fill_value=None, dtype=object)
            for i, v in zip(rows, values):
                array[i] = v
        infos[key] = array
        infos["_" + key] = mask.copy()  # every key its own mask, as gymnasium's
    return infos
