"""``backend="asyncio"`` and ``backend="thread"``: one coroutine per env, every sampler contract.

Envs here come from ``tests/async_envs.py`` (async envs and their blocking twins). Every test runs
under both event loops (see conftest).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import numpy as np
import pytest
from async_envs import (
    CountingAsyncEnv,
    CountingEnv,
    EnvFactory,
    FailingAsyncEnv,
    RandomLengthAsyncEnv,
    RandomLengthEnv,
    blocking_counting,
    counting,
    failing,
    hanging,
    random_length,
)
from helpers import SamplerFactory, wait_until

from asyncsample import EpisodeBatch, Sampler, StepType, WorkerError
from asyncsample._env_tasks import Admission
from asyncsample.errors import StepTimeoutError

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def _blocking_random_length() -> RandomLengthEnv:
    return RandomLengthEnv(1, 20)


#: (backend, factory of an env factory): the same episodes on both backends.
LANES = {
    "asyncio": lambda: random_length(1, 20),
    "thread": lambda: EnvFactory(lambda i: RandomLengthEnv(1, 20)),
}


class Versioned:
    """A random agent with parameters (so a stream can update it)."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def get_actions(self, observations: np.ndarray) -> Any:
        return self.rng.integers(0, 2, len(observations)), {}

    def set_param_values(self, params: Any) -> None:
        pass


