"""The ``local`` backend: envs stepped in the event loop's thread, no IPC.

For cheap envs and debugging. A step blocks the loop for as long as the env takes, so
``step_timeout`` cannot be honoured here (it is refused). Closing envs (a restart, ``aclose()``)
happens in a thread of its own, waited for at most ``close_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from asyncsample import _validate
from asyncsample._infos import snapshot
from asyncsample._validate import call_targets, reset_arguments, set_attr_targets
from asyncsample.backends._closing import close_off_loop, optional_close_timeout, wait_closed
from asyncsample.backends._remote import closed_error
from asyncsample.backends._slot import spec_group
from asyncsample.backends.base import (
    LOGGER,
    EnvHost,
    HostSpec,
    failure_error,
    reject_unknown_options,
)
from asyncsample.env_group import (
    EnvFailureError,
    StepBuffers,
    StepInfos,
)
from asyncsample.env_update import EnvSource

__all__ = ["CallerHost", "LocalBackend", "LocalHost"]


class _Closer:
    """Closes envs one after the other (in a thread: :func:`close_off_loop`), errors ignored."""

    def __init__(self, envs: list[Any]) -> None:
        self.envs = envs

    def close(self) -> None:
        for env in self.envs:
            with contextlib.suppress(Exception):
                env.close()


async def close_envs(envs: list[Any], close_timeout: float | None, what: str) -> None:
    """Close ``envs``: in a thread of their own, waited for at most ``close_timeout`` (then
    abandoned with a :class:`ResourceWarning`); ``None``: here, in the loop's thread."""
    if not envs:
        return
    closer = _Closer(envs)
    if close_timeout is None:
        closer.close()
        return
    await wait_closed(close_off_loop(closer), close_timeout, what)


