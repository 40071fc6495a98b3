"""Step buffers of spaces with leaves of no fixed size (``Text``, ``Sequence``), nested freely
in ``Dict`` and ``Tuple``: such a leaf's buffer is a 1-D ``object`` array of rows (a ``str``, or
an array of the feature's dtype and shape), its fixed-size siblings stay plain arrays.

The rows become columns (:mod:`asyncsample.columns`) when a batch is assembled, and travel
between processes packed, one buffer per leaf (:mod:`asyncsample.backends._column_wire`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from asyncsample._tree import Tree
from asyncsample._validate import RECORDABLE_SPACES
from asyncsample.columns import as_column, is_variable_space

__all__ = [
    "allocate",
    "columnar",
    "has_variable",
    "leaf_spaces",
    "normalize",
    "put",
    "to_columns",
]


def _children(space: gym.Space[Any]) -> list[tuple[Any, gym.Space[Any]]] | None:
    if isinstance(space, gym.spaces.Dict):
        return list(space.spaces.items())
    if isinstance(space, gym.spaces.Tuple):
        return list(enumerate(space.spaces))
    return None


def has_variable(space: gym.Space[Any]) -> bool:
    """Whether any leaf of ``space`` is ``Text`` or a ``Sequence`` of ``Box``/``Discrete``."""
    children = _children(space)
    if children is None:
        return is_variable_space(space)
    return any(has_variable(s) for _, s in children)


def columnar(space: gym.Space[Any]) -> bool:
    """Whether every leaf of ``space`` is recorded in columns: a fixed-size space, ``Text``, or a
    ``Sequence`` of ``Box``/``Discrete``, nested in ``Dict``/``Tuple``."""
    children = _children(space)
    if children is None:
        return isinstance(space, RECORDABLE_SPACES) or is_variable_space(space)
    return all(columnar(s) for _, s in children)


def leaf_spaces(space: gym.Space[Any]) -> Tree:
    """``space`` as a tree (dicts and tuples) of its leaf spaces, shaped as its values are."""
    if isinstance(space, gym.spaces.Dict):
        return {k: leaf_spaces(s) for k, s in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        return tuple(leaf_spaces(s) for s in space.spaces)
    return space


def _empty(space: gym.Space[Any]) -> Any:
    if isinstance(space, gym.spaces.Text):
        return ""
    feature = space.feature_space  # type: ignore[attr-defined]
    return np.zeros((0, *(feature.shape or ())), dtype=feature.dtype or np.float64)


def allocate(space: gym.Space[Any], n: int, make: Callable[[gym.Space[Any], int], Any]) -> Tree:
    """Buffers of ``n`` rows of a :func:`columnar` ``space``: ``make(leaf, n)`` for the
    largest subtrees of fixed-size leaves, an ``object`` array of empty rows per variable leaf."""
    if is_variable_space(space):
        out = np.empty(n, dtype=object)
        empty = _empty(space)
        for i in range(n):
            out[i] = empty
        return out
    children = _children(space)
    if children is None or not has_variable(space):
        return make(space, n)
    if isinstance(space, gym.spaces.Dict):
        return {k: allocate(s, n, make) for k, s in children}
    return tuple(allocate(s, n, make) for _, s in children)


def normalize(space: gym.Space[Any], value: Any) -> Any:
    """A value of the variable leaf ``space`` in its recorded form: ``str``, or an array of the
    feature's dtype of shape ``(length, *feature_shape)``.

    Raises:
        TypeError: a text value that is not a ``str``; ValueError: a sequence whose items do
            not have the feature's shape.
    """
    if isinstance(space, gym.spaces.Text):
        if not isinstance(value, str):
            raise TypeError(f"a value of {space} must be a str, got {type(value).__name__}")
        return value if type(value) is str else str(value)
    feature = space.feature_space  # type: ignore[attr-defined]
    shape = tuple(feature.shape or ())
    array = np.asarray(value, dtype=feature.dtype or np.float64)
    if array.shape[1:] != shape or array.ndim != 1 + len(shape):
        if array.size == 0:
            return np.zeros((0, *shape), dtype=array.dtype)
        raise ValueError(
            f"a value of {space} must hold items of shape {shape}, got an array of shape "
            f"{array.shape}"
        )
    return array


def put(out: Tree, spaces: Tree, i: Any, value: Any) -> None:
    """``out[i] = value`` leaf by leaf, variable leaves normalized (``spaces``: the
    :func:`leaf_spaces` tree); a value of another structure raises ``KeyError``/``TypeError``."""
    if isinstance(spaces, dict):
        if not isinstance(value, dict):
            raise TypeError(f"expected a dict, got {type(value).__name__}")
        for k, s in spaces.items():
            put(out[k], s, i, value[k])
    elif isinstance(spaces, tuple):
        if not isinstance(value, tuple) or len(value) != len(spaces):
            raise TypeError(f"expected a tuple of {len(spaces)}, got {type(value).__name__}")
        for k, s in enumerate(spaces):
            put(out[k], s, i, value[k])
    elif is_variable_space(spaces):
        out[i] = normalize(spaces, value)
    else:
        out[i] = value


def to_columns(tree: Tree, spaces: Tree) -> Tree:
    """A batched ``tree`` with each variable leaf's ``object`` rows made a column
    (:func:`asyncsample.columns.as_column`)."""
    if isinstance(spaces, dict):
        return {k: to_columns(tree[k], s) for k, s in spaces.items()}
    if isinstance(spaces, tuple):
        return tuple(to_columns(tree[k], s) for k, s in enumerate(spaces))
    if is_variable_space(spaces) and isinstance(tree, np.ndarray):
        return as_column(tree, spaces)  # rows, whether object or stacked (all of one length)
    return tree
