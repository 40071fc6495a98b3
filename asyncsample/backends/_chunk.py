"""Chunks of steps run inside an env host by the host's own copy of the agent (inference="host").

One :class:`ChunkRequest` per chunk: the host asks its agent, steps the worker's envs and writes
each step's records into the worker's :class:`ChunkBuffers`, replying with a small
:class:`ChunkReply`. The request carries a copy of the worker's
:class:`~asyncsample._engine.StopRule`, so the host stops exactly where per-step stepping would.
With two sets of buffers (the ``process`` backend) a :class:`NextChunk` runs the following chunk
from the state the last one left, while the worker replays that one.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from asyncsample._action_check import AgentOutputCheck, check_actions, make_action_check
from asyncsample._engine import CallMode, StopRule
from asyncsample._infos import snapshot
from asyncsample._recorder import put_row, row_of
from asyncsample._step_fields import StepFields
from asyncsample._tree import Tree, tree_leaves, tree_map
from asyncsample.agent import RandomAgent, trusted_actions
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
from asyncsample.env_group import EnvFailure, EnvFailureError, EnvGroup, StepBuffers
from asyncsample.errors import AgentRowsError

__all__ = [
    "AgentHost",
    "ChunkBuffers",
    "ChunkReply",
    "ChunkRequest",
    "ChunkRunner",
    "NextChunk",
    "SentChunk",
    "chunk_capacity",
    "chunk_rows",
    "chunk_sets",
    "install_agent",
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
    """

    rule: StopRule
    steps: int
    counts: np.ndarray
    active: np.ndarray
    buffer: int = 0
    epoch: int | None = None
    obs_row: int = -1


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