class LocalHost:
    """Hosts one worker's envs in the main process (``close_timeout``: see :func:`close_envs`)."""

    _wrap = False  # True: every failure is a WorkerError (wrap=True on every call)

    def __init__(
        self,
        spec: HostSpec,
        close_timeout: float | None = None,
        buffers: StepBuffers | None = None,
    ) -> None:
        self.spec = spec
        self._group = spec_group(spec, buffers)
        self.buffers = self._group.buffers
        self.closed = False
        self.close_timeout = close_timeout

    def take_envs(self) -> list[Any]:
        """Take the envs out of the group (to be closed elsewhere); it holds none after."""
        envs = self._group.envs
        taken = [env for env in envs if env is not None]
        envs[:] = [None] * len(envs)
        return taken

    async def _close_envs(self) -> None:
        what = f"the envs of worker {self.spec.worker}"
        await close_envs(self.take_envs(), self.close_timeout, what)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, wrap: bool = False) -> Any:
        if self.closed:
            raise closed_error(self.spec.worker, what)
        try:
            return fn(*args)
        except EnvFailureError as exc:
            failure = exc.failure
            if not failure.retry and not (wrap or self._wrap):
                # The caller's own mistake, raised where it happened: no host boundary to cross.
                raise failure.error from None
            raise failure_error(self.spec.worker, failure) from failure.error

    async def build(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        self._call("build", self._group.build, chains, seeds)

    async def update(self, updates: Sequence[EnvSource | None], seeds: Sequence[int]) -> None:
        self._call("update", self._group.update, updates, seeds)

    async def reset(
        self,
        mask: np.ndarray,
        seeds: Sequence[int | None] | None = None,
        options: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
    ) -> dict[int, dict[str, object]]:
        args = reset_arguments(self.spec.n_envs, seeds, options)
        result: dict[int, dict[str, object]] = self._call("reset", self._group.reset, mask, *args)
        return snapshot(result) if result else result

    async def step(self, mask: np.ndarray) -> StepInfos:
        result: StepInfos = self._call("step", self._group.step, mask)
        if result.env_infos is not None or result.reset_infos:
            result = StepInfos(
                snapshot(result.env_infos), snapshot(result.reset_infos), result.final_obs
            )
        # Let other tasks run between steps: the loop must not wait for a whole call.
        await asyncio.sleep(0)
        return result

    async def call(
        self,
        name: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        envs: Sequence[int] | None = None,
    ) -> list[Any]:
        indices = call_targets(name, self.spec.n_envs, envs)
        results: list[Any] = self._call(
            "call", self._group.call, name, list(args), dict(kwargs or {}), indices, wrap=True
        )
        return results

    async def set_attr(
        self, name: str, values: Sequence[Any], envs: Sequence[int] | None = None
    ) -> None:
        indices = set_attr_targets(name, values, self.spec.n_envs, envs)
        self._call("set_attr", self._group.set_attr, name, list(values), indices, wrap=True)

    async def restart(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        if not self.closed:
            LOGGER.info("worker %d: rebuilding its envs in the main process", self.spec.worker)
            await self._close_envs()  # bounded: a close that hangs does not hold the rebuild
        await self.build(chains, seeds)

    async def close(self) -> None:
        await self._close_envs()

    def shut(self) -> None:
        """Close the envs for good: every later call raises ``SamplerClosedError``."""
        self.closed = True
        self._group.close()


class CallerHost(LocalHost):
    """A :class:`LocalHost` for the faces' sub-envs, stepped in the caller's thread
    (:meth:`step_now`); every env failure is a WorkerError naming the env, as a host's is."""

    _wrap = True
    _given: list[Any] | None = None  # the next step's actions as given (give_actions)

    def give_actions(self, actions: list[Any] | None) -> None:
        """See :meth:`~asyncsample.backends.base.GivenActionsHost.give_actions`."""
        self._given = actions

    def step_now(self, mask: np.ndarray, everyone: bool | None = None) -> StepInfos:
        """:meth:`step`, synchronously, in the caller's thread."""
        given, self._given = self._given, None
        result: StepInfos = self._call("step", self._group.step, mask, given, everyone)
        return result

    async def step(self, mask: np.ndarray) -> StepInfos:
        result = self.step_now(mask)
        await asyncio.sleep(0)
        return result


class LocalBackend:
    """Creates a :class:`LocalHost` per worker (:class:`CallerHost` with ``caller``);
    ``n_processes`` and ``host_threads`` are accepted for a uniform interface and ignored;
    ``close_timeout``: see :func:`close_envs` (``None``: envs close in the loop's thread).

    Raises:
        TypeError: an unknown option (the valid ones are listed).
        ValueError: a ``step_timeout`` (a step that blocks the loop's thread cannot be pre-empted).
    """

    OPTIONS = ("n_processes", "step_timeout", "host_threads", "caller", "close_timeout")

    def __init__(
        self,
        n_processes: int | None = None,
        step_timeout: float | None = None,
        host_threads: int | None = 1,
        caller: bool = False,
        close_timeout: float | None = None,
        **unknown: object,
    ) -> None:
        reject_unknown_options("local", unknown, self.OPTIONS)
        self.close_timeout = optional_close_timeout(close_timeout)
        _validate.optional_positive_int("n_processes", n_processes)
        _validate.optional_positive_int("host_threads", host_threads)
        if _validate.positive_seconds("step_timeout", step_timeout) is not None:
            raise ValueError(
                "step_timeout cannot be used with backend='local': a step that blocks the event "
                f"loop's thread cannot be pre-empted (got step_timeout={step_timeout!r}); use "
                "backend='process'"
            )
        self._kind = CallerHost if caller else LocalHost
        self._hosts: list[LocalHost] = []
        self.rows: list[StepBuffers] = []
        """The hosts' buffers, given before :meth:`start` (the rows of a process pool's joint
        buffers, see ``ProcessBackend.guests``); none: their own."""
        self._closed = False

    async def start(self, specs: Sequence[HostSpec]) -> list[EnvHost]:
        if self._closed:
            raise RuntimeError("the local backend is closed")
        rows: list[StepBuffers | None] = [*self.rows] or [None] * len(specs)
        self._hosts = [self._kind(s, self.close_timeout, b) for s, b in zip(specs, rows)]
        return list(self._hosts)

    async def aclose(self) -> None:
        """Close every env, in one thread waited for at most ``close_timeout`` (see
        :func:`close_envs`); every later call raises ``SamplerClosedError``."""
        self._closed = True
        hosts, self._hosts = self._hosts, []
        envs: list[Any] = []
        for host in hosts:
            host.closed = True
            envs += host.take_envs()
        await close_envs(envs, self.close_timeout, "the envs of the local backend")

    def close_now(self) -> None:
        self._closed = True
        for host in self._hosts:
            host.shut()
        self._hosts = []
