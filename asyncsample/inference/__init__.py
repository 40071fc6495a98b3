"""Where the policy runs (``Sampler(inference=...)``): ``"per_worker"`` (default),
``"batched"`` (:mod:`.batched`) or ``"host"`` (:mod:`.host`); a :class:`Batched` or
:class:`Host` instance carries the mode's options."""

from __future__ import annotations

from typing import Any

from asyncsample.inference.batched import Batched, Batcher, BatchStats, FlushRule
from asyncsample.inference.host import Host, check_host_agent

__all__ = [
    "BatchStats",
    "Batched",
    "Batcher",
    "FlushRule",
    "Host",
    "check_inference",
]


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
            f"inference must be one of 'per_worker', 'batched', 'host' or a "
            f"asyncsample.inference.Batched or Host instance, got {inference!r}"
        )
    if agent is None or isinstance(agent, list):
        given = "agent=None (a RandomAgent per worker)" if agent is None else "a list of agents"
        raise ValueError(
            f"inference='batched' needs one agent shared by all workers (its calls are merged "
            f"into one), got {given}"
        )
    return options
