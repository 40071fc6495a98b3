"""Sampler(metrics=...): each metric's value against what the run did, on every backend, and
the bottleneck gauge in three synthetic runs (a slow env, a slow agent, a slow consumer)."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import async_envs
import numpy as np
import pytest
from envs import BadShapeEnv, FailingEnv, HangingEnv, KillSelfEnv, NoisyEnv, SleepyEnv
from helpers import SamplerFactory, wait_until
from prometheus_client import CollectorRegistry

from asyncsample import EpisodeBatch, RandomAgent, Sampler, StepType, VectorEnv, WorkerError, _clock
from asyncsample._clock import (
    CLOCK_SIZE,
    ENV,
    GAP_SECONDS,
    MAX_GAP,
    STEPS,
    AgentTimer,
    Pace,
    gap_after,
    timed_group_step,
)

pytestmark = pytest.mark.timeout(120)

P = "asyncsample_"


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of metric ``name``'s samples that carry ``labels`` (0 when none)."""
    total = 0.0
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == P + name and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                total += sample.value
    return total


def ends(batches: list[EpisodeBatch], kind: StepType) -> int:
    return sum(int(np.count_nonzero(np.asarray(b.step_types) == kind)) for b in batches)


def open_fragments(batch: EpisodeBatch) -> int:
    """Episodes of a fragments batch still running at its end."""
    last = np.cumsum(batch.lengths) - 1
    types = np.asarray(batch.step_types)[last]
    return int(np.count_nonzero((types != StepType.TERMINAL) & (types != StepType.TIMEOUT)))


def env_for(backend: str) -> Any:
    if backend == "asyncio":
        return async_envs.random_length(1, 20)
    return NoisyEnv


def check_counts(
    registry: CollectorRegistry,
    backend: str,
    batches: list[EpisodeBatch],
    sampled: bool = False,
    n_envs: int = 6,
) -> None:
    """``sampled``: inference="host", whose hosts time a sample of whole chunks; ``n_envs``:
    the sampler's envs. The latency histograms count the calls up to each timer's last timed
    one (each timed call standing for the calls since the one before: see ``Pace``)."""
    steps = sum(b.n_transitions for b in batches)
    assert value(registry, "env_steps_total", backend=backend) == steps
    timed = value(registry, "env_step_seconds_count", backend=backend)
    if backend in ("asyncio", "thread"):
        # lane hosts in this process: every step of some envs per call, weighing the steps
        # taken since the last fold with a timed step: the steps, up to the last such fold
        assert 0 < timed <= steps * (1 + 1e-9)
    elif sampled:  # a sample of whole chunks, each timed step weighing the chunks since
        assert 0 < timed <= MAX_GAP * steps
    else:  # a host's timed call stands for the calls since its last: behind by under a gap
        assert 0 < timed <= steps
        assert steps - timed < MAX_GAP * n_envs
    assert value(registry, "env_step_seconds_sum", backend=backend) > 0
    terminated = ends(batches, StepType.TERMINAL)
    truncated = ends(batches, StepType.TIMEOUT)
    assert terminated > 0 and truncated > 0
    assert value(registry, "episodes_total", end="terminated") == terminated
    assert value(registry, "episodes_total", end="truncated") == truncated
    assert value(registry, "episodes_total", end="deadline") == 0
    assert value(registry, "episode_length_count") == terminated + truncated
    assert value(registry, "episode_seconds_count") == terminated + truncated
    # every step's action is one row of one agent call
    calls = value(registry, "agent_calls_total")
    assert calls > 0
    timed_calls = value(registry, "agent_call_seconds_count")
    assert timed_calls > 0
    assert value(registry, "agent_call_seconds_sum") > 0
    if not sampled:  # a timer per worker (per_worker) or one (merged calls): behind the calls
        assert 0 <= calls - timed_calls < MAX_GAP * 2  # by under a gap each
    assert value(registry, "agent_call_rows_count") == calls
    assert value(registry, "agent_call_rows_sum") == steps
    assert value(registry, "policy_lag_count") == steps
    assert value(registry, "call_wait_seconds_count") == len(batches)
    assert value(registry, "agent_version") == 0
    # the barrier: the episodes still running are exactly the last batch's open fragments
    assert value(registry, "episodes_in_flight") == open_fragments(batches[-1])
    assert value(registry, "env_calls_in_flight") == 0
    assert sum(value(registry, "bottleneck", side=s) for s in ("env", "agent", "caller")) == 1


