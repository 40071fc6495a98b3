"""Where the policy runs (``Sampler(inference=...)``).

``"per_worker"`` (default): each worker calls its agent with its own rows. ``"batched"``: one
shared agent, the workers' concurrent calls merged into one (see :mod:`.batched`); pass a
:class:`Batched` instance to choose its flush rule and threading. On ``backend="asyncio"`` and
``"thread"`` the requests of the envs ready together are merged per agent in either mode.
``"host"``: a copy of the agent inside every env host, stepping chunks of steps (see
:mod:`.host`); pass a :class:`Host` instance to choose the chunk length.
"""

from __future__ import annotations

from typing import Any

from asyncsample.inference.batched import Batched, Batcher, BatchStats, FlushRule
from asyncsample.inference.host import Host, HostInference, check_host_agent

__all__ = [
    "INFERENCE_MODES",
    "BatchStats",
    "Batched",
    "Batcher",
    "FlushRule",
    "Host",
    "HostInference",
    "check_inference",
]

INFERENCE_MODES = ("per_worker", "batched", "host")


def check_inference(inference: Any, agent: Any) -> Batched | Host | None:
    """Validate ``Sampler(inference=..., agent=...)``; the mode's options, or ``None``.

    Raises:
        ValueError: an unknown mode, ``"batched"`` without exactly one shared agent, or
            ``"host"`` with an async agent.
    """
    if isinstance(inference, Host) or (isinstance(inference, str) and inference == "host"):
        host = inference if isinstance(inference, Host) else Host()
        for a in agent if isinstance(agent, list) else [agent]:
            if a is not None:
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
