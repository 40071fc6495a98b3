"""An env host for async envs: its own event loop (uvloop where installed) steps each env on its
own, a :class:`~asyncsample.backends.aio.LaneHost` per worker slot, as ``backend="asyncio"``
does in the caller's loop. Lane requests (reset, step, rebuild one env) come in batches and
their replies leave in batches, one frame per pass of the loop each way (:data:`LANES_ID`);
whole-worker requests (build, update, call, set_attr, close) are frames of their own."""

from __future__ import annotations

import asyncio
import collections
import gc
import pickle
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncsample._batcher import Batched, Batcher
from asyncsample._clock import AgentTimer, record_agent_calls
from asyncsample._recorder import put_row
from asyncsample._tree import row_copy, tree_map
from asyncsample.agent import run_draws
from asyncsample.backends import _watchdog
from asyncsample.backends._chunk import (
    agent_error,
    alike_key,
    install_agent,
    params_key,
    set_agent_params,
)
from asyncsample.backends._column_wire import (
    object_rows,
    pack_replies,
    pack_runs,
    step_replies,
    unpack_requests,
)
from asyncsample.backends._pacing import CallWindow
from asyncsample.backends._transport import (
    HEADER,
    HELLO_ID,
    SLOT,
    ST_FAIL,
    ST_OK,
    Op,
    ReplyProtocol,
    dump_failure,
    dumps,
    portable_error,
    round_trips,
    split_version,
    worker_failure,
)
from asyncsample.backends.aio import LaneHost, make_async_env
from asyncsample.backends.base import DeadlinePassed, HostSpec, StepRun
from asyncsample.env_group import PENDING_SEED, StepBuffers
from asyncsample.errors import WorkerError

__all__ = [
    "LANES_ID",
    "LANE_HOST_NICE",
    "LaneKind",
    "LaneOptions",
    "LaneServer",
    "ST_AGENT",
    "ST_DEADLINE",
    "loop_factory",
    "quiet_collector",
    "serve",
]

#: The request id of lane batches, both ways (never a call's: ids wrap before it).
LANES_ID = 0xFFFFFFFF
#: A lane reply's status when the episode's deadline came first (the call was cancelled).
ST_DEADLINE = 2
#: A lane reply's status when the agent copy raised (``inference="host"``): the call fails.
ST_AGENT = 3


class LaneKind:
    """The first field of a lane request: what it asks of one env.

    ``STEP``, ``ACT`` and ``RUN`` are served by one step loop (in
    :meth:`LaneServer._serve_env`): a ``STEP`` is one step with the caller's action, an ``ACT``
    one with the action of the slot's agent copy, a ``RUN`` up to ``steps`` of those. They
    differ only in where the action comes from and in what the reply carries.
    """

    STEP = 0  # (STEP, key, slot, env, action or None: in the shared buffers, seconds left or None)
    RESET = 1  # (RESET, key, slot, env, seed or PENDING, options, seconds left or None)
    REBUILD = 2  # (REBUILD, key, slot, env, cloudpickled chain, seed)
    CANCEL = 3  # (CANCEL, key): the caller gave up on request ``key``
    # (ACT, key, slot, env, seconds left or None, version asked under): the slot's agent copy
    # acts, the env steps; the reply names the version that acted where it is another
    ACT = 4
    # (RUN, key, slot, env, seconds left or None, steps >= 1, merged): ACT up to ``steps`` times, in
    # one version (the reply's StepRun.version)
    RUN = 5
    # (STEPS, first key, slot, envs: int64 bytes): a STEP of each env, its action in the shared
    # buffers, keys first, first + 1, ... (one request for a batch: none to pickle per step)
    STEPS = 6


#: The lane requests that step an env (one loop serves them: see :class:`LaneKind`).
_STEPPING = frozenset({LaneKind.STEP, LaneKind.ACT, LaneKind.RUN})

#: A reset with the env's pending seed (``PENDING_SEED`` does not survive pickling).
PENDING = "pending"


