"""The interface between a worker and the host of its envs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import gymnasium as gym
import numpy as np

from asyncsample.env_group import EnvFailure, StepBuffers, StepInfos
from asyncsample.env_update import EnvSource
from asyncsample.errors import WorkerError

__all__ = ["Backend", "EnvHost", "HostSpec", "failure_error"]


@dataclass(frozen=True)
class HostSpec:
    """What a backend needs to host the envs of one worker.

    Attributes:
        worker: the worker's index.
        n_envs: how many env copies the worker steps together.
        observation_space, action_space: the env's spaces (for the step buffers).
        max_episode_length: the host truncates episodes at this length (``None``: never).
    """

    worker: int
    n_envs: int
    observation_space: gym.Space
    action_space: gym.Space
    max_episode_length: int | None


class EnvHost(Protocol):
    """The host of one worker's envs, as the worker sees it.

    Every method may raise :class:`~asyncsample.WorkerError` (an env raised),
    :class:`~asyncsample.WorkerCrashedError` (the host died) or
    :class:`~asyncsample.StepTimeoutError`. After any of them the host must be rebuilt with
    :meth:`restart` before it is used again.
    """

    buffers: StepBuffers
    """Shared with the host: the worker writes ``actions`` and reads the rest after a step."""

    async def build(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        """Build the envs: env ``i`` from ``chains[i]``, first reset with ``seeds[i]``."""
        ...

    async def update(self, updates: Sequence[EnvSource | None], seeds: Sequence[int]) -> None:
        """Apply one env update per env (``None`` keeps it); a new env object gets ``seeds[i]``."""
        ...

    async def reset(self, mask: np.ndarray) -> dict[int, dict[str, object]]:
        """Reset the envs where ``mask`` is true; returns their reset infos by env index."""
        ...

    async def step(self, mask: np.ndarray) -> StepInfos:
        """Step the envs where ``mask`` is true with ``buffers.actions``, autoresetting ends."""
        ...

    async def restart(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        """Recover from a failure: replace a dead or hung host, then rebuild the envs."""
        ...

    async def close(self) -> None:
        """Close the envs. Idempotent."""
        ...


class Backend(Protocol):
    """Starts and stops the hosts of all workers."""

    async def start(self, specs: Sequence[HostSpec]) -> list[EnvHost]:
        """Start one host per spec, in order."""
        ...

    async def aclose(self) -> None:
        """Stop every host and release every resource (processes, shared memory). Idempotent."""
        ...


def failure_error(worker: int, failure: EnvFailure) -> BaseException:
    """The exception a worker raises for an env failure reported by its host.

    A failure that is the caller's own mistake (an observation that does not fit the declared
    space) is not worth a restart: it is wrapped with ``retry = False``.
    """
    err = WorkerError(
        f"{type(failure.error).__name__}: {failure.error}",
        worker=worker,
        env=failure.env,
        remote_traceback=failure.traceback or None,
        retry=failure.retry,
    )
    err.__cause__ = failure.error
    return err
