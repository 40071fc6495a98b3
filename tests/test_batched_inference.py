"""``Sampler(inference="batched")``: one merged agent call for the workers' concurrent requests."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from typing import Any

import cloudpickle
import numpy as np
import pytest
from envs import DictObsEnv, NoisyEnv
from helpers import SamplerFactory

from asyncsample import EpisodeBatch, Sampler, _batcher
from asyncsample.inference import Batched

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.sampler_defaults(
        env=NoisyEnv, n_workers=4, envs_per_worker=2, max_episode_length=30, seed=7
    ),
]

# The dict-observation env below must reach the env-host processes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class LinearAgent:
    """Actions depend only on the observation rows; records the rows of every call."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def act(self, observations: Any) -> np.ndarray:
        obs = observations["pos"] if isinstance(observations, dict) else observations
        obs = np.asarray(obs)
        self.calls.append(len(obs))
        return (np.floor((obs[:, 0] + 1.0) * 1.5).astype(np.int64)).clip(0, 2)

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        actions = self.act(observations)
        return actions, {"twice": actions * 2}


class AsyncLinearAgent(LinearAgent):
    """:class:`LinearAgent` behind an ``async def`` that yields to the loop."""

    async def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:  # type: ignore[override]
        await asyncio.sleep(0)
        return super().get_actions(observations)


