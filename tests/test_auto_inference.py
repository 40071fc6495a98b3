"""``Sampler(inference="auto")``, the default: the sampler picks the mode, says which and why,
and the batches are those of the mode it would otherwise have run."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import pytest
from envs import ConstantAgent
from helpers import SamplerFactory

from asyncsample import InferenceChoice, Replayable, Sampler, VecWorker

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


class OwnActions(VecWorker):
    def compute_actions(self, observations: Any) -> Any:
        return super().compute_actions(observations)


@pytest.mark.parametrize(
    ("kwargs", "mode", "why"),
    [
        ({}, "host", "RandomAgent runs in the env hosts"),
        ({"agent": ConstantAgent(0)}, "per_worker", "your agent"),
        ({"backend": "local"}, "per_worker", "envs live in this process"),
        ({"episode_timeout": 5.0}, "per_worker", "episode_timeout"),
        ({"worker_class": OwnActions}, "per_worker", "worker_class computes the actions"),
        ({"env": Replayable("CartPole-v1")}, "per_worker", "reads the random agents' state"),
    ],
)
async def test_the_choice_and_its_reason(kwargs: dict[str, Any], mode: str, why: str) -> None:
    options: dict[str, Any] = {"backend": "process", **kwargs}
    agent, env = options.pop("agent", None), options.pop("env", "CartPole-v1")
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
    for auto, per_worker in zip(*out):
        assert auto.n_transitions > 0
        assert auto.equals(per_worker)


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
