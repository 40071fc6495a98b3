"""Helpers over (possibly nested) structures of numpy arrays.

Observations and actions of ``Dict`` and ``Tuple`` spaces are dicts and tuples of arrays, as
gymnasium's vector utilities produce them. These helpers apply one function to every leaf so the
rest of the code treats a nested batch like a single array.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

Tree = Any  # np.ndarray | dict[str, Tree] | tuple[Tree, ...]


def tree_map(fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """Apply ``fn`` leaf by leaf to ``tree`` and the same-shaped trees in ``rest``."""
    if isinstance(tree, Mapping):
        return {k: tree_map(fn, tree[k], *(r[k] for r in rest)) for k in tree}
    if isinstance(tree, tuple):
        return tuple(tree_map(fn, t, *(r[i] for r in rest)) for i, t in enumerate(tree))
    return fn(tree, *rest)


def tree_leaves(tree: Tree) -> list[Any]:
    """The leaves of ``tree`` in a fixed order."""
    if isinstance(tree, Mapping):
        return [leaf for k in tree for leaf in tree_leaves(tree[k])]
    if isinstance(tree, tuple):
        return [leaf for t in tree for leaf in tree_leaves(t)]
    return [tree]


def tree_concat(trees: list[Tree]) -> Tree:
    """Concatenate same-shaped trees along the leading axis."""
    return tree_map(lambda *xs: np.concatenate(xs, axis=0), *trees)


def tree_index(tree: Tree, index: Any) -> Tree:
    """Index every leaf of ``tree`` with ``index``."""
    return tree_map(lambda x: x[index], tree)
