"""What the ``process`` and ``ray`` backends share: env hosts that live somewhere else.

:class:`Incarnation` is one life of a remote host (its unanswered calls in order, ``step_timeout``
on the head call only, "fail everyone" when it dies); :class:`PoolMember` one place in the pool,
its incarnation replaced once when it died; :class:`RemoteHost` one worker's view of its member,
a death translated into :class:`~asyncsample.WorkerCrashedError`,
:class:`~asyncsample.StepTimeoutError` or :class:`~asyncsample.SamplerClosedError`. What moves
the bytes stays in each backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import cloudpickle
import numpy as np

from asyncsample._validate import call_targets, set_attr_targets
from asyncsample.backends._transport import Op, with_version
from asyncsample.backends._watchdog import (
    REPORT_GRACE,
    STALLED_AT_CLOSE,
    TICK,
    BlockReport,
    loop_limit,
)
from asyncsample.backends.base import LOGGER, HostSpec
from asyncsample.env_group import StepBuffers
from asyncsample.env_update import EnvSource
from asyncsample.errors import SamplerClosedError, StepTimeoutError, WorkerCrashedError, WorkerError

__all__ = [
    "HostDied",
    "Incarnation",
    "LoopChecks",
    "PendingCall",
    "PoolMember",
    "RemoteHost",
    "closed_error",
    "progress_poll",
    "slots_blob",
]


class HostDied(Exception):
    """Set on the futures of calls whose host died, was killed or was shut down."""


@dataclass(slots=True, eq=False)
class PendingCall:
    """One call sent to a remote host and not answered yet.

    Attributes:
        label: what was asked (``"step"``, ``"build"``...), for messages.
        future: resolved with the raw reply, or failed with :class:`HostDied`.
        key: the backend's handle of the call (a request id, an ObjectRef).
        done: the host answered it; ``timed_out``: it outlived ``timeout`` and its host was
            killed for it.
        progress: for a call of many steps (a chunk), a counter the host bumps after each step;
            ``timeout`` then bounds each step, judged by how long the counter stood still
            (``base``: its value when the host started on the call; ``seen``: at the last look,
            first seen so at loop time ``since``). ``None``: ``timeout`` bounds the whole call.
    """

    label: str
    worker: int
    timeout: float | None
    future: asyncio.Future[Any]
    progress: np.ndarray | None = None
    key: Any = field(default=None, init=False)
    done: bool = field(default=False, init=False)
    timed_out: bool = field(default=False, init=False)
    base: int = field(default=0, init=False)
    seen: int = field(default=0, init=False)
    since: float = field(default=0.0, init=False)

    @property
    def limit(self) -> str | None:
        """How the timeout is named in messages."""
        return None if self.timeout is None else f"step_timeout={self.timeout:g}s"

    def what(self) -> str:
        """What outlived the timeout: ``"step"``, ``"step 3 of a chunk"``..."""
        if self.progress is None:
            return self.label
        return f"step {self.seen - self.base + 1} of a {self.label}"


def progress_poll(timeout: float) -> float:
    """How often a call judged per step has its counter read: a tenth of the timeout, at most
    :data:`PROGRESS_POLL`."""
    return max(min(timeout / 10, PROGRESS_POLL), 0.001)


#: The longest pause between two looks at a chunk's step counter, in seconds.
PROGRESS_POLL = 0.25


class Incarnation(ABC):
    """One life of a remote host, as the main process sees it. It serves its calls in order,
    so only the head of :attr:`calls` runs: its timeout starts when the one before is answered."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.calls: deque[PendingCall] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.dead = False
        self.closing = False  # being shut down on purpose: its death is not news
        self.reason = ""
        self.cause: BaseException | None = None
        # Why it was killed, for host_restarts_total: "died", "hung" (a call past step_timeout)
        # or "blocked" (its event loop stood still); and where it stood, if the host said.
        self.kill_cause = "died"
        self.report: BlockReport | None = None
        # Its event loop's counter at the last look, and the loop time it last moved (watched).
        self.loop_seen = -1
        self.loop_since: float | None = None
        self.waited = 0.0  # when a call past its timeout first waited for the host's report

    @abstractmethod
    def describe(self) -> str:
        """``"env-host process 1234"``, ``"env-host actor 0 (pid 1234 on 10.0.0.1)"``..."""

    @abstractmethod
    def _kill(self) -> None:
        """Kill the remote host, harmlessly if it is gone already (synchronous, never raises)."""

    def _defer_timeout(self, call: PendingCall) -> bool:
        """Whether a timeout that fell due should wait a moment (a reply may be in unread)."""
        return False

    def new_call(
        self,
        label: str,
        worker: int,
        timeout: float | None,
        progress: np.ndarray | None = None,
    ) -> PendingCall:
        """A call, queued as the host will serve it (see :class:`PendingCall`); failed at once
        if the host is dead."""
        call = PendingCall(label, worker, timeout, self.loop.create_future(), progress)
        if self.dead:
            call.future.set_exception(HostDied(self.reason))
            return call
        calls = self.calls
        calls.append(call)
        if timeout is not None and len(calls) == 1:
            self._arm(call, timeout)
        return call

    def _arm(self, call: PendingCall, timeout: float) -> None:
        """Start the clock of ``call``, which the host works on from now."""
        delay = timeout
        if call.progress is not None:  # judged per step: the counter is looked at from now
            call.base = call.seen = int(call.progress[0])
            call.since = self.loop.time()
            delay = progress_poll(timeout)
        self.timer = self.loop.call_later(delay, self._on_timeout, call)

    def _still_going(self, call: PendingCall, timeout: float) -> bool:
        """Whether a call judged per step is still on a step younger than ``timeout``."""
        progress = call.progress
        if progress is None:
            return False
        now = self.loop.time()
        count = int(progress[0])
        if count != call.seen:
            # A step ended since the last look. Its successor started now at the latest, so a
            # step is only judged hung once it has surely outlived ``timeout``.
            call.seen = count
            call.since = now
        left = call.since + timeout - now
        if left <= 0:
            return False
        self.timer = self.loop.call_later(min(left, progress_poll(timeout)), self._on_timeout, call)
        return True

    def answered(self, call: PendingCall) -> None:
        """The host answered ``call``: the next queued call is what it works on now."""
        call.done = True
        calls = self.calls
        if calls and calls[0].done:
            while calls and calls[0].done:
                calls.popleft()
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            if calls and not self.dead:
                head = calls[0]
                if head.timeout is not None:
                    self._arm(head, head.timeout)

    def _on_timeout(self, call: PendingCall) -> None:
        self.timer = None
        if call.done or self.dead or call.timeout is None:
            return
        if self._still_going(call, call.timeout):
            return
        if self._defer_timeout(call):
            self.timer = self.loop.call_later(0.001, self._on_timeout, call)
            return
        if self._report_due():
            self.timer = self.loop.call_later(TICK, self._on_timeout, call)
            return
        call.timed_out = True
        self.kill_cause = "hung"
        self.report = self.host_report()
        what = f"{call.what()} of worker {call.worker} took longer than {call.limit}"
        blame = "" if self.report is None else f" ({self.report.message()})"
        self.die(f"was killed: a {what}{blame}")

    def host_report(self) -> BlockReport | None:
        """Where the host's loop or serving thread stands still, if its watchdog said so (see
        :mod:`asyncsample.backends._watchdog`); ``None``: it did not, or cannot tell us."""
        return None

    def loop_turns(self) -> int | None:
        """The counter the host's event loop bumps, read now (``None``: not read this way)."""
        return None

    def _report_due(self) -> bool:
        """Whether a call past its timeout waits (at most :data:`REPORT_GRACE`) for the host's
        watchdog to say where it stands: a host that can say, and has not yet."""
        if not self.can_report or self.host_report() is not None:
            return False
        now = self.loop.time()
        self.waited = self.waited or now
        return now - self.waited < REPORT_GRACE

    #: Whether :meth:`host_report` can say where a busy host stands (its watchdog writes it).
    can_report = False

    def judge_loop(
        self, turns: int, report: BlockReport | None, now: float, timeout: float | None
    ) -> None:
        """One look at the host's event loop (its counter ``turns``, its watchdog's ``report``) at
        loop time ``now``: a loop that stood still for ``timeout`` (:func:`loop_limit`) is killed,
        as ``blocked`` when the watchdog named the line, else :data:`REPORT_GRACE` later as
        ``hung`` (a call that holds the GIL stops the watchdog too)."""
        if turns != self.loop_seen or self.loop_since is None:
            self.loop_seen, self.loop_since = turns, now
            return
        if timeout is None or self.dead or self.closing:
            return
        if report is not None:
            self.kill_cause, self.report = "blocked", report
            self.die(f"was killed: {report.message()}")
        elif now - self.loop_since >= loop_limit(timeout) + REPORT_GRACE:
            self.kill_cause = "hung"
            self.die(
                f"was killed: its event loop stood still for {now - self.loop_since:.1f} s, past "
                f"step_timeout={timeout:g}s, and its watchdog could not say where (a call that "
                "holds the GIL?)"
            )

    def loop_stalled(self) -> bool:
        """Whether its watched loop was last seen standing still for :data:`STALLED_AT_CLOSE`."""
        since = self.loop_since
        return since is not None and self.loop.time() - since >= STALLED_AT_CLOSE

    async def wait_exit(self, exited: asyncio.Future[Any], grace: float) -> str:
        """Wait at most ``grace`` seconds for ``exited``; what to say if it did not come (the
        reason to kill the host): sooner when its event loop, read by :meth:`loop_turns`,
        stands still for :data:`STALLED_AT_CLOSE` (it cannot close its envs)."""
        end = self.loop.time() + grace
        while not exited.done():
            now = self.loop.time()
            turns = self.loop_turns()
            if turns is not None:
                self.judge_loop(turns, None, now, None)
                if self.loop_stalled():
                    return (
                        f"was killed: its event loop stood still for {STALLED_AT_CLOSE:g}s after "
                        "it was asked to exit (an env blocking it?)"
                    )
            if now >= end:
                break
            await asyncio.wait({exited}, timeout=min(end - now, TICK))
        return f"was killed: it did not exit within {grace:g}s of being asked to"

    def die(self, reason: str, cause: BaseException | None = None) -> None:
        """Mark the host dead: kill it and fail every call waiting on it. Idempotent."""
        if self.dead:
            return
        self.dead = True
        self.reason = reason
        self.cause = cause
        if not self.closing:
            LOGGER.warning("%s %s; the calls waiting on it fail", self.describe(), reason)
        # This may run from a finalizer after the loop closed: never let it raise.
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self._kill()
        pending = list(self.calls)
        self.calls.clear()
        for call in pending:
            if not call.future.done():
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    call.future.set_exception(HostDied(reason))
        self._on_death()

    def _on_death(self) -> None:  # noqa: B027 - a hook, empty by default
        """Release what the backend holds for this incarnation (after :meth:`die`)."""

    def kind(self) -> str:
        """Why this host went: ``"blocked"``, ``"hung"`` or ``"died"``."""
        return self.kill_cause

    def crashed(self, worker: int) -> WorkerCrashedError:
        """The error of a call that found this host dead."""
        err = WorkerCrashedError(f"{self.describe()} {self.reason}", worker=worker)
        err.__cause__ = self.cause
        return err


