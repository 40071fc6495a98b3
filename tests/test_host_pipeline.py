"""``inference="host"`` on the ``process`` backend pipelines its chunks: the host runs the next
chunk while the main process replays the last one, with the same batches."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from envs import KillSelfEnv, NoisyEnv, SleepyEnv
from helpers import SamplerFactory, wait_until

from asyncsample import EpisodeBatch
from asyncsample._engine import CallMode, StopRule
from asyncsample._memory import adjacent_rows, carve
from asyncsample._recorder import row_of
from asyncsample._tree import tree_leaves
from asyncsample.agent import RandomAgent
from asyncsample.backends import ChunkReply, ChunkRequest, NextChunk
from asyncsample.backends._chunk import ChunkBuffers, chunk_rows, chunk_sets
from asyncsample.backends._chunk_loop import ChunkRunner
from asyncsample.env_group import EnvFailureError, EnvGroup, StepBuffers
from asyncsample.inference import Host
from asyncsample.inference.host import ChunkStepper
from asyncsample.worker import Transition, VecWorker

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.sampler_defaults(
        backend="process",
        env=NoisyEnv,
        inference="host",
        n_workers=1,
        envs_per_worker=2,
        max_episode_length=30,
        seed=7,
    ),
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ClockAgent:
    """Deterministic actions; every action reports the host's clock and the agent's parameter."""

    def __init__(self) -> None:
        self.version = 0

    def get_param_values(self) -> int:
        return self.version

    def set_param_values(self, params: Any) -> None:
        self.version = int(params["version"])

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        n = len(observations)
        actions = (np.asarray(observations)[:, 0] > 0).astype(np.int64)
        return actions, {
            "t": np.full(n, time.monotonic()),
            "version": np.full(n, self.version),
        }


@dataclass
class Replayed:
    """One chunk as the main process replayed it."""

    first: float  # the host's clock at the chunk's first step
    last: float  # ... and at its last step
    start: float  # the main process's clock as its replay began
    end: float  # ... and ended
    steps: int
    version: int  # the parameter the chunk's first step ran with
    worker: int


def record_replays(monkeypatch: pytest.MonkeyPatch, seconds: float = 0.0) -> list[Replayed]:
    """Log every replayed chunk; each replay takes ``seconds`` longer."""
    log: list[Replayed] = []
    original = ChunkStepper._replay

    def replay(
        self: ChunkStepper, reply: ChunkReply, version: int, chunk: ChunkBuffers | None = None
    ) -> None:
        start = time.monotonic()
        time.sleep(seconds)
        original(self, reply, version, chunk)
        infos = reply.agent_infos
        assert isinstance(infos, dict)
        first, last = float(infos["t"][0][0]), float(infos["t"][reply.steps - 1][0])
        v, w = int(infos["version"][0][0]), self.worker.worker_number
        log.append(Replayed(first, last, start, time.monotonic(), reply.steps, v, w))

    monkeypatch.setattr(ChunkStepper, "_replay", replay)
    return log


def count_follows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the NextChunk requests sent."""
    count = [0]
    original = ChunkStepper._follow

    async def follow(self: ChunkStepper, host: Any, buffer: int) -> Any:
        count[0] += 1
        return await original(self, host, buffer)

    monkeypatch.setattr(ChunkStepper, "_follow", follow)
    return count


class NextObsWorker(VecWorker):
    """Collects every step's next observations through ``process_transition``."""

    def process_transition(self, history: Any, transition: Transition) -> Any:
        rows = np.flatnonzero(transition.active)
        return [*(history or []), transition.next_observations[rows].copy()]


def assert_same_steps(a: EpisodeBatch, b: EpisodeBatch) -> None:
    assert np.array_equal(a.lengths, b.lengths)
    assert np.array_equal(a.observations, b.observations)
    assert np.array_equal(a.last_observations, b.last_observations)
    assert np.array_equal(a.actions, b.actions)
    assert np.array_equal(a.rewards, b.rewards)
    assert np.array_equal(a.step_types, b.step_types)
    assert np.array_equal(a.env_infos["t"], b.env_infos["t"])
    for k in ("worker", "env", "agent_version"):
        assert np.array_equal(a.episode_infos[k], b.episode_infos[k])


