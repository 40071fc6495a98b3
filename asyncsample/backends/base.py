"""The interface between a worker and the host of its envs."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from asyncsample.env_group import EnvFailure, StepBuffers, StepInfos
from asyncsample.env_update import EnvSource
from asyncsample.errors import WorkerError

__all__ = ["LOGGER", "Backend", "EnvHost", "HostSpec", "failure_error", "reject_unknown_options"]

#: Where backends report restarts, timeouts and dead hosts (warning level).
LOGGER = logging.getLogger("asyncsample")


@dataclass(frozen=True)
class HostSpec:
    """What a backend needs to host the envs of one worker.

    Attributes:
        worker: the worker's index.
        n_envs: how many env copies the worker steps together.
        observation_space, action_space: the env's spaces (for the step buffers).
        max_episode_length: the host truncates episodes at this length (``None``: never).
        chunk_steps: ``inference="host"``: the capacity, in worker steps, of the chunk buffers
            the host's own agent copy fills per request (see :mod:`asyncsample.backends._chunk`);
            ``0``: the worker asks for actions itself, one step per request.
        autoreset: how the host's env group restarts an ended episode, one of
            :data:`~asyncsample.env_group.AUTORESET_MODES` (the vector-env faces choose it).
    """

    worker: int
    n_envs: int
    observation_space: gym.Space[Any]
    action_space: gym.Space[Any]
    max_episode_length: int | None
    chunk_steps: int = 0
    autoreset: str = "SameStep"


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

    async def reset(
        self,
        mask: np.ndarray,
        seeds: Sequence[int | None] | None = None,
        options: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
    ) -> dict[int, dict[str, object]]:
        """Reset the envs where ``mask`` is true; returns their reset infos by env index.

        ``seeds`` (one per env, ``None`` entries: no seed) replace the envs' pending seeds for
        this reset; ``options`` (one dict for all, or one per env) go to ``env.reset``. The
        defaults are the sampler's own resets: pending seeds, no options.
        """
        ...

    async def call(
        self,
        name: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        envs: Sequence[int] | None = None,
    ) -> list[Any]:
        """``getattr(env, name)`` of each env in ``envs`` (default: all), called with ``args``
        and ``kwargs`` when callable (gymnasium's ``VectorEnv.call``); one result per env.

        A failure is a :class:`~asyncsample.WorkerError` naming the env (``retry`` false for an
        ``AttributeError``).
        """
        ...

    async def set_attr(
        self, name: str, values: Sequence[Any], envs: Sequence[int] | None = None
    ) -> None:
        """Set attribute ``name`` of env ``envs[k]`` (default: all) to ``values[k]``."""
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
        """Stop every host and release every resource (processes, shared memory). Idempotent.

        A host call still in flight, or made afterwards, raises
        :class:`~asyncsample.SamplerClosedError`.
        """
        ...

    def close_now(self) -> None:
        """Synchronous last resort (an unclosed sampler being collected): release everything
        without waiting for envs to close. Idempotent."""
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


def reject_unknown_options(
    backend: str, unknown: Mapping[str, object], valid: Sequence[str]
) -> None:
    """Raise ``TypeError`` naming the unknown options of ``backend`` and listing the valid ones.

    Every backend treats options it does not know the same way: a mistyped option is an error,
    never silently ignored.
    """
    if unknown:
        raise TypeError(
            f"backend {backend!r} got unknown option(s) {', '.join(map(repr, sorted(unknown)))}; "
            f"valid options: {', '.join(valid)}"
        )