#: What a process host that keeps its CPU busy on its own (async envs, or the agent's chunks of
#: ``inference="host"``) adds to its niceness by default, so that the caller's event loop gets
#: a core when it wakes: at 10,000 episodes of the seam study's minimal async env (100x100 over
#: 2 hosts, ``inference="host"``) the loop's lag p99 fell from 16 to 9-11 ms, and the steps per
#: second rose; on the README's run (CartPole-v1 4x8, chunks) it fell from 4 ms to 1.1-2.8 ms.
LANE_HOST_NICE = 5


@dataclass(frozen=True)
class LaneOptions:
    """What a host of async envs needs beyond its slots: ``step_timeout`` and ``close_timeout``
    (as on ``backend="asyncio"``), ``max_concurrency``, this host's share of the sampler's
    cap on env calls in flight (``None``: no cap)."""

    step_timeout: float | None
    close_timeout: float
    max_concurrency: int | None


def serve(
    sock: socket.socket,
    specs: Sequence[HostSpec],
    buffers: Sequence[StepBuffers],
    options: LaneOptions,
    block: np.ndarray | None = None,
) -> None:
    """Serve the slots of ``specs`` on ``sock`` until an ``exit`` request or the stream's end;
    ``block``: shared with the caller, its loop's counter and its watchdog's report (see
    :func:`watch_loop`)."""
    quiet_collector()
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_serve_socket(sock, specs, buffers, options, block))


def watch_loop(
    server: LaneServer, limit: float | None, counter: Any, blocked: Callable[[Any | None], None]
) -> tuple[Any, _watchdog.Watch | None]:
    """Show that the running loop turns: ``counter[0]`` bumped every
    :data:`~asyncsample.backends._watchdog.TICK` seconds (the env calls running counted for the
    metrics then too); with ``limit`` (``step_timeout``), a watchdog thread that hands ``blocked``
    the :class:`~asyncsample.backends._watchdog.BlockReport` of a loop that stood still that long
    (:func:`~asyncsample.backends._watchdog.loop_limit`), and ``None`` once it turns again.
    Returns the ticker and the watch, to stop both."""
    _watchdog.env_calls(LaneHost)
    ticker = _watchdog.tick(asyncio.get_running_loop(), counter, server.count_calls)
    watched = None
    if limit is not None:
        watched = _watchdog.watch(
            _watchdog.Watch(
                _watchdog.loop_limit(limit),
                counter,
                lambda report, first: blocked(report),
                on_move=lambda: blocked(None),
            )
        )
    return ticker, watched


#: The cyclic collector's thresholds in a host of async envs (see :func:`quiet_collector`).
HOST_GC_THRESHOLDS = (100_000, 10, 10)


def quiet_collector() -> None:
    """Collect cycles far less often in a host of async envs (a process of ours).

    With thousands of envs in flight, every step's future, coroutine and reply is still alive when
    the collector's default young pass runs (every 700 net allocations), so it is promoted and
    soon triggers full passes over every live object: at 5,000 envs per host, most of the host's
    CPU went to the collector. Nearly all of a host's garbage is freed by reference counting, so
    the young pass waits for 100,000 allocations instead; cycles are still collected.
    """
    gc.set_threshold(*HOST_GC_THRESHOLDS)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (``None``: asyncio's own)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _serve_socket(
    sock: socket.socket,
    specs: Sequence[HostSpec],
    buffers: Sequence[StepBuffers],
    options: LaneOptions,
    block: np.ndarray | None,
) -> None:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    sock.setblocking(False)
    protocol = ReplyProtocol()
    transport, _ = await loop.create_unix_connection(lambda: protocol, sock=sock)

    def send(rid: int, status: int, payload: bytes) -> None:
        if not transport.is_closing():
            transport.write(HEADER.pack(len(payload), rid, status) + payload)

    server = LaneServer(specs, buffers, options, lambda body: send(LANES_ID, ST_OK, body))

    def on_eof() -> None:
        if not done.done():
            done.set_result(None)

    def on_frame(rid: int, op: int, payload: bytes) -> None:
        if rid == LANES_ID:
            server.handle(payload)
        elif op == Op.EXIT:
            on_eof()
        else:
            task = server.call(SLOT.unpack_from(payload)[0], op, payload[SLOT.size :])

            def reply(t: asyncio.Task[tuple[int, bytes]]) -> None:
                if not t.cancelled():
                    send(rid, *t.result())

            task.add_done_callback(reply)

    protocol.attach(on_frame, on_eof)
    ticker = watched = None
    if block is not None:
        ticker, watched = watch_loop(
            server,
            options.step_timeout,
            _watchdog.turns_of(block),
            lambda report: (
                _watchdog.forget_report(block)
                if report is None
                else _watchdog.write_report(block, report)
            ),
        )
    send(HELLO_ID, ST_OK, b"")
    try:
        await done
    finally:
        _watchdog.unwatch(watched)
        if ticker is not None:
            ticker.cancel()
        await server.shut()
        transport.close()


