"""Checkpoint and resume (docs/checkpoint.md): a resumed sampler continues bit for bit; episodes
in flight come back by snapshot or replay, or are dropped and counted; damaged files and states
of another shape are refused; a trainer killed with SIGKILL continues from its last checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings
from typing import Any

import cloudpickle
import numpy as np
import pytest
from async_envs import RandomLengthAsyncEnv, RandomLengthEnv
from checkpoint_trainer import ObservingAgent, train
from helpers import leaves_nothing

import asyncsample
from asyncsample import (
    CheckpointError,
    EpisodeBatch,
    Replayable,
    Sampler,
    SamplerState,
    StepType,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TESTS = os.path.dirname(os.path.abspath(__file__))


class SnapshotRandomLengthEnv(RandomLengthEnv):
    """:class:`RandomLengthEnv` that hands out its whole state (the snapshot protocol)."""

    def get_state(self) -> dict[str, Any]:
        logic = self.logic
        return {
            "t": logic.t,
            "length": logic.length,
            "rng": self.np_random.bit_generator.state,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self.logic.t, self.logic.length = state["t"], state["length"]
        self.np_random.bit_generator.state = state["rng"]


class SnapshotRandomLengthAsyncEnv(RandomLengthAsyncEnv):
    """The async twin, with coroutine ``get_state``/``set_state``."""

    async def get_state(self) -> dict[str, Any]:
        return {
            "t": self.logic.t,
            "length": self.logic.length,
            "rng": self.np_random.bit_generator.state,
        }

    async def set_state(self, state: dict[str, Any]) -> None:
        self.logic.t, self.logic.length = state["t"], state["length"]
        self.np_random.bit_generator.state = state["rng"]


def blocking() -> RandomLengthEnv:
    return RandomLengthEnv(2, 12)


def asynchronous() -> RandomLengthAsyncEnv:
    return RandomLengthAsyncEnv(2, 12)


def snapshot_env() -> SnapshotRandomLengthEnv:
    return SnapshotRandomLengthEnv(2, 12)


def snapshot_async_env() -> SnapshotRandomLengthAsyncEnv:
    return SnapshotRandomLengthAsyncEnv(2, 12)


def make(backend: str, env: Any, resume: SamplerState | None = None, **kwargs: Any) -> Sampler:
    options: dict[str, Any] = {
        "n_workers": 2,
        "envs_per_worker": 3,
        "seed": 7,
        "n_processes": 2,
        "backend": backend,
        "resume": resume,
        # Bit for bit needs the fixed split: without it the steps in flight at a checkpoint
        # drop (test_a_checkpoint_without_fixed_shares_drops_the_steps_in_flight).
        "fixed_shares": True,
    }
    options.update(kwargs)
    agent = options.pop("agent", ObservingAgent())
    return Sampler(env, agent, **options)


async def run(sampler: Sampler, how: str, n: int, at: int | None = None) -> tuple[list, Any]:
    """``n`` batches of ``how`` (a stream, or calls); the state taken after batch ``at``."""
    out: list[EpisodeBatch] = []
    state = None
    if how.startswith("stream"):
        stream = sampler.stream(20, fragments=how == "stream-fragments")
        async with contextlib.aclosing(stream) as it:
            async for batch in it:
                out.append(batch)
                if len(out) == at:
                    state = await sampler.checkpoint()
                if len(out) == n:
                    break
        return out, state
    for _ in range(n):
        if how == "fragments":
            out.append(await sampler.obtain_fragments(20))
        elif how == "episodes":
            out.append(await sampler.obtain_exact_episodes(2))
        else:
            out.append(await sampler.obtain_samples(20))
        if len(out) == at:
            state = await sampler.checkpoint()
    return out, state


def assert_same(expected: list[EpisodeBatch], got: list[EpisodeBatch]) -> None:
    assert len(expected) == len(got)
    for k, (a, b) in enumerate(zip(expected, got)):
        assert a.equals(b), f"batch {k} after the resume differs from the uninterrupted run's"


async def resumed_equals_uninterrupted(
    backend: str, env: Any, how: str, tmp_path: Any, **kwargs: Any
) -> SamplerState:
    """Run 6 batches straight; run 3, checkpoint, save, load, resume for 3: the same batches."""
    async with make(backend, env, **kwargs) as sampler:
        full, _ = await run(sampler, how, 6)
    async with make(backend, env, **kwargs) as sampler:
        head, state = await run(sampler, how, 4, at=3)
    assert state is not None
    assert_same(full[:4], head)  # taking the checkpoint did not disturb the run
    path = tmp_path / "sampler.state"
    assert state.save(path) == path.stat().st_size
    loaded = SamplerState.load(path)
    async with make(backend, env, resume=loaded, **kwargs) as sampler:
        tail, _ = await run(sampler, how, 3)
        assert sampler.total_env_steps == sum(b.n_transitions for b in full)
        report = sampler.resumed
    assert report is not None and report.dropped == 0
    assert_same(full[3:], tail)
    return loaded


# -- bit for bit after a resume, per backend, call mode and in-flight way ----------------------


@pytest.mark.parametrize("how", ["stream", "stream-fragments", "fragments", "samples", "episodes"])
async def test_local_replay_resumes_bit_for_bit(how: str, tmp_path: Any) -> None:
    state = await resumed_equals_uninterrupted("local", Replayable(blocking), how, tmp_path)
    if how != "episodes":  # exact episodes leave nothing running
        assert state.counts()["replay"] > 0


async def test_random_agent_state_is_resumed(tmp_path: Any) -> None:
    # The built-in RandomAgent's generator (and the draws it made ahead) are in the state.
    await resumed_equals_uninterrupted(
        "local", Replayable(blocking), "samples", tmp_path, agent=None
    )


@pytest.mark.parametrize(
    "how",
    # fragments on process: slow, a twin of the async envs' fragments on process and of local's
    ["stream", pytest.param("fragments", marks=pytest.mark.slow)],
)
async def test_process_replay_resumes_bit_for_bit(how: str, tmp_path: Any) -> None:
    with leaves_nothing(collect=False):
        await resumed_equals_uninterrupted("process", Replayable(blocking), how, tmp_path)


@pytest.mark.parametrize("backend", ["asyncio", "process"])
async def test_async_envs_resume_bit_for_bit_in_fixed_shares(backend: str, tmp_path: Any) -> None:
    # Async envs (asyncio's lanes, and lanes in the process hosts): a stream of fragments.
    await resumed_equals_uninterrupted(
        backend, Replayable(asynchronous), "stream-fragments", tmp_path
    )


@pytest.mark.parametrize(
    ("backend", "env"),
    [
        ("local", snapshot_env),  # the blocking envs' group restores the step count, as on:
        pytest.param("process", snapshot_env, marks=pytest.mark.slow),
        ("asyncio", snapshot_async_env),
        ("process", snapshot_async_env),  # async envs in the hosts' event loops
    ],
)
async def test_snapshot_envs_resume_bit_for_bit(backend: str, env: Any, tmp_path: Any) -> None:
    state = await resumed_equals_uninterrupted(
        backend, env, "stream-fragments", tmp_path, max_episode_length=6
    )
    counts = state.counts()
    assert counts["snapshot"] >= 5 and counts["replay"] == counts["drop"] == 0


def short() -> RandomLengthEnv:
    return RandomLengthEnv(1, 4)


async def test_envs_updated_before_the_checkpoint_come_back_updated() -> None:
    async def calls(sampler: Sampler, n: int, at: int | None = None) -> tuple[list, Any]:
        out, state = [], None
        for k in range(n):
            update = Replayable(short) if k == 1 else None
            out.append(await sampler.obtain_fragments(20, env_update=update))
            if k + 1 == at:
                state = await sampler.checkpoint()
        return out, state

    async with make("local", Replayable(blocking)) as sampler:
        full, _ = await calls(sampler, 5)
    async with make("local", Replayable(blocking)) as sampler:
        _, state = await calls(sampler, 3, at=3)
    assert state.workers[0].chains is not None
    async with make("local", Replayable(blocking), resume=state) as sampler:
        tail = [await sampler.obtain_fragments(20) for _ in range(2)]
    assert_same(full[3:], tail)


async def test_a_state_taken_on_local_resumes_on_process() -> None:
    # Their batches are the same (the reproducibility rule): so are the states.
    async with make("local", Replayable(blocking)) as sampler:
        full, _ = await run(sampler, "stream", 5)
    async with make("local", Replayable(blocking)) as sampler:
        _, state = await run(sampler, "stream", 3, at=3)
    with leaves_nothing(collect=False):
        async with make("process", Replayable(blocking), resume=state) as sampler:
            tail, _ = await run(sampler, "stream", 2)
    assert_same(full[3:], tail)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stream", "fragments"])
async def test_ray_replay_resumes_bit_for_bit(how: str, tmp_path: Any, ray_cluster: Any) -> None:
    await resumed_equals_uninterrupted("ray", Replayable(blocking), how, tmp_path)


async def test_dropped_episodes_are_counted_and_warned_never_half_recorded() -> None:
    async with make("local", blocking) as sampler:
        _, state = await run(sampler, "stream", 3, at=3)
    assert state is not None
    in_flight = state.counts()["drop"]
    assert in_flight > 0 and state.counts()["replay"] == state.counts()["snapshot"] == 0
    with pytest.warns(RuntimeWarning, match=rf"{in_flight} episode\(s\) in flight were dropped"):
        sampler = make("local", blocking, resume=state)
        await sampler.start()
    async with sampler:
        report = sampler.resumed
        assert report is not None and report.dropped == in_flight
        assert report.dropped_steps == sum(
            int(w.lengths[i])
            for w in state.workers
            for i, e in enumerate(w.envs)
            if e.how == "drop"
        )
        assert sampler.workers[0].episodes.dropped_steps >= 0
        tail, _ = await run(sampler, "stream", 2)
    for batch in tail:  # every episode of the resumed stream starts with its first step
        starts = np.concatenate([[0], np.cumsum(batch.lengths)[:-1]])
        assert (batch.step_types[starts] == StepType.FIRST).all()
        assert batch.n_transitions == int(batch.lengths.sum())


async def test_a_lane_stream_of_complete_episodes_drops_the_episodes_inside_a_step() -> None:
    # Steps run on between the rounds of such a stream: those episodes cannot be read and are
    # dropped at resume (counted); the others come back, and no episode comes out half-made.
    async with make("asyncio", Replayable(asynchronous)) as sampler:
        _, state = await run(sampler, "stream", 3, at=3)
    assert state is not None
    counts = state.counts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        async with make("asyncio", Replayable(asynchronous), resume=state) as sampler:
            tail, _ = await run(sampler, "stream", 3)
            report = sampler.resumed
    assert report is not None and report.dropped == counts["drop"]
    assert report.replay == counts["replay"] and counts["replay"] + counts["drop"] > 0
    for batch in tail:
        starts = np.concatenate([[0], np.cumsum(batch.lengths)[:-1]])
        assert (batch.step_types[starts] == StepType.FIRST).all()


# -- one instant ---------------------------------------------------------------------------------


async def test_a_checkpoint_during_a_call_waits_for_it() -> None:
    async with make("local", Replayable(blocking)) as sampler:
        await sampler.start()
        call = asyncio.ensure_future(sampler.obtain_samples(200))
        await asyncio.sleep(0)  # the call holds the sampler
        state = await sampler.checkpoint()
        batch = await call
        assert state.total_env_steps == batch.n_transitions == sampler.total_env_steps


async def test_a_stream_checkpoint_keeps_the_batches_it_buffered() -> None:
    # buffer_size=3: rounds sampled ahead of the consumer are in the state, yielded first later.
    async with make("local", Replayable(blocking)) as sampler:
        full, _ = await run(sampler, "stream", 7)
    async with make("local", Replayable(blocking)) as sampler:
        stream = sampler.stream(20, buffer_size=3)
        async with contextlib.aclosing(stream) as it:
            head = [await it.__anext__()]
            for _ in range(50):  # let the producer fill its buffer
                await asyncio.sleep(0)
            state = await sampler.checkpoint()
    assert state.stream is not None and len(state.stream.pending) >= 1
    async with make("local", Replayable(blocking), resume=state) as sampler:
        with pytest.raises(CheckpointError, match="num_samples=20"):
            await sampler.obtain_samples(5)  # the batches kept are a stream's: never lost
        with pytest.raises(CheckpointError, match="open it with those arguments"):
            await sampler.stream(21).__anext__()
        tail, _ = await run(sampler, "stream", 6)
    assert_same(full, head + tail)


class BreakingEnv(RandomLengthEnv):
    """Raises from its 40th step on."""

    def step(self, action: Any) -> Any:
        if self.logic.steps_taken >= 40:
            raise RuntimeError("broken")
        return super().step(action)


def breaking() -> BreakingEnv:
    return BreakingEnv(2, 12)


async def test_a_failed_host_is_refused_and_a_failing_stream_never_hangs_a_checkpoint() -> None:
    async with make("local", breaking, max_restarts=0, n_workers=1) as sampler:
        with pytest.raises(asyncsample.WorkerError):
            for _ in range(20):
                await sampler.obtain_samples(20)
        with pytest.raises(CheckpointError, match="failed env host not rebuilt"):
            await sampler.checkpoint()  # never a state of a host that failed
    async with make("local", breaking, max_restarts=0, n_workers=1) as sampler:
        stream = sampler.stream(20, buffer_size=1)
        async with contextlib.aclosing(stream) as it:
            await it.__anext__()
            with pytest.raises((CheckpointError, asyncsample.WorkerError)):
                for _ in range(20):  # each checkpoint returns, or is refused once it fails
                    await sampler.checkpoint()
                    await it.__anext__()


# -- refused -------------------------------------------------------------------------------------


async def test_a_state_of_another_shape_is_refused_naming_the_difference() -> None:
    async with make("local", Replayable(blocking)) as sampler:
        state = await sampler.checkpoint()
    cases = [
        ({"n_workers": 3}, "n_workers=2, this sampler has n_workers=3"),
        ({"envs_per_worker": 2}, "envs_per_worker=3, this sampler has envs_per_worker=2"),
        ({"max_episode_length": 5}, "max_episode_length=None, this sampler has max_episode_le"),
        ({"seed": 8}, "seed=7, this sampler has seed=8"),
    ]
    for kwargs, message in cases:
        with pytest.raises(CheckpointError, match=message):
            async with make("local", Replayable(blocking), resume=state, **kwargs) as other:
                await other.start()
    with pytest.raises(CheckpointError, match="observation_space"):
        async with make("local", "CartPole-v1", resume=state) as other:
            await other.start()
    with pytest.raises(TypeError, match="resume must be a SamplerState"):
        make("local", blocking, resume={"seed": 7})


def test_corrupt_truncated_and_foreign_files_are_refused(tmp_path: Any) -> None:
    async def take() -> SamplerState:
        async with make("local", Replayable(blocking)) as sampler:
            await sampler.obtain_fragments(20)
            return await sampler.checkpoint()

    state = asyncio.run(take())
    path = tmp_path / "good.state"
    size = state.save(path)
    data = path.read_bytes()
    assert len(data) == size and not list(tmp_path.glob(".asyncsample-state-*"))
    corrupt = tmp_path / "corrupt.state"
    flipped = bytearray(data)
    flipped[-10] ^= 0xFF
    corrupt.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"corrupt\.state' is corrupt: its checksum"):
        SamplerState.load(corrupt)
    truncated = tmp_path / "truncated.state"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated\.state' is truncated or overlong"):
        SamplerState.load(truncated)
    header_only = tmp_path / "header.state"
    header_only.write_bytes(data[:20])
    with pytest.raises(CheckpointError, match="shorter than the header"):
        SamplerState.load(header_only)
    foreign = tmp_path / "foreign.state"
    foreign.write_bytes(pickle.dumps({"not": "a state"}))
    with pytest.raises(CheckpointError, match="not a sampler state file"):
        SamplerState.load(foreign)
    assert isinstance(SamplerState.load(path), SamplerState)
    assert issubclass(CheckpointError, asyncsample.AsyncSampleError)


# -- a trainer killed with SIGKILL ---------------------------------------------------------------


def _wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _trainer(out: Any, backend: str, loop: str, *extra: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [TESTS, env.get("PYTHONPATH", "")] if p)
    command = [sys.executable, os.path.join(TESTS, "checkpoint_trainer.py")]
    command += ["--backend", backend, "--out", str(out), "--loop", loop, *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize(
    ("backend", "fragments"),
    [
        ("local", False),
        # The costly twins (three interpreters each; on "process", env hosts outliving the
        # killed trainer for a while): slow. The in-process resumes on "process" and of async
        # envs on "asyncio" (test_async_envs_resume_bit_for_bit_in_fixed_shares) stay.
        pytest.param("process", False, marks=pytest.mark.slow),
        pytest.param("asyncio", True, marks=pytest.mark.slow),
    ],
)
async def test_a_trainer_killed_mid_stream_continues_from_its_checkpoint(
    backend: str, fragments: bool, tmp_path: Any, request: pytest.FixtureRequest
) -> None:
    loop = "uvloop" if "uvloop" in request.node.name else "asyncio"
    n, every = 8, 2
    run_args = ["--batches", str(n), "--every", str(every)]
    run_args += ["--fragments"] if fragments else []
    expected = await train(backend, None, n, every, fragments=fragments)
    with leaves_nothing(collect=False):
        # A slow trainer (each batch blocks it 0.2 s), killed once a checkpoint is on disk.
        killed = _trainer(tmp_path, backend, loop, *run_args, "--delay", "0.2")
        try:
            latest = tmp_path / "LATEST"
            await asyncio.to_thread(
                _wait_for, lambda: latest.exists() or killed.poll() is not None, 60, "LATEST"
            )
            assert killed.poll() is None, killed.communicate()[1].decode()[-2000:]
            killed.send_signal(signal.SIGKILL)
        finally:
            killed.kill()
            killed.communicate()
        assert killed.returncode == -signal.SIGKILL
        step = latest.read_text()
        resumed_from = int(step.split("-")[1])
        assert resumed_from < n
        resumed = _trainer(tmp_path, backend, loop, *run_args, "--resume")
        _, err = await asyncio.to_thread(resumed.communicate, timeout=90)
        assert resumed.returncode == 0, err.decode()[-3000:]
    got = [pickle.loads((tmp_path / f"batch-{i}.pkl").read_bytes()) for i in range(n)]
    assert_same(expected, got)


# -- the study ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_checkpoint_study_runs_quick(tmp_path: Any) -> None:
    """``python -m benchmarks.checkpoint --quick``: every way measured, results written."""
    import json

    sys.path.insert(0, os.path.dirname(TESTS))
    from benchmarks.checkpoint import WAYS, main

    assert main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert [r["way"] for r in result["rows"]] == list(WAYS)
    for row in result["rows"]:
        assert row["in_flight"] == 100 and row["bytes"] > 0 and row["checkpoint_s"] > 0
    came = {r["way"]: r["resumed"] for r in result["rows"]}
    assert came["replay"]["replay"] == came["snapshot"]["snapshot"] == came["drop"]["dropped"]
    assert "| replay | 100 |" in (tmp_path / "results.md").read_text()
