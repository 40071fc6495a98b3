"""How info dicts become dicts of arrays, dropping nothing: a key on some rows only is filled
where absent and gets a ``"_" + key`` presence mask (gymnasium's); nested dicts likewise."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from asyncsample.columns import RaggedArray, concat_leaves, object_rows

__all__ = [
    "MISSING",
    "as_info_arrays",
    "concat_infos",
    "fill_value",
    "filled",
    "key_rows",
    "mask_key",
    "snapshot",
    "stack_column",
    "stack_infos",
]

_SCALARS = frozenset({int, float, bool, str, bytes, complex, type(None)})


def snapshot(infos: Any) -> Any:
    """A copy of info dicts as a pickle to another process would deliver them: an env may reuse
    and mutate its info dict (and the arrays in it) from step to step."""
    kind = type(infos)
    if kind in _SCALARS or isinstance(infos, np.generic):  # numpy scalars are immutable too
        return infos
    if kind is dict:
        return {k: v if type(v) in _SCALARS else snapshot(v) for k, v in infos.items()}
    if kind is list or kind is tuple:
        # A step's env infos: a list of dicts, copied without a call per dict (a host's chunk
        # loop does this at every step).
        items = [
            {k: v if type(v) in _SCALARS else snapshot(v) for k, v in item.items()}
            if type(item) is dict
            else snapshot(item)
            for item in infos
        ]
        return items if kind is list else tuple(items)
    if kind is np.ndarray:
        return infos.copy()
    return copy.deepcopy(infos)


MISSING: Any = object()
"""Marks a row on which an info key is absent (see :func:`stack_column`)."""


def mask_key(key: str) -> str:
    """The name of the presence mask of info key ``key``: ``"_" + key`` (gymnasium's naming)."""
    return "_" + key


def _stack_values(values: list[Any]) -> np.ndarray:
    """Stack per-item values into one array; ragged values become a 1-D object array."""
    try:
        return np.asarray(values)
    except ValueError:
        return object_rows(values)


def fill_value(dtype: np.dtype[Any]) -> Any:
    """What an info array holds where its key is absent: NaN, ``None`` (object) or zero."""
    if dtype.kind in "fc":
        return np.nan
    if dtype.kind == "O":
        return None
    return np.zeros((), dtype).item()


def filled(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` holding only :func:`fill_value`."""
    return np.full(shape, fill_value(dtype), dtype=dtype)


def key_rows(infos: Sequence[Mapping[str, Any]]) -> dict[str, list[int] | None]:
    """Every key of ``infos``, in order of first appearance, with the rows that carry it
    (``None``: every row); rows are grouped by key set first, for one pass per distinct set."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, info in enumerate(infos):
        groups.setdefault(tuple(info), []).append(i)
    parts: dict[str, list[list[int]]] = {}
    for keys, rows in groups.items():
        for key in keys:
            parts.setdefault(key, []).append(rows)
    n = len(infos)
    out: dict[str, list[int] | None] = {}
    for key, lists in parts.items():
        rows = lists[0] if len(lists) == 1 else sorted(itertools.chain.from_iterable(lists))
        out[key] = None if len(rows) == n else rows
    return out


def _stack_key(
    infos: Sequence[Mapping[str, Any]], key: str, rows: list[int] | None
) -> tuple[Any, np.ndarray | None]:
    """Stack ``key`` of ``infos``, present on ``rows`` (``None``: all); returns (value, mask)."""
    n = len(infos)
    if rows is None:
        values = [d[key] for d in infos]
        if isinstance(values[0], Mapping) and all(isinstance(v, Mapping) for v in values):
            return stack_infos(values), None
        return _stack_values(values), None
    mask = np.zeros(n, dtype=bool)
    mask[rows] = True
    present = [infos[i][key] for i in rows]
    if all(isinstance(v, Mapping) for v in present):
        nested: list[Mapping[str, Any]] = [{}] * n
        for i, v in zip(rows, present, strict=True):
            nested[i] = v
        return stack_infos(nested), mask
    stacked = _stack_values(present)
    out = filled((n, *stacked.shape[1:]), stacked.dtype)
    out[rows] = stacked
    return out, mask


def stack_column(values: Sequence[Any]) -> tuple[Any, np.ndarray | None]:
    """Stack one info key's values, :data:`MISSING` where absent: ``(stacked, mask)``, the mask
    ``None`` when the key is on every row (a dict of arrays where every value is a dict)."""
    rows = [i for i, v in enumerate(values) if v is not MISSING]
    infos = [{} if v is MISSING else {"": v} for v in values]
    return _stack_key(infos, "", None if len(rows) == len(values) else rows)


def stack_infos(
    infos: Sequence[Mapping[str, Any]],
    *,
    name: str = "infos",
    keys: Iterable[str] | None = None,
    rows: Mapping[str, list[int] | None] | None = None,
) -> dict[str, Any]:
    """Stack one info dict per step (or per episode) into a dict of arrays, by the module's rule.

    Ragged values become a 1-D object array. ``keys``: only these, in this order; ``rows``:
    :func:`key_rows` of ``infos`` if the caller has it; ``name`` is unused (kept for callers).
    """
    del name
    if rows is None:
        if not any(infos):  # the common case: no info at all
            return {}
        first = infos[0].keys()
        if all(d.keys() == first for d in infos):  # every key on every row: no masks
            rows = dict.fromkeys(first)
        else:
            rows = key_rows(infos)
    out: dict[str, Any] = {}
    for key in rows if keys is None else keys:
        stacked, mask = _stack_key(infos, key, rows[key])
        out[key] = stacked
        if mask is not None:
            out[mask_key(key)] = mask
    return out


def _concat_arrays(arrays: list[Any]) -> Any:
    """Concatenate along the leading axis, falling back to object rows for mismatched shapes;
    ragged columns (:class:`~asyncsample.columns.RaggedArray`) join as one."""
    if any(isinstance(a, RaggedArray) for a in arrays):
        return concat_leaves(arrays)
    try:
        return np.concatenate(arrays, axis=0)
    except ValueError:
        return np.concatenate([object_rows(a) for a in arrays], axis=0)


def _absent_rows(like: Any, n: int) -> Any:
    """``n`` rows of the fill value of a column like ``like`` (a ragged one: empty rows)."""
    if isinstance(like, RaggedArray):
        return RaggedArray(like.values[:0], np.zeros(n + 1, dtype=np.int64))
    return filled((n, *like.shape[1:]), like.dtype)


def concat_infos(
    dicts: Sequence[Mapping[str, Any]], sizes: Sequence[int], where: str = "infos"
) -> dict[str, Any]:
    """Concatenate info dicts of arrays along the leading axis, keeping every key.

    ``sizes`` gives each dict's number of rows. A key some dicts lack is filled there and gets a
    mask; a mask present in any input is kept even when all true, so a split batch concatenates
    back to itself. A key holding a dict in one input and an array in another: ``ValueError``.
    """
    if not any(dicts):
        return {}
    union: dict[str, None] = {}  # every key, in order of first appearance
    for d in dicts:
        union.update(dict.fromkeys(d))
    out: dict[str, Any] = {}
    for key in [k for k in union if not (k.startswith("_") and k[1:] in union)]:  # not masks
        mkey = mask_key(key)
        parts = [d.get(key, MISSING) for d in dicts]
        has_mask = any(mkey in d for d in dicts) or any(p is MISSING for p in parts)
        present = [p for p in parts if p is not MISSING]
        if all(isinstance(p, Mapping) for p in present):
            out[key] = concat_infos(
                [{} if p is MISSING else p for p in parts], sizes, f"{where}[{key!r}]"
            )
        elif any(isinstance(p, Mapping) for p in present):
            raise ValueError(
                f"{where}[{key!r}] is a dict in some inputs and an array in others; they "
                "cannot be concatenated"
            )
        else:
            like = present[0]
            out[key] = _concat_arrays(
                [
                    _absent_rows(like, n) if p is MISSING else p
                    for p, n in zip(parts, sizes, strict=True)
                ]
            )
        if has_mask:
            mask = np.concatenate(
                [
                    np.asarray(d[mkey], dtype=bool)
                    if mkey in d
                    else np.full(n, key in d, dtype=bool)
                    for d, n in zip(dicts, sizes, strict=True)
                ]
            )
            if isinstance(out[key], np.ndarray) and not mask.all():
                out[key][~mask] = fill_value(out[key].dtype)
            out[mkey] = mask
    return out


def as_info_arrays(info: Any, where: str) -> dict[str, Any]:
    """Accept a path's info either as a dict of arrays or as a list of per-step dicts."""
    if info is None:
        return {}
    if isinstance(info, Mapping):
        return {
            k: as_info_arrays(v, f"{where}[{k!r}]") if isinstance(v, Mapping) else np.asarray(v)
            for k, v in info.items()
        }
    if isinstance(info, Sequence) and all(isinstance(d, Mapping) for d in info):
        return stack_infos(info, name=where)
    raise ValueError(
        f"{where} must be a dict of arrays or a list of dicts, not {type(info).__name__}"
    )
