"""The lockstep round of :class:`~asyncsample.vector.hosted.HostedEnvs` without the event loop
where it can do without it (the loop's machinery costs more than the rest of a common step):
requests go out at once, replies are read in ``poll`` and a quiet round is built from the step
buffers; anything else is finished on the face's portal. Also its ``step_async``/``step_wait``.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncsample._tree import Tree
from asyncsample.backends._handoff import NAP, Handoff
from asyncsample.backends._threads import BoundedSpin
from asyncsample.backends.base import DirectReader, EnvHost, InlineHost, LockstepHost, SentStep
from asyncsample.env_group import StepInfos
from asyncsample.vector.placement import cpus
from asyncsample.vector.portal import BlockingPortal

__all__ = ["LockstepRounds", "PendingRound", "StepResult", "outcome"]

#: How long :meth:`LockstepRounds.lockstep` waits for replies outside the event loop before it
#: hands the round to the loop (where a step timeout, a dying host's sentinel... are seen).
_DIRECT_WAIT = 0.05


@dataclass
class StepResult:
    """What one lockstep round returned, per sub-env: ``obs`` (``None`` for a round of some
    hosts only), ``env_infos`` (``None``: all empty), the non-empty ``reset_infos`` of its resets,
    the ``restarted`` sub-envs with the reason, the envs' own ``final_obs`` if the hosts sent
    them."""

    obs: Tree | None
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    env_infos: list[dict[str, Any]] | None
    reset_infos: dict[int, dict[str, Any]]
    restarted: dict[int, str]
    final_obs: dict[int, Any] = field(default_factory=dict)

    def info(self, i: int) -> dict[str, Any]:
        """The step info of sub-env ``i``."""
        return {} if self.env_infos is None else self.env_infos[i]

    @classmethod
    def empty(cls, n: int) -> StepResult:
        """A result of ``n`` sub-envs, none stepped."""
        return cls(None, np.zeros(n), np.zeros(n, np.bool_), np.zeros(n, np.bool_), None, {}, {})

    @property
    def quiet(self) -> bool:
        """No info, no reset and no restart anywhere (the common step)."""
        return self.env_infos is None and not self.reset_infos and not self.restarted


@dataclass(slots=True)
class PendingRound:
    """A lockstep round sent by :meth:`~LockstepRounds.lockstep_send`: the requests that went
    out without the loop (from host 0 on), the hosts' connections by file descriptor (``None``:
    some host has none), or the round as a task on the portal's loop; the outcomes of the
    caller's own hosts once stepped."""

    sent: list[SentStep]
    readers: dict[int, DirectReader] | None
    task: asyncio.Task[StepResult] | None = None
    finished: bool = False
    inline: list[StepInfos | BaseException] | None = None

    def done(self) -> bool:
        """Whether the round is over."""
        return self.finished


async def outcome(step: Awaitable[StepInfos]) -> StepInfos | BaseException:
    """A host's answer to a step, or its failure."""
    try:
        return await step
    except Exception as exc:
        return exc


