"""Faults and exits: crashes, hangs, cancellation, interrupts, garbage collection, exit.

After each, no child process and no new /dev/shm entry may remain, and no half-made episode may
be returned.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
from envs import (
    GridWorldEnv,
    HangingEnv,
    KillSelfEnv,
    NoisyEnv,
    ScriptedAgent,
    SignallingAgent,
    SleepyEnv,
)
from helpers import host_processes, new_shm_entries, run_python, shm_entries, wait_gone

from asyncsample import (
    EpisodeBatch,
    Sampler,
    StepTimeoutError,
    StepType,
    WorkerCrashedError,
    WorkerError,
)

pytestmark = pytest.mark.timeout(90)

SCRIPTED_OBS = [0, 1, 2, 6, 10, 14]


def assert_complete(batch: EpisodeBatch) -> None:
    for ep in batch.split():
        assert StepType(ep.step_types[-1]) in (StepType.TERMINAL, StepType.TIMEOUT)
        first = StepType(ep.step_types[0])
        assert first == StepType.FIRST or (ep.lengths[0] == 1 and first != StepType.MID)


def per_worker(batch: EpisodeBatch, n_workers: int) -> list[int]:
    workers = batch.episode_infos["worker"]
    return [int(batch.lengths[workers == w].sum()) for w in range(n_workers)]


async def test_killed_host_is_restarted_and_quota_met(tmp_path: Path, no_leaks: None) -> None:
    env = functools.partial(KillSelfEnv, 15, str(tmp_path / "killed"))
    async with Sampler(
        env, n_workers=2, envs_per_worker=2, n_processes=2, seed=0, max_episode_length=40
    ) as s:
        # Noticed at once: there is no step_timeout, so a death not noticed would hang until
        # the test's timeout.
        batch = await s.obtain_samples(400)
        assert s.restarts >= 1
        assert s.last_stats is not None and s.last_stats.restarts == s.restarts
    assert (tmp_path / "killed").exists()
    assert all(total >= 200 for total in per_worker(batch, 2))
    assert_complete(batch)


async def test_external_sigkill_mid_call(no_leaks: None) -> None:
    env = functools.partial(SleepyEnv, 0.002)
    agent = SignallingAgent(after=10)
    others = set(host_processes())  # e.g. a Ray cluster an earlier test started: not ours
    async with Sampler(env, agent, n_workers=2, n_processes=2, seed=0, max_episode_length=30) as s:
        await s.obtain_samples(20)
        agent.calls = 0
        agent.event.clear()
        call = asyncio.ensure_future(s.obtain_samples(600))
        await agent.event.wait()  # 10 steps into the call, about 590 to go
        victims = [p for p in host_processes() if p not in others]
        assert victims
        os.kill(victims[0], signal.SIGKILL)
        batch = await call
        assert s.restarts >= 1
    assert all(total >= 300 for total in per_worker(batch, 2))
    assert_complete(batch)


async def test_crash_past_the_budget_reaches_the_caller(no_leaks: None) -> None:
    env = functools.partial(KillSelfEnv, 3)  # every new env kills its host again
    s = Sampler(env, n_workers=2, n_processes=2, max_restarts=2, max_episode_length=20)
    try:
        with pytest.raises(WorkerCrashedError, match=r"worker \d") as info:
            await s.obtain_samples(100)
        assert isinstance(info.value, WorkerError)
        assert s.restarts >= 2
    finally:
        await s.aclose()
    assert s.closed


async def test_the_call_after_a_spent_budget_rebuilds_the_host(
    tmp_path: Path, no_leaks: None
) -> None:
    """A host that died past the budget is rebuilt by the next call, before any step of it."""
    env = functools.partial(KillSelfEnv, 5, str(tmp_path / "killed"))
    async with Sampler(env, n_workers=1, max_restarts=0, seed=0, max_episode_length=20) as s:
        with pytest.raises(WorkerCrashedError):
            await s.obtain_samples(100)
        batch = await s.obtain_samples(100)  # on the dead host's corpse it would crash again
        assert s.workers[0].restarts == 1  # rebuilt once, by the second call
    assert batch.n_transitions >= 100
    assert_complete(batch)


async def test_hanging_env_times_out_and_is_replaced(tmp_path: Path, no_leaks: None) -> None:
    env = functools.partial(HangingEnv, 8, 3600.0, str(tmp_path / "hung"))
    async with Sampler(
        # step_timeout well above a loaded machine's env build time, far below the hang's hour
        env,
        n_workers=2,
        n_processes=2,
        step_timeout=3.0,
        seed=1,
        max_episode_length=25,
    ) as s:
        batch = await s.obtain_samples(200)  # the hang (an hour) ends by step_timeout
        assert s.restarts >= 1
    assert all(total >= 100 for total in per_worker(batch, 2))
    assert_complete(batch)


async def test_hanging_env_past_the_budget(no_leaks: None) -> None:
    env = functools.partial(HangingEnv, 2, 3600.0)
    async with Sampler(
        env, n_workers=1, n_processes=1, step_timeout=0.3, max_restarts=1, max_episode_length=25
    ) as s:
        with pytest.raises(StepTimeoutError, match="worker 0") as info:
            await s.obtain_samples(50)
        assert isinstance(info.value, TimeoutError)


@pytest.mark.parametrize("backend", ["local", "process"])
async def test_cancellation_at_any_moment_leaves_the_sampler_usable(
    backend: str, no_leaks: None
) -> None:
    rng = random.Random(0)

    class SlowScripted(ScriptedAgent):
        async def get_actions(self, observations):  # type: ignore[override]
            await asyncio.sleep(0.0005)
            return super().get_actions(observations)

    async with Sampler(
        functools.partial(GridWorldEnv, "4x4"),
        SlowScripted(),
        n_workers=3,
        envs_per_worker=2,
        backend=backend,
        n_processes=2,
    ) as s:
        for i in range(12):
            call = [s.obtain_samples, s.obtain_fragments, s.obtain_exact_episodes][i % 3]
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(rng.uniform(0.0, 0.03)):
                    await call(10_000)
            batch = await s.obtain_samples(36)
            for ep in batch.split():
                assert ep.observations.tolist() == SCRIPTED_OBS
            frags = await s.obtain_fragments(12)
            assert frags.observations.tolist()[:2] == [0, 1]  # fresh episodes, nothing leaked
        assert s.total_env_steps > 0


async def test_cancelled_task_does_not_leak_steps_into_next_call(no_leaks: None) -> None:
    async def run(cancel: bool) -> EpisodeBatch:
        agent = SignallingAgent(after=5)
        async with Sampler(
            NoisyEnv,
            agent,
            n_workers=2,
            envs_per_worker=2,
            n_processes=2,
            seed=5,
            max_episode_length=20,
        ) as s:
            if cancel:
                task = asyncio.ensure_future(s.obtain_samples(100_000))
                await agent.event.wait()  # steps were taken in the call being cancelled
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            return await s.obtain_exact_episodes(3)

    batch = await run(cancel=True)
    assert batch.n_episodes == 6
    assert_complete(batch)
    assert batch.episode_infos["worker"].tolist() == [0, 0, 0, 1, 1, 1]


async def test_many_tasks_each_get_a_valid_batch(no_leaks: None) -> None:
    async with Sampler(
        functools.partial(GridWorldEnv, "4x4"),
        ScriptedAgent(),
        n_workers=2,
        envs_per_worker=2,
        n_processes=2,
    ) as s:
        calls = [s.obtain_samples(12 + i) for i in range(10)]
        calls += [s.obtain_exact_episodes(2) for _ in range(5)]
        results = await asyncio.gather(*calls)
    for batch in results:
        for ep in batch.split():
            assert ep.observations.tolist() == SCRIPTED_OBS
    assert [r.n_episodes for r in results[10:]] == [4] * 5


async def test_actions_outside_the_action_space() -> None:
    class OutOfRange:
        def get_actions(self, observations):
            return np.full(len(observations), 7), {}

    async with Sampler(functools.partial(GridWorldEnv, "4x4"), OutOfRange(), backend="local") as s:
        with pytest.raises(ValueError, match=r"action.*worker 0.*outside the action space.*env 0"):
            await s.obtain_samples(10)
        assert s.total_env_steps == 0
        await s.obtain_samples(6, agent_update=ScriptedAgent())  # still usable


async def test_agent_returning_wrong_shape() -> None:
    class WrongShape:
        def get_actions(self, observations):
            return np.zeros((len(observations), 2), dtype=np.int64), {}

    async with Sampler(functools.partial(GridWorldEnv, "4x4"), WrongShape(), backend="local") as s:
        with pytest.raises(ValueError, match=r"action.*shape \(2,\) per env"):
            await s.obtain_samples(10)


async def test_unclosed_sampler_warns_and_cleans_up_when_collected(no_leaks: None) -> None:
    others = set(host_processes())
    s = Sampler(NoisyEnv, n_workers=2, n_processes=2, max_episode_length=10)
    await s.obtain_samples(20)
    pids = [p for p in host_processes() if p not in others]
    assert pids
    with pytest.warns(ResourceWarning, match="unclosed"):
        del s
        gc.collect()
    assert wait_gone(pids) == []


SCRIPT_HEAD = """
import asyncio, os, psutil, signal, sys, tempfile, time
import cloudpickle, envs
cloudpickle.register_pickle_by_value(envs)
from asyncsample import Sampler