class LaneServer:
    """The worker slots of one host of async envs (a :class:`LaneHost` each, over ``buffers``
    or buffers of their own), serving lane requests and whole-worker calls as tasks on the
    running loop; each pass of the loop's finished lane requests go to ``send`` as one pickled
    list of ``(key, status, value)``. ``obs_in_reply``: the caller does not share the buffers
    (Ray), so each reply carries its env's observation (and final observation).

    With ``inference="host"`` each slot holds a seeded copy of its worker's agent (installed and
    updated by whole-worker requests); an :data:`LaneKind.ACT` request asks it for the env's
    action and steps the env with it. The requests of one pass of the loop are merged into one
    agent call per slot (async agents awaited here), or per group of slots whose copies act
    alike (:func:`~asyncsample.backends._chunk.alike_key`: they share one copy and its calls),
    and the reply carries the action and its agent infos after the step's ``(reward,
    terminated, truncated, info)``."""

    def __init__(
        self,
        specs: Sequence[HostSpec],
        buffers: Sequence[StepBuffers | None],
        options: LaneOptions,
        send: Callable[[bytes], None],
        obs_in_reply: bool = False,
    ) -> None:
        window = None
        if options.max_concurrency is not None:  # no pacing: this loop serves no one else
            window = CallWindow(options.max_concurrency, None)
        self.slots = [
            LaneHost(
                spec,
                make_async_env,
                options.step_timeout,
                window,
                options.close_timeout,
                buffers=buffers,
            )
            for spec, buffers in zip(specs, buffers)
        ]
        self.by_worker = {spec.worker: k for k, spec in enumerate(specs)}
        self.timed = [k for k, s in enumerate(self.slots) if s.buffers.clock is not None]
        # Per slot, its envs' serving tasks, where its host finds the env calls running.
        self.watched: list[list[asyncio.Future[Any]]] = [[] for _ in self.slots]
        for slot, watched in zip(self.slots, self.watched):
            slot.watch_lanes(watched)
        self._send = send
        self.obs_in_reply = obs_in_reply
        # Slots whose Text/Sequence rows cannot be shared: their rows travel in the replies,
        # packed one column per leaf per batch (_column_wire), and their actions in requests.
        self._rows_travel = {id(s) for s in self.slots if object_rows(s.spec)}
        self._pack = bool(self._rows_travel)
        self.out: list[tuple[int, int, Any]] = []  # lane replies of this pass of the loop
        # Its step replies where the caller shares the buffers, per slot: keys, envs, and
        # (index, status, value) where not a success of no value (see StepReplies).
        self.steps_out: dict[int, tuple[list[int], list[int], list[tuple[int, int, Any]]]] = {}
        self.flushing = self.closing = False  # closing: shut, lane requests are dropped
        self.envs: dict[tuple[int, int], _EnvLane] = {}  # each env's queue of lane requests
        self.keys: dict[int, tuple[int, int]] = {}  # the env of each request not yet answered
        self.calls: set[asyncio.Task[Any]] = set()
        self.agents: list[Any] = [None] * len(self.slots)  # inference="host": agent copies
        # Per slot, its agent copy's installs and updates (bumped as an update starts and as it
        # ends: a run in flight ends at its next step if either came).
        self.changes = [0] * len(self.slots)
        # Per slot, the change its copy's row draws (run_draws) were taken at, the draws, and
        # whether their rows fit its action rows (a run takes them as its block of actions).
        self._draws: list[tuple[int, Any, bool]] = [(-1, None, False)] * len(self.slots)
        self.versions = [0] * len(self.slots)  # per slot, its copy's agent version (the stamp)
        # Per slot, its parameter update waiting for the agent calls asked of its copy (its
        # envs' requests wait for it).
        self._updating: list[asyncio.Future[None] | None] = [None] * len(self.slots)
        self._batchers: list[Batcher | None] = [None] * len(self.slots)  # their merged calls
        # Per slot, its copy's alike_key as installed and with its parameters; the copies with
        # equal keys share one copy and one batcher: one call a pass for all their envs.
        self._alike: list[tuple[bytes | None, bytes | None]] = [(None, None)] * len(self.slots)
        self._shared: dict[bytes, tuple[Any, Batcher]] = {}

    async def shut(self) -> None:
        """Cancel what runs and close every env (each close bounded by ``close_timeout``)."""
        self.closing = True
        for lane in self.envs.values():
            if lane.task is not None:
                lane.task.cancel()
        for task in list(self.calls):
            task.cancel()
        await asyncio.gather(*(s.shut() for s in self.slots), return_exceptions=True)

    # -- whole-worker requests ------------------------------------------------------------------

    def call(self, slot: int, op: int, body: bytes) -> asyncio.Task[tuple[int, bytes]]:
        """Run a whole-worker request (build, update, call, set_attr, close, agent install or
        parameters) of slot ``slot``; its task's result is the reply's ``(status, payload)``."""
        task = asyncio.ensure_future(self._call(slot, op, body))
        self.calls.add(task)
        task.add_done_callback(self.calls.discard)
        return task

    async def _call(self, k: int, op: int, body: bytes) -> tuple[int, bytes]:
        slot = self.slots[k]
        try:
            if op == Op.AGENT:  # a new copy: the calls in flight keep the one they have
                version, blob = split_version(body)
                self._key(k, None)
                self.agents[k] = agent = install_agent(blob)
                key = alike_key(blob, agent) if slot.buffers.clock is None else None
                self._key(k, key, key)
                self.versions[k] = version
                self.changes[k] += 1
                return ST_OK, b""
            if op == Op.PARAMS:
                await self._update(k, *split_version(body))
                return ST_OK, b""
            args = pickle.loads(body) if len(body) else ()
            value: Any = None
            if op == Op.BUILD:
                await slot.build(*args)
            elif op == Op.UPDATE:
                await slot.update(*args)
            elif op == Op.CALL:
                value = dumps(await slot.call(*args))
            elif op == Op.SET_ATTR:
                await slot.set_attr(*args)
            elif op == Op.CLOSE:
                await slot.close()
            else:
                raise ValueError(f"request {Op(op).label!r} is not served by a host of async envs")
            return ST_OK, value or b""
        except Exception as exc:
            return ST_FAIL, dump_failure(worker_failure(exc))

    async def _update(self, k: int, version: int, blob: bytes) -> None:
        """Slot ``k``'s copy takes the parameters in ``blob`` (agent ``version``) once the agent
        calls already asked of it are made, so that each step runs with the parameters of the
        version it is stamped with; the slot's requests that come meanwhile wait for it."""
        agent, installed = self.agents[k], self._alike[k][0]
        # The batchers that may hold calls of this copy: its own, and where it is shared.
        batchers = [b for a, b in self._shared.values() if a is agent]
        own = self._batchers[k]
        if own is not None:
            batchers.append(own)
        self._key(k, installed)  # until the parameters are in place: the slots alike move on
        gate = self._updating[k] = asyncio.get_running_loop().create_future()
        self.changes[k] += 1  # the runs in flight end at their next step (one compare there)
        try:
            for batcher in batchers:  # (no call of this copy is asked meanwhile: see _key)
                await batcher.made(agent)
            set_agent_params(agent, blob, self.slots[k].spec.worker)
            self._key(k, installed, params_key(installed, blob))
            self.versions[k] = version
            self.changes[k] += 1
        finally:
            self._updating[k] = None
            gate.set_result(None)

    async def _updated(self, k: int) -> None:
        """Once no update of slot ``k``'s copy is waiting."""
        gate = self._updating[k]
        while gate is not None:
            await gate
            gate = self._updating[k]

    def _key(self, k: int, installed: bytes | None, key: bytes | None = None) -> None:
        """Slot ``k``'s copy has the alike key ``key`` now (``installed``: as installed). A
        shared copy that is slot ``k``'s is dropped (the slots still alike take another's at
        their next request), and so are those no slot has any more."""
        own = self.agents[k]
        self._alike[k] = (installed, key)
        held = {key for _, key in self._alike}
        for gone in [g for g, (agent, _) in self._shared.items() if agent is own or g not in held]:
            del self._shared[gone]

    def _asked(self, k: int, host: LaneHost) -> tuple[Any, Batcher]:
        """The copy that acts for slot ``k``'s envs and the batcher of its merged calls: slot
        ``k``'s own, or the one its slots alike share (see :func:`alike_key`)."""
        key = self._alike[k][1]
        if key is not None:
            shared = self._shared.get(key)
            if shared is None:
                shared = self._shared[key] = (
                    self.agents[k],
                    Batcher(Batched(), action_space=host.spec.action_space),
                )
            return shared
        batcher = self._batchers[k]
        if batcher is None:
            batcher = self._batchers[k] = Batcher(Batched(), action_space=host.spec.action_space)
            if host.buffers.clock is not None:  # metrics on: its calls, rows and sampled seconds
                batcher.timer = AgentTimer()
        return self.agents[k], batcher

    # -- lane requests --------------------------------------------------------------------------

    def handle(self, payload: bytes) -> None:
        """Start the lane requests of one batch (see :class:`LaneKind`); none once shut."""
        if self.closing:  # (a Ray actor may run a batch sent before its shutdown after it)
            return
        requests = pickle.loads(payload)
        if type(requests) is tuple:  # actions packed in columns (Text, Sequence leaves)
            requests = unpack_requests(requests)
        for request in requests:
            self._lane(request)

    def _lane(self, request: tuple[Any, ...]) -> None:
        kind, key = request[0], request[1]
        if kind == LaneKind.STEPS:
            slot, queue = request[2], self._queue
            for k, i in enumerate(np.frombuffer(request[3], dtype=np.int64).tolist()):
                queue((slot, i), key + k, (LaneKind.STEP, key + k, slot, i, None, None))
            return
        if kind == LaneKind.CANCEL:
            env = self.keys.pop(key, None)
            if env is not None:
                self.envs[env].cancel(key)
            return
        self._queue((request[2], request[3]), key, request)

    def _queue(self, env: tuple[int, int], key: int, request: tuple[Any, ...]) -> None:
        """Queue ``request`` (its ``key``) for ``env`` (slot, index), whose task serves it."""
        lane = self.envs.get(env)
        if lane is None:
            lane = self.envs[env] = _EnvLane()
        self.keys[key] = env
        lane.queue.append(request)
        if lane.task is None:
            lane.task = asyncio.ensure_future(self._serve_env(lane, self.slots[env[0]], env[1]))
            self.watched[env[0]].append(lane.task)
        elif lane.idle is not None:
            lane.idle.set_result(None)
            lane.idle = None

    @_watchdog.env_site("step")  # its frame, where it awaits its env's step itself
    async def _serve_env(self, lane: _EnvLane, host: LaneHost, i: int) -> None:
        """Env ``i``'s requests, one at a time, in the order they came (a long-lived task per
        env: no task per request, each of which would live as long as its call)."""
        loop = asyncio.get_running_loop()
        queue = lane.queue
        buffers = host.buffers
        # Its rows travel in the replies (the caller does not share them); else its steps'
        # replies go in columns (StepReplies).
        travel = self.obs_in_reply or isinstance(buffers.obs, list) or id(host) in self._rows_travel
        while True:
            if not queue:
                lane.idle = loop.create_future()
                await lane.idle
                continue
            request = queue.popleft()
            kind, key = request[0], request[1]
            lane.running = key
            value: Any
            try:
                if kind in _STEPPING:
                    # STEP, ACT or RUN: the env's steps, in this one loop (see LaneKind), in
                    # this frame (a coroutine per request would be one more frame to resume
                    # at every step). A RUN's actions are drawn here by the built-in random
                    # agent unless ``merged`` (metrics off: they time the merged calls).
                    given, out = kind == LaneKind.STEP, None
                    if given:
                        run = False
                        when = None if request[5] is None else loop.time() + request[5]
                    else:
                        k, run = request[2], kind == LaneKind.RUN
                        when = None if request[4] is None else loop.time() + request[4]
                        if self._updating[k] is not None:
                            await self._updated(k)
                        version, draw, drawn = self.versions[k], None, False
                        draws: Any = None
                        if run:
                            steps, changes = request[5] - 1, self.changes
                            change = changes[k]
                            if not request[6] and buffers.clock is None:
                                draws, drawn = self._draw(k, change, host)
                                draw = None if draws is None else draws.one
                            obs, action_rows = buffers.obs, buffers.actions
                            # Plain rows go straight into blocks of the run's length, the env's
                            # observations into ``out`` (one copy each: EnvGroup.finish), the
                            # buffers' row written once, as the run ends.
                            blocks = type(obs) is np.ndarray and type(action_rows) is np.ndarray
                            drawn = drawn and blocks
                            seen: Any = []
                            acts: Any = []
                            if blocks:  # (a row more in ``out``: the last step's observation)
                                seen = np.empty((steps + 2, *obs.shape[1:]), obs.dtype)
                                out, seen[0] = seen, obs[i]
                                if drawn:  # the run's actions, drawn at once
                                    acts = draws.take(steps + 1)
                                else:
                                    shape = (steps + 1, *action_rows.shape[1:])
                                    acts = np.empty(shape, action_rows.dtype)
                            rewards: list[float] = []
                            infos: list[tuple[int, dict[str, Any]]] = []
                            agent_infos: list[tuple[int, dict[str, Any]]] = []
                    envs = host.direct_steps() if when is None else None
                    j = 0
                    try:
                        while True:  # (a single step's STEP and ACT leave after it)
                            if run:
                                if j and changes[k] != change:
                                    break  # an update: a run is of one version
                                if out is None:
                                    seen.append(_row(obs, i))
                            if given:
                                action = request[4]
                                if action is None:  # the caller wrote it into the shared buffers
                                    action = _row(buffers.actions, i)
                            elif drawn:
                                action = acts[j]
                            elif draw is not None:
                                action = draw()
                            else:
                                if out is not None:  # the copy reads the buffers' row
                                    obs[i] = out[j]
                                action, extra = await self._ask(k, host, i)
                                if extra and run:
                                    agent_infos.append((j, extra))
                            if envs is None or (not given and host.closed):  # (closed since)
                                value = await host.step_one(i, action, when, host.tick())
                                if out is not None:
                                    out[j + 1] = obs[i]
                            else:  # awaited here: a coroutine less (see LaneHost.direct_steps)
                                try:
                                    value = await envs[i].step(action)  # the env's call
                                except (asyncio.CancelledError, Exception) as exc:
                                    raise host.step_error(i, exc) from exc
                                value = host.finish_step(i, value, out, j + 1)
                            if not run:
                                break
                            reward, terminated, truncated, info = value
                            if drawn:
                                pass  # (the run's block holds it already)
                            elif blocks:
                                acts[j] = action
                            else:
                                acts.append(action)
                            rewards.append(reward)
                            if info:
                                infos.append((j, info))
                            if terminated or truncated or j == steps:
                                break
                            j += 1
                    finally:
                        if out is not None:  # the env's latest observation, however the run ends
                            obs[i] = out[len(rewards)]
                    if run:
                        if drawn:  # the draws it did not use, for the next
                            draws.give_back(acts, len(rewards))
                        if blocks:
                            seen, acts = seen[: len(rewards)], acts[: len(rewards)]
                        value = StepRun(
                            seen, acts, rewards, infos, agent_infos, terminated, truncated, version
                        )
                    elif not given:
                        if not (
                            self.obs_in_reply
                            or isinstance(buffers.actions, list)
                            or id(host) in self._rows_travel
                        ):  # shared with the caller: read there, not sent (numpy scalars and
                            put_row(buffers.actions, i, action)  # rows cost more to pickle
                            action = None
                        value = (*value, action, extra, version)
                elif kind == LaneKind.RESET:
                    seed = PENDING_SEED if request[4] == PENDING else request[4]
                    when = None if request[6] is None else loop.time() + request[6]
                    value = await host.reset_one(i, seed, request[5], when)
                    agent = self.agents[request[2]]
                    if agent is not None and hasattr(agent, "reset"):  # its copy starts it too
                        self._agent_reset(agent, host, i)
                else:
                    await host.rebuild_one(i, pickle.loads(request[4]), request[5])
                    value = None
                if travel:
                    if kind == LaneKind.RUN:
                        ended = value.terminated or value.truncated
                    else:
                        ended = isinstance(value, tuple) and (value[1] or value[2])
                    final = _row(buffers.final_obs, i) if ended else None
                    value = (value, _row(buffers.obs, i), final)
                elif kind == LaneKind.RUN:  # the last step's outcome: in the shared buffers
                    buffers.terminated[i], buffers.truncated[i] = value.terminated, value.truncated
                elif kind == LaneKind.STEP or kind == LaneKind.ACT:
                    # The caller shares the buffers: the outcome goes there, the reply carries
                    # the infos only, if any (a reply of floats, flags and dicts pickled and
                    # unpickled per step cost both sides more than the rest of the step's path).
                    buffers.rewards[i] = value[0]
                    buffers.terminated[i], buffers.truncated[i] = value[1], value[2]
                    if kind == LaneKind.STEP:
                        value = (value[3], None) if value[3] else None
                    elif value[6] != request[5]:  # not the version it was asked under
                        value = (value[3], value[5], value[6])
                    else:
                        value = (value[3], value[5]) if value[3] or value[5] else None
                reply: tuple[int, int, Any] = (key, ST_OK, value)
            except DeadlinePassed:
                reply = (key, ST_DEADLINE, None)
            except asyncio.CancelledError:
                if lane.cancelled != key:
                    raise  # the host closing
                # The caller gave up on this call: no reply. (An env's own CancelledError came
                # back as the WorkerError of LaneHost._raised.)
                lane.cancelled = None
                current = asyncio.current_task()
                assert current is not None
                current.uncancel()
                if self.timed and not self.flushing:  # the clocks' calls in flight, settled
                    self.flushing = True
                    loop.call_soon(self._flush)
                continue
            except _AgentFault as fault:
                reply = (key, ST_AGENT, fault.error)
            except Exception as exc:
                reply = (key, ST_FAIL, exc if round_trips(exc) else portable_error(exc))
            finally:
                lane.running = None
            self.keys.pop(key, None)
            if kind == LaneKind.STEP and not travel:
                self._step_reply(request[2], i, reply)
            else:
                self.out.append(reply)
            if not self.flushing:
                self.flushing = True
                loop.call_soon(self._flush)

    async def _ask(self, k: int, host: LaneHost, i: int) -> tuple[Any, dict[str, Any]]:
        """The action (and agent infos) slot ``k``'s agent copy picks for env ``i``'s
        observation, in the copy's merged call of this pass of the loop."""
        worker = host.spec.worker
        if self.agents[k] is None:
            raise _agent_fault(
                RuntimeError(f"worker {worker}: no agent installed in its env host"), worker
            )
        agent, batcher = self._asked(k, host)
        obs = host.buffers.obs
        observation = (
            obs[i] if isinstance(obs, (np.ndarray, list)) else tree_map(lambda a: a[i], obs)
        )
        try:  # (its copy's parameters stay until the call is made: see _update)
            action, infos = await batcher.request(agent, worker, observation, i)
            return action, infos
        except WorkerError:
            raise  # the agent failed this env's row (AgentRowsError): the env's fault alone
        except Exception as exc:
            raise _agent_fault(exc, worker) from None

    def _draw(self, k: int, change: int, host: LaneHost) -> tuple[Any, bool]:
        """Slot ``k``'s row draws (:func:`run_draws`) for its copy as of ``change``, and whether
        a run may take its block of actions from them (its rows are the action rows' dtype and
        shape); taken once per install or update, not per run: it compares the action space."""
        taken, draws, fits = self._draws[k]
        if taken != change:
            draws = run_draws(self.agents[k], host.spec.action_space)
            actions = host.buffers.actions
            fits = (
                draws is not None
                and type(actions) is np.ndarray
                and (draws.dtype, draws.shape) == (actions.dtype, actions.shape[1:])
            )
            self._draws[k] = (change, draws, fits)
        return draws, fits

    @staticmethod
    def _agent_reset(agent: Any, host: LaneHost, i: int) -> None:
        """``agent.reset(mask)`` of the copy for env ``i``'s new episode (one-hot ``mask``)."""
        mask = np.zeros(host.n_envs, dtype=bool)
        mask[i] = True
        try:
            agent.reset(mask)
        except Exception as exc:
            raise _agent_fault(exc, host.spec.worker) from None

    def _step_reply(self, slot: int, i: int, reply: tuple[int, int, Any]) -> None:
        """Env ``i``'s step reply, into slot ``slot``'s columns (see :class:`StepReplies`)."""
        columns = self.steps_out.get(slot)
        if columns is None:
            columns = self.steps_out[slot] = ([], [], [])
        keys, envs, odd = columns
        key, status, value = reply
        if status != ST_OK or value is not None:
            odd.append((len(keys), status, value))
        keys.append(key)
        envs.append(i)

    def count_calls(self) -> None:
        """With metrics on, settle each slot's clock now, its env calls running included (the
        loop's ticks do, so the caller's gauge is live while no reply comes)."""
        for k in self.timed:
            self.slots[k].settle_clock()

    def _flush(self) -> None:
        self.flushing = False
        out, self.out = self.out, []
        for k in self.timed:  # metrics on: the steps and agent calls so far into the clock
            slot = self.slots[k]
            slot.settle_clock()
            batcher = self._batchers[k]
            if batcher is not None and batcher.timer is not None and batcher.timer.calls:
                record_agent_calls(slot.buffers.clock, *batcher.timer.drain())  # type: ignore[arg-type]
        steps, self.steps_out = self.steps_out, {}
        if out or steps:
            payload: Any = pack_replies(out, ST_OK) if self._pack else pack_runs(out)
            if steps:
                payload = step_replies(payload, steps)
            self._send(dumps(payload))


