"""``stream()`` with ``inference="host"`` on the ``process`` backend: each worker's host starts
the next round's first chunk as its part of a round ends (``RunAhead``), with the batches a
stream without it gives; anything that ends the stream abandons that chunk and the next call
starts fresh episodes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
from envs import FailingEnv, KillSelfEnv, NoisyEnv, SleepyEnv
from helpers import SamplerFactory, stays, wait_until
from test_host_pipeline import (
    ClockAgent,
    assert_same_steps,
    assert_updates_from_next_chunk,
    pipelined_runner,
    record_replays,
)

from asyncsample import EpisodeBatch, Sampler, StepType
from asyncsample._engine import CallMode, Continuity, StopRule
from asyncsample.backends import ChunkRequest, NextChunk
from asyncsample.backends.process import ProcessHost
from asyncsample.inference import Host
from asyncsample.inference import host as host_module
from asyncsample.inference.host import ChunkStepper

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.sampler_defaults(
        backend="process",
        env=NoisyEnv,
        inference=Host(chunk_steps=4),
        n_workers=2,
        envs_per_worker=2,
        max_episode_length=30,
        seed=7,
    ),
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Worker steps of each worker's part of a round of ``stream(ROUND, fragments=True)`` (2 x 2 envs).
STEPS = 20
ROUND = STEPS * 4

#: The states in which a chunk may have run ahead of the records (a stream's run-ahead).
AHEAD = (Continuity.RAN_AHEAD, Continuity.TAKING_OVER)


def assert_from_reset(batch: EpisodeBatch) -> None:
    """Every episode (or fragment) starts at a reset and is whole: NoisyEnv's step count ``t``
    runs 1..length, the first step is FIRST (unless it is also the last), rewards and step
    types have one entry per step."""
    assert len(batch.rewards) == len(batch.step_types) == int(batch.lengths.sum())
    start = 0
    for n in batch.lengths.tolist():
        assert n > 0
        t = batch.env_infos["t"][start : start + n]
        assert np.array_equal(t, np.arange(1, n + 1)), t
        if n > 1:
            assert batch.step_types[start] == StepType.FIRST
        start += n


async def stream_batches(
    s: Sampler,
    count: int,
    *,
    fragments: bool,
    num_samples: int = ROUND,
    delay: float = 0.0,
    buffer_size: int = 2,
) -> list[EpisodeBatch]:
    """The first ``count`` batches of a stream, taken ``delay`` seconds apart."""
    out: list[EpisodeBatch] = []
    it = s.stream(num_samples, fragments=fragments, buffer_size=buffer_size)
    async with contextlib.aclosing(it):
        async for batch in it:
            out.append(batch)
            if len(out) == count:
                break
            await asyncio.sleep(delay)
    return out


def count_takeovers(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per part that found a chunk run ahead for it: whether it took it over."""
    log: list[bool] = []
    original = ChunkStepper._take_over

    async def take_over(self: ChunkStepper) -> None:
        await original(self)
        log.append(self._taken is not None)

    monkeypatch.setattr(ChunkStepper, "_take_over", take_over)
    return log


def progress(s: Sampler) -> list[int]:
    """Per worker, the steps its host ran in chunks so far."""
    out = []
    for worker in s.workers:
        chunk = worker.host.chunk  # type: ignore[union-attr]
        assert chunk is not None
        out.append(int(chunk.progress[0]))
    return out


async def waiting_ahead(s: Sampler) -> None:
    """Wait until every host stands still 4 steps (one chunk) past a round's end: the producer
    waits to hand over a batch and the next round's first chunk has run."""

    def ahead() -> bool:
        return all(p % STEPS == 4 for p in progress(s)) and all(
            w.episodes.state in AHEAD for w in s.workers
        )

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # it also holds for a moment between two rounds
        await wait_until(ahead, 10)
        if await stays(ahead, 0.3):
            return
    raise AssertionError(f"the hosts never stood still one chunk past a round: {progress(s)}")


# -- the host's side, in this process -----------------------------------------------------------


