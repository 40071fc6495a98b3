"""The ``ray`` backend on a local Ray cluster shared by the whole module.

The sampler suite (tests/test_sampler.py) covers the sampler's behaviour on every backend; this
module covers what is specific to Ray: identical batches to ``local``, env exceptions, actors that
die or hang, cancellation, clean shutdown with no actor left, an existing cluster left running,
and the error when ray is not installed.
"""

from __future__ import annotations

import asyncio
import functools
import os
import pickle
import subprocess
import sys
import textwrap
import time
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from envs import (
    SCRIPT,
    AlwaysFailingEnv,
    FailingEnv,
    GridWorldEnv,
    NoisyEnv,
    ScriptedAgent,
    SignallingAgent,
)
from helpers import SamplerFactory, wait_until

from asyncsample import (
    EpisodeBatch,
    Sampler,
    SamplerClosedError,
    StepTimeoutError,
    StepType,
    WorkerCrashedError,
    WorkerError,
)
from asyncsample.backends import HostSpec, make_backend
from asyncsample.backends import ray as ray_backend
from asyncsample.backends._ray_actor import EnvActor, _Packed, best_codec, copy_into, encode_request
from asyncsample.backends._remote import slots_blob
from asyncsample.backends._transport import Op
from asyncsample.backends.ray import INSTALL_HINT, RayBackend, RayHost
from asyncsample.env_group import StepBuffers
from asyncsample.env_update import make_env
from asyncsample.seeding import worker_seeds

try:
    import ray
except ImportError as exc:  # pragma: no cover - CI installs ray with the test extra
    raise ImportError(
        f"tests/test_ray_backend.py needs ray: {INSTALL_HINT} (the test extra includes it)"
    ) from exc

pytestmark = [pytest.mark.timeout(120), pytest.mark.sampler_defaults(backend="ray")]

# Envs defined here reach the actors by value, like those of tests/envs.py.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class KillOnceEnv(NoisyEnv):
    """SIGKILLs its own process (the actor) at its ``kill_at``-th step, once across all copies."""

    def __init__(self, flag: str, kill_at: int = 10) -> None:
        super().__init__()
        self.flag = flag
        self.kill_at = kill_at
        self.steps = 0

    def step(self, action: Any):
        self.steps += 1
        if self.steps == self.kill_at and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            os.kill(os.getpid(), 9)
        return super().step(action)


class HangOnceEnv(NoisyEnv):
    """Hangs (blocking sleep) at its ``hang_at``-th step, once across all copies."""

    def __init__(self, flag: str, hang_at: int = 5) -> None:
        super().__init__()
        self.flag = flag
        self.hang_at = hang_at
        self.steps = 0

    def step(self, action: Any):
        self.steps += 1
        if self.steps == self.hang_at and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            time.sleep(600)
        return super().step(action)


class DictEnv(NoisyEnv):
    """Dict observations with an 84x84x4 image leaf, and Dict actions (nested buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_space = gym.spaces.Dict(
            {
                "image": gym.spaces.Box(0, 255, (84, 84, 4), np.uint8),
                "state": gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
            }
        )
        self.action_space = gym.spaces.Dict(
            {"move": gym.spaces.Discrete(3), "force": gym.spaces.Box(-1.0, 1.0, (2,), np.float32)}
        )

    def _obs(self, state: np.ndarray) -> dict[str, np.ndarray]:
        image = np.full((84, 84, 4), int(self.t) % 256, np.uint8)
        return {"image": image, "state": state}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        state, info = super().reset(seed=seed, options=options)
        return self._obs(state), info

    def step(self, action: Any):
        state, r, term, trunc, info = super().step(action["move"])
        return self._obs(state), r + float(action["force"][0]), term, trunc, info


@pytest.fixture
def cluster(ray_cluster: Any) -> Any:
    """The session's local Ray cluster (the one Ray fixture, in tests/conftest.py)."""
    return ray_cluster


def alive_actors() -> list[str]:
    """Ids of actors that are not dead, from the GCS (the state API needs the dashboard)."""
    from ray._private import state

    return [aid for aid, info in state.actors().items() if info["State"] != "DEAD"]