@pytest.fixture(params=sorted(LANES))
def lane(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _check_whole(batch: EpisodeBatch) -> None:
    """Every episode starts with FIRST and ends in TERMINAL or TIMEOUT; obs follow the env."""
    for episode in batch.split():
        types = episode.step_types
        assert len(types) == 1 or types[0] == StepType.FIRST
        assert types[-1] in (StepType.TERMINAL, StepType.TIMEOUT)
        assert (types[1:-1] == StepType.MID).all()
        # The env's observation counts the steps of its episode.
        np.testing.assert_array_equal(episode.observations[:, 0], np.arange(len(types)))


async def test_three_call_modes(make_sampler: SamplerFactory, lane: str) -> None:
    sampler = make_sampler(
        lane, LANES[lane](), n_workers=2, envs_per_worker=3, seed=3, max_episode_length=50
    )
    batch = await sampler.obtain_samples(200)
    _check_whole(batch)
    for w in range(2):
        mine = batch.episode_infos["worker"] == w
        assert batch.lengths[mine].sum() >= 100
    assert (batch.agent_versions == 0).all()

    batch = await sampler.obtain_exact_episodes(4)
    _check_whole(batch)
    for w in range(2):
        envs = batch.episode_infos["env"][batch.episode_infos["worker"] == w]
        # Env i runs n // E + (i < n % E) episodes: 2, 1, 1.
        assert sorted(np.bincount(envs, minlength=3).tolist()) == [1, 1, 2]
        assert np.bincount(envs, minlength=3)[0] == 2

    first = await sampler.obtain_fragments(60)
    assert 60 <= first.n_transitions < 60 + 6
    second = await sampler.obtain_fragments(60)
    # A fragment cut by the first call continues in the second: it starts with MID.
    assert (second.step_types[np.cumsum(second.lengths) - second.lengths] == StepType.MID).any()


async def test_fixed_seed_reproducible(make_sampler: SamplerFactory) -> None:
    """Zero-latency async envs finish in the same order every run: identical batches."""
    batches = []
    for _ in range(2):
        sampler = make_sampler(
            "asyncio", random_length(1, 20), n_workers=2, envs_per_worker=4, seed=11
        )
        batches.append(
            [
                await sampler.obtain_samples(300),
                await sampler.obtain_exact_episodes(5),
                await sampler.obtain_fragments(77),
            ]
        )
        await sampler.aclose()
    for a, b in zip(*batches):
        assert a.equals(b)


async def test_slow_env_never_stalls_fast_one(make_sampler: SamplerFactory) -> None:
    """One env of a worker takes 50 ms a step, the other 1 ms: the fast one runs on."""
    factory = EnvFactory(lambda i: CountingAsyncEnv(5, latency=0.2 if i % 2 == 0 else 0.001))
    sampler = make_sampler("asyncio", factory, n_workers=1, envs_per_worker=2, seed=0)
    batch = await sampler.obtain_samples(100)
    # The factory's first env was the sampler's probe: env 0 is fast, env 1 slow.
    per_env = np.bincount(batch.episode_infos["env"], minlength=2)
    # In lockstep both would have run the same number of episodes at the slow env's pace.
    assert per_env[0] >= 20 and per_env[1] <= 1


async def test_max_concurrency_caps_calls_in_flight(make_sampler: SamplerFactory) -> None:
    in_flight = 0
    peak = 0

    class Tracked(CountingAsyncEnv):
        async def step(self, action: Any) -> Any:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                await asyncio.sleep(0.002)
                return await super().step(action)
            finally:
                in_flight -= 1

    sampler = make_sampler(
        "asyncio", lambda: Tracked(5), n_workers=4, envs_per_worker=5, max_concurrency=3, seed=0
    )
    await sampler.obtain_samples(200)
    assert peak == 3


async def test_agent_is_asked_for_the_ready_envs_at_once(make_sampler: SamplerFactory) -> None:
    """Many one-env workers: one call of the shared agent per pass of the loop."""
    sizes: list[int] = []

    class Agent:
        async def get_actions(self, observations: np.ndarray) -> Any:
            sizes.append(len(observations))
            await asyncio.sleep(0)
            return np.zeros(len(observations), dtype=np.int64), {"seen": observations[:, 0].copy()}

    sampler = make_sampler(
        "asyncio",
        counting(4),
        Agent(),
        n_workers=50,
        envs_per_worker=1,
        inference="batched",
        seed=0,
    )
    batch = await sampler.obtain_samples(400)
    assert max(sizes) == 50
    assert np.mean(sizes) > 10
    np.testing.assert_array_equal(batch.agent_infos["seen"], batch.observations[:, 0])


async def test_env_error_rebuilds_and_keeps_the_cause(make_sampler: SamplerFactory) -> None:
    factory = failing(fail_at=3, times=2)
    sampler = make_sampler("asyncio", factory, n_workers=1, envs_per_worker=2, seed=0)
    batch = await sampler.obtain_samples(50)
    _check_whole(batch)
    # Both envs failed once: each was rebuilt alone (a fault is the env's, not its worker's).
    assert sampler.last_stats is not None and sampler.last_stats.restarts == 2
    assert len(factory.made) == 1 + 2 + 2  # the probe, the worker's two, one rebuild each
    assert all(env.closed for env in factory.made[1:3])

    always = EnvFactory(lambda i: FailingAsyncEnv(2))
    broken = make_sampler("asyncio", always, n_workers=1, envs_per_worker=1, max_restarts=1, seed=0)
    with pytest.raises(WorkerError) as info:
        await broken.obtain_samples(20)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "failed on its step 2" in str(info.value)


async def test_hung_step_found_in_step_timeout(make_sampler: SamplerFactory) -> None:
    factory = hanging(hang_at=2, times=2)
    sampler = make_sampler(
        "asyncio", factory, n_workers=1, envs_per_worker=2, step_timeout=0.2, seed=0
    )
    batch = await sampler.obtain_samples(40)  # without step_timeout: never
    _check_whole(batch)
    assert factory.made[1].cancelled  # the hung step was cancelled, not left running

    stuck = make_sampler(
        "asyncio",
        hanging(hang_at=1, times=99),
        n_workers=1,
        step_timeout=0.1,
        max_restarts=1,
        seed=0,
    )
    with pytest.raises(StepTimeoutError, match=r"step_timeout=0\.1s"):
        await stuck.obtain_samples(10)


@pytest.mark.parametrize("lane", ["asyncio", "thread", "process"])
async def test_episode_timeout_cuts_stragglers(make_sampler: SamplerFactory, lane: str) -> None:
    """Episodes of 20 steps of 20 ms run 0.4 s; a deadline of 0.1 s cuts them as TIMEOUT (on
    "thread" the env whose step still runs at the deadline is abandoned and rebuilt; on
    "process", async envs in the host, the step in flight is cancelled there)."""
    sampler = make_sampler(
        lane,
        (blocking_counting if lane == "thread" else counting)(20, latency=0.02),
        n_workers=1,
        envs_per_worker=4,
        episode_timeout=0.1,
        seed=0,
    )
    batch = await sampler.obtain_exact_episodes(4)
    assert (batch.step_types[np.cumsum(batch.lengths) - 1] == StepType.TIMEOUT).all()
    assert batch.episode_infos["deadline"].all()
    assert (batch.lengths < 20).all()
    _check_whole(batch)


async def test_thread_backend_keeps_the_loop_free(make_sampler: SamplerFactory) -> None:
    """Blocking steps run in the pool's threads, several at once, never in the loop's thread."""
    threads: set[str] = set()
    lock = threading.Lock()
    in_flight = 0
    peak = 0

    class Blocking(CountingEnv):
        def step(self, action: Any) -> Any:
            nonlocal in_flight, peak
            with lock:
                in_flight += 1
                peak = max(peak, in_flight)
                threads.add(threading.current_thread().name)
            try:
                time.sleep(0.01)
                return super().step(action)
            finally:
                with lock:
                    in_flight -= 1

    sampler = make_sampler(
        "thread", lambda: Blocking(5), n_workers=2, envs_per_worker=4, max_concurrency=8, seed=0
    )
    batch = await sampler.obtain_samples(80)
    _check_whole(batch)
    assert threading.current_thread().name not in threads
    assert all(name.startswith("asyncsample-env") for name in threads)
    assert peak >= 2


async def test_thread_backend_closes_its_threads(make_sampler: SamplerFactory) -> None:
    sampler = make_sampler("thread", _blocking_random_length, n_workers=2, seed=0)
    await sampler.obtain_samples(50)
    await sampler.aclose()
    names = [t.name for t in threading.enumerate()]
    assert not [n for n in names if n.startswith("asyncsample-env")]


async def test_aclose_leaves_no_task(make_sampler: SamplerFactory) -> None:
    factory = counting(5, latency=0.01)
    sampler = make_sampler("asyncio", factory, n_workers=3, envs_per_worker=3, seed=0)
    task = asyncio.ensure_future(sampler.obtain_samples(10_000))
    await wait_until(lambda: any(e.logic.steps_taken for e in factory.made[1:]), "a step")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    batch = await sampler.obtain_samples(30)  # usable after a cancelled call
    _check_whole(batch)
    await sampler.aclose()
    await asyncio.sleep(0)
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not others


async def test_stream_records_versions_per_step(make_sampler: SamplerFactory, lane: str) -> None:
    sampler = make_sampler(lane, LANES[lane](), Versioned(), n_workers=2, envs_per_worker=2, seed=0)
    seen: list[np.ndarray] = []
    async with contextlib.aclosing(sampler.stream(40)) as it:
        async for batch in it:
            seen.append(batch.agent_versions)
            await sampler.update_agent({})  # a parameter set: the version moves on
            if len(seen) == 4:
                break
    assert max(int(v.max()) for v in seen) >= 2


async def test_admission_holds_back_new_episodes() -> None:
    admission = Admission(max_lag=1)
    await admission.admit((0, 0), 0)
    await admission.admit((0, 1), 1)  # 1 - 0 <= 1
    waiting = asyncio.ensure_future(admission.admit((0, 2), 2))  # 2 - 0 > 1: held back
    await wait_until(lambda: admission.waits == 1, "the admission to hold it back")
    assert not waiting.done()
    admission.closed((0, 0))
    await asyncio.wait_for(waiting, 30.0)
    assert admission.oldest(0) == 1
    # Held back, but the call needs no more episodes: it gives up at once.
    assert not await admission.admit((0, 3), 5, lambda: False)


async def test_admission_in_stream(make_sampler: SamplerFactory) -> None:
    """With max_policy_lag=0 no episode starts under a new version while an older one is open."""
    sampler = make_sampler(
        "asyncio",
        random_length(1, 30, latency=(0.0, 0.002)),
        Versioned(),
        n_workers=2,
        envs_per_worker=4,
        seed=0,
    )
    async with contextlib.aclosing(sampler.stream(50, max_policy_lag=0)) as it:
        n = 0
        async for batch in it:
            for episode in batch.split():
                # Admission at lag 0: the episode ran under one version from its start... or
                # was started before an update it outlived; never started behind an open one.
                assert episode.agent_versions[0] == episode.episode_infos["agent_version"][0]
            admission = sampler._core.admission
            assert admission is not None and admission.max_lag == 0
            await sampler.update_agent({})
            n += 1
            if n == 4:
                break
        assert admission.waits > 0  # new episodes were held back behind older open ones


async def test_sync_env_refused_on_asyncio() -> None:
    with pytest.raises(TypeError, match="backend='thread'"):
        Sampler(lambda: CountingEnv(5), backend="asyncio")
    with pytest.raises(TypeError, match=r"blocking gymnasium\.Env"):
        Sampler("CartPole-v1", backend="asyncio")
    with pytest.raises(ValueError, match="max_concurrency"):
        Sampler("CartPole-v1", backend="process", max_concurrency=4)
    with pytest.raises(ValueError, match="inference='host'"):
        Sampler(counting(5), backend="asyncio", inference="host")


async def test_env_update_on_asyncio(make_sampler: SamplerFactory) -> None:
    sampler = make_sampler("asyncio", counting(5), n_workers=1, envs_per_worker=2, seed=0)
    await sampler.obtain_samples(20)
    batch = await sampler.obtain_samples(20, env_update=lambda: CountingAsyncEnv(3))
    assert (batch.lengths == 3).all()


@pytest.mark.parametrize("backend", ["local", "process"])
async def test_episode_timeout_on_lockstep_backends(
    make_sampler: SamplerFactory, backend: str
) -> None:
    """The deadline is checked after each step: episodes of 20 steps of 10 ms are cut."""
    sampler = make_sampler(
        backend,
        lambda: CountingEnv(20, latency=0.01),
        n_workers=2,
        envs_per_worker=2,
        episode_timeout=0.05,
        seed=0,
    )
    batch = await sampler.obtain_exact_episodes(3)
    _check_whole(batch)
    ends = batch.step_types[np.cumsum(batch.lengths) - 1]
    assert (ends == StepType.TIMEOUT).all()
    assert batch.episode_infos["deadline"].all()
    assert (batch.lengths < 20).all()
    # The next episode of a cut env starts fresh: its observations count from 0 again.
    again = await sampler.obtain_samples(40)
    _check_whole(again)


async def test_episode_timeout_refused_with_host_inference() -> None:
    with pytest.raises(ValueError, match="episode_timeout needs inference='per_worker'"):
        Sampler("CartPole-v1", inference="host", episode_timeout=1.0)


async def test_fraction_samples_on_lanes(make_sampler: SamplerFactory) -> None:
    """One worker's envs take 30 ms a step, the other's 1 ms: with fraction_samples=0.25 the
    fast worker fills in and the call ends long before the slow worker has its share."""
    factory = EnvFactory(lambda i: CountingAsyncEnv(5, latency=0.03 if i in (1, 2) else 0.001))
    sampler = make_sampler("asyncio", factory, n_workers=2, envs_per_worker=2, seed=0)
    batch = await sampler.obtain_samples(200, fraction_samples=0.25)
    _check_whole(batch)
    assert batch.n_transitions >= 200
    per_worker = np.bincount(batch.episode_infos["worker"], weights=batch.lengths, minlength=2)
    assert per_worker[0] >= 25  # its minimum: ceil(0.25 * 100)
    assert per_worker[1] > per_worker[0]


async def test_evaluate_on_lanes(make_sampler: SamplerFactory, lane: str) -> None:
    sampler = make_sampler(lane, LANES[lane](), Versioned(), n_workers=2, seed=0)
    result = await sampler.evaluate(5)
    assert len(result.returns) == 5
    _check_whole(result.batch)


async def test_thread_backend_rebuild_does_not_wait_for_a_stuck_step(
    make_sampler: SamplerFactory,
) -> None:
    """A blocking step stuck for 6 s is found at step_timeout; the worker's envs are rebuilt
    at once (the stuck thread finishes on its own, and its env is closed then): the call returns
    while the step is still stuck (released by the test afterwards)."""
    built = 0
    release, finished = threading.Event(), threading.Event()

    class Stuck(CountingEnv):
        def __init__(self) -> None:
            nonlocal built
            built += 1
            super().__init__(5)
            self.stuck = built == 2  # the first worker env (the probe is the first built)

        def step(self, action: Any) -> Any:
            if self.stuck and self.logic.steps_taken == 2:
                self.stuck = False
                release.wait(6.0)
                finished.set()
            return super().step(action)

    sampler = make_sampler(
        "thread", Stuck, n_workers=1, envs_per_worker=2, step_timeout=0.3, max_concurrency=4, seed=0
    )
    batch = await sampler.obtain_exact_episodes(6)  # three of each env: the stuck one's too
    assert sampler.restarts == 1 and not finished.is_set()  # it did not wait for the stuck step
    _check_whole(batch)
    release.set()


async def test_exact_episodes_and_fragments_reproducible_whatever_the_latency(
    make_sampler: SamplerFactory,
) -> None:
    """Random latencies change which env finishes first, not the batch: each env's episodes and
    steps are fixed by the call (fixed_shares=True), and pieces are ordered by the env's own
    step count."""

    class ByObs:
        def get_actions(self, observations: np.ndarray) -> Any:
            return (observations[:, 1] > 0.5).astype(np.int64), {}

    batches = []
    for run in range(2):
        # Different latencies per run: a latency draw of its own rng, seeded by the run.
        rng = np.random.default_rng(run)
        factory = EnvFactory(
            lambda i, rng=rng: RandomLengthAsyncEnv(1, 10, latency=float(rng.uniform(0, 0.004)))
        )
        sampler = make_sampler(
            "asyncio", factory, ByObs(), n_workers=2, envs_per_worker=3, seed=5, fixed_shares=True
        )
        batches.append(
            [
                await sampler.obtain_exact_episodes(4),
                await sampler.obtain_fragments(40),
                await sampler.obtain_fragments(40),
            ]
        )
        await sampler.aclose()
    for a, b in zip(*batches):
        assert a.equals(b)


# -- the inference modes on the lanes: one merger, options honoured or refused (issue 31) -------


class ThreadNoting:
    """A shared agent that notes the thread each call runs in and the rows it was given."""

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.rows: list[int] = []

    def get_actions(self, observations: np.ndarray) -> Any:
        self.threads.add(threading.current_thread().name)
        self.rows.append(len(observations))
        return np.zeros(len(observations), dtype=np.int64), {}


@pytest.mark.parametrize("options", [{"flush": "lockstep"}, {"min_fraction": 0.5}])
async def test_batched_options_the_lanes_cannot_honour_are_refused(
    lane: str, options: dict[str, Any]
) -> None:
    """Before: Batched(flush=..., min_fraction=...) was dropped without a word on the lanes."""
    from asyncsample.inference import Batched

    name = next(iter(options))
    with pytest.raises(ValueError, match=rf"{name}.*backend='{lane}'.*one pass"):
        Sampler(LANES[lane](), ThreadNoting(), backend=lane, inference=Batched(**options))


async def test_batched_threaded_runs_the_merged_call_in_the_helper_thread(
    make_sampler: SamplerFactory, lane: str
) -> None:
    """Before: threaded=True was dropped on the lanes (the agent ran in the loop's thread)."""
    from asyncsample.inference import Batched

    agent = ThreadNoting()
    inference = Batched(threaded=True)
    sampler = make_sampler(
        lane, LANES[lane](), agent, n_workers=3, envs_per_worker=4, seed=1, inference=inference
    )
    batch = await sampler.obtain_samples(60)
    assert batch.n_transitions >= 60
    assert agent.threads == {"asyncsample-batcher_0"}
    assert max(agent.rows) > 4  # rows of several workers merged into one call


async def test_the_merged_call_reports_the_rows_and_every_worker(
    make_sampler: SamplerFactory,
) -> None:
    """A bad merged output names its rows and all the workers they came from (before: the
    first requester's worker only)."""

    class Scalar:
        def get_actions(self, observations: np.ndarray) -> Any:
            return np.int64(0), {}

    factory = EnvFactory(lambda j: CountingAsyncEnv(5))
    sampler = make_sampler("asyncio", factory, Scalar(), n_workers=3, envs_per_worker=2)
    with pytest.raises(ValueError, match=r"6 rows, .* of workers 0, 1, 2\), got a scalar"):
        await sampler.obtain_samples(20)


async def test_per_env_stepping_is_a_capability_of_the_lane_hosts_only() -> None:
    """The engine picks the lanes by the ``PerEnvHost`` protocol, not by a host class; the lane
    host applies the time limit through the shared per-env bookkeeping (``EnvGroup.finish``)."""
    from asyncsample.backends.aio import AsyncioBackend
    from asyncsample.backends.base import HostSpec, PerEnvHost
    from asyncsample.backends.local import LocalBackend

    env = CountingAsyncEnv(10)
    spec = HostSpec(0, 1, env.observation_space, env.action_space, max_episode_length=3)
    lanes, local = AsyncioBackend(), LocalBackend()
    try:
        (lane_host,) = await lanes.start([spec])
        (local_host,) = await local.start([spec])
        assert isinstance(lane_host, PerEnvHost) and not isinstance(local_host, PerEnvHost)
        await lane_host.build([[lambda: CountingAsyncEnv(10)]], [0])  # type: ignore[attr-defined]
        await lane_host.reset_one(0)  # type: ignore[attr-defined]
        flags = [(await lane_host.step_one(0, 0))[1:3] for _ in range(3)]  # type: ignore[attr-defined]
        assert flags == [(False, False), (False, False), (False, True)]  # cut at 3, not 10
        assert lane_host.buffers.truncated[0] and not lane_host.buffers.terminated[0]
    finally:
        await lanes.aclose()
        await local.aclose()
