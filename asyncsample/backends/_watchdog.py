"""Watching event loops (and a lockstep host's serving thread) from outside: a loop that stops
turning is found, and the line that stopped it named.

An ``asyncio`` timeout cannot fire while a coroutine blocks its loop (a ``time.sleep``, a
``requests.get`` or a looping verifier inside ``async def step``): only a watch from another
thread can. The loop bumps a counter from a timer (:func:`tick`: a callback every
:data:`TICK` seconds, nothing per step); one watchdog thread per process (:class:`Watch`, polled
by :func:`watch`) sees the counter stand still for ``limit`` seconds, captures the watched
thread's stack (``sys._current_frames()``, the ``faulthandler`` way) and names the env whose call
was running and the line it was blocked at (:func:`name_block`). A host of envs writes that
report into a shared block (:func:`write_report`) for the caller, which kills and restarts it;
the caller's own loop cannot be pre-empted, so there it is a warning and the env's fault once
the block ends.
"""

from __future__ import annotations

import asyncio
import inspect
import linecache
import logging
import os
import pickle
import sys
import sysconfig
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

import numpy as np

from asyncsample.errors import LoopBlockedError

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_LIMIT",
    "ENV_CALL_MARK",
    "LOOP_FLOOR",
    "REPORT_GRACE",
    "STALLED_AT_CLOSE",
    "SITE_METHODS",
    "BlockReport",
    "CallerWatch",
    "TICK",
    "Watch",
    "blocked_error",
    "clear_report",
    "env_calls",
    "env_site",
    "forget_report",
    "loop_limit",
    "name_block",
    "read_report",
    "stop_watch",
    "tick",
    "turns_of",
    "unwatch",
    "watch",
    "write_report",
]

#: Seconds between two bumps of a watched loop's counter (a timer callback: nothing per step).
TICK = 0.05
#: Bytes of the shared block of a host: the counter, the report's length, the pickled report.
BLOCK_BYTES = 16 + 16 * 1024
#: The shortest stand-still of an event loop that counts as a block, in seconds, whatever
#: ``step_timeout`` says: on a loaded machine a healthy loop can stall for a fraction of a second
#: (descheduled, a collection of a large heap) with no env at fault.
LOOP_FLOOR = 1.0
#: Seconds a host's call past ``step_timeout`` waits for the host's watchdog to say where it
#: stands before the host is killed; and how much longer than ``step_timeout`` a host of async
#: envs whose loop stands still gets when its watchdog says nothing (a call holding the GIL).
REPORT_GRACE = 0.5
#: Seconds a host of async envs being closed may leave its loop standing still before it is
#: killed (it cannot close its envs while an env blocks its loop): aclose() does not wait out
#: ``close_timeout`` for a host that cannot use it.
STALLED_AT_CLOSE = 0.5
#: The longest pause between two looks of the watchdog thread, in seconds.
_POLL = 0.1

_ADVICE = {
    "loop": "an AsyncEnv must await, not block; move blocking work to asyncio.to_thread",
    "caller": (
        "an AsyncEnv must await, not block; move blocking work to asyncio.to_thread, or use "
        "backend='process', whose hosts are killed and restarted when their loop stops"
    ),
    "thread": "its host was killed and restarted",
}


@dataclass(frozen=True)
class BlockReport:
    """Where a watched loop (or serving thread) stood still.

    Attributes:
        worker, env: the env whose call was running (``None``: not found in the stack).
        what: that call (``"step"``, ``"reset"``, ``"build"``...).
        seconds: how long the loop had stood still when the stack was taken.
        file, line, code: the line it stood at (the innermost frame of the env's own code).
        stack: the watched thread's stack, formatted.
        where: ``"loop"`` (a host's event loop), ``"caller"`` (the sampler's own loop) or
            ``"thread"`` (a lockstep host's serving thread).
    """

    worker: int | None
    env: int | None
    what: str
    seconds: float
    file: str
    line: int
    code: str
    stack: str
    where: str = "loop"

    def place(self) -> str:
        """``verify.py:42 (time.sleep(30))``."""
        text = f"{os.path.basename(self.file)}:{self.line}"
        return f"{text} ({self.code})" if self.code else text

    def culprit(self) -> str:
        """``env 17 of worker 3`` (or what is known of it)."""
        if self.env is not None and self.worker is not None:
            return f"env {self.env} of worker {self.worker}"
        if self.worker is not None:
            return f"an env of worker {self.worker}"
        return "an env"

    def message(self) -> str:
        """The one line an error or warning says."""
        if self.env is None:  # not in an env's call: the agent, the caller's code, a build
            loop = {
                "caller": "the sampler's event loop",
                "thread": "its host's serving thread",
            }.get(self.where, "its host's event loop")
            return (
                f"{loop} stood still for {self.seconds:.1f} s at {self.place()}, not in an env's "
                "reset or step"
            )
        if self.where == "thread":
            return (
                f"{self.culprit()} blocked its host's serving thread for {self.seconds:.1f} s in "
                f"{self.what} at {self.place()}: {_ADVICE['thread']}"
            )
        loop = "the sampler's event loop" if self.where == "caller" else "its host's event loop"
        return (
            f"{self.culprit()} blocked {loop} for {self.seconds:.1f} s in {self.what} at "
            f"{self.place()}: {_ADVICE[self.where]}"
        )


