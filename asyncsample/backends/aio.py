"""The ``asyncio`` and ``thread`` backends: envs in the caller's process, each on its own.

``asyncio`` hosts :class:`~asyncsample.AsyncEnv` envs in the sampler's event loop; ``thread``
hosts blocking gymnasium envs in a bounded pool of threads (:class:`ThreadedEnv`). Both use a
:class:`LaneHost`, which steps one env at a time (a ``PerEnvHost``) through an ``EnvGroup``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import time
import traceback
import warnings
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from asyncsample import _validate
from asyncsample._clock import CALLS, LaneTiming
from asyncsample._tasks import run_all
from asyncsample._tree import row_copy, tree_map
from asyncsample.async_env import check_async_env
from asyncsample.backends import _watchdog
from asyncsample.backends._closing import (
    CLOSE_TIMEOUT,
    cancelled_by_env,
    close_bounded,
)
from asyncsample.backends._pacing import CallWindow
from asyncsample.backends._remote import closed_error
from asyncsample.backends._threaded import ThreadedEnv, default_threads
from asyncsample.backends.base import (
    LOGGER,
    DeadlinePassed,
    EnvHost,
    HostSpec,
    reject_unknown_options,
)
from asyncsample.env_group import (
    EPISODE_STEPS_ATTR,
    PENDING_SEED,
    SNAPSHOT_ATTR,
    EnvFailureError,
    EnvGroup,
    StepBuffers,
    StepInfos,
    lockstep_infos,
)
from asyncsample.env_update import EnvSource, EnvUpdate, make_env, replacement
from asyncsample.errors import StepTimeoutError, WorkerError
from asyncsample.multiagent.slots import as_slot_env

_perf = time.perf_counter

#: A host of async envs counts its env calls running (``settle_clock``) at most this often.
CALLS_EVERY = 0.01

__all__ = [
    "AsyncioBackend",
    "LaneHost",
    "PerEnvLockstep",
    "ThreadBackend",
    "ThreadedEnv",
    "default_threads",
    "lane_parallel",
    "make_async_env",
]


def lane_parallel(backend: str, max_concurrency: int | None, envs: int) -> int:
    """How many of ``envs`` env steps a lane backend runs at once."""
    cap = max_concurrency or (default_threads() if backend == "thread" else envs)
    return min(envs, cap)


class PerEnvLockstep:
    """The lockstep seam of :class:`EnvHost` (``reset``/``step`` of a mask of envs) made of a
    :class:`~asyncsample.backends.base.PerEnvHost`'s ``reset_one``/``step_one``, run at once."""

    n_envs: int
    buffers: StepBuffers
    in_flight: dict[int, asyncio.Task[Any]]
    reset_one: Callable[..., Coroutine[Any, Any, dict[str, Any]]]
    step_one: Callable[..., Coroutine[Any, Any, tuple[float, bool, bool, dict[str, Any]]]]
    #: Whether to time the next step taken here for the metrics: 0 not to, else the steps it
    #: stands for (a host that samples its own steps, at its :class:`~asyncsample._clock.Pace`);
    #: never, unless a host's metrics are on.
    tick: Callable[[], int] = staticmethod(lambda: 0)

    async def reset(
        self,
        mask: np.ndarray,
        seeds: Sequence[int | None] | None = None,
        options: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
    ) -> dict[int, dict[str, object]]:
        """Reset the envs in ``mask`` concurrently; their non-empty reset infos by env."""
        indices = np.flatnonzero(mask).tolist()
        seed_list, option_list = _validate.reset_arguments(self.n_envs, seeds, options)
        calls = [
            self.reset_one(
                i,
                PENDING_SEED if seed_list is None else seed_list[i],
                None if option_list is None else option_list[i],
            )
            for i in indices
        ]
        infos = await run_all(calls)
        return {i: info for i, info in zip(indices, infos) if info}

    async def step(self, mask: np.ndarray) -> StepInfos:
        """Step the envs in ``mask`` concurrently, with same-step autoreset."""
        indices = np.flatnonzero(mask).tolist()
        actions = self.buffers.actions
        results = await run_all(
            [
                self.step_one(
                    i, tree_map(lambda a, i=i: row_copy(a, i), actions), None, self.tick()
                )
                for i in indices
            ]
        )
        step_infos, reset_now = self._step_results(indices, results)
        infos = await run_all([self.reset_one(i) for i in reset_now])
        step_infos.reset_infos = {i: info for i, info in zip(reset_now, infos) if info}
        return step_infos

    def _step_results(
        self, indices: list[int], results: Sequence[tuple[float, bool, bool, dict[str, Any]]]
    ) -> tuple[StepInfos, list[int]]:
        return lockstep_infos(self.n_envs, indices, results)

    async def drop_in_flight(self, envs: Sequence[int] | None = None) -> list[int]:
        """Cancel and await the carried steps of ``envs`` (default: all); the envs that had one."""
        dropped = [i for i in (self.in_flight if envs is None else envs) if i in self.in_flight]
        tasks = [self.in_flight.pop(i) for i in dropped]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for task in tasks:
            if not task.cancelled():
                task.exception()  # retrieved: a step that failed after its round is dropped too
        return dropped


