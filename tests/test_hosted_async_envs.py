"""Async envs in the env hosts (issue 33): ``backend="process"`` steps each async env on its own
in its host's event loop, and keeps the contracts of ``backend="asyncio"``: the same batches for a
seed (with an agent whose actions do not depend on the order of its calls), faults that are one
env's own, a killed host restarted, ``max_concurrency`` split over the hosts, nothing left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from async_envs import (
    CountingAsyncEnv,
    FaultyAsyncEnv,
    RandomLengthAsyncEnv,
    faulty,
    random_length,
)
from envs import first_to_claim
from helpers import touch, wait_until

from asyncsample import EpisodeBatch, Sampler, StepType, WorkerError
from asyncsample.backends._pacing import shares

# Faults and cancellation run under both loops in the quick pass (marked both_loops); the other
# uvloop variants, and every Ray variant, in the slow pass (tests/conftest.py).
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]


@pytest.fixture(params=["process", "ray"])
def backend(request: pytest.FixtureRequest) -> str:
    """The host backends that take async envs (Ray's variants are slow: its cluster starts)."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return str(request.param)


FIELDS = ("observations", "actions", "rewards", "lengths", "step_types")


class ThresholdAgent:
    """Deterministic: action 1 where the observation's draw is above one half (so the batches
    do not depend on the order in which envs ask)."""

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, Any]]:
        obs = np.asarray(observations)
        return (obs[..., 1] > 0.5).astype(np.int64), {}


async def _batches(sampler: Sampler, mode: str) -> list[EpisodeBatch]:
    """Two consecutive calls of ``mode`` (the second continues the first's fragments)."""
    if mode == "episodes":
        return [await sampler.obtain_exact_episodes(30) for _ in range(2)]
    return [await sampler.obtain_fragments(10) for _ in range(2)]


@pytest.mark.parametrize("mode", ["episodes", "fragments"])
@pytest.mark.parametrize("inference", ["per_worker", "batched", "host"])
async def test_batches_equal_the_asyncio_backends(
    make_sampler: Any, backend: str, mode: str, inference: str
) -> None:
    """``host``: the hosts' agent copies act; the batches equal the asyncio backend's with the
    agent in the caller."""
    out = {}
    for name in ("asyncio", backend):
        sampler = make_sampler(
            name,
            random_length(1, 20, None),
            ThresholdAgent(),
            n_workers=3,
            envs_per_worker=4,
            seed=3,
            inference="per_worker" if name == "asyncio" and inference == "host" else inference,
            fixed_shares=True,  # fragments: the same steps of each env, whatever the timing
        )
        out[name] = await _batches(sampler, mode)
        await sampler.aclose()
    for a, p in zip(out["asyncio"], out[backend]):
        assert p.n_transitions > 0
        for field in FIELDS:
            np.testing.assert_array_equal(getattr(a, field), getattr(p, field), err_msg=field)
        np.testing.assert_array_equal(a.episode_infos["env"], p.episode_infos["env"])


