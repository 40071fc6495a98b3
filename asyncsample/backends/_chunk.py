"""Chunks of steps run inside an env host by the host's own copy of the agent (inference="host").

One :class:`ChunkRequest` per chunk: the host asks its agent, steps the worker's envs and writes
each step's records into the worker's :class:`ChunkBuffers`, replying with a small
:class:`ChunkReply`. The request carries a copy of the worker's
:class:`~asyncsample._engine.StopRule`, so the host stops exactly where per-step stepping would.
With two sets of buffers (the ``process`` backend) a :class:`NextChunk` runs the following chunk
from the state the last one left, while the worker replays that one.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from asyncsample._engine import StopRule
from asyncsample._recorder import row_of
from asyncsample._step_fields import StepFields
from asyncsample._tree import Tree, tree_leaves, tree_map
from asyncsample.agent import RandomAgent
from asyncsample.backends._column_wire import unpack_chunk
from asyncsample.backends._transport import (
    KEEP_CHUNK_OBS,
    Op,
    Unzeroed,
    buffer_rows,
    round_trips,
    shared_buffers,
    shared_tree,
    view_buffers,
    view_tree,
)
from asyncsample.backends.base import EnvHost, HostSpec, agent_note
from asyncsample.env_group import StepBuffers

__all__ = [
    "AgentHost",
    "ChunkBuffers",
    "ChunkReply",
    "ChunkRequest",
    "NextChunk",
    "SentChunk",
    "acts_alike",
    "agent_error",
    "alike_key",
    "chunk_capacity",
    "chunk_rows",
    "chunk_sets",
    "install_agent",
    "params_key",
    "set_agent_params",
]

#: Default longest chunk, in worker steps (an agent update waits at most this long to apply).
DEFAULT_CHUNK_STEPS = 64
#: Shared memory one set of a worker's chunk buffers may take at most (long rows: shorter chunks).
CHUNK_BYTES = 8 << 20
#: The same with an observation arena (see :func:`chunk_capacity`): a set's observation rows
#: are then a fallback, and its final observations are written only where episodes end.
ARENA_CHUNK_BYTES = 32 << 20
#: Sets of chunk buffers of a pipelined slot (one replayed while the host fills the other).
PIPELINE_SETS = 2
#: Shared memory a worker's observation arena may take at most (address space: only the rows
#: written take memory). The worker's observation records live there (see :class:`ChunkBuffers`).
ARENA_BYTES = 512 << 20
#: The most rows of an observation arena (small observations need no more).
ARENA_MAX_ROWS = 4096


@dataclass
class ChunkBuffers(StepFields):
    """The records of one chunk (:class:`~asyncsample._step_fields.StepFields` per step):
    every array has leading axes ``(rows, n_envs)``, ``rows`` at least ``capacity`` (see
    :func:`chunk_rows`); a spare row of ``obs`` gets the observations after the last step.

    Attributes:
        capacity: the most steps one chunk can hold.
        progress: one ``int64`` the host bumps after every step, never reset: the main process
            judges each step against ``step_timeout`` by it.
        epoch: one ``int64`` the main process bumps at every agent update: a
            :class:`NextChunk` sent before the update is not run.
        arena: the worker's observation arena ``(R, n_envs, ...)`` (shared memory in a process
            host, else ``None``), where the worker keeps its observation records: a request's
            ``obs_row`` has the host write observations there instead of :attr:`obs`.
    """

    capacity: int
    progress: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    epoch: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    arena: Tree = None

    @classmethod
    def from_flat(
        cls, flat: StepBuffers, capacity: int, n_envs: int, counter: Any = None, arena: Tree = None
    ) -> ChunkBuffers:
        """View step buffers of ``rows * n_envs`` envs as chunk buffers; ``counter``: the memory
        of the step counter and the update epoch (default: local)."""
        rows = len(flat.rewards) // n_envs

        def shape(a: np.ndarray) -> np.ndarray:
            return a.reshape(rows, n_envs, *a.shape[1:])

        counters = np.zeros(2, np.int64) if counter is None else np.frombuffer(counter, np.int64)
        return cls(
            obs=tree_map(shape, flat.obs),
            final_obs=tree_map(shape, flat.final_obs),
            actions=tree_map(shape, flat.actions),
            rewards=shape(flat.rewards),
            terminated=shape(flat.terminated),
            truncated=shape(flat.truncated),
            capacity=capacity,
            progress=counters[0:1],
            epoch=counters[1:2],
            arena=arena,
        )

    def with_arena_obs(self, row: int, end: int) -> ChunkBuffers:
        """This chunk with arena rows ``row:end`` as its observations (not
        ``dataclasses.replace``: twice the cost, per chunk)."""
        chunk = object.__new__(ChunkBuffers)
        chunk.__dict__.update(self.__dict__, obs=self.arena_view(row, end))
        return chunk

    def arena_view(self, row: int, end: int) -> Tree:
        """Rows ``row:end`` of the observation :attr:`arena` (views)."""
        arena = self.arena
        return (
            arena[row:end] if type(arena) is np.ndarray else tree_map(lambda a: a[row:end], arena)
        )


def chunk_rows(capacity: int, sets: int = 1) -> int:
    """Rows of ``sets`` sets of chunk buffers of ``capacity`` steps, a spare row each."""
    return (capacity + 1) * sets


def chunk_sets(
    flat: StepBuffers, capacity: int, n_envs: int, counter: Any = None, arena: Tree = None
) -> list[ChunkBuffers]:
    """Split step buffers of ``chunk_rows(capacity, sets) * n_envs`` envs into a slot's sets of
    chunk buffers, sharing one step counter, epoch and ``arena``."""
    per = (capacity + 1) * n_envs
    counters = np.zeros(2, np.int64) if counter is None else counter
    return [
        ChunkBuffers.from_flat(
            buffer_rows(flat, k * per, k * per + per), capacity, n_envs, counters, arena
        )
        for k in range(len(flat.rewards) // per)
    ]


def arena_rows(observation_space: gym.Space[Any], n_envs: int, capacity: int) -> int:
    """Rows of a worker's observation arena: what :data:`ARENA_BYTES` holds, at most
    :data:`ARENA_MAX_ROWS`; 0 (no arena) when fewer than two chunks fit."""
    probe = StepBuffers.allocate(observation_space, gym.spaces.Discrete(2), 1, columns=True)
    leaves = tree_leaves(probe.obs)
    if any(a.dtype == object for a in leaves):
        return 0
    row = max(sum(a.nbytes for a in leaves) * n_envs, 1)
    rows = min(ARENA_MAX_ROWS, ARENA_BYTES // row)
    return rows if rows >= 2 * (capacity + 1) else 0


def chunk_capacity(
    observation_space: gym.Space[Any],
    action_space: gym.Space[Any],
    n_envs: int,
    steps: int,
    arena: bool = False,
) -> int:
    """How many steps a worker's chunk buffers hold: ``steps``, fewer if a row is large.

    ``arena``: the buffers are shared memory with an observation arena where one fits
    (:func:`shared_chunk_sets`): the chunk's observations go there, and a set's own observation
    and final observation rows take memory only once written (a fallback, and the steps where
    episodes end), so a row counts its final observations once, within :data:`ARENA_CHUNK_BYTES`.
    """
    probe = StepBuffers.allocate(observation_space, action_space, 1, columns=True)
    obs = sum(a.nbytes for a in tree_leaves(probe.obs))
    act = sum(a.nbytes for a in tree_leaves(probe.actions))
    row = (obs * 2 + act + 10) * n_envs
    capacity = int(max(1, min(steps, CHUNK_BYTES // max(row, 1))))
    if arena and capacity < steps:
        wide = int(max(1, min(steps, ARENA_CHUNK_BYTES // max((obs + act + 10) * n_envs, 1))))
        if wide > capacity and arena_rows(observation_space, n_envs, wide):
            return wide
    return capacity


RawChunks = tuple[int, int, list[Any], Any, tuple[int, Any] | None]
"""What a process host needs to view a slot's chunk buffers: ``(capacity, rows, blocks,
counters, arena)``, ``arena`` the arena's rows and raw blocks (:func:`~asyncsample._memory.carve`'s
order), or ``None``."""


def shared_chunk_sets(spec: HostSpec, ctx: Any) -> tuple[list[ChunkBuffers], RawChunks | None]:
    """A process host slot's sets of chunk buffers and arena in shared memory (none when
    ``spec`` asks for no chunks), and what the host needs to view them."""
    if spec.chunk_steps <= 0:
        return [], None
    obs_space, n_envs = spec.observation_space, spec.n_envs
    rows = chunk_rows(spec.chunk_steps, PIPELINE_SETS)
    n_arena = arena_rows(obs_space, n_envs, spec.chunk_steps)
    # With an arena, the sets' observation rows are a fallback and their final observations are
    # written where episodes end: pages that take memory once written (nothing reads a row
    # before the host wrote it).
    _, blocks = shared_buffers(
        obs_space,
        spec.action_space,
        rows * n_envs,
        ctx,
        columns=spec.columns,
        lazy_obs=n_arena > 0,
    )
    counters = ctx.RawArray("q", 2)  # the step counter and the update epoch
    arena = None
    if n_arena:
        memory: list[Any] = []
        shared_tree(obs_space, n_envs, Unzeroed(), memory, n_arena)
        arena = (n_arena, memory)
    raw = (spec.chunk_steps, rows, blocks, counters, arena)
    return view_chunk_sets(spec, raw), raw


def view_chunk_sets(spec: HostSpec, raw: RawChunks) -> list[ChunkBuffers]:
    """A slot's sets of chunk buffers over the shared memory :func:`shared_chunk_sets` made,
    seen from either process."""
    capacity, rows, blocks, counters, raw_arena = raw
    obs_space, n_envs = spec.observation_space, spec.n_envs
    flat = view_buffers(obs_space, spec.action_space, rows * n_envs, blocks, columns=spec.columns)
    arena = None
    if raw_arena is not None:
        n_arena, memory = raw_arena
        # Rows of (n_arena, n_envs, ...); a multi-agent env's slots end to end in each row, so
        # that a policy's rows of a step are a view (_memory.carve).
        arena = view_tree(obs_space, n_envs, iter(memory), n_arena)
    return chunk_sets(flat, capacity, n_envs, counters, arena)


@dataclass
class ChunkRequest:
    """What the worker asks its host to run.

    Attributes:
        rule: where the worker's part of the call stops (a copy the host may consume).
        steps: the most worker steps to run (at most the chunk capacity).
        counts: per env, rows of its current episode already recorded by the worker.
        active: per env, whether it is stepped.
        buffer: which set of the slot's chunk buffers to fill.
        epoch: ``None``, or (a stream's run-ahead) the update epoch when it was sent: after an
            update since, the host runs nothing and keeps the state for the next request.
        obs_row: the arena row the chunk's observations go to, or -1: the set's own rows.
        starters: a part's first request in a call: the workers numbered below it start their
            parts of the call too (the others have no share), so a host with alike agent copies
            waits for theirs to run them side by side; 0: unknown (a retry, a run-ahead).
    """

    rule: StopRule
    steps: int
    counts: np.ndarray
    active: np.ndarray
    buffer: int = 0
    epoch: int | None = None
    obs_row: int = -1
    starters: int = 0


@dataclass
class NextChunk:
    """Run up to ``steps`` steps following the host's last chunk, from the state it left,
    into set ``buffer``; nothing when the last chunk failed or an agent update was made after
    ``epoch`` (the worker then asks again)."""

    steps: int
    buffer: int
    epoch: int


@dataclass(slots=True, eq=False)
class SentChunk:
    """A chunk request sent and not awaited yet: its call's ``future``, ``reply`` (awaits the
    payload or raises what a failure means) and the agent ``version`` it runs with."""

    future: Any
    reply: Callable[[], Awaitable[bytes]]
    version: int
    into: tuple[ChunkBuffers, Tree] | None = None
    """Where the reply's ``object`` rows go (:attr:`ChunkReply.columns`): the request's chunk
    set and the step buffers' observations; ``None`` when the rows are shared."""
    seen: Callable[[ChunkReply | None], None] | None = None
    """Told the reply once it came (``None``: the chunk failed), before anyone reads it."""

    async def wait(self) -> ChunkReply:
        """The chunk's reply (its ``object`` rows written into :attr:`into`)."""
        try:
            result: ChunkReply = pickle.loads(await self.reply())
        except Exception:
            if self.seen is not None:
                self.seen(None)
            raise
        if self.into is not None and result.columns is not None:
            unpack_chunk(*self.into, result.steps, result.columns)
        if self.seen is not None:
            self.seen(result)
        return result

    def abandon(self) -> None:
        """Nobody will wait for this chunk: its reply, or its host's death, is dropped."""
        future = self.future
        if not future.done():
            future.cancel()
        elif not future.cancelled():
            future.exception()  # retrieved: no "exception was never retrieved" at collection


