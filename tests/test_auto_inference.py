"""``Sampler(inference="auto")``, the default: the sampler picks the mode, says which and why,
and the batches are those of the mode it would otherwise have run."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from typing import Any

import numpy as np
import pytest
from async_envs import CountingAsyncEnv
from envs import ConstantAgent, GridWorldEnv, LevelAgent, NoisyParamAgent, ParamAgent
from helpers import SamplerFactory

from asyncsample import InferenceChoice, Replayable, Sampler, VecWorker
from asyncsample.inference import copies

ASYNC_ENV = functools.partial(CountingAsyncEnv, 100)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def same_batches(auto: list[Any], per_worker: list[Any]) -> None:
    """The batches of the run with "auto" equal those of the run with "per_worker", one by one."""
    assert len(auto) == len(per_worker)
    for a, p in zip(auto, per_worker):
        assert a.n_transitions > 0
        assert a.equals(p)


class OwnActions(VecWorker):
    def compute_actions(self, observations: Any) -> Any:
        return super().compute_actions(observations)


class AsyncParamAgent(ParamAgent):
    async def get_actions(self, observations: Any) -> Any:  # type: ignore[override]
        await asyncio.sleep(0)
        return super().get_actions(observations)


class LockedParamAgent(ParamAgent):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()  # cannot be pickled


class GpuParamAgent(ParamAgent):
    device = "cuda:0"


class Seeded(NoisyParamAgent):
    """A stochastic agent with the ``seed`` hook: each copy in a host draws from its worker's
    seed, so the copies of a host do not share its calls."""


class PlainAgent(ParamAgent):
    """A ParamAgent without parameter methods, for an update that copies cannot follow."""

    get_param_values = None  # type: ignore[assignment]
    set_param_values = None  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("kwargs", "mode", "why"),
    [
        ({}, "host", "RandomAgent runs in the env hosts"),
        ({"agent": ConstantAgent(0)}, "per_worker", "has no get_param_values"),
        ({"agent": ParamAgent()}, "host", "follow its parameters"),
        ({"agent": ParamAgent(), "n_workers": 8}, "host", "share one agent call a step"),
        ({"agent": ParamAgent(), "n_workers": 4}, "host", "share one agent call a step"),
        ({"agent": ParamAgent(), "n_workers": 2}, "host", "at every call"),  # one worker a host
        ({"agent": Seeded(0), "n_workers": 8}, "batched", "8 workers over 2 env host(s) "),
        # the hosts time each worker's chunks on its own: no shared calls
        ({"agent": ParamAgent(), "n_workers": 8, "metrics": True}, "batched", "8 workers over"),
        # a factory (blocking or async envs: the hosts share the calls of either)
        ({"agent": ParamAgent(), "n_workers": 8, "env": ASYNC_ENV}, "host", "share one agent"),
        ({"agent": ParamAgent(), "n_workers": 8, "backend": "ray"}, "batched", "8 workers over"),
        ({"agent": Seeded(0), "n_workers": 6, "n_processes": None}, "batched", "not given: 2"),
        ({"agent": Seeded(0), "n_workers": 8}, "batched", "at most 4 workers, with more envs"),
        ({"agent": Seeded(0), "n_workers": 8, "n_processes": 4}, "host", "copies of your"),
        ({"agent": [ParamAgent() for _ in range(8)], "n_workers": 8}, "host", "copies of your"),
        ({"agent": AsyncParamAgent()}, "per_worker", "is async"),
        ({"agent": LockedParamAgent()}, "per_worker", "cannot be pickled"),
        ({"agent": GpuParamAgent()}, "batched", "is on cuda:0"),
        ({"agent": [GpuParamAgent(), GpuParamAgent()]}, "per_worker", "is on cuda:0"),
        ({"agent": ParamAgent(), "backend": "thread"}, "per_worker", "envs live in this"),
        ({"backend": "local"}, "per_worker", "envs live in this process"),
        ({"episode_timeout": 5.0}, "per_worker", "episode_timeout"),
        ({"worker_class": OwnActions}, "per_worker", "worker_class computes the actions"),
        ({"env": Replayable("CartPole-v1")}, "per_worker", "reads the random agents' state"),
    ],
)
async def test_the_choice_and_its_reason(kwargs: dict[str, Any], mode: str, why: str) -> None:
    options: dict[str, Any] = {"backend": "process", "n_workers": 2, "n_processes": 2, **kwargs}
    agent, env = options.pop("agent", None), options.pop("env", None)
    if env is None:
        env = GridWorldEnv if agent is not None else "CartPole-v1"
    sampler = Sampler(env, agent, **options)
    try:
        choice = sampler.inference
        assert isinstance(choice, InferenceChoice)
        assert (choice.mode, choice.auto) == (mode, True)
        assert why in choice.reason
        assert choice.describe() == f"{mode} (auto: {choice.reason})"
    finally:
        await sampler.aclose()


async def test_an_explicit_mode_is_obeyed(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="asyncsample"):
        sampler = Sampler("CartPole-v1", inference="per_worker")
        auto = Sampler("CartPole-v1")
    try:
        assert sampler.inference == InferenceChoice("per_worker", "given", auto=False)
        assert sampler.inference.describe() == "per_worker (given)"
        assert "inference='host' (auto)" in caplog.text  # the choice is logged
    finally:
        await sampler.aclose()
        await auto.aclose()


async def test_the_auto_choice_gives_the_batches_of_per_worker(
    make_sampler: SamplerFactory,
) -> None:
    out = []
    for inference in ("auto", "per_worker"):
        sampler = make_sampler(
            "process",
            "CartPole-v1",
            n_workers=2,
            envs_per_worker=3,
            seed=5,
            max_episode_length=50,
            inference=inference,
        )
        batches = [
            await sampler.obtain_samples(200),
            await sampler.obtain_fragments(90),
            await sampler.obtain_exact_episodes(2),
        ]
        assert sampler.inference.mode == ("host" if inference == "auto" else "per_worker")
        out.append(batches)
        await sampler.aclose()
    same_batches(*out)


async def test_a_checkpoint_of_random_agents_in_the_hosts_warns_and_streams_can_take_one(
    make_sampler: SamplerFactory,
) -> None:
    # "auto" put the random agents in the hosts: a checkpoint cannot read them (a warning says
    # so), but it can be taken between a stream's batches (the auto choice does not run ahead).
    sampler = make_sampler("process", "CartPole-v1", n_workers=2, envs_per_worker=2, seed=0)
    async with contextlib.aclosing(sampler.stream(64)) as batches:
        async for _ in batches:
            with pytest.warns(RuntimeWarning, match="inference='per_worker'"):
                state = await sampler.checkpoint()
            break
    assert sampler.inference.mode == "host"
    assert sum(state.counts().values()) == 4


async def test_the_choice_does_not_follow_the_cpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 hosts on a 16-CPU machine would serve one worker each, but a script that does not set
    # n_processes picks the same mode on every machine (a stochastic agent's batches differ
    # between modes).
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    sampler = Sampler(GridWorldEnv, Seeded(0), backend="process", n_workers=8)
    try:
        assert sampler.inference.mode == "batched"
    finally:
        await sampler.aclose()


async def test_copies_too_big_for_every_worker_stay_in_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(copies, "COPIES_BUDGET", 1000)
    sampler = Sampler(GridWorldEnv, ParamAgent(), backend="process", n_workers=2)
    try:
        assert sampler.inference.mode == "batched"
        assert "MiB: 2 copies in the env hosts" in sampler.inference.reason
    finally:
        await sampler.aclose()


async def test_the_hosts_copies_follow_changes_made_in_place(make_sampler: SamplerFactory) -> None:
    # A trainer that changes its agent in place and passes no agent_update gets the batches it
    # would get with the agent in its process.
    out = []
    for inference in ("auto", "per_worker"):
        agent = ParamAgent()
        sampler = make_sampler(
            "process",
            GridWorldEnv,
            agent,
            n_workers=2,
            envs_per_worker=2,
            seed=3,
            max_episode_length=12,
            inference=inference,
        )
        batches = [await sampler.obtain_samples(60)]
        agent.script[:] = (agent.script + 1) % 4  # the same array, changed
        batches.append(await sampler.obtain_samples(60))
        batches.append(await sampler.obtain_samples(60))  # unchanged: nothing is sent
        agent.script = np.zeros_like(agent.script)  # a new array
        batches.append(await sampler.obtain_fragments(40))
        await sampler.update_agent(np.full_like(agent.script, 2))  # an explicit update
        batches.append(await sampler.obtain_samples(60))
        assert sampler.inference.follows == (inference == "auto")
        assert sampler.inference.mode == ("host" if inference == "auto" else "per_worker")
        out.append(batches)
        await sampler.aclose()
    same_batches(*out)
    actions = [set(np.asarray(b.actions).tolist()) for b in out[0]]
    assert actions[3] == {0} and actions[4] == {2}
    assert not np.array_equal(out[0][0].actions[:10], out[0][1].actions[:10])


async def test_seeded_agents_of_their_own_give_the_batches_of_per_worker(
    make_sampler: SamplerFactory,
) -> None:
    # Each worker's own stochastic agent: its copy in the host goes on from the random state
    # it was seeded with (not the sampler's seed tree), as the agent would in this process.
    out = []
    for inference, agent_seed in (("auto", 0), ("per_worker", 0), ("auto", 100)):
        agents = [NoisyParamAgent(agent_seed + w) for w in range(2)]
        sampler = make_sampler(
            "process", GridWorldEnv, agents, n_workers=2, envs_per_worker=2, seed=3,
            max_episode_length=12, inference=inference,
        )  # fmt: skip
        out.append([await sampler.obtain_samples(80), await sampler.obtain_fragments(40)])
        assert sampler.inference.mode == ("host" if inference == "auto" else "per_worker")
        await sampler.aclose()
    same_batches(out[0], out[1])
    assert not np.array_equal(out[0][0].actions, out[2][0].actions)


async def test_a_new_agent_the_copies_cannot_follow_is_refused(
    make_sampler: SamplerFactory,
) -> None:
    agent = ParamAgent()
    sampler = make_sampler("process", GridWorldEnv, agent, n_workers=2, envs_per_worker=1)
    await sampler.obtain_samples(20)
    with pytest.raises(ValueError, match=r"agent_update: .*get_param_values.*\(PlainAgent\)"):
        await sampler.obtain_samples(20, agent_update=PlainAgent(np.zeros(16, np.int64)))
    assert sampler.workers[0].agent is agent  # nothing applied, in the caller or the hosts
    batch = await sampler.obtain_samples(20)
    assert np.array_equal(batch.actions, agent.script[batch.observations])


@pytest.mark.filterwarnings("ignore::pytest.PytestWarning")
def test_a_digest_is_one_of_the_values() -> None:
    torch = pytest.importorskip("torch")
    net = torch.nn.Linear(3, 2)
    params = {k: v.clone() for k, v in net.state_dict().items()}
    same = {k: v.clone() for k, v in net.state_dict().items()}
    assert copies.digest(params) == copies.digest(same)
    same["bias"][0] += 1
    assert copies.digest(params) != copies.digest(same)
    half = params["weight"].to(torch.bfloat16)
    assert copies.digest([half, np.ones(2)]) == copies.digest([half.clone(), np.ones(2)])
    assert copies.digest(np.ones(2)) != copies.digest(np.ones(2, np.float32))


async def test_a_checkpoint_of_your_agents_copies_in_the_hosts_warns(
    make_sampler: SamplerFactory,
) -> None:
    sampler = make_sampler("process", GridWorldEnv, ParamAgent(), n_workers=2, envs_per_worker=1)
    await sampler.obtain_samples(20)
    with pytest.warns(RuntimeWarning, match="copies of your agent in the env hosts"):
        await sampler.checkpoint()


async def test_copies_beside_async_envs_follow_too(make_sampler: SamplerFactory) -> None:
    # Async envs in the hosts' event loops: the copies act per env there, and follow as well.
    agent = LevelAgent(0)
    sampler = make_sampler(
        "process", CountingAsyncEnv, agent, n_workers=2, envs_per_worker=3, n_processes=2
    )
    first = await sampler.obtain_samples(60)
    assert (sampler.inference.mode, sampler.inference.follows) == ("host", True)
    assert set(first.rewards.tolist()) == {0.0}  # the env's reward is the action taken
    agent.level[...] = 1  # in place
    await sampler.obtain_samples(60)  # steps started before the change may end in it
    assert set((await sampler.obtain_samples(60)).rewards.tolist()) == {1.0}