async def start_hosts(
    env: Any, n_workers: int = 2, n_envs: int = 2, seed: int = 0, **options: Any
) -> tuple[RayBackend, list[RayHost]]:
    """A started RayBackend with the envs of every worker built."""
    probe = make_env(env)
    specs = [
        HostSpec(w, n_envs, probe.observation_space, probe.action_space, None)
        for w in range(n_workers)
    ]
    probe.close()
    backend = RayBackend(**options)
    hosts: list[Any] = await backend.start(specs)
    _, seeds = worker_seeds(seed, n_workers, n_envs)
    await asyncio.gather(
        *(h.build([[env]] * n_envs, s.next_env_seeds()) for h, s in zip(hosts, seeds))
    )
    return backend, hosts


async def step_all(host: RayHost) -> None:
    mask = np.ones(len(host.buffers.rewards), dtype=bool)
    await host.reset(mask)
    host.buffers.actions[:] = 1
    await host.step(mask)


# -- ray missing ------------------------------------------------------------------------------


def test_import_asyncsample_never_imports_ray() -> None:
    code = "import sys, asyncsample, asyncsample.backends; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_ray_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # "import ray" now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'asyncsample\[ray\]'"):
        RayBackend()
    with pytest.raises(ImportError, match=r"pip install 'asyncsample\[ray\]'"):
        make_backend("ray", n_processes=2)


def test_option_errors() -> None:
    with pytest.raises(ValueError, match="placement_strategy must be one of"):
        RayBackend(placement_strategy="EVERYWHERE")
    with pytest.raises(ValueError, match="bundle cannot be empty"):
        RayBackend(placement_strategy="PACK", num_cpus=0)
    with pytest.raises(ValueError, match="num_gpus must be >= 0"):
        RayBackend(num_gpus=-1)
    with pytest.raises(TypeError, match="workers_per_actor must be an int"):
        RayBackend(workers_per_actor=1.5)
    with pytest.raises(TypeError, match="resources must be a dict"):
        RayBackend(resources=["sim"])
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'num_cpu'.*num_cpus"):
        RayBackend(num_cpu=2)
    with pytest.raises(TypeError, match="'num_cpu'"):
        make_backend("ray", num_cpu=2)


# -- same results as local --------------------------------------------------------------------


async def _four_calls(sampler: Sampler) -> list[EpisodeBatch]:
    async with sampler as s:
        return [
            await s.obtain_samples(300),
            await s.obtain_exact_episodes(2),
            await s.obtain_fragments(100),
            await s.obtain_fragments(100),
        ]


async def test_identical_batches_to_local(cluster: Any, make_sampler: SamplerFactory) -> None:
    kw: dict[str, Any] = {"n_workers": 3, "envs_per_worker": 2, "seed": 7}
    local = await _four_calls(make_sampler(env="CartPole-v1", backend="local", **kw))
    remote = await _four_calls(make_sampler(env="CartPole-v1", **kw))
    assert all(a.equals(b) for a, b in zip(local, remote))
    # Dict observations and actions, env and reset infos; replies large enough to travel as
    # arrays through the object store; one worker per actor, in a placement group.
    kw = {"n_workers": 2, "envs_per_worker": 4, "seed": 3, "max_episode_length": 20}
    local = await _four_calls(make_sampler(env=DictEnv, backend="local", **kw))
    options = {"placement_strategy": "PACK", "workers_per_actor": 1}
    remote = await _four_calls(make_sampler(env=DictEnv, backend_options=options, **kw))
    assert all(a.equals(b) for a, b in zip(local, remote))
    assert "t" in remote[0].env_infos and "start" in remote[0].episode_infos
    assert alive_actors() == []
    groups = ray.util.placement_group_table().values()
    assert groups and all(g["state"] == "REMOVED" for g in groups)
    assert ray.is_initialized()  # a cluster the sampler did not start is left running


