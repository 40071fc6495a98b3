"""The ``process`` backend on its own: same data as ``local``, faults, cancellation, clean exits.

Every async test runs under asyncio and uvloop (see conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector.utils import concatenate
from helpers import alive, leaves_nothing, touch, wait_gone, wait_until, wait_until_blocking

from asyncsample._tree import tree_leaves
from asyncsample.backends.base import HostSpec
from asyncsample.backends.local import LocalHost
from asyncsample.backends.process import ProcessBackend, ProcessHost
from asyncsample.env_group import EnvFailureError, EnvGroup, StepBuffers
from asyncsample.errors import (
    SamplerClosedError,
    StepTimeoutError,
    WorkerCrashedError,
    WorkerError,
)

pytestmark = pytest.mark.timeout(60)

MAX_LEN = 6  # the hosts' max_episode_length: some episodes of the test envs are truncated by it


# -- tiny deterministic envs ------------------------------------------------------------------


def _action_sum(action: Any) -> float:
    if isinstance(action, dict):
        return sum(_action_sum(v) for v in action.values())
    if isinstance(action, tuple):
        return sum(_action_sum(v) for v in action)
    return float(np.sum(np.asarray(action, dtype=np.float64)))


class KaboomError(Exception):
    """What a faulty env raises."""


class _CountingEnv(gym.Env):
    """Deterministic given its seed: episode length and start drawn from ``np_random`` at reset.

    Episodes of odd length terminate, of even length are truncated by the env itself, and the
    longer ones are cut by the host's ``max_episode_length``. Every third step has an info.

    Args:
        fail_at: raise :class:`KaboomError` on this step of the first episode.
        delay: seconds each step sleeps.
        children: start this many ``sleep`` processes (as a simulator would) at construction.
        stepping: a flag file created when a step begins, so a test can wait until the env is
            in its (slow) step.
        stepped: a flag file created when a step is done.
    """

    def __init__(
        self,
        fail_at: int | None = None,
        delay: float = 0.0,
        children: int = 0,
        stepping: str | None = None,
        stepped: str | None = None,
    ) -> None:
        self.fail_at = fail_at
        self.delay = delay
        self.stepping = stepping
        self.stepped = stepped
        self.procs = [subprocess.Popen(["sleep", "120"]) for _ in range(children)]
        self.steps = 0
        self.t = 0
        self.x = 0.0
        self.horizon = 1

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self.t = 0
        self.horizon = int(self.np_random.integers(2, 10))
        self.x = float(self.np_random.uniform(-1, 1))
        return self._obs(), {"x0": self.x, "pids": [p.pid for p in self.procs]}

    def step(self, action: Any) -> Any:
        self.steps += 1
        if self.stepping is not None:
            touch(self.stepping)
        if self.fail_at is not None and self.steps == self.fail_at:
            raise KaboomError(f"kaboom at step {self.steps}")
        if self.delay:
            time.sleep(self.delay)
        self.t += 1
        self.x += 0.1 * _action_sum(action) + 0.01 * self.t
        end = self.t >= self.horizon
        info = {"t": self.t, "x": self.x} if self.t % 3 == 0 else {}
        if self.stepped is not None:
            touch(self.stepped)
        return (
            self._obs(),
            self.x,
            end and self.horizon % 2 == 1,
            end and self.horizon % 2 == 0,
            info,
        )

    def _obs(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []


class BoxEnv(_CountingEnv):
    observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    action_space = gym.spaces.Box(-1, 1, (2,), np.float32)

    def _obs(self) -> Any:
        return np.array([self.x, self.t, self.horizon], np.float32)


class DiscreteEnv(_CountingEnv):
    observation_space = gym.spaces.Discrete(50)
    action_space = gym.spaces.Discrete(3)

    def _obs(self) -> Any:
        return int(abs(self.x) * 10 + self.t) % 50


class DictEnv(_CountingEnv):
    observation_space = gym.spaces.Dict(
        {
            "pos": gym.spaces.Box(-np.inf, np.inf, (2,), np.float64),
            "bits": gym.spaces.MultiBinary(3),
            "cell": gym.spaces.Discrete(7),
        }
    )
    action_space = gym.spaces.MultiDiscrete([3, 2])

    def _obs(self) -> Any:
        bits = np.array([self.t % 2, (self.t // 2) % 2, 1], np.int8)
        return {"pos": np.array([self.x, -self.x]), "bits": bits, "cell": self.t % 7}


class TupleEnv(_CountingEnv):
    observation_space = gym.spaces.Tuple(
        (gym.spaces.Box(-np.inf, np.inf, (2, 2), np.float32), gym.spaces.Discrete(5))
    )
    action_space = gym.spaces.Dict(
        {"a": gym.spaces.Discrete(2), "b": gym.spaces.Box(-1, 1, (1,), np.float64)}
    )

    def _obs(self) -> Any:
        return (np.array([[self.x, self.t], [0.0, 1.0]], np.float32), self.t % 5)


ENVS = {"box": BoxEnv, "discrete": DiscreteEnv, "dict": DictEnv, "tuple": TupleEnv}


def spec(env_cls: type[gym.Env] = BoxEnv, n_envs: int = 3, worker: int = 0) -> HostSpec:
    return HostSpec(worker, n_envs, env_cls.observation_space, env_cls.action_space, MAX_LEN)


# -- helpers ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def started(
    specs: list[HostSpec], **options: Any
) -> AsyncIterator[tuple[ProcessBackend, list[ProcessHost]]]:
    backend = ProcessBackend(**options)
    try:
        hosts = await backend.start(specs)
        assert all(isinstance(h, ProcessHost) for h in hosts)
        yield backend, hosts  # type: ignore[misc]
    finally:
        await backend.aclose()


def write_actions(space: gym.Space, actions: list[Any], *buffers: Any) -> None:
    for buf in buffers:
        concatenate(space, actions, buf.actions)


def assert_same_buffers(a: Any, b: Any, where: str) -> None:
    for name in ("obs", "final_obs", "actions", "rewards", "terminated", "truncated"):
        for x, y in zip(tree_leaves(getattr(a, name)), tree_leaves(getattr(b, name))):
            np.testing.assert_array_equal(x, y, err_msg=f"{name} differs {where}")


def closure_factory(env_cls: type[gym.Env]) -> Callable[[], gym.Env]:
    def factory() -> gym.Env:
        return env_cls()

    return factory


# -- same data as local ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(ENVS))
async def test_matches_local_host(kind: str) -> None:
    env_cls = ENVS[kind]
    n = 3
    s = spec(env_cls, n)
    local = LocalHost(s)
    rng = np.random.default_rng(7)
    act_space = env_cls.action_space
    act_space.seed(11)
    chains = [[env_cls]] * n
    seeds = [101, 102, 103]
    async with (
        leaves_nothing(),
        started([s, spec(env_cls, 2, worker=1)], n_processes=1) as (
            _,
            (host, other),
        ),
    ):
        assert host.buffers.obs is not local.buffers.obs
        buffers = host.buffers
        await local.build(chains, seeds)
        await host.build(chains, seeds)
        await other.build([[env_cls]] * 2, [5, 6])  # a neighbour in the same process
        mask = np.ones(n, bool)
        assert await host.reset(mask) == await local.reset(mask)
        assert_same_buffers(host.buffers, local.buffers, "after reset")
        ends = 0
        for t in range(80):
            if t == 40:
                # An update built from a closure (cloudpickled) replaces env 1.
                updates = [None, closure_factory(env_cls), None]
                await local.update(updates, [0, 201, 0])
                await host.update(updates, [0, 201, 0])
                reset_mask = np.array([False, True, False])
                assert await host.reset(reset_mask) == await local.reset(reset_mask)
            step_mask = rng.random(n) < 0.8
            write_actions(
                act_space, [act_space.sample() for _ in range(n)], host.buffers, local.buffers
            )
            got = await host.step(step_mask)
            want = await local.step(step_mask)
            assert got == want, f"infos differ at step {t}"
            assert_same_buffers(host.buffers, local.buffers, f"at step {t}")
            other.buffers.actions[...] = 0
            await other.step(np.ones(2, bool))
            ends += int(np.sum(host.buffers.terminated | host.buffers.truncated))
        assert host.buffers is buffers
        assert ends > 10  # autoresets (and max_episode_length truncations) did happen
    await local.close()


async def test_empty_mask_and_int_mask() -> None:
    async with started([spec(BoxEnv, 2)]) as (_, (host,)):
        await host.build([[BoxEnv]] * 2, [1, 2])
        await host.reset(np.ones(2, bool))
        before = host.buffers.obs.copy()
        infos = await host.step(np.zeros(2, bool))
        assert infos.env_infos is None and infos.reset_infos == {}
        np.testing.assert_array_equal(host.buffers.obs, before)
        await host.step(np.array([0, 1]))  # any array that converts to bool works
        assert host.buffers.obs[1, 1] == 1 and host.buffers.obs[0, 1] == 0


# -- env errors ------------------------------------------------------------------------------


async def test_env_error_is_worker_error_then_restart() -> None:
    chains = [[BoxEnv], [lambda: BoxEnv(fail_at=3)]]
    async with leaves_nothing(), started([spec(BoxEnv, 2, worker=4)]) as (_, (host,)):
        await host.build(chains, [1, 2])
        await host.reset(np.ones(2, bool))
        pid = host.pid
        with pytest.raises(WorkerError) as info:
            for _ in range(5):
                await host.step(np.ones(2, bool))
        err = info.value
        assert type(err) is WorkerError
        assert err.worker == 4 and err.env == 1 and err.retry
        assert isinstance(err.__cause__, KaboomError)
        assert "kaboom at step 3" in str(err)
        assert "Remote traceback" in str(err) and "in step" in str(err)
        assert "KaboomError" in (err.remote_traceback or "")
        # The process is alive: restart rebuilds this worker's envs in place.
        await host.restart([[BoxEnv], [BoxEnv]], [3, 4])
        assert host.pid == pid
        await host.reset(np.ones(2, bool))
        for _ in range(5):
            await host.step(np.ones(2, bool))


class _WrongShape(BoxEnv):
    def _obs(self) -> Any:
        return np.zeros(5, np.float32)


async def test_observation_that_does_not_fit_is_not_retried() -> None:
    async with started([spec(BoxEnv, 2, worker=3)]) as (_, (host,)):
        await host.build([[BoxEnv], [_WrongShape]], [1, 2])
        with pytest.raises(WorkerError) as info:
            await host.reset(np.ones(2, bool))
        err = info.value
        assert err.worker == 3 and err.env == 1 and not err.retry
        assert isinstance(err.__cause__, ValueError) and "observation" in str(err)


class _GoesBadAtStep3(BoxEnv):
    def _obs(self) -> Any:
        return np.zeros(5 if self.steps >= 3 else 3, np.float32)


class _TrackedObs(BoxEnv):
    """Remembers a weak reference to every observation it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[np.ndarray]] = []

    def _obs(self) -> Any:
        obs = super()._obs()
        self.refs.append(weakref.ref(obs))
        return obs


