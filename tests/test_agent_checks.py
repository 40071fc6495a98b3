"""Everything an agent returns is checked at the step, with an error that says what and where."""

from __future__ import annotations

import contextlib
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from envs import SCRIPT, ScriptedAgent
from helpers import SamplerFactory

from asyncsample import RandomAgent, WorkerError
from asyncsample.agent import trusted_actions

N_ENVS = 3

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.sampler_defaults(n_workers=1, envs_per_worker=N_ENVS, n_processes=1, seed=0),
]


class OutputAgent(ScriptedAgent):
    """Scripted actions; from its ``bad_from``-th call on, returns ``make(actions)`` instead."""

    def __init__(self, make: Any, bad_from: int = 0) -> None:
        super().__init__(SCRIPT)
        self.make = make
        self.bad_from = bad_from
        self.calls = 0

    def get_actions(self, observations: np.ndarray) -> Any:
        actions, _ = super().get_actions(observations)
        self.calls += 1
        if self.calls > self.bad_from:
            return self.make(actions)
        return actions, {"logp": np.zeros(len(actions)), "mean": np.zeros((len(actions), 2))}


BAD_OUTPUTS = {
    "two-row array": (
        lambda a: np.stack([a, a]),
        r"agent output: .*worker 0 must return an \(actions, agent_infos\) tuple, got a numpy "
        r"array of shape \(2, 3\)",
    ),
    "list pair": (
        lambda a: [a, {}],
        r"agent output: .*worker 0 .*tuple, got a list of length 2",
    ),
    "3-tuple": (
        lambda a: (a, {}, None),
        r"agent output: .*worker 0 .*tuple, got a tuple of length 3",
    ),
    "infos not a dict": (
        lambda a: (a, [1, 2, 3]),
        r"agent_infos: .*worker 0 must return a dict .*got a list of length 3",
    ),
    "infos too short": (
        lambda a: (a, {"logp": np.zeros(len(a) - 1)}),
        r"agent_infos\['logp'\]: .*worker 0 .*envs_per_worker \(3\); got 2 rows",
    ),
    "infos too long": (
        lambda a: (a, {"logp": np.zeros(len(a) + 2)}),
        r"agent_infos\['logp'\]: .*worker 0 .*envs_per_worker \(3\); got 5 rows",
    ),
    "infos scalar": (
        lambda a: (a, {"logp": 0.5}),
        r"agent_infos\['logp'\]: .*worker 0 .*envs_per_worker \(3\); got a scalar",
    ),
    # (A list of rows of varying length is a ragged column; a scalar among lists is not.)
    "infos ragged": (
        lambda a: (a, {"logp": [1, [1, 2], []]}),
        r"agent_infos\['logp'\]: .*worker 0 .*not array-like",
    ),
    "key changes dtype kind": (
        lambda a: (a, {"logp": np.array(["x"] * len(a)), "mean": np.zeros((len(a), 2))}),
        r"agent_infos\['logp'\]: .*worker 0 changed this key between steps: it had dtype kind "
        r"'f' and per-env shape \(\), now dtype object",  # strings: a text column
    ),
    "key changes shape": (
        lambda a: (a, {"logp": np.zeros(len(a)), "mean": np.zeros((len(a), 3))}),
        r"agent_infos\['mean'\]: .*worker 0 changed this key .*per-env shape \(2,\), now .*"
        r"per-env shape \(3,\)",
    ),
}


async def _check(make_sampler: SamplerFactory, backend: str, case: str) -> None:
    bad, pattern = BAD_OUTPUTS[case]
    # Checks that compare with an earlier step need one good step first.
    agent = OutputAgent(bad, bad_from=2 if "changes" in case else 0)
    async with make_sampler(backend, agent=agent) as s:
        with pytest.raises(ValueError, match=pattern):
            await s.obtain_samples(30)
        # The sampler stays usable: the next call, with a good agent, returns correct data.
        good = await s.obtain_samples(12, agent_update=ScriptedAgent())
        assert good.lengths.tolist() == [6, 6, 6]
        assert good.actions.tolist() == [2, 2, 1, 1, 1, 2] * 3


