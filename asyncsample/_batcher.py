"""One merger of agent requests: ``inference="batched"``, and the envs stepped one at a time.

:class:`Batcher` stacks the observations waiting for actions (a worker's rows,
:meth:`Batcher.get_actions`, or one env's row on the lanes, :meth:`Batcher.request`), asks each
agent once and splits the output back by rows. It knows whether each worker in the call runs
Python, waits for actions or waits on its host: ``"lockstep"`` flushes when every worker waits
for actions (reproducible), ``"eager"`` as soon as none runs Python, deferred with
``loop.call_soon`` so that host replies already read resume their workers first. Lanes are never
all waiting: their requests are flushed at the end of each pass of the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import itertools
import operator
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import gymnasium as gym
import numpy as np

from asyncsample import _validate
from asyncsample._action_check import (
    AgentOutputCheck,
    action_rows,
    check_actions,
    info_rows,
    make_action_check,
    row_value,
)
from asyncsample._clock import AgentTimer
from asyncsample._passes import pass_queue
from asyncsample._tree import Tree, stack_rows, tree_concat, tree_leaves, tree_map
from asyncsample.agent import Agent, AgentOutput, trusted_actions
from asyncsample.errors import AgentRowsError

__all__ = ["Batched", "Batcher", "FlushRule", "RowsDelivery"]

FlushRule = Literal["lockstep", "eager"]
_FLUSH_RULES = ("lockstep", "eager")

_RUNNING, _WAITING, _ON_HOST = 0, 1, 2

#: ``"eager"`` decides this many loop iterations after the last request: a host reply reaches
#: its worker one iteration after the socket is read; the rest is margin for a busy loop.
SETTLE_ITERATIONS = 3

#: The workers' observations of a merged call are viewed in place (no copy) from this many bytes
#: on; fewer are copied into one array, which costs less than proving them adjacent (1 us
#: against 12 us for 8 rows of 4 floats, 2026-12-01).
VIEW_BYTES = 1 << 18


@dataclass(frozen=True)
class Batched:
    """Options of ``inference="batched"`` (pass an instance as ``Sampler(inference=...)``).

    Attributes:
        flush: ``"lockstep"`` (reproducible for a fixed seed, also with a stochastic agent) or
            ``"eager"`` (no waiting for stragglers; batch composition depends on timing).
            ``None`` (default): ``"lockstep"``, or ``"eager"`` where envs step one at a time.
        threaded: run a blocking ``get_actions`` in a helper thread, so the event loop keeps
            reading host replies during the forward pass (helps when the agent releases the GIL,
            e.g. torch; costs a thread hand-off per call). Async agents are always awaited in
            the loop.
        min_fraction: ``"eager"`` only: also wait until at least this fraction of the workers
            in the call are waiting for actions (Sample Factory waits for about a third), unless
            every worker is; ``0`` flushes as soon as no worker is running Python.
    """

    flush: FlushRule | None = None
    threaded: bool = False
    min_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.flush is not None:
            _validate.choice("flush", self.flush, _FLUSH_RULES)
        _validate.flag("threaded", self.threaded)
        _validate.unit_interval("min_fraction", self.min_fraction)

    def check_per_env(self, backend: str) -> None:
        """Refuse a ``"lockstep"`` flush or a ``min_fraction``: lanes (``backend``) cannot wait."""
        if self.flush == "lockstep" or self.min_fraction:
            raise ValueError(
                f"inference=Batched(flush={self.flush!r}, min_fraction={self.min_fraction}): "
                f"backend={backend!r} steps each env on its own and merges the requests of the "
                "envs ready in one pass of the event loop (flush='eager'); it cannot wait for "
                "every worker ('lockstep') nor for a fraction of them (min_fraction): leave "
                "them at their defaults"
            )


@dataclass(slots=True)
class _Request:
    worker: int
    agent: Agent | None  # None: the shared agent, read at the flush
    observations: Tree
    rows: int
    future: asyncio.Future[Any]
    one: bool = False  # one env's row (no leading axis): answered with its action and infos
    env: int | None = None  # that env's index in its worker (named by a failed row's fault)
    envs: list[int] | None = None  # rows of these envs of the worker, checked as the lanes' are


class RowsDelivery:
    """Where the output of an :meth:`Batcher.ask_rows` request goes: ``deliver`` is called
    once, with ``(actions, agent_infos, faults)`` (``faults``: ``(row, error)`` of each row the
    agent failed, :class:`~asyncsample.AgentRowsError`) or with the error that failed them all.
    It stands in for a request's future (one object per request of many rows); :meth:`cancel`:
    its asker is gone (an agent call whose every asker is gone is cancelled)."""

    __slots__ = ("_callbacks", "_cancelled", "_deliver", "_done")

    def __init__(self, deliver: Callable[[Any], None]) -> None:
        self._deliver = deliver
        self._done = False
        self._cancelled = False
        self._callbacks: list[Callable[[Any], None]] = []

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return self._cancelled

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._callbacks.append(callback)

    def _end(self) -> None:
        self._done = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def set_result(self, result: Any) -> None:
        if not self._done:
            self._end()
            self._deliver(result)

    def set_exception(self, exc: BaseException) -> None:
        if not self._done:
            self._end()
            self._deliver(exc)

    def cancel(self) -> None:
        if not self._done:
            self._cancelled = True
            self._end()


@dataclass
class BatchStats:
    """How the batcher's calls were made up (for benchmarks and tuning): agent ``calls``,
    observation ``rows`` in all, and how many calls had each number of workers."""

    calls: int = 0
    rows: int = 0
    workers_per_call: Counter[int] = field(default_factory=Counter)

    @property
    def mean_workers(self) -> float:
        """Mean number of workers per call."""
        n = sum(self.workers_per_call.values())
        return sum(k * v for k, v in self.workers_per_call.items()) / n if n else 0.0


class Batcher:
    """Merges the concurrent agent requests of a sampler's workers or envs (module docstring).

    Args:
        options: the flush rule and threading.
        agent_source: the current shared agent, read at every flush, for :meth:`get_actions`.
        action_space: for :meth:`request` (lanes): checks the merged actions; given, requests are
            flushed at the end of every pass.
    """

    def __init__(
        self,
        options: Batched,
        agent_source: Callable[[], Agent] | None = None,
        action_space: gym.Space[Any] | None = None,
    ) -> None:
        self._agent_source = agent_source
        self.options = options
        self.action_space = action_space
        self._per_pass = action_space is not None
        self._values = None if action_space is None else make_action_check(action_space)
        self._checks: dict[int, tuple[Callable[[], object], AgentOutputCheck, bool]] = {}
        self._state: dict[int, int] = {}
        self._pending: list[_Request] = []
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._busy = False  # an async or threaded agent call is in flight (worker rows)
        self._tasks: set[asyncio.Future[Any]] = set()
        self._quiet = 0  # loop iterations since the last state change
        eager = options.flush == "eager" and not self._per_pass  # lanes: nothing to settle
        self._settle = SETTLE_ITERATIONS if eager else 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._agent_lock = threading.Lock()
        self.stats = BatchStats()
        self.timer: AgentTimer | None = None
        """With metrics on, where each merged call's seconds and rows go."""

    # -- hooks called by the sampler and the workers ------------------------------------------

    def join(self, worker: int) -> None:
        """Worker ``worker`` takes part in the current sampler call."""
        if not self._per_pass:
            self._state[worker] = _RUNNING

    def leave(self, worker: int) -> None:
        """Worker ``worker`` is done with the current call (finished, failed or cancelled)."""
        if self._per_pass:
            return
        self._state.pop(worker, None)
        self._pending = [r for r in self._pending if r.worker != worker]
        self._schedule()

    def host_wait(self, worker: int) -> None:
        """Worker ``worker`` is about to await a step of its env host."""
        if worker in self._state:
            self._state[worker] = _ON_HOST
            self._schedule()

    def host_done(self, worker: int) -> None:
        """Worker ``worker`` resumed after its host step."""
        if worker in self._state:
            self._state[worker] = _RUNNING

    async def get_actions(self, worker: int, observations: Tree) -> AgentOutput:
        """Worker ``worker``'s rows of the next merged call on ``observations``."""
        leaf = tree_leaves(observations)[0]
        future: asyncio.Future[AgentOutput] = asyncio.get_running_loop().create_future()
        request = _Request(worker, None, observations, len(leaf), future)
        self._pending.append(request)
        self._state[worker] = _WAITING
        self._schedule()
        try:
            return await future
        except asyncio.CancelledError:
            if request in self._pending:
                self._pending.remove(request)
            raise

    def request(
        self, agent: Agent, worker: int, observation: Tree, env: int | None = None
    ) -> asyncio.Future[Any]:
        """A future of ``(action, agent_infos)`` for ``observation`` of env ``env`` of
        ``worker``; a :class:`~asyncsample.WorkerError` of that env where the agent failed its
        row (:class:`~asyncsample.AgentRowsError`)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append(_Request(worker, agent, observation, 1, future, True, env))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._check)
        return future

    def ask_rows(
        self,
        agent: Agent,
        worker: int,
        observations: Tree,
        envs: list[int],
        deliver: Callable[[Any], None],
    ) -> RowsDelivery:
        """Ask ``agent`` for the actions of ``envs`` of ``worker`` (their ``observations``, one
        row each), merged with the other requests of this pass: one request, however many rows
        (the ready batches of :class:`~asyncsample._env_runs.RunStepper`), answered through
        ``deliver`` (see :class:`RowsDelivery`). The rows are checked as the lanes' are, each a
        fault of its env alone."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        to = RowsDelivery(deliver)
        request = _Request(worker, agent, observations, len(envs), to, envs=envs)  # type: ignore[arg-type]
        self._pending.append(request)
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._check)
        return to

    def calls_on(self, agent: Agent) -> bool:
        """Whether a call of ``agent`` is asked and not yet made, or any agent call is running
        (awaited, or in the helper thread): parameters set now could reach its rows."""
        return bool(self._tasks) or any(r.agent is agent for r in self._pending)

    async def made(self, agent: Agent) -> None:
        """Return once :meth:`calls_on` ``agent`` is false: the calls asked are made at the end
        of the pass; a running call is awaited (not polled: an LLM's may take seconds)."""
        while self.calls_on(agent):
            if self._tasks:
                await asyncio.wait(list(self._tasks))
            else:
                await asyncio.sleep(0)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold off agent calls (an update must not race a forward pass in the helper thread)."""
        with self._agent_lock:
            yield

    def close(self) -> None:
        """Release the helper thread (a call still running finishes on its own)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    async def aclose(self) -> None:
        """Cancel the agent calls still awaited."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    # -- flushing -----------------------------------------------------------------------------

    def _schedule(self) -> None:
        self._quiet = 0
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._check)

    def _ready(self) -> bool:
        if not self._pending:
            return False
        if self._per_pass:
            return True
        if self._busy:
            return False
        state = self._state.values()
        waiting, total = len(self._pending), len(self._state)
        if self.options.flush != "eager" or waiting == total:
            return waiting == total
        return _RUNNING not in state and waiting >= self.options.min_fraction * total

    def _check(self) -> None:
        if self._quiet < self._settle and self._pending and not self._busy:
            # Let the host replies already read run their workers first (see module doc).
            self._quiet += 1
            asyncio.get_running_loop().call_soon(self._check)
            return
        self._scheduled = False
        if not self._ready():
            return
        pending, self._pending = self._pending, []
        if self._per_pass:  # one call per agent, rows in the order the envs asked
            by_agent: dict[tuple[int, bool], list[_Request]] = {}
            for r in pending:
                if not r.future.done():  # cancelled lanes drop out
                    by_agent.setdefault((id(r.agent), r.envs is None), []).append(r)
            for requests in by_agent.values():
                agent = requests[0].agent
                if getattr(agent, "merge_rows", True) is False:  # a call per row: none waits
                    for r in requests:  # for another's reply (requests sent one per row)
                        self._call(agent, [r])  # type: ignore[arg-type]
                else:
                    self._call(agent, requests)  # type: ignore[arg-type]
            return
        requests = sorted((r for r in pending if not r.future.done()), key=lambda r: r.worker)
        if requests:
            assert self._agent_source is not None
            self._call(self._agent_source(), requests)

    def _call(self, agent: Agent, requests: list[_Request]) -> None:
        """One agent call on the stacked rows of ``requests``."""
        workers = set(map(_worker_of, requests))
        rows = len(requests) if requests[0].one else sum(r.rows for r in requests)
        stats = self.stats
        stats.calls += 1
        stats.workers_per_call[len(workers)] += 1
        stats.rows += rows
        timer = self.timer
        weight = 0 if timer is None else timer.due(rows)
        start = time.perf_counter() if weight else 0.0
        try:
            observations = _stack(requests)
            if self.options.threaded and not inspect.iscoroutinefunction(agent.get_actions):
                call = self._call_in_thread(agent, observations)
                self._start(agent, requests, call, (start, weight))
                return
            with self._agent_lock:
                result: Any = agent.get_actions(observations)
            if type(result) is not tuple and inspect.isawaitable(result):
                self._start(agent, requests, result, (start, weight))
                return
        except AgentRowsError as exc:  # some rows failed: each is its env's fault alone
            result = exc
        except Exception as exc:
            self._fail(requests, exc)
            return
        if weight and timer is not None:  # a call the metrics' timer samples
            timer.took(time.perf_counter() - start, weight)
        self._deliver(agent, requests, result)

    def _call_in_thread(self, agent: Agent, observations: Tree) -> Any:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="asyncsample-batcher"
            )
        lock = self._agent_lock

        def call() -> Any:
            with lock:
                return agent.get_actions(observations)

        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, call)

    def _start(
        self, agent: Agent, requests: list[_Request], call: Any, timing: tuple[float, int]
    ) -> None:
        self._busy = not self._per_pass
        task = asyncio.ensure_future(call)  # a task, or the helper thread's future
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._finished, agent, requests, timing))
        if self._per_pass:  # lanes: a call whose every requester gave up is cancelled
            abandoned = functools.partial(_cancel_if_abandoned, task, requests)
            for r in requests:
                r.future.add_done_callback(abandoned)

    def _finished(
        self,
        agent: Agent,
        requests: list[_Request],
        timing: tuple[float, int],
        task: asyncio.Future[Any],
    ) -> None:
        self._tasks.discard(task)
        self._busy = False
        start, weight = timing
        if weight and self.timer is not None:  # a call the metrics' timer samples
            self.timer.took(time.perf_counter() - start, weight)
        if task.cancelled():
            # Not a CancelledError: the requesters would take it for their own cancellation.
            what = f"the agent's get_actions ({_rows_of(requests)}) was cancelled"
            self._fail(requests, RuntimeError(what))
        elif (exc := task.exception()) is not None:
            if isinstance(exc, AgentRowsError):  # some rows failed: each its env's fault
                self._deliver(agent, requests, exc)
            else:
                self._fail(requests, exc)
        else:
            self._deliver(agent, requests, task.result())
        if not self._per_pass:
            self._schedule()

    def _fail(self, requests: list[_Request], exc: BaseException) -> None:
        for r in requests:
            if not r.future.done():
                self.host_done(r.worker)
                r.future.set_exception(exc)

    def _deliver(self, agent: Agent, requests: list[_Request], result: Any) -> None:
        """The agent's output (or its :class:`AgentRowsError`) to the requests."""
        failed: AgentRowsError | None = None
        if isinstance(result, AgentRowsError):
            failed, result = result, (result.actions, result.agent_infos)
        if requests[0].one:
            self._deliver_rows(agent, requests, result, failed)
            return
        if requests[0].envs is not None:
            self._deliver_env_rows(agent, requests, result, failed)
            return
        try:
            parts = _split(result, requests)
            if failed is not None:
                failed.check_rows(sum(r.rows for r in requests), _rows_of(requests))
        except ValueError as exc:
            for r in requests:
                self._fail([r], ValueError(f"{exc}; raised in worker {r.worker}"))
            return
        start = 0
        for r, part in zip(requests, parts):
            first, start = start, start + r.rows
            if r.future.done():
                continue
            self.host_done(r.worker)
            # A worker's rows are stepped together: a failed row fails its worker's step, as an
            # env fault there does (its host is restarted).
            bad = [] if failed is None else [j for j in failed.failures if first <= j < start]
            if bad:
                fault = failed.row_fault(bad[0], worker=r.worker, env=bad[0] - first)  # type: ignore[union-attr]
                r.future.set_exception(fault)
            else:
                r.future.set_result(part)

    def _output(
        self, agent: Agent, requests: list[_Request], n: int, result: Any
    ) -> tuple[Any, dict[str, np.ndarray], bool, int]:
        """``agent``'s merged output for ``n`` rows of ``requests``: its actions (as rows of the
        space) and agent infos, checked; whether its actions are trusted; the first worker."""
        worker = min(map(_worker_of, requests))
        check, trusted = self._check_of(agent, worker)
        check.worker, check.n_envs = worker, n
        actions, infos = check.output(result)
        if self.action_space is not None:
            actions = action_rows(actions, self.action_space)
        return actions, infos, trusted, worker

    def _deliver_rows(
        self,
        agent: Agent,
        requests: list[_Request],
        result: Any,
        failed: AgentRowsError | None = None,
    ) -> None:
        """Each env its action and agent infos, the merged output checked first as rows; the
        rows ``failed`` names get their env's fault instead (the others are delivered)."""
        n = len(requests)
        try:
            actions, infos, trusted, worker = self._output(agent, requests, n, result)
            if failed is not None:
                requests, actions, infos = self._fail_rows(requests, actions, infos, failed)
                n = len(requests)
                if not n:
                    return
            actions = check_actions(
                actions,
                _like_rows(actions, n),
                worker=worker,
                action_space=self.action_space,  # type: ignore[arg-type]
                values=None if trusted else self._values,
                rows=functools.partial(_rows_of, requests),
            )
        except Exception as exc:
            self._fail(requests, exc)
            return
        if type(actions) is np.ndarray and not infos:  # the common case: a row each, no infos
            for r, action in zip(requests, actions):
                future = r.future
                if not future.done():
                    future.set_result((action, {}))
            return
        plain = isinstance(actions, np.ndarray)
        for j, r in enumerate(requests):
            if r.future.done():
                continue
            action = actions[j] if plain else tree_map(lambda a, j=j: a[j], actions)
            r.future.set_result(
                (action, {k: row_value(v, j) for k, v in infos.items()} if infos else {})
            )

    def _deliver_env_rows(
        self,
        agent: Agent,
        requests: list[_Request],
        result: Any,
        failed: AgentRowsError | None = None,
    ) -> None:
        """:meth:`ask_rows` requests their rows of the output, checked as :meth:`_deliver_rows`
        checks the lanes' rows; a row ``failed`` names is its env's fault alone."""
        n = sum(r.rows for r in requests)
        try:
            actions, infos, trusted, worker = self._output(agent, requests, n, result)
            bad: list[int] = []
            if failed is not None:
                failed.check_rows(n, _rows_of(requests))
                bad = sorted(failed.failures)
            rows = functools.partial(_rows_of, requests)
            # One action per row; the values of the rows the agent did not fail in range.
            space = self.action_space
            values = None if trusted else self._values
            like = _like_rows(actions, n)
            check_actions(
                actions, like, worker=worker, action_space=space,  # type: ignore[arg-type]
                values=None if bad else values, rows=rows,
            )  # fmt: skip
            good = np.setdiff1d(np.arange(n), bad) if bad else None
            if good is not None and len(good) and values is not None:
                kept = tree_map(lambda a: np.asarray(a)[good], actions)
                check_actions(
                    kept, _like_rows(kept, len(good)), worker=worker,
                    action_space=space, values=values, rows=rows,  # type: ignore[arg-type]
                )  # fmt: skip
        except Exception as exc:
            self._fail(requests, exc)
            return
        parts: list[tuple[_Request, Any]] = []
        start = 0
        for r in requests:
            first, start = start, start + r.rows
            envs = r.envs
            faults = [
                (j - first, failed.row_fault(j, worker=r.worker, env=envs[j - first]))  # type: ignore[union-attr, index]
                for j in bad
                if first <= j < start
            ]
            part = slice(first, start)
            out = tree_map(lambda a, s=part: a[s], actions), {k: v[part] for k, v in infos.items()}
            parts.append((r, (*out, faults)))
        self._hand_out(parts)

    def _hand_out(self, parts: list[tuple[_Request, Any]]) -> None:
        """Deliver each request its part in the loop's passes of bounded work: each delivery
        sends its envs' steps, and a merged call of every worker's rows would hold the loop
        (:mod:`asyncsample._passes`)."""
        queue = pass_queue(asyncio.get_running_loop())
        for r, part in parts:
            queue.put(r.future.set_result, part)

    def _fail_rows(
        self,
        requests: list[_Request],
        actions: Tree,
        infos: dict[str, np.ndarray],
        failed: AgentRowsError,
    ) -> tuple[list[_Request], Tree, dict[str, np.ndarray]]:
        """Fail the rows ``failed`` names, each with its env's fault; the other requests and
        their rows of ``actions`` and ``infos``."""
        n = len(requests)
        failed.check_rows(n, _rows_of(requests))
        for j in failed.failures:
            r = requests[j]
            if not r.future.done():
                r.future.set_exception(failed.row_fault(j, worker=r.worker, env=r.env))
        keep = np.array([j for j in range(n) if j not in failed.failures], dtype=np.int64)
        # (a list of actions as an array; arrays and ragged columns take rows as they are)
        actions = tree_map(lambda a: (np.asarray(a) if isinstance(a, list) else a)[keep], actions)
        infos = {k: v[keep] for k, v in infos.items()}
        return [requests[j] for j in keep.tolist()], actions, infos

    def _check_of(self, agent: Agent, worker: int) -> tuple[AgentOutputCheck, bool]:
        """The output check of ``agent`` (a new agent object, e.g. an update's, gets a new one)
        and whether its actions are trusted (:func:`trusted_actions`, asked once per agent)."""
        known = self._checks.get(id(agent))
        if known is not None and known[0]() is agent:
            return known[1], known[2]
        try:
            ref: Callable[[], object] = weakref.ref(agent)
        except TypeError:  # not weakly referenceable: keep it (its id cannot be reused then)
            ref = functools.partial(_same, agent)
        check = AgentOutputCheck(worker, 1)
        trusted = trusted_actions(agent, self.action_space)  # type: ignore[arg-type]
        self._checks[id(agent)] = (ref, check, trusted)
        return check, trusted


