"""Ready batches where the agent acts in the caller (``per_worker``, ``batched``) and the envs
are async envs in process hosts: ``obtain_fragments`` without fixed shares takes each reply frame's
steps in one pass, asks the agent once for the envs ready in a pass of the event loop and sends
their steps as one frame (no coroutine or task per env step). The records must be exactly those
of one request per step."""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from async_envs import CountingAsyncEnv, GatedAsyncEnv
from envs import first_to_claim
from helpers import SamplerFactory, touch, wait_until
from test_step_runs import (
    LENGTH,
    N_ENVS,
    N_WORKERS,
    FailOnceAsyncEnv,
    HarmonicAsyncEnv,
    ParityAgent,
    _by_env,
    _check_records,
    assert_whole_pieces,
    calls_and_restarts,
)

from asyncsample import AgentRowsError, EpisodeBatch, StepType
from asyncsample._batcher import Batched, Batcher
from asyncsample._env_runs import RunStepper
from asyncsample._env_tasks import LaneStepper
from asyncsample.backends import _lane_link
from asyncsample.backends._lane_link import LaneLink, answered

pytestmark = [pytest.mark.timeout(120), pytest.mark.both_loops]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MODES = ["per_worker", "batched"]


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The rows of each agent request of the ready batches; no lane may run meanwhile."""
    rows: list[int] = []
    original = Batcher.ask_rows

    def counting(self: Batcher, agent: Any, worker: int, obs: Any, envs: list[int], *a: Any) -> Any:
        rows.append(len(envs))
        return original(self, agent, worker, obs, envs, *a)

    async def no_lanes(self: LaneStepper, *args: Any) -> None:
        raise AssertionError("a lane per env ran where the ready batches should")

    monkeypatch.setattr(Batcher, "ask_rows", counting)
    monkeypatch.setattr(LaneStepper, "run", no_lanes)
    yield rows


@pytest.fixture(params=["process", "ray"])
def backend(request: pytest.FixtureRequest) -> str:
    """Both host backends of async envs (Ray's variants run in the slow pass: its cluster
    starts)."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return str(request.param)


def _sampler(
    make_sampler: SamplerFactory,
    inference: str,
    env: Any = None,
    backend: str = "process",
    agent: Any = None,
    **kw: Any,
) -> Any:
    return make_sampler(
        backend,
        env or functools.partial(CountingAsyncEnv, LENGTH, 0.001),
        agent or ParityAgent(),
        inference=inference,
        n_workers=N_WORKERS,
        envs_per_worker=N_ENVS,
        seed=3,
        **kw,
    )


def _in_order(batches: list[EpisodeBatch]) -> None:
    """Each env's steps, in order, none lost or repeated across the calls; a fragment cut by its
    call ends where the next one begins."""
    for key, pieces in _by_env(batches).items():
        t = np.concatenate([p.observations[:, 0] for p in pieces]).astype(np.int64)
        np.testing.assert_array_equal(t, np.arange(len(t)) % LENGTH, err_msg=str(key))
        for before, after in itertools.pairwise(pieces):
            if before.step_types[-1] != StepType.TERMINAL:
                np.testing.assert_array_equal(
                    before.last_observations[0], after.observations[0], err_msg=str(key)
                )


@pytest.mark.parametrize("inference", MODES)
async def test_fragments_hold_every_step_once_in_order(
    make_sampler: SamplerFactory, asked: list[int], inference: str, backend: str
) -> None:
    sampler = _sampler(make_sampler, inference, backend=backend)
    quota = 40  # not a multiple of the 6 envs: steps answered past the quota open the next call
    batches, stats = [], []
    for _ in range(8):
        batches.append(await sampler.obtain_fragments(quota))
        stats.append(sampler.last_stats)
    assert max(asked) > 1  # several envs' rows in one agent request
    for batch in batches:
        # the quota, and at most one step per env past it
        assert quota <= batch.n_transitions < quota + N_WORKERS * N_ENVS
        _check_records(batch)
        assert (batch.agent_versions == 0).all()
    _in_order(batches)
    episode_return = float(sum(k % 2 for k in range(LENGTH)))
    ended = [s for s in stats if s.episodes]
    assert ended
    for s in ended:
        assert s.min_return == s.max_return == episode_return
        assert s.mean_length == s.max_length == LENGTH