@pytest.mark.parametrize("case", sorted(BAD_OUTPUTS))
async def test_bad_agent_output_local(case: str, make_sampler: SamplerFactory) -> None:
    await _check(make_sampler, "local", case)


@pytest.mark.parametrize("case", sorted(BAD_OUTPUTS))
async def test_bad_agent_output_process(case: str, make_sampler: SamplerFactory) -> None:
    await _check(make_sampler, "process", case)


@pytest.mark.slow
async def test_bad_agent_output_ray(ray_cluster: Any, make_sampler: SamplerFactory) -> None:
    await _check(make_sampler, "ray", "infos too short")


async def test_none_infos_count_as_empty(make_sampler: SamplerFactory) -> None:
    agent = OutputAgent(lambda a: (a, None))
    async with make_sampler("local", agent=agent) as s:
        batch = await s.obtain_samples(12)
    assert batch.agent_infos == {}
    assert batch.lengths.tolist() == [6, 6, 6]


async def test_infos_are_stored_per_env_and_step(make_sampler: SamplerFactory) -> None:
    class Infos(ScriptedAgent):
        def get_actions(self, observations: np.ndarray) -> Any:
            actions, _ = super().get_actions(observations)
            obs = np.asarray(observations)
            # Python lists are array-like too; the value records the observation it saw.
            return actions, {"obs": obs.tolist(), "pair": np.stack([obs, -obs], axis=1)}

    async with make_sampler("local", agent=Infos()) as s:
        batch = await s.obtain_samples(12)
    assert batch.agent_infos["obs"].tolist() == batch.observations.tolist()
    assert batch.agent_infos["pair"][:, 1].tolist() == (-batch.observations).tolist()


async def test_a_new_agent_may_change_its_info_dtypes(make_sampler: SamplerFactory) -> None:
    # The dtype/shape rule holds while the agent is the same object; a new agent starts afresh.
    floats = OutputAgent(lambda a: (a, {"v": np.zeros(len(a))}))
    strings = OutputAgent(lambda a: (a, {"v": np.array(["s"] * len(a))}))
    async with make_sampler("local", agent=floats) as s:
        first = await s.obtain_samples(12)
        second = await s.obtain_samples(12, agent_update=strings)
    assert first.agent_infos["v"].dtype.kind == "f"
    assert second.agent_infos["v"].tolist() == ["s"] * 18


async def test_bad_output_in_a_stream_leaves_the_sampler_usable(
    make_sampler: SamplerFactory,
) -> None:
    agent = OutputAgent(lambda a: (a, {"logp": np.zeros(1)}), bad_from=10)
    async with make_sampler("local", agent=agent) as s:
        with pytest.raises(ValueError, match=r"agent_infos\['logp'\]"):
            async with contextlib.aclosing(s.stream(6)) as it:
                async for _ in it:
                    pass
        batch = await s.obtain_exact_episodes(1, agent_update=ScriptedAgent())
    assert batch.lengths.tolist() == [6]


class LoudRandomAgent(RandomAgent):
    """A RandomAgent subclass whose actions leave the space: it must not be trusted."""

    def get_actions(self, observations: Any) -> Any:
        actions, infos = super().get_actions(observations)
        return np.full_like(actions, 7), infos


def test_only_the_built_in_random_agent_of_the_env_space_is_trusted() -> None:
    space = gym.spaces.Discrete(4)
    assert trusted_actions(RandomAgent(gym.spaces.Discrete(4)), space)
    assert not trusted_actions(LoudRandomAgent(space), space)
    assert not trusted_actions(RandomAgent(gym.spaces.Discrete(9)), space)
    assert not trusted_actions(ScriptedAgent(SCRIPT), space)


