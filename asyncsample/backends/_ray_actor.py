"""The actor side of the ``ray`` backend: :class:`EnvActor` and the wire format of its calls.

This module never imports ray, so the actor class can be pickled to the cluster by reference.
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
import struct
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncsample._tree import Tree, tree_leaves, tree_map
from asyncsample.backends import _threads
from asyncsample.backends._column_wire import pack_column, unpack_column
from asyncsample.backends._slot import HostSlot
from asyncsample.backends._transport import dump_failure
from asyncsample.backends._transport import dumps as _dumps
from asyncsample.env_group import EnvFailure, EnvFailureError, StepBuffers

__all__ = [
    "FAIL",
    "LARGE_REPLY",
    "OK",
    "PROGRESS_GROUP",
    "WATCH_GROUP",
    "EnvActor",
    "LaneActor",
    "best_codec",
    "copy_into",
    "encode_request",
]

#: Replies whose observations reach this many bytes travel as arrays through Ray's object
#: store (no copies); smaller ones as one pickled bytes object (fewer, cheaper serialisations).
LARGE_REPLY = 100 * 1024

#: The records of a chunk a ``run_chunk`` reply carries (the first ``steps`` rows of each).
CHUNK_RECORDS = ("obs", "actions", "rewards", "terminated", "truncated", "final_obs")

#: The Ray concurrency group of :meth:`EnvActor.progress` (one thread of its own) when chunks are
#: judged per step: it answers while the actor's other thread runs a chunk.
PROGRESS_GROUP = "progress"
#: The Ray concurrency group of :meth:`LaneActor.beat` (a thread and loop of its own): it answers
#: while an env blocks the actor's loop.
WATCH_GROUP = "watch"

# Compression must shrink a leaf this many times, else it is sent raw for this many replies.
_MIN_RATIO = 1.25
_SKIP_AFTER_MISS = 1000

# Reply statuses of the actor's methods.
OK = 0
FAIL = 1
# Requests of reset and step: worker index and how the actions are encoded, then the mask.
_HEAD = struct.Struct("<iB")
_NO_ACTIONS = 0
_RAW_ACTIONS = 1
_PICKLED_ACTIONS = 2


# -- payloads ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Packed:
    """A compressed array (one leaf of an observation payload)."""

    codec: str
    data: bytes
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def pack(cls, array: np.ndarray, codec: str) -> _Packed:
        """Compress ``array`` with ``codec`` (``"lz4"`` or ``"zlib"``)."""
        data = _codec(codec)[0](np.ascontiguousarray(array).data)
        return cls(codec, data, array.dtype.str, tuple(array.shape))

    def unpack(self) -> np.ndarray:
        """The original array (read-only)."""
        raw = _codec(self.codec)[1](self.data)
        return np.frombuffer(raw, dtype=np.dtype(self.dtype)).reshape(self.shape)


@dataclass(frozen=True, slots=True)
class _Column:
    """A leaf of ``object`` rows (Text, Sequence) as one column
    (:func:`asyncsample.backends._column_wire.pack_column`), not one pickled object per row."""

    column: tuple[Any, ...]
    shape: tuple[int, ...]

    @classmethod
    def of(cls, leaf: np.ndarray) -> _Column:
        return cls(pack_column(leaf.reshape(-1)), tuple(leaf.shape))

    def unpack(self) -> np.ndarray:
        """The leaf's rows again, an ``object`` array of its shape."""
        rows = unpack_column(self.column)
        out = np.empty(len(rows), dtype=object)
        for k, row in enumerate(rows):
            out[k] = row
        return out.reshape(self.shape)


def _columned(leaf: Any) -> Any:
    """An ``object`` leaf as a :class:`_Column`; any other as it is."""
    return _Column.of(leaf) if isinstance(leaf, np.ndarray) and leaf.dtype == object else leaf


def _codec(name: str) -> tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]:
    """``(compress, decompress)`` of codec ``name`` (zlib at level 1: fast)."""
    if name == "lz4":
        import lz4.frame

        return lz4.frame.compress, lz4.frame.decompress
    return functools.partial(zlib.compress, level=1), zlib.decompress


def best_codec() -> str:
    """``"lz4"`` when the lz4 package is installed (fast), else ``"zlib"`` (level 1)."""
    try:
        import lz4.frame  # noqa: F401
    except ImportError:
        return "zlib"
    return "lz4"


def copy_into(dst: Tree, src: Tree, index: Any = Ellipsis) -> None:
    """``dst[index] = src`` leaf by leaf, unpacking compressed leaves."""

    def copy(d: np.ndarray, s: Any) -> None:
        d[index] = s.unpack() if isinstance(s, (_Packed, _Column)) else s

    tree_map(copy, dst, src)


