"""One coroutine per env: the stepper of hosts that step each env on its own (a
:class:`~asyncsample.backends.base.PerEnvHost`: ``asyncio``, ``thread``, async envs in the env
hosts).

Each env runs its own loop (reset when it must, ask for an action, step, record), so a slow env
never stalls a fast one, and writes its own column of the worker's records (the recorder's
per-env cursor), so the engine's rules and batch assembly apply unchanged. With
``inference="host"`` (an :class:`~asyncsample.backends.base.ActingHost`) the host's agent copy
picks the action: one request per step, the action recorded from its reply.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from asyncsample._batcher import Batcher
from asyncsample._engine import CallMode, Part, StopRule
from asyncsample._quotas import QuotaWatch
from asyncsample._recorder import Resume, put_row, store_agent_infos
from asyncsample._run_records import RUN_STEPS, put_run, within_quota
from asyncsample._tree import row_copy, tree_map
from asyncsample.agent import row_draw
from asyncsample.backends import _watchdog
from asyncsample.backends._closing import cancelled_by_env
from asyncsample.backends.base import (
    ActingHost,
    BareStepHost,
    DeadlinePassed,
    DirectStepHost,
    PerEnvHost,
    StepRun,
)
from asyncsample.errors import StepTimeoutError, WorkerError

if TYPE_CHECKING:
    from asyncsample.worker import Worker

__all__ = ["Admission", "LaneSettings", "LaneStepper"]

logger = logging.getLogger("asyncsample")

_NEVER = np.inf
"""The deadline of an episode without one."""

# Until when a lane steps: its stream round is done, its call needs no more episodes, its env
# has no fragment steps left, the stop rule says so (asked per env), or the call's quota
# without fixed shares is in.
_UNTIL_ROUND, _UNTIL_NEED, _UNTIL_LEFT, _UNTIL_RULE, _UNTIL_POOL = range(5)


def _row_copy(i: int, leaf: np.ndarray) -> np.ndarray:
    """Row ``i`` of a buffer's leaf, copied."""
    row: np.ndarray = row_copy(leaf, i)
    return row


def _seen(carrier: asyncio.Future[Any]) -> None:
    """Mark a carried step's error as retrieved: the sampler may close before a call takes it up
    (the next call's lane still gets it)."""
    if not carrier.cancelled():
        carrier.exception()


def _taken(carrier: asyncio.Future[Any]) -> int:
    """The steps a carried step's lane returned the outcome of (the env took them)."""
    if not carrier.done() or carrier.cancelled() or carrier.exception() is not None:
        return 0
    result = carrier.result()
    return len(result.rewards) if type(result) is StepRun else 1


class Admission:
    """Staleness at admission (``stream(max_policy_lag=k)`` on the lanes): an env starts an
    episode under version ``v`` only while ``v`` minus the oldest version of its worker's open
    episodes is at most ``k``; else it waits for those to end (or for the call's share)."""

    def __init__(self, max_lag: int) -> None:
        self.max_lag = max_lag
        self._versions: dict[int, collections.Counter[int]] = collections.defaultdict(
            collections.Counter
        )
        self._open: dict[tuple[int, int], int] = {}
        self._changed = asyncio.Event()
        self.waits = 0  # how many times an env was held back

    def oldest(self, worker: int) -> int | None:
        """The oldest agent version among ``worker``'s open episodes."""
        versions = self._versions.get(worker)
        return min(versions) if versions else None

    async def admit(
        self, key: tuple[int, int], version: int, still: Callable[[], bool] = lambda: True
    ) -> bool:
        """Wait until env ``key`` may start an episode under ``version`` (then count it open);
        false as soon as ``still()`` is false."""
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
        versions[version] -= 1
        if versions[version] <= 0:
            del versions[version]
        self._changed.set()


@dataclass
class _Lanes:
    """One run's lanes: ``stepping``, the envs whose step is in flight (in a stream round or a
    call without fixed shares), each with its lane's ``(row, length, return, steps left)``;
    ``detached``, those left running as their step's carrier when the round ended."""

    stepping: dict[int, tuple[int, int, float, int]] = field(default_factory=dict)
    detached: set[int] = field(default_factory=set)