def test_a_run_ahead_sent_before_an_update_runs_nothing_and_leaves_its_state() -> None:
    chunks = pipelined_runner()
    rule = StopRule.for_call(CallMode.FRAGMENTS, 24, 2)
    ahead = ChunkRequest(rule, 5, np.zeros(2, np.int64), np.ones(2, dtype=bool), 0, epoch=0)
    chunks.chunk.epoch[0] += 1  # an update was made after it was sent
    assert chunks.run(ahead).steps == 0
    # The next round's NextChunk, sent after the update, runs its first chunk from that state.
    assert chunks.run(NextChunk(5, 1, 1)).steps == 5
    assert chunks.run(NextChunk(5, 0, 1)).steps == 5
    assert chunks.run(NextChunk(5, 1, 1)).steps == 2  # 12 steps in all
    # Sent with the current epoch, it runs as a plain request.
    ahead = ChunkRequest(rule, 5, np.zeros(2, np.int64), np.ones(2, dtype=bool), 0, epoch=1)
    assert chunks.run(ahead).steps == 5


# -- through the sampler --------------------------------------------------------------------------


async def test_the_host_runs_the_next_rounds_first_chunk_while_the_consumer_holds_a_batch(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None, make_sampler: SamplerFactory
) -> None:
    takeovers = count_takeovers(monkeypatch)
    for ahead in (True, False):
        async with make_sampler(agent=ClockAgent()) as s:
            s._core.run_ahead = ahead
            it = s.stream(ROUND, fragments=True, buffer_size=1)
            async with contextlib.aclosing(it):
                async for _batch in it:
                    # The producer finishes a round, waits to hand it over (the queue is full),
                    # and, with run-ahead, each host has run the round after it's first chunk.
                    # The consumer holds batch 1, batch 2 waits in the queue, and the producer
                    # waits to hand over batch 3: 3 rounds, and with run-ahead round 4's first
                    # chunk (4 steps), ran in each host before batch 2 reached the consumer.
                    if ahead:
                        await waiting_ahead(s)
                        assert progress(s) == [3 * STEPS + 4] * 2
                    else:
                        await wait_until(lambda: progress(s) == [3 * STEPS] * 2, 10)
                        assert await stays(lambda: progress(s) == [3 * STEPS] * 2, 0.3)
                    break
    assert takeovers and all(takeovers)


@pytest.mark.parametrize("fragments", [True, False])
@pytest.mark.parametrize(("delay", "buffer_size"), [(0.0, 2), (0.02, 1)])
async def test_batches_equal_those_without_run_ahead(
    fragments: bool,
    delay: float,
    buffer_size: int,
    monkeypatch: pytest.MonkeyPatch,
    make_sampler: SamplerFactory,
) -> None:
    async def run(inference: Any, ahead: bool = True) -> list[EpisodeBatch]:
        async with make_sampler(agent=ClockAgent(), inference=inference) as s:
            s._core.run_ahead = ahead
            return await stream_batches(
                s, 6, fragments=fragments, num_samples=ROUND, delay=delay, buffer_size=buffer_size
            )

    expected = await run("per_worker")
    without = await run(Host(chunk_steps=4), ahead=False)
    takeovers = count_takeovers(monkeypatch)
    got = await run(Host(chunk_steps=4))
    assert len(takeovers) >= 4 and all(takeovers), takeovers
    for a, b, c in zip(expected, without, got, strict=True):
        assert_same_steps(a, b)
        assert_same_steps(a, c)