async def test_envs_live_in_the_hosts(make_sampler: Any, backend: str) -> None:
    """The envs report the pid they run in: the hosts', never the caller's."""

    class PidEnv(CountingAsyncEnv):
        async def step(self, action: Any) -> Any:
            obs, reward, terminated, truncated, _info = await super().step(action)
            return obs, reward, terminated, truncated, {"pid": os.getpid()}

    sampler = make_sampler(backend, PidEnv, n_workers=2, envs_per_worker=3, n_processes=2)
    batch = await sampler.obtain_samples(60)
    pids = set(batch.env_infos["pid"].tolist())
    assert os.getpid() not in pids
    assert len(pids) == 2
    if backend == "process":
        assert pids <= set(sampler._core.backend.pids)  # type: ignore[union-attr]


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="niceness is POSIX's")
async def test_busy_hosts_run_below_the_callers_priority(make_sampler: Any) -> None:
    """By default the process hosts of async envs, and those that run the agent's chunks
    (``inference="host"``, here the default for the built-in agent), add LANE_HOST_NICE to
    their niceness (the caller's loop comes first), ``host_nice`` another amount; hosts that
    wait on the caller for every step (``per_worker``) nothing."""
    from asyncsample.backends.process import LANE_HOST_NICE, ProcessBackend

    def niceness(sampler: Any) -> set[int]:
        pids = sampler._core.backend.pids
        assert pids
        return {os.getpriority(os.PRIO_PROCESS, pid) for pid in pids}

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    hosted = make_sampler("process", CountingAsyncEnv, n_workers=2, n_processes=2)
    await hosted.obtain_samples(20)
    assert niceness(hosted) == {min(19, mine + LANE_HOST_NICE)}
    for nice in (0, 2):
        options = {"host_nice": nice}
        other = make_sampler(
            "process", CountingAsyncEnv, n_workers=2, n_processes=2, backend_options=options
        )
        await other.obtain_samples(20)
        assert niceness(other) == {min(19, mine + nice)}
    chunks = make_sampler("process", "CartPole-v1", n_workers=2, n_processes=2)
    await chunks.obtain_samples(20)
    assert chunks.inference.mode == "host"
    assert niceness(chunks) == {min(19, mine + LANE_HOST_NICE)}
    kwargs = {"n_workers": 2, "n_processes": 2, "inference": "per_worker"}
    stepped = make_sampler("process", "CartPole-v1", **kwargs)
    await stepped.obtain_samples(20)
    assert niceness(stepped) == {mine}
    options = {"host_nice": 0}  # chunk hosts again, told not to lower their priority
    quiet = make_sampler(
        "process", "CartPole-v1", n_workers=2, n_processes=2, backend_options=options
    )
    await quiet.obtain_samples(20)
    assert quiet.inference.mode == "host"
    assert niceness(quiet) == {mine}
    with pytest.raises(TypeError, match=r"host_nice must be an int >= 0 or None, got float 2.5"):
        ProcessBackend(host_nice=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"host_nice must be from 0 to 19, got 20"):
        ProcessBackend(host_nice=20)


@pytest.mark.both_loops
@pytest.mark.parametrize("kind", ["raise", "cancel", "hang", "reward", "info"])
async def test_a_fault_is_the_envs_own(make_sampler: Any, backend: str, kind: str) -> None:
    """Env 17 of the one worker's 50 misbehaves once; only its episode is lost, it alone is
    rebuilt, and every other env's episodes come out whole."""
    n = 50
    sampler = make_sampler(
        backend,
        faulty("asyncio", kind, 17, n),
        n_workers=1,
        envs_per_worker=n,
        n_processes=1,
        seed=0,
        step_timeout=0.5 if kind == "hang" else None,
    )
    batch = await sampler.obtain_exact_episodes(3 * n)
    assert sampler.restarts == 1
    assert len(batch.lengths) == 3 * n
    assert (np.bincount(batch.episode_infos["env"], minlength=n) == 3).all()  # 3 from each env
    assert (batch.lengths == 10).all()  # whole episodes only: the one cut short is dropped
    for episode in batch.split():
        np.testing.assert_array_equal(episode.observations[:, 0], np.arange(10))
        assert episode.step_types[0] == StepType.FIRST
        assert episode.step_types[-1] == StepType.TERMINAL


async def test_past_max_restarts_the_call_names_the_env(make_sampler: Any, backend: str) -> None:
    sampler = make_sampler(
        backend,
        functools.partial(FaultyAsyncEnv, "raise"),  # every env raises on its third step
        n_workers=1,
        envs_per_worker=4,
        n_processes=1,
        max_restarts=2,
    )
    with pytest.raises(WorkerError, match=r"worker 0, env \d.*FaultyAsyncEnv raised") as info:
        await sampler.obtain_exact_episodes(20)
    assert info.value.env is not None
    assert sampler.restarts == 2 * 4  # each env spent its own budget of 2


class SignallingEnv(RandomLengthAsyncEnv):
    """Episodes of 5-15 steps of 2 ms; once ``where/armed`` exists, its next step creates
    ``where/stepping``: a sign, seen from any process, that a call (the one after the arming) is
    stepping envs."""

    def __init__(self, where: str) -> None:
        super().__init__(5, 15, 0.002)
        self.armed, self.stepping = os.path.join(where, "armed"), os.path.join(where, "stepping")

    async def step(self, action: Any) -> Any:
        if os.path.exists(self.armed) and not os.path.exists(self.stepping):
            touch(self.stepping)
        return await super().step(action)


async def _mid_call(tmp_path: Any, call: Any) -> asyncio.Future[Any]:
    """Start ``call`` (a coroutine) and return its task once it steps envs (by its steps'
    sign, not a guess of how long it takes to start)."""
    touch(tmp_path / "armed")
    task = asyncio.ensure_future(call)
    await wait_until((tmp_path / "stepping").exists, "a step of the call")
    assert not task.done()  # a call of hundreds of steps of 2 ms: mid-call
    return task


