"""Columns of values without a fixed size: text (an array of strings) and ragged sequences.

A batch records a gymnasium ``Text`` space as a column of strings: a numpy array of dtype
``StringDType`` where numpy has it (numpy >= 2), else of dtype ``object`` holding ``str``. It
records a ``Sequence`` space (of ``Box`` or ``Discrete``: token ids, embeddings) as a
:class:`RaggedArray`: the rows' items laid end to end in one flat array, and offsets saying
where each row starts (Apache Arrow's list layout). Nothing is padded until a trainer asks
(:meth:`RaggedArray.to_padded`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = [
    "RaggedArray",
    "as_column",
    "column_rows",
    "concat_leaves",
    "infer_column",
    "is_text",
    "is_variable_space",
    "text_array",
    "text_dtype",
]


def _string_dtype() -> np.dtype[Any]:
    dtypes = getattr(np, "dtypes", None)
    maker = getattr(dtypes, "StringDType", None)
    return np.dtype(object) if maker is None else np.dtype(maker())


#: The dtype of text columns: ``StringDType`` (numpy >= 2) or ``object`` (numpy 1.x).
_TEXT_DTYPE: np.dtype[Any] = _string_dtype()


def text_dtype() -> np.dtype[Any]:
    """The dtype of a text column: numpy's ``StringDType`` where available, else ``object``."""
    return _TEXT_DTYPE


def text_array(values: Iterable[Any]) -> np.ndarray:
    """A 1-D text column of ``values`` (each a ``str``)."""
    items = [str(v) for v in values]
    dtype = text_dtype()
    if dtype.kind == "O":
        out = np.empty(len(items), dtype=object)
        out[:] = items
        return out
    return np.array(items, dtype=dtype)


