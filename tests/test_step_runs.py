"""Runs of steps: where a host's agent copy acts (``inference="host"``, async envs in process
hosts) and the call counts steps (``obtain_fragments``), an env takes several steps per request,
answered at once. The records must be exactly those of one request per step."""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
from async_envs import CountingAsyncEnv, GatedAsyncEnv
from helpers import SamplerFactory, touch, wait_until

from asyncsample import EpisodeBatch, StepType, _env_runs
from asyncsample._env_runs import RunStepper
from asyncsample._run_records import RUN_STEPS
from asyncsample.backends._lane_link import RemoteLanes

pytestmark = [pytest.mark.timeout(120), pytest.mark.both_loops]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N_WORKERS, N_ENVS, LENGTH = 2, 3, 7


class ParityAgent:
    """Deterministic: each action is its observation's step count modulo 2 (so a row whose
    action does not belong to its observation shows), with one agent info; ``flip``: the
    other action (an update that shows in every row it acted for)."""

    def __init__(self, flip: bool = False) -> None:
        self.flip = flip

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        actions = (np.asarray(observations)[:, 0].astype(np.int64) + self.flip) % 2
        return actions, {"twice": actions * 2}


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The steps asked of each run request the caller sends."""
    asked: list[int] = []
    original = RemoteLanes.run_soon

    def counting(self: RemoteLanes, i: int, steps: int, *args: Any) -> Any:
        asked.append(steps)
        return original(self, i, steps, *args)

    monkeypatch.setattr(RemoteLanes, "run_soon", counting)
    yield asked


@pytest.fixture
def run_parts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The workers whose parts :class:`RunStepper` drove (no lane per env)."""
    parts: list[int] = []
    original = RunStepper.run

    async def counting(self: RunStepper, *args: Any) -> None:
        parts.append(self.worker.worker_number)
        await original(self, *args)

    monkeypatch.setattr(RunStepper, "run", counting)
    yield parts


