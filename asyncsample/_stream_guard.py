"""Refusing, at once, a call that an open ``stream()`` of the same sampler would block forever.

A call from the stream's own body could never run. The body is the context the stream hands its
batches to (a context variable): the iterating task once it has a batch, and the tasks started
from it after that (they copy its context). Calls from anywhere else queue behind the stream.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

from asyncsample.errors import SamplerBusyError

__all__ = ["StreamGuard"]

_BODIES: contextvars.ContextVar[tuple[object, ...]] = contextvars.ContextVar(
    "asyncsample_stream_bodies", default=()
)
"""The streams whose body the current context runs (or was started from)."""


class StreamGuard:
    """The open stream of one sampler, if any, and the check every locked call makes."""

    def __init__(self) -> None:
        self._open: object | None = None
        self._task: asyncio.Task[Any] | None = None  # the one the stream last handed a batch to

    def opened(self) -> None:
        """A stream took the sampler."""
        self._open = object()

    def closed(self) -> None:
        """The stream released the sampler."""
        self._open = self._task = None

    def handing_out(self) -> None:
        """The stream is about to yield a batch: the current context runs its body."""
        stream = self._open
        if stream is not None:
            self._task = asyncio.current_task()
            bodies = _BODIES.get()
            if stream not in bodies:  # stays after the stream closes, never matched again
                _BODIES.set((*bodies[-7:], stream))

    def check(self, call: str) -> None:
        """Raise :class:`SamplerBusyError` if ``call`` comes from the open stream's body."""
        stream = self._open
        if stream is not None and stream in _BODIES.get():
            where = (
                "the task that iterates an open stream() of this sampler (in the body of an open "
                "stream)"
                if asyncio.current_task() is self._task
                else "a task started from the body of an open stream() of this sampler"
            )
            raise SamplerBusyError(
                f"{call}() was called from {where}: the stream holds the sampler until it "
                "closes, so the call would wait forever. Close the stream first (leave its "
                "'async for' loop or aclose() it), or make the call from a task started before "
                "the stream or outside its body (it then runs when the stream closes); "
                "update_agent() applies at once during a stream"
            )
