"""Where the time goes, counted in plain arrays (the metrics' raw figures; no dependency).

With ``Sampler(metrics=...)`` every env host adds how long its env steps and its agent copy's
calls took to a *clock*, a float64 array beside its step buffers (shared memory on ``process``),
which :mod:`asyncsample.metrics` folds once per call. Off unless metrics are on.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import Any

import numpy as np

__all__ = [
    "AGENT",
    "BOUNDS",
    "CLOCK_SIZE",
    "ENDS",
    "ENV",
    "AgentTimer",
    "HostTiming",
    "record_seconds",
    "timed_agent",
    "timed_group_step",
]

#: Upper bounds (seconds) of the latency histograms' buckets: 1, 2.5, 5 per decade, 10 us to 10 s.
BOUNDS: tuple[float, ...] = (
    *(float(f"{m}e{e}") for e in range(-5, 1) for m in (1, 2.5, 5)),
    10.0,
)
_N = len(BOUNDS) + 1  # the last bucket is +Inf

ENV = 0
"""Offset of the env-step section: ``_N`` bucket counts (per env step), then the seconds' sum."""
AGENT = _N + 1
"""Offset of the host agent's section (``inference="host"``): bucket counts per timed call, the
seconds' sum, then the exact count of calls."""
ENDS = AGENT + _N + 2
"""Episodes the host saw end: terminated, then truncated (the vector faces count these)."""
CLOCK_SIZE = ENDS + 2

_perf = time.perf_counter


def record_seconds(clock: np.ndarray, seconds: list[float]) -> None:
    """Add env steps of ``seconds`` each to the env-step section of ``clock`` (the lane hosts)."""
    clock[ENV : ENV + _N] += np.bincount(np.searchsorted(BOUNDS, seconds), minlength=_N)
    clock[ENV + _N] += sum(seconds)


def timed_group_step(group: Any, step: Any, clock: np.ndarray, weight: int = 1) -> Any:
    """``group.step`` that records its envs' time in ``clock``: each env step counts the call's
    seconds divided by the envs it stepped, as ``weight`` steps (see :class:`HostTiming`)."""
    items: Any = clock.data  # item access through a memoryview: cheaper than numpy's
    section, total = ENV, ENV + _N

    def timed(mask: np.ndarray, given: Any = None, everyone: bool | None = None) -> Any:
        start = _perf()
        infos = step(mask, given, everyone)
        seconds = _perf() - start
        n = group.last_stepped
        if n:
            items[section + bisect_left(BOUNDS, seconds / n)] += n * weight
            items[total] += seconds * weight
        ended = group.last_ended
        if ended:
            terminated = group.buffers.terminated
            ends = sum(1 for i in ended if terminated[i])
            items[ENDS] += ends
            items[ENDS + 1] += len(ended) - ends
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
    """``inference="host"`` with metrics: one chunk in :attr:`EVERY` is timed step by step (its
    ``group.step`` and ``runner.agent_actions`` swapped), each timed step weighing :attr:`EVERY`
    (timing every step would add ~10% to the chunk loop); agent calls are counted exactly."""

    EVERY = 8

    def __init__(self, group: Any, runner: Any, clock: np.ndarray) -> None:
        self.group, self.runner = group, runner
        self.items = clock.data
        self.plain_step = type(group).step.__get__(group)
        self.timed_step = timed_group_step(group, self.plain_step, clock, self.EVERY)
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
    """Agent calls made in the caller's process: their seconds and rows, folded once per call."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.rows: list[int] = []

    def add(self, seconds: float, rows: int) -> None:
        self.seconds.append(seconds)
        self.rows.append(rows)

    def drain(self) -> tuple[list[float], list[int]]:
        seconds, rows = self.seconds, self.rows
        self.seconds, self.rows = [], []
        return seconds, rows