def loop_limit(step_timeout: float) -> float:
    """How long a watched event loop may stand still: ``step_timeout``, at least
    :data:`LOOP_FLOOR`."""
    return max(step_timeout, LOOP_FLOOR)


# -- naming the culprit -----------------------------------------------------------------------

_F = TypeVar("_F", bound=Callable[..., Any])

#: The code objects of the calls an env runs in, with the call's name (see :func:`env_calls`).
_SITES: dict[Any, str] = {}


#: The public methods of a host class that an env's call runs under, by the call they name;
#: their frames hold the env's index ``i`` while it runs (a lane host's ``step_one``, an
#: ``EnvGroup``'s ``step`` over its envs...).
SITE_METHODS = {
    "step_one": "step",
    "reset_one": "reset",
    "rebuild_one": "build",
    "step": "step",
    "reset": "reset",
    "build": "build",
}


#: Per site of :func:`env_site`, the lines where its frame awaits the env's call: elsewhere
#: (its own work, an agent's) it names no env.
_SITE_LINES: dict[Any, frozenset[int]] = {}

#: What ends the line of an :func:`env_site` where the env's call is awaited.
ENV_CALL_MARK = "# the env's call"


def env_site(what: str) -> Callable[[_F], _F]:
    """Decorate a function whose frame holds the env's index ``i`` (and ``self`` or ``host``
    with its worker) as one an env's ``what`` runs under, on its lines that end with
    :data:`ENV_CALL_MARK` (a lane that awaits its env's step itself)."""

    def site(fn: _F) -> _F:
        try:
            lines, first = inspect.getsourcelines(fn)
        except OSError:  # no source: the whole frame counts
            lines, first = [], 0
        marked = [
            first + k for k, line in enumerate(lines) if line.rstrip().endswith(ENV_CALL_MARK)
        ]
        if marked:
            _SITE_LINES[fn.__code__] = frozenset(marked)
        _SITES[fn.__code__] = what
        return fn

    return site


def env_calls(owner: type) -> None:
    """Register the methods of ``owner`` (a host class) that an env's call runs under (see
    :data:`SITE_METHODS`): :func:`name_block` finds the env in their frames."""
    for name, what in SITE_METHODS.items():
        method = getattr(owner, name, None)
        code = getattr(method, "__code__", None)
        if code is not None:
            _SITES[code] = what


def _library(filename: str) -> bool:
    """Whether ``filename`` is the standard library's or this package's (not the env's code)."""
    return filename.startswith(_STDLIB) or filename.startswith(_PACKAGE) or filename[:1] == "<"


_STDLIB = tuple(
    p for p in {sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")} if p
)
_PACKAGE = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)


def name_block(frame: FrameType, seconds: float, where: str = "loop") -> BlockReport:
    """The :class:`BlockReport` of the stack whose innermost frame is ``frame``."""
    sites = _SITES
    inner: list[FrameType] = []  # innermost first, down to the env call's own frame
    worker: int | None = None
    env: int | None = None
    what = "a call"
    f: FrameType | None = frame
    while f is not None:
        code = f.f_code
        lines = _SITE_LINES.get(code)
        if code in sites and (lines is None or f.f_lineno in lines):
            local = f.f_locals
            owner, i = local.get("self"), local.get("i")
            found = sites[code]
            if isinstance(i, int) and owner is not None:
                spec = getattr(owner, "spec", None)
                w = getattr(spec, "worker", None) if spec is not None else None
                w = getattr(owner, "worker", None) if w is None else w
                if not isinstance(w, int):  # a lane's frame: its host's worker
                    w = getattr(getattr(local.get("host"), "spec", None), "worker", None)
                worker = w if isinstance(w, int) else None
                env, what = i, str(found or "a call")
                break
        inner.append(f)
        f = f.f_back
    own = [x for x in inner if not _library(_file_of(x))]
    chosen = own[0] if own else (inner[0] if inner else frame)
    file, line = _file_of(chosen), chosen.f_lineno
    code_line = linecache.getline(file, line).strip()
    shown = ([f] if f is not None else []) + inner[::-1]  # from the env call inward
    stack = "".join(
        traceback.format_list(
            [traceback.FrameSummary(_file_of(x), x.f_lineno, x.f_code.co_name) for x in shown]
        )
    )
    return BlockReport(worker, env, what, seconds, file, line, code_line, stack, where)