class LockstepRounds:
    """The lockstep round of :class:`~asyncsample.vector.hosted.HostedEnvs` (a mixin: the state,
    the round in the event loop, :meth:`step`, and the merge of the answers are its host's)."""

    portal: BlockingPortal
    hosts: list[EnvHost]
    broken: set[int]
    # The hosts [0, _remote_hosts) are processes; _inline are the rest, in the caller's process.
    _remote_hosts: int
    _inline: list[InlineHost]
    # The host processes as LockstepHosts (empty: some cannot step without the loop).
    _direct: list[LockstepHost]
    # Every sub-env of a host (read-only): the step mask of the common lockstep step.
    _whole: list[np.ndarray]
    # The poller of the hosts' connections, made for the file descriptors _polled.
    _poller: select.poll
    _polled: tuple[int, ...] = ()
    # Seconds to poll the hosts' connections before sleeping in poll (see placement.spins).
    _caller_spin: float = 0.0
    _spin: BoundedSpin | None = None  # made with the first spin
    # The round lockstep_send sent and no lockstep_wait finished (see _drop_round).
    _round: PendingRound | None = None
    # The caller's one host when it holds every sub-env (the in-process placement, no groups):
    # a common round is then its step alone, as SyncVectorEnv's is (see lockstep).
    _alone: InlineHost | None = None

    step: Callable[..., Coroutine[Any, Any, StepResult]]
    _merge: Callable[..., Coroutine[Any, Any, StepResult]]
    _combine: Callable[..., StepResult]
    read_obs: Callable[..., Tree]

    def lockstep(self, mask: np.ndarray | None = None) -> StepResult:
        """:meth:`step` of the sub-envs in ``mask`` (all), without the event loop if it can."""
        alone = self._alone
        if alone is not None and mask is None and not self.broken:
            if self.portal.in_caller_thread():  # else the loop's thread steps them, as before
                return self._step_alone(alone)
        return self.lockstep_wait(self.lockstep_send(mask), None, True)

    def _step_alone(self, host: InlineHost) -> StepResult:
        """The round of every sub-env when the caller's one host holds them all: its step, read
        from its buffers as :meth:`_combine` reads it (the host's rows are the sub-envs, in
        order), without a request sent or a round tracked. A failure goes to :meth:`_merge`."""
        try:
            got = host.step_now(self._whole[0], True)
        except Exception as exc:
            return self.portal.call(self._merge, None, [exc])
        buf = host.buffers
        obs = buf.obs
        return StepResult(
            obs.copy() if type(obs) is np.ndarray else self.read_obs(),
            buf.rewards.copy(),
            buf.terminated.copy(),
            buf.truncated.copy(),
            got.env_infos,
            got.reset_infos,
            {},
            got.final_obs or {},
        )

    def lockstep_send(self, mask: np.ndarray | None = None) -> PendingRound:
        """Send a lockstep round (``step_async``); :meth:`lockstep_wait` finishes it. Some
        sub-envs (``mask``), a broken host or a caller inside a running loop: :meth:`step` is
        started on the portal's loop."""
        portal = self.portal
        if mask is not None or self.broken or not portal.in_caller_thread():
            round_ = PendingRound([], None, portal.start(self.step, mask))
        else:
            round_ = self._send_round()
        self._round = round_
        return round_

    def lockstep_wait(
        self, round_: PendingRound, timeout: float | None = None, sent_here: bool = False
    ) -> StepResult:
        """The result of ``round_`` (``step_wait``), read without the loop when it is quiet;
        ``sent_here``: :meth:`lockstep_send` sent it in this call (the caller's thread checked).

        Raises:
            TimeoutError: ``timeout`` seconds passed first. The round is then the loop's (a
                task: the hosts' ``step_timeout`` timers run) and still pending: wait again.
        """
        portal = self.portal
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if round_.task is not None:
                res = portal.wait(round_.task, timeout)
            elif not sent_here and not portal.in_caller_thread():  # from inside a running loop
                inline = self._step_inline(round_)
                res = self._in_loop(round_, deadline, self._collect, round_.sent, inline)
            else:
                res = self._finish_round(round_, deadline)
        except BaseException as exc:
            if not isinstance(exc, TimeoutError):  # else the round is still pending
                self._round_over(round_)
            raise
        self._round_over(round_)
        return res

    def _round_over(self, round_: PendingRound) -> None:
        round_.finished = True
        if self._round is round_:
            self._round = None

    def _drop_round(self) -> None:
        """Once the hosts are stopped: take the outcomes of a round never waited for (asyncio
        would log a host's failure that nobody retrieved)."""
        round_, self._round = self._round, None
        if round_ is not None:
            for request in round_.sent:
                with contextlib.suppress(Exception):
                    request.result_now()

    def _send_round(self) -> PendingRound:
        """Send the host processes their step requests without the loop, host 0 first, as
        long as they take one (a dead host takes none: the loop sends the rest)."""
        sent: list[SentStep] = []
        readers: dict[int, DirectReader] | None = {}
        for host in self._direct:
            request = host.step_nowait()
            if request is None:
                break
            sent.append(request)
            reader = host.direct_reader()
            if reader is None or readers is None:
                readers = None
            else:
                readers[reader.fd] = reader
        return PendingRound(sent, readers)

    def _finish_round(self, round_: PendingRound, deadline: float | None) -> StepResult:
        """Step the caller's own hosts (once per round), then read the replies of a round sent
        by :meth:`_send_round`."""
        alone = self._alone
        if alone is not None and round_.inline is None and deadline is None:
            round_.inline = []  # stepped here, once
            return self._step_alone(alone)
        inline = self._step_inline(round_)
        sent, readers = round_.sent, round_.readers
        if len(sent) == self._remote_hosts and readers is not None:
            outcomes = self._read_direct(sent, readers, deadline) if sent else []
            if outcomes is not None:  # read directly: replies, no exceptions
                failed = inline and any(isinstance(o, BaseException) for o in inline)
                outcomes += inline
                if not failed:
                    return self._combine(None, outcomes)
                return self._in_loop(round_, deadline, self._merge, None, outcomes)
        return self._in_loop(round_, deadline, self._collect, sent, inline)

    def _step_inline(self, round_: PendingRound) -> list[StepInfos | BaseException]:
        """Step the caller's own hosts, once per round; their outcomes."""
        if round_.inline is None:
            round_.inline = []
            for k, host in enumerate(self._inline):
                try:
                    round_.inline.append(host.step_now(self._whole[self._remote_hosts + k], True))
                except Exception as exc:
                    round_.inline.append(exc)
        return round_.inline

    def _in_loop(
        self,
        round_: PendingRound,
        deadline: float | None,
        fn: Callable[..., Coroutine[Any, Any, StepResult]],
        *args: Any,
    ) -> StepResult:
        """Finish ``round_`` in the portal's loop with ``fn(*args)``: to its end, or (with a
        ``deadline``) as the round's task, waited for until then."""
        if deadline is None:
            return self.portal.call(fn, *args)
        round_.task = self.portal.start(fn, *args)
        return self.portal.wait(round_.task, deadline - time.monotonic())

    def _read_direct(
        self,
        sent: list[SentStep],
        readers: dict[int, DirectReader],
        deadline: float | None = None,
    ) -> list[StepInfos | BaseException] | None:
        """Read the replies to ``sent`` without the loop; ``None``: the loop must finish the
        round (a reply that is no quiet one, a slow host, or ``deadline`` passed)."""
        outcomes: list[StepInfos | BaseException] = []
        fds = tuple(readers)
        for request in sent:
            while not request.done():
                ready = self._wait_readable(fds, deadline, getattr(request, "handoff", None))
                if ready is None:
                    return None
                for fd, _ in ready:
                    if not readers[fd].read_now():
                        return None
            infos = request.result_now()
            if infos is None:
                return None
            outcomes.append(infos)
        return outcomes

    def _wait_readable(
        self, fds: tuple[int, ...], deadline: float | None = None, flag: Handoff | None = None
    ) -> list[tuple[int, int]] | None:
        """``poll`` the connections ``fds`` for at most ``_DIRECT_WAIT`` (not past
        ``deadline``), with one poller for as long as they stay the same; what is ready
        (``None``: nothing in time). ``flag``: a step handed over in shared memory, waited for
        there, spinning and then asleep (the host wakes the caller with a frame), in naps that
        look at it again (see :mod:`asyncsample.backends._handoff`)."""
        if fds != self._polled:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            self._poller, self._polled = poller, fds
        poll = self._poller.poll
        wait = _DIRECT_WAIT
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - time.monotonic()))
        if flag is not None and flag.answered():  # in the buffers, or its frame is sent
            return [] if flag.quiet() else poll(wait * 1000) or None
        if self._caller_spin:
            # The hosts have CPUs of their own (placement.spins): poll before sleeping, while
            # the machine is not busy (see BoundedSpin).
            spin = self._spin
            if spin is None:
                spin = self._spin = BoundedSpin(cpus())
            if spin.allowed():
                if flag is not None:
                    if spin.poll(flag.answered, self._caller_spin):
                        return []
                else:
                    ready = spin.poll(poll, self._caller_spin)
                    if ready:
                        return ready
        if flag is not None:
            return self._nap(flag, poll, wait)
        return poll(wait * 1000) or None

    @staticmethod
    def _nap(
        flag: Handoff, poll: Callable[[float], list[tuple[int, int]]], wait: float
    ) -> list[tuple[int, int]] | None:
        """Sleep until ``flag`` is answered (``[]``), a frame comes (what ``poll`` found) or
        ``wait`` seconds passed (``None``), looking at ``flag`` every ``NAP`` seconds."""
        end = time.monotonic() + wait
        flag.waiting(True)
        try:
            while not flag.answered():
                left = end - time.monotonic()
                if left <= 0:
                    return None
                ready = poll(min(left, NAP) * 1000)
                if ready:
                    return ready
            return []
        finally:
            flag.waiting(False)

    async def _collect(
        self, sent: list[SentStep], inline: list[StepInfos | BaseException]
    ) -> StepResult:
        """Finish, in the loop, a round whose first ``len(sent)`` requests went out without
        it and whose caller's hosts answered ``inline``: the other requests go out now."""
        outcomes = [await outcome(request.wait()) for request in sent]
        for h in range(len(sent), self._remote_hosts):
            outcomes.append(await outcome(self.hosts[h].step(self._whole[h])))
        return await self._merge(None, outcomes + inline)
