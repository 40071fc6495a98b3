"""Helpers shared by the tests: leak checks, waiting for a condition, and running Python in a
fresh interpreter.

Tests wait for what they mean: an ``asyncio.Event`` set by an agent or worker, a flag file an env
creates in its host process (:func:`touch`), or, where a process must be watched from outside,
a bounded poll of a predicate (:func:`wait_until`). They never sleep a fixed time and hope it was
enough. The one exception, checking that something does *not* happen, has its own helper,
:func:`stays`, which names the window it watches.

The scripted envs and agents live in ``tests/envs.py`` (shipped to env hosts by value); the one
Ray fixture, ``ray_cluster``, and the ``no_leaks`` fixture are in ``tests/conftest.py``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import psutil

if TYPE_CHECKING:
    from asyncsample import Sampler

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"

#: Seconds a process that was told to end may take to be gone. Generous: on a loaded 2-core
#: machine reaping can take a while, and a test only waits this long when something leaked.
GONE_TIMEOUT = 30.0


class SamplerFactory(Protocol):
    """The type of the ``make_sampler`` fixture (``tests/conftest.py``)."""

    def __call__(
        self, backend: str | None = None, env: Any = None, agent: Any = None, **kwargs: Any
    ) -> Sampler: ...


#: Seconds a test waits for a condition that should come quickly before it fails. Generous, for
#: a loaded 2-core machine: a healthy test only waits as long as the condition takes.
WAIT_TIMEOUT = 30.0
#: Seconds between two looks at a polled condition.
POLL = 0.005


def touch(path: str | os.PathLike[str]) -> None:
    """Create ``path`` (a flag file: any process can see it, e.g. an env in its host process)."""
    with open(path, "a"):
        pass


async def wait_until(
    predicate: Callable[[], object], what: str, timeout: float = WAIT_TIMEOUT
) -> None:
    """Return as soon as ``predicate()`` is true; fail the test if it is not within ``timeout``.

    For conditions the event loop cannot be told about (another process's state, a flag file).
    The loop keeps running while it waits.

    Raises:
        AssertionError: naming ``what`` was awaited, after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        await asyncio.sleep(POLL)


def wait_until_blocking(
    predicate: Callable[[], object], what: str, timeout: float = WAIT_TIMEOUT
) -> None:
    """:func:`wait_until` that blocks the thread (and so the event loop, when that is the point)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(POLL)


async def stays(predicate: Callable[[], object], seconds: float) -> bool:
    """Whether ``predicate()`` holds throughout the next ``seconds`` (the loop runs meanwhile).

    The one timed wait of the suite: that something does *not* happen can only be watched for a
    while. Returns False as soon as the predicate fails, so a broken test fails fast.
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not predicate():
            return False
        await asyncio.sleep(POLL)
    return bool(predicate())


def shm_entries() -> set[str]:
    """Names in /dev/shm (empty where there is no /dev/shm)."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def new_shm_entries(before: set[str], settle: float = 2.0) -> list[str]:
    """Entries of /dev/shm that appeared since ``before`` and are ours.

    Other programs on the machine may create entries meanwhile; an entry counts as ours when this
    process or one of its descendants holds it, or when no process holds it (a leak). Another
    program's short-lived entries (multiprocessing's named semaphores, unlinked right after they
    are made) can look unheld for a moment: an entry is only reported if it is still ours after
    up to ``settle`` seconds; the answer comes at once when there is none.
    """
    deadline = time.monotonic() + settle
    while True:
        found = _new_shm_entries_now(before)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def _new_shm_entries_now(before: set[str]) -> list[str]:
    """One look for :func:`new_shm_entries`."""
    new = {e for e in shm_entries() - before if os.path.exists(f"/dev/shm/{e}")}
    if not new:
        return []
    holders: dict[str, set[int]] = {e: set() for e in new}
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for e in new:
            path = f"/dev/shm/{e}"
            if path in maps or path in fds:
                holders[e].add(pid)
    mine = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    return sorted(
        e for e in new if (not holders[e] or holders[e] & mine) and os.path.exists(f"/dev/shm/{e}")
    )


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(pids: Iterable[int], timeout: float = GONE_TIMEOUT) -> list[int]:
    """The pids still alive after waiting up to ``timeout`` seconds for them to end."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if alive(p)]
    return left


