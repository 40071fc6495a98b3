"""The remote-host state machine of ``backends/_remote.py``, against a fake host.

The ``process`` and ``ray`` backends share it: an :class:`Incarnation` (one life of a host: its
unanswered calls in order, ``step_timeout`` on the head call only, everyone failed when it dies)
and a :class:`PoolMember` (one place in the pool, replaced once when its incarnation died). Here
the host is a fake that records requests and answers them when the test says so, and the clock is
a fake too: a timeout falls due when the test fires it, so nothing depends on how fast the
machine is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import pytest

from asyncsample.backends._remote import Incarnation, PendingCall, PoolMember, RemoteHost
from asyncsample.backends._transport import Op
from asyncsample.backends.base import HostSpec
from asyncsample.errors import SamplerClosedError, StepTimeoutError, WorkerCrashedError

SPACE = gym.spaces.Discrete(2)


class FakeTimer:
    """What ``loop.call_later`` returned: fired by the test, or cancelled by the code."""

    def __init__(self, delay: float, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.delay, self.fn, self.args = delay, fn, args
        self.cancelled = False
        self.fired = False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        assert not self.cancelled, "a cancelled timer fell due"
        self.fired = True
        self.fn(*self.args)


class FakeClock:
    """The loop as an incarnation sees it: real futures, timers the test fires by hand."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.timers: list[FakeTimer] = []

    def create_future(self) -> asyncio.Future[Any]:
        return self.loop.create_future()

    def call_later(self, delay: float, fn: Callable[..., None], *args: Any) -> FakeTimer:
        timer = FakeTimer(delay, fn, args)
        self.timers.append(timer)
        return timer

    @property
    def armed(self) -> list[FakeTimer]:
        """The timers neither fired nor cancelled."""
        return [t for t in self.timers if not t.cancelled and not t.fired]


class FakeIncarnation(Incarnation):
    """A host that answers only when told to."""

    def __init__(self, clock: FakeClock, number: int) -> None:
        super().__init__(clock)  # type: ignore[arg-type]
        self.number = number
        self.kills = 0

    def describe(self) -> str:
        return f"fake host {self.number}"

    def _kill(self) -> None:
        self.kills += 1

    def reply(self, call: PendingCall, payload: Any = b"") -> None:
        """The host answers ``call`` (as a backend's read callback would)."""
        call.future.set_result(payload)
        self.answered(call)

    def labels(self) -> list[tuple[str, int]]:
        """What the host has not answered yet, in order: (label, worker)."""
        return [(c.label, c.worker) for c in self.calls]


class FakeMember(PoolMember[FakeIncarnation]):
    """A member whose incarnations are fakes; ``gate`` holds a spawn until the test opens it."""

    def __init__(self, clock: FakeClock, specs: list[HostSpec]) -> None:
        super().__init__(0, specs)
        self.clock = clock
        self.spawns = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def _spawn(self) -> FakeIncarnation:
        self.spawns += 1
        await self.gate.wait()
        new = FakeIncarnation(self.clock, self.spawns)
        self.incarnations.append(new)
        return new


class FakeHost(RemoteHost[FakeIncarnation]):
    """One worker's view of the fake member: each request is one pending call."""

    def _submit(self, incarnation: FakeIncarnation, op: Op, payload: tuple[Any, ...]) -> Any:
        call = incarnation.new_call(op.label, self.worker, self._timeout)
        call.key = payload
        return call

    def _unpack(self, reply: Any) -> Any:
        return reply


async def pool(
    n_workers: int, step_timeout: float | None = None
) -> tuple[FakeClock, FakeMember, list[FakeHost]]:
    """A started member hosting ``n_workers`` workers, and each worker's host."""
    clock = FakeClock()
    specs = [HostSpec(w, 1, SPACE, SPACE, None) for w in range(n_workers)]
    member = FakeMember(clock, specs)
    await member.live()
    hosts = [FakeHost(s, member, None, step_timeout) for s in specs]  # type: ignore[arg-type]
    return clock, member, hosts