def test_env_group_keeps_no_copy_of_stored_observations() -> None:
    """An observation written into its buffer row is not also kept by the group (an image env
    would otherwise hold every env's observation twice in its host)."""
    space, act = BoxEnv.observation_space, BoxEnv.action_space
    group = EnvGroup(0, StepBuffers.allocate(space, act, 2), space, act, 4)
    group.build([[_TrackedObs], [_TrackedObs]], [1, 2])
    try:
        group.reset(np.ones(2, bool))
        for _ in range(6):  # episodes end within these steps: final observations too
            group.step(np.ones(2, bool))
        gc.collect()
        refs = [ref for env in group.envs for ref in env.unwrapped.refs]  # type: ignore[union-attr]
        assert len(refs) >= 14
        assert all(ref() is None for ref in refs)
        assert group.buffers.obs.shape == (2, 3)
    finally:
        group.close()


def test_finish_writes_a_run_step_observation_into_the_run_block() -> None:
    """``EnvGroup.finish`` with ``out`` (a host's run of steps): the observation goes to
    ``out[row]`` and not to the buffers' row (written once, as the run ends); one without the
    row's shape (a list) is converted as the buffers' row takes it, and copied there."""
    space, act = BoxEnv.observation_space, BoxEnv.action_space
    group = EnvGroup(0, StepBuffers.allocate(space, act, 2), space, act, 4)
    block = np.zeros((3, 3), space.dtype)
    obs = np.array([0.25, 0.5, 0.75], space.dtype)
    assert group.finish(1, (obs, 1.0, False, False, {}), block, 1) == (1.0, False, False, {})
    np.testing.assert_array_equal(block[1], obs)
    assert not block[0].any() and not block[2].any()
    assert not group.buffers.obs.any()  # the buffers' rows untouched
    group.finish(1, ([0.5, 0.5, 0.5], 0.0, False, False, {}), block, 2)
    np.testing.assert_array_equal(block[2], [0.5, 0.5, 0.5])
    with pytest.raises(EnvFailureError, match="shape"):  # still checked: a wrong shape
        group.finish(0, (np.zeros(5, space.dtype), 0.0, False, False, {}), block, 0)
    assert group.finish(1, (obs, 1.0, False, False, {}))[0] == 1.0  # no block: the buffers'
    np.testing.assert_array_equal(group.buffers.obs[1], obs)


