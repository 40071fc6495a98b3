"""The ``process`` backend: the envs of every worker live in a pool of long-lived processes.

``P = min(n_processes or os.cpu_count(), n_workers)`` env-host processes are started from a
forkserver; worker ``w`` lives in process ``w % P``, so one process hosts the envs of several
workers and the agent compute of one worker overlaps the env compute of another.

Per worker step there is one round trip: the worker writes its actions into shared memory and
sends a tiny frame (slot and active mask); the host steps every env of that worker (autoreset and
``max_episode_length`` included, by :class:`~asyncsample.env_group.EnvGroup`), writes the results
into shared memory and replies with a header, plus pickled infos only when there are any. See
:mod:`asyncsample.backends._transport` for the wire format.

In the main process, one reader task per host process owns its stream and resolves per-request
futures by request id; a caller that is cancelled simply drops its future, and the late reply is
discarded. A dead host is noticed at once (end of stream or its process sentinel): every request
waiting on it fails with :class:`~asyncsample.WorkerCrashedError`. ``step_timeout`` is measured
from the moment the host starts on a request (requests of the workers sharing a host are served
in order, so time spent queued behind them does not count); a request that outlives it fails with
:class:`~asyncsample.StepTimeoutError` and the host is killed with its whole process tree.

No child process and no shared-memory segment outlives :meth:`ProcessBackend.aclose`, an error
during start, the backend's garbage collection, or the interpreter's exit.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import multiprocessing
import multiprocessing.util  # before our atexit hook: hooks run last-in first-out, ours first
import os
import pickle
import select
import signal
import socket
import sys
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import cloudpickle
import numpy as np
import psutil

from asyncsample.backends import _host_main
from asyncsample.backends._transport import (
    HEADER,
    HELLO_ID,
    OP_BUILD,
    OP_CLOSE,
    OP_EXIT,
    OP_NAMES,
    OP_RESET,
    OP_STEP,
    OP_UPDATE,
    SLOT,
    ST_OK,
    load_failure,
    shared_buffers,
)
from asyncsample.backends.base import EnvHost, HostSpec, failure_error
from asyncsample.env_group import StepBuffers, StepInfos
from asyncsample.env_update import EnvSource
from asyncsample.errors import StepTimeoutError, WorkerCrashedError, WorkerError

__all__ = ["ProcessBackend", "ProcessHost", "support_process_pids"]

#: Imported once by the forkserver, so that every host process starts with them loaded.
#: Not ``__main__``: env factories and updates travel by cloudpickle (by value when defined in the
#: main script) and gymnasium ids as their registered EnvSpec, so hosts never import the user's
#: script, which therefore needs no ``if __name__ == "__main__":`` guard.
_PRELOAD = ["numpy", "gymnasium", "asyncsample.backends._host_main"]
#: Seconds a host gets to close its envs and exit when asked to, before it is killed.
EXIT_GRACE = 2.0
#: Seconds a new host may take to import what it needs and report ready.
START_TIMEOUT = 60.0
#: Seconds to wait for a killed host to be reaped.
_KILL_WAIT = 5.0
#: Seconds to wait for a host's exit status after its stream ended.
_EOF_GRACE = 1.0
_MAX_ID = 0xFFFFFFFF


def _context() -> Any:
    """The forkserver context, with numpy, gymnasium and the host module preloaded."""
    ctx = multiprocessing.get_context("forkserver")
    from multiprocessing import forkserver

    current = list(getattr(forkserver._forkserver, "_preload_modules", None) or [])
    wanted = current + [m for m in _PRELOAD if m not in current]
    if wanted != current:
        ctx.set_forkserver_preload(wanted)
    return ctx


def support_process_pids() -> set[int]:
    """Pids of Python's own multiprocessing helpers (the forkserver and the resource tracker).

    They are started once per interpreter, shared by every user of ``multiprocessing`` in it, and
    end with the interpreter; they host no envs. Tests that check that no child process is left
    behind should leave them out.
    """
    from multiprocessing import forkserver, resource_tracker

    pids = {
        getattr(forkserver._forkserver, "_forkserver_pid", None),
        getattr(resource_tracker._resource_tracker, "_pid", None),
    }
    return {pid for pid in pids if pid is not None}


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "died"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


def _kill_tree(proc: psutil.Process | None, pid: int) -> None:
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


_BOOL = np.dtype(np.bool_)


def _mask_bytes(mask: np.ndarray) -> bytes:
    if type(mask) is np.ndarray and mask.dtype is _BOOL:
        return mask.tobytes()
    return np.asarray(mask, dtype=np.bool_).tobytes()


class _HostDied(Exception):
    """Set on the futures of requests whose host process died."""


class _TimedOut(Exception):
    """Set on the future of the request that outlived ``step_timeout``."""


class _Conn:
    """One incarnation of an env-host process: the process, its stream and its reader task."""

    def __init__(
        self,
        process: Any,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.process = process
        self.pid: int = process.pid
        try:
            self.ps: psutil.Process | None = psutil.Process(self.pid)
        except psutil.Error:
            self.ps = None
        self.loop = loop
        self.reader = reader
        self.writer = writer
        self.pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        # Requests the host has not answered yet, in the order it serves them:
        # (request id, timeout, opcode, worker).
        self.queue: deque[tuple[int, float | None, int, int]] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.next_id = HELLO_ID + 1
        self.dead = False
        self.closing = False
        self.reason = ""
        self.ready: asyncio.Future[str | None] = loop.create_future()
        self.exited: asyncio.Future[int | None] = loop.create_future()
        self.sentinel: int = process.sentinel
        sock = writer.get_extra_info("socket")
        self.fd: int = sock.fileno() if sock is not None else -1
        self.watching = True
        loop.add_reader(self.sentinel, self._on_sentinel)
        self.task = loop.create_task(self._read_loop(), name=f"asyncsample-host-{self.pid}-reader")

    # -- requests -------------------------------------------------------------------------------

    def send(
        self, op: int, body: bytes, timeout: float | None, worker: int
    ) -> tuple[int, asyncio.Future[tuple[int, bytes]]]:
        """Send one request; its future resolves to ``(status, payload)``."""
        rid = self.next_id
        self.next_id = rid + 1 if rid < _MAX_ID else HELLO_ID + 1
        fut: asyncio.Future[tuple[int, bytes]] = self.loop.create_future()
        self.pending[rid] = fut
        try:
            self.writer.write(HEADER.pack(len(body), rid, op) + body)
        except Exception as exc:  # the transport broke: the host is gone
            self.die(f"could not be sent a request ({exc!r})")  # fails fut too
            return rid, fut
        queue = self.queue
        queue.append((rid, timeout, op, worker))
        if timeout is not None and len(queue) == 1:
            self.timer = self.loop.call_later(timeout, self._on_timeout, queue[0])
        return rid, fut

    async def _read_loop(self) -> None:
        reader = self.reader
        readexactly = reader.readexactly
        unpack = HEADER.unpack
        size = HEADER.size
        pending = self.pending
        queue = self.queue
        try:
            while True:
                length, rid, status = unpack(await readexactly(size))
                payload = await readexactly(length) if length else b""
                if rid == HELLO_ID:
                    if not self.ready.done():
                        self.ready.set_result(None)
                    continue
                # The host serves requests in order: this answers the head of the queue, and
                # the host starts on the next one now, so that is when its timeout starts.
                while queue and queue.popleft()[0] != rid:
                    pass
                if self.timer is not None:
                    self.timer.cancel()
                    self.timer = None
                if queue and queue[0][1] is not None:
                    self.timer = self.loop.call_later(queue[0][1], self._on_timeout, queue[0])
                fut = pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result((status, payload))
        except (asyncio.IncompleteReadError, OSError):
            pass  # end of stream
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave waiters hanging on a reader bug
            self.die(f"broke its control stream ({exc!r})")
            return
        if not self.dead:
            # The host closed its end: it is exiting or gone. Its exit status follows shortly.
            await asyncio.wait({self.exited}, timeout=_EOF_GRACE)
            self.die("closed its control connection")

    def _reply_waiting(self) -> bool:
        """Whether a reply has arrived that the reader task has not handled yet."""
        if getattr(self.reader, "_buffer", None):
            return True  # read from the socket, the reader task runs next
        try:
            return bool(select.select([self.fd], [], [], 0)[0])
        except (OSError, ValueError):
            return False

    def _on_timeout(self, head: tuple[int, float | None, int, int]) -> None:
        rid, timeout, op, worker = head
        self.timer = None
        if not self.task.done() and self._reply_waiting():
            # A stalled loop may run this timer before it reads a reply that came in time (the
            # host answers in order: a waiting reply is this request's). Look again shortly:
            # the reader task will have handled the reply and cancelled this timer.
            self.timer = self.loop.call_later(0.001, self._on_timeout, head)
            return
        what = f"{OP_NAMES.get(op, op)} took longer than step_timeout={timeout:g}s"
        fut = self.pending.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(_TimedOut(f"{what}; env-host process {self.pid} was killed"))
        self.die(f"was killed: a {what} (worker {worker})")

    # -- death --------------------------------------------------------------------------------

    def _on_sentinel(self) -> None:
        self._unwatch()
        code: int | None
        try:
            code = self.process.exitcode
        except Exception:  # the status pipe broke: the forkserver is gone
            code = None
        if not self.exited.done():
            self.exited.set_result(code)
        self.die("was shut down" if self.closing else _describe_exit(code))
        with contextlib.suppress(Exception):
            self.process.close()

    def _unwatch(self) -> None:
        if self.watching:
            self.watching = False
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.sentinel)

    def die(self, reason: str) -> None:
        """Mark the host dead: fail every waiting request, kill the process tree, close."""
        if self.dead:
            return
        self.dead = True
        self.reason = reason
        _kill_tree(None if self.exited.done() else self.ps, self.pid)
        # What follows may run from a finalizer after the loop closed: never let it raise.
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.queue.clear()
        pending = list(self.pending.values())
        self.pending.clear()
        for fut in pending:
            if not fut.done():
                with contextlib.suppress(RuntimeError):
                    fut.set_exception(_HostDied(reason))
        if not self.ready.done():
            with contextlib.suppress(RuntimeError):
                self.ready.set_result(reason)
        with contextlib.suppress(Exception):
            self.writer.close()

    async def shutdown(self, grace: float) -> None:
        """Ask the host to exit, kill it if it does not in ``grace`` seconds, release all."""
        self.closing = True
        if not self.dead:
            with contextlib.suppress(Exception):
                self.writer.write(HEADER.pack(0, HELLO_ID, OP_EXIT))
        if not self.exited.done() and self.watching:
            await asyncio.wait({self.exited}, timeout=grace)
        if not self.exited.done() and self.watching:
            self.die(f"was killed: it did not exit within {grace:g}s of being asked to")
            await asyncio.wait({self.exited}, timeout=_KILL_WAIT)
        self.die("was shut down")
        self.task.cancel()
        await asyncio.wait({self.task})
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()
        self.release()

    def release(self) -> None:
        """Synchronous last resort (also for finalizers): kill, reap, close everything."""
        with contextlib.suppress(Exception):
            self.die("was shut down")
        if not self.exited.done():
            with contextlib.suppress(Exception):
                self.process.join(_KILL_WAIT)
        self._unwatch()
        with contextlib.suppress(Exception):
            self.process.close()
        with contextlib.suppress(Exception):
            self.task.cancel()
        with contextlib.suppress(Exception):
            self.writer.transport.abort()


_START_LOCK = threading.Lock()
_STARTER_LOCK = threading.Lock()
_starter: concurrent.futures.ThreadPoolExecutor | None = None


def _start_locked(process: Any) -> None:
    with _START_LOCK:  # Process.start() is not safe to call from several threads at once
        with _main_not_imported():
            process.start()


@contextlib.contextmanager
def _main_not_imported() -> Iterator[None]:
    """Start a child without it re-running the main script.

    multiprocessing makes a spawned or forkserver child import ``__main__`` (by ``__spec__``
    name or ``__file__`` path), which re-runs an unguarded script's top level in every host.
    Hosts need nothing from it, so both are hidden from ``Process.start`` for its duration.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved: dict[str, Any] = {
        k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__
    }
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