def hosts():
    return [p.pid for p in psutil.Process().children(recursive=True)]

async def until_exists(path, what):
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"waited 30 s for {what}"
        await asyncio.sleep(0.005)
"""


# A fresh interpreter (10-17 s of the default run on a loaded 2-core machine): slow. The default
# run keeps a sampler never closed cleaned up, hosts and shared memory
# (test_unclosed_sampler_warns_and_cleans_up_when_collected), and hosts ending with a parent that
# dies without closing them (test_process_backend.py::test_hosts_die_with_a_killed_parent).
@pytest.mark.slow
def test_interpreter_exit_without_aclose() -> None:
    before = shm_entries()
    result = run_python(
        SCRIPT_HEAD
        + """
async def main():
    s = Sampler(envs.NoisyEnv, n_workers=2, n_processes=2, max_episode_length=10)
    await s.obtain_samples(20)
    print(" ".join(map(str, hosts())), flush=True)
asyncio.run(main())  # returns without aclose(): the interpreter exits with hosts running
"""
    )
    assert result.returncode == 0, result.stderr
    pids = [int(p) for p in result.stdout.split()]
    assert pids
    assert wait_gone(pids) == []
    assert new_shm_entries(before) == []


@pytest.mark.slow  # a fresh interpreter: CI runs it with -m slow
def test_keyboard_interrupt_in_the_middle_of_sampling() -> None:
    before = shm_entries()
    result = run_python(
        SCRIPT_HEAD
        + """
