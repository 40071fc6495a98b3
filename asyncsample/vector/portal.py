"""A blocking portal: synchronous callers run coroutines on one private event loop.

The loop runs in the caller's thread when that thread runs no loop (the usual case: no thread
handoff, which would cost several times a small env's step), else in a helper thread while the
caller blocks. A call interrupted from outside (``KeyboardInterrupt``) cancels its coroutine; the
cancellation completes at the next call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["BlockingPortal"]

_T = TypeVar("_T")


class BlockingPortal:
    """One private event loop, run on behalf of synchronous callers (see the module doc)."""

    def __init__(self) -> None:
        # asyncio's own loop, not uvloop: uvloop sets up its signal wake-up socket pair every
        # time it starts running in the main thread, and this loop is started once per call.
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None
        # The task of the call now running the loop (see _run).
        self._running: asyncio.Task[Any] | None = None

    def call(self, fn: Callable[..., Coroutine[Any, Any, _T]], *args: Any) -> _T:
        """Run ``fn(*args)`` on the portal's loop until it ends; its result or its exception."""
        result: _T = self._dispatch(self._run, fn, args)
        return result

    def start(self, fn: Callable[..., Coroutine[Any, Any, _T]], *args: Any) -> asyncio.Task[_T]:
        """Start ``fn(*args)`` as a task and run the loop until it waits on something (for
        ``step_async``: its requests are on their way); :meth:`wait` collects it."""
        return self._dispatch(self._start, fn, args)

    def wait(self, task: asyncio.Task[_T], timeout: float | None = None) -> _T:
        """Run the loop until ``task`` (from :meth:`start`) ends; its result or its exception.

        Raises:
            TimeoutError: ``timeout`` seconds passed first; the task runs on (wait again).
        """
        result: _T = self._dispatch(self._wait, task, timeout)
        return result

    def in_caller_thread(self) -> bool:
        """Whether calls run the loop in the caller's thread, which may then also use the
        loop's futures and the hosts' connections while the loop is idle."""
        return not self.loop.is_running() and not self.loop.is_closed() and not _in_running_loop()

    def close(self, wait: bool = True) -> None:
        """Stop the helper thread (``wait=False``, for finalizers: without waiting for it) and
        close the loop (idempotent)."""
        if self._helper is not None:
            self._helper.shutdown(wait=wait)
            self._helper = None
        if not self.loop.is_closed() and not self.loop.is_running():
            self.loop.close()

    # -- in the thread that runs the loop -------------------------------------------------------

    def _run(self, fn: Callable[..., Coroutine[Any, Any, _T]], args: tuple[Any, ...]) -> _T:
        # Not run_until_complete: its done callback costs the loop one more iteration (and the
        # future plumbing around it) per call. The task stops the loop itself as it ends.
        with self._lock:
            loop = self.loop
            task = loop.create_task(self._stop_at_end(fn, args))
            self._running = task
            try:
                loop.run_forever()
            except BaseException:
                if not task.done():
                    task.cancel()  # interrupted from outside: the next run completes the cancel
                raise
            finally:
                self._running = None
            if not task.done():  # the loop was stopped by something else: finish the call
                return self._until_done(task)
            return task.result()

    async def _stop_at_end(
        self, fn: Callable[..., Coroutine[Any, Any, _T]], args: tuple[Any, ...]
    ) -> _T:
        """Await ``fn(*args)``, then stop the loop if this is still the call it runs (a call
        cancelled by an interruption ends during a later call, which it must not stop)."""
        try:
            return await fn(*args)
        finally:
            if self._running is not None and self._running is asyncio.current_task(self.loop):
                self.loop.stop()

    def _start(
        self, fn: Callable[..., Coroutine[Any, Any, _T]], args: tuple[Any, ...]
    ) -> asyncio.Task[_T]:
        with self._lock:
            task = self.loop.create_task(fn(*args))
            self.loop.run_until_complete(asyncio.sleep(0))  # ready tasks run once
            return task

    def _wait(self, task: asyncio.Task[_T], timeout: float | None) -> _T:
        with self._lock:
            if timeout is not None and not task.done():
                self.loop.run_until_complete(asyncio.wait({task}, timeout=max(0.0, timeout)))
                if not task.done():
                    raise TimeoutError(f"the call did not end within {timeout} seconds")
            return self._until_done(task)

    def _until_done(self, task: asyncio.Task[_T]) -> _T:
        try:
            return self.loop.run_until_complete(task)
        except BaseException:
            if not task.done():
                task.cancel()  # interrupted from outside: the next run completes the cancel
            raise

    def _dispatch(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` here, or in the helper thread when this thread runs a loop."""
        if not _in_running_loop():
            return fn(*args)
        if self._helper is None:
            self._helper = concurrent.futures.ThreadPoolExecutor(1, "asyncsample-portal")
        return self._helper.submit(fn, *args).result()


def _in_running_loop() -> bool:
    return asyncio._get_running_loop() is not None  # get_running_loop's test, without raising
