"""Backends: where the envs of each worker live (``local``, ``process``, ``ray``, ``asyncio``,
``thread``). Registering one is an entry of :data:`TABLE`. What code outside this package may
use is exported here; the underscored modules are the backends' own."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncsample import _validate
from asyncsample.backends._chunk import (
    DEFAULT_CHUNK_STEPS,
    AgentHost,
    ChunkBuffers,
    ChunkReply,
    ChunkRequest,
    NextChunk,
    SentChunk,
    chunk_capacity,
)
from asyncsample.backends.base import (
    Backend,
    DirectReader,
    EnvHost,
    GivenActionsHost,
    GuestBackend,
    HostSpec,
    InlineHost,
    LockstepHost,
    ProcessPool,
    RestartBudget,
    SentStep,
    reject_unknown_options,
)
from asyncsample.backends.placement import Placement, placement, pool_size

__all__ = [
    "BACKENDS",
    "DEFAULT_CHUNK_STEPS",
    "TABLE",
    "AgentHost",
    "Backend",
    "ChunkBuffers",
    "ChunkReply",
    "ChunkRequest",
    "DirectReader",
    "EnvHost",
    "GivenActionsHost",
    "GuestBackend",
    "HostSpec",
    "InlineHost",
    "LockstepHost",
    "NextChunk",
    "Placement",
    "ProcessPool",
    "RestartBudget",
    "SentChunk",
    "SentStep",
    "Traits",
    "backend_options",
    "check_options",
    "chunk_capacity",
    "make_backend",
    "placement",
    "pool_size",
    "traits",
    "with_trait",
]


@dataclass(frozen=True)
class Traits:
    """What a backend is: what the sampler and the faces ask instead of its name.

    Attributes:
        name: the backend's name (``Sampler(backend=...)``).
        cls: its :class:`Backend` class, ``"module:Class"`` here (imported on first use).
        in_process: its envs live in the caller's process (one host, sources need not pickle).
        shared_memory: its step buffers are shared memory (``/dev/shm``).
        preempts: it can cut a step that outlives ``step_timeout``.
        host_mode: its hosts are :class:`AgentHost` (``inference="host"``).
        per_env: it steps each env on its own (:mod:`asyncsample._env_tasks`).
        async_envs: its envs are async envs (:class:`~asyncsample.AsyncEnv`).
        async_hosts: its hosts also take async envs, each stepped on its own in the host's
            event loop (as ``per_env`` backends step theirs).
        lockstep: its hosts are :class:`LockstepHost` (the vector env's loop-free step).
        shared_calls: with ``inference="host"``, a host shares its agent calls among the
            workers whose copies of one agent act alike: their chunks side by side, one call a
            step (:func:`~asyncsample.backends._chunk_loop.run_joint`), or their async envs'
            rows ready in one pass of its loop in one call.
        per_host: the option that sets how many workers share a host (``None``: none).
        needs: the optional package it needs, also its extra's name (``None``: none).
    """

    name: str
    cls: str
    in_process: bool = False
    shared_memory: bool = False
    preempts: bool = True
    host_mode: bool = False
    per_env: bool = False
    async_envs: bool = False
    async_hosts: bool = False
    lockstep: bool = False
    shared_calls: bool = False
    per_host: str | None = None
    needs: str | None = None

    def backend_class(self) -> Any:
        """The backend's class, imported now."""
        module, name = self.cls.split(":")
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)

    def hosts_started(
        self, n_processes: int | None, n_workers: int, options: Mapping[str, Any]
    ) -> int:
        """How many env hosts it starts for ``n_workers`` (its placement: ``w % n``)."""
        if self.in_process:
            return 1
        n_processes = options.get("n_processes", n_processes)  # the option overrides
        per_host = None if self.per_host is None else options.get(self.per_host)
        per_host = _validate.optional_positive_int(str(self.per_host), per_host)
        return pool_size(n_processes, n_workers, per_host)

    def env_parallel(
        self, max_concurrency: int | None, envs: int, hosts: int, per_env: bool = False
    ) -> int:
        """How many of ``envs`` env steps it runs at once on ``hosts`` hosts (``per_env``: each
        env is stepped on its own there, async envs in hosts too)."""
        if not (self.per_env or per_env):  # a host steps its workers' envs one after another
            return hosts
        from asyncsample.backends.aio import lane_parallel

        return lane_parallel(self.name, max_concurrency, envs)


#: Every backend, by name: registering one is an entry here.
TABLE: dict[str, Traits] = {
    t.name: t
    for t in [
        Traits(
            "process",
            "process:ProcessBackend",
            shared_memory=True,
            host_mode=True,
            lockstep=True,
            async_hosts=True,
            shared_calls=True,
        ),
        Traits("local", "local:LocalBackend", in_process=True, preempts=False),
        Traits(
            "ray",
            "ray:RayBackend",
            host_mode=True,
            async_hosts=True,
            per_host="workers_per_actor",
            needs="ray",
        ),
        Traits("asyncio", "aio:AsyncioBackend", in_process=True, per_env=True, async_envs=True),
        Traits("thread", "aio:ThreadBackend", in_process=True, per_env=True),
    ]
}
BACKENDS = tuple(TABLE)


def traits(name: object) -> Traits:
    """The traits of backend ``name`` (a ``ValueError`` listing the names for another)."""
    return TABLE[str(_validate.choice("backend", name, BACKENDS))]


def with_trait(trait: str) -> str:
    """The backends with ``trait``, for messages: ``'process' or 'ray'``."""
    names = [repr(n) for n, t in TABLE.items() if getattr(t, trait)]
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 2 else names)


def make_backend(name: str, **options: object) -> Backend:
    """Create the backend called ``name`` with its options (``n_processes``, ...)."""
    return traits(name).backend_class()(**options)  # type: ignore[no-any-return]


def backend_options(name: str) -> tuple[str, ...]:
    """The options backend ``name`` accepts (without importing ray)."""
    return tuple(traits(name).backend_class().OPTIONS)


def check_options(name: str, options: Mapping[str, object]) -> None:
    """Raise the ``TypeError`` :func:`make_backend` would for unknown options, before any work."""
    valid = backend_options(name)
    reject_unknown_options(name, {k: v for k, v in options.items() if k not in valid}, valid)