async def counted_run(
    make_sampler: SamplerFactory, backend: str, env: Any
) -> tuple[CollectorRegistry, list[EpisodeBatch]]:
    """Three fragments calls of 2 workers x 3 envs on ``backend`` with metrics on, their counts
    checked against the batches (:func:`check_counts`); the registry and the batches."""
    registry = CollectorRegistry()
    sampler = make_sampler(
        backend, env, n_workers=2, envs_per_worker=3, max_episode_length=8, seed=3,
        metrics=registry, fixed_shares=True,  # no step left in flight between calls
    )  # fmt: skip
    batches = [await sampler.obtain_fragments(150) for _ in range(3)]
    check_counts(registry, backend, batches)
    return registry, batches


@pytest.mark.parametrize("backend", ["local", "process", "thread", "asyncio"])
async def test_counts_match_the_run(backend: str, make_sampler: SamplerFactory) -> None:
    registry, batches = await counted_run(make_sampler, backend, env_for(backend))
    lockstep_calls = sum(b.n_transitions for b in batches) / 3  # a call per worker step
    if backend in ("local", "process"):
        assert value(registry, "agent_calls_total") == lockstep_calls
    # per-worker labels: the workers' steps add up to their own transitions
    for w in range(2):
        mine = sum(int(b.lengths[b.episode_infos["worker"] == w].sum()) for b in batches)
        assert value(registry, "env_steps_total", worker=str(w)) == mine


@pytest.mark.parametrize("backend", ["process", "local"])
async def test_host_and_batched_inference_count_agent_calls(
    backend: str, make_sampler: SamplerFactory
) -> None:
    registry = CollectorRegistry()
    inference = "host" if backend == "process" else "batched"
    agent = RandomAgent(NoisyEnv().action_space, seed=0)  # batched: one shared agent
    sampler = make_sampler(
        backend,
        NoisyEnv,
        agent,
        n_workers=2,
        envs_per_worker=3,
        max_episode_length=8,
        seed=4,
        inference=inference,
        metrics=registry,
    )
    batches = [await sampler.obtain_fragments(150) for _ in range(2)]
    check_counts(registry, backend, batches, sampled=inference == "host")
    if inference == "host":  # one agent call per worker step of the hosts, counted exactly
        assert value(registry, "agent_calls_total") == sum(b.n_transitions for b in batches) / 3


async def test_exact_episodes_and_update_version(make_sampler: SamplerFactory) -> None:
    registry = CollectorRegistry()
    sampler = make_sampler("local", NoisyEnv, n_workers=2, max_episode_length=8, metrics=registry)
    batch = await sampler.obtain_exact_episodes(3)
    await sampler.update_agent(sampler.workers[0].agent)
    batch2 = await sampler.obtain_exact_episodes(3)
    assert value(registry, "episodes_total") == batch.n_episodes + batch2.n_episodes == 12
    assert value(registry, "env_steps_total") == batch.n_transitions + batch2.n_transitions
    assert value(registry, "agent_version") == 1
    assert value(registry, "episodes_in_flight") == 0  # exact episodes leave none running


async def test_deadline_ends_are_counted(make_sampler: SamplerFactory) -> None:
    registry = CollectorRegistry()
    env = async_envs.counting(length=1000, latency=0.002)
    sampler = make_sampler(
        "asyncio", env, n_workers=1, envs_per_worker=2, episode_timeout=0.05, metrics=registry
    )
    batch = await sampler.obtain_exact_episodes(2)
    deadline = int(np.count_nonzero(batch.episode_infos.get("deadline", np.zeros(0, bool))))
    assert deadline == batch.n_episodes > 0
    assert value(registry, "episodes_total", end="deadline") == deadline
    assert value(registry, "episodes_total", end="truncated") == 0