#: How late a step's ``step_timeout`` may fire and still be the step's (seconds): later, the
#: caller's loop stood still meanwhile (another env's step blocked it) and the step is given
#: that time back, so one env's block is never another env's fault.
LATE_S = 0.05


class _StepTimer:
    """A step's ``step_timeout`` in ``scope``: at ``when`` the step has timed out, unless the
    timer fires more than :data:`LATE_S` late; then it waits again for as long as it was late."""

    def __init__(self, loop: asyncio.AbstractEventLoop, scope: asyncio.Timeout, when: float):
        self.loop, self.scope, self.when = loop, scope, when
        self.handle = loop.call_at(when, self.fire)

    def fire(self) -> None:
        now = self.loop.time()
        late = now - self.when
        if late > LATE_S:
            self.when = now + late
            self.handle = self.loop.call_at(self.when, self.fire)
        else:
            self.scope.reschedule(now)  # the step's own time is out: cancelled now


class LaneHost(PerEnvLockstep):
    """Hosts one worker's envs in the caller's process, each reset and stepped on its own.

    Args:
        make: the backend's ``make(source, old)`` of an env (from a factory, id or update).
        step_timeout, close_timeout: see :class:`AsyncioBackend`.
        window: the env calls in flight across the sampler (``None``: no cap, no pacing).
        buffers: the step buffers (default: its own; an env host's are shared with the caller).
    """

    def __init__(
        self,
        spec: HostSpec,
        make: Callable[[EnvSource, Any], Any],
        step_timeout: float | None,
        window: CallWindow | None,
        close_timeout: float = CLOSE_TIMEOUT,
        buffers: StepBuffers | None = None,
    ) -> None:
        self.spec = spec
        self.n_envs = spec.n_envs
        self.buffers = buffers or StepBuffers.allocate(
            spec.observation_space,
            spec.action_space,
            spec.n_envs,
            timed=spec.timed,
            columns=spec.columns,
        )
        # With metrics on: the seconds of the env steps timed since take_timed (the fold here)
        # or settle_clock (a LaneServer's host); which: see timed_envs and tick. The env calls
        # running (env_calls): a limited step's env marked True in _stepping while it runs, a
        # plain step found where it is suspended (_lanes, in_flight): nothing per plain step.
        self.timing = LaneTiming()
        self._stepping: list[bool | None] | None = None
        self._lanes: Sequence[asyncio.Future[Any]] = ()
        if self.buffers.clock is not None:
            self._stepping = [None] * spec.n_envs
            self.tick = self.timing.pace.tick
        self._calls_due = 0.0  # a host's: when settle_clock counts the calls running again
        self._recount: asyncio.TimerHandle | None = None
        self.group = EnvGroup(
            spec.worker,
            self.buffers,
            spec.observation_space,
            spec.action_space,
            spec.max_episode_length,
        )
        self.group.malformed_retry = True  # a fault is the env's own: it is rebuilt
        self.envs: list[Any] = self.group.envs
        self._make = make
        self.step_timeout = step_timeout
        self.close_timeout = close_timeout
        self.window = window
        self._plain = step_timeout is None
        self.in_flight: dict[int, asyncio.Task[Any]] = {}  # steps a stream's round left running
        self.blocked: dict[int, _watchdog.BlockReport] = {}  # by env (_watchdog.CallerWatch)
        self.closed = False
        self._closing: set[asyncio.Task[Any]] = set()  # closes of rebuilt envs still running

    def _step_results(
        self, indices: list[int], results: Sequence[tuple[float, bool, bool, dict[str, Any]]]
    ) -> tuple[StepInfos, list[int]]:
        return self.group.step_results(indices, results)

    # -- building -----------------------------------------------------------------------------

    async def build(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        """Build env ``i`` from ``chains[i]``; its first reset gets ``seeds[i]``."""
        self._check_open("build")
        await self.drop_in_flight()
        await self._close_envs()
        for i, chain in enumerate(chains):
            self.group.place(i, self._build_env(i, chain), seeds[i])

    async def update(self, updates: Sequence[EnvSource | None], seeds: Sequence[int]) -> None:
        """Apply one update per env (``None`` keeps it); a new env object gets its new seed."""
        self._check_open("update")
        for i, update in enumerate(updates):
            if update is None:
                continue
            old = self.envs[i]
            env = self._guard(i, "update", self._make, update, old)
            if env is not old:
                if old is not None:  # the lane backends' updates leave the closing to us
                    await self._close_one(i, old)
                self.group.place(i, env, seeds[i], fresh=False)

    async def restart(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        """Rebuild every env of the worker from its chain (after an env raised or hung)."""
        LOGGER.info("worker %d: rebuilding its envs in the event loop", self.spec.worker)
        await self.build(chains, seeds)

    async def rebuild_one(self, i: int, chain: Sequence[EnvSource], seed: int) -> None:
        """Build env ``i`` again from ``chain``; the old one is closed in the background."""
        self._check_open("rebuild")
        self.blocked.pop(i, None)  # a block of the old env's (reported late) is not the new one's
        env = self._build_env(i, chain)
        old = self.envs[i]
        self.group.place(i, env, seed)
        if old is not None:
            task = asyncio.ensure_future(self._close_one(i, old))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _build_env(self, i: int, chain: Sequence[EnvSource]) -> Any:
        env = self._guard(i, "build", self._make, chain[0], None)
        for update in chain[1:]:
            env = self._guard(i, "build", self._make, update, env)
        return env

    async def _close_one(self, i: int, env: Any) -> None:
        await close_bounded(env, self.close_timeout, f"env {i} of worker {self.spec.worker}")

    # -- one env at a time (the non-lockstep stepper) ----------------------------------------

    async def reset_one(
        self,
        i: int,
        seed: Any = PENDING_SEED,
        options: dict[str, Any] | None = None,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """Reset env ``i`` (with its pending seed by default) into ``buffers.obs[i]``; its info.

        Raises:
            DeadlinePassed: the loop time ``deadline`` came first; the reset was cancelled.
        """
        self._check_open("reset")
        group = self.group
        kwargs = group.reset_kwargs(i, seed, options)
        result = await self._await(i, "reset", self.envs[i].reset(**kwargs), deadline)
        if self.blocked and i in self.blocked:  # the watchdog found it blocking the loop
            raise _watchdog.blocked_error(self.blocked.pop(i), self.spec.worker, i)
        try:
            info = group.finish_reset(i, result)
            group.store(i)
        except EnvFailureError as exc:
            raise _failure(self.spec.worker, exc) from exc.failure.error
        return info

    async def step_one(
        self, i: int, action: Any, deadline: float | None = None, timed: int = 0
    ) -> tuple[float, bool, bool, dict[str, Any]]:
        """Step env ``i`` with ``action``: :meth:`EnvGroup.finish`'s ``(reward, ...)``; with
        metrics on, ``timed`` (not 0: the steps it stands for): its seconds go to the timed
        steps' (see :meth:`timed_envs` and :attr:`tick`).

        Raises:
            DeadlinePassed: the loop time ``deadline`` came first; the step was cancelled.
            StepTimeoutError: the step took longer than ``step_timeout``.
            WorkerError: the env raised (its ``__cause__``).
        """
        if self.closed:
            raise closed_error(self.spec.worker, "step")
        stepping = self._stepping
        if deadline is None and self._plain:
            # The hot path (no timeout): the env's coroutine, awaited here in its window.
            window = self.window
            if window is not None and not window.enter_now():
                await window.enter()
            try:
                call = self.envs[i].step(action)
                if not timed:  # metrics off, or an untimed step: this one test
                    result = await call
                else:  # metrics on, a step to time
                    start = _perf()
                    try:
                        result = await call
                    finally:
                        self.timing.add(_perf() - start, timed)
            except (asyncio.CancelledError, Exception) as exc:
                raise self._raised(i, "step", exc) from exc
            finally:
                if window is not None:
                    window.leave()
        else:
            step = self.envs[i].step
            if stepping is None:
                call = step(action)
            else:
                call = self._tracked(stepping, i, step, action, timed)
            result = await self._await(i, "step", call, deadline)
        return self.finish_step(i, result)

    def finish_step(
        self, i: int, result: Any, out: np.ndarray | None = None, row: int = 0
    ) -> tuple[float, bool, bool, dict[str, Any]]:
        """Env ``i``'s step returned ``result``: :meth:`EnvGroup.finish`'s ``(reward, ...)``
        (``out``, ``row``: where its observation goes, see there).

        Raises:
            WorkerError: the watchdog found the step blocking the loop, or the result is wrong.
        """
        if self.blocked and i in self.blocked:  # the watchdog found it blocking the loop
            raise _watchdog.blocked_error(self.blocked.pop(i), self.spec.worker, i)
        try:
            return self.group.finish(i, result, out, row)
        except EnvFailureError as exc:
            raise _failure(self.spec.worker, exc) from exc.failure.error

    def direct_steps(self, windowed: bool = False) -> list[Any] | None:
        """The envs, where a lane may await an env's step itself (then :meth:`step_error` and
        :meth:`finish_step`): no ``step_timeout``, metrics off, and no :attr:`window` unless the
        lane takes its place in it (``windowed``). Else ``None``: each step goes through
        :meth:`step_one`. A coroutine less per step (the lane's frame holds ``i`` for the
        watchdog, as ``step_one``'s would)."""
        if not self._plain or self._stepping is not None or self.closed:
            return None
        return self.envs if windowed or self.window is None else None

    def step_error(self, i: int, exc: BaseException) -> WorkerError:
        """The error for env ``i``'s ``exc`` raised by its step (raised again if not the env's
        own)."""
        if self.closed:
            raise closed_error(self.spec.worker, "step") from exc
        return self._raised(i, "step", exc)

    async def _tracked(
        self, stepping: list[bool | None], i: int, step: Any, action: Any, timed: int
    ) -> Any:
        """``step(action)`` with metrics on, once :meth:`_await` runs it (after the limiter):
        marked running in ``stepping`` until it returns or raises (see :attr:`env_calls`), and
        timed if ``timed``."""
        stepping[i] = True
        try:
            call = step(action)
            return await (self._timed(call, timed) if timed else call)
        finally:
            stepping[i] = None

    async def _timed(self, call: Any, weight: int) -> Any:
        """``call`` awaited, its seconds added to the timed steps' (standing for ``weight``)."""
        start = _perf()
        try:
            return await call
        finally:
            self.timing.add(_perf() - start, weight)

    @property
    def env_calls(self) -> int:
        """The env steps running now (metrics on; else 0): from the start of a step call
        (after its ``max_concurrency`` slot) until it returns or raises. Read when scraped,
        from any thread: the marks of the limited steps, and the plain steps suspended in the
        env's call (see :meth:`_in_env_call`), each looked at once under the GIL."""
        stepping = self._stepping
        if stepping is None:
            return 0
        marked = len(stepping) - stepping.count(None)
        lanes = {*self._lanes, *list(self.in_flight.values())}  # a detached lane is in both
        return marked + sum(1 for task in lanes if self._in_env_call(task))

    def _in_env_call(self, lane: asyncio.Future[Any]) -> bool:
        """Whether ``lane`` (a lane's task, a carried step's, a host process's serving task)
        waits in the env's call of a plain :meth:`step_one`: down its awaits, a ``step_one``
        not awaiting :meth:`_await` (a limited step: its mark counts). A mark per plain step
        cost 1.5-2% of a zero-latency one; keeping its call, 2-3% (A/B, 2026-11-28)."""
        get_coro = getattr(lane, "get_coro", None)
        step = None if get_coro is None or lane.done() else get_coro()
        step_one = LaneHost.step_one.__code__
        waits = (getattr(self._await, "__code__", None), CallWindow.enter.__code__)  # no call yet
        for _ in range(4):
            step = getattr(step, "cr_await", None)
            if getattr(step, "cr_code", None) is step_one:
                inner = getattr(step, "cr_await", None)
                return inner is not None and getattr(inner, "cr_code", None) not in waits
        return False

    def watch_lanes(self, lanes: Sequence[asyncio.Future[Any]]) -> None:
        """See :meth:`~asyncsample.backends.base.PerEnvHost.watch_lanes` (kept with metrics on,
        until the next call's; a host process's server gives one list it adds its serving
        tasks to)."""
        if self._stepping is not None:
            self._lanes = lanes

    def timed_envs(self) -> frozenset[int]:
        """With metrics on, the envs whose every step the next call's lanes time (see
        :meth:`~asyncsample._clock.LaneTiming.envs`); else none. A host of async envs in
        another process paces its own steps (see :attr:`tick`)."""
        if self._stepping is None:
            return frozenset()
        return self.timing.envs(self.n_envs)

    def take_timed(self, per_step: float) -> list[float]:
        """See :meth:`~asyncsample._clock.LaneTiming.take` (the fold in this process)."""
        return self.timing.take(per_step)

    def settle_clock(self) -> None:
        """Add the env steps timed since the last call to the clock, each weighing the steps it
        stands for, and the calls running (before the metrics read it)."""
        clock = self.buffers.clock
        assert clock is not None
        self.timing.settle(clock)
        # A host's calls in flight, read by the caller with the replies: counted over every env,
        # so at most once in CALLS_EVERY seconds (a host settles each pass of its loop), and
        # again once that has passed when a settle came too soon.
        now = _perf()
        if now >= self._calls_due:
            self._count_calls()
        elif self._recount is None:
            loop = asyncio.get_running_loop()
            self._recount = loop.call_later(self._calls_due - now, self._count_calls)

    def _count_calls(self) -> None:
        """Write the calls running into the clock (a host's ``CALLS`` cell)."""
        clock = self.buffers.clock
        assert clock is not None
        if self._recount is not None:
            self._recount.cancel()
            self._recount = None
        self._calls_due = _perf() + CALLS_EVERY
        clock[CALLS] = self.env_calls

    async def _await(self, i: int, what: str, call: Any, deadline: float | None) -> Any:
        """Await an env call in the window, under ``step_timeout`` and ``deadline``."""
        loop = asyncio.get_running_loop()
        timeout = self.step_timeout
        window = self.window
        by_deadline = False
        try:
            if window is not None and not window.enter_now():
                await window.enter()  # (not the call's time: step_timeout starts after it)
            try:
                step_when = None if timeout is None else loop.time() + timeout
                by_deadline = deadline is not None and (step_when is None or deadline <= step_when)
                when = deadline if by_deadline else step_when
                if when is None:
                    return await call
                if by_deadline or deadline is not None:  # a deadline is wall-clock, blocks or not
                    async with asyncio.timeout_at(when):
                        return await call
                async with asyncio.timeout(None) as scope:
                    timer = _StepTimer(loop, scope, when)
                    try:
                        return await call
                    finally:
                        timer.handle.cancel()
            finally:
                if window is not None:
                    window.leave()
        except TimeoutError:
            if by_deadline:  # a call in a thread runs on: its env is tied up until it returns
                busy = self.envs[i].busy if isinstance(self.envs[i], ThreadedEnv) else None
                raise DeadlinePassed(busy is not None and not busy.done()) from None
            raise StepTimeoutError(
                f"env {i} of worker {self.spec.worker}: {what} took longer than "
                f"step_timeout={timeout:g}s",
                worker=self.spec.worker,
                env=i,
            ) from None
        except (asyncio.CancelledError, Exception) as exc:
            raise self._raised(i, what, exc) from exc
        finally:
            if asyncio.iscoroutine(call):
                call.close()  # never awaited when the window's wait was cancelled

    def _raised(self, i: int, what: str, exc: BaseException) -> WorkerError:
        """The error for env ``i``'s ``exc`` in ``what`` (raised again if not the env's own)."""
        if isinstance(exc, WorkerError) or (
            isinstance(exc, asyncio.CancelledError) and not cancelled_by_env()
        ):
            raise exc
        return _env_error(self.spec.worker, i, what, exc)

    async def call(
        self,
        name: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        envs: Sequence[int] | None = None,
    ) -> list[Any]:
        """``getattr(env, name)`` of each env, called (and awaited) when callable."""
        self._check_open("call")
        out = []
        for i in _validate.call_targets(name, self.n_envs, envs):
            try:
                value = getattr(self.envs[i], name)
                if callable(value):
                    value = value(*args, **dict(kwargs or {}))
                if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
                    value = await value
            except Exception as exc:
                err = _env_error(self.spec.worker, i, f"call {name!r}", exc)
                err.retry = not isinstance(exc, AttributeError)
                raise err from exc
            out.append(value)
        return out

    async def set_attr(
        self, name: str, values: Sequence[Any], envs: Sequence[int] | None = None
    ) -> None:
        """Set attribute ``name`` of env ``envs[k]`` to ``values[k]``."""
        self._check_open("set_attr")
        if name == EPISODE_STEPS_ATTR:
            self.group.set_attr(
                name, values, _validate.set_attr_targets(name, values, self.n_envs, envs)
            )
            return
        if name == SNAPSHOT_ATTR:  # the envs' set_state, awaited where it is a coroutine
            for i, value in zip(
                _validate.set_attr_targets(name, values, self.n_envs, envs), values
            ):
                done = self.envs[i].get_wrapper_attr("set_state")(value)
                if inspect.isawaitable(done):
                    await done
            return
        for i, value in zip(_validate.set_attr_targets(name, values, self.n_envs, envs), values):
            setattr(self.envs[i], name, value)

    async def close(self) -> None:
        """Close the envs (awaiting their ``close``). Idempotent."""
        await self._close_envs()

    async def shut(self) -> None:
        """Close the envs for good: every later call raises ``SamplerClosedError``."""
        self.closed = True
        await self.drop_in_flight()
        await self._close_envs()
        if self._closing:  # each bounded by close_timeout
            await asyncio.wait(list(self._closing))

    async def _close_envs(self) -> None:
        envs = list(self.envs)
        self.envs[:] = [None] * self.n_envs
        await asyncio.gather(
            *(self._close_one(i, env) for i, env in enumerate(envs) if env is not None)
        )

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise closed_error(self.spec.worker, what)

    def _guard(self, i: int, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            err = _env_error(self.spec.worker, i, what, exc)
            err.retry = not isinstance(exc, (TypeError, ValueError))  # else the caller's mistake
            raise err from exc


def _failure(worker: int, exc: EnvFailureError) -> WorkerError:
    """The ``WorkerError`` for what :class:`EnvGroup` found wrong with an env's answer."""
    failure = exc.failure
    return WorkerError(str(failure.error), worker=worker, env=failure.env, retry=failure.retry)


def _env_error(worker: int, env: int, what: str, exc: BaseException) -> WorkerError:
    """The ``WorkerError`` for env ``env``'s exception during ``what``."""
    return WorkerError(
        f"env {env} of worker {worker} raised during {what}: {type(exc).__name__}: {exc}",
        worker=worker,
        env=env,
        remote_traceback="".join(traceback.format_exception(exc)),
    )


def make_async_env(source: EnvSource, old: Any) -> Any:
    """An async env from a factory or an env update (``asyncio`` backend)."""
    if isinstance(source, EnvUpdate):
        env = replacement(source, old)
    elif callable(source):
        env = as_slot_env(source())
    else:
        raise TypeError(
            "env: backend='asyncio' takes a zero-argument callable returning an "
            f"asyncsample.AsyncEnv, got {type(source).__name__}"
        )
    check_async_env(env, "env")
    return env


class AsyncioBackend:
    """Creates a :class:`LaneHost` per worker for envs whose calls are coroutines.

    Args:
        n_processes, host_threads: accepted for a uniform interface and ignored (no processes).
        step_timeout: seconds a step may take; past it the env is rebuilt (a failure).
        max_concurrency: env calls in flight at once across the sampler (``None``: no cap).
        close_timeout: the longest an env's ``close()`` is waited for.
        loop_lag: the event loop's lag (seconds) to keep to by running fewer env calls at once
            while it is behind (see :mod:`~asyncsample.backends._pacing`; ``LOOP_LAG``, 2 ms,
            suits a loop shared with a service); ``None`` (the default): as many as
            ``max_concurrency``, whatever the loop's lag.
    """

    OPTIONS = (
        "n_processes",
        "step_timeout",
        "host_threads",
        "max_concurrency",
        "close_timeout",
        "loop_lag",
    )
    NAME = "asyncio"
    POOLED = False  # True: the pool of threads caps the env calls, not a limiter

    def __init__(
        self,
        n_processes: int | None = None,
        step_timeout: float | None = None,
        host_threads: int | None = 1,
        max_concurrency: int | None = None,
        close_timeout: float = CLOSE_TIMEOUT,
        loop_lag: float | None = None,
        **unknown: object,
    ) -> None:
        reject_unknown_options(self.NAME, unknown, self.OPTIONS)
        self.loop_lag = _validate.positive_seconds("loop_lag", loop_lag)
        timeout = _validate.positive_seconds("close_timeout", close_timeout)
        self.close_timeout = CLOSE_TIMEOUT if timeout is None else timeout
        _validate.optional_positive_int("n_processes", n_processes)
        _validate.optional_positive_int("host_threads", host_threads)
        self.step_timeout = _validate.positive_seconds("step_timeout", step_timeout)
        self.max_concurrency = _validate.optional_positive_int("max_concurrency", max_concurrency)
        self._hosts: list[LaneHost] = []
        self._window: CallWindow | None = None
        self._closed = False
        self._watch: _watchdog.CallerWatch | None = None  # the loop, watched for envs that block it

    def _make(self, source: EnvSource, old: Any) -> Any:
        return make_async_env(source, old)

    async def start(self, specs: Sequence[HostSpec]) -> list[EnvHost]:
        """One :class:`LaneHost` per spec; one window of env calls shared by all."""
        if self._closed:
            raise RuntimeError(f"the {self.NAME} backend is closed")
        cap = None if self.POOLED else self.max_concurrency  # (else the pool's threads cap)
        if cap is not None or self.loop_lag is not None:
            self._window = CallWindow(cap, self.loop_lag)
        window = self._window
        self._hosts = [
            LaneHost(s, self._make, self.step_timeout, window, self.close_timeout) for s in specs
        ]
        self._watch = _watchdog.CallerWatch(self.step_timeout, self._hosts)
        return list(self._hosts)

    async def aclose(self) -> None:
        """Close every env (awaiting their ``close``). Idempotent."""
        self._closed = True
        _watchdog.stop_watch(self._watch)
        if self._window is not None:
            self._window.close()
        hosts, self._hosts = self._hosts, []
        await asyncio.gather(*(h.shut() for h in hosts))

    def close_now(self) -> None:
        """Forget the envs without awaiting their ``close`` (an unclosed sampler collected)."""
        self._closed = True
        _watchdog.stop_watch(self._watch)
        if self._window is not None:
            self._window.close()
        for host in self._hosts:
            host.closed = True
        self._hosts = []


class ThreadBackend(AsyncioBackend):
    """Blocking gymnasium envs stepped in a bounded pool of threads (:class:`ThreadedEnv`) of
    ``max_concurrency`` threads (default :func:`default_threads`)."""

    NAME = "thread"
    POOLED = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.max_concurrency or default_threads(),
            thread_name_prefix="asyncsample-env",
        )
        self._running: set[concurrent.futures.Future[Any]] = set()

    def _make(self, source: EnvSource, old: Any) -> Any:
        if isinstance(source, EnvUpdate):
            inner = replacement(source, None if old is None else old.env)
            if old is not None and inner is old.env:
                return old
            if not isinstance(inner, gym.Env):
                raise TypeError(
                    f"env update {source!r} must give a gymnasium.Env on backend='thread', "
                    f"got {type(inner).__name__}"
                )
        else:
            inner = make_env(source)
        return ThreadedEnv(inner, self._executor, self._running)

    async def aclose(self) -> None:
        """Close every env, then stop the pool's threads, waiting at most ``close_timeout`` for
        calls still running (then abandoned with a ``ResourceWarning``)."""
        try:
            await super().aclose()
        finally:
            executor = self._executor
            executor.shutdown(wait=False, cancel_futures=True)
            running = [asyncio.wrap_future(f) for f in list(self._running) if not f.done()]
            stuck: set[Any] = set()
            if running:
                _, stuck = await asyncio.wait(running, timeout=self.close_timeout)
            if not stuck:  # every thread is idle: they exit at once; join them
                await asyncio.to_thread(executor.shutdown, wait=True)
            else:
                warnings.warn(
                    f"backend 'thread': {len(stuck)} env call(s) still run "
                    f"close_timeout={self.close_timeout:g}s after aclose(); their threads "
                    "are abandoned to finish on their own",
                    ResourceWarning,
                    stacklevel=2,
                )

    def close_now(self) -> None:
        """Stop the pool without waiting."""
        super().close_now()
        self._executor.shutdown(wait=False, cancel_futures=True)