class ArenaObs:
    """The main process's view of a process host's current observations (its step buffers'
    ``obs``), kept where the host keeps them: a chunk into the observation arena leaves them
    in the row after its last step, until a request needs them home
    (:meth:`ChunkRunner.settle`, :data:`~asyncsample.backends._transport.KEEP_CHUNK_OBS`)."""

    def __init__(self, buffers: StepBuffers, chunk: ChunkBuffers | None) -> None:
        self.buffers = buffers
        self.arena = None if chunk is None else chunk.arena  # None: nothing to follow
        self.own = buffers.obs
        self.row = -1  # the arena row our view points at, or -1: home

    def sent(self, op: Op) -> None:
        """Request ``op`` was sent to the host."""
        if op not in KEEP_CHUNK_OBS:
            self.home()

    def seen(self, reply: ChunkReply | None) -> None:
        """A chunk's ``reply`` came (``None``: it failed, and the host settled)."""
        if reply is not None and reply.steps == 0:
            return  # nothing ran: they stay where they were
        if reply is None or reply.obs_row < 0 or self.arena is None:
            self.home()
            return
        self.row = reply.obs_row + reply.steps
        self.buffers.obs = row_of(self.arena, self.row)

    def home(self) -> None:
        """A request the host serves with its observations home was sent."""
        if self.row >= 0:
            self.row = -1
            self.buffers.obs = self.own


