"""The env-host process: a plain blocking loop (no event loop, no thread) that reads a frame,
hands it to its slot's :meth:`~asyncsample.backends._slot.HostSlot.serve` and replies, until an
``exit`` request or the end of the stream."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import io
import multiprocessing
import os
import pickle
import select
import signal
import socket
import sys
import time
from collections import deque
from typing import Any

import numpy as np

from asyncsample.backends import _lane_serve, _threads, _watchdog
from asyncsample.backends._chunk import (
    ChunkRequest,
    NextChunk,
    RawChunks,
    view_chunk_sets,
)
from asyncsample.backends._chunk_loop import run_joint
from asyncsample.backends._handoff import NAP, WAKE_ID, HostHandoff
from asyncsample.backends._lane_serve import LaneOptions
from asyncsample.backends._slot import HostSlot, RawArena, view_step_arena
from asyncsample.backends._threads import BoundedSpin
from asyncsample.backends._transport import (
    HELLO_ID,
    SLOT,
    ST_FAIL,
    ST_OK,
    FrameReader,
    Op,
    dump_failure,
    dumps_infos,
    failure_from_exception,
    send_frame,
    slot_buffers,
)
from asyncsample.env_group import EnvFailureError, EnvGroup

__all__ = ["main"]

_watchdog.env_calls(EnvGroup)  # a lockstep host's watchdog names the env in its frames

_PR_SET_PDEATHSIG = 1
#: How long a host with a chunk request that may run beside others (see
#: :mod:`~asyncsample.backends._chunk_loop`) waits for theirs before it runs those at hand. The
#: workers of a call send their requests in one pass of the caller's loop.
JOIN_WAIT = 0.0005
#: How long a host waits for the first chunk requests of the workers that start a call with
#: alike agent copies (:attr:`ChunkRequest.starters`): they are sure to come, one worker after
#: another (about 0.1 ms apart); running without one costs a chunk of agent calls of its own.
START_WAIT = 0.005
#: A lockstep host's watchdog says where a request stands once it has run this share of
#: ``step_timeout`` (and again at each look): before the caller's timer kills the host.
_WATCH_AT = 0.9
#: A host polling for a flag step (see :meth:`StepReader.wait_spinning`) looks at its socket
#: once every this many looks at the flag (a look at the flag costs well under a microsecond).
_POLL_EVERY = 16

Frame = tuple[int, int, bytes]
"""A request as the reader hands it over: ``(request id, opcode, payload)``."""


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the main process dies, even if an env hangs:
    ``PR_SET_PDEATHSIG`` covers the forkserver (the parent), ``O_ASYNC`` on multiprocessing's
    parent sentinel the main process."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the forkserver died before prctl took effect
            os._exit(1)
    try:
        sentinel = multiprocessing.parent_process().sentinel  # type: ignore[union-attr]
        fcntl.fcntl(sentinel, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(sentinel, fcntl.F_SETSIG, signal.SIGKILL)
        flags = fcntl.fcntl(sentinel, fcntl.F_GETFL)
        fcntl.fcntl(sentinel, fcntl.F_SETFL, flags | os.O_ASYNC)
    except (AttributeError, OSError, ValueError):
        return
    if select.select([sentinel], [], [], 0)[0]:  # the main process died before we got here
        os._exit(1)


def _kill_descendants() -> None:
    """Kill whatever processes the envs started and left behind."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:  # best effort on the way out
        return
    for child in children:
        with contextlib.suppress(Exception):
            child.kill()


