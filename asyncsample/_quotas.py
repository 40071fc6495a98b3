"""The quotas of a call that its workers share: :class:`SharedQuota` (``fraction_samples < 1``)
and the views each stepper kind takes of it (:class:`QuotaView`; the lanes' :class:`QuotaWatch`),
:class:`FreeQuota` (a call without fixed shares on envs stepped one at a time) and
:class:`LaneRound` (a stream round of complete episodes on the lanes)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Self

__all__ = ["FreeQuota", "LaneRound", "QuotaView", "QuotaWatch", "SharedQuota"]


class SharedQuota:
    """The quota of a call with ``fraction_samples < 1``: a worker may stop once it has its
    ``minimums`` entry and the call's total has reached ``target`` (``num_samples``)."""

    def __init__(self, target: int, minimums: Mapping[int, int]) -> None:
        self.target = target
        self.minimums = dict(minimums)
        self.counts = dict.fromkeys(self.minimums, 0)
        self.total = 0

    def report(self, worker: int, count: int) -> None:
        """Worker ``worker`` would now return ``count`` transitions (it may go down: restarts)."""
        self.total += count - self.counts[worker]
        self.counts[worker] = count

    def may_stop(self, worker: int) -> bool:
        """Whether ``worker`` has its minimum and the call's total has reached the target."""
        return self.counts[worker] >= self.minimums[worker] and self.total >= self.target

    def lacking(self, worker: int) -> int:
        """What ``worker``'s minimum or the call's total still lacks (at least 1)."""
        return max(self.minimums[worker] - self.counts[worker], self.target - self.total, 1)


class QuotaView:
    """How the workers of a call share its :class:`SharedQuota` (a subclass per stepper kind,
    one view per quota and kind: :meth:`of`); a report wakes the workers in :meth:`wait_while`."""

    _views: ClassVar[weakref.WeakKeyDictionary[SharedQuota, Any]] = weakref.WeakKeyDictionary()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._views = weakref.WeakKeyDictionary()

    def __init__(self, quota: SharedQuota) -> None:
        self.quota = quota
        self._waiters: list[asyncio.Future[None]] = []

    @classmethod
    def of(cls, quota: SharedQuota) -> Self:
        """The view of ``quota`` of this kind (made by the first worker that asks)."""
        view: Self | None = cls._views.get(quota)
        if view is None:
            view = cls._views[quota] = cls(quota)
        return view

    def report(self, worker: int, count: int) -> None:
        """Worker ``worker`` would now return ``count`` transitions; wake the waiting workers."""
        self.quota.report(worker, count)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait_while(self, worker: int, holds: Callable[[], bool]) -> None:
        """While the quota does not let ``worker`` stop and ``holds()``, wait for reports."""
        while not self.quota.may_stop(worker) and holds():
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter


class LaneRound:
    """One round of a stream of complete episodes on the lanes: no env stops stepping until
    each of the ``workers`` has its share; then their steps in flight go on into the next."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.done = workers == 0
        self._stops: list[asyncio.Future[None]] = []
        self._satisfied: set[int] = set()

    def join(self, stop: asyncio.Future[None]) -> None:
        """``stop`` is set when the round is done."""
        if self.done:
            stop.set_result(None)
        else:
            self._stops.append(stop)

    def satisfied(self, worker: int) -> None:
        """``worker`` has its share; the round is done once every worker has said so."""
        self._satisfied.add(worker)
        if not self.done and len(self._satisfied) >= self.workers:
            self.done = True
            for stop in self._stops:
                if not stop.done():
                    stop.set_result(None)


class FreeQuota:
    """The quota of an ``obtain_fragments`` call whose envs step one at a time without fixed
    shares (``Sampler(fixed_shares=False)``, the lanes): any env of any worker may fill it, and
    once ``target`` transitions are in every worker's ``stop`` is set, whatever steps are still
    in flight (they go on into the next call). A call never waits for the slowest env's tail.

    Counting is per worker, so a worker that drops recorded steps (an env's fault) sets its
    count again (:meth:`set`) instead of the call counting steps no batch will hold.
    """

    def __init__(self, target: int, envs: int = 1) -> None:
        self.target = target
        self.envs = envs  # every env of the call's workers
        self.total = 0
        self.met = False
        self._counts: dict[int, int] = {}
        self._stops: list[asyncio.Future[None]] = []

    def join(self, stop: asyncio.Future[None]) -> None:
        """``stop`` is set once the quota is met."""
        if self.met:
            stop.set_result(None)
        else:
            self._stops.append(stop)

    def add(self, worker: int, steps: int = 1) -> None:
        """``worker`` recorded ``steps`` more transitions (once per step of every lane: inline)."""
        counts = self._counts
        counts[worker] = counts.get(worker, 0) + steps
        self.total += steps
        if not self.met and self.total >= self.target:
            self._meet()

    def room(self) -> int:
        """How many transitions a run that comes in now may add to this call: what the quota
        lacks, at least one (one step per env past the quota, as a single step would)."""
        return max(1, self.target - self.total)

    def run_steps(self, most: int) -> int:
        """How many steps an env may take in one run (:meth:`ActingHost.run_soon`): its even
        part of the quota, between 1 and ``most`` (a run past the quota goes on into the next
        call)."""
        return max(1, min(most, -(-self.target // self.envs)))

    def set(self, worker: int, count: int) -> None:
        """``worker`` would now return ``count`` transitions (after a drop or a restart: its
        count, read again)."""
        self.total += count - self._counts.get(worker, 0)
        self._counts[worker] = count
        if not self.met and self.total >= self.target:
            self._meet()
        elif self.met and self.total < self.target:  # a drop after the quota was in
            self.met = False  # (its stops stay set: a worker still stepping fills it again)

    def _meet(self) -> None:
        self.met = True
        for stop in self._stops:
            if not stop.done():
                stop.set_result(None)
        self._stops = []


class QuotaWatch(QuotaView):
    """The lanes' view of a call's :class:`SharedQuota` (``fraction_samples``).

    The quota lets a worker stop once it has its minimum and the call's total reached the
    target; until then a worker past its minimum fills in. But every worker goes on to its own
    minimum anyway, so steps that fill in for minimums still owed are wasted: with
    ``fraction_samples=0.99`` (minimums that add up to the quota) each worker's envs raced past
    their minimum while another worker was short of its own, and the call returned 213-215
    transitions for 200 where one step per env in flight allows 212. A lane therefore stops
    once its worker has its minimum and the total *plus the minimums still owed* reaches the
    target (:meth:`covered`), and the worker then waits (:meth:`wait`) for the others to deliver
    what they owe, woken by every report (:meth:`report`). Counts are reported after every step
    of a fragment call, so no lane decides on another worker's stale count.
    """

    def report(self, worker: int, count: int) -> None:
        """As :meth:`QuotaView.report`, for a count that changed."""
        if self.quota.counts[worker] != count:
            super().report(worker, count)

    def covered(self, worker: int) -> bool:
        """Whether ``worker`` may stop: it has its minimum and the total, counting what every
        other worker still owes of its minimum, reaches the target."""
        quota = self.quota
        counts, minimums = quota.counts, quota.minimums
        if counts[worker] < minimums[worker]:
            return False
        if quota.total >= quota.target:
            return True
        owed = 0
        for other, minimum in minimums.items():
            if counts[other] < minimum:
                owed += minimum - counts[other]
        return quota.total + owed >= quota.target

    async def wait(self, worker: int) -> None:
        """While ``worker`` is covered but the quota does not yet let it stop, wait for the other
        workers' reports."""
        await self.wait_while(worker, lambda: self.covered(worker))