async def test_returns_are_the_rewards_summed_in_order(
    make_sampler: SamplerFactory, asked: list[int]
) -> None:
    length = 23
    sampler = _sampler(make_sampler, "batched", functools.partial(HarmonicAsyncEnv, length))
    expected = 0.0
    for t in range(length):
        expected += 1.0 / (t + 3)
    returns: list[float] = []
    while len(returns) < 2 * N_WORKERS * N_ENVS:
        await sampler.obtain_fragments(50)
        if sampler.last_stats.episodes:
            returns += [sampler.last_stats.min_return, sampler.last_stats.max_return]
    assert set(returns) == {expected}


@pytest.mark.parametrize("inference", MODES)
async def test_an_env_failing_loses_only_its_episode(
    make_sampler: SamplerFactory, asked: list[int], inference: str, tmp_path: Path
) -> None:
    env = functools.partial(FailOnceAsyncEnv, str(tmp_path / "failed"), LENGTH)
    sampler = _sampler(make_sampler, inference, env)
    batches, restarts = await calls_and_restarts(sampler)
    assert restarts == 1  # rebuilt alone, the call went on
    for batch in batches:
        assert 40 <= batch.n_transitions < 40 + N_WORKERS * N_ENVS
        _check_records(batch)
    assert_whole_pieces(batches)


class ParityRowFailingAgent(ParityAgent):
    """:class:`ParityAgent` that fails, once over all its copies, the first row it is given at
    step count 2 (:class:`~asyncsample.AgentRowsError`); records every row it was given."""

    def __init__(self, flag: str) -> None:
        super().__init__()
        self.flag = flag
        self.rows: list[int] = []

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        actions, infos = super().get_actions(observations)
        self.rows.append(len(actions))
        at = np.flatnonzero(np.asarray(observations)[:, 0] == 2)
        if len(at) and first_to_claim(self.flag):
            raise AgentRowsError(actions, infos, {int(at[0]): RuntimeError("no reply")})
        return actions, infos


@pytest.mark.parametrize("inference", MODES)
async def test_a_row_the_agent_fails_is_its_envs_fault_alone(
    make_sampler: SamplerFactory, asked: list[int], inference: str, tmp_path: Path
) -> None:
    agent = ParityRowFailingAgent(str(tmp_path / "failed"))
    sampler = _sampler(make_sampler, inference, agent=agent)
    batches, restarts = await calls_and_restarts(sampler)
    assert restarts == 1
    assert max(agent.rows) > 1  # the failed row was one of several in its call
    for batch in batches:
        _check_records(batch)
    assert_whole_pieces(batches)


@pytest.mark.parametrize("inference", MODES)
async def test_an_update_between_calls_stamps_the_steps_after_it(
    make_sampler: SamplerFactory, asked: list[int], inference: str
) -> None:
    sampler = _sampler(make_sampler, inference, functools.partial(CountingAsyncEnv, 1000, 0.002))
    await sampler.obtain_fragments(60)
    await sampler.update_agent(ParityAgent(flip=True))
    batches = [await sampler.obtain_fragments(60) for _ in range(3)]
    for pieces in _by_env(batches).values():
        versions = np.concatenate([p.agent_versions for p in pieces])
        t = np.concatenate([p.observations[:, 0] for p in pieces]).astype(np.int64)
        actions = np.concatenate([p.actions for p in pieces])
        # each step is stamped with the version of the agent that picked its action
        np.testing.assert_array_equal(actions, (t + versions) % 2)
        assert versions.tolist() == sorted(versions.tolist())


