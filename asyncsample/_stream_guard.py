"""Refusing, at once, a call that an open ``stream()`` of the same sampler would block forever.

A stream holds its sampler until it closes, and other calls queue behind it (the contract). A
call made from the stream's own body can never run: the body would have to finish first. This
guard tells those calls apart from the ones that may queue:

- the call runs in the task the stream last handed a batch to (the body itself), or
- the call runs in a task started from the body (it carries the body's context marker) and the
  body's task is suspended waiting for that task: directly, or through ``asyncio.wait_for``,
  ``asyncio.gather`` or the exit of an ``asyncio.TaskGroup``.

A task the body starts and does not wait for still queues, as any other task's call does.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
from typing import Any

from asyncsample.errors import SamplerBusyError

__all__ = ["StreamGuard"]

_BODIES: contextvars.ContextVar[tuple[object, ...]] = contextvars.ContextVar(
    "asyncsample_stream_bodies", default=()
)
"""The open streams whose body the current context runs in (or was started from)."""

_ASYNCIO_DIR = os.path.dirname(asyncio.__file__)
_MAX_NODES = 256


class StreamGuard:
    """The open stream of one sampler, if any, and the check every locked call makes."""

    def __init__(self) -> None:
        self._open: object | None = None
        self._body: asyncio.Task[Any] | None = None

    def opened(self) -> None:
        """A stream took the sampler."""
        self._open = object()
        self._body = None

    def closed(self) -> None:
        """The stream released the sampler."""
        self._open = None
        self._body = None

    def handing_out(self) -> None:
        """The stream is about to yield a batch: the current task and context run its body."""
        stream = self._open
        if stream is None:
            return
        self._body = asyncio.current_task()
        bodies = _BODIES.get()
        if stream not in bodies:
            # The generator runs in its consumer's context: the marker stays there (and in the
            # tasks started from it) until this stream closes; a stale marker is never matched.
            _BODIES.set((*bodies[-7:], stream))

    def check(self, call: str) -> None:
        """Raise :class:`SamplerBusyError` if ``call`` comes from the open stream's body."""
        stream, body = self._open, self._body
        if stream is None or body is None:
            return
        task = asyncio.current_task()
        if task is body:
            where = "the task that iterates an open stream() of this sampler (in the body"
        elif task is not None and stream in _BODIES.get() and _waits_for(body, task):
            where = (
                "a task that the body of an open stream() of this sampler waits for (in the body"
            )
        else:
            return
        raise SamplerBusyError(
            f"{call}() was called from {where} of an open stream): the stream holds the sampler "
            "until it closes, so the call would wait forever. Close the stream first (leave its "
            "'async for' loop or aclose() it), or make the call from a task the stream's body "
            "does not wait for (it then runs when the stream closes); update_agent() applies at "
            "once during a stream"
        )


def _waits_for(waiter: asyncio.Task[Any], task: asyncio.Task[Any]) -> bool:
    """Whether ``waiter`` is suspended until ``task`` ends (best effort, see the module doc).

    Walks what ``waiter`` is suspended in: the chain of awaited coroutines, the tasks and futures
    asyncio's own frames hold (``wait_for``'s inner task, ``gather``'s children, a task group's
    tasks), and what those tasks are suspended in, in turn.
    """
    if waiter.done():
        return False
    todo: list[Any] = [waiter]
    seen: set[int] = set()
    while todo and len(seen) < _MAX_NODES:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node is task:
            return True
        if isinstance(node, asyncio.Future):
            todo.extend(getattr(node, "_children", None) or ())  # gather's future
            if isinstance(node, asyncio.Task) and not node.done():
                todo.append(node.get_coro())
                todo.append(getattr(node, "_fut_waiter", None))  # what `await future` waits on
            continue
        frame = getattr(node, "cr_frame", None)
        if frame is not None and frame.f_code.co_filename.startswith(_ASYNCIO_DIR):
            for value in frame.f_locals.values():
                if isinstance(value, asyncio.Future):
                    todo.append(value)
                else:
                    todo.extend(getattr(value, "_tasks", None) or ())  # a TaskGroup
        todo.append(getattr(node, "cr_await", None) or getattr(node, "gi_yieldfrom", None))
    return False
