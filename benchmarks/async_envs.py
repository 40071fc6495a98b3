"""Envs that wait: thousands of concurrent I/O-bound episodes (issue 23, item 6).

Run from the repository root::

    asyncsample bench async_envs            # 100, 1,000 and 10,000 episodes in flight
    asyncsample bench async_envs --quick    # 10 and 100 episodes, tiny durations (a smoke run)
    python -m benchmarks.async_envs --levels 1000 --contenders pool-32 ours-asyncio

The env's step *waits* (an HTTP call, a sandbox, a simulator behind a socket): a latency drawn
from the env's own seeded RNG, mean 50 ms, 1% of the steps 20x longer than the others (and a
+-20% jitter on every step, so the envs do not march in step). It is written twice with the
same RNG stream: :class:`SleepLatencyEnv`, a blocking gymnasium env (``time.sleep``), and
:class:`AsyncLatencyEnv`, an async env (``await asyncio.sleep``). Box(4,) observations,
Discrete(2) actions, episodes of 100 steps (truncated by the env itself).

Contenders, each cell in a fresh process (:func:`benchmarks._runner.run_fresh`):

- ``gym-async``: gymnasium's ``AsyncVectorEnv`` of the blocking env, one process per env, at
  most 64 envs (above 64 episodes it runs 64 and the table says so); no event loop.
- ``pool-32``, ``pool-256``: a ``concurrent.futures.ThreadPoolExecutor`` of 32 / 256 threads
  stepping N blocking envs, driven as the LLM-agent stacks drive theirs: one asyncio task per
  env, each awaiting ``loop.run_in_executor(pool, env.step, action)``.
- ``plain-asyncio``: the async env with nothing between it and the loop: one task per env
  awaiting ``env.step`` (the ceiling of the asyncio path on this machine).
- ``ours-thread``: ``Sampler(backend="thread")`` on the blocking env (``max_concurrency``
  threads, 256 by default).
- ``ours-asyncio``: ``Sampler(backend="asyncio")`` on the async env.
- ``ours-asyncio-zero``: the async env with no latency at all (1,000 episodes): the per-step
  CPU cost of the asyncio path itself.

Ours run with one shared seeded ``RandomAgent`` and ``inference="batched"`` in two layouts, one
env per worker and 100 envs per worker (``n_workers x envs_per_worker`` = N); the table shows
the better, a second table both.

Per cell: env steps/s, counted as the steps happen (for ours the better of a ``stream`` of
complete episodes and one of fragments on the same sampler, for the peers their envs' own
loop), against the ideal (N / mean latency); the event-loop lag p50/p99 (a probe task sleeps
1 ms and records how late it wakes); the main process's CPU per step
(``time.process_time``); the memory per open episode (growth of the RSS of the process tree /
N); and the duration of a call of N episodes' worth of steps (``obtain_samples(N * 100)`` a
few times; for the peers, every env running one episode) with its p50/p99, for ours also with
``episode_timeout`` at 3x the mean episode duration. Results:
``benchmarks/results/async_envs/`` (``results.json``, ``results.md``, ``async_envs.png``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import psutil
from gymnasium import spaces

from asyncsample import AsyncEnv
from benchmarks import fmt
from benchmarks.contenders import LagProbe

RESULTS = Path(__file__).resolve().parent / "results" / "async_envs"

#: Default latency model and episode of the study (issue 23).
MEAN_LATENCY_S = 0.050
TAIL_PROBABILITY = 0.01
TAIL_FACTOR = 20.0
JITTER = 0.2
EPISODE_LENGTH = 100

#: The peers that need one process per env stop at this many envs.
MAX_PROCESS_ENVS = 64
#: Envs per worker of ours' second layout (the first is one env per worker).
WIDE_ENVS_PER_WORKER = 100

CONTENDERS = [
    "plain-asyncio",
    "gym-async",
    "pool-32",
    "pool-256",
    "ours-thread",
    "ours-asyncio",
    "ours-asyncio-zero",
]

__all__ = [
    "CONTENDERS",
    "AsyncLatencyEnv",
    "CellSpec",
    "LatencyModel",
    "SleepLatencyEnv",
    "main",
    "make_env",
    "run_cell",
]


# --------------------------------------------------------------------------------------------
# The envs


@dataclass(frozen=True)
class LatencyModel:
    """A heavy-tailed step latency: most steps take ``base``, a few ``tail_factor`` x longer.

    A step's latency is ``base * (tail_factor if tail else 1) * uniform(1 - jitter, 1 + jitter)``
    with ``tail`` true with probability ``tail_probability``; ``base`` is chosen so that the
    mean is ``mean`` exactly.

    Attributes:
        mean: Mean latency in seconds (0: no wait at all).
        tail_probability: Share of the steps in the tail.
        tail_factor: How much longer a tail step is than an ordinary one.
        jitter: Relative spread of every step (uniform), so envs drift apart as real ones do.
    """

    mean: float = MEAN_LATENCY_S
    tail_probability: float = TAIL_PROBABILITY
    tail_factor: float = TAIL_FACTOR
    jitter: float = JITTER

    @property
    def base(self) -> float:
        """The latency of an ordinary (not tail) step, before its jitter."""
        return self.mean / (1.0 - self.tail_probability + self.tail_probability * self.tail_factor)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` latencies (seconds) from ``rng``; zeros when the mean is zero."""
        if self.mean <= 0:
            return np.zeros(n)
        u = rng.random((2, n))
        scale = np.where(u[0] < self.tail_probability, self.tail_factor, 1.0)
        return self.base * scale * (1.0 - self.jitter + 2.0 * self.jitter * u[1])


_COUNT_LOCK = threading.Lock()


