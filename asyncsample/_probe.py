"""The one env a sampler builds in the caller's process to read the spaces and step limit.

Built where it costs the caller's event loop nothing: a blocking env in a daemon thread of its
own whenever a loop runs in the constructor's thread (:class:`Probe`), read when the sampler
starts, then closed in that same thread; with no loop running, or for an async env (whose
factory the ``asyncio`` backend calls in the loop for every env anyway), at once, closed off the
loop's thread. ``aclose()`` may wait for that close, bounded by ``close_timeout``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

from asyncsample import _validate
from asyncsample._daemon_threads import start_daemon
from asyncsample.async_env import check_async_env, is_async_env, time_limit
from asyncsample.backends._closing import CLOSE_TIMEOUT, close_bounded, close_off_loop
from asyncsample.batch import EnvSpec
from asyncsample.env_update import EnvId, EnvUpdate, checked_env, make_env
from asyncsample.multiagent.slots import as_slot_env

__all__ = [
    "Probe",
    "Probed",
    "loop_runs_here",
    "maybe_async",
    "probe_spaces",
    "wait_probe_closed",
]

Closing = asyncio.Future[Any] | concurrent.futures.Future[None]
"""A close still running: on the loop (a task or a future a thread completes), or in a thread."""


@dataclass(frozen=True)
class Probed:
    """What the probe env told: the env spec, whether the env has a time limit of its own, its
    close still running (``None``: closed already), and whether it is an async env."""

    spec: EnvSpec
    time_limited: bool
    closing: Closing | None
    asynchronous: bool = False


def probe_spaces(
    source: Any,
    *,
    asynchronous: bool | None,
    max_episode_length: int | None,
    close_timeout: float,
) -> Probed:
    """Build one env from ``source`` (the first of a list; an async env if ``asynchronous``,
    either kind if ``None``: the host backends take both) here and now, and read its spaces.
    ``ValueError``: it could not be built or recorded; ``TypeError``: an env of the wrong kind
    for the backend."""
    first = source[0] if isinstance(source, list) else source
    closing: Closing | None
    built = _build_either(first) if asynchronous is None else None
    if asynchronous or is_async_env(built):
        if built is None:
            observation_space, action_space, limit, closing = probe_async_env(first, close_timeout)
        else:
            observation_space, action_space, limit, closing = read_async_env(built, close_timeout)
        probed = _probed(observation_space, action_space, limit, max_episode_length, closing)
        return dataclasses.replace(probed, asynchronous=True)
    env = _build(first) if built is None else _checked(built, first)
    try:
        observation_space, action_space = env.observation_space, env.action_space
        limit = time_limit(env)
    finally:
        closing = close_off_loop(env)
    return _probed(observation_space, action_space, limit, max_episode_length, closing)


class Probe:
    """A blocking env built, read and closed in a daemon thread of its own, started at once.

    :meth:`result` (in a loop: :meth:`wait`) gives the :class:`Probed` or raises what
    :func:`probe_spaces` would have raised; the close runs in the same thread after the spaces
    are read (``Probed.closing``). A build or close that never returns holds neither the loop nor
    the interpreter's exit for long (see :mod:`asyncsample._daemon_threads`).
    """

    def __init__(
        self,
        source: Any,
        *,
        max_episode_length: int | None,
        either: bool = False,
        close_timeout: float = 10.0,
    ) -> None:
        self._future: concurrent.futures.Future[Probed] = concurrent.futures.Future()
        first = source[0] if isinstance(source, list) else source
        start_daemon(
            self._run, first, max_episode_length, either, close_timeout, name="asyncsample-probe"
        )

    def _run(
        self, source: Any, max_episode_length: int | None, either: bool, close_timeout: float
    ) -> None:
        """``either``: the env may be an async env (the host backends), closed here with a loop
        of this thread's own."""
        closing: concurrent.futures.Future[None] = concurrent.futures.Future()
        env = None
        try:
            built = _build_either(source) if either else None
            if is_async_env(built):
                spaces = read_async_env(built, close_timeout)  # closed now, in a loop of its own
                probed = _probed(*spaces[:3], max_episode_length, closing)
                probed = dataclasses.replace(probed, asynchronous=True)
            else:
                env = _build(source) if built is None else _checked(built, source)
                observation_space, action_space = env.observation_space, env.action_space
                limit = time_limit(env)
                probed = _probed(
                    observation_space, action_space, limit, max_episode_length, closing
                )
        except BaseException as exc:
            self._future.set_exception(exc)
        else:
            self._future.set_result(probed)
        finally:
            if env is not None:
                try:
                    env.close()
                except Exception:  # as close_off_loop: a broken close is not the sampler's
                    pass
            closing.set_result(None)

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> Probed:
        """The probe's outcome, waiting for it in this thread if need be."""
        return self._future.result()

    async def wait(self) -> Probed:
        """The probe's outcome, awaited."""
        return await asyncio.wrap_future(self._future)

    async def wait_for(self, timeout: float) -> Probed | None:
        """The probe's outcome, awaited (``None``: not done within ``timeout`` seconds)."""
        waiting = asyncio.wrap_future(self._future)
        done, _ = await asyncio.wait([waiting], timeout=timeout)
        if not done:  # left to finish in its thread (not cancelled: the thread sets it)
            waiting.add_done_callback(_retrieved)
            return None
        return waiting.result()