class ChunkRunner:
    """One worker slot's agent copy and chunk loop over its ``group`` of envs, into its sets of
    ``chunks``; actions are checked against ``action_space``."""

    def __init__(
        self, group: EnvGroup, chunks: list[ChunkBuffers], action_space: gym.Space[Any]
    ) -> None:
        self.group = group
        self.chunks = chunks
        self.chunk = chunks[0]
        self.action_space = action_space
        # After a chunk that ran to its end: its rule, active and counts (see NextChunk).
        self._state: tuple[StopRule, np.ndarray, np.ndarray] | None = None
        self._next_row = -1  # the arena row of the next chunk's observations (NextChunk)
        self._ready_row = -1  # the arena row that holds the current observations, or -1
        self._own = group.buffers.obs  # the group's own observation buffer (see settle)
        self.agent: Any = None
        self._output_check = AgentOutputCheck(group.worker, group.n_envs)
        self._action_check = make_action_check(action_space)
        self._trusted = False

    def install(self, blob: bytes) -> None:
        """Install the agent in ``blob`` (``pickle((cloudpickled agent, seed))``), seeded."""
        agent = install_agent(blob, self._guard)
        self.agent = agent
        self._output_check.forget()
        self._trusted = trusted_actions(agent, self.action_space)

    def set_params(self, blob: bytes) -> None:
        """``agent.set_param_values(params)`` with the parameters pickled in ``blob``."""
        set_agent_params(self.agent, blob, self.group.worker, self._guard)

    def settle(self) -> None:
        """The group's observations back in its own buffer, from the arena row a chunk left
        them in (a copy): before any request but a chunk, an agent install or its parameters,
        which all read or write them there (the main process's view goes home alike)."""
        buffers = self.group.buffers
        if buffers.obs is not self._own:
            put_row(self._own, Ellipsis, buffers.obs)
            buffers.obs = self._own
        self._ready_row = -1

    def reset_agent(self, mask: np.ndarray) -> None:
        """``agent.reset(mask)``, where the agent has it (episodes start in ``mask``)."""
        self._ready_row = -1  # reset envs show new observations
        reset = getattr(self.agent, "reset", None)
        if reset is not None and mask.any():
            self._guard(reset, mask.copy())

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            raise self._failure(exc) from exc

    def _failure(self, exc: Exception) -> EnvFailureError:
        """What the agent's ``exc`` is reported as (in the ``except`` block: the traceback)."""
        if isinstance(exc, AgentRowsError):  # a failed row: that env's fault (host restarted)
            n = self.group.n_envs
            try:
                exc.check_rows(n, f"the {n} envs of worker {self.group.worker}")
            except ValueError as bad:
                return self._failure(bad)
            row = next(iter(exc.failures))
            fault = exc.row_fault(row, worker=self.group.worker, env=row)
            return EnvFailureError(EnvFailure(row, fault, traceback.format_exc(), retry=True))
        error = agent_error(exc, self.group.worker)
        return EnvFailureError(EnvFailure(None, error, traceback.format_exc(), retry=False))

    def agent_actions(self, observations: Tree) -> tuple[Tree, dict[str, np.ndarray]]:
        """The agent's checked ``(actions, agent_infos)`` for ``observations``."""
        result = self.agent.get_actions(observations)
        if self._trusted:  # the built-in random agent: rows of its own space, no infos
            return result  # type: ignore[no-any-return]
        actions, infos = self._output_check.output(result)
        actions = check_actions(
            actions,
            self.group.buffers.actions,
            worker=self.group.worker,
            action_space=self.action_space,
            values=self._action_check,
        )
        return actions, infos

    def run(self, request: ChunkRequest | NextChunk) -> ChunkReply:
        """Run up to ``request.steps`` worker steps, or until the request's rule stops."""
        if self.agent is None:
            raise RuntimeError(f"worker {self.group.worker}: no agent installed in its env host")
        if isinstance(request, NextChunk):
            state = self._state
            if state is None or int(self.chunk.epoch[0]) != request.epoch:
                return ChunkReply(0)
            rule, active, counts = state
            row = self._next_row
        else:
            rule = request.rule.copy()
            active = request.active.copy()
            counts = request.counts.astype(np.int64, copy=True)
            row = self._next_row = request.obs_row
            if request.epoch is not None and int(self.chunk.epoch[0]) != request.epoch:
                self._state = (rule, active, counts)  # a run-ahead sent before an update
                return ChunkReply(0)
        self._state = None  # until this chunk has run to its end
        chunk = self.chunks[request.buffer]
        into = self._arena_rows(row, min(request.steps, chunk.capacity))
        if into is None:
            self.settle()
        # A chunk that follows one into the arena starts at the row that holds the current
        # observations (the last one's spare row): nothing to copy there.
        written = into is not None and row == self._ready_row
        try:
            reply = self._run(chunk, request.steps, rule, active, counts, into, written)
        except BaseException:
            self.settle()
            raise
        self._state = (rule, active, counts)
        if into is None:
            self._next_row = -1
        else:
            reply.obs_row = row
            self._next_row = row + reply.steps
            if reply.steps > 0:  # (none: the current observations stay where they were)
                self._ready_row = self._next_row
        return reply

    def _agent_reset(self) -> Callable[..., Any] | None:
        """The agent's ``reset``, or ``None`` where there is nothing to call (none, or the
        built-in :class:`~asyncsample.agent.RandomAgent`'s, which does nothing)."""
        reset = getattr(self.agent, "reset", None)
        if getattr(reset, "__func__", None) is RandomAgent.reset:
            return None
        return reset

    def _restore_flags(self, own: tuple[np.ndarray, np.ndarray, np.ndarray], keep: bool) -> None:
        """Point the group's rewards and flags back at its own buffers ``own``; ``keep``: with
        the values of the rows they pointed at (the last step's)."""
        buf = self.group.buffers
        for name, mine in zip(("rewards", "terminated", "truncated"), own):
            row = getattr(buf, name)
            if row is not mine:
                if keep:
                    mine[...] = row
                setattr(buf, name, mine)

    def _arena_rows(self, row: int, steps: int) -> Tree:
        """Arena rows ``row...row + steps`` and the spare row, or ``None`` if there are none."""
        arena = self.chunk.arena
        end = row + steps + 1
        if arena is None or row < 0 or end > len(tree_leaves(arena)[0]):
            return None
        return self.chunk.arena_view(row, end)

    def _run(
        self,
        chunk: ChunkBuffers,
        max_steps: int,
        rule: StopRule,
        active: np.ndarray,
        counts: np.ndarray,
        into: Tree = None,
        written: bool = False,
    ) -> ChunkReply:
        """The chunk loop: ``rule``, ``active`` and ``counts`` are consumed in place;
        observations go to ``into`` (arena rows) if given, else to the set's rows; ``written``:
        row 0 already holds the current observations. Written for the cost per step: one
        assignment per plain row, episode ends from the group's list."""
        group = self.group
        buf = group.buffers
        everyone = bool(active.all())
        progress: Any = chunk.progress.data  # item access through a memoryview: cheaper
        infos_per_step: list[dict[str, np.ndarray]] = []
        step_infos: dict[int, tuple[list[dict[str, Any]] | None, dict[int, dict[str, Any]]]] = {}
        obs_rows = chunk.obs if into is None else into
        act_rows, buf_act = chunk.actions, buf.actions
        flat_obs = type(obs_rows) is np.ndarray and type(buf.obs) is np.ndarray
        flat_act = type(act_rows) is np.ndarray and type(buf_act) is np.ndarray
        final_rows, buf_final = chunk.final_obs, buf.final_obs
        flat_final = type(final_rows) is np.ndarray and type(buf_final) is np.ndarray
        rewards, terminated, truncated = chunk.rewards, chunk.terminated, chunk.truncated
        own = buf.rewards, buf.terminated, buf.truncated
        more, took, step, actions_for = rule.more, rule.took, group.step, self.agent_actions
        # Episode ends matter to the rule only for samples and episodes (see StopRule.ended).
        watch_ends = rule.mode is CallMode.SAMPLES or rule.episodes_left is not None
        agent_reset = self._agent_reset()
        n_envs = group.n_envs
        # Per env, the step its episode's count is 0 at (a list: cheaper than numpy's per end).
        origin = [-c for c in counts.tolist()]
        steps = 0
        # Into the arena, while every env is stepped, each step writes its observations straight
        # into the next row (the group's buffer points there): no copy of them in the host. The
        # last step's stay there until another request needs them home (settle).
        swap = into is not None
        home = self._own
        ready = written  # row j holds the current observations
        # While every env is stepped, the group writes each step's rewards and flags straight
        # into the chunk's rows (its buffers point there): no copy of them either.
        direct = everyone
        try:
            for j in range(min(max_steps, chunk.capacity)):
                if not more(active):
                    break
                if swap:
                    # The arena's rows lay a multi-agent env's slots end to end, as the group's
                    # own rows do (``_memory.carve``): a policy's rows need no copy.
                    observations = obs_rows[j] if flat_obs else row_of(obs_rows, j)
                    if not ready:
                        put_row(observations, Ellipsis, buf.obs)
                    if everyone:
                        buf.obs = obs_rows[j + 1] if flat_obs else row_of(obs_rows, j + 1)
                    elif buf.obs is not home:  # some envs stay put: the buffer holds every env's
                        put_row(home, Ellipsis, observations)
                        buf.obs = home
                    ready = everyone
                elif flat_obs:
                    if not ready:
                        obs_rows[j] = buf.obs
                    observations = obs_rows[j]
                    ready = False
                else:
                    if not ready:
                        put_row(obs_rows, j, buf.obs)
                    # The group's own rows (the same values): a multi-agent env's slots lie end
                    # to end there (``_memory.carve``), so a policy's rows need no copy.
                    observations = buf.obs
                    ready = False
                try:
                    actions, infos = actions_for(observations)
                except Exception as exc:
                    raise self._failure(exc) from exc
                if flat_act:
                    act_rows[j] = actions
                    buf_act[...] = actions
                else:
                    put_row(act_rows, j, actions)
                    put_row(buf_act, Ellipsis, actions)
                infos_per_step.append(infos)
                if direct:
                    buf.rewards, buf.terminated, buf.truncated = (
                        rewards[j],
                        terminated[j],
                        truncated[j],
                    )
                result = step(active, None, everyone)
                progress[0] += 1  # a step ended: the main process judges the next from now
                if result.env_infos is not None or result.reset_infos:
                    # Copied now: the chunk's reply is pickled once, after an env may have
                    # changed an info dict it reuses (as a step's own reply would not see).
                    step_infos[j] = (snapshot(result.env_infos), snapshot(result.reset_infos))
                if not direct:
                    rewards[j] = buf.rewards
                    terminated[j] = buf.terminated
                    truncated[j] = buf.truncated
                steps = j + 1
                took(1)
                ended = group.last_ended
                if not ended:
                    continue
                if flat_final:  # a row per ended env: cheaper than fancy indexing for a few
                    final_row = final_rows[j]
                    for i in ended:
                        final_row[i] = buf_final[i]
                else:
                    _put_final(final_rows, buf_final, j, np.array(ended, dtype=np.intp))
                if watch_ends:
                    index = np.array(ended, dtype=np.intp)
                    if rule.ended(index, sum(steps - origin[i] for i in ended), active):
                        everyone = False
                        if direct:  # from the next step on, copied from the group's buffers
                            direct = False
                            self._restore_flags(own, True)
                for i in ended:
                    origin[i] = steps
                if agent_reset is not None:
                    done = np.zeros(n_envs, dtype=bool)
                    done[ended] = True
                    self._guard(agent_reset, done)
            counts[:] = [steps - o for o in origin]
            if steps and not ready and (into is not None or len(rewards) > chunk.capacity):
                put_row(obs_rows, steps, buf.obs)
        except BaseException:
            self._restore_flags(own, False)
            raise
        self._restore_flags(own, True)
        return ChunkReply(steps, _pack_infos(infos_per_step), step_infos)


def _put_final(dst: Tree, src: Tree, j: int, index: np.ndarray) -> None:
    """Row ``j`` of the chunk's final observations ``dst`` takes ``src``'s rows ``index``."""

    def put(d: np.ndarray, s: np.ndarray) -> None:
        d[j, index] = s[index]

    tree_map(put, dst, src)


def _pack_infos(
    per_step: list[dict[str, np.ndarray]],
) -> dict[str, np.ndarray] | list[tuple[int, dict[str, np.ndarray]]]:
    """Stack the agent infos when every step has the same keys and shapes; else list them."""
    first = per_step[0] if per_step else {}
    if first and all(
        infos.keys() == first.keys()
        and all(infos[k].shape == v.shape and infos[k].dtype == v.dtype for k, v in first.items())
        for infos in per_step
    ):
        return {k: np.stack([infos[k] for infos in per_step]) for k in first}
    return [(j, infos) for j, infos in enumerate(per_step) if infos]


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
