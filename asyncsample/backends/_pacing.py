"""A window of env calls in flight that keeps the caller's event loop on time.

Thousands of async envs in the caller's loop (``backend="asyncio"``, ``"thread"``) can keep
more callbacks ready than the loop runs in a few milliseconds. Every wake-up then waits behind
all of them, and so does every other task of that loop (a web service's handlers, a trainer's
timers): 10,000 envs of 50 ms steps lagged it 350 ms at p99 (the seam study at d166de5).

A :class:`CallWindow` lets at most ``size`` env calls run at once (``max_concurrency``). With a
``lag`` target (``backend_options={"loop_lag": seconds}``, e.g. :data:`LOOP_LAG`) it also
fires a timer of its own every :data:`PERIOD` seconds while calls run, and looks how late it
came: when most recent looks were late the loop is behind, and the window shrinks to a share of
the calls running; while calls wait and the looks are on time, it grows. The loop then holds
about ``lag`` seconds of ready work and the other calls wait outside its ready queue (Little's
law: the envs' throughput is the loop's as long as the window covers the loop's rate times a
step's latency). What no window moves: the cyclic collector's full pauses, and the burst of
steps that ended during one; after a shrink the window holds its size at least as long as the
loop was behind, so one such burst shrinks it once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Sequence

__all__ = [
    "GROW",
    "HOLD",
    "LATE_LOOKS",
    "LOOKS",
    "LOOP_LAG",
    "ON_TIME_LOOKS",
    "PERIOD",
    "SHRINK",
    "START",
    "START_GROW",
    "CallWindow",
    "shares",
]

#: A loop lag (seconds) for ``backend_options["loop_lag"]``: a loop shared with a service.
LOOP_LAG = 0.002
#: How often a window with a lag target looks at the loop's lag (seconds), while calls run.
PERIOD = 0.005
#: A late look leaves the window at this share of the calls running then.
SHRINK = 0.9
#: An on-time look while calls wait grows the window by this share of it (one call at least).
GROW = 0.01
#: A window with a lag target starts at this size, and grows by :data:`START_GROW` a look
#: until it first shrinks: thousands of envs' first steps at once would lag the loop first.
START = 64.0
START_GROW = 0.1
#: A window shrinks when this many of the last :data:`LOOKS` looks were late: the loop is
#: behind, not just past one burst (a collector's pause, the burst of steps after it, a call's
#: end), which the window cannot move and would only lose throughput for.
LATE_LOOKS = 4
#: It grows (while calls wait) only when at most this many of them were late.
ON_TIME_LOOKS = 1
LOOKS = 8
LOOKS_MASK = (1 << LOOKS) - 1
#: After a shrink, the window keeps its size this long however late the loop is (seconds), or as
#: long as the late look was behind if that is longer: the calls running then end, and the
#: loop's ready work shows the new size (a burst of 200 ms of steps shrinks it once, not four
#: times).
HOLD = 0.05

_perf = time.perf_counter


class CallWindow:
    """At most ``size`` env calls in flight; ``size`` follows the loop's lag (see the module).

    Args:
        cap: the most calls at once, ever (``max_concurrency``); ``None``: no fixed cap.
        lag: the loop lag (seconds) to keep to; ``None``: the window stays at ``cap``.

    A call takes a place with :meth:`enter_now` (no await: the hot path) or, when that says no,
    awaits :meth:`enter`; it gives the place back with :meth:`leave`. Waiters enter in order.
    """

    def __init__(self, cap: int | None, lag: float | None) -> None:
        self.cap: float = math.inf if cap is None else float(cap)
        self.size: float = self.cap if lag is None else min(self.cap, START)
        """The calls allowed at once now."""
        self.lag = lag
        self.running = 0
        """The calls holding a place."""
        self.shrinks = 0
        """How often a late look shrank the window."""
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._due = 0.0
        self._held = 0.0  # until when the last shrink holds
        self._late = 0  # a bit per recent look: 1 if it was late
        self._timer: asyncio.TimerHandle | None = None

    @property
    def waiting(self) -> int:
        """The calls waiting for a place."""
        return sum(1 for fut in self._waiters if not fut.done())

    def enter_now(self) -> bool:
        """Take a place if one is free and nobody waits; ``False``: await :meth:`enter`."""
        if self.running < self.size and not self._waiters:
            self.running += 1
            if self._timer is None and self.lag is not None:
                self._look_soon()
            return True
        return False

    async def enter(self) -> None:
        """Wait for a place, in turn (a cancelled wait holds none)."""
        if self.enter_now():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._wake()  # past the cancelled waiters ahead: the place is taken now if free
        if self._timer is None and self.lag is not None:
            self._look_soon()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # the place came with the cancellation
                self.leave()
            raise

    def leave(self) -> None:
        """Give a place back (the next waiter takes it, if the window has room)."""
        self.running -= 1
        if self._waiters:
            self._wake()

    def close(self) -> None:
        """Stop looking at the loop (the backend closes)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters and self.running < self.size:
            fut = waiters.popleft()
            if not fut.done():
                self.running += 1
                fut.set_result(None)

    def _look_soon(self) -> None:
        self._due = _perf() + PERIOD
        self._timer = asyncio.get_running_loop().call_later(PERIOD, self._look)

    def _look(self) -> None:
        """The timer fired: shrink the window if it came late, else grow it if calls wait."""
        self._timer = None
        assert self.lag is not None
        now = _perf()
        behind_by = now - self._due
        late = behind_by > self.lag
        self._late = ((self._late << 1) | late) & LOOKS_MASK
        behind = self._late.bit_count()
        if behind >= LATE_LOOKS:
            if now >= self._held:
                self.size = max(1.0, min(self.size, self.running) * SHRINK)
                self.shrinks += 1
                self._held = now + max(HOLD, behind_by)
        elif behind <= ON_TIME_LOOKS and self._waiters:
            grow = GROW if self.shrinks else START_GROW  # a start, doubling until a first shrink
            self.size = min(self.cap, self.size + max(1.0, self.size * grow))
            self._wake()
        if self.running or self._waiters:
            self._look_soon()


def shares(total: int | None, sizes: Sequence[int]) -> list[int | None]:
    """Split a cap of ``total`` env calls in flight over hosts of ``sizes`` envs: in proportion,
    adding up to ``total`` (each at least one)."""
    if total is None:
        return [None] * len(sizes)
    if total < len(sizes):
        raise ValueError(
            f"max_concurrency must be at least the number of env hosts ({len(sizes)}) for async "
            f"envs on env hosts (each host gets a share), got {total}"
        )
    n = sum(sizes)
    out = [max(1, total * s // n) for s in sizes]
    for k in range(total - sum(out)):  # the rest, one each, to the largest hosts first
        out[sorted(range(len(sizes)), key=lambda j: -sizes[j])[k % len(sizes)]] += 1
    return out  # type: ignore[return-value]
