"""``Sampler(inference="host")``: the agent runs in the env hosts, a chunk of steps per request."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import sys
import threading
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
from envs import AlwaysFailingEnv, DictObsEnv, FailingEnv, HangingEnv, KillSelfEnv, NoisyEnv
from helpers import SamplerFactory, run_python

from asyncsample import EpisodeBatch, Sampler, StepType, WorkerError
from asyncsample.inference import Host
from asyncsample.worker import Transition, VecWorker

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.sampler_defaults(
        backend="process",
        env=NoisyEnv,
        inference="host",
        n_workers=4,
        envs_per_worker=2,
        max_episode_length=30,
        seed=7,
    ),
]

# The agents and envs below must reach the env-host processes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class LinearAgent:
    """Deterministic: actions depend only on the observation rows; one agent info."""

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        obs = observations["pos"] if isinstance(observations, dict) else observations
        actions = np.floor((np.asarray(obs)[:, 0] + 1.0) * 1.5).astype(np.int64).clip(0, 2)
        return actions, {"twice": actions * 2}


class SeededAgent:
    """Stochastic, reproducible through its ``seed`` hook (called in the host)."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng()
        self.seeded_with: int | None = None

    def seed(self, seed: int) -> None:
        self.seeded_with = seed
        self.rng = np.random.default_rng(seed)

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        n = len(observations)
        return self.rng.integers(0, 3, n), {"seed": np.full(n, self.seeded_with or -1)}


class VersionAgent:
    """Its parameter is a version number; every action reports the version that chose it."""

    def __init__(self) -> None:
        self.version = 0

    def get_param_values(self) -> int:
        return self.version

    def set_param_values(self, params: Any) -> None:
        self.version = int(params["version"])

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        n = len(observations)
        return np.full(n, self.version % 3), {"version": np.full(n, self.version)}


class FixedAgent:
    """Always ``action``; an agent info says which object chose it."""

    def __init__(self, action: int) -> None:
        self.action = action

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        n = len(observations)
        return np.full(n, self.action), {"version": np.full(n, -self.action)}


class RaisingAgent(LinearAgent):
    """Raises at its ``at``-th call."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.calls = 0

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        self.calls += 1
        if self.calls == self.at:
            raise ArithmeticError("agent broke")
        return super().get_actions(observations)


class OutOfRangeAgent:
    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return np.full(len(observations), 7), {}


class AsyncAgent(LinearAgent):
    async def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:  # type: ignore[override]
        return super().get_actions(observations)


class LockedAgent(LinearAgent):
    """Holds a lock: cannot be pickled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


class RecordingWorker(VecWorker):
    """Counts transitions and sums next observations through ``process_transition``."""

    def process_transition(self, history: Any, transition: Transition) -> Any:
        n, total = history or (0, 0.0)
        rows = np.flatnonzero(transition.active)
        return n + len(rows), total + float(np.sum(transition.next_observations[rows]))


def assert_equal_batches(a: EpisodeBatch, b: EpisodeBatch) -> None:
    assert np.array_equal(a.lengths, b.lengths)
    for x, y in ((a.observations, b.observations), (a.last_observations, b.last_observations)):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                assert np.array_equal(x[k], y[k])
        else:
            assert np.array_equal(x, y)
    assert np.array_equal(a.actions, b.actions)
    assert np.array_equal(a.rewards, b.rewards)
    assert np.array_equal(a.step_types, b.step_types)
    assert a.agent_infos.keys() == b.agent_infos.keys()
    for k in a.agent_infos:
        assert np.array_equal(a.agent_infos[k], b.agent_infos[k])
    for k in ("worker", "env", "agent_version"):
        assert np.array_equal(a.episode_infos[k], b.episode_infos[k])
    assert np.array_equal(a.env_infos["t"], b.env_infos["t"])


async def four_calls(sampler: Sampler) -> list[EpisodeBatch]:
    async with sampler:
        return [
            await sampler.obtain_samples(200),
            await sampler.obtain_exact_episodes(3),
            await sampler.obtain_fragments(100),
            await sampler.obtain_fragments(100),
        ]


