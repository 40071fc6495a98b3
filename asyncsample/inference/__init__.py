"""Where the policy runs (``Sampler(inference=...)``): ``"auto"`` (default: the sampler picks,
:func:`choose_inference`), ``"per_worker"``, ``"batched"`` (its merger, in the low module
:mod:`asyncsample._batcher`) or ``"host"`` (:mod:`.host`); a :class:`Batched` or :class:`Host`
instance carries the mode's options."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from asyncsample._batcher import Batched, Batcher, BatchStats, FlushRule
from asyncsample.agent import distinct
from asyncsample.backends._chunk import acts_alike
from asyncsample.inference.copies import host_fit
from asyncsample.inference.host import Host, check_host_agent

__all__ = [
    "ASSUMED_HOSTS",
    "BatchStats",
    "Batched",
    "Batcher",
    "FlushRule",
    "HOST_WORKERS",
    "Host",
    "InferenceChoice",
    "Setup",
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
        follows: the hosts run copies of your agent that follow its parameters (``"auto"``
            chose ``"host"`` for it).
        given: the ``inference`` value the sampler runs (``mode``, or the argument as given:
            a :class:`Batched` or :class:`Host` carries options).
    """

    mode: str
    reason: str
    auto: bool = True
    follows: bool = False
    given: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.given is None:
            object.__setattr__(self, "given", self.mode)

    def describe(self) -> str:
        """``mode`` with how it was chosen, e.g. ``host (auto: ...)``."""
        return f"{self.mode} (auto: {self.reason})" if self.auto else f"{self.mode} (given)"


@dataclass(frozen=True)
class Setup:
    """What of a sampler's setup ``inference="auto"`` looks at, beside the agent and layout.

    Attributes:
        host_mode: the backend's hosts can run agent copies (``process``, ``ray``).
        episode_timeout: ``Sampler(episode_timeout=...)``.
        own_compute_actions: the worker class overrides ``compute_actions``.
        exact_resume: the sampler resumes a state or replays its envs (``Replayable``): a
            checkpoint must read the agents' state, which it does in the caller only.
        shared_calls: the hosts share their agent calls among workers whose copies act alike
            (``process`` with metrics off: they time each worker's calls on their own).
    """

    host_mode: bool
    episode_timeout: float | None = None
    own_compute_actions: bool = False
    exact_resume: bool = False
    shared_calls: bool = False


def choose_inference(
    inference: Any, agent: Any, setup: Setup, layout: tuple[int, int | None] = (1, None)
) -> InferenceChoice:
    """The mode for ``Sampler(inference=inference)``; ``"auto"`` picks the mode measured fastest
    for such a setup and agent (and logs its choice at info level).

    Args:
        inference: ``Sampler(inference=...)`` as given.
        agent: ``Sampler(agent=...)`` as given (``None``: a ``RandomAgent`` per worker).
        setup: the rest of the sampler's setup that bears on the choice.
        layout: ``n_workers`` (one agent copy each in the hosts) and ``n_processes`` as given
            (``None``: not given).

    The choice is made from the arguments and the agent alone, never from timings or the
    machine's CPU count (the default ``n_processes``): for a stochastic agent the modes give
    different (each reproducible) batches, so a choice that followed the machine would make a
    seed's batches depend on it.

    - ``agent=None`` (a seeded :class:`~asyncsample.RandomAgent` per worker) on a backend whose
      hosts can act (``process``, ``ray``): the agents run in the hosts, a chunk of steps per
      request instead of one round trip per step (1.41x a ``SyncVectorEnv(32)`` on CartPole-v1
      with 4x8, against 0.60x with ``per_worker``: ``benchmarks/results/first_run/``).
    - Your agent, where the hosts can run copies of it that follow it (see
      :func:`~asyncsample.inference.copies.host_fit`): in the hosts too. Where one agent is
      shared by the workers and its copies share each host's calls (``process`` with metrics
      off, and :func:`~asyncsample.backends._chunk.acts_alike`: no ``seed`` or ``reset``
      method), whatever the number of workers per host: a host asks its copy once a step for
      the rows of all its workers. Else with at most :data:`HOST_WORKERS`
      workers per env host (``n_processes`` as given, else :data:`ASSUMED_HOSTS`), each copy
      called on its own; with more, one merged call in the caller (``"batched"``) when all
      workers share the agent.
    - Else ``"per_worker"``, with the first reason that keeps the agent in the caller.
    """
    if not (isinstance(inference, str) and inference == "auto"):
        name = inference if isinstance(inference, str) else type(inference).__name__.lower()
        return InferenceChoice(str(name), "given", auto=False, given=inference)
    choice = _auto(agent, setup, layout)
    _LOGGER.info("inference=%r (auto): %s", choice.mode, choice.reason)
    return choice