def test_actor_encodings_and_compression_in_process() -> None:
    """The actor class without Ray: raw and pickled actions, plain and compressed replies."""
    probe = DictEnv()
    slots = slots_blob([HostSpec(0, 4, probe.observation_space, probe.action_space, 20)])
    plain = EnvActor(slots, None, "zlib")
    packed = EnvActor(slots, 1000, best_codec())
    blob = cloudpickle.dumps(([[DictEnv]] * 4, [1, 2, 3, 4]))
    mask = np.ones(4, dtype=bool)
    actions = {"force": np.full((4, 2), 0.5, np.float32), "move": np.array([0, 1, 2, 1])}
    replies = []
    for actor in (plain, packed):
        assert pickle.loads(actor.serve(0, Op.BUILD, blob)) == (0, b"")
        reset = actor.reset(encode_request(0, mask))
        assert isinstance(reset, tuple) == (actor is plain)  # large replies stay arrays
        for _ in range(30):
            step = actor.step(encode_request(0, mask, actions))
        replies.append((reset, step))
    (_, step_a), (reset_b, step_b) = replies
    for codec in {"zlib", best_codec()}:
        frame = np.arange(4 * 84 * 84 * 4).reshape(4, 84, 84, 4).astype(np.uint8)
        assert np.array_equal(_Packed.pack(frame, codec).unpack(), frame)
    noise = np.random.default_rng(0).integers(0, 256, (4, 84, 84, 4), dtype=np.uint8)
    assert packed._pack(0, "obs", {"image": noise})["image"] is noise  # does not pay: raw
    assert packed.skip[(0, "obs", 0)] > 0  # and not tried again for a while
    # Object arrays (Text, Graph... spaces) are pickled rather than sent as raw bytes.
    objects = {"force": actions["force"], "move": actions["move"].astype(object)}
    assert encode_request(0, mask, objects)[4] == 2 and encode_request(0, mask, actions)[4] == 1
    again = EnvActor(slots, None, "zlib")
    again.serve(0, Op.BUILD, blob)
    again.reset(encode_request(0, mask))
    for _ in range(30):
        step_c = again.step(encode_request(0, mask, objects))
    assert np.array_equal(step_c[1][0]["image"], step_a[1][0]["image"])
    assert np.array_equal(step_c[1][1], step_a[1][1])
    obs_b = pickle.loads(reset_b)[1][0]["image"]
    assert obs_b.codec == best_codec() and len(obs_b.data) < obs_b.unpack().nbytes / 10
    a, b = step_a[1], pickle.loads(step_b)[1]
    out = StepBuffers.allocate(probe.observation_space, probe.action_space, 4)
    copy_into(out.obs, b[0])
    assert np.array_equal(out.obs["image"], a[0]["image"])
    assert np.array_equal(a[1], b[1]) and a[6] == b[6]


# -- failures ---------------------------------------------------------------------------------


async def test_env_exception_is_a_worker_error_and_only_its_slot_is_rebuilt(cluster: Any) -> None:
    backend, hosts = await start_hosts(AlwaysFailingEnv, n_workers=2, n_processes=1)
    try:
        actor = hosts[0].actor
        assert hosts[1].actor == actor  # two workers, one actor
        with pytest.raises(WorkerError, match=r"worker 1, env 0: ValueError") as info:
            await step_all(hosts[1])
        assert not isinstance(info.value, WorkerCrashedError)
        assert isinstance(info.value.__cause__, ValueError)
        assert "this env always fails" in str(info.value)
        # What the project writes, whatever cloudpickle keeps of a by-value env's file name
        # (3.1.3 on: "<dynamic-code>"): the env's own frame and exception in the traceback.
        remote = info.value.remote_traceback or ""
        assert "Remote traceback" in str(info.value) and remote.rstrip() in str(info.value)
        assert "in step" in remote and "ValueError: this env always fails" in remote
        assert (info.value.worker, info.value.env) == (1, 0)
        await hosts[1].restart([[NoisyEnv]] * 2, [1, 2])
        assert hosts[1].actor == actor  # the actor was alive: not replaced
        await step_all(hosts[1])
    finally:
        await backend.aclose()
    await backend.aclose()  # idempotent
    assert alive_actors() == []