def per_worker_steps(batch: EpisodeBatch, n_workers: int) -> list[int]:
    workers = batch.episode_infos["worker"]
    return [int(batch.lengths[workers == w].sum()) for w in range(n_workers)]


def assert_complete(batch: EpisodeBatch) -> None:
    for ep in batch.split():
        assert StepType(ep.step_types[-1]) in (StepType.TERMINAL, StepType.TIMEOUT)


# -- same batches as per_worker -------------------------------------------------------------------


@pytest.mark.parametrize("chunk_steps", [None, 1, 3])
async def test_deterministic_agent_matches_per_worker(
    chunk_steps: int | None, no_leaks: None, make_sampler: SamplerFactory
) -> None:
    expected = await four_calls(make_sampler(agent=LinearAgent(), inference="per_worker"))
    inference = "host" if chunk_steps is None else Host(chunk_steps=chunk_steps)
    got = await four_calls(make_sampler(agent=LinearAgent(), inference=inference))
    for a, b in zip(expected, got, strict=True):
        assert_equal_batches(a, b)


async def test_random_agents_match_per_worker(no_leaks: None, make_sampler: SamplerFactory) -> None:
    # agent=None: a seeded RandomAgent per worker; its generator travels with the copy.
    expected = await four_calls(make_sampler(agent=None, inference="per_worker"))
    got = await four_calls(make_sampler(agent=None))
    for a, b in zip(expected, got, strict=True):
        assert_equal_batches(a, b)


async def test_dict_observations_match_per_worker(make_sampler: SamplerFactory) -> None:
    expected = await four_calls(
        make_sampler(agent=LinearAgent(), inference="per_worker", env=DictObsEnv)
    )
    got = await four_calls(
        make_sampler(agent=LinearAgent(), inference=Host(chunk_steps=5), env=DictObsEnv)
    )
    for a, b in zip(expected, got, strict=True):
        assert_equal_batches(a, b)


async def test_process_transition_matches_per_worker(make_sampler: SamplerFactory) -> None:
    async def run(inference: str) -> list[Any]:
        async with make_sampler(
            agent=LinearAgent(), inference=inference, worker_class=RecordingWorker
        ) as s:
            await s.obtain_samples(150)
            await s.obtain_fragments(60)
            return [w.history for w in s.workers]

    assert await run("host") == await run("per_worker")


async def test_seeded_agent_is_reproducible_for_any_n_processes(
    make_sampler: SamplerFactory,
) -> None:
    runs = [
        await four_calls(make_sampler(agent=SeededAgent(), n_processes=n)) for n in (1, 2, 2, 4)
    ]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert_equal_batches(a, b)
    seeds = runs[0][0].agent_infos["seed"]
    workers = np.repeat(runs[0][0].episode_infos["worker"], runs[0][0].lengths)
    # Each worker's copy was seeded (by its hook) with its own seed from the seed tree.
    assert len({int(seeds[workers == w][0]) for w in range(4)}) == 4
    assert (seeds >= 0).all()


# -- quotas -----------------------------------------------------------------------------------


async def test_quotas_hold_exactly(make_sampler: SamplerFactory) -> None:
    async with make_sampler(agent=LinearAgent(), inference=Host(chunk_steps=7)) as s:
        batch = await s.obtain_exact_episodes(5)
        assert_complete(batch)
        assert batch.episode_infos["worker"].tolist() == [w for w in range(4) for _ in range(5)]
        # env i of a worker runs 5 // 2 + (i < 5 % 2) episodes
        envs = batch.episode_infos["env"].reshape(4, 5)
        assert all(sorted(row.tolist()) == [0, 0, 0, 1, 1] for row in envs)
        frags = await s.obtain_fragments(101)  # 26, 25, 25, 25 per worker: 13 steps x 2 envs
        assert per_worker_steps(frags, 4) == [26, 26, 26, 26]


# -- agent updates --------------------------------------------------------------------------------