async def test_observation_that_stops_fitting_names_its_env() -> None:
    """The host keeps no copy of observations stored in their buffer rows; a later misfit is
    still reported with its own env index (not one of the envs that fit)."""
    async with started([spec(BoxEnv, 3, worker=2)]) as (_, (host,)):
        await host.build([[BoxEnv], [_GoesBadAtStep3], [BoxEnv]], [1, 2, 3])
        await host.reset(np.ones(3, bool))
        with pytest.raises(WorkerError) as info:
            for _ in range(5):
                await host.step(np.ones(3, bool))
        err = info.value
        assert err.worker == 2 and err.env == 1 and not err.retry
        assert "env 1" in str(err) and "(5,)" in str(err)


class _Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


class _RaisesUnpicklable(BoxEnv):
    def step(self, action: Any) -> Any:
        raise _Unpicklable()


async def test_unpicklable_exception_becomes_runtime_error() -> None:
    async with started([spec(BoxEnv, 1)]) as (_, (host,)):
        await host.build([[_RaisesUnpicklable]], [1])
        await host.reset(np.ones(1, bool))
        with pytest.raises(WorkerError) as info:
            await host.step(np.ones(1, bool))
        assert isinstance(info.value.__cause__, RuntimeError)
        assert "_Unpicklable" in str(info.value) and "could not be pickled" in str(info.value)


