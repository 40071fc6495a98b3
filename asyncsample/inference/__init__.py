"""Where the policy runs (``Sampler(inference=...)``): ``"auto"`` (default: the sampler picks,
:func:`choose_inference`), ``"per_worker"``, ``"batched"`` (:mod:`.batched`) or ``"host"``
(:mod:`.host`); a :class:`Batched` or :class:`Host` instance carries the mode's options."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from asyncsample.inference.batched import Batched, Batcher, BatchStats, FlushRule
from asyncsample.inference.host import Host, check_host_agent

__all__ = [
    "BatchStats",
    "Batched",
    "Batcher",
    "FlushRule",
    "Host",
    "InferenceChoice",
    "check_inference",
    "choose_inference",
]

_LOGGER = logging.getLogger("asyncsample")


@dataclass(frozen=True)
class InferenceChoice:
    """The inference mode a sampler runs and why (``inference="auto"`` picks it).

    Attributes:
        mode: ``"per_worker"``, ``"batched"`` or ``"host"``.
        reason: one sentence, for the log and ``asyncsample run``.
        auto: whether the sampler chose it (``inference="auto"``) or it was given.
        given: the ``inference`` value the sampler runs (``mode``, or the argument as given:
            a :class:`Batched` or :class:`Host` carries options).
    """

    mode: str
    reason: str
    auto: bool = True
    given: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.given is None:
            object.__setattr__(self, "given", self.mode)

    def describe(self) -> str:
        """``mode`` with how it was chosen, e.g. ``host (auto: ...)``."""
        return f"{self.mode} (auto: {self.reason})" if self.auto else f"{self.mode} (given)"


def choose_inference(
    inference: Any,
    agent: Any,
    host_mode: bool,
    episode_timeout: float | None,
    own_compute_actions: bool,
    exact_resume: bool = False,
) -> InferenceChoice:
    """The mode for ``Sampler(inference=inference)``; ``"auto"`` picks the fastest that gives
    the same batches (and logs its choice at info level).

    Args:
        inference: ``Sampler(inference=...)`` as given.
        agent: ``Sampler(agent=...)`` as given (``None``: a ``RandomAgent`` per worker).
        host_mode: the backend's hosts can run agent copies (``process``, ``ray``).
        episode_timeout: ``Sampler(episode_timeout=...)``.
        own_compute_actions: the worker class overrides ``compute_actions``.
        exact_resume: the sampler resumes a state or replays its envs (``Replayable``): a
            checkpoint must read the agents' state, which it does in the caller only.

    Every mode gives identical batches for a seed (``tests/test_digest.py``), so the choice is
    one of speed. With ``agent=None`` (a seeded :class:`~asyncsample.RandomAgent` per worker) on a
    backend whose hosts can act (``process``, ``ray``), the agents run in the hosts: each host
    steps a chunk of steps per request instead of one round trip per step (1.10x a
    ``SyncVectorEnv(32)`` on CartPole-v1 with 4x8, against 0.58x with ``per_worker``:
    ``benchmarks/results/first_run/``). A user's
    agent stays in the caller (``per_worker``): whether it is cheaper in the hosts depends on
    its cost, which is not measured here.
    """
    if not (isinstance(inference, str) and inference == "auto"):
        name = inference if isinstance(inference, str) else type(inference).__name__.lower()
        return InferenceChoice(str(name), "given", auto=False, given=inference)
    choice = _auto(agent, host_mode, episode_timeout, own_compute_actions, exact_resume)
    _LOGGER.info("inference=%r (auto): %s", choice.mode, choice.reason)
    return choice


def _auto(
    agent: Any,
    host_mode: bool,
    episode_timeout: float | None,
    own_compute_actions: bool,
    exact_resume: bool,
) -> InferenceChoice:
    # The first reason that keeps the agent in the caller, else the hosts.
    keep = [
        (agent is not None, "your agent runs in the caller, batched per worker"),
        (not host_mode, "the envs live in this process, beside the agent"),
        (episode_timeout is not None, "episode_timeout is checked between steps in the caller"),
        (own_compute_actions, "the worker_class computes the actions in the caller"),
        (exact_resume, "a resume or Replayable env reads the random agents' state in the caller"),
    ]
    for holds, reason in keep:
        if holds:
            return InferenceChoice("per_worker", reason)
    return InferenceChoice(
        "host", "the built-in RandomAgent runs in the env hosts, a chunk of steps per request"
    )


def check_inference(inference: Any, agent: Any, awaited: bool = False) -> Batched | Host | None:
    """Validate ``Sampler(inference=..., agent=...)``; the mode's options, or ``None``.

    Args:
        awaited: the envs may be async envs, whose hosts await an async agent (``"host"``): its
            check is left to when the envs' kind is known.

    Raises:
        ValueError: an unknown mode, ``"batched"`` without exactly one shared agent, or
            ``"host"`` with an async agent (not ``awaited``).
    """
    if isinstance(inference, Host) or (isinstance(inference, str) and inference == "host"):
        host = inference if isinstance(inference, Host) else Host()
        for a in agent if isinstance(agent, list) else [agent]:
            if a is not None and not awaited:
                check_host_agent(a)
        return host
    if isinstance(inference, Batched):
        options: Batched | None = inference
    elif inference == "per_worker":
        return None
    elif inference == "batched":
        options = Batched()
    else:
        raise ValueError(
            f"inference must be one of 'auto', 'per_worker', 'batched', 'host' or a "
            f"asyncsample.inference.Batched or Host instance, got {inference!r}"
        )
    if agent is None or isinstance(agent, list):
        given = "agent=None (a RandomAgent per worker)" if agent is None else "a list of agents"
        raise ValueError(
            f"inference='batched' needs one agent shared by all workers (its calls are merged "
            f"into one), got {given}"
        )
    return options
