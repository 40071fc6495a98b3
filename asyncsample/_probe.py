"""The one env a sampler builds in the caller's process to read the spaces and step limit; it is
closed off the event loop's thread, and ``aclose()`` may wait for that close, bounded."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncsample import _validate
from asyncsample.async_env import is_async_env, time_limit
from asyncsample.backends._closing import close_off_loop
from asyncsample.backends.aio import probe_async_env, read_async_env
from asyncsample.batch import EnvSpec
from asyncsample.env_update import EnvUpdate, checked_env, make_env

__all__ = ["probe_spaces"]


def probe_spaces(
    source: Any,
    *,
    asynchronous: bool | None,
    max_episode_length: int | None,
    close_timeout: float,
) -> tuple[EnvSpec, bool, asyncio.Future[Any] | None, bool]:
    """Build one env from ``source`` (the first of a list; an async env if ``asynchronous``)
    and read its spaces: the env spec, whether the env has a time limit of its own, and the close
    still running (``None``: closed already), and whether it is an async env (``asynchronous``
    ``None``: either kind, as it turns out). ``ValueError``: it could not be built or recorded;
    ``TypeError``: an env of the wrong kind for the backend."""
    first = source[0] if isinstance(source, list) else source
    closing: asyncio.Future[Any] | None
    built = None
    if asynchronous is None and callable(first) and not isinstance(first, EnvUpdate):
        try:
            built = first()
        except Exception as exc:
            raise ValueError(f"env: could not build an env from {first!r}: {exc}") from exc
        asynchronous = is_async_env(built)
    if asynchronous and built is not None:
        observation_space, action_space, limit, closing = read_async_env(built, close_timeout)
    elif asynchronous:
        observation_space, action_space, limit, closing = probe_async_env(first, close_timeout)
    else:
        try:
            env = make_env(first) if built is None else checked_env(built, first)
        except Exception as exc:
            raise ValueError(f"env: could not build an env from {first!r}: {exc}") from exc
        try:
            observation_space, action_space = env.observation_space, env.action_space
            limit = time_limit(env)
        finally:
            closing = close_off_loop(env)
    _validate.recordable_space("env: observation_space", observation_space)
    _validate.recordable_space("env: action_space", action_space)
    spec = EnvSpec(
        observation_space=observation_space,
        action_space=action_space,
        max_episode_length=max_episode_length or limit,
    )
    return spec, limit is not None, closing, bool(asynchronous)
