"""Big observations are copied once in the main process on the ``process`` backend: with
``inference="host"`` the host writes its chunks' observations into the worker's shared
observation arena, which is the worker's records; with ``"per_worker"`` and ``"batched"`` each
step writes its observations into the arena row the worker records next. The batch is gathered
from there into memory of earlier batches that nothing refers to any more (``BatchMemory``). A
batch the user holds is never written again."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import sys
from collections.abc import Iterator
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from helpers import SamplerFactory

import asyncsample._assembly as assembly
import asyncsample._batcher as batched_module
import asyncsample._engine as engine
import asyncsample.worker as worker_module
from asyncsample import EpisodeBatch, RandomAgent, Transition, VecWorker
from asyncsample._memory import BatchMemory
from asyncsample.backends import _chunk

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.sampler_defaults(
        backend="process",
        inference="host",
        n_workers=2,
        envs_per_worker=2,
        n_processes=2,
        seed=11,
    ),
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SHAPE = (48, 48, 3)


class FrameEnv(gym.Env):  # type: ignore[type-arg]
    """Image frames that differ at every step (a reused buffer would show), episodes of 5 to 40
    steps."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 255, SHAPE, np.uint8)
        self.action_space = gym.spaces.Discrete(3)
        self.t = 0
        self.length = 10
        self.frame = np.zeros(SHAPE, np.uint8)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        self.length = int(self.np_random.integers(5, 40))
        self.frame[:] = self.np_random.integers(0, 256, SHAPE, dtype=np.uint8)
        return self.frame.copy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        self.frame[self.t % SHAPE[0]] = self.np_random.integers(0, 256, SHAPE[1:], dtype=np.uint8)
        self.frame[0, 0, 0] = (self.t + int(action)) % 256
        return self.frame.copy(), float(action), self.t >= self.length, False, {}


class Copies:
    """Bytes of observations the main process copies: into the worker's records (the chunk
    replay, or ``recorded`` by a worker's step) and into batches (the gather)."""

    def __init__(self) -> None:
        self.replayed = 0
        self.gathered = 0
        self.recorded = 0
        self.recorded_rows = 0


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[Copies]:
    seen = Copies()
    put_rows, gather = engine.put_rows, assembly._gather

    def counting_put_rows(dst: Any, start: int, src: Any, n: int) -> None:
        if isinstance(src, np.ndarray) and src.shape[2:] == SHAPE:
            seen.replayed += src[:n].nbytes
        put_rows(dst, start, src, n)

    def counting_gather(plans: Any, records: Any, likes: Any, memory: Any = None) -> np.ndarray:
        out = gather(plans, records, likes, memory)
        if out.shape[1:] == SHAPE:
            seen.gathered += out.nbytes
        return out

    put_row = worker_module.put_row

    def counting_put_row(dst: Any, index: Any, src: Any) -> None:
        if isinstance(src, np.ndarray) and src.shape[1:] == SHAPE:
            seen.recorded += src.nbytes
            seen.recorded_rows += 1
        put_row(dst, index, src)

    monkeypatch.setattr(engine, "put_rows", counting_put_rows)
    monkeypatch.setattr(assembly, "_gather", counting_gather)
    monkeypatch.setattr(worker_module, "put_row", counting_put_row)
    yield seen


@pytest.mark.both_loops
async def test_one_copy_of_each_observation(make_sampler: SamplerFactory, copies: Copies) -> None:
    """Every call mode: the replay copies no observation (the chunks the host wrote are the
    records, in the arena), the batch is the one copy."""
    async with make_sampler(env=FrameEnv) as s:
        batches = [
            await s.obtain_samples(300),
            await s.obtain_fragments(300),
            await s.obtain_exact_episodes(3),
            await s.obtain_samples(300),
        ]
        for worker in s.workers:
            rows = worker.episodes.recorder.rows
            chunk = worker.host.chunk  # type: ignore[union-attr]
            assert chunk is not None and chunk.arena is not None
            assert rows.on_arena and np.shares_memory(rows.obs, chunk.arena)
    assert copies.replayed == 0
    assert copies.gathered == sum(b.observations.nbytes for b in batches) > 0


async def test_stream_run_ahead_writes_in_place(
    make_sampler: SamplerFactory, copies: Copies
) -> None:
    """A stream's rounds (the chunk run ahead for the next round included) go into the arena
    in place: no replay copy."""
    async with make_sampler(env=FrameEnv) as s:
        n = 0
        async with contextlib.aclosing(s.stream(200, fragments=True)) as batches:
            async for batch in batches:
                n += batch.n_transitions
                if n >= 1200:
                    break
    assert copies.replayed == 0
    assert copies.gathered >= 1200 * np.prod(SHAPE)


STEP_MODES = ["per_worker", "batched"]


