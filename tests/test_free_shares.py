"""``obtain_fragments`` without fixed shares (``Sampler(fixed_shares=False)``, the default) on
the backends that step envs one at a time: a call returns once its quota is in, whichever envs
filled it; a step still in flight opens the next call's fragment of its env, with the agent
version it ran under; nothing is lost, duplicated or reordered.

The env that holds the tail here waits at a gate (a file the test creates), so which env has a
step in flight when a call returns is decided by the test, never by timing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from async_envs import CountingAsyncEnv, CountingEnv, GatedAsyncEnv, GatedEnv
from helpers import SamplerFactory, touch
from prometheus_client import CollectorRegistry

from asyncsample import EpisodeBatch, RandomAgent, Sampler
from asyncsample._run_records import RUN_STEPS

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

N_ENVS = 4


@pytest.fixture(params=["asyncio", "thread", "process"])
def lane(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _envs(lane: str, gate: Path) -> list[list[Any]]:
    """One worker: env 0 waits at ``gate``, the others step at once (1,000-step episodes)."""
    blocking = lane == "thread"
    gated = GatedEnv if blocking else GatedAsyncEnv
    counting = CountingEnv if blocking else CountingAsyncEnv
    return [[functools.partial(gated, str(gate)), *[functools.partial(counting, 1000)] * 3]]


def _sampler(make_sampler: SamplerFactory, lane: str, gate: Path, **kwargs: Any) -> Sampler:
    return make_sampler(
        lane, _envs(lane, gate), n_workers=1, envs_per_worker=N_ENVS, seed=0, **kwargs
    )


def _by_env(batches: list[EpisodeBatch]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per env, its step counts (``obs[:, 0]``) and agent versions over ``batches``, in order."""
    steps: dict[int, list[np.ndarray]] = {}
    versions: dict[int, list[np.ndarray]] = {}
    for batch in batches:
        for piece in batch.split():
            env = int(piece.episode_infos["env"][0])
            steps.setdefault(env, []).append(piece.observations[:, 0])
            versions.setdefault(env, []).append(piece.agent_versions)
    return {e: (np.concatenate(steps[e]), np.concatenate(versions[e])) for e in steps}