def _support_process(proc: psutil.Process) -> bool:
    """Python's multiprocessing forkserver or resource tracker: per-interpreter singletons that
    live until the interpreter exits and host no envs."""
    try:
        cmd = " ".join(proc.cmdline())
        direct = proc.ppid() == os.getpid()
    except psutil.Error:
        return True
    return direct and ("forkserver" in cmd or "resource_tracker" in cmd)


def descendants(root: int | None = None) -> list[int]:
    """Pids of the running descendants of ``root`` (default: this process)."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return []
    return [p.pid for p in children if alive(p.pid)]


def host_processes() -> list[int]:
    """Pids of this process's descendants other than Python's forkserver and resource tracker:
    env hosts and whatever they started."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        if not _support_process(proc) and alive(proc.pid):
            out.append(proc.pid)
    return out


def _ray_process(pid: int) -> bool:
    """Whether ``pid`` is one of Ray's own processes (its daemons and its worker pool, which
    outlives the actors it ran)."""
    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
    return "ray::" in cmd or f"{os.sep}ray{os.sep}" in cmd


def live_ray_actors() -> set[str]:
    """The ids of the actors Ray's control store does not report dead (none without Ray)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return set()
    from ray._private import state

    return {actor for actor, info in state.actors().items() if info["State"] != "DEAD"}


class leaves_nothing:
    """Fail if the block leaves a child process (other than Python's multiprocessing helpers),
    a /dev/shm entry of ours or, with Ray running, a live Ray actor behind. Use with ``with``
    or ``async with``. Ray's own processes (its daemons, and its worker pool, which outlives the
    actors it ran) are not counted: a Ray actor left running is found by Ray's own account.

    Args:
        collect: run the garbage collector first, for blocks that drop what they made without
            closing it. A full collection costs a noticeable fraction of a second once torch is
            imported, so callers that close everything themselves pass False.
    """

    def __init__(self, collect: bool = True) -> None:
        self.collect = collect

    def __enter__(self) -> None:
        self._procs = set(host_processes())
        self._shm = shm_entries()
        self._actors = live_ray_actors()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self.collect:
            gc.collect()
        if exc_type is not None:
            return  # the block's own failure is the one to report
        new = [p for p in host_processes() if p not in self._procs and not _ray_process(p)]
        left = wait_gone(new)
        assert not left, f"child processes outlived the block: {left}"
        deadline = time.monotonic() + WAIT_TIMEOUT
        actors = live_ray_actors() - self._actors
        while actors and time.monotonic() < deadline:
            time.sleep(POLL)
            actors = live_ray_actors() - self._actors
        assert not actors, f"Ray actors outlived the block: {sorted(actors)}"
        leaked = new_shm_entries(self._shm)
        assert not leaked, f"shared-memory segments outlived the block: {leaked}"

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.__exit__(exc_type, exc, tb)


def python_env() -> dict[str, str]:
    """The environment for a child Python that imports asyncsample and ``tests/envs.py``."""
    path = [str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def default_sigint() -> None:
    """For ``preexec_fn``: the child gets Ctrl-C's default action. A shell running the suite as
    a background job (``bash .ci/run &``) ignores SIGINT, an ignored signal stays ignored across
    ``exec``, and Python then never raises ``KeyboardInterrupt``: the tests of Ctrl-C would test
    the shell."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_python(code: str, *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (dedented) in a fresh interpreter; returns its exit status and output."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=python_env(),
        preexec_fn=default_sigint,
    )


def patient_direct_reads(monkeypatch: Any, seconds: float = WAIT_TIMEOUT) -> None:
    """Let a face's loop-free step wait ``seconds`` (not 50 ms, ``_DIRECT_WAIT``) for its hosts'
    replies before it hands the round to the loop: on a loaded machine a quiet step's reply can
    take longer, and a test of which steps run the loop must not depend on that."""
    from asyncsample.vector import _lockstep

    monkeypatch.setattr(_lockstep, "_DIRECT_WAIT", seconds)


def count_loop_runs(face: Any, monkeypatch: Any) -> list[int]:
    """A one-item list counting the runs of a vector-env face's portal loop from now on (every
    portal call, start and wait runs ``run_forever``): the loop-free lockstep steps run none."""
    loop = face._hosted.portal.loop
    runs = [0]
    run_forever = loop.run_forever

    def counted() -> None:
        runs[0] += 1
        run_forever()

    monkeypatch.setattr(loop, "run_forever", counted)
    return runs
