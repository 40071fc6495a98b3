"""The probe env (issue 32): a ``Sampler`` built in a running event loop builds the one env that
tells the spaces in a thread of its own, so a slow factory never stalls the caller's loop; what
needs the env is checked when the sampler starts, what does not still in the constructor.

A factory that waits for an event only the loop sets tells the two apart without timing: built in
the loop's thread, it would wait for an event that can never be set (and give up, failing).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
from helpers import SamplerFactory, run_python

from asyncsample import Sampler

pytestmark = [pytest.mark.timeout(60), pytest.mark.both_loops]


class GatedFactory:
    """Builds CartPole once ``release`` is set (giving up after 20 s); records its threads."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.threads: list[int] = []

    def __reduce__(self) -> tuple[Any, ...]:
        # In the env hosts (process), a plain CartPole factory: only this process gates.
        return functools.partial, (gym.make, "CartPole-v1")

    def __call__(self) -> gym.Env[Any, Any]:
        self.threads.append(threading.get_ident())
        if not self.release.wait(20):
            raise RuntimeError("built where the loop could not let it go on")
        return gym.make("CartPole-v1")


@pytest.mark.parametrize("backend", ["local", "process", "thread"])
async def test_the_probe_env_is_built_off_the_loop(
    make_sampler: SamplerFactory, backend: str
) -> None:
    factory = GatedFactory()
    sampler = make_sampler(backend, factory, n_workers=2, seed=0)  # before: never returned
    factory.release.set()  # only this loop can let the probe go on
    batch = await sampler.obtain_samples(20)
    assert batch.n_transitions >= 20
    assert sampler.env_spec.max_episode_length == 500
    await sampler.aclose()
    assert factory.threads[0] != threading.get_ident()  # the probe: in a thread of its own


async def test_a_factory_that_fails_is_reported_as_the_sampler_starts() -> None:
    def broken() -> gym.Env[Any, Any]:
        raise RuntimeError("no simulator licence")

    with pytest.raises(ValueError, match=r"env: could not build an env from .*licence"):
        await asyncio.to_thread(Sampler, broken, backend="local")  # no loop there: at once
    sampler = Sampler(broken, backend="local")  # in a loop: built meanwhile
    for _ in range(2):  # every call says why, and nothing was started
        with pytest.raises(ValueError, match=r"env: could not build an env from .*licence"):
            await sampler.obtain_samples(10)
    await sampler.aclose()


async def test_checks_that_need_no_env_stay_in_the_constructor() -> None:
    with pytest.raises(ValueError, match="unknown gymnasium env id 'NoSuchEnv-v0'"):
        Sampler("NoSuchEnv-v0")
    with pytest.raises(TypeError, match="env must be a gymnasium id"):
        Sampler(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="envs_per_worker=1000000000"):
        Sampler("CartPole-v1", envs_per_worker=10**9)  # memory: refused before any env is built


async def test_env_spec_before_start_waits_for_the_probe() -> None:
    sampler = Sampler(functools.partial(gym.make, "CartPole-v1"), backend="local")
    assert sampler.env_spec.action_space == gym.spaces.Discrete(2)
    await sampler.aclose()


async def test_aclose_before_start_does_not_wait_for_a_stuck_probe() -> None:
    factory = GatedFactory()
    sampler = Sampler(factory, backend="local", close_timeout=0.2)
    with pytest.warns(ResourceWarning, match=r"was not built within close_timeout=0\.2s"):
        await sampler.aclose()
    factory.release.set()


# A sampler built in a coroutine that returns at once: the interpreter exits while the probe
# builds its env. The factory writes its name down as the env closes.
_EXIT_WHILE_PROBING = """
import asyncio, pathlib, time
import gymnasium as gym
import asyncsample._daemon_threads
from asyncsample import Sampler

asyncsample._daemon_threads.EXIT_GRACE_S = {grace}

class Noted(gym.Wrapper):
    def close(self):
        pathlib.Path({note!r}).write_text("closed")
        super().close()

def slow_factory():
    time.sleep({build_s})  # the exit comes first
    return Noted(gym.make("CartPole-v1"))

async def main():
    Sampler(slow_factory, backend="local")  # never started

asyncio.run(main())
"""


@pytest.mark.timeout(60)
def test_the_interpreter_exit_waits_for_a_probe_still_building(tmp_path: Path) -> None:
    # MuJoCo built in a daemon thread the exit cut short crashed the process (SIGSEGV, about
    # 1 run in 10 of docs/inference.md's snippet): the exit now lets the probe finish and close.
    note = tmp_path / "closed"
    proc = run_python(_EXIT_WHILE_PROBING.format(grace=10.0, note=str(note), build_s=0.5))
    assert proc.returncode == 0, proc.stderr
    assert note.read_text() == "closed"  # before: the thread was ended before its close


@pytest.mark.timeout(60)
def test_the_interpreter_exit_leaves_a_stuck_probe_after_its_grace(tmp_path: Path) -> None:
    note = tmp_path / "closed"
    code = _EXIT_WHILE_PROBING.format(grace=0.5, note=str(note), build_s=3600)
    started = time.monotonic()
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 30  # not the factory's hour
    assert not note.exists()