def _agent(inference: str) -> Any:
    """``batched`` merges the calls of one shared agent (the others: a random agent each)."""
    return RandomAgent(gym.spaces.Discrete(3), seed=5) if inference == "batched" else None


async def _every_call(
    s: Any, copies: Copies | None = None, histories: list[str] | None = None
) -> list[EpisodeBatch]:
    """Every call mode, then a stream of fragments (its rounds: 4 taken, at most 2 ahead);
    ``histories``: gets the workers' transition digests after the calls (a :class:`Recording`
    worker's; the stream's rounds run ahead depend on timing)."""
    out = [
        await s.obtain_samples(300),
        await s.obtain_fragments(300),
        await s.obtain_fragments(200),
        await s.obtain_exact_episodes(3),
        await s.obtain_samples(300),
    ]
    if copies is not None:  # one row per worker and call at most
        assert copies.recorded_rows <= len(out) * len(s.workers)
    if histories is not None:
        histories += [w.history.hexdigest() for w in s.workers]
    async with contextlib.aclosing(s.stream(200, fragments=True, buffer_size=1)) as batches:
        async for batch in batches:
            out.append(batch)
            if len(out) >= 9:
                break
    return out


@pytest.mark.parametrize("inference", STEP_MODES)
async def test_steps_write_their_observations_into_the_records(
    make_sampler: SamplerFactory, copies: Copies, inference: str
) -> None:
    """``per_worker`` and ``batched``: each step writes its observations into the arena row the
    worker records next, so recording copies a row only where a call starts (after a reset, or
    where the rows start again at the arena's front), never per step; the batch is the one
    copy."""
    async with make_sampler(env=FrameEnv, agent=_agent(inference), inference=inference) as s:
        batches = await _every_call(s, copies)
        for worker in s.workers:
            rows = worker.episodes.recorder.rows
            arena = worker.host.obs_arena  # type: ignore[attr-defined]
            assert arena is not None
            assert rows.on_arena and np.shares_memory(rows.obs, arena.rows)
            # The gather reads the records as env rows in place (the workers' rows interleave).
            flat, per_row = assembly._flat_rows(rows.obs)
            assert np.shares_memory(flat, arena.rows) and per_row == 2 * len(s.workers)
    steps = sum(b.n_transitions for b in batches) // 4  # per worker, 2 envs each
    assert steps > 500
    assert copies.recorded_rows <= (len(batches) + 2) * len(s.workers)  # the rounds ahead too
    assert copies.gathered == sum(b.observations.nbytes for b in batches) > 0


class MergedViews(RandomAgent):
    """A shared random agent that counts its merged calls (every worker's rows) and those whose
    observations are a view (not a concatenation of the workers' rows)."""

    def __init__(self) -> None:
        super().__init__(gym.spaces.Discrete(3), seed=5)
        self.merged = self.views = 0

    def get_actions(self, observations: Any) -> Any:
        if len(observations) == 4:  # 2 workers x 2 envs
            self.merged += 1
            self.views += not observations.flags.owndata
        return super().get_actions(observations)


async def test_batched_agent_reads_the_arena(
    make_sampler: SamplerFactory, monkeypatch: pytest.MonkeyPatch, copies: Copies
) -> None:
    """``batched`` (lockstep): the workers' rows of a step lie side by side in one step arena,
    so the merged agent call reads a view of them; nothing is concatenated (for rows of any
    size: these frames are below ``VIEW_BYTES``, under which rows are copied, cheaper)."""
    monkeypatch.setattr(batched_module, "VIEW_BYTES", 0)
    concatenated = []
    concat = batched_module.tree_concat

    def counting_concat(parts: list[Any]) -> Any:
        concatenated.append(len(parts))
        return concat(parts)

    monkeypatch.setattr(batched_module, "tree_concat", counting_concat)
    agent = MergedViews()
    async with make_sampler(env=FrameEnv, agent=agent, inference="batched") as s:
        batches = [await s.obtain_fragments(200) for _ in range(3)]
    assert agent.merged >= 3 * 50 and agent.views == agent.merged
    assert not concatenated
    assert copies.recorded_rows <= 3 * 2
    assert copies.gathered == sum(b.observations.nbytes for b in batches)


class CrashOnce(FrameEnv):
    """A :class:`FrameEnv` whose first env to reach step 6 in each host process raises once."""

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.t == 6 and not os.environ.get("ASYNCSAMPLE_TEST_CRASHED"):
            os.environ["ASYNCSAMPLE_TEST_CRASHED"] = "1"  # in this host process
            raise RuntimeError("crash once")
        return super().step(action)