@pytest.mark.parametrize("mode", ["episodes", "fragments"])
async def test_a_killed_host_loses_only_its_envs_episodes(
    make_sampler: Any, backend: str, mode: str, tmp_path: Any
) -> None:
    sampler = make_sampler(
        backend,
        functools.partial(SignallingEnv, str(tmp_path)),
        n_workers=2,
        envs_per_worker=8,
        n_processes=2,
        seed=0,
    )
    await sampler.obtain_samples(50)
    hosts = sampler._core.backend
    if mode == "fragments":  # without fixed shares: the quota counts what the restart left
        call = await _mid_call(tmp_path, sampler.obtain_fragments(1_500))
    else:
        call = await _mid_call(tmp_path, sampler.obtain_exact_episodes(80))
    if backend == "process":
        victim = hosts.pids[0]  # type: ignore[union-attr]
        os.kill(victim, signal.SIGKILL)
    else:
        import ray

        victim = hosts.actors[0]  # type: ignore[union-attr]
        ray.kill(victim, no_restart=True)
    batch = await call
    assert sampler.restarts >= 1
    live = hosts.pids if backend == "process" else hosts.actors  # type: ignore[union-attr]
    assert victim not in live
    if mode == "fragments":
        assert batch.n_transitions >= 1_500
        for piece in batch.split():  # every piece's steps in order, none lost in between
            assert (np.diff(piece.observations[:, 0]) == 1).all()
        return
    assert len(batch.lengths) == 2 * 80  # per worker
    for episode in batch.split():
        np.testing.assert_array_equal(
            episode.observations[:, 0], np.arange(len(episode.step_types))
        )
        assert episode.step_types[-1] == StepType.TERMINAL


class HungCloseAsyncEnv(CountingAsyncEnv):
    """The first of these envs (in any process) to reach its 3rd step raises there; in an env
    host its ``close()`` hangs (cancellably) and leaves files in ``where``: ``started-*`` as it
    begins, ``given-up-*`` when cancelled, ``ended-*`` if it ever returns (the probe env, in
    the caller, closes at once)."""

    def __init__(self, where: str, caller: int) -> None:
        super().__init__(10)
        self.where, self.caller = where, caller

    async def step(self, action: Any) -> Any:
        if self.logic.steps_taken == 2 and first_to_claim(os.path.join(self.where, "fault")):
            raise RuntimeError("HungCloseAsyncEnv raised")
        return await super().step(action)

    async def close(self) -> None:
        if os.getpid() == self.caller:
            return await super().close()
        name = f"{os.getpid()}-{id(self)}"
        touch(os.path.join(self.where, f"started-{name}"))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            touch(os.path.join(self.where, f"given-up-{name}"))
            raise
        touch(os.path.join(self.where, f"ended-{name}"))


async def test_a_hung_close_is_bounded_by_close_timeout(
    make_sampler: Any, backend: str, tmp_path: Any
) -> None:
    """Async envs in the hosts: the env rebuilt after its fault is closed in the background
    while the call goes on, and its hung close is given up at close_timeout; aclose() returns
    with every close still hung, and leaves no host (make_sampler's check) or actor behind."""
    sampler = make_sampler(
        backend,
        functools.partial(HungCloseAsyncEnv, str(tmp_path), os.getpid()),
        n_workers=1,
        envs_per_worker=4,
        n_processes=1,
        close_timeout=0.5,
        seed=0,
    )
    batch = await sampler.obtain_exact_episodes(12)
    assert sampler.restarts == 1 and len(batch.lengths) == 12
    await wait_until(lambda: len(list(tmp_path.glob("given-up-*"))) == 1, "a close given up")
    assert len(list(tmp_path.glob("started-*"))) == 1  # the replaced env's, no other yet
    await sampler.aclose()
    assert len(list(tmp_path.glob("started-*"))) == 1 + 4  # every env's close was asked for
    assert not list(tmp_path.glob("ended-*"))  # and none of them returned


async def test_max_concurrency_is_split_over_the_hosts(make_sampler: Any, backend: str) -> None:
    """Each env reports how many steps of its host process were in flight at once."""
    assert shares(7, [8, 8]) == [4, 3] or shares(7, [8, 8]) == [3, 4]
    assert sum(shares(10, [3, 5, 8])) == 10
    with pytest.raises(
        ValueError, match="max_concurrency must be at least the number of env hosts"
    ):
        shares(1, [4, 4])

    sampler = make_sampler(
        backend,
        PeakEnv,
        n_workers=2,
        envs_per_worker=16,
        n_processes=2,
        max_concurrency=6,
    )
    batch = await sampler.obtain_samples(2000)
    peaks = batch.env_infos["peak"]
    assert peaks.max() <= 3  # each host's share of 6
    assert peaks.max() == 3  # and the share is used


