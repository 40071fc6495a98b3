"""Vectorised checks that a worker's actions lie in the action space.

``space.contains`` takes one action at a time and costs microseconds each; these checks take the
stacked actions of all of a worker's envs in a few numpy operations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["make_action_check"]

# Returns the indices of the envs whose action is outside the space (empty when all fit).
Check = Callable[[Any], np.ndarray]


def _rows_bad(bad: np.ndarray) -> np.ndarray:
    return np.flatnonzero(bad.reshape(len(bad), -1).any(axis=1))


def _not_integral(a: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        return np.zeros(a.shape, dtype=bool)
    return ~np.isfinite(a) | (np.floor(a) != a)


_NONE = np.zeros(0, dtype=np.int64)


def make_action_check(space: gym.Space) -> Check | None:
    """A check for the stacked actions of ``space``, or ``None`` for spaces it cannot check.

    The common case (every action fits) costs two reductions; only a failing batch pays for
    finding which env is wrong.
    """
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
            if a.dtype.kind in "iu" and a.size and start <= a.min() and a.max() < stop:
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


def _union(bad: list[np.ndarray]) -> np.ndarray:
    if not bad:
        return _NONE
    return np.unique(np.concatenate(bad))