def main(
    sock: socket.socket,
    slots_blob: bytes,
    raw_buffers: list[Any],
    raw_chunks: list[RawChunks | None] | None = None,
    host_threads: int | None = None,
    lanes: LaneOptions | None = None,
    raw_arenas: list[RawArena | None] | None = None,
    spin_after_step: float | None = None,
    watch: tuple[Any, float | None] | None = None,
    handoff: Any = None,
    nice: int = 0,
) -> None:
    """Serve requests on ``sock`` for the slots of ``slots_blob`` (pickled ``HostSpec`` list)
    until told to exit or orphaned; per slot, ``raw_buffers`` are what
    :func:`~asyncsample.backends._transport.slot_buffers` views, ``raw_chunks`` its
    :data:`~asyncsample.backends._chunk.RawChunks` (or ``None``) and ``raw_arenas`` its
    observation arena (:data:`~asyncsample.backends._slot.RawArena`, or ``None``); with
    ``lanes``, the slots' envs are async envs served in an event loop
    (:mod:`asyncsample.backends._lane_serve`). ``spin_after_step``: see :class:`StepReader`.
    ``watch``: the block shared with the caller (see :mod:`asyncsample.backends._watchdog`) and
    the ``step_timeout`` of a lockstep host's requests (a host of async envs: its loop's).
    ``handoff``: the shared block of quiet steps handed over without a frame (see
    :mod:`asyncsample.backends._handoff`). ``nice``: what the host adds to its niceness (the
    threads it starts inherit it)."""
    _threads.limit(host_threads)  # before the envs (or an agent) import anything
    _die_with_parent()
    if nice:
        with contextlib.suppress(OSError, AttributeError):
            os.nice(nice)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # a group of its own: the whole tree can be killed, even orphans
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C is the main process's to handle
    # Keep the collector from touching (so copying) what the forkserver shared copy-on-write.
    gc.freeze()
    sock.setblocking(True)
    specs = pickle.loads(slots_blob)
    block = None if watch is None else np.frombuffer(watch[0], dtype=np.uint8)
    if lanes is not None:
        _serve_lanes(sock, specs, raw_buffers, lanes, block)
        return
    slots: list[HostSlot] = []
    chunks = raw_chunks or [None] * len(specs)
    arenas = raw_arenas or [None] * len(specs)
    for spec, raw, raw_chunk, raw_arena in zip(specs, raw_buffers, chunks, arenas):
        buffers = slot_buffers(
            spec.observation_space, spec.action_space, spec.n_envs, raw, spec.timed, spec.columns
        )
        sets = None if raw_chunk is None else view_chunk_sets(spec, raw_chunk)
        arena = None if raw_arena is None else view_step_arena(spec, raw_arena)
        slots.append(HostSlot(spec, buffers, sets, host_threads, "env-host process", arena))
    reader = StepReader(sock, spin_after_step or 0.0)
    limit = None if watch is None else watch[1]
    turns = [0]  # a list, not the shared counter: a numpy cell's bump costs 5x more per step
    watched = None
    if block is not None and limit is not None:  # say where a request stands past the limit
        watched = _watchdog.watch(
            _watchdog.Watch(
                limit * _WATCH_AT,
                turns,
                lambda report, first: _watchdog.write_report(block, report),
                serving=True,
                where="thread",
                on_move=lambda: _watchdog.forget_report(block),
            )
        )
    try:
        flags = None if handoff is None else HostHandoff(handoff, sock)
        send_frame(sock, HELLO_ID, ST_OK)
        _serve(sock, reader, slots, turns if watched is not None else None, flags)
    except (BrokenPipeError, ConnectionError):
        pass  # the parent went away: nothing left to answer
    finally:
        _watchdog.unwatch(watched)
        for slot in slots:
            slot.close()
        reader.close()
        sock.close()
        _kill_descendants()


def _serve_lanes(
    sock: socket.socket,
    specs: list[Any],
    raw_buffers: list[Any],
    lanes: LaneOptions,
    block: np.ndarray | None = None,
) -> None:
    """Serve the slots' async envs in an event loop until ``exit`` or the stream's end."""
    buffers = [
        slot_buffers(s.observation_space, s.action_space, s.n_envs, raw, s.timed, s.columns)
        for s, raw in zip(specs, raw_buffers)
    ]
    try:
        _lane_serve.serve(sock, specs, buffers, lanes, block)
    except (BrokenPipeError, ConnectionError):
        pass  # the parent went away: nothing left to answer
    finally:
        sock.close()
        _kill_descendants()


