"""``Sampler(inference="auto")``, the default: the sampler picks the mode, says which and why,
and the batches are those of the mode it would otherwise have run."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from envs import ConstantAgent
from helpers import SamplerFactory

from asyncsample import InferenceChoice, Sampler, VecWorker

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
    ],
)
async def test_the_choice_and_its_reason(kwargs: dict[str, Any], mode: str, why: str) -> None:
    options: dict[str, Any] = {"backend": "process", **kwargs}
    agent = options.pop("agent", None)
    sampler = Sampler("CartPole-v1", agent, **options)
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