@pytest.mark.parametrize("chunk_steps", [4, 64])  # with and without a NextChunk in the part
async def test_a_run_ahead_skipped_for_an_update_is_asked_again(
    chunk_steps: int, monkeypatch: pytest.MonkeyPatch, make_sampler: SamplerFactory
) -> None:
    async def run(ahead: bool) -> list[EpisodeBatch]:
        async with make_sampler(agent=ClockAgent(), inference=Host(chunk_steps)) as s:
            s._core.run_ahead = ahead
            return await stream_batches(s, 5, fragments=True)

    expected = await run(False)
    skipped: list[int] = []
    send_chunk = ProcessHost.send_chunk

    async def send(self: ProcessHost, request: ChunkRequest | NextChunk) -> Any:
        if isinstance(request, ChunkRequest) and request.epoch is not None:
            assert self.chunk is not None
            self.chunk.epoch[0] += 1  # an update made as it went out: the host skips it
            skipped.append(self.worker)
        return await send_chunk(self, request)

    monkeypatch.setattr(ProcessHost, "send_chunk", send)
    takeovers = count_takeovers(monkeypatch)
    got = await run(True)
    assert skipped and takeovers and all(takeovers)
    for a, b in zip(expected, got, strict=True):
        assert_same_steps(a, b)


async def test_an_update_between_rounds_applies_from_the_next_chunk(
    monkeypatch: pytest.MonkeyPatch, make_sampler: SamplerFactory
) -> None:
    chunks = record_replays(monkeypatch)
    updates: list[tuple[float, int]] = []
    env = functools.partial(SleepyEnv, 0.001)
    async with make_sampler(agent=ClockAgent(), env=env) as s:
        it = s.stream(ROUND, fragments=True, buffer_size=1)
        async with contextlib.aclosing(it):
            version = 0
            async for batch in it:
                # Episodes carry the version their first step ran with, at most the newest.
                assert batch.episode_infos["agent_version"].max() <= version
                version += 1
                await s.update_agent({"version": version})
                updates.append((time.monotonic(), version))
                await asyncio.sleep(0.01)
                if version == 6:
                    break
    assert_updates_from_next_chunk(chunks, updates)
    assert {c.version for c in chunks} >= set(range(6))


async def test_closing_the_stream_then_calls_start_fresh_episodes(
    no_leaks: None, make_sampler: SamplerFactory
) -> None:
    async def fresh_calls(s: Sampler) -> None:
        after = await s.obtain_fragments(ROUND)
        assert after.n_transitions == ROUND
        assert_from_reset(after)
        assert not any(w.episodes.state in AHEAD for w in s.workers)
        assert_from_reset(await s.obtain_samples(100))

    async with make_sampler(agent=ClockAgent()) as s:
        await s.obtain_fragments(ROUND)  # the stream continues these fragments
        it = s.stream(ROUND, fragments=True, buffer_size=1)
        async with contextlib.aclosing(it):
            async for _batch in it:  # the producer waits to hand over a batch
                await waiting_ahead(s)
                break
        # The hosts ran the next round's first chunk: their envs moved past the records.
        assert all(w.episodes.state in AHEAD for w in s.workers)
        await fresh_calls(s)
        for fragments in (True, False):
            for batch in await stream_batches(s, 3, fragments=fragments, delay=0.01):
                if fragments:
                    assert batch.n_transitions == ROUND
                else:
                    assert_from_reset(batch)  # whole episodes
            # Each worker's host ran the next round's first chunk, or the producer was cancelled
            # in the worker's part of a round: either way its envs moved past the records.
            assert all(w.episodes.state in (*AHEAD, Continuity.IN_CALL) for w in s.workers)
            await fresh_calls(s)
        assert s.restarts == 0


@pytest.mark.both_loops
async def test_a_stream_closed_mid_round_drops_the_chunks_run_ahead(
    no_leaks: None, make_sampler: SamplerFactory
) -> None:
    # Worker 0 is fast: it finishes its part of round 2 and runs round 3's first chunk while
    # worker 1 is still stepping; the stream closes (the producer is cancelled) meanwhile.
    slow = functools.partial(SleepyEnv, 0.02)
    async with make_sampler(agent=ClockAgent(), env=[NoisyEnv, slow]) as s:
        it = s.stream(ROUND, fragments=True, buffer_size=1)
        async with contextlib.aclosing(it):
            async for batch in it:
                assert batch.n_transitions == ROUND
                await wait_until(lambda: progress(s)[0] == 2 * STEPS + 4, 10)
                assert progress(s)[1] < 2 * STEPS  # mid-round
                break
        assert s.workers[0].episodes.state in AHEAD
        after = await s.obtain_fragments(ROUND)
        assert after.n_transitions == ROUND
        assert_from_reset(after)
        assert_from_reset(await s.obtain_samples(60))


