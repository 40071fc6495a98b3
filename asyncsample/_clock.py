"""Where the time goes, counted in plain arrays (the metrics' raw figures; no dependency).

With ``Sampler(metrics=...)`` every env host adds how long its env steps and its agent copy's
calls took to a *clock*, a float64 array beside its step buffers (shared memory on ``process``),
which :mod:`asyncsample.metrics` folds once per call. Off unless metrics are on.

The latency histograms are **sampled**, by one rule (:class:`Pace`): each timer (an env host's
steps, a host process's async env steps, a worker's agent calls, a sampler's merged agent calls,
a host's chunks with ``inference="host"``) times its first two calls, then leaves gaps of calls
that depend on how long its timed calls took (:func:`gap_after`: about :data:`GAP_SECONDS` of
calls, 1 to :data:`MAX_GAP`), and a timed call counts as the calls since the previous timed one
in the bucket counts and the sum. So timing costs about the same small share of every workload:
a 5-us env step is timed one in 64, a 1-ms one every time. A lane host in the caller's process
instead times every step of some of its envs per call (``LaneHost.timed_envs``: no choice per
step; as many as the same gap asks), which the fold weighs by the steps taken. The counts (env
steps, episode ends, agent calls and their rows) are exact.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import defaultdict
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
    "GAP_SECONDS",
    "MAX_GAP",
    "STEPS",
    "AgentTimer",
    "HostTiming",
    "LaneTiming",
    "Pace",
    "gap_after",
    "record_agent_calls",
    "record_seconds",
    "timed_agent",
    "timed_group_step",
]

MAX_GAP = 64
"""The most calls a timed call stands for (a timer of calls of under ``GAP_SECONDS / MAX_GAP``
times one in this many)."""
GAP_SECONDS = 5e-4
"""About how many seconds of calls a timer leaves between two timed ones: a timed call costs
under a microsecond more (two clock reads, a bucket's add), so timing costs at most about 0.1%
of the time it measures; a call of this long or longer is timed every time."""

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
"""Episodes the host saw end: terminated, then truncated (counted for the vector faces)."""
STEPS = ENDS + 2
"""The env steps the host took, exact (counted for the vector faces: a sampler counts its steps
from its episodes)."""
ROWS = STEPS + 1
"""A host's agent copy's calls by their rows where they vary (``inference="host"`` with async
envs: the envs ready in a pass): :data:`ROWS_N` bucket counts, then the rows' sum (exact)."""
CALLS = ROWS + ROWS_N + 1
"""A host of async envs: its env calls running, as of its last reply (the caller's
``env_calls_in_flight``)."""
CLOCK_SIZE = CALLS + 1
TRUNCATED = ENDS + 1

_perf = time.perf_counter


def gap_after(seconds: float) -> int:
    """The calls from a timed call of ``seconds`` to a timer's next timed one (see
    :data:`GAP_SECONDS`): 1 to :data:`MAX_GAP`."""
    if seconds >= GAP_SECONDS:
        return 1
    if seconds * MAX_GAP <= GAP_SECONDS:
        return MAX_GAP
    return int(GAP_SECONDS / seconds)


class Pace:
    """A timer's sampling rule: which calls to time, and how many calls a timed one stands for.

    :meth:`tick` counts a call: 0 not to time it, else its weight, the calls since the previous
    timed one (the first call's: 1). The timer writes each timed call's seconds to :attr:`last`,
    which sets the gap after the next timed one: decided before that call's own seconds are
    known, so no call's chance of being timed depends on how long it takes. Calls that overlap
    (async envs) each tick as they start."""

    __slots__ = ("gap", "last", "left")

    def __init__(self) -> None:
        self.left = 1  # calls until the next timed one
        self.gap = 1  # the calls the next timed one stands for
        self.last = GAP_SECONDS  # the latest timed call's seconds (none yet: time the second too)

    def tick(self) -> int:
        """Count a call: 0 not to time it, else the calls it stands for. (A hot caller counts
        :attr:`left` down itself, and calls :meth:`timed` when it reaches 0: no call per call.)"""
        self.left -= 1
        return 0 if self.left else self.timed()

    def timed(self) -> int:
        """The countdown reached 0, this call is timed: the calls it stands for (and the next
        gap is set)."""
        weight = self.gap
        self.left = self.gap = gap_after(self.last)
        return weight


def record_agent_calls(
    clock: np.ndarray,
    calls: int,
    by_rows: dict[int, int],
    seconds: list[float],
    weights: list[int],
) -> None:
    """Add a host agent copy's ``calls`` (exact; ``by_rows``: how many of each size) and the
    timed ones' ``seconds`` (each standing for its ``weights``) to the agent sections of
    ``clock``."""
    for s, weight in zip(seconds, weights):
        clock[AGENT + bisect_left(BOUNDS, s)] += weight
        clock[AGENT + _N] += weight * s
    clock[AGENT + _N + 1] += calls
    for rows, n in by_rows.items():
        clock[ROWS + bisect_left(ROWS_BOUNDS, rows)] += n
        clock[ROWS + ROWS_N] += rows * n


def record_seconds(clock: np.ndarray, seconds: list[float], weights: list[int]) -> None:
    """Add env steps of ``seconds`` each, each counting its ``weights`` steps (the timed ones of
    a lane host), to the env-step section of ``clock``."""
    values = np.asarray(seconds, dtype=np.float64)
    counts = np.asarray(weights, dtype=np.float64)
    where = np.searchsorted(_BOUNDS_ARRAY, values)
    clock[ENV : ENV + _N] += np.bincount(where, counts, minlength=_N)
    clock[ENV + _N] += float((values * counts).sum())  # (np.dot of floats wakes BLAS threads)


def timed_group_step(
    group: Any,
    step: Any,
    clock: np.ndarray,
    weight: list[int] | None = None,
    counted: bool = False,
) -> Any:
    """``group.step`` that times its calls by a :class:`Pace` (the call's seconds per env it
    stepped, each of those env steps counting the timed call's weight) into ``clock``; given
    ``weight``, times every call instead, each env step counting ``weight[0]``
    (:class:`HostTiming` sets it per chunk). ``counted``: also counts its env steps and episode
    ends (exactly; a vector face's host). An untimed, uncounted call costs the wrapper's frame
    and a countdown: the hosts' clock measured 0.9% of CartPole 4x8's steps/s with the counts
    kept for every host."""
    items: Any = clock.data  # item access through a memoryview: cheaper than numpy's
    section, total = ENV, ENV + _N
    left, gap, last = 1, 1, GAP_SECONDS  # a Pace's, in cells: cheaper than its attributes
    every = weight is not None

    def timed(mask: np.ndarray, given: Any = None, everyone: bool | None = None) -> Any:
        nonlocal left, gap, last
        left -= 1
        if left and not every:
            infos = step(mask, given, everyone)
        else:
            if every:
                counts = weight[0]  # type: ignore[index]
            else:
                counts = gap
                left = gap = gap_after(last)
            start = _perf()
            infos = step(mask, given, everyone)
            seconds = _perf() - start
            n = group.last_stepped
            if n:
                items[section + bisect_left(BOUNDS, seconds / n)] += n * counts
                items[total] += seconds * counts
                last = seconds
            elif not every:  # nothing stepped: time the next call, for these calls too
                left, gap = 1, counts
        if counted:
            items[STEPS] += group.last_stepped
            ended = group.last_ended
            if ended:
                terminated = group.buffers.terminated
                for i in ended:
                    items[ENDS if terminated[i] else TRUNCATED] += 1
        return infos

    return timed


def timed_agent(actions: Any, clock: np.ndarray, weight: list[int]) -> Any:
    """A host agent's ``actions`` that records each call's seconds, as ``weight[0]`` calls."""
    items: Any = clock.data
    bounds, total = BOUNDS, AGENT + _N

    def timed(observations: Any) -> Any:
        start = _perf()
        result = actions(observations)
        seconds = _perf() - start
        counts = weight[0]
        items[AGENT + bisect_left(bounds, seconds)] += counts
        items[total] += seconds * counts
        return result

    return timed


class HostTiming:
    """``inference="host"`` with metrics: chunks are timed step by step by a :class:`Pace` of
    chunks (their ``group.step`` and ``runner.agent_actions`` swapped; its gap from the timed
    chunk's seconds per step), each timed step and agent call weighing the chunks since the
    previous timed one (timing every step would add ~10% to the chunk loop); agent calls are
    counted exactly."""

    def __init__(self, group: Any, runner: Any, clock: np.ndarray) -> None:
        self.group, self.runner = group, runner
        self.items = clock.data
        self.pace = Pace()
        self.weight = [1]  # the timed chunk's, read by its timed step and agent
        self.plain_step = type(group).step.__get__(group)
        self.timed_step = timed_group_step(group, self.plain_step, clock, self.weight)
        self.plain_actions = runner.agent_actions
        self.timed_actions = timed_agent(self.plain_actions, clock, self.weight)

    def run(self, request: Any) -> Any:
        """Run ``request`` on the runner, timed or not; the runner's reply."""
        weight = self.pace.tick()
        self.group.step = self.timed_step if weight else self.plain_step
        self.runner.agent_actions = self.timed_actions if weight else self.plain_actions
        if not weight:
            reply = self.runner.run(request)
        else:
            self.weight[0] = weight
            start = _perf()
            reply = self.runner.run(request)
            self.pace.last = (_perf() - start) / max(reply.steps, 1)
        self.items[AGENT + _N + 1] += reply.steps
        return reply


class AgentTimer:
    """Agent calls made in the caller's process, folded once per call: counted exactly (calls,
    and calls by rows), timed by a :class:`Pace`.

    A caller asks :meth:`due` before each agent call (which counts it) and, when it answers a
    weight (not 0), gives the call's seconds and that weight to :meth:`took`. (A worker's own
    calls, one per step, are counted and paced by the worker, ``Worker.agent_calls``: the same
    rule without a method call; their timed seconds come to :meth:`took` too.)
    """

    def __init__(self) -> None:
        self.calls = 0
        self.by_rows: defaultdict[int, int] = defaultdict(int)  # calls by their rows
        self.seconds: list[float] = []  # of the timed calls
        self.weights: list[int] = []  # the calls each timed one stands for
        self.pace = Pace()

    def due(self, rows: int) -> int:
        """Count an agent call of ``rows`` observations; 0 not to time it, else its weight."""
        self.calls += 1
        self.by_rows[rows] += 1
        pace = self.pace
        pace.left -= 1
        return 0 if pace.left else pace.timed()

    def took(self, seconds: float, weight: int) -> None:
        """A timed call of ``weight`` took ``seconds`` (which paces the next ones)."""
        self.seconds.append(seconds)
        self.weights.append(weight)
        self.pace.last = seconds

    def drain(self) -> tuple[int, dict[int, int], list[float], list[int]]:
        """The calls, the calls by rows, and the timed calls' seconds and weights since the last
        drain."""
        drained = self.calls, dict(self.by_rows), self.seconds, self.weights
        self.calls, self.seconds, self.weights = 0, [], []
        self.by_rows.clear()
        return drained


class LaneTiming:
    """A lane host's timed steps (``LaneHost``, metrics on): their seconds and the steps each
    stands for, and which envs a call's lanes time.

    Its :attr:`pace`'s ``last`` is the seconds per step of the host's envs (not a step's own
    seconds: the steps overlap), from the fold (:meth:`take`) or from the steps settled
    (:meth:`settle`)."""

    def __init__(self) -> None:
        self.durations: list[float] = []  # (a step in flight may add: cleared in place)
        self.weights: list[int] = []  # the steps each of durations stands for (a host's ticks)
        self.pace = Pace()
        self.turn = 0  # which envs :meth:`envs` names next
        self._settled = _perf()

    def add(self, seconds: float, weight: int) -> None:
        """A timed step took ``seconds``, standing for ``weight`` steps."""
        self.durations.append(seconds)
        self.weights.append(weight)

    def envs(self, n: int) -> frozenset[int]:
        """The envs of ``n`` whose every step the next call times: as many as the pace's gap
        asks (one env in the gap, or one env every few calls when the gap is wider than the
        envs), another set each call, so that every env takes its turn and no step pays for a
        choice (the fold weighs them by the steps taken)."""
        gap, turn = gap_after(self.pace.last), self.turn
        self.turn = turn + 1
        if gap <= n:
            return frozenset(range(turn % gap, n, gap))
        calls = -(-gap // n)  # calls from one env's turn to the next's
        return frozenset() if turn % calls else frozenset({turn // calls % n})

    def take(self, per_step: float) -> list[float]:
        """The seconds of the steps timed since the last take (for the fold in the host's
        process, which weighs them by the steps taken meanwhile); ``per_step``: the round's
        seconds per env step, which paces the next calls."""
        self.pace.last = per_step
        taken = self.durations[:]
        self.durations.clear()
        self.weights.clear()
        return taken

    def settle(self, clock: np.ndarray) -> None:
        """Add the steps timed since the last settle to ``clock``'s env-step section, each
        weighing the steps it stands for (a host in another process: its ticks paced them)."""
        durations, weights = self.durations, self.weights
        if durations:
            record_seconds(clock, durations, weights)
            now = _perf()  # the steps the timed ones stood for took this long, overlapping
            self.pace.last = (now - self._settled) / sum(weights)
            self._settled = now
            durations.clear()
            weights.clear()