class StepReader(FrameReader):
    """A :class:`FrameReader` that, with ``spin`` seconds, waits for the request after a step's
    reply polling its socket for at most that long before it blocks in a read.

    A host that blocks sleeps in the kernel until the next request wakes it, and inside a
    training loop (the caller runs its policy between steps, a few hundred microseconds) that
    wake-up is much of a round trip. Polling instead is PufferLib's busy-wait, bounded: an idle
    host (the caller's update, the end of a run) stops after ``spin`` and sleeps as before. Only
    the faces turn it on, where the caller and every host process have a CPU each (see
    :mod:`asyncsample.vector.placement`). On a machine busier than that, a poller takes a CPU
    another process wants (on a loaded 2-CPU machine, a spin that yielded made the mixed
    HalfCheetah loop 0.6x the sleeping one): it spins only while no more threads are runnable
    than there are CPUs, and a spin during which the kernel switched this thread out turns the
    spin off for a while, longer for each such spin in a row
    (:class:`~asyncsample.backends._threads.BoundedSpin`, the caller's polling too)."""

    def __init__(self, sock: socket.socket, spin: float = 0.0) -> None:
        super().__init__(sock)
        file = self._file
        if not isinstance(file, io.BufferedReader):  # makefile("rb") with a buffer is one
            raise TypeError(f"a buffered reader was expected, got {type(file).__name__}")
        self._peek = file.peek  # the buffered bytes, or one read of the socket
        self._sock = sock
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self.spin = spin
        self._spin = BoundedSpin(os.cpu_count() or 1)

    def wait_spinning(self, flag: HostHandoff | None = None) -> bool:
        """Return once a request (or the end of the stream) is readable, in the buffer or the
        socket, or ``spin`` passed (at once while backed off); with a ``flag``, ``True`` once its
        request count rose (the socket is polled every ``_POLL_EVERY`` looks)."""
        if not self._spin.allowed() or self.buffered():
            return False
        if flag is None:
            self._spin.poll(self._poller.poll, self.spin)
            return False
        poll, pending, looks = self._poller.poll, flag.pending, 0

        def look(_: int) -> int:
            nonlocal looks
            if pending():
                return 1
            looks += 1
            return 2 if looks % _POLL_EVERY == 0 and poll(0) else 0

        return self._spin.poll(look, self.spin) == 1

    def wait_readable(self, seconds: float) -> None:
        """Return once the socket is readable, or after ``seconds``."""
        select.select([self._sock], [], [], seconds)

    def buffered(self) -> bool:
        """Whether a request (or the end of the stream) is in the buffer or arrives in one read
        that does not block."""
        sock = self._sock
        sock.setblocking(False)  # peek: the buffered bytes, else one read that does not block
        try:
            return bool(self._peek(1))
        except OSError:
            return True  # the connection is gone: the blocking read will see it
        finally:
            sock.setblocking(True)

    def nap_for(self, flag: HostHandoff) -> bool:
        """Sleep until a request is readable (``False``) or ``flag``'s count rose (``True``),
        looking at the count every ``NAP`` seconds; the caller is told (``looking``) and wakes
        this host with a frame when it raises the count (the naps cover a wake-up lost between
        the two cores' stores)."""
        flag.looking(False)
        try:
            if self.buffered():
                return flag.pending()
            while not flag.pending():
                if self._poller.poll(NAP * 1000):
                    return False
            return True
        finally:
            flag.looking(True)


def _serve(
    sock: socket.socket,
    reader: StepReader,
    slots: list[HostSlot],
    turns: list[int] | None = None,
    flag: HostHandoff | None = None,
) -> None:
    """Read a frame, hand it to its slot, reply; until ``exit`` or the end of the stream. After
    a step's reply, the next request is waited for spinning (``reader.spin``, see
    :class:`StepReader`). ``turns`` (watched, see :mod:`asyncsample.backends._watchdog`): bumped
    before and after each request, so it is odd while one is served. ``flag``: quiet steps are
    also handed over through it (see :mod:`asyncsample.backends._handoff`), looked at while
    spinning and between naps."""
    unpack_slot = SLOT.unpack_from
    slot_size = SLOT.size
    spin = reader.spin > 0
    wholes = [b"\x01" * slot.group.n_envs for slot in slots]  # a flag step's mask: every env
    spun = False
    backlog: deque[Frame | None] = deque()  # frames read ahead (see _partners), in order
    while True:
        if (
            not backlog
            and flag is not None
            and (flag.pending() or (spun and reader.wait_spinning(flag)) or reader.nap_for(flag))
        ):
            k = flag.take()
            try:
                flag.answer(ST_OK, _run(slots[k], Op.STEP, wholes[k], turns))
            except EnvFailureError as exc:
                flag.answer(ST_FAIL, dump_failure(exc.failure))
            except (BrokenPipeError, ConnectionError):
                raise
            except Exception as exc:  # a bug of the host, unpicklable infos
                flag.answer(ST_FAIL, failure_from_exception(exc, retry=False))
            spun = spin
            continue
        frame = backlog.popleft() if backlog else reader.read()
        if frame is None:
            return
        rid, op, payload = frame
        if op == Op.EXIT:
            return
        if rid == WAKE_ID:  # a flag step's wake-up: its request is seen above
            continue
        spun = False
        try:
            k = unpack_slot(payload)[0]
            slot = slots[k]
            if op == Op.CHUNK and slot.copy_key is not None:  # with others' alike, if they come
                request = slot.chunk_request(memoryview(payload)[slot_size:])
                starting = isinstance(request, ChunkRequest)
                starters = request.starters if isinstance(request, ChunkRequest) else 0
                partners = _partners(reader, backlog, slots, k, starting, starters)
                _run_joint(sock, [(rid, slot, request), *partners], turns)
                continue
            reply = _run(slot, op, memoryview(payload)[slot_size:], turns)
            send_frame(sock, rid, ST_OK, reply)
            if spin and op == Op.STEP:
                if flag is None:
                    reader.wait_spinning()
                spun = True
        except (BrokenPipeError, ConnectionError):
            raise
        except Exception as exc:
            _answer_failed(sock, rid, exc)


