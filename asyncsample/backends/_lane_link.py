"""The caller's side of an env host of async envs (:mod:`asyncsample.backends._lane_serve`):
each env reset and stepped on its own, as a :class:`~asyncsample.backends.base.PerEnvHost`, so
the engine's lanes (:mod:`asyncsample._env_tasks`) run over it unchanged.

One :class:`LaneLink` per host connection gathers the lane requests of every worker it hosts into
one frame per pass of the event loop, and hands each reply of the host's batches to its waiter.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import pickle
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

import cloudpickle
import numpy as np

from asyncsample._clock import CALLS
from asyncsample._passes import pass_queue
from asyncsample._recorder import put_row
from asyncsample.backends._column_wire import (
    RunColumns,
    RunFrame,
    StepReplies,
    object_rows,
    pack_requests,
    unpack_replies,
)
from asyncsample.backends._lane_serve import PENDING, ST_AGENT, ST_DEADLINE, LaneKind
from asyncsample.backends._remote import Incarnation, PoolMember, closed_error
from asyncsample.backends._transport import ST_OK, dumps
from asyncsample.backends.aio import PerEnvLockstep
from asyncsample.backends.base import DeadlinePassed, StepRun
from asyncsample.env_group import PENDING_SEED, StepBuffers
from asyncsample.env_update import EnvSource
from asyncsample.errors import LoopBlockedError, WorkerCrashedError, WorkerError

__all__ = [
    "ST_DIED",
    "LaneLink",
    "RemoteLanes",
    "RunSink",
    "SinkStep",
    "answered",
    "watch_error",
]

#: The status a request's owner settles it with when its host died (``value``: the error).
ST_DIED = -1


class RunSink(Protocol):
    """Who applies a host's replies as they come, in place of their futures (the runs' stepper,
    :class:`asyncsample._env_runs.RunStepper`, while its call is in progress): the runs of a
    reply frame in one pass, anything else one by one."""

    def take(self, i: int, outcome: Any) -> None:
        """Env ``i``'s request was answered: its value, or the error its future would raise."""
        ...

    def take_runs(self, runs: RunColumns, rs: np.ndarray, envs: np.ndarray) -> None:
        """Runs ``rs`` of ``runs`` answered envs ``envs``' requests."""
        ...

    def take_steps(self, envs: np.ndarray, infos: list[dict[str, Any] | None]) -> None:
        """Steps of envs ``envs`` (their rewards and flags in the step buffers, their env
        ``infos``) answered their requests."""
        ...


@dataclasses.dataclass
class _Runs:
    """The runs of one reply frame that answered one owner's requests."""

    owner: RemoteLanes
    runs: RunColumns
    rs: list[int]
    envs: list[int]
    futures: list[asyncio.Future[Any]]

    def add(self, r: int, i: int, future: asyncio.Future[Any]) -> None:
        self.rs.append(r)
        self.envs.append(i)
        self.futures.append(future)

    def settle(self) -> None:
        self.owner.settle_runs(self)


@dataclasses.dataclass
class _Steps:
    """The steps of one reply frame that answered one owner's requests (their outcomes in the
    step buffers; ``values``: ``(info, agent infos)`` or ``None`` each; ``futures``: each one's
    future or :data:`SinkStep`)."""

    owner: RemoteLanes
    envs: list[int]
    values: list[Any]
    futures: list[Any]

    @classmethod
    def of(cls, steps: dict[RemoteLanes, _Steps], owner: RemoteLanes) -> _Steps:
        """``owner``'s batch in ``steps`` (a frame's, by owner), made if it has none yet."""
        batch = steps.get(owner)
        if batch is None:
            batch = steps[owner] = cls(owner, [], [], [])
        return batch

    def add(self, i: int, value: Any, future: Any) -> None:
        self.envs.append(i)
        self.values.append(value)
        self.futures.append(future)

    def settle(self) -> None:
        self.owner.settle_steps(self)