def _cancel_if_abandoned(
    task: asyncio.Future[Any], requests: list[_Request], _: asyncio.Future[Any]
) -> None:
    """Cancel ``task``, an agent call still running, once every request it serves was cancelled
    (their lanes were: a call cancelled, a share met), so that what it awaits (an LLM server's
    replies) stops too, not after its results would be dropped."""
    if not task.done() and all(r.future.cancelled() for r in requests):
        task.cancel()


_worker_of = operator.attrgetter("worker")


def _same(value: object) -> object:
    """``value`` (a strong reference standing in for a weak one)."""
    return value


def _stack(requests: list[_Request]) -> Tree:
    """The requests' observations as one array (tree) of rows."""
    if requests[0].one:
        first = requests[0].observations
        if isinstance(first, np.ndarray):
            return stack_rows([r.observations for r in requests])
        return tree_map(lambda *xs: stack_rows(xs), *[r.observations for r in requests])
    if len(requests) == 1:
        return requests[0].observations
    parts = [r.observations for r in requests]
    first = parts[0]
    if type(first) is np.ndarray and first.nbytes * len(parts) >= VIEW_BYTES:
        joined = _side_by_side(parts)
        if joined is not None:
            return joined
    return tree_concat(parts)


def _side_by_side(parts: list[Any]) -> np.ndarray | None:
    """The arrays ``parts`` as one array without a copy, when they are contiguous runs of rows
    of the same array one after the other (the workers' rows of one step arena row on
    ``process``: :func:`~asyncsample.backends._slot.step_arenas`), else ``None``."""
    first = parts[0]
    if type(first) is not np.ndarray or not first.flags.c_contiguous or first.ndim == 0:
        return None
    owner = first.base
    end = first.ctypes.data + first.nbytes
    for part in parts[1:]:
        if (
            type(part) is not np.ndarray
            or part.base is not owner
            or part.ctypes.data != end
            or part.dtype != first.dtype
            or part.shape[1:] != first.shape[1:]
            or not part.flags.c_contiguous
        ):
            return None
        end += part.nbytes
    if owner is None:
        return None
    rows = sum(len(p) for p in parts)
    return np.lib.stride_tricks.as_strided(first, (rows, *first.shape[1:]), first.strides)


