"""The lockstep steps sent to an env-host process: as an ordinary call (:class:`QueuedStep`), bare
over the socket (:class:`DirectStep`) or, to a polling host, handed over through shared memory
(:class:`FlagStep`).

Where the caller and every env-host process have a CPU each (the faces' ``spin_after_step``), a
host polls for the next step request after each reply. Over the socket that request costs both
sides a frame (a write, a poll and a read each way, the frame parsed and dispatched): more than a
cheap env's step. Here the caller writes its actions into the shared step buffers as before and
raises a counter in a small shared block (:class:`Handoff`); the polling host sees it, steps every
env of the slot as a ``STEP`` frame would, and raises the reply counter. Infos of plain numbers
come in the slot's info cells (:mod:`asyncsample._info_cells`). Other infos, a final observation
the buffers cannot hold, or a failure still reply with a frame (``FLAG_ID``), which the counter's
status points to, so nothing is ever lost. PufferLib's workers hand over this way.

A side that stops looking says so first: the host clears ``LOOKING`` before it sleeps in a read
(the caller then sends a ``WAKE_ID`` frame after raising the counter, or a plain frame), and the
caller sets ``WAITING`` before it sleeps in ``poll`` (the host then sends a ``WAKE_ID`` frame after
its reply). Both sleeps are naps of at most :data:`NAP` seconds that look at the counters again,
so a wake-up lost between two cores' stores costs a nap, never a hang; a dead host is seen as
before (its connection ends).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from asyncsample._info_cells import COLUMNS
from asyncsample.backends._transport import HEADER, ST_OK, Op, load_failure, send_frame
from asyncsample.backends.base import failure_error
from asyncsample.env_group import StepInfos

if TYPE_CHECKING:
    import socket

    from asyncsample.backends._remote import PendingCall

__all__ = [
    "CTL_SLOTS",
    "FLAG_ID",
    "NAP",
    "QUIET",
    "WAKE_ID",
    "DirectStep",
    "FlagStep",
    "QueuedStep",
    "Handoff",
    "HostHandoff",
]

#: The block's int64 cells: the caller's request count and the slot it is for, the host's reply
#: count and its status, whether the host will look at the request count before it sleeps, and
#: whether the caller sleeps waiting for the reply.
REQ, SLOT_CELL, REP, STATUS, LOOKING, WAITING = range(6)
CTL_SLOTS = 8
#: Reply statuses: the outcome is in the shared buffers alone; a frame (``FLAG_ID``) carries it;
#: in the buffers, with infos in the slot's info cells (:mod:`asyncsample._info_cells`).
IN_BUFFERS, FRAME, IN_CELLS = 0, 1, 2
#: The outcome of a step with nothing to report: one shared object, never changed.
QUIET = StepInfos(None, {})
#: Request ids no call takes (see ``process._Conn``): a flag step's reply frame, and a frame that
#: only wakes the other side (either way).
FLAG_ID = 0xFFFFFFFE
WAKE_ID = 0xFFFFFFFD
#: The longest a side sleeps before it looks at the counters again (seconds).
NAP = 0.005

_WAKE = HEADER.pack(0, WAKE_ID, Op.STEP)


class ProcessHost(Protocol):
    """What a sent step needs of its host (``process.ProcessHost``)."""

    @property
    def worker(self) -> int: ...

    def step_infos(self, payload: bytes) -> StepInfos: ...

    async def reply(self, inc: Any, call: PendingCall) -> Any: ...


class _Conn(Protocol):
    """What a sent step needs of its host's connection (``process._Conn``)."""

    dead: bool
    direct: dict[int, Any]
    pending: dict[int, PendingCall]

    def new_call(
        self, label: str, worker: int, timeout: float | None, progress: Any = None
    ) -> PendingCall: ...

    async def nap(self, seconds: float) -> None: ...


def _cells(raw: Any) -> memoryview:
    """The block as int64 cells (a memoryview: a cell reads and writes in ~40 ns)."""
    return memoryview(raw).cast("B").cast("q")


class Handoff:
    """The caller's side of one host process's block (made per process incarnation)."""

    def __init__(self, raw: Any) -> None:
        self.ctl = _cells(raw)  # (the memoryview keeps ``raw`` alive)
        self.sent = self.ctl[REQ]

    def send(self, slot: int, wake: Callable[[bytes], bool]) -> bool:
        """Ask the host to step every env of ``slot`` (its actions are in the shared buffers);
        ``False``: the host is not looking (send a frame instead). ``wake`` writes a frame."""
        ctl = self.ctl
        if not ctl[LOOKING] or ctl[REP] != self.sent:
            return False
        ctl[SLOT_CELL] = slot
        self.sent += 1
        ctl[REQ] = self.sent
        if not ctl[LOOKING]:  # it went to sleep meanwhile: wake it (a lost one costs a nap)
            wake(_WAKE)
        return True

    def answered(self, _timeout: int = 0) -> bool:
        """Whether the host answered the last request (a poll's signature: ``BoundedSpin.poll``
        spins on it)."""
        return self.ctl[REP] == self.sent

    def quiet(self) -> bool:
        """Whether the answer is in shared memory alone (no frame follows)."""
        return self.ctl[STATUS] != FRAME

    def in_cells(self) -> bool:
        """Whether the answer's infos are in the slot's info cells."""
        return self.ctl[STATUS] == IN_CELLS

    def waiting(self, on: bool) -> None:
        """The caller sleeps (``True``) waiting for the reply, or no longer does."""
        self.ctl[WAITING] = int(on)


