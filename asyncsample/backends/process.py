"""The ``process`` backend: the envs of every worker live in a pool of long-lived processes.

Worker ``w`` lives in env-host process ``w % P`` (started from a forkserver). A step is one round
trip: data in shared memory, a tiny frame each way (:mod:`asyncsample.backends._transport`);
replies resolve their request's future by id in the loop's read callback, and a dead host is
noticed at once (end of stream or its sentinel). No child process or shared memory outlives
:meth:`ProcessBackend.aclose`, a failed start, the backend's collection or the interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import psutil

from asyncsample import _validate
from asyncsample._tasks import wait_all
from asyncsample._validate import reset_arguments
from asyncsample.backends import _chunk, _column_wire, _host_main, _watchdog
from asyncsample.backends._chunk import ChunkBuffers, ChunkReply, ChunkRequest, NextChunk
from asyncsample.backends._closing import CLOSE_TIMEOUT, optional_close_timeout, settled_grace
from asyncsample.backends._handoff import (
    CTL_SLOTS,
    FLAG_ID,
    WAKE_ID,
    DirectStep,
    FlagStep,
    Handoff,
    QueuedStep,
)
from asyncsample.backends._lane_link import LaneLink, RemoteLanes
from asyncsample.backends._lane_serve import LANE_HOST_NICE, LANES_ID, LaneOptions
from asyncsample.backends._pacing import shares
from asyncsample.backends._procs import (
    KILL_WAIT,
    describe_exit,
    forkserver_context,
    host_cpus,
    kill_started,
    kill_tree,
    pin,
    release_all,
    start_process,
    support_process_pids,
    track,
)
from asyncsample.backends._remote import (
    HostDied,
    Incarnation,
    LoopChecks,
    PendingCall,
    PoolMember,
    RemoteHost,
    closed_error,
)
from asyncsample.backends._slot import RawArena, StepArena, step_arenas
from asyncsample.backends._transport import (
    HEADER,
    HELLO_ID,
    SLOT,
    ST_OK,
    Op,
    dumps,
    joint_buffers,
    load_failure,
    own_slot_buffers,
)
from asyncsample.backends._transport import ReplyProtocol as _ReplyProtocol
from asyncsample.backends.base import (
    DirectReader,
    EnvHost,
    HostSpec,
    SentStep,
    failure_error,
    reject_unknown_options,
)
from asyncsample.backends.placement import placement
from asyncsample.env_group import StepBuffers, StepInfos
from asyncsample.errors import WorkerCrashedError

__all__ = ["ProcessBackend", "ProcessHost", "ProcessLaneHost", "support_process_pids"]

#: Seconds a host gets to close its envs and exit when asked to, before it is killed, when the
#: backend was given no ``close_timeout`` (and at most, for a host still busy with a call).
EXIT_GRACE = 2.0
#: Seconds a new host may take to import what it needs and report ready.
START_TIMEOUT = 60.0
#: Seconds to wait for a killed host to be reaped.
#: Seconds to wait for a host's exit status after its stream ended.
_EOF_GRACE = 1.0
_MAX_ID = WAKE_ID  # and above: LANES_ID, the handoff's FLAG_ID and WAKE_ID
#: Bytes asked of the socket per read (replies are small; infos and chunk replies may not be).
_READ_SIZE = 1 << 18


_BOOL = np.dtype(np.bool_)


def _mask_bytes(mask: np.ndarray) -> bytes:
    if type(mask) is np.ndarray and mask.dtype is _BOOL:
        return mask.tobytes()
    return np.asarray(mask, dtype=np.bool_).tobytes()


class _Conn(Incarnation):
    """One incarnation of an env-host process: the process and its control stream."""

    def __init__(
        self,
        process: Any,
        transport: asyncio.WriteTransport,
        protocol: _ReplyProtocol,
        loop: asyncio.AbstractEventLoop,
        block: np.ndarray | None = None,
        handoff: Any = None,
    ) -> None:
        super().__init__(loop)
        self.handoff = None if handoff is None else Handoff(handoff)  # see _handoff
        self._nap: asyncio.Future[None] | None = None  # a FlagStep waiting in the loop
        self.block = block  # shared: its loop's counter, where its watchdog saw it stand still
        self.can_report, self.ticking = block is not None, False  # ticking: its loop bumps it
        self.process = process
        self.pid: int = process.pid
        try:
            self.ps: psutil.Process | None = psutil.Process(self.pid)
        except psutil.Error:
            self.ps = None
        self.transport = transport
        self.protocol = protocol
        # Calls by request id until answered (a cancelled caller's reply is dropped when it comes).
        self.pending: dict[int, PendingCall] = {}
        # Bare steps (send_direct) by request id, until read or taken over by the loop.
        self.direct: dict[int, DirectStep | FlagStep] = {}
        self.next_id = HELLO_ID + 1
        self.ready: asyncio.Future[str | None] = loop.create_future()
        self.exited: asyncio.Future[int | None] = loop.create_future()
        self.sentinel: int = process.sentinel
        sock = transport.get_extra_info("socket")
        self.fd: int = sock.fileno() if sock is not None else -1
        self.watching = True
        self.eof_timer: asyncio.TimerHandle | None = None
        # A host of async envs: its lane requests and replies (see _lane_link).
        self.lanes = LaneLink(
            lambda body: transport.write(HEADER.pack(len(body), LANES_ID, Op.STEP) + body), loop
        )
        loop.add_reader(self.sentinel, self._on_sentinel)
        protocol.attach(self._on_frame, self._on_eof)

    def describe(self) -> str:
        return f"env-host process {self.pid}"

    def send(
        self, op: Op, body: bytes, timeout: float | None, worker: int, progress: Any = None
    ) -> PendingCall:
        """Send one request; its future resolves to ``(status, payload)``."""
        rid = self._next_rid()
        call = self.new_call(op.label, worker, timeout, progress)
        if self.dead:
            return call
        call.key = rid
        self.pending[rid] = call
        try:
            self.transport.write(HEADER.pack(len(body), rid, op) + body)
        except Exception as exc:  # the transport broke: the host is gone
            self.die(f"could not be sent a request ({exc!r})")  # fails the call too
        return call

    def _next_rid(self) -> int:
        rid = self.next_id
        self.next_id = rid + 1 if rid < _MAX_ID - 1 else HELLO_ID + 1
        return rid

    def send_direct(self, step: DirectStep, body: bytes) -> bool:
        """Send a bare step request (no call, future or timer: see :class:`DirectStep`);
        ``False``: nothing was sent, use :meth:`send`."""
        if self.dead or self.calls or self.fd < 0 or self.transport.get_write_buffer_size():
            return False
        rid = self._next_rid()
        if not self._write_now(HEADER.pack(len(body), rid, Op.STEP) + body):
            return False
        step.rid = rid
        self.direct[rid] = step
        return True

    def flag_step(self, host: ProcessHost, slot: int) -> FlagStep | None:
        """Hand a step of every env of ``slot`` over through the shared block (see
        :mod:`~asyncsample.backends._handoff`); ``None``: the host is not polling for one."""
        handoff = self.handoff
        if handoff is None or self.dead or self.calls or self.direct or self.fd < 0:
            return None
        if not handoff.send(slot, self._write_now):
            return None
        step = self.direct[FLAG_ID] = FlagStep(host, self, handoff)
        return step

    def _write_now(self, data: bytes) -> bool:
        """Write ``data`` without the loop, what the socket does not take now through the
        transport (out with the loop); ``False``: the connection broke, nothing was sent (the
        normal path finds out why)."""
        try:
            n = os.write(self.fd, data)  # non-blocking: the transport made it so
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            return False
        if n < len(data):
            self.transport.write(data[n:])
        return True

    async def nap(self, seconds: float) -> None:
        """Sleep until a handoff frame comes (a reply, a wake-up), the host dies, or ``seconds``."""
        self._nap = nap = self.loop.create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(nap, seconds)
        self._nap = None

    def _wake(self) -> None:
        nap = self._nap
        if nap is not None and not nap.done():
            nap.set_result(None)

    def _on_frame(self, rid: int, status: int, payload: bytes) -> None:
        if self.direct:
            step = self.direct.pop(rid, None)
            if step is not None:
                step.reply = (status, payload)
                if rid == FLAG_ID:
                    self._wake()
                return
        if rid == WAKE_ID:
            self._wake()
            return
        if rid == LANES_ID:
            self.lanes.replied(payload)
            return
        if rid == HELLO_ID:
            if not self.ready.done():
                self.ready.set_result(None)
            return
        call = self.pending.pop(rid, None)
        if call is None:
            return
        self.answered(call)  # the host serves in order: the next call's clock starts now
        fut = call.future
        if not fut.done():
            fut.set_result((status, payload))

    def _on_eof(self) -> None:
        if not self.dead and self.eof_timer is None:
            # The host is exiting or gone: its exit status usually follows and names the cause.
            self.eof_timer = self.loop.call_later(
                _EOF_GRACE, self.die, "closed its control connection"
            )

    def read_now(self) -> bool:
        """Read what the host sent, for a synchronous caller while the loop is not running;
        ``False`` when the stream needs the loop instead (end, error, writes still queued)."""
        if self.fd < 0 or self.dead or self.protocol.ended:
            return False
        if self.transport.get_write_buffer_size():
            return False
        try:
            data = os.read(self.fd, _READ_SIZE)  # non-blocking: the transport made it so
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False
        if len(data) == HEADER.size and self.direct and not self.protocol.buffered:
            # The common reply, to a bare step: one frame, header only (a quiet step).
            length, rid, status = HEADER.unpack(data)
            step = self.direct.pop(rid, None) if length == 0 else None
            if step is not None:
                step.reply = (status, b"")
                return True
        self.protocol.feed(data)
        return True

    def _defer_timeout(self, call: PendingCall) -> bool:
        """Whether a reply (this call's: the host answers in order) waits unread: a stalled
        loop may run the timer before it reads a reply that came in time."""
        if self.protocol.ended:
            return False
        try:
            return bool(select.select([self.fd], [], [], 0)[0])
        except (OSError, ValueError):
            return False

    def host_report(self) -> _watchdog.BlockReport | None:
        return None if self.block is None else _watchdog.read_report(self.block)

    def loop_turns(self) -> int | None:
        block = self.block if self.ticking and self.ready.done() else None
        return None if block is None else int(_watchdog.turns_of(block)[0])

    def _on_sentinel(self) -> None:
        self._unwatch()
        code: int | None
        try:
            code = self.process.exitcode
        except Exception:  # the status pipe broke: the forkserver is gone
            code = None
        if not self.exited.done():
            self.exited.set_result(code)
        self.die("was shut down" if self.closing else describe_exit(code))
        with contextlib.suppress(Exception):
            self.process.close()

    def _unwatch(self) -> None:
        if self.watching:
            self.watching = False
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.sentinel)

    def _kill(self) -> None:
        kill_tree(None if self.exited.done() else self.ps, self.pid)

    def _on_death(self) -> None:
        self._wake()
        self.pending.clear()
        self.lanes.fail(HostDied(self.reason))
        if self.eof_timer is not None:
            self.eof_timer.cancel()
            self.eof_timer = None
        if not self.ready.done():
            with contextlib.suppress(RuntimeError):
                self.ready.set_result(self.reason)
        with contextlib.suppress(Exception):
            self.transport.close()

    async def shutdown(self, grace: float) -> None:
        """Ask the host to exit, kill it if it does not in ``grace`` seconds, release all."""
        self.closing = True
        if not self.dead:
            with contextlib.suppress(Exception):
                self.transport.write(HEADER.pack(0, HELLO_ID, Op.EXIT))
        if not self.exited.done() and self.watching:
            reason = await self.wait_exit(self.exited, grace)  # (sooner if its loop stands still)
        if not self.exited.done() and self.watching:
            self.die(reason)
            await asyncio.wait({self.exited}, timeout=KILL_WAIT)
        self.die("was shut down")
        self.release()

    def release(self) -> None:
        """Synchronous last resort (also for finalizers): kill, reap, close everything."""
        self.closing = True
        with contextlib.suppress(Exception):
            self.die("was shut down")
        if not self.exited.done():
            with contextlib.suppress(Exception):
                self.process.join(KILL_WAIT)
        self._unwatch()
        with contextlib.suppress(Exception):
            self.process.close()
        with contextlib.suppress(Exception):
            self.transport.abort()


class _Member(PoolMember[_Conn]):
    """One place in the pool: the worker slots it hosts and its current process."""

    def __init__(
        self,
        index: int,
        ctx: Any,
        specs: list[HostSpec],
        raw: list[Any],
        raw_chunks: list[_chunk.RawChunks | None] | None = None,
        host_threads: int | None = None,
        cpu: int | None = None,
        lanes: LaneOptions | None = None,
        raw_arenas: list[RawArena | None] | None = None,
        spin_after_step: float | None = None,
        step_timeout: float | None = None,
        nice: int = 0,
    ) -> None:
        super().__init__(index, specs)
        self.block_raw, self.step_timeout = ctx.RawArray("B", _watchdog.BLOCK_BYTES), step_timeout
        self.block: np.ndarray = np.frombuffer(self.block_raw, np.uint8)  # see _Conn.block
        self.spin_after_step = spin_after_step  # see _host_main.StepReader
        self.lanes = lanes  # a host of async envs (each stepped on its own in its event loop)
        self.raw_arenas = raw_arenas  # per slot, what the host needs to view its step arena
        self.ctx = ctx
        self.host_threads = host_threads
        self.cpu, self.nice = cpu, nice  # its CPU (None: not pinned), what it adds to its nice
        self.raw = raw  # per slot, the shared blocks of its step buffers
        self.raw_chunks = raw_chunks  # per slot, what the host needs to view its chunk buffers

    def _discard(self, incarnation: _Conn) -> None:
        incarnation.release()

    async def _spawn(self) -> _Conn:
        loop = asyncio.get_running_loop()
        self.incarnations = [c for c in self.incarnations if not (c.dead and c.exited.done())]
        _watchdog.clear_report(self.block)
        parent_sock, child_sock = socket.socketpair()
        # A polling host takes quiet steps through shared memory too (see _handoff).
        ctl = self.ctx.RawArray("q", CTL_SLOTS) if self.spin_after_step and not self.lanes else None
        try:
            process = self.ctx.Process(
                target=_host_main.main,
                args=(
                    child_sock,
                    self.slots_blob,
                    self.raw,
                    self.raw_chunks,
                    self.host_threads,
                    self.lanes,
                    self.raw_arenas,
                    self.spin_after_step,
                    (self.block_raw, self.step_timeout),
                    ctl,
                    self.nice,
                ),
                name=f"asyncsample-host-{self.index}",
            )
            await start_process(process)
            pin(process.pid, self.cpu)
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        try:
            transport, protocol = await loop.create_unix_connection(
                _ReplyProtocol, sock=parent_sock
            )
        except BaseException:
            kill_started(process)
            parent_sock.close()
            raise
        conn = _Conn(process, transport, protocol, loop, self.block, ctl)
        conn.ticking = self.lanes is not None
        self.current = conn
        self.incarnations.append(conn)
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


class ProcessHost(RemoteHost[_Conn]):
    """The host of one worker's envs, as seen from the main process."""

    where = "env-host process"

    def __init__(
        self,
        spec: HostSpec,
        member: _Member,
        slot: int,
        buffers: StepBuffers,
        step_timeout: float | None,
        chunks: list[ChunkBuffers],
        arena: StepArena | None = None,
    ) -> None:
        super().__init__(spec, member, buffers, step_timeout)
        self.obs_arena = None if arena is None else arena.attach(buffers)  # see StepArena
        self._slot, self._slot_index = SLOT.pack(slot), slot
        self._whole_mask = np.ones(spec.n_envs, dtype=np.bool_)
        self._whole_body = b""
        self._given: list[Any] | None = None
        self._columns = _column_wire.object_rows(spec)  # Text/Sequence leaves: packed, not shared
        self.chunks = chunks  # inference="host": the 2 sets of chunk buffers the host fills
        self.chunk = chunks[0] if chunks else None  # (shared memory): the first
        self.arena_obs = _chunk.ArenaObs(buffers, self.chunk)  # see ChunkRunner.settle

    @property
    def pid(self) -> int | None:
        """Pid of the process that hosts these envs (``None`` before start)."""
        return None if self._incarnation is None else self._incarnation.pid

    def direct_reader(self) -> DirectReader | None:
        """The live connection, for a synchronous caller reading replies itself (``None``: none)."""
        inc = self._incarnation
        return None if inc is None or inc.dead else inc

    def _sent_bare(self, incarnation: _Conn) -> bool:
        return any(step.host is self for step in list(incarnation.direct.values()))

    def _submit(self, incarnation: _Conn, op: Op, payload: tuple[Any, ...]) -> PendingCall:
        self.arena_obs.sent(op)
        body = self._slot + payload[0] if payload else self._slot
        return incarnation.send(op, body, self._timeout, self.worker)

    def _unpack(self, reply: Any) -> Any:
        status, payload = reply
        if status != ST_OK:
            raise failure_error(self.worker, load_failure(payload))
        return payload

    async def reset(
        self,
        mask: np.ndarray,
        seeds: Sequence[int | None] | None = None,
        options: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
    ) -> dict[int, dict[str, object]]:
        if seeds is None and options is None:
            payload = await self._request(Op.RESET, _mask_bytes(mask))
        else:
            args = reset_arguments(self.spec.n_envs, seeds, options)
            blob = self._pickle("reset options", args)
            payload = await self._request(Op.RESET_ARGS, _mask_bytes(mask) + blob)
        return _column_wire.read_reset_reply(self.buffers.obs, payload)  # rows not shared: here

    async def step(self, mask: np.ndarray) -> StepInfos:
        self.arena_obs.home()  # the hot path: _request without its generic layers, same checks
        inc = self._incarnation
        body = self._step_body(mask)
        if inc is None or self._member.closed:
            return self.step_infos(await self._request(Op.STEP, body))
        call = inc.send(Op.STEP, self._slot + body, self._timeout, self.worker)
        return self.step_infos(await self.reply(inc, call))

    def give_actions(self, actions: list[Any] | None) -> None:
        """See :meth:`~asyncsample.backends.base.GivenActionsHost.give_actions`."""
        self._given = actions

    def step_nowait(self) -> SentStep | None:
        """See :meth:`~asyncsample.backends.base.LockstepHost.step_nowait`; without a
        ``step_timeout`` (whose clock is the loop's) the request is sent bare."""
        self.arena_obs.home()
        inc = self._incarnation
        if inc is None or inc.dead or self._member.closed:
            return None
        body = self._whole_body
        if not body or self._given is not None:
            cache = self._given is None and not (
                isinstance(self.buffers.actions, list) or self._columns
            )
            body = self._slot + self._step_body(self._whole_mask)
            if cache:  # the same request every step
                self._whole_body = body
        if self._timeout is None:
            if inc.handoff is not None and body is self._whole_body:  # actions in the buffers
                flagged = inc.flag_step(self, self._slot_index)
                if flagged is not None:
                    return flagged
            step = DirectStep(self, inc)
            if inc.send_direct(step, body):
                return step
        call = inc.send(Op.STEP, body, self._timeout, self.worker)
        return QueuedStep(self, inc, call)

    def _step_body(self, mask: np.ndarray) -> bytes:
        body = _mask_bytes(mask)
        if isinstance(self.buffers.actions, list) or self._columns:  # rows not shared
            body += self._pickle("actions", _column_wire.outgoing_rows(self.buffers.actions))
        elif self._given is not None:  # this step's actions, as the caller gave them
            body += self._pickle("actions", self._given)
            self._given = None
        return body

    def step_infos(self, payload: bytes) -> StepInfos:
        """What a step reply's ``payload`` says (observations without fixed-size rows go to
        the buffers)."""
        return _column_wire.read_step_reply(self.buffers, payload)

    async def run_chunk(self, request: ChunkRequest) -> tuple[ChunkReply, int]:
        """See :meth:`~asyncsample.backends._chunk.AgentHost.run_chunk`."""
        sent = await self.send_chunk(request)
        return await sent.wait(), sent.version

    async def send_chunk(self, request: ChunkRequest | NextChunk) -> _chunk.SentChunk:
        """Send a chunk request (after syncing the agent copy) without awaiting its reply."""
        version = await self.sync_agent()
        inc, chunk = self._incarnation, self.chunk
        if inc is None or self._member.closed or chunk is None:
            raise closed_error(self.worker, "run its chunk")
        body = self._slot + dumps(request)
        call = inc.send(Op.CHUNK, body, self._timeout, self.worker, chunk.progress)
        into = (self.chunks[request.buffer], self.buffers.obs) if self._columns else None
        seen = self.arena_obs.seen
        return _chunk.SentChunk(call.future, lambda: self.reply(inc, call), version, into, seen)


class ProcessLaneHost(RemoteLanes, ProcessHost):
    """The host of one worker's async envs, each reset and stepped on its own in its env-host
    process's event loop (see :mod:`asyncsample.backends._lane_link`)."""

    def __init__(self, spec: HostSpec, member: _Member, slot: int, buffers: StepBuffers) -> None:
        # No per-call timer: the host holds each env call to step_timeout itself.
        super().__init__(spec, member, slot, buffers, None, [])
        self._lanes_init(slot)


class ProcessBackend:
    """Hosts the envs of all workers in a pool of env-host processes.

    Args:
        n_processes: size of the pool (default: the number of CPUs), capped at the number of
            workers.
        step_timeout: seconds a host may spend on one build, update, reset or step before it is
            killed and the request fails with :class:`~asyncsample.StepTimeoutError` (naming
            its line); so is a host of async envs whose loop stands still (:class:`LoopChecks`).
        host_threads: intra-op threads of the numeric libraries (torch, OpenMP, MKL, OpenBLAS)
            in each host process; ``None`` leaves the libraries' defaults (every core each).
        pin_cpus: pin host ``i`` to the ``i``-th CPU this process may use: ``True`` always,
            ``None`` when there is a host for every such CPU (the faces' choice, see
            :func:`~asyncsample.backends._procs.host_cpus`), ``False`` (default) never.
        close_timeout: seconds :meth:`aclose` lets a host close its envs before it is killed
            (``None``: ``EXIT_GRACE``); a host still busy with a call gets at most
            ``EXIT_GRACE``. With async envs, also the longest an env's ``close()`` is waited for
            in its host (``None``: 10 s).
        max_concurrency: async envs (each stepped on its own in its host's event loop): the env
            calls in flight across the hosts (each host gets a share). ``step_timeout`` then
            cuts one env's call (that env is rebuilt), not the host.
        spin_after_step: seconds a host polls for a request after a step's reply (see _host_main).
        host_nice: what each host of async envs, or of the agent's chunks
            (``inference="host"``), adds to its niceness (0 to 19, as ``nice``: a lower CPU
            priority; ``None``: :data:`LANE_HOST_NICE`). Such hosts keep every core busy on their
            own; below the caller, they never keep its event loop waiting for one.

    Raises:
        TypeError: an unknown option (the valid ones are listed) or a wrong type.
    """

    OPTIONS = (
        "n_processes",
        "step_timeout",
        "host_threads",
        "pin_cpus",
        "close_timeout",
        "max_concurrency",
        "spin_after_step",
        "host_nice",
    )

    def __init__(
        self,
        n_processes: int | None = None,
        step_timeout: float | None = None,
        host_threads: int | None = 1,
        pin_cpus: bool | None = False,
        close_timeout: float | None = None,
        max_concurrency: int | None = None,
        spin_after_step: float | None = None,
        host_nice: int | None = None,
        **unknown: object,
    ) -> None:
        reject_unknown_options("process", unknown, self.OPTIONS)
        self.host_nice = _validate.optional_niceness("host_nice", host_nice, LANE_HOST_NICE)
        self.spin_after_step = _validate.positive_seconds("spin_after_step", spin_after_step)
        self.close_timeout = optional_close_timeout(close_timeout)
        self.max_concurrency = _validate.optional_positive_int("max_concurrency", max_concurrency)
        if pin_cpus is not None and not isinstance(pin_cpus, bool):
            raise TypeError(
                f"pin_cpus must be True, False or None, got {type(pin_cpus).__name__} {pin_cpus!r}"
            )
        self.pin_cpus = pin_cpus
        self.n_processes = _validate.optional_positive_int("n_processes", n_processes)
        self.step_timeout = _validate.positive_seconds("step_timeout", step_timeout)
        self.host_threads = _validate.optional_positive_int("host_threads", host_threads)
        self._members: list[_Member] = []
        self._started = False
        self._closed = False
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._token = -1
        self._checks: LoopChecks | None = None  # async envs' hosts: their loops, watched
        self.joint: StepBuffers | None = None
        """The step buffers of every host in one allocation (hosts with the same spaces), in
        host order, then the :attr:`guests`' rows: a vector env's ``step`` returns ``joint.obs``
        itself with ``copy=False``, and a copy of each field where ``copy`` is true."""
        self.guests: list[HostSpec] = []
        """Specs of hosts in the caller's process whose rows :attr:`joint` holds too (set before
        :meth:`start`; their buffers are then :attr:`guest_buffers`)."""
        self.guest_buffers: list[StepBuffers] = []

    @property
    def pids(self) -> list[int]:
        """Pids of the live host processes, in pool order."""
        return [
            m.current.pid for m in self._members if m.current is not None and not m.current.dead
        ]

    async def start(self, specs: Sequence[HostSpec]) -> list[EnvHost]:
        if self._closed:
            raise RuntimeError("the process backend is closed")
        if self._started:
            raise RuntimeError("the process backend was already started")
        self._started = True
        specs = list(specs)
        if not specs:
            return []
        where = placement(len(specs), self.n_processes)
        ctx = forkserver_context()
        # One allocation when the spaces are the same, but not with chunks (the hosts would
        # write the same cache lines at every step).
        whole = specs + self.guests
        joint = None if any(s.chunk_steps for s in specs) else joint_buffers(whole, ctx)
        raws: list[Any]
        if joint is None:
            self.joint = None
            own = [own_slot_buffers(s, ctx) for s in specs]
            buffers, raws = [buf for buf, _ in own], [raw for _, raw in own]
        else:
            self.joint, buffers, raws = joint
            self.guest_buffers = buffers[len(specs) :]
            buffers, raws = buffers[: len(specs)], raws[: len(specs)]
        chunks = [_chunk.shared_chunk_sets(spec, ctx) for spec in specs]  # inference="host"
        raw_chunks = [raw for _, raw in chunks]
        arenas = step_arenas(specs)  # per_worker, batched
        raw_arenas = [None if a is None else a.raw for a in arenas]
        splits = list(zip(*(where.split(x) for x in (specs, raws, raw_chunks, raw_arenas))))
        cpus = host_cpus(len(splits), self.pin_cpus)
        lanes = specs[0].lanes
        # Hosts busy on their own between requests run below the caller (see LANE_HOST_NICE).
        nice = self.host_nice if lanes or any(s.chunk_steps for s in specs) else 0
        close = CLOSE_TIMEOUT if self.close_timeout is None else self.close_timeout
        caps = shares(
            self.max_concurrency if lanes else None, [sum(s.n_envs for s in m[0]) for m in splits]
        )
        self._members = [
            _Member(
                m,
                ctx,
                member_specs,
                member_raws,
                member_chunks,
                self.host_threads,
                cpus[m],
                LaneOptions(self.step_timeout, close, caps[m]) if lanes else None,
                member_arenas,
                self.spin_after_step,
                self.step_timeout,
                nice,
            )
            for m, (member_specs, member_raws, member_chunks, member_arenas) in enumerate(splits)
        ]
        self._token = token = track(self._members)
        self._finalizer = weakref.finalize(self, release_all, self._members, token)
        self._finalizer.atexit = False  # see _procs.track
        try:
            await wait_all([m.live() for m in self._members])
            if self._closed:
                raise RuntimeError("the process backend was closed while it started")
        except BaseException:
            self._closed = True
            self._release()
            raise
        members = self._members
        if lanes and self.step_timeout is not None:
            self._checks = LoopChecks(members, self.step_timeout)
        if lanes:
            return [
                ProcessLaneHost(spec, members[where.member(w)], where.slot(w), buffers[w])
                for w, spec in enumerate(specs)
            ]
        at = [(members[where.member(w)], where.slot(w)) for w in range(len(specs))]
        return [
            ProcessHost(spec, *at[w], buffers[w], self.step_timeout, sets, arenas[w])
            for w, (spec, (sets, _)) in enumerate(zip(specs, chunks))
        ]

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for member in self._members:
            member.closed = True
        conns = [c for m in self._members for c in m.incarnations]
        try:
            wait = self.close_timeout
            graces = await asyncio.gather(*(settled_grace(c, wait, EXIT_GRACE) for c in conns))
            await asyncio.gather(
                *(c.shutdown(g) for c, g in zip(conns, graces)), return_exceptions=True
            )
        finally:
            self._release()  # whatever the graceful path left (idempotent)

    def close_now(self) -> None:
        """Kill every host process and release everything at once (no graceful exit)."""
        self._closed = True
        for member in self._members:
            member.closed = True
        self._release()

    def _release(self) -> None:
        if self._checks is not None:
            self._checks.cancel()
        if self._finalizer is not None:
            self._finalizer.detach()
        release_all(self._members, self._token)
