"""``fraction_samples``: fast workers fill in for stragglers at the call level.

Slowness is made deterministic with a gate, not with timing: worker 1 of a :class:`GatedWorker`
sampler waits at its first action until worker 0 has taken a given number of steps, so worker 0
provably goes past its share before worker 1 contributes anything. The gate lives in the main
process beside the worker coroutines, so it works the same on every backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import sys
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from envs import ConstantAgent, NoisyEnv, SleepyEnv, first_to_claim

from asyncsample import EpisodeBatch, Sampler, StepType
from asyncsample.agent import AgentOutput
from asyncsample.worker import VecWorker

pytestmark = pytest.mark.timeout(90)

# The env hosts cannot import this test module by name: ship its envs by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

ENDS = (StepType.TERMINAL, StepType.TIMEOUT)


class CounterEnv(gym.Env[np.ndarray, np.int64]):
    """Observation = steps taken in the episode; terminates after ``length`` steps.

    Makes continuity checkable: a fragment that continues an episode starts at the observation
    where the previous fragment stopped, and a gap or a duplicated step shows up at once.
    """

    def __init__(self, length: int | None = None) -> None:
        self.observation_space = gym.spaces.Box(0.0, np.inf, (1,), np.float64)
        self.action_space = gym.spaces.Discrete(2)
        self.length = length
        self.t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0]), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        done = self.length is not None and self.t >= self.length
        return np.array([float(self.t)]), 1.0, done, False, {}


class Gate:
    """Opens when worker 0 asks for its ``open_at``-th action (counted over the gate's life)."""

    def __init__(self, open_at: int) -> None:
        self.open_at = open_at
        self.calls = 0
        self.event = asyncio.Event()


class GatedWorker(VecWorker):
    """Worker 1 waits at every action until the gate opens; worker 0 opens it."""

    def __init__(self, *, gate: Gate, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = gate

    async def compute_actions(self, observations: Any) -> AgentOutput:
        if self.worker_number == 1:
            await self.gate.event.wait()
        elif self.worker_number == 0:
            self.gate.calls += 1
            if self.gate.calls >= self.gate.open_at:
                self.gate.event.set()
        return await super().compute_actions(observations)


@pytest.fixture(params=["local", "process", "ray"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return str(request.param)


def gated(backend: str, gate: Gate, env: Any = None, **kwargs: Any) -> Sampler:
    kwargs.setdefault("n_processes", 2)
    return Sampler(
        env or functools.partial(CounterEnv, 5),
        n_workers=2,
        envs_per_worker=2,
        backend=backend,
        seed=3,
        worker_class=GatedWorker,
        worker_args={"gate": gate},
        **kwargs,
    )


def per_worker(batch: EpisodeBatch, n_workers: int) -> list[int]:
    workers = batch.episode_infos["worker"]
    return [int(batch.lengths[workers == w].sum()) for w in range(n_workers)]


def minimum(fraction: float, share: int) -> int:
    return math.ceil(round(fraction * share, 9))


def check_worker_major(batch: EpisodeBatch) -> None:
    workers = batch.episode_infos["worker"]
    assert np.all(np.diff(workers) >= 0), workers


def check_whole_episodes(batch: EpisodeBatch, length: int) -> None:
    """Every episode is complete and uncut: FIRST ... TERMINAL, observations 0..length-1."""
    for ep in batch.split():
        assert StepType(ep.step_types[0]) == StepType.FIRST
        assert StepType(ep.step_types[-1]) in ENDS
        assert ep.observations[:, 0].tolist() == list(range(length))
        assert float(ep.last_observations[0, 0]) == length


# -- a straggler -------------------------------------------------------------------------------


async def test_samples_fast_worker_fills_in_for_a_gated_one(backend: str) -> None:
    # share 20 per worker, minimum 10. Worker 1 takes no step until worker 0 asks for its 16th
    # action: by then worker 0 has completed 3 rounds of 2 episodes of 5 (30 > its share) and
    # must go on, since the total (its own) is short of 40.
    gate = Gate(open_at=16)
    async with gated(backend, gate) as s:
        batch = await s.obtain_samples(40, fraction_samples=0.5)
        stats = s.last_stats
    assert stats is not None
    counts = per_worker(batch, 2)
    assert counts[0] >= 30 > 20  # past its share: it filled in
    assert counts[1] >= minimum(0.5, 20)
    assert sum(counts) == batch.n_transitions >= 40
    assert list(stats.worker_transitions) == counts
    assert len(stats.worker_wait_seconds) == 2
    assert all(t >= 0 for t in stats.worker_wait_seconds)
    check_worker_major(batch)
    check_whole_episodes(batch, 5)


async def test_slow_env_every_worker_reaches_its_minimum() -> None:
    # A real straggler (worker 1's env sleeps in every step) on the process backend: the split
    # depends on timing, the guarantees do not.
    envs = [NoisyEnv, functools.partial(SleepyEnv, 0.002)]
    async with Sampler(
        envs, n_workers=2, envs_per_worker=2, backend="process", n_processes=2, seed=1
    ) as s:
        for _ in range(2):
            batch = await s.obtain_samples(200, fraction_samples=0.25)
            counts = per_worker(batch, 2)
            assert counts[0] >= minimum(0.25, 100) and counts[1] >= minimum(0.25, 100)
            assert sum(counts) >= 200
            assert s.last_stats is not None and list(s.last_stats.worker_transitions) == counts
            check_worker_major(batch)
            for ep in batch.split():  # complete episodes only (a 1-step one is just its end)
                assert len(ep.step_types) == 1 or StepType(ep.step_types[0]) == StepType.FIRST
                assert StepType(ep.step_types[-1]) in ENDS


async def test_worker_without_a_share_takes_no_part() -> None:
    async with Sampler(functools.partial(CounterEnv, 3), n_workers=3, backend="local", seed=0) as s:
        batch = await s.obtain_samples(2, fraction_samples=0.5)
        assert s.last_stats is not None
        assert s.last_stats.worker_transitions[2] == 0
        assert 2 not in batch.episode_infos["worker"].tolist()
        assert batch.n_transitions >= 2


# -- the default is today's behaviour ----------------------------------------------------------


@pytest.mark.parametrize("mode", ["samples", "fragments"])
async def test_default_is_exactly_todays_behaviour(mode: str) -> None:
    def make() -> Sampler:
        return Sampler(NoisyEnv, n_workers=3, envs_per_worker=2, backend="local", seed=11)

    async with make() as a, make() as b:
        for n in (50, 31, 77):
            if mode == "samples":
                x = await a.obtain_samples(n)
                y = await b.obtain_samples(n, fraction_samples=1.0)
            else:
                x = await a.obtain_fragments(n)
                y = await b.obtain_fragments(n, fraction_samples=1)
            assert x.n_transitions == y.n_transitions
            assert np.array_equal(x.lengths, y.lengths)
            assert np.array_equal(x.observations, y.observations)
            assert np.array_equal(x.actions, y.actions)
            assert np.array_equal(x.rewards, y.rewards)
            assert np.array_equal(x.step_types, y.step_types)
            assert np.array_equal(x.episode_infos["worker"], y.episode_infos["worker"])
            assert a.last_stats is not None and b.last_stats is not None
            assert a.last_stats.worker_transitions == b.last_stats.worker_transitions
            shares = [n // 3 + (w < n % 3) for w in range(3)]
            if mode == "fragments":
                # Every worker steps its envs ceil(share / 2) times, as before.
                expected = [2 * math.ceil(sh / 2) for sh in shares]
                assert list(b.last_stats.worker_transitions) == expected


# -- fragments ---------------------------------------------------------------------------------


def check_fragment_continuity(
    batches: list[EpisodeBatch], length: int | None
) -> dict[tuple[int, int], float]:
    """Each (worker, env) stream of pieces continues exactly where the previous one stopped."""
    last: dict[tuple[int, int], float] = {}
    for batch in batches:
        for ep in batch.split():
            key = (int(ep.episode_infos["worker"][0]), int(ep.episode_infos["env"][0]))
            obs = ep.observations[:, 0]
            first = StepType(ep.step_types[0])
            single_end = len(obs) == 1 and first in ENDS  # a 1-step piece is just its end
            if obs[0] == 0.0:
                assert first == StepType.FIRST or single_end
                assert key not in last  # the previous piece of this env had ended
            else:
                assert first == StepType.MID or single_end
                assert key in last and obs[0] == last[key], (key, obs[0], last.get(key))
            assert np.array_equal(np.diff(obs), np.ones(len(obs) - 1))  # no gap, no repeat
            end = float(ep.last_observations[0, 0])
            assert end == obs[-1] + 1
            if StepType(ep.step_types[-1]) in ENDS:
                assert length is not None and end == length
                last.pop(key, None)
            else:
                last[key] = end
    return last


async def test_fragments_with_a_straggler_continue_across_calls(backend: str) -> None:
    # share 20 transitions (10 steps of 2 envs), minimum 10; worker 1 is held until worker 0
    # asks for its 16th action, by when worker 0 has returned 30 > 20 transitions.
    gate = Gate(open_at=16)
    async with gated(backend, gate, env=functools.partial(CounterEnv, 7)) as s:
        first = await s.obtain_fragments(40, fraction_samples=0.5)
        stats = s.last_stats
        assert stats is not None
        counts = per_worker(first, 2)
        assert counts[0] >= 30 and counts[1] >= 10 and sum(counts) >= 40
        assert counts[0] % 2 == 0 and counts[1] % 2 == 0  # steps x active envs
        assert list(stats.worker_transitions) == counts
        check_worker_major(first)
        later = [
            await s.obtain_fragments(40),
            await s.obtain_fragments(40, fraction_samples=0.3),
            await s.obtain_fragments(40),
        ]
    check_fragment_continuity([first, *later], 7)


async def test_fragments_without_straggler_every_env_continues() -> None:
    # No gate in play (it is open from the start): both workers run freely.
    gate = Gate(open_at=0)
    gate.event.set()
    async with gated("local", gate, env=CounterEnv) as s:
        batches = [await s.obtain_fragments(30, fraction_samples=0.4) for _ in range(4)]
    open_pieces = check_fragment_continuity(batches, None)
    assert set(open_pieces) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    total = sum(b.n_transitions for b in batches)
    # Endless episodes: the last observation of each env is its step count over all calls.
    assert sum(open_pieces.values()) == total


class FailingCounterEnv(CounterEnv):
    """:class:`CounterEnv` whose ``fail_at``-th step raises, once per ``flag`` file."""

    def __init__(self, flag: str, fail_at: int) -> None:
        super().__init__()
        self.flag = flag
        self.fail_at = fail_at
        self.calls = 0

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.calls += 1
        if self.calls == self.fail_at and first_to_claim(self.flag):
            raise RuntimeError("injected failure in step")
        return super().step(action)


@pytest.mark.parametrize("mode", ["samples", "fragments"])
async def test_a_restart_during_a_fraction_call(mode: str, tmp_path: Any) -> None:
    # Worker 0's host fails in its 7th step: the fragments it had in progress are dropped (its
    # count goes down) and redone; the guarantees still hold at the end of the call.
    flag = str(tmp_path / "failed")
    gate = Gate(open_at=12)
    envs = [functools.partial(FailingCounterEnv, flag, 7), CounterEnv]
    async with gated("local", gate, env=envs, max_episode_length=5) as s:
        call = s.obtain_samples if mode == "samples" else s.obtain_fragments
        batch = await call(40, fraction_samples=0.5)
        assert s.restarts == 1
        assert s.last_stats is not None and s.last_stats.restarts == 1
    counts = per_worker(batch, 2)
    assert counts[0] >= 10 and counts[1] >= 10 and sum(counts) >= 40
    for ep in batch.split():
        obs = ep.observations[:, 0]
        assert np.array_equal(np.diff(obs), np.ones(len(obs) - 1))
        if mode == "samples":
            assert obs.tolist() == [0, 1, 2, 3, 4]


# -- stream ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fragments", [False, True])
async def test_stream_with_fraction(fragments: bool) -> None:
    gate = Gate(open_at=16)
    async with gated("process", gate) as s:
        batches: list[EpisodeBatch] = []
        async with contextlib.aclosing(
            s.stream(40, fragments=fragments, fraction_samples=0.5)
        ) as it:
            async for batch in it:
                batches.append(batch)
                assert batch.n_transitions >= 40
                assert s.last_stats is not None
                assert list(s.last_stats.worker_transitions) == per_worker(batch, 2)
                if len(batches) == 3:
                    break
    # The first round: worker 1 held until worker 0 went past its share.
    assert per_worker(batches[0], 2)[0] > 20
    if fragments:
        check_fragment_continuity(batches, 5)
    else:
        for batch in batches:
            check_whole_episodes(batch, 5)


# -- inference="batched" -----------------------------------------------------------------------


async def test_batched_inference_a_worker_that_stops_leaves_the_batcher() -> None:
    # Lockstep batching: worker 0's episodes last 2 steps, worker 1's 15. Shares 20, minimums
    # 18. After 26 lockstep steps worker 0 has 26 and worker 1 15: the total (41) is met and
    # worker 0 stops, but worker 1 must go on alone to 30. If worker 0 stayed in the batcher,
    # worker 1's next action would wait for it forever.
    envs = [functools.partial(CounterEnv, 2), functools.partial(CounterEnv, 15)]
    async with Sampler(
        envs,
        ConstantAgent(1),
        n_workers=2,
        backend="process",
        n_processes=2,
        seed=0,
        inference="batched",
    ) as s:
        batch = await s.obtain_samples(40, fraction_samples=0.9)
        assert s.last_stats is not None
        counts = per_worker(batch, 2)
        assert counts[1] == 30
        assert counts[0] >= 18 and sum(counts) >= 40
        assert list(s.last_stats.worker_transitions) == counts
        # The sampler is still usable, and the default still splits evenly.
        again = await s.obtain_samples(40)
        assert per_worker(again, 2)[1] == 30  # 2 episodes of 15 reach the share of 20


# -- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.0001, 2, float("nan"), float("inf")])
async def test_fraction_out_of_range(value: float) -> None:
    async with Sampler(CounterEnv, n_workers=2, backend="local", max_episode_length=3) as s:
        with pytest.raises(ValueError, match="fraction_samples"):
            await s.obtain_samples(10, fraction_samples=value)
        with pytest.raises(ValueError, match="fraction_samples"):
            await s.obtain_fragments(10, fraction_samples=value)
        with pytest.raises(ValueError, match="fraction_samples"):
            async with contextlib.aclosing(s.stream(10, fraction_samples=value)) as it:
                await it.__anext__()
        assert s.total_env_steps == 0


@pytest.mark.parametrize("value", [True, False, "0.5", None, [0.5]])
async def test_fraction_wrong_type(value: Any) -> None:
    async with Sampler(CounterEnv, n_workers=2, backend="local", max_episode_length=3) as s:
        with pytest.raises(TypeError, match="fraction_samples"):
            await s.obtain_samples(10, fraction_samples=value)
        with pytest.raises(TypeError, match="fraction_samples"):
            await s.obtain_fragments(10, fraction_samples=value)
        with pytest.raises(TypeError, match="fraction_samples"):
            async with contextlib.aclosing(s.stream(10, fraction_samples=value)) as it:
                await it.__anext__()


async def test_fraction_accepts_numpy_and_int() -> None:
    async with Sampler(CounterEnv, n_workers=2, backend="local", max_episode_length=3) as s:
        for value in (np.float32(0.5), np.float64(0.25), 1, np.int64(1)):
            batch = await s.obtain_samples(12, fraction_samples=value)  # type: ignore[arg-type]
            assert batch.n_transitions >= 12


# -- inference="host": the workers decide between chunks ------------------------------------------


class FileGateEnv(CounterEnv):
    """A :class:`CounterEnv` across processes: the ``opener`` creates ``path`` at its
    ``open_at``-th step (counted over its life); the others wait for ``path`` before each step."""

    def __init__(self, length: int, path: str, opener: bool, open_at: int = 0) -> None:
        super().__init__(length)
        self.path, self.opener, self.open_at, self.steps = path, opener, open_at, 0

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        import os
        import time

        self.steps += 1
        if self.opener:
            if self.steps == self.open_at:
                with open(self.path, "w"):
                    pass
        else:
            deadline = time.monotonic() + 60
            while not os.path.exists(self.path) and time.monotonic() < deadline:
                time.sleep(0.001)
        return super().step(action)


@pytest.mark.parametrize("chunk_steps", [1, 8])
async def test_host_inference_fast_worker_fills_in(chunk_steps: int, tmp_path: Any) -> None:
    from asyncsample import Host

    def sampler(gate: str) -> Sampler:
        # Worker 1 cannot take a step before worker 0 has stepped each env 60 times (120
        # transitions, more than its share of 100): worker 0 must have gone past its share.
        envs = [
            functools.partial(FileGateEnv, 5, gate, True, 60),
            functools.partial(FileGateEnv, 5, gate, False),
        ]
        return Sampler(
            envs,
            n_workers=2,
            envs_per_worker=2,
            backend="process",
            n_processes=2,
            seed=2,
            inference=Host(chunk_steps=chunk_steps),
        )

    async with sampler(str(tmp_path / "samples")) as s:
        batch = await s.obtain_samples(200, fraction_samples=0.25)
        counts = per_worker(batch, 2)
        assert counts[0] >= 110 and counts[1] >= minimum(0.25, 100) and sum(counts) >= 200
        assert s.last_stats is not None and list(s.last_stats.worker_transitions) == counts
        check_worker_major(batch)
        check_whole_episodes(batch, 5)
    async with sampler(str(tmp_path / "fragments")) as s:
        fragments = [await s.obtain_fragments(200, fraction_samples=0.25)]
        counts = per_worker(fragments[0], 2)
        assert counts[0] >= 120 and counts[1] >= 25 and sum(counts) >= 200
        fragments += [await s.obtain_fragments(40, fraction_samples=0.5) for _ in range(2)]
        for frag in fragments:
            check_worker_major(frag)
    check_fragment_continuity(fragments, 5)


# -- inference="host": a chunk asks for this worker's part of what the call lacks ---------------


@pytest.mark.both_loops
@pytest.mark.parametrize("fraction", [0.99, 0.25])
async def test_host_inference_chunks_stop_where_steps_would(fraction: float) -> None:
    """Each chunk asks for its worker's part of what the call lacks. Before, every worker's first
    chunk asked for all of it: 777 transitions for 200 (4 workers x 3 envs, chunks of 64 steps).
    Per-step stepping passes the quota by at most one step per env (fragments) or the episodes
    each env has in progress (samples); so do the chunks now."""
    async with Sampler(
        functools.partial(CounterEnv, 7),
        n_workers=4,
        envs_per_worker=3,
        backend="process",
        n_processes=2,
        seed=0,
        inference="host",
    ) as s:
        for _ in range(2):
            fragments = await s.obtain_fragments(200, fraction_samples=fraction)
            assert 200 <= fragments.n_transitions <= 200 + 4 * 3
            check_worker_major(fragments)
            samples = await s.obtain_samples(200, fraction_samples=fraction)
            assert 200 <= samples.n_transitions <= 200 + 4 * 3 * 7
            check_worker_major(samples)
            check_whole_episodes(samples, 7)
