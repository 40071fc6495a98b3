"""The checks an :class:`~asyncsample.batch.EpisodeBatch` runs on its fields when it is built.

A ``ValueError`` names the malformed field and what it should have been. ``batch`` imports this
module, so the batch passes its fields, spaces and ``StepType`` in.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Mapping
from typing import Any

import gymnasium
import numpy as np

from asyncsample._tree import Tree
from asyncsample.columns import RaggedArray, is_variable_space

__all__ = [
    "check_batched",
    "check_fields",
    "check_infos",
    "check_step_types",
    "space_mismatch",
]


def check_fields(
    step_type: type[enum.IntEnum],
    obs_space: gymnasium.Space[Any],
    action_space: gymnasium.Space[Any],
    *,
    episode_infos: dict[str, Any],
    observations: Tree,
    last_observations: Tree,
    actions: Tree,
    rewards: np.ndarray,
    env_infos: dict[str, Any],
    agent_infos: dict[str, Any],
    step_types: np.ndarray,
    lengths: np.ndarray,
    agent_versions: np.ndarray | None,
    agent_ids: np.ndarray | None = None,
    env_steps: np.ndarray | None = None,
    agent_steps: np.ndarray | None = None,
) -> None:
    """Check every field's shape, dtype and consistency; a ``ValueError`` names a bad one."""
    _check_ndarray("lengths", lengths)
    if lengths.ndim != 1:
        raise ValueError(
            f"lengths has shape {lengths.shape}, but must be 1-D with one entry per episode"
        )
    if not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths has dtype {lengths.dtype}, but must have an integer dtype")
    if lengths.size and lengths.min() < 1:
        raise ValueError(
            f"lengths has entry {lengths.min()}, but every episode needs at least 1 step"
        )
    n_episodes = lengths.shape[0]
    expected_steps = int(lengths.sum())

    _check_ndarray("rewards", rewards)
    if rewards.ndim != 1:
        raise ValueError(
            f"rewards has shape {rewards.shape}, but must have shape ({expected_steps},)"
        )
    n_steps = rewards.shape[0]
    if n_steps != expected_steps:
        raise ValueError(
            f"lengths sum to {expected_steps}, but the batch has {n_steps} transitions "
            "(entries of rewards)"
        )

    for name, column, integer in (
        ("agent_versions", agent_versions, True),
        ("agent_ids", agent_ids, False),
        ("env_steps", env_steps, True),
        ("agent_steps", agent_steps, True),
    ):
        if column is not None and (
            not isinstance(column, np.ndarray)
            or column.shape != (n_steps,)
            or (integer and not np.issubdtype(column.dtype, np.integer))
        ):
            kind = "an integer numpy.ndarray" if integer else "a numpy.ndarray"
            raise ValueError(
                f"{name} must be None or {kind} of shape ({n_steps},), "
                f"got {_describe_array(column)}"
            )

    last_prefix = (
        "last_observations must have the same number of entries as the observation space: "
        "each last observation"
    )
    for tree, field, size, what, space, prefix in (
        (observations, "observations", n_steps, "rewards", obs_space, "Each observation"),
        (last_observations, "last_observations", n_episodes, "lengths", obs_space, last_prefix),
        (actions, "actions", n_steps, "rewards", action_space, "Each action"),
    ):
        check_batched(tree, field, size, what)
        problem = space_mismatch(tree, space)
        if problem is not None:
            raise ValueError(f"{prefix}{problem}")

    check_step_types(step_types, n_steps, step_type)
    check_infos(env_infos, "env_infos", n_steps, "rewards")
    check_infos(agent_infos, "agent_infos", n_steps, "rewards")
    check_infos(episode_infos, "episode_infos", n_episodes, "lengths")


def _check_ndarray(name: str, value: object) -> None:
    if not isinstance(value, np.ndarray):
        raise ValueError(f"{name} is of type {type(value).__name__}, but must be a numpy.ndarray")


