"""Runs of steps without a task per env: :class:`RunStepper` drives ``obtain_fragments`` without
fixed shares where the hosts' agent copies act (``inference="host"``, async envs in env hosts).
Each env takes runs of steps in its host (:mod:`asyncsample._run_records`). While a call is in
progress the stepper is its hosts' sink (:class:`~asyncsample.backends._lane_link.RunSink`):
each reply frame's runs are recorded in one vectorised pass over the frame's columns, and their
envs asked for their next runs, until the call's quota is in; no future, task or callback per
run. Runs still in flight then go on and open the next call's batch. The lanes
(:mod:`asyncsample._env_tasks`) drive every other call.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from asyncsample._env_tasks import LaneSettings, LaneStepper
from asyncsample._run_records import RUN_STEPS, put_infos, put_run, within_quota
from asyncsample._tree import row_copy
from asyncsample.backends.base import StepRun
from asyncsample.errors import WorkerError

if TYPE_CHECKING:
    from asyncsample._engine import Part, StopRule
    from asyncsample.backends._column_wire import RunColumns
    from asyncsample.backends._lane_link import RemoteLanes
    from asyncsample.worker import Worker

__all__ = ["RunStepper", "fits"]

#: The fewest runs of one worker a reply frame records in one vectorised pass
#: (:meth:`RunStepper._record_runs`); fewer go one by one, which costs less for so few (about
#: 45 against 75 us for 7 runs of 9 steps, measured alone).
VECTOR_RUNS = 12

#: The one context of :func:`_seen`: a callback's own copy is one more object per run.
_CONTEXT = contextvars.Context()


def _seen(future: asyncio.Future[Any]) -> None:
    """Mark a request's error as retrieved: its reply may come after the sampler closed, when
    no call applies it."""
    if not future.cancelled():
        future.exception()


def fits(worker: Worker, part: Part) -> bool:
    """Whether :class:`RunStepper` drives ``worker``'s part: an ``obtain_fragments`` call without
    fixed shares, plain array rows, no episode deadline, a host that runs steps."""
    host = worker.host
    buffers = getattr(host, "buffers", None)
    return (
        part.pool is not None
        and part.quota is None
        and part.lane_round is None
        and hasattr(host, "settle_runs")
        and type(getattr(buffers, "obs", None)) is np.ndarray
        and type(getattr(buffers, "actions", None)) is np.ndarray
        and worker.episodes.episode_timeout is None
    )


class RunStepper:
    """Drives one worker's part of an ``obtain_fragments`` call without fixed shares on runs of
    steps (see the module docstring; :func:`fits` says where).

    Every env has at most one request in flight (a reset, a run or a rebuild), kept in the
    host's ``in_flight``. While :meth:`run` is in progress the stepper is the host's sink: it
    takes each reply as it comes (a reply is applied by the call in progress when it comes, not
    by the one that asked for it: a run asked in one call often ends in the next). A reply that
    comes between calls settles its future in ``in_flight``, for the next call to apply it (or
    to drop it: any other call, or an update of the envs).
    """

    def __init__(self, worker: Worker, part: Part, settings: LaneSettings) -> None:
        # The lanes' bookkeeping (start, drops, rebuilds, episode ends) serves runs unchanged.
        self.lanes = LaneStepper(worker, None, part, settings)
        self.worker = worker
        self.host = cast("RemoteLanes", worker.host)
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
        self.host.sink = self
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
            if self.host.sink is self:
                self.host.sink = None
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
        host, worker = self.host, self.worker
        if pool.met or not self.active or i in host.in_flight:
            return
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
        in_flight: dict[int, Any] = host.in_flight
        in_flight[i] = future
        future.add_done_callback(_seen, context=_CONTEXT)
        if future.done():  # (its host died before: settled at once)
            self.apply(i, future)

    def apply(self, i: int, future: asyncio.Future[Any]) -> None:
        """Apply env ``i``'s answered request in ``in_flight`` (see :meth:`take`)."""
        self.take(i, future.exception() or future.result())

    def take(self, i: int, outcome: Any) -> None:
        """Apply the outcome of env ``i``'s request (taken out of ``in_flight``): a run, a
        reset's info or an error; then ask for its next (the host's sink, see
        :class:`~asyncsample.backends._lane_link.RunSink`)."""
        del self.host.in_flight[i]
        self.start_obs.pop(i, None)
        if isinstance(outcome, BaseException):
            if isinstance(outcome, WorkerError) and outcome.retry:
                self._failed(i, outcome)
            else:  # the env may be mid-episode: reset before it is used again
                self.worker.episodes.needs_reset[i] = True
                self._fail(outcome)
            return
        if type(outcome) is StepRun:
            self._record(i, outcome)
        else:  # a reset's info
            self._started(i, outcome)
        self._next(i)

    def take_runs(
        self, runs: RunColumns, rs: np.ndarray, envs: np.ndarray, versions: np.ndarray
    ) -> None:
        """Record runs ``rs`` of ``runs``, envs ``envs``' (asked under ``versions``): those
        within the quota's room in one pass (:meth:`_record_runs`), the one that crosses it and
        any after one by one (:meth:`_record`); then ask each env for its next."""
        in_flight, start_obs = self.host.in_flight, self.start_obs
        ids = envs.tolist()
        for i in ids:
            del in_flight[i]
            start_obs.pop(i, None)
        pool = self.pool
        assert pool is not None
        lengths = runs.lengths[rs]
        fit = int(np.searchsorted(np.cumsum(lengths), pool.room(), side="right"))
        if fit < VECTOR_RUNS:  # a pass's fixed cost is more than that of a few runs one by one
            fit = 0
        else:
            self._record_runs(runs, rs[:fit], envs[:fit], versions[:fit], lengths[:fit])
        for r, i, version in zip(rs[fit:].tolist(), ids[fit:], versions[fit:].tolist()):
            run = runs.run(r)
            run.version = version
            self._record(i, run)
        for i in ids:
            self._next(i)

    def _record_runs(
        self,
        runs: RunColumns,
        rs: np.ndarray,
        envs: np.ndarray,
        versions: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        """Record whole runs (within the quota's room), every column in one pass: each step's
        row is its env's cursor plus its place in its run."""
        episodes = self.worker.episodes
        rows, cursor = episodes.recorder.rows, episodes.recorder.cursor
        assert cursor is not None
        t = cursor[envs]
        ends = t + lengths
        top = int(ends.max())
        if top > rows.size:
            rows.cover(top - 1, *self.like)
        total = int(lengths.sum())
        step = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        src = np.repeat(runs.starts[rs], lengths) + step
        at, env = np.repeat(t, lengths) + step, np.repeat(envs, lengths)
        rows.obs[at, env] = runs.obs[src]
        rows.actions[at, env] = runs.actions[src]
        rewards = runs.rewards[src]
        rows.rewards[at, env] = rewards
        rows.versions[at, env] = np.repeat(versions, lengths)
        if runs.infos or runs.agent_infos or rows.agent_infos:
            for r, i, start, n in zip(rs.tolist(), envs.tolist(), t.tolist(), lengths.tolist()):
                put_infos(rows, start, i, n, runs.infos.get(r, ()), runs.agent_infos.get(r, ()))
        # Returns summed step by step from the episode's so far, as a lone run's are: a row per
        # run, its return then its rewards (zeros past its end), summed along by cumsum, which
        # adds in order (the same floats on every path).
        by_step = np.zeros((len(rs), int(lengths.max()) + 1))
        by_step[:, 0] = episodes.returns[envs]
        by_step[np.repeat(np.arange(len(rs)), lengths), step + 1] = rewards
        episodes.returns[envs] = by_step.cumsum(axis=1)[:, -1]
        episodes.lengths[envs] += lengths
        cursor[envs] = ends
        ended = runs.terminated[rs] | runs.truncated[rs]
        for i, end in zip(envs[ended].tolist(), ends[ended].tolist()):
            self.lanes.end_episode(i, end - 1)
        self.pool.add(self.worker.worker_number, total)  # type: ignore[union-attr]

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
