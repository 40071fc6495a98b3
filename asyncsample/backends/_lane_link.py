"""The caller's side of an env host of async envs (:mod:`asyncsample.backends._lane_serve`):
each env reset and stepped on its own, as a :class:`~asyncsample.backends.base.PerEnvHost`, so
the engine's lanes (:mod:`asyncsample._env_tasks`) run over it unchanged.

One :class:`LaneLink` per host connection gathers the lane requests of every worker it hosts into
one frame per pass of the event loop, and hands each reply of the host's batches to its waiter.
"""

from __future__ import annotations

import asyncio
import collections
import pickle
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import cloudpickle

from asyncsample._clock import CALLS
from asyncsample._recorder import put_row
from asyncsample.backends._lane_serve import PENDING, ST_AGENT, ST_DEADLINE, LaneKind
from asyncsample.backends._remote import HostDied, Incarnation, PoolMember, closed_error
from asyncsample.backends._transport import ST_OK, dumps
from asyncsample.backends.aio import PerEnvLockstep
from asyncsample.backends.base import DeadlinePassed
from asyncsample.env_group import PENDING_SEED, StepBuffers
from asyncsample.env_update import EnvSource
from asyncsample.errors import WorkerCrashedError, WorkerError

__all__ = ["REPLIES_PER_PASS", "LaneLink", "RemoteLanes"]

#: The most lane replies handed to their waiters in one pass of the caller's loop: each wakes a
#: lane, which records its step and asks for the next (~10 us), so a host's batch of thousands
#: handed over at once held the caller's loop for tens of milliseconds (lag p99 over 100 ms at
#: 10,000 episodes); the rest wait for the next pass, after the loop's other callbacks.
REPLIES_PER_PASS = 256


class LaneLink:
    """The lane requests and replies of one host connection (``send`` sends a pickled batch)."""

    def __init__(self, send: Callable[[bytes], None], loop: asyncio.AbstractEventLoop) -> None:
        self._send = send
        self._loop = loop
        self._out: list[tuple[Any, ...]] = []
        self._waiting: dict[int, asyncio.Future[tuple[int, Any]]] = {}
        self._next = 0
        self._flushing = False
        self._backlog: collections.deque[tuple[int, int, Any]] = collections.deque()
        self._draining = False
        self.dead: BaseException | None = None

    def submit(self, kind: int, *args: Any) -> tuple[int, asyncio.Future[tuple[int, Any]]]:
        """Queue a request (sent at the end of this pass of the loop): its key and reply."""
        key = self._next
        self._next = key + 1
        future = self._loop.create_future()
        if self.dead is not None:
            future.set_exception(self.dead)
            return key, future
        self._waiting[key] = future
        self._queue((kind, key, *args))
        return key, future

    def cancel(self, key: int) -> None:
        """The caller gave up on ``key``: the host cancels it (its reply, if any, is dropped)."""
        if self._waiting.pop(key, None) is not None and self.dead is None:
            self._queue((LaneKind.CANCEL, key))

    def _queue(self, request: tuple[Any, ...]) -> None:
        self._out.append(request)
        if not self._flushing:
            self._flushing = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        out, self._out = self._out, []
        if out and self.dead is None:
            self._send(dumps(out))

    def replied(self, payload: bytes) -> None:
        """A batch of replies came: ``(key, status, value)`` each, handed to their waiters at
        most :data:`REPLIES_PER_PASS` per pass of the loop (in the order they came)."""
        replies = pickle.loads(payload)
        if not self._backlog and len(replies) <= REPLIES_PER_PASS:
            self._hand(replies)
            return
        self._backlog.extend(replies)
        if not self._draining:
            self._draining = True
            self._drain()

    def _drain(self) -> None:
        backlog = self._backlog
        n = min(len(backlog), REPLIES_PER_PASS)
        self._hand([backlog.popleft() for _ in range(n)])
        if backlog:
            self._loop.call_soon(self._drain)
        else:
            self._draining = False

    def _hand(self, replies: list[tuple[int, int, Any]]) -> None:
        waiting = self._waiting
        for key, status, value in replies:
            future = waiting.pop(key, None)
            if future is not None and not future.done():
                future.set_result((status, value))

    def fail(self, error: BaseException) -> None:
        """The host died: every waiter gets ``error`` (as later requests will)."""
        self.dead = error
        waiting, self._waiting = self._waiting, {}
        self._out.clear()
        self._backlog.clear()
        for future in waiting.values():
            if not future.done():
                future.set_exception(error)


