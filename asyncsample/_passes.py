"""Work in the caller's event loop, bounded per pass of the loop.

Thousands of envs answer in bursts: a reply frame holds hundreds of steps, a call starts with
every env ready at once, one merged agent call answers every worker. Each piece of that work is
short, but a pass of the loop runs every callback that is ready, so together they would hold the
loop (and the ticker of a web service sharing it) for tens of milliseconds. Such pieces go into
the loop's :class:`PassQueue` instead: each pass of the loop runs them, in order, for about
:data:`SLICE_S`, and leaves the rest to the next passes, behind whatever else is ready.
"""

from __future__ import annotations

import asyncio
import collections
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["SLICE_S", "PassQueue", "pass_queue"]

#: The queued work one pass of the event loop does before the rest waits for the next pass
#: (seconds).
SLICE_S = 0.002

_QUEUES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PassQueue] = (
    weakref.WeakKeyDictionary()
)


class PassQueue:
    """The pieces of work waiting for a pass of ``loop`` (see the module docstring)."""

    __slots__ = ("_items", "_loop", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # A weak reference: the queue is the value of its loop's entry in _QUEUES, and would
        # keep the loop (a weak key) alive for good.
        self._loop = weakref.ref(loop)
        self._items: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._scheduled = False

    def put(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` in a coming pass of the loop, after the pieces put before it."""
        self._items.append((fn, args))
        loop = self._loop()
        if not self._scheduled and loop is not None:
            self._scheduled = True
            loop.call_soon(self._run)

    def _run(self) -> None:
        loop = self._loop()
        if loop is None:  # (it runs this: it lives)
            return
        items = self._items
        end = time.perf_counter() + SLICE_S
        while items:
            fn, args = items.popleft()
            try:
                fn(*args)
            except Exception as exc:  # one piece's bug must not stop the others
                loop.call_exception_handler(
                    {"message": f"asyncsample: {fn!r} raised", "exception": exc}
                )
            if time.perf_counter() > end:
                break
        if items:
            loop.call_soon(self._run)
        else:
            self._scheduled = False


#: The loop asked for last (a weak reference) and its queue: asked per worker per pass, a lookup
#: in :data:`_QUEUES` (a weak reference made per call) costs more than the work it queues.
_last: tuple[weakref.ref[asyncio.AbstractEventLoop], PassQueue] | None = None


def pass_queue(loop: asyncio.AbstractEventLoop) -> PassQueue:
    """The queue of ``loop``'s passes (one per loop)."""
    global _last
    last = _last
    if last is not None and last[0]() is loop:
        return last[1]
    queue = _QUEUES.get(loop)
    if queue is None:
        queue = _QUEUES[loop] = PassQueue(loop)
    _last = (weakref.ref(loop), queue)
    return queue
