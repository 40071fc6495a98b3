"""Where the time goes, counted in plain arrays (the metrics' raw figures; no dependency).

With ``Sampler(metrics=...)`` every env host adds how long its env steps and its agent copy's
calls took to a *clock*, a float64 array beside its step buffers (shared memory on ``process``),
which :mod:`asyncsample.metrics` folds once per call. Off unless metrics are on.

The latency histograms are **sampled**, by one rule (:data:`SAMPLE_EVERY`): each timer (an env
host's steps, a host process's async env steps, a worker's agent calls, a sampler's merged agent
calls, a host's chunks with ``inference="host"``) times the first of its calls and then one in
:data:`SAMPLE_EVERY`, and a timed call counts as :data:`SAMPLE_EVERY` calls in the bucket counts
and the sum. A lane host in the caller's process instead times every step of one env in
:data:`SAMPLE_EVERY` per call (``LaneHost.timed_envs``: no choice per step), which the fold
weighs by the steps taken. The counts (env steps, episode ends, agent calls and their rows) are
exact.
"""

from __future__ import annotations

import itertools
import time
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = [
    "AGENT",
    "BOUNDS",
    "CALLS",
    "CLOCK_SIZE",
    "ENDS",
    "ENV",
    "ROWS",
    "ROWS_BOUNDS",
    "ROWS_N",
    "SAMPLE_EVERY",
    "STEPS",
    "AgentTimer",
    "HostTiming",
    "record_agent_calls",
    "record_seconds",
    "sampled",
    "timed_agent",
    "timed_group_step",
]

SAMPLE_EVERY = 8
"""The latency histograms' sampling: one call in this many (more than 1) is timed, and counts this
many: a timer's calls number 1, 2, ..., and those of number ``k`` with ``k % SAMPLE_EVERY == 1``
are timed."""

#: Upper bounds (seconds) of the latency histograms' buckets: 1, 2.5, 5 per decade, 10 us to 10 s.
BOUNDS: tuple[float, ...] = (
    *(float(f"{m}e{e}") for e in range(-5, 1) for m in (1, 2.5, 5)),
    10.0,
)
_N = len(BOUNDS) + 1  # the last bucket is +Inf
_BOUNDS_ARRAY = np.asarray(BOUNDS)

#: Upper bounds of the rows-per-agent-call histogram's buckets.
ROWS_BOUNDS: tuple[float, ...] = (
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0
)  # fmt: skip
ROWS_N = len(ROWS_BOUNDS) + 1  # the last bucket is +Inf

ENV = 0
"""Offset of the env-step section: ``_N`` bucket counts (sampled, weighted), then the seconds'
sum (of the same sample, weighted)."""
AGENT = _N + 1
"""Offset of the host agent's section (``inference="host"``): bucket counts per timed call, the
seconds' sum, then the exact count of calls."""
ENDS = AGENT + _N + 2
"""Episodes the host saw end: terminated, then truncated (the vector faces count these)."""
STEPS = ENDS + 2
"""The env steps the host took, exact (the vector faces count these; with ``inference="host"``
only the timed chunks', unread: the sampler counts its steps from its episodes)."""
ROWS = STEPS + 1
"""A host's agent copy's calls by their rows where they vary (``inference="host"`` with async
envs: the envs ready in a pass): :data:`ROWS_N` bucket counts, then the rows' sum (exact)."""
CALLS = ROWS + ROWS_N + 1
"""A host of async envs: its env calls running, as of its last reply (the caller's
``env_calls_in_flight``)."""
CLOCK_SIZE = CALLS + 1
TRUNCATED = ENDS + 1

_perf = time.perf_counter


def record_agent_calls(
    clock: np.ndarray,
    calls: int,
    by_rows: dict[int, int],
    seconds: list[float],
    weight: int = SAMPLE_EVERY,
) -> None:
    """Add a host agent copy's ``calls`` (exact; ``by_rows``: how many of each size) and the
    timed ones' ``seconds`` (each weighing ``weight``) to the agent sections of ``clock``."""
    for s in seconds:
        clock[AGENT + bisect_left(BOUNDS, s)] += weight
        clock[AGENT + _N] += weight * s
    clock[AGENT + _N + 1] += calls
    for rows, n in by_rows.items():
        clock[ROWS + bisect_left(ROWS_BOUNDS, rows)] += n
        clock[ROWS + ROWS_N] += rows * n


def sampled() -> Iterator[bool]:
    """The sampling rule as a timer's ticks, one per call: ``True`` for the calls to time (the
    first, then one in :data:`SAMPLE_EVERY`). ``next()`` of it is cheaper per call than a
    countdown kept in an attribute."""
    return itertools.cycle([True] + [False] * (SAMPLE_EVERY - 1))