@dataclass
class ChunkReply:
    """What a host answers for a chunk, besides the shared buffers.

    Attributes:
        steps: worker steps run (the first ``steps`` rows of the chunk buffers are valid).
        agent_infos: one dict of arrays stacked over the steps (every step had the same keys),
            or a list of ``(step, infos)`` for the steps with any.
        step_infos: by step, ``(env_infos, reset_infos)`` where either is non-empty.
        obs_row: the arena row of the first step's observations, or -1 (the set's rows).
    """

    steps: int
    agent_infos: dict[str, np.ndarray] | list[tuple[int, dict[str, np.ndarray]]] = field(
        default_factory=list
    )
    step_infos: dict[int, tuple[list[dict[str, Any]] | None, dict[int, dict[str, Any]]]] = field(
        default_factory=dict
    )
    obs_row: int = -1
    columns: Any = None
    """Text/Sequence leaves (object rows, not in shared memory): the chunk's observation,
    final observation and action rows and the current observations, packed by the host
    (:func:`asyncsample.backends._column_wire.pack_block`); else ``None``."""

    def infos_at(self, step: int) -> dict[str, np.ndarray]:
        """The agent infos of ``step``."""
        infos = self.agent_infos
        if isinstance(infos, dict):
            return {k: v[step] for k, v in infos.items()}
        return next((value for j, value in infos if j == step), {})  # only steps with infos


