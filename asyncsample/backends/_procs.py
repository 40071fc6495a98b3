"""Env-host processes as processes: the forkserver they start from, Python's own helper
processes beside them, how an exit is told, and how a host's process tree is killed."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from typing import Any

import psutil

__all__ = ["forkserver_context", "describe_exit", "kill_tree", "support_process_pids"]

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