@pytest.mark.parametrize("backend", ["local", "process", "thread"])
async def test_faults_injected_equal_faults_counted(
    backend: str, tmp_path: Path, make_sampler: SamplerFactory
) -> None:
    registry = CollectorRegistry()
    env = functools.partial(FailingEnv, str(tmp_path / "failed"), 5)
    sampler = make_sampler(backend, env, n_workers=2, envs_per_worker=2, metrics=registry)
    batch = await sampler.obtain_samples(200)
    assert (tmp_path / "failed").exists()
    assert value(registry, "env_faults_total", kind="raised") == 1
    assert value(registry, "env_faults_total") == 1
    assert value(registry, "restarts_total") == sampler.restarts == 1
    # the steps lost with the dropped episodes were taken too: counted, not in the batch
    assert value(registry, "env_steps_total") >= batch.n_transitions


async def test_abandoned_steps_are_counted(make_sampler: SamplerFactory) -> None:
    # obtain_fragments leaves episodes running and obtain_samples resets them, one env at a
    # time on the lanes: every step the envs took is counted, whatever became of its episode
    registry = CollectorRegistry()
    env = async_envs.counting(length=50)
    sampler = make_sampler("asyncio", env, n_workers=2, envs_per_worker=3, metrics=registry)
    for _ in range(2):
        await sampler.obtain_fragments(40)
        await sampler.obtain_samples(40)
    taken = sum(e.logic.steps_taken for e in env.made)
    dropped = sum(w.episodes.dropped_steps for w in sampler._core.workers)
    assert dropped > 0  # episodes were abandoned unfinished
    assert value(registry, "env_steps_total") == taken


async def test_async_env_faults_counted(make_sampler: SamplerFactory) -> None:
    registry = CollectorRegistry()
    # one fault (two envs of a worker failing in the same pass of the loop are one restart)
    env = async_envs.failing(fail_at=3, times=1)
    sampler = make_sampler("asyncio", env, n_workers=2, envs_per_worker=2, metrics=registry)
    await sampler.obtain_samples(100)
    await sampler.obtain_samples(100)
    injected = sum(e.failed for e in env.made)
    assert injected == 1
    assert value(registry, "env_faults_total", kind="raised") == injected
    assert value(registry, "restarts_total") == injected == sampler.restarts


async def test_hung_and_killed_hosts_are_counted(
    tmp_path: Path, make_sampler: SamplerFactory
) -> None:
    registry = CollectorRegistry()
    hung = functools.partial(HangingEnv, 6, 3600.0, str(tmp_path / "hung"))
    sampler = make_sampler(
        "process", hung, n_workers=2, n_processes=2, step_timeout=1.0, metrics=registry
    )
    await sampler.obtain_samples(60)
    assert value(registry, "env_faults_total", kind="hung") == 1
    killed = functools.partial(KillSelfEnv, 6, str(tmp_path / "killed"))
    sampler = make_sampler("process", killed, n_workers=2, n_processes=2, metrics=registry)
    await sampler.obtain_samples(60)
    assert value(registry, "env_faults_total", kind="killed") == 1
    assert value(registry, "env_faults_total", kind="hung") == 1  # two samplers, one registry
    assert value(registry, "restarts_total") == 2


async def test_malformed_observations_are_counted(make_sampler: SamplerFactory) -> None:
    registry = CollectorRegistry()
    sampler = make_sampler("process", BadShapeEnv, n_workers=1, metrics=registry)
    with pytest.raises(WorkerError):
        await sampler.obtain_samples(20)
    assert value(registry, "env_faults_total", kind="malformed") == 1
    assert value(registry, "restarts_total") == 0