IncT = TypeVar("IncT", bound=Incarnation)


class PoolMember(ABC, Generic[IncT]):
    """One place in the pool (``index``): the workers it hosts (``specs``, in slot order) and
    its current incarnation."""

    def __init__(self, index: int, specs: Sequence[HostSpec]) -> None:
        self.index = index
        self.workers = [s.worker for s in specs]
        self.slots_blob = slots_blob(specs)
        self.current: IncT | None = None
        self.incarnations: list[IncT] = []  # every one not yet released
        self.lock = asyncio.Lock()
        self.closed = False
        #: Restarts by cause (``died``, ``hung``, ``blocked``: see ``Incarnation.kill_cause``).
        self.restarts: dict[str, int] = {"died": 0, "hung": 0, "blocked": 0}

    @abstractmethod
    async def _spawn(self) -> IncT:
        """Start a new incarnation (appended to :attr:`incarnations` as soon as it exists)."""

    def _discard(self, incarnation: IncT) -> None:
        """Stop an incarnation that was started after the backend closed."""
        incarnation.closing = True
        incarnation.die("was shut down")

    async def live(self) -> IncT:
        """The current incarnation, started anew (once, whoever asks) if it is dead.

        Raises:
            SamplerClosedError: the backend is closed.
            WorkerCrashedError: a new incarnation failed to start.
        """
        async with self.lock:
            current = self.current
            if current is not None and not current.dead:
                return current
            if self.closed:
                raise closed_error(self.workers[0], "restart its env host")
            new = await self._spawn()
            self.current = new
            if self.closed:  # closed while the new one started: it was left out
                self._discard(new)
                raise closed_error(self.workers[0], "restart its env host")
            if current is not None:
                self.restarts[current.kind()] += 1
                LOGGER.warning(
                    "%s (workers %s) %s; restarted as %s",
                    current.describe(),
                    ", ".join(map(str, self.workers)),
                    current.reason,
                    new.describe(),
                )
            return new