# -- the host's side, in this process -----------------------------------------------------------


def pipelined_runner(n_envs: int = 2, capacity: int = 5) -> ChunkRunner:
    """A chunk runner with two sets of buffers over ``n_envs`` NoisyEnvs, reset."""
    env = NoisyEnv()
    obs_space, act_space = env.observation_space, env.action_space
    group = EnvGroup(
        0, StepBuffers.allocate(obs_space, act_space, n_envs), obs_space, act_space, 30
    )
    group.build([[NoisyEnv]] * n_envs, list(range(n_envs)))
    group.reset(np.ones(n_envs, dtype=bool))
    flat = StepBuffers.allocate(obs_space, act_space, chunk_rows(capacity, 2) * n_envs)
    runner = ChunkRunner(group, chunk_sets(flat, capacity, n_envs), act_space)
    runner.install(pickle.dumps((cloudpickle.dumps(RandomAgent(act_space, seed=0)), 0)))
    return runner


class Broken:
    """An agent whose every call raises."""

    def get_actions(self, observations: Any) -> Any:
        raise KeyError("boom")


def install_broken(runner: ChunkRunner) -> None:
    runner.install(pickle.dumps((cloudpickle.dumps(Broken()), 0)))


def fragments(steps: int, n_envs: int = 2) -> ChunkRequest:
    rule = StopRule.for_call(CallMode.FRAGMENTS, steps * n_envs, n_envs)
    return ChunkRequest(rule, 5, np.zeros(n_envs, np.int64), np.ones(n_envs, dtype=bool))


def test_next_chunk_goes_on_from_the_last_chunks_state() -> None:
    runner = pipelined_runner()
    sets = runner.chunks
    assert len(sets) == 2 and sets[0].progress is not sets[1].progress
    assert np.shares_memory(sets[0].progress, sets[1].progress)
    assert runner.run(NextChunk(5, 1, 0)).steps == 0  # nothing to go on from yet
    assert runner.run(fragments(12)).steps == 5
    after_first = sets[0].obs[5].copy()  # the spare row: the observations after the chunk
    reply = runner.run(NextChunk(5, 1, 0))
    assert reply.steps == 5
    assert np.array_equal(sets[1].obs[0], after_first)
    assert runner.run(NextChunk(5, 0, 0)).steps == 2  # 12 steps in all
    assert runner.run(NextChunk(5, 1, 0)).steps == 0  # the part is over


def test_next_chunk_is_skipped_after_an_update_or_a_failure() -> None:
    runner = pipelined_runner()
    assert runner.run(fragments(20)).steps == 5
    runner.chunk.epoch[0] += 1  # an update was made after the next request was sent
    assert runner.run(NextChunk(5, 1, 0)).steps == 0
    assert runner.run(NextChunk(5, 1, 1)).steps == 5  # the state was kept for the next one

    install_broken(runner)
    with pytest.raises(EnvFailureError):
        runner.run(fragments(20))
    runner.install(pickle.dumps((cloudpickle.dumps(RandomAgent(runner.action_space)), 0)))
    assert runner.run(NextChunk(5, 1, 1)).steps == 0  # a failed chunk leaves no state


# -- through the sampler --------------------------------------------------------------------------


async def test_host_runs_the_next_chunk_while_the_last_is_replayed(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None, make_sampler: SamplerFactory
) -> None:
    # Each replay blocks the caller 0.1 s: time enough for a host on a loaded machine to start
    # the next chunk (0.02 s was not, with both cores busy).
    log = record_replays(monkeypatch, seconds=0.1)
    follows = count_follows(monkeypatch)
    async with make_sampler(agent=ClockAgent(), inference=Host(chunk_steps=4)) as s:
        batch = await s.obtain_fragments(80)  # 40 steps of 2 envs: 10 chunks of 4
    assert batch.n_transitions == 80
    assert [r.steps for r in log] == [4] * 10
    # Chunk k + 1 started in the host before chunk k's (slow) replay ended: the host did not
    # wait for it. Without pipelining the request for k + 1 is only sent after that replay.
    ahead = [later.first < r.end for r, later in itertools.pairwise(log)]
    assert all(ahead), ahead
    # One ChunkRequest, then a NextChunk per chunk after the first, none to spare: the part's
    # steps are known in fragments mode.
    assert follows[0] == 9