@dataclass
class _EnvLane:
    """One env's lane requests in a host: those waiting (in order), the one running, the task
    that serves them (started with the first), and the future it idles on."""

    queue: collections.deque[tuple[Any, ...]] = field(default_factory=collections.deque)
    task: asyncio.Task[None] | None = None
    idle: asyncio.Future[None] | None = None
    running: int | None = None
    cancelled: int | None = None

    def cancel(self, key: int) -> None:
        """The caller gave up on request ``key``: dropped if waiting, cancelled if running."""
        if self.running == key:
            if self.cancelled != key and self.task is not None:
                self.cancelled = key
                self.task.cancel()
            return
        for k, request in enumerate(self.queue):
            if request[1] == key:
                del self.queue[k]
                return


def _row(tree: Any, i: int) -> Any:
    """Env ``i``'s row of a buffer (a copy: the buffer is written again by its next call)."""
    if type(tree) is np.ndarray:  # one array: no tree_map (25x the indexing's cost)
        return tree[i] if tree.ndim == 1 else tree[i].copy()  # a scalar is a copy already
    if isinstance(tree, list):
        return tree[i]
    return tree_map(lambda a: row_copy(a, i), tree)


class _AgentFault(Exception):
    """What the agent copy raised, on its way to the caller as the call's error (not the env's:
    the env is not rebuilt for it)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _agent_fault(exc: BaseException, worker: int) -> _AgentFault:
    return _AgentFault(agent_error(exc, worker) if isinstance(exc, Exception) else exc)