async def test_parameter_and_agent_updates_reach_every_host(make_sampler: SamplerFactory) -> None:
    async with make_sampler(agent=VersionAgent(), inference=Host(chunk_steps=4)) as s:
        batch = await s.obtain_samples(80)
        assert (batch.agent_infos["version"] == 0).all()
        batch = await s.obtain_samples(80, agent_update={"version": 5})
        assert (batch.agent_infos["version"] == 5).all()
        assert (batch.episode_infos["agent_version"] == 1).all()
        await s.update_agent({"version": 6})
        batch = await s.obtain_exact_episodes(2)
        assert (batch.agent_infos["version"] == 6).all()
        assert (batch.episode_infos["agent_version"] == 2).all()
        # A new agent object is pickled to the hosts; then parameters again.
        batch = await s.obtain_samples(40, agent_update=FixedAgent(2))
        assert (batch.agent_infos["version"] == -2).all()
        assert (batch.actions == 2).all()
        per_worker: list[Any] = [FixedAgent(w % 3) for w in range(4)]
        batch = await s.obtain_exact_episodes(1, agent_update=per_worker)
        workers = np.repeat(batch.episode_infos["worker"], batch.lengths)
        assert np.array_equal(batch.actions, workers % 3)
        assert (batch.episode_infos["agent_version"] == 4).all()


@pytest.mark.parametrize("fragments", [False, True])
async def test_stream_matches_per_worker(fragments: bool, make_sampler: SamplerFactory) -> None:
    async def run(inference: Any) -> list[EpisodeBatch]:
        out = []
        async with make_sampler(agent=LinearAgent(), inference=inference) as s:
            async with contextlib.aclosing(s.stream(90, fragments=fragments)) as it:
                async for batch in it:
                    out.append(batch)
                    if len(out) == 4:
                        break
        return out

    expected = await run("per_worker")
    for a, b in zip(expected, await run(Host(chunk_steps=6)), strict=True):
        assert_equal_batches(a, b)


async def test_stream_versions_are_exact_and_lag_is_enforced(make_sampler: SamplerFactory) -> None:
    agent = VersionAgent()
    async with make_sampler(
        agent=agent, inference=Host(chunk_steps=3), n_workers=2, n_processes=2
    ) as s:
        seen = 0
        async with contextlib.aclosing(s.stream(40, buffer_size=2, max_policy_lag=1)) as it:
            async for batch in it:
                newest = seen
                versions = batch.episode_infos["agent_version"]
                assert (versions >= newest - 1).all()  # max_policy_lag=1
                starts = np.concatenate([[0], np.cumsum(batch.lengths)[:-1]])
                # The version an episode is stamped with chose its first action.
                first = batch.agent_infos["version"][starts]
                assert np.array_equal(first, versions)
                seen += 1
                await s.update_agent({"version": seen})
                if seen == 6:
                    break
        assert seen == 6
        assert s.workers[0].agent_version == 6


# -- construction errors --------------------------------------------------------------------------


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match=r"backend='process'.*'local'"):
        Sampler(NoisyEnv, LinearAgent(), backend="local", inference="host")
    with pytest.raises(ValueError, match=r"async agent.*AsyncAgent"):
        Sampler(NoisyEnv, AsyncAgent(), inference="host")
    with pytest.raises(TypeError, match=r"LockedAgent.*cannot be pickled"):
        Sampler(NoisyEnv, LockedAgent(), inference="host")
    with pytest.raises(ValueError, match="overrides compute_actions"):

        class Custom(VecWorker):
            async def compute_actions(self, observations: Any) -> Any:
                return await super().compute_actions(observations)

        Sampler(NoisyEnv, LinearAgent(), inference="host", worker_class=Custom)
    with pytest.raises(ValueError, match="chunk_steps must be >= 1, got 0"):
        Host(chunk_steps=0)
    with pytest.raises(TypeError, match="chunk_steps must be an int >= 1, got str"):
        Host(chunk_steps="8")  # type: ignore[arg-type]