def _leaves_with_paths(tree: Tree, path: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for every leaf of a dict/tuple tree, e.g. ``("['pos']", arr)``."""
    if isinstance(tree, Mapping):
        for key, sub in tree.items():
            yield from _leaves_with_paths(sub, f"{path}[{key!r}]")
    elif isinstance(tree, tuple):
        for i, sub in enumerate(tree):
            yield from _leaves_with_paths(sub, f"{path}[{i}]")
    else:
        yield path, tree


def check_batched(tree: Tree, field: str, size: int, what: str) -> None:
    """Every leaf of ``tree`` must be an ndarray with leading dimension ``size``."""
    for path, leaf in _leaves_with_paths(tree):
        name = f"{field}{path}"
        if isinstance(leaf, RaggedArray):  # a column of rows of varying length
            if len(leaf) != size:
                raise ValueError(
                    f"{name} has batch size {len(leaf)}, but must have batch size {size} to "
                    f"match {what}"
                )
            continue
        _check_ndarray(name, leaf)
        if leaf.ndim == 0:
            raise ValueError(
                f"{name} has shape (), but must have batch size {size} to match {what}"
            )
        if leaf.shape[0] != size:
            raise ValueError(
                f"{name} has batch size {leaf.shape[0]}, but must have batch size {size} to "
                f"match {what}"
            )


def space_mismatch(tree: Tree, space: gymnasium.Space[Any], path: str = "") -> str | None:
    """How one item of a batched ``tree`` fails to fit ``space`` (shapes only, as in garage: the
    space's shape or its flat dimension), or ``None`` if it fits."""
    is_dict = isinstance(space, gymnasium.spaces.Dict)
    is_tuple = isinstance(space, gymnasium.spaces.Tuple)
    if is_variable_space(space) or isinstance(tree, RaggedArray):
        return _column_mismatch(tree, space, path)
    if isinstance(tree, np.ndarray):
        shape = tuple(tree.shape[1:])
        expected = space.shape
        if expected is not None and shape == tuple(expected):
            return None
        if expected is None and not (is_dict or is_tuple):
            return None
        try:
            flat: int | None = int(gymnasium.spaces.flatdim(space))
        except (NotImplementedError, ValueError, TypeError):  # no flat dimension
            flat = None
        if flat is not None and math.prod(shape) == flat:
            return None
        wanted = f"shape {expected} or " if expected is not None else ""
        return (
            f"{path} has shape {shape}, but must have {wanted}{flat} entries to match the "
            f"space {space}"
        )
    parts: list[tuple[Any, Tree, gymnasium.Space[Any]]]
    if isinstance(space, gymnasium.spaces.Dict) and isinstance(tree, Mapping):
        if set(tree) != set(space.spaces):
            return (
                f"{path} has keys {sorted(tree)}, but must have the keys "
                f"{sorted(space.spaces)} of the space {space}"
            )
        parts = [(key, tree[key], sub) for key, sub in space.spaces.items()]
    elif isinstance(space, gymnasium.spaces.Tuple) and isinstance(tree, tuple):
        if len(tree) != len(space.spaces):
            return (
                f"{path} has {len(tree)} parts, but must have the {len(space.spaces)} parts of "
                f"the space {space}"
            )
        parts = [(i, sub_tree, sub) for i, (sub_tree, sub) in enumerate(zip(tree, space.spaces))]
    else:
        return f"{path} is a {type(tree).__name__}, which does not fit the space {space}"
    for key, sub_tree, sub in parts:
        problem = space_mismatch(sub_tree, sub, f"{path}[{key!r}]")
        if problem is not None:
            return problem
    return None


def _column_mismatch(tree: Any, space: gymnasium.Space[Any], path: str) -> str | None:
    """How a column fails a ``Text`` space (a 1-D array of strings) or a ``Sequence`` space (a
    :class:`~asyncsample.columns.RaggedArray` of the feature's item shape), or ``None``."""
    if isinstance(space, gymnasium.spaces.Text):
        if isinstance(tree, np.ndarray) and tree.ndim == 1 and tree.dtype.kind in "TUO":
            return None
        return (
            f"{path} is {_describe_array(tree)}, but must be a 1-D array of strings (a text "
            f"column) to match the space {space}"
        )
    if isinstance(space, gymnasium.spaces.Sequence):
        feature = tuple(space.feature_space.shape or ())
        if isinstance(tree, RaggedArray) and tree.item_shape == feature:
            return None
        got = (
            f"a RaggedArray of items of shape {tree.item_shape}"
            if isinstance(tree, RaggedArray)
            else _describe_array(tree)
        )
        return (
            f"{path} is {got}, but must be a RaggedArray of items of shape {feature} to match "
            f"the space {space}"
        )
    return f"{path} is a RaggedArray, which does not fit the space {space}"


def check_infos(infos: Any, name: str, size: int, what: str) -> None:
    """An info dict holds arrays (or nested dicts of them) with leading dimension ``size``."""
    if not isinstance(infos, Mapping):
        raise ValueError(f"{name} is of type {type(infos).__name__}, but must be a dict")
    for key, value in infos.items():
        if isinstance(value, Mapping):
            check_infos(value, f"{name}[{key!r}]", size, what)
        elif isinstance(value, RaggedArray):
            if len(value) != size:
                raise ValueError(
                    f"Entry {key!r} in {name} has batch size {len(value)}, but must have batch "
                    f"size {size} to match {what}"
                )
        elif not isinstance(value, np.ndarray):
            raise ValueError(
                f"Entry {key!r} in {name} is of type {type(value).__name__}, but must be a "
                "numpy.ndarray, a RaggedArray or a dict"
            )
        elif value.ndim == 0 or value.shape[0] != size:
            got = value.shape[0] if value.ndim else "() (a scalar)"
            raise ValueError(
                f"Entry {key!r} in {name} has batch size {got}, but must have batch size "
                f"{size} to match {what}"
            )


def check_step_types(step_types: Any, n_transitions: int, step_type: type[enum.IntEnum]) -> None:
    """``step_types``: shape ``(T,)``, ``step_type`` members (object dtype) or their integers."""
    _check_ndarray("step_types", step_types)
    if step_types.ndim != 1:
        raise ValueError(
            f"step_types has shape {step_types.shape}, but must have shape ({n_transitions},)"
        )
    check_batched(step_types, "step_types", n_transitions, "rewards")
    if step_types.dtype == object:
        kinds = set(map(type, step_types.tolist()))
        if not all(issubclass(k, int | np.integer) and k is not bool for k in kinds):
            names = sorted(k.__name__ for k in kinds)
            raise ValueError(
                f"step_types holds objects of type {names}, but must hold StepType members"
            )
        values = step_types.astype(np.int64)
    elif np.issubdtype(step_types.dtype, np.integer):
        values = step_types
    else:
        raise ValueError(
            f"step_types has dtype {step_types.dtype}, but must have dtype StepType or an "
            "integer dtype"
        )
    low, high = int(min(step_type)), int(max(step_type))
    if values.size and (values.min() < low or values.max() > high):
        raise ValueError(
            f"step_types has values from {values.min()} to {values.max()}, but must be StepType "
            f"values in {low}..{high}"
        )


def _describe_array(value: object) -> str:
    """Type, shape and dtype of ``value`` for an error message."""
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return f"a {type(value).__name__}"
