"""Backends: where the envs of each worker live.

A worker talks to its envs through one small async interface, :class:`EnvHost`. A
:class:`Backend` starts one host per worker. ``local`` keeps envs in the main process, ``process``
in a pool of env-host processes, ``ray`` in Ray actors; the worker and sampler code is the same.

What code outside this package may use is exported here: the protocols of the seam
(:class:`EnvHost`, :class:`AgentHost`, :class:`DirectReader`, :class:`SentStep`,
:class:`Backend`), the placement
of workers on hosts, and the chunk records of ``inference="host"``. The underscored modules are
the backends' own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from asyncsample import _validate
from asyncsample.backends._chunk import (
    DEFAULT_CHUNK_STEPS,
    ChunkBuffers,
    ChunkReply,
    ChunkRequest,
    NextChunk,
    SentChunk,
    chunk_capacity,
)
from asyncsample.backends.base import (
    AgentHost,
    Backend,
    DirectReader,
    EnvHost,
    HostSpec,
    InlineHost,
    SentStep,
    reject_unknown_options,
)
from asyncsample.backends.placement import Placement, placement, pool_size

if TYPE_CHECKING:
    from asyncsample.backends.aio import AsyncioBackend
    from asyncsample.backends.local import LocalBackend
    from asyncsample.backends.process import ProcessBackend
    from asyncsample.backends.ray import RayBackend

__all__ = [
    "DEFAULT_CHUNK_STEPS",
    "LANE_BACKENDS",
    "AgentHost",
    "Backend",
    "ChunkBuffers",
    "ChunkReply",
    "ChunkRequest",
    "DirectReader",
    "EnvHost",
    "HostSpec",
    "InlineHost",
    "NextChunk",
    "Placement",
    "SentChunk",
    "SentStep",
    "backend_options",
    "check_options",
    "chunk_capacity",
    "make_backend",
    "placement",
    "pool_size",
]

BACKENDS = ("process", "local", "ray", "asyncio", "thread")

#: Backends whose envs live in the caller's process, each env stepped on its own
#: (:mod:`asyncsample.backends.aio`, :mod:`asyncsample._env_tasks`).
LANE_BACKENDS = ("asyncio", "thread")


def _backend_class(
    name: object,
) -> type[LocalBackend | ProcessBackend | RayBackend | AsyncioBackend]:
    """The class of backend ``name``, imported on first use (so ``ray`` only when asked for)."""
    name = _validate.choice("backend", name, BACKENDS)
    if name == "asyncio":
        from asyncsample.backends.aio import AsyncioBackend

        return AsyncioBackend
    if name == "thread":
        from asyncsample.backends.aio import ThreadBackend

        return ThreadBackend
    if name == "local":
        from asyncsample.backends.local import LocalBackend

        return LocalBackend
    if name == "process":
        from asyncsample.backends.process import ProcessBackend

        return ProcessBackend
    from asyncsample.backends.ray import RayBackend

    return RayBackend


def make_backend(name: str, **options: object) -> Backend:
    """Create the backend called ``name`` with its options (``n_processes``, ...)."""
    return _backend_class(name)(**options)  # type: ignore[arg-type]


def backend_options(name: str) -> tuple[str, ...]:
    """The options backend ``name`` accepts (without importing ray)."""
    return _backend_class(name).OPTIONS


def check_options(name: str, options: Mapping[str, object]) -> None:
    """Raise the ``TypeError`` :func:`make_backend` would for unknown options, before any work.

    For callers that take backend options early (a sampler's constructor) and start the
    backend later.
    """
    valid = backend_options(name)
    reject_unknown_options(name, {k: v for k, v in options.items() if k not in valid}, valid)
