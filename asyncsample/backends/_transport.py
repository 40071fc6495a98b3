"""What crosses the boundary between the main process and an env-host process.

* **Shared memory** for the step data: the :class:`~asyncsample.env_group.StepBuffers` of every
  worker are lock-free ``RawArray`` blocks (unlinked at once: nothing is left behind by any
  exit), made in the parent and handed to the host when it starts.
* **A framed byte stream** over a ``socket.socketpair`` for control: a :data:`HEADER` (payload
  length, request id, opcode or status) and a payload. A step request is the slot and one byte
  per env of the active mask; a quiet step's reply is the header alone. Infos and errors are
  pickled only when there are any.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import io
import pickle
import socket
import struct
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import sharedctypes
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import create_shared_memory, read_from_shared_memory

from asyncsample._clock import CLOCK_SIZE
from asyncsample._info_cells import INFO_SPACE, InfoCells, info_rows
from asyncsample._memory import carve
from asyncsample._tree import Tree, tree_map
from asyncsample.env_group import EnvFailure, StepBuffers, fixed_rows
from asyncsample.errors import WorkerError

__all__ = [
    "HEADER",
    "KEEP_CHUNK_OBS",
    "SLOT",
    "Op",
    "FrameReader",
    "RawArrayContext",
    "ReplyProtocol",
    "SharedArray",
    "Unzeroed",
    "dump_failure",
    "dumps",
    "dumps_infos",
    "failure_from_exception",
    "load_failure",
    "portable_error",
    "round_trips",
    "send_frame",
    "joint_buffers",
    "own_slot_buffers",
    "shared_buffers",
    "shared_tree",
    "slot_buffers",
    "view_buffers",
    "view_tree",
    "worker_failure",
]

#: ``<payload length> <request id> <opcode (request) | status (reply)>``, little-endian.
HEADER = struct.Struct("<IIB")
#: The worker slot a request is for (the index of the worker's envs within its host process).
SLOT = struct.Struct("<H")


class Op(enum.IntEnum):
    """What a request asks of an env host (the opcode of a request frame; Ray's call too)."""

    STEP = 1  # payload: slot + mask bytes
    RESET = 2  # payload: slot + mask bytes
    BUILD = 3  # payload: slot + cloudpickle((chains, seeds))
    UPDATE = 4  # payload: slot + cloudpickle((updates, seeds))
    CLOSE = 5  # payload: slot
    EXIT = 6  # no payload, no reply: close every env and exit
    CALL = 7  # payload: slot + cloudpickle((name, args, kwargs, envs)); reply: pickled results
    SET_ATTR = 8  # payload: slot + cloudpickle((name, values, envs))
    RESET_ARGS = 9  # payload: slot + mask bytes + cloudpickle((seeds, options))
    # inference="host" (see asyncsample.backends._chunk):
    AGENT = 10  # payload: slot + version + cloudpickle((agent, seed)): install the agent copy
    PARAMS = 11  # payload: slot + version + pickle(params): agent.set_param_values(params)
    CHUNK = 12  # payload: slot + pickle(ChunkRequest); reply: pickle(ChunkReply)

    @property
    def label(self) -> str:
        """What the request is called in messages (``"step"``, ``"agent install"``...)."""
        return _LABELS[self]


#: The requests that leave an env host's current observations where a chunk put them (in its
#: observation arena): the main process's view of them stays there too (see
#: :meth:`~asyncsample.backends._chunk_loop.ChunkRunner.settle`).
KEEP_CHUNK_OBS = frozenset({Op.CHUNK, Op.AGENT, Op.PARAMS})

_LABELS = {
    **{op: op.name.lower() for op in Op},
    Op.AGENT: "agent install",
    Op.PARAMS: "parameter update",
}


#: The agent version an :data:`Op.AGENT` or :data:`Op.PARAMS` body starts with: the host
#: stamps what its copy does with it (a request asked before an update may run after it).
VERSION = struct.Struct("<q")


def with_version(version: int, blob: bytes) -> bytes:
    """An agent install's or parameter update's body: ``blob`` after its agent ``version``."""
    return VERSION.pack(version) + blob


def split_version(body: bytes | memoryview) -> tuple[int, bytes]:
    """``(version, blob)`` of a body made by :func:`with_version`."""
    return VERSION.unpack_from(body)[0], bytes(body[VERSION.size :])


# Reply statuses.
ST_OK = 0  # payload: empty, or a pickle of the result
ST_FAIL = 1  # payload: a pickled EnvFailure

#: Request id of the frame a host sends once it is ready to serve.
HELLO_ID = 0


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` fast (plain pickle), falling back to cloudpickle for lambdas and the like."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # any pickling failure: try harder
        blob: bytes = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return blob


#: The numpy scalar types that come back exactly from their Python value (``type(x)(x.item())``).
_PLAIN_SCALARS = frozenset(np.dtype(code).type for code in "?bhilqBHILQefd")


class _InfoPickler(pickle.Pickler):
    """Pickles a numpy scalar as its type called on its Python value: the default reduce of
    ``np.float64`` is three times slower to pickle (two infos of HalfCheetah-v5's four numpy
    floats: 17.8 us, 6.5 us so; unpickled in 3.9 and 2.5 us), and the same objects come back."""

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _PLAIN_SCALARS:
            return kind, (obj.item(),)
        return NotImplemented


def dumps_infos(obj: Any) -> bytes:
    """:func:`dumps` for replies that carry env infos, a step's or a chunk's steps' (their
    numpy scalars, see :class:`_InfoPickler`)."""
    buf = io.BytesIO()
    try:
        _InfoPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception:  # any pickling failure: the general way
        return dumps(obj)
    return buf.getvalue()


def round_trips(error: BaseException) -> bool:
    """Whether ``error`` survives a pickle round trip (so it can be rebuilt in the caller)."""
    try:
        blob = cloudpickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
        return isinstance(pickle.loads(blob), BaseException)
    except Exception:  # whatever went wrong, the exception cannot travel
        return False


def dump_failure(failure: EnvFailure) -> bytes:
    """Pickle an :class:`EnvFailure`; an exception that does not survive pickling is replaced."""
    error = failure.error
    if not round_trips(error):
        error = RuntimeError(f"{error!r} (the original exception could not be pickled)")
    portable = EnvFailure(failure.env, error, failure.traceback, failure.retry)
    blob: bytes = cloudpickle.dumps(portable, protocol=pickle.HIGHEST_PROTOCOL)
    return blob


def failure_from_exception(exc: BaseException, env: int | None = None, retry: bool = True) -> bytes:
    """A pickled :class:`EnvFailure` for an exception raised outside an env (by the host itself)."""
    text = "".join(traceback.format_exception(exc))
    return dump_failure(EnvFailure(env, exc, text, retry))


def portable_error(exc: BaseException) -> WorkerError:
    """A :class:`~asyncsample.WorkerError` that crosses to the caller for one that cannot."""
    err = WorkerError(
        f"{type(exc).__name__}: {exc} (the original exception could not be pickled)",
        worker=getattr(exc, "worker", -1),
        env=getattr(exc, "env", None),
        remote_traceback="".join(traceback.format_exception(exc)),
        retry=getattr(exc, "retry", True),
    )
    return err


def worker_failure(exc: Exception) -> EnvFailure:
    """The :class:`EnvFailure` of a whole-worker request's exception (the worker's reply)."""
    if isinstance(exc, WorkerError):
        cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        text = exc.remote_traceback or "".join(traceback.format_exception(exc))
        return EnvFailure(exc.env, cause, text, exc.retry)
    return EnvFailure(None, exc, "".join(traceback.format_exception(exc)), retry=False)


def load_failure(payload: bytes) -> EnvFailure:
    """Unpickle what :func:`dump_failure` made; never raises."""
    try:
        failure = pickle.loads(payload)
        if isinstance(failure, EnvFailure):
            return failure
        error: BaseException = RuntimeError(f"env host sent a malformed failure: {failure!r}")
    except Exception as exc:  # report what we can rather than lose the failure
        error = RuntimeError(f"the env host's error report could not be unpickled: {exc!r}")
    return EnvFailure(None, error, "")


class FrameReader:
    """Reads frames from a blocking socket (the env host's side)."""

    def __init__(self, sock: socket.socket) -> None:
        self._file = sock.makefile("rb", buffering=1 << 16)

    def read(self) -> tuple[int, int, bytes] | None:
        """The next ``(request id, opcode, payload)``, or ``None`` at end of stream."""
        header = self._file.read(HEADER.size)
        if len(header) < HEADER.size:
            return None
        length, rid, op = HEADER.unpack(header)
        payload = self._file.read(length) if length else b""
        if len(payload) < length:
            return None
        return rid, op, payload

    def close(self) -> None:
        self._file.close()


def send_frame(sock: socket.socket, rid: int, code: int, payload: bytes = b"") -> None:
    """Send one frame on a blocking socket."""
    sock.sendall(HEADER.pack(len(payload), rid, code) + payload)


class ReplyProtocol(asyncio.Protocol):
    """Splits an env host's reply stream into frames for the owner's ``on_frame``, straight
    from the loop's read callback (no reader task, no future per frame); bytes are kept until
    an owner is attached. :meth:`feed` also takes bytes a caller read itself."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._on_frame: Callable[[int, int, bytes], None] | None = None
        self._on_eof: Callable[[], None] | None = None
        self.ended = False

    def attach(
        self, on_frame: Callable[[int, int, bytes], None], on_eof: Callable[[], None]
    ) -> None:
        """Start handing frames (and the end of the stream) to the owner."""
        self._on_frame = on_frame
        self._on_eof = on_eof
        self._parse()
        if self.ended:
            on_eof()

    def data_received(self, data: bytes) -> None:
        self.feed(data)

    def feed(self, data: bytes) -> None:
        """Take bytes read from the host's socket."""
        buf = self._buf
        on_frame = self._on_frame
        if not buf and on_frame is not None and len(data) >= _HSIZE:
            # The common case: exactly one whole frame, taken without a copy into the buffer.
            length, rid, status = _unpack_header(data)
            if len(data) == _HSIZE + length:
                on_frame(rid, status, data[_HSIZE:] if length else b"")
                return
        buf += data
        self._parse()

    def _parse(self) -> None:
        on_frame = self._on_frame
        if on_frame is None:
            return
        buf = self._buf
        pos = 0
        end_of_data = len(buf)
        while end_of_data - pos >= _HSIZE:
            length, rid, status = _unpack_header(buf, pos)
            end = pos + _HSIZE + length
            if end > end_of_data:
                break
            payload = bytes(buf[pos + _HSIZE : end]) if length else b""
            pos = end
            on_frame(rid, status, payload)
        if pos:
            del buf[:pos]

    @property
    def buffered(self) -> bool:
        """Whether part of a frame is waiting for the rest."""
        return bool(self._buf)

    def eof_received(self) -> bool:
        self._ended()
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended()

    def _ended(self) -> None:
        if not self.ended:
            self.ended = True
            if self._on_eof is not None:
                self._on_eof()


_HSIZE = HEADER.size
_unpack_header = HEADER.unpack_from


class SharedArray:
    """A ``RawArray`` with the ``get_obj()`` gymnasium's shared-memory readers expect (pickled
    while a process starts, it travels as a file descriptor of its heap arena)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def get_obj(self) -> Any:
        return self.obj


class RawArrayContext:
    """The ``ctx`` for gymnasium's ``create_shared_memory``: lock-free ``RawArray`` blocks (a
    lock is a named semaphore, and the protocol already orders every access)."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx

    def Array(self, typecode_or_type: Any, size: int) -> SharedArray:
        return SharedArray(self._ctx.RawArray(typecode_or_type, size))


class Unzeroed:
    """A ``ctx`` for ``create_shared_memory``: ``RawArray`` blocks not zeroed, so their pages
    take memory only once written (for rows nobody reads before they are written)."""

    def Array(self, typecode_or_type: Any, size: int) -> SharedArray:
        types = sharedctypes.typecode_to_type  # type: ignore[attr-defined]
        type_ = types.get(typecode_or_type, typecode_or_type)
        return SharedArray(sharedctypes._new_value(type_ * size))  # type: ignore[attr-defined]


def shared_tree(
    space: gym.Space[Any], n: int, ctx: Any, raw: list[Any], rows: int | None = None
) -> Tree:
    """:func:`~asyncsample._memory.carve`'s buffers of ``space`` in shared memory from ``ctx``
    (``n`` rows, or ``(rows, n)``), each block appended to ``raw`` for the host's view."""

    def leaf(leaf_space: gym.Space[Any], count: int) -> Tree:
        memory = create_shared_memory(leaf_space, count, ctx=ctx)
        raw.append(memory)
        return read_from_shared_memory(leaf_space, memory, count)

    return carve(space, n, leaf, rows)


def view_tree(
    space: gym.Space[Any], n: int, blocks: Iterator[Any], rows: int | None = None
) -> Tree:
    """The view of the buffers :func:`shared_tree` made, from its next ``blocks``."""
    return carve(
        space, n, lambda leaf, count: read_from_shared_memory(leaf, next(blocks), count), rows
    )


def shared_buffers(
    observation_space: gym.Space[Any],
    action_space: gym.Space[Any],
    n_envs: int,
    ctx: Any,
    timed: bool = False,
    columns: bool = False,
    lazy_obs: bool = False,
    info_cells: bool = False,
) -> tuple[StepBuffers, list[Tree]]:
    """Step buffers in shared memory, and the raw blocks to hand to the host process;
    ``lazy_obs``: the observation and final observation blocks are :class:`Unzeroed` (rows
    nobody reads before they are written: pages take memory once written); ``info_cells``: a
    slot's (:attr:`StepBuffers.infos`)."""
    raw: list[Tree] = []
    shm_ctx = RawArrayContext(ctx)
    lazy = Unzeroed()

    def make(space: gym.Space[Any], n: int) -> Tree:
        return shared_tree(
            space, n, lazy if lazy_obs and space is observation_space else shm_ctx, raw
        )

    buffers = StepBuffers.allocate(
        observation_space, action_space, n_envs, make, timed, columns, info_cells
    )
    return buffers, raw


def view_buffers(
    observation_space: gym.Space[Any],
    action_space: gym.Space[Any],
    n_envs: int,
    raw: list[Tree],
    timed: bool = False,
    columns: bool = False,
    info_cells: bool = False,
) -> StepBuffers:
    """The host's view of the buffers :func:`shared_buffers` made (same allocation order)."""
    blocks = iter(raw)

    def make(space: gym.Space[Any], n: int) -> Tree:
        return view_tree(space, n, blocks)

    return StepBuffers.allocate(
        observation_space, action_space, n_envs, make, timed, columns, info_cells
    )


#: A slot's part of step buffers shared by several slots: ``(blocks, total envs, first env,
#: the slot's own clock block or None, its own info cells' block)``.
JointRaw = tuple[list[Tree], int, int, Any, Any]

#: The space of a clock's cells (:attr:`StepBuffers.clock`).
_CLOCK_SPACE = gym.spaces.Box(-np.inf, np.inf, (), np.float64)


def joint_buffers(
    specs: Sequence[Any], ctx: Any
) -> tuple[StepBuffers, list[StepBuffers], list[JointRaw]] | None:
    """Step buffers of the slots of ``specs`` in one allocation, each slot's a run of rows (a
    vector env's ``copy=False`` returns the observations as one array); a timed slot's clock
    is its own block, as are its info cells. The whole, each slot's rows, and what each slot's
    host needs; ``None`` when the spaces differ or have no fixed-size rows."""
    observation_space, action_space = specs[0].observation_space, specs[0].action_space
    if not (fixed_rows(observation_space) and fixed_rows(action_space)) or any(
        s.observation_space != observation_space or s.action_space != action_space for s in specs
    ):
        return None
    counts = [s.n_envs for s in specs]
    total = sum(counts)
    whole, raw = shared_buffers(observation_space, action_space, total, ctx)
    shm_ctx = RawArrayContext(ctx)
    parts, raws, first = [], [], 0
    for spec, n in zip(specs, counts):
        part, clock_block = buffer_rows(whole, first, first + n), None
        if spec.timed:
            clock_block = create_shared_memory(_CLOCK_SPACE, CLOCK_SIZE, ctx=shm_ctx)  # type: ignore[arg-type]
            part = dataclasses.replace(part, clock=_clock_view(clock_block))
        info_block = create_shared_memory(INFO_SPACE, info_rows(n), ctx=shm_ctx)  # type: ignore[arg-type]
        part = dataclasses.replace(part, infos=_info_view(info_block, n))
        parts.append(part)
        raws.append((raw, total, first, clock_block, info_block))
        first += n
    return whole, parts, raws


def _clock_view(block: Any) -> np.ndarray:
    """A clock's array in its shared block."""
    return np.asarray(read_from_shared_memory(_CLOCK_SPACE, block, CLOCK_SIZE))


def _info_view(block: Any, n_envs: int) -> InfoCells:
    """A slot's info cells in their shared block."""
    cells = read_from_shared_memory(INFO_SPACE, block, info_rows(n_envs))
    return InfoCells(np.asarray(cells), n_envs)


def buffer_rows(buffers: StepBuffers, a: int, b: int) -> StepBuffers:
    """Rows ``a:b`` of every field of ``buffers`` (views)."""
    return StepBuffers(
        obs=tree_map(lambda x: x[a:b], buffers.obs),
        final_obs=tree_map(lambda x: x[a:b], buffers.final_obs),
        actions=tree_map(lambda x: x[a:b], buffers.actions),
        rewards=buffers.rewards[a:b],
        terminated=buffers.terminated[a:b],
        truncated=buffers.truncated[a:b],
    )


def own_slot_buffers(spec: Any, ctx: Any) -> tuple[StepBuffers, list[Tree]]:
    """A slot's step buffers in blocks of its own (:func:`shared_buffers`, with info cells) and
    the raw blocks its host views with :func:`slot_buffers`."""
    spaces = (spec.observation_space, spec.action_space)
    return shared_buffers(*spaces, spec.n_envs, ctx, spec.timed, spec.columns, info_cells=True)


def slot_buffers(
    observation_space: gym.Space[Any],
    action_space: gym.Space[Any],
    n_envs: int,
    raw: list[Tree] | JointRaw,
    timed: bool = False,
    columns: bool = False,
) -> StepBuffers:
    """The host's view of a slot's step buffers: its own blocks (:func:`shared_buffers`) or its
    rows of joint ones (:func:`joint_buffers`)."""
    if isinstance(raw, tuple):
        blocks, total, first, clock_block, info_block = raw
        whole = view_buffers(observation_space, action_space, total, blocks)
        rows = buffer_rows(whole, first, first + n_envs)
        clock = None if clock_block is None else _clock_view(clock_block)
        return dataclasses.replace(rows, clock=clock, infos=_info_view(info_block, n_envs))
    return view_buffers(observation_space, action_space, n_envs, raw, timed, columns, True)