class Recording(VecWorker):
    """Digests every transition the worker sees (the observations of the active envs and the
    next ones, read from the host's current observations)."""

    def process_transition(self, history: Any, transition: Transition) -> Any:
        seen = history or hashlib.sha256()
        active = transition.active
        seen.update(np.ascontiguousarray(transition.observations[active]).tobytes())
        seen.update(np.ascontiguousarray(transition.next_observations[active]).tobytes())
        return seen


@pytest.mark.parametrize("inference", STEP_MODES)
@pytest.mark.parametrize(
    "env",
    [
        # Slow: CrashOnce, a FrameEnv whose hosts raise once each, steps the same frames over the
        # same arenas in the default run, and its restarts fall back to copies too.
        pytest.param(FrameEnv, marks=pytest.mark.slow, id="FrameEnv"),
        pytest.param(CrashOnce, id="CrashOnce"),
    ],
)
async def test_step_arena_small_or_none_gives_the_same_batches(
    make_sampler: SamplerFactory,
    monkeypatch: pytest.MonkeyPatch,
    copies: Copies,
    inference: str,
    env: type[FrameEnv],
) -> None:
    """Records that outgrow a small arena, steps at its end and host restarts (an env that
    raises) fall back to copies: the batches and the transitions a worker sees stay those of a
    sampler without an arena, and of one with a large arena."""
    results = []
    recorded = []
    for rows in (4096, 7, 0):  # 7 rows: the records leave the arena in every call
        monkeypatch.setattr(_chunk, "ARENA_MAX_ROWS", rows)
        copies.recorded_rows = 0
        async with make_sampler(
            env=env, agent=_agent(inference), inference=inference, worker_class=Recording
        ) as s:
            histories: list[str] = []
            batches = await _every_call(s, histories=histories)
            arenas = [w.host.obs_arena for w in s.workers]  # type: ignore[attr-defined]
            assert all((a is not None) == bool(rows) for a in arenas)
            if env is CrashOnce:
                assert s.restarts > 0
        results.append((batches, histories))
        recorded.append(copies.recorded_rows)
    for batches, histories in results[1:]:
        assert histories == results[0][1]
        for a, b in zip(results[0][0], batches, strict=True):
            _assert_same(a, b)
    assert recorded[0] < recorded[1] < recorded[2]  # no arena: a copy per step


async def _calls_then_stream(s: Any) -> list[EpisodeBatch]:
    out = [
        await s.obtain_samples(250),
        await s.obtain_fragments(160),
        await s.obtain_exact_episodes(2),
    ]
    async with contextlib.aclosing(s.stream(120)) as episodes:
        async for batch in episodes:
            out.append(batch)
            if len(out) >= 8:
                break
    return out


async def _fragment_stream(s: Any) -> list[EpisodeBatch]:
    # Alone in its sampler: what the envs did in a chunk run ahead for a stream closed before
    # (dropped, the next call starts fresh episodes) depends on timing.
    out = []
    async with contextlib.aclosing(s.stream(120, fragments=True)) as fragments:
        async for batch in fragments:
            out.append(batch)
            if len(out) >= 6:
                break
    return out


async def test_small_arena_and_no_arena_give_the_same_batches(
    make_sampler: SamplerFactory, monkeypatch: pytest.MonkeyPatch, copies: Copies
) -> None:
    """Records that outgrow the arena, chunks that do not fit at its end and run-aheads that
    would overlap the rows still to gather fall back to copies: the batches stay those of a
    sampler without an arena, and of one with a large arena."""
    results = []
    replayed = []
    for rows in (4096, 24, 0):  # 24 rows: a few chunks of 4 steps
        monkeypatch.setattr(_chunk, "ARENA_MAX_ROWS", rows)
        copies.replayed = 0
        batches = []
        for run in (_calls_then_stream, _fragment_stream):
            async with make_sampler(env=FrameEnv, inference=_host(4)) as s:
                batches += await run(s)
                arenas = [w.host.chunk.arena for w in s.workers]  # type: ignore[union-attr]
                assert all((a is not None) == bool(rows) for a in arenas)
        results.append(batches)
        replayed.append(copies.replayed)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            _assert_same(a, b)
    assert replayed[0] == 0  # in place
    assert replayed[1] > 0 and replayed[2] > 0  # the fallbacks did copy