async def test_closed_sampler_keeps_its_counters(make_sampler: SamplerFactory) -> None:
    registry = CollectorRegistry()
    sampler = make_sampler("local", NoisyEnv, metrics=registry)
    batch = await sampler.obtain_fragments(40)
    await sampler.aclose()
    assert value(registry, "env_steps_total") == batch.n_transitions
    assert value(registry, "episodes_in_flight") == 0


def test_bad_metrics_argument() -> None:
    with pytest.raises(TypeError, match="metrics must be None, True"):
        Sampler("CartPole-v1", backend="local", metrics="yes")


def test_without_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    with pytest.raises(ImportError, match=r"asyncsample\[metrics\]"):
        Sampler("CartPole-v1", backend="local", metrics=True)


def test_core_imports_without_prometheus() -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import asyncio, asyncsample\n"
        "async def main():\n"
        "    async with asyncsample.Sampler('CartPole-v1', backend='local') as s:\n"
        "        print((await s.obtain_samples(10)).n_transitions >= 10)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_gap_after_keeps_timing_about_a_thousandth_of_the_time_timed() -> None:
    assert gap_after(1.0) == gap_after(GAP_SECONDS) == 1  # slow calls: every one timed
    assert gap_after(GAP_SECONDS / 10) == 10
    assert gap_after(GAP_SECONDS / 1000) == gap_after(0.0) == MAX_GAP  # fast: one in MAX_GAP


def test_one_sampling_rule() -> None:
    """The first two calls are timed, then the gap follows the latest timed call's seconds
    (each timed call standing for the calls since the one before); the calls and their rows
    are exact."""
    timer = AgentTimer()
    weights = []
    for i in range(200):
        weight = timer.due(3 if i % 2 else 5)
        if weight:
            timer.took(1e-6, weight)  # fast calls: MAX_GAP
        weights.append(weight)
    picked = [i for i, w in enumerate(weights) if w]
    assert picked == [0, 1, 1 + MAX_GAP, 1 + 2 * MAX_GAP, 1 + 3 * MAX_GAP]
    calls, by_rows, seconds, counted = timer.drain()
    assert calls == 200 and by_rows == {5: 100, 3: 100}
    assert seconds == [1e-6] * 5
    assert counted == [1, 1, MAX_GAP, MAX_GAP, MAX_GAP]
    assert sum(counted) == picked[-1] + 1  # every call up to the last timed one, once
    assert timer.drain() == (0, {}, [], [])
    # a slow call: the gap closes after the next timed call (whose gap was set before, when
    # its own seconds were not known)
    timer = AgentTimer()
    assert timer.due(1) == 1
    timer.took(1e-6, 1)
    assert timer.due(1) == 1
    timer.took(GAP_SECONDS, 1)
    assert [timer.due(1) for _ in range(MAX_GAP)] == [0] * (MAX_GAP - 1) + [MAX_GAP]
    timer.took(GAP_SECONDS, MAX_GAP)
    assert [timer.due(1) for _ in range(3)] == [1, 1, 1]


def test_pace_counts_overlapping_calls_as_they_start() -> None:
    pace = Pace()
    assert [pace.tick() for _ in range(3)] == [1, 1, 1]  # no seconds yet: every call
    pace.last = GAP_SECONDS / 4  # the next timed call (set before: weight 1) sets a gap of 4
    assert [pace.tick() for _ in range(9)] == [1, 0, 0, 0, 4, 0, 0, 0, 4]


