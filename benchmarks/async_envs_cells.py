"""One cell of the ``async_envs`` study: a contender at a number of episodes in flight.

Each cell runs in a fresh process (``python -m benchmarks.async_envs --child SPEC OUT``) and,
over one timed window after its warm-up, measures: env steps/s (counted where the steps happen),
the event-loop lag (a probe task), the CPU per step of the caller (this process) and of its
child processes (env hosts, the ceiling's loops, gymnasium's env processes), and the memory per
open episode. A cell ends ``ok``, ``refused`` (the sampler refused the configuration before
stepping: async envs in the env hosts today), ``unavailable`` (the installed peer lacks it) or
``error``. Here: the spec, the measuring and the runners in one event loop (plain asyncio, the
thread pools, ours); :mod:`benchmarks.async_envs_run` holds the others and the dispatch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
from gymnasium import spaces

from benchmarks.latency_envs import (
    EPISODE_LENGTH,
    JITTER,
    MEAN_LATENCY_S,
    TAIL_FACTOR,
    TAIL_PROBABILITY,
    LatencyModel,
    _LatencyCore,
    make_env,
    shared_count,
)
from benchmarks.runs import LagProbe

#: Where the env hosts' step counters live (memory, not disk), where there is such a place.
_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None

#: The peers that need one process per env stop at this many envs.
MAX_PROCESS_ENVS = 64
#: Seeds of the ceiling's loops are ``seed + SEED_STRIDE * index``: no two share a stream.
SEED_STRIDE = 1_000_000

#: Async envs in the env hosts (issue 33): contender -> (backend, inference).
HOST_CONTENDERS = {
    "ours-process-per_worker": ("process", "per_worker"),
    "ours-process-batched": ("process", "batched"),
    "ours-process-host": ("process", "host"),
    "ours-ray-batched": ("ray", "batched"),
    "ours-ray-host": ("ray", "host"),
}

CONTENDERS = [
    "ceiling",
    "plain-asyncio",
    "gym-async",
    "pool-32",
    "pool-256",
    "torchrl-asyncio",
    "ours-thread",
    "ours-asyncio",
    *HOST_CONTENDERS,
    "ours-asyncio-zero",
]

__all__ = [
    "CONTENDERS",
    "HOST_CONTENDERS",
    "CellResult",
    "CellSpec",
    "Refused",
    "Unavailable",
    "children_cpu",
    "run_ours",
    "run_tasks",
    "tree_rss",
]


class Refused(Exception):
    """The sampler refused the contender's configuration before taking a step."""


