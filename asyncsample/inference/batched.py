"""``inference="batched"``: the workers' concurrent ``get_actions`` calls become one call.

Each worker hands its observations to the :class:`Batcher` and awaits its rows of the result.
The batcher stacks the observations of the waiting workers (worker-major rows), asks the one
shared agent once and splits actions and agent infos back by rows. A policy call costs about the
same for 4 rows as for 64 (a torch forward plus a distribution sample is ~200 us), so the number
of calls per env step is what matters.

When to flush is the whole game. The batcher knows the state of every worker in the current
call: running Python, waiting for actions, or waiting on its env host (the worker says so just
before and just after it awaits a host step). Two rules:

- ``"lockstep"`` (default, reproducible): flush when every worker still in the call is waiting
  for actions. Every call then holds the same workers in the same order for a fixed seed, so even
  a stochastic agent with one internal RNG draws the same numbers for the same rows on every run.
  A slow env host delays every worker's next action (a straggler holds the batch).
- ``"eager"``: flush as soon as no worker is running Python, i.e. when no further request can
  arrive before some env step completes. Hosts never idle waiting for a straggler, but which
  workers share a call depends on timing: a stochastic agent's RNG draws go to timing-dependent
  rows (its output is then not reproducible; an agent whose actions depend only on its input
  still is).

A host reply resolves a future, but the worker resumes only when the event loop runs its
callback; deciding at once would flush one row short. The decision is therefore deferred with
``loop.call_soon`` until the ready callbacks of the current loop iteration have run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from asyncsample import _validate
from asyncsample._clock import AgentTimer
from asyncsample._tree import Tree, tree_concat, tree_leaves, tree_map
from asyncsample.agent import Agent, AgentOutput

__all__ = ["Batched", "Batcher", "FlushRule"]

FlushRule = Literal["lockstep", "eager"]
_FLUSH_RULES = ("lockstep", "eager")

_RUNNING, _WAITING, _ON_HOST = 0, 1, 2

#: ``"eager"`` decides this many loop iterations after the last request: a host reply reaches
#: its worker one iteration after the socket is read (the read callback resolves the future, the
#: worker task runs next); the rest is margin for replies that arrive while the loop is busy.
SETTLE_ITERATIONS = 3


@dataclass(frozen=True)
class Batched:
    """Options of ``inference="batched"`` (pass an instance as ``Sampler(inference=...)``).

    Attributes:
        flush: ``"lockstep"`` (reproducible for a fixed seed, also with a stochastic agent) or
            ``"eager"`` (no waiting for stragglers; batch composition depends on timing).
        threaded: run a blocking ``get_actions`` in a helper thread, so the event loop keeps
            reading host replies during the forward pass (helps when the agent releases the GIL,
            e.g. torch; costs a thread hand-off per call). Async agents are always awaited in
            the loop.
        min_fraction: ``"eager"`` only: also wait until at least this fraction of the workers
            in the call are waiting for actions (Sample Factory waits for about a third), unless
            every worker is; ``0`` flushes as soon as no worker is running Python.
    """

    flush: FlushRule = "lockstep"
    threaded: bool = False
    min_fraction: float = 0.0

    def __post_init__(self) -> None:
        _validate.choice("flush", self.flush, _FLUSH_RULES)
        _validate.flag("threaded", self.threaded)
        _validate.unit_interval("min_fraction", self.min_fraction)


@dataclass
class _Request:
    worker: int
    observations: Tree
    rows: int
    future: asyncio.Future[AgentOutput]


@dataclass
class BatchStats:
    """How the batcher's calls were made up (for benchmarks and tuning).

    Attributes:
        calls: agent calls made.
        rows: observation rows passed to the agent in all.
        workers_per_call: how many calls had each number of workers.
    """

    calls: int = 0
    rows: int = 0
    workers_per_call: Counter[int] = field(default_factory=Counter)

    @property
    def mean_workers(self) -> float:
        """Mean number of workers per call."""
        n = sum(self.workers_per_call.values())
        return sum(k * v for k, v in self.workers_per_call.items()) / n if n else 0.0


class Batcher:
    """Merges the concurrent ``get_actions`` calls of a sampler's workers into one.

    Args:
        agent_source: returns the current shared agent (read at every flush, so an agent
            replaced by an update is used from the next call on).
        options: the flush rule and threading.
    """

    def __init__(self, agent_source: Callable[[], Agent], options: Batched) -> None:
        self._agent_source = agent_source
        self.options = options
        self._state: dict[int, int] = {}
        self._pending: dict[int, _Request] = {}
        self._scheduled = False
        self._busy = False  # an async or threaded agent call is in flight
        self._quiet = 0  # loop iterations since the last state change
        self._settle = SETTLE_ITERATIONS if options.flush == "eager" else 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._agent_lock = threading.Lock()
        self.stats = BatchStats()
        self.timer: AgentTimer | None = None
        """With metrics on, where each merged call's seconds and rows go."""
        self._call_start = (0.0, 0)

    # -- hooks called by the sampler and the workers ------------------------------------------

    def join(self, worker: int) -> None:
        """Worker ``worker`` takes part in the current sampler call."""
        self._state[worker] = _RUNNING

    def leave(self, worker: int) -> None:
        """Worker ``worker`` is done with the current call (finished, failed or cancelled)."""
        self._state.pop(worker, None)
        self._pending.pop(worker, None)
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
        request = _Request(worker, observations, len(leaf), future)
        self._pending[worker] = request
        self._state[worker] = _WAITING
        self._schedule()
        try:
            return await future
        except asyncio.CancelledError:
            if self._pending.get(worker) is request:
                del self._pending[worker]
            raise

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

    # -- flushing -----------------------------------------------------------------------------

    def _schedule(self) -> None:
        self._quiet = 0
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._check)

    def _ready(self) -> bool:
        if self._busy or not self._pending:
            return False
        state = self._state.values()
        waiting, total = len(self._pending), len(self._state)
        if self.options.flush == "lockstep" or waiting == total:
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
        requests = [self._pending.pop(w) for w in sorted(self._pending)]
        requests = [r for r in requests if not r.future.done()]
        if not requests:
            return
        self.stats.calls += 1
        self.stats.workers_per_call[len(requests)] += 1
        agent = self._agent_source()
        try:
            observations = (
                requests[0].observations
                if len(requests) == 1
                else tree_concat([r.observations for r in requests])
            )
            rows = sum(r.rows for r in requests)
            self.stats.rows += rows
            timer = self.timer
            if timer is not None:
                self._call_start = (time.perf_counter(), rows)
            if self.options.threaded and not _is_async(agent):
                self._start(requests, self._call_in_thread(agent, observations))
                return
            with self._agent_lock:
                result = agent.get_actions(observations)
            if type(result) is not tuple and inspect.isawaitable(result):
                self._start(requests, _await(result))
                return
        except Exception as exc:
            self._fail(requests, exc)
            return
        if timer is not None:
            timer.add(time.perf_counter() - self._call_start[0], rows)
        self._deliver(requests, result)

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
        return _await(loop.run_in_executor(self._executor, call))

    def _start(self, requests: list[_Request], call: Any) -> None:
        self._busy = True
        task = asyncio.get_running_loop().create_task(call)
        task.add_done_callback(lambda t: self._finished(requests, t))

    def _finished(self, requests: list[_Request], task: asyncio.Task[Any]) -> None:
        self._busy = False
        if self.timer is not None:
            start, rows = self._call_start
            self.timer.add(time.perf_counter() - start, rows)
        if task.cancelled():
            self._fail(requests, asyncio.CancelledError())
        elif (exc := task.exception()) is not None:
            self._fail(requests, exc)
        else:
            self._deliver(requests, task.result())
        self._schedule()

    def _fail(self, requests: list[_Request], exc: BaseException) -> None:
        for r in requests:
            if not r.future.done():
                self._running(r.worker)
                if isinstance(exc, asyncio.CancelledError):
                    r.future.cancel()
                else:
                    r.future.set_exception(exc)

    def _running(self, worker: int) -> None:
        if worker in self._state:
            self._state[worker] = _RUNNING

    def _deliver(self, requests: list[_Request], result: Any) -> None:
        try:
            parts = _split(result, requests)
        except ValueError as exc:
            for r in requests:
                if not r.future.done():
                    self._running(r.worker)
                    r.future.set_exception(ValueError(f"{exc}; raised in worker {r.worker}"))
            return
        for r, part in zip(requests, parts):
            if not r.future.done():
                self._running(r.worker)
                r.future.set_result(part)


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _is_async(agent: Agent) -> bool:
    return inspect.iscoroutinefunction(getattr(agent, "get_actions", None))