def encode_request(worker: int, mask: np.ndarray, actions: Tree | None = None) -> bytes:
    """One bytes object for a reset or step (the cheapest thing to send through Ray): ``worker``,
    the mask, then fixed-size array actions as raw bytes leaf by leaf, or pickled ones."""
    kind = _NO_ACTIONS
    parts = [b"", np.asarray(mask, dtype=np.bool_).tobytes()]
    if actions is not None:
        leaves = tree_leaves(actions)
        if all(isinstance(leaf, np.ndarray) and leaf.dtype != object for leaf in leaves):
            kind = _RAW_ACTIONS
            parts.extend(leaf.tobytes() for leaf in leaves)
        else:
            kind = _PICKLED_ACTIONS
            parts.append(_dumps(tree_map(_columned, actions)))
    parts[0] = _HEAD.pack(worker, kind)
    return b"".join(parts)


# -- the actor (runs in a Ray worker process) -------------------------------------------------


class EnvActor:
    """Hosts the envs of several workers, one :class:`~asyncsample.backends._slot.HostSlot` per
    worker slot (made a Ray actor class by :class:`RayBackend`).

    It decodes requests and encodes replies; what an operation does is the slot's. Every method
    replies ``(status, payload)``: an env failure is a ``FAIL`` with a pickled :class:`EnvFailure`.
    :meth:`progress` alone may run in :data:`PROGRESS_GROUP`, a thread of its own.

    Args:
        slots_blob: the cloudpickled :class:`HostSpec` of each hosted worker.
        compress_threshold: compress observation leaves of at least this many bytes (``None``:
            never).
        codec: ``"lz4"`` or ``"zlib"``; zlib is used when lz4 is not installed here.
        host_threads: threads of the numeric libraries in this actor (``None``: their defaults).
    """

    def __init__(
        self,
        slots_blob: bytes,
        compress_threshold: int | None,
        codec: str,
        host_threads: int | None = None,
    ) -> None:
        _threads.limit(host_threads)
        self.slots: dict[int, HostSlot] = {}
        self.large: dict[int, bool] = {}
        for spec in pickle.loads(slots_blob):
            slot = HostSlot.allocate(spec, host_threads, "env-host actor")
            self.slots[spec.worker] = slot
            obs_bytes = sum(leaf.nbytes for leaf in tree_leaves(slot.group.buffers.obs))
            self.large[spec.worker] = obs_bytes >= LARGE_REPLY
        self.threshold = compress_threshold
        self.skip: dict[tuple[int, str, int], int] = {}
        # Per worker whose chunk is running: its step counter's value when the chunk started.
        self.chunk_start: dict[int, int] = {}
        self.codec = codec if codec != "lz4" or best_codec() == "lz4" else "zlib"

    def _pack(self, worker: int, what: str, tree: Tree) -> Tree:
        """Compress the leaves of ``tree`` of at least ``compress_threshold`` bytes that shrink."""
        threshold = self.threshold
        if tree is None:
            return tree
        if any(leaf.dtype == object for leaf in tree_leaves(tree)):
            tree = tree_map(_columned, tree)  # Text/Sequence rows: one column per leaf
        if threshold is None:
            return tree
        skip = self.skip
        index = itertools.count()

        def pack(leaf: Any) -> Any:
            key = (worker, what, next(index))
            if isinstance(leaf, _Column) or leaf.nbytes < threshold:
                return leaf
            left = skip.get(key, 0)
            if left:
                skip[key] = left - 1
                return leaf
            packed = _Packed.pack(leaf, self.codec)
            if len(packed.data) * _MIN_RATIO > leaf.nbytes:
                skip[key] = _SKIP_AFTER_MISS
                return leaf
            return packed

        return tree_map(pack, tree)

    def ready(self) -> tuple[int, str]:
        """The actor's pid and node address, once it is up."""
        import ray

        ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return os.getpid(), ip

    def _run(self, fn: Callable[..., Any], *args: Any, worker: int | None = None) -> Any:
        """``(status, payload)`` of ``fn(*args)``; as arrays if large observations are in it."""
        try:
            payload = fn(*args)
        except EnvFailureError as exc:
            return _dumps((FAIL, dump_failure(exc.failure)))
        except Exception as exc:  # a bug of the host itself: report it like an env failure
            text = "".join(traceback.format_exception(exc))
            return _dumps((FAIL, dump_failure(EnvFailure(None, exc, text))))
        large = False
        if worker is not None:
            if self.threshold is None:
                large = self.large[worker]
            else:  # what compression left as arrays: all of it, for frames that do not shrink
                obs = (payload[0], payload[5]) if len(payload) > 2 else payload[0]
                raw = sum(x.nbytes for x in tree_leaves(obs) if isinstance(x, np.ndarray))
                large = raw >= LARGE_REPLY
        return (OK, payload) if large else _dumps((OK, payload))

    def serve(self, worker: int, op: int, body: bytes) -> Any:
        """Operation ``op`` of the worker's slot on the request ``body`` (its reply bytes)."""
        return self._run(self.slots[worker].serve, op, body)

    def _decode(self, request: bytes) -> tuple[int, HostSlot, np.ndarray]:
        """Split a request; actions, if any, are written into the slot's buffers."""
        worker, kind = _HEAD.unpack_from(request)
        slot = self.slots[worker]
        n_envs = slot.group.n_envs
        offset = _HEAD.size + n_envs
        mask = np.frombuffer(request, np.bool_, n_envs, _HEAD.size)
        if kind == _RAW_ACTIONS:
            for leaf in tree_leaves(slot.group.buffers.actions):
                raw = np.frombuffer(request, leaf.dtype, leaf.size, offset)
                leaf[...] = raw.reshape(leaf.shape)
                offset += leaf.nbytes
        elif kind == _PICKLED_ACTIONS:
            copy_into(slot.group.buffers.actions, pickle.loads(request[offset:]))
        return worker, slot, mask

    def reset(self, request: bytes, args: bytes | None = None) -> Any:
        """Reset the masked envs of a worker; payload ``(obs, reset_infos)``. ``args``: ``None``
        (pending seeds, no options), or pickled ``(seeds, options)``."""
        worker, slot, mask = self._decode(request)

        def reset() -> tuple[Tree, dict[int, dict[str, Any]]]:
            seeds, options = (None, None) if args is None else slot.load(args, "reset options")
            infos = slot.reset(mask, seeds, options)
            return self._pack(worker, "obs", slot.group.buffers.obs), infos

        return self._run(reset, worker=worker)

    def step(self, request: bytes) -> Any:
        """Step the masked envs of a worker; payload ``(obs, rewards, terminated, truncated, done,
        final_obs, infos)``, ``final_obs`` only the rows of ``done``."""
        worker, slot, mask = self._decode(request)
        buf = slot.group.buffers

        def step() -> tuple[Any, ...]:
            infos = slot.step(mask)
            done = np.flatnonzero((buf.terminated | buf.truncated) & mask)
            final = tree_map(lambda x: x[done], buf.final_obs) if len(done) else None
            return (
                self._pack(worker, "obs", buf.obs),
                buf.rewards,
                buf.terminated,
                buf.truncated,
                done,
                self._pack(worker, "final", final),
                infos,
                *_clock_of(buf),
            )

        return self._run(step, worker=worker)

    def run_chunk(self, worker: int, request: bytes) -> Any:
        """Run a pickled :class:`ChunkRequest`; payload: the reply, its records, the current obs."""
        slot = self.slots[worker]

        def run() -> tuple[Any, ...]:
            runner = slot.runner
            if runner is not None:  # (slot.run_chunk raises the error otherwise)
                self.chunk_start[worker] = int(runner.chunk.progress[0])
            try:
                reply = slot.run_chunk(slot.load(request, "chunk request"))
            finally:
                self.chunk_start.pop(worker, None)
            chunk = slot.runner.chunk  # type: ignore[union-attr]  # run_chunk checked it
            k = reply.steps
            head = {n: tree_map(lambda x: x[:k], getattr(chunk, n)) for n in CHUNK_RECORDS}
            for name in ("obs", "final_obs"):
                head[name] = self._pack(worker, f"chunk_{name}", head[name])
            current = self._pack(worker, "obs", slot.group.buffers.obs)
            return (reply, head, current, *_clock_of(slot.group.buffers))

        return self._run(run)

    def progress(self, worker: int) -> int:
        """How many steps the worker's running chunk has taken (0 when none is running); called
        from :data:`PROGRESS_GROUP`'s thread while :meth:`run_chunk` runs."""
        start = self.chunk_start.get(worker)
        runner = self.slots[worker].runner
        if start is None or runner is None:
            return 0
        return int(runner.chunk.progress[0]) - start

    def shutdown(self) -> None:
        """Close every env of this actor (before it is killed)."""
        for slot in self.slots.values():
            slot.close()