class PeakEnv(CountingAsyncEnv):
    """Counts the steps in flight in its process (a class attribute: one count per host)."""

    running = 0
    peak = 0

    def __init__(self) -> None:
        super().__init__(10, 0.002)

    async def step(self, action: Any) -> Any:
        cls = type(self)
        cls.running += 1
        cls.peak = max(cls.peak, cls.running)
        try:
            obs, reward, terminated, truncated, _info = await super().step(action)
        finally:
            cls.running -= 1
        return obs, reward, terminated, truncated, {"peak": cls.peak}


async def test_a_stream_with_updates(make_sampler: Any, backend: str) -> None:
    sampler = make_sampler(
        backend, random_length(3, 8, 0.001), n_workers=2, envs_per_worker=4, n_processes=2
    )
    seen = []
    async with contextlib.aclosing(sampler.stream(50, max_policy_lag=1)) as stream:
        async for batch in stream:
            seen.append(batch)
            await sampler.update_agent(ThresholdAgent())  # a new agent object: version + 1
            if len(seen) == 3:
                break
    assert all(b.n_transitions >= 50 for b in seen)
    versions = np.concatenate([b.episode_infos["agent_version"] for b in seen])
    assert versions.max() >= 1
    # max_policy_lag=1: no episode of the last batch started two versions back
    assert seen[-1].episode_infos["agent_version"].min() >= versions.max() - 2
    after = await sampler.obtain_exact_episodes(4, env_update=random_length(2, 2, None))
    assert (after.lengths == 2).all()


class PidAgent:
    """Deterministic (:class:`ThresholdAgent`'s rule), async or not, with its process id, its
    parameter and its rows per call in the agent infos; ``fail``: raises on its call."""

    def __init__(self, awaits: bool = False, fail: bool = False) -> None:
        self.awaits, self.fail, self.param = awaits, fail, 0
        self.resets = 0

    def set_param_values(self, params: Any) -> None:
        self.param = int(params)

    def reset(self, mask: np.ndarray) -> None:
        self.resets += int(mask.sum())

    def _output(self, observations: Any) -> tuple[np.ndarray, dict[str, Any]]:
        if self.fail:
            raise ArithmeticError("the agent's own error")
        obs = np.asarray(observations)
        n = len(obs)
        infos = {
            "pid": np.full(n, os.getpid()),
            "param": np.full(n, self.param),
            "rows": np.full(n, n),
            "resets": np.full(n, self.resets),
        }
        return (obs[..., 1] > 0.5).astype(np.int64), infos

    def get_actions(self, observations: Any) -> Any:
        if not self.awaits:
            return self._output(observations)

        async def later() -> tuple[np.ndarray, dict[str, Any]]:
            await asyncio.sleep(0.001)  # an agent behind a service
            return self._output(observations)

        return later()


@pytest.mark.parametrize("awaits", [False, True])
async def test_inference_host_runs_the_agent_in_the_hosts(
    make_sampler: Any, backend: str, awaits: bool
) -> None:
    """The hosts' agent copies act (their pid), merged over the envs ready in a pass (rows per
    call above one), reset with their envs; async agents are awaited there; parameter updates
    and a new agent reach them, and each step records the version it ran under."""
    sampler = make_sampler(
        backend,
        random_length(3, 8, 0.002),
        PidAgent(awaits),
        n_workers=2,
        envs_per_worker=8,
        n_processes=2,
        inference="host",
    )
    batch = await sampler.obtain_exact_episodes(8)
    pids = set(batch.agent_infos["pid"].tolist())
    assert os.getpid() not in pids and len(pids) == 2
    if backend == "process":
        assert pids <= set(sampler._core.backend.pids)  # type: ignore[union-attr]
    assert batch.agent_infos["rows"].max() > 1
    assert (batch.agent_infos["resets"] >= 1).all()  # the copy saw its env's reset first
    assert (batch.agent_infos["param"] == 0).all()
    assert (batch.agent_versions == 0).all()
    after = await sampler.obtain_exact_episodes(4, agent_update=np.array(7))
    assert (after.agent_infos["param"] == 7).all()
    assert (after.agent_versions == 1).all()
    fresh = await sampler.obtain_exact_episodes(4, agent_update=PidAgent(awaits))
    assert (fresh.agent_infos["param"] == 0).all()
    assert (fresh.agent_versions == 2).all()