async def test_factory_that_cannot_be_pickled_is_a_type_error() -> None:
    lock = threading.Lock()
    async with started([spec(BoxEnv, 1)]) as (_, (host,)):
        with pytest.raises(TypeError, match="cannot be pickled"):
            await host.build([[lambda: (lock, BoxEnv())[1]]], [1])
        await host.build([[BoxEnv]], [1])  # nothing was sent: the host is fine


# -- crashes, timeouts -----------------------------------------------------------------------


async def test_sigkill_mid_step_is_noticed_at_once_then_restart(tmp_path: Path) -> None:
    specs = [spec(BoxEnv, 1, worker=0), spec(BoxEnv, 1, worker=1)]
    stepping = str(tmp_path / "stepping")
    async with leaves_nothing(), started(specs, n_processes=1) as (backend, (slow, neighbour)):
        await slow.build([[lambda: BoxEnv(delay=30, stepping=stepping)]], [1])
        await neighbour.build([[BoxEnv]], [2])
        await slow.reset(np.ones(1, bool))
        await neighbour.reset(np.ones(1, bool))
        pid = slow.pid
        buffers = slow.buffers
        assert pid is not None and neighbour.pid == pid and backend.pids == [pid]
        task = asyncio.ensure_future(slow.step(np.ones(1, bool)))
        await wait_until(lambda: os.path.exists(stepping), "the env to be in its 30 s step")
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashedError) as info:
            await task
        # Noticed at once, not when the 30 s step would have ended (half of it: a margin that
        # holds on a loaded machine).
        assert time.monotonic() - killed < 15.0
        assert (
            info.value.worker == 0 and "SIGKILL" in str(info.value) and str(pid) in str(info.value)
        )
        with pytest.raises(WorkerCrashedError):  # its neighbour lost its envs too
            await neighbour.step(np.ones(1, bool))
        # Both restart concurrently: one new process, started once.
        await asyncio.gather(slow.restart([[BoxEnv]], [3]), neighbour.restart([[BoxEnv]], [4]))
        assert slow.pid == neighbour.pid != pid and backend.pids == [slow.pid]
        assert slow.buffers is buffers  # the new process got the same shared memory
        for host in (slow, neighbour):
            await host.reset(np.ones(1, bool))
            await host.step(np.ones(1, bool))
        assert not alive(pid)