class AgentFailure(Exception):
    """What an agent raised inside a host, when that exception cannot be pickled."""


def agent_error(exc: Exception, worker: int) -> BaseException:
    """The error to report for ``exc``, raised by the agent of ``worker`` inside its host:
    ``exc`` with a note if it survives pickling, else an :class:`AgentFailure` describing it."""
    note = agent_note(worker)
    if round_trips(exc):
        if note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)
        return exc
    return AgentFailure(f"{note}: {type(exc).__name__}: {exc}")


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def install_agent(blob: bytes, call: Callable[..., Any] = _call) -> Any:
    """The agent copy in ``blob`` (``pickle((cloudpickled agent, seed))``, see
    :func:`~asyncsample.inference.host.with_seed`), seeded with ``agent.seed(seed)`` where it has
    one (through ``call(fn, *args)``, which may wrap what the agent raises)."""
    agent_blob, seed = pickle.loads(blob)
    agent = pickle.loads(agent_blob)
    seeder = getattr(agent, "seed", None)
    if seed is not None and callable(seeder):
        call(seeder, int(seed))
    return agent


def alike_key(blob: bytes, agent: Any) -> bytes | None:
    """The key of the agent copy installed from ``blob``: equal for the copies of one host that
    act alike on any rows, so that one call may serve their rows (the chunks side by side of
    :func:`~asyncsample.backends._chunk_loop.run_joint`, the lanes' merged calls). ``None``
    for a copy that keeps its own calls: a worker's own agent (installed without a seed, as it
    would go on in the caller), and one whose copies do not act alike (:func:`acts_alike`)."""
    agent_blob, seed = pickle.loads(blob)
    if seed is None or not acts_alike(agent):
        return None
    return hashlib.blake2b(agent_blob).digest()