async def test_no_follow_up_when_one_chunk_holds_the_part(
    monkeypatch: pytest.MonkeyPatch, make_sampler: SamplerFactory
) -> None:
    follows = count_follows(monkeypatch)
    async with make_sampler(agent=ClockAgent(), inference=Host(chunk_steps=8)) as s:
        await s.obtain_fragments(16)  # 8 steps of 2 envs
    assert follows[0] == 0


@pytest.mark.parametrize("seconds", [0.0, 0.005])
async def test_batches_do_not_depend_on_how_far_ahead_the_host_is(
    seconds: float, monkeypatch: pytest.MonkeyPatch, make_sampler: SamplerFactory
) -> None:
    async def calls(inference: Any) -> list[EpisodeBatch]:
        async with make_sampler(agent=ClockAgent(), inference=inference, n_workers=2) as s:
            return [
                await s.obtain_samples(150),
                await s.obtain_exact_episodes(3),
                await s.obtain_fragments(60),
                await s.obtain_fragments(60),
                await s.obtain_samples(100, fraction_samples=0.5),
            ]

    expected = await calls("per_worker")
    record_replays(monkeypatch, seconds)
    got = await calls(Host(chunk_steps=3))
    for a, b in zip(expected, got, strict=False):
        if a is expected[-1]:  # fraction_samples: shares depend on timing, not the steps
            assert b.n_transitions >= 100
            continue
        assert_same_steps(a, b)


async def test_next_observations_are_right_while_the_host_runs_ahead(
    monkeypatch: pytest.MonkeyPatch, make_sampler: SamplerFactory
) -> None:
    # The observation after a chunk's last step comes from the chunk's spare row: the host's
    # current observations already belong to the next chunk.
    async def run(inference: Any) -> list[Any]:
        async with make_sampler(
            agent=ClockAgent(), inference=inference, worker_class=NextObsWorker
        ) as s:
            await s.obtain_samples(120)
            await s.obtain_fragments(40)
            return s.workers[0].history  # type: ignore[no-any-return]

    expected = await run("per_worker")
    record_replays(monkeypatch, seconds=0.005)
    got = await run(Host(chunk_steps=3))
    assert len(got) == len(expected)
    for a, b in zip(expected, got, strict=True):
        assert np.array_equal(a, b)


def assert_updates_from_next_chunk(log: list[Replayed], updates: list[tuple[float, int]]) -> None:
    """Each update (``(time.monotonic() once update_agent returned, version)``) applies from
    the next chunk its worker's host starts, as documented: the chunk running then finishes
    with the parameters it started with.

    A host looks for updates (the epoch) before a chunk's first step, not at the same instant,
    so the chunk running may have taken its first step just after update_agent returned: the
    first step's clock does not tell. The chunk after it does: a host starts a chunk only
    once its previous chunk's last step is done, so a chunk whose predecessor's last step came
    after an update returned started after it and must run with it.
    """
    for worker in {c.worker for c in log}:
        chunks = sorted((c for c in log if c.worker == worker), key=lambda c: c.first)
        for before, chunk in itertools.pairwise(chunks):
            made = [v for t, v in updates if t < before.last]
            assert chunk.version >= max(made, default=0), (before, chunk, updates)


def _replayed_with(log: list[Replayed], version: int) -> bool:
    """Whether a chunk run with parameter ``version`` was replayed."""
    return any(chunk.version == version for chunk in log)