#: The most workers per env host for which ``"auto"`` runs in the hosts a user's agent whose
#: copies do not share calls (:func:`~asyncsample.backends._chunk.acts_alike`): each host then
#: calls one copy per worker, so beyond this one merged call in the caller is cheaper
#: (a torch MLP on CartPole-v1 over 2 hosts, 2026-12-01: 4x8 host 52.2k steps/s, batched 33.7k;
#: 8x4 host 27.1k, batched 33.4k; ``benchmarks/results/policy/``).
HOST_WORKERS = 2
#: The env hosts ``"auto"`` counts with when ``n_processes`` is not given: a fixed number, not
#: this machine's CPU count, so that the same script picks the same mode everywhere.
ASSUMED_HOSTS = 2


def _auto(agent: Any, setup: Setup, layout: tuple[int, int | None]) -> InferenceChoice:
    # The first reason that keeps the agent in the caller, else the hosts.
    yours = agent is not None
    keep = [
        (not setup.host_mode, "the envs live in this process, beside the agent"),
        (
            setup.episode_timeout is not None,
            "episode_timeout is checked between steps in the caller",
        ),
        (setup.own_compute_actions, "the worker_class computes the actions in the caller"),
        (
            setup.exact_resume,
            f"a resume or Replayable env reads the {'' if yours else 'random '}agents' state "
            "in the caller",
        ),
    ]
    for holds, reason in keep:
        if holds:
            return InferenceChoice("per_worker", reason)
    if not yours:
        return InferenceChoice(
            "host", "the built-in RandomAgent runs in the env hosts, a chunk of steps per request"
        )
    shared = not isinstance(agent, list)
    agents = distinct(agent if isinstance(agent, list) else [agent])
    n_workers, n_processes = layout[0], layout[1] or ASSUMED_HOSTS  # a copy per worker
    unfit = next((why for a in agents if (why := host_fit(a, n_workers)) is not None), None)
    if unfit is not None:
        if shared and unfit.merge:
            return InferenceChoice("batched", f"{unfit.reason}: one merged call in the caller")
        return InferenceChoice("per_worker", unfit.reason)
    # The workers of a host may share its calls: one copy's call a step for all of them.
    alike = shared and setup.shared_calls and acts_alike(agents[0])
    if shared and not alike and n_workers > HOST_WORKERS * n_processes:
        return InferenceChoice(
            "batched",
            f"{n_workers} workers over {n_processes} env host(s)"
            f"{'' if layout[1] else f' (n_processes not given: {ASSUMED_HOSTS})'} would each call "
            "the agent there: one merged call in the caller is cheaper (at most "
            f"{HOST_WORKERS * n_processes} workers, with more envs each, run it in the hosts)",
        )
    together = alike and n_workers > n_processes
    return InferenceChoice(
        "host",
        "copies of your agent run in the env hosts, a chunk of steps per request, and follow "
        "its parameters (get_param_values) at every call"
        + (
            "; the workers of a host share one agent call a step (the agent has no seed or "
            "reset method)"
            if together
            else ""
        ),
        follows=True,
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