async def test_unpicklable_or_async_agent_update_is_refused_before_it_applies(
    make_sampler: SamplerFactory,
) -> None:
    async with make_sampler(agent=VersionAgent(), n_workers=2) as s:
        with pytest.raises(TypeError, match=r"LockedAgent.*cannot be pickled"):
            await s.obtain_samples(20, agent_update=LockedAgent())
        with pytest.raises(ValueError, match="async agent"):
            await s.update_agent(AsyncAgent())
        assert all(isinstance(w.agent, VersionAgent) for w in s.workers)
        assert all(w.agent_version == 0 for w in s.workers)
        batch = await s.obtain_samples(20)
        assert (batch.agent_infos["version"] == 0).all()


# -- faults ------------------------------------------------------------------------------------


async def test_env_error_names_worker_and_env(no_leaks: None, make_sampler: SamplerFactory) -> None:
    async with make_sampler(agent=LinearAgent(), env=AlwaysFailingEnv, max_restarts=0) as s:
        with pytest.raises(WorkerError, match=r"worker \d, env \d: ValueError") as info:
            await s.obtain_samples(50)
        assert "this env always fails" in (info.value.remote_traceback or "")


async def test_agent_error_in_host_is_a_worker_error(
    no_leaks: None, make_sampler: SamplerFactory
) -> None:
    async with make_sampler(agent=RaisingAgent(at=3), n_workers=2) as s:
        with pytest.raises(WorkerError, match=r"agent of worker .* raised in its env host") as info:
            await s.obtain_samples(100)
        assert info.value.retry is False
        assert "ArithmeticError: agent broke" in (info.value.remote_traceback or "")
    async with make_sampler(agent=OutOfRangeAgent(), n_workers=2) as s:
        with pytest.raises(WorkerError, match="outside the action space"):
            await s.obtain_samples(10)


async def test_env_failure_is_recovered_and_quota_met(
    tmp_path: Path, no_leaks: None, make_sampler: SamplerFactory
) -> None:
    env = functools.partial(FailingEnv, str(tmp_path / "failed"), 9)
    async with make_sampler(
        agent=LinearAgent(), inference=Host(chunk_steps=16), env=env, n_workers=2
    ) as s:
        batch = await s.obtain_samples(300)
        assert s.restarts == 1
        assert all(t >= 150 for t in per_worker_steps(batch, 2))
        assert_complete(batch)
        frags = await s.obtain_fragments(64)
        assert per_worker_steps(frags, 2) == [32, 32]


async def test_killed_host_is_restarted_agent_reinstalled(
    tmp_path: Path, no_leaks: None, make_sampler: SamplerFactory
) -> None:
    env = functools.partial(KillSelfEnv, 25, str(tmp_path / "killed"))
    async with make_sampler(agent=VersionAgent(), env=env, n_workers=2, max_episode_length=20) as s:
        await s.update_agent({"version": 3})
        batch = await s.obtain_samples(400)
        assert s.restarts >= 1
        assert (tmp_path / "killed").exists()
        assert all(t >= 200 for t in per_worker_steps(batch, 2))
        assert_complete(batch)
        # The new host got the agent and its latest parameters again.
        assert (batch.agent_infos["version"] == 3).all()
        episodes = await s.obtain_exact_episodes(2)
        assert episodes.n_episodes == 4


async def test_hung_chunk_times_out_and_is_replaced(
    tmp_path: Path, no_leaks: None, make_sampler: SamplerFactory
) -> None:
    env = functools.partial(HangingEnv, 8, 3600.0, str(tmp_path / "hung"))
    async with make_sampler(
        agent=LinearAgent(), inference=Host(chunk_steps=4), env=env, n_workers=2, step_timeout=1.0
    ) as s:
        batch = await s.obtain_samples(100)  # the hour-long step ends at 4 x step_timeout
        assert s.restarts >= 1
    assert all(t >= 50 for t in per_worker_steps(batch, 2))
    assert_complete(batch)


