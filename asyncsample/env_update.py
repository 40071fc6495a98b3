"""Env updates: how a sampler call swaps or retasks the envs of its workers (garage's semantics),
applied where the env lives by :func:`apply_env_update`."""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import gymnasium as gym

from asyncsample.async_env import check_blocking_env
from asyncsample.multiagent.slots import as_slot_env

__all__ = [
    "EnvChoice",
    "EnvId",
    "EnvSource",
    "EnvUpdate",
    "NewEnvUpdate",
    "SetTaskUpdate",
    "apply_env_update",
    "checked_env",
    "describe_chain",
    "describe_source",
    "make_env",
    "replacement",
]

EnvSource = Any
"""Where an env comes from: a gymnasium id (``str``), a zero-argument callable returning a
``gymnasium.Env``, a ``gymnasium.Env`` (deep-copied per env) or an :class:`EnvUpdate`.
(``Any`` to type checkers: a ``gymnasium.Env`` is generic and an id is checked at run time.)"""

EnvChoice = Any
"""The envs of one worker: one :data:`EnvSource` for all, a list of one per env (``None``
keeps that env, in an update), or ``None`` (no update)."""


class EnvUpdate:
    """An update that maps the old env to the new one; the base class keeps the old env."""

    def __call__(self, old_env: gym.Env | None = None) -> gym.Env | None:
        """Return the env to use from now on."""
        return old_env


class NewEnvUpdate(EnvUpdate):
    """Replace the env by a new one from ``env_constructor()`` (the old one is closed)."""

    def __init__(self, env_constructor: Callable[[], gym.Env]) -> None:
        if not callable(env_constructor):
            raise TypeError(
                "env_constructor must be a zero-argument callable returning a gymnasium.Env, "
                f"got {env_constructor!r}"
            )
        self.env_constructor = env_constructor

    def __call__(self, old_env: gym.Env | None = None) -> gym.Env:
        if old_env is not None:
            old_env.close()
        return checked_env(self.env_constructor(), self.env_constructor)


class SetTaskUpdate(EnvUpdate):
    """Give the env a new task with ``env.unwrapped.set_task(task)``, rebuilding it from
    ``env_type()`` when there is none or its unwrapped type differs (with a warning, as garage);
    ``wrapper_constructor(env, task)``, if given, wraps a rebuilt env."""

    def __init__(
        self,
        env_type: type[gym.Env],
        task: Any,
        wrapper_constructor: Callable[[gym.Env, Any], gym.Env] | None = None,
    ) -> None:
        if not isinstance(env_type, type):
            raise ValueError(f"env_type must be a type (an env class), got {env_type!r}")
        self.env_type = env_type
        self.task = task
        self.wrapper_constructor = wrapper_constructor

    def new_env(self) -> gym.Env:
        """A new env of ``env_type`` with the task set (and wrapped)."""
        env = self.env_type()
        env.unwrapped.set_task(self.task)  # type: ignore[attr-defined]
        if self.wrapper_constructor is not None:
            env = self.wrapper_constructor(env, self.task)
        return env

    def __call__(self, old_env: gym.Env | None = None) -> gym.Env:
        return cast(gym.Env, self.retask(old_env, close=True))

    def retask(self, old_env: Any, *, close: bool) -> Any:
        """Set the task on ``old_env``, or build a new env (``close``: closing the old one)."""
        if old_env is None:
            return self.new_env()
        if type(old_env.unwrapped) is not self.env_type:
            warnings.warn(
                f"SetTaskUpdate: the env has type {type(old_env.unwrapped).__name__}, not "
                f"{self.env_type.__name__}; closing it and building a new one",
                stacklevel=3,
            )
            if close:
                old_env.close()
            return self.new_env()
        old_env.unwrapped.set_task(self.task)  # type: ignore[attr-defined]
        return old_env


