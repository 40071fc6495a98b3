"""An env that blocks the loop (or serving thread) it runs in: its host is killed and restarted
past ``step_timeout``, the fault names the env, the worker and the line, only that env spends
its restart budget, and the call completes with every healthy episode intact; on the caller's
own loop, a warning names the env and the line. And the live gauges: what is in flight, read
while a call runs.

Each block is a ``time.sleep(60)``: a call that waited for it to end would outlive the test's
timeout, so a call that completes proves the block was cut (no clock is asserted)."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import sys
from pathlib import Path
from typing import Any, ClassVar

import blocking_envs
import cloudpickle
import numpy as np
import pytest
from async_envs import CountingAsyncEnv
from blocking_envs import ACTIONS, BLOCK_LINE, BlockingAsyncEnv, BlockingEnv, block, claim
from helpers import SamplerFactory, wait_until
from lane_server import LaneServerHost
from prometheus_client import CollectorRegistry
from test_metrics import value

from asyncsample import EpisodeBatch, RandomAgent, StepType
from asyncsample.backends import _watchdog
from asyncsample.backends._lane_serve import LaneKind
from asyncsample.backends._watchdog import BlockReport, Watch, name_block

cloudpickle.register_pickle_by_value(blocking_envs)  # the env hosts cannot import it by name

pytestmark = pytest.mark.timeout(120)

PLACE = f"blocking_envs.py:{BLOCK_LINE} (time.sleep(seconds))"


def check_intact(batch: EpisodeBatch, length: int) -> None:
    """Every episode of ``batch`` is whole: its steps count 0, 1, ... and it ends terminated at
    ``length`` (a half-made episode would skip or repeat a count, or end early)."""
    start = 0
    types = np.asarray(batch.step_types)
    obs = np.asarray(batch.observations)
    for n in np.asarray(batch.lengths).tolist():
        assert n == length
        assert obs[start : start + n, 0].tolist() == list(range(n))
        assert types[start + n - 1] == StepType.TERMINAL
        start += n


def rebuilt_logs(caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[str]]:
    """The caller's log lines of env rebuilds: those counted against max_restarts, the others."""
    counted, free = [], []
    for record in caplog.records:
        text = record.getMessage()
        if "rebuilding env" in text:
            (free if "not counted against max_restarts" in text else counted).append(text)
    return counted, free


