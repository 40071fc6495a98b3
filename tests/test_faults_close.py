"""``close_timeout`` on the lockstep backends (issue 32): ``process``, ``ray`` and ``local`` wait
for an env's ``close()`` as long as ``close_timeout`` and no longer.

Before, ``process`` and ``ray`` killed a host a fixed 2 s after asking it to exit, whatever
``close_timeout`` said, and ``local`` closed its envs in the loop's thread without a bound. The
tests tell the two apart by what a close got to do, never by how long a call took: an env whose
``close()`` sleeps and then writes a file finished its close only if it was waited for.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import sys
import threading
import time
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from helpers import SamplerFactory

import asyncsample.backends.process as process_module
import asyncsample.backends.ray as ray_module
from asyncsample import Sampler

pytestmark = [pytest.mark.timeout(120)]

# The env hosts cannot import this test module by name: ship its envs by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class SlowCloseEnv(gym.Env[np.ndarray, np.int64]):
    """Episodes of 5 steps; ``close()`` sleeps ``delay`` seconds, then writes ``path.<pid>``."""

    def __init__(self, path: str, delay: float) -> None:
        self.observation_space = gym.spaces.Box(0.0, np.inf, (1,), np.float64)
        self.action_space = gym.spaces.Discrete(2)
        self.path, self.delay, self.t = path, delay, 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0]), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        return np.array([float(self.t)]), 1.0, self.t >= 5, False, {}

    def close(self) -> None:
        time.sleep(self.delay)
        pathlib.Path(f"{self.path}.{os.getpid()}").write_text("closed")


def _slow_close(tmp_path: pathlib.Path, delay: float) -> Any:
    return functools.partial(SlowCloseEnv, str(tmp_path / "closed"), delay)


def _closed_in_hosts(tmp_path: pathlib.Path) -> int:
    """How many envs finished their close outside this process (not the probe env's close)."""
    return sum(1 for p in tmp_path.glob("closed.*") if p.suffix != f".{os.getpid()}")


# -- process ------------------------------------------------------------------------------------


@pytest.mark.both_loops
@pytest.mark.parametrize("inference", ["host", "per_worker"])  # host: what "auto" picks here
async def test_process_waits_close_timeout_for_an_env_to_close(
    make_sampler: SamplerFactory,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    inference: str,
) -> None:
    # A close of 1 s, past the fixed grace (0.2 s here) but well within close_timeout. With
    # inference="host" a chunk may still run when the call returns: the host gets its close
    # time once that chunk is answered (it was killed at the grace: ProcessBackend._grace).
    monkeypatch.setattr(process_module, "EXIT_GRACE", 0.2)
    env = _slow_close(tmp_path, 1.0)
    sampler = make_sampler(
        "process", env, n_workers=1, close_timeout=60.0, seed=0, inference=inference
    )
    await sampler.obtain_samples(10)
    await sampler.aclose()
    # before: the host was killed mid-close, 0.2 s after it was asked to exit
    assert _closed_in_hosts(tmp_path) == 1


@pytest.mark.both_loops
async def test_process_kills_a_host_past_close_timeout(
    make_sampler: SamplerFactory, tmp_path: pathlib.Path
) -> None:
    # A close of 1.5 s, within the fixed 2 s of before but past close_timeout.
    env = _slow_close(tmp_path, 1.5)
    sampler = make_sampler("process", env, n_workers=1, close_timeout=0.2, seed=0)
    await sampler.obtain_samples(10)
    await sampler.aclose()
    # before: the host got 2 s, long enough for the close to finish
    assert _closed_in_hosts(tmp_path) == 0


def test_backends_take_close_timeout() -> None:
    """Checked as given (what it does: the two tests above, and Ray's below)."""
    with pytest.raises(ValueError, match="close_timeout"):
        process_module.ProcessBackend(close_timeout=0)
    with pytest.raises(ValueError, match="close_timeout"):
        ray_module.RayBackend(close_timeout=-1.0)


# -- ray ----------------------------------------------------------------------------------------


@pytest.mark.slow  # Ray
async def test_ray_waits_close_timeout_for_an_env_to_close(
    ray_cluster: Any, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ray_module, "EXIT_GRACE", 0.2)
    env = _slow_close(tmp_path, 1.0)
    async with Sampler(env, n_workers=1, backend="ray", close_timeout=60.0, seed=0) as sampler:
        await sampler.obtain_samples(10)
    # before: the actor was killed mid-close, 0.2 s after it was asked to shut down
    assert _closed_in_hosts(tmp_path) == 1


# -- local --------------------------------------------------------------------------------------


class StuckCloseEnv(SlowCloseEnv):
    """``close()`` blocks until ``release`` is set (at most 60 s); step ``fail_at`` raises."""

    release = threading.Event()

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__("", 0.0)
        self.fail_at, self.steps, self.closed = fail_at, 0, False

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("a step of an env whose close will hang")
        return super().step(action)

    def close(self) -> None:
        self.release.wait(60)
        self.closed = True


@pytest.fixture
def stuck_close() -> Any:
    StuckCloseEnv.release.clear()
    yield StuckCloseEnv
    StuckCloseEnv.release.set()  # let the abandoned closes end


@pytest.mark.both_loops
async def test_local_aclose_is_bounded_by_close_timeout(stuck_close: Any) -> None:
    sampler = Sampler(stuck_close, n_workers=2, backend="local", close_timeout=0.2, seed=0)
    await sampler.obtain_samples(10)
    with pytest.warns(ResourceWarning, match=r"the envs of the local backend: .*0\.2s"):
        await sampler.aclose()  # before: blocked the loop until the close returned
    assert sampler.closed


@pytest.mark.both_loops
async def test_local_restart_does_not_wait_past_close_timeout(stuck_close: Any) -> None:
    made: list[StuckCloseEnv] = []

    def factory() -> StuckCloseEnv:
        made.append(stuck_close(fail_at=3 if len(made) == 1 else None))  # the first worker env
        return made[-1]

    sampler = Sampler(factory, n_workers=1, backend="local", close_timeout=0.2, seed=0)
    with pytest.warns(ResourceWarning, match="the envs of worker 0"):
        batch = await sampler.obtain_samples(10)
    assert batch.n_transitions >= 10 and sampler.restarts == 1
    assert not made[1].closed  # still stuck in its close, abandoned: the rebuild went on
    stuck_close.release.set()
    with contextlib.suppress(Warning):
        await sampler.aclose()