def test_a_host_times_its_step_calls_at_its_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    """An env host's timed step calls (4 envs each) count each env step as the calls since the
    last timed one: the histogram's count is the steps up to the last timed call, its seconds
    the timed calls' seconds per env, weighted."""
    now = [0.0]
    tick = [2e-6]  # each read of the clock: a fast call (4 envs in 2 us)

    def clock() -> float:
        now[0] += tick[0]
        return now[0]

    monkeypatch.setattr(_clock, "_perf", clock)

    class Group:
        last_stepped = 4
        last_ended = ()

    cells = np.zeros(CLOCK_SIZE)
    step = timed_group_step(Group(), lambda mask, given, everyone: None, cells, counted=True)
    for _ in range(200):
        step(None)
    counted = 1 + 1 + 3 * MAX_GAP  # the calls up to the last timed one (number 194)
    buckets = cells[ENV : ENV + len(_clock.BOUNDS) + 1]
    assert cells[STEPS] == 800  # exact
    assert buckets[0] == 4 * counted  # 0.5 us per env step: the first bucket
    assert cells[ENV + len(_clock.BOUNDS) + 1] == pytest.approx(2e-6 * counted)
    tick[0] = 1e-3  # slow calls from now: after the two gaps already set, every call is timed
    for _ in range(2 * MAX_GAP + 16):  # calls 200 to 343: timed 257, 321, then 322 to 343
        step(None)
    slow = buckets.sum() - 4 * counted
    assert slow == 4 * (2 * MAX_GAP + 22)


def test_integer_tally_counts_as_observe() -> None:
    # policy_lag's fold by tally puts every value in the bucket observe would, sum included
    from asyncsample.metrics import _LAG_BOUNDS, _Hist

    values = np.array([0, 0, 1, 2, 3, 4, 5, 8, 9, 16, 40, 64, 65, 100, 0], dtype=np.int64)
    for vals in (values, np.array([1, 70_000], dtype=np.int64)):  # the second: no tally array
        direct, tallied = _Hist(_LAG_BOUNDS), _Hist(_LAG_BOUNDS)
        direct.observe(vals.astype(np.float64))
        tallied.observe_counts(vals)
        assert tallied.counts.tolist() == direct.counts.tolist()
        assert tallied.sum == direct.sum == float(vals.sum())
    assert direct.counts.sum() > 0


def test_a_host_clock_whose_calls_in_flight_fall_is_not_a_restart() -> None:
    # a host of async envs keeps its env calls running in the clock's last cell (a gauge): a
    # fall there between two folds must not read as a new host, which would count every timed
    # step again
    from asyncsample._clock import CALLS, CLOCK_SIZE, ENV, STEPS
    from asyncsample.metrics import _gained

    seen: dict[int, np.ndarray] = {}
    clock = np.zeros(CLOCK_SIZE)
    clock[ENV], clock[STEPS], clock[CALLS] = 8, 100, 3
    assert _gained(seen, 0, clock)[STEPS] == 100
    clock[ENV], clock[STEPS], clock[CALLS] = 16, 150, 1
    gained = _gained(seen, 0, clock)
    assert gained[ENV] == 8 and gained[STEPS] == 50
    clock[:] = 0  # a restarted host's clock starts again: all of it is new
    clock[STEPS] = 7
    assert _gained(seen, 0, clock)[STEPS] == 7


def test_policy_lag_fold_counts_as_observe() -> None:
    # the fold's policy lag (one bucket's add when every step has one version) is observe's
    from asyncsample.metrics import _LAG_BOUNDS, _fold_lags, _Hist

    newest = 7
    for versions in (
        np.full(1000, 7, dtype=np.int64),  # no update during the call: lag 0
        np.full(300, 2, dtype=np.int32),  # one older version
        np.array([7, 6, 6, 0, 3, 7, 1], dtype=np.int64),  # updates during a stream
    ):
        direct, folded = _Hist(_LAG_BOUNDS), _Hist(_LAG_BOUNDS)
        direct.observe((newest - versions.astype(np.int64)).astype(np.float64))
        _fold_lags(folded, newest, versions)
        assert folded.counts.tolist() == direct.counts.tolist()
        assert folded.sum == direct.sum
        assert folded.counts.sum() == len(versions)


# -- the bottleneck ---------------------------------------------------------------------------