@dataclass
class LaneSettings:
    """What every lane of a sampler shares: ``max_restarts`` of one env in a call,
    ``restarted(worker, failure)`` at each rebuild, ``admission()``: the stream's, if any."""

    max_restarts: int
    restarted: Callable[[int, WorkerError], None]
    admission: Callable[[], Admission | None]


class LaneStepper:
    """Runs one coroutine per env of ``worker`` (see the module docstring).

    Args:
        worker: the worker; its host must be a :class:`~asyncsample.backends.base.PerEnvHost`.
        requests: the mode's merger of the envs' agent requests; ``None``: the host's agent
            copies act (its host is an :class:`~asyncsample.backends.base.ActingHost`).
        part: the worker's part of the call. Once a ``samples`` call has its share, steps in
            flight are cancelled, or left running for a stream's next round to take up; once
            the quota of a call without fixed shares (``part.pool``) is in, they are left
            running for the next call.
        settings: see :class:`LaneSettings`.
    """

    def __init__(
        self, worker: Worker, requests: Batcher | None, part: Part, settings: LaneSettings
    ) -> None:
        self.worker = worker
        self.host = cast(PerEnvHost, worker.host)  # checked once, when the mode attached
        self.requests = requests
        self.acting = cast(ActingHost, self.host) if requests is None else None
        # A host in other processes: its steps are bare futures (see BareStepHost), told by its
        # one method (an isinstance of the protocol would look up every member, per call).
        bare = hasattr(self.host, "step_soon")
        self.bare = cast(BareStepHost, self.host) if bare else None
        # With metrics on, the envs whose steps this call times (a host in this process; as many
        # as its timing's gap asks, another set each call): chosen once, not per step.
        self.timed = self.host.timed_envs()
        self.episode_timeout = worker.episodes.episode_timeout
        self.admission = settings.admission()
        self.quota = quota = part.quota
        self.watch = None if quota is None else QuotaWatch.of(quota)
        self.resume = part.resume
        self.pool = part.pool
        # Steps in flight go on into the next round (or call, without fixed shares).
        self.carry = part.leave is Resume.EPISODES or self.pool is not None
        self.detaching = False
        self.round = part.lane_round if self.carry and quota is None else None
        self.settings = settings
        n = worker.n_envs
        self.env_restarts = [0] * n  # rebuilds of each env in this call
        recorder = worker.episodes.recorder
        if recorder.cursor is None:
            recorder.cursor = np.zeros(n, dtype=np.int64)
        self.deadlines = worker.episodes.deadlines
        self.runs: set[int] = set()  # the envs whose run of steps is in flight
        worker.episodes.clock = asyncio.get_running_loop().time  # step_one's deadlines' clock

    async def start(self, own: bool = True) -> None:
        """Stamp the unstarted episodes; drop the steps left running that this call won't take
        (the host's agent copy brought up to date first, where it acts). ``own``: the lanes
        drive the call, and each step left in flight needs a future to carry it."""
        if self.acting is not None:
            await self.acting.sync_agent()
        episodes = self.worker.episodes
        keep_waiting = getattr(self.host, "keep_waiting", None)
        if own and keep_waiting is not None:
            for i in list(self.host.in_flight):
                keep_waiting(i)
        if self.host.in_flight:
            # Continuing: drop only those of envs to reset.
            keep = self.resume is Resume.EPISODES or (
                self.pool is not None and self.resume is Resume.FRAGMENTS
            )
            stale = [i for i in self.host.in_flight if not keep or episodes.needs_reset[i]]
            if keep_waiting is not None:
                for i in stale:
                    keep_waiting(i)
            # A carried step the env finished is a step it took, though no batch will hold it.
            episodes.dropped_steps += sum(map(_taken, (self.host.in_flight[i] for i in stale)))
            episodes.needs_reset[await self.host.drop_in_flight(stale)] = True
        episodes.stamp_unstarted(self.worker.agent_version, self.host.in_flight)
        if self.pool is not None:  # a retry after a restart: what the worker holds now
            self.pool.set(self.worker.worker_number, episodes.count(True))

    async def advance(self, rule: StopRule, lacking: int | None = None) -> int:
        """Step every env until the rule, or ``lacking`` more transitions, say stop (with a
        shared quota: first wait while the other workers owe what this one would fill in)."""
        watch = self.watch
        if watch is not None:
            w = self.worker.worker_number
            await watch.wait(w)
            if watch.quota.may_stop(w):
                return 1
        await self.run(rule, lacking)
        return 1

    def _may_stop(self, fragments: bool) -> bool:
        """The call's shared quota lets this worker stop (each env asks before its step)."""
        watch, w = self.watch, self.worker.worker_number
        assert watch is not None
        watch.report(w, self.worker.episodes.count(fragments))
        return watch.covered(w)

    def _report(self, fragments: bool) -> None:
        """Tell the shared quota this worker's count (after a step, or a drop)."""
        if self.watch is not None:
            self.watch.report(self.worker.worker_number, self.worker.episodes.count(fragments))

    async def run(self, rule: StopRule, lacking: int | None = None) -> None:
        """Step every env until ``rule`` (or ``lacking`` more transitions) says stop."""
        steps = rule.start_envs(self.worker.n_envs, lacking)
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        if self.round is not None:
            self.round.join(stop)
        if self.pool is not None:
            self.pool.join(stop)
        lanes = _Lanes()
        tasks = [
            asyncio.ensure_future(self._lane(i, rule, stop, lanes))
            for i in range(self.worker.n_envs)
        ]
        self.host.watch_lanes(tasks)
        try:
            pending: set[asyncio.Future[Any]] = set(tasks)
            cut = False
            while pending:
                done, pending = await asyncio.wait(
                    pending | ({stop} if not cut else set()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                pending.discard(stop)
                for task in done - {stop}:
                    if task.cancelled():
                        if not cut:  # a lane ends cancelled only when this loop cancels it
                            raise RuntimeError(
                                f"a lane of worker {self.worker.worker_number} ended cancelled"
                            )
                    elif task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                if stop.done() and not cut:
                    # The share is in. A plain call's steps in flight would be dropped: cut
                    # them; a stream round's are left running for the next round (the lane
                    # that awaits one becomes its carrier: it returns the step's outcome).
                    cut = True
                    self.detaching = self.carry
                    keep: list[int] = []
                    for i, task in enumerate(tasks):
                        if task not in pending:
                            continue
                        if i in lanes.stepping:
                            self._detach(i, rule, lanes.stepping[i])
                            lanes.detached.add(i)
                            self.host.in_flight[i] = task
                            task.add_done_callback(_seen)  # also if no call takes it up
                            pending.discard(task)
                            if self.pool is not None and i not in self.runs:
                                keep.append(i)  # the next call records its row again
                        else:
                            task.cancel()
                    if keep:
                        self.keep_rows(np.array(keep, dtype=np.int64))
        finally:
            kept = [task for i, task in enumerate(tasks) if i not in lanes.detached]
            for task in kept:
                task.cancel()
            if kept:
                await asyncio.wait(kept)
            if not stop.done():
                stop.cancel()
            self.detaching = False
        rule.took(steps)

    @_watchdog.env_site("step")  # its frame, where it awaits its env's step itself
    async def _lane(self, i: int, rule: StopRule, stop: asyncio.Future[None], lanes: _Lanes) -> Any:
        """Env ``i``'s loop (its cursor, length and return in locals, written back where read).

        In a stream round (``carry``) a lane whose step is in flight when the round ends is left
        running as that step's carrier: it returns the step's outcome (or raises its error) for
        the next round's lane of env ``i`` to record, and touches nothing else. No task or shield
        per step: each would live as long as the step.
        """
        worker = self.worker
        episodes = worker.episodes
        host = self.host
        acting, bare = self.acting, self.bare
        step_soon = None if bare is None else bare.step_soon
        # A host in this process with no timeout or metrics: the env's step awaited here, in
        # the host's window of env calls.
        own = cast(DirectStepHost, host)
        direct = None
        if acting is None and hasattr(host, "direct_steps"):
            direct = own.direct_steps(windowed=True)
        envs: list[Any] = [] if direct is None else direct
        window = None if direct is None else own.window
        request = None if self.requests is None else self.requests.request
        # Without fixed shares (no batch to reproduce bit for bit) and with metrics off (they
        # time the merged calls), the built-in random agent's row is drawn by the lane itself:
        # no request, no future, no second wake-up per step (see row_draw).
        inline = self.pool is not None and request is not None and self.requests.timer is None  # type: ignore[union-attr]
        draw_agent: Any = None
        draw: Callable[[], Any] | None = None
        timed = i in self.timed
        buffers = host.buffers
        recorder = episodes.recorder
        rows = recorder.rows
        cursor = recorder.cursor
        assert cursor is not None
        one = np.zeros(worker.n_envs, dtype=bool)
        one[i] = True
        samples = rule.mode is CallMode.SAMPLES
        carry = self.carry
        in_flight = host.in_flight
        carrying, detached = lanes.stepping, lanes.detached
        flat = isinstance(buffers.obs, np.ndarray) and isinstance(buffers.actions, np.ndarray)
        deadline_free = self.episode_timeout is None
        w = worker.worker_number
        needs_reset, lengths, returns = episodes.needs_reset, episodes.lengths, episodes.returns
        deadlines = self.deadlines
        steps_left = rule.env_steps if rule.mode is CallMode.FRAGMENTS else None
        # fraction_samples of fragments: the quota counts the recorded steps before every step.
        live_cursor = steps_left is not None and self.quota is not None
        lane_round = self.round
        may_stop = None
        if self.quota is not None:
            may_stop = functools.partial(self._may_stop, steps_left is not None)
        # Until when the lane steps (no closures: a lane lives as long as its call, and their
        # cells and functions would be objects more, per env, for the cyclic collector).
        pool = self.pool
        if pool is not None:  # without fixed shares: until the call's quota is in
            until = _UNTIL_POOL
        elif lane_round is not None:  # within a stream round: until the round is done
            until = _UNTIL_ROUND
        elif samples and may_stop is None:
            until = _UNTIL_NEED
        elif steps_left is not None and may_stop is None:
            until = _UNTIL_LEFT
        else:
            until = _UNTIL_RULE
        more = self._more
        # Where the host's agent copy acts and the call counts steps: runs of steps, one reply
        # each (plain rows; no deadline to cut a run at).
        runs = (
            acting is not None
            and flat
            and deadline_free
            and (until == _UNTIL_POOL or until == _UNTIL_LEFT)
        )
        # Fragments: the env's steps left live in a local too (written back where the quota
        # reads them, and at the exit).
        left = 0 if steps_left is None else int(steps_left[i])
        loop = asyncio.get_running_loop()
        t, length, ret = int(cursor[i]), int(lengths[i]), float(returns[i])
        deadline = float(deadlines[i])
        # A step the previous round left running: its observation and action are in row t.
        carried = in_flight.get(i)
        stepping = False
        try:
            while carried is not None or (
                not pool.met  # type: ignore[union-attr]
                if until == _UNTIL_POOL
                else more(until, i, rule, left, may_stop)
            ):
                try:
                    if carried is not None:
                        stepping = True
                        if pool is not None and i in episodes.carried_rows:  # kept till recorded
                            rows.cover(t, buffers.obs, buffers.actions)  # the previous call's
                            episodes.carried_rows.put_back(rows, t, i, forget=False)
                        result = (
                            carried.result() if carried.done() else await asyncio.shield(carried)
                        )
                    else:
                        if needs_reset[i]:
                            length, ret = 0, 0.0  # a reset cut by its deadline leaves none
                            still = functools.partial(more, until, i, rule, left, may_stop)
                            started = await self._start_episode(i, one, still)
                            length, ret, deadline = 0, 0.0, float(deadlines[i])
                            if not started:
                                break
                        if t >= rows.size:
                            rows.cover(t, buffers.obs, buffers.actions)
                        observation: Any = None
                        if flat:  # recorded first; an agent asked reads the row (below)
                            rows.obs[t, i] = buffers.obs[i]
                        else:
                            observation = tree_map(functools.partial(_row_copy, i), buffers.obs)
                            put_row(rows.obs, (t, i), observation)
                        when = None if deadline == _NEVER else deadline
                        step: Awaitable[Any] | None
                        if acting is None:
                            if inline and worker.agent is not draw_agent:  # (an update's)
                                draw_agent = worker.agent
                                draw = row_draw(draw_agent, self.requests.action_space)  # type: ignore[union-attr, arg-type]
                            if draw is not None:
                                action, infos = draw(), {}
                            else:  # the record's row (never an arena's): no second copy
                                if observation is None:
                                    observation = rows.obs[t, i]
                                action, infos = await request(  # type: ignore[misc]
                                    worker.agent,  # type: ignore[arg-type]
                                    w,
                                    observation,
                                    i,  # a row the agent failed (AgentRowsError): i's fault
                                )
                            if flat and not infos and not rows.agent_infos:
                                rows.actions[t, i] = action
                            else:
                                self._put_action(rows, t, i, action, infos, flat)
                            step = (
                                None
                                if direct is not None and when is None
                                else host.step_one(i, action, when, timed)
                                if step_soon is None
                                else step_soon(i, action, when)
                            )
                        elif runs:  # the host's agent copy acts: a run of steps, one reply
                            step = self._run_soon(acting, i, left, when)
                        else:  # the host's agent copy acts: the action comes with the reply
                            step = acting.act_soon(i, worker.agent_version, when)
                        rows.versions[t, i] = worker.agent_version
                        stepping = True
                        if carry:  # a round's end may leave this lane as the step's carrier
                            carrying[i] = (t, length, ret, left)
                        try:
                            if step is not None:
                                result = await step
                            else:
                                if window is not None and not window.enter_now():
                                    await window.enter()
                                try:
                                    result = await envs[i].step(action)  # the env's call
                                except (asyncio.CancelledError, Exception) as exc:
                                    raise own.step_error(i, exc) from exc
                                finally:
                                    if window is not None:
                                        window.leave()
                                result = own.finish_step(i, result)
                        except asyncio.CancelledError:
                            if bare is not None:  # a bare future: the host is told
                                bare.abandon(i)
                            raise
                        finally:
                            if carry:
                                del carrying[i]
                            if runs:
                                self.runs.discard(i)
                        if carry and i in detached:
                            return result
                except DeadlinePassed as cut:
                    if i in detached:
                        raise
                    in_flight.pop(i, None)
                    carried, stepping = None, False
                    cursor[i], lengths[i], returns[i] = t, length, ret
                    self._cut(i)
                    length, ret = 0, 0.0
                    if cut.running:  # its env is tied up until the call returns: abandoned
                        await self.rebuild_env(i, self._abandoned(i))
                    continue
                except WorkerError as exc:
                    if not exc.retry or i in detached:
                        raise
                    failure: WorkerError = exc
                except asyncio.CancelledError as exc:
                    if not cancelled_by_env() or i in detached:
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
                    recorded = self.drop_episode(i)
                    if steps_left is not None:  # a fragment call redoes the dropped steps
                        left += recorded
                        steps_left[i] = left
                    if may_stop is not None:  # the worker's count went down
                        self._report(steps_left is not None)
                    if pool is not None:
                        pool.set(w, episodes.count(True))
                    length, ret = 0, 0.0
                    await self.rebuild_env(i, failure)
                    continue
                if carried is not None:
                    in_flight.pop(i, None)
                    episodes.carried_rows.drop(i)
                    carried = None
                stepping = False
                split = False
                if acting is not None and type(result) is StepRun:  # a run: one reply
                    if pool is not None:  # past the quota, the rest opens the next call
                        result, split = within_quota(result, pool, host, episodes, i)
                    n = put_run(rows, t, i, result, (buffers.obs, buffers.actions))
                    for reward in result.rewards:  # the per-step float sums
                        ret += reward
                    terminated, truncated = result.terminated, result.truncated
                else:
                    n = 1
                    if acting is None:
                        reward, terminated, truncated, info = result
                    else:
                        reward, terminated, truncated, info, action, infos, acted = result
                        if acted >= 0:  # an update reached the host first: it acted
                            rows.versions[t, i] = acted
                        if action is None:  # the host wrote it into the shared step buffers
                            action = (
                                buffers.actions[i]
                                if flat
                                else tree_map(functools.partial(_row_copy, i), buffers.actions)
                            )
                        self._put_action(rows, t, i, action, infos, flat)
                    rows.rewards[t, i] = reward
                    if info:
                        row = rows.env_infos.get(t)
                        if row is None:
                            row = rows.env_infos[t] = [{} for _ in range(worker.n_envs)]
                        row[i] = info
                    ret += reward
                t += n
                length += n
                if pool is not None:
                    cursor[i] = t  # the quota's count may be read for a drop
                    pool.add(w, n)
                if steps_left is not None:
                    left -= n
                    if live_cursor:
                        steps_left[i] = left
                        cursor[i] = t
                        self._report(True)
                if terminated or truncated:
                    cursor[i], lengths[i], returns[i] = t, length, ret
                    self.end_episode(i, t - 1)
                    length, ret = 0, 0.0
                    if samples and not rule.env_more(i, episodes.active, may_stop):
                        if lane_round is not None:
                            lane_round.satisfied(w)  # sets every worker's stop when all are in
                        elif not stop.done():
                            stop.set_result(None)
                elif deadline != _NEVER and deadline <= loop.time():
                    cursor[i], lengths[i], returns[i] = t, length, ret
                    self._cut(i)
                    length, ret = 0, 0.0
                if split:
                    break
        except asyncio.CancelledError:
            if i in detached:
                raise  # a carrier: the next round's lane (or the drop of it) sees the cancel
            if not (self.detaching and i in in_flight) and (stepping or not self.detaching):
                # Cut off mid-step (its share is in, or the call was cancelled): the env may
                # be mid-step, so it is reset before it is used again.
                needs_reset[i] = True
                task = in_flight.pop(i, None)
                if task is not None:
                    task.cancel()
            raise
        finally:
            if i not in detached:  # a carrier's were written before its step
                cursor[i], lengths[i], returns[i] = t, length, ret
                if steps_left is not None:
                    steps_left[i] = left
        return None

    def _run_soon(self, acting: ActingHost, i: int, left: int, when: float | None) -> Any:
        """Env ``i``'s next run of steps (one step: a plain request): as many as its steps left
        (fragments with fixed shares) or its part of what the call's quota lacks."""
        pool = self.pool
        k = min(RUN_STEPS, left) if pool is None else pool.run_steps(RUN_STEPS)
        if k < 2:
            return acting.act_soon(i, self.worker.agent_version, when)
        self.runs.add(i)
        return acting.run_soon(i, k, pool is None, when)

    @staticmethod
    def _put_action(rows: Any, t: int, i: int, action: Any, infos: Any, flat: bool) -> None:
        """Record env ``i``'s action and agent infos at its row ``t``."""
        if flat:
            rows.actions[t, i] = action
        else:
            put_row(rows.actions, (t, i), action)
        if infos or rows.agent_infos:
            store_agent_infos(rows, t, infos, i)

    def _more(
        self, until: int, i: int, rule: StopRule, left: int, may_stop: Callable[[], bool] | None
    ) -> bool:
        """Whether env ``i``'s lane takes another step (``until``: which rule applies)."""
        if until == _UNTIL_POOL:
            return not self.pool.met  # type: ignore[union-attr]
        if until == _UNTIL_ROUND:
            return not self.round.done  # type: ignore[union-attr]
        if until == _UNTIL_NEED:
            return rule.need > 0
        if until == _UNTIL_LEFT:
            return left > 0
        return rule.env_more(i, self.worker.episodes.active, may_stop)

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
        reset = None if self.acting is not None else getattr(worker.agent, "reset", None)
        if reset is not None:  # (an acting host's agent copy was reset with the env)
            reset(one.copy())
        return more()

    def _detach(self, i: int, rule: StopRule, lane: tuple[int, int, float, int]) -> None:
        """Write the state of env ``i``'s lane, left running as its step's carrier, where the
        next round's lane reads it: its row, length, return and steps left."""
        episodes = self.worker.episodes
        cursor = episodes.recorder.cursor
        assert cursor is not None
        t, length, ret, left = lane
        cursor[i], episodes.lengths[i], episodes.returns[i] = t, length, ret
        # A fragment cut now ends at the observation the step left running started from (its
        # host may be writing later ones into the step buffers as it goes).
        obs = episodes.recorder.rows.obs
        if type(obs) is np.ndarray:
            episodes.cut_obs[i] = row_copy(obs[t], i)
        else:
            episodes.cut_obs[i] = tree_map(lambda x: row_copy(x[t], i), obs)
        if rule.env_steps is not None and rule.mode is CallMode.FRAGMENTS:
            rule.env_steps[i] = left

    def keep_rows(self, envs: np.ndarray) -> None:
        """Copy the rows of the steps ``envs`` leave in flight, for the next call (one pass)."""
        episodes = self.worker.episodes
        cursor = episodes.recorder.cursor
        assert cursor is not None
        episodes.carried_rows.keep(episodes.recorder.rows, cursor[envs], envs)

    def drop_episode(self, i: int) -> int:
        """Drop env ``i``'s episode in progress (it is reset next); the steps it had recorded."""
        recorded = self.worker.episodes.drop_env(i)
        self._closed(i)
        return recorded

    def _closed(self, i: int) -> None:
        if self.admission is not None:
            self.admission.closed((self.worker.worker_number, i))

    async def rebuild_env(self, i: int, failure: WorkerError) -> None:
        """Rebuild env ``i``; past the call's ``max_restarts`` for it, ``failure`` is raised."""
        worker = self.worker
        w = worker.worker_number
        while True:
            if not failure.charged:  # not its fault (another env's, or a deadline): no budget
                logger.info(
                    "worker %d: rebuilding env %d (not counted against max_restarts) after %s",
                    w,
                    i,
                    str(failure).split("\n", 1)[0],
                )
            elif self.env_restarts[i] >= self.settings.max_restarts:
                failure.retry = False  # the call fails: no worker-wide rebuild either
                raise failure
            else:
                self.env_restarts[i] += 1
                worker.restarts += 1
                self.settings.restarted(w, failure)
                logger.warning(
                    "worker %d: rebuilding env %d (restart %d of at most %d in this call) after "
                    "%s: %s",
                    w,
                    i,
                    self.env_restarts[i],
                    self.settings.max_restarts,
                    type(failure).__name__,
                    str(failure).split("\n", 1)[0],
                )
            try:
                await self.host.rebuild_one(i, worker.env_chain(i), worker.next_env_seed(i))
                worker.episodes.fresh[i] = True
                return
            except WorkerError as exc:
                if not exc.retry:
                    raise
                failure = exc

    def _abandoned(self, i: int) -> StepTimeoutError:
        """Why env ``i`` is rebuilt when its episode's deadline cut a call it could not stop:
        not charged against ``max_restarts`` (the deadline's doing, not a fault)."""
        w = self.worker.worker_number
        abandoned = StepTimeoutError(
            f"a call of the env still ran at its episode's deadline (episode_timeout="
            f"{self.episode_timeout:g}s) and its thread cannot be stopped: the env is abandoned "
            "(closed once the call returns) and rebuilt",
            worker=w,
            env=i,
        )
        abandoned.charged = False
        return abandoned

    def end_episode(self, i: int, t: int) -> None:
        """Env ``i``'s episode ended at its row ``t`` (the host wrote its flags and last obs)."""
        buffers, episodes = self.host.buffers, self.worker.episodes
        ended, version = np.array([i]), self.worker.agent_version
        episodes.close_episodes(ended, t, buffers.terminated, buffers.final_obs, {}, version)
        episodes.needs_reset[i] = True  # reset before its next step
        episodes.deadlines[i] = np.inf
        self._closed(i)

    def _cut(self, i: int) -> None:
        """Env ``i``'s episode passed its deadline: it ends truncated (``deadline`` in its info)."""
        episodes = self.worker.episodes
        cursor = episodes.recorder.cursor
        assert cursor is not None
        if episodes.lengths[i] > 0:
            buffers = self.host.buffers
            buffers.terminated[i] = False
            buffers.truncated[i] = True
            put_row(buffers.final_obs, i, tree_map(lambda x: x[i], buffers.obs))
            episodes.episode_info[i]["deadline"] = True
            self.end_episode(i, int(cursor[i]) - 1)
        else:  # no step taken: nothing to end
            self.drop_episode(i)
