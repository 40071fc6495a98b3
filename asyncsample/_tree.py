"""Helpers that treat the nested dicts/tuples of arrays of ``Dict``/``Tuple`` spaces as one."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from asyncsample.columns import RaggedArray, concat_leaves, object_rows

Tree = Any  # np.ndarray | dict[str, Tree] | tuple[Tree, ...]


def tree_map(fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """Apply ``fn`` leaf by leaf to ``tree`` and the same-shaped trees in ``rest``."""
    if type(tree) is np.ndarray:  # the common leaf, told without the ABC's isinstance
        return fn(tree, *rest)
    if isinstance(tree, Mapping):
        return {k: tree_map(fn, tree[k], *(r[k] for r in rest)) for k in tree}
    if isinstance(tree, tuple):
        return tuple(tree_map(fn, t, *(r[i] for r in rest)) for i, t in enumerate(tree))
    return fn(tree, *rest)


def row_copy(leaf: Any, i: Any) -> Any:
    """Row ``i`` of a buffer's ``leaf``, copied; a ``str`` (a text leaf's row) is immutable and
    is itself."""
    row = leaf[i]
    return row.copy() if hasattr(row, "copy") and not isinstance(row, str) else row


def stack_rows(rows: Sequence[Any]) -> np.ndarray:
    """Rows of one leaf stacked along a new leading axis; rows of a ``Text`` or ``Sequence``
    leaf (``str``, or arrays of different lengths) as a 1-D ``object`` array of them."""
    first = rows[0]
    if not isinstance(first, str):
        try:  # the common case first: no check per row (it cost a tenth of a batched call)
            return np.stack(rows)
        except ValueError:  # arrays of different shapes: a Sequence leaf's rows
            if not isinstance(first, np.ndarray):
                raise
    return object_rows(rows)


def tree_leaves(tree: Tree) -> list[Any]:
    """The leaves of ``tree`` in a fixed order."""
    if isinstance(tree, Mapping):
        return [leaf for k in tree for leaf in tree_leaves(tree[k])]
    if isinstance(tree, tuple):
        return [leaf for t in tree for leaf in tree_leaves(t)]
    return [tree]


def tree_concat(trees: list[Tree]) -> Tree:
    """Concatenate same-shaped trees along the leading axis."""
    return tree_map(lambda *xs: concat_leaves(xs), *trees)


def tree_index(tree: Tree, index: Any) -> Tree:
    """Index every leaf of ``tree`` with ``index``."""
    return tree_map(lambda x: x[index], tree)


def tree_equal(a: Any, b: Any) -> bool:
    """Exact equality of two dict/tuple trees of arrays: types, shapes, dtypes and every value
    (NaN equals NaN), down into object arrays."""
    if any(isinstance(a, kind) != isinstance(b, kind) for kind in (Mapping, tuple, np.ndarray)):
        return False
    if isinstance(a, Mapping):
        return list(a) == list(b) and all(tree_equal(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(tree_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, RaggedArray) or isinstance(b, RaggedArray):
        return isinstance(a, RaggedArray) and a.equals(b)
    if isinstance(a, np.ndarray):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype == object:
            return all(tree_equal(x, y) for x, y in zip(a.flat, b.flat, strict=True))
        return bool(np.array_equal(a, b, equal_nan=bool(np.issubdtype(a.dtype, np.inexact))))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False