async def test_chunks_started_after_an_update_run_with_it(
    monkeypatch: pytest.MonkeyPatch, make_sampler: SamplerFactory
) -> None:
    # A NextChunk queued before an update must not start with the old parameters once the
    # update was made (the host skips it and the worker asks again after the update).
    log = record_replays(monkeypatch)
    env = functools.partial(SleepyEnv, 0.002)
    updates: list[tuple[float, int]] = []
    async with make_sampler(agent=ClockAgent(), env=env, inference=Host(chunk_steps=2)) as s:
        async with contextlib.aclosing(s.stream(400, fragments=True)) as it:
            async for _batch in it:  # the next round runs meanwhile: update it midway
                for version in range(1, 6):  # once a chunk ran with the version before
                    ran = functools.partial(_replayed_with, log, version - 1)
                    await wait_until(ran, f"a chunk run with version {version - 1}")
                    await s.update_agent({"version": version})
                    updates.append((time.monotonic(), version))
                break
    assert len(log) > 20
    assert_updates_from_next_chunk(log, updates)
    assert {c.version for c in log} >= {0, 1, 2, 3, 4}


async def test_host_killed_with_a_chunk_queued(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    no_leaks: None,
    make_sampler: SamplerFactory,
) -> None:
    env = functools.partial(KillSelfEnv, 30, str(tmp_path / "killed"))
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        async with make_sampler(
            agent=ClockAgent(), env=env, inference=Host(chunk_steps=4), n_workers=2
        ) as s:
            batch = await s.obtain_fragments(200)
            assert s.restarts == 1
            assert batch.n_transitions >= 200
            episodes = await s.obtain_exact_episodes(2)
            assert episodes.n_episodes == 4
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


# -- the current observations stay where the last chunk wrote them ---------------------------------


class SlotsEnv(gym.Env):
    """NoisyEnv's steps, observed as a ``Tuple`` of equal slots (a multi-agent env's shape)."""

    def __init__(self) -> None:
        self.inner = NoisyEnv()
        self.observation_space = gym.spaces.Tuple(
            [gym.spaces.Box(-1.0, 1.0, (2, 3), np.float32)] * 3
        )
        self.action_space = self.inner.action_space

    def _slots(self, obs: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(np.stack([obs * k, obs + k]).astype(np.float32) for k in range(3))

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        obs, info = self.inner.reset(seed=seed)
        return self._slots(obs), info

    def step(self, action: Any) -> Any:
        obs, *rest = self.inner.step(action)
        return (self._slots(obs), *rest)


class SlotsAgent:
    """Deterministic actions from a :class:`SlotsEnv`'s first slot."""

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        first = np.asarray(observations[0])
        return (first[:, 0, 0] > 0).astype(np.int64), {"sum": first.sum(axis=(1, 2))}


def arena_runner(
    space_env: type[gym.Env], arena_rows: int | None, capacity: int = 4
) -> ChunkRunner:
    """A chunk runner over 2 reset envs, with an observation arena of ``arena_rows`` rows
    (``None``: none), laid out as the process backend lays it."""
    env = space_env()
    obs_space, act_space = env.observation_space, env.action_space
    group = EnvGroup(0, StepBuffers.allocate(obs_space, act_space, 2), obs_space, act_space, 30)
    group.build([[space_env]] * 2, [3, 4])
    group.reset(np.ones(2, dtype=bool))
    flat = StepBuffers.allocate(obs_space, act_space, chunk_rows(capacity, 2) * 2)
    arena = None
    if arena_rows is not None:
        arena = carve(obs_space, 2, lambda s, n: np.zeros((n, *s.shape), s.dtype), arena_rows)
    runner = ChunkRunner(group, chunk_sets(flat, capacity, 2, arena=arena), act_space)
    runner.install(pickle.dumps((cloudpickle.dumps(RandomAgent(act_space, seed=0)), 0)))
    return runner


def into_arena(row: int, steps: int = 4) -> ChunkRequest:
    request = fragments(40)
    request.steps, request.obs_row = steps, row
    return request


@pytest.mark.parametrize("space_env", [NoisyEnv, SlotsEnv])
def test_a_chunk_leaves_the_current_observations_in_the_arena(space_env: type[gym.Env]) -> None:
    """A chunk into the arena writes each step's observations straight into the next row and
    leaves the last ones there (no copy home per chunk); the next chunk starts from that row,
    and any other request settles them home first. The observations are those of a runner
    without an arena, step for step."""
    runner, plain = arena_runner(space_env, 12), arena_runner(space_env, None)
    group = runner.group
    own = group.buffers.obs
    arena = runner.chunk.arena
    row_at = functools.partial(row_of, arena)

    def same(a: Any, b: Any) -> bool:
        return all(
            np.array_equal(x, y) for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True)
        )

    def run_both(request: ChunkRequest | NextChunk) -> ChunkReply:
        reply = runner.run(request)
        expected = plain.run(request)  # (it has no arena: into its chunk's own rows)
        assert reply.steps == expected.steps
        chunk = plain.chunks[getattr(request, "buffer", 0)]
        for j in range(reply.steps + 1):
            assert same(row_at(reply.obs_row + j), row_of(chunk.obs, j)), j
        return reply

    reply = run_both(into_arena(0))
    assert reply.steps == 4 and reply.obs_row == 0
    assert group.buffers.obs is not own
    assert all(
        np.shares_memory(a, b)
        for a, b in zip(tree_leaves(group.buffers.obs), tree_leaves(row_at(4)))
    )
    if space_env is SlotsEnv:  # a row's slots end to end: a policy's rows of a step are a view
        assert adjacent_rows(list(row_at(4))) is not None
    kept = [a.copy() for a in tree_leaves(row_at(4))]
    for a in tree_leaves(own):
        a[...] = 9  # read no more while the observations are in the arena
    run_both(NextChunk(4, 1, 0))  # goes on from row 4, written by the last step: not copied
    assert all(np.array_equal(a, b) for a, b in zip(tree_leaves(row_at(4)), kept))
    assert all((a == 9).all() for a in tree_leaves(own))
    runner.settle()  # another request: home, with the last chunk's observations
    plain.settle()
    assert group.buffers.obs is own and same(own, row_at(8)) and same(own, plain.group.buffers.obs)
    for a in tree_leaves(row_at(8)):
        a[...] = 7  # read no more: a chunk elsewhere starts from home
    run_both(into_arena(2, 3))  # from home into row 2, left in row 5
    for a in tree_leaves(own):
        a[...] = 9
    run_both(into_arena(9, 2))  # from row 5 into row 9 (copied), left in row 11

    install_broken(runner)
    with pytest.raises(EnvFailureError):
        runner.run(into_arena(6))
    assert group.buffers.obs is own  # a failed chunk settles