class SlowAgent:
    """A random agent that takes ``delay`` seconds per call (a slow policy server)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def get_actions(self, observations: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        time.sleep(self.delay)
        return np.zeros(len(observations), dtype=np.int64), {}


def verdict(registry: CollectorRegistry) -> str:
    sides = [s for s in ("env", "agent", "caller") if value(registry, "bottleneck", side=s) == 1]
    assert len(sides) == 1, sides
    return sides[0]


@pytest.mark.parametrize("backend", ["local", "process"])
@pytest.mark.parametrize(
    ("side", "env", "agent"),
    [
        # env steps take 10 ms, the agent (random) microseconds: the envs hold the run
        ("env", functools.partial(SleepyEnv, 0.01), None),
        # the agent takes 10 ms per call, the envs microseconds: the envs wait on the agent
        ("agent", NoisyEnv, SlowAgent(0.01)),
    ],
    ids=["slow_env", "slow_agent"],
)
@pytest.mark.slow  # seconds of deliberate waiting; the slow pass runs it
async def test_bottleneck_slow_env_or_agent(
    backend: str, side: str, env: Any, agent: Any, make_sampler: SamplerFactory
) -> None:
    registry = CollectorRegistry()
    sampler = make_sampler(
        backend, env, agent, n_workers=2, envs_per_worker=2, n_processes=2, metrics=registry
    )
    for _ in range(3):
        await sampler.obtain_fragments(40)
        assert verdict(registry) == side, sampler.metrics.shares  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", ["local", "process"])
@pytest.mark.slow  # seconds of deliberate waiting; the slow pass runs it
async def test_bottleneck_slow_consumer(backend: str, make_sampler: SamplerFactory) -> None:
    # a round takes milliseconds; the consumer holds each batch 0.3 s: the caller holds the run
    registry = CollectorRegistry()
    sampler = make_sampler(
        backend, NoisyEnv, n_workers=2, envs_per_worker=2, n_processes=2, metrics=registry
    )
    seen = []
    async for _ in sampler.stream(40, fragments=True, buffer_size=1):
        seen.append(verdict(registry))
        if len(seen) == 6:
            break
        await asyncio.sleep(0.3)
    assert seen[3:] == ["caller"] * 3, (seen, sampler.metrics.shares)  # type: ignore[union-attr]
    assert value(registry, "call_wait_seconds_count") == 6


async def test_ray_counts_match_the_run(ray_cluster: Any, make_sampler: SamplerFactory) -> None:
    await counted_run(make_sampler, "ray", NoisyEnv)
    host = make_sampler(
        "ray",
        NoisyEnv,
        n_workers=2,
        envs_per_worker=3,
        max_episode_length=8,
        inference="host",
        metrics=CollectorRegistry(),
    )
    await host.obtain_fragments(60)
    assert host.metrics is not None and host.metrics.state.agent_calls > 0


# -- the vector faces -------------------------------------------------------------------------


def test_vector_env_counts_match_the_steps(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    killed = functools.partial(KillSelfEnv, 30, str(tmp_path / "killed"))
    venv = VectorEnv(killed, 4, n_processes=2, seed=0, max_restarts=2, metrics=registry)
    try:
        venv.reset()
        terminated = truncated = 0
        for _ in range(100):
            _, _, term, trunc, info = venv.step(venv.action_space.sample())
            terminated += int(term.sum())
            # sub-envs of a restarted host end their episode truncated: the face's doing, not
            # an end the host saw
            truncated += int((trunc & ~info.get("_restarted", np.zeros(4, bool))).sum())
        steps = value(registry, "env_steps_total", backend="process")
        assert steps >= 4 * 100 - 4
        # sampled: each host (two, and the restarted one) times its step calls of its 2 envs at
        # its pace, each timed env step standing for the calls since its last: behind the
        # steps by under a gap per host
        timed = value(registry, "env_step_seconds_count")
        assert 0 < timed <= steps
        assert steps - timed < MAX_GAP * 2 * 3
        assert value(registry, "env_step_seconds_sum") > 0
        assert value(registry, "env_faults_total", kind="killed") == 1
        assert value(registry, "restarts_total") == 1
    finally:
        venv.close()
    # after close the counters stay
    assert value(registry, "episodes_total", end="terminated") == terminated
    assert value(registry, "episodes_total", end="truncated") == truncated


def test_sb3_face_counts() -> None:
    from asyncsample.sb3 import AsyncSampleVecEnv  # imports SB3 and torch: seconds, so here

    registry = CollectorRegistry()
    venv = AsyncSampleVecEnv("CartPole-v1", 4, n_processes=2, metrics=registry)
    try:
        venv.reset()
        dones = 0
        for _ in range(200):
            _, _, done, _ = venv.step(np.array([venv.action_space.sample() for _ in range(4)]))
            dones += int(done.sum())
        assert dones > 0
        assert value(registry, "env_steps_total") == 800
        assert value(registry, "episodes_total") == dones
        timed = value(registry, "env_step_seconds_count")  # 2 hosts of 2 envs, sampled
        assert 0 < timed <= 800 and 800 - timed < MAX_GAP * 4
    finally:
        venv.close()


@pytest.mark.parametrize("backend", ["asyncio", "process"])
async def test_env_calls_in_flight_is_live(backend: str, make_sampler: SamplerFactory) -> None:
    # 6 envs, each step 50 ms, max_concurrency=4: scrapes during a call see up to 4 running
    # (async envs in hosts: as of each host's last reply, so the cap may not be seen)
    registry = CollectorRegistry()
    sampler = make_sampler(
        backend,
        async_envs.counting(length=1000, latency=0.05),
        n_workers=2,
        envs_per_worker=3,
        max_concurrency=4,
        metrics=registry,
        fixed_shares=True,  # no step left in flight once the call returns
    )
    seen = await _scraped_in_flight(sampler, registry)
    if backend == "process":
        assert 1 <= max(seen) <= 4 and min(seen) >= 0  # reported, never above the cap
        # the cut steps' cancels settle in the hosts (each host reports as it replies)
        await wait_until(lambda: value(registry, "env_calls_in_flight") == 0, "no call in flight")
    else:
        assert max(seen) == 4 and min(seen) >= 0  # never above the cap, which the steps fill
    assert value(registry, "env_calls_in_flight") == 0


async def _scraped_in_flight(sampler: Any, registry: CollectorRegistry) -> list[float]:
    """``env_calls_in_flight`` scraped every 10 ms while ``obtain_fragments(60)`` runs."""
    await sampler.start()
    call = asyncio.ensure_future(sampler.obtain_fragments(60))
    seen = []
    while not call.done():  # scraped while the call runs
        seen.append(value(registry, "env_calls_in_flight"))
        await asyncio.sleep(0.01)
    await call
    return seen


@pytest.mark.parametrize("backend", ["asyncio", "thread"])
async def test_env_calls_in_flight_is_live_without_a_cap(
    backend: str, make_sampler: SamplerFactory
) -> None:
    # no max_concurrency, no step_timeout: the lane host's plain path, where nothing is counted
    # per step (the calls running are found in the lanes' coroutines when read); 6 envs, each
    # step 50 ms; on asyncio the third step of one env raises (its call returned: not in
    # flight)
    registry = CollectorRegistry()
    env = (
        async_envs.failing(fail_at=3, times=1, length=1000, latency=0.05)
        if backend == "asyncio"
        else async_envs.blocking_counting(length=1000, latency=0.05)
    )
    sampler = make_sampler(
        backend, env, n_workers=2, envs_per_worker=3, metrics=registry, fixed_shares=True
    )
    seen = await _scraped_in_flight(sampler, registry)
    assert max(seen) == 6 and min(seen) >= 0  # every env in a step at once, never more
    assert value(registry, "env_calls_in_flight") == 0
    if backend == "asyncio":
        assert value(registry, "env_faults_total", kind="raised") == 1


async def test_closed_samplers_merge_into_one_state(make_sampler: SamplerFactory) -> None:
    # a service making a sampler per job: counts add up, the registry keeps one closed state
    registry = CollectorRegistry()
    total = 0
    for n_workers in (1, 3, 2):
        sampler = make_sampler("local", NoisyEnv, n_workers=n_workers, metrics=registry)
        total += (await sampler.obtain_fragments(30)).n_transitions
        await sampler.aclose()
    assert value(registry, "env_steps_total") == total
    assert value(registry, "env_steps_total", worker="2") > 0
    assert sampler.metrics is not None
    assert len(sampler.metrics._hub.states) == 1


async def test_lane_hosts_time_every_env_in_turn_and_count_every_step(
    make_sampler: SamplerFactory,
) -> None:
    """An in-process lane host times every step of some envs per call (12 envs: as many as the
    gap asks, one env every few calls when the gap is wider than the envs), another set each
    call, none chosen per step; the fold weighs them by the steps taken, so the histogram
    counts every step."""
    registry = CollectorRegistry()
    sampler = make_sampler(
        "asyncio",
        async_envs.counting(length=30, latency=0.002),
        n_workers=1,
        envs_per_worker=12,
        metrics=registry,
    )
    await sampler.start()
    host = sampler._core.workers[0].host
    pace, turn = host.timing.pace, host.timing.turn
    pace.last = GAP_SECONDS  # a gap of 1: every env
    assert host.timed_envs() == frozenset(range(12))
    pace.last = GAP_SECONDS / 4  # a gap of 4: a third of the envs, in turn
    turns = [host.timed_envs() for _ in range(4)]
    assert set().union(*turns) == set(range(12))  # every env takes its turn
    assert [len(t) for t in turns] == [3, 3, 3, 3] and len(set(turns)) == 4
    pace.last = 0.0  # a gap of MAX_GAP steps: one env every ceil(MAX_GAP / 12) calls
    calls = -(-MAX_GAP // 12)
    turns = [host.timed_envs() for _ in range(12 * calls)]
    assert sum(len(t) for t in turns) == 12
    assert set().union(*turns) == set(range(12))
    pace.last, host.timing.turn = GAP_SECONDS, turn
    # 2-ms steps, 12 at a time: a round's seconds per step pace a gap of a few envs, so every
    # call times some and the count is every step
    batches = [await sampler.obtain_fragments(240) for _ in range(5)]
    steps = sum(b.n_transitions for b in batches)
    assert value(registry, "env_steps_total") == steps
    assert value(registry, "env_step_seconds_count") == pytest.approx(steps)
    assert value(registry, "env_step_seconds_sum") > 0
    assert 0 < gap_after(pace.last) <= 12


class SleepyAgent:
    """Zero actions; each call sleeps ``seconds`` (an agent of known cost)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, Any]]:
        time.sleep(self.seconds)
        return np.zeros(len(observations), dtype=np.int64), {}


