"""examples/remote_policy.py: the micro-batcher, the policy app with its agent, the tool env, and
(slow) the whole process tree run from its command line."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from helpers import leaves_nothing

if importlib.util.find_spec("torch") is None:  # found, not imported: torch takes seconds
    pytest.skip("torch is not installed", allow_module_level=True)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load() -> ModuleType:
    """The example as the module ``remote_policy``: importable by name, as the policy server's
    spawned process must import it (a spawned child gets this process's ``sys.path``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.append(str(EXAMPLES))
    return importlib.import_module("remote_policy")


example = load()


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` on 127.0.0.1 (a free port); yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


# -- the micro-batcher ----------------------------------------------------------------------------


def echo(observations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A stand-in policy: action = the observation's first column, log-prob = its negation."""
    return observations[:, 0].astype(np.int64), -observations[:, 0]


async def test_batcher_merges_concurrent_requests_and_answers_each_its_own() -> None:
    batcher = example.MicroBatcher(echo, max_rows=64, max_wait=0.05)
    task = asyncio.create_task(batcher.run())
    try:
        requests = [np.full((1 + i % 3, 3), i, np.float32) for i in range(40)]
        answers = await asyncio.gather(*(batcher.submit(obs) for obs in requests))
    finally:
        task.cancel()
    for i, (obs, (actions, log_probs)) in enumerate(zip(requests, answers, strict=True)):
        assert actions.tolist() == [i] * len(obs) and log_probs.tolist() == [-i] * len(obs)
    stats = batcher.stats()
    assert stats["requests"] == 40 and stats["rows"] == sum(len(r) for r in requests)
    # 79 rows in passes of at most 64 rows: two passes, never a pass per request.
    assert stats["passes"] == 2 and stats["largest_pass"] <= 64


async def test_batcher_passes_when_rows_are_enough_not_at_the_window() -> None:
    batcher = example.MicroBatcher(echo, max_rows=8, max_wait=30.0)
    task = asyncio.create_task(batcher.run())
    try:
        async with asyncio.timeout(5):  # a 30 s window: only "enough rows" can answer in time
            await asyncio.gather(*(batcher.submit(np.zeros((2, 3), np.float32)) for _ in range(4)))
    finally:
        task.cancel()
    assert batcher.stats()["passes"] == 1


async def test_batcher_window_answers_a_lone_request() -> None:
    batcher = example.MicroBatcher(echo, max_rows=1024, max_wait=0.002)
    task = asyncio.create_task(batcher.run())
    try:
        async with asyncio.timeout(5):
            for _ in range(3):
                await batcher.submit(np.zeros((1, 3), np.float32))
    finally:
        task.cancel()
    assert batcher.stats()["passes"] == 3


async def test_batcher_reports_a_failed_pass_to_every_request() -> None:
    def broken(observations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise RuntimeError("forward failed")

    batcher = example.MicroBatcher(broken, max_rows=64, max_wait=0.01)
    task = asyncio.create_task(batcher.run())
    try:
        results = await asyncio.gather(
            *(batcher.submit(np.zeros((1, 3), np.float32)) for _ in range(5)),
            return_exceptions=True,
        )
    finally:
        task.cancel()
    assert all(isinstance(r, RuntimeError) for r in results)


# -- the policy app and its agent, the tool service and its env (in this process) -----------------


# Slow: the policy imports torch (10-25 s of the default run on a loaded 2-core machine). The
# default run keeps the micro-batcher the app serves (the tests above) and the example's aiohttp
# client and server (the tool env below); the slow pass runs the app and agent here and in the
# policy server's own process (test_policy_server_process_starts_serves_and_stops).
@pytest.mark.slow
async def test_agent_gets_actions_from_the_policy_app() -> None:
    app = example.create_policy_app(example.PolicyConfig(seed=0, batch_wait_ms=5.0))
    async with serving(app) as url, aiohttp.ClientSession() as session:
        agent = example.RemotePolicyAgent(session, url)
        observations = np.random.default_rng(0).uniform(-1, 1, (8, example.OBS_DIM))
        answers = await asyncio.gather(*(agent.get_actions(observations[i::4]) for i in range(4)))
        for actions, infos in answers:
            assert actions.shape == (2,) and set(actions.tolist()) <= {0, 1}
            assert infos["logp"].shape == (2,) and (infos["logp"] <= 0).all()
        agent.reset(np.ones(2, bool))
        async with session.get(f"{url}/stats") as response:
            stats = await response.json()
    assert stats["requests"] == 4 and stats["rows"] == 8 and stats["passes"] < 4


async def run_episode(env: Any, seed: int) -> tuple[list[Any], list[Any]]:
    obs, _ = await env.reset(seed=seed)
    observations, steps = [obs], []
    actions = np.random.default_rng(seed)
    while True:
        obs, reward, terminated, truncated, _ = await env.step(int(actions.integers(2)))
        observations.append(obs)
        steps.append((reward, terminated, truncated))
        if terminated or truncated:
            return observations, steps


async def test_tool_env_awaits_the_tool_and_is_reproducible() -> None:
    async with example.ToolService() as tool, aiohttp.ClientSession() as session:
        env = example.make_env(session, tool.url)
        assert env.max_episode_steps == example.MAX_EPISODE_STEPS
        first = await run_episode(env, seed=3)
        calls = tool.calls
        assert calls == len(first[1]) + 1  # one call per step and one per reset
        again = await run_episode(example.make_env(session, tool.url), seed=3)
        # 20 envs at once: their calls overlap (each waits 2-8 ms; in sequence at least 40 ms
        # per step round) and each episode is still its seed's.
        many = await asyncio.gather(
            *(run_episode(example.make_env(session, tool.url), s) for s in range(20))
        )
    assert all(np.array_equal(a, b) for a, b in zip(first[0], again[0], strict=True))
    assert first[1] == again[1]
    assert np.array_equal(many[3][0], first[0]) and many[3][1] == first[1]
    for observations, steps in many:
        assert all(env.observation_space.contains(o) for o in observations)
        assert steps[-1][1] or steps[-1][2]
        assert len(steps) <= example.MAX_EPISODE_STEPS


# -- the whole tree (a child process for the policy), as a user runs it ---------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_policy_server_process_starts_serves_and_stops() -> None:
    async with (
        example.PolicyServer(example.PolicyConfig()) as policy,
        aiohttp.ClientSession() as session,
    ):
        agent = example.RemotePolicyAgent(session, policy.url)
        observations = np.zeros((32, example.OBS_DIM), np.float32)
        answers = await asyncio.gather(
            *(agent.get_actions(observations[i : i + 1]) for i in range(32))
        )
        assert all(a.shape == (1,) for a, _ in answers)
        async with session.get(f"{policy.url}/stats") as response:
            stats = await response.json()
        process = policy._process
    assert stats["requests"] == 32 and stats["passes"] < 32
    assert policy.exitcode == 0 and not process.is_alive()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_remote_policy_example_runs_end_to_end(tmp_path: Path) -> None:
    command = [sys.executable, str(EXAMPLES / "remote_policy.py"), "--quick"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    iterations = re.findall(r"iteration (\d+): (\d+) steps, (\d+) episodes", out)
    assert [int(i) for i, _, _ in iterations] == [1, 2]
    assert all(int(steps) >= 1_000 and int(eps) >= 1 for _, steps, eps in iterations)
    match = re.search(r"policy server: (\d+) requests .* (\d+) forward passes", out)
    assert match is not None, out
    requests, passes = int(match.group(1)), int(match.group(2))
    assert 0 < passes < requests  # concurrent requests shared forward passes
    calls = re.search(r"tool service: (\d+) calls", out)
    assert calls is not None and int(calls.group(1)) >= 2_000
    assert "policy server exited with code 0" in out


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_remote_policy_run_in_this_loop_leaves_nothing_running() -> None:
    """The example's ``run`` under the test's loop (asyncio's and uvloop): figures, then no task
    and no child process left."""
    args = example.parse_args(
        ["--quick", "--iterations", "1", "--steps", "400", "--episode-timeout", "120"]
    )
    with leaves_nothing(collect=False):
        figures = await example.run(args)
    assert asyncio.all_tasks() == {asyncio.current_task()}
    (row,) = figures["iterations"]
    assert row["steps"] >= 400 and row["episodes"] >= 1
    assert 0 <= row["found"] <= row["episodes"] and row["deadline"] == 0
    assert row["mean_episode_seconds"] > 0
    assert figures["policy"]["passes"] < figures["policy"]["requests"]
    assert figures["tool_calls"] >= 400 and figures["policy_exitcode"] == 0
