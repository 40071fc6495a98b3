"""Runs of steps without a task per env: :class:`RunStepper` drives ``obtain_fragments`` without
fixed shares where the hosts' agent copies act (``inference="host"``, async envs in env hosts).
Each env takes runs of steps in its host (:mod:`asyncsample._run_records`); each reply is applied
by a callback that asks for the env's next run, until the call's quota is in. Runs still in
flight then go on and open the next call's batch. The lanes (:mod:`asyncsample._env_tasks`)
drive every other call.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from asyncsample._env_tasks import LaneSettings, LaneStepper
from asyncsample._run_records import RUN_STEPS, put_run, within_quota
from asyncsample._tree import row_copy
from asyncsample.backends.base import RunHost, StepRun
from asyncsample.errors import WorkerError

if TYPE_CHECKING:
    from asyncsample._engine import Part, StopRule
    from asyncsample.worker import Worker

__all__ = ["RunStepper", "fits"]

#: The stepper of each host's current call (a reply is applied by the call in progress when it
#: comes, not by the one that asked for it: a run asked in one call often ends in the next).
_STEPPERS: weakref.WeakKeyDictionary[Any, RunStepper] = weakref.WeakKeyDictionary()


def _route(host: Any, i: int, future: asyncio.Future[Any]) -> None:
    """Hand env ``i``'s answered request to its host's current stepper (its error marked as
    seen: the sampler may close first); between calls it waits in ``in_flight``."""
    if future.cancelled():
        return
    future.exception()
    stepper = _STEPPERS.get(host)
    if stepper is not None and stepper.active and host.in_flight.get(i) is future:
        stepper.apply(i, future)


def fits(worker: Worker, part: Part) -> bool:
    """Whether :class:`RunStepper` drives ``worker``'s part: an ``obtain_fragments`` call without
    fixed shares, plain array rows, no episode deadline, a host that runs steps."""
    host = worker.host
    buffers = getattr(host, "buffers", None)
    return (
        part.pool is not None
        and part.quota is None
        and part.lane_round is None
        and hasattr(host, "run_soon")
        and type(getattr(buffers, "obs", None)) is np.ndarray
        and type(getattr(buffers, "actions", None)) is np.ndarray
        and worker.episodes.episode_timeout is None
    )


class RunStepper:
    """Drives one worker's part of an ``obtain_fragments`` call without fixed shares on runs of
    steps (see the module docstring; :func:`fits` says where).

    Every env has at most one request in flight (a reset, a run or a rebuild), kept in the
    host's ``in_flight`` between calls; a reply that comes between calls waits there for the
    next call to apply it (or to drop it: any other call, or an update of the envs).
    """

    def __init__(self, worker: Worker, part: Part, settings: LaneSettings) -> None:
        # The lanes' bookkeeping (start, drops, rebuilds, episode ends) serves runs unchanged.
        self.lanes = LaneStepper(worker, None, part, settings)
        self.worker = worker
        self.host = cast(RunHost, worker.host)
        self.pool = part.pool
        assert self.pool is not None
        buffers = self.host.buffers
        self.like = (buffers.obs, buffers.actions)
        self.active = False
        self.stop: asyncio.Future[None] | None = None
        self.start_obs: dict[int, np.ndarray] = {}  # each run's first observation
        self.rebuilding: set[asyncio.Task[None]] = set()
        self.rebuilt: set[int] = set()  # the envs being rebuilt (asked again when done)

    async def start(self) -> None:
        """See :meth:`LaneStepper.start`."""
        await self.lanes.start()

    async def advance(self, rule: StopRule, lacking: int | None = None) -> int:
        """Step until the call's quota is in (a call without fixed shares has no other rule)."""
        await self.run(rule)
        return 1

    async def run(self, rule: StopRule, lacking: int | None = None) -> None:
        """Apply what came between calls, ask every idle env for a run, and wait for the quota."""
        pool = self.pool
        assert pool is not None
        steps = rule.start_envs(self.worker.n_envs, lacking)
        in_flight = self.host.in_flight
        self.active = True
        _STEPPERS[self.host] = self
        try:
            while not pool.met:  # (again if a drop after the quota was in reopened it)
                self.stop = stop = asyncio.get_running_loop().create_future()
                pool.join(stop)
                for i in range(self.worker.n_envs):
                    future = in_flight.get(i)
                    if future is None:
                        if i not in self.rebuilt:
                            self._next(i)
                    elif future.done():
                        self.apply(i, future)
                await stop
        finally:
            self.active = False
            if _STEPPERS.get(self.host) is self:
                del _STEPPERS[self.host]
            for task in self.rebuilding:
                task.cancel()
            if self.rebuilding:
                await asyncio.wait(self.rebuilding)
            cut = self.worker.episodes.cut_obs
            for i in in_flight:
                if i in self.start_obs:  # a run not recorded: the fragment ends where it began
                    cut[i] = self.start_obs[i]
            if self.stop is not None and not self.stop.done():
                self.stop.cancel()
        rule.took(steps)

    # -- per env ----------------------------------------------------------------------------------

    def _next(self, i: int) -> None:
        """Ask env ``i`` for its next reset or run, unless the quota is in."""
        pool = self.pool
        assert pool is not None
        if pool.met or not self.active:
            return
        host, worker = self.host, self.worker
        future: asyncio.Future[Any]
        try:
            if worker.episodes.needs_reset[i]:
                future = host.reset_soon(i)
            else:
                self.start_obs[i] = row_copy(host.buffers.obs, i)
                steps = pool.run_steps(RUN_STEPS)
                future = host.run_soon(i, steps, worker.agent_version, False)
        except WorkerError as exc:  # its host is dead: this env's failure
            self._failed(i, exc)
            return
        host.in_flight[i] = future
        future.add_done_callback(functools.partial(_route, host, i))

    def apply(self, i: int, future: asyncio.Future[Any]) -> None:
        """Apply env ``i``'s answered request (taken out of ``in_flight``) and ask for the next."""
        del self.host.in_flight[i]
        self.start_obs.pop(i, None)
        exc = future.exception()
        if exc is not None:
            if isinstance(exc, WorkerError) and exc.retry:
                self._failed(i, exc)
            else:  # the env may be mid-episode: reset before it is used again
                self.worker.episodes.needs_reset[i] = True
                self._fail(exc)
            return
        value = future.result()
        if type(value) is StepRun:
            self._record(i, value)
        else:  # a reset's info
            self._started(i, value)
        self._next(i)

    def _started(self, i: int, info: dict[str, Any]) -> None:
        episodes, version = self.worker.episodes, self.worker.agent_version
        one = np.zeros(self.worker.n_envs, dtype=bool)
        one[i] = True
        episodes.started(one, {i: info} if info else {})
        episodes.episode_info[i] = episodes.fresh_info(episodes.episode_info[i], i, version)

    def _record(self, i: int, run: StepRun) -> None:
        """Record env ``i``'s run: past the quota, its rest opens the next call."""
        pool = self.pool
        assert pool is not None
        episodes = self.worker.episodes
        cursor = episodes.recorder.cursor
        assert cursor is not None
        run, _ = within_quota(run, pool, self.host, episodes, i)
        t = int(cursor[i])
        n = put_run(episodes.recorder.rows, t, i, run, self.like)
        ret = float(episodes.returns[i])
        for reward in run.rewards:  # the per-step float sums
            ret += reward
        cursor[i] = t + n
        episodes.lengths[i] += n
        episodes.returns[i] = ret
        if run.terminated or run.truncated:
            self.lanes.end_episode(i, t + n - 1)
        pool.add(self.worker.worker_number, n)

    def _failed(self, i: int, failure: WorkerError) -> None:
        """Env ``i`` failed: its episode is dropped, the env rebuilt alone, then asked again."""
        self.lanes.drop_episode(i)
        pool = self.pool
        assert pool is not None
        pool.set(self.worker.worker_number, self.worker.episodes.count(True))
        task = asyncio.ensure_future(self._rebuild(i, failure))
        self.rebuilding.add(task)
        self.rebuilt.add(i)
        task.add_done_callback(self.rebuilding.discard)

    async def _rebuild(self, i: int, failure: WorkerError) -> None:
        try:
            await self.lanes.rebuild_env(i, failure)
        except asyncio.CancelledError:
            self.worker.episodes.needs_reset[i] = True
            raise
        except BaseException as exc:
            self._fail(exc)
            return
        finally:
            self.rebuilt.discard(i)
        self._next(i)

    def _fail(self, exc: BaseException) -> None:
        """The call fails with ``exc`` (an agent's error, or past ``max_restarts``)."""
        stop = self.stop
        if stop is not None and not stop.done():
            stop.set_exception(exc)
