"""Daemon threads the interpreter's exit waits for, for a while.

The sampler builds and closes blocking envs in daemon threads of their own, so that a build or a
close stuck for good holds neither the event loop nor the interpreter's exit. But the
interpreter ends daemon threads still running at exit from inside their next wait for the GIL,
and a thread ended that way inside an extension's C++ frames (MuJoCo building a model as
``asyncio.run`` returns) crashes the process with a segmentation fault. So the exit waits for
these threads, at most :data:`EXIT_GRACE_S` seconds in all, then leaves the stuck ones behind.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["EXIT_GRACE_S", "start_daemon"]

EXIT_GRACE_S = 10.0
"""How long, in all, the interpreter's exit waits for the threads :func:`start_daemon` started."""

_RUNNING: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def start_daemon(target: Callable[..., None], *args: Any, name: str) -> threading.Thread:
    """Start ``target(*args)`` in a daemon thread that the interpreter's exit waits for."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    _RUNNING.add(thread)
    thread.start()
    return thread


@atexit.register
def _join_at_exit() -> None:
    deadline = time.monotonic() + EXIT_GRACE_S
    for thread in list(_RUNNING):
        thread.join(max(0.0, deadline - time.monotonic()))
