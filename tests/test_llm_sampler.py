"""ChatAgent driving text envs through the sampler, against the local chat server: replies, token
ids, log-probabilities and the model recorded in the batch (asyncio and process hosts); a 500
after the retries and a stalled request are that env's fault alone (its episode lost, the env
rebuilt, the other episodes intact); the cap on requests in flight holds across the envs.
"""

from __future__ import annotations

import asyncio
import string
import sys
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from helpers import SamplerFactory, wait_until

from asyncsample import AsyncEnv, EpisodeBatch
from asyncsample.llm import ChatAgent
from asyncsample.llm.testing import ChatRequest, ChatServer, Fault, token_ids, token_logprobs

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the env, into the env hosts

TURNS = 3


class TalkEnv(AsyncEnv[str, str]):
    """A prompt with an id drawn from the env's generator; each reply is echoed back as the next
    observation; ``TURNS`` turns; the reward is the reply's length."""

    observation_space = gym.spaces.Text(1024, charset=string.printable)
    action_space = gym.spaces.Text(1024, min_length=0, charset=string.printable)

    def __init__(self) -> None:
        self.t = 0
        self.id = 0

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        await super().reset(seed=seed)
        self.t = 0
        self.id = int(self.np_random.integers(10**9))
        return f"task {self.id} turn 0", {"task": self.id}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.t += 1
        obs = f"task {self.id} turn {self.t} after {len(action)} chars"
        return obs, float(len(action)), self.t >= TURNS, False, {}

    async def close(self) -> None:
        pass


def _reply(messages: list[dict[str, Any]]) -> str:
    return f"reply to <{messages[-1]['content']}>"


def _check_episodes(batch: EpisodeBatch) -> None:
    """Whole episodes whose every action is the server's reply to its observation, with that
    reply's tokens and log-probabilities and the server's model beside it."""
    assert batch.lengths.tolist() == [TURNS] * len(batch.lengths)
    for k, (obs, action) in enumerate(zip(batch.observations, batch.actions)):
        assert str(action) == f"reply to <{obs}>"
        ids = token_ids(str(action))
        np.testing.assert_array_equal(batch.agent_infos["token_ids"][k], ids)
        np.testing.assert_allclose(batch.agent_infos["logprobs"][k], token_logprobs(ids), 1e-6)
    assert set(np.asarray(batch.agent_infos["model"]).tolist()) == {"served/model"}
    for episode in batch.split():
        task = int(episode.episode_infos["task"][0])
        assert str(episode.observations[0]) == f"task {task} turn 0"
        for t in range(1, TURNS):
            assert str(episode.observations[t]).startswith(f"task {task} turn {t} after")


def _sampler(make_sampler: SamplerFactory, backend: str, agent: ChatAgent, **kw: Any) -> Any:
    options: dict[str, Any] = {"n_workers": 2, "envs_per_worker": 4, "n_processes": 1, "seed": 5}
    return make_sampler(backend, TalkEnv, agent, max_episode_length=TURNS, **{**options, **kw})


@pytest.mark.parametrize(
    ("backend", "inference"),
    [("asyncio", "per_worker"), ("process", "per_worker"), ("process", "host")],
)
async def test_replies_token_ids_logprobs_and_model_are_recorded(
    make_sampler: SamplerFactory, backend: str, inference: str
) -> None:
    """In the caller, and as a copy in each env host (its own connections there)."""
    async with ChatServer(_reply, model="served/model") as server:
        async with ChatAgent(
            server.base_url, "asked", logprobs=True, return_token_ids=True
        ) as agent:
            sampler = _sampler(make_sampler, backend, agent, inference=inference)
            batch = await sampler.obtain_exact_episodes(4)
            fragments = await sampler.obtain_fragments(16)
            await sampler.aclose()
    assert len(batch.lengths) == 8
    _check_episodes(batch)
    assert fragments.n_transitions >= 16
    assert sampler.last_stats is not None and sampler.last_stats.restarts == 0