class LaneActor:
    """Hosts the async envs of several workers in the actor's event loop, a
    :class:`~asyncsample.backends._lane_serve.LaneServer` (made a Ray actor class by
    :class:`RayBackend`, with a concurrency of a few calls: the env calls are tasks of the
    server's own, never Ray calls, so Ray's limit on an actor's calls cannot cap them).

    Lane requests come in batches (:meth:`submit`, nothing awaited), numbered by the caller;
    the caller keeps one :meth:`replies` call waiting, which returns the batches of replies ready
    since the last one.

    Ray runs an async actor's calls in no guaranteed order, and it does reorder ``submit`` calls
    in practice; the server must see the batches in the order they were sent (a cancel before
    the request it cancels would leave that request running: a step after the reset that
    followed it). So a batch that comes early waits in :attr:`early` for those before it.
    """

    def __init__(self, slots_blob: bytes, options: Any, host_threads: int | None = None) -> None:
        _threads.limit(host_threads)
        self.specs = pickle.loads(slots_blob)
        self.options = options
        self.server: Any = None
        self.ready_replies: list[bytes] = []
        self.waiting: Any = None  # the event a waiting replies() call waits on
        self.timed: list[tuple[int, Any]] = []  # metrics on: (worker, its LaneHost) per slot
        self.next_batch = 0  # the number of the next batch of lane requests to start
        self.early: dict[int, bytes] = {}  # batches that came before one sent earlier
        # The loop's counter, bumped by a timer, and where the watchdog found it standing still
        # (read by beat(), from a thread of its own; see asyncsample.backends._watchdog).
        self.turns = np.zeros(1, dtype=np.int64)
        self.report: Any = None

    def _server(self) -> Any:
        if self.server is None:  # on the actor's loop, at its first call
            import asyncio

            from asyncsample.backends._lane_serve import LaneServer, quiet_collector, watch_loop

            quiet_collector()  # the actor's process is ours: as in a process host
            self.waiting = asyncio.Event()
            self.server = LaneServer(
                self.specs, [None] * len(self.specs), self.options, self._replied, True
            )
            self.timed = [
                (spec.worker, slot)
                for spec, slot in zip(self.specs, self.server.slots)
                if slot.buffers.clock is not None
            ]
            watch_loop(self.server, self.options.step_timeout, self.turns, self._blocked)
        return self.server

    def _blocked(self, report: Any) -> None:
        self.report = report  # from the watchdog thread (None: the stall ended); see beat()

    async def beat(self) -> tuple[int, Any, list[tuple[int, int]]]:
        """In :data:`WATCH_GROUP`: the loop's counter, the watchdog's report (or ``None``) and,
        with metrics on, each timed slot's env calls running ``(worker, calls)``."""
        from asyncsample._clock import CALLS

        calls = [(worker, int(slot.buffers.clock[CALLS])) for worker, slot in self.timed]
        return int(self.turns[0]), self.report, calls

    def _replied(self, body: bytes) -> None:
        self.ready_replies.append(body)
        self.waiting.set()

    async def ready(self) -> tuple[int, str]:
        """The actor's pid and node address, once it is up."""
        import ray

        self._server()
        ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return os.getpid(), ip

    async def submit(self, number: int, payload: bytes) -> None:
        """Start batch ``number`` of lane requests (0, 1, ... in the order the caller sent
        them), after every batch sent before it."""
        server = self._server()
        early = self.early
        early[number] = payload  # waits here if Ray ran this call before an earlier one
        while self.next_batch in early:
            payload = early.pop(self.next_batch)
            self.next_batch += 1
            server.handle(payload)

    async def replies(self) -> tuple[list[bytes], list[tuple[int, np.ndarray]] | None]:
        """The batches of lane replies ready (waits for one), and with metrics on each timed
        slot's clock, ``(worker, clock)`` (its sampled step timings travel with the replies:
        the caller's copy of the clock is not shared memory as on ``process``)."""
        self._server()
        while not self.ready_replies:
            self.waiting.clear()
            await self.waiting.wait()
        out, self.ready_replies = self.ready_replies, []
        if not self.timed:
            return out, None
        clocks = []
        for worker, slot in self.timed:
            slot.settle_clock()
            clocks.append((worker, slot.buffers.clock.copy()))
        return out, clocks

    async def serve(self, worker: int, op: int, body: bytes) -> bytes:
        """A whole-worker request (build, update, call, set_attr, close); its reply's bytes."""
        server = self._server()
        status, payload = await server.call(server.by_worker[worker], op, body)
        return _dumps((status, payload))

    async def shutdown(self) -> None:
        """Close every env of this actor (before it is killed)."""
        await self._server().shut()


def _clock_of(buffers: StepBuffers) -> tuple[Any, ...]:
    """With metrics on, the host's clock travels at the end of its step and chunk replies."""
    return () if buffers.clock is None else (buffers.clock,)