async def one_call(
    step_timeout: float | None = None,
) -> tuple[FakeClock, FakeMember, FakeHost, FakeIncarnation, asyncio.Future[None]]:
    """A one-worker pool with one ``build`` sent and not answered yet."""
    clock, member, (host,) = await pool(1, step_timeout)
    inc = current(member)
    task = asyncio.ensure_future(host.build([[]], [0]))
    await sent(inc, 1)
    return clock, member, host, inc, task


def current(member: FakeMember) -> FakeIncarnation:
    assert member.current is not None
    return member.current


async def sent(inc: FakeIncarnation, n: int) -> None:
    """Let the loop run until ``n`` calls are pending on ``inc`` (each task sends at once)."""
    for _ in range(100):
        if len(inc.calls) >= n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(inc.calls)} calls were sent, not {n}")


# -- calls in order ------------------------------------------------------------------------------


async def test_calls_are_answered_in_the_order_they_were_sent() -> None:
    _, member, hosts = await pool(3)
    inc = current(member)
    tasks = [asyncio.ensure_future(h.build([[]], [w])) for w, h in enumerate(hosts)]
    await sent(inc, 3)
    assert inc.labels() == [("build", 0), ("build", 1), ("build", 2)]
    calls = list(inc.calls)
    inc.reply(calls[0])
    assert inc.labels() == [("build", 1), ("build", 2)]
    await tasks[0]
    assert not tasks[1].done() and not tasks[2].done()
    inc.reply(calls[1])
    inc.reply(calls[2])
    await asyncio.gather(*tasks)
    assert not inc.calls and not inc.dead


async def test_a_reply_behind_an_unanswered_head_waits_for_it() -> None:
    # A host answers in order, but the bookkeeping must not lose a reply that arrives early.
    _, member, hosts = await pool(2)
    inc = current(member)
    tasks = [asyncio.ensure_future(h.build([[]], [w])) for w, h in enumerate(hosts)]
    await sent(inc, 2)
    first, second = list(inc.calls)
    inc.reply(second)
    assert inc.labels() == [("build", 0), ("build", 1)]  # the head still runs
    inc.reply(first)
    assert not inc.calls
    await asyncio.gather(*tasks)


async def test_replies_reach_their_caller() -> None:
    _, member, (host,) = await pool(1)
    inc = current(member)
    task = asyncio.ensure_future(host._request(Op.CALL, "x"))
    await sent(inc, 1)
    (call,) = inc.calls
    assert call.key == ("x",)
    inc.reply(call, "result")
    assert await task == "result"


# -- a death fails every pending call ----------------------------------------------------------


async def test_a_death_fails_every_pending_call_of_every_worker() -> None:
    _, member, hosts = await pool(3)
    inc = current(member)
    tasks = [asyncio.ensure_future(h.build([[]], [w])) for w, h in enumerate(hosts)]
    await sent(inc, 3)
    inc.die("died of SIGKILL", cause=OSError("gone"))
    assert inc.dead and inc.kills == 1 and not inc.calls
    for w, task in enumerate(tasks):
        with pytest.raises(WorkerCrashedError, match="fake host 1 died of SIGKILL") as info:
            await task
        assert info.value.worker == w
        assert isinstance(info.value.__cause__, OSError)
    inc.die("again")  # idempotent: no second kill, the first reason stays
    assert inc.kills == 1 and inc.reason == "died of SIGKILL"


async def test_a_call_to_a_dead_host_fails_at_once() -> None:
    _, member, (host,) = await pool(1)
    inc = current(member)
    inc.die("died")
    with pytest.raises(WorkerCrashedError, match="died"):
        await host.build([[]], [0])
    assert not inc.calls


async def test_a_death_after_the_backend_closed_is_sampler_closed() -> None:
    _, member, host, inc, task = await one_call()
    member.closed = True
    inc.closing = True
    inc.die("was shut down")
    with pytest.raises(SamplerClosedError, match="worker 0 could not finish its build"):
        await task
    with pytest.raises(SamplerClosedError):  # and nothing new is sent
        await host.build([[]], [0])


# -- step_timeout: the head call only ----------------------------------------------------------


