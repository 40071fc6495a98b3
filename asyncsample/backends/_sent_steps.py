"""The step requests of :meth:`~asyncsample.backends.process.ProcessHost.step_nowait` (the
faces' loop-free lockstep round): one queued as an ordinary call, one sent bare."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from asyncsample.backends._remote import Incarnation, PendingCall
from asyncsample.backends._transport import ST_OK, Op, load_failure
from asyncsample.backends.base import failure_error
from asyncsample.env_group import StepInfos

__all__ = ["QUIET", "DirectStep", "QueuedStep", "StepConn", "StepHost"]


class StepConn(Incarnation):
    """What a sent step needs of the host's connection: its calls and bare steps by id."""

    pending: dict[int, PendingCall]
    direct: dict[int, Any]


class StepHost(Protocol):
    """What a sent step needs of its host (the process backend's host)."""

    worker: int

    def step_infos(self, payload: bytes) -> StepInfos: ...

    async def reply(self, inc: Any, call: PendingCall) -> bytes: ...


#: The outcome of a step with nothing to report: one shared object, never changed.
QUIET = StepInfos(None, {})


@dataclass(slots=True, eq=False)
class QueuedStep:
    """A step request queued as an ordinary call (see
    :class:`~asyncsample.backends.base.SentStep`)."""

    host: StepHost
    inc: StepConn
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
    """A step request sent bare (no call, future or timer): its reply is kept here when read;
    awaited before that, it becomes an ordinary call, with the loop's failure handling."""

    host: StepHost
    inc: StepConn
    rid: int = 0
    reply: tuple[int, bytes] | None = None

    def done(self) -> bool:
        return self.reply is not None or self.inc.dead

    def result_now(self) -> StepInfos | None:
        reply = self.reply
        if reply is None or reply[0] != ST_OK:
            return None
        if not reply[1]:
            return QUIET  # the common step: nothing to unpickle, nothing to build
        return self.host.step_infos(reply[1])

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
        status, payload = self.reply
        if status != ST_OK:
            raise failure_error(host.worker, load_failure(payload))
        return host.step_infos(payload)
