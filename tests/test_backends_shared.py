"""What every backend does alike: options, close_now, SamplerClosedError, logging, and the
host extensions the vector-env faces build on (reset seeds/options, call, set_attr).

Every async test runs under asyncio and uvloop (see conftest.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from envs import NoisyEnv, SignallingAgent
from test_process_backend import leaves_nothing

from asyncsample import Sampler, SamplerClosedError, StepTimeoutError, WorkerCrashedError
from asyncsample.backends import (
    GivenActionsHost,
    LockstepHost,
    RestartBudget,
    check_options,
    make_backend,
    traits,
)
from asyncsample.backends.base import EnvHost, HostSpec
from asyncsample.backends.local import LocalBackend
from asyncsample.backends.placement import placement, pool_size
from asyncsample.backends.process import ProcessBackend
from asyncsample.errors import WorkerError

pytestmark = pytest.mark.timeout(90)

# Envs defined here reach the env hosts by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

BACKENDS = ["local", "process"]


class RecordingEnv(gym.Env):  # type: ignore[type-arg]
    """Reports the seed and options of its last reset; has attributes and methods to call."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float64)
    action_space = gym.spaces.Discrete(2)
    render_mode = "rgb_array"

    def __init__(self) -> None:
        self.label = "plain"
        self.resets = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self.resets += 1
        obs = self.np_random.uniform(-1, 1, 2)
        return obs, {"seed": seed, "options": options}

    def step(self, action: Any) -> Any:
        self.last_action = action
        return self.np_random.uniform(-1, 1, 2), 1.0, False, False, {}

    def scaled(self, x: float, *, factor: float = 1.0) -> float:
        return x * factor + self.resets

    def explode(self) -> None:
        raise RuntimeError(f"explode called on {self.label}")

    def lock(self) -> Any:
        return threading.Lock()  # cannot be pickled

    def render(self) -> Any:
        return np.full((2, 2, 3), self.resets, np.uint8)


def host_spec(n_envs: int = 3, worker: int = 0, env: type[gym.Env] = RecordingEnv) -> HostSpec:  # type: ignore[type-arg]
    probe = env()
    return HostSpec(worker, n_envs, probe.observation_space, probe.action_space, None)


@asynccontextmanager
async def hosts_on(
    backend_name: str, specs: list[HostSpec], **options: Any
) -> AsyncIterator[tuple[Any, list[EnvHost]]]:
    backend = make_backend(backend_name, **options)
    try:
        yield backend, await backend.start(specs)
    finally:
        await backend.aclose()


# -- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
def test_unknown_options_are_named_with_the_valid_ones(name: str) -> None:
    with pytest.raises(TypeError) as info:
        make_backend(name, n_process=2)
    text = str(info.value)
    assert "'n_process'" in text and "n_processes" in text and "step_timeout" in text
    cls = LocalBackend if name == "local" else ProcessBackend
    with pytest.raises(TypeError, match="'colour'"):
        cls(colour="red")


@pytest.mark.parametrize("name", [*BACKENDS, "ray"])
def test_check_options_before_any_work(name: str) -> None:
    check_options(name, {"n_processes": 2, "step_timeout": None})
    with pytest.raises(TypeError, match=r"'n_process'.*valid options: n_processes"):
        check_options(name, {"n_process": 2})


def test_ray_options_are_known_without_importing_ray() -> None:
    code = (
        "import sys; from asyncsample.backends import backend_options; "
        "assert 'num_cpus' in backend_options('ray'); assert 'ray' not in sys.modules"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env)


def test_local_refuses_step_timeout() -> None:
    with pytest.raises(ValueError, match="step_timeout"):
        LocalBackend(step_timeout=1.0)
    LocalBackend(n_processes=3)  # accepted: the sampler passes it to every backend