async def test_step_timeout_kills_the_process_tree_then_restart(tmp_path: Path) -> None:
    specs = [spec(BoxEnv, 1, worker=0), spec(BoxEnv, 1, worker=1)]
    stepping = str(tmp_path / "stepping")
    async with (
        leaves_nothing(),
        # Wide margins: building envs that start processes can take a while on a busy machine.
        started(specs, n_processes=1, step_timeout=2.5) as (
            _,
            (hung, neighbour),
        ),
    ):
        await hung.build([[lambda: BoxEnv(delay=60, children=2, stepping=stepping)]], [1])
        await neighbour.build([[BoxEnv]], [2])
        infos = await hung.reset(np.ones(1, bool))
        await neighbour.reset(np.ones(1, bool))
        sims = list(infos[0]["pids"])
        pid = hung.pid
        assert pid is not None and all(alive(p) for p in sims)
        # The neighbour's step is queued behind the hung one and is not what times out.
        began = time.monotonic()
        hung_step = asyncio.ensure_future(hung.step(np.ones(1, bool)))
        await wait_until(lambda: os.path.exists(stepping), "the env to be in its 60 s step")
        neighbour_step = asyncio.ensure_future(neighbour.step(np.ones(1, bool)))
        with pytest.raises(StepTimeoutError) as info:
            await hung_step
        # Not before step_timeout; well before the 60 s step would end (a loaded-machine margin).
        assert 2.0 < time.monotonic() - began < 30.0
        assert isinstance(info.value, TimeoutError) and info.value.worker == 0
        assert "step_timeout" in str(info.value)
        with pytest.raises(WorkerCrashedError) as crash:
            await neighbour_step
        assert "step_timeout" in str(crash.value)
        assert not wait_gone([pid, *sims])
        await hung.restart([[BoxEnv]], [3])
        await neighbour.restart([[BoxEnv]], [4])
        for host in (hung, neighbour):
            await host.reset(np.ones(1, bool))
            await host.step(np.ones(1, bool))