@pytest.fixture(params=["process", "ray"])
def backend(request: pytest.FixtureRequest) -> str:
    """The host backends whose event loops are watched (Ray's variants are slow)."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return str(request.param)


async def test_a_blocked_host_loop_is_killed_named_and_only_the_culprit_pays(
    backend: str,
    make_sampler: SamplerFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 2 workers x 3 async envs in one host; the first env at its 3rd step sleeps 60 s
    caplog.set_level(logging.INFO, logger="asyncsample")
    registry = CollectorRegistry()
    sampler = make_sampler(
        backend,
        functools.partial(BlockingAsyncEnv, str(tmp_path / "flag")),
        n_workers=2,
        envs_per_worker=3,
        n_processes=1,
        step_timeout=1,
        max_restarts=1,
        metrics=registry,
    )
    batch = await sampler.obtain_exact_episodes(12)
    check_intact(batch, 5)
    assert batch.n_episodes >= 12
    counted, free = rebuilt_logs(caplog)
    assert len(counted) == 1, counted  # the culprit alone spends its budget
    culprit = counted[0]
    assert "LoopBlockedError" in culprit and "blocked its host's event loop" in culprit
    assert f"in step at {PLACE}" in culprit
    worker, env = int(culprit.split("worker ")[1].split(":")[0]), int(culprit.split("env ")[1][0])
    assert f"env {env} of worker {worker} blocked" in culprit
    # the host's other envs (those with a call in flight or one to make) rebuilt for free
    assert 1 <= len(free) <= 5
    assert not any(f"worker {worker}: rebuilding env {env} " in f for f in free)
    assert value(registry, "host_restarts_total", cause="blocked") == 1
    assert value(registry, "host_restarts_total", cause="died") == 0
    assert value(registry, "env_faults_total", kind="hung") == 1
    assert value(registry, "env_faults_total") == 1
    assert value(registry, "restarts_total") == 1


async def test_a_blocking_gymnasium_env_on_process_is_killed_with_its_line(
    make_sampler: SamplerFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # lockstep hosts of blocking envs: killed past step_timeout as before, the line now named
    caplog.set_level(logging.WARNING, logger="asyncsample")  # (another test may have raised it)
    registry = CollectorRegistry()
    sampler = make_sampler(
        "process",
        functools.partial(BlockingEnv, str(tmp_path / "flag")),
        n_workers=2,
        envs_per_worker=2,
        step_timeout=1,
        metrics=registry,
    )
    batch = await sampler.obtain_exact_episodes(8)
    check_intact(batch, 5)
    lines = [r.getMessage() for r in caplog.records if "StepTimeoutError" in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records]
    assert "took longer than step_timeout=1s" in lines[0]
    assert "blocked its host's serving thread" in lines[0] and f"in step at {PLACE}" in lines[0]
    assert value(registry, "host_restarts_total", cause="hung") == 1
    assert value(registry, "host_restarts_total", cause="blocked") == 0


async def test_a_block_of_the_callers_loop_is_warned_once_with_its_line(
    make_sampler: SamplerFactory, tmp_path: Path
) -> None:
    # the caller's loop cannot be pre-empted: a 1.5 s block past step_timeout=1 is named in a
    # warning, and the env's call is its fault once it returns (the env rebuilt, counted)
    registry = CollectorRegistry()
    sampler = make_sampler(
        "asyncio",
        functools.partial(BlockingAsyncEnv, str(tmp_path / "flag"), seconds=1.5),
        n_workers=2,
        envs_per_worker=2,
        step_timeout=1,
        metrics=registry,
    )
    with pytest.warns(RuntimeWarning, match="blocked the sampler's event loop") as caught:
        batch = await sampler.obtain_exact_episodes(8)
    check_intact(batch, 5)
    texts = [str(w.message) for w in caught if "event loop" in str(w.message)]
    assert len(texts) == 1  # once per env
    assert f"in step at {PLACE}" in texts[0] and "of worker" in texts[0]
    assert "backend='process'" in texts[0]
    assert value(registry, "env_faults_total", kind="hung") == 1


async def test_a_block_is_named_where_a_lane_awaits_its_envs_step_itself(
    make_sampler: SamplerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # neither step_timeout nor metrics: the lanes await their envs' steps with no step_one in
    # between (LaneHost.direct_steps), so the watchdog finds the env in the lane's frame; the
    # limit is BLOCK_LIMIT's (10 s), made 1 s here
    monkeypatch.setattr(_watchdog, "BLOCK_LIMIT", 1.0)
    sampler = make_sampler(
        "asyncio",
        functools.partial(BlockingAsyncEnv, str(tmp_path / "flag"), seconds=1.5),
        n_workers=2,
        envs_per_worker=2,
    )
    with pytest.warns(RuntimeWarning, match="blocked the sampler's event loop") as caught:
        batch = await sampler.obtain_exact_episodes(8)
    check_intact(batch, 5)
    texts = [str(w.message) for w in caught if "event loop" in str(w.message)]
    assert len(texts) == 1
    assert f"in step at {PLACE}" in texts[0] and re.search(r"env \d of worker \d", texts[0])


class _NamesItsStack(CountingAsyncEnv):
    """Each step takes the watchdog's report of the stack it runs in, as if it blocked there."""

    reports: ClassVar[list[BlockReport]] = []

    async def step(self, action: Any) -> Any:
        _NamesItsStack.reports.append(name_block(sys._getframe(), 2.0))
        return await super().step(action)