class RemoteLanes(PerEnvLockstep):
    """The per-env calls of a remote host's worker slot (mixed into its ``RemoteHost``), over
    the :class:`LaneLink` of its live incarnation (``incarnation.lanes``)."""

    worker: int
    buffers: StepBuffers
    n_envs: int
    _slot_index: int
    _incarnation: Any
    _member: PoolMember[Any]

    @property
    def env_calls(self) -> int:
        """This worker's env calls running in its host, as of the host's last reply (metrics on;
        else 0)."""
        clock = self.buffers.clock
        return 0 if clock is None else int(clock[CALLS])

    def _lanes_init(self, slot: int, obs_in_reply: bool = False) -> None:
        self._slot_index = slot
        self.n_envs = self.spec.n_envs  # type: ignore[attr-defined]
        self.in_flight = {}
        # The observations travel with the replies (buffers not shared, or without fixed rows).
        self._obs_in_reply = obs_in_reply or isinstance(self.buffers.obs, list)
        self._built_in: list[Any] = [None] * self.n_envs  # the incarnation each env lives in

    async def build(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        """Build every env (see ``RemoteHost.build``), in the live incarnation."""
        await super().build(chains, seeds)  # type: ignore[misc]
        self._built_in = [self._incarnation] * self.n_envs

    async def _lane(self, kind: int, i: int, *args: Any) -> Any:
        """Send one lane request for env ``i`` and await its reply's value."""
        if self._member.closed:
            raise closed_error(self.worker, "step")
        inc: Incarnation = self._incarnation
        if kind != LaneKind.REBUILD:
            built = self._built_in[i]
            if built is None or built.dead or built is not inc:
                # Its host died (since): this env's failure; its lane rebuilds it in a new one.
                raise _dead_error(built, self.worker, i)
        link: LaneLink = inc.lanes  # type: ignore[attr-defined]
        key, future = link.submit(kind, self._slot_index, i, *args)
        try:
            status, value = await future
        except asyncio.CancelledError:
            link.cancel(key)
            raise
        except HostDied:
            if self._member.closed:
                raise closed_error(self.worker, "step") from None
            raise _dead_error(inc, self.worker, i) from None
        if status == ST_OK:
            if self._obs_in_reply:
                value, obs, final = value
                _put(self.buffers.obs, i, obs)
                if final is not None:  # a step that ended its episode: the flags are read too
                    _put(self.buffers.final_obs, i, final)
                    self.buffers.terminated[i], self.buffers.truncated[i] = value[1], value[2]
            return value
        if status == ST_DEADLINE:
            raise DeadlinePassed
        if status == ST_AGENT and isinstance(value, WorkerError):
            value.retry = False  # the agent copy's error: the call's, never the env's
        raise value

    @staticmethod
    def _left(deadline: float | None) -> float | None:
        return None if deadline is None else deadline - asyncio.get_running_loop().time()

    async def reset_one(
        self,
        i: int,
        seed: Any = PENDING_SEED,
        options: dict[str, Any] | None = None,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """Reset env ``i`` in the host; see :meth:`~asyncsample.backends.aio.LaneHost.reset_one`."""
        seed = PENDING if seed is PENDING_SEED else seed
        info: dict[str, Any] = await self._lane(
            LaneKind.RESET, i, seed, options, self._left(deadline)
        )
        return info

    def step_one(
        self, i: int, action: Any, deadline: float | None = None
    ) -> Coroutine[Any, Any, tuple[float, bool, bool, dict[str, Any]]]:
        """Step env ``i`` in the host; see :meth:`~asyncsample.backends.aio.LaneHost.step_one`.

        The request's own coroutine, returned: no second coroutine per step (each one lives as
        long as the step, and thousands in flight keep the cyclic collector busy)."""
        return self._lane(LaneKind.STEP, i, action, self._left(deadline))

    def act_one(
        self, i: int, deadline: float | None = None
    ) -> Coroutine[Any, Any, tuple[float, bool, bool, dict[str, Any], Any, dict[str, Any]]]:
        """Step env ``i`` in the host with the action its agent copy picks (``inference="host"``):
        ``(reward, terminated, truncated, info, action, agent_infos)``; see :meth:`step_one`."""
        return self._lane(LaneKind.ACT, i, self._left(deadline))

    async def rebuild_one(self, i: int, chain: Sequence[EnvSource], seed: int) -> None:
        """Build env ``i`` again, in a new host if this one died (its other envs are rebuilt
        by their own lanes as they find it dead)."""
        inc = self._incarnation
        if inc is None or inc.dead:
            self._incarnation = await self._member.live()
        blob = cloudpickle.dumps(list(chain), protocol=pickle.HIGHEST_PROTOCOL)
        await self._lane(LaneKind.REBUILD, i, blob, seed)
        self._built_in[i] = self._incarnation
        if getattr(self, "_agent_blob", None) is not None:  # inference="host": a new host's copy
            await self.sync_agent()  # type: ignore[attr-defined]


def _put(buffer: Any, i: int, row: Any) -> None:
    if isinstance(buffer, list):  # a space without fixed-size rows
        buffer[i] = row
    else:
        put_row(buffer, i, row)


def _dead_error(inc: Incarnation | None, worker: int, env: int) -> WorkerError:
    """The error of env ``env``'s call that found its host dead: that env's (it is rebuilt)."""
    if inc is None:
        return WorkerError("its env host was not started", worker=worker, env=env, retry=False)
    err = WorkerCrashedError(f"{inc.describe()} {inc.reason}", worker=worker, env=env)
    err.__cause__ = inc.cause
    return err