def test_pool_layout_helpers() -> None:
    specs = [host_spec(1, worker=w) for w in range(5)]
    where = placement(5, 2)
    layout = where.split(specs)
    assert [[s.worker for s in m] for m in layout] == [[0, 2, 4], [1, 3]]
    assert [where.member(w) for w in range(5)] == [0, 1, 0, 1, 0]
    assert [where.slot(w) for w in range(5)] == [0, 0, 1, 1, 2]
    assert list(where.workers(1)) == [1, 3]
    assert pool_size(8, 3) == 3 and pool_size(2, 5) == 2
    assert pool_size(None, 1) == 1
    assert pool_size(8, 5, workers_per_actor=2) == 3  # Ray's option wins over n_processes
    assert placement(5, None, 2).n_members == 3


# -- close_now ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
async def test_close_now_releases_everything_and_later_calls_say_closed(name: str) -> None:
    async with leaves_nothing():
        backend = make_backend(name, n_processes=2)
        hosts = await backend.start([host_spec(2, worker=w) for w in range(2)])
        for host in hosts:
            await host.build([[RecordingEnv]] * 2, [1, 2])
            await host.reset(np.ones(2, bool))
        backend.close_now()
        backend.close_now()  # idempotent
        with pytest.raises(SamplerClosedError):
            await hosts[0].step(np.ones(2, bool))
        with pytest.raises(SamplerClosedError):
            await hosts[1].restart([[RecordingEnv]] * 2, [3, 4])
        await backend.aclose()  # still fine afterwards


# -- a call in flight when the sampler is closed ------------------------------------------------


class SlowEnv(NoisyEnv):
    def step(self, action: Any) -> Any:
        time.sleep(0.02)
        return super().step(action)


@pytest.mark.parametrize("name", BACKENDS)
async def test_call_in_flight_when_closed_raises_sampler_closed(name: str) -> None:
    async with leaves_nothing():
        agent = SignallingAgent(after=3)
        sampler = Sampler(SlowEnv, agent, n_workers=2, envs_per_worker=2, backend=name, seed=0)
        await sampler.start()
        task = asyncio.ensure_future(sampler.obtain_samples(10**6))
        await agent.event.wait()  # sampling is under way: steps are in flight
        await sampler.aclose()
        with pytest.raises(SamplerClosedError):
            await task
        with pytest.raises(SamplerClosedError):
            await sampler.obtain_samples(10)


async def test_process_step_in_flight_when_backend_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncsample.backends.process as process_module

    monkeypatch.setattr(process_module, "EXIT_GRACE", 0.5)
    async with leaves_nothing():
        backend = ProcessBackend(n_processes=1)
        (host,) = await backend.start([host_spec(1, env=NoisyEnv)])
        await host.build([[SlowHangEnv]], [1])
        await host.reset(np.ones(1, bool))
        step = asyncio.ensure_future(host.step(np.ones(1, bool)))
        await asyncio.sleep(0)  # sent
        await backend.aclose()
        with pytest.raises(SamplerClosedError, match="worker 0 could not finish its step"):
            await step


# -- logging --------------------------------------------------------------------------------------


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "asyncsample" and r.levelno == logging.WARNING
    ]


async def test_host_death_and_restart_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncsample")
    async with leaves_nothing(), hosts_on("process", [host_spec(1)]) as (_, (host,)):
        await host.build([[RecordingEnv]], [1])
        pid = host.pid  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashedError):
            await host.call("resets")  # waits on the dead host, or finds it dead
        died = [m for m in _warnings(caplog) if f"env-host process {pid}" in m and "SIGKILL" in m]
        assert died, _warnings(caplog)
        await host.restart([[RecordingEnv]], [2])
        new_pid = host.pid  # type: ignore[attr-defined]
        assert new_pid != pid
        restarted = [m for m in _warnings(caplog) if "restarted as" in m]
        assert restarted and str(new_pid) in restarted[0] and "workers 0" in restarted[0]


