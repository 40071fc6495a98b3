"""One worker slot inside an env host: what every remote host does with a request, once.

A process host or a Ray actor holds one :class:`HostSlot` per worker (its ``EnvGroup`` and, with
``inference="host"``, its ``ChunkRunner``); :meth:`HostSlot.serve` runs a request from its bytes
to the reply's, so the hosts only move bytes.
"""

from __future__ import annotations

import pickle
import shutil
import traceback
from collections.abc import Callable
from multiprocessing import heap
from typing import Any

import numpy as np

from asyncsample._clock import HostTiming
from asyncsample._info_cells import COLUMNS
from asyncsample.backends import _threads
from asyncsample.backends._chunk import (
    ARENA_BYTES,
    ChunkBuffers,
    ChunkReply,
    ChunkRequest,
    NextChunk,
    arena_rows,
    chunk_rows,
    chunk_sets,
)
from asyncsample.backends._chunk_loop import ChunkRunner
from asyncsample.backends._column_wire import (
    object_rows,
    pack_chunk,
    pack_columns,
    unpack_columns_into,
)
from asyncsample.backends._transport import KEEP_CHUNK_OBS, Op, dumps, dumps_infos, split_version
from asyncsample.backends.base import HostSpec
from asyncsample.env_group import (
    EnvFailure,
    EnvFailureError,
    EnvGroup,
    StepBuffers,
    StepInfos,
)

__all__ = ["HostSlot", "RawArena", "StepArena", "arena_budget", "spec_group", "step_arenas"]

_Body = bytes | memoryview


def spec_group(spec: HostSpec, buffers: StepBuffers | None = None) -> EnvGroup:
    """The :class:`EnvGroup` of ``spec`` over ``buffers`` (default: buffers of its own)."""
    if buffers is None:
        obs_space, act_space = spec.observation_space, spec.action_space
        buffers = StepBuffers.allocate(
            obs_space, act_space, spec.n_envs, timed=spec.timed, columns=spec.columns
        )
    return EnvGroup(
        spec.worker,
        buffers,
        spec.observation_space,
        spec.action_space,
        spec.max_episode_length,
        spec.autoreset,
        spec.final_in_reply,
        spec.counted,
    )


RawArena = tuple[int, Any, int, int]
"""What a process host needs to view a slot's :class:`StepArena`: ``(rows, memory, slots,
index)``, the slot being ``index`` of the ``slots`` that share the block ``memory``."""


class StepArena:
    """A worker's observation records in shared memory that its host's steps write into
    (``per_worker`` and ``batched`` on ``process``): ``rows`` ``(R, n_envs, ...)``, and
    ``target``, the row the next step request writes its observations to (``-1``: the slot's
    step buffer), which the main process sets and the host takes with the request.

    Either side points its view of the slot's step ``buffers.obs`` at the row the host's
    current observations are in (:attr:`row`, ``-1``: its own step buffer). The host goes back
    to its own buffer (a copy in the host) before any request but a step, and before a step
    into its own buffer; the main process after asking for anything but a step (:meth:`home`).
    The worker records row ``t`` without a copy when the last step wrote it there.
    """

    def __init__(self, rows: np.ndarray, target: np.ndarray, raw: RawArena | None = None) -> None:
        self.rows = rows
        self.target = target
        self.raw = raw  # what a process host views it from (keeps the shared block alive)
        self.row = -1
        self.buffers: StepBuffers | None = None
        self.own: Any = None

    def attach(self, buffers: StepBuffers) -> StepArena:
        """The slot's step buffers, whose ``obs`` this arena points (its own array: home)."""
        self.buffers, self.own = buffers, buffers.obs
        return self

    def aim(self, row: int) -> None:
        """The main process: the next step writes its observations into ``row`` (-1: home)."""
        self.target[0] = row
        self.row = row
        assert self.buffers is not None
        self.buffers.obs = self.own if row < 0 else self.rows[row]

    def home(self) -> None:
        """The main process: the host's observations are back in its step buffer (a request
        other than a step was sent)."""
        if self.row >= 0:
            self.row = -1
            assert self.buffers is not None
            self.buffers.obs = self.own

    def take(self, mask: np.ndarray) -> None:
        """The host, serving a step: point the group's observations at the row asked for; the
        envs not stepped keep theirs (copied there)."""
        row = int(self.target[0])
        self.target[0] = -1  # asked once: a step sent without aiming goes home
        if row == self.row:
            return
        buffers = self.buffers
        assert buffers is not None
        new = self.own if row < 0 else self.rows[row]
        if row < 0 or not mask.all():
            new[...] = buffers.obs
        buffers.obs = new
        self.row = row

    def settle(self) -> None:
        """The host, before any request but a step: its observations back in its own buffer."""
        if self.row >= 0:
            buffers = self.buffers
            assert buffers is not None
            self.own[...] = buffers.obs
            buffers.obs = self.own
            self.row = -1