class Unavailable(Exception):
    """The installed peer does not have what the contender measures."""


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


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's live descendants: env hosts, loops."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
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
        sigma: Lognormal spread of every step instead of the jitter (0: the jitter; see
            :class:`~benchmarks.latency_envs.LatencyModel`).
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
        fragment_calls: Ours: also time consecutive ``obtain_fragments(chunk)`` calls.
        cores: Processes of the ceiling and env hosts of ours' ``process``/``ray`` (0: every
            core, ``os.cpu_count()``).
        seed: Seed of the envs and agents.
        gc_threshold: The cyclic collector's thresholds in the cell's process and the processes
            it forks (the ceiling's loops), as ``gc.set_threshold`` takes them; empty: Python's
            own. Ours' env hosts set their own (``_lane_serve.quiet_collector``) either way.
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
    sigma: float = 0.0
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
    fragment_calls: bool = True
    cores: int = 0
    seed: int = 0
    gc_threshold: list[int] = field(default_factory=list)

    def env_kwargs(self) -> dict[str, Any]:
        """Arguments of :func:`make_env` but ``blocking``."""
        return {
            "mean": self.mean,
            "tail_probability": self.tail_probability,
            "tail_factor": self.tail_factor,
            "jitter": self.jitter,
            "sigma": self.sigma,
            "episode_length": self.episode_length,
        }

    def latency(self) -> LatencyModel:
        """The spec's latency model."""
        return LatencyModel(
            self.mean, self.tail_probability, self.tail_factor, self.jitter, self.sigma
        )

    @property
    def n_envs(self) -> int:
        """Envs actually run: N, but at most 64 for ``gym-async``."""
        if self.contender == "gym-async":
            return min(self.n_episodes, MAX_PROCESS_ENVS)
        return self.n_episodes

    @property
    def n_cores(self) -> int:
        """``cores``, or every core of the machine when 0."""
        return self.cores or os.cpu_count() or 1

    @property
    def ideal(self) -> float | None:
        """Steps/s of N episodes each waiting the mean latency per step (None without waits)."""
        return self.n_episodes / self.mean if self.mean > 0 else None

    @property
    def layout(self) -> str:
        """How the contender holds its envs, for the tables."""
        if self.contender.startswith("ours-"):
            text = f"{self.n_workers}x{self.envs_per_worker}"
            if self.contender in HOST_CONTENDERS:
                text += f" over {self.n_cores} hosts"
            return text + (f", {self.threads} threads" if self.contender == "ours-thread" else "")
        if self.contender.startswith("pool-"):
            return f"{self.n_envs} envs, {self.threads} threads"
        if self.contender == "plain-asyncio":
            return f"{self.n_envs} tasks"
        if self.contender == "ceiling":
            return f"{self.n_cores} processes x {math.ceil(self.n_envs / self.n_cores)} tasks"
        if self.contender == "torchrl-asyncio":
            return f"AsyncEnvPool of {self.n_envs} envs"
        return f"{self.n_envs} processes"


@dataclass
class CellResult:
    """What one run measured (see the module's docstring)."""

    steps: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    host_cpu_s: float = 0.0
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
    fragment_calls: dict[str, Any] = field(default_factory=dict)
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
            "host_cpu_us_per_step": 1e6 * self.host_cpu_s / self.steps if self.steps else None,
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
    spec: CellSpec,
    result: CellResult,
    count: Callable[[], int],
    probe: LagProbe | None,
    start: Any = None,
) -> None:
    """Let the running contender warm up, then time ``seconds`` of it: steps, CPU, lag, RSS.

    ``start``, a barrier shared with other processes (the ceiling's loops), opens one timed
    window for all of them.
    """
    await asyncio.sleep(spec.warmup_s)
    result.rss_open = tree_rss()
    if start is not None:
        await asyncio.get_running_loop().run_in_executor(None, start.wait, 120.0)
    if probe is not None:
        probe.lags.clear()
    s0, c0, h0, t0 = count(), time.process_time(), children_cpu(), time.perf_counter()
    await asyncio.sleep(spec.seconds)
    s1, c1, h1, t1 = count(), time.process_time(), children_cpu(), time.perf_counter()
    result.steps, result.cpu_s, result.seconds = s1 - s0, c1 - c0, t1 - t0
    result.host_cpu_s = max(0.0, h1 - h0)
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