async def test_step_timeout_kill_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncsample")
    async with (
        leaves_nothing(),
        hosts_on("process", [host_spec(1, env=NoisyEnv)], step_timeout=1.5) as (_, (host,)),
    ):
        await host.build([[lambda: SlowHangEnv()]], [1])
        await host.reset(np.ones(1, bool))
        with pytest.raises(StepTimeoutError):
            await host.step(np.ones(1, bool))
        killed = [m for m in _warnings(caplog) if "took longer than step_timeout=1.5s" in m]
        assert killed and "was killed" in killed[0] and "step of worker 0" in killed[0]


class SlowHangEnv(NoisyEnv):
    def step(self, action: Any) -> Any:
        time.sleep(60)
        return super().step(action)


@pytest.mark.parametrize("name", BACKENDS)
async def test_rebuilding_envs_after_an_env_error_is_logged(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asyncsample")
    async with hosts_on(name, [host_spec(1)]) as (_, (host,)):
        await host.build([[RecordingEnv]], [1])
        await host.restart([[RecordingEnv]], [2])
        # Info level: the sampler's own warning for the restart already names worker and cause.
        rebuilt = [r for r in caplog.records if "worker 0: rebuilding its envs" in r.getMessage()]
        assert rebuilt and all(r.levelno == logging.INFO for r in rebuilt)


# -- reset with seeds and options -----------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
async def test_reset_seeds_and_options(name: str) -> None:
    n = 3
    async with hosts_on(name, [host_spec(n)]) as (_, (host,)):
        await host.build([[RecordingEnv]] * n, [11, 12, 13])
        everyone = np.ones(n, bool)
        # Default arguments: the pending build seeds, no options (today's behaviour).
        infos = await host.reset(everyone)
        assert [infos[i]["seed"] for i in range(n)] == [11, 12, 13]
        assert all(infos[i]["options"] is None for i in range(n))
        first_obs = host.buffers.obs.copy()
        # The pending seeds are spent: later default resets get none.
        infos = await host.reset(everyone)
        assert [infos[i]["seed"] for i in range(n)] == [None] * n
        # Explicit seeds for this reset: same seed, same first observation.
        infos = await host.reset(everyone, seeds=[11, None, 13])
        assert [infos[i]["seed"] for i in range(n)] == [11, None, 13]
        np.testing.assert_array_equal(host.buffers.obs[[0, 2]], first_obs[[0, 2]])
        # One options dict for every env, or one per env; seeds and options on a subset.
        infos = await host.reset(everyone, options={"level": 2})
        assert [infos[i]["options"] for i in range(n)] == [{"level": 2}] * n
        assert [infos[i]["seed"] for i in range(n)] == [None] * n
        mask = np.array([False, True, True])
        infos = await host.reset(mask, seeds=[0, 7, np.int64(8)], options=[None, {"a": 1}, None])
        assert sorted(infos) == [1, 2]
        assert (infos[1]["seed"], infos[1]["options"]) == (7, {"a": 1})
        assert (infos[2]["seed"], infos[2]["options"]) == (8, None)


@pytest.mark.parametrize("name", BACKENDS)
async def test_explicit_seed_replaces_the_pending_build_seed(name: str) -> None:
    async with hosts_on(name, [host_spec(2)]) as (_, (host,)):
        await host.build([[RecordingEnv]] * 2, [11, 12])
        infos = await host.reset(np.ones(2, bool), seeds=[5, None])
        assert (infos[0]["seed"], infos[1]["seed"]) == (5, None)
        infos = await host.reset(np.ones(2, bool))  # the build seeds were dropped, not kept
        assert (infos[0]["seed"], infos[1]["seed"]) == (None, None)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seeds": [1, 2]}, ValueError, "one seed per env"),
        ({"seeds": [1, 2, -3]}, ValueError, r"seeds\[2\]"),
        ({"seeds": [1, 2, 1.5]}, TypeError, r"seeds\[2\]"),
        ({"seeds": 7}, TypeError, "seeds must be"),
        ({"options": "fast"}, TypeError, "options must be"),
        ({"options": [{}, {}]}, ValueError, "one per env"),
        ({"options": [{}, {}, 3]}, TypeError, r"options\[2\]"),
    ],
)
@pytest.mark.parametrize("name", BACKENDS)
async def test_reset_argument_errors(
    name: str, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    async with hosts_on(name, [host_spec(3)]) as (_, (host,)):
        await host.build([[RecordingEnv]] * 3, [1, 2, 3])
        with pytest.raises(error, match=match):
            await host.reset(np.ones(3, bool), **kwargs)
        infos = await host.reset(np.ones(3, bool))  # nothing was sent: still pending seeds
        assert [infos[i]["seed"] for i in range(3)] == [1, 2, 3]


# -- call and set_attr ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
async def test_call_get_and_set_attributes(name: str) -> None:
    async with hosts_on(name, [host_spec(3)]) as (_, (host,)):
        await host.build([[RecordingEnv]] * 3, [1, 2, 3])
        await host.reset(np.ones(3, bool))
        # Attributes that are not callable come back as values (get_attr).
        assert await host.call("label") == ["plain"] * 3
        assert await host.call("render_mode", envs=[1]) == ["rgb_array"]
        # Methods are called with args and kwargs, per env.
        assert await host.call("scaled", (2.0,), {"factor": 3.0}) == [7.0] * 3
        await host.set_attr("label", ["a", "b"], envs=[0, 2])
        assert await host.call("label") == ["a", "plain", "b"]
        await host.set_attr("resets", [10, 20, 30])
        assert await host.call("scaled", (0.0,), envs=[2, 0]) == [30.0, 10.0]
        frames = await host.call("render")
        assert [f.shape for f in frames] == [(2, 2, 3)] * 3
        assert [int(f[0, 0, 0]) for f in frames] == [10, 20, 30]


@pytest.mark.parametrize("name", BACKENDS)
async def test_call_failures_name_the_env(name: str) -> None:
    async with hosts_on(name, [host_spec(3, worker=4)]) as (_, (host,)):
        await host.build([[RecordingEnv]] * 3, [1, 2, 3])
        await host.reset(np.ones(3, bool))
        with pytest.raises(WorkerError) as info:
            await host.call("no_such_thing", envs=[2])
        err = info.value
        assert (err.worker, err.env, err.retry) == (4, 2, False)
        assert isinstance(err.__cause__, AttributeError) and "no_such_thing" in str(err)
        await host.set_attr("label", ["one"], envs=[1])
        with pytest.raises(WorkerError) as info:
            await host.call("explode", envs=[0, 1])
        err = info.value
        assert (err.worker, err.env, err.retry) == (4, 0, True)
        assert isinstance(err.__cause__, RuntimeError) and "explode called on plain" in str(err)
        with pytest.raises(ValueError, match="out of range"):
            await host.call("label", envs=[3])
        with pytest.raises(ValueError, match="one value per env"):
            await host.set_attr("label", ["x"], envs=[0, 1])
        # The host is still usable after every one of these.
        assert await host.call("label") == ["plain", "one", "plain"]


async def test_call_result_that_cannot_be_pickled_is_not_retried() -> None:
    async with hosts_on("process", [host_spec(1)]) as (_, (host,)):
        await host.build([[RecordingEnv]], [1])
        with pytest.raises(WorkerError) as info:
            await host.call("lock")
        assert not info.value.retry and "lock" in str(info.value)
        assert await host.call("label") == ["plain"]


async def test_call_arguments_that_cannot_be_pickled_are_a_type_error() -> None:
    async with hosts_on("process", [host_spec(1)]) as (_, (host,)):
        await host.build([[RecordingEnv]], [1])
        with pytest.raises(TypeError, match="cannot be pickled"):
            await host.call("scaled", (threading.Lock(),))
        assert await host.call("label") == ["plain"]


@pytest.mark.parametrize("name", BACKENDS)
async def test_call_and_reset_agree_across_backends(name: str) -> None:
    """The same operations give the same observations on every backend."""
    results = {}
    for backend in ("local", name):
        async with hosts_on(backend, [host_spec(2)]) as (_, (host,)):
            await host.build([[RecordingEnv]] * 2, [4, 5])
            await host.reset(np.ones(2, bool), seeds=[21, 22], options={"x": 1})
            host.buffers.actions[:] = 1
            await host.step(np.ones(2, bool))
            results[backend] = (host.buffers.obs.copy(), await host.call("resets"))
    np.testing.assert_array_equal(results["local"][0], results[name][0])
    assert results["local"][1] == results[name][1] == [1, 1]


# -- host_threads ---------------------------------------------------------------------------------


class ThreadsEnv(RecordingEnv):
    """Reports the threads of the numeric libraries in the process that hosts it."""

    def threads(self) -> dict[str, Any]:
        import torch  # imported here, after the host set its thread variables

        from asyncsample.backends._threads import openblas_threads

        return {
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "torch": torch.get_num_threads(),
            "openblas": openblas_threads(),
        }


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.slow  # starts hosts that import torch: seconds each
async def test_process_hosts_run_host_threads_threads(threads: int) -> None:
    async with hosts_on("process", [host_spec(1, env=ThreadsEnv)], host_threads=threads) as (
        _,
        (host,),
    ):
        await host.build([[ThreadsEnv]], [1])
        (report,) = await host.call("threads")
    assert report["omp"] == str(threads) and report["torch"] == threads
    assert set(report["openblas"]) <= {threads}  # numpy's, loaded before the host started


@pytest.mark.slow  # starts hosts that import torch: seconds each
async def test_process_hosts_default_to_one_thread_and_none_leaves_the_defaults() -> None:
    async with hosts_on("process", [host_spec(1, env=ThreadsEnv)]) as (_, (host,)):
        await host.build([[ThreadsEnv]], [1])
        (report,) = await host.call("threads")
    assert report["omp"] == "1" and report["torch"] == 1
    async with hosts_on("process", [host_spec(1, env=ThreadsEnv)], host_threads=None) as (
        _,
        (host,),
    ):
        await host.build([[ThreadsEnv]], [1])
        (report,) = await host.call("threads")
    assert report["omp"] == os.environ.get("OMP_NUM_THREADS")  # the caller's, untouched


class TorchThreadsAgent:
    """A host-mode agent that reports torch's thread count in the host with each action."""

    def get_actions(self, observations: Any) -> Any:
        import torch

        n = len(observations)
        return np.zeros(n, np.int64), {"threads": np.full(n, torch.get_num_threads())}


def test_host_threads_is_checked_everywhere() -> None:
    for make in (
        lambda **kw: Sampler(RecordingEnv, backend="local", **kw),
        lambda **kw: make_backend("process", **kw),
        lambda **kw: make_backend("local", **kw),
    ):
        with pytest.raises(ValueError, match=r"host_threads must be >= 1, got 0"):
            make(host_threads=0)
        with pytest.raises(TypeError, match=r"host_threads must be an int >= 1 or None"):
            make(host_threads=1.5)


@pytest.mark.slow  # starts hosts that import torch: seconds each
async def test_sampler_passes_host_threads_to_the_hosts_and_the_agent_copy() -> None:
    async with Sampler(
        ThreadsEnv,
        TorchThreadsAgent(),
        n_workers=2,
        backend="process",
        inference="host",
        host_threads=2,
        seed=0,
        max_episode_length=5,
    ) as sampler:
        batch = await sampler.obtain_samples(20)
    assert set(batch.agent_infos["threads"].tolist()) == {2}


# -- the host's side: one slot object, operations as an enum --------------------------------------


def test_operations_are_an_int_enum_with_labels() -> None:
    from asyncsample.backends._transport import HEADER, Op

    assert HEADER.unpack(HEADER.pack(0, 7, Op.CHUNK))[2] == Op.CHUNK == 12
    assert Op(1) is Op.STEP and Op.AGENT.label == "agent install"
    assert Op.PARAMS.label == "parameter update" and Op.SET_ATTR.label == "set_attr"


def test_host_slot_serves_every_operation_from_bytes() -> None:
    from asyncsample.backends._slot import HostSlot
    from asyncsample.backends._transport import Op
    from asyncsample.env_group import EnvFailureError

    slot = HostSlot.allocate(host_spec(2))
    all_envs = np.ones(2, np.bool_).tobytes()
    assert slot.serve(Op.BUILD, cloudpickle.dumps(([[RecordingEnv]] * 2, [1, 2]))) == b""
    infos = pickle.loads(slot.serve(Op.RESET, all_envs))
    assert infos[0]["seed"] == 1 and infos[1]["seed"] == 2
    slot.group.buffers.actions[:] = 1
    assert slot.serve(Op.STEP, all_envs) == b""  # nothing to say: an empty reply
    args = cloudpickle.dumps(("scaled", [2.0], {"factor": 3.0}, [1]))
    assert pickle.loads(slot.serve(Op.CALL, args)) == [7.0]
    with pytest.raises(ValueError, match="unknown request opcode 99"):
        slot.serve(99, b"")
    with pytest.raises(RuntimeError, match="not started for inference='host'"):
        slot.serve(Op.AGENT, b"")
    with pytest.raises(EnvFailureError) as info:
        slot.serve(Op.UPDATE, b"not a pickle")
    failure = info.value.failure
    assert not failure.retry and "env update could not be unpickled" in str(failure.error)
    assert slot.serve(Op.CLOSE, b"") == b""


@pytest.mark.parametrize("name", BACKENDS)
async def test_loop_free_lockstep_is_a_capability_of_the_host(name: str) -> None:
    async with hosts_on(name, [host_spec(1)]) as (_, (host,)):
        assert isinstance(host, LockstepHost) == traits(name).lockstep
        if not traits(name).lockstep:
            assert not hasattr(host, "step_nowait")  # no stub: the capability is absent
            return
        reader = host.direct_reader()
        assert reader is not None and reader.fd >= 0 and callable(reader.read_now)
        await host.build([[RecordingEnv]], [0])
        host.buffers.rewards[:] = 0.0
        sent = host.step_nowait()
        assert sent is not None
        assert (await sent.wait()).reset_infos == {} and host.buffers.rewards[0] == 1.0
        assert isinstance(host, GivenActionsHost)  # actions as given, not cast into the buffer
        host.give_actions([1.25])
        sent = host.step_nowait()
        assert sent is not None and (await sent.wait()).reset_infos == {}
        assert await host.call("last_action") == [1.25]
        host.buffers.actions[:] = 1
        sent = host.step_nowait()  # the buffers again: the given actions went with their step
        assert sent is not None and (await sent.wait()).reset_infos == {}
        assert await host.call("last_action") == [1]


async def test_the_restart_budget_retries_within_its_limit_and_only_what_may_be_retried() -> None:
    a, b, c = (WorkerError(x, worker=0) for x in "abc")
    not_retried = WorkerError("d", worker=0, retry=False)
    seen: list[WorkerError | None] = []

    def failing(*errors: WorkerError) -> Any:
        pending = list(errors)

        async def attempt(failure: WorkerError | None) -> str:
            seen.append(failure)  # None first, then the failure it restarts after
            if pending:
                raise pending.pop(0)
            return "done"

        return attempt

    budget = RestartBudget(2)
    failures: list[WorkerError] = []
    assert await budget.run(failing(a, b), lambda exc: exc.retry, failures.append) == "done"
    assert budget.used == 2 and seen == [None, a, b] and failures == [a, b]
    with pytest.raises(WorkerError) as info:  # the budget is spent: raised, not retried
        await budget.run(failing(c), lambda exc: exc.retry)
    assert info.value is c and budget.used == 2
    fresh = RestartBudget(5)
    with pytest.raises(WorkerError) as info:  # not retryable: raised at once
        await fresh.run(failing(not_retried), lambda exc: exc.retry)
    assert info.value is not_retried and fresh.used == 0
