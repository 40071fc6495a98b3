"""Env-host processes as processes: the forkserver they start from, Python's own helper
processes beside them, how one is started off the event loop's thread, how an exit is told,
and how a host's process tree is killed."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import multiprocessing
import multiprocessing.util  # before our atexit hook: hooks run last-in first-out, ours first
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import psutil

__all__ = [
    "KILL_WAIT",
    "describe_exit",
    "forkserver_context",
    "kill_started",
    "kill_tree",
    "release_all",
    "start_hidden",
    "start_process",
    "support_process_pids",
    "track",
]

#: Imported once by the forkserver for every host. Not ``__main__``: envs travel by cloudpickle,
#: so the user's script needs no ``if __name__ == "__main__":`` guard.
_PRELOAD = ["numpy", "gymnasium", "asyncsample.backends._host_main"]


def forkserver_context() -> Any:
    """The forkserver context, with numpy, gymnasium and the host module preloaded."""
    ctx = multiprocessing.get_context("forkserver")
    from multiprocessing import forkserver

    current = list(getattr(forkserver._forkserver, "_preload_modules", None) or [])
    wanted = current + [m for m in _PRELOAD if m not in current]
    if wanted != current:
        ctx.set_forkserver_preload(wanted)
    return ctx


def support_process_pids() -> set[int]:
    """Pids of Python's own multiprocessing helpers (the forkserver and the resource tracker),
    which live as long as the interpreter: leak checks leave them out."""
    from multiprocessing import forkserver, resource_tracker

    pids = {
        getattr(forkserver._forkserver, "_forkserver_pid", None),
        getattr(resource_tracker._resource_tracker, "_pid", None),
    }
    return {pid for pid in pids if pid is not None}


def describe_exit(code: int | None) -> str:
    """How a host process ended, from its exit code (``None``: unknown), for messages."""
    if code is None:
        return "died"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


def kill_tree(proc: psutil.Process | None, pid: int) -> None:
    """SIGKILL a host process, its descendants, and whatever is left in its process group."""
    children: list[psutil.Process] = []
    if proc is not None:
        with contextlib.suppress(psutil.Error):
            children = proc.children(recursive=True)
        with contextlib.suppress(psutil.Error):
            proc.kill()  # psutil refuses if the pid was reused by another process
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    # The host made itself leader of its own group: this also reaches orphans of a dead host.
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def host_cpus(n_hosts: int, pin: bool | None) -> list[int | None]:
    """The CPU each of ``n_hosts`` host processes is pinned to (``None``: not pinned).

    ``True``: host ``i`` on the ``i``-th allowed CPU (round robin); ``None``: so only with a host
    for every allowed CPU (Linux keeps a woken host on its cache-hot CPU, so two hosts that met
    on one can stay there, waiting for each other every lockstep round, while another idles).
    """
    getaffinity = getattr(os, "sched_getaffinity", None)
    if pin is False or getaffinity is None:
        return [None] * n_hosts
    allowed = sorted(getaffinity(0))
    if pin is None and (len(allowed) < 2 or n_hosts < len(allowed)):
        return [None] * n_hosts
    return [allowed[i % len(allowed)] for i in range(n_hosts)]


def pin(pid: int, cpu: int | None) -> None:
    """Pin process ``pid`` to ``cpu`` (nothing for ``None``; a failure only costs speed)."""
    if cpu is not None:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setaffinity(pid, {cpu})


#: How long a killed host process is waited for (reaped) before it is left to the OS.
KILL_WAIT = 5.0

#: Starts host processes off the loop's thread, one at a time (Process.start() is not
#: thread-safe); a thread of our own, as the loop's default executor may be anything.
_STARTER = concurrent.futures.ThreadPoolExecutor(1, "asyncsample-host-start")


def start_hidden(process: Any) -> None:
    """``process.start()`` with ``__main__``'s ``__file__`` and ``__spec__`` hidden, so the new
    host does not re-run the main script."""
    main = sys.modules.get("__main__")
    if main is None:
        process.start()
        return
    saved: dict[str, Any] = {
        k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__
    }
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        process.start()
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


async def start_process(process: Any) -> None:
    """``process.start()`` off the loop's thread (killed if the caller is cancelled meanwhile)."""
    fut = asyncio.get_running_loop().run_in_executor(_STARTER, start_hidden, process)
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({fut})
        if not fut.cancelled() and fut.exception() is None:
            kill_started(process)
        raise


def kill_started(process: Any) -> None:
    """Kill and reap a host process that was started but will not be used."""
    kill_tree(None, process.pid)
    with contextlib.suppress(Exception):
        process.kill()
        process.join(KILL_WAIT)
        process.close()


def release_all(members: Sequence[Any], token: int) -> None:
    """Release every incarnation of the pool ``members`` (each ``release()``: kill, reap, close)
    and forget ``token`` (see :func:`track`)."""
    _LIVE.pop(token, None)
    for member in members:
        for conn in member.incarnations:
            conn.release()


def track(members: Sequence[Any]) -> int:
    """Have the pool ``members`` of a backend released at the interpreter's exit if it is not
    closed by then; the token :func:`release_all` forgets them by."""
    token = next(_TOKENS)
    _LIVE[token] = members
    return token


#: The members of every backend not yet closed, by token (released at interpreter exit).
_LIVE: dict[int, Sequence[Any]] = {}
_TOKENS = itertools.count()


def _release_at_exit() -> None:
    for token, members in list(_LIVE.items()):
        release_all(members, token)


# The hosts must be gone before multiprocessing joins its children at exit (it would wait
# forever on a host reading from us): an atexit hook, registered after multiprocessing's so it
# runs first, and a multiprocessing finalizer, run before the join, whichever comes first
# (weakref.finalize objects are disabled by then).
atexit.register(_release_at_exit)
multiprocessing.util.Finalize(None, _release_at_exit, exitpriority=100)
