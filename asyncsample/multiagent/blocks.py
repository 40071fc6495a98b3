"""Memory for big agent-row arrays, reused once the batches that held it are gone.

A multi-agent call copies each agent's observations into rows (one copy: a segment's rows must
be contiguous). Written into a new array, a 164 KB Pistonball row also costs the caller the
page faults of fresh memory, which on this project's 2-core machine took more of the kernel's
time than the copy took (``benchmarks/multiagent.py --profile``: ``np.take`` 270 us of CPU per
row, against about 35 us into memory already touched). :class:`Blocks` hands out arrays of at
least :data:`MIN_BYTES` as views of a few owned blocks, each handed out again once nothing else
refers to it: every view of a block holds a reference to the block (numpy's ``base``), so its
reference count tells whether a batch of the user's still uses it. Small arrays are plain
``np.empty``.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["MIN_BYTES", "Blocks"]

#: Arrays smaller than this are plain ``np.empty`` (their faults cost little).
MIN_BYTES = 1 << 20


class Blocks:
    """A few reusable memory blocks for big arrays (module docstring).

    Args:
        keep: the most blocks kept; beyond it the least recently used is let go (a block a
            batch still uses is then freed with that batch). A trainer that holds one batch
            while the next is made needs the blocks of two.
    """

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._blocks: list[np.ndarray] = []  # least recently used first

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype`` (on a free block if it is big)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < MIN_BYTES or dtype.hasobject:
            return np.empty(shape, dtype)
        blocks = self._blocks
        best = -1
        for i in range(len(blocks)):  # the smallest free block that fits
            size = blocks[i].nbytes
            if size >= nbytes and sys.getrefcount(blocks[i]) == 2:  # the list's and the call's
                if best < 0 or size < blocks[best].nbytes:
                    best = i
        if best >= 0:
            block = blocks.pop(best)
        else:
            block = np.empty(nbytes, dtype=np.uint8)
            if len(blocks) >= self.keep:
                free = [i for i in range(len(blocks)) if sys.getrefcount(blocks[i]) == 2]
                blocks.pop(free[0] if free else 0)
        blocks.append(block)
        out: np.ndarray = block[:nbytes].view(dtype).reshape(shape)
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {"keep": self.keep, "_blocks": []}  # a copy (an agent sent to a host) starts empty
