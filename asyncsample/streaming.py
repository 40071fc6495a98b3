"""``Sampler.stream``: rounds sampled in a background task into a queue of ``buffer_size``
batches, each round resuming what the last left running; a slow consumer pauses the workers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncsample import _resume, _validate
from asyncsample._env_tasks import Admission
from asyncsample._recorder import Resume
from asyncsample.batch import EpisodeBatch
from asyncsample.checkpoint import SamplerState, StreamState
from asyncsample.stats import SampleStats

if TYPE_CHECKING:
    from asyncsample._core import Mode, SamplerCore

__all__ = ["merge_stats", "stream"]

logger = logging.getLogger("asyncsample")


async def stream(
    sampler: SamplerCore,
    num_samples: int,
    *,
    fragments: bool = False,
    agent_update: Any = None,
    max_policy_lag: int | None = None,
    buffer_size: int = 2,
    fraction_samples: float = 1.0,
) -> AsyncGenerator[EpisodeBatch, None]:
    """The body of :meth:`Sampler.stream` (see there), over the sampler's core."""
    num_samples = _validate.positive_int("num_samples", num_samples)
    fraction = _validate.fraction("fraction_samples", fraction_samples)
    fragments = _validate.flag("fragments", fragments)
    buffer_size = _validate.positive_int("buffer_size", buffer_size)
    max_policy_lag = _validate.optional_nonnegative_int("max_policy_lag", max_policy_lag)
    sampler.check_open()
    sampler.check_agent_update(agent_update)
    mode: Mode = "fragments" if fragments else "samples"
    async with sampler.locked("stream"):
        sampler.check_open()
        await sampler.start_unlocked()
        if not fragments and not sampler.warned_endless:
            sampler.warn_if_endless()
        sampler.apply_agent_update(agent_update)
        queue: asyncio.Queue[tuple[EpisodeBatch, SampleStats] | BaseException] = asyncio.Queue(
            maxsize=buffer_size
        )

        metrics = sampler.metrics
        leave = Resume.FRAGMENTS if fragments else Resume.EPISODES
        # The first round continues a previous obtain_fragments call's fragments, or the stream
        # a resumed checkpoint was taken in (whose sampled rounds come first).
        resume = Resume.NOTHING
        if fragments and sampler.last_mode == "fragments":
            resume = Resume.FRAGMENTS
        ready = _resume.continue_stream(sampler, num_samples, fragments, fraction)
        if ready is not None:
            resume = leave
        gate = _resume.RoundGate()

        async def produce() -> None:
            nonlocal resume
            try:
                while True:
                    await gate.enter()  # a checkpoint holds the rounds between two of them
                    try:
                        # ahead: inference="host" may start the next round's chunks (RunAhead).
                        result = await sampler.sample_round(
                            mode,
                            num_samples,
                            resume=resume,
                            leave=leave,
                            fraction=fraction,
                            ahead=sampler.run_ahead,
                        )
                    finally:
                        gate.left()
                    sampler.last_mode = mode
                    resume = leave
                    gate.putting = result
                    waited = time.perf_counter()
                    await queue.put(result)  # a full queue: the rounds wait for the consumer
                    gate.putting = None
                    if metrics is not None:
                        metrics.caller_idle(time.perf_counter() - waited)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # handed to the consumer, raised there
                await queue.put(exc)

        sampler.streaming = True
        if sampler.lanes and max_policy_lag is not None and not fragments:
            # No episode starts while the versions in flight would spread by more than the lag.
            sampler.admission = Admission(max_policy_lag)
        ready = ready or []

        async def take() -> SamplerState:
            await gate.pause()
            try:
                held = _resume.drain(queue, gate.putting)
                pending = [*ready, *held]
                taken = StreamState(num_samples, fragments, fraction, pending)
                return await _resume.capture(sampler, taken)
            finally:
                gate.release()

        sampler.stream_checkpoint = take
        producer = asyncio.ensure_future(produce())
        try:
            while True:
                asked = time.perf_counter()
                parts: list[EpisodeBatch] = []
                stats: list[SampleStats] = []
                while sum(p.n_transitions for p in parts) < num_samples:
                    item = ready.pop(0) if ready else await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    batch, stat = item
                    if max_policy_lag is not None:
                        newest = sampler.newest_agent_version()
                        fresh = batch.episode_infos["agent_version"] >= newest - max_policy_lag
                        if not fresh.all():
                            logger.info(
                                "stream: dropped %d of %d episodes that started more than "
                                "max_policy_lag=%d agent versions before the newest (%d)",
                                int((~fresh).sum()),
                                len(fresh),
                                max_policy_lag,
                                newest,
                            )
                            batch = batch.select(fresh)
                    parts.append(batch)
                    stats.append(stat)
                out = EpisodeBatch.concatenate(*parts) if len(parts) > 1 else parts[0]
                sampler.total_env_steps += out.n_transitions
                sampler.last_stats = merge_stats(stats, out, sampler.n_workers)
                sampler.stream_guard.handing_out()
                if metrics is not None:
                    metrics.batch_waited(time.perf_counter() - asked)
                yield out
        finally:
            sampler.streaming = False
            sampler.stream_checkpoint = None
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
            sampler.mode.drop_ahead()  # chunks started for a round that will not come
            sampler.admission = None


def merge_stats(stats: list[SampleStats], batch: EpisodeBatch, n_workers: int) -> SampleStats:
    """The statistics of the rounds that made one streamed ``batch`` (after lag drops)."""
    transitions = batch.n_transitions
    if len(stats) == 1 and stats[0].transitions == transitions:
        return stats[0]
    workers = np.asarray(batch.episode_infos.get("worker", np.zeros(0)), dtype=np.int64)
    worker_transitions: tuple[int, ...] = ()
    if len(workers) == len(batch.lengths):
        counts = np.bincount(workers, weights=batch.lengths, minlength=n_workers)
        worker_transitions = tuple(int(c) for c in counts)
    waits = [s.worker_wait_seconds for s in stats if s.worker_wait_seconds]
    wait_sums = tuple(float(sum(w)) for w in zip(*waits)) if waits else ()
    episodes = sum(s.episodes for s in stats)
    seconds = sum(s.seconds for s in stats)
    weighted = [s for s in stats if s.episodes]

    def mean(attr: str) -> float:
        if not weighted:
            return float("nan")
        return float(sum(getattr(s, attr) * s.episodes for s in weighted) / episodes)

    return SampleStats(
        transitions=transitions,
        episodes=episodes,
        mean_return=mean("mean_return"),
        max_return=max((s.max_return for s in weighted), default=float("nan")),
        min_return=min((s.min_return for s in weighted), default=float("nan")),
        mean_length=mean("mean_length"),
        max_length=max((s.max_length for s in stats), default=0),
        seconds=seconds,
        steps_per_second=transitions / seconds if seconds > 0 else 0.0,
        agent_version=max(s.agent_version for s in stats),
        restarts=sum(s.restarts for s in stats),
        worker_transitions=worker_transitions,
        worker_wait_seconds=wait_sums,
    )