async def test_a_step_that_ends_in_the_next_call_is_taken_up_by_it(
    make_sampler: SamplerFactory, asked: list[int], tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    envs = [
        [
            functools.partial(GatedAsyncEnv, str(gate)),
            *[functools.partial(CountingAsyncEnv, 1000, 0.005)] * 2,
        ]
    ]
    agent = ParityAgent(flip=True)  # action 1 at step 0: a row not kept would hold a 0
    sampler = make_sampler(
        "process", envs, agent, inference="per_worker", n_workers=1, envs_per_worker=3
    )
    try:
        first = await sampler.obtain_fragments(12)  # env 0's step waits at the gate
        host = sampler.workers[0].host
        assert host is not None
        waiting = host.in_flight[0]
        assert not answered(waiting)
        call = asyncio.ensure_future(sampler.obtain_fragments(300))
        touch(gate)
        # The step asked in the first call ends in the second: that call records it (its row
        # kept from the first) and asks env 0's next step at once.
        await wait_until(lambda: host.in_flight.get(0) not in (None, waiting), "env 0's next")
        assert not call.done()
        batch = await call
    finally:
        touch(gate)
    assert not [p for p in first.split() if int(p.episode_infos["env"][0]) == 0]  # none done
    env0 = [p for p in batch.split() if int(p.episode_infos["env"][0]) == 0]
    assert env0
    # The second call records env 0's first step (asked in the first call, its row kept from
    # it) first, with the action the first call's agent picked for its observation.
    assert env0[0].step_types[0] == StepType.FIRST
    assert int(env0[0].observations[0, 0]) == 0
    t = np.concatenate([p.observations[:, 0] for p in env0]).astype(np.int64)
    np.testing.assert_array_equal(t, np.arange(len(t)))
    np.testing.assert_array_equal(np.concatenate([p.actions for p in env0]), (t + 1) % 2)


class GatedFailingAsyncEnv(GatedAsyncEnv):
    """Its first step waits at the gate, then raises (once: a rebuilt env steps on)."""

    async def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        first = self.logic.steps_taken == 0 and not os.path.exists(self.gate)
        result = await super().step(action)
        if first:
            raise RuntimeError("failed after the gate")
        return result


async def test_a_step_carried_into_the_next_call_that_fails_leaves_no_row_behind(
    make_sampler: SamplerFactory, tmp_path: Path
) -> None:
    """The row kept for a step in flight goes with its episode when the step fails: the rebuilt
    env's first step is recorded as its own (its action and agent version), not as the kept
    one."""
    gate = tmp_path / "gate"
    envs = [
        [
            functools.partial(GatedFailingAsyncEnv, str(gate)),
            *[functools.partial(CountingAsyncEnv, 1000, 0.005)] * 2,
        ]
    ]
    sampler = make_sampler(
        "process", envs, ParityAgent(), inference="per_worker", n_workers=1, envs_per_worker=3
    )
    try:
        await sampler.obtain_fragments(12)  # env 0's first step waits at the gate: row kept
        await sampler.update_agent(ParityAgent(flip=True))  # version 1 picks the other action
        call = asyncio.ensure_future(sampler.obtain_fragments(300))
        touch(gate)  # the kept step fails in the second call; env 0 is rebuilt and steps on
        batch = await call
    finally:
        touch(gate)
    assert sampler.last_stats.restarts == 1
    env0 = [p for p in batch.split() if int(p.episode_infos["env"][0]) == 0]
    assert env0
    first = env0[0]
    assert first.step_types[0] == StepType.FIRST
    assert first.agent_versions.tolist() == [1] * len(first.rewards)
    t = first.observations[:, 0].astype(np.int64)
    np.testing.assert_array_equal(first.actions, (t + 1) % 2)


async def test_closing_with_steps_in_flight_leaves_no_unretrieved_error(
    make_sampler: SamplerFactory,
) -> None:
    """Steps still in flight when the sampler closes get its error (their hosts are gone), and
    nobody is left to look at it: no "Future exception was never retrieved" is logged."""
    loop = asyncio.get_running_loop()
    logged: list[str] = []
    loop.set_exception_handler(lambda _loop, context: logged.append(context["message"]))
    try:
        envs = [
            [
                functools.partial(CountingAsyncEnv, 1000, 0.002),
                *[functools.partial(CountingAsyncEnv, 1000, 0.5)] * 2,
            ]
        ]
        sampler = make_sampler(
            "process", envs, ParityAgent(), inference="per_worker", n_workers=1, envs_per_worker=3
        )
        await sampler.obtain_fragments(10)  # from env 0; the others' steps of 0.5 s in flight
        host = sampler.workers[0].host
        assert host is not None and sorted(host.in_flight) == [1, 2]
        await sampler.aclose()
        settled = list(host.in_flight.values())
        assert settled and all(f.done() for f in settled)  # with the closed sampler's error
        host.in_flight.clear()
        del settled  # as when the sampler is collected: an unretrieved error is logged now
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert not [m for m in logged if "never retrieved" in m]


class FailEveryRowAgent:
    """Fails every row it is given (:class:`~asyncsample.AgentRowsError`)."""

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        actions = np.zeros(len(observations), dtype=np.int64)
        failures = {j: RuntimeError("no reply") for j in range(len(observations))}
        raise AgentRowsError(actions, {}, failures)


@pytest.mark.parametrize("rows", [1, 3])
async def test_a_request_whose_every_row_failed_is_each_envs_fault(rows: int) -> None:
    """The rows left to check are none: each env gets its fault, the request no error of its
    own (a request of one row whose row failed raised a ValueError from the empty check)."""
    batcher = Batcher(Batched(), action_space=gym.spaces.Discrete(2))
    got: list[Any] = []
    envs = list(range(5, 5 + rows))
    batcher.ask_rows(FailEveryRowAgent(), 0, np.zeros((rows, 4)), envs, got.append)  # type: ignore[arg-type]
    await wait_until(lambda: bool(got), "the delivery")
    assert not isinstance(got[0], BaseException)
    _actions, _infos, faults = got[0]
    assert [k for k, _ in faults] == list(range(rows))
    assert [fault.env for _, fault in faults] == envs


async def test_an_error_of_the_sampler_in_a_loop_callback_fails_the_call(
    make_sampler: SamplerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error raised where the loop runs the stepper (a reply frame's pass, here) fails the call
    with that error, not only in the loop's log while the call waits for its quota forever."""

    def broken(self: Any, *args: Any) -> None:
        raise RuntimeError("a bug in recording")

    monkeypatch.setattr(RunStepper, "_record_steps", broken)
    sampler = _sampler(make_sampler, "per_worker")
    with pytest.raises(RuntimeError, match="a bug in recording"):
        await asyncio.wait_for(sampler.obtain_fragments(40), 30)


async def test_a_lanes_call_takes_up_the_bare_steps_a_ready_batch_call_left(
    make_sampler: SamplerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bare steps a call of ready batches leaves in flight (their keys kept by their owner,
    not by the link) are taken up by a call of the lanes (``obtain_samples``): a reply not read
    yet goes to the future the lane awaits. No step is lost or repeated."""
    adopted: list[int] = []
    original = LaneLink.adopt

    def counting(self: LaneLink, owner: Any, key: int, i: int, future: Any) -> None:
        adopted.append(i)
        original(self, owner, key, i, future)

    monkeypatch.setattr(LaneLink, "adopt", counting)
    fast, slow = (functools.partial(CountingAsyncEnv, LENGTH, t) for t in (0.002, 0.3))
    envs = [[slow, fast, fast], [fast, fast, fast]]
    sampler = make_sampler(
        "process", envs, ParityAgent(), inference="batched", n_workers=2, envs_per_worker=3
    )
    batches = []
    for _ in range(2):
        batches.append(await sampler.obtain_fragments(40))  # env 0's step of 0.3 s in flight
        batches.append(await sampler.obtain_samples(12))
    assert adopted  # env 0's step was in flight, unanswered, as a lanes call began
    for batch in batches:
        _check_records(batch)
    assert_whole_pieces(batches)


async def test_a_killed_host_fails_the_bare_steps_it_held_and_their_envs_step_again(
    make_sampler: SamplerFactory,
) -> None:
    """A host killed with bare steps in flight: each of those steps fails as its env's fault
    (the env is rebuilt and steps again), never left unanswered while the other host's envs
    meet the quotas."""
    env = functools.partial(CountingAsyncEnv, LENGTH, 0.01)
    sampler = _sampler(make_sampler, "batched", env, n_processes=2)
    await sampler.obtain_fragments(40)
    hosts = sampler._core.backend
    call = asyncio.ensure_future(sampler.obtain_fragments(400))
    await asyncio.sleep(0.2)  # mid-call: every env has a step in flight
    os.kill(hosts.pids[0], signal.SIGKILL)
    batches = [await call]
    for _ in range(4):
        batches.append(await sampler.obtain_fragments(40))
    assert sampler.restarts >= 1
    assert_whole_pieces(batches)
    every_env = {(w, e) for w in range(N_WORKERS) for e in range(N_ENVS)}
    assert set(_by_env(batches[-2:])) == every_env


async def test_a_batch_too_big_for_one_block_of_keys_is_sent_step_by_step(
    make_sampler: SamplerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's keys are one block (``KEY_BITS``): a bigger batch goes a request per step,
    each in the link's dicts, and its records are the same."""
    monkeypatch.setattr(_lane_link, "KEY_BITS", 2)  # blocks of 4 keys, batches of up to 6 envs
    one_by_one: list[int] = []
    original = LaneLink.submit

    def counting(
        self: LaneLink, owner: Any, kind: int, slot: int, i: int, *a: Any, **kw: Any
    ) -> Any:
        if kw.get("bare"):
            one_by_one.append(i)
        return original(self, owner, kind, slot, i, *a, **kw)

    monkeypatch.setattr(LaneLink, "submit", counting)
    sampler = make_sampler(
        "process",
        functools.partial(CountingAsyncEnv, LENGTH, 0.001),
        ParityAgent(),
        inference="batched",
        n_workers=1,
        envs_per_worker=6,
        seed=3,
    )
    batches = [await sampler.obtain_fragments(40) for _ in range(4)]
    assert one_by_one  # the first call asks all 6 envs at once
    for batch in batches:
        _check_records(batch)
    _in_order(batches)