class TreeActionEnv(CountingAsyncEnv):
    """Actions of a Dict space (a tree of rows): the reward reads both parts."""

    def __init__(self) -> None:
        super().__init__(6)
        self.action_space = gym.spaces.Dict(
            {"a": gym.spaces.Discrete(3), "b": gym.spaces.Box(-1.0, 1.0, (2,), np.float32)}
        )

    async def step(self, action: Any) -> Any:
        obs, _reward, terminated, truncated, info = await super().step(0)
        return obs, float(action["a"]) + float(np.sum(action["b"])), terminated, truncated, info


class TreeAgent:
    def get_actions(self, observations: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        obs = np.asarray(observations)
        a = (obs[:, 0] % 3).astype(np.int64)
        b = np.stack([obs[:, 0] / 10, -obs[:, 0] / 20], axis=1).astype(np.float32)
        return {"a": a, "b": b}, {"mark": obs[:, 0] * 2}


async def test_inference_host_with_tree_actions_equals_the_asyncio_backend(
    make_sampler: Any,
) -> None:
    """Actions of a Dict space chosen in the hosts reach the batch as the caller's agent's do
    (written into the shared step buffers by the host, read there)."""
    out = {}
    for name, inference in (("asyncio", "per_worker"), ("process", "host")):
        sampler = make_sampler(
            name, TreeActionEnv, TreeAgent(), n_workers=2, envs_per_worker=3, seed=1,
            inference=inference,
        )  # fmt: skip
        out[name] = await sampler.obtain_exact_episodes(4)
        await sampler.aclose()
    a, p = out["asyncio"], out["process"]
    assert p.n_transitions == a.n_transitions > 0
    for key in ("a", "b"):
        np.testing.assert_array_equal(a.actions[key], p.actions[key])
    np.testing.assert_array_equal(a.rewards, p.rewards)
    np.testing.assert_array_equal(a.agent_infos["mark"], p.agent_infos["mark"])
    assert p.actions["b"].dtype == np.float32 and (p.actions["b"] != 0).any()


async def test_inference_host_agent_error_fails_the_call(make_sampler: Any) -> None:
    """An error of the hosts' agent copy is the call's, named, not an env's fault: no env is
    rebuilt for it, and the sampler stays usable."""
    sampler = make_sampler(
        "process",
        random_length(3, 8, None),
        PidAgent(fail=True),
        n_workers=1,
        envs_per_worker=4,
        inference="host",
    )
    with pytest.raises(ArithmeticError, match="the agent's own error") as info:
        await sampler.obtain_samples(20)
    assert any("worker 0" in note for note in getattr(info.value, "__notes__", ()))
    assert sampler.restarts == 0
    batch = await sampler.obtain_samples(20, agent_update=PidAgent())
    assert batch.n_transitions >= 20


async def test_inference_host_agent_reinstalled_in_a_restarted_host(
    make_sampler: Any, tmp_path: Any
) -> None:
    """A killed host's envs are rebuilt in its successor, and so is the agent copy, mid-call."""
    sampler = make_sampler(
        "process",
        functools.partial(SignallingEnv, str(tmp_path)),
        PidAgent(),
        n_workers=2,
        envs_per_worker=8,
        n_processes=2,
        seed=0,
        inference="host",
    )
    await sampler.obtain_samples(50)
    hosts = sampler._core.backend
    call = await _mid_call(tmp_path, sampler.obtain_exact_episodes(40))
    before = set(hosts.pids)  # type: ignore[union-attr]
    victim = hosts.pids[0]  # type: ignore[union-attr]
    os.kill(victim, signal.SIGKILL)
    batch = await call
    assert sampler.restarts >= 1
    successors = set(hosts.pids) - before  # type: ignore[union-attr]
    assert successors and successors & set(batch.agent_infos["pid"].tolist())  # its copy acted
    assert len(batch.lengths) == 2 * 40
    for episode in batch.split():
        np.testing.assert_array_equal(
            episode.observations[:, 0], np.arange(len(episode.step_types))
        )


async def test_inference_host_refuses_an_async_agent_over_blocking_envs() -> None:
    """A factory may build either kind: with blocking envs after all, ``host`` runs chunks in
    hosts without an event loop, so an async agent (and ``episode_timeout``) is refused then."""

    class AsyncAgent:
        async def get_actions(self, observations: Any) -> Any:
            return np.zeros(len(observations), dtype=np.int64), {}

    with pytest.raises(ValueError, match="inference='host' cannot run an async agent"):
        await asyncio.to_thread(
            Sampler,
            functools.partial(gym.make, "CartPole-v1"),
            AsyncAgent(),
            backend="process",
            inference="host",
        )
    sampler = Sampler(
        functools.partial(gym.make, "CartPole-v1"),
        backend="process",
        inference="host",
        episode_timeout=1.0,
    )
    with pytest.raises(ValueError, match="episode_timeout needs inference='per_worker'"):
        await sampler.start()
    await sampler.aclose()


async def test_blocking_envs_still_take_the_lockstep_path(make_sampler: Any) -> None:
    sampler = make_sampler("process", "CartPole-v1", n_workers=2, n_processes=2)
    assert not sampler._core.lanes
    batch = await sampler.obtain_samples(100)
    assert batch.n_transitions >= 100


async def test_spaces_read_from_the_probe_env() -> None:
    sampler = Sampler(CountingAsyncEnv, backend="process")
    assert sampler.env_spec.action_space == gym.spaces.Discrete(2)
    assert sampler._core.lanes and sampler._core.hosted_lanes
    await sampler.aclose()


async def test_metrics_of_async_envs_in_process_hosts(make_sampler: Any) -> None:
    """Env steps are counted exactly; the hosts' step latencies (sampled at their pace, weighted)
    reach the caller through the shared clock."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    sampler = make_sampler(
        "process", random_length(5, 10, 0.001), n_workers=2, envs_per_worker=4, metrics=registry
    )
    await sampler.obtain_exact_episodes(5)
    steps = sum(
        registry.get_sample_value(
            "asyncsample_env_steps_total", {"backend": "process", "worker": w}
        )
        or 0.0
        for w in ("0", "1")
    )
    timed = registry.get_sample_value("asyncsample_env_step_seconds_count", {"backend": "process"})
    assert steps >= 2 * 5 * 5  # at least the batch's steps
    # 1-ms steps, 4 overlapping per host: timed nearly all (a gap of a few steps), each standing
    # for the steps since the last; the steps cut at the end were timed too
    assert timed is not None and steps / 2 <= timed <= steps + 8 * 8


async def test_metrics_of_the_agent_copies_in_the_hosts(make_sampler: Any, backend: str) -> None:
    """inference="host": the hosts' agent calls reach the caller, counted exactly with the rows
    of each (the envs ready in a pass: a row per step acted on), their seconds sampled."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    sampler = make_sampler(
        backend,
        random_length(5, 10, 0.001),
        PidAgent(),
        n_workers=2,
        envs_per_worker=8,
        inference="host",
        metrics=registry,
    )
    await sampler.obtain_exact_episodes(5)

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"backend": backend, **labels}) or 0.0

    steps = sum(value("asyncsample_env_steps_total", worker=w) for w in ("0", "1"))
    calls = value("asyncsample_agent_calls_total")
    rows = value("asyncsample_agent_call_rows_sum")
    assert value("asyncsample_agent_call_rows_count") == calls
    assert steps <= rows <= steps + 2 * 8  # a row per step, and the steps cut at the call's end
    assert 0 < calls < rows  # merged: calls of several rows
    timed = value("asyncsample_agent_call_seconds_count")
    assert 0 < timed <= calls  # the calls up to the last timed one, weighted


async def test_metrics_of_async_envs_in_ray_hosts(make_sampler: Any, ray_cluster: Any) -> None:
    """As on process: the actors' sampled step latencies reach the caller, with the replies."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    sampler = make_sampler(
        "ray", random_length(5, 10, 0.001), n_workers=2, envs_per_worker=4, metrics=registry
    )
    await sampler.obtain_exact_episodes(5)
    steps = sum(
        registry.get_sample_value("asyncsample_env_steps_total", {"backend": "ray", "worker": w})
        or 0.0
        for w in ("0", "1")
    )
    timed = registry.get_sample_value("asyncsample_env_step_seconds_count", {"backend": "ray"})
    total = registry.get_sample_value("asyncsample_env_step_seconds_sum", {"backend": "ray"})
    assert steps >= 2 * 5 * 5  # at least the batch's steps
    # 1-ms steps, 4 overlapping per host: timed nearly all (a gap of a few steps), each standing
    # for the steps since the last; the steps cut at the end were timed too
    assert timed is not None and steps / 2 <= timed <= steps + 8 * 8
    assert total is not None and total > 0
