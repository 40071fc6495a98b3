"""Closing envs with a bound (``close_timeout``): a ``close()`` that never returns (a dead remote
session) must not hold a restart, an env update or ``aclose()``."""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from typing import Any

from asyncsample import _validate
from asyncsample._daemon_threads import start_daemon
from asyncsample.async_env import close_env
from asyncsample.backends.base import LOGGER

__all__ = [
    "CLOSE_TIMEOUT",
    "cancelled_by_env",
    "close_bounded",
    "close_off_loop",
    "exit_grace",
    "optional_close_timeout",
    "settled_grace",
    "wait_closed",
]

CLOSE_TIMEOUT = 10.0
"""The default ``close_timeout``: the longest a restart or ``aclose()`` waits for an env's
``close()``."""

_CANCEL_GRACE = 0.1
"""Seconds a cancelled close may take to unwind before it is abandoned."""


def optional_close_timeout(value: object) -> float | None:
    """A backend's ``close_timeout`` option: ``None`` (the backend's own default) or seconds."""
    if value is None:
        return None
    return _validate.seconds("close_timeout", value)


def exit_grace(close_timeout: float | None, busy: bool, default: float) -> float:
    """Seconds an env host asked to exit (it closes its envs first) gets before it is killed:
    ``close_timeout``, or ``default`` when none was given. A host still ``busy`` with a call (a
    step that may never return) cannot close anything before that call ends: it gets at most
    ``default``, as before ``close_timeout`` reached the hosts."""
    if close_timeout is None:
        return default
    return min(close_timeout, default) if busy else close_timeout


async def settled_grace(host: Any, close_timeout: float | None, default: float) -> float:
    """:func:`exit_grace` of a remote ``host`` (a process host's connection: its ``calls``, each
    with a ``future``, and its bare steps in flight, ``direct``) whose calls may still run, such
    as a chunk of ``inference="host"`` that goes on after its call returned: they are waited for
    first, within the busy host's grace (``default``); once answered, the host is idle and gets
    all of ``close_timeout`` for its envs' closes (it was killed mid-close at the busy grace)."""
    direct = bool(host.direct)
    pending = [call.future for call in host.calls if not call.future.done()]
    busy = exit_grace(close_timeout, True, default)
    if not pending or direct:  # a bare step in flight may never return: the busy grace
        return exit_grace(close_timeout, bool(pending or direct), default)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await asyncio.wait(pending, timeout=busy)
    if any(not f.done() for f in pending):
        return max(busy - (loop.time() - start), 0.0)
    return exit_grace(close_timeout, False, default)


async def wait_closed(closing: asyncio.Future[Any] | None, timeout: float, what: str) -> bool:
    """Wait at most ``timeout`` seconds for a close running in a thread (``closing``, from
    :func:`close_off_loop`); whether it finished. Else it is abandoned with a
    :class:`ResourceWarning` naming ``what`` (its daemon thread holds neither loop nor exit)."""
    if closing is None or closing.done():
        return True
    _, stuck = await asyncio.wait([closing], timeout=timeout)
    if not stuck:
        return True
    warnings.warn(
        f"{what}: close() did not return within close_timeout={timeout:g}s; its thread is "
        "abandoned",
        ResourceWarning,
        stacklevel=2,
    )
    return False


def cancelled_by_env() -> bool:
    """Whether a ``CancelledError`` being handled now is the env's own, not the sampler's: the
    sampler's ``Task.cancel()`` is counted by ``Task.cancelling()``, an env's raise is not."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


async def close_bounded(env: Any, timeout: float, where: str) -> bool:
    """Close ``env`` (awaiting an async ``close``, errors logged); whether it finished within
    ``timeout`` seconds. Else it is cancelled, or abandoned if it will not stop, with a
    :class:`ResourceWarning` naming the env (``where``: ``"env 3 of worker 0"``)."""
    task = asyncio.ensure_future(_close_logged(env))
    try:
        done, _ = await asyncio.wait([task], timeout=timeout)
        if done:
            return True
        task.cancel()
        await asyncio.wait([task], timeout=_CANCEL_GRACE)
    except asyncio.CancelledError:
        task.cancel()
        raise
    warnings.warn(
        f"{where}: its close() did not return within close_timeout={timeout:g}s; "
        + ("it was cancelled" if task.done() else "it is abandoned (it ignored cancellation)"),
        ResourceWarning,
        stacklevel=2,
    )
    return False


def close_off_loop(env: Any) -> asyncio.Future[None] | None:
    """Close a blocking env in a daemon thread of its own (a close stuck for good holds
    neither the loop nor, for long, the interpreter's exit); the future says when it is done
    (``None``: no loop runs here, the env was closed at once)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        _close_sync(env)
        return None
    future: asyncio.Future[None] = loop.create_future()

    def finished() -> None:
        if not future.done():
            future.set_result(None)

    def run() -> None:
        _close_sync(env)
        with contextlib.suppress(RuntimeError):  # the loop was closed meanwhile
            loop.call_soon_threadsafe(finished)

    start_daemon(run, name="asyncsample-close")
    return future


def _close_sync(env: Any) -> None:
    try:
        env.close()
    except Exception as exc:
        LOGGER.debug("closing an env raised %r", exc)


async def _close_logged(env: Any) -> None:
    try:
        await close_env(env)
    except Exception as exc:
        LOGGER.debug("closing an env raised %r", exc)