def arena_budget(arenas: int) -> int:
    """Bytes each of ``arenas`` step arenas may take: half of what /dev/shm has free, shared
    (an arena takes memory only as rows are written: it must not promise more than there is)."""
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:  # no /dev/shm: the heap's memory comes from a temporary file
        free = ARENA_BYTES * 2 * arenas
    return free // (2 * max(arenas, 1))


def _arena_row(spec: HostSpec) -> np.ndarray | None:
    """One env's observation buffer for ``spec``, if its slot may have a :class:`StepArena`:
    not with chunks (``inference="host"`` has its own arena), async envs (``lanes``), a face's
    autoreset, or observations that are not one array of fixed rows."""
    if spec.chunk_steps or spec.lanes or spec.autoreset != "SameStep" or spec.final_in_reply:
        return None
    like = StepBuffers.allocate(spec.observation_space, spec.action_space, 1).obs
    if type(like) is not np.ndarray or like.dtype == object:
        return None
    return like


def step_arenas(specs: list[HostSpec]) -> list[StepArena | None]:
    """The :class:`StepArena` of each process host slot of ``specs`` (``None``: none, see
    :func:`_arena_row`, or fewer than 4 rows fit), in shared memory that takes nothing until
    rows are written. Slots of the same observations and envs share one block, their rows
    side by side in slot order (arena row ``r`` of every slot in one run: a merged agent call of
    the same row is a view, see :mod:`asyncsample._batcher`)."""
    out: list[StepArena | None] = [None] * len(specs)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for k, spec in enumerate(specs):
        like = _arena_row(spec)
        if like is not None:
            groups.setdefault((like.shape, like.dtype.str, spec.n_envs), []).append(k)
    budget = arena_budget(len(specs))
    for members in groups.values():
        spec = specs[members[0]]
        like = _arena_row(spec)
        assert like is not None
        row = like.nbytes * spec.n_envs
        n = min(arena_rows(spec.observation_space, spec.n_envs, 1), budget // max(row, 1))
        if n < 4:
            continue
        slots = len(members)
        memory = heap.BufferWrapper(64 * slots + n * slots * row)  # not zeroed
        targets, rows = _joint_arena(spec, like, (n, memory, slots, 0))
        for index, k in enumerate(members):
            target = targets[8 * index : 8 * index + 1]
            target[0] = -1
            out[k] = StepArena(rows[:, index], target, (n, memory, slots, index))
    return out


def _joint_arena(spec: HostSpec, like: np.ndarray, raw: RawArena) -> tuple[np.ndarray, np.ndarray]:
    """The mailboxes (one per cache line) and rows ``(n, slots, n_envs, ...)`` of the shared
    block of ``raw``."""
    n, memory, slots, _ = raw
    view = memory.create_memoryview()
    targets = np.frombuffer(view, np.int64, 8 * slots)
    shape = (n, slots, spec.n_envs, *like.shape[1:])
    count = int(np.prod(shape, dtype=np.int64))
    return targets, np.frombuffer(view, like.dtype, count, 64 * slots).reshape(shape)


def view_step_arena(spec: HostSpec, raw: RawArena) -> StepArena:
    """Slot ``index``'s arena in the shared block of ``raw`` that :func:`step_arenas` made
    (seen from a host process)."""
    like = _arena_row(spec)
    assert like is not None
    index = raw[3]
    targets, rows = _joint_arena(spec, like, raw)
    return StepArena(rows[:, index], targets[8 * index : 8 * index + 1], raw)


class HostSlot:
    """One worker's envs (``spec``, over ``buffers``, else its own) and, with ``inference="host"``,
    its agent copy (over ``chunks``) in an env host, called ``where`` in messages."""

    def __init__(
        self,
        spec: HostSpec,
        buffers: StepBuffers | None,
        chunks: list[ChunkBuffers] | None = None,
        host_threads: int | None = None,
        where: str = "env host",
        arena: StepArena | None = None,
    ) -> None:
        self.group = group = spec_group(spec, buffers)
        self.arena = None if arena is None else arena.attach(group.buffers)
        self.runner = None if not chunks else ChunkRunner(group, chunks, spec.action_space)
        self.timing: HostTiming | None = None  # metrics on, inference="host": times chunks
        if self.runner is not None and group.buffers.clock is not None:
            self.timing = HostTiming(group, self.runner, group.buffers.clock)
        self.host_threads = host_threads
        self.where = where
        # Text/Sequence leaves in object rows: not shared, they travel packed (_column_wire).
        self.columns = object_rows(spec)
        self._whole = b"\x01" * spec.n_envs  # a step of every env: no look at its mask
        # Each operation from its request body to its reply payload (None: an empty reply).
        self._ops: dict[int, Callable[[_Body], bytes | None]] = {
            Op.STEP: self._serve_step,
            Op.RESET: lambda body: self._reset_reply(self.reset(np.frombuffer(body, np.bool_))),
            Op.RESET_ARGS: self._serve_reset_args,
            Op.BUILD: lambda body: group.build(*self.load(body, "env")),
            Op.UPDATE: lambda body: group.update(*self.load(body, "env update")),
            Op.CALL: lambda body: self._call(*self.load(body, "call arguments")),
            Op.SET_ATTR: lambda body: group.set_attr(*self.load(body, "attribute values")),
            Op.AGENT: self._install_agent,
            Op.PARAMS: lambda body: self._runner().set_params(split_version(body)[1]),
            Op.CHUNK: lambda body: dumps_infos(self.run_chunk(self.load(body, "chunk request"))),
            Op.CLOSE: lambda body: group.close(),
        }

    @classmethod
    def allocate(
        cls, spec: HostSpec, host_threads: int | None = None, where: str = "env host"
    ) -> HostSlot:
        """A slot with buffers of its own (an actor's: nothing is shared with the caller)."""
        obs_space, act_space, n = spec.observation_space, spec.action_space, spec.n_envs
        chunks = None
        if spec.chunk_steps > 0:  # one set: an actor's chunks are not pipelined
            flat = StepBuffers.allocate(
                obs_space, act_space, chunk_rows(spec.chunk_steps) * n, columns=spec.columns
            )
            chunks = chunk_sets(flat, spec.chunk_steps, n)
        return cls(spec, None, chunks, host_threads, where)

    def reset(
        self, mask: np.ndarray, seeds: Any = None, options: Any = None
    ) -> dict[int, dict[str, Any]]:
        """Reset the envs in ``mask``; the agent copy (``inference="host"``) starts them too."""
        infos = self.group.reset(mask, seeds, options)
        if self.runner is not None:
            self.runner.reset_agent(mask)
        return infos

    def step(self, mask: np.ndarray) -> StepInfos:
        return self.group.step(mask)

    def run_chunk(self, request: ChunkRequest | NextChunk) -> ChunkReply:
        runner = self._runner()
        reply = runner.run(request) if self.timing is None else self.timing.run(request)
        if self.columns and self.where == "env-host process":  # object rows: not shared
            chunk = runner.chunks[request.buffer]
            reply.columns = pack_chunk(chunk, self.group.buffers.obs, reply.steps)
        return reply

    def close(self) -> None:
        self.group.close()

    def _runner(self) -> ChunkRunner:
        if self.runner is None:
            raise RuntimeError(f"this {self.where} was not started for inference='host'")
        return self.runner

    def serve(self, op: int, body: _Body) -> bytes:
        """Run request ``op`` with its ``body`` (after the slot); the reply's payload.

        Raises:
            EnvFailureError: what the envs or the agent raised, or unpicklable request (no retry).
        """
        handler = self._ops.get(op)
        if handler is None:
            raise ValueError(f"unknown request opcode {op}")
        self._prepare(op)
        return handler(body) or b""

    def _prepare(self, op: int) -> None:
        if self.arena is not None and op != Op.STEP:
            self.arena.settle()  # the observations back where every other request expects them
        elif self.runner is not None and op not in KEEP_CHUNK_OBS:
            self.runner.settle()  # the same for those a chunk left in its arena

    @property
    def copy_key(self) -> bytes | None:
        """Its agent copy's :attr:`ChunkRunner.copy_key`: chunks of slots with equal keys may
        run side by side (:func:`~asyncsample.backends._chunk_loop.run_joint`); ``None`` where
        its chunks run alone (metrics on, object rows, no copy alike)."""
        if self.runner is None or self.timing is not None or self.columns:
            return None
        return self.runner.copy_key

    @property
    def worker(self) -> int:
        """The number of the worker whose envs it holds."""
        return self.group.worker

    @property
    def going(self) -> bool:
        """Whether its last chunk left the worker's part going on (:attr:`ChunkRunner.going`)."""
        return self.runner is not None and self.runner.going

    def chunk_request(self, body: _Body) -> ChunkRequest | NextChunk:
        """The chunk request in ``body``, the slot ready to run it beside others."""
        self._prepare(Op.CHUNK)
        request: ChunkRequest | NextChunk = self.load(body, "chunk request")
        return request

    def _serve_step(self, body: _Body) -> bytes:
        buffers = self.group.buffers
        n = self.group.n_envs
        given = None
        if isinstance(buffers.actions, list):  # actions without fixed-size rows: pickled
            buffers.actions[:] = self.load(body[n:], "actions")
            body = body[:n]
        elif self.columns:  # the action columns of the object leaves, then the mask
            unpack_columns_into(buffers.actions, self.load(body[n:], "actions"))
            body = body[:n]
        elif len(body) > n:  # actions the caller gave in another dtype: pickled, as given
            given = self.load(body[n:], "actions")
            body = body[:n]
        mask = np.frombuffer(body, np.bool_)
        if self.arena is not None:  # the observations go to the arena row the worker asked for
            self.arena.take(mask)
        infos = self.group.step(mask, given, body == self._whole or None)
        if isinstance(buffers.obs, list):  # observations without fixed-size rows: pickled
            return dumps_infos((infos.env_infos, infos.reset_infos, infos.final_obs, buffers.obs))
        if self.columns:  # the object leaves' rows, one column each
            rows = (pack_columns(buffers.obs), pack_columns(buffers.final_obs))
            return dumps_infos((infos.env_infos, infos.reset_infos, infos.final_obs, rows))
        if infos.final_obs:
            return dumps_infos((infos.env_infos, infos.reset_infos, infos.final_obs))
        if not infos.reset_infos:
            if infos.env_infos is None:
                return b""
            if buffers.infos is not None and buffers.infos.write(infos.env_infos):
                return COLUMNS  # numbers, in the cells: nothing pickled
        return dumps_infos((infos.env_infos, infos.reset_infos))

    def _reset_reply(self, infos: dict[int, dict[str, Any]]) -> bytes:
        obs = self.group.buffers.obs
        if isinstance(obs, list):  # observations without fixed-size rows: pickled
            return dumps_infos((infos, obs))
        if self.columns:  # the object leaves' rows, one column each
            return dumps_infos((infos, pack_columns(obs)))
        return dumps_infos(infos) if infos else b""

    def _serve_reset_args(self, body: _Body) -> bytes:
        n = self.group.n_envs
        seeds, options = self.load(body[n:], "reset options")
        return self._reset_reply(self.reset(np.frombuffer(body[:n], np.bool_), seeds, options))

    def _call(self, name: str, args: Any, kwargs: Any, envs: Any) -> bytes:
        """The pickled results of :meth:`EnvGroup.call` (unpicklable ones: a failure, no retry)."""
        results = self.group.call(name, args, kwargs, envs)
        try:
            return dumps(results)
        except Exception as exc:
            text = "".join(traceback.format_exception(exc))
            raise EnvFailureError(EnvFailure(None, exc, text, retry=False)) from exc

    def _install_agent(self, body: _Body) -> None:
        """Install the agent copy (which may import torch: its threads are set after); its
        version is the caller's to stamp (a slot's requests run in the order sent)."""
        runner = self._runner()
        runner.install(split_version(body)[1])
        _threads.apply_torch(self.host_threads)

    def load(self, body: _Body, what: str) -> Any:
        """Unpickle a request's ``body``; a failure (a module missing here) is not retried."""
        try:
            return pickle.loads(body)
        except Exception as exc:
            error = RuntimeError(
                f"the {what} could not be unpickled in the {self.where} "
                f"({type(exc).__name__}: {exc}); install the packages it needs where the env "
                "hosts run (with Ray: on every node, or ship them with a Ray runtime_env, "
                "init_kwargs={'runtime_env': {...}})"
            )
            error.__cause__ = exc
            text = "".join(traceback.format_exception(exc))
            raise EnvFailureError(EnvFailure(None, error, text, retry=False)) from exc