async def test_env_exception_restart_still_meets_quota(
    cluster: Any, tmp_path: Any, make_sampler: SamplerFactory
) -> None:
    env = functools.partial(FailingEnv, str(tmp_path / "failed"), 3, "step")
    async with make_sampler(env=env, n_workers=2, envs_per_worker=2, seed=0) as s:
        batch = await s.obtain_samples(200)
        assert s.restarts == 1
    workers = batch.episode_infos["worker"]
    for w in range(2):
        assert batch.lengths[workers == w].sum() >= 100
    assert alive_actors() == []


async def test_killed_actor_fails_its_workers_and_is_recreated_once(cluster: Any) -> None:
    backend, hosts = await start_hosts(NoisyEnv, n_workers=2, n_processes=1)
    try:
        old = hosts[0].actor
        await asyncio.gather(*(step_all(h) for h in hosts))
        ray.kill(old)
        # ray.kill returns before the actor is gone: a step sent meanwhile may still be served.
        dead = old._actor_id.hex()
        await wait_until(lambda: dead not in alive_actors(), "the killed actor to be dead")
        results = await asyncio.gather(*(step_all(h) for h in hosts), return_exceptions=True)
        assert all(isinstance(r, WorkerCrashedError) for r in results), results
        assert "died" in str(results[0])
        await asyncio.gather(*(h.restart([[NoisyEnv]] * 2, [5, 6]) for h in hosts))
        assert hosts[0].actor == hosts[1].actor != old
        assert len(backend._members[0].incarnations) == 2  # recreated once for both workers
        await asyncio.gather(*(step_all(h) for h in hosts))
    finally:
        await backend.aclose()
    assert alive_actors() == []


async def test_actor_death_mid_run_is_restarted_and_quota_met(
    cluster: Any, tmp_path: Any, make_sampler: SamplerFactory
) -> None:
    env = functools.partial(KillOnceEnv, str(tmp_path / "killed"), 10)
    async with make_sampler(
        env=env, n_workers=2, n_processes=1, seed=1, max_episode_length=30
    ) as s:
        batch = await s.obtain_samples(400)
        assert s.restarts == 2  # both workers lived on the killed actor
        assert len(s._backend._members[0].incarnations) == 2  # type: ignore[union-attr]
    workers = batch.episode_infos["worker"]
    for w in range(2):
        assert batch.lengths[workers == w].sum() >= 200
    for ep in batch.split():
        assert StepType(ep.step_types[-1]) in (StepType.TERMINAL, StepType.TIMEOUT)
    assert alive_actors() == []


async def test_step_timeout_kills_the_actor_then_restart_recovers(
    cluster: Any, tmp_path: Any, make_sampler: SamplerFactory
) -> None:
    env = functools.partial(HangOnceEnv, str(tmp_path / "hung"), 5)
    # step_timeout well above a loaded machine's actor start and env build, far below the hang
    async with make_sampler(env=env, n_workers=1, step_timeout=5.0, max_restarts=0, seed=2) as s:
        start = time.monotonic()
        with pytest.raises(StepTimeoutError, match=r"worker 0.*step_timeout=5s") as info:
            await s.obtain_samples(50)
        assert time.monotonic() - start < 60  # by step_timeout, not the env's 600 s hang
        assert isinstance(info.value, TimeoutError)
        assert s._backend.actors == []  # type: ignore[union-attr]  # killed, not recreated yet
        batch = await s.obtain_samples(50)  # the next call restarts the host
        assert batch.lengths.sum() >= 50
        assert len(s._backend.actors) == 1  # type: ignore[union-attr]
    assert alive_actors() == []


async def test_cancelled_call_leaks_nothing(cluster: Any, make_sampler: SamplerFactory) -> None:
    grid = functools.partial(GridWorldEnv, "4x4")
    async with make_sampler(env=grid, agent=ScriptedAgent(), n_workers=2, envs_per_worker=2) as s:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await s.obtain_samples(10**9)
        batch = await s.obtain_samples(30)
    for ep in batch.split():
        assert ep.observations.tolist() == [0, 1, 2, 6, 10, 14]
        assert ep.actions.tolist() == [SCRIPT[o] for o in [0, 1, 2, 6, 10, 14]]
        assert StepType(ep.step_types[0]) == StepType.FIRST
    assert alive_actors() == []


