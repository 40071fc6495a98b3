"""Awaiting several coroutines at once; both helpers leave nothing running when they return or
raise (a cancellation of the caller cancels them all and waits for them)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

__all__ = ["run_all", "wait_all"]

_T = TypeVar("_T")


async def run_all(coros: Iterable[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run ``coros`` concurrently; the first error cancels the others and is raised as itself."""
    tasks: list[asyncio.Task[_T]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as group_error:
        error = group_error.exceptions[0]
        raise error from error.__cause__
    return [t.result() for t in tasks]


async def wait_all(coros: Iterable[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run ``coros`` concurrently to their ends, none cancelled by another's error (starting every
    host, say); then raise the first error (in the order given), if any."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]