def _partners(
    reader: StepReader,
    backlog: deque[Frame | None],
    slots: list[HostSlot],
    first: int,
    starting: bool,
    starters: int = 0,
) -> list[tuple[int, HostSlot, ChunkRequest | NextChunk]]:
    """The chunk requests to run beside slot ``first``'s (see
    :mod:`~asyncsample.backends._chunk_loop`): of each other slot with the same agent copy, its next
    request if that is a chunk, taken out of ``backlog``, to which the frames readable now are
    added. The requests of the slots whose part is going on (of every such slot, when
    ``first``'s request is a part's first chunk: the workers of a call start together) are
    waited for, up to :data:`JOIN_WAIT`; given ``starters`` (:attr:`ChunkRequest.starters`), those
    of the slots of the workers numbered below it, up to :data:`START_WAIT`. ``(id, slot,
    request)`` each."""
    key = slots[first].copy_key
    wanted = {k for k, slot in enumerate(slots) if k != first and slot.copy_key == key}
    if starters:
        awaited = {k for k in wanted if slots[k].worker < starters}
        deadline = time.monotonic() + START_WAIT
    else:
        awaited = {k for k in wanted if starting or slots[k].going}
        deadline = time.monotonic() + JOIN_WAIT
    taken: list[tuple[int, HostSlot, ChunkRequest | NextChunk]] = []
    while wanted:
        # Read before the look: past the deadline, what came meanwhile is still taken (a host
        # not run for a while between its look and its clock would miss it).
        left = deadline - time.monotonic()
        while (not backlog or backlog[-1] is not None) and reader.buffered():
            backlog.append(reader.read())  # a frame comes whole: one write of the caller's
        keep: deque[Frame | None] = deque()
        for frame in backlog:
            if frame is not None and wanted and frame[0] != WAKE_ID:
                rid, op, payload = frame
                if op == Op.EXIT:
                    wanted.clear()
                elif (k := SLOT.unpack_from(payload)[0]) in wanted:
                    wanted.discard(k)  # its next request: later ones wait for it
                    if op == Op.CHUNK:
                        slot = slots[k]
                        try:
                            taken.append((rid, slot, slot.chunk_request(payload[SLOT.size :])))
                            continue
                        except EnvFailureError:
                            pass  # answered in its turn, as its own request
            keep.append(frame)
        backlog.clear()
        backlog.extend(keep)
        if not (awaited & wanted) or left <= 0 or (backlog and backlog[-1] is None):
            break
        reader.wait_readable(left)
    return taken


def _run_joint(
    sock: socket.socket,
    asked: list[tuple[int, HostSlot, ChunkRequest | NextChunk]],
    turns: list[int] | None,
) -> None:
    """Run the chunk requests ``asked`` (``(id, slot, request)``) side by side and reply to
    each, in order, as its own request would be answered."""
    if turns is not None:
        turns[0] += 1
    try:
        results = run_joint(
            [slot.runner for _, slot, _ in asked],  # type: ignore[misc]
            [request for _, _, request in asked],
        )
    finally:
        if turns is not None:
            turns[0] += 1
    for (rid, _, _), result in zip(asked, results):
        try:
            if isinstance(result, Exception):
                raise result
            send_frame(sock, rid, ST_OK, dumps_infos(result))
        except (BrokenPipeError, ConnectionError):
            raise
        except Exception as exc:
            _answer_failed(sock, rid, exc)


def _answer_failed(sock: socket.socket, rid: int, exc: Exception) -> None:
    """Answer request ``rid`` with the failure ``exc`` means: an env's or the agent's
    (:class:`EnvFailureError`, retried as it says), else a bug of the host or infos that cannot
    be pickled (not worth a restart)."""
    if isinstance(exc, EnvFailureError):
        send_frame(sock, rid, ST_FAIL, dump_failure(exc.failure))
    else:
        send_frame(sock, rid, ST_FAIL, failure_from_exception(exc, retry=False))


def _run(slot: HostSlot, op: int, body: Any, turns: list[int] | None) -> bytes:
    """``slot.serve(op, body)``, inside a turn of the watchdog's count where there is one."""
    if turns is None:
        return slot.serve(op, body)
    turns[0] += 1
    try:
        return slot.serve(op, body)
    finally:
        turns[0] += 1