@pytest.mark.slow  # a fresh interpreter or a deliberate wait: CI runs it with -m slow
async def test_step_timeout_counts_from_when_the_host_starts_the_request() -> None:
    # Four workers in one process, each step takes 1 s: the fourth waits 3 s in line, more than
    # step_timeout, but its own step is well within it (wide margins: on a loaded 2-core machine
    # building an env alone has taken over a second).
    specs = [spec(BoxEnv, 1, worker=w) for w in range(4)]
    async with started(specs, n_processes=1, step_timeout=2.5) as (_, hosts):
        for host in hosts:
            await host.build([[lambda: BoxEnv(delay=1.0)]], [1])
            await host.reset(np.ones(1, bool))
        await asyncio.gather(*(h.step(np.ones(1, bool)) for h in hosts))


@pytest.mark.slow  # a fresh interpreter or a deliberate wait: CI runs it with -m slow
async def test_step_timeout_spares_a_reply_that_came_in_time_to_a_stalled_loop(
    tmp_path: Path,
) -> None:
    # Wide margins: on a loaded 2-core machine building an env alone has taken over a second.
    stepped = str(tmp_path / "stepped")
    async with started([spec(BoxEnv, 1)], step_timeout=3.0) as (_, (host,)):
        await host.build([[lambda: BoxEnv(delay=0.2, stepped=stepped)]], [1])
        await host.reset(np.ones(1, bool))
        step = asyncio.ensure_future(host.step(np.ones(1, bool)))
        await asyncio.sleep(0)  # one turn of the loop: the task sends the request
        sent = time.monotonic()
        # The loop stalls (the thread blocks) until the env has answered and, past that, until
        # the step_timeout timer is due (with a margin): the reply is in before the timer runs.
        wait_until_blocking(lambda: os.path.exists(stepped), "the env to finish its step")
        wait_until_blocking(lambda: time.monotonic() - sent > 3.0 + 1.0, "step_timeout to pass")
        await step
        await host.step(np.ones(1, bool))


# -- cancellation ----------------------------------------------------------------------------


class _InfoEveryStep(BoxEnv):
    def step(self, action: Any) -> Any:
        obs, r, term, trunc, _ = super().step(action)
        return obs, r, term, trunc, {"late": "step reply"}


async def test_cancelled_step_then_reset_returns_correct_data() -> None:
    n = 2
    s = spec(BoxEnv, n)
    local = LocalHost(s)
    await local.build([[BoxEnv]] * n, [8, 9])
    mask = np.ones(n, bool)
    await local.reset(mask)
    want_reset = await local.reset(mask)
    async with leaves_nothing(), started([s]) as (_, (host,)):
        await host.build([[lambda: _InfoEveryStep(delay=0.3)]] * n, [8, 9])
        await host.reset(mask)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await host.step(mask)
        # The cancelled step still runs in the host; its late reply must not answer this reset.
        got_reset = await host.reset(mask)
        assert got_reset == want_reset
        assert_same_buffers_obs(host.buffers.obs, local.buffers.obs)
        host.buffers.actions[...] = 0.5
        local.buffers.actions[...] = 0.5
        await local.step(mask)
        infos = await host.step(mask)
        assert infos.env_infos == [{"late": "step reply"}] * n
        assert_same_buffers_obs(host.buffers.obs, local.buffers.obs)
    await local.close()


