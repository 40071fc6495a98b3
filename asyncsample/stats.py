"""Per-call statistics, computed while sampling so a trainer can log them without recomputing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["SampleStats"]


@dataclass(frozen=True)
class SampleStats:
    """What one sampler call (or one streamed batch) did.

    Episode figures cover the episodes that *finished* during the call, whole, whether or not
    they are in the batch.

    Attributes:
        transitions: transitions in the batch.
        episodes: episodes finished.
        mean_return, max_return, min_return: undiscounted returns of those episodes (NaN if none).
        mean_length, max_length: their lengths (NaN / 0 if none).
        seconds: wall time of the call.
        steps_per_second: ``transitions / seconds``.
        agent_version: the newest agent version among the workers.
        restarts: env-host restarts during the call.
        worker_transitions: transitions each worker contributed to the batch (index = worker).
        worker_wait_seconds: per worker, the seconds it sat idle between finishing its part and
            the end of the call (a straggler shows up as high waits of everyone else).
    """

    transitions: int
    episodes: int
    mean_return: float
    max_return: float
    min_return: float
    mean_length: float
    max_length: int
    seconds: float
    steps_per_second: float
    agent_version: int
    restarts: int
    worker_transitions: tuple[int, ...] = ()
    worker_wait_seconds: tuple[float, ...] = ()

    @classmethod
    def collect(
        cls,
        finished: Sequence[tuple[float, int, int]],
        *,
        transitions: int,
        seconds: float,
        agent_version: int,
        restarts: int,
        worker_transitions: Sequence[int] = (),
        worker_wait_seconds: Sequence[float] = (),
    ) -> SampleStats:
        """Summarise ``(return, length, version)`` of the finished episodes."""
        returns = np.array([f[0] for f in finished], dtype=np.float64)
        lengths = np.array([f[1] for f in finished], dtype=np.int64)
        nan = float("nan")
        return cls(
            transitions=transitions,
            episodes=len(finished),
            mean_return=float(returns.mean()) if len(returns) else nan,
            max_return=float(returns.max()) if len(returns) else nan,
            min_return=float(returns.min()) if len(returns) else nan,
            mean_length=float(lengths.mean()) if len(lengths) else nan,
            max_length=int(lengths.max()) if len(lengths) else 0,
            seconds=seconds,
            steps_per_second=transitions / seconds if seconds > 0 else 0.0,
            agent_version=agent_version,
            restarts=restarts,
            worker_transitions=tuple(int(n) for n in worker_transitions),
            worker_wait_seconds=tuple(float(t) for t in worker_wait_seconds),
        )

    def as_dict(self) -> dict[str, Any]:
        """The statistics as a plain dict (for loggers)."""
        return asdict(self)
