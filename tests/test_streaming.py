"""Streaming, per-call statistics and evaluation."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math

import gymnasium as gym
import numpy as np
import pytest
from envs import SCRIPT, GridWorldEnv, NoisyEnv, ParamAgent, ScriptedAgent
from helpers import SamplerFactory, stays

from asyncsample import EpisodeBatch, SamplerBusyError, StepType

pytestmark = pytest.mark.timeout(60)

SCRIPTED_OBS = [0, 1, 2, 6, 10, 14]


@pytest.fixture(params=["local", "process"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


class CountingAgent(ParamAgent):
    """Counts the steps it is asked for; sets ``reached`` at the ``notify_at``-th."""

    def __init__(self, notify_at: int | None = None) -> None:
        super().__init__()
        self.calls = 0
        self.notify_at = notify_at
        self.reached = asyncio.Event()

    def get_actions(self, observations: np.ndarray):
        self.calls += 1
        if self.notify_at is not None and self.calls >= self.notify_at:
            self.reached.set()
        return super().get_actions(observations)


async def test_stream_yields_whole_episodes_that_span_rounds(
    backend: str, make_sampler: SamplerFactory
) -> None:
    async with make_sampler(backend, agent=ScriptedAgent(), n_workers=2, envs_per_worker=2) as s:
        seen = 0
        async with contextlib.aclosing(s.stream(10)) as batches:
            async for batch in batches:
                assert batch.n_transitions >= 10
                for ep in batch.split():
                    # A quota of 5 per worker cuts episodes of 6 steps: they carry over whole.
                    assert ep.observations.tolist() == SCRIPTED_OBS
                    assert StepType(ep.step_types[0]) == StepType.FIRST
                    assert StepType(ep.step_types[-1]) == StepType.TERMINAL
                seen += 1
                if seen == 5:
                    break
        assert s.total_env_steps == 5 * 24  # 2 workers x 2 envs x 6 steps, every round
        # After the stream the sampler is free again.
        batch = await s.obtain_samples(12)
    assert batch.n_transitions >= 12


async def test_stream_fragments_continue(backend: str, make_sampler: SamplerFactory) -> None:
    async with make_sampler(backend, agent=ScriptedAgent(), n_workers=1, envs_per_worker=1) as s:
        observations: list[int] = []
        async with contextlib.aclosing(s.stream(4, fragments=True)) as batches:
            async for batch in batches:
                observations.extend(batch.observations.tolist())
                if len(observations) >= 12:
                    break
    assert observations[:12] == SCRIPTED_OBS * 2


async def test_agent_updates_during_stream_take_effect_and_are_tagged(
    backend: str, make_sampler: SamplerFactory
) -> None:
    agent = ParamAgent()
    left = np.zeros(16, dtype=np.int64)  # always 'left': stuck in cell 0 until truncated
    async with make_sampler(backend, agent=[agent], n_workers=1, max_episode_length=6) as s:
        versions: list[int] = []
        async with contextlib.aclosing(s.stream(6)) as batches:
            async for batch in batches:
                versions.extend(batch.episode_infos["agent_version"].tolist())
                if batch.episode_infos["agent_version"].max() >= 1:
                    # The episodes of the new version follow the new parameters.
                    new = batch.select(batch.episode_infos["agent_version"] >= 1)
                    assert set(new.observations.tolist()) == {0}
                    break
                await s.update_agent(left)
    assert versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions)


async def test_max_policy_lag_drops_stale_episodes(
    backend: str, make_sampler: SamplerFactory
) -> None:
    # Every round is 6 steps (4 scripted envs, 6-step episodes): the yielded round and three
    # buffered ones are 4 x 6 agent calls.
    agent = CountingAgent(notify_at=4 * 6)
    # per_worker: the agent counts its calls in this process ("auto" would run copies in hosts).
    async with make_sampler(
        backend, agent=[agent], n_workers=1, envs_per_worker=4, inference="per_worker"
    ) as s:
        async with contextlib.aclosing(s.stream(6, max_policy_lag=0, buffer_size=3)) as it:
            first = await anext(it)
            assert first.episode_infos["agent_version"].tolist() == [0] * first.n_episodes
            await agent.reached.wait()  # batches of version 0 have piled up in the buffer
            await s.update_agent(np.asarray(SCRIPT))
            second = await anext(it)
    assert set(second.episode_infos["agent_version"].tolist()) == {1}


@pytest.mark.parametrize("buffer_size", [1, 2])
async def test_an_update_reaches_the_batch_after_the_buffered_ones(
    buffer_size: int, make_sampler: SamplerFactory
) -> None:
    """The update lag the docs state: an update made while the buffer is full first shows in
    the (buffer_size + 2)-th batch after it; the buffer_size + 1 before it (the buffered ones
    and the round that waited to enter the buffer) were sampled under the old version."""
    # Rounds of 4 fragment steps (1 worker x 2 envs x 2 steps): the yielded round, the buffered
    # ones and the one waiting to enter the buffer make buffer_size + 2 rounds of agent calls.
    agent = CountingAgent(notify_at=(buffer_size + 2) * 2)
    async with make_sampler("local", agent=[agent], n_workers=1, envs_per_worker=2) as s:
        stream = s.stream(4, fragments=True, buffer_size=buffer_size)
        async with contextlib.aclosing(stream) as it:
            await anext(it)
            await agent.reached.wait()  # the consumer trains: the buffer fills meanwhile
            calls = -1
            while calls != agent.calls:  # until the producer waits for room in the buffer
                calls = agent.calls
                await stays(lambda: agent.calls == calls, 0.1)  # noqa: B023 (read at once)
            await s.update_agent(np.asarray(SCRIPT))
            old = [await anext(it) for _ in range(buffer_size + 1)]
            new = await anext(it)
    assert [b.agent_versions.tolist() for b in old] == [[0] * 4] * (buffer_size + 1)
    assert set(new.agent_versions.tolist()) == {1}


async def test_slow_consumer_pauses_sampling_and_closing_stops_it(
    backend: str, make_sampler: SamplerFactory
) -> None:
    # One yielded, two buffered, one being produced: four rounds of 6 steps, then a pause.
    agent = CountingAgent(notify_at=4 * 6)
    # per_worker: the agent counts its calls in this process ("auto" would run copies in hosts).
    async with make_sampler(
        backend, agent=[agent], n_workers=1, envs_per_worker=2, inference="per_worker"
    ) as s:
        async with contextlib.aclosing(s.stream(12, buffer_size=2)) as it:
            await anext(it)
            await agent.reached.wait()  # a slow consumer: the buffer has filled meanwhile
            calls = agent.calls
            assert calls <= 5 * 6
            assert await stays(lambda: agent.calls == calls, 0.1)  # paused, not sampling on
        stopped = agent.calls
        assert await stays(lambda: agent.calls == stopped, 0.1)  # closed: stopped for good
        assert s.total_env_steps == 12


async def test_calls_wait_for_an_open_stream(make_sampler: SamplerFactory) -> None:
    async with make_sampler("local", agent=ScriptedAgent(), n_workers=1) as s:
        order: list[str] = []
        outside = contextvars.copy_context()  # not the stream's body (see _stream_guard)
        async with contextlib.aclosing(s.stream(6)) as it:
            await anext(it)
            call = asyncio.get_running_loop().create_task(s.obtain_samples(6), context=outside)
            await anext(it)  # the stream goes on while the call waits...
            assert await stays(lambda: not call.done(), 0.05)  # ...and the call keeps waiting
            order.append("stream closed")
        batch = await call
        order.append("call done")
    assert order == ["stream closed", "call done"]
    assert batch.n_transitions == 6


async def test_stream_argument_errors(make_sampler: SamplerFactory) -> None:
    async with make_sampler("local", agent=ScriptedAgent()) as s:
        with pytest.raises(ValueError, match="num_samples must be >= 1"):
            await anext(s.stream(0))
        with pytest.raises(ValueError, match="max_policy_lag must be >= 0"):
            await anext(s.stream(5, max_policy_lag=-1))
        with pytest.raises(TypeError, match="buffer_size must be an int"):
            await anext(s.stream(5, buffer_size=1.5))  # type: ignore[arg-type]


async def test_stats_beside_each_batch(backend: str, make_sampler: SamplerFactory) -> None:
    async with make_sampler(
        backend, env=NoisyEnv, n_workers=2, envs_per_worker=2, seed=4, max_episode_length=30
    ) as s:
        batch = await s.obtain_exact_episodes(5)
        stats = s.last_stats
        assert stats is not None
        assert stats.episodes == batch.n_episodes == 10
        assert stats.transitions == batch.n_transitions
        assert math.isclose(stats.mean_return, float(batch.returns.mean()))
        assert math.isclose(stats.max_return, float(batch.returns.max()))
        assert stats.max_length == batch.lengths.max()
        assert stats.mean_length == pytest.approx(batch.lengths.mean())
        assert stats.steps_per_second > 0 and stats.seconds > 0
        assert stats.agent_version == 0 and stats.restarts == 0
        # Fragments: episodes finished during the call are counted whole.
        await s.obtain_fragments(40)
        frag_stats = s.last_stats
        assert frag_stats is not None and frag_stats.transitions == 40
        assert set(frag_stats.as_dict()) >= {"episodes", "mean_return", "steps_per_second"}


class FrameEnv(GridWorldEnv):
    """A grid world that renders a tiny rgb_array frame showing its cell."""

    render_mode = "rgb_array"

    def render(self) -> np.ndarray:
        frame = np.zeros((4, 4, 3), dtype=np.uint8)
        frame[divmod(self.state, 4)] = 255
        return frame


class MaybeGreedy(ScriptedAgent):
    """Scripted when asked for deterministic actions, always 'left' otherwise."""

    def get_actions(self, observations: np.ndarray, deterministic: bool = False):
        if deterministic:
            return super().get_actions(observations)
        return np.zeros(len(observations), dtype=np.int64), {}


async def test_evaluate_on_test_envs(backend: str, make_sampler: SamplerFactory) -> None:
    async with make_sampler(
        backend, env=FrameEnv, agent=MaybeGreedy(), n_workers=2, max_episode_length=8
    ) as s:
        result = await s.evaluate(4)
        assert result.returns.tolist() == [1.0] * 4
        assert result.lengths.tolist() == [6] * 4
        assert result.frames is None
        explore = await s.evaluate(2, deterministic=False)
        assert explore.returns.tolist() == [0.0, 0.0]  # stuck in cell 0 until truncated
        video = await s.evaluate(1, render=True)
        assert video.frames is not None
        assert video.frames.shape == (7, 4, 4, 3)
        assert video.frames[0][0, 0].tolist() == [255, 255, 255]  # the start cell
        assert video.frames[-1][3, 3].tolist() == [255, 255, 255]  # the goal cell
        # Evaluation never touched the training envs' data.
        assert s.total_env_steps == 0
    assert s.closed


def test_evaluation_render_needs_rgb_array() -> None:
    from asyncsample.evaluation import RenderingEnvFactory

    with pytest.raises(ValueError, match="render_mode 'rgb_array'"):
        RenderingEnvFactory(NoisyEnv)()
    assert isinstance(RenderingEnvFactory(FrameEnv)(), gym.Wrapper)


def test_batch_select_keeps_chosen_episodes(make_sampler: SamplerFactory) -> None:
    async def sample() -> EpisodeBatch:
        async with make_sampler(
            "local", env=NoisyEnv, n_workers=1, envs_per_worker=3, seed=2, max_episode_length=20
        ) as s:
            return await s.obtain_exact_episodes(4)

    batch = asyncio.run(sample())
    chosen = batch.select([1, 3])
    assert chosen.lengths.tolist() == batch.lengths[[1, 3]].tolist()
    assert chosen.split()[1].equals(batch.split()[3])


@pytest.mark.both_loops
async def test_calls_from_the_stream_body_raise_at_once(make_sampler: SamplerFactory) -> None:
    async with make_sampler(
        "local", agent=ScriptedAgent(), n_workers=1, max_episode_length=20
    ) as s:
        async with contextlib.aclosing(s.stream(6)) as it:
            async for _ in it:
                for call in (
                    lambda: s.obtain_samples(6),
                    lambda: s.obtain_exact_episodes(1),
                    lambda: s.obtain_fragments(6),
                ):
                    with pytest.raises(SamplerBusyError, match="body of an open stream"):
                        await call()
                    # A task the body starts (as wait_for does on Python 3.11) is the body too.
                    with pytest.raises(SamplerBusyError, match="Close the stream first"):
                        await asyncio.wait_for(call(), 5)
                    with pytest.raises(SamplerBusyError):
                        await asyncio.gather(call())
                    with pytest.raises(ExceptionGroup) as group_error:
                        async with asyncio.TaskGroup() as group:
                            group.create_task(call())
                    assert group_error.group_contains(SamplerBusyError)
                # What needs no lock still works: updates, and evaluation on its own envs.
                await s.update_agent(None)
                await s.start()
                evaluation = await asyncio.wait_for(s.evaluate(1), 30)
                assert len(evaluation.lengths) == 1
                break
        # Once the stream is closed the same task samples again.
        batch = await asyncio.wait_for(s.obtain_samples(6), 30)
    assert batch.n_transitions >= 6


@pytest.mark.both_loops
async def test_the_body_is_the_context_the_stream_hands_batches_to(
    make_sampler: SamplerFactory,
) -> None:
    async with make_sampler(
        "local", agent=ScriptedAgent(), n_workers=1, max_episode_length=20
    ) as s:
        before = contextvars.copy_context()  # taken before the stream's first batch
        async with contextlib.aclosing(s.stream(6)) as it:
            async for _ in it:
                # A task the body starts is the body, also when the body does not wait for it.
                started = asyncio.create_task(s.obtain_samples(6))
                await asyncio.sleep(0)
                assert started.done() and isinstance(started.exception(), SamplerBusyError)
                # A task in a context from before the stream is not: it queues behind it.
                loop = asyncio.get_running_loop()
                queued = loop.create_task(s.obtain_samples(6), context=before)
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                assert not queued.done()
                break
        batch = await asyncio.wait_for(queued, 30)
    assert batch.n_transitions >= 6


@pytest.mark.both_loops
async def test_other_tasks_still_queue_behind_the_stream_body(
    make_sampler: SamplerFactory,
) -> None:
    async with make_sampler(
        "local", agent=ScriptedAgent(), n_workers=1, max_episode_length=20
    ) as s:
        outside = asyncio.Event()

        async def later() -> EpisodeBatch:
            await outside.wait()
            return await s.obtain_samples(6)

        task = asyncio.ensure_future(later())  # started before the stream: not its body
        async with contextlib.aclosing(s.stream(6)) as it:
            async for _ in it:
                outside.set()
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                assert not task.done()  # queued behind the stream, not refused
                break
        batch = await asyncio.wait_for(task, 30)
    assert batch.n_transitions >= 6
