"""One coroutine per env: the stepper of the ``asyncio`` and ``thread`` backends.

A worker's envs are not stepped in lockstep here. Each env runs its own loop (reset when it must,
ask for an action, step, record), so a slow env never stalls a fast one, and every env writes its
steps to its own column of the worker's step records (the recorder's per-env cursor): an
episode's steps stay contiguous in that column, so the engine's bookkeeping, stop rules and batch
assembly apply unchanged.

- :class:`ActionRequests` merges the action requests of every env that became ready in one pass
  of the event loop into one agent call per agent (a policy service sees batches, however many
  one-env workers there are).
- :class:`Admission` holds back new episodes in ``stream`` while the open episodes' agent
  versions would spread by more than ``max_policy_lag``.
- :class:`LaneStepper` is the :class:`~asyncsample._engine.Stepper`; where a call stops is the
  engine's :class:`~asyncsample._engine.StopRule`, applied per env.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import logging
import math
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncsample._action_check import AgentOutputCheck, check_actions, make_action_check
from asyncsample._clock import AgentTimer
from asyncsample._engine import CallMode, SharedQuota, StopRule
from asyncsample._recorder import Resume, put_row, store_agent_infos
from asyncsample._tree import Tree, tree_map
from asyncsample.agent import Agent, trusted_actions
from asyncsample.backends._closing import cancelled_by_env
from asyncsample.backends.aio import DeadlinePassed, LaneHost
from asyncsample.errors import WorkerError

if TYPE_CHECKING:
    from asyncsample.worker import Worker

__all__ = ["ActionRequests", "Admission", "LaneRound", "LaneStepper"]

logger = logging.getLogger("asyncsample")

_NEVER = np.inf
"""The deadline of an episode without one."""


class ActionRequests:
    """Batches the action requests of the envs that are ready in the same pass of the loop.

    Each request is one env's observation; the first request of a pass schedules a flush at the
    end of the pass, which stacks the observations per agent, calls the agent once (awaiting it
    when it is async) and hands every env its row of the actions and agent infos.

    Args:
        action_space: checks the actions' shapes and values.
    """

    def __init__(self, action_space: Any) -> None:
        self.action_space = action_space
        self._values = make_action_check(action_space)
        self._groups: dict[int, tuple[Agent, set[int], list[tuple[Tree, asyncio.Future[Any]]]]] = {}
        self._checks: dict[int, tuple[Callable[[], object], AgentOutputCheck]] = {}
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.timer: AgentTimer | None = None
        """With metrics on, where each agent call's seconds and rows go."""

    def request(self, agent: Agent, worker: int, observation: Tree) -> asyncio.Future[Any]:
        """A future of ``(action, agent_infos)`` for ``observation``, of an env of ``worker``."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        group = self._groups.get(id(agent))
        if group is None:
            self._groups[id(agent)] = (agent, {worker}, [(observation, future)])
        else:
            group[1].add(worker)
            group[2].append((observation, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        self._scheduled = False
        groups, self._groups = self._groups, {}
        for agent, workers, requests in groups.values():
            live = [(o, f) for o, f in requests if not f.done()]  # cancelled lanes drop out
            if not live:
                continue
            first = live[0][0]
            if isinstance(first, np.ndarray):
                stacked: Tree = np.stack([o for o, _ in live])
            else:
                stacked = tree_map(lambda *xs: np.stack(xs), *[o for o, _ in live])
            timer = self.timer
            start = 0.0 if timer is None else time.perf_counter()
            try:
                result = agent.get_actions(stacked)
            except Exception as exc:
                _fail(live, exc)
                continue
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._tasks.add(task)
                if timer is not None:
                    task.add_done_callback(functools.partial(_timed, timer, start, len(live)))
                task.add_done_callback(functools.partial(self._awaited, agent, workers, live))
            else:
                if timer is not None:
                    timer.add(time.perf_counter() - start, len(live))
                self._deliver(agent, workers, live, result)

    def _awaited(
        self,
        agent: Agent,
        workers: set[int],
        live: list[tuple[Tree, asyncio.Future[Any]]],
        task: asyncio.Task[Any],
    ) -> None:
        worker = min(workers)
        self._tasks.discard(task)
        if task.cancelled():
            # Not a CancelledError: the lanes would take it for their own cancellation.
            _fail(live, RuntimeError(f"the agent's get_actions (worker {worker}) was cancelled"))
        elif task.exception() is not None:
            _fail(live, task.exception())  # type: ignore[arg-type]
        else:
            self._deliver(agent, workers, live, task.result())

    def _deliver(
        self,
        agent: Agent,
        workers: set[int],
        live: list[tuple[Tree, asyncio.Future[Any]]],
        result: Any,
    ) -> None:
        n = len(live)
        worker = min(workers)
        try:
            check = self._check_of(agent, worker)
            check.worker, check.n_envs = worker, n
            actions, infos = check.output(result)
            trusted = trusted_actions(agent, self.action_space)
            names = ", ".join(map(str, sorted(workers)))
            actions = check_actions(
                actions,
                _like_rows(actions, n),
                worker=worker,
                action_space=self.action_space,
                values=None if trusted else self._values,
                rows=f"{n} rows, the observations of the envs ready at once of "
                f"worker{'s' if len(workers) > 1 else ''} {names}",
            )
        except Exception as exc:
            _fail(live, exc)
            return
        plain = isinstance(actions, np.ndarray)
        for j, (_, future) in enumerate(live):
            if future.done():
                continue
            action = actions[j] if plain else tree_map(lambda a, j=j: a[j], actions)
            future.set_result((action, {k: v[j] for k, v in infos.items()} if infos else {}))

    def _check_of(self, agent: Agent, worker: int) -> AgentOutputCheck:
        """The output check of ``agent`` (a new agent object, such as one an update put in,
        gets a new one: the kinds and shapes of its infos may differ from its predecessor's)."""
        known = self._checks.get(id(agent))
        if known is not None and known[0]() is agent:
            return known[1]
        try:
            ref: Callable[[], object] = weakref.ref(agent)
        except TypeError:  # not weakly referenceable: keep it (its id cannot be reused then)
            ref = functools.partial(_same, agent)
        check = AgentOutputCheck(worker, 1)
        self._checks[id(agent)] = (ref, check)
        return check

    async def aclose(self) -> None:
        """Cancel the agent calls still awaited."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


def _same(value: object) -> object:
    """``value`` (a strong reference standing in for a weak one)."""
    return value


def _like_rows(actions: Tree, n: int) -> Tree:
    """What :func:`check_actions` compares shapes against: ``n`` rows of the space's shape."""

    def like(a: Any) -> np.ndarray:
        a = np.asarray(a)
        return np.empty((n, *a.shape[1:]), dtype=a.dtype) if a.ndim else a

    return tree_map(like, actions)


def _timed(timer: AgentTimer, start: float, rows: int, _: object) -> None:
    timer.add(time.perf_counter() - start, rows)


def _fail(live: list[tuple[Tree, asyncio.Future[Any]]], exc: BaseException) -> None:
    for _, future in live:
        if not future.done():
            future.set_exception(exc)


class Admission:
    """Staleness at admission (``stream(max_policy_lag=k)`` on the lane backends).

    Tracks the agent version of every open episode, per worker. An env may start a new episode
    under version ``v`` only while ``v - oldest open version of its worker <= k``; otherwise it
    waits until its worker's older episodes end (or the call's share is in). So the versions in
    flight never spread by more than ``k``, rather than episodes being run to the end and thrown
    away afterwards. Per worker, because the workers' shares are separate: a worker waiting on
    another's episode, which that worker would only finish in the next round, could wait forever.
    """

    def __init__(self, max_lag: int) -> None:
        self.max_lag = max_lag
        self._versions: dict[int, collections.Counter[int]] = collections.defaultdict(
            collections.Counter
        )
        self._open: dict[tuple[int, int], int] = {}
        self._changed = asyncio.Event()
        self.waits = 0
        """How many times an env was held back."""

    def oldest(self, worker: int) -> int | None:
        """The oldest agent version among ``worker``'s open episodes."""
        versions = self._versions.get(worker)
        return min(versions) if versions else None

    async def admit(
        self, key: tuple[int, int], version: int, still: Callable[[], bool] = lambda: True
    ) -> bool:
        """Wait until env ``key`` (worker, env) may start an episode under ``version``, then
        count it open and return true; return false as soon as ``still()`` is false (the call
        needs no more episodes). An episode of ``key`` still counted (dropped by a restart)
        is forgotten first."""
        self.closed(key)
        held = False
        while True:
            oldest = self.oldest(key[0])
            if oldest is None or version - oldest <= self.max_lag:
                break
            if not still():
                return False
            if not held:
                self.waits += 1
                held = True
            self._changed.clear()
            await self._changed.wait()
        self._open[key] = version
        self._versions[key[0]][version] += 1
        return True

    def closed(self, key: tuple[int, int]) -> None:
        """Env ``key``'s episode ended or was dropped (nothing if it had none open)."""
        version = self._open.pop(key, None)
        if version is None:
            return
        versions = self._versions[key[0]]
        count = versions[version] - 1
        if count > 0:
            versions[version] = count
        else:
            del versions[version]
        self._changed.set()


class LaneRound:
    """One round of a stream of complete episodes, across its workers: no env stops stepping
    until every worker has its share (a worker done early keeps its envs stepping into the
    episodes the next round continues, rather than idling behind the slowest worker); then every
    worker's steps in flight are left for the next round.

    Args:
        workers: the workers taking part (those with a share).
    """

    def __init__(self, workers: int) -> None:
        self.waiting = workers
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
        if worker in self._satisfied:
            return
        self._satisfied.add(worker)
        self.waiting -= 1
        if self.waiting <= 0 and not self.done:
            self.done = True
            for stop in self._stops:
                if not stop.done():
                    stop.set_result(None)


class _Call:
    """Where this stepper run stops, per env: the engine's rule, or, for a unit of a call with
    ``fraction_samples`` (``lacking`` given), once ``lacking`` more transitions are in (as
    :meth:`StopRule.limited` says for a chunk: past the worker's own share if the call's total
    still lacks them)."""

    def __init__(self, stepper: LaneStepper, rule: StopRule, lacking: int | None) -> None:
        episodes = stepper.worker.episodes
        self.episodes = episodes
        self.quota = stepper.quota
        self.worker = stepper.worker.worker_number
        self.rule = rule
        self.mode = rule.mode
        n = episodes.n_envs
        self.limit = None
        self.start_completed = episodes.recorder.completed_steps
        if self.mode is CallMode.FRAGMENTS:
            steps = rule.steps if lacking is None else math.ceil(lacking / n)
            self.steps_left = np.full(n, max(steps, 0), dtype=np.int64)
            self.steps = steps
        elif self.mode is CallMode.SAMPLES and lacking is not None:
            self.limit = lacking

    def more(self, i: int) -> bool:
        """Whether env ``i`` takes another step."""
        mode = self.mode
        if mode is CallMode.SAMPLES:
            return not self.satisfied()
        if mode is CallMode.FRAGMENTS:
            if self.steps_left[i] <= 0:
                return False
            quota = self.quota
            if quota is None:
                return True
            # fraction_samples: every worker's envs stop once the call's total is in (each
            # env asks before its step, so the total passes it by at most the steps in flight).
            quota.report(self.worker, self.episodes.count(True))
            return not quota.may_stop(self.worker)
        return bool(self.episodes.active[i])

    def satisfied(self) -> bool:
        """``SAMPLES``: the completed episodes this run asked for are in (with a shared quota:
        the worker may stop, re-judged at every step, since the other workers move it too)."""
        quota = self.quota
        if quota is not None:
            quota.report(self.worker, self.episodes.count(False))
            return quota.may_stop(self.worker)
        limit = self.limit
        if limit is None:
            return self.rule.need <= 0
        return self.episodes.recorder.completed_steps - self.start_completed >= limit

    def more_of(self, i: int, lane_round: LaneRound | None = None) -> Callable[[], bool]:
        """:meth:`more` of env ``i`` as a cheap zero-argument check (asked before every step);
        within a :class:`LaneRound`, until the round is done."""
        if lane_round is not None:
            return lambda: not lane_round.done
        if self.mode is CallMode.SAMPLES and self.limit is None:
            rule = self.rule
            return lambda: rule.need > 0
        return functools.partial(self.more, i)


class LaneStepper:
    """Runs one coroutine per env of ``worker`` (see the module docstring).

    Args:
        worker: the worker; its host must be a :class:`~asyncsample.backends.aio.LaneHost`.
        requests: the sampler's :class:`ActionRequests`.
        leave: what the call leaves running (``Resume.NOTHING``: once a ``samples`` call has its
            share, steps still in flight are cancelled, since their episodes would be dropped;
            ``Resume.EPISODES``, a stream's round: they are left running for the next round).
        resume: what the call continues (steps a previous round left running are taken up
            only by a continuing ``Resume.EPISODES`` call; any other call drops them).
        lane_round: the stream round this call is part of (see :class:`LaneRound`).
        episode_timeout: seconds an episode may run before it is cut as truncated.
        admission: the stream's :class:`Admission`, if any.
        quota: the call's shared quota (``fraction_samples < 1``), if any: each env checks it
            before every step, so a worker stops as soon as the call may spare it.
        max_restarts: how often one env may be rebuilt in this call; past it the env's error
            is raised (``retry`` false: the call fails).
        restarted: called with the worker and the failure at each rebuild of an env (the
            sampler counts restarts and, with metrics, the fault; a failure past
            ``max_restarts`` is raised instead and counted where the call fails).

    A fault is the env's own: an env that raises (its own ``CancelledError`` included), hangs
    past ``step_timeout`` or returns a malformed step loses its episode in progress and is
    closed (bounded by ``close_timeout``) and rebuilt, while every other env's episode goes on.
    """

    def __init__(
        self,
        worker: Worker,
        requests: ActionRequests,
        *,
        leave: Resume,
        episode_timeout: float | None,
        admission: Admission | None = None,
        quota: SharedQuota | None = None,
        resume: Resume = Resume.NOTHING,
        lane_round: LaneRound | None = None,
        max_restarts: int = 3,
        restarted: Callable[[int, WorkerError], None] | None = None,
    ) -> None:
        host = worker.host
        assert isinstance(host, LaneHost)
        self.worker = worker
        self.host = host
        self.requests = requests
        self.leave = leave
        self.episode_timeout = episode_timeout
        self.admission = admission
        self.quota = quota
        self.resume = resume
        self.carry = leave is Resume.EPISODES
        """A stream of complete episodes: at the end of a round, steps still in flight are left
        running (:attr:`LaneHost.in_flight`) and the next round takes them up, so no round
        waits for its stragglers."""
        self.detaching = False
        self.round = lane_round if self.carry and quota is None else None
        self.max_restarts = max_restarts
        self.restarted = restarted
        n = worker.n_envs
        self.env_restarts = [0] * n
        """Rebuilds of each env in this call."""
        recorder = worker.episodes.recorder
        if recorder.cursor is None:
            recorder.cursor = np.zeros(n, dtype=np.int64)
        self.deadlines = worker.episodes.deadlines
        # step_one takes deadlines in the loop's time
        worker.episodes.clock = asyncio.get_running_loop().time

    async def start(self) -> None:
        """Episodes that have not taken a step start under the current agent version (resets
        happen in each env's own coroutine); steps a previous round left running are dropped
        unless this call continues that round's episodes."""
        episodes = self.worker.episodes
        if self.host.in_flight:
            if self.resume is Resume.EPISODES:
                stale = [i for i in self.host.in_flight if episodes.needs_reset[i]]
                dropped = await self.host.drop_in_flight(stale)
            else:
                dropped = await self.host.drop_in_flight()
            episodes.needs_reset[dropped] = True
        episodes.stamp_unstarted(self.worker.agent_version, self.host.in_flight)

    async def advance(self, rule: StopRule, lacking: int | None = None) -> int:
        """Step every env until the rule, or ``lacking`` more transitions, say stop."""
        await self._run(_Call(self, rule, lacking))
        return 1

    async def run(self, rule: StopRule) -> None:
        """Step every env until ``rule`` says stop."""
        await self._run(_Call(self, rule, None))

    async def _run(self, call: _Call) -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        if self.round is not None:
            self.round.join(stop)
        tasks = [
            asyncio.ensure_future(self._lane(i, call, stop)) for i in range(self.worker.n_envs)
        ]
        try:
            pending: set[asyncio.Future[Any]] = set(tasks)
            cut = False
            while pending:
                done, pending = await asyncio.wait(
                    pending | ({stop} if not cut else set()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                pending.discard(stop)
                for task in done:
                    if task is stop:
                        continue
                    if task.cancelled():
                        if not cut:  # a lane ends cancelled only when this loop cancels it
                            raise RuntimeError(
                                f"a lane of worker {self.worker.worker_number} ended cancelled"
                            )
                    elif task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                if stop.done() and not cut:
                    # The share is in. A plain call's steps in flight would be dropped: cut
                    # them; a stream round's are left running for the next round.
                    cut = True
                    self.detaching = self.carry
                    for task in pending:
                        task.cancel()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            if not stop.done():
                stop.cancel()
            self.detaching = False
        if call.mode is CallMode.FRAGMENTS:
            call.rule.took(call.steps)

    async def _lane(self, i: int, call: _Call, stop: asyncio.Future[None]) -> None:
        """Env ``i``'s loop: reset when it must, ask for an action, step, record.

        The env's cursor, episode length and return live in locals while it runs (numpy
        scalar reads and writes cost more than the rest of a step) and go back to the
        engine's arrays wherever the engine reads them: an episode's end, a cut, the exit.
        """
        worker = self.worker
        episodes = worker.episodes
        host = self.host
        buffers = host.buffers
        recorder = episodes.recorder
        rows = recorder.rows
        cursor = recorder.cursor
        assert cursor is not None
        one = np.zeros(worker.n_envs, dtype=bool)
        one[i] = True
        samples = call.mode is CallMode.SAMPLES
        stop_when_in = samples and (self.leave is Resume.NOTHING or self.carry)
        carry = self.carry
        in_flight = host.in_flight
        flat = isinstance(buffers.obs, np.ndarray) and isinstance(buffers.actions, np.ndarray)
        request = self.requests.request
        step = host.step_one
        w = worker.worker_number
        needs_reset, lengths, returns = episodes.needs_reset, episodes.lengths, episodes.returns
        deadlines = self.deadlines
        steps_left = call.steps_left if call.mode is CallMode.FRAGMENTS else None
        # fraction_samples of fragments: the shared quota counts the steps in the records
        # before every step, so the cursor cannot wait for the episode's end.
        live_cursor = steps_left is not None and call.quota is not None
        lane_round = self.round
        more = call.more_of(i, lane_round)
        loop = asyncio.get_running_loop()
        t, length, ret = int(cursor[i]), int(lengths[i]), float(returns[i])
        deadline = float(deadlines[i])
        # A step the previous round left running: its observation and action are in row t.
        carried = in_flight.get(i)
        stepping = False
        try:
            while carried is not None or more():
                try:
                    if carried is not None:
                        stepping = True
                        result = await asyncio.shield(carried)
                    else:
                        if needs_reset[i]:
                            length, ret = 0, 0.0  # a reset cut by its deadline leaves none
                            started = await self._start_episode(i, one, more)
                            length, ret, deadline = 0, 0.0, float(deadlines[i])
                            if not started:
                                break
                        if flat:
                            observation = buffers.obs[i].copy()
                        else:
                            observation = tree_map(lambda x: x[i].copy(), buffers.obs)
                        action, infos = await request(
                            worker.agent,  # type: ignore[arg-type]
                            w,
                            observation,
                        )
                        if t >= rows.size:
                            rows.cover(t, buffers.obs, buffers.actions)
                        if flat:
                            rows.obs[t, i] = observation
                            rows.actions[t, i] = action
                        else:
                            put_row(rows.obs, (t, i), observation)
                            put_row(rows.actions, (t, i), action)
                        if infos or rows.agent_infos:
                            store_agent_infos(rows, t, infos, i)
                        rows.versions[t, i] = worker.agent_version
                        stepping = True
                        when = None if deadline == _NEVER else deadline
                        if carry:  # a task of its own, which a round's end may leave running
                            carried = in_flight[i] = loop.create_task(step(i, action, when))
                            result = await asyncio.shield(carried)
                        else:
                            result = await step(i, action, when)
                except DeadlinePassed:
                    in_flight.pop(i, None)
                    carried, stepping = None, False
                    cursor[i], lengths[i], returns[i] = t, length, ret
                    self._cut(i)
                    length, ret = 0, 0.0
                    continue
                except WorkerError as exc:
                    if not exc.retry:
                        raise
                    failure: WorkerError = exc
                except asyncio.CancelledError as exc:
                    if not cancelled_by_env():
                        raise
                    failure = WorkerError(
                        f"env {i} of worker {w}: a call of its ended with the env's own "
                        "CancelledError",
                        worker=w,
                        env=i,
                    )
                    failure.__cause__ = exc
                else:
                    failure = None  # type: ignore[assignment]
                if failure is not None:
                    # The env's fault, not its worker's: drop its episode, rebuild it alone.
                    task = in_flight.pop(i, None)
                    if task is not None:
                        task.cancel()
                    carried, stepping = None, False
                    cursor[i], lengths[i], returns[i] = t, length, ret
                    self._drop(i, call)
                    length, ret = 0, 0.0
                    await self._rebuild(i, failure)
                    continue
                if carried is not None:
                    in_flight.pop(i, None)
                    carried = None
                stepping = False
                reward, terminated, truncated, info = result
                rows.rewards[t, i] = reward
                if info:
                    row = rows.env_infos.get(t)
                    if row is None:
                        row = rows.env_infos[t] = [{} for _ in range(worker.n_envs)]
                    row[i] = info
                t += 1
                length += 1
                ret += reward
                if steps_left is not None:
                    steps_left[i] -= 1
                    if live_cursor:
                        cursor[i] = t
                if terminated or truncated:
                    cursor[i], lengths[i], returns[i] = t, length, ret
                    self._end(i, t - 1)
                    length, ret = 0, 0.0
                    if stop_when_in and call.satisfied():
                        if lane_round is not None:
                            lane_round.satisfied(w)  # sets every worker's stop when all are in
                        elif not stop.done():
                            stop.set_result(None)
                elif deadline != _NEVER and deadline <= loop.time():
                    cursor[i], lengths[i], returns[i] = t, length, ret
                    self._cut(i)
                    length, ret = 0, 0.0
        except asyncio.CancelledError:
            if not (self.detaching and i in in_flight) and (stepping or not self.detaching):
                # Cut off mid-step (its share is in, or the call was cancelled): the env may
                # be mid-step, so it is reset before it is used again.
                needs_reset[i] = True
                task = in_flight.pop(i, None)
                if task is not None:
                    task.cancel()
            raise
        finally:
            cursor[i], lengths[i], returns[i] = t, length, ret

    async def _start_episode(self, i: int, one: np.ndarray, more: Callable[[], bool]) -> bool:
        """Reset env ``i`` for a new episode (once admitted); false: the call needs no more."""
        worker = self.worker
        episodes = worker.episodes
        version = worker.agent_version
        key = (worker.worker_number, i)
        if self.admission is not None:
            if not await self.admission.admit(key, version, more):
                return False
        deadline = None
        if self.episode_timeout is not None:  # the episode's clock starts with its reset
            deadline = asyncio.get_running_loop().time() + self.episode_timeout
        try:
            info = await self.host.reset_one(i, deadline=deadline)
        except BaseException:
            if self.admission is not None:
                self.admission.closed(key)
            raise
        episodes.started(one, {i: info} if info else {})
        if deadline is not None:
            self.deadlines[i] = deadline
        episodes.episode_info[i] = episodes.fresh_info(episodes.episode_info[i], i, version)
        reset = getattr(worker.agent, "reset", None)
        if reset is not None:
            reset(one.copy())
        return more()

    def _drop(self, i: int, call: _Call) -> None:
        """Env ``i`` failed: its episode in progress is dropped (its rows are never returned;
        a fragment call redoes their steps), and it is reset before its next step."""
        episodes = self.worker.episodes
        recorder = episodes.recorder
        cursor = recorder.cursor
        assert cursor is not None
        recorded = int(cursor[i] - recorder.piece_start[i])
        if call.mode is CallMode.FRAGMENTS and recorded > 0:
            call.steps_left[i] += recorded
        recorder.piece_start[i] = cursor[i]
        recorder.piece_position[i] = 0
        episodes.needs_reset[i] = True
        episodes.lengths[i] = 0
        episodes.returns[i] = 0.0
        self.deadlines[i] = np.inf
        if self.admission is not None:
            self.admission.closed((self.worker.worker_number, i))

    async def _rebuild(self, i: int, failure: WorkerError) -> None:
        """Close env ``i`` (bounded) and build it again, within the call's ``max_restarts``
        for it; past them ``failure`` (or the rebuild's own error) is raised, not retried."""
        worker = self.worker
        w = worker.worker_number
        while True:
            if self.env_restarts[i] >= self.max_restarts:
                failure.retry = False  # the call fails: no worker-wide rebuild either
                raise failure
            self.env_restarts[i] += 1
            worker.restarts += 1
            if self.restarted is not None:
                self.restarted(w, failure)
            logger.warning(
                "worker %d: rebuilding env %d (restart %d of at most %d in this call) after %s: %s",
                w,
                i,
                self.env_restarts[i],
                self.max_restarts,
                type(failure).__name__,
                str(failure).split("\n", 1)[0],
            )
            try:
                await self.host.rebuild_one(i, worker.env_chain(i), worker.next_env_seed(i))
                return
            except WorkerError as exc:
                if not exc.retry:
                    raise
                failure = exc

    def _end(self, i: int, t: int) -> None:
        """Env ``i``'s episode ended at its row ``t`` (the host wrote its flags and last obs)."""
        episodes = self.worker.episodes
        buffers = self.host.buffers
        episodes.close_episodes(
            np.array([i]),
            t,
            buffers.terminated,
            buffers.final_obs,
            {},
            self.worker.agent_version,
        )
        episodes.needs_reset[i] = True
        self.deadlines[i] = np.inf
        if self.admission is not None:
            self.admission.closed((self.worker.worker_number, i))

    def _cut(self, i: int) -> None:
        """Env ``i``'s episode passed its deadline: it ends as truncated at its last step, its
        ``episode_infos["deadline"]`` true; the env is reset before its next step."""
        episodes = self.worker.episodes
        cursor = episodes.recorder.cursor
        assert cursor is not None
        if episodes.lengths[i] > 0:
            buffers = self.host.buffers
            buffers.terminated[i] = False
            buffers.truncated[i] = True
            put_row(buffers.final_obs, i, tree_map(lambda x: x[i], buffers.obs))
            episodes.episode_info[i]["deadline"] = True
            self._end(i, int(cursor[i]) - 1)
        else:
            episodes.needs_reset[i] = True
            self.deadlines[i] = np.inf
            if self.admission is not None:
                self.admission.closed((self.worker.worker_number, i))
