"""Where the policy runs (``Sampler(inference=...)``).

``"per_worker"`` (default): each worker calls its agent with its own rows. ``"batched"``: one
shared agent, the workers' concurrent calls merged into one (see :mod:`.batched`); pass a
:class:`Batched` instance to choose its flush rule and threading.
"""

from __future__ import annotations

from typing import Any

from asyncsample.inference.batched import Batched, Batcher, BatchStats, FlushRule

__all__ = ["INFERENCE_MODES", "BatchStats", "Batched", "Batcher", "FlushRule", "check_inference"]

INFERENCE_MODES = ("per_worker", "batched")


def check_inference(inference: Any, agent: Any) -> Batched | None:
    """Validate ``Sampler(inference=..., agent=...)``; the batching options, or ``None``.

    Raises:
        ValueError: an unknown mode, ``"host"`` (not available in this version), or
            ``"batched"`` without exactly one shared agent.
    """
    if isinstance(inference, Batched):
        options: Batched | None = inference
    elif inference == "per_worker":
        return None
    elif inference == "batched":
        options = Batched()
    elif inference == "host":
        raise ValueError(
            "inference='host' (the agent running inside the env hosts) is not available in this "
            "version of asyncsample; use 'per_worker' or 'batched'"
        )
    else:
        raise ValueError(
            f"inference must be one of 'per_worker', 'batched' or a "
            f"asyncsample.inference.Batched instance, got {inference!r}"
        )
    if agent is None or isinstance(agent, list):
        given = "agent=None (a RandomAgent per worker)" if agent is None else "a list of agents"
        raise ValueError(
            f"inference='batched' needs one agent shared by all workers (its calls are merged "
            f"into one), got {given}"
        )
    return options