def is_text(value: object) -> bool:
    """Whether ``value`` is a text column: a 1-D array of ``StringDType``, or of ``object``
    holding only ``str``, or numpy's fixed-width unicode."""
    if not isinstance(value, np.ndarray) or value.ndim != 1:
        return False
    if value.dtype.kind in "TU":
        return True
    return value.dtype == object and all(type(v) is str for v in value.tolist())


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class RaggedArray:
    """Rows of varying length, in Apache Arrow's list layout: row ``i`` is
    ``values[offsets[i]:offsets[i + 1]]``.

    Each row is an array of shape ``(length, *item_shape)``; the items of every row share one
    dtype and item shape. A slice of rows is a view (its offsets need not start at zero);
    indexing with an array of indices or a boolean mask gathers a new one.

    Attributes:
        values: ``(total, *item_shape)``, every row's items end to end.
        offsets: ``(n_rows + 1,)`` int64, non-decreasing, within ``values``.
    """

    values: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        if not isinstance(self.values, np.ndarray) or self.values.ndim < 1:
            raise ValueError(
                f"RaggedArray values must be a numpy array of at least 1 dimension, got "
                f"{_describe(self.values)}"
            )
        offsets = self.offsets
        if (
            not isinstance(offsets, np.ndarray)
            or offsets.ndim != 1
            or len(offsets) < 1
            or not np.issubdtype(offsets.dtype, np.integer)
        ):
            raise ValueError(
                "RaggedArray offsets must be a 1-D integer numpy array of n_rows + 1 entries, "
                f"got {_describe(offsets)}"
            )
        if len(offsets) > 1 and (
            offsets[0] < 0 or offsets[-1] > len(self.values) or (np.diff(offsets) < 0).any()
        ):
            raise ValueError(
                "RaggedArray offsets must be non-decreasing and within values "
                f"({len(self.values)} items), got offsets from {offsets[0]} to {offsets[-1]}"
            )

    # -- making -------------------------------------------------------------------------

    @classmethod
    def from_rows(
        cls,
        rows: Iterable[Any],
        dtype: Any = None,
        item_shape: tuple[int, ...] | None = None,
    ) -> RaggedArray:
        """A ragged array of ``rows`` (each array-like of shape ``(length, *item_shape)``).

        ``dtype`` and ``item_shape`` default to the first row's (``float64`` and ``()`` when
        there is none), and are needed to make an empty row of the right kind.
        """
        arrays = [np.asarray(r) if dtype is None else np.asarray(r, dtype=dtype) for r in rows]
        if item_shape is None:
            item_shape = next((a.shape[1:] for a in arrays if a.ndim >= 1), ())
        if dtype is None:
            dtype = next((a.dtype for a in arrays if a.size), arrays[0].dtype if arrays else None)
            dtype = np.dtype(np.float64 if dtype is None else dtype)
        shaped = [
            a.reshape(-1, *item_shape) if a.ndim != 1 + len(item_shape) else a for a in arrays
        ]
        for k, a in enumerate(shaped):
            if a.shape[1:] != tuple(item_shape):
                raise ValueError(
                    f"row {k} has items of shape {a.shape[1:]}, but the rows' items must all "
                    f"have shape {tuple(item_shape)}"
                )
        lengths = np.fromiter((len(a) for a in shaped), dtype=np.int64, count=len(shaped))
        offsets = np.zeros(len(shaped) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if shaped:
            values = np.concatenate(shaped, axis=0).astype(dtype, copy=False)
        else:
            values = np.zeros((0, *item_shape), dtype=dtype)
        return cls(values, offsets)

    @classmethod
    def concatenate(cls, parts: Sequence[RaggedArray]) -> RaggedArray:
        """The rows of ``parts`` one after another (their items must share dtype and shape)."""
        if not parts:
            raise ValueError("RaggedArray.concatenate needs at least one ragged array")
        compact = [p.compact() for p in parts]
        values = np.concatenate([p.values for p in compact], axis=0)
        offsets = [np.zeros(1, dtype=np.int64)]
        base = 0
        for p in compact:
            offsets.append(p.offsets[1:] + base)
            base += len(p.values)
        return cls(values, np.concatenate(offsets))

    # -- reading --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def shape(self) -> tuple[int]:
        """``(n_rows,)``: a ragged array is a column of rows, as a 1-D array is."""
        return (len(self),)

    @property
    def ndim(self) -> int:
        """1: rows along the leading axis (the rows themselves have varying length)."""
        return 1

    @property
    def dtype(self) -> np.dtype[Any]:
        """The dtype of the items."""
        return self.values.dtype

    @property
    def item_shape(self) -> tuple[int, ...]:
        """The shape of one item of a row (``()`` for token ids)."""
        return tuple(self.values.shape[1:])

    @property
    def lengths(self) -> np.ndarray:
        """``(n_rows,)`` int64: the length of each row."""
        return np.diff(self.offsets).astype(np.int64, copy=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows' items and offsets."""
        start, stop = int(self.offsets[0]), int(self.offsets[-1])
        return int(self.values[start:stop].nbytes + self.offsets.nbytes)

    def __getitem__(self, index: Any) -> Any:
        """Row ``index`` (an int: an array), or the rows of a slice (a view), an index array or
        a boolean mask (a new ragged array)."""
        if isinstance(index, (int, np.integer)):
            n = len(self)
            i = int(index) + n if index < 0 else int(index)
            if not 0 <= i < n:
                raise IndexError(f"row {index} is out of range for {n} rows")
            return self.values[self.offsets[i] : self.offsets[i + 1]]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return RaggedArray(self.values, self.offsets[start : max(stop, start) + 1])
            index = np.arange(start, stop, step)
        return self.take(np.asarray(index))

    def take(self, index: np.ndarray) -> RaggedArray:
        """The rows at ``index`` (integer indices or a boolean mask), gathered into a new one."""
        idx = np.asarray(index)
        if idx.dtype == bool:
            if idx.shape != (len(self),):
                raise IndexError(f"a mask of {idx.shape} does not fit {len(self)} rows")
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"an index is out of range for {n} rows")
        idx = np.where(idx < 0, idx + n, idx)
        starts = self.offsets[:-1][idx]
        lengths = self.offsets[1:][idx] - starts
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # One gather: the position of every item of the new rows in the old values.
        items = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(
            offsets[:-1] - starts, lengths
        )
        return RaggedArray(self.values[items], offsets)

    def compact(self) -> RaggedArray:
        """This one with offsets from zero and no items outside the rows (no copy if so)."""
        start, stop = int(self.offsets[0]), int(self.offsets[-1])
        if start == 0 and stop == len(self.values):
            return self
        return RaggedArray(self.values[start:stop], self.offsets - start)

    def to_list(self) -> list[np.ndarray]:
        """The rows, one array each (views into :attr:`values`)."""
        return [
            self.values[a:b] for a, b in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist())
        ]

    def to_padded(
        self, pad_value: Any = 0, length: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The rows as one padded array, and their lengths.

        Args:
            pad_value: what fills each row past its end.
            length: the padded length (default: the longest row); rows longer are cut.

        Returns:
            ``(padded, lengths)``: ``padded`` has shape ``(n_rows, length, *item_shape)`` and
            the items' dtype; ``lengths`` is ``(n_rows,)`` int64, each row's true length (before
            any cut).
        """
        lengths = self.lengths
        width = (int(lengths.max()) if len(lengths) else 0) if length is None else int(length)
        if width < 0:
            raise ValueError(f"length must be >= 0 or None, got {length}")
        out = np.full((len(self), width, *self.item_shape), pad_value, dtype=self.dtype)
        kept = np.minimum(lengths, width)
        row = np.repeat(np.arange(len(self)), kept)
        col = np.arange(int(kept.sum()), dtype=np.int64) - np.repeat(np.cumsum(kept) - kept, kept)
        out[row, col] = self.values[self.offsets[:-1][row] + col]
        return out, lengths

    def equals(self, other: object) -> bool:
        """Same rows: lengths, items' dtype and shape, and every item (NaN equals NaN)."""
        if not isinstance(other, RaggedArray):
            return False
        a, b = self.compact(), other.compact()
        if a.dtype != b.dtype or a.item_shape != b.item_shape:
            return False
        if not np.array_equal(a.offsets, b.offsets):
            return False
        nan = bool(np.issubdtype(a.dtype, np.inexact))
        return bool(np.array_equal(a.values, b.values, equal_nan=nan))

    def __repr__(self) -> str:
        return (
            f"RaggedArray(rows={len(self)}, items={int(self.offsets[-1] - self.offsets[0])}, "
            f"dtype={self.dtype}, item_shape={self.item_shape})"
        )


def concat_leaves(parts: Sequence[Any]) -> Any:
    """Columns joined along the leading axis: ragged arrays into one, else
    :func:`numpy.concatenate`."""
    if any(isinstance(p, RaggedArray) for p in parts):
        return RaggedArray.concatenate([_as_ragged(p) for p in parts])
    return np.concatenate(parts, axis=0)


def _as_ragged(column: Any) -> RaggedArray:
    """A ragged column as it is; a plain one of rows of one length (an info key whose rows all
    had the same length in one batch: stacked) as ragged, to join a ragged one."""
    if isinstance(column, RaggedArray):
        return column
    if isinstance(column, np.ndarray) and column.ndim >= 2:
        n, length = column.shape[:2]
        offsets = np.arange(n + 1, dtype=np.int64) * length
        return RaggedArray(column.reshape(n * length, *column.shape[2:]), offsets)
    if isinstance(column, np.ndarray) and column.dtype == object:
        return RaggedArray.from_rows(list(column))
    raise ValueError(f"cannot join a ragged column with {_describe(column)} (not rows of arrays)")


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return f"a {type(value).__name__}"


def _is_sequence_space(space: object) -> bool:
    return isinstance(space, gym.spaces.Sequence) and isinstance(
        space.feature_space, (gym.spaces.Box, gym.spaces.Discrete)
    )


def is_variable_space(space: object) -> bool:
    """Whether ``space`` is a leaf recorded as a column without fixed-size rows: ``Text``, or a
    ``Sequence`` of ``Box`` or ``Discrete``."""
    return isinstance(space, gym.spaces.Text) or _is_sequence_space(space)


def _item_kind(space: gym.spaces.Sequence) -> tuple[np.dtype[Any], tuple[int, ...]]:
    feature = space.feature_space
    return np.dtype(feature.dtype or np.float64), tuple(feature.shape or ())


def object_rows(rows: Sequence[Any] | np.ndarray) -> np.ndarray:
    """``rows`` as a 1-D ``object`` array, one row per element, whatever each row is (a
    ``str``, an array of any shape): assigned one by one, so numpy never broadcasts them."""
    out = np.empty(len(rows), dtype=object)
    for k, row in enumerate(rows):
        out[k] = row
    return out


def column_rows(column: Any) -> np.ndarray:
    """A column (text, ragged, object or plain array) as a 1-D ``object`` array of its rows:
    what the step records of the sampler hold for a leaf without fixed-size rows."""
    out = np.empty(len(column), dtype=object)
    if isinstance(column, RaggedArray):
        out[:] = column.to_list() if len(column) else []
    else:
        out[:] = list(column)
    return out


def as_column(rows: np.ndarray, space: gym.Space[Any]) -> Any:
    """The column of a leaf ``space`` (``Text``, ``Sequence``) from its 1-D object array of
    rows (``str``, and arrays of the feature's dtype and shape)."""
    if isinstance(space, gym.spaces.Text):
        return text_array(rows.tolist())
    if isinstance(space, gym.spaces.Sequence):
        dtype, shape = _item_kind(space)
        return RaggedArray.from_rows(list(rows), dtype=dtype, item_shape=shape)
    return rows


def infer_column(value: np.ndarray) -> Any:
    """An info column in its recorded form: a 1-D array of strings as text, a 1-D ``object``
    array of arrays of one dtype and item shape as ragged; anything else as it is."""
    if not isinstance(value, np.ndarray) or value.ndim != 1:
        return value
    if value.dtype.kind == "U":
        return text_array(value.tolist())
    if value.dtype != object or not len(value):
        return value
    items = value.tolist()
    first = items[0]
    if type(first) is str:
        return text_array(items) if all(type(v) is str for v in items) else value
    if isinstance(first, np.ndarray) and first.ndim >= 1:
        dtype, shape = first.dtype, first.shape[1:]
        if all(
            isinstance(v, np.ndarray) and v.ndim >= 1 and v.dtype == dtype and v.shape[1:] == shape
            for v in items
        ):
            return RaggedArray.from_rows(items, dtype=dtype, item_shape=shape)
    return value