#: The known costs of the run below: each env step, each agent call, each episode's steps.
STEP_S, AGENT_S, LENGTH = 0.01, 0.005, 5


@pytest.mark.parametrize("backend", ["asyncio", "thread", "local"])
async def test_latencies_add_up_to_the_known_delays(
    backend: str, make_sampler: SamplerFactory
) -> None:
    """Each histogram's mean is at least the delay put in (a step sleeps 10 ms, an agent call
    5 ms, an episode is 5 steps) and within a generous multiple of it: a timer that measured
    the wrong span (too little, or a whole call) would fall outside."""
    registry = CollectorRegistry()
    env: Any = (
        async_envs.counting(LENGTH, STEP_S)
        if backend == "asyncio"
        else functools.partial(async_envs.CountingEnv, LENGTH, STEP_S)
    )
    sampler = make_sampler(
        backend, env, SleepyAgent(AGENT_S), n_workers=2, envs_per_worker=2, metrics=registry
    )
    batch = await sampler.obtain_exact_episodes(6)
    assert len(batch.lengths) == 12 and (batch.lengths == LENGTH).all()
    for name, least in (
        ("env_step_seconds", STEP_S),
        ("agent_call_seconds", AGENT_S),
        ("episode_seconds", LENGTH * STEP_S),
    ):
        count, total = value(registry, f"{name}_count"), value(registry, f"{name}_sum")
        assert count > 0, name
        assert least * 0.95 <= total / count < least * 100, (name, total, count)
    assert value(registry, "episode_seconds_count") == 12