async def _start_process(process: Any) -> None:
    """``process.start()`` off the event loop's thread.

    A start blocks until the forkserver has forked the child; the first one in an interpreter
    also waits for the forkserver to import numpy and gymnasium (about a second). If the caller
    is cancelled meanwhile, the start is waited for and the new process killed, so none leaks.
    """
    global _starter
    with _STARTER_LOCK:
        if _starter is None:  # our own thread: the loop's default executor may be anything
            _starter = concurrent.futures.ThreadPoolExecutor(1, "asyncsample-host-start")
    fut = asyncio.get_running_loop().run_in_executor(_starter, _start_locked, process)
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({fut})
        if not fut.cancelled() and fut.exception() is None:
            _kill_tree(None, process.pid)
            with contextlib.suppress(Exception):
                process.kill()
                process.join(_KILL_WAIT)
                process.close()
        raise


class _Member:
    """One place in the pool: the worker slots it hosts and its current process."""

    def __init__(self, index: int, ctx: Any, slots: list[tuple[HostSpec, list[Any]]]) -> None:
        self.index = index
        self.ctx = ctx
        self.workers = [spec.worker for spec, _ in slots]
        self.slots_blob = cloudpickle.dumps(
            [
                (s.worker, s.n_envs, s.observation_space, s.action_space, s.max_episode_length)
                for s, _ in slots
            ],
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        self.raw = [raw for _, raw in slots]
        self.conn: _Conn | None = None
        self.conns: list[_Conn] = []  # every incarnation not yet released
        self.lock = asyncio.Lock()
        self.closed = False

    async def live_conn(self) -> _Conn:
        """The current host process, started anew (once, whoever asks) if it is dead."""
        async with self.lock:
            conn = self.conn
            if conn is None or conn.dead:
                if self.closed:
                    raise WorkerCrashedError(
                        "the process backend is closed: its env hosts cannot be restarted",
                        worker=self.workers[0],
                    )
                conn = await self._spawn()
                if self.closed:  # closed while this one started: it was left out
                    conn.release()
                    raise WorkerCrashedError(
                        "the process backend was closed while its env host restarted",
                        worker=self.workers[0],
                    )
            return conn

    async def _spawn(self) -> _Conn:
        loop = asyncio.get_running_loop()
        self.conns = [c for c in self.conns if not (c.dead and c.exited.done())]
        parent_sock, child_sock = socket.socketpair()
        try:
            process = self.ctx.Process(
                target=_host_main.main,
                args=(child_sock, self.slots_blob, self.raw),
                name=f"asyncsample-host-{self.index}",
            )
            await _start_process(process)
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        try:
            reader, writer = await asyncio.open_unix_connection(sock=parent_sock, limit=1 << 20)
        except BaseException:
            _kill_tree(None, process.pid)
            with contextlib.suppress(Exception):
                process.kill()
                process.join(_KILL_WAIT)
                process.close()
            parent_sock.close()
            raise
        conn = _Conn(process, reader, writer, loop)
        self.conn = conn
        self.conns.append(conn)
        done, _ = await asyncio.wait({conn.ready}, timeout=START_TIMEOUT)
        if not done:
            conn.die(f"was killed: it did not start within {START_TIMEOUT:g}s")
        reason = conn.ready.result()
        if reason is not None:
            raise WorkerCrashedError(
                f"env-host process {conn.pid} {reason} while starting (see its output above)",
                worker=self.workers[0],
            )
        return conn


def _release_all(members: list[_Member], token: int) -> None:
    _LIVE.pop(token, None)
    for member in members:
        for conn in member.conns:
            conn.release()


#: The members of every backend not yet closed, by token: what interpreter exit must release.
_LIVE: dict[int, list[_Member]] = {}
_TOKENS = itertools.count()


def _release_at_exit() -> None:
    for token, members in list(_LIVE.items()):
        _release_all(members, token)


# At interpreter exit the hosts must be gone before multiprocessing joins its non-daemon
# children (else it waits forever on a host blocked reading from us). Two hooks, either may run
# first: our atexit hook (registered after multiprocessing's, so it runs before it, unless
# multiprocessing re-registers its own later), and a multiprocessing finalizer, which its exit
# function runs before joining. (weakref.finalize objects cannot be used here: weakref's own exit
# hook disables them before ours runs.)
atexit.register(_release_at_exit)
multiprocessing.util.Finalize(None, _release_at_exit, exitpriority=100)


class ProcessHost:
    """The host of one worker's envs, as seen from the main process."""

    def __init__(
        self,
        spec: HostSpec,
        member: _Member,
        slot: int,
        buffers: StepBuffers,
        step_timeout: float | None,
    ) -> None:
        self.spec = spec
        self.worker = spec.worker
        self.buffers = buffers
        self._member = member
        self._slot = SLOT.pack(slot)
        self._timeout = step_timeout
        self._conn: _Conn | None = None

    @property
    def pid(self) -> int | None:
        """Pid of the process that hosts these envs (``None`` before start)."""
        return None if self._conn is None else self._conn.pid

    def _crashed(self, conn: _Conn, reason: str) -> WorkerCrashedError:
        return WorkerCrashedError(f"env-host process {conn.pid} {reason}", worker=self.worker)

    async def _call(self, op: int, body: bytes) -> bytes:
        conn = self._conn
        if conn is None:
            raise RuntimeError("the process backend has not started this host")
        if conn.dead:
            raise self._crashed(conn, conn.reason)
        rid, fut = conn.send(op, body, self._timeout, self.worker)
        try:
            status, payload = await fut
        except _HostDied as exc:
            raise self._crashed(conn, str(exc)) from None
        except _TimedOut as exc:
            raise StepTimeoutError(str(exc), worker=self.worker) from None
        except asyncio.CancelledError:
            conn.pending.pop(rid, None)  # the late reply will be dropped
            raise
        if status != ST_OK:
            raise failure_error(self.worker, load_failure(payload))
        return payload

    def _pickle(self, what: str, sources: Any, seeds: Sequence[int]) -> bytes:
        try:
            blob = cloudpickle.dumps((sources, list(seeds)), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"the {what} of worker {self.worker} cannot be pickled (with cloudpickle) to send "
                f"it to its env-host process: {type(exc).__name__}: {exc}"
            ) from exc
        return self._slot + blob

    async def build(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        await self._call(OP_BUILD, self._pickle("env", [list(c) for c in chains], seeds))

    async def update(self, updates: Sequence[EnvSource | None], seeds: Sequence[int]) -> None:
        await self._call(OP_UPDATE, self._pickle("env update", list(updates), seeds))

    async def reset(self, mask: np.ndarray) -> dict[int, dict[str, object]]:
        payload = await self._call(OP_RESET, self._slot + _mask_bytes(mask))
        if not payload:
            return {}
        infos: dict[int, dict[str, object]] = pickle.loads(payload)
        return infos

    async def step(self, mask: np.ndarray) -> StepInfos:
        payload = await self._call(OP_STEP, self._slot + _mask_bytes(mask))
        if not payload:
            return StepInfos(None, {})
        env_infos, reset_infos = pickle.loads(payload)
        return StepInfos(env_infos, reset_infos)

    async def restart(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        # A dead or killed process is replaced (once for all its workers); a live one, where an
        # env merely raised, keeps running and only this worker's envs are rebuilt.
        self._conn = await self._member.live_conn()
        await self.build(chains, seeds)

    async def close(self) -> None:
        conn = self._conn
        if conn is None or conn.dead:
            return
        with contextlib.suppress(WorkerError):
            await self._call(OP_CLOSE, self._slot)


class ProcessBackend:
    """Hosts the envs of all workers in a pool of env-host processes.

    Args:
        n_processes: size of the pool (default: the number of CPUs), capped at the number of
            workers.
        step_timeout: seconds a host may spend on one build, update, reset or step before it is
            killed and the request fails with :class:`~asyncsample.StepTimeoutError`.
    """

    def __init__(
        self,
        n_processes: int | None = None,
        step_timeout: float | None = None,
        **_ignored: object,
    ) -> None:
        if n_processes is not None and (
            isinstance(n_processes, bool) or not isinstance(n_processes, (int, np.integer))
        ):
            raise TypeError(f"n_processes must be an int or None, got {n_processes!r}")
        if n_processes is not None and n_processes < 1:
            raise ValueError(f"n_processes must be >= 1, got {n_processes}")
        if step_timeout is not None and not step_timeout > 0:
            raise ValueError(f"step_timeout must be > 0 seconds or None, got {step_timeout!r}")
        self.n_processes = None if n_processes is None else int(n_processes)
        self.step_timeout = None if step_timeout is None else float(step_timeout)
        self._members: list[_Member] = []
        self._hosts: list[ProcessHost] = []
        self._started = False
        self._closed = False
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._token = -1

    @property
    def pids(self) -> list[int]:
        """Pids of the live host processes, in pool order."""
        return [m.conn.pid for m in self._members if m.conn is not None and not m.conn.dead]

    async def start(self, specs: Sequence[HostSpec]) -> list[EnvHost]:
        if self._closed:
            raise RuntimeError("the process backend is closed")
        if self._started:
            raise RuntimeError("the process backend was already started")
        self._started = True
        specs = list(specs)
        if not specs:
            return []
        n = min(self.n_processes or os.cpu_count() or 1, len(specs))
        ctx = _context()
        slots: list[list[tuple[HostSpec, list[Any]]]] = [[] for _ in range(n)]
        placed: list[tuple[HostSpec, int, int, StepBuffers]] = []
        for w, spec in enumerate(specs):
            buffers, raw = shared_buffers(
                spec.observation_space, spec.action_space, spec.n_envs, ctx
            )
            placed.append((spec, w % n, len(slots[w % n]), buffers))
            slots[w % n].append((spec, raw))
        self._members = [_Member(i, ctx, s) for i, s in enumerate(slots)]
        self._token = token = next(_TOKENS)
        self._finalizer = weakref.finalize(self, _release_all, self._members, token)
        self._finalizer.atexit = False  # see _release_at_exit
        _LIVE[token] = self._members
        try:
            results = await asyncio.gather(
                *(m.live_conn() for m in self._members), return_exceptions=True
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            if self._closed:
                raise RuntimeError("the process backend was closed while it started")
        except BaseException:
            self._closed = True
            self._release()
            raise
        self._hosts = [
            ProcessHost(spec, self._members[m], slot, buffers, self.step_timeout)
            for spec, m, slot, buffers in placed
        ]
        for host in self._hosts:
            host._conn = host._member.conn
        return list(self._hosts)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for member in self._members:
            member.closed = True
        conns = [c for m in self._members for c in m.conns]
        try:
            await asyncio.gather(*(c.shutdown(EXIT_GRACE) for c in conns), return_exceptions=True)
        finally:
            self._release()  # whatever the graceful path left (idempotent)

    def _release(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        _release_all(self._members, self._token)