async def test_only_the_head_call_has_a_timer() -> None:
    clock, member, hosts = await pool(3, step_timeout=2.0)
    inc = current(member)
    tasks = [asyncio.ensure_future(h.build([[]], [w])) for w, h in enumerate(hosts)]
    await sent(inc, 3)
    assert [(t.delay, t.args[0].worker) for t in clock.armed] == [(2.0, 0)]
    head = inc.calls[0]
    inc.reply(head)
    # Time spent queued does not count: the next call's full timeout starts now.
    assert [(t.delay, t.args[0].worker) for t in clock.armed] == [(2.0, 1)]
    assert clock.timers[0].cancelled
    for call in list(inc.calls):
        inc.reply(call)
    assert clock.armed == []
    await asyncio.gather(*tasks)


async def test_the_head_call_timing_out_kills_the_host_and_fails_the_queue() -> None:
    clock, member, hosts = await pool(3, step_timeout=2.0)
    inc = current(member)
    tasks = [asyncio.ensure_future(h.build([[]], [w])) for w, h in enumerate(hosts)]
    await sent(inc, 3)
    (timer,) = clock.armed
    timer.fire()
    assert inc.dead and inc.kills == 1
    with pytest.raises(StepTimeoutError, match=r"build took longer than step_timeout=2s") as info:
        await tasks[0]
    assert info.value.worker == 0 and isinstance(info.value, TimeoutError)
    for w in (1, 2):  # queued behind it: they did not time out, their host died
        with pytest.raises(WorkerCrashedError, match="build of worker 0 took longer") as crash:
            await tasks[w]
        assert not isinstance(crash.value, StepTimeoutError) and crash.value.worker == w


async def test_a_timer_of_an_answered_call_does_nothing() -> None:
    clock, _, _, inc, task = await one_call(step_timeout=1.0)
    (timer,) = clock.armed
    inc.reply(inc.calls[0])
    await task
    timer.fn(*timer.args)  # a timer that fell due in the same loop turn as the reply
    assert not inc.dead


async def test_no_timer_without_step_timeout() -> None:
    clock, _, _, inc, task = await one_call()
    assert clock.timers == []
    inc.reply(inc.calls[0])
    await task


# -- replacement, once ------------------------------------------------------------------------


async def test_a_dead_member_is_replaced_once_for_all_its_workers() -> None:
    _, member, hosts = await pool(2)
    old = current(member)
    old.die("died")
    member.gate.clear()  # hold the new incarnation's start until both workers asked for it
    restarts = [asyncio.ensure_future(h.restart([[]], [w])) for w, h in enumerate(hosts)]
    for _ in range(10):
        await asyncio.sleep(0)
    assert member.spawns == 2  # the first start, and one replacement however many ask
    member.gate.set()
    while member.current is old or len(current(member).calls) < 2:
        await asyncio.sleep(0)
    new = current(member)
    assert new is not old and new.number == 2
    assert new.labels() == [("build", 0), ("build", 1)]  # each worker rebuilds its envs there
    for call in list(new.calls):
        new.reply(call)
    await asyncio.gather(*restarts)
    assert member.spawns == 2


async def test_a_live_member_is_not_replaced_by_a_restart() -> None:
    _, member, (host,) = await pool(1)
    inc = current(member)
    task = asyncio.ensure_future(host.restart([[]], [0]))  # an env raised: the host is fine
    await sent(inc, 1)
    inc.reply(inc.calls[0])
    await task
    assert member.current is inc and member.spawns == 1


async def test_no_replacement_once_the_backend_closed() -> None:
    _, member, (host,) = await pool(1)
    current(member).die("died")
    member.closed = True
    with pytest.raises(SamplerClosedError, match="restart its env host"):
        await host.restart([[]], [0])
    assert member.spawns == 1


async def test_a_replacement_started_while_closing_is_shut_down() -> None:
    _, member, (host,) = await pool(1)
    current(member).die("died")
    member.gate.clear()
    task = asyncio.ensure_future(host.restart([[]], [0]))
    while member.spawns < 2:
        await asyncio.sleep(0)
    member.closed = True  # the backend closes while the new incarnation starts
    member.gate.set()
    with pytest.raises(SamplerClosedError):
        await task
    late = member.incarnations[-1]
    assert late.dead and late.closing and late.kills == 1