# Each place that trusts an agent: the worker (per_worker, batched), the lanes' merged requests
# (thread), the env host's chunk loop (host).
@pytest.mark.parametrize(
    "backend, inference",
    [("local", "per_worker"), ("local", "batched"), ("thread", "per_worker"), ("process", "host")],
)
@pytest.mark.parametrize("agent_kind", ["subclass", "other space"])
async def test_an_untrusted_random_agent_is_range_checked(
    backend: str, inference: str, agent_kind: str, make_sampler: SamplerFactory
) -> None:
    agent = LoudRandomAgent(gym.spaces.Discrete(4), seed=0)
    if agent_kind == "other space":
        agent = RandomAgent(gym.spaces.Discrete(9), seed=0)  # draws 4..8 as well
    async with make_sampler(backend, agent=agent, inference=inference) as s:
        with pytest.raises((ValueError, WorkerError), match="outside the action space"):
            await s.obtain_samples(30)
        good = await s.obtain_samples(12, agent_update=ScriptedAgent())
        # Still usable: whole scripted episodes (on thread the envs are not in lockstep, so
        # two or three of them complete by the quota).
        assert good.n_transitions >= 12 and set(good.lengths.tolist()) == {6}


@pytest.mark.parametrize(
    "space",
    [gym.spaces.Discrete(5, start=2), gym.spaces.Box(-1.0, 2.0, shape=(3,), dtype=np.float32)],
    ids=["discrete", "box"],
)
def test_the_random_agents_rows_drawn_one_at_a_time_are_a_batched_calls(space: Any) -> None:
    one, many = RandomAgent(space, seed=7), RandomAgent(space, seed=7)
    draw = one.row_sampler()
    assert draw is not None
    rows = np.stack([np.asarray(draw()) for _ in range(2000)])  # past a block of draws
    batched = np.concatenate(
        [many.get_actions(np.zeros((n, 4)))[0] for n in (1, 999, 3, 997)]  # 2,000 rows
    )
    assert rows.dtype == batched.dtype
    assert np.array_equal(rows, batched)


def test_rows_of_other_spaces_are_not_drawn_one_at_a_time() -> None:
    # Rows of a MultiDiscrete space come from a batched space per row count: a row drawn alone
    # would differ from the same row of a call of many.
    assert RandomAgent(gym.spaces.MultiDiscrete([2, 3]), seed=0).row_sampler() is None


@pytest.mark.parametrize(
    "space",
    [gym.spaces.Discrete(5, start=2), gym.spaces.Box(-1.0, 2.0, shape=(3,), dtype=np.float32)],
    ids=["discrete", "box"],
)
def test_rows_taken_a_run_at_a_time_and_given_back_are_those_drawn_one_at_a_time(
    space: Any,
) -> None:
    # A host's run takes the rows of its longest length at once and gives back those its
    # shorter end left: the steps get the rows a draw per step would give, across blocks too.
    runs, one = RandomAgent(space, seed=3).run_sampler(), RandomAgent(space, seed=3).row_sampler()
    assert runs is not None and one is not None
    assert (runs.dtype, runs.shape) == (np.dtype(space.dtype), space.shape)
    rng, taken = np.random.default_rng(0), []
    while len(taken) < 3000:  # past a block of draws (1,024 rows of a Discrete space)
        n = int(rng.integers(1, 40))
        used = int(rng.integers(0, n + 1))
        block = runs.take(n)
        taken.extend(block[:used].copy())
        runs.give_back(block, used)
    assert np.array_equal(np.stack(taken), np.stack([np.asarray(one()) for _ in taken]))


def test_rows_drawn_while_a_run_was_out_are_not_given_back_twice() -> None:
    runs = RandomAgent(gym.spaces.Discrete(3), seed=1).run_sampler()
    assert runs is not None
    block = runs.take(10)
    runs.one()  # another env's draw while the run's step awaited
    runs.give_back(block, 2)  # too late: its rows are skipped, not handed out again
    after = runs.take(20)
    everything = RandomAgent(gym.spaces.Discrete(3), seed=1).run_sampler()
    assert everything is not None
    assert np.array_equal(after, everything.take(31)[11:])
