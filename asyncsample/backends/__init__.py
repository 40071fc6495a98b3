"""Backends: where the envs of each worker live.

A worker talks to its envs through one small async interface, :class:`EnvHost`. A
:class:`Backend` starts one host per worker. ``local`` keeps envs in the main process, ``process``
in a pool of env-host processes, ``ray`` in Ray actors; the worker and sampler code is the same.
"""

from __future__ import annotations

from collections.abc import Mapping

from asyncsample.backends.base import Backend, EnvHost, HostSpec, reject_unknown_options

__all__ = ["Backend", "EnvHost", "HostSpec", "backend_options", "check_options", "make_backend"]

BACKENDS = ("process", "local", "ray")


def make_backend(name: str, **options: object) -> Backend:
    """Create the backend called ``name`` with its options (``n_processes``, ...)."""
    if name == "local":
        from asyncsample.backends.local import LocalBackend

        return LocalBackend(**options)  # type: ignore[arg-type]
    if name == "process":
        from asyncsample.backends.process import ProcessBackend

        return ProcessBackend(**options)  # type: ignore[arg-type]
    if name == "ray":
        from asyncsample.backends.ray import RayBackend

        return RayBackend(**options)  # type: ignore[arg-type]
    raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {name!r}")


def backend_options(name: str) -> tuple[str, ...]:
    """The options backend ``name`` accepts (without importing ray)."""
    if name == "local":
        from asyncsample.backends.local import LocalBackend

        return LocalBackend.OPTIONS
    if name == "process":
        from asyncsample.backends.process import ProcessBackend

        return ProcessBackend.OPTIONS
    if name == "ray":
        from asyncsample.backends.ray import RayBackend

        return RayBackend.OPTIONS
    raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {name!r}")


def check_options(name: str, options: Mapping[str, object]) -> None:
    """Raise the ``TypeError`` :func:`make_backend` would for unknown options, before any work.

    For callers that take backend options early (a sampler's constructor) and start the
    backend later.
    """
    valid = backend_options(name)
    reject_unknown_options(name, {k: v for k, v in options.items() if k not in valid}, valid)
