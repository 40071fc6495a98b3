"""Ready batches without a task per env: :class:`RunStepper` drives ``obtain_fragments`` without
fixed shares on async envs in env hosts. While a call is in progress the stepper is its hosts'
sink (:class:`~asyncsample.backends._lane_link.RunSink`), with no task, coroutine or callback per
env step:

- where the hosts' agent copies act (``inference="host"``), each env takes runs of steps in its
  host (:mod:`asyncsample._run_records`); each reply frame's runs are recorded in one vectorised
  pass over the frame's columns, and their envs asked for their next runs;
- where the agent acts in the caller (``per_worker``, ``batched``), each reply records its step,
  and the envs ready in one pass of the event loop get their actions from one agent request
  (:meth:`~asyncsample._batcher.Batcher.ask_rows`, merged per agent with the other
  workers' ready rows) and go to their hosts as one frame.

Until the call's quota is in; steps still in flight then go on and open the next call's batch.
The lanes (:mod:`asyncsample._env_tasks`) drive every other call.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, cast

import numpy as np

from asyncsample._action_check import row_value
from asyncsample._env_tasks import LaneSettings, LaneStepper
from asyncsample._passes import pass_queue
from asyncsample._recorder import store_agent_infos
from asyncsample._run_records import RUN_STEPS, put_infos, put_run, within_quota
from asyncsample._tree import row_copy
from asyncsample.backends._lane_link import answered, watch_error
from asyncsample.backends.base import StepRun
from asyncsample.errors import WorkerError

if TYPE_CHECKING:
    from asyncsample._batcher import Batcher, RowsDelivery
    from asyncsample._engine import Part, StopRule
    from asyncsample.backends._column_wire import RunColumns
    from asyncsample.backends._lane_link import RemoteLanes
    from asyncsample.worker import Worker

__all__ = ["RunStepper", "fits"]

#: The fewest runs of one worker a reply frame records in one vectorised pass
#: (:meth:`RunStepper._record_runs`); fewer go one by one, which costs less for so few (about
#: 45 against 75 us for 7 runs of 9 steps, measured alone).
VECTOR_RUNS = 12


_P = ParamSpec("_P")


def _fails_the_call(
    method: Callable[Concatenate[RunStepper, _P], None],
) -> Callable[Concatenate[RunStepper, _P], None]:
    """``method`` of a stepper, run by the loop (a reply, a pass's queue, an agent's delivery):
    an error it raises fails the stepper's call instead of only reaching the loop's exception
    handler, which would leave the call waiting for a quota that no longer comes."""

    def guarded(self: RunStepper, /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            method(self, *args, **kwargs)
        except Exception as exc:
            self._fail(exc)

    functools.update_wrapper(guarded, method)
    return guarded


def fits(worker: Worker, part: Part) -> bool:
    """Whether :class:`RunStepper` drives ``worker``'s part: an ``obtain_fragments`` call (or a
    fragment stream's round: no admission there) without fixed shares, plain array rows, no
    episode deadline, a host that answers in frames."""
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
    """Drives one worker's part of an ``obtain_fragments`` call without fixed shares on ready
    batches: runs of steps of the hosts' agent copies, or single steps of the caller's agent
    (``requests``) (see the module docstring; :func:`fits` says where).

    Every env has at most one request in flight (a reset, a run, a step or a rebuild), kept in
    the host's ``in_flight`` (a step as a :data:`SinkStep` while a sink takes its reply).
    While :meth:`run` is in progress the stepper is the host's sink: it takes each reply as it
    comes (a reply is applied by the call in progress when it comes, not by the one that asked
    for it: a run asked in one call often ends in the next). A reply that comes between calls
    settles its future in ``in_flight``, for the next call to apply it (or to drop it: any other
    call, or an update of the envs).
    """

    def __init__(
        self, worker: Worker, part: Part, settings: LaneSettings, requests: Batcher | None = None
    ) -> None:
        # The lanes' bookkeeping (start, drops, rebuilds, episode ends) serves runs unchanged.
        self.lanes = LaneStepper(worker, requests, part, settings)
        self.requests = requests
        """The merger of agent requests where the agent acts in the caller, else ``None``."""
        self.worker = worker
        self.host = cast("RemoteLanes", worker.host)
        self.pool = part.pool
        assert self.pool is not None
        buffers = self.host.buffers
        self.like = (buffers.obs, buffers.actions)
        self.active = False
        self.stop: asyncio.Future[None] | None = None
        # Each run's first observation; None for a step of the caller's agent, which began at
        # the row its request recorded (its env's cursor).
        self.start_obs: dict[int, np.ndarray | None] = {}
        self.rebuilding: set[asyncio.Task[None]] = set()
        self.rebuilt: set[int] = set()  # the envs being rebuilt (asked again when done)
        # Agent in the caller: the envs ready for actions, asked for at the end of this pass.
        self.ready: list[int] = []
        self.asking: set[int] = set()  # ready or asked, with no request in the host
        self.deliveries: list[RowsDelivery] = []  # the agent requests not answered yet

    async def start(self) -> None:
        """See :meth:`LaneStepper.start` (steps left in flight stay :data:`SinkStep` s: this
        call's sink takes their replies)."""
        await self.lanes.start(own=False)

    async def advance(self, rule: StopRule, lacking: int | None = None) -> int:
        """Step until the call's quota is in (a call without fixed shares has no other rule)."""
        await self.run(rule)
        return 1

    async def run(self, rule: StopRule, lacking: int | None = None) -> None:
        """Apply what came between calls, ask every idle env for a run, and wait for the quota."""
        pool = self.pool
        assert pool is not None
        steps = rule.start_envs(self.worker.n_envs, lacking)
        self.active = True
        self.host.sink = self
        try:
            queue = pass_queue(asyncio.get_running_loop())
            while not pool.met:  # (again if a drop after the quota was in reopened it)
                self.stop = stop = asyncio.get_running_loop().create_future()
                pool.join(stop)
                queue.put(self._begin)  # every worker starts at once: in bounded passes
                await stop
        finally:
            self.active = False
            if self.host.sink is self:
                self.host.sink = None
            for task in self.rebuilding:
                task.cancel()
            if self.rebuilding:
                await asyncio.wait(self.rebuilding)
            # The rest in the loop's bounded passes: every worker's call ends at once.
            ended = asyncio.get_running_loop().create_future()
            pass_queue(asyncio.get_running_loop()).put(self._end, ended)
            try:
                await ended
            except asyncio.CancelledError:
                self._end(ended)  # now, if its turn has not come
                raise
        rule.took(steps)

    def _end(self, ended: asyncio.Future[None]) -> None:
        """End the call (once: ``ended`` is set): forget the agent requests not answered yet,
        end the fragments of the envs with a step in flight where it began, and copy the rows
        of those steps for the next call (in one pass)."""
        if ended.done():
            return
        try:
            for delivery in self.deliveries:  # their envs are asked again by the next call
                delivery.cancel()
            self.deliveries.clear()
            self.ready.clear()
            self.asking.clear()
            episodes = self.worker.episodes
            starts = [i for i in self.host.in_flight if i in self.start_obs]
            rows, cursor = episodes.recorder.rows, episodes.recorder.cursor
            assert cursor is not None
            for i in starts:  # not recorded: the fragment ends where it began
                start = self.start_obs[i]
                episodes.cut_obs[i] = row_copy(rows.obs[cursor[i]], i) if start is None else start
            if starts and self.requests is not None:  # steps: the next call records their rows
                envs = np.array(starts, dtype=np.int64)
                episodes.carried_rows.keep(rows, cursor[envs], envs)
            if self.stop is not None and not self.stop.done():
                self.stop.cancel()
        except BaseException as exc:
            ended.set_exception(exc)
        else:
            ended.set_result(None)

    @_fails_the_call
    def _begin(self) -> None:
        """Apply what came since the last call (the steps together), ask every idle env."""
        if not self.active:
            return
        in_flight = self.host.in_flight
        steps: list[tuple[int, Any]] = []
        for i in range(self.worker.n_envs):
            future = in_flight.get(i)
            if future is None:
                if i not in self.rebuilt:
                    self._next(i)
            elif not answered(future):
                continue
            elif (
                not future.cancelled()
                and future.exception() is None
                and type(future.result()) is tuple
            ):
                steps.append((i, future.result()))  # recorded together, below
            else:
                self.apply(i, future)
        if steps:  # steps answered between calls: one pass
            self._take_outcomes(steps)

    # -- per env ----------------------------------------------------------------------------------

    def _next(self, i: int) -> None:
        """Ask env ``i`` for its next reset or run, unless the quota is in."""
        pool = self.pool
        assert pool is not None
        host, worker = self.host, self.worker
        if pool.met or not self.active or i in host.in_flight or i in self.asking:
            return
        future: asyncio.Future[Any]
        try:
            if worker.episodes.needs_reset[i]:
                future = host.reset_soon(i)
            elif self.requests is not None:  # its action comes from this pass's agent request
                self._ask([i])
                return
            else:
                self.start_obs[i] = row_copy(host.buffers.obs, i)
                steps = pool.run_steps(RUN_STEPS)
                future = host.run_soon(i, steps, False)
        except WorkerError as exc:  # its host is dead: this env's failure
            self._failed(i, exc)
            return
        in_flight: dict[int, Any] = host.in_flight
        in_flight[i] = future
        watch_error(future)
        if future.done():  # (its host died before: settled at once)
            self.apply(i, future)

    def _next_many(self, ids: list[int]) -> None:
        """:meth:`_next` of each of ``ids``; those the caller's agent acts for, in one pass."""
        pool = self.pool
        assert pool is not None
        if pool.met or not self.active:
            return
        if self.requests is None:
            for i in ids:
                self._next(i)
            return
        flags = self.worker.episodes.needs_reset[ids].tolist()
        if any(flags):  # (their resets are sent now: the others are asked for together)
            for i in itertools.compress(ids, flags):
                self._next(i)
            ids = [i for i, reset in zip(ids, flags) if not reset]
        in_flight, asking = self.host.in_flight, self.asking
        ready = [i for i in ids if i not in in_flight and i not in asking]
        if ready:
            self._ask(ready)

    def _ask(self, envs: list[int]) -> None:
        """Envs ``envs`` get their actions from this pass's agent request (:meth:`_act`)."""
        self.asking.update(envs)
        if not self.ready:
            pass_queue(asyncio.get_running_loop()).put(self._act)
        self.ready.extend(envs)

    def apply(self, i: int, future: asyncio.Future[Any]) -> None:
        """Apply env ``i``'s answered request in ``in_flight`` (see :meth:`take`)."""
        self.take(i, future.exception() or future.result())

    @_fails_the_call
    def take(self, i: int, outcome: Any) -> None:
        """Apply the outcome of env ``i``'s request (taken out of ``in_flight``): a run, a
        reset's info or an error; then ask for its next (the host's sink, see
        :class:`~asyncsample.backends._lane_link.RunSink`)."""
        del self.host.in_flight[i]
        start = self.start_obs.pop(i, None)
        if isinstance(outcome, BaseException):
            if isinstance(outcome, WorkerError) and outcome.retry:
                self._failed(i, outcome)
            else:  # the env may be mid-episode: reset before it is used again
                self.worker.episodes.needs_reset[i] = True
                self._fail(outcome)
            return
        if type(outcome) is StepRun:
            self._record(i, outcome)
        elif type(outcome) is tuple:  # a step of the caller's agent (its outcome in the reply)
            self._take_outcomes([(i, outcome)], [start])
            return
        else:  # a reset's info
            self._started(i, outcome)
        self._next(i)

    @_fails_the_call
    def take_runs(self, runs: RunColumns, rs: np.ndarray, envs: np.ndarray) -> None:
        """Record runs ``rs`` of ``runs``, envs ``envs``': those
        within the quota's room in one pass (:meth:`_record_runs`), the one that crosses it and
        any after one by one (:meth:`_record`); then ask each env for its next."""
        in_flight, start_obs = self.host.in_flight, self.start_obs
        ids = envs.tolist()
        for i in ids:
            del in_flight[i]
            start_obs.pop(i, None)
        pool = self.pool
        assert pool is not None
        fit = 0  # a pass's fixed cost is more than that of a few runs one by one
        if len(ids) >= VECTOR_RUNS:  # (most frames bring a worker fewer: no numpy for them)
            lengths = runs.lengths[rs]
            fit = int(np.searchsorted(np.cumsum(lengths), pool.room(), side="right"))
            if fit >= VECTOR_RUNS:
                self._record_runs(runs, rs[:fit], envs[:fit], lengths[:fit])
            else:
                fit = 0
        for r, i in zip(rs[fit:].tolist(), ids[fit:]):
            self._record(i, runs.run(r))
        for i in ids:
            self._next(i)

    def _record_runs(
        self,
        runs: RunColumns,
        rs: np.ndarray,
        envs: np.ndarray,
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
        rows.versions[at, env] = np.repeat(runs.versions[rs], lengths)
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
        reset = None if self.requests is None else getattr(self.worker.agent, "reset", None)
        if reset is not None:  # (an acting host's agent copy was reset with the env)
            reset(one)

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

    # -- the agent in the caller ------------------------------------------------------------------

    @_fails_the_call
    def _act(self) -> None:
        """Ask the agent for the actions of the envs ready in this pass (one request: their
        rows, written into the records at each env's row)."""
        envs, self.ready = self.ready, []
        pool = self.pool
        assert pool is not None and self.requests is not None
        if not envs:
            return
        if not self.active or pool.met:
            self.asking.difference_update(envs)
            return
        worker = self.worker
        recorder = worker.episodes.recorder
        rows, cursor = recorder.rows, recorder.cursor
        assert cursor is not None
        index = np.array(envs, dtype=np.int64)
        t = cursor[index]
        top = max(t.tolist())  # (a numpy reduction costs more, for a pass's few envs)
        if top >= rows.size:
            rows.cover(top, *self.like)
        obs = self.host.buffers.obs[index]
        rows.obs[t, index] = obs
        acted = functools.partial(self._acted, envs, index, t, worker.agent_version)
        self.deliveries = [d for d in self.deliveries if not d.done()]
        self.deliveries.append(
            self.requests.ask_rows(worker.agent, worker.worker_number, obs, envs, acted)  # type: ignore[arg-type]
        )

    @_fails_the_call
    def _acted(
        self,
        envs: list[int],
        index: np.ndarray,
        t: np.ndarray,
        version: int,
        output: Any,
    ) -> None:
        """Record the actions of ``envs`` (asked under agent ``version``) and send their steps;
        a row the agent failed is its env's failure alone."""
        self.asking.difference_update(envs)
        pool = self.pool
        assert pool is not None
        if not self.active or pool.met:  # asked again by the next call
            return
        if isinstance(output, BaseException):
            self._fail(output)
            return
        actions, infos, faults = output
        worker = self.worker
        rows = worker.episodes.recorder.rows
        rows.actions[t, index] = actions
        rows.versions[t, index] = version
        if infos or rows.agent_infos:
            for k, (i, row) in enumerate(zip(envs, t.tolist())):
                store_agent_infos(rows, row, {key: row_value(v, k) for key, v in infos.items()}, i)
        failed = dict(faults)
        for k, fault in failed.items():
            self._failed(envs[k], fault)
        host = self.host
        in_flight: dict[int, Any] = host.in_flight
        start_obs = self.start_obs
        if failed:
            keep = [k for k in range(len(envs)) if k not in failed]
            envs, index = [envs[k] for k in keep], index[keep]
            actions = actions[keep]
        sent = host.step_many(envs, index, actions)
        if type(sent) is range:  # SinkSteps all: their rows recorded with the request
            in_flight.update(zip(envs, sent))
            start_obs.update(dict.fromkeys(envs))
            return
        for i, future in zip(envs, sent):
            if isinstance(future, WorkerError):  # its host is dead: this env's failure
                self._failed(i, future)
                continue
            start_obs[i] = None  # its row, recorded with the request
            in_flight[i] = future
            if answered(future):  # (its host died before: settled at once)
                self.apply(i, future)

    @_fails_the_call
    def take_steps(self, envs: np.ndarray, infos: list[dict[str, Any] | None]) -> None:
        """Record the steps of ``envs``, answered in one frame (their outcomes in the step
        buffers), in one pass (:meth:`_record_steps`); then ask each env for its next."""
        host = self.host
        in_flight, start_obs = host.in_flight, self.start_obs
        ids = envs.tolist()
        starts = [start_obs.pop(i, None) for i in ids]
        for i in ids:
            del in_flight[i]
        buffers = host.buffers
        flags = buffers.terminated[envs], buffers.truncated[envs]
        self._record_steps(envs, starts, buffers.rewards[envs], *flags, infos)
        self._next_many(ids)

    def _take_outcomes(self, steps: list[tuple[int, Any]], starts: list[Any] | None = None) -> None:
        """:meth:`take_steps` of answered steps given as ``(env, outcome)``: still in flight,
        or already taken out with their first observations ``starts``."""
        ids = [i for i, _ in steps]
        if starts is None:
            for i in ids:
                del self.host.in_flight[i]
            starts = [self.start_obs.pop(i, None) for i in ids]
        rewards, terminated, truncated, infos = zip(*(outcome for _, outcome in steps))
        self._record_steps(
            np.array(ids, dtype=np.int64),
            starts,
            np.array(rewards, dtype=np.float64),
            np.array(terminated, dtype=bool),
            np.array(truncated, dtype=bool),
            list(infos),
        )
        for i in ids:
            self._next(i)

    def _record_steps(
        self,
        envs: np.ndarray,
        starts: list[Any],
        rewards: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        infos: list[dict[str, Any] | None],
    ) -> None:
        """Record one step of each of ``envs`` (``starts``: the observations they began at):
        those within the quota's room; any after it opens the next call (:meth:`_carry`)."""
        pool, worker = self.pool, self.worker
        assert pool is not None
        episodes = worker.episodes
        recorder = episodes.recorder
        rows, cursor = recorder.rows, recorder.cursor
        assert cursor is not None
        ids = envs.tolist()
        carried = episodes.carried_rows
        if carried:  # the previous call's rows of these steps
            which = envs[carried.held[envs]]
            if which.size:
                at = cursor[which]
                rows.cover(int(at.max()), *self.like)
                carried.put_back(rows, at, which)
        fit = min(pool.room(), len(ids))
        if fit < len(ids):  # past the quota: these steps open the next call
            # No info: None, not {} (the collector stops tracking a tuple of no container).
            outcomes = zip(
                rewards[fit:].tolist(),
                terminated[fit:].tolist(),
                truncated[fit:].tolist(),
                [info or None for info in infos[fit:]],
            )
            self._carry(envs[fit:], list(outcomes), starts[fit:])
        if not fit:
            return
        envs, rewards = envs[:fit], rewards[:fit]
        t = cursor[envs]
        rows.rewards[t, envs] = rewards
        for i, row, info in zip(ids, t.tolist(), infos[:fit]) if any(infos) else ():
            if info:  # (its agent infos were recorded with its action)
                by_env = rows.env_infos.get(row)
                if by_env is None:
                    by_env = rows.env_infos[row] = [{} for _ in range(rows.n_envs)]
                by_env[i] = info
        cursor[envs] = t + 1
        episodes.lengths[envs] += 1
        episodes.returns[envs] += rewards  # one step each: the per-step float sums
        pool.add(worker.worker_number, fit)
        ended = terminated[:fit] | truncated[:fit]
        for i, row in zip(envs[ended].tolist(), t[ended].tolist()):
            self.lanes.end_episode(i, row)

    def _carry(
        self,
        envs: np.ndarray,
        outcomes: list[tuple[float, bool, bool, dict[str, Any] | None]],
        starts: list[Any],
    ) -> None:
        """Leave the steps of ``envs`` (answered past the quota) in flight for the next call to
        record first, their rows copied (in one pass); this call's fragment of each ends at its
        ``starts``, where the step began."""
        episodes = self.worker.episodes
        rows, cursor = episodes.recorder.rows, episodes.recorder.cursor
        assert cursor is not None
        t = cursor[envs]
        episodes.carried_rows.keep(rows, t, envs)
        loop = asyncio.get_running_loop()
        in_flight: dict[int, Any] = self.host.in_flight
        for i, row, outcome, start in zip(envs.tolist(), t.tolist(), outcomes, starts):
            future = loop.create_future()
            future.set_result(outcome)
            in_flight[i] = future
            episodes.cut_obs[i] = row_copy(rows.obs[row], i) if start is None else start

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
