"""A blocking gymnasium env behind coroutines, its calls run in a thread pool: the ``thread``
backend's envs (see :mod:`asyncsample.backends.aio`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
from collections.abc import Callable
from typing import Any

import gymnasium as gym

__all__ = ["ThreadedEnv", "default_threads"]


def default_threads() -> int:
    """The ``thread`` backend's pool size when ``max_concurrency`` is not given: 4 per core."""
    return 4 * (os.cpu_count() or 1)


class ThreadedEnv:
    """A blocking gymnasium env behind coroutine ``reset``/``step``/``close``, its calls run in
    ``executor`` one at a time (also after a cancelled one: a thread cannot be interrupted)."""

    def __init__(
        self,
        env: gym.Env,
        executor: concurrent.futures.Executor,
        running: set[concurrent.futures.Future[Any]] | None = None,
    ) -> None:
        self.env = env
        self.observation_space = env.observation_space
        self.action_space = env.action_space
        self._executor = executor
        self.busy: concurrent.futures.Future[Any] | None = None  # its last call (may still run)
        self._running = running if running is not None else set()  # the backend's calls

    def _submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        future = self._executor.submit(fn, *args, **kwargs)
        self._running.add(future)
        future.add_done_callback(self._running.discard)
        return future

    @property
    def unwrapped(self) -> Any:
        """The blocking env's own ``unwrapped`` (``SetTaskUpdate`` reaches it this way)."""
        return self.env.unwrapped

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        busy = self.busy
        if busy is not None and not busy.done():
            await asyncio.wait([asyncio.wrap_future(busy)])
        future = self._submit(fn, *args, **kwargs)
        self.busy = future
        return await asyncio.wrap_future(future)

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """``env.reset`` in a pool thread."""
        kwargs = {} if options is None else {"options": options}
        return await self._run(self.env.reset, seed=seed, **kwargs)  # type: ignore[no-any-return]

    async def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """``env.step`` in a pool thread."""
        return await self._run(self.env.step, action)  # type: ignore[no-any-return]

    async def close(self) -> None:
        """``env.close`` in a pool thread; behind a call still running (a hung step) it is
        queued, not awaited: waiting could hold the caller as long as the stuck call."""
        busy = self.busy
        if busy is not None and not busy.done():
            env = self.env

            def close_after(_: concurrent.futures.Future[Any]) -> None:
                with contextlib.suppress(RuntimeError):  # the pool was shut down meanwhile
                    self._submit(env.close)

            busy.add_done_callback(close_after)
            return
        await self._run(self.env.close)