def assert_same_buffers_obs(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_equal(a, b)


# -- clean exits -----------------------------------------------------------------------------


async def test_aclose_leaves_no_process_and_no_shm_entry() -> None:
    async with leaves_nothing():
        specs = [spec(env, 2, worker=w) for w, env in enumerate(ENVS.values())]
        backend = ProcessBackend(n_processes=2)
        hosts = await backend.start(specs)
        pids = list(backend.pids)
        sims: list[int] = []
        for host, env in zip(hosts, ENVS.values()):
            await host.build([[lambda env=env: env(children=1)]] * 2, [1, 2])
            infos = await host.reset(np.ones(2, bool))
            sims += [p for info in infos.values() for p in info["pids"]]
            await host.step(np.ones(2, bool))
        assert len(pids) == 2 and all(alive(p) for p in pids + sims)
        await backend.aclose()
        assert not wait_gone(pids + sims)
        await backend.aclose()  # idempotent
        with pytest.raises(SamplerClosedError, match="closed"):
            await hosts[0].step(np.ones(2, bool))
        with pytest.raises(SamplerClosedError, match="closed"):
            await hosts[0].restart([[BoxEnv]] * 2, [1, 2])  # starts nothing


class _HangsOnClose(BoxEnv):
    def close(self) -> None:
        time.sleep(60)


async def test_aclose_kills_a_host_whose_env_hangs_in_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncsample.backends.process as process_module

    monkeypatch.setattr(process_module, "EXIT_GRACE", 0.5)
    async with leaves_nothing():
        backend = ProcessBackend()
        (host,) = await backend.start([spec(BoxEnv, 1)])
        await host.build([[_HangsOnClose]], [1])
        began = time.monotonic()
        await backend.aclose()
        # Killed after its grace period, not waited for: the env's close hangs for 60 s.
        assert time.monotonic() - began < 30.0


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.05])
async def test_cancelled_start_leaves_nothing(delay: float) -> None:
    async with leaves_nothing():
        backend = ProcessBackend(n_processes=2)
        task = asyncio.ensure_future(backend.start([spec(BoxEnv, 1, worker=w) for w in range(2)]))
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await backend.aclose()


async def test_garbage_collected_backend_leaves_nothing() -> None:
    async with leaves_nothing():
        backend = ProcessBackend()
        hosts = await backend.start([spec(BoxEnv, 1)])
        await hosts[0].build([[BoxEnv]], [1])
        pids = backend.pids
        del backend, hosts
        gc.collect()
        assert not wait_gone(pids)
        # One turn of the loop runs the connection_lost callbacks that the collected backend's
        # transport.abort() scheduled (call_soon), before the loop closes.
        await asyncio.sleep(0)


def _run_script(body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(
        """
        import asyncio, os, signal, sys, time
        import numpy as np, gymnasium as gym
        from asyncsample.backends.base import HostSpec
        from asyncsample.backends.process import ProcessBackend

        HUNG = os.environ["HUNG_FLAG"]  # created by an env when it starts to hang

        class Env(gym.Env):
            observation_space = gym.spaces.Box(-1, 1, (2,))
            action_space = gym.spaces.Discrete(2)
            def reset(self, *, seed=None, options=None):
                return np.zeros(2, np.float32), {}
            def step(self, action):
                if action == 1:
                    open(HUNG, "a").close()
                    time.sleep(120)  # hangs
                return np.zeros(2, np.float32), 0.0, False, False, {}

        async def until_hung():
            deadline = time.monotonic() + 30
            while not os.path.exists(HUNG):
                assert time.monotonic() < deadline, "the env never started to hang"
                await asyncio.sleep(0.005)

        async def start():
            space = Env.observation_space, Env.action_space
            specs = [HostSpec(w, 1, *space, None) for w in range(2)]
            backend = ProcessBackend(n_processes=2)
            hosts = await backend.start(specs)
            for h in hosts:
                await h.build([[Env]], [0])
                await h.reset(np.ones(1, bool))
            print(*backend.pids, flush=True)
            return backend, hosts
        """
    ) + textwrap.dedent(body)
    env = {**os.environ, "HUNG_FLAG": str(tmp_path / "hung")}
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=50, env=env
    )