async def test_the_callers_view_follows_the_hosts_observations(
    make_sampler: SamplerFactory,
) -> None:
    """The main process reads a host's current observations where the last chunk left them
    (its arena row) and at home once it asked for anything else; batches are those of
    ``per_worker``, step for step, through calls that continue and calls that reset."""

    async def calls(inference: Any) -> tuple[list[EpisodeBatch], list[tuple[int, bool]]]:
        views: list[tuple[int, bool]] = []
        async with make_sampler(
            env=SlotsEnv, agent=SlotsAgent(), inference=inference, n_workers=2
        ) as s:
            batches = []
            for call in (
                lambda: s.obtain_fragments(20),
                lambda: s.obtain_fragments(30),
                lambda: s.obtain_samples(50),
                lambda: s.obtain_exact_episodes(2),
                lambda: s.obtain_fragments(16),
            ):
                batches.append(await call())
                host: Any = s.workers[0].host
                view = getattr(host, "arena_obs", None)
                if view is not None and view.arena is not None:
                    at = tree_leaves(host.buffers.obs)[0]
                    views.append((view.row, np.shares_memory(at, tree_leaves(view.arena)[0])))
            if views:
                await s.workers[0].host.reset(np.ones(2, dtype=bool))  # a request: home
                views.append((view.row, host.buffers.obs is view.own))
        return batches, views

    expected, _ = await calls("per_worker")
    got, views = await calls(Host(chunk_steps=3))
    for a, b in zip(expected, got, strict=True):
        assert_same_steps(a, b)
    assert views[:-1] and all(row >= 0 and shared for row, shared in views[:-1])
    assert views[-1] == (-1, True)