async def test_a_block_is_named_where_a_hosts_run_awaits_its_envs_step_itself() -> None:
    # a run of steps in a host of async envs (inference="host", the random agent drawing each
    # row): neither step_timeout nor metrics, so the run awaits its env's steps itself
    host = LaneServerHost(RandomAgent(ACTIONS), n_slots=2, make_env=_NamesItsStack)
    await host.start()
    try:
        _NamesItsStack.reports.clear()
        host.submit((LaneKind.RUN, 1, 1, 0, None, 3, False))  # worker 1's env 0
        run, _obs, _final = await host.until(1)
    finally:
        await host.close()
    assert len(run.rewards) == 3
    assert [(r.worker, r.env, r.what) for r in _NamesItsStack.reports] == [(1, 0, "step")] * 3


class _SlowResetAgent(RandomAgent):
    """Its first ``reset`` (claiming ``flag``) blocks the loop it runs in for 1.5 s."""

    def __init__(self, flag: str) -> None:
        super().__init__(ACTIONS, seed=0)
        self.flag = flag

    def reset(self, do_resets: Any = None) -> None:
        if claim(self.flag):
            block(1.5)


async def test_an_agents_block_in_a_lane_is_not_its_envs_fault(
    make_sampler: SamplerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the agent's reset runs in the lane's frame too, but not on the line where the lane awaits
    # its env's step: the warning names no env, and no env is rebuilt for it
    monkeypatch.setattr(_watchdog, "BLOCK_LIMIT", 1.0)
    sampler = make_sampler(
        "asyncio",
        functools.partial(BlockingAsyncEnv, str(tmp_path / "never"), at=10**9),
        n_workers=1,
        envs_per_worker=2,
        agent=_SlowResetAgent(str(tmp_path / "agent")),
    )
    with pytest.warns(RuntimeWarning, match="not in an env's reset or step") as caught:
        batch = await sampler.obtain_exact_episodes(4)
    check_intact(batch, 5)
    assert not [w for w in caught if "blocked the sampler's event loop" in str(w.message)]
    assert sampler.restarts == 0


@pytest.mark.slow
async def test_a_block_of_the_callers_loop_is_not_the_fault_of_a_step_it_outlasts(
    make_sampler: SamplerFactory, tmp_path: Path
) -> None:
    # env 1's steps each await 0.6 s, within step_timeout=1; env 0 blocks the loop for 1.5 s
    # while one is in flight, so that step's timeout comes 0.5 s late: the step gets that time
    # back and ends well, and only the blocking env is counted (LATE_S in backends/aio.py)
    registry = CollectorRegistry()
    envs = [
        [
            functools.partial(BlockingAsyncEnv, str(tmp_path / "block"), seconds=1.5),
            functools.partial(
                BlockingAsyncEnv, str(tmp_path / "hold"), at=1, seconds=0.6, hold=True
            ),
        ]
    ]
    sampler = make_sampler(
        "asyncio", envs, n_workers=1, envs_per_worker=2, step_timeout=1, metrics=registry
    )
    with pytest.warns(RuntimeWarning, match="blocked the sampler's event loop"):
        batch = await sampler.obtain_exact_episodes(2)
    check_intact(batch, 5)
    assert 1 in batch.episode_infos["env"].tolist()  # the held env's episode, whole
    assert value(registry, "env_faults_total", kind="hung") == 1


async def test_aclose_does_not_wait_out_a_blocked_host(
    make_sampler: SamplerFactory, tmp_path: Path
) -> None:
    # no step_timeout: the host's loop blocks (600 s) and nothing kills it during the call; the
    # call is cancelled, and aclose() kills the host once its loop stood still (it could close
    # nothing) instead of waiting close_timeout out (300 s: past the test's timeout); the fixture
    # checks for leaks
    flag = tmp_path / "flag"
    sampler = make_sampler(
        "process",
        functools.partial(BlockingAsyncEnv, str(flag), seconds=600),
        n_workers=1,
        envs_per_worker=2,
        close_timeout=300,
    )
    await sampler.start()
    call = asyncio.ensure_future(sampler.obtain_exact_episodes(4))
    await wait_until(flag.exists, "the block to start")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await sampler.aclose()


def test_a_watch_reports_a_stall_past_its_limit_and_forgets_it_once_it_moves() -> None:
    # a lockstep host's counter: odd while a request is served; looked at by hand
    counter = [1]
    said: list[Any] = []
    watch = Watch(1.0, counter, lambda report, first: said.append((report, first)), serving=True)
    watch.on_move = lambda: said.append("moved")
    start = watch.since
    watch.look(start + 0.5)
    assert said == []  # under the limit
    watch.look(start + 1.5)
    watch.look(start + 1.6)
    assert [first for _, first in said] == [True, False]  # said once, then refreshed
    assert said[0][0].seconds == 1.5
    counter[0] += 1  # the request ended
    watch.look(start + 1.7)
    assert said[-1] == "moved"
    watch.look(start + 5.0)  # idle between requests (even): never a stall
    assert len(said) == 3


def test_a_report_names_the_innermost_line_of_the_envs_own_code() -> None:
    import sys

    def inner() -> Any:
        return sys._getframe()

    report = name_block(inner(), 2.0)
    assert isinstance(report, BlockReport)
    assert report.file == __file__ and report.code == "return sys._getframe()"
    assert report.env is None
    assert report.message().startswith("its host's event loop stood still for 2.0 s at ")
    assert "not in an env's reset or step" in report.message()


async def scraped_live(sampler: Any, registry: CollectorRegistry, n: int) -> None:
    """While ``sampler`` holds ``n`` episodes open mid-call, the scrapes read ``n`` episodes and
    ``n`` env calls in flight, and an oldest episode that ages; then the call is cancelled."""
    await sampler.start()
    call = asyncio.ensure_future(sampler.obtain_fragments(100))
    try:
        await wait_until(
            lambda: (
                value(registry, "episodes_in_flight") == n
                and value(registry, "env_calls_in_flight") == n
            ),
            "every episode and env call in flight, scraped mid-call",
        )
        first = value(registry, "oldest_episode_seconds")
        assert first > 0
        await wait_until(
            lambda: value(registry, "oldest_episode_seconds") > first + 0.1,
            "the oldest episode's age to grow",
        )
        assert not call.done()
    finally:
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call


@pytest.mark.parametrize("backend", ["asyncio", "process", "ray"])
async def test_live_gauges_read_mid_call(
    backend: str, make_sampler: SamplerFactory, request: pytest.FixtureRequest
) -> None:
    # 4 envs each hold their episode open from their 2nd step (an await of 60 s): scraped while
    # the call runs, 4 episodes and 4 env calls are in flight, the oldest episode ages
    if backend == "ray":
        request.getfixturevalue("ray_cluster")  # (a slow variant: it starts the cluster)
    registry = CollectorRegistry()
    sampler = make_sampler(
        backend,
        functools.partial(BlockingAsyncEnv, "-", at=2, hold=True, length=1000),
        n_workers=2,
        envs_per_worker=2,
        metrics=registry,
    )
    await scraped_live(sampler, registry, 4)


@pytest.mark.slow  # the held hosts are killed at aclose (2 s: busy with a step)
async def test_live_gauges_of_lockstep_hosts_read_mid_call(make_sampler: SamplerFactory) -> None:
    # a blocking env on process: each worker's lockstep step holds its 2 envs from the 2nd step
    registry = CollectorRegistry()
    sampler = make_sampler(
        "process",
        functools.partial(BlockingEnv, "-", at=2, hold=True, length=1000),
        n_workers=2,
        envs_per_worker=2,
        metrics=registry,
    )
    await scraped_live(sampler, registry, 4)
