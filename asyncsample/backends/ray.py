"""The ``ray`` backend: env hosts as Ray actors, anywhere in a Ray cluster.

Only the envs move: worker ``w`` lives on actor ``w % A``, which runs one
:class:`~asyncsample.env_group.EnvGroup` per worker slot as every backend does. A worker step is
one actor call (wire format: :mod:`~asyncsample.backends._ray_actor`) whose future a Ray thread
resolves with ``call_soon_threadsafe``. A call that outlives ``step_timeout`` (with
``inference="host"``: a step of a chunk, :meth:`_Actor.watch`) kills the actor; a dead actor
fails every call waiting on it. ``import asyncsample`` never imports ray: :class:`RayBackend` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import math
import os
import pickle
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from asyncsample import _validate
from asyncsample._clock import CALLS
from asyncsample._tasks import wait_all
from asyncsample.backends._chunk import ChunkBuffers, ChunkReply, ChunkRequest
from asyncsample.backends._closing import CLOSE_TIMEOUT, exit_grace, optional_close_timeout
from asyncsample.backends._lane_link import LaneLink, RemoteLanes
from asyncsample.backends._lane_serve import LaneOptions
from asyncsample.backends._pacing import shares
from asyncsample.backends._ray_actor import (
    OK,
    PROGRESS_GROUP,
    WATCH_GROUP,
    EnvActor,
    LaneActor,
    best_codec,
    copy_into,
    encode_request,
)
from asyncsample.backends._remote import (
    PROGRESS_POLL,
    HostDied,
    Incarnation,
    PendingCall,
    PoolMember,
    RemoteHost,
    progress_poll,
)
from asyncsample.backends._transport import Op, load_failure
from asyncsample.backends._transport import dumps as _dumps
from asyncsample.backends._watchdog import REPORT_GRACE
from asyncsample.backends.base import EnvHost, HostSpec, failure_error, reject_unknown_options
from asyncsample.backends.placement import placement
from asyncsample.env_group import StepBuffers, StepInfos
from asyncsample.errors import WorkerCrashedError, WorkerError

__all__ = ["INSTALL_HINT", "EnvActor", "RayBackend", "RayHost"]

#: What to run when ray is missing.
INSTALL_HINT = "pip install 'asyncsample[ray]'"
#: Ray's placement-group strategies.
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: Seconds the actors get to close their envs in ``aclose`` before they are killed, when the
#: backend was given no ``close_timeout`` (and at most, for an actor still busy with a call).
EXIT_GRACE = 2.0
#: Seconds an actor may wait to be scheduled before a warning says what it waits for.
PENDING_WARNING = 10.0
#: Seconds to wait for Ray to confirm that killed actors are dead.
_KILL_WAIT = 5.0


class _Actor(Incarnation):
    """One incarnation of an env-host actor, as the main process sees it."""

    def __init__(self, ray: Any, handle: Any, index: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.ray = ray
        self.handle = handle
        self.index = index
        self.where = ""
        # Chunks judged per step: the polling tasks (see watch), and when a count was asked for.
        self.watchers: set[asyncio.Task[None]] = set()
        self.polling: dict[PendingCall, float] = {}
        self.lanes: LaneLink | None = None  # async envs: see start_lanes
        self.batches = 0  # lane request batches sent (LaneActor.submit starts them in order)
        # Metrics on, async envs: each worker's clock in the caller (the actor's copies come
        # with its replies); shared by the member's incarnations.
        self.clocks: dict[int, np.ndarray] = {}

    def start_lanes(self, step_timeout: float | None = None) -> None:
        """Async envs (a :class:`LaneActor`): lane requests go out in batches, one call per pass
        of the loop, and one ``replies`` call always waits for the actor's next replies; with
        ``step_timeout`` or metrics on, the actor's loop is watched (:meth:`_watch_loop`)."""
        self.lanes = LaneLink(self._send_lanes, self.loop)
        tasks = [
            self.loop.create_task(self._take_replies()),
            self.loop.create_task(self._watch_loop(step_timeout)),
        ]
        for task in tasks:
            self.watchers.add(task)
            task.add_done_callback(self.watchers.discard)

    async def _watch_loop(self, timeout: float | None) -> None:
        """Ask the actor's :meth:`LaneActor.beat` (a thread of its own) every
        :func:`~asyncsample.backends._remote.progress_poll` of ``timeout`` (metrics only: every
        :data:`~asyncsample.backends._remote.PROGRESS_POLL`): the env calls running go into the
        clocks, and the loop is judged (:meth:`judge_loop`; a call holding the GIL keeps beat
        from answering too: it is judged as standing still)."""
        interval = PROGRESS_POLL if timeout is None else progress_poll(timeout)
        beat = self.handle.beat.options(concurrency_group=WATCH_GROUP)
        while not self.dead:
            await asyncio.sleep(interval)
            if timeout is None and not self.clocks:
                continue  # nothing to watch for (the clocks are there from the hosts' start)
            try:
                ref = beat.remote()
            except Exception:  # Ray is gone: the other calls find out why
                return
            try:
                turns, report, calls = await asyncio.wait_for(
                    asyncio.wrap_future(ref.future()), interval + REPORT_GRACE
                )
            except TimeoutError:
                turns, report, calls = self.loop_seen, None, []
            except Exception:  # the actor died: its calls say why
                return
            for worker, n in calls:
                clock = self.clocks.get(worker)
                if clock is not None:
                    clock[CALLS] = n
            self.judge_loop(turns, report, self.loop.time(), timeout)

    def _send_lanes(self, body: bytes) -> None:
        number, self.batches = self.batches, self.batches + 1
        call = self.submit("submit", (number, body), None, -1, "lane requests")
        call.future.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _take_replies(self) -> None:
        lanes = self.lanes
        assert lanes is not None
        while not self.dead:
            try:
                batches, clocks = await self.submit("replies", (), None, -1, "lane replies").future
            except HostDied:
                return  # _on_death failed the lanes' waiters
            except WorkerError as exc:  # the actor method raised: a bug of the host
                self.die(str(exc), exc)
                return
            if clocks is not None:  # metrics on: the host's sampled step timings, so far
                for worker, clock in clocks:
                    mine = self.clocks.get(worker)
                    if mine is not None:
                        mine[:] = clock
            for body in batches:
                lanes.replied(body)

    def describe(self) -> str:
        return f"env-host actor {self.index}" + (f" ({self.where})" if self.where else "")

    def submit(
        self,
        method: str,
        args: tuple[Any, ...],
        timeout: float | None,
        worker: int,
        label: str | None = None,
        progress: np.ndarray | None = None,
    ) -> PendingCall:
        """Call ``method`` on the actor (``label``: the call's name in messages; ``progress``: a
        chunk's step counter, :meth:`watch`); its future fails with :class:`HostDied` if the actor
        is or becomes dead, with a :class:`~asyncsample.WorkerError` if the actor method raised."""
        if not self.dead and not self.ray.is_initialized():
            # Someone shut Ray down: its actors died with it (and a call now would start Ray).
            self.die("is gone: Ray was shut down")
        call = self.new_call(label or method, worker, timeout, progress)
        if self.dead:
            return call
        try:
            ref = getattr(self.handle, method).remote(*args)
        except Exception as exc:  # Ray itself is gone (shut down, disconnected)
            self.die(f"could not be called ({type(exc).__name__}: {exc})", exc)
            return call
        call.key = ref
        ref.future().add_done_callback(lambda cf: self._from_ray_thread(call, cf))
        return call

    def watch(self, call: PendingCall, worker: int, timeout: float) -> None:
        """Judge a chunk ``call`` per step: while the actor works on it, ask
        :meth:`EnvActor.progress` (in its own concurrency group) into its ``progress`` counter every
        :func:`~asyncsample.backends._remote.progress_poll` seconds, which the timer then judges."""
        task = self.loop.create_task(self._poll(call, worker, timeout))
        self.watchers.add(task)
        task.add_done_callback(self.watchers.discard)

    async def _poll(self, call: PendingCall, worker: int, timeout: float) -> None:
        counter = call.progress
        assert counter is not None
        interval = progress_poll(timeout)
        progress = self.handle.progress.options(concurrency_group=PROGRESS_GROUP)
        while True:
            await asyncio.sleep(interval)
            if call.done or self.dead:
                return
            calls = self.calls
            if not calls or calls[0] is not call:
                continue  # queued behind another worker's call: the chunk has not started
            try:
                ref = progress.remote(worker)
            except Exception:  # Ray is gone: the call learns it from its own reply
                return
            self.polling[call] = self.loop.time()
            try:
                steps = await asyncio.wrap_future(ref.future())
            except Exception:  # the actor died: so did the call, which says why
                return
            finally:
                self.polling.pop(call, None)
            if not call.done:
                counter[0] = steps

    def _defer_timeout(self, call: PendingCall) -> bool:
        """Whether the step counter of ``call`` is being asked for, for less than its timeout (an
        env that hangs holding the GIL is found after at most twice ``step_timeout``)."""
        sent = self.polling.get(call)
        timeout = call.timeout
        return sent is not None and timeout is not None and self.loop.time() - sent < timeout

    def _on_death(self) -> None:
        for task in list(self.watchers):
            task.cancel()
        self.polling.clear()
        if self.lanes is not None:
            self.lanes.fail(HostDied(self.reason))

    def _from_ray_thread(self, call: PendingCall, cf: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(self._on_reply, call, cf)

    def _on_reply(self, call: PendingCall, cf: Any) -> None:
        call.key = None
        self.answered(call)
        try:
            value = cf.result()
        except BaseException as exc:
            self._on_error(call, exc)
            return
        if not call.future.done():
            call.future.set_result(value)

    def _on_error(self, call: PendingCall, exc: BaseException) -> None:
        ray = self.ray
        if isinstance(exc, ray.exceptions.RayTaskError):
            # The actor method raised: a bug of the host, not an env failure.
            cause = getattr(exc, "cause", None) or exc
            err = WorkerError(
                f"{self.describe()} failed in {call.label}: {type(cause).__name__}: {cause}",
                worker=call.worker,
                remote_traceback=str(exc),
            )
            err.__cause__ = cause
            if not call.future.done():
                call.future.set_exception(err)
            return
        if isinstance(exc, asyncio.CancelledError | ray.exceptions.TaskCancelledError):
            reason = "cancelled the call"
        elif isinstance(exc, ray.exceptions.RayActorError):
            reason = "died"
        else:  # object lost, out of memory, node died...
            reason = f"failed ({type(exc).__name__})"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.die(f"{reason}: {first_line}" if first_line else reason, exc)
        if not call.future.done():
            call.future.set_exception(HostDied(self.reason))

    def _kill(self) -> None:
        self.kill()

    def kill(self) -> None:
        """Kill the actor process (no Ray restart); harmless if it is dead already."""
        if self.ray.is_initialized():
            with contextlib.suppress(Exception):
                self.ray.kill(self.handle, no_restart=True)


class _Member(PoolMember[_Actor]):
    """One place in the actor pool: the workers it hosts and its current actor."""

    def __init__(self, spawner: RayBackend, index: int, specs: list[HostSpec]) -> None:
        super().__init__(index, specs)
        self.spawner = spawner
        self.clocks: dict[int, np.ndarray] = {}  # async envs, metrics on: see _Actor.clocks

    async def _spawn(self) -> _Actor:
        spawner = self.spawner
        handle = spawner.new_actor(self.index, self.slots_blob)
        actor = _Actor(spawner.ray, handle, self.index, asyncio.get_running_loop())
        self.incarnations.append(actor)
        try:
            pid, ip = await asyncio.wait_for(self._ready(actor), spawner.start_timeout)
        except TimeoutError:
            actor.closing = True
            actor.die("could not be scheduled")
            raise WorkerCrashedError(
                f"{actor.describe()} was not scheduled within start_timeout="
                f"{spawner.start_timeout:g}s: does the cluster have the resources it asks for "
                f"({spawner.resource_text()})?",
                worker=self.workers[0],
            ) from None
        except BaseException:
            actor.die("failed to start")
            raise
        actor.where = f"pid {pid} on {ip}"
        if spawner.lanes is not None:
            actor.clocks = self.clocks
            actor.start_lanes(spawner.step_timeout)
        return actor

    async def _ready(self, actor: _Actor) -> tuple[int, str]:
        """Wait for the actor to be up; warn once if it is still not scheduled after a while."""
        call = actor.submit("ready", (), None, self.workers[0])
        ready = call.future
        try:
            done, _ = await asyncio.wait({ready}, timeout=PENDING_WARNING)
            if not done:
                spawner = self.spawner
                with contextlib.suppress(Exception):
                    free = spawner.ray.available_resources()
                    free_text = ", ".join(f"{k}={v:g}" for k, v in sorted(free.items()))
                    warnings.warn(
                        f"{actor.describe()} has waited {PENDING_WARNING:g}s to be scheduled. "
                        f"Each env-host actor asks for {spawner.resource_text()}; the cluster "
                        f"has {free_text or 'nothing'} free. Lower num_cpus (num_cpus=0 lets "
                        "actors share CPUs, as processes do) or n_processes, add resources, or "
                        "set start_timeout to fail instead of waiting.",
                        RuntimeWarning,
                        stacklevel=1,
                    )
            try:
                result: tuple[int, str] = await ready
            except HostDied:
                err = actor.crashed(self.workers[0])
                raise err from err.__cause__
        finally:
            ready.cancel()
        return result


class RayHost(RemoteHost[_Actor]):
    """The host of one worker's envs, living in a Ray actor shared with other workers."""

    where = "env-host actor"

    def __init__(self, spec: HostSpec, member: _Member, step_timeout: float | None) -> None:
        spaces = (spec.observation_space, spec.action_space)
        buffers = StepBuffers.allocate(*spaces, spec.n_envs, timed=spec.timed, columns=spec.columns)
        super().__init__(spec, member, buffers, step_timeout)
        self.chunk: ChunkBuffers | None = None
        """``inference="host"``: this worker's copy of the chunk records (filled per reply)."""
        if spec.chunk_steps > 0:
            flat = StepBuffers.allocate(
                *spaces, spec.chunk_steps * spec.n_envs, columns=spec.columns
            )
            self.chunk = ChunkBuffers.from_flat(flat, spec.chunk_steps, spec.n_envs)

    @property
    def actor(self) -> Any:
        """The Ray actor handle this worker's envs currently live in."""
        return None if self._incarnation is None else self._incarnation.handle

    def _submit(self, incarnation: _Actor, op: Op, payload: tuple[Any, ...]) -> PendingCall:
        timeout, worker = self._timeout, self.worker
        if op is Op.STEP or op is Op.RESET:
            method, args = op.label, payload  # the request carries the worker
        elif op is Op.CHUNK:  # inference="host"
            args = (worker, *payload)
            if timeout is None:
                return incarnation.submit("run_chunk", args, None, worker, op.label)
            # step_timeout bounds each step: the actor's count of this chunk's steps is polled
            # into a counter of the call's own while the chunk runs (see _Actor.watch).
            counter = np.zeros(1, np.int64)
            call = incarnation.submit("run_chunk", args, timeout, worker, op.label, counter)
            incarnation.watch(call, worker, timeout)
            return call
        else:
            method, args = "serve", (worker, int(op), *(payload or (b"",)))
        return incarnation.submit(method, args, timeout, worker, op.label)

    def _unpack(self, reply: Any) -> Any:
        status, payload = pickle.loads(reply) if isinstance(reply, bytes) else reply
        if status != OK:
            raise failure_error(self.worker, load_failure(payload))
        return payload

    async def reset(
        self,
        mask: np.ndarray,
        seeds: Sequence[int | None] | None = None,
        options: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
    ) -> dict[int, dict[str, object]]:
        request = encode_request(self.worker, mask)
        if seeds is None and options is None:
            obs, infos = await self._request(Op.RESET, request)
        else:
            args = _validate.reset_arguments(self.spec.n_envs, seeds, options)
            obs, infos = await self._request(Op.RESET, request, self._pickle("reset options", args))
        copy_into(self.buffers.obs, obs)
        result: dict[int, dict[str, object]] = infos
        return result

    async def step(self, mask: np.ndarray) -> StepInfos:
        buf = self.buffers
        # The request is a copy of the actions: the worker may write the next ones meanwhile.
        payload = await self._request(Op.STEP, encode_request(self.worker, mask, buf.actions))
        obs, rewards, terminated, truncated, done, final, infos = payload[:7]
        if buf.clock is not None:  # metrics: the actor's clock came with the reply
            buf.clock[:] = payload[7]
        copy_into(buf.obs, obs)
        buf.rewards[:] = rewards
        buf.terminated[:] = terminated
        buf.truncated[:] = truncated
        if final is not None:
            copy_into(buf.final_obs, final, done)
        result: StepInfos = infos
        return result

    async def run_chunk(self, request: ChunkRequest) -> tuple[ChunkReply, int]:
        """``inference="host"``: one chunk in one actor call; the reply and its agent version."""
        version = await self.sync_agent()
        chunk = self.chunk
        assert chunk is not None
        payload = await self._request(Op.CHUNK, _dumps(request))
        reply, records, current = payload[:3]
        if self.buffers.clock is not None:
            self.buffers.clock[:] = payload[3]
        if reply.steps:
            for name, record in records.items():
                copy_into(getattr(chunk, name), record, slice(0, reply.steps))
        copy_into(self.buffers.obs, current)
        result: ChunkReply = reply
        return result, version


class RayLaneHost(RemoteLanes, RayHost):
    """The host of one worker's async envs, each reset and stepped on its own in its actor's
    event loop (see :mod:`asyncsample.backends._lane_link`)."""

    def __init__(self, spec: HostSpec, member: _Member) -> None:
        # No per-call timer: the actor holds each env call to step_timeout itself.
        super().__init__(spec, member, None)
        self._lanes_init(member.workers.index(spec.worker), obs_in_reply=True)
        if self.buffers.clock is not None:  # metrics on: the actor's clock lands here
            member.clocks[spec.worker] = self.buffers.clock


# A local Ray started by a RayBackend is shared meanwhile; the last backend to close shuts it.
_OWNER_LOCK = threading.Lock()
_owned: dict[str, int] = {"users": 0}


class RayBackend:
    """Hosts the envs of all workers in Ray actors (the options are those of docs/backends.md).

    Args:
        n_processes: number of env-host actors (default: the CPU count), at most ``n_workers``.
        step_timeout: seconds an actor may spend on a call (on a step of a chunk) before it is
            killed: :class:`~asyncsample.StepTimeoutError`.
        address: a running Ray cluster. Default: an initialised Ray, else ``RAY_ADDRESS``, else a
            local instance started here and shut down by :meth:`aclose`.
        num_cpus, num_gpus, memory, resources: Ray resources of each actor.
        placement_strategy: reserve one placement-group bundle per actor first (``"SPREAD"``,
            ``"PACK"``, ``"STRICT_SPREAD"``, ``"STRICT_PACK"``); ``None``: Ray's own scheduling.
        workers_per_actor: host this many workers per actor (overrides ``n_processes``).
        compress_threshold: compress observation arrays of at least this many bytes (``None``: no).
        init_kwargs: extra keyword arguments for ``ray.init``.
        start_timeout: seconds to wait for the actors to be up (``None``: as long as it takes).
        host_threads: intra-op threads of the numeric libraries in each actor (``None``: theirs).
        close_timeout: seconds :meth:`aclose` lets the actors close their envs before they are
            killed (``None``: ``EXIT_GRACE``); while an actor is still busy with a call, at most
            ``EXIT_GRACE``.
            With async envs, also the longest an env's ``close()`` is waited for (``None``: 10 s).
        max_concurrency: async envs (each stepped on its own in its actor's event loop): the env
            calls in flight across the actors (each gets a share). ``step_timeout`` then cuts one
            env's call.
    """

    def __init__(
        self,
        n_processes: int | None = None,
        step_timeout: float | None = None,
        address: str | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        memory: int | None = None,
        resources: Mapping[str, float] | None = None,
        placement_strategy: str | None = None,
        workers_per_actor: int | None = None,
        compress_threshold: int | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
        start_timeout: float | None = None,
        host_threads: int | None = 1,
        max_concurrency: int | None = None,
        close_timeout: float | None = None,
        **unknown: object,
    ) -> None:
        reject_unknown_options("ray", unknown, self.OPTIONS)
        self.close_timeout = optional_close_timeout(close_timeout)
        try:
            import ray
        except ImportError as exc:
            raise ImportError(
                f"backend='ray' needs the ray package, which is not installed: {INSTALL_HINT}"
            ) from exc
        self.ray = ray
        self.n_processes = _validate.optional_positive_int("n_processes", n_processes)
        self.workers_per_actor = _validate.optional_positive_int(
            "workers_per_actor", workers_per_actor
        )
        self.compress_threshold = _validate.optional_nonnegative_int(
            "compress_threshold", compress_threshold
        )
        self.step_timeout = _validate.positive_seconds("step_timeout", step_timeout)
        self.start_timeout = _validate.positive_seconds("start_timeout", start_timeout)
        self.host_threads = _validate.optional_positive_int("host_threads", host_threads)
        self.max_concurrency = _validate.optional_positive_int("max_concurrency", max_concurrency)
        self.lanes: LaneOptions | None = None  # async envs: what each actor's server takes
        self._caps: list[int | None] = []
        self.address = _validate.optional_str("address", address)
        self.num_cpus = _validate.amount("num_cpus", num_cpus)
        self.num_gpus = _validate.amount("num_gpus", num_gpus)
        self.memory = _validate.optional_positive_int("memory", memory)
        self.resources = _validate.amounts("resources", resources)
        if placement_strategy is not None:
            _validate.choice("placement_strategy", placement_strategy, PLACEMENT_STRATEGIES)
        self.placement_strategy = placement_strategy
        if placement_strategy is not None and not self._bundle():
            raise ValueError(
                "placement_strategy needs actors that ask for some resource (num_cpus, num_gpus, "
                "memory or resources): a placement-group bundle cannot be empty"
            )
        self.init_kwargs = _validate.options_dict("init_kwargs", init_kwargs)
        if self.address is None and isinstance(self.init_kwargs.get("address"), str):
            self.address = self.init_kwargs["address"]
        self.init_kwargs.pop("address", None)
        self.codec = best_codec()
        self.started_ray = False  # whether this backend started (and so shuts down) Ray
        self._owner = False
        self._actor_class: Any = None
        self._placement_group: Any = None
        self._members: list[_Member] = []
        self._hosts: list[RayHost] = []
        self._started = False
        self._closed = False

    #: The options: the keyword arguments of ``__init__``.
    OPTIONS = tuple(inspect.signature(__init__).parameters)[1:-1]

    # -- resources ----------------------------------------------------------------------------

    def _bundle(self) -> dict[str, float]:
        asked = {"CPU": self.num_cpus, "GPU": self.num_gpus, "memory": self.memory or 0}
        return {k: v for k, v in [*asked.items(), *self.resources.items()] if v}

    def resource_text(self) -> str:
        """What each actor asks for (``"CPU=1, sim=1"``), for messages."""
        return ", ".join(f"{k}={v:g}" for k, v in self._bundle().items()) or "no resources"

    def new_actor(self, index: int, slots_blob: bytes) -> Any:
        """A new env-host actor for pool member ``index`` (its handle)."""
        options: dict[str, Any] = {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "max_restarts": 0,  # restarts are the sampler's, with its budget
            "max_task_retries": 0,
        }
        if self.memory:
            options["memory"] = self.memory
        if self.resources:
            options["resources"] = dict(self.resources)
        if self._placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._placement_group, placement_group_bundle_index=index
            )
        if self.lanes is not None:
            # A few calls at once: the env calls are the actor's own tasks (see LaneActor).
            options["max_concurrency"] = 8 + 2 * len(pickle.loads(slots_blob))
            lanes = dataclasses.replace(self.lanes, max_concurrency=self._caps[index])
            return self._actor_class.options(**options).remote(slots_blob, lanes, self.host_threads)
        return self._actor_class.options(**options).remote(
            slots_blob, self.compress_threshold, self.codec, self.host_threads
        )

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def actors(self) -> list[Any]:
        """Handles of the live env-host actors, in pool order."""
        return [
            m.current.handle for m in self._members if m.current is not None and not m.current.dead
        ]

    async def start(self, specs: Sequence[HostSpec]) -> list[EnvHost]:
        if self._closed:
            raise RuntimeError("the ray backend is closed")
        if self._started:
            raise RuntimeError("the ray backend was already started")
        self._started = True
        specs = list(specs)
        if not specs:
            return []
        where = placement(len(specs), self.n_processes, self.workers_per_actor)
        n = where.n_members
        try:
            await asyncio.to_thread(self._connect, math.ceil(n * self.num_cpus))
            ray = self.ray
            if specs[0].lanes:
                close = CLOSE_TIMEOUT if self.close_timeout is None else self.close_timeout
                self.lanes = LaneOptions(self.step_timeout, close, None)
                members = where.split(specs)
                self._caps = shares(self.max_concurrency, [len(m) for m in members])
                # LaneActor.beat answers from a thread of its own while an env blocks the loop.
                self._actor_class = ray.remote(concurrency_groups={WATCH_GROUP: 1})(LaneActor)
            elif self.step_timeout is not None and any(s.chunk_steps > 0 for s in specs):
                # Chunks judged per step: EnvActor.progress answers from a thread of its own.
                groups = {PROGRESS_GROUP: 1}
                self._actor_class = ray.remote(concurrency_groups=groups)(EnvActor)
            else:
                self._actor_class = ray.remote(EnvActor)
            if self.placement_strategy is not None:
                from ray.util.placement_group import placement_group

                self._placement_group = placement_group(
                    [self._bundle() for _ in range(n)], strategy=self.placement_strategy
                )
                try:
                    await asyncio.wait_for(self._placement_group.ready(), self.start_timeout)
                except TimeoutError:
                    raise RuntimeError(
                        f"the placement group ({n} bundles of {self.resource_text()}, "
                        f"{self.placement_strategy}) was not ready within start_timeout="
                        f"{self.start_timeout:g}s: the cluster lacks the resources"
                    ) from None
            self._members = [_Member(self, i, s) for i, s in enumerate(where.split(specs))]
            await wait_all([m.live() for m in self._members])
            self._hosts = [
                RayLaneHost(spec, self._members[where.member(w)])
                if self.lanes is not None
                else RayHost(spec, self._members[where.member(w)], self.step_timeout)
                for w, spec in enumerate(specs)
            ]
        except BaseException:
            await asyncio.shield(self.aclose())
            raise
        return list(self._hosts)

    def _connect(self, cpus_wanted: int) -> None:
        """Use the initialised Ray, connect to ``address``, or start a local instance."""
        ray = self.ray
        with _OWNER_LOCK:
            if ray.is_initialized():
                if _owned["users"] > 0:  # a local instance another RayBackend started
                    _owned["users"] += 1
                    self._owner = True
                return
            address = self.address or os.environ.get("RAY_ADDRESS") or None
            if address is not None and address != "local":
                ray.init(address=address, **self.init_kwargs)
                return
            # Logical CPUs are scheduling tokens: this instance exists for the sampler, so it
            # may oversubscribe the machine as the process backend does.
            cores = os.cpu_count() or 1
            kwargs: dict[str, Any] = {
                "num_cpus": max(2 * cores, cpus_wanted + cores),
                "include_dashboard": False,
            }
            kwargs.update(self.init_kwargs)
            ray.init(address="local", **kwargs)
            self.started_ray = True
            self._owner = True
            _owned["users"] = 1

    async def aclose(self) -> None:
        """Close the envs, kill the actors, drop the placement group, release Ray; idempotent."""
        if self._closed:
            return
        self._closed = True
        actors = self._closing_actors()
        # A Ray shut down under us took the actors with it; a Ray call now would start it again.
        live = self.ray.is_initialized()
        if live:  # let the envs close themselves (env.close()) first
            for actor in actors:  # a loop that stands still cannot close anything: killed now
                if not actor.dead and actor.loop_stalled():
                    actor.die("was killed: its event loop stood still when it was closed")
            live_actors = [a for a in actors if not a.dead]
            busy = any(a.calls for a in live_actors)
            grace = exit_grace(self.close_timeout, busy, EXIT_GRACE)
            await _settle(live_actors, "shutdown", grace)
        else:
            self._placement_group = None
        for actor in actors:
            actor.die("was shut down")
            actor.kill()
        if live:  # until Ray reports the killed actors dead
            await _settle(actors, "ready", _KILL_WAIT)
        self._release()
        if self._owner:
            self._owner = False
            await asyncio.to_thread(_release_ray, self.ray)

    def _release(self) -> None:
        pg, self._placement_group = self._placement_group, None
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        self._members = []
        self._hosts = []

    def close_now(self) -> None:
        """Synchronous last resort (an unclosed sampler being collected): kill the actors."""
        if self._closed:
            return
        self._closed = True
        actors = self._closing_actors()
        if not self.ray.is_initialized():
            self._placement_group = None
            return
        for actor in actors:
            actor.die("was shut down")
        self._release()

    def _closing_actors(self) -> list[_Actor]:
        """Mark every member closed (calls in flight raise SamplerClosedError); all actors."""
        actors: list[_Actor] = []
        for member in self._members:
            member.closed = True
            for actor in member.incarnations:
                actor.closing = True
                actors.append(actor)
        return actors


async def _settle(actors: list[_Actor], method: str, timeout: float) -> None:
    """Call ``method`` of every actor; wait up to ``timeout`` for the replies, cancel the rest."""
    futures = []
    for actor in actors:
        with contextlib.suppress(Exception):  # Ray may already be gone
            futures.append(asyncio.wrap_future(getattr(actor.handle, method).remote().future()))
    if not futures:
        return
    await asyncio.wait(futures, timeout=timeout)
    for fut in futures:
        if fut.done() and not fut.cancelled():
            fut.exception()
        else:
            fut.cancel()


def _release_ray(ray: Any) -> None:
    with _OWNER_LOCK:
        _owned["users"] = max(0, _owned["users"] - 1)
        if _owned["users"] == 0 and ray.is_initialized():
            ray.shutdown()