class HostHandoff:
    """The host's side: takes the caller's flag requests and answers them."""

    def __init__(self, raw: Any, sock: socket.socket) -> None:
        self.ctl = ctl = _cells(raw)
        self.served = ctl[REQ]
        ctl[REP] = self.served
        ctl[LOOKING] = 1
        self._sock = sock

    def pending(self) -> bool:
        """Whether a request waits (the caller raised its count)."""
        return self.ctl[REQ] != self.served

    def take(self) -> int:
        """Take the waiting request: the slot it is for."""
        self.served = self.ctl[REQ]
        return self.ctl[SLOT_CELL]

    def answer(self, status: int, payload: bytes) -> None:
        """Answer the request taken: in shared memory alone (an OK status, no payload or infos in
        the cells), else with a ``FLAG_ID`` frame sent before the count rises (the caller reads
        it once it sees why)."""
        ctl = self.ctl
        framed = status != ST_OK or (bool(payload) and payload != COLUMNS)
        if framed:
            send_frame(self._sock, FLAG_ID, status, payload)
        ctl[STATUS] = FRAME if framed else IN_CELLS if payload else IN_BUFFERS
        ctl[REP] = self.served
        if not framed and ctl[WAITING]:
            self._sock.sendall(_WAKE)

    def looking(self, on: bool) -> None:
        """The host looks at the request count before it sleeps (``True``), or sleeps."""
        self.ctl[LOOKING] = int(on)


@dataclass(slots=True, eq=False)
class FlagStep:
    """A step request handed over by :class:`Handoff` (see
    :class:`~asyncsample.backends.base.SentStep`): answered in the shared buffers, or by a
    ``FLAG_ID`` frame (``reply``) when the host had more to say."""

    host: ProcessHost
    inc: _Conn
    handoff: Handoff
    reply: tuple[int, bytes] | None = None

    def done(self) -> bool:
        if self.inc.dead:
            return True
        handoff = self.handoff
        return handoff.answered() and (handoff.quiet() or self.reply is not None)

    def result_now(self) -> StepInfos | None:
        handoff = self.handoff
        if self.inc.dead or not handoff.answered():
            return None
        if handoff.quiet():
            self.inc.direct.pop(FLAG_ID, None)
            return self.host.step_infos(COLUMNS) if handoff.in_cells() else QUIET
        reply = self.reply
        if reply is None or reply[0] != ST_OK:
            return None
        return self.host.step_infos(reply[1])

    async def wait(self) -> StepInfos:
        """Wait in the loop: asleep, woken by the host's frame (or a nap's end)."""
        inc, handoff = self.inc, self.handoff
        while not self.done():
            handoff.waiting(True)
            try:
                if self.done():
                    break
                await inc.nap(NAP)
            finally:
                handoff.waiting(False)
        if inc.dead and self.result_now() is None and self.reply is None:
            call = inc.new_call(Op.STEP.label, self.host.worker, None)  # failed: the host died
            await self.host.reply(inc, call)
        infos = self.result_now()
        if infos is not None:
            return infos
        assert self.reply is not None
        return _outcome(self.host, self.reply)


@dataclass(slots=True, eq=False)
class QueuedStep:
    """A step request queued as an ordinary call (see
    :class:`~asyncsample.backends.base.SentStep`)."""

    host: ProcessHost
    inc: _Conn
    call: PendingCall

    def done(self) -> bool:
        return self.call.future.done()

    def result_now(self) -> StepInfos | None:
        fut = self.call.future
        if not fut.done() or fut.cancelled() or fut.exception() is not None:
            return None
        status, payload = fut.result()
        if status != ST_OK:
            return None
        return self.host.step_infos(payload)

    async def wait(self) -> StepInfos:
        return self.host.step_infos(await self.host.reply(self.inc, self.call))


@dataclass(slots=True, eq=False)
class DirectStep:
    """A step request sent bare over the socket (no call, future or timer): its reply is kept
    here when read; awaited before that, it becomes an ordinary call, with the loop's failure
    handling."""

    host: ProcessHost
    inc: _Conn
    rid: int = 0
    reply: tuple[int, bytes] | None = None

    def done(self) -> bool:
        return self.reply is not None or self.inc.dead

    def result_now(self) -> StepInfos | None:
        reply = self.reply
        if reply is None or reply[0] != ST_OK:
            return None
        # The common step: an empty reply, nothing to unpickle, nothing to build.
        return self.host.step_infos(reply[1]) if reply[1] else QUIET

    async def wait(self) -> StepInfos:
        host, inc = self.host, self.inc
        if self.reply is None and inc.direct.pop(self.rid, None) is not None:
            # Taken over by the loop: the only request in flight, so the host works on it now.
            call = inc.new_call(Op.STEP.label, host.worker, None)
            if not inc.dead:
                call.key = self.rid
                inc.pending[self.rid] = call
            return host.step_infos(await host.reply(inc, call))
        if self.reply is None:  # read by the loop meanwhile? (never both: the pop decides)
            raise RuntimeError("a bare step request lost its reply")
        return _outcome(host, self.reply)


def _outcome(host: ProcessHost, reply: tuple[int, bytes]) -> StepInfos:
    """What a bare step's reply frame says: its infos, or the failure it reports, raised."""
    status, payload = reply
    if status != ST_OK:
        raise failure_error(host.worker, load_failure(payload))
    return host.step_infos(payload)