async def test_actors_that_cannot_be_scheduled_warn_then_fail_after_start_timeout(
    cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ray_backend, "PENDING_WARNING", 0.2)
    with (
        pytest.warns(RuntimeWarning, match=r"waited 0.2s to be scheduled.*asks for CPU=1, sim=1"),
        pytest.raises(WorkerCrashedError, match=r"not scheduled within start_timeout.*sim=1"),
    ):
        await start_hosts(NoisyEnv, resources={"sim": 1}, start_timeout=1.0)
    assert alive_actors() == []


# -- cluster ownership ------------------------------------------------------------------------


def test_cluster_ownership(cluster: Any, tmp_path: Any) -> None:
    """In a fresh interpreter: a cluster given by address is left running; one the backend
    started itself is shut down by ``aclose``."""
    script = tmp_path / "ownership.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, sys
            import asyncsample
            assert "ray" not in sys.modules

            async def sample(**options):
                s = asyncsample.Sampler(
                    "CartPole-v1", n_workers=2, seed=0, backend="ray", backend_options=options
                )
                async with s:
                    batch = await s.obtain_samples(50)
                    assert batch.lengths.sum() >= 50
                    return s._backend.started_ray

            async def main():
                import ray
                assert not await sample(address=sys.argv[1])
                assert ray.is_initialized()  # not shut down: the sampler did not start it
                ray.shutdown()  # disconnects this driver only
                assert await sample(init_kwargs={"log_to_driver": False})
                assert not ray.is_initialized()  # started by the sampler, shut down by it
                print("OK")

            asyncio.run(main())
            """
        )
    )
    address = ray.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, str(script), address],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr
    assert ray.get(ray.put(1)) == 1  # the module's cluster is still up
    assert alive_actors() == []  # the other driver's actors on it are gone


# -- closing, host extensions -----------------------------------------------------------------


@pytest.mark.slow
async def test_call_in_flight_when_closed_raises_sampler_closed(
    cluster: Any, make_sampler: SamplerFactory
) -> None:
    agent = SignallingAgent(after=3)
    sampler = make_sampler(env=NoisyEnv, agent=agent, n_workers=2, envs_per_worker=2, seed=0)
    await sampler.start()
    task = asyncio.ensure_future(sampler.obtain_samples(10**6))
    await agent.event.wait()
    await sampler.aclose()
    with pytest.raises(SamplerClosedError):
        await task
    assert alive_actors() == []


class _AttrEnv(NoisyEnv):
    label = "plain"

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        obs, info = super().reset(seed=seed, options=options)
        return obs, {**info, "seed": seed, "options": options}

    def scaled(self, x: float, *, factor: float = 1.0) -> float:
        return x * factor


async def test_reset_seeds_options_call_and_set_attr(cluster: Any) -> None:
    backend, hosts = await start_hosts(_AttrEnv, n_workers=1, n_envs=2, n_processes=1)
    (host,) = hosts
    try:
        infos = await host.reset(np.ones(2, bool), seeds=[5, None], options={"a": 1})
        assert [(infos[i]["seed"], infos[i]["options"]) for i in range(2)] == [
            (5, {"a": 1}),
            (None, {"a": 1}),
        ]
        assert await host.call("scaled", (2.0,), {"factor": 3.0}) == [6.0, 6.0]
        await host.set_attr("label", ["x"], envs=[1])
        assert await host.call("label") == ["plain", "x"]
        with pytest.raises(WorkerError) as info:
            await host.call("missing", envs=[1])
        assert (info.value.env, info.value.retry) == (1, False)
    finally:
        await backend.aclose()
    assert alive_actors() == []


class _ThreadsEnv(_AttrEnv):
    def threads(self) -> tuple[str | None, int]:
        import torch  # imported here, after the actor set its thread variables

        return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


@pytest.mark.parametrize("threads", [1, 2])
async def test_actors_run_host_threads_threads(cluster: Any, threads: int) -> None:
    backend, (host,) = await start_hosts(
        _ThreadsEnv, n_workers=1, n_envs=1, n_processes=1, host_threads=threads
    )
    try:
        assert await host.call("threads") == [(str(threads), threads)]
    finally:
        await backend.aclose()
    assert alive_actors() == []