@pytest.mark.slow  # a fresh interpreter or a deliberate wait: CI runs it with -m slow
def test_hosts_end_at_interpreter_exit_without_aclose(tmp_path: Path) -> None:
    began = time.monotonic()
    result = _run_script(
        """
        async def main():
            global keep
            keep = await start()
            keep[1][0].buffers.actions[:] = 1
            asyncio.ensure_future(keep[1][0].step(np.ones(1, bool)))  # a hung env
            await until_hung()
        asyncio.run(main())
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - began < 50  # the exit did not wait for the hung env's 120 s
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 2
    assert not wait_gone(pids)


def test_hosts_die_with_a_killed_parent(tmp_path: Path) -> None:
    result = _run_script(
        """
        async def main():
            backend, hosts = await start()
            hosts[0].buffers.actions[:] = 1
            asyncio.ensure_future(hosts[0].step(np.ones(1, bool)))  # a hung env
            await until_hung()
            os.kill(os.getpid(), signal.SIGKILL)
        asyncio.run(main())
        """,
        tmp_path,
    )
    assert result.returncode == -signal.SIGKILL
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 2
    assert not wait_gone(pids)


# -- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"n_processes": 0}, ValueError),
        ({"n_processes": 1.5}, TypeError),
        ({"n_processes": True}, TypeError),
        ({"step_timeout": 0}, ValueError),
        ({"step_timeout": -1.0}, ValueError),
    ],
)
def test_bad_options(options: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        ProcessBackend(**options)


async def test_pool_layout() -> None:
    specs = [spec(BoxEnv, 1, worker=w) for w in range(5)]
    async with started(specs, n_processes=2) as (backend, hosts):
        assert len(backend.pids) == 2
        assert [h.pid for h in hosts] == [backend.pids[w % 2] for w in range(5)]
    async with started(specs[:1], n_processes=8) as (backend, _):
        assert len(backend.pids) == 1  # never more processes than workers


def test_host_cpus_pins_only_a_pool_with_a_host_per_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncsample.backends import _procs

    monkeypatch.setattr(_procs.os, "sched_getaffinity", lambda pid: {4, 2}, raising=False)
    assert _procs.host_cpus(2, None) == [2, 4]
    assert _procs.host_cpus(3, None) == [2, 4, 2]  # more hosts than CPUs: round robin
    assert _procs.host_cpus(1, None) == [None]  # a CPU to spare: the scheduler decides
    assert _procs.host_cpus(1, True) == [2]
    assert _procs.host_cpus(2, False) == [None, None]
    monkeypatch.setattr(_procs.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert _procs.host_cpus(2, None) == [None, None]  # one CPU: nothing to spread


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
@pytest.mark.timeout(60)
async def test_pin_cpus_pins_each_host_process() -> None:
    """Pinned on request; by default the sampler's hosts are free and a vector env's, one per
    CPU, pinned (its lockstep round needs them on different CPUs: see _procs.host_cpus)."""
    allowed = sorted(os.sched_getaffinity(0))
    from asyncsample import Sampler

    async with Sampler(
        "CartPole-v1", n_workers=2, n_processes=2, backend_options={"pin_cpus": True}
    ) as sampler:
        await sampler.obtain_samples(10)
        pids = sampler._core.backend.pids
        assert [os.sched_getaffinity(pid) for pid in pids] == [
            {allowed[0]},
            {allowed[1 % len(allowed)]},
        ]
    async with Sampler("CartPole-v1", n_workers=2, n_processes=2) as sampler:  # the default
        await sampler.obtain_samples(10)
        for pid in sampler._core.backend.pids:
            assert os.sched_getaffinity(pid) == set(allowed)
    from asyncsample.vector import VectorEnv

    venv = VectorEnv("CartPole-v1", len(allowed), n_processes=len(allowed))  # a host per CPU
    try:
        assert [os.sched_getaffinity(pid) for pid in venv.pids] == [{cpu} for cpu in allowed]
    finally:
        venv.close()
    with pytest.raises(TypeError, match=r"pin_cpus must be True, False or None, got int 1"):
        ProcessBackend(pin_cpus=1)  # type: ignore[arg-type]