async def wait_probe_closed(closing: Closing | None, close_timeout: float) -> None:
    """Wait for the probe env's close at most ``close_timeout`` (plus a second for an async close,
    which bounds itself); a close in a thread still running then is abandoned with a
    :class:`ResourceWarning`."""
    if closing is None or closing.done():
        return
    waiting = closing if isinstance(closing, asyncio.Future) else asyncio.wrap_future(closing)
    _, stuck = await asyncio.wait([waiting], timeout=close_timeout + 1.0)
    if stuck:
        warnings.warn(
            f"the env built to read the spaces: its close() did not return within "
            f"close_timeout={close_timeout:g}s; its thread is abandoned",
            ResourceWarning,
            stacklevel=3,
        )


def loop_runs_here() -> bool:
    """Whether an event loop runs in this thread (a constructor called from a coroutine)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Read the outcome of a future nobody awaits any more (no "never retrieved" warning)."""
    if not future.cancelled():
        future.exception()


def _build(source: Any) -> Any:
    try:
        return make_env(source)
    except Exception as exc:
        raise ValueError(f"env: could not build an env from {source!r}: {exc}") from exc


def maybe_async(source: Any) -> bool:
    """Whether ``source`` (or the first of a list) may build an async env: a factory may; an
    id, an env or an update gives a blocking env."""
    first = source[0] if isinstance(source, list) else source
    return callable(first) and not isinstance(first, (str, EnvId, EnvUpdate))


def _build_either(source: Any) -> Any:
    """The env a factory makes, of either kind (``None`` for an id, an env or an update: those
    give blocking envs, :func:`_build` makes them)."""
    if not maybe_async(source):
        return None
    try:
        return as_slot_env(source())
    except Exception as exc:
        raise ValueError(f"env: could not build an env from {source!r}: {exc}") from exc


def _checked(env: Any, source: Any) -> Any:
    """A blocking env a factory made (a ``ValueError`` for anything else, as :func:`_build`)."""
    try:
        return checked_env(env, source)
    except Exception as exc:
        raise ValueError(f"env: could not build an env from {source!r}: {exc}") from exc


def _probed(
    observation_space: Any,
    action_space: Any,
    limit: int | None,
    max_episode_length: int | None,
    closing: Closing | None,
) -> Probed:
    _validate.recordable_space("env: observation_space", observation_space)
    _validate.recordable_space("env: action_space", action_space)
    spec = EnvSpec(
        observation_space=observation_space,
        action_space=action_space,
        max_episode_length=max_episode_length or limit,
    )
    return Probed(spec, limit is not None, closing)


def probe_async_env(
    source: Any, close_timeout: float = CLOSE_TIMEOUT
) -> tuple[gym.Space[Any], gym.Space[Any], int | None, asyncio.Task[Any] | None]:
    """Build one async env from ``source`` to read its spaces and step limit, then close it:
    now if no loop runs, else in a task (returned, else ``None``) for ``aclose()`` to await.

    Raises:
        TypeError: ``source`` is not a factory, or builds a blocking env (use ``"thread"``).
        ValueError: the factory raised.
    """
    if isinstance(source, str) or not callable(source):
        raise TypeError(
            "env: backend='asyncio' takes a zero-argument callable returning an "
            f"asyncsample.AsyncEnv, got {type(source).__name__} {source!r:.60}"
        )
    try:
        env = as_slot_env(source())
    except Exception as exc:
        raise ValueError(f"env: could not build an env from {source!r}: {exc}") from exc
    if isinstance(env, gym.Env):
        raise TypeError(
            f"env: backend='asyncio' needs envs whose reset and step are coroutines (an "
            f"asyncsample.AsyncEnv); {source!r} returned {type(env).__name__}, a blocking "
            "gymnasium.Env: use backend='thread' (or 'process') for it"
        )
    return read_async_env(env, close_timeout)


def read_async_env(
    env: Any, close_timeout: float = CLOSE_TIMEOUT
) -> tuple[gym.Space[Any], gym.Space[Any], int | None, asyncio.Task[Any] | None]:
    """The spaces and step limit of the async env ``env``, which is then closed (see
    :func:`probe_async_env`)."""
    check_async_env(env, "env")
    limit = getattr(env, "max_episode_steps", None)
    if limit is None:
        limit = getattr(getattr(env, "spec", None), "max_episode_steps", None)
    closing = close_bounded(env, close_timeout, "the env built to read the spaces")
    task = None
    try:
        task = asyncio.get_running_loop().create_task(closing)
    except RuntimeError:  # no loop runs
        asyncio.run(closing)
    return env.observation_space, env.action_space, limit, task