#: The one context of :func:`_seen`: a callback's own copy is one more object per request.
_CONTEXT = contextvars.Context()


def _seen(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def watch_error(future: asyncio.Future[Any]) -> None:
    """Mark the error ``future`` may get as retrieved once it comes: a request's reply may come
    after the sampler closed (its host's death settles it), when no call applies it."""
    future.add_done_callback(_seen, context=_CONTEXT)


SinkStep = int
"""A step request's key, standing for its future while none is needed: while a call is in
progress its :attr:`RemoteLanes.sink` takes the reply. It gets a future only when no sink takes
its reply (:meth:`RemoteLanes.settle`: between calls, or its host died) or when a call of the
lanes or a drop needs one (:meth:`RemoteLanes.keep_waiting`). An int: thousands in flight are no
work for the cyclic collector, which does not track ints (it tracks every object of a class of
ours, stateless or not). Keys are unique in the process, so a key is its own request's and no
other's: a key in hand is compared with ``==`` (a reply's key is another int object)."""

KEY_BITS = 20
"""Request keys come in blocks of ``1 << KEY_BITS`` (a batch of steps takes one block)."""
_BLOCKS = itertools.count(1)
"""Every link's blocks of request keys (keys above the small ints Python shares)."""


#: A step reply's status and value where :class:`StepReplies` lists it not: a success, no info.
_QUIET = (ST_OK, None)


def _new_keys() -> int:
    """The first key of a block of keys no request in the process had."""
    return next(_BLOCKS) << KEY_BITS


def answered(request: Any) -> bool:
    """Whether ``request`` in flight, a future or a :data:`SinkStep`, was answered (a
    :data:`SinkStep` never is: its reply goes to the sink, or to a future it gets then)."""
    return type(request) is not SinkStep and bool(request.done())


class LaneLink:
    """The lane requests and replies of one host connection (``send`` sends a pickled batch)."""

    def __init__(self, send: Callable[[bytes], None], loop: asyncio.AbstractEventLoop) -> None:
        self._send = send
        self._loop = loop
        self._out: list[tuple[Any, ...]] = []
        self._waiting: dict[int, Any] = {}  # each request's future, or a step's SinkStep
        self._owners: dict[int, RemoteLanes] = {}  # who settles each request's future
        self._envs: dict[int, int] = {}  # the env of each request
        # The owners of batches of bare steps, by worker slot: they keep those steps' keys
        # (RemoteLanes.bare_keys), not the three dicts above.
        self._slots: dict[int, RemoteLanes] = {}
        self._flushing = False
        self.dead: BaseException | None = None
        # Step requests carry Text/Sequence actions: packed one column per leaf per batch.
        self.pack_actions = False

    def submit(
        self, owner: RemoteLanes, kind: int, slot: int, i: int, *args: Any, bare: bool = False
    ) -> tuple[int, asyncio.Future[Any]]:
        """Queue a request for env ``i`` of worker slot ``slot`` (sent at the end of this pass of
        the loop): its key, and the future ``owner`` settles with its reply
        (:meth:`RemoteLanes.settle`); ``bare``: a :data:`SinkStep` in place of the future.
        Two dict entries per request, no object of its own: with thousands in flight, each
        object that lives as long as a step is one more for the cyclic collector to walk."""
        key = _new_keys()
        if bare and self.dead is None:  # the sink takes the reply: no future
            future: Any = key
        else:
            future = self._loop.create_future()
        if self.dead is not None:
            owner.settle(i, ST_DIED, self.dead, future)
            return key, future
        self._waiting[key] = future
        self._owners[key] = owner
        self._envs[key] = i
        self._queue((kind, key, slot, i, *args))
        return key, future

    def submit_steps(self, owner: RemoteLanes, slot: int, envs: np.ndarray) -> int:
        """A bare step (its action in the shared step buffers) of each of ``envs``, on a live
        link, as one request: the first of their keys, in the order of ``envs`` (each its
        step's :data:`SinkStep`). ``owner`` keeps the keys (:attr:`RemoteLanes.bare_keys`): a
        reply in the host's columns (:class:`StepReplies`) is its step's when they match."""
        first = _new_keys()
        self._slots[slot] = owner
        raw = np.ascontiguousarray(envs, dtype=np.int64).tobytes()
        self._out.append((LaneKind.STEPS, first, slot, raw))
        self._flush_soon()
        return first

    def adopt(self, owner: RemoteLanes, key: int, i: int, future: asyncio.Future[Any]) -> None:
        """``future`` waits for ``key``, env ``i``'s bare step not answered yet, as a request of
        :meth:`submit` does (its owner forgot the key)."""
        self._waiting[key] = future
        self._owners[key] = owner
        self._envs[key] = i

    def rebind(self, key: int, future: asyncio.Future[Any]) -> bool:
        """``future`` waits for ``key``'s reply in place of its :data:`SinkStep`; false if the
        reply came already."""
        if key not in self._waiting:
            return False
        self._waiting[key] = future
        return True

    def cancel(self, key: int, bare: bool = False) -> None:
        """The caller gave up on ``key`` (``bare``: a bare step its owner forgot): the host
        cancels it (its reply, if any, is dropped)."""
        if bare or self._waiting.pop(key, None) is not None:
            if not bare:
                del self._owners[key], self._envs[key]
            if self.dead is None:
                self._queue((LaneKind.CANCEL, key))

    def _queue(self, request: tuple[Any, ...]) -> None:
        self._out.append(request)
        self._flush_soon()

    def _flush_soon(self) -> None:
        if not self._flushing:
            self._flushing = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        out, self._out = self._out, []
        if out and self.dead is None:
            packed = pack_requests(out, LaneKind.STEP) if self.pack_actions else None
            self._send(dumps(out if packed is None else packed))

    def replied(self, payload: bytes) -> None:
        """A batch of replies came: ``(key, status, value)`` each, or a :class:`RunFrame`, and
        step replies in columns (:class:`StepReplies`)."""
        replies = pickle.loads(payload)
        columns = None
        if type(replies) is StepReplies:
            columns, replies = replies, replies.rest
        runs = None
        if type(replies) is RunFrame:  # runs of steps, their rows in the frame's columns
            runs = RunColumns(replies)
            replies = replies.others
        elif type(replies) is tuple:  # rows packed in columns (Text, Sequence leaves)
            replies = unpack_replies(replies)
        steps: dict[RemoteLanes, _Steps] = {}
        for key, status, value in replies:
            self._reply(key, status, value, steps)
        if columns is not None:
            keys = np.frombuffer(columns.keys, dtype=np.int64)
            envs = np.frombuffer(columns.envs, dtype=np.int64)
            at = 0
            for slot, n, odd in columns.slots:
                self._columns_replied(slot, keys[at : at + n], envs[at : at + n], odd, steps)
                at += n
        if steps:
            self._settle(list(steps.values()))
        if runs is not None:
            self._runs_replied(runs)

    def _reply(self, key: int, status: int, value: Any, steps: dict[RemoteLanes, _Steps]) -> None:
        """Request ``key``'s reply, to its future (a step the sink takes: into ``steps``)."""
        future = self._waiting.pop(key, None)
        if future is None:  # given up on
            return
        owner, i = self._owners.pop(key), self._envs.pop(key)
        if answered(future):
            return
        if status == ST_OK and owner.sinks_step(i, future):  # taken in one pass
            _Steps.of(steps, owner).add(i, value, future)
        else:
            owner.settle(i, status, value, future)

    def _columns_replied(
        self,
        slot: int,
        keys: np.ndarray,
        envs: np.ndarray,
        odd_replies: list[tuple[int, int, Any]],
        steps: dict[RemoteLanes, _Steps],
    ) -> None:
        """Worker slot ``slot``'s step replies (see :class:`StepReplies`): those of its owner's
        bare steps (their keys match :attr:`RemoteLanes.bare_keys`) into ``steps`` in one pass,
        an error to its env at once; any other as :meth:`_reply` takes it (a lane's own
        request, or one given up on)."""
        odd = {k: (status, value) for k, status, value in odd_replies}
        owner = self._slots.get(slot)
        mine = None if owner is None else owner.bare_keys[envs] == keys
        if mine is None or not all(mine.tolist()):  # (a numpy reduction costs more, for a few)
            key_list = keys.tolist()
            others = range(len(key_list)) if mine is None else np.flatnonzero(~mine).tolist()
            for k in others:
                status, value = odd.get(k, _QUIET) if odd else _QUIET
                self._reply(key_list[k], status, value, steps)
            if mine is None or not mine.any():
                return
            at = np.flatnonzero(mine)
            keys, envs = keys[at], envs[at]
            if odd:
                where = at.tolist()
                odd = {j: odd[k] for j, k in enumerate(where) if k in odd}
        assert owner is not None
        owner.bare_keys[envs] = 0  # read: its owner settles it (settle_steps)
        ids, markers = envs.tolist(), keys.tolist()
        values: list[Any] = [None] * len(ids)
        failed = False
        for j, (status, value) in odd.items():
            if status == ST_OK:
                values[j] = value
            else:  # its env's error, at once
                owner.settle(ids[j], status, value, markers[j])
                failed = True
        if failed:
            keep = [j for j in range(len(ids)) if odd.get(j, (ST_OK,))[0] == ST_OK]
            ids, markers = [ids[j] for j in keep], [markers[j] for j in keep]
            values = [values[j] for j in keep]
        batch = _Steps.of(steps, owner)
        batch.envs.extend(ids)
        batch.values.extend(values)
        batch.futures.extend(markers)

    def _runs_replied(self, runs: RunColumns) -> None:
        """The runs of a frame, grouped by owner (:meth:`RemoteLanes.settle_runs`)."""
        waiting, owners, envs = self._waiting, self._owners, self._envs
        batches: dict[RemoteLanes, _Runs] = {}
        for r, key in enumerate(runs.keys):
            future = waiting.pop(key, None)
            if future is None:  # given up on
                continue
            owner, i = owners.pop(key), envs.pop(key)
            if not future.done():
                batch = batches.get(owner)
                if batch is None:
                    batch = batches[owner] = _Runs(owner, runs, [], [], [])
                batch.add(r, i, future)
        self._settle(list(batches.values()))

    def _settle(self, batches: list[_Runs] | list[_Steps]) -> None:
        """Settle a frame's ``batches`` (one per owner) in the loop's passes of bounded work
        (:mod:`asyncsample._passes`): a frame of thousands of steps or runs never holds the
        loop. Each batch checks again, when its turn comes, that its requests are in flight."""
        queue = pass_queue(self._loop)
        for batch in batches:
            queue.put(batch.settle)

    def fail(self, error: BaseException) -> None:
        """The host died: every waiter gets ``error`` (as later requests will)."""
        self.dead = error
        waiting, self._waiting = self._waiting, {}
        owners, envs = self._owners, self._envs
        self._owners, self._envs = {}, {}
        self._out.clear()
        for key, future in waiting.items():
            if not answered(future):
                owners[key].settle(envs[key], ST_DIED, error, future)
        for owner in self._slots.values():
            owner.fail_bare(self, error)


class RemoteLanes(PerEnvLockstep):
    """The per-env calls of a remote host's worker slot (mixed into its ``RemoteHost``), over
    the :class:`LaneLink` of its live incarnation (``incarnation.lanes``)."""

    worker: int
    buffers: StepBuffers
    n_envs: int
    #: Who takes this host's replies in place of their futures (a call in progress), or None.
    sink: RunSink | None = None
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
        spec = self.spec  # type: ignore[attr-defined]
        # Object rows (Text, Sequence leaves): not in shared memory, they travel packed.
        self._columns = object_rows(spec)
        self._obs_in_reply = obs_in_reply or isinstance(self.buffers.obs, list) or self._columns
        self._built_in: list[Any] = [None] * self.n_envs  # the incarnation each env lives in
        self._all_in: Any = None  # the incarnation every env lives in, if one
        # Each env's request in flight (one at a time): its link, key and incarnation.
        self._links: list[LaneLink | None] = [None] * self.n_envs
        self._keys = [0] * self.n_envs
        # Per env, the key of its bare step in flight whose reply was not read (0: none); a
        # batch of bare steps is kept here, not in its link's dicts (LaneLink.submit_steps).
        self.bare_keys = np.zeros(self.n_envs, dtype=np.int64)
        self._kinds = [0] * self.n_envs
        self._sent_to: list[Any] = [None] * self.n_envs
        # Per env, a step's SinkStep and the future it got (keep_waiting) while its reply, read
        # already, waited for its turn (settle_steps).
        self._late: dict[int, tuple[Any, asyncio.Future[Any]]] = {}

    async def build(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        """Build every env (see ``RemoteHost.build``), in the live incarnation."""
        await super().build(chains, seeds)  # type: ignore[misc]
        self._built_in = [self._incarnation] * self.n_envs
        self._all_in = self._incarnation

    def _send(self, kind: int, i: int, *args: Any, bare: bool = False) -> asyncio.Future[Any]:
        """Send one lane request for env ``i``: a future of its reply's value (or error)."""
        if self._member.closed:
            raise closed_error(self.worker, "step")
        inc: Incarnation = self._incarnation
        if kind != LaneKind.REBUILD:
            built = self._built_in[i]
            if built is None or built.dead or built is not inc:
                # Its host died (since): this env's failure; its lane rebuilds it in a new one.
                raise _dead_error(built, self.worker, i)
        link: LaneLink = inc.lanes  # type: ignore[attr-defined]
        if self._obs_in_reply and self._columns:
            link.pack_actions = True
        self._links[i], self._sent_to[i], self._kinds[i] = link, inc, kind
        key, future = link.submit(self, kind, self._slot_index, i, *args, bare=bare)
        self._keys[i] = key
        return future

    def abandon(self, i: int) -> None:
        """The caller gave up on env ``i``'s request in flight (its awaiter was cancelled): the
        host cancels it. Nothing if it was answered already."""
        link = self._links[i]
        if link is not None:
            self._links[i] = None
            bare = int(self.bare_keys[i])
            if bare:
                self.bare_keys[i] = 0
                link.cancel(bare, bare=True)
            else:
                link.cancel(self._keys[i])

    def settle(self, i: int, status: int, value: Any, future: Any) -> None:
        """Settle ``future``, env ``i``'s request (or its :data:`SinkStep`), with its reply
        (:class:`LaneLink`); while a :attr:`sink` is set, it takes the reply of the request in
        flight instead."""
        self._links[i] = None
        ok, outcome = self._outcome(i, status, value)
        in_flight: dict[int, Any] = self.in_flight
        if self.sink is not None and in_flight.get(i) == future:
            self.sink.take(i, outcome)
            return
        marker: Any = future
        if type(marker) is SinkStep:  # no call takes it now: it gets a future after all
            future = asyncio.get_running_loop().create_future()
            watch_error(future)
            if in_flight.get(i) == marker:
                in_flight[i] = future
        if ok:
            future.set_result(outcome)
        else:
            future.set_exception(outcome)

    def sinks_step(self, i: int, future: asyncio.Future[Any]) -> bool:
        """Whether the :attr:`sink` takes ``future``, env ``i``'s step in flight, answered well,
        in one pass with the others of its frame (:meth:`settle_steps`)."""
        return (
            self.sink is not None
            and self._kinds[i] == LaneKind.STEP
            and not self._obs_in_reply
            and self.in_flight.get(i) is future
        )

    def settle_steps(self, batch: _Steps) -> None:
        """Settle ``batch``, steps that answered this host's requests (their outcomes in the step
        buffers): those still in flight to the :attr:`sink` in one pass, any other as
        :meth:`settle` would."""
        links, in_flight, sink = self._links, self.in_flight, self.sink
        if (  # the common case: every one still in flight to the sink, in one pass
            sink is not None
            and not self._late
            and [in_flight.get(i) for i in batch.envs] == batch.futures
        ):
            for i in batch.envs:
                links[i] = None
            values = batch.values
            infos = (
                [None if value is None else value[0] for value in values] if any(values) else values
            )
            sink.take_steps(np.array(batch.envs, dtype=np.int64), infos)
            return
        envs: list[int] = []
        infos = []
        for i, value, future in zip(batch.envs, batch.values, batch.futures, strict=True):
            late = self._late.pop(i, None) if self._late else None
            if late is not None and late[0] == future:  # its call ended: its future now
                future = late[1]
            if sink is not None and in_flight.get(i) == future:
                links[i] = None
                envs.append(i)
                infos.append(None if value is None else value[0])
            elif not answered(future):
                self.settle(i, ST_OK, value, future)
        if envs:
            assert sink is not None
            sink.take_steps(np.array(envs, dtype=np.int64), infos)

    def step_many(self, envs: list[int], index: np.ndarray, actions: Any) -> Sequence[Any]:
        """:meth:`step_soon` for each of ``envs`` (``index``: the same as an array) with its
        row of ``actions``, for the :attr:`sink` to take: written into the shared step buffers
        at once. Each is a :data:`SinkStep` (:meth:`keep_waiting` gives it a future if the sink
        lets it go) or, where the actions travel, a future whose error is marked retrieved, or
        the :class:`~asyncsample.WorkerError` of an env whose host died; a ``range`` of keys
        when all are :data:`SinkStep` s."""
        shared = not self._obs_in_reply and type(self.buffers.actions) is np.ndarray
        if shared:
            self.buffers.actions[index] = actions
            inc: Incarnation | None = self._incarnation
            if (  # the common case: every env's host lives, one pass for them all
                not self._member.closed
                and inc is not None
                and self._all_in is inc
                and len(envs) < 1 << KEY_BITS  # (their keys fit in one block)
                and not inc.dead
                and inc.lanes.dead is None
            ):
                link: LaneLink = inc.lanes  # type: ignore[attr-defined]
                links, sent_to, kinds = self._links, self._sent_to, self._kinds
                for i in envs:
                    links[i], sent_to[i], kinds[i] = link, inc, LaneKind.STEP
                first = link.submit_steps(self, self._slot_index, index)
                self.bare_keys[index] = np.arange(first, first + len(envs))
                return range(first, first + len(envs))
        out: list[Any] = []
        for k, i in enumerate(envs):
            try:
                if shared:  # (the sink takes the reply: no future, see SinkStep)
                    out.append(self._send(LaneKind.STEP, i, None, None, bare=True))
                else:
                    future = self.step_soon(i, actions[k])
                    watch_error(future)
                    out.append(future)
            except WorkerError as exc:
                out.append(exc)
        return out

    def keep_waiting(self, i: int) -> None:
        """Env ``i``'s step in flight, if a :data:`SinkStep`, gets a future (in
        :attr:`in_flight`): no sink will take it (a call of the lanes, a drop)."""
        in_flight: dict[int, Any] = self.in_flight
        if type(in_flight.get(i)) is not SinkStep:
            return
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        link = self._links[i]
        bare = int(self.bare_keys[i])
        if link is not None and bare:  # a bare step's reply not read: it goes to the future
            self.bare_keys[i] = 0
            link.adopt(self, bare, i, future)
        elif link is None or not link.rebind(self._keys[i], future):
            # Its reply came, and waits for its turn in the loop's passes (settle_steps).
            self._late[i] = (in_flight[i], future)
        watch_error(future)
        in_flight[i] = future

    def fail_bare(self, link: LaneLink, error: BaseException) -> None:
        """``link``'s host died: each bare step sent there and not answered gets ``error``."""
        bare = self.bare_keys
        for i in np.flatnonzero(bare).tolist():
            if self._links[i] is link:
                key = int(bare[i])
                bare[i] = 0
                self.settle(i, ST_DIED, error, key)

    def settle_runs(self, batch: _Runs) -> None:
        """Settle ``batch``, runs that answered this host's requests: those still in flight to
        the :attr:`sink` at once, any other as :meth:`settle` would."""
        links = self._links
        in_flight, sink = self.in_flight, self.sink
        rs: list[int] = []
        envs: list[int] = []
        for r, i, future in zip(batch.rs, batch.envs, batch.futures, strict=True):
            if sink is not None and in_flight.get(i) is future:
                links[i] = None
                rs.append(r)
                envs.append(i)
            elif not future.done():
                self.settle(i, ST_OK, batch.runs.run(r), future)
        if envs:
            assert sink is not None
            sink.take_runs(
                batch.runs,
                np.array(rs, dtype=np.int64),
                np.array(envs, dtype=np.int64),
            )

    def _outcome(self, i: int, status: int, value: Any) -> tuple[bool, Any]:
        """Env ``i``'s reply: ``(True, value)``, or ``(False, the error it raises)``."""
        if status == ST_OK:
            buffers = self.buffers
            kind = self._kinds[i]
            if self._obs_in_reply:
                value, obs, final = value
                _put(buffers.obs, i, obs)
                if final is not None:  # a step that ended its episode: the flags are read too
                    _put(buffers.final_obs, i, final)
                    if kind == LaneKind.RUN:
                        buffers.terminated[i], buffers.truncated[i] = (
                            value.terminated,
                            value.truncated,
                        )
                    else:
                        buffers.terminated[i], buffers.truncated[i] = value[1], value[2]
            elif kind == LaneKind.STEP or kind == LaneKind.ACT:  # the outcome is in the buffers
                reply = value
                value = (  # no info: None (a tuple of no container is not tracked)
                    float(buffers.rewards[i]),
                    bool(buffers.terminated[i]),
                    bool(buffers.truncated[i]),
                    None if reply is None else reply[0] or None,
                )
                if kind == LaneKind.ACT:  # (and the version that acted, where not as asked)
                    if reply is None:
                        value += (None, {}, -1)
                    else:
                        value += (None, reply[1] or {}, reply[2] if len(reply) > 2 else -1)
            return True, value
        if status == ST_DEADLINE:
            error: BaseException = DeadlinePassed()
        elif status == ST_DIED:
            if self._member.closed:
                error = closed_error(self.worker, "step")
            else:
                error = _dead_error(self._sent_to[i], self.worker, i)
        else:
            error = value
            if status == ST_AGENT and isinstance(error, WorkerError):
                error.retry = False  # the agent copy's error: the call's, never the env's
        return False, error

    async def _lane(self, kind: int, i: int, *args: Any) -> Any:
        """Send one lane request for env ``i`` and await its reply's value."""
        future = self._send(kind, i, *args)
        try:
            return await future
        except asyncio.CancelledError:
            self.abandon(i)
            raise

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
        self, i: int, action: Any, deadline: float | None = None, timed: int = 0
    ) -> Coroutine[Any, Any, tuple[float, bool, bool, dict[str, Any]]]:
        """Step env ``i`` in the host; see :meth:`~asyncsample.backends.aio.LaneHost.step_one`
        (``timed`` is the host's to decide: it samples its own steps).

        The request's own coroutine, returned: no second coroutine per step (the lanes use
        :meth:`step_soon`, no coroutine at all)."""
        return self._lane(LaneKind.STEP, i, self._action(i, action), self._left(deadline))

    def watch_lanes(self, lanes: Sequence[asyncio.Future[Any]]) -> None:
        """Nothing: the host counts its own env calls running (into its clock)."""

    def timed_envs(self) -> frozenset[int]:
        """None: the host samples the steps it times (see
        :meth:`~asyncsample.backends.base.PerEnvHost.timed_envs`)."""
        return frozenset()

    def _action(self, i: int, action: Any) -> Any:
        """What a step request carries of env ``i``'s ``action``: nothing where the host shares
        the step buffers (written into its row there: a numpy scalar or row costs more to pickle
        than the rest of the request)."""
        if self._obs_in_reply or isinstance(self.buffers.actions, list):
            return action
        _put(self.buffers.actions, i, action)
        return None

    def step_soon(
        self, i: int, action: Any, deadline: float | None = None
    ) -> asyncio.Future[tuple[float, bool, bool, dict[str, Any] | None]]:
        """:meth:`step_one` as a bare future (the lanes' way: no coroutine per step); whoever
        awaits it calls :meth:`abandon` when cancelled. An empty info is ``None``."""
        return self._send(LaneKind.STEP, i, self._action(i, action), self._left(deadline))

    def act_soon(
        self, i: int, version: int, deadline: float | None = None
    ) -> asyncio.Future[tuple[float, bool, bool, dict[str, Any], Any, dict[str, Any], int]]:
        """Step env ``i`` in the host with the action its agent copy picks (``inference="host"``):
        a future of ``(reward, terminated, truncated, info, action, agent_infos, acted)`` (see
        :meth:`step_soon` and :meth:`~asyncsample.backends.base.ActingHost.act_soon`)."""
        return self._send(LaneKind.ACT, i, self._left(deadline), version)

    def reset_soon(self, i: int) -> asyncio.Future[dict[str, Any]]:
        """:meth:`reset_one` with the pending seed, as a bare future (see :meth:`step_soon`)."""
        return self._send(LaneKind.RESET, i, PENDING, None, None)

    async def drop_in_flight(self, envs: Sequence[int] | None = None) -> list[int]:
        """See :meth:`~asyncsample.backends.base.PerEnvHost.drop_in_flight`; the host is told to
        cancel a bare request in flight (a lane's carrier tells it when cancelled)."""
        for i in list(self.in_flight) if envs is None else envs:
            self.keep_waiting(i)
            request = self.in_flight.get(i)
            if request is not None and not request.done() and not isinstance(request, asyncio.Task):
                self.abandon(i)
        return await super().drop_in_flight(envs)

    def run_soon(
        self, i: int, steps: int, merged: bool, deadline: float | None = None
    ) -> asyncio.Future[StepRun]:
        """See :meth:`~asyncsample.backends.base.ActingHost.run_soon`: one request and one reply
        for the run (see :meth:`step_soon`)."""
        return self._send(LaneKind.RUN, i, self._left(deadline), steps, merged)

    async def rebuild_one(self, i: int, chain: Sequence[EnvSource], seed: int) -> None:
        """Build env ``i`` again, in a new host if this one died (its other envs are rebuilt
        by their own lanes as they find it dead)."""
        inc = self._incarnation
        if inc is None or inc.dead:
            self._incarnation = await self._member.live()
        blob = cloudpickle.dumps(list(chain), protocol=pickle.HIGHEST_PROTOCOL)
        await self._lane(LaneKind.REBUILD, i, blob, seed)
        inc = self._built_in[i] = self._incarnation
        self._all_in = inc if all(built is inc for built in self._built_in) else None
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
    report = inc.report
    if inc.kind() == "blocked" and report is not None and report.env is not None:
        if (report.worker, report.env) == (worker, env):  # the culprit: its fault
            blocked = LoopBlockedError(
                report.message(), worker=worker, env=env, remote_traceback=report.stack
            )
            blocked.report = report
            return blocked
        err = WorkerCrashedError(
            f"{inc.describe()} {inc.reason}; this env lost its episode in progress and is "
            "rebuilt, not counted against its max_restarts",
            worker=worker,
            env=env,
        )
        err.charged = False
        return err
    err = WorkerCrashedError(f"{inc.describe()} {inc.reason}", worker=worker, env=env)
    err.__cause__ = inc.cause
    return err