def _split(result: Any, requests: list[_Request]) -> list[AgentOutput]:
    """Cut a merged agent output into each request's rows (views, no copies)."""
    total = sum(r.rows for r in requests)
    workers = ", ".join(str(r.worker) for r in requests)
    where = f"the {total} stacked observation rows of workers {workers}"
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError(
            f"action: the shared agent (inference='batched') must return (actions, agent_infos) "
            f"for {where}, got {type(result).__name__}"
        )
    actions, infos = result
    actions = tree_map(np.asarray, actions)
    for leaf in tree_leaves(actions):
        n = "a scalar" if leaf.ndim == 0 else f"{leaf.shape[0]} rows"
        if leaf.ndim == 0 or leaf.shape[0] != total:
            raise ValueError(
                f"action: the shared agent (inference='batched') must return exactly one action "
                f"per row of {where}, got {n}"
            )
    infos = {k: np.asarray(v) for k, v in (infos or {}).items()}
    for key, value in infos.items():
        if value.ndim == 0 or value.shape[0] != total:
            n = "a scalar" if value.ndim == 0 else f"{value.shape[0]} rows"
            raise ValueError(
                f"agent info {key!r}: the shared agent (inference='batched') must return one "
                f"value per row of {where}, got {n}"
            )
    parts: list[AgentOutput] = []
    start = 0
    for r in requests:
        stop = start + r.rows
        s = slice(start, stop)
        parts.append((tree_map(lambda x, s=s: x[s], actions), {k: v[s] for k, v in infos.items()}))
        start = stop
    return parts