@pytest.fixture(params=[1, _env_runs.VECTOR_RUNS], ids=["vectorised", "default"])
def frames(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[list[int]]:
    """How many runs each reply frame brought :class:`RunStepper` for one worker; with
    ``VECTOR_RUNS`` 1 every frame's runs are recorded in one vectorised pass (by default a
    worker of 3 envs records its runs one by one)."""
    monkeypatch.setattr(_env_runs, "VECTOR_RUNS", request.param)
    sizes: list[int] = []
    original = RunStepper.take_runs

    def counting(self: RunStepper, runs: Any, rs: np.ndarray, *args: Any) -> None:
        sizes.append(len(rs))
        original(self, runs, rs, *args)

    monkeypatch.setattr(RunStepper, "take_runs", counting)
    yield sizes


class FailOnceAsyncEnv(CountingAsyncEnv):
    """Raises on its 5th step, mid-run, if it is the first env of all to get there (a flag file
    tells the env hosts apart)."""

    def __init__(self, flag: str, length: int) -> None:
        super().__init__(length)
        self.flag = flag

    async def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.logic.steps_taken == 4:
            try:
                os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                raise RuntimeError("failed once")
        return await super().step(action)


def _sampler(
    make_sampler: SamplerFactory, length: int = LENGTH, latency: float = 0.0, **kwargs: Any
) -> Any:
    return make_sampler(
        "process",
        functools.partial(CountingAsyncEnv, length, latency),
        ParityAgent(),
        inference="host",
        n_workers=N_WORKERS,
        envs_per_worker=N_ENVS,
        seed=3,
        **kwargs,
    )


def _check_records(batch: EpisodeBatch, length: int = LENGTH) -> None:
    """Every row's action, reward, infos and step type belong to its observation."""
    t = batch.observations[:, 0].astype(np.int64)
    np.testing.assert_array_equal(batch.actions, t % 2)
    np.testing.assert_array_equal(batch.rewards, (t % 2).astype(np.float64))
    np.testing.assert_array_equal(batch.agent_infos["twice"], 2 * (t % 2))
    np.testing.assert_array_equal(batch.env_infos["t"], t + 1)
    ends = batch.step_types == StepType.TERMINAL
    np.testing.assert_array_equal(ends, t == length - 1)


async def calls_and_restarts(
    sampler: Any, calls: int = 4, quota: int = 40
) -> tuple[list[EpisodeBatch], int]:
    """``calls`` consecutive ``obtain_fragments(quota)``: the batches, and the env rebuilds."""
    batches, restarts = [], 0
    for _ in range(calls):
        batches.append(await sampler.obtain_fragments(quota))
        restarts += sampler.last_stats.restarts
    return batches, restarts


def assert_whole_pieces(batches: list[EpisodeBatch]) -> None:
    """No half-made episode: each piece's steps are consecutive, an episode's from step 0."""
    for key, pieces in _by_env(batches).items():
        for piece in pieces:
            t = piece.observations[:, 0].astype(np.int64)
            np.testing.assert_array_equal(t, t[0] + np.arange(len(t)), err_msg=str(key))
            if piece.step_types[0] == StepType.FIRST:
                assert t[0] == 0


def _by_env(batches: list[EpisodeBatch]) -> dict[tuple[int, int], list[EpisodeBatch]]:
    pieces: dict[tuple[int, int], list[EpisodeBatch]] = {}
    for batch in batches:
        for piece in batch.split():
            key = (int(piece.episode_infos["worker"][0]), int(piece.episode_infos["env"][0]))
            pieces.setdefault(key, []).append(piece)
    return pieces


async def test_fragments_over_runs_hold_every_step_once_in_order(
    make_sampler: SamplerFactory, runs: list[int], run_parts: list[int], frames: list[int]
) -> None:
    sampler = _sampler(make_sampler)
    quota = 40  # not a multiple of the 6 envs: runs are split at the quota
    batches, stats = [], []
    for _ in range(6):
        batches.append(await sampler.obtain_fragments(quota))
        stats.append(sampler.last_stats)
    assert max(runs) > 1  # runs were asked for, of at most RUN_STEPS steps
    assert max(runs) <= RUN_STEPS
    assert sorted(set(run_parts)) == list(range(N_WORKERS))  # by the runs' stepper
    assert max(frames) > 1  # several envs' runs recorded in one pass
    for batch in batches:
        # the quota, and at most one step per env past it (a split run's rest waits)
        assert quota <= batch.n_transitions < quota + N_WORKERS * N_ENVS
        _check_records(batch)
    for key, pieces in _by_env(batches).items():
        t = np.concatenate([p.observations[:, 0] for p in pieces]).astype(np.int64)
        # each env's steps, in order, none lost or repeated across the calls
        np.testing.assert_array_equal(t, np.arange(len(t)) % LENGTH, err_msg=str(key))
        for before, after in itertools.pairwise(pieces):
            if before.step_types[-1] != StepType.TERMINAL:  # a fragment cut by its call
                np.testing.assert_array_equal(
                    before.last_observations[0], after.observations[0], err_msg=str(key)
                )
    # the episodes' returns and lengths, summed over runs, as over single steps
    episode_return = float(sum(k % 2 for k in range(LENGTH)))
    ended = [s for s in stats if s.episodes]
    assert ended
    for s in ended:
        assert s.min_return == s.max_return == episode_return
        assert s.mean_length == s.max_length == LENGTH


class HarmonicAsyncEnv(CountingAsyncEnv):
    """Step ``t``'s reward (from 0) is ``1 / (t + 3)``: floats whose sum depends on the order
    it is taken in."""

    async def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, _reward, terminated, truncated, info = await super().step(action)
        return obs, 1.0 / (float(obs[0]) + 2.0), terminated, truncated, info


async def test_returns_are_the_rewards_summed_in_order_over_runs(
    make_sampler: SamplerFactory, frames: list[int]
) -> None:
    """Every episode's return is its rewards added one after another, as one request per step
    would sum them, on both ways a frame's runs are recorded (one pass, one by one)."""
    length = 23  # more steps than a run (16): episodes span runs and calls
    sampler = make_sampler(
        "process",
        functools.partial(HarmonicAsyncEnv, length),
        ParityAgent(),
        inference="host",
        n_workers=N_WORKERS,
        envs_per_worker=N_ENVS,
        seed=3,
    )
    expected = backwards = 0.0
    for t in range(length):
        expected += 1.0 / (t + 3)
        backwards += 1.0 / (length - t + 2)
    assert expected != backwards  # the order shows
    returns: list[float] = []
    while len(returns) < 2 * N_WORKERS * N_ENVS:
        await sampler.obtain_fragments(50)
        stats = sampler.last_stats
        if stats.episodes:
            returns += [stats.min_return, stats.max_return]
    assert set(returns) == {expected}


async def test_fixed_shares_ask_runs_of_each_env_share(
    make_sampler: SamplerFactory, runs: list[int], run_parts: list[int]
) -> None:
    sampler = _sampler(make_sampler, length=100, fixed_shares=True)
    share = 2 * RUN_STEPS + 3  # per env: two full runs and a short one
    batch = await sampler.obtain_fragments(share * N_WORKERS * N_ENVS)
    assert batch.n_transitions == share * N_WORKERS * N_ENVS
    assert not run_parts  # fixed shares: the lanes, each asking runs of its share
    assert sorted(runs) == sorted([RUN_STEPS, RUN_STEPS, 3] * N_WORKERS * N_ENVS)
    for pieces in _by_env([batch]).values():
        assert sum(len(p.rewards) for p in pieces) == share
    t = batch.observations[:, 0].astype(np.int64)
    np.testing.assert_array_equal(batch.actions, t % 2)


async def test_an_update_ends_the_runs_it_meets(
    make_sampler: SamplerFactory, runs: list[int]
) -> None:
    sampler = _sampler(make_sampler, length=1000, latency=0.005)  # runs of 50-80 ms
    await sampler.obtain_fragments(60)
    await sampler.update_agent(ParityAgent(flip=True))  # reaches the hosts mid-run
    batches = [await sampler.obtain_fragments(60) for _ in range(3)]
    for pieces in _by_env(batches).values():
        versions = np.concatenate([p.agent_versions for p in pieces])
        t = np.concatenate([p.observations[:, 0] for p in pieces]).astype(np.int64)
        actions = np.concatenate([p.actions for p in pieces])
        # each step is stamped with the version of the agent copy that picked its action
        np.testing.assert_array_equal(actions, (t + versions) % 2)
        old = int((versions == 0).sum())
        # at most a run's steps in flight at the update keep version 0; every later one has 1
        assert versions.tolist() == [0] * old + [1] * (len(versions) - old)
        assert old < RUN_STEPS


async def test_an_env_failing_mid_run_loses_only_its_episode(
    make_sampler: SamplerFactory, run_parts: list[int], tmp_path: Path
) -> None:
    # the first env to reach its 5th step raises there (in its first run)
    sampler = make_sampler(
        "process",
        functools.partial(FailOnceAsyncEnv, str(tmp_path / "failed"), LENGTH),
        ParityAgent(),
        inference="host",
        n_workers=N_WORKERS,
        envs_per_worker=N_ENVS,
        seed=3,
    )
    batches, restarts = await calls_and_restarts(sampler)
    assert run_parts
    assert restarts == 1  # rebuilt alone, the call went on
    for batch in batches:
        assert 40 <= batch.n_transitions < 40 + N_WORKERS * N_ENVS
        _check_records(batch)
    assert_whole_pieces(batches)


async def test_a_run_that_ends_in_the_next_call_is_taken_up_by_it(
    make_sampler: SamplerFactory, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    envs = [
        [
            functools.partial(GatedAsyncEnv, str(gate)),
            *[functools.partial(CountingAsyncEnv, 1000, 0.01)] * 2,
        ]
    ]
    sampler = make_sampler(
        "process", envs, ParityAgent(), inference="host", n_workers=1, envs_per_worker=3, seed=3
    )
    try:
        await sampler.obtain_fragments(12)  # env 0's run waits at the gate
        host = sampler.workers[0].host
        assert host is not None
        asked = host.in_flight[0]
        assert not asked.done()
        call = asyncio.ensure_future(sampler.obtain_fragments(400))  # ~2 s of the other envs
        touch(gate)
        # The run asked by the first call ends in the second: that call records it and asks
        # env 0's next run at once (not when a third call begins).
        await wait_until(lambda: host.in_flight.get(0) not in (None, asked), "env 0's next run")
        assert not call.done()
        batch = await call
    finally:
        touch(gate)
    assert 0 in batch.episode_infos["env"].tolist()
