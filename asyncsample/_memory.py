"""Memory for a sampler's big batch arrays, handed out again once the batches that held it go.

Fresh memory costs the kernel's zeroing of every page at first touch. For image observations
that is more than the copy into it: on this project's 2-core machine the caller of 64 Pistonball
envs spent three quarters of its CPU in the kernel's ``clear_page_erms`` (``perf record`` at
5547a17) before its batches' columns came from here. :class:`BatchMemory` hands out arrays of at
least ``min_bytes`` as views of a few owned blocks. Every view of a block holds a reference to it
(numpy's ``base``), so a block's reference count tells whether a batch of the user's still uses
it; only a block nothing refers to is handed out again. Small arrays are plain ``np.empty``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["MIN_BYTES", "BatchMemory", "adjacent_rows", "carve"]

#: Arrays smaller than this are plain ``np.empty`` (their page faults cost little).
MIN_BYTES = 1 << 20


class BatchMemory:
    """A few reusable memory blocks for big arrays (module docstring). Thread-safe: a batch is
    put together off the event loop's thread while the loop makes other arrays.

    Args:
        keep: the most blocks kept; beyond it the least recently used free one is let go (a
            block a batch still uses is then freed with that batch). A trainer that holds one
            batch while the next is made needs the blocks of two.
        min_bytes: arrays smaller than this are allocated afresh.
    """

    def __init__(self, keep: int = 6, min_bytes: int = MIN_BYTES) -> None:
        self.keep = keep
        self.min_bytes = min_bytes
        self._blocks: list[np.ndarray] = []  # least recently used first
        self._lock = threading.Lock()
        self.reused = 0  # blocks handed out again (for tests and benchmarks)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype`` (on a free block if it is big)."""
        return self.empty_many([(shape, dtype)])[0]

    def take(self, n: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised array of ``n`` rows of ``shape``."""
        return self.empty((n, *shape), dtype)

    def empty_many(self, specs: Sequence[tuple[tuple[int, ...], Any]]) -> list[np.ndarray]:
        """Uninitialised arrays of these ``(shape, dtype)``, carved in order from one block when
        they are big together: the leaves of one tree side by side, so that the rows of
        consecutive leaves of one shape are one array's rows (``adjacent_rows``)."""
        dtypes = [np.dtype(d) for _, d in specs]
        sizes = [int(np.prod(s, dtype=np.int64)) * d.itemsize for (s, _), d in zip(specs, dtypes)]
        carved = [not d.hasobject for d in dtypes]
        offsets, total = [], 0
        for size, dtype, carve in zip(sizes, dtypes, carved):
            total = -(-total // dtype.alignment) * dtype.alignment  # leaves of one dtype: no gap
            offsets.append(total)
            if carve:
                total += size
        if total < self.min_bytes:
            return [np.empty(s, d) for (s, _), d in zip(specs, dtypes)]
        block = self._block(total)
        return [
            block[o : o + n].view(d).reshape(s) if carve else np.empty(s, d)
            for (s, _), d, o, n, carve in zip(specs, dtypes, offsets, sizes, carved)
        ]

    def _block(self, nbytes: int) -> np.ndarray:
        with self._lock:
            blocks = self._blocks
            best = -1
            for i in range(len(blocks)):  # the smallest free block that fits, up to twice over
                size = blocks[i].nbytes
                # References: the list's and getrefcount's argument; any other is a holder.
                if nbytes <= size <= 2 * nbytes and sys.getrefcount(blocks[i]) == 2:
                    if best < 0 or size < blocks[best].nbytes:
                        best = i
            if best >= 0:
                block = blocks.pop(best)
                self.reused += 1
            else:
                block = np.empty(nbytes + nbytes // 8, dtype=np.uint8)  # room for a larger one
                if len(blocks) >= self.keep:
                    free = [i for i in range(len(blocks)) if sys.getrefcount(blocks[i]) == 2]
                    blocks.pop(free[0] if free else 0)
            blocks.append(block)
            return block

    def __getstate__(self) -> dict[str, Any]:
        # A copy (an agent sent to a host) starts empty, with a lock of its own.
        return {"keep": self.keep, "min_bytes": self.min_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["keep"], state["min_bytes"])  # type: ignore[misc]


def adjacent_rows(leaves: Sequence[np.ndarray]) -> np.ndarray | None:
    """``leaves`` (arrays of one shape and dtype) joined along their first axis as a view, when
    they lie end to end in one C-contiguous memory (as :meth:`BatchMemory.empty_many` carves
    them); else ``None``."""
    if not leaves:
        return None
    first = leaves[0]
    if type(first) is not np.ndarray or first.dtype.hasobject or not first.flags.c_contiguous:
        return None
    address = first.__array_interface__["data"][0]
    step = first.nbytes
    for k, leaf in enumerate(leaves):
        if (
            type(leaf) is not np.ndarray
            or leaf.shape != first.shape
            or leaf.dtype != first.dtype
            or not leaf.flags.c_contiguous
            or leaf.__array_interface__["data"][0] != address + k * step
        ):
            return None
    owner = first if first.base is None else first.base
    if not isinstance(owner, np.ndarray) or not owner.flags.c_contiguous:
        return None
    # One memory: separate arrays may lie end to end by chance (two blocks allocated in turn).
    if any(leaf.base is not owner for leaf in leaves[1:]):
        return None
    start = address - owner.__array_interface__["data"][0]
    flat = owner.reshape(-1).view(np.uint8)
    whole = flat[start : start + first.nbytes * len(leaves)]
    return whole.view(first.dtype).reshape(len(leaves) * len(first), *first.shape[1:])


def carve(
    space: gym.Space[Any],
    n: int,
    make: Callable[[gym.Space[Any], int], Any],
    rows: int | None = None,
) -> Any:
    """Buffers of ``n`` rows of ``space``, each leaf's made by ``make(leaf_space, count)``; the
    members of a ``Tuple`` of equal leaf spaces (a multi-agent env's slots) are views of one
    block, end to end, so that :func:`adjacent_rows` joins their rows without a copy (a
    policy's observations in the hosts).

    ``rows``: leaves of ``(rows, n, ...)`` instead (an observation arena of ``rows`` rows of
    ``n`` envs), such members end to end within each row.
    """
    if isinstance(space, gym.spaces.Dict):
        return {k: carve(sub, n, make, rows) for k, sub in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        subs = space.spaces
        if not _equal_leaves(subs):
            return tuple(carve(sub, n, make, rows) for sub in subs)
        m = len(subs)
        block = make(subs[0], m * n * (rows or 1))
        if rows is None:
            return tuple(block[k * n : (k + 1) * n] for k in range(m))
        block = block.reshape(rows, m, n, *block.shape[1:])
        return tuple(block[:, k] for k in range(m))
    leaf = make(space, n * (rows or 1))
    return leaf if rows is None else leaf.reshape(rows, n, *leaf.shape[1:])


def _equal_leaves(spaces: Sequence[gym.Space[Any]]) -> bool:
    """Whether ``spaces`` are two or more leaf spaces whose rows have one shape and dtype."""
    first = spaces[0] if spaces else None
    if len(spaces) < 2 or isinstance(first, (gym.spaces.Dict, gym.spaces.Tuple)):
        return False
    return all(
        type(s) is type(first) and s.shape == first.shape and s.dtype == first.dtype for s in spaces
    )