async def test_chunks_are_longer_with_an_arena_and_give_the_same_batches(
    make_sampler: SamplerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows too large for long chunks: with an arena (the chunks' observations go there, the
    sets' own rows take memory once written) the chunks are as long as asked; without one they
    are short. The batches are the same."""
    monkeypatch.setattr(_chunk, "CHUNK_BYTES", 5 * 2 * (2 * int(np.prod(SHAPE)) + 20))
    results, capacities = [], []
    for rows in (4096, 0):
        monkeypatch.setattr(_chunk, "ARENA_MAX_ROWS", rows)
        batches = []
        for run in (_calls_then_stream, _fragment_stream):
            async with make_sampler(env=FrameEnv) as s:
                batches += await run(s)
                capacities.append({w.host.chunk.capacity for w in s.workers})  # type: ignore[union-attr]
        results.append(batches)
    assert capacities == [{64}, {64}, {5}, {5}]
    for a, b in zip(*results, strict=True):
        _assert_same(a, b)


def _host(chunk_steps: int) -> Any:
    from asyncsample.inference import Host

    return Host(chunk_steps=chunk_steps)


def _assert_same(a: EpisodeBatch, b: EpisodeBatch) -> None:
    np.testing.assert_array_equal(a.observations, b.observations)
    np.testing.assert_array_equal(a.last_observations, b.last_observations)
    np.testing.assert_array_equal(a.actions, b.actions)
    np.testing.assert_array_equal(a.rewards, b.rewards)
    np.testing.assert_array_equal(a.step_types, b.step_types)
    np.testing.assert_array_equal(a.lengths, b.lengths)


@pytest.mark.parametrize("inference", ["host", "per_worker", "batched"])
async def test_held_batches_are_never_overwritten(
    make_sampler: SamplerFactory, inference: str
) -> None:
    """A slow consumer keeps every other batch of a stream while later rounds run: each held
    batch still equals the copy taken when it arrived, and the memory of the batches let go was
    used again (so the check met reuse)."""
    async with make_sampler(env=FrameEnv, agent=_agent(inference), inference=inference) as s:
        memory: BatchMemory = s._core.memory
        held: list[tuple[EpisodeBatch, np.ndarray, np.ndarray]] = []
        k = 0
        async with contextlib.aclosing(s.stream(400, fragments=True, buffer_size=2)) as it:
            async for batch in it:
                k += 1
                if k % 2:
                    piece = batch.split()[0]  # a view kept beyond the batch itself
                    held.append((batch, batch.observations.copy(), piece.observations))
                del batch
                await asyncio.sleep(0.05)  # slow: the producer runs rounds ahead meanwhile
                if k >= 12:
                    break
        assert memory.reused > 0
        for batch, seen, piece in held:
            np.testing.assert_array_equal(batch.observations, seen)
            np.testing.assert_array_equal(piece, seen[: len(piece)])
        for (a, _, _), (b, _, _) in itertools.pairwise(held):
            assert not np.shares_memory(a.observations, b.observations)


def test_batch_memory_reuses_only_what_nothing_holds() -> None:
    """The reuse rule itself: an array held through any view is not handed out again."""
    memory = BatchMemory(keep=2, min_bytes=0)
    dtype = np.dtype(np.uint8)
    a = memory.take(100, SHAPE, dtype)
    view = a[10:20]
    del a
    b = memory.take(100, SHAPE, dtype)
    assert not np.shares_memory(b, view) and memory.reused == 0
    del view
    c = memory.take(90, SHAPE, dtype)  # the first array again: nothing holds it
    assert memory.reused == 1 and c.shape == (90, *SHAPE)
    d = memory.take(100, SHAPE, dtype)  # b and c are held, the pool is full: a fresh one
    assert not np.shares_memory(d, b) and not np.shares_memory(d, c)
    e = memory.take(1000, SHAPE, dtype)  # too large for any kept array
    assert e.shape[0] == 1000


@pytest.mark.parametrize("n_processes", [1, 2])
def test_vector_env_copy_false_returns_the_shared_buffer(n_processes: int) -> None:
    """``VectorEnv(copy=False)`` (gymnasium's semantics): ``reset`` and ``step`` return the
    hosts' shared observation buffer itself, one array for all sub-envs, with the values a
    ``copy=True`` vector env returns as fresh arrays of its own (one copy)."""
    from asyncsample import VectorEnv

    seen: dict[bool, list[np.ndarray]] = {}
    for copy in (False, True):
        venv = VectorEnv(FrameEnv, 4, n_processes=n_processes, copy=copy)
        try:
            joint = venv._hosted.backend.joint  # type: ignore[attr-defined]
            assert joint is not None
            obs, _ = venv.reset(seed=3)
            frames = [obs.copy()]
            views = [obs]
            for t in range(30):
                obs = venv.step(np.array([t % 3, 1, 2, 0]))[0]
                frames.append(obs.copy())
                views.append(obs)
            for view in views:
                assert np.shares_memory(view, joint.obs) is (not copy)
                if copy:
                    assert view.flags.owndata  # its own memory: made in one copy
                else:
                    assert view is joint.obs
            seen[copy] = frames
        finally:
            venv.close()
    for a, b in zip(seen[False], seen[True], strict=True):
        np.testing.assert_array_equal(a, b)