import numpy as np

class InterruptAt:  # action 0; once armed, SIGINT (Ctrl-C) to this process after `left` calls
    def __init__(self):
        self.left = None
    def get_actions(self, observations):
        if self.left is not None:
            self.left -= 1
            if self.left == 0:
                os.kill(os.getpid(), signal.SIGINT)  # in the middle of sampling
        return np.zeros(len(observations), dtype=np.int64), {}

async def main():
    env = lambda: envs.SleepyEnv(0.001)
    agent = InterruptAt()
    async with Sampler(env, agent, n_workers=2, n_processes=2, max_episode_length=50) as s:
        await s.obtain_samples(10)
        print(" ".join(map(str, hosts())), flush=True)
        agent.left = 20  # interrupt the next call after 20 steps
        await s.obtain_samples(10**7)
try:
    asyncio.run(main())
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""
    )
    lines = result.stdout.split("\n")
    assert "interrupted" in result.stdout, result.stderr
    pids = [int(p) for p in lines[0].split()]
    assert pids
    assert wait_gone(pids) == []
    assert new_shm_entries(before) == []


@pytest.mark.slow  # a fresh interpreter: CI runs it with -m slow
def test_parent_killed_takes_its_hosts_along() -> None:
    result = run_python(
        SCRIPT_HEAD
        + """
async def main():
    hanging = os.path.join(tempfile.mkdtemp(), "hanging")
    env = lambda: envs.HangingEnv(3, 3600.0, hanging=hanging)  # the hosts get stuck in a step
    s = Sampler(env, n_workers=2, n_processes=2, max_episode_length=50)
    await s.start()
    print(" ".join(map(str, hosts())), flush=True)
    task = asyncio.ensure_future(s.obtain_samples(100))
    await until_exists(hanging, "an env to hang")
    os.kill(os.getpid(), signal.SIGKILL)
asyncio.run(main())
"""
    )
    assert result.returncode == -signal.SIGKILL
    pids = [int(p) for p in result.stdout.split()]
    assert pids
    assert wait_gone(pids) == []