class RngAgent:
    """A stochastic agent with one internal generator."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return self.rng.integers(0, 3, len(observations)), {}


def assert_equal_batches(a: EpisodeBatch, b: EpisodeBatch) -> None:
    assert np.array_equal(a.lengths, b.lengths)
    for x, y in ((a.observations, b.observations), (a.last_observations, b.last_observations)):
        if isinstance(x, dict):
            for k in x:
                assert np.array_equal(x[k], y[k])
        else:
            assert np.array_equal(x, y)
    assert np.array_equal(a.actions, b.actions)
    assert np.array_equal(a.rewards, b.rewards)
    assert np.array_equal(a.agent_infos["twice"], b.agent_infos["twice"])
    assert np.array_equal(a.episode_infos["worker"], b.episode_infos["worker"])


async def three_calls(sampler: Sampler) -> list[EpisodeBatch]:
    async with sampler:
        return [
            await sampler.obtain_samples(200),
            await sampler.obtain_exact_episodes(3),
            await sampler.obtain_fragments(100),
            await sampler.obtain_fragments(100),
        ]


MODES = [
    ("sync", Batched("lockstep")),
    ("threaded", Batched("lockstep", threaded=True)),
    ("async", Batched("lockstep")),
    ("sync", Batched("eager")),
    ("threaded", Batched("eager", threaded=True)),
    ("async", Batched("eager")),
]


@pytest.mark.parametrize("backend", ["local", "process"])
@pytest.mark.parametrize(("call", "options"), MODES, ids=[f"{c}-{o.flush}" for c, o in MODES])
async def test_deterministic_agent_matches_per_worker(
    backend: str, call: str, options: Batched, make_sampler: SamplerFactory
) -> None:
    agent_cls = AsyncLinearAgent if call == "async" else LinearAgent
    expected = await three_calls(make_sampler(backend, agent=agent_cls()))
    agent = agent_cls()
    got = await three_calls(make_sampler(backend, agent=agent, inference=options))
    for a, b in zip(expected, got):
        assert_equal_batches(a, b)
    # Some calls merged several workers' rows (2 per worker here).
    assert max(agent.calls) > 2


@pytest.mark.parametrize("backend", ["local", "process"])
async def test_dict_observations_match_per_worker(
    backend: str, make_sampler: SamplerFactory
) -> None:
    expected = await three_calls(make_sampler(backend, agent=LinearAgent(), env=DictObsEnv))
    got = await three_calls(
        make_sampler(backend, agent=LinearAgent(), inference="batched", env=DictObsEnv)
    )
    for a, b in zip(expected, got):
        assert_equal_batches(a, b)


@pytest.mark.parametrize("backend", ["local", "process"])
async def test_lockstep_merges_every_worker(backend: str, make_sampler: SamplerFactory) -> None:
    agent = LinearAgent()
    # Fragments: every worker steps its envs the same number of times, in lockstep.
    async with make_sampler(
        backend, agent=agent, inference="batched", env=DictObsEnv, n_workers=4
    ) as sampler:
        await sampler.obtain_fragments(4 * 2 * 10)
    assert agent.calls == [8] * 10


@pytest.mark.parametrize("backend", ["local", "process"])
async def test_eager_merges_several_workers(backend: str, make_sampler: SamplerFactory) -> None:
    agent = LinearAgent()
    async with make_sampler(
        backend, agent=agent, inference=Batched("eager"), n_workers=4
    ) as sampler:
        await sampler.obtain_fragments(4 * 2 * 50)
        stats = sampler._batcher.stats  # type: ignore[union-attr]
    assert sum(agent.calls) == 4 * 2 * 50
    assert stats.rows == 4 * 2 * 50
    assert stats.mean_workers > 1.0  # calls merged more than one worker on average


@pytest.mark.parametrize("backend", ["local", "process"])
async def test_stochastic_agent_is_reproducible_in_lockstep(
    backend: str, make_sampler: SamplerFactory
) -> None:
    async def run() -> list[EpisodeBatch]:
        async with make_sampler(backend, agent=RngAgent(3), inference="batched") as sampler:
            return [await sampler.obtain_samples(300), await sampler.obtain_fragments(100)]

    first, second = await run(), await run()
    for a, b in zip(first, second):
        assert np.array_equal(a.actions, b.actions)
        assert np.array_equal(a.observations, b.observations)


class FailingAgent(LinearAgent):
    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        if len(self.calls) == self.fail_at:
            self.calls.append(-1)
            raise RuntimeError("agent exploded")
        return super().get_actions(observations)


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("backend", ["local", "process"])
async def test_agent_error_reaches_the_call_and_sampler_stays_usable(
    backend: str, threaded: bool, make_sampler: SamplerFactory
) -> None:
    agent = FailingAgent(fail_at=5)
    async with make_sampler(backend, agent=agent, inference=Batched(threaded=threaded)) as sampler:
        with pytest.raises(RuntimeError, match="agent exploded"):
            await sampler.obtain_samples(500)
        batch = await sampler.obtain_samples(200)
    assert batch.n_transitions >= 200
    assert np.array_equal(batch.actions, LinearAgent().act(batch.observations))


class WrongRows(LinearAgent):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        actions, infos = super().get_actions(observations)
        if self.what == "actions":
            return actions[:-1], infos
        return actions, {"twice": infos["twice"][:1]}


@pytest.mark.parametrize("what", ["actions", "infos"])
async def test_wrong_number_of_rows_is_a_value_error_naming_the_workers(
    what: str, make_sampler: SamplerFactory
) -> None:
    async with make_sampler("local", agent=WrongRows(what), inference="batched") as sampler:
        with pytest.raises(ValueError, match=r"workers 0, 1, 2, 3.*raised in worker \d") as info:
            await sampler.obtain_samples(100)
        assert ("action" if what == "actions" else "agent info 'twice'") in str(info.value)
    # The sampler is still usable after the error (a fresh agent this time).
    async with make_sampler("local", agent=WrongRows(what), inference="batched") as sampler:
        await sampler.update_agent(LinearAgent())
        assert (await sampler.obtain_samples(50)).n_transitions >= 50


class ParamLinear(LinearAgent):
    def __init__(self) -> None:
        super().__init__()
        self.offset = 0

    def act(self, observations: Any) -> np.ndarray:
        return (super().act(observations) + self.offset) % 3

    def get_param_values(self) -> np.ndarray:
        return np.array([self.offset])

    def set_param_values(self, params: Any) -> None:
        self.offset = int(np.asarray(params)[0])


@pytest.mark.parametrize("threaded", [False, True])
async def test_agent_updates_parameters_and_new_agent(
    threaded: bool, make_sampler: SamplerFactory
) -> None:
    agent = ParamLinear()
    async with make_sampler(
        "process", agent=agent, inference=Batched(threaded=threaded)
    ) as sampler:
        batch = await sampler.obtain_samples(100, agent_update=np.array([1]))
        assert agent.offset == 1
        assert np.array_equal(batch.actions, (LinearAgent().act(batch.observations) + 1) % 3)
        assert set(batch.episode_infos["agent_version"].tolist()) == {1}
        other = LinearAgent()
        batch = await sampler.obtain_samples(100, agent_update=other)
        assert np.array_equal(batch.actions, LinearAgent().act(batch.observations))
        assert sum(other.calls) >= 100
        with pytest.raises(ValueError, match="inference='batched' shares one agent"):
            await sampler.obtain_samples(10, agent_update=[None] * 4)


class BlockingAsyncAgent(LinearAgent):
    def __init__(self) -> None:
        super().__init__()
        self.block = False
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:  # type: ignore[override]
        if self.block:
            self.entered.set()
            await self.release.wait()
        return super().get_actions(observations)


class BlockingThreadAgent(LinearAgent):
    def __init__(self) -> None:
        super().__init__()
        self.block = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        if self.block:
            self.entered.set()
            self.release.wait(30)
        return super().get_actions(observations)


@pytest.mark.parametrize("kind", ["async", "threaded"])
@pytest.mark.parametrize("backend", ["local", "process"])
async def test_cancelled_call_leaves_no_stuck_request(
    backend: str, kind: str, make_sampler: SamplerFactory
) -> None:
    agent: Any = BlockingAsyncAgent() if kind == "async" else BlockingThreadAgent()
    options = Batched(threaded=kind == "threaded")
    async with make_sampler(backend, agent=agent, inference=options) as sampler:
        await sampler.obtain_samples(50)
        agent.block = True
        task = asyncio.ensure_future(sampler.obtain_samples(10_000))
        if kind == "async":
            await agent.entered.wait()
        else:
            await asyncio.get_running_loop().run_in_executor(None, agent.entered.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        agent.block = False
        agent.release.set()
        batch = await asyncio.wait_for(sampler.obtain_samples(200), 30)
    assert batch.n_transitions >= 200
    assert np.array_equal(batch.actions, LinearAgent().act(batch.observations))
    assert np.all(batch.lengths >= 1)


async def test_stream_with_batched_inference(make_sampler: SamplerFactory) -> None:
    agent = ParamLinear()
    async with make_sampler("process", agent=agent, inference="batched") as sampler:
        async with contextlib.aclosing(sampler.stream(100)) as it:
            n = 0
            async for batch in it:
                base = LinearAgent().act(batch.observations)
                if n < 2:  # before the update
                    assert np.array_equal(batch.actions, base)
                else:  # steps before and after the update (at a step boundary) in one batch
                    assert np.all((batch.actions == base) | (batch.actions == (base + 2) % 3))
                n += 1
                if n == 2:
                    await sampler.update_agent(np.array([2]))
                if n == 4:
                    break
        assert agent.offset == 2
        batch = await sampler.obtain_samples(100)
        assert np.array_equal(batch.actions, (LinearAgent().act(batch.observations) + 2) % 3)


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match=r"inference='host'.*backend='process'"):
        Sampler(NoisyEnv, LinearAgent(), backend="local", inference="host")
    with pytest.raises(ValueError, match=r"inference must be one of.*'gpu'"):
        Sampler(NoisyEnv, LinearAgent(), backend="local", inference="gpu")
    with pytest.raises(ValueError, match=r"one agent shared by all workers.*agent=None"):
        Sampler(NoisyEnv, None, backend="local", inference="batched")
    with pytest.raises(ValueError, match=r"one agent shared by all workers.*list of agents"):
        Sampler(NoisyEnv, [LinearAgent(), LinearAgent()], backend="local", inference="batched")
    with pytest.raises(ValueError, match="flush must be one of"):
        Batched(flush="sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["local", "process"])
async def test_eager_min_fraction_one_waits_for_every_worker(
    backend: str, make_sampler: SamplerFactory
) -> None:
    agent = LinearAgent()
    options = Batched("eager", min_fraction=1.0)
    async with make_sampler(backend, agent=agent, inference=options, n_workers=4) as sampler:
        await sampler.obtain_fragments(4 * 2 * 10)
    assert agent.calls == [8] * 10
    with pytest.raises(ValueError, match="min_fraction must be >= 0 and <= 1"):
        Batched("eager", min_fraction=1.5)


@pytest.mark.parametrize("row_bytes", [16, _batcher.VIEW_BYTES // 4])
def test_merged_rows_are_viewed_in_place_only_when_big(row_bytes: int) -> None:
    """The workers' observations of a merged call: adjacent rows of one array are viewed in
    place from VIEW_BYTES on, copied below it (cheaper than proving them adjacent); rows of
    different arrays are copied whatever their size. The values are the same either way."""
    base = np.arange(4 * row_bytes, dtype=np.uint8).reshape(4, row_bytes)
    other = base.copy()

    def request(rows: np.ndarray) -> Any:
        return _batcher._Request(0, None, rows, len(rows), None)  # type: ignore[arg-type]

    adjacent = _batcher._stack([request(base[:2]), request(base[2:])])
    np.testing.assert_array_equal(adjacent, base)
    big = 4 * row_bytes >= _batcher.VIEW_BYTES
    assert np.shares_memory(adjacent, base) is big
    apart = _batcher._stack([request(base[:2]), request(other[2:])])
    np.testing.assert_array_equal(apart, base)
    assert not np.shares_memory(apart, base) and not np.shares_memory(apart, other)
