"""What a worker has recorded during a call: time-major step rows, episode pieces and plans.

A step costs a few row copies, whatever the number of envs; episodes are cut out of the rows
with one gather per field when collected (:func:`asyncsample._assembly.assemble`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncsample._assembly import Plan
from asyncsample._tree import Tree, tree_leaves, tree_map
from asyncsample.batch import StepType

__all__ = [
    "CarriedRows",
    "Piece",
    "Recorder",
    "Resume",
    "Rows",
    "put_row",
    "put_rows",
    "row_of",
    "store_agent_info_block",
    "store_agent_infos",
]


class Resume(enum.Enum):
    """What a sampler call continues from the previous one (and leaves for the next).

    ``NOTHING``: fresh episodes. ``FRAGMENTS``: the episodes ``obtain_fragments`` left running
    continue (their earlier steps were returned). ``EPISODES``: running episodes continue with
    their steps so far kept, so they come out whole (a stream of complete episodes).
    """

    NOTHING = "nothing"
    FRAGMENTS = "fragments"
    EPISODES = "episodes"


@dataclass
class Piece:
    """An episode, or the part of one, recorded during the current call."""

    env: int
    start: int  # first row in the step buffers
    stop: int  # one past the last row
    position: int  # steps the episode had taken before this piece
    end: StepType | None  # TERMINAL/TIMEOUT when the episode ended, else None (a fragment)
    last_observation: Tree
    episode_info: dict[str, Any]


@dataclass
class Rows:
    """Time-major step records of one call: row ``t`` holds step ``t`` of every env."""

    n_envs: int
    capacity: int = 0
    size: int = 0
    obs: Tree = None
    actions: Tree = None
    rewards: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    agent_infos: dict[str, np.ndarray] = field(default_factory=dict)
    env_infos: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    versions: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    """The agent version each step was taken under, ``(rows, n_envs)``."""
    arena: Tree = None
    """Observation records in shared memory that the env host writes itself (on ``process``:
    its chunks with ``inference="host"``, its steps with ``per_worker`` and ``batched``), or
    ``None``; while :attr:`on_arena`, :attr:`obs` is the view ``arena[base:]``, so the batch is
    gathered from what the host wrote in one copy."""
    base: int = 0  # the arena row of row 0 (while on_arena)
    on_arena: bool = False
    room: int = 1  # rows a chunk needs free in the arena (its capacity and the spare row)
    n_arena: int = 0  # rows of the arena
    spare: Tree = None  # the local observation records of a call that outgrew the arena

    def use_arena(self, arena: Tree, room: int) -> None:
        """Keep the observations in ``arena``: now if no row is recorded, else from next call."""
        if self.arena is None:
            self.arena, self.room = arena, room
            self.n_arena = len(tree_leaves(arena)[0])
            if self.size == 0:
                self._rebase(0, 0)

    def arena_rows(self) -> int:
        """Rows of the arena (0 without one)."""
        return self.n_arena

    def arena_row(self, t: int) -> int:
        """The arena row where the host writes a chunk (or a step's next row) starting at row
        ``t`` in place, or -1."""
        if not self.on_arena or self.base + t + self.room > self.n_arena:
            return -1
        return self.base + t

    def clear(self, append: bool = False) -> None:
        """Forget every row; ``append``: a chunk run ahead writes past the old rows in the arena."""
        if self.arena is not None:
            self._rebase(self._next_base(None, append), 0)
        self.size = 0
        self.env_infos = {}

    def _next_base(self, start: int | None, append: bool) -> int:
        """The arena row of row 0 once rows before ``start`` (``None``: all) are dropped: the
        front whenever safe, so the rows in use stay within about two calls' worth."""
        keep = 0 if start is None else max(self.size - start, 0)
        rows = self.arena_rows()
        if self.on_arena:
            if start is None:
                if not append or self.room <= self.base:
                    return 0
                b = self.base + self.size
            else:
                b = self.base + start  # the rows kept stay where they are
                if b > rows // 2 and (not append or keep + self.room <= self.base):
                    return 0  # moved to the front (a copy of the rows kept)
            if b + keep + self.room <= rows:
                return b
        return 0

    def next_arena_row(self, start: int | None) -> int:
        """Where the first chunk of the next call goes in the arena when sent before this call's
        rows are gathered (a stream's run-ahead), or -1 when it would overlap them."""
        if self.arena is None:
            return -1
        keep = 0 if start is None else max(self.size - start, 0)
        if not self.on_arena and keep + self.room > self.arena_rows():
            return -1
        p = self._next_base(start, True) + keep
        if p + self.room > self.arena_rows():
            return -1
        if self.on_arena and p < self.base + self.size and self.base < p + self.room:
            return -1
        return p

    def _rebase(self, base: int, keep: int, start: int = 0) -> None:
        """Put row 0 at arena row ``base``, with the ``keep`` rows from ``start`` moved there."""
        arena = self.arena
        if not self.on_arena and keep + self.room > self.arena_rows():
            return  # the rows kept do not fit: they stay in local memory
        if keep:

            def move(a: np.ndarray, old: np.ndarray) -> None:
                a[base : base + keep] = old[start : start + keep]  # overlap-safe in numpy

            if self.on_arena:
                if self.base + start != base:
                    tree_map(move, arena, tree_map(lambda a: a[self.base :], arena))
            else:
                tree_map(move, arena, self.obs)
        if not self.on_arena and self.obs is not None:
            self.spare = self.obs  # for the next call that outgrows the arena
        self.base = base
        self.on_arena = True
        self.obs = tree_map(lambda a: a[base:], arena)

    def _leave_arena(self, rows: int, obs: Tree) -> None:
        """The records outgrow the arena: the observation rows so far move to local memory (that
        of the last call that did, if large enough: no fresh pages)."""
        spare, self.spare = self.spare, None
        if spare is not None and len(tree_leaves(spare)[0]) < self.capacity:
            spare = None

        def local(like: np.ndarray, old: np.ndarray, arr: np.ndarray | None = None) -> np.ndarray:
            if arr is None or arr.shape[1:] != like.shape or arr.dtype != like.dtype:
                arr = np.zeros((self.capacity, *like.shape), dtype=like.dtype)
            arr[:rows] = old[:rows]
            return arr

        if spare is None:
            self.obs = tree_map(local, obs, self.obs)
        else:
            self.obs = tree_map(local, obs, self.obs, spare)
        self.on_arena = False

    def drop_before(self, start: int, append: bool = False) -> None:
        """Forget rows before ``start``; the rest move to the front (or stay put in the arena)."""
        n = self.size - start
        if start == 0:
            return
        keep = max(n, 0)
        in_arena = self.arena is not None and (
            self.on_arena or keep + self.room <= self.arena_rows()
        )
        if in_arena:
            self._rebase(self._next_base(start, append), keep, start)
        if n > 0:

            def shift(a: np.ndarray) -> None:
                a[:n] = a[start : self.size]  # numpy copies overlapping ranges correctly

            if not in_arena:
                tree_map(shift, self.obs)
            tree_map(shift, self.actions)
            shift(self.rewards)
            shift(self.versions)
            for column in self.agent_infos.values():
                shift(column)
        self.env_infos = {t - start: v for t, v in self.env_infos.items() if t >= start}
        self.size = max(n, 0)

    def next_row(self, obs: Tree, actions_like: Tree) -> int:
        """Index of a new row, growing the buffers (shaped like ``obs``/``actions_like``)."""
        t = self.size
        if t < self.capacity and (not self.on_arena or self.base + t < self.n_arena):
            self.size = t + 1  # the common step: a free row, no call
            return t
        return self.reserve(1, obs, actions_like)

    def reserve(self, n: int, obs: Tree, actions_like: Tree) -> int:
        """Index of the first of ``n`` new rows, growing the buffers as needed."""
        t = self.size
        while t + n > self.capacity:
            self._grow(obs, actions_like)
        if self.on_arena and t + n > self.arena_rows() - self.base:
            self._leave_arena(t, obs)
        self.size = t + n
        return t

    def cover(self, t: int, obs: Tree, actions_like: Tree) -> None:
        """Make row ``t`` exist (the envs of a non-lockstep worker each write their own rows)."""
        if t >= self.size:
            self.reserve(t + 1 - self.size, obs, actions_like)

    def _grow(self, obs: Tree, actions_like: Tree) -> None:
        new, old = max(64, 2 * self.capacity), self.capacity

        def grow(records: np.ndarray, like: np.ndarray) -> np.ndarray:
            arr = np.zeros((new, *like.shape), dtype=like.dtype)
            if old:
                arr[:old] = records[:old]
            return arr

        if not self.on_arena:
            self.obs = tree_map(grow, self.obs if old else obs, obs)
        self.actions = tree_map(grow, self.actions if old else actions_like, actions_like)
        self.rewards = grow(self.rewards, np.zeros(self.n_envs))
        self.versions = grow(self.versions, np.zeros(self.n_envs, dtype=np.int64))
        self.agent_infos = {k: grow(v, v[0]) for k, v in self.agent_infos.items()}
        self.capacity = new


class CarriedRows:
    """Per env, the row of its step still in flight when an ``obtain_fragments`` call without
    fixed shares ended (its observation, action, agent version and agent infos), for the next
    call to record again as its first row.

    Columns by env, each row copied out and put back with one indexing per column for all the
    envs a worker keeps: a call's end keeps thousands, and one object per env would cost a
    Python step each and be walked by the cyclic collector until the next call.
    """

    def __init__(self, n_envs: int) -> None:
        self.n_envs = n_envs
        self.held = np.zeros(n_envs, dtype=bool)
        self._some = False  # whether any is held: asked per reply batch, an array pass each
        self.obs: Tree = None
        self.actions: Tree = None
        self.versions = np.zeros(n_envs, dtype=np.int64)
        self.agent_infos: dict[str, np.ndarray] = {}

    def __bool__(self) -> bool:
        return self._some

    @property
    def count(self) -> int:
        """How many envs have a row kept."""
        return int(np.count_nonzero(self.held))

    def __contains__(self, i: int) -> bool:
        return bool(self.held[i])

    def keep(self, rows: Rows, t: np.ndarray | int, envs: np.ndarray | int) -> None:
        """Copy env ``envs[k]``'s row ``t[k]`` of ``rows`` for every ``k`` (or env ``envs``'s
        row ``t``)."""
        self.obs = _fit(self.obs, rows.obs, self.n_envs)
        self.actions = _fit(self.actions, rows.actions, self.n_envs)
        at = (t, envs)
        for mine, theirs in self._pairs(rows):
            _copy_rows(mine, envs, theirs, at)
        for key, column in rows.agent_infos.items():
            mine = self.agent_infos[key] = _by_env(self.agent_infos.get(key), column, self.n_envs)
            mine[envs] = column[at]
        self.held[envs] = True
        self._some = bool(self.held.any())

    def put_back(
        self, rows: Rows, t: np.ndarray | int, envs: np.ndarray | int, forget: bool = True
    ) -> None:
        """Put the rows kept of ``envs`` (each kept) back as env ``envs[k]``'s row ``t[k]`` of
        ``rows`` (which exists; or one env's, ``envs`` and ``t`` ints); ``forget``: they are
        kept no more (else until :meth:`drop`). An agent info column ``rows`` lacks, or of
        another shape (a replaced agent), is left out."""
        at = (t, envs)
        for mine, theirs in self._pairs(rows):
            _copy_rows(theirs, at, mine, envs)
        for key, mine in self.agent_infos.items():
            column = rows.agent_infos.get(key)
            if column is not None and column.shape[2:] == mine.shape[1:]:
                column[at] = mine[envs]
        if forget:
            self.drop(envs)

    def _pairs(self, rows: Rows) -> tuple[tuple[Tree, Tree], ...]:
        """The columns kept and those of ``rows`` they copy: observations, actions, versions."""
        return (self.obs, rows.obs), (self.actions, rows.actions), (self.versions, rows.versions)

    def drop(self, envs: Any) -> None:
        """Forget the rows kept of ``envs`` (an env, a mask or indices; kept or not)."""
        self.held[envs] = False
        if self._some:
            self._some = bool(self.held.any())


def _copy_rows(dst: Tree, into: Any, src: Tree, at: Any) -> None:
    """``dst[into] = src[at]`` leaf by leaf."""
    tree_map(lambda d, s: d.__setitem__(into, s[at]), dst, src)


def _fit(mine: Tree, theirs: Tree, n_envs: int) -> Tree:
    """:func:`_by_env` leaf by leaf (``mine`` is ``None`` before the first row is kept)."""
    if mine is None:
        return tree_map(lambda x: _by_env(None, x, n_envs), theirs)
    return tree_map(lambda m, x: _by_env(m, x, n_envs), mine, theirs)


def _by_env(mine: np.ndarray | None, theirs: np.ndarray, n_envs: int) -> np.ndarray:
    """``mine``, or a new column of ``n_envs`` rows shaped like ``theirs``' (time, env) rows
    if it is none or no longer fits them."""
    if mine is None or mine.shape[1:] != theirs.shape[2:] or mine.dtype != theirs.dtype:
        return np.zeros((n_envs, *theirs.shape[2:]), dtype=theirs.dtype)
    return mine


def put_row(dst: Tree, index: Any, src: Tree) -> None:
    """``dst[index] = src`` leaf by leaf (one assignment for a plain array)."""
    if isinstance(dst, np.ndarray):
        dst[index] = src
    else:
        tree_map(lambda d, s: d.__setitem__(index, s), dst, src)


def put_rows(dst: Tree, start: int, src: Tree, n: int) -> None:
    """``dst[start:start + n] = src[:n]`` leaf by leaf."""
    tree_map(lambda d, s: d.__setitem__(slice(start, start + n), s[:n]), dst, src)


def row_of(tree: Tree, index: int) -> Tree:
    """``tree[index]`` leaf by leaf."""
    if isinstance(tree, np.ndarray):
        return tree[index]
    return tree_map(lambda x: x[index], tree)


_PRESENT = "\x00present:"
"""Prefix of the agent-info columns that record where a key was present."""


def _column(rows: Rows, key: str, value: np.ndarray, per_env: tuple[int, ...]) -> np.ndarray:
    """The column of agent info ``key``, allocated with its presence column when the key first
    appears, and again when its per-env shape or dtype kind changed (only after the agent was
    replaced: see :class:`asyncsample._action_check.AgentOutputCheck`)."""
    store = rows.agent_infos
    column = store.get(key)
    if column is None or column.shape[2:] != per_env or column.dtype.kind != value.dtype.kind:
        column = np.zeros((rows.capacity, rows.n_envs, *per_env), dtype=value.dtype)
        store[key] = column
        store[_PRESENT + key] = np.zeros((rows.capacity, rows.n_envs), dtype=bool)
    return column


def _mark_present(rows: Rows, where: Any, agent_infos: dict[str, np.ndarray]) -> None:
    """Record at ``where`` which keys ``agent_infos`` has (in columns beside the values)."""
    for name, present in rows.agent_infos.items():
        if name.startswith(_PRESENT):
            present[where] = name[len(_PRESENT) :] in agent_infos


def store_agent_infos(
    rows: Rows, t: int, agent_infos: dict[str, np.ndarray], env: int | None = None
) -> None:
    """Write the (already checked) agent infos of step ``t`` into their columns: every env's
    row of each key, or with ``env`` only that env's (envs not stepped in lockstep). Called on
    every step once any agent info was seen, so a key absent at ``t`` is marked absent there."""
    where: Any = t if env is None else (t, env)
    for key, value in agent_infos.items():
        per_env = value.shape if env is not None else value.shape[1:]
        column = _column(rows, key, value, per_env)
        if env is not None and value.dtype == object and not value.ndim:
            column[where] = value[()]  # one object (a string, a ragged row): itself
        else:
            column[where] = value
    _mark_present(rows, where, agent_infos)


def store_agent_info_block(
    rows: Rows, start: int, n: int, agent_infos: dict[str, np.ndarray]
) -> None:
    """:func:`store_agent_infos` for ``n`` rows from ``start``, each key stacked over them."""
    block = slice(start, start + n)
    for key, value in agent_infos.items():
        _column(rows, key, value, value.shape[2:])[block] = value[:n]
    _mark_present(rows, block, agent_infos)


class Recorder:
    """The step rows and episode pieces of one worker's current call; the rows stay valid until
    the next call begins, because the plans handed to the sampler point into them."""

    def __init__(self, n_envs: int) -> None:
        self.rows = Rows(n_envs)
        self.pieces: list[Piece] = []
        self.piece_start = np.zeros(n_envs, dtype=np.int64)
        self.piece_position = np.zeros(n_envs, dtype=np.int64)
        self.completed_steps = 0  # of the episodes completed (not fragments) since collected
        # Per env, the next row it writes when its envs are not in lockstep (_env_tasks);
        # None: every env writes row rows.size.
        self.cursor: np.ndarray | None = None
        self._carry_from: int | None = None

    def positions(self) -> np.ndarray | int:
        """Per env (or for all, in lockstep), the row its next step goes to."""
        return self.rows.size if self.cursor is None else self.cursor

    def begin(self, resume: Resume, lengths: np.ndarray, append: bool = False) -> None:
        """Start a call's records (``lengths``: each env's episode's steps so far; ``append``: as
        in :meth:`Rows.clear`); with :attr:`Resume.EPISODES` the running episodes keep theirs."""
        if resume is Resume.EPISODES and self._carry_from is not None:
            # Episodes left running keep their steps: move their rows to the front.
            self.rows.drop_before(self._carry_from, append)
            self.piece_start -= self._carry_from
            if self.cursor is not None:
                self.cursor -= self._carry_from
        else:
            self.rows.clear(append)
            self.piece_start[:] = 0
            self.piece_position[:] = lengths
            if self.cursor is not None:
                self.cursor[:] = 0
        self._carry_from = None
        self.pieces = []
        self.completed_steps = 0

    def next_arena_row(self) -> int:
        """:meth:`Rows.next_arena_row` for the call after this one."""
        return self.rows.next_arena_row(self._carry_from)

    def end(self, leave: Resume) -> None:
        """End a call; with :attr:`Resume.EPISODES` the running episodes' rows are kept."""
        self._carry_from = int(self.piece_start.min()) if leave is Resume.EPISODES else None

    def carried_from(self) -> int | None:
        """The first row the last call left for the next (:attr:`Resume.EPISODES`), or ``None``."""
        return self._carry_from

    def carry_all(self) -> None:
        """The next call carries every row recorded now (a resume put a stream's rows back)."""
        self._carry_from = 0

    def start_episodes(self, mask: np.ndarray) -> None:
        """Envs in ``mask`` start a new episode at the next row."""
        self.piece_start[mask] = self.rows.size if self.cursor is None else self.cursor[mask]
        self.piece_position[mask] = 0

    def close_piece(
        self, env: int, stop: int, end: StepType | None, last: Tree, info: dict[str, Any]
    ) -> None:
        """Record rows ``piece_start[env]:stop`` of ``env`` as a piece ending with ``end``."""
        start = int(self.piece_start[env])
        self.pieces.append(Piece(env, start, stop, int(self.piece_position[env]), end, last, info))
        if end is not None:
            self.completed_steps += stop - start
        self.piece_start[env] = stop

    def open_steps(self) -> int:
        """Transitions of the running episodes recorded this call (not rows a restart dropped)."""
        return int(np.maximum(self.positions() - self.piece_start, 0).sum())

    def collect(self, like_obs: Tree, like_actions: Tree) -> Plan:
        """The plan of the pieces recorded since the last collection; forgets them. Envs not in
        lockstep: in the order lockstep would have closed them, not wall-clock order."""
        pieces, rows = self.pieces, self.rows
        if self.cursor is not None:
            pieces.sort(key=lambda p: (p.stop, p.env))
        self.pieces = []
        self.completed_steps = 0
        lengths = [p.stop - p.start for p in pieces]
        counts = np.array(lengths, dtype=np.int64)
        # Each piece's rows start..stop, without an arange per piece.
        shift = np.array([p.start for p in pieces], dtype=np.int64) - (np.cumsum(counts) - counts)
        t_idx = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(shift, counts)
        e_idx = np.repeat(np.array([p.env for p in pieces], dtype=np.int64), counts)
        step_types = np.full(len(t_idx), StepType.MID, dtype=np.uint8)
        offset = 0
        for p, n in zip(pieces, lengths):
            if p.position == 0:  # FIRST at an episode's start, its end type last
                step_types[offset] = StepType.FIRST
            if p.end is not None:
                step_types[offset + n - 1] = p.end
            offset += n
        return Plan(
            obs=rows.obs,
            actions=rows.actions,
            rewards=rows.rewards if rows.capacity else None,
            versions=rows.versions if rows.capacity else None,
            agent_infos={k: v for k, v in rows.agent_infos.items() if not k.startswith(_PRESENT)},
            agent_info_masks={  # of the keys missing on some of the plan's transitions
                name[len(_PRESENT) :]: present
                for name, present in rows.agent_infos.items()
                if name.startswith(_PRESENT) and not present[t_idx, e_idx].all()
            },
            env_infos=dict(rows.env_infos),
            like_obs=like_obs,
            like_actions=like_actions,
            rows=t_idx,
            envs=e_idx,
            lengths=counts,
            step_types=step_types,
            last_observations=[p.last_observation for p in pieces],
            episode_infos=[p.episode_info for p in pieces],
        )