async def test_cancellation_mid_chunk_leaves_the_sampler_usable(
    no_leaks: None, make_sampler: SamplerFactory
) -> None:
    rng = random.Random(0)
    async with make_sampler(agent=LinearAgent(), inference=Host(chunk_steps=50), n_workers=3) as s:
        expected = await s.obtain_exact_episodes(2)
        for i in range(9):
            call = [s.obtain_samples, s.obtain_fragments, s.obtain_exact_episodes][i % 3]
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(rng.uniform(0.0, 0.03)):
                    await call(1_000_000)
            batch = await s.obtain_exact_episodes(2)
            assert batch.n_episodes == 6
            assert_complete(batch)
            assert batch.episode_infos["worker"].tolist() == [0, 0, 1, 1, 2, 2]
        assert expected.n_episodes == 6


# -- ray ---------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_ray_matches_per_worker_and_takes_updates(
    ray_cluster: Any, make_sampler: SamplerFactory
) -> None:
    expected = await four_calls(make_sampler(agent=LinearAgent(), inference="per_worker"))
    got = await four_calls(
        make_sampler(agent=LinearAgent(), inference=Host(chunk_steps=5), backend="ray")
    )
    for a, b in zip(expected, got, strict=True):
        assert_equal_batches(a, b)
    async with make_sampler(
        agent=VersionAgent(), inference=Host(chunk_steps=4), backend="ray", n_workers=2
    ) as s:
        batch = await s.obtain_samples(60, agent_update={"version": 4})
        assert (batch.agent_infos["version"] == 4).all()
        assert (batch.episode_infos["agent_version"] == 1).all()
        batch = await s.obtain_exact_episodes(2, agent_update=FixedAgent(1))
        assert (batch.actions == 1).all()
        assert batch.n_episodes == 4


CLUSTER_SCRIPT = """
import asyncio, functools
import cloudpickle, envs, ray
from ray.cluster_utils import Cluster
from asyncsample import Sampler, StepType
from asyncsample.inference import Host
from asyncsample.worker import VecWorker
cloudpickle.register_pickle_by_value(envs)

class Noticing(VecWorker):
    started = None  # set once a worker recorded 40 transitions of the call

    def process_transition(self, history, transition):
        n = (history or 0) + int(transition.active.sum())
        if n >= 40 and Noticing.started is not None:
            Noticing.started.set()
        return n

async def main():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]  # one actor on each
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        async with Sampler(
            functools.partial(envs.SleepyEnv, 0.002), None, n_workers=4, envs_per_worker=2,
            n_processes=2, seed=0, max_episode_length=20, backend="ray",
            inference=Host(chunk_steps=8), worker_class=Noticing,
            backend_options={"num_cpus": 1},
        ) as s:
            await s.obtain_samples(100)
            cluster.add_node(num_cpus=1)  # room for the actor that replaces the lost one
            cluster.wait_for_nodes()
            for w in s.workers:
                w.history = 0
            Noticing.started = asyncio.Event()
            call = asyncio.ensure_future(s.obtain_samples(2000))
            await Noticing.started.wait()  # the call is under way
            cluster.remove_node(nodes[0], allow_graceful=False)
            batch = await call
            workers = batch.episode_infos["worker"]
            shares = [int(batch.lengths[workers == w].sum()) for w in range(4)]
            ends = [StepType(ep.step_types[-1]) for ep in batch.split()]
            again = await s.obtain_exact_episodes(2)
            print("RESULT", s.restarts, min(shares), set(ends) <= {StepType.TERMINAL,
                  StepType.TIMEOUT}, again.n_episodes)
    finally:
        ray.shutdown()
        cluster.shutdown()

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ray_cluster_node_removed_mid_call() -> None:
    # A fresh interpreter: the cluster's Ray must not meet the session's.
    result = run_python(CLUSTER_SCRIPT, timeout=360)
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-5000:]
    restarts, min_share, complete, episodes = lines[-1].split()[1:]
    assert int(restarts) >= 1  # the lost node's actor was recreated
    assert int(min_share) >= 500  # every worker's quota met, its lost episodes redone
    assert complete == "True"  # no half-made episode returned
    assert int(episodes) == 8  # the recreated actor serves the next call