def _rows_of(requests: list[_Request], workers: list[int] | None = None) -> str:
    """The rows asked for and their workers, for the messages."""
    workers = workers or sorted({r.worker for r in requests})
    names = ", ".join(map(str, workers))
    if requests[0].one:
        return (
            f"{len(requests)} rows, the observations of the envs ready at once of "
            f"worker{'s' if len(workers) > 1 else ''} {names}"
        )
    return f"the {sum(r.rows for r in requests)} stacked observation rows of workers {names}"


def _like_rows(actions: Tree, n: int) -> Tree:
    """``n`` rows of the space's shape, for :func:`check_actions` to compare against."""

    def like(a: Any) -> np.ndarray:
        a = np.asarray(a) if not isinstance(a, np.ndarray) else a
        return np.empty((n, *a.shape[1:]), dtype=a.dtype)

    return tree_map(like, actions)


def _split(result: Any, requests: list[_Request]) -> list[AgentOutput]:
    """Cut a merged agent output into each request's rows (views, no copies)."""
    total = sum(r.rows for r in requests)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError(
            f"action: the shared agent (inference='batched') must return (actions, agent_infos) "
            f"for {_rows_of(requests)}, got {type(result).__name__}"
        )
    actions, infos = result
    actions = tree_map(info_rows, actions)
    infos = {k: info_rows(v) for k, v in (infos or {}).items()}
    named = [("action", "exactly one action", leaf) for leaf in tree_leaves(actions)]
    named += [(f"agent info {k!r}", "one value", v) for k, v in infos.items()]
    for what, one, value in named:
        if value.ndim == 0 or value.shape[0] != total:
            n = "a scalar" if value.ndim == 0 else f"{value.shape[0]} rows"
            raise ValueError(
                f"{what}: the shared agent (inference='batched') must return {one} per row of "
                f"{_rows_of(requests)}, got {n}"
            )
    bounds = [0, *itertools.accumulate(r.rows for r in requests)]
    return [
        (tree_map(lambda x, s=s: x[s], actions), {k: v[s] for k, v in infos.items()})
        for s in itertools.starmap(slice, itertools.pairwise(bounds))
    ]
