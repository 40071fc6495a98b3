"""A gymnasium ``VectorEnv`` whose sub-envs live on the process pool.

:class:`VectorEnv` packs its ``num_envs`` sub-envs ``num_envs / n_processes`` to an env host of the
``process`` backend: the same env-group code, shared-memory step buffers and framed transport as
the sampler, one round trip per host and step (not one per env). For the same seeds and actions it
returns exactly what :class:`gymnasium.vector.SyncVectorEnv` returns.

How the three autoreset modes map onto the hosts, which always reset an env in the step that ends
its episode (same-step autoreset):

* ``SAME_STEP`` is what the hosts do. The true last observation travels home beside the step's
  info (only on the steps that end an episode), so ``info["final_obs"]`` holds exactly what the
  env returned.
* ``NEXT_STEP`` (gymnasium's default): a small wrapper around every sub-env, in its host, defers
  that automatic reset. The step that ends an episode returns the last observation; the next step
  does not step the env but resets it (``reset()`` without a seed, so it draws from the env's RNG
  exactly as ``SyncVectorEnv`` does) and returns the first observation, reward 0, both flags
  false and the reset's info. A ``reset()`` by the caller in between is the only reset the env
  sees, as with ``SyncVectorEnv``.
* ``DISABLED``: the same deferral; the caller resets finished sub-envs with
  ``reset(options={"reset_mask": mask})``. Stepping a finished sub-env raises ``RuntimeError``.

Calls: :class:`VectorEnv` is synchronous, as gymnasium's API is. Each call runs a private event
loop until its requests are answered: in the caller's thread, or, when the caller is itself inside
a running event loop (a coroutine, a notebook), in a helper thread while the caller waits. Either
way the caller's thread is blocked for the call, as with any gymnasium vector env; from async code
prefer :class:`~asyncsample.Sampler`, which never blocks its loop. A step costs the main process
little: its requests go out before the loop runs (``step_async`` returns right then), and the
loop runs once, until the hosts' replies are in, with no task created per step.

EnvPool-style stepping: with ``batch_size`` below ``num_envs``, :meth:`VectorEnv.async_reset`,
:meth:`VectorEnv.send` and :meth:`VectorEnv.recv` drop the lockstep: sub-envs are grouped
``gcd(num_envs, batch_size)`` to an env host, hosts answer independently, and ``recv`` returns the
first ``batch_size`` sub-envs answered with their indices in ``info["env_id"]``; ``send`` takes
actions for the sub-envs of earlier ``recv`` batches.

Faults: a sub-env that raises fails the call with :class:`SubEnvError` naming the sub-env, with
the remote traceback and the env's exception as its ``__cause__`` (a missing attribute raises
:class:`SubEnvAttributeError`, also an ``AttributeError``). A host process that dies or outlives
``step_timeout`` during a step is rebuilt (at most ``max_restarts`` times per host over the
vector env's life) and its sub-envs start new episodes: that step returns them with
``truncated=True``, ``terminated=False``, reward 0, the new episode's first observation and the
reason in ``info["restarted"]`` (with its ``"_restarted"`` mask). In ``NEXT_STEP`` mode the next
step is their autoreset step as usual (the same first observation, reward 0, the reset's info);
in ``SAME_STEP`` mode ``info["final_obs"]`` holds that first observation too, since the last one
died with the host. Past the budget the :class:`~asyncsample.WorkerCrashedError` (or
:class:`~asyncsample.StepTimeoutError`) is raised. After any raised error the failed host's
sub-envs refuse to step until ``reset()``, which rebuilds them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import select
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector import VectorEnv as _GymVectorEnv
from gymnasium.vector.utils import batch_space

from asyncsample import _validate
from asyncsample._tree import Tree, tree_map
from asyncsample.backends import make_backend, pool_size
from asyncsample.backends.base import EnvHost, HostSpec
from asyncsample.env_update import EnvId, make_env
from asyncsample.errors import AsyncSampleError, StepTimeoutError, WorkerCrashedError, WorkerError

__all__ = ["SubEnvAttributeError", "SubEnvError", "VectorEnv"]

_T = TypeVar("_T")

#: Where a host-side wrapper puts the raw last observation of an episode (same-step mode).
_FINAL_OBS_KEY = "__asyncsample_final_obs__"


class SubEnvError(WorkerError):
    """A sub-env of a :class:`VectorEnv` (or of the SB3 face) raised.

    Attributes:
        sub_env: index of the sub-env in the vector env.
        worker: index of the env host that held it; ``env``: the same as ``sub_env``.
        remote_traceback: the traceback text from the env-host process.
    """

    def __init__(
        self, message: str, *, sub_env: int, host: int, remote_traceback: str | None = None
    ) -> None:
        text = f"sub-env {sub_env} (env host {host}): {message}"
        if remote_traceback:
            text += f"\n\nRemote traceback:\n{remote_traceback.rstrip()}"
        AsyncSampleError.__init__(self, text)
        self.sub_env = sub_env
        self.worker = host
        self.env = sub_env
        self.remote_traceback = remote_traceback
        self.retry = True


class SubEnvAttributeError(SubEnvError, AttributeError):
    """A sub-env has no such attribute (also an ``AttributeError``, as SB3's ``has_attr`` and
    gymnasium expect)."""


# -- the host side ------------------------------------------------------------------------------


class _SubEnv(gym.Wrapper[Any, Any, Any, Any]):
    """Wraps every sub-env inside its host: defers autoresets and ships true last observations.

    Attribute reads and writes pass through to the wrapped env (``get_wrapper_attr`` and
    ``set_wrapper_attr`` are forwarded), so the wrapper is invisible to ``call``/``get_attr``/
    ``set_attr``.
    """

    def __init__(self, env: gym.Env[Any, Any], defer: bool, ship_final_obs: bool) -> None:
        super().__init__(env)
        self._as_defer = defer
        self._as_ship = ship_final_obs
        self._as_done = False
        self._as_last: Any = None

    @property
    def spec(self) -> Any:  # type: ignore[override]
        return self.env.spec

    def get_wrapper_attr(self, name: str) -> Any:
        if name.startswith("_asyncsample_"):
            return getattr(self, name)  # the faces' own helpers below
        return self.env.get_wrapper_attr(name)

    def _asyncsample_get(self, name: str) -> Any:
        """The attribute ``name`` of the env, never called (SB3's ``get_attr``)."""
        return self.env.get_wrapper_attr(name)

    def _asyncsample_setattr(self, name: str, value: Any) -> None:
        """Plain ``setattr`` on the user's outermost env (SB3's ``set_attr``)."""
        setattr(self.env, name, value)

    def _asyncsample_method(self, name: str, args: Any, kwargs: Any) -> Any:
        """Call the method ``name`` of the env (SB3's ``env_method``)."""
        return self.env.get_wrapper_attr(name)(*args, **kwargs)

    def _asyncsample_is_wrapped(self, wrapper_class: type) -> bool:
        """Whether the user's env is wrapped with ``wrapper_class`` (SB3's ``env_is_wrapped``)."""
        env: Any = self.env
        while isinstance(env, gym.Wrapper):
            if isinstance(env, wrapper_class):
                return True
            env = env.env
        return False

    def set_wrapper_attr(self, name: str, value: Any, *, force: bool = True) -> bool:
        return self.env.set_wrapper_attr(name, value, force=force)

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        if terminated or truncated:
            if self._as_defer:
                self._as_done = True
                self._as_last = obs
            elif self._as_ship:
                info = {**info, _FINAL_OBS_KEY: obs}
        return obs, reward, terminated, truncated, info

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        if self._as_done:
            # The host's automatic reset right after the episode ended: deferred to the next
            # step (or the caller's own reset), the env keeps its last observation until then.
            self._as_done = False
            last, self._as_last = self._as_last, None
            return last, {}
        self._as_done = False
        self._as_last = None
        return self.env.reset(seed=seed, options=options)


@dataclass
class _Factory:
    """Builds one sub-env in its host: the user's env inside a :class:`_SubEnv`."""

    source: Any
    defer: bool
    ship_final_obs: bool

    def __call__(self) -> gym.Env[Any, Any]:
        return _SubEnv(make_env(self.source), self.defer, self.ship_final_obs)


# -- running a private event loop from synchronous code -----------------------------------------


def _new_loop() -> asyncio.AbstractEventLoop:
    # asyncio's own loop, not uvloop: uvloop sets up its signal wake-up socket pair every time
    # it starts running in the main thread, and this loop is started once per call.
    return asyncio.new_event_loop()


class _LoopRunner:
    """Runs coroutines to completion on a private event loop, from synchronous code.

    In a thread without a running event loop the private loop runs right there (no thread hop).
    Called from inside a running loop (a coroutine, a Jupyter cell), it runs in a helper thread
    while the caller's thread blocks, as any synchronous call does.
    """

    def __init__(self) -> None:
        self.loop = _new_loop()
        self._lock = threading.Lock()
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None

    def run(self, coro: Coroutine[Any, Any, _T] | asyncio.Future[_T]) -> _T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            with self._lock:
                return self.loop.run_until_complete(coro)
        if self._helper is None:
            self._helper = concurrent.futures.ThreadPoolExecutor(1, "asyncsample-vector-env")
        return self._helper.submit(self._run_locked, coro).result()

    def _run_locked(self, coro: Coroutine[Any, Any, _T] | asyncio.Future[_T]) -> _T:
        with self._lock:
            return self.loop.run_until_complete(coro)

    def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, which may run :attr:`loop` itself (``run_until_complete``), in the
        thread that may run the loop: the caller's, or the helper thread (see :meth:`run`)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            with self._lock:
                return fn(*args)
        if self._helper is None:
            self._helper = concurrent.futures.ThreadPoolExecutor(1, "asyncsample-vector-env")
        return self._helper.submit(self._call_locked, fn, *args).result()

    def _call_locked(self, fn: Callable[..., _T], *args: Any) -> _T:
        with self._lock:
            return fn(*args)

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None
        if not self.loop.is_closed() and not self.loop.is_running():
            self.loop.close()


# -- the engine both faces share ----------------------------------------------------------------


@dataclass
class _StepResult:
    """What one lockstep round returned, per sub-env (the faces format it)."""

    obs: Tree
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    env_infos: list[dict[str, Any]]
    reset_infos: dict[int, dict[str, Any]]
    final_obs: dict[int, Any]
    restarted: dict[int, str]


class _HostCall:
    """One request to an env host, its coroutine advanced by hand instead of by a task.

    The process backend sends a request synchronously (its bytes go out inside the coroutine's
    first step), so a lockstep round starts every host's requests before the event loop runs,
    then runs the loop only until their reply futures resolve: no task per round, host or call,
    and no loop pass just to start them. The coroutine must only await futures of the engine's
    loop (or yield bare, as ``asyncio.sleep(0)`` does), which the hosts' ``step`` and ``reset``
    do.
    """

    __slots__ = ("_coro", "done", "error", "reader", "value", "waiting")

    def __init__(
        self, coro: Coroutine[Any, Any, Any], reader: Callable[[], _Reader | None] | None = None
    ) -> None:
        self._coro = coro
        self.waiting: asyncio.Future[Any] | None = None
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.advance()
        #: Where the reply comes from, for a wait that reads it without the loop (or None).
        self.reader = None if reader is None or self.done else reader()

    def advance(self) -> None:
        """Run the coroutine until it waits on a future that is not done, or ends."""
        coro = self._coro
        try:
            yielded = coro.send(None)
            while not isinstance(yielded, asyncio.Future) or yielded.done():
                if yielded is None or isinstance(yielded, asyncio.Future):
                    yielded = coro.send(None)  # a bare yield, or a future already resolved
                else:
                    yielded = coro.throw(
                        RuntimeError(f"an env-host call awaited {yielded!r}, not a future")
                    )
        except StopIteration as stop:
            self.value = stop.value
        except BaseException as exc:  # the call's failure: the round deals with it
            self.error = exc
        else:
            self.waiting = yielded
            return
        self.done = True
        self.waiting = None

    async def wait_async(self) -> None:
        """Wait for the call from a coroutine on its loop (cancelling it leaves the call)."""
        while not self.done:
            fut = self.waiting
            assert fut is not None
            await asyncio.wait({fut})
            self.advance()


class _Reader(Protocol):
    """A host connection whose replies a synchronous caller may read itself (process hosts)."""

    fd: int

    def read_now(self) -> bool:
        """Read what arrived and resolve the calls it answers; ``False``: use the loop."""
        ...


#: How long a synchronous wait reads the hosts' sockets itself before it hands over to the
#: event loop, which also runs ``step_timeout`` timers (at most this late) and host-death
#: callbacks. A dead host ends its stream, which hands over at once.
_DIRECT_SLICE = 0.1


def _read_directly(calls: Sequence[_HostCall]) -> bool:
    """Wait for ``calls`` by reading their hosts' sockets here, without running the loop.

    Starting and stopping an event loop, its selector pass and the callbacks between the
    socket and the call cost more main-process CPU than the rest of a lockstep step of a
    fast env. Returns ``True`` when every call ended, ``False`` to let the loop take over
    (a call with no direct reader, a stream that ended or needs the loop, the time slice
    used up); the loop then carries on from wherever this left off.
    """
    deadline = 0.0
    while True:
        readers: dict[int, _Reader] = {}
        for call in calls:
            if call.done:
                continue
            if call.waiting is not None and call.waiting.done():
                call.advance()
                if call.done:
                    continue
            if call.reader is None or call.waiting is None:
                return False
            readers[call.reader.fd] = call.reader
        if not readers:
            return True
        now = time.monotonic()
        if not deadline:
            deadline = now + _DIRECT_SLICE
        elif now >= deadline:
            return False
        try:
            ready = select.select(list(readers), [], [], deadline - now)[0]
        except (OSError, ValueError):
            return False
        if not ready:
            return False
        for fd in ready:
            if not readers[fd].read_now():
                return False


def _wait_calls(loop: asyncio.AbstractEventLoop, calls: Sequence[_HostCall]) -> None:
    """Run ``loop`` (not running) until every call in ``calls`` ended.

    The replies are read directly where possible (see :func:`_read_directly`). Otherwise one
    ``run_forever`` for all the futures the calls wait on (``run_until_complete`` per future
    would start and stop the loop once per host), stopped by the last one resolved.
    """
    if _read_directly(calls):
        return
    while True:
        waiting = [c.waiting for c in calls if c.waiting is not None and not c.waiting.done()]
        if waiting:
            # [futures left, still running]: a run cut short (KeyboardInterrupt) must never
            # stop a later one when its futures resolve at last.
            state = [len(waiting), True]

            def one_done(_: asyncio.Future[Any], state: list[int] = state) -> None:
                state[0] -= 1
                if state[0] == 0 and state[1]:
                    loop.stop()

            for fut in waiting:
                fut.add_done_callback(one_done)
            try:
                loop.run_forever()
            finally:
                state[1] = False
                for fut in waiting:
                    fut.remove_done_callback(one_done)
        busy = False
        for call in calls:
            if not call.done:
                call.advance()
                busy = busy or not call.done
        if not busy:
            return


#: What a host does in a round: (reset mask, step mask) in the host's own sub-env numbering.
_Plan = tuple[np.ndarray | None, np.ndarray | None]


@dataclass
class _Round:
    """A lockstep round sent to the hosts and not finished yet.

    ``calls[h]`` is host ``h``'s ``(reset, step)`` calls, ``None`` for a host that takes no
    part, or the error of a host that cannot (failed earlier and not rebuilt).
    """

    plans: list[_Plan]
    calls: list[tuple[_HostCall | None, _HostCall | None] | BaseException | None]
    everyone: bool
    whole: bool

    def pending(self) -> list[_HostCall]:
        return [c for e in self.calls if isinstance(e, tuple) for c in e if c is not None]


def _quiet(outcome: Any) -> bool:
    """Whether a host's round outcome is a step with no info and no reset (nor a failure)."""
    return (
        type(outcome) is tuple
        and not outcome[1]
        and outcome[0] is not None
        and outcome[0].env_infos is None
        and not outcome[0].reset_infos
    )


def _crash_like(exc: BaseException) -> bool:
    return isinstance(exc, (WorkerCrashedError, StepTimeoutError))


def _with_text(exc: WorkerError, text: str) -> WorkerError:
    """A copy of ``exc`` (same class and fields) with a message that names sub-envs."""
    err = type(exc).__new__(type(exc))
    Exception.__init__(err, text)
    err.__dict__.update(exc.__dict__)
    return err


def _raise(err: BaseException, original: BaseException) -> NoReturn:
    """Raise ``err``, chained to the env's own exception when there is one."""
    raise err from (err.__cause__ if err.__cause__ is not None else original)


def _env_sources(env: Any, num_envs: int) -> list[Any]:
    if isinstance(env, (list, tuple)):
        if len(env) != num_envs:
            raise ValueError(
                f"env: a list of factories must have num_envs={num_envs} entries, got {len(env)}"
            )
        sources = list(env)
    else:
        sources = [env] * num_envs
    out: list[Any] = []
    for i, source in enumerate(sources):
        if isinstance(source, str):
            out.append(EnvId(source))
        elif callable(source) and not isinstance(source, gym.Env):
            out.append(source)
        else:
            what = f"env[{i}]" if isinstance(env, (list, tuple)) else "env"
            raise TypeError(
                f"{what} must be a gymnasium id (str) or a zero-argument callable returning a "
                f"gymnasium.Env, got {type(source).__name__}"
            )
    return out


def _check_step_timeout(value: Any) -> None:
    """``step_timeout`` of the vector faces: ``None`` or a number of seconds > 0."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
    ):
        raise ValueError(f"step_timeout must be a number of seconds > 0 or None, got {value!r}")


class _Engine:
    """Sub-envs on env hosts of the process backend, driven in lockstep from a private loop."""

    def __init__(
        self,
        sources: list[Any],
        *,
        n_processes: int | None,
        step_timeout: float | None,
        max_restarts: int,
        defer: bool,
        ship_final_obs: bool,
        group_size: int | None = None,
        backend: str = "process",
        host_threads: int | None = 1,
    ) -> None:
        self.num_envs = len(sources)
        probe = make_env(sources[0])
        try:
            self.single_observation_space: gym.Space[Any] = probe.observation_space
            self.single_action_space: gym.Space[Any] = probe.action_space
            self.metadata: dict[str, Any] = dict(probe.metadata)
            self.render_mode: str | None = probe.render_mode
            self.spec = probe.spec
        finally:
            probe.close()
        self.max_restarts = max_restarts
        self.restarts: list[int] = []
        self.closed = False
        self._chains = [[_Factory(s, defer, ship_final_obs)] for s in sources]
        n_procs = pool_size(n_processes, self.num_envs)
        n_hosts = n_procs if group_size is None else self.num_envs // group_size
        n_procs = min(n_procs, n_hosts)
        bounds = np.linspace(0, self.num_envs, n_hosts + 1).round().astype(int).tolist()
        self.slices = [(bounds[h], bounds[h + 1]) for h in range(n_hosts)]
        self.host_of = np.repeat(np.arange(n_hosts), [b - a for a, b in self.slices])
        # Every sub-env of a host (read-only): the step mask of the common lockstep step.
        self._whole = [np.ones(b - a, dtype=np.bool_) for a, b in self.slices]
        self.runner = _LoopRunner()
        self.n_procs = n_procs
        options: dict[str, Any] = {"n_processes": n_procs, "host_threads": host_threads}
        if backend == "process":
            options["step_timeout"] = step_timeout
        self.backend = make_backend(backend, **options)
        self.hosts: list[EnvHost] = []
        self.broken: set[int] = set()
        try:
            self.runner.run(self._start())
        except BaseException:
            self.close()
            raise

    # -- lifecycle --------------------------------------------------------------------------

    async def _start(self) -> None:
        specs = [
            HostSpec(h, b - a, self.single_observation_space, self.single_action_space, None)
            for h, (a, b) in enumerate(self.slices)
        ]
        self.hosts = await self.backend.start(specs)
        self.restarts = [0] * len(self.hosts)
        await asyncio.gather(*(self._build(h) for h in range(len(self.hosts))))

    def _host_chains(self, h: int) -> tuple[list[list[Any]], list[Any]]:
        a, b = self.slices[h]
        return self._chains[a:b], [None] * (b - a)

    async def _build(self, h: int) -> None:
        chains, seeds = self._host_chains(h)
        try:
            await self.hosts[h].build(chains, seeds)
        except WorkerError as exc:
            _raise(self._translate(h, exc), exc)

    async def _restart(self, h: int) -> None:
        chains, seeds = self._host_chains(h)
        await self.hosts[h].restart(chains, seeds)
        self.broken.discard(h)

    def close(self) -> None:
        """Stop every host (idempotent); nothing is left behind."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.runner.loop.is_closed() and not self.runner.loop.is_running():
                self.runner.run(self.backend.aclose())
        finally:
            release = getattr(self.backend, "_release", None)
            if release is not None:
                release()  # whatever the graceful path could not do (idempotent)
            self.runner.close()

    # -- errors -----------------------------------------------------------------------------

    def _translate(self, h: int, exc: WorkerError) -> WorkerError:
        a, b = self.slices[h]
        cause = exc.__cause__
        if _crash_like(exc):
            restarts = self.restarts[h] if self.restarts else 0
            text = (
                f"sub-envs {a}..{b - 1} (env host {h}): {exc.args[0] if exc.args else exc}"
                f" (restarted {restarts} of max_restarts={self.max_restarts} times)"
            )
            return _with_text(exc, text)
        if exc.env is not None:
            message = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
            kind = SubEnvAttributeError if isinstance(cause, AttributeError) else SubEnvError
            err = kind(message, sub_env=a + exc.env, host=h, remote_traceback=exc.remote_traceback)
            err.retry = exc.retry
            err.__cause__ = cause
            return err
        return _with_text(exc, f"sub-envs {a}..{b - 1} (env host {h}): {exc}")

    async def _recover(self, h: int, exc: BaseException) -> dict[int, dict[str, Any]]:
        """Restart a crashed host within budget; returns the reset infos of its new episodes."""
        if not isinstance(exc, WorkerError):
            raise exc
        if not _crash_like(exc) or self.restarts[h] >= self.max_restarts:
            self.broken.add(h)
            _raise(self._translate(h, exc), exc)
        self.restarts[h] += 1
        try:
            await self._restart(h)
            a, b = self.slices[h]
            infos = await self.hosts[h].reset(np.ones(b - a, dtype=np.bool_))
        except WorkerError as again:
            self.broken.add(h)
            _raise(self._translate(h, again), again)
        return infos

    # -- remote operations ------------------------------------------------------------------

    def _by_host(self, indices: Sequence[int]) -> dict[int, list[int]]:
        """The positions in ``indices`` of the sub-envs of each host."""
        groups: dict[int, list[int]] = {}
        for pos, i in enumerate(indices):
            groups.setdefault(int(self.host_of[i]), []).append(pos)
        return groups

    def _fail_remote(self, h: int, exc: BaseException) -> NoReturn:
        if isinstance(exc, WorkerError):
            if _crash_like(exc):
                self.broken.add(h)
            _raise(self._translate(h, exc), exc)
        raise exc

    def call(
        self, name: str, args: Sequence[Any], kwargs: dict[str, Any], indices: Sequence[int]
    ) -> list[Any]:
        """``call`` on the sub-envs ``indices`` (gymnasium's semantics); one result per index."""
        self.check_open()
        groups = self._by_host(indices)

        async def one(h: int, positions: list[int]) -> list[Any]:
            a = self.slices[h][0]
            envs = [indices[p] - a for p in positions]
            try:
                return await self.hosts[h].call(name, args, kwargs, envs=envs)
            except BaseException as exc:
                self._fail_remote(h, exc)

        async def run() -> list[Any]:
            hosts = list(groups)
            results = await asyncio.gather(
                *(one(h, groups[h]) for h in hosts), return_exceptions=True
            )
            out: list[Any] = [None] * len(indices)
            for h, r in zip(hosts, results):
                if isinstance(r, BaseException):
                    raise r
                for p, value in zip(groups[h], r):
                    out[p] = value
            return out

        return self.runner.run(run())

    def set_attr(self, name: str, values: Sequence[Any], indices: Sequence[int]) -> None:
        """Set ``name`` to ``values[k]`` on sub-env ``indices[k]`` (through its wrappers)."""
        self.check_open()
        groups = self._by_host(indices)

        async def one(h: int, positions: list[int]) -> None:
            a = self.slices[h][0]
            envs = [indices[p] - a for p in positions]
            try:
                await self.hosts[h].set_attr(name, [values[p] for p in positions], envs=envs)
            except BaseException as exc:
                self._fail_remote(h, exc)

        async def run() -> None:
            results = await asyncio.gather(
                *(one(h, ps) for h, ps in groups.items()), return_exceptions=True
            )
            for r in results:
                if isinstance(r, BaseException):
                    raise r

        self.runner.run(run())

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the vector env is closed")

    # -- observations and actions -----------------------------------------------------------

    def read_obs(self) -> Tree:
        """A fresh batch of every sub-env's current observation."""
        parts = [host.buffers.obs for host in self.hosts]
        if type(parts[0]) is np.ndarray:
            return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
        if len(parts) == 1:
            return tree_map(np.copy, parts[0])
        return tree_map(lambda *xs: np.concatenate(xs, axis=0), *parts)

    def host_obs(self, hosts: Sequence[int]) -> Tree:
        """A fresh batch of the current observations of the sub-envs of ``hosts``, in order."""
        parts = [self.hosts[h].buffers.obs for h in hosts]
        return tree_map(lambda *xs: np.concatenate(xs, axis=0), *parts)

    def obs_row(self, i: int, final: bool = False) -> Any:
        h = int(self.host_of[i])
        buf = self.hosts[h].buffers
        return tree_map(
            lambda leaf: np.copy(leaf[i - self.slices[h][0]]), buf.final_obs if final else buf.obs
        )

    def write_actions(self, actions: Any) -> None:
        n = self.num_envs
        if type(actions) is np.ndarray and isinstance(self.hosts[0].buffers.actions, np.ndarray):
            # The common case (Box, Discrete, Multi* action spaces): one slice copy per host.
            if actions.ndim == 0 or actions.shape[0] != n:
                raise ValueError(
                    f"actions must be a batch of num_envs={n} actions (leading axis {n}) for "
                    f"the action space {self.single_action_space}, got shape {actions.shape}"
                )
            try:
                for (a, b), host in zip(self.slices, self.hosts):
                    host.buffers.actions[...] = actions[a:b]
            except ValueError as exc:
                raise ValueError(
                    f"actions do not fit the batched action space "
                    f"{batch_space(self.single_action_space, n)}: {exc}"
                ) from exc
            return

        def put_all(h: int) -> Callable[..., None]:
            a, b = self.slices[h]

            def put(dst: np.ndarray, src: Any) -> None:
                dst[...] = src[a:b]

            return put

        def check(leaf: Any) -> np.ndarray:
            arr = np.asarray(leaf)
            if arr.ndim == 0 or arr.shape[0] != n:
                raise ValueError(
                    f"actions must be a batch of num_envs={n} actions (leading axis {n}) for "
                    f"the action space {self.single_action_space}, got shape {arr.shape}"
                )
            return arr

        try:
            batch = tree_map(check, actions)
            for h, host in enumerate(self.hosts):
                tree_map(put_all(h), host.buffers.actions, batch)
        except (KeyError, IndexError, TypeError) as exc:
            raise ValueError(
                f"actions do not fit the batched action space "
                f"{batch_space(self.single_action_space, n)}: {type(exc).__name__}: {exc}"
            ) from exc

    # -- lockstep rounds --------------------------------------------------------------------

    def start(
        self, step_mask: np.ndarray, reset_mask: np.ndarray, hosts: Sequence[int] | None = None
    ) -> _Round:
        """Send a round: step the sub-envs in ``step_mask``, reset those in ``reset_mask`` (none
        in both). Synchronous: the requests are on their way when it returns (see
        :class:`_HostCall`); :meth:`finish` or :meth:`step` collects the answers.

        With ``hosts``, only those hosts take part, and the result's ``obs`` is ``None`` (the
        other hosts may be writing theirs): read the rows with :meth:`host_obs`.
        """
        plans: list[_Plan] = []
        any_reset = bool(reset_mask.any())
        everyone = not any_reset and bool(step_mask.all())
        if everyone:  # the common lockstep step: whole hosts, no resets
            plans = [(None, whole) for whole in self._whole]
        else:
            for a, b in self.slices:
                s = step_mask[a:b]
                r = reset_mask[a:b]
                plans.append((r.copy() if r.any() else None, s.copy() if s.any() else None))
        calls: list[tuple[_HostCall | None, _HostCall | None] | BaseException | None] = []
        for h, (r_local, s_local) in enumerate(plans):
            if hosts is not None and h not in hosts:
                calls.append(None)
            elif h in self.broken:
                a, b = self.slices[h]
                calls.append(
                    RuntimeError(
                        f"sub-envs {a}..{b - 1} (env host {h}) failed earlier and were not "
                        "rebuilt: call reset() before stepping again"
                    )
                )
            else:
                # Reset first: both go out at once on the host's stream, served in order.
                host = self.hosts[h]
                reader = host.direct_reader
                calls.append(
                    (
                        None if r_local is None else _HostCall(host.reset(r_local), reader),
                        None if s_local is None else _HostCall(host.step(s_local), reader),
                    )
                )
        return _Round(plans, calls, everyone, hosts is None)

    def finish(self, rnd: _Round) -> _StepResult:
        """Run the private loop (not running, in this thread) until ``rnd`` is answered."""
        loop = self.runner.loop
        _wait_calls(loop, rnd.pending())
        outcomes = [self._outcome(e) for e in rnd.calls]
        recovered: dict[int, dict[int, dict[str, Any]] | BaseException] = {}
        for h, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                try:
                    recovered[h] = loop.run_until_complete(self._recover(h, outcome))
                except BaseException as exc:
                    recovered[h] = exc
        return self._result(rnd, outcomes, recovered)

    async def step(
        self, step_mask: np.ndarray, reset_mask: np.ndarray, hosts: Sequence[int] | None = None
    ) -> _StepResult:
        """:meth:`start` and :meth:`finish` from a coroutine on the private loop."""
        rnd = self.start(step_mask, reset_mask, hosts)
        for call in rnd.pending():
            await call.wait_async()
        outcomes = [self._outcome(e) for e in rnd.calls]
        recovered: dict[int, dict[int, dict[str, Any]] | BaseException] = {}
        for h, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                try:
                    recovered[h] = await self._recover(h, outcome)
                except BaseException as exc:
                    recovered[h] = exc
        return self._result(rnd, outcomes, recovered)

    @staticmethod
    def _outcome(
        entry: tuple[_HostCall | None, _HostCall | None] | BaseException | None,
    ) -> Any:
        """A host's ``(step infos or None, reset infos)``, or the error its round ended with."""
        if entry is None or isinstance(entry, BaseException):
            return (None, {}) if entry is None else entry
        reset_call, step_call = entry
        for call in entry:
            if call is not None and call.error is not None:
                return call.error
        return (
            None if step_call is None else step_call.value,
            {} if reset_call is None else reset_call.value,
        )

    def _result(
        self,
        rnd: _Round,
        outcomes: list[Any],
        recovered: dict[int, dict[int, dict[str, Any]] | BaseException],
    ) -> _StepResult:
        """Merge the hosts' answers (and restarts) into one result, in sub-env order."""
        n = self.num_envs
        if rnd.everyone and rnd.whole and all(_quiet(o) for o in outcomes):
            # The common step: every sub-env stepped, no info, no reset, no failure.
            bufs = [host.buffers for host in self.hosts]
            return _StepResult(
                self.read_obs(),
                np.concatenate([b.rewards for b in bufs]),
                np.concatenate([b.terminated for b in bufs]),
                np.concatenate([b.truncated for b in bufs]),
                [{} for _ in range(n)],
                {},
                {},
                {},
            )
        everyone = rnd.everyone
        rewards = np.zeros(n, dtype=np.float64)
        terminated = np.zeros(n, dtype=np.bool_)
        truncated = np.zeros(n, dtype=np.bool_)
        env_infos: list[dict[str, Any]] = [{} for _ in range(n)]
        reset_infos: dict[int, dict[str, Any]] = {}
        final_obs: dict[int, Any] = {}
        restarted: dict[int, str] = {}
        failure: BaseException | None = None
        for h, outcome in enumerate(outcomes):
            a, b = self.slices[h]
            if isinstance(outcome, BaseException):
                fresh = recovered[h]
                if isinstance(fresh, BaseException):
                    failure = failure or fresh
                    continue
                reason = str(outcome.args[0] if outcome.args else outcome)
                for k in range(b - a):
                    truncated[a + k] = True
                    restarted[a + k] = reason
                    if k in fresh:
                        reset_infos[a + k] = fresh[k]
                continue
            step_infos, resets = outcome
            for k, info in resets.items():
                reset_infos[a + k] = info
            if step_infos is None:
                continue
            buf = self.hosts[h].buffers
            s = rnd.plans[h][1]
            assert s is not None
            if everyone:
                rewards[a:b] = buf.rewards
                terminated[a:b] = buf.terminated
                truncated[a:b] = buf.truncated
            else:
                rewards[a:b][s] = buf.rewards[s]
                terminated[a:b][s] = buf.terminated[s]
                truncated[a:b][s] = buf.truncated[s]
            if step_infos.env_infos is not None:
                for k, info in enumerate(step_infos.env_infos):
                    if info and s[k]:
                        if _FINAL_OBS_KEY in info:
                            info = dict(info)
                            final_obs[a + k] = info.pop(_FINAL_OBS_KEY)
                        env_infos[a + k] = info
            for k, info in step_infos.reset_infos.items():
                reset_infos[a + k] = info
        if failure is not None:
            raise failure
        return _StepResult(
            self.read_obs() if rnd.whole else None,
            rewards,
            terminated,
            truncated,
            env_infos,
            reset_infos,
            final_obs,
            restarted,
        )

    async def reset(
        self, mask: np.ndarray, seeds: Sequence[int | None], options: dict[str, Any] | None
    ) -> dict[int, dict[str, Any]]:
        """Reset the sub-envs in ``mask`` with their seeds and ``options``; their reset infos."""

        async def one(h: int) -> dict[int, dict[str, Any]]:
            a, b = self.slices[h]
            local = mask[a:b].copy()
            if h in self.broken:
                await self._restart(h)
                local[:] = True
            if not local.any():
                return {}
            host = self.hosts[h]
            host_seeds = [seeds[a + k] for k in range(b - a)]
            while True:
                try:
                    infos = await host.reset(local, seeds=host_seeds, options=options)
                except WorkerError as exc:
                    if not _crash_like(exc) or self.restarts[h] >= self.max_restarts:
                        self.broken.add(h)
                        _raise(self._translate(h, exc), exc)
                    self.restarts[h] += 1
                    await self._restart(h)
                    local[:] = True
                    continue
                return {a + k: info for k, info in infos.items()}

        results = await asyncio.gather(
            *(one(h) for h in range(len(self.slices))), return_exceptions=True
        )
        out: dict[int, dict[str, Any]] = {}
        for r in results:
            if isinstance(r, BaseException):
                raise r
            out.update(r)
        return out


def _finalize(engine: _Engine) -> None:
    with contextlib.suppress(Exception):
        engine.close()


class _InfoBatch:
    """Builds gymnasium vector infos for a batch of ``num_envs`` rows (for :meth:`recv`)."""

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs

    _add_info = _GymVectorEnv._add_info


def _scatter(leaf: Any, ids: np.ndarray, order: np.ndarray, n: int) -> np.ndarray:
    """Rows of ``leaf`` (one per id) placed at rows ``ids`` of an ``n``-row array."""
    arr = np.asarray(leaf)
    if arr.ndim == 0 or arr.shape[0] != len(ids):
        raise ValueError(
            f"actions must have one row per env id ({len(ids)}), got shape {arr.shape}"
        )
    out = np.zeros((n, *arr.shape[1:]), dtype=arr.dtype)
    out[ids[order]] = arr[order]
    return out


def _merge(into: _StepResult, res: _StepResult, a: int, b: int) -> None:
    """Copy the rows ``a:b`` of one host's result into another result."""
    into.rewards[a:b] = res.rewards[a:b]
    into.terminated[a:b] = res.terminated[a:b]
    into.truncated[a:b] = res.truncated[a:b]
    into.env_infos[a:b] = res.env_infos[a:b]
    into.reset_infos.update({i: v for i, v in res.reset_infos.items() if a <= i < b})
    into.final_obs.update({i: v for i, v in res.final_obs.items() if a <= i < b})
    into.restarted.update({i: v for i, v in res.restarted.items() if a <= i < b})


# -- the gymnasium face -------------------------------------------------------------------------


class VectorEnv(_GymVectorEnv[Any, Any, np.ndarray]):
    """A gymnasium vector env whose sub-envs live ``num_envs / n_processes`` to an env host.

    Args:
        env: a gymnasium id, a zero-argument factory, or a list of ``num_envs`` factories.
        num_envs: number of sub-envs.
        n_processes: env-host processes (default: the number of CPUs, at most ``num_envs``).
        seed: seeds the first ``reset()`` that is given no seed (sub-env ``i`` gets
            ``seed + i``), so ``VectorEnv(..., seed=s).reset()`` is ``reset(seed=s)``.
        autoreset_mode: ``"NextStep"`` (default), ``"SameStep"`` or ``"Disabled"`` (a
            :class:`gymnasium.vector.AutoresetMode` or its value).
        step_timeout: seconds a host may spend on one step, reset or call before it is killed
            (and restarted, see ``max_restarts``).
        max_restarts: how often each host may be rebuilt after it died or timed out, over the
            vector env's life; past that the error is raised.
        batch_size: for EnvPool-style :meth:`send`/:meth:`recv`: how many sub-envs ``recv``
            returns. Sub-envs are then grouped ``gcd(num_envs, batch_size)`` to an env host
            (several hosts share a process), and hosts answer independently.
        host_threads: intra-op threads of the numeric libraries (torch, OpenMP, MKL, OpenBLAS)
            in each env-host process; ``None`` leaves the libraries' defaults.

    All sub-envs must share the observation and action spaces of the first one. Actions are
    stored in the action space's dtype before they reach the sub-envs.
    """

    def __init__(
        self,
        env: Any,
        num_envs: int,
        *,
        n_processes: int | None = None,
        seed: int | None = None,
        autoreset_mode: str | AutoresetMode | None = None,
        step_timeout: float | None = None,
        max_restarts: int = 3,
        batch_size: int | None = None,
        host_threads: int | None = 1,
    ) -> None:
        num = _validate.positive_int("num_envs", num_envs)
        host_threads = _validate.optional_positive_int("host_threads", host_threads)
        _validate.optional_positive_int("n_processes", n_processes)
        _validate.nonnegative_int("max_restarts", max_restarts)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        _check_step_timeout(step_timeout)
        if autoreset_mode is None:
            mode = AutoresetMode.NEXT_STEP
        else:
            try:
                mode = AutoresetMode(autoreset_mode)
            except ValueError:
                raise ValueError(
                    "autoreset_mode must be an AutoresetMode or one of "
                    f"{[m.value for m in AutoresetMode]}, got {autoreset_mode!r}"
                ) from None
        batch = _validate.optional_positive_int("batch_size", batch_size)
        if batch is not None and batch > num:
            raise ValueError(f"batch_size must be <= num_envs={num}, got {batch}")
        sources = _env_sources(env, num)
        self.autoreset_mode = mode
        self.num_envs = num
        self._engine = _Engine(
            sources,
            n_processes=n_processes,
            step_timeout=step_timeout,
            max_restarts=max_restarts,
            defer=mode != AutoresetMode.SAME_STEP,
            ship_final_obs=mode == AutoresetMode.SAME_STEP,
            group_size=None if batch is None else math.gcd(num, batch),
            host_threads=host_threads,
        )
        self.batch_size = num if batch is None else batch
        self._finalizer = weakref.finalize(self, _finalize, self._engine)
        eng = self._engine
        self.metadata = dict(eng.metadata)
        self.metadata["autoreset_mode"] = mode
        self.render_mode = eng.render_mode
        self.single_observation_space = eng.single_observation_space
        self.single_action_space = eng.single_action_space
        self.observation_space = batch_space(self.single_observation_space, num)
        self.action_space = batch_space(self.single_action_space, num)
        self._initial_seed = None if seed is None else int(seed)
        # Sub-envs whose episode ended on the last step (reset at the next one, NEXT_STEP) or
        # that must be reset by the caller (DISABLED); sub-envs already reset by a restart.
        self._autoreset = np.zeros(num, dtype=np.bool_)
        self._fresh = np.zeros(num, dtype=np.bool_)
        self._fresh_infos: dict[int, dict[str, Any]] = {}
        self._pending: _Round | None = None
        # The masks of the common step (every sub-env steps, none resets): read-only.
        self._all_envs = np.ones(num, dtype=np.bool_)
        self._no_envs = np.zeros(num, dtype=np.bool_)
        # EnvPool-style send/recv: requests in flight and answers not yet received, by host.
        self._inflight: dict[int, tuple[asyncio.Task[_StepResult], np.ndarray, np.ndarray]] = {}
        self._answered: list[int] = []

    @property
    def n_processes(self) -> int:
        """Number of env-host processes."""
        return self._engine.n_procs

    @property
    def pids(self) -> list[int]:
        """Pids of the live env-host processes."""
        return list(getattr(self._engine.backend, "pids", []))

    @property
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """The ``np_random_seed`` of every sub-env."""
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]
        """The ``np_random`` generator of every sub-env (copies from their hosts)."""
        return self.get_attr("np_random")

    # -- reset ------------------------------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the sub-envs (all, or those in ``options["reset_mask"]``).

        Args:
            seed: ``None``, an int (sub-env ``i`` gets ``seed + i``) or one seed per sub-env.
            options: passed to every reset sub-env; ``"reset_mask"`` (a bool array of shape
                ``(num_envs,)``) selects the sub-envs to reset and is not passed on.
        """
        self._engine.check_open()
        self._drain()
        n = self.num_envs
        if seed is None and self._initial_seed is not None:
            seed = self._initial_seed
        self._initial_seed = None
        if seed is None:
            seeds: list[int | None] = [None] * n
        elif isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            seeds = [int(seed) + i for i in range(n)]
        elif isinstance(seed, (list, tuple)):
            if len(seed) != n:
                raise ValueError(
                    f"seed: a list of seeds must have num_envs={n} entries, got {len(seed)}"
                )
            seeds = list(seed)
        else:
            raise TypeError(f"seed must be None, an int or a list of ints, got {seed!r}")
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"options must be a dict or None, got {type(options).__name__}")
        mask = np.ones(n, dtype=np.bool_)
        if options is not None and "reset_mask" in options:
            options = dict(options)
            mask = options.pop("reset_mask")
            if not isinstance(mask, np.ndarray):
                raise TypeError(
                    f"options['reset_mask'] must be a numpy array, got {type(mask).__name__}"
                )
            if mask.shape != (n,):
                raise ValueError(f"options['reset_mask'] must have shape ({n},), got {mask.shape}")
            if mask.dtype != np.bool_:
                raise TypeError(f"options['reset_mask'] must have dtype bool, got {mask.dtype}")
            if not mask.any():
                raise ValueError("options['reset_mask'] must select at least one sub-env")
        reset_infos = self._engine.runner.run(self._engine.reset(mask, seeds, options))
        self._last_reset = reset_infos
        self._autoreset[mask] = False
        self._fresh[mask] = False
        for i in np.flatnonzero(mask).tolist():
            self._fresh_infos.pop(i, None)
        infos: dict[str, Any] = {}
        for i in np.flatnonzero(mask).tolist():
            infos = self._add_info(infos, reset_infos.get(i, {}), i)
        return self._engine.read_obs(), infos

    # -- step -------------------------------------------------------------------------------

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every sub-env with its action (see the module doc for the autoreset modes)."""
        eng = self._engine
        step_mask, reset_mask = self._send(actions)
        return self._finish(eng.runner.call(self._round, step_mask, reset_mask))

    def _round(self, step_mask: np.ndarray, reset_mask: np.ndarray) -> _StepResult:
        eng = self._engine
        return eng.finish(eng.start(step_mask, reset_mask))

    def step_async(self, actions: Any) -> None:
        """Send the actions; the hosts step while the caller does something else."""
        eng = self._engine
        step_mask, reset_mask = self._send(actions)
        # The requests go out now, without running the loop (see _HostCall).
        self._pending = eng.runner.call(eng.start, step_mask, reset_mask)

    def _send(self, actions: Any) -> tuple[np.ndarray, np.ndarray]:
        """Check the state, write the actions; the step and reset masks of the round."""
        eng = self._engine
        eng.check_open()
        if self._pending is not None:
            raise RuntimeError("step_async was called twice without step_wait in between")
        mode = self.autoreset_mode
        if mode == AutoresetMode.DISABLED and self._autoreset.any():
            done = np.flatnonzero(self._autoreset).tolist()
            raise RuntimeError(
                f"sub-envs {done} ended their episodes and autoreset_mode is DISABLED: reset them "
                "with reset(options={'reset_mask': mask}) before stepping"
            )
        eng.write_actions(actions)
        if mode == AutoresetMode.NEXT_STEP and (self._autoreset.any() or self._fresh.any()):
            reset_mask = self._autoreset.copy()
            step_mask = ~(reset_mask | self._fresh)
        else:
            reset_mask = self._no_envs
            step_mask = self._all_envs
        self._step_masks = (step_mask, reset_mask)
        return step_mask, reset_mask

    def step_wait(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Wait for the step sent by :meth:`step_async` and return its results."""
        eng = self._engine
        eng.check_open()
        rnd = self._pending
        if rnd is None:
            raise RuntimeError("step_wait was called without step_async")
        self._pending = None
        return self._finish(eng.runner.call(eng.finish, rnd))

    def _finish(
        self, res: _StepResult
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        step_mask, reset_mask = self._step_masks
        if (
            not res.reset_infos
            and not res.restarted
            and not self._fresh_infos
            and not any(res.env_infos)
        ):
            # The common step: no info anywhere. What _infos does then, on whole arrays.
            done = res.terminated | res.truncated
            if self.autoreset_mode != AutoresetMode.SAME_STEP:
                np.logical_and(done, step_mask, out=self._autoreset)
                self._fresh[:] = False
                return res.obs, res.rewards, res.terminated, res.truncated, {}
            if not done.any():
                self._autoreset[:] = False
                return res.obs, res.rewards, res.terminated, res.truncated, {}
        ids = list(range(self.num_envs))
        infos = self._infos(res, ids, self, step_mask, reset_mask)
        return res.obs, res.rewards, res.terminated, res.truncated, infos

    def _infos(
        self,
        res: _StepResult,
        ids: list[int],
        batch: Any,
        step_mask: np.ndarray,
        reset_mask: np.ndarray,
    ) -> dict[str, Any]:
        """The vector info of sub-envs ``ids`` (row ``k`` of ``batch`` is ``ids[k]``); updates
        the autoreset state of those sub-envs."""
        eng = self._engine
        mode = self.autoreset_mode
        infos: dict[str, Any] = {}
        where = np.asarray(ids, dtype=np.int64)
        done = res.terminated[where] | res.truncated[where]
        quiet = (
            not res.reset_infos
            and not res.restarted
            and not any(res.env_infos[i] for i in ids)
            and not (mode == AutoresetMode.SAME_STEP and done.any())
            and not (self._fresh_infos and self._fresh[where].any())
        )
        if quiet:
            # The common step: no info anywhere, nothing to format (same result as below).
            ids = []
        for k, i in enumerate(ids):
            if i in res.restarted:
                if mode == AutoresetMode.SAME_STEP:
                    final = {"final_obs": eng.obs_row(i), "final_info": {}}
                    infos = batch._add_info(infos, final, k)
                    infos = batch._add_info(infos, {"restarted": res.restarted[i]}, k)
                    infos = batch._add_info(infos, res.reset_infos.get(i, {}), k)
                else:
                    infos = batch._add_info(infos, {"restarted": res.restarted[i]}, k)
                continue
            if mode == AutoresetMode.NEXT_STEP and (reset_mask[i] or self._fresh[i]):
                info = res.reset_infos.get(i, {}) if reset_mask[i] else self._fresh_infos.pop(i, {})
                infos = batch._add_info(infos, info, k)
                continue
            if mode == AutoresetMode.SAME_STEP and (res.terminated[i] or res.truncated[i]):
                last = res.final_obs[i] if i in res.final_obs else eng.obs_row(i, final=True)
                final = {"final_obs": last, "final_info": res.env_infos[i]}
                infos = batch._add_info(infos, final, k)
                infos = batch._add_info(infos, res.reset_infos.get(i, {}), k)
                continue
            infos = batch._add_info(infos, res.env_infos[i], k)
        if mode == AutoresetMode.SAME_STEP:
            self._autoreset[where] = False
        else:
            self._autoreset[where] = done & step_mask[where]
            self._fresh[where] = False
            for i in ids:
                if i not in res.restarted:
                    continue
                if mode == AutoresetMode.NEXT_STEP:
                    self._fresh[i] = True
                    self._fresh_infos[i] = res.reset_infos.get(i, {})
                else:
                    self._autoreset[i] = True
        return infos

    def _drain(self) -> None:
        """Finish a step sent by ``step_async`` and never waited for (its results are lost)."""
        rnd, self._pending = self._pending, None
        if rnd is not None:
            with contextlib.suppress(Exception):
                self._engine.runner.call(self._engine.finish, rnd)
        tasks = [t for t, _, _ in self._inflight.values()]
        if tasks:
            with contextlib.suppress(Exception):
                self._engine.runner.run(asyncio.wait(tasks))
        self._inflight.clear()
        self._answered.clear()

    # -- EnvPool-style asynchronous stepping --------------------------------------------------

    def async_reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        """Reset every sub-env; :meth:`recv` returns their first observations, a batch at a time."""
        self.reset(seed=seed, options=options)
        n = self.num_envs
        zeros = np.zeros(n, dtype=np.bool_)
        res = _StepResult(
            None, np.zeros(n), zeros, zeros.copy(), [{} for _ in range(n)], self._last_reset, {}, {}
        )
        loop = self._engine.runner.loop
        for h in range(len(self._engine.slices)):
            fut: asyncio.Future[_StepResult] = loop.create_future()
            fut.set_result(res)
            self._inflight[h] = (fut, zeros, np.ones(n, dtype=np.bool_))  # type: ignore[assignment]
            self._answered.append(h)

    def send(self, actions: Any, env_ids: Any) -> None:
        """Send actions to the sub-envs ``env_ids`` (those of an earlier :meth:`recv`).

        ``actions[k]`` goes to sub-env ``env_ids[k]``. The hosts of these sub-envs start at once;
        :meth:`recv` returns whichever ``batch_size`` sub-envs are answered first.
        """
        eng = self._engine
        eng.check_open()
        if self._pending is not None:
            raise RuntimeError("send() while a step_async is waiting for step_wait")
        if self.autoreset_mode == AutoresetMode.DISABLED:
            raise ValueError("send/recv needs autoreset_mode NextStep or SameStep, not Disabled")
        ids = np.asarray(env_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0 or ids.min() < 0 or ids.max() >= self.num_envs:
            raise ValueError(f"env_ids must be sub-env indices in [0, {self.num_envs}), got {ids}")
        hosts = sorted({int(eng.host_of[i]) for i in ids})
        covered = sorted(ids.tolist())
        expected = [i for h in hosts for i in range(*eng.slices[h])]
        if covered != expected:
            raise ValueError(
                "env_ids must be the sub-envs of one or more earlier recv() batches (sub-envs are "
                f"sent a host at a time: groups {[eng.slices[h] for h in hosts]}), got {ids}"
            )
        busy = [h for h in hosts if h in self._inflight]
        if busy:
            raise ValueError(
                f"env_ids include sub-envs whose last step was not received yet: {ids}"
            )
        # Rows of ``actions`` follow ``env_ids``; put them in sub-env order for the buffers.
        order = np.argsort(ids, kind="stable")
        full = tree_map(lambda leaf: _scatter(leaf, ids, order, self.num_envs), actions)
        for h in hosts:
            a, b = eng.slices[h]
            tree_map(
                lambda dst, src, a=a, b=b: dst.__setitem__(Ellipsis, src[a:b]),
                eng.hosts[h].buffers.actions,
                full,
            )
        n = self.num_envs
        for h in hosts:
            a, b = eng.slices[h]
            reset_mask = np.zeros(n, dtype=np.bool_)
            step_mask = np.zeros(n, dtype=np.bool_)
            if self.autoreset_mode == AutoresetMode.NEXT_STEP:
                reset_mask[a:b] = self._autoreset[a:b]
                step_mask[a:b] = ~(self._autoreset[a:b] | self._fresh[a:b])
            else:
                step_mask[a:b] = True
            task = eng.runner.loop.create_task(eng.step(step_mask, reset_mask, hosts=[h]))
            task.add_done_callback(functools.partial(self._on_answer, h))
            self._inflight[h] = (task, step_mask, reset_mask)
        eng.runner.run(asyncio.sleep(0))  # the requests go out now

    def _on_answer(self, h: int, task: asyncio.Task[_StepResult]) -> None:
        if self._inflight.get(h, (None,))[0] is task:
            self._answered.append(h)

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The first ``batch_size`` sub-envs answered, with ``info["env_id"]`` naming them.

        Same layout as :meth:`step` for those sub-envs only (row ``k`` is sub-env
        ``info["env_id"][k]``), same autoreset mode.
        """
        eng = self._engine
        eng.check_open()

        def size(h: int) -> int:
            return int(eng.slices[h][1] - eng.slices[h][0])

        ready = sum(size(h) for h in self._answered)
        if ready < self.batch_size:
            waiting = [t for h, (t, _, _) in self._inflight.items() if h not in self._answered]
            if sum(size(h) for h in self._inflight) < self.batch_size:
                raise RuntimeError(
                    f"recv() needs at least batch_size={self.batch_size} sub-envs sent "
                    "(call async_reset() first, then send() what recv() returned)"
                )

            async def enough() -> None:
                pending = set(waiting)
                while sum(size(h) for h in self._answered) < self.batch_size and pending:
                    _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)

            eng.runner.run(enough())
        chosen: list[int] = []
        count = 0
        while count < self.batch_size:
            h = self._answered.pop(0)
            chosen.append(h)
            count += size(h)
        results = [self._inflight.pop(h) for h in chosen]
        for task, _, _ in results:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        ids = [i for h in chosen for i in range(*eng.slices[h])]
        where = np.asarray(ids, dtype=np.int64)
        step_mask = np.zeros(self.num_envs, dtype=np.bool_)
        reset_mask = np.zeros(self.num_envs, dtype=np.bool_)
        merged = results[0][0].result()
        for h, (task, s, r) in zip(chosen, results):
            a, b = eng.slices[h]
            res = task.result()
            step_mask[a:b] = s[a:b]
            reset_mask[a:b] = r[a:b]
            if res is not merged:
                _merge(merged, res, a, b)
        infos = self._infos(merged, ids, _InfoBatch(len(ids)), step_mask, reset_mask)
        infos["env_id"] = where.copy()
        obs = eng.host_obs(chosen)
        return (
            obs,
            merged.rewards[where],
            merged.terminated[where],
            merged.truncated[where],
            infos,
        )

    # -- calls ------------------------------------------------------------------------------

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call ``name`` on every sub-env (or read it, if it is not callable)."""
        self._drain()
        return tuple(self._engine.call(name, args, kwargs, range(self.num_envs)))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """The attribute ``name`` of every sub-env (called if it is a method, as gymnasium does)."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | object) -> None:
        """Set ``name`` on every sub-env: one value for all, or a list with one per sub-env."""
        self._drain()
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(
                f"values: a list must have num_envs={self.num_envs} entries, got {len(values)}"
            )
        self._engine.set_attr(name, list(values), range(self.num_envs))

    def render(self) -> tuple[Any, ...]:
        """The frames rendered by every sub-env."""
        return self.call("render")

    def close_extras(self, **kwargs: Any) -> None:
        """Stop the env hosts and release their processes and shared memory."""
        self._pending = None
        self._finalizer.detach()
        self._engine.close()

    def __repr__(self) -> str:
        spec = self._engine.spec
        what = f"{spec.id}, " if spec is not None else ""
        return (
            f"asyncsample.VectorEnv({what}num_envs={self.num_envs}, n_processes={self.n_processes})"
        )