def record_seconds(clock: np.ndarray, seconds: list[float], weight: int = SAMPLE_EVERY) -> None:
    """Add env steps of ``seconds`` each, each counting ``weight`` steps (the timed ones of a
    lane host), to the env-step section of ``clock``."""
    values = np.asarray(seconds, dtype=np.float64)
    where = np.searchsorted(_BOUNDS_ARRAY, values)
    clock[ENV : ENV + _N] += weight * np.bincount(where, minlength=_N)
    clock[ENV + _N] += weight * float(values.sum())


def timed_group_step(
    group: Any, step: Any, clock: np.ndarray, every: int = SAMPLE_EVERY, weight: int = SAMPLE_EVERY
) -> Any:
    """``group.step`` that counts its env steps and episode ends in ``clock`` (exactly), and
    times its first call and then one in ``every``: each env step of a timed call counts the
    call's seconds divided by the envs it stepped, as ``weight`` steps (see :class:`HostTiming`).
    """
    items: Any = clock.data  # item access through a memoryview: cheaper than numpy's
    section, total = ENV, ENV + _N
    left = 1  # calls until the next timed one

    def timed(mask: np.ndarray, given: Any = None, everyone: bool | None = None) -> Any:
        nonlocal left
        left -= 1
        if left:
            infos = step(mask, given, everyone)
            n = group.last_stepped
        else:
            left = every
            start = _perf()
            infos = step(mask, given, everyone)
            seconds = _perf() - start
            n = group.last_stepped
            if n:
                items[section + bisect_left(BOUNDS, seconds / n)] += n * weight
                items[total] += seconds * weight
        items[STEPS] += n
        ended = group.last_ended
        if ended:
            terminated = group.buffers.terminated
            for i in ended:
                items[ENDS if terminated[i] else TRUNCATED] += 1
        return infos

    return timed


def timed_agent(actions: Any, clock: np.ndarray, weight: int = 1) -> Any:
    """A host agent's ``actions`` that records each call's seconds, as ``weight`` calls."""
    items: Any = clock.data
    bounds, total = BOUNDS, AGENT + _N

    def timed(observations: Any) -> Any:
        start = _perf()
        result = actions(observations)
        seconds = _perf() - start
        items[AGENT + bisect_left(bounds, seconds)] += weight
        items[total] += seconds * weight
        return result

    return timed


class HostTiming:
    """``inference="host"`` with metrics: the first chunk and then one in :attr:`EVERY` are
    timed step by step (their ``group.step`` and ``runner.agent_actions`` swapped), each timed
    step weighing :attr:`EVERY` (timing every step would add ~10% to the chunk loop); agent
    calls are counted exactly."""

    EVERY = SAMPLE_EVERY

    def __init__(self, group: Any, runner: Any, clock: np.ndarray) -> None:
        self.group, self.runner = group, runner
        self.items = clock.data
        self.plain_step = type(group).step.__get__(group)
        self.timed_step = timed_group_step(group, self.plain_step, clock, 1, self.EVERY)
        self.plain_actions = runner.agent_actions
        self.timed_actions = timed_agent(self.plain_actions, clock, self.EVERY)
        self.chunks = 0

    def run(self, request: Any) -> Any:
        """Run ``request`` on the runner, timed or not; the runner's reply."""
        timed = self.chunks % self.EVERY == 0
        self.chunks += 1
        self.group.step = self.timed_step if timed else self.plain_step
        self.runner.agent_actions = self.timed_actions if timed else self.plain_actions
        reply = self.runner.run(request)
        self.items[AGENT + _N + 1] += reply.steps
        return reply


class AgentTimer:
    """Agent calls made in the caller's process, folded once per call: counted exactly (calls,
    and calls by rows), the first and then one in :data:`SAMPLE_EVERY` timed.

    A caller asks :meth:`due` before each agent call (which counts it) and, when it answers
    ``True``, gives the call's seconds to :meth:`took`. (A worker's own calls, one per step, are
    counted and picked by the worker, ``Worker.agent_calls``: the same rule without a method
    call; their timed seconds come to :meth:`took` too.)
    """

    def __init__(self) -> None:
        self.calls = 0
        self.by_rows: defaultdict[int, int] = defaultdict(int)  # calls by their rows
        self.seconds: list[float] = []  # of the timed calls
        self._left = 1  # calls until the next timed one

    def due(self, rows: int) -> bool:
        """Count an agent call of ``rows`` observations; whether to time it."""
        self.calls += 1
        self.by_rows[rows] += 1
        self._left -= 1
        if self._left:
            return False
        self._left = SAMPLE_EVERY
        return True

    def took(self, seconds: float) -> None:
        """A call :meth:`due` picked took ``seconds``."""
        self.seconds.append(seconds)

    def drain(self) -> tuple[int, dict[int, int], list[float]]:
        """The calls, the calls by rows and the timed calls' seconds since the last drain."""
        drained = self.calls, dict(self.by_rows), self.seconds
        self.calls, self.seconds = 0, []
        self.by_rows.clear()
        return drained