class _LatencyCore:
    """What both latency envs share: spaces, the latency stream and the episode.

    Latencies are drawn from the env's ``np_random`` (seeded by its base class's ``reset``, as
    gymnasium seeds it) in blocks, one generator call per 256 steps rather than two per step;
    the two envs see the same latencies for the same seed.
    """

    np_random: np.random.Generator  # the base class's (gymnasium.Env or AsyncEnv)

    _BLOCK = 256
    #: Steps taken by every latency env of this process (what the timed phases count).
    steps_taken = 0

    @staticmethod
    def count() -> int:
        """Steps taken so far by the latency envs of this process."""
        return _LatencyCore.steps_taken

    def __init__(
        self, latency: LatencyModel | None = None, episode_length: int = EPISODE_LENGTH
    ) -> None:
        latency = latency or LatencyModel()
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.latency = latency
        self.episode_length = episode_length
        self._block = np.zeros(0)
        self._next = 0
        self._t = 0

    def _begin(self, seed: int | None) -> tuple[np.ndarray, dict[str, Any]]:
        """Start an episode, after the base class's ``reset`` seeded ``np_random``."""
        if seed is not None:  # a new generator: latencies drawn from the old one are void
            self._block = np.zeros(0)
            self._next = 0
        self._t = 0
        return np.zeros(4, dtype=np.float32), {}

    def _wait(self) -> float:
        """The next step's latency (seconds)."""
        if self.latency.mean <= 0:
            return 0.0
        if self._next >= len(self._block):
            self._block = self.latency.draw(self.np_random, self._BLOCK)
            self._next = 0
        wait = float(self._block[self._next])
        self._next += 1
        return wait

    def _advance(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        obs = np.zeros(4, dtype=np.float32)
        obs[0] = self._t / self.episode_length
        obs[1] = float(action)
        return obs, 1.0, False, self._t >= self.episode_length, {}


class SleepLatencyEnv(_LatencyCore, gym.Env[np.ndarray, np.int64]):
    """The blocking env: its step sleeps (``time.sleep``) a latency of :class:`LatencyModel`.

    Args:
        latency: The latency model (default: mean 50 ms, 1% of steps 20x longer).
        episode_length: Steps per episode (the last one is truncated).
    """

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start an episode (instantly: only steps wait)."""
        super().reset(seed=seed)
        return self._begin(seed)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Wait the step's latency (blocking the thread), then advance the episode."""
        wait = self._wait()
        if wait > 0:
            time.sleep(wait)
        with _COUNT_LOCK:  # steps of threads: an unlocked += could lose a count
            _LatencyCore.steps_taken += 1
        return self._advance(action)


class AsyncLatencyEnv(_LatencyCore, AsyncEnv[np.ndarray, np.int64]):
    """The async env: its step awaits ``asyncio.sleep`` of a latency of :class:`LatencyModel`.

    With a zero mean the step returns without awaiting anything (the asyncio path's own cost).

    Args:
        latency: The latency model (default: mean 50 ms, 1% of steps 20x longer).
        episode_length: Steps per episode (the last one is truncated).
    """

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start an episode (instantly: only steps wait)."""
        await super().reset(seed=seed)
        return self._begin(seed)

    async def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Await the step's latency, then advance the episode."""
        wait = self._wait()
        if wait > 0:
            await asyncio.sleep(wait)
        _LatencyCore.steps_taken += 1
        return self._advance(action)


def make_env(
    blocking: bool,
    mean: float = MEAN_LATENCY_S,
    tail_probability: float = TAIL_PROBABILITY,
    tail_factor: float = TAIL_FACTOR,
    jitter: float = JITTER,
    episode_length: int = EPISODE_LENGTH,
) -> SleepLatencyEnv | AsyncLatencyEnv:
    """A :class:`SleepLatencyEnv` (``blocking``) or an :class:`AsyncLatencyEnv`.

    Module level, so ``functools.partial(make_env, ...)`` pickles by reference for subprocesses.
    """
    cls = SleepLatencyEnv if blocking else AsyncLatencyEnv
    return cls(LatencyModel(mean, tail_probability, tail_factor, jitter), episode_length)


# --------------------------------------------------------------------------------------------
# Measuring


def tree_rss() -> int:
    """RSS of this process and of all its descendants, in bytes."""
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += child.memory_info().rss
    return total


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` (linear interpolation), None when empty."""
    return float(np.percentile(values, q)) if values else None


# --------------------------------------------------------------------------------------------
# One cell


@dataclass
class CellSpec:
    """One run: a contender at a number of episodes in flight (JSON-able).

    Attributes:
        contender: One of :data:`CONTENDERS`.
        n_episodes: Episodes in flight (N).
        n_workers: Ours: workers (``n_workers * envs_per_worker`` = N).
        envs_per_worker: Ours: envs per worker.
        threads: Thread-pool size (``pool-*``; ``ours-thread``'s ``max_concurrency``).
        mean: Mean step latency, seconds (0: no wait).
        tail_probability: Share of the steps in the tail.
        tail_factor: Tail steps are this much longer.
        jitter: Relative spread of every step.
        episode_length: Steps per episode.
        warmup_s: Seconds stepped before the timed phase.
        seconds: Seconds of the timed phase (steps/s, CPU, lag).
        calls: Timed calls for the call durations (0: none).
        call_limit_s: A contender whose call would take longer than this (by its measured
            rate) skips the call durations.
        timeout_factor: Ours' ``episode_timeout`` in mean episode durations (0: no such calls).
        loop: ``"uvloop"`` or ``"asyncio"``.
        streams: Ours' steps/s from these streams, one after the other on the same sampler:
            ``"episodes"`` (complete episodes) and/or ``"fragments"``; the better one counts.
        chunk_s: Ours' stream batches: this many seconds of steps at the ideal rate.
        fraction: Ours' stream's ``fraction_samples`` (below 1, fast workers fill in for slow
            ones and a round need not wait for its slowest worker).
        seed: Seed of the envs and agents.
    """

    contender: str
    n_episodes: int
    n_workers: int = 0
    envs_per_worker: int = 0
    threads: int = 0
    mean: float = MEAN_LATENCY_S
    tail_probability: float = TAIL_PROBABILITY
    tail_factor: float = TAIL_FACTOR
    jitter: float = JITTER
    episode_length: int = EPISODE_LENGTH
    warmup_s: float = 2.0
    seconds: float = 5.0
    calls: int = 5
    call_limit_s: float = 20.0
    timeout_factor: float = 3.0
    loop: str = "uvloop"
    streams: list[str] = field(default_factory=lambda: ["episodes", "fragments"])
    chunk_s: float = 1.0
    fraction: float = 1.0
    seed: int = 0

    def env_kwargs(self) -> dict[str, Any]:
        """Arguments of :func:`make_env` but ``blocking``."""
        return {
            "mean": self.mean,
            "tail_probability": self.tail_probability,
            "tail_factor": self.tail_factor,
            "jitter": self.jitter,
            "episode_length": self.episode_length,
        }

    def latency(self) -> LatencyModel:
        """The spec's latency model."""
        return LatencyModel(self.mean, self.tail_probability, self.tail_factor, self.jitter)

    @property
    def n_envs(self) -> int:
        """Envs actually run: N, but at most 64 for ``gym-async``."""
        if self.contender == "gym-async":
            return min(self.n_episodes, MAX_PROCESS_ENVS)
        return self.n_episodes

    @property
    def ideal(self) -> float | None:
        """Steps/s of N episodes each waiting the mean latency per step (None without waits)."""
        return self.n_episodes / self.mean if self.mean > 0 else None

    @property
    def layout(self) -> str:
        """How the contender holds its envs, for the tables."""
        if self.contender.startswith("ours-"):
            text = f"{self.n_workers}x{self.envs_per_worker}"
            return text + (f", {self.threads} threads" if self.contender == "ours-thread" else "")
        if self.contender.startswith("pool-"):
            return f"{self.n_envs} envs, {self.threads} threads"
        if self.contender == "plain-asyncio":
            return f"{self.n_envs} tasks"
        return f"{self.n_envs} processes"


@dataclass
class CellResult:
    """What one run measured (see the module's docstring)."""

    steps: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    rss_before: int = 0
    rss_open: int = 0
    start_s: float = 0.0
    lag: dict[str, Any] = field(default_factory=dict)
    idle_lag: dict[str, Any] = field(default_factory=dict)
    calls: list[float] = field(default_factory=list)
    call_steps: list[int] = field(default_factory=list)
    timeout_calls: list[float] = field(default_factory=list)
    timeout_call_steps: list[int] = field(default_factory=list)
    stream: str = ""
    streams: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def finish(self, spec: CellSpec) -> dict[str, Any]:
        """The raw numbers and the derived ones (rates, ratios, percentiles) as a dict."""
        rate = self.steps / self.seconds if self.seconds > 0 else None
        ideal = spec.ideal
        probe_cpu = (self.idle_lag.get("probe_cpu_share") or 0.0) * self.seconds
        out = dataclasses.asdict(self) | {
            "contender": spec.contender,
            "n_episodes": spec.n_episodes,
            "n_envs": spec.n_envs,
            "layout": spec.layout,
            "steps_per_s": rate,
            "ideal_steps_per_s": ideal,
            "ratio_to_ideal": rate / ideal if rate and ideal else None,
            "cpu_us_per_step_raw": 1e6 * self.cpu_s / self.steps if self.steps else None,
            "cpu_us_per_step": 1e6 * max(0.0, self.cpu_s - probe_cpu) / self.steps
            if self.steps
            else None,
            "bytes_per_episode": (self.rss_open - self.rss_before) / spec.n_envs
            if self.rss_open
            else None,
            "call_steps_per_s": sum(self.call_steps) / sum(self.calls) if self.calls else None,
            "call_p50_s": percentile(self.calls, 50),
            "call_p99_s": percentile(self.calls, 99),
            "timeout_call_p50_s": percentile(self.timeout_calls, 50),
            "timeout_call_p99_s": percentile(self.timeout_calls, 99),
        }
        return out


async def _timed_phase(
    spec: CellSpec, result: CellResult, count: Callable[[], int], probe: LagProbe | None
) -> None:
    """Let the running contender warm up, then time ``seconds`` of it: steps, CPU, lag, RSS."""
    await asyncio.sleep(spec.warmup_s)
    result.rss_open = tree_rss()
    if probe is not None:
        probe.lags.clear()
    s0, c0, t0 = count(), time.process_time(), time.perf_counter()
    await asyncio.sleep(spec.seconds)
    s1, c1, t1 = count(), time.process_time(), time.perf_counter()
    result.steps, result.cpu_s, result.seconds = s1 - s0, c1 - c0, t1 - t0
    if probe is not None:
        result.lag = probe.summary()


async def _idle_lag(seconds: float = 0.2) -> dict[str, Any]:
    """The probe on the idle loop: its lag (the timer's own granularity) and its own CPU cost.

    ``probe_cpu_share`` (CPU seconds per second) is subtracted from the timed phase's CPU, so
    the CPU per step is the contender's, not the probe's (1,000 wake-ups a second weigh on a
    contender that steps only a few hundred times a second).
    """
    probe = LagProbe()
    c0, t0 = time.process_time(), time.perf_counter()
    probe.start()
    await asyncio.sleep(seconds)
    await probe.stop()
    lag = probe.summary()
    lag["probe_cpu_share"] = (time.process_time() - c0) / (time.perf_counter() - t0)
    return lag


def _call_budget_ok(spec: CellSpec, result: CellResult) -> bool:
    """True when a call of N episodes should finish within the call limit at the measured rate."""
    if spec.calls <= 0:
        return False
    rate = result.steps / result.seconds if result.seconds else 0.0
    expected = spec.n_envs * spec.episode_length / rate if rate else math.inf
    if expected > spec.call_limit_s:
        result.notes.append(
            f"call durations skipped: a call of {spec.n_envs} episodes would take "
            f"~{expected:.0f} s at the measured rate (limit {spec.call_limit_s:.0f} s)"
        )
        return False
    return True


def run_gym_async(spec: CellSpec) -> CellResult:
    """gymnasium ``AsyncVectorEnv`` of the blocking env: lockstep, one process per env.

    No event loop (a blocking vector env): no lag. A call of N episodes is ``episode_length``
    lockstep steps.
    """
    result = CellResult()
    if spec.n_envs < spec.n_episodes:
        result.notes.append(
            f"{spec.n_envs} envs, not {spec.n_episodes}: a process per env; the ratio is "
            f"against the ideal of {spec.n_episodes} episodes"
        )
    result.rss_before = tree_rss()
    t0 = time.perf_counter()
    env_fn = functools.partial(make_env, True, **spec.env_kwargs())
    venv = gym.vector.AsyncVectorEnv(
        [env_fn] * spec.n_envs,
        shared_memory=True,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    try:
        venv.reset(seed=spec.seed)
        result.start_s = time.perf_counter() - t0
        rng = np.random.default_rng(spec.seed)

        def step() -> None:
            venv.step(rng.integers(0, 2, size=spec.n_envs))

        end = time.perf_counter() + spec.warmup_s
        while time.perf_counter() < end:
            step()
        result.rss_open = tree_rss()
        iters = 0
        c0, t0 = time.process_time(), time.perf_counter()
        while time.perf_counter() - t0 < spec.seconds:
            step()
            iters += 1
        result.cpu_s = time.process_time() - c0
        result.seconds = time.perf_counter() - t0
        result.steps = iters * spec.n_envs
        if _call_budget_ok(spec, result):
            for _ in range(spec.calls):
                t0 = time.perf_counter()
                for _ in range(spec.episode_length):
                    step()
                result.calls.append(time.perf_counter() - t0)
                result.call_steps.append(spec.episode_length * spec.n_envs)
    finally:
        venv.close()
    return result


async def run_tasks(spec: CellSpec) -> CellResult:
    """One asyncio task per env, each running its env's episodes with random actions.

    ``pool-*``: a thread pool of ``threads`` steps the blocking envs, each task awaiting
    ``loop.run_in_executor(pool, env.step, a)``. ``plain-asyncio``: each task awaits its async
    env's ``step`` directly, nothing between them (the asyncio path's ceiling). Actions come
    from each task's own generator; a task resets its env at the end of every episode.
    """
    result = CellResult(idle_lag=await _idle_lag())
    result.rss_before = tree_rss()
    t0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    blocking = spec.contender.startswith("pool-")
    pool = concurrent.futures.ThreadPoolExecutor(max(1, spec.threads), thread_name_prefix="env")
    envs = [make_env(blocking, **spec.env_kwargs()) for _ in range(spec.n_envs)]

    async def call(fn: Callable[..., Any], *args: Any) -> Any:
        if blocking:
            return await loop.run_in_executor(pool, fn, *args)
        return await fn(*args)

    for i, env in enumerate(envs):
        await call(functools.partial(env.reset, seed=spec.seed + i))
    steps = [0]

    stop = asyncio.Event()

    async def episode(env: Any, rng: np.random.Generator) -> int:
        await call(env.reset)
        n = 0
        while not stop.is_set():
            *_, terminated, truncated, _ = await call(env.step, int(rng.integers(2)))
            n += 1
            steps[0] += 1
            if terminated or truncated:
                break
        return n

    async def forever(env: Any, rng: np.random.Generator) -> None:
        while not stop.is_set():
            await episode(env, rng)

    rngs = [np.random.default_rng([spec.seed, i]) for i in range(spec.n_envs)]
    probe = LagProbe()
    try:
        result.start_s = time.perf_counter() - t0
        probe.start()
        tasks = [loop.create_task(forever(e, r)) for e, r in zip(envs, rngs, strict=True)]
        try:
            await _timed_phase(spec, result, lambda: steps[0], probe)
        finally:
            # Let every env finish its step in flight (a cancelled task would leave its step
            # running in a thread, racing the next use of the env).
            stop.set()
            await asyncio.gather(*tasks)
            stop.clear()
        if _call_budget_ok(spec, result):
            for _ in range(spec.calls):
                t0 = time.perf_counter()
                lengths = await asyncio.gather(
                    *(episode(e, r) for e, r in zip(envs, rngs, strict=True))
                )
                result.calls.append(time.perf_counter() - t0)
                result.call_steps.append(sum(lengths))
    finally:
        await probe.stop()
        pool.shutdown(wait=True, cancel_futures=True)
    return result


async def run_ours(spec: CellSpec) -> CellResult:
    """asyncsample's ``thread`` or ``asyncio`` backend with a batched seeded random agent.

    Steps/s, CPU and lag come from a stream of each kind in ``spec.streams`` (the better
    counts; every one is in ``streams``); the call durations from ``obtain_samples(N *
    episode_length)``, then again with ``episode_timeout`` at ``timeout_factor`` mean episode
    durations.
    """
    from asyncsample import RandomAgent, Sampler

    result = CellResult(idle_lag=await _idle_lag())
    result.rss_before = tree_rss()
    t0 = time.perf_counter()
    thread = spec.contender == "ours-thread"
    factory = functools.partial(make_env, thread, **spec.env_kwargs())
    agent = RandomAgent(spaces.Discrete(2), seed=spec.seed)
    common: dict[str, Any] = {
        "n_workers": spec.n_workers,
        "envs_per_worker": spec.envs_per_worker,
        "max_episode_length": spec.episode_length,
        "seed": spec.seed,
        "backend": "thread" if thread else "asyncio",
        "inference": "batched",
    }
    if thread:
        common["max_concurrency"] = spec.threads
    probe = LagProbe()
    # Batches of ``chunk_s`` seconds of steps at the ideal rate (at least one per episode).
    chunk = max(spec.n_episodes, int(spec.chunk_s * (spec.ideal or 20_000.0)))
    try:
        async with Sampler(factory, agent, **common) as sampler:
            result.start_s = time.perf_counter() - t0
            probe.start()
            for kind in spec.streams:
                part = CellResult(idle_lag=result.idle_lag, rss_before=result.rss_before)
                await _stream_phase(spec, part, sampler, chunk, probe, kind)
                result.streams[kind] = part.finish(spec)
                if _better_stream(spec, part, result):
                    result.steps, result.seconds = part.steps, part.seconds
                    result.cpu_s, result.lag, result.rss_open = part.cpu_s, part.lag, part.rss_open
                    result.stream = kind
            if _call_budget_ok(spec, result):
                await _calls(spec, result, sampler.obtain_samples, result.calls, result.call_steps)
        if spec.timeout_factor > 0 and spec.mean > 0 and spec.calls > 0 and result.calls:
            timeout = spec.timeout_factor * spec.mean * spec.episode_length
            async with Sampler(factory, agent, **common, episode_timeout=timeout) as sampler:
                await _calls(
                    spec,
                    result,
                    sampler.obtain_samples,
                    result.timeout_calls,
                    result.timeout_call_steps,
                )
    finally:
        await probe.stop()
    return result


def _better_stream(spec: CellSpec, new: CellResult, old: CellResult) -> bool:
    """Whether the stream measured in ``new`` beat ``old``'s: more steps/s, or (without
    latency, where the CPU is what is measured) less CPU per step."""
    if not old.steps:
        return bool(new.steps)
    if not new.steps:
        return False
    if spec.mean <= 0:
        return new.cpu_s / new.steps < old.cpu_s / old.steps
    return new.steps / new.seconds > old.steps / old.seconds


async def _stream_phase(
    spec: CellSpec, result: CellResult, sampler: Any, chunk: int, probe: LagProbe, kind: str
) -> None:
    """Consume a stream in the background while :func:`_timed_phase` counts the env steps.

    Steps are counted where they happen (:attr:`_LatencyCore.steps_taken`), not from the
    batches: a batch of complete episodes arrives seconds apart, too coarse for a timed phase
    of a few seconds.
    """

    async def consume() -> None:
        fragments = kind == "fragments"
        stream = sampler.stream(chunk, fragments=fragments, fraction_samples=spec.fraction)
        async with contextlib.aclosing(stream) as batches:
            async for _ in batches:
                pass

    task = asyncio.get_running_loop().create_task(consume())
    try:
        await _timed_phase(spec, result, _LatencyCore.count, probe)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _calls(
    spec: CellSpec,
    result: CellResult,
    call: Callable[[int], Awaitable[Any]],
    durations: list[float],
    steps: list[int],
) -> None:
    """Time ``spec.calls`` calls of ``call(N * episode_length)``."""
    for _ in range(spec.calls):
        t0 = time.perf_counter()
        batch = await call(spec.n_episodes * spec.episode_length)
        durations.append(time.perf_counter() - t0)
        steps.append(batch.n_transitions)


def run_cell(spec: CellSpec) -> dict[str, Any]:
    """Run one cell in this process; return its numbers (see :meth:`CellResult.finish`)."""
    if spec.contender == "gym-async":
        return run_gym_async(spec).finish(spec)
    if spec.contender.startswith("pool-") or spec.contender == "plain-asyncio":
        coro: Callable[[CellSpec], Awaitable[CellResult]] = run_tasks
    elif spec.contender.startswith("ours-"):
        coro = run_ours
    else:
        raise ValueError(f"unknown contender {spec.contender!r}; expected one of {CONTENDERS}")
    with asyncio.Runner(loop_factory=_loop_factory(spec.loop)) as runner:
        return runner.run(coro(spec)).finish(spec)  # type: ignore[arg-type]


def _loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if loop == "uvloop":
        import uvloop

        return uvloop.new_event_loop  # type: ignore[no-any-return]
    return None


def outcome_of(spec: CellSpec) -> dict[str, Any]:
    """``{"status": "ok", ...numbers}`` of a run, or ``{"status": "error", "note", ...}``."""
    try:
        return {"status": "ok", **run_cell(spec)}
    except Exception as exc:  # report every failure instead of dying silently
        return {
            "status": "error",
            "note": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=20),
        }


def run_file(spec_path: str, out_path: str) -> int:
    """The child's entry point: run the :class:`CellSpec` in ``spec_path``, write the outcome."""
    warnings.simplefilter("ignore")
    spec = CellSpec(**json.loads(Path(spec_path).read_text()))
    Path(out_path).write_text(json.dumps(outcome_of(spec)))
    return 0


# --------------------------------------------------------------------------------------------
# The plan


@dataclass
class Plan:
    """The study's settings (from the command line)."""

    levels: list[int]
    contenders: list[str]
    spec: dict[str, Any]
    zero_episodes: int = 1000
    thread_pool: int = 256
    timeout: float = 300.0


def cells(plan: Plan) -> Iterator[CellSpec]:
    """Every run of the plan, level by level."""
    base = plan.spec
    for n in plan.levels:
        for contender in plan.contenders:
            if contender == "ours-asyncio-zero":
                continue
            if contender.startswith("ours-"):
                for w, e in _layouts(n):
                    threads = min(plan.thread_pool, n) if contender == "ours-thread" else 0
                    yield CellSpec(contender, n, w, e, threads, **base)
            elif contender.startswith("pool-"):
                yield CellSpec(contender, n, threads=int(contender.split("-")[1]), **base)
            else:
                yield CellSpec(contender, n, **base)
    if "ours-asyncio-zero" in plan.contenders:
        zero = base | {"mean": 0.0, "calls": 0}
        for w, e in _layouts(plan.zero_episodes):
            yield CellSpec("ours-asyncio-zero", plan.zero_episodes, w, e, **zero)


def _layouts(n: int) -> list[tuple[int, int]]:
    """Ours' layouts of N episodes: one env per worker, and 100 envs per worker (N / 10 below
    200 episodes, at least 2)."""
    wide = WIDE_ENVS_PER_WORKER if n >= 2 * WIDE_ENVS_PER_WORKER else max(2, n // 10)
    layouts = [(n, 1)]
    if wide > 1 and n % wide == 0:
        layouts.append((n // wide, wide))
    return layouts


def execute(plan: Plan, out: Path, in_process: bool = False) -> list[dict[str, Any]]:
    """Run every cell (each in a fresh process unless ``in_process``); return the records."""
    from benchmarks._runner import run_fresh

    specs = list(cells(plan))
    records: list[dict[str, Any]] = []
    log = out / "runs.jsonl"
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix="asyncsample-aiobench-") as tmp:
        for i, spec in enumerate(specs, 1):
            print(
                f"[{i}/{len(specs)}] {spec.contender} N={spec.n_episodes} ({spec.layout})",
                file=sys.stderr,
                flush=True,
            )
            fields = dataclasses.asdict(spec)
            if in_process:
                outcome = outcome_of(spec)
            else:
                outcome = run_fresh(
                    ["-m", "benchmarks.async_envs", "--child"], fields, plan.timeout, Path(tmp)
                )
            record = {"spec": fields, "layout": spec.layout, **outcome}
            if outcome.get("status") != "ok":
                print(f"  {outcome.get('status')}: {outcome.get('note')}", file=sys.stderr)
            records.append(record)
            with log.open("a") as f:
                f.write(json.dumps(record, default=str) + "\n")
    return records


# --------------------------------------------------------------------------------------------
# Report


def best_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (level, contender): ours' better layout (highest steps/s; lowest CPU per
    step for the zero-latency env), or the failed run when none finished."""
    best: dict[tuple[int, str], dict[str, Any]] = {}
    for rec in records:
        key = (rec["spec"]["n_episodes"], rec["spec"]["contender"])
        old = best.get(key)
        if old is None or _better(rec, old):
            best[key] = rec
    order = {c: i for i, c in enumerate(CONTENDERS)}
    return sorted(
        best.values(), key=lambda r: (r["spec"]["n_episodes"], order[r["spec"]["contender"]])
    )


def _better(new: dict[str, Any], old: dict[str, Any]) -> bool:
    if new.get("status") != "ok":
        return False
    if old.get("status") != "ok":
        return True
    if new["spec"]["contender"] == "ours-asyncio-zero":
        return bool((new["cpu_us_per_step"] or math.inf) < (old["cpu_us_per_step"] or math.inf))
    return bool((new["steps_per_s"] or 0) > (old["steps_per_s"] or 0))


def _row(rec: dict[str, Any]) -> list[str]:
    spec = rec["spec"]
    layout = rec["layout"] + (f", {rec['stream']} stream" if rec.get("stream") else "")
    head = [f"{spec['n_episodes']:,}", f"`{spec['contender']}`", layout]
    if rec.get("status") != "ok":
        return head + [f"{rec.get('status')}: {rec.get('note', '')}"[:120]] + ["-"] * 7
    lag = rec.get("lag") or {}
    per_ep = rec.get("bytes_per_episode")
    return [
        *head,
        fmt.k(rec["steps_per_s"]),
        fmt.pct(rec["ratio_to_ideal"]),
        f"{fmt.f(lag.get('p50_ms'))} / {fmt.f(lag.get('p99_ms'))}",
        fmt.f(rec["cpu_us_per_step"], "{:.1f}"),
        fmt.f(None if per_ep is None else per_ep / 1024, "{:.1f}"),
        f"{fmt.f(rec['call_p50_s'])} / {fmt.f(rec['call_p99_s'])}",
        f"{fmt.f(rec['timeout_call_p50_s'])} / {fmt.f(rec['timeout_call_p99_s'])}",
    ]


HEADER = [
    "episodes",
    "contender",
    "layout",
    "steps/s",
    "% ideal",
    "loop lag p50 / p99 ms",
    "CPU us/step",
    "KiB/episode",
    "call p50 / p99 s",
    "with episode_timeout p50 / p99 s",
]


def targets(records: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, each with the measured value and whether it is met."""
    rows = {(r["spec"]["n_episodes"], r["spec"]["contender"]): r for r in best_rows(records)}

    def ok(key: tuple[int, str]) -> dict[str, Any] | None:
        rec = rows.get(key)
        return rec if rec is not None and rec.get("status") == "ok" else None

    lines: list[str] = []

    def check(name: str, value: float | None, goal: str, met: bool | None) -> None:
        verdict = "not measured" if met is None else ("met" if met else "NOT met")
        lines.append(f"| {name} | {goal} | {fmt.f(value)} | {verdict} |")

    for n, goal in ((1000, 0.9), (10_000, 0.8)):
        rec = ok((n, "ours-asyncio"))
        ratio = rec["ratio_to_ideal"] if rec else None
        check(
            f"asyncio at {n:,}: share of the ideal",
            ratio,
            f">= {goal}",
            None if ratio is None else ratio >= goal,
        )
    ours, pool = ok((1000, "ours-asyncio")), ok((1000, "pool-32"))
    speedup = ours["steps_per_s"] / pool["steps_per_s"] if ours and pool else None
    check(
        "asyncio / 32-thread pool at 1,000",
        speedup,
        ">= 10",
        None if speedup is None else speedup >= 10,
    )
    lags: dict[int, list[float]] = {}
    for r in records:
        p99 = (r.get("lag") or {}).get("p99_ms")
        if r.get("status") == "ok" and r["spec"]["contender"] == "ours-asyncio" and p99 is not None:
            lags.setdefault(r["spec"]["n_episodes"], []).append(p99)
    for n, level_lags in sorted(lags.items()):
        worst = max(level_lags)
        check(f"asyncio at {n:,}: worst loop lag p99 (ms), every layout", worst, "< 20",
              worst < 20)  # fmt: skip
    spreads = [
        r["timeout_call_p99_s"] / r["timeout_call_p50_s"]
        for r in rows.values()
        if r.get("status") == "ok"
        and r["spec"]["contender"] == "ours-asyncio"
        and r.get("timeout_call_p50_s")
    ]
    spread = max(spreads) if spreads else None
    check(
        "asyncio with episode_timeout: call p99 / p50 (worst level)",
        spread,
        "<= 1.5",
        None if spread is None else spread <= 1.5,
    )
    zero = [r for (n, c), r in rows.items() if c == "ours-asyncio-zero" and r.get("status") == "ok"]
    cpu = zero[0]["cpu_us_per_step"] if zero else None
    n_zero = zero[0]["spec"]["n_episodes"] if zero else 1000
    check(
        f"zero-latency asyncio at {n_zero:,}: main-process CPU per step (us)",
        cpu,
        "<= 20",
        None if cpu is None else cpu <= 20,
    )
    return ["| target | goal | measured | verdict |", "|---|---|---|---|", *lines, ""]


def markdown(results: dict[str, Any]) -> str:
    """The study's report: set-up, the table (best layout), targets, every run, notes."""
    cfg = dataclasses.asdict(CellSpec("", 0, **results["plan"]["spec"]))
    records = results["runs"]
    model = CellSpec("", 0, **results["plan"]["spec"]).latency()
    lines = [
        "# Envs that wait: thousands of concurrent episodes (`asyncsample bench async_envs`)",
        "",
        f"`{results['command']}`",
        "",
        f"Each step waits {model.mean * 1e3:g} ms on average: {model.base * 1e3:.1f} ms, "
        f"{model.tail_probability:.0%} of the steps {model.tail_factor:g}x longer, "
        f"+-{model.jitter:.0%} jitter, drawn from the env's seeded RNG; episodes of "
        f"{cfg['episode_length']} steps. The ideal is N / mean latency. Timed phase "
        f"{cfg['seconds']:g} s after {cfg['warmup_s']:g} s of warm-up; {cfg['calls']} calls "
        f"of N x {cfg['episode_length']} steps for the call durations (p99 of few calls is "
        f"about their max); `episode_timeout` = {cfg['timeout_factor']:g}x the mean episode "
        f"duration. Event loop: {cfg['loop']}.",
        "",
        f"Machine: {results['machine'].get('cpu_affinity')} cores "
        f"({results['machine'].get('cpu_model')}), load before `{results['load_before']}`, "
        f"after `{results['load_after']}` (a shared machine: see the load).",
        "",
        "## Best layout per contender",
        "",
        *fmt.table(HEADER, [_row(r) for r in best_rows(records)]),
        "## Targets (issue 23)",
        "",
        *targets(records),
        "## Every run",
        "",
        *fmt.table(HEADER, [_row(r) for r in records]),
        "## Notes",
        "",
        "- `gym-async` runs at most 64 envs (a process per env); its ratio is against the "
        "cell's ideal. It has no event loop (a blocking call): no lag; its call is "
        f"{cfg['episode_length']} lockstep steps.",
        "- `pool-N`: one asyncio task per env awaiting `loop.run_in_executor`; its call is "
        "every env running one episode. A call whose length at the measured rate would pass "
        f"{cfg['call_limit_s']:g} s is skipped.",
        f"- Ours: steps/s from a stream of each kind in {cfg['streams']} on one sampler "
        f"(batches of {cfg['chunk_s']:g} s of steps at the ideal rate; the better one counts, "
        "see `stream` and `streams` in results.json), counted as the env steps happen; calls "
        "are `obtain_samples(N x episode length)`.",
        "- CPU us/step: `time.process_time()` of the main process over the timed phase / steps "
        "(for `gym-async`, the env processes' CPU is not in it), less the lag probe's own CPU "
        "(measured on the idle loop: at a few hundred steps/s the probe is most of it, so "
        "those cells read near zero; `cpu_us_per_step_raw` in results.json keeps it). "
        "KiB/episode: growth of the RSS of the process tree (RSS double-counts shared pages "
        "of child processes) / envs.",
        "- Loop lag: a task sleeping 1 ms records how late it wakes; on an idle loop it reads "
        "the timer's granularity (`idle_lag` in results.json).",
    ]
    for rec in records:
        for note in rec.get("notes") or []:
            lines.append(f"- `{rec['spec']['contender']}` N={rec['spec']['n_episodes']}: {note}")
    return "\n".join(lines) + "\n"


def write_chart(out: Path, results: dict[str, Any]) -> list[Path]:
    """``async_envs.png``: steps/s per level and contender (log scale) against the ideal, and
    the event-loop lag p99 beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        r
        for r in best_rows(results["runs"])
        if r.get("status") == "ok" and r["spec"]["contender"] != "ours-asyncio-zero"
    ]
    if not rows:
        return []
    levels = sorted({r["spec"]["n_episodes"] for r in rows})
    contenders = [c for c in CONTENDERS if any(r["spec"]["contender"] == c for r in rows)]
    cell = {(r["spec"]["contender"], r["spec"]["n_episodes"]): r for r in rows}
    width = 0.8 / len(contenders)
    fig, (rate_ax, lag_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, value in (
        (rate_ax, lambda r: r["steps_per_s"]),
        (lag_ax, lambda r: (r.get("lag") or {}).get("p99_ms")),
    ):
        for j, c in enumerate(contenders):
            xs, ys = [], []
            for i, n in enumerate(levels):
                rec = cell.get((c, n))
                if rec is not None and value(rec) is not None:
                    xs.append(i + (j - (len(contenders) - 1) / 2) * width)
                    ys.append(value(rec))
            if ys:
                ax.bar(xs, ys, width, label=c, color=f"C{j}")
        ax.set_xticks(range(len(levels)), [f"{n:,} episodes" for n in levels])
    for i, n in enumerate(levels):
        ideal = next(r["ideal_steps_per_s"] for r in rows if r["spec"]["n_episodes"] == n)
        rate_ax.hlines(ideal, i - 0.45, i + 0.45, colors="k", linestyles="dashed",
                       label="ideal (N / mean latency)" if i == 0 else None)  # fmt: skip
    rate_ax.set_yscale("log")
    rate_ax.set_ylabel("env steps / s")
    mean_ms = results["plan"]["spec"].get("mean", MEAN_LATENCY_S) * 1e3
    rate_ax.set_title(f"steps/s against the ideal (steps wait {mean_ms:g} ms on average)")
    rate_ax.legend(fontsize=8)
    lag_ax.axhline(20, color="k", linestyle="dashed", label="target p99 (20 ms)")
    lag_ax.set_yscale("symlog", linthresh=1.0)  # from well under 1 ms to seconds
    lag_ax.set_ylabel("ms")
    lag_ax.set_title("event-loop lag p99 (gym-async has no loop)")
    lag_ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "async_envs.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


# --------------------------------------------------------------------------------------------
# Command line


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, Plan]:
    """The command line, and the plan it asks for."""
    p = argparse.ArgumentParser(
        prog="asyncsample bench async_envs", description=__doc__.split("\n\n", 1)[0]
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="10 and 100 episodes, 20 ms steps, 20-step episodes, 1 s runs",
    )
    p.add_argument(
        "--levels", type=int, nargs="+", help="episodes in flight (default 100 1000 10000)"
    )
    p.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=CONTENDERS)
    p.add_argument("--latency-ms", type=float, help="mean step latency (default 50; quick 20)")
    p.add_argument(
        "--tail", type=float, help="share of the steps in the tail (default 0.01; 0: no tail)"
    )
    p.add_argument("--episode-length", type=int, help="steps per episode (default 100; quick 20)")
    p.add_argument("--seconds", type=float, help="timed phase per run (default 5; quick 1)")
    p.add_argument("--warmup", type=float, help="warm-up per run, seconds (default 2; quick 0.5)")
    p.add_argument("--calls", type=int, help="timed calls per run (default 5; quick 2)")
    p.add_argument(
        "--call-limit", type=float, help="longest expected call, s (default 20; quick 5)"
    )
    p.add_argument(
        "--zero-episodes",
        type=int,
        default=1000,
        help="episodes of the zero-latency cell (default 1000)",
    )
    p.add_argument("--threads", type=int, default=256, help="ours-thread's max_concurrency")
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    p.add_argument(
        "--streams",
        nargs="+",
        choices=["episodes", "fragments"],
        default=["episodes", "fragments"],
        help="ours' steps/s from these streams (the better counts; default both)",
    )
    p.add_argument(
        "--chunk",
        type=float,
        default=1.0,
        help="ours' stream batches, in seconds of steps at the ideal rate (default 1)",
    )
    p.add_argument(
        "--fraction",
        type=float,
        default=1.0,
        help="ours' stream's fraction_samples (default 1.0)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is killed")
    p.add_argument(
        "--in-process", action="store_true", help="run the cells in this process (tests, debugging)"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--render",
        type=Path,
        metavar="RESULTS_JSON",
        help="only re-write results.md and the chart from an existing results.json (to --out)",
    )
    args = p.parse_args(argv)
    q = args.quick

    def pick(value: Any, full: Any, quick: Any) -> Any:
        return value if value is not None else (quick if q else full)

    spec = {
        "mean": pick(args.latency_ms, 50.0, 20.0) / 1e3,
        "tail_probability": pick(args.tail, TAIL_PROBABILITY, TAIL_PROBABILITY),
        "episode_length": pick(args.episode_length, EPISODE_LENGTH, 20),
        "seconds": pick(args.seconds, 5.0, 1.0),
        "warmup_s": pick(args.warmup, 2.0, 0.5),
        "calls": pick(args.calls, 5, 2),
        "call_limit_s": pick(args.call_limit, 20.0, 5.0),
        "loop": args.loop,
        "streams": list(dict.fromkeys(args.streams)),
        "chunk_s": args.chunk,
        "fraction": args.fraction,
    }
    if args.loop == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            spec["loop"] = "asyncio"
    levels = pick(args.levels, [100, 1000, 10_000], [10, 100])
    zero = args.zero_episodes if not q or args.zero_episodes != 1000 else 100
    plan = Plan(levels, list(args.contenders), spec, zero, args.threads, args.timeout)
    return args, plan


def _default_budget(args: argparse.Namespace) -> bool:
    """Whether the run used the study's default budget (no --quick, no override of it)."""
    budget = (
        "levels",
        "latency_ms",
        "tail",
        "episode_length",
        "seconds",
        "warmup",
        "calls",
        "call_limit",
    )
    return not args.quick and all(getattr(args, name) is None for name in budget)


def _load() -> str:
    import os

    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def command_line(argv: list[str]) -> str:
    """The command that ran the study, without its ``--out`` (a path of the machine)."""
    shown: list[str] = []
    skip = False
    for arg in argv:
        if skip or arg.startswith("--out="):
            skip = False
            continue
        if arg == "--out":
            skip = True
            continue
        shown.append(arg)
    return " ".join(["asyncsample bench async_envs", *shown])


def render(results_json: Path, out: Path) -> int:
    """Re-write results.md and the chart of an earlier run from its results.json."""
    from benchmarks import report

    results = json.loads(results_json.read_text())
    (out / "results.md").write_text(markdown(results))
    report.draw_charts(write_chart, out, results)
    print(f"wrote {out / 'results.md'}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the study; write results.json, results.md and the chart to ``--out``.

    Returns:
        0 when every run finished, 1 when one failed (the results are written either way).
    """
    from benchmarks import report

    argv = list(sys.argv[1:] if argv is None else argv)
    args, plan = parse(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.render is not None:
        return render(args.render, out)
    load_before = _load()
    t0 = time.perf_counter()
    records = execute(plan, out, in_process=args.in_process)
    results: dict[str, Any] = {
        "study": "async_envs",
        "command": command_line(argv),
        "machine": report.machine_info(),
        "plan": dataclasses.asdict(plan),
        # The pages (benchmarks/pages.py) cite only a run of the default budget; --quick or any
        # budget override makes this a smoke run.
        "settings": {"quick": not _default_budget(args), "budget": plan.spec},
        "elapsed_s": time.perf_counter() - t0,
        "load_before": load_before,
        "load_after": _load(),
        "runs": records,
    }
    report.write_json(out / "results.json", results)
    (out / "runs.jsonl").unlink(missing_ok=True)
    (out / "results.md").write_text(markdown(results))
    charts = report.draw_charts(write_chart, out, results)
    failed = [r for r in records if r.get("status") != "ok"]
    print(
        f"async_envs: {len(records)} runs in {results['elapsed_s']:.0f} s, {len(failed)} failed; "
        f"wrote {out / 'results.json'}, {out / 'results.md'}" + "".join(f", {p}" for p in charts),
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(run_file(sys.argv[2], sys.argv[3]))
    sys.exit(main())