def acts_alike(agent: Any) -> bool:
    """Whether the copies of ``agent`` (one object shared by several workers) act alike on any
    rows, so that one call may serve them all; not the built-in random agent (each worker's
    generator), nor an agent with ``seed`` (each copy draws from its worker's seed), ``reset``
    (its state follows one worker's envs) or ``merge_rows = False``."""
    return not (
        isinstance(agent, RandomAgent)
        or callable(getattr(agent, "seed", None))
        or callable(getattr(agent, "reset", None))
        or getattr(agent, "merge_rows", True) is False
    )


def params_key(key: bytes | None, blob: bytes) -> bytes | None:
    """The key of a copy with :func:`alike_key` ``key`` once the parameters in ``blob`` replaced
    its earlier ones."""
    return None if key is None else hashlib.blake2b(key + blob).digest()


def set_agent_params(
    agent: Any, blob: bytes, worker: int, call: Callable[..., Any] = _call
) -> None:
    """``agent.set_param_values(params)`` with the parameters pickled in ``blob``."""
    params = pickle.loads(blob)
    setter = getattr(agent, "set_param_values", None)
    if setter is None:
        raise TypeError(
            f"agent_update is a parameter set but the agent of worker {worker} has no "
            "set_param_values"
        )
    call(setter, params)


class AgentHost(EnvHost, Protocol):
    """An env host that also runs a copy of the worker's agent (``inference="host"``).

    :meth:`set_agent` and :meth:`set_params` only record what the copy should be;
    :meth:`sync_agent` (and every :meth:`run_chunk`) sends what the host lacks, also to a host
    that was just restarted.
    """

    @property
    def chunk(self) -> ChunkBuffers | None:
        """The chunk records the host fills (``None``: the spec asked for no chunks)."""
        ...

    def set_agent(self, blob: bytes, version: int) -> None:
        """Install ``blob`` (a pickled ``(cloudpickled agent, seed)``) before the next chunk;
        it replaces earlier parameters. ``version``: the worker's agent version after it."""
        ...

    def set_params(self, blob: bytes, version: int) -> None:
        """``set_param_values`` with the pickled parameters ``blob`` before the next chunk."""
        ...

    async def sync_agent(self) -> int:
        """Send the agent and parameters the host lacks; the agent version in force there."""
        ...

    async def run_chunk(self, request: ChunkRequest) -> tuple[ChunkReply, int]:
        """Run one chunk with the host's agent copy (synced first); the reply and the agent
        version the chunk ran with. ``step_timeout`` applies per step of the chunk."""
        ...