def _file_of(frame: FrameType) -> str:
    """The file of ``frame``'s code: cloudpickle ships code by value as ``<dynamic-code>``
    (an env defined in the user's script), but its globals keep the module's ``__file__``."""
    name = frame.f_code.co_filename
    if name[:1] == "<":
        file = frame.f_globals.get("__file__")
        if isinstance(file, str):
            return file
    return name


# -- the shared block of a host ---------------------------------------------------------------


def turns_of(block: np.ndarray) -> np.ndarray:
    """The counter of a shared block (uint8, :data:`BLOCK_BYTES`), as a one-cell int64 view."""
    return block[:8].view(np.int64)


def write_report(block: np.ndarray, report: BlockReport) -> None:
    """Write ``report`` into ``block`` (cut to fit), its length last."""
    data = pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)
    room = len(block) - 16
    if len(data) > room:  # the stack is what may not fit: keep its innermost part
        cut = report.stack[-(room // 2) :]
        data = pickle.dumps(
            BlockReport(**{**report.__dict__, "stack": cut}), protocol=pickle.HIGHEST_PROTOCOL
        )
        data = data if len(data) <= room else b""
    length = block[8:16].view(np.int64)
    length[0] = 0
    block[16 : 16 + len(data)] = np.frombuffer(data, np.uint8)
    length[0] = len(data)


def read_report(block: np.ndarray) -> BlockReport | None:
    """The report in ``block``, if any."""
    n = int(block[8:16].view(np.int64)[0])
    if n <= 0 or n > len(block) - 16:
        return None
    try:
        report = pickle.loads(block[16 : 16 + n].tobytes())
    except Exception:  # written while read: the next look has it whole
        return None
    return report if isinstance(report, BlockReport) else None


def clear_report(block: np.ndarray) -> None:
    """Forget the report of ``block`` and zero its counter (a new host starts)."""
    block[:16] = 0


def forget_report(block: np.ndarray) -> None:
    """Forget the report of ``block`` (the stall it told of ended); its counter stays."""
    block[8:16] = 0


# -- the watchdog thread ----------------------------------------------------------------------


def tick(loop: Any, counter: np.ndarray, also: Callable[[], None] | None = None) -> Any:
    """Bump ``counter[0]`` from ``loop`` every :data:`TICK` seconds (and call ``also``), until
    the returned handle's ``cancel()``."""
    handle = _Ticker(loop, counter, also)
    handle.arm()
    return handle


class _Ticker:
    def __init__(self, loop: Any, counter: np.ndarray, also: Callable[[], None] | None) -> None:
        self.loop, self.counter, self.also = loop, counter, also
        self.timer: Any = None

    def arm(self) -> None:
        self.timer = self.loop.call_later(TICK, self.run)

    def run(self) -> None:
        self.counter[0] += 1
        if self.also is not None:
            self.also()
        self.arm()

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Watch:
    """A thread watched for standing still ``limit`` seconds.

    Args:
        limit: the seconds the counter may stand still.
        counter: a one-cell int64 array (or list) the watched thread bumps (:func:`tick`, or a
            lockstep host around each request: odd while it serves one).
        on_block: called from the watchdog thread with the :class:`BlockReport` and whether it is
            the first of this stall; again at each look while the stall lasts (the stack fresh).
        serving: a lockstep host's counter: judged only while odd (a request being served).
        where: see :class:`BlockReport`.
        thread: the watched thread's id (default: the caller's).
        on_move: called when the counter moves again after a stall was reported.
    """

    def __init__(
        self,
        limit: float,
        counter: np.ndarray | list[int],
        on_block: Callable[[BlockReport, bool], None],
        serving: bool = False,
        where: str = "loop",
        thread: int | None = None,
        on_move: Callable[[], None] | None = None,
    ) -> None:
        self.limit = limit
        self.counter = counter
        self.on_block = on_block
        self.on_move = on_move
        self.serving = serving
        self.where = where
        self.thread = threading.get_ident() if thread is None else thread
        self.seen = int(counter[0])
        self.since = time.monotonic()
        self.told = False

    def look(self, now: float) -> None:
        """One look (from the watchdog thread)."""
        count = int(self.counter[0])
        if count != self.seen or (self.serving and count % 2 == 0):
            if self.told and self.on_move is not None:
                self.on_move()  # the stall ended: what was said of it no longer holds
            self.seen, self.since, self.told = count, now, False
            return
        stalled = now - self.since
        if stalled < self.limit:
            return
        frame = sys._current_frames().get(self.thread)
        if frame is None:
            return
        try:
            report = name_block(frame, stalled, self.where)
        finally:
            del frame
        first, self.told = not self.told, True
        self.on_block(report, first)


class _Watchdog:
    """The one watchdog thread of a process: started with the first :func:`watch`, gone (joined)
    with the last :func:`unwatch`, so a closed sampler leaves no thread of its own behind."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watches: list[Watch] = []
        self.stop = threading.Event()  # set: the thread's watches are gone, it ends
        self.thread: threading.Thread | None = None

    def add(self, w: Watch) -> None:
        with self.lock:
            self.watches.append(w)
            if self.thread is None:
                self.stop = threading.Event()
                self.thread = threading.Thread(
                    target=self.run, args=(self.stop,), name="asyncsample-watchdog", daemon=True
                )
                self.thread.start()

    def remove(self, w: Watch) -> None:
        thread = None
        with self.lock:
            if w in self.watches:
                self.watches.remove(w)
            if not self.watches and self.thread is not None:
                thread, self.thread = self.thread, None
                self.stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(_POLL)  # at once: it waits on the event just set

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self.lock:
                watches = list(self.watches)
            pause = min([w.limit / 10 for w in watches] + [_POLL])
            if stop.wait(max(pause, 0.005)):
                return
            now = time.monotonic()
            for w in watches:
                try:
                    w.look(now)
                except Exception:  # a watch must never stop the others
                    traceback.print_exc()


_WATCHDOG = _Watchdog()


def watch(w: Watch) -> Watch:
    """Start watching ``w`` (the process's watchdog thread starts with the first)."""
    _WATCHDOG.add(w)
    return w


def unwatch(w: Watch | None) -> None:
    """Stop watching ``w`` (nothing if ``None`` or not watched)."""
    if w is not None:
        _WATCHDOG.remove(w)


def blocked_error(report: BlockReport, worker: int, env: int) -> LoopBlockedError:
    """The culprit's error: a :class:`~asyncsample.LoopBlockedError` that carries ``report``."""
    err = LoopBlockedError(report.message(), worker=worker, env=env, remote_traceback=report.stack)
    err.report = report
    return err


#: Seconds an env may block the caller's event loop (``asyncio``, ``thread``) before it is
#: named in a warning and its call made its fault, when no ``step_timeout`` was given.
BLOCK_LIMIT = 10.0


class CallerWatch:
    """The running loop (the caller's own: ``asyncio``, ``thread``, a face's portal) watched from
    the watchdog thread. It cannot be pre-empted, but an env that blocks it longer than
    ``step_timeout`` (:func:`loop_limit`; else :data:`BLOCK_LIMIT`) is named in a log line and
    a warning (once per env), and its host (one of ``hosts``, each with a ``spec.worker`` and a
    ``blocked`` dict by env) makes the env's call its fault once it returns."""

    def __init__(self, step_timeout: float | None, hosts: Sequence[Any]) -> None:
        counter = np.zeros(1, dtype=np.int64)
        self.hosts = hosts
        for host in hosts:
            env_calls(type(host))
        self.warned: set[tuple[int | None, int | None]] = set()
        self.ticker = tick(asyncio.get_running_loop(), counter)
        limit = BLOCK_LIMIT if step_timeout is None else loop_limit(step_timeout)
        self.watch: Watch | None = watch(Watch(limit, counter, self.blocked, where="caller"))

    def blocked(self, report: BlockReport, first: bool) -> None:
        """From the watchdog thread: the loop stands still (said once per stall)."""
        if not first:
            return
        for host in self.hosts:
            if report.env is not None and host.spec.worker == report.worker:
                host.blocked[report.env] = report
        key = (report.worker, report.env)
        if key not in self.warned:
            self.warned.add(key)
            logging.getLogger("asyncsample").warning("%s", report.message())
            warnings.warn(report.message(), RuntimeWarning, stacklevel=1)

    def stop(self) -> None:
        """Stop watching (idempotent)."""
        unwatch(self.watch)
        self.watch = None
        self.ticker.cancel()


def stop_watch(watched: CallerWatch | None) -> None:
    """:meth:`CallerWatch.stop`, nothing for ``None``."""
    if watched is not None:
        watched.stop()