async def run_tasks(spec: CellSpec, start: Any = None) -> CellResult:
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
            await _timed_phase(spec, result, lambda: steps[0], probe, start)
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
    """asyncsample with a seeded random agent: ``thread``, ``asyncio`` or async envs in hosts.

    Steps/s, CPU and lag come from a stream of each kind in ``spec.streams`` (the better
    counts; every one is in ``streams``), then from consecutive ``obtain_fragments`` calls
    (``fragment_calls``); the call durations from ``obtain_samples(N * episode_length)``, then
    again with ``episode_timeout`` at ``timeout_factor`` mean episode durations. A sampler that
    refuses the configuration (async envs on ``process``/``ray`` today) raises :class:`Refused`.
    """
    from asyncsample import RandomAgent, Sampler

    result = CellResult(idle_lag=await _idle_lag())
    result.rss_before = tree_rss()
    t0 = time.perf_counter()
    thread = spec.contender == "ours-thread"
    counted = _LatencyCore.count
    counter_dir = None
    if spec.contender in HOST_CONTENDERS:  # envs in other processes count in shared files
        counter_dir = tempfile.mkdtemp(prefix="asyncsample-steps-", dir=_SHM)
        counted = functools.partial(shared_count, counter_dir)
    factory = functools.partial(make_env, thread, counter_dir=counter_dir, **spec.env_kwargs())
    agent = RandomAgent(spaces.Discrete(2), seed=spec.seed)
    backend, inference = HOST_CONTENDERS.get(
        spec.contender, ("thread" if thread else "asyncio", "batched")
    )
    common: dict[str, Any] = {
        "n_workers": spec.n_workers,
        "envs_per_worker": spec.envs_per_worker,
        "max_episode_length": spec.episode_length,
        "seed": spec.seed,
        "backend": backend,
        "inference": inference,
    }
    if thread:
        common["max_concurrency"] = spec.threads
    if spec.contender in HOST_CONTENDERS:
        common["n_processes"] = min(spec.n_cores, spec.n_workers)
    try:
        sampler = Sampler(factory, agent, **common)
        await sampler.start()  # built in this loop, a sampler reads its probe env as it starts
    except Exception as exc:
        if counter_dir is not None:
            shutil.rmtree(counter_dir, ignore_errors=True)
        if spec.contender in HOST_CONTENDERS:  # a configuration the sampler does not take yet
            message = str(exc).replace(repr(factory), "the async env factory")
            raise Refused(f"{type(exc).__name__}: {message}") from exc
        raise
    probe = LagProbe()
    # Batches of ``chunk_s`` seconds of steps at the ideal rate (at least one per episode).
    chunk = max(spec.n_episodes, int(spec.chunk_s * (spec.ideal or 20_000.0)))
    try:
        async with sampler:
            result.start_s = time.perf_counter() - t0
            probe.start()
            for kind in spec.streams:
                part = CellResult(idle_lag=result.idle_lag, rss_before=result.rss_before)
                await _stream_phase(spec, part, sampler, chunk, probe, kind, counted)
                result.streams[kind] = part.finish(spec)
                if _better_stream(spec, part, result):
                    result.steps, result.seconds = part.steps, part.seconds
                    result.cpu_s, result.lag, result.rss_open = part.cpu_s, part.lag, part.rss_open
                    result.host_cpu_s = part.host_cpu_s
                    result.stream = kind
            if spec.fragment_calls:
                part = CellResult(idle_lag=result.idle_lag, rss_before=result.rss_before)
                await _stream_phase(spec, part, sampler, chunk, probe, "fragment-calls", counted)
                result.fragment_calls = part.finish(spec) | {"chunk": chunk}
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
        if counter_dir is not None:
            shutil.rmtree(counter_dir, ignore_errors=True)
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
    spec: CellSpec,
    result: CellResult,
    sampler: Any,
    chunk: int,
    probe: LagProbe,
    kind: str,
    count: Callable[[], int],
) -> None:
    """Sample in the background while :func:`_timed_phase` counts the env steps.

    ``kind``: a stream of complete ``"episodes"``, a stream of ``"fragments"``, or
    ``"fragment-calls"``: ``obtain_fragments(chunk)`` called again and again. Steps are counted
    where they happen (``count``: :meth:`_LatencyCore.count`, or for envs in the env hosts
    the counters they keep in shared files), not from the batches: a batch of complete episodes
    arrives seconds apart, too coarse for a timed phase of a few seconds.
    """

    async def consume() -> None:
        if kind == "fragment-calls":
            while True:
                await sampler.obtain_fragments(chunk)
        stream = sampler.stream(
            chunk, fragments=kind == "fragments", fraction_samples=spec.fraction
        )
        async with contextlib.aclosing(stream) as batches:
            async for _ in batches:
                pass

    task = asyncio.get_running_loop().create_task(consume())
    try:
        await _timed_phase(spec, result, count, probe)
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


def _loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if loop == "uvloop":
        import uvloop

        return uvloop.new_event_loop  # type: ignore[no-any-return]
    return None