class _Victim:
    """A fault rule for the first conversation that reaches turn 1: ``fault`` on every attempt
    of it, no other request touched."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.prompt: str | None = None

    def __call__(self, request: ChatRequest) -> Fault | None:
        if self.prompt is None and " turn 1 " in request.prompt:
            self.prompt = request.prompt
        return self.fault if request.prompt == self.prompt else None


@pytest.mark.parametrize("kind", ["error", "stall"])
async def test_a_failed_or_stalled_reply_is_its_envs_fault_alone(
    make_sampler: SamplerFactory, kind: str
) -> None:
    victim = _Victim(Fault.error(500) if kind == "error" else Fault.hang())
    async with ChatServer(_reply, model="served/model", fault=victim) as server:
        async with ChatAgent(
            server.base_url,
            "asked",
            timeout=0.5,
            retries=2,
            logprobs=True,
            return_token_ids=True,
        ) as agent:
            agent.BACKOFF_BASE = 0.01
            sampler = _sampler(make_sampler, "asyncio", agent)
            batch = await sampler.obtain_exact_episodes(4)
            await sampler.aclose()
    assert victim.prompt is not None
    assert sampler.last_stats is not None and sampler.last_stats.restarts == 1
    assert len(batch.lengths) == 8  # the lost episode was redone, the others kept
    _check_episodes(batch)
    assert victim.prompt not in [str(o) for o in batch.observations]  # its episode is gone
    if kind == "error":
        assert server.statuses[500] == 3  # the first try and two retries, then the env's fault
    else:
        assert server.statuses[500] == 0


async def test_requests_in_flight_stay_under_the_cap(make_sampler: SamplerFactory) -> None:
    async with ChatServer(_reply, model="served/model", latency=0.005) as server:
        async with ChatAgent(
            server.base_url, "asked", max_in_flight=3, logprobs=True, return_token_ids=True
        ) as agent:
            sampler = _sampler(make_sampler, "asyncio", agent, envs_per_worker=12)
            batch = await sampler.obtain_exact_episodes(24)
            await sampler.aclose()
    _check_episodes(batch)
    assert server.requests == 48 * TURNS
    assert 1 <= server.max_in_flight <= 3


async def test_on_ray_a_stalled_reply_costs_only_its_envs_episode(
    make_sampler: SamplerFactory, ray_cluster: Any
) -> None:
    """The envs in Ray actors, the agent in the caller (slow: the cluster starts)."""
    victim = _Victim(Fault.hang())
    async with ChatServer(_reply, model="served/model", fault=victim) as server:
        async with ChatAgent(
            server.base_url, "asked", timeout=0.5, logprobs=True, return_token_ids=True
        ) as agent:
            sampler = _sampler(make_sampler, "ray", agent)
            batch = await sampler.obtain_exact_episodes(4)
            await sampler.aclose()
    assert sampler.last_stats is not None and sampler.last_stats.restarts == 1
    assert len(batch.lengths) == 8
    _check_episodes(batch)


async def test_a_call_cancelled_mid_reply_leaves_the_sampler_usable(
    make_sampler: SamplerFactory,
) -> None:
    slow = {"on": True}

    def latency(request: ChatRequest) -> float:
        return 30.0 if slow["on"] else 0.0

    async with ChatServer(_reply, model="served/model", latency=latency) as server:
        async with ChatAgent(
            server.base_url, "asked", logprobs=True, return_token_ids=True
        ) as agent:
            sampler = _sampler(make_sampler, "asyncio", agent)
            call = asyncio.ensure_future(sampler.obtain_exact_episodes(4))
            await wait_until(lambda: server.in_flight == 8, "every env's request in flight")
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await wait_until(lambda: server.in_flight == 0, "the cancelled requests dropped")
            slow["on"] = False
            batch = await sampler.obtain_exact_episodes(4)
            await sampler.aclose()
    assert len(batch.lengths) == 8
    _check_episodes(batch)