class EnvId:
    """A gymnasium id and its registration, for hosts that never imported the registering module."""

    def __init__(self, env_id: str) -> None:
        self.id = env_id
        module, sep, name = env_id.rpartition(":")
        if sep:  # gymnasium's "module:EnvId": importing the module registers the id
            importlib.import_module(module)
        self.spec = gym.spec(name if sep else env_id)

    def __call__(self, **kwargs: Any) -> gym.Env:
        return gym.make(self.spec, **kwargs)

    def __repr__(self) -> str:
        return repr(self.id)


def checked_env(env: Any, source: Any) -> gym.Env:
    """``env``, built from ``source``, if it is a gymnasium env (else a ``TypeError``)."""
    if not isinstance(env, gym.Env):
        check_blocking_env(env, f"env factory {source!r}")
        raise TypeError(
            f"env factory {source!r} must return a gymnasium.Env, got {type(env).__name__}"
        )
    return env


def make_env(source: EnvSource) -> gym.Env:
    """Build a fresh env from a gymnasium id, a factory, an env (deep-copied) or an EnvUpdate."""
    if isinstance(source, str):
        return gym.make(source)
    if isinstance(source, gym.Env):
        return copy.deepcopy(source)
    if isinstance(source, EnvUpdate):
        return checked_env(as_slot_env(source(None)), source)
    if callable(source):
        return checked_env(as_slot_env(source()), source)
    raise TypeError(
        "env must be a gymnasium id (str), a zero-argument callable returning a gymnasium.Env, "
        f"a gymnasium.Env or an EnvUpdate, got {type(source).__name__}"
    )


def apply_env_update(
    old_env: gym.Env | None, update: EnvSource | None
) -> tuple[gym.Env | None, bool]:
    """Apply one update to one env: ``(env, changed)`` (``changed``: it needs a reset); ``None``
    keeps the env, an ``EnvUpdate`` is called with it, anything else replaces it."""
    if update is None:
        return old_env, False
    if isinstance(update, EnvUpdate):
        return checked_env(as_slot_env(update(old_env)), update), True
    new_env = make_env(update)
    if old_env is not None and old_env is not new_env:
        old_env.close()
    return new_env, True


def describe_source(source: EnvSource) -> str:
    """Where an env comes from, for error messages (a factory pickled by value has no file name
    in the remote traceback): a gymnasium id, or its factory's module and qualified name."""
    while isinstance(source, functools.partial):
        source = source.func
    if isinstance(source, (str, EnvId)):
        return f"gymnasium id {str(getattr(source, 'id', source))!r}"
    if isinstance(source, NewEnvUpdate):
        return describe_source(source.env_constructor)
    if isinstance(source, SetTaskUpdate):
        return f"{_qualified(source.env_type)} with task {source.task!r}"
    if isinstance(source, gym.Env):
        return f"a copy of a {_qualified(type(source))}"
    if isinstance(source, type) or inspect.isroutine(source):
        return _qualified(source)
    return f"a {_qualified(type(source))}"


def describe_chain(chain: Sequence[EnvSource]) -> str:
    """:func:`describe_source` of each source of one env, from the last that built it anew."""
    start = 0
    for i, source in enumerate(chain):
        if isinstance(source, NewEnvUpdate) or not isinstance(source, EnvUpdate):
            start = i
    return ", then ".join(describe_source(s) for s in chain[start:])


def _qualified(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return f"{module}.{name}" if module else str(name)


def replacement(update: EnvUpdate, old_env: Any) -> Any:
    """What ``update`` puts in place of ``old_env``, without closing it (the caller does, when
    the result differs): for backends whose envs may be async, with a coroutine ``close``."""
    if isinstance(update, NewEnvUpdate):
        return as_slot_env(update.env_constructor())
    if isinstance(update, SetTaskUpdate):
        return update.retask(old_env, close=False)
    return as_slot_env(update(old_env))


def is_env_source(obj: Any) -> bool:
    """Whether ``obj`` can build or update an env."""
    return isinstance(obj, (str, gym.Env, EnvUpdate)) or callable(obj)