@pytest.mark.both_loops
async def test_a_call_does_not_wait_for_a_step_in_flight(
    make_sampler: SamplerFactory, lane: str, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    sampler = _sampler(make_sampler, lane, gate)
    try:
        first = await sampler.obtain_fragments(30)
        # env 0's first step waits at the gate: the call filled its quota without it
        assert first.n_transitions >= 30
        assert 0 not in first.episode_infos["env"].tolist()
        host = sampler.workers[0].host
        assert host is not None and 0 in host.in_flight
        # an update between calls: the step in flight keeps the version it ran under (0)
        await sampler.update_agent(RandomAgent(sampler.env_spec.action_space, seed=1))
        touch(gate)
        batches = [first]
        for _ in range(50):  # env 0's carried step comes in within a call or two
            batches.append(await sampler.obtain_fragments(30))
            if 0 in batches[-1].episode_infos["env"].tolist():
                break
    finally:
        touch(gate)
    for batch in batches:
        assert batch.n_transitions >= 30
    per_env = _by_env(batches)
    assert set(per_env) == set(range(N_ENVS))
    for env, (steps, versions) in per_env.items():
        # every step of every env, once and in order, across the calls
        np.testing.assert_array_equal(steps, np.arange(len(steps)), err_msg=f"env {env}")
        assert versions[0] == 0  # each env's first step ran before the update
    # Env 0's steps after the update run under it, but for the step in flight (in process hosts,
    # whose agent copies act: the rest of its run of steps, taken before the copy was updated)
    versions0 = per_env[0][1].tolist()
    old = versions0.count(0)
    assert versions0 == [0] * old + [1] * (len(versions0) - old), versions0
    assert (1 <= old <= RUN_STEPS) if lane == "process" else old == 1
    assert {int(v) for v in np.concatenate([b.agent_versions for b in batches[1:]])} <= {0, 1}


async def test_fixed_shares_split_each_call_evenly(
    make_sampler: SamplerFactory, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    touch(gate)  # env 0 steps as the others do
    sampler = _sampler(make_sampler, "asyncio", gate, fixed_shares=True)
    for _ in range(2):
        batch = await sampler.obtain_fragments(40)
        assert sorted(batch.episode_infos["env"].tolist()) == list(range(N_ENVS))
        assert batch.lengths.tolist() == [10] * N_ENVS
        assert not sampler.workers[0].host.in_flight  # type: ignore[union-attr]


@contextlib.asynccontextmanager
async def _one_step_in_flight(
    make_sampler: SamplerFactory, tmp_path: Path
) -> AsyncIterator[tuple[Sampler, Path]]:
    """A sampler on ``asyncio`` whose ``obtain_fragments(30)`` left env 0's first step in flight
    at its gate, and the gate (opened on the way out, whatever happened)."""
    gate = tmp_path / "gate"
    sampler = _sampler(make_sampler, "asyncio", gate)
    try:
        await sampler.obtain_fragments(30)
        host = sampler.workers[0].host
        assert host is not None and 0 in host.in_flight
        yield sampler, gate
    finally:
        touch(gate)


async def test_a_different_call_drops_the_steps_in_flight_and_counts_them(
    make_sampler: SamplerFactory, tmp_path: Path
) -> None:
    async with _one_step_in_flight(make_sampler, tmp_path) as (sampler, gate):
        host = sampler.workers[0].host
        assert host is not None
        touch(gate)
        await host.in_flight[0]  # env 0 took the step: no batch will hold it
        dropped = sampler.workers[0].episodes.dropped_steps
        batch = await sampler.obtain_samples(30)
    assert not host.in_flight
    assert sampler.workers[0].episodes.dropped_steps > dropped
    for piece in batch.split():  # obtain_samples starts fresh episodes
        np.testing.assert_array_equal(piece.observations[:, 0], np.arange(piece.lengths[0]))


async def test_a_checkpoint_without_fixed_shares_drops_the_steps_in_flight(
    make_sampler: SamplerFactory, tmp_path: Path
) -> None:
    async with _one_step_in_flight(make_sampler, tmp_path) as (sampler, _):
        state = await sampler.checkpoint()
    # env 0 is inside its step: its episode cannot be read at this instant
    assert state.workers[0].envs[0].how == "drop"


async def test_an_env_that_fails_in_its_carried_step_is_rebuilt_alone(
    make_sampler: SamplerFactory, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"

    failed = tmp_path / "failed"

    class FailsAtTheGate(GatedAsyncEnv):
        async def step(self, action: Any) -> Any:
            result = await super().step(action)
            if failed.exists():  # the rebuilt env steps
                return result
            touch(failed)
            raise RuntimeError("failed after the gate")

    envs = [[lambda: FailsAtTheGate(str(gate)), *[functools.partial(CountingAsyncEnv, 1000)] * 3]]
    sampler = make_sampler("asyncio", envs, n_workers=1, envs_per_worker=N_ENVS, seed=0)
    try:
        batches = [await sampler.obtain_fragments(30)]
        touch(gate)
        for _ in range(50):  # the carried step fails within a call or two
            batches.append(await sampler.obtain_fragments(30))
            if sampler.restarts:
                break
    finally:
        touch(gate)
    assert sampler.restarts == 1
    per_env = _by_env(batches)
    assert {1, 2, 3} <= set(per_env)  # env 0's failed step is in no batch
    for env, (steps, _) in per_env.items():
        np.testing.assert_array_equal(steps, np.arange(len(steps)), err_msg=f"env {env}")


async def test_fixed_shares_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="fixed_shares must be a bool, got int 1"):
        Sampler("CartPole-v1", fixed_shares=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "merged"),
    [({}, False), ({"fixed_shares": True}, True), ({"metrics": "registry"}, True)],
    ids=["free-shares", "fixed-shares", "metrics"],
)
async def test_lanes_draw_the_random_agents_rows_themselves_without_fixed_shares(
    options: dict[str, Any], merged: bool, make_sampler: SamplerFactory
) -> None:
    # Without fixed shares (nothing to reproduce bit for bit) and with metrics off (they time
    # the merged calls), a lane takes the built-in agent's row itself: no request, no merged
    # call. Otherwise every row goes through the merger, as an agent of the user's does.
    if options.get("metrics") == "registry":
        options = {"metrics": CollectorRegistry()}
    envs = [[functools.partial(CountingAsyncEnv, 7)] * N_ENVS] * 2
    async with make_sampler(
        "asyncio", envs, n_workers=2, envs_per_worker=N_ENVS, seed=0, **options
    ) as sampler:
        batches = [await sampler.obtain_fragments(60) for _ in range(3)]
        merger = sampler._core.mode.merger
        assert merger is not None
        rows = merger.stats.rows
    assert (rows > 0) is merged
    for batch in batches:
        assert batch.n_transitions >= 60
        assert set(np.unique(batch.actions)) <= {0, 1}