@pytest.mark.both_loops
async def test_a_consumer_cancelled_while_the_producer_waits(
    no_leaks: None, make_sampler: SamplerFactory
) -> None:
    async with make_sampler(agent=ClockAgent()) as s:
        got: list[EpisodeBatch] = []

        async def consume() -> None:
            async with contextlib.aclosing(s.stream(ROUND, fragments=True, buffer_size=1)) as it:
                async for batch in it:
                    got.append(batch)
                    await asyncio.sleep(30)  # the producer fills the queue and waits

        task = asyncio.ensure_future(consume())
        await wait_until(lambda: bool(got), 10)
        await waiting_ahead(s)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        after = await s.obtain_fragments(ROUND)
        assert_from_reset(after)
        assert after.n_transitions == ROUND


@pytest.mark.both_loops
@pytest.mark.parametrize("fault", ["kill", "raise"])
async def test_a_host_killed_or_an_env_failing_during_a_chunk_run_ahead(
    fault: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    no_leaks: None,
    make_sampler: SamplerFactory,
) -> None:
    # Each env's 22nd step falls in round 2's first chunk (steps 21-24), which runs ahead: the
    # first env there kills its host, or raises; round 2's first chunk fails and is retried.
    flag = str(tmp_path / "fault")
    if fault == "kill":
        env = functools.partial(KillSelfEnv, STEPS + 2, flag)
    else:
        env = functools.partial(FailingEnv, flag, STEPS + 2)
    takeovers = count_takeovers(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        async with make_sampler(agent=ClockAgent(), env=env) as s:
            batches = await stream_batches(s, 4, fragments=True, delay=0.01, buffer_size=1)
            assert [b.n_transitions for b in batches] == [ROUND] * 4
            assert s.restarts == 1
            assert takeovers[:2] == [True, True]  # round 2 took the failing chunk over
            assert_from_reset(await s.obtain_samples(60))
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


@pytest.mark.both_loops
async def test_a_host_killed_during_a_chunk_run_ahead_of_a_closed_stream(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    no_leaks: None,
    make_sampler: SamplerFactory,
) -> None:
    # The consumer holds batch 1, batch 2 waits in the queue, the producer waits to hand over
    # batch 3: each env's 62nd step falls in round 4's first chunk, run ahead, never taken over.
    flag = tmp_path / "killed"
    env = functools.partial(KillSelfEnv, 3 * STEPS + 2, str(flag))
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        async with make_sampler(agent=ClockAgent(), env=env, n_workers=1) as s:
            it = s.stream(ROUND // 2, fragments=True, buffer_size=1)
            async with contextlib.aclosing(it):
                async for _batch in it:
                    await wait_until(flag.exists, 10)  # the run-ahead killed its host
                    break
            assert s.restarts == 0  # nobody waited for that chunk
            after = await s.obtain_fragments(ROUND // 2)
            assert after.n_transitions == ROUND // 2
            assert_from_reset(after)
            assert s.restarts == 1
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


async def test_a_run_ahead_that_does_not_match_is_dropped_with_its_episodes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, make_sampler: SamplerFactory
) -> None:
    # Were the next round's first request ever other than the one run ahead, the chunk that ran
    # is not replayed: its envs moved past the records, so every env starts a fresh episode.
    monkeypatch.setattr(host_module, "_same_request", lambda a, b: False)
    with caplog.at_level(logging.INFO, logger="asyncsample"):
        async with make_sampler(agent=ClockAgent()) as s:
            batches = await stream_batches(s, 4, fragments=True)
    for batch in batches:
        assert batch.n_transitions == ROUND
        assert_from_reset(batch)  # every round's fragments start at a reset
    assert any("not taken over" in r.getMessage() for r in caplog.records)