class LoopChecks:
    """Every :func:`progress_poll` of ``timeout``: the event loop of each live incarnation of
    ``members`` that can be read (:meth:`Incarnation.loop_turns`) judged
    (:meth:`Incarnation.judge_loop`); nothing per step. Until :meth:`cancel`."""

    def __init__(self, members: Sequence[PoolMember[Any]], timeout: float) -> None:
        self.members = members
        self.timeout = timeout
        self.timer: asyncio.TimerHandle | None = None
        self._look()

    def _look(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for member in self.members:
            inc = member.current
            turns = None if inc is None or inc.dead else inc.loop_turns()
            if inc is not None and turns is not None:
                inc.judge_loop(turns, inc.host_report(), now, self.timeout)
        self.timer = loop.call_later(progress_poll(self.timeout), self._look)

    def cancel(self) -> None:
        """Stop looking (idempotent)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def closed_error(worker: int, what: str) -> SamplerClosedError:
    """The error of a host call made or in flight when the backend was closed."""
    return SamplerClosedError(
        f"worker {worker} could not {what}: the sampler (and its env hosts) was closed"
    )


class RemoteHost(ABC, Generic[IncT]):
    """The host of one worker's envs (``spec``) in a started ``member`` of a remote pool, as
    the worker sees it, with its step ``buffers`` and ``step_timeout``."""

    #: How the remote side is called in error messages ("env-host process").
    where = "env host"

    def __init__(
        self,
        spec: HostSpec,
        member: PoolMember[IncT],
        buffers: StepBuffers,
        step_timeout: float | None,
    ) -> None:
        self.spec = spec
        self.worker = spec.worker
        self.buffers = buffers
        self._member = member
        self._timeout = step_timeout
        self._incarnation: IncT | None = member.current
        # inference="host": what the host's agent copy should be, and what it is.
        self._agent_blob: bytes | None = None
        self._params_blob: bytes | None = None
        self._agent_version = 0
        self._agent_dirty = False
        self._params_dirty = False
        self._agent_inc: IncT | None = None
        self._synced_version = 0

    @property
    def host_restarts(self) -> dict[str, int]:
        """The restarts of this worker's host (shared with the other workers it hosts), by
        cause (see :attr:`PoolMember.restarts`)."""
        return self._member.restarts

    @property
    def env_calls(self) -> int:
        """The env calls running now for the metrics (read at scrape time, from any thread): this
        worker's envs while a call of its is in its host (lockstep: all of them at once)."""
        inc = self._incarnation
        if inc is None or inc.dead:
            return 0
        worker = self.worker
        busy = any(c.worker == worker for c in list(inc.calls)) or self._sent_bare(inc)
        return self.spec.n_envs if busy else 0

    def _sent_bare(self, incarnation: IncT) -> bool:
        """Whether a step of this worker is in its host without a call (see ``process``)."""
        return False

    @abstractmethod
    def _submit(self, incarnation: IncT, op: Op, payload: tuple[Any, ...]) -> PendingCall:
        """Send one request for this worker's slot; the call's future gets the raw reply."""

    @abstractmethod
    def _unpack(self, reply: Any) -> Any:
        """The payload of a raw reply, or raise the :class:`~asyncsample.WorkerError` in it."""

    async def _request(self, op: Op, *payload: Any) -> Any:
        """Send ``op`` with ``payload`` and await its reply (see :meth:`reply`)."""
        inc = self._incarnation
        if inc is None:
            raise RuntimeError(f"the backend has not started the host of worker {self.worker}")
        if self._member.closed:
            raise closed_error(self.worker, op.label)
        return await self.reply(inc, self._submit(inc, op, payload))

    async def reply(self, inc: IncT, call: PendingCall) -> Any:
        """The payload of ``call``'s reply, or the error a failure or death means."""
        try:
            reply = await call.future
        except HostDied:
            err: Exception
            if self._member.closed:
                err = closed_error(self.worker, f"finish its {call.label}")
            elif call.timed_out:
                report = inc.report
                blame = "" if report is None else f": {report.message()}"
                err = StepTimeoutError(
                    f"{call.what()} took longer than {call.limit}; {inc.describe()} was "
                    f"killed{blame}",
                    worker=self.worker,
                    env=None if report is None else report.env,
                    remote_traceback=None if report is None else report.stack,
                )
            else:
                err = inc.crashed(self.worker)
            raise err from err.__cause__
        return self._unpack(reply)

    def _pickle(self, what: str, obj: Any) -> bytes:
        try:
            return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)  # type: ignore[no-any-return]
        except Exception as exc:
            raise TypeError(
                f"the {what} of worker {self.worker} cannot be pickled (with cloudpickle) to send "
                f"it to its {self.where}: {type(exc).__name__}: {exc}"
            ) from exc

    async def build(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        blob = self._pickle("env", ([list(c) for c in chains], list(seeds)))
        await self._request(Op.BUILD, blob)

    async def update(self, updates: Sequence[EnvSource | None], seeds: Sequence[int]) -> None:
        blob = self._pickle("env update", (list(updates), list(seeds)))
        await self._request(Op.UPDATE, blob)

    async def call(
        self,
        name: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        envs: Sequence[int] | None = None,
    ) -> list[Any]:
        indices = call_targets(name, self.spec.n_envs, envs)
        blob = self._pickle("call arguments", (name, list(args), dict(kwargs or {}), indices))
        reply = await self._request(Op.CALL, blob)
        results: list[Any] = pickle.loads(reply)
        return results

    async def set_attr(
        self, name: str, values: Sequence[Any], envs: Sequence[int] | None = None
    ) -> None:
        indices = set_attr_targets(name, values, self.spec.n_envs, envs)
        blob = self._pickle("attribute values", (name, list(values), indices))
        await self._request(Op.SET_ATTR, blob)

    def set_agent(self, blob: bytes, version: int) -> None:
        """See :meth:`~asyncsample.backends._chunk.AgentHost.set_agent`."""
        self._agent_blob = blob
        self._params_blob = None
        self._params_dirty = False
        self._agent_dirty = True
        self._agent_version = version

    def set_params(self, blob: bytes, version: int) -> None:
        """See :meth:`~asyncsample.backends._chunk.AgentHost.set_params`."""
        self._params_blob = blob
        self._params_dirty = True
        self._agent_version = version

    async def sync_agent(self) -> int:
        """Send the agent and parameters the host lacks; the agent version in force there.

        A new incarnation gets the agent again, then the latest parameters. Updates made while
        a message is in flight are sent next, so the version returned is the one the next chunk
        runs with.
        """
        while True:
            inc = self._incarnation
            if self._agent_blob is None:
                raise RuntimeError(f"worker {self.worker}: no agent was given to its env host")
            if self._agent_inc is not inc:
                self._agent_dirty = True
                self._params_dirty = self._params_blob is not None
            if not (self._agent_dirty or self._params_dirty):
                return self._synced_version
            if self._agent_dirty:
                blob, version = self._agent_blob, self._agent_version
                self._agent_dirty = False
                try:
                    await self._request(Op.AGENT, with_version(version, blob))
                except BaseException:
                    self._agent_dirty = True
                    raise
                self._agent_inc = inc
                self._synced_version = version
                self._params_dirty = self._params_blob is not None
            if self._params_dirty and self._params_blob is not None:
                blob, version = self._params_blob, self._agent_version
                self._params_dirty = False
                try:
                    await self._request(Op.PARAMS, with_version(version, blob))
                except BaseException:
                    self._params_dirty = True
                    raise
                self._synced_version = version

    async def restart(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        """Replace a dead or killed host (once for all its workers), then rebuild the envs (a
        live host, where an env merely raised, keeps running)."""
        old = self._incarnation
        self._incarnation = inc = await self._member.live()
        if inc is old:
            LOGGER.info("worker %d: rebuilding its envs in %s", self.worker, inc.describe())
        await self.build(chains, seeds)

    async def close(self) -> None:
        inc = self._incarnation
        if inc is None or inc.dead or self._member.closed:
            return
        with contextlib.suppress(WorkerError, SamplerClosedError):
            await self._request(Op.CLOSE)


def slots_blob(specs: Sequence[HostSpec]) -> bytes:
    """What a remote host is started with: the :class:`HostSpec` of each slot, cloudpickled
    (spaces may be defined in the user's script)."""
    blob: bytes = cloudpickle.dumps(list(specs), protocol=pickle.HIGHEST_PROTOCOL)
    return blob
