"""The episode engine, the same for every inference mode and backend: :class:`Episodes` (a
worker's bookkeeping, the one place where episodes end), :class:`StopRule` (where a worker's part
of a call stops) and :func:`run_part`, which drives the mode's :class:`Stepper`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import time
import weakref
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass
from functools import reduce
from operator import add
from typing import Any, NamedTuple, Protocol

import numpy as np

from asyncsample._assembly import Plan
from asyncsample._memory import BatchMemory
from asyncsample._quotas import FreeQuota, LaneRound, SharedQuota
from asyncsample._recorder import (
    CarriedRows,
    Recorder,
    Resume,
    put_rows,
    store_agent_info_block,
    store_agent_infos,
)
from asyncsample._step_fields import StepFields
from asyncsample._tree import Tree, row_copy, tree_leaves, tree_map
from asyncsample.batch import StepType

__all__ = [
    "CallMode",
    "Continuity",
    "Episodes",
    "FinishedEpisode",
    "Part",
    "RecordStep",
    "StepStepper",
    "Stepper",
    "StopRule",
    "Transition",
    "run_part",
    "share_of",
]


class CallMode(enum.IntEnum):
    """The three call modes: what a worker's share counts and where its part stops."""

    SAMPLES = 0
    """Steps of completed episodes, until they reach the share."""
    EPISODES = 1
    """A fixed number of complete episodes per env; an env is stepped no more once it has them."""
    FRAGMENTS = 2
    """A number of worker steps; episodes still running become fragments."""


class Continuity(enum.Enum):
    """Where a worker's episodes stand between and during calls (:attr:`Episodes.state`): the
    next call continues only from ``IDLE`` or (a stream's next round) ``RAN_AHEAD``."""

    IDLE = "idle"
    """The last call ended (:meth:`Episodes.end`)."""
    IN_CALL = "in call"
    """A call runs; still so at the next :meth:`Episodes.begin` when it was cancelled midway."""
    BROKEN = "broken"
    """The env host failed: it is rebuilt before the next step, in this call or the next."""
    RAN_AHEAD = "ran ahead"
    """A chunk past the end of the last call may have run (a stream's run-ahead)."""
    TAKING_OVER = "taking over"
    """A call began that may take that chunk over; its stepper settles it (then ``IN_CALL``)."""


_CONTINUABLE = (Continuity.IDLE, Continuity.IN_CALL)


class FinishedEpisode(NamedTuple):
    """Return, length and agent version of one completed episode (for the call's statistics)."""

    ret: float
    length: int
    agent_version: int


@dataclass
class Transition:
    """One worker step, as :meth:`Worker.process_transition` sees it (inactive rows are stale)."""

    observations: Tree
    actions: Tree
    rewards: np.ndarray
    next_observations: Tree
    terminated: np.ndarray
    truncated: np.ndarray
    env_infos: list[dict[str, Any]] | None
    agent_infos: dict[str, np.ndarray]
    active: np.ndarray


def transition_at(
    episodes: Episodes,
    t: int,
    next_observations: Tree,
    terminated: np.ndarray,
    truncated: np.ndarray,
    env_infos: list[dict[str, Any]] | None,
    agent_infos: dict[str, Any],
) -> Transition:
    """The :class:`Transition` of row ``t`` of ``episodes``' records (copies of the flags)."""
    rows = episodes.recorder.rows
    return Transition(
        observations=tree_map(lambda x: x[t], rows.obs),
        actions=tree_map(lambda x: x[t], rows.actions),
        rewards=rows.rewards[t],
        next_observations=next_observations,
        terminated=terminated.copy(),
        truncated=truncated.copy(),
        env_infos=env_infos,
        agent_infos=agent_infos,
        active=episodes.active.copy(),
    )


@dataclass
class StopRule:
    """Where one worker's part of a call stops.

    Attributes:
        mode: the call mode.
        share: the worker's share (``SAMPLES``/``FRAGMENTS``: transitions).
        need: ``SAMPLES``: steps of completed episodes still missing from the share.
        steps: ``FRAGMENTS``: worker steps still to take.
        episodes_left: ``EPISODES``: per env, episodes it must still complete.
        env_steps: ``FRAGMENTS`` on the lanes (:meth:`start_envs`): per env, steps to take.
    """

    mode: CallMode
    share: int = 0
    need: int = 0
    steps: int = 0
    episodes_left: np.ndarray | None = None
    env_steps: np.ndarray | None = None

    @classmethod
    def for_call(cls, mode: CallMode, share: int, n_envs: int) -> StopRule:
        """The rule of a worker's ``share`` of a call (``EPISODES``: its episodes)."""
        if mode is CallMode.EPISODES:
            left = np.array(
                [share // n_envs + (i < share % n_envs) for i in range(n_envs)], dtype=np.int64
            )
            return cls(mode, share, episodes_left=left)
        if mode is CallMode.FRAGMENTS:
            return cls(mode, share, steps=math.ceil(share / n_envs))
        return cls(mode, share, need=share)

    def more(self, active: np.ndarray) -> bool:
        """Whether the worker takes another step (checked before every step)."""
        mode = self.mode
        if mode is CallMode.SAMPLES:
            return self.need > 0
        if mode is CallMode.FRAGMENTS:
            return self.steps > 0
        return bool(active.any())

    def start_envs(self, n_envs: int, lacking: int | None = None) -> int:
        """Each env asks :meth:`env_more` on its own (the lanes); ``FRAGMENTS``: the steps each
        takes (for ``lacking`` more transitions, if given), for :meth:`took`."""
        if self.mode is not CallMode.FRAGMENTS:
            return 0
        steps = self.steps if lacking is None else math.ceil(lacking / n_envs)
        self.env_steps = np.full(n_envs, max(steps, 0), dtype=np.int64)
        return steps

    def env_more(
        self, i: int, active: np.ndarray, may_stop: Callable[[], bool] | None = None
    ) -> bool:
        """Whether env ``i`` takes another step; ``may_stop``: the shared quota's."""
        mode = self.mode
        if mode is CallMode.EPISODES:
            return bool(active[i])
        if mode is CallMode.FRAGMENTS and self.env_steps[i] <= 0:  # type: ignore[index]
            return False
        if may_stop is not None:
            return not may_stop()
        return mode is CallMode.FRAGMENTS or self.need > 0

    def ended(self, envs: np.ndarray, steps: int, active: np.ndarray) -> bool:
        """``envs``' episodes ended (``steps`` steps in all); whether an env was made inactive."""
        if self.mode is CallMode.SAMPLES:
            self.need -= steps
            return False
        left = self.episodes_left
        if left is None:
            return False
        left[envs] -= 1
        spent = envs[left[envs] <= 0]
        if len(spent):
            active[spent] = False
            return True
        return False

    def start_active(self, n_envs: int) -> np.ndarray:
        """Per env, whether a call under this rule steps it from the start."""
        left = self.episodes_left
        return np.ones(n_envs, dtype=bool) if left is None else left > 0

    def took(self, steps: int) -> None:
        """The worker took ``steps`` more steps."""
        if self.mode is CallMode.FRAGMENTS:
            self.steps -= steps

    def limited(self, lacking: int, n_envs: int) -> StopRule:
        """A copy that stops once ``lacking`` more transitions are in (``fraction_samples``)."""
        if self.mode is CallMode.FRAGMENTS:
            return StopRule(self.mode, self.share, steps=math.ceil(lacking / n_envs))
        return StopRule(self.mode, self.share, need=lacking)

    def copy(self) -> StopRule:
        """An independent copy (what a chunk request carries)."""
        left = None if self.episodes_left is None else self.episodes_left.copy()
        return StopRule(self.mode, self.share, self.need, self.steps, left)

    def recovered(self, completed_steps: int, n_envs: int) -> None:
        """After a restart dropped the fragments in progress, redo their steps (``FRAGMENTS``)."""
        if self.mode is CallMode.FRAGMENTS:
            self.steps = math.ceil(max(self.share - completed_steps, 0) / n_envs)


RecordStep = Callable[
    [int, int, dict[str, np.ndarray], list[dict[str, Any]] | None, np.ndarray], None
]
"""``record(j, t, agent_infos, env_infos, done)``: step ``j`` of a chunk became row ``t``."""


class Episodes:
    """One worker's episodes: bookkeeping, the current call's rule, and its records.

    Attributes:
        lengths, returns, episode_info: per env, of the episode in progress.
        active: per env, whether it is stepped; ``everyone``: all are.
        needs_reset: per env, whether the next :meth:`Worker.start_episode` resets it.
        recorder, rule: the step rows and pieces of the current call, where it stops.
        finished: every episode completed since the sampler read it.
        state: where the episodes stand between and during calls (:class:`Continuity`).
    """

    def __init__(self, worker: int, n_envs: int) -> None:
        self.worker = worker
        self.n_envs = n_envs
        self.lengths = np.zeros(n_envs, dtype=np.int64)
        self.returns = np.zeros(n_envs, dtype=np.float64)
        self.done = np.zeros(n_envs, dtype=bool)  # scratch of the per-step path
        self.active = np.ones(n_envs, dtype=bool)
        self.everyone = True
        self.needs_reset = np.ones(n_envs, dtype=bool)
        self.fresh = np.ones(n_envs, dtype=bool)  # built, never reset since (a checkpoint reads it)
        self.episode_info: list[dict[str, Any]] = [{} for _ in range(n_envs)]
        self.recorder = Recorder(n_envs)
        self.rule: StopRule | None = None
        self.finished: list[FinishedEpisode] = []
        self.state = Continuity.IDLE
        self.episode_timeout: float | None = None  # seconds before an episode is cut
        self.deadlines = np.full(n_envs, np.inf)  # per env, in ``clock`` time
        self.clock: Callable[[], float] = time.monotonic  # the loop's, on the lanes
        self.ends = [0, 0, 0]  # episodes ended so far: terminated, truncated, cut at a deadline
        self.dropped_steps = 0  # steps of episodes abandoned unfinished so far
        self.started_at: list[float] | None = None  # metrics on: per env, when its episode began
        self.durations: list[float] = []  # seconds of the episodes ended since the metrics read
        # Per env, the row of its step still in flight when an obtain_fragments call without
        # fixed shares ended (the lanes): the next call records it again as its first row.
        self.carried_rows = CarriedRows(n_envs)
        # Per env, the observation its fragment ends at where the step buffers hold a later one
        # (a run of steps split at the quota: its rest opens the next call).
        self.cut_obs: dict[int, Any] = {}
        self._cut_memory = BatchMemory(keep=3)  # the observations fragments end at, per call

    # -- a call ---------------------------------------------------------------------------------

    def begin(self, resume: Resume, rule: StopRule | None, *, ahead: bool = False) -> None:
        """Prepare a call continuing ``resume`` and stopping at ``rule`` (``ahead``: a stream's)."""
        state = self.state
        ran_ahead = state is Continuity.RAN_AHEAD or state is Continuity.TAKING_OVER
        append = ran_ahead and ahead
        if state is not Continuity.IDLE and (state is not Continuity.RAN_AHEAD or not ahead):
            # The previous call ended midway, or the envs moved past its end: nothing may leak.
            resume = Resume.NOTHING
            self.needs_reset[:] = True
            ran_ahead = False
        if resume is Resume.NOTHING:
            self.needs_reset |= self.lengths > 0
        if state is not Continuity.BROKEN:  # a broken host stays so until it is rebuilt
            self.state = Continuity.TAKING_OVER if ran_ahead else Continuity.IN_CALL
        self.recorder.begin(resume, self.lengths, append)
        self.rule = rule
        self.active[:] = True if rule is None else rule.start_active(self.n_envs)
        self.everyone = bool(self.active.all())

    def next_start(self, resume: Resume, rule: StopRule) -> tuple[np.ndarray, np.ndarray] | None:
        """Per env, the rows a call continuing ``resume`` under ``rule`` starts with, and whether
        it is stepped; ``None`` if it resets an env first (the records are left intact)."""
        if self.state not in _CONTINUABLE or self.needs_reset.any():
            return None
        if resume is Resume.NOTHING and bool((self.lengths > 0).any()):
            return None
        recorder = self.recorder
        if resume is Resume.EPISODES:  # their rows move to the front: the counts stay
            counts = (recorder.rows.size - recorder.piece_start).astype(np.int64)
        else:
            counts = np.zeros(self.n_envs, dtype=np.int64)
        return counts, rule.start_active(self.n_envs)

    def end(self, leave: Resume) -> None:
        """End a call, leaving what ``leave`` says running (the records stay till the next call)."""
        self.recorder.end(leave)
        if leave is Resume.NOTHING:
            self.needs_reset |= self.lengths > 0
        self.rule = None
        self.active[:] = True
        self.everyone = True
        if self.state is Continuity.IN_CALL:
            self.state = Continuity.IDLE
        elif self.state is Continuity.TAKING_OVER:  # never settled: the chunk is still ahead
            self.state = Continuity.RAN_AHEAD

    def recovered(self) -> int:
        """The host was rebuilt: episodes in progress are dropped; returns how many."""
        dropped = int(np.count_nonzero(self.lengths))
        self.dropped_steps += int(self.lengths.sum())
        self.needs_reset[:] = True
        self.fresh[:] = True
        self.lengths[:] = 0
        self.returns[:] = 0.0
        if self.rule is not None:
            self.rule.recovered(self.recorder.completed_steps, self.n_envs)
        return dropped

    def count(self, fragments: bool) -> int:
        """Transitions the worker would return if it stopped now."""
        recorder = self.recorder
        return recorder.completed_steps + (recorder.open_steps() if fragments else 0)

    def collect(self, current_obs: Tree, like_actions: Tree, *, fragments: bool = False) -> Plan:
        """Where the call's pieces lie; ``fragments``: running episodes cut at ``current_obs``."""
        recorder = self.recorder
        if fragments:
            stops = np.broadcast_to(recorder.positions(), (self.n_envs,)).tolist()
            starts = recorder.piece_start
            cut = [i for i in range(self.n_envs) if self.active[i] and stops[i] > starts[i]]
            copied = self._cut_rows([i for i in cut if i not in self.cut_obs], current_obs)
            for i in cut:
                current = self.cut_obs.get(i)
                if current is None:
                    current = copied[i]
                recorder.close_piece(i, stops[i], None, current, self.episode_info[i])
                recorder.piece_position[i] = self.lengths[i]
        self.cut_obs.clear()
        return recorder.collect(current_obs, like_actions)

    def _cut_rows(self, envs: list[int], obs: Tree) -> dict[int, Tree]:
        """Rows ``envs`` of ``obs`` copied, every leaf's at once into one block of memory that
        earlier calls let go (one fresh 164 KB row copy costs its 41 page faults, call after
        call)."""
        if not envs:
            return {}
        index = np.asarray(envs)

        def numeric(x: Any) -> bool:
            return type(x) is np.ndarray and not x.dtype.hasobject

        outs = iter(
            self._cut_memory.empty_many(
                [((len(envs), *x.shape[1:]), x.dtype) for x in tree_leaves(obs) if numeric(x)]
            )
        )

        def leaf(x: Any) -> Any:
            if not numeric(x):  # text and object leaves: each row its own copy
                return [row_copy(x, i) for i in envs]
            return np.take(x, index, axis=0, out=next(outs), mode="clip")

        rows = tree_map(leaf, obs)
        return {i: tree_map(lambda r, k=k: r[k], rows) for k, i in enumerate(envs)}

    # -- episodes -------------------------------------------------------------------------------

    def fresh_info(self, info: dict[str, Any], env: int, version: int) -> dict[str, Any]:
        """The info of an episode of ``env`` starting under agent ``version``."""
        return {**info, "worker": self.worker, "env": env, "agent_version": version}

    def stamp_unstarted(self, version: int, stepping: Collection[int] = ()) -> None:
        """Episodes without a step start under ``version`` (except the envs ``stepping`` now)."""
        for i, length in enumerate(self.lengths.tolist()):  # a list: cheaper than numpy's
            if length == 0 and i not in stepping:
                self.episode_info[i] = self.fresh_info(self.episode_info[i], i, version)

    def started(self, mask: np.ndarray, infos: Mapping[int, dict[str, Any]]) -> None:
        """The envs in ``mask`` were reset, with reset ``infos`` by env."""
        self.needs_reset &= ~mask
        self.fresh &= ~mask
        envs = np.flatnonzero(mask).tolist()
        starts = self.started_at
        if starts is not None:  # metrics on: scalar reads per reset env (a lane resets one)
            lengths, now = self.lengths, time.perf_counter()
            for i in envs:
                self.dropped_steps += int(lengths[i])
                starts[i] = now
        self.lengths[mask] = 0
        self.returns[mask] = 0.0
        if self.episode_timeout is not None:
            self.deadlines[mask] = self.clock() + self.episode_timeout
        for i in envs:
            self.episode_info[i] = dict(infos.get(i, {}))  # empty infos do not travel
        if self.carried_rows:  # a row kept for a step of the env's last episode is no more
            self.carried_rows.drop(mask)
        self.recorder.start_episodes(mask)

    def close_episodes(
        self,
        envs: np.ndarray,
        t: int,
        terminated: np.ndarray,
        final_obs: Tree,
        reset_infos: Mapping[int, dict[str, Any]],
        version: int,
    ) -> None:
        """The episodes of ``envs`` ended at row ``t`` (``terminated`` or truncated): cut and
        count them, start the next ones (``reset_infos`` by env) under agent ``version``."""
        recorder = self.recorder
        lengths, returns = self.lengths, self.returns
        steps = recorder.completed_steps
        now = time.perf_counter() if self.started_at is not None else 0.0
        flat = type(final_obs) is np.ndarray and final_obs.dtype != object
        for i in envs.tolist():
            last = _row_copied(final_obs, i, flat)
            ret, length = float(returns[i]), int(lengths[i])
            returns[i], lengths[i] = 0.0, 0
            self._close(i, t + 1, bool(terminated[i]), last, reset_infos, version, ret, length, now)
        self._closed(envs, recorder.completed_steps - steps)

    def _close(
        self,
        i: int,
        stop: int,
        terminated: bool,
        last: Tree,
        reset_infos: Mapping[int, dict[str, Any]],
        version: int,
        ret: float,
        length: int,
        now: float,
    ) -> None:
        """Env ``i``'s episode (``ret``, ``length``) ended before row ``stop`` with ``last``;
        its next one starts under ``version`` (``now``: the time, metrics on)."""
        info = self.episode_info[i]
        self.ends[0 if terminated else 2 if info.get("deadline") else 1] += 1
        starts = self.started_at
        if starts is not None:
            self.durations.append(now - starts[i])
            starts[i] = now
        end = StepType.TERMINAL if terminated else StepType.TIMEOUT
        recorder = self.recorder
        recorder.close_piece(i, stop, end, last, info)
        self.finished.append(FinishedEpisode(ret, length, int(info["agent_version"])))
        self.episode_info[i] = self.fresh_info(reset_infos.get(i, {}), i, version)
        recorder.piece_position[i] = 0

    def _closed(self, envs: np.ndarray, steps: int) -> None:
        """The episodes of ``envs`` (``steps`` steps in all) were closed: their next ones'
        deadlines, the call's rule."""
        if self.episode_timeout is not None:  # the next episodes start now (autoreset)
            self.deadlines[envs] = self.clock() + self.episode_timeout
        rule = self.rule
        if rule is not None:
            if rule.ended(envs, steps, self.active):
                self.everyone = False

    def drop_env(self, i: int) -> int:
        """Drop env ``i``'s episode in progress (it is reset next); the steps it had recorded."""
        recorder = self.recorder
        cursor = recorder.cursor
        assert cursor is not None
        recorded = int(cursor[i] - recorder.piece_start[i])
        recorder.piece_start[i] = cursor[i]
        recorder.piece_position[i] = 0
        self.carried_rows.drop(i)  # (the row of its step in flight, if one was kept)
        self.dropped_steps += int(self.lengths[i])
        self.needs_reset[i] = True
        self.lengths[i] = 0
        self.returns[i] = 0.0
        self.deadlines[i] = np.inf
        return recorded

    def replay(
        self,
        chunk: StepFields,
        steps: int,
        agent_infos: dict[str, np.ndarray] | list[tuple[int, dict[str, np.ndarray]]],
        step_infos: Mapping[int, tuple[list[dict[str, Any]] | None, dict[int, dict[str, Any]]]],
        version: int,
        like: tuple[Tree, Tree],
        record: RecordStep | None = None,
        obs_row: int = -1,
    ) -> None:
        """Turn ``steps`` steps of ``chunk`` run elsewhere into records and episodes; episodes
        that start in it, or had not taken a step before it, run under ``version``.

        Args:
            agent_infos: stacked over the steps, or ``(step, infos)`` for the steps with any.
            step_infos: by step, ``(env_infos, reset_infos)`` where either is non-empty.
            like: observations and actions shaped like one row (to grow the records).
            record: called after each step, if given.
            obs_row: the arena row the host wrote ``chunk.obs`` to (not copied again), or -1.
        """
        self.stamp_unstarted(version)
        if steps <= 0:
            return
        rows = self.recorder.rows
        t0 = rows.reserve(steps, *like)
        if obs_row < 0 or not rows.on_arena or rows.base + t0 != obs_row:
            put_rows(rows.obs, t0, chunk.obs, steps)
        put_rows(rows.actions, t0, chunk.actions, steps)
        rewards = chunk.rewards[:steps]
        rows.rewards[t0 : t0 + steps] = rewards
        rows.versions[t0 : t0 + steps] = version
        if isinstance(agent_infos, dict):
            if agent_infos or rows.agent_infos:
                store_agent_info_block(rows, t0, steps, agent_infos)
        elif agent_infos or rows.agent_infos:
            listed = dict(agent_infos)
            for j in range(steps):
                store_agent_infos(rows, t0 + j, listed.get(j, {}))
        for j, (env_infos, _) in step_infos.items():
            if env_infos is not None:
                rows.env_infos[t0 + j] = env_infos
        flags = chunk.terminated[:steps] | chunk.truncated[:steps]
        rule = self.rule
        if record is None and (rule is None or rule.episodes_left is None):
            self._replay_ends(chunk, steps, flags, rewards, t0, step_infos, version)
            return
        events = np.flatnonzero(flags.any(axis=1)).tolist()
        if record is not None:
            events = list(range(steps))
        no_infos: tuple[None, dict[int, dict[str, Any]]] = (None, {})
        j0 = 0
        for j in events:
            self._advance(rewards[j0 : j + 1])
            j0 = j + 1
            done = flags[j] if self.everyone else flags[j] & self.active
            if record is not None:
                info_j = (
                    {k: v[j] for k, v in agent_infos.items()}
                    if isinstance(agent_infos, dict)
                    else dict(agent_infos).get(j, {})
                )
                record(j, t0 + j, info_j, step_infos.get(j, no_infos)[0], done)
            ended = np.flatnonzero(done)
            if len(ended):
                finals = chunk.final_obs
                final = (
                    finals[j]
                    if type(finals) is np.ndarray
                    else tree_map(lambda x, j=j: x[j], finals)
                )
                reset_infos = step_infos.get(j, no_infos)[1]
                self.close_episodes(ended, t0 + j, chunk.terminated[j], final, reset_infos, version)
        self._advance(rewards[j0:steps])

    def _replay_ends(
        self,
        chunk: StepFields,
        steps: int,
        flags: np.ndarray,
        rewards: np.ndarray,
        t0: int,
        step_infos: Mapping[int, tuple[list[dict[str, Any]] | None, dict[int, dict[str, Any]]]],
        version: int,
    ) -> None:
        """:meth:`replay`'s episode ends and sums in one pass, where no end makes an env
        inactive (no rule of episodes per env): each episode's return summed over its env's
        column in Python floats (the same float64 additions, in the same order, as step by
        step) and the episode closed, in the order the episodes ended."""
        active = None if self.everyone else self.active
        js, ends = np.nonzero(flags if active is None else flags & active)
        if not len(js):
            self._advance(rewards)
            return
        columns = rewards.T.tolist()
        returns, lengths = self.returns.tolist(), self.lengths.tolist()
        start = [0] * self.n_envs
        finals, terminated = chunk.final_obs, chunk.terminated[:steps].tolist()
        flat = type(finals) is np.ndarray and finals.dtype != object
        now = time.perf_counter() if self.started_at is not None else 0.0
        completed = self.recorder.completed_steps
        no_infos: tuple[None, dict[int, dict[str, Any]]] = (None, {})
        for j, i in zip(js.tolist(), ends.tolist()):
            total = reduce(add, columns[i][start[i] : j + 1], returns[i])  # in order
            last = _row_copied(finals, (j, i), flat)
            length = lengths[i] + j + 1 - start[i]
            returns[i], lengths[i], start[i] = 0.0, 0, j + 1
            reset_infos = step_infos.get(j, no_infos)[1]
            self._close(
                i, t0 + j + 1, terminated[j][i], last, reset_infos, version, total, length, now
            )
        stepped = range(self.n_envs) if active is None else np.flatnonzero(active).tolist()
        for i in stepped:  # what follows each env's last end in the chunk
            returns[i] = reduce(add, columns[i][start[i] : steps], returns[i])
            lengths[i] += steps - start[i]
        self.returns[:] = returns
        self.lengths[:] = lengths
        self._closed(ends, self.recorder.completed_steps - completed)

    def late(self) -> np.ndarray:
        """The envs whose episode in progress passed its deadline (``episode_timeout``)."""
        late = (self.deadlines <= self.clock()) & (self.lengths > 0)
        if not self.everyone:
            late &= self.active
        return np.flatnonzero(late)

    def _advance(self, rewards: np.ndarray) -> None:
        """The active envs took ``len(rewards)`` steps (the same float sums as step by step)."""
        n = len(rewards)
        if n == 0:
            return
        if self.everyone:
            self.lengths += n
            if n == 1:
                self.returns += rewards[0]
            else:
                stacked = np.concatenate([self.returns[None], rewards])
                self.returns[:] = np.add.accumulate(stacked, axis=0)[-1]
            return
        active = self.active
        self.lengths[active] += n
        stacked = np.concatenate([self.returns[active][None], rewards[:, active]])
        self.returns[active] = np.add.accumulate(stacked, axis=0)[-1]


@dataclass
class Part:
    """One worker's part of a call, as the mode's stepper sees it.

    Attributes:
        resume, leave: what it continues from the previous call, and leaves for the next.
        quota: the call's shared quota (``fraction_samples < 1``), if any.
        then: a stream round follows, continuing what this one leaves (a mode may start it).
        lane_round: the stream round this part is in, on the lanes.
        pool: the call's quota without fixed shares (``obtain_fragments`` on the lanes).
        starters: the workers numbered below it have a part in this call (the others no share).
    """

    resume: Resume
    leave: Resume
    quota: SharedQuota | None = None
    then: Resume | None = None
    lane_round: LaneRound | None = None
    pool: FreeQuota | None = None
    starters: int = 0


class Stepper(Protocol):
    """How a worker's envs move: ``start`` resets what needs it; ``advance`` takes (and returns)
    at least a step, never past ``rule`` or ``lacking`` more transitions; ``run``: to ``rule``."""

    async def start(self) -> None: ...

    async def advance(self, rule: StopRule, lacking: int | None = None) -> int: ...

    async def run(self, rule: StopRule) -> None: ...


class StepperWorker(Protocol):
    """A worker, as :class:`StepStepper` and :func:`run_part` see it."""

    worker_number: int
    n_envs: int
    episodes: Episodes

    async def start_episode(self) -> None: ...

    async def step_episode(self) -> bool: ...

    def current_plan(self, *, fragments: bool) -> Plan: ...


class StepStepper:
    """One env step per request: garage's ``start_episode``/``step_episode`` of the worker."""

    def __init__(self, worker: StepperWorker) -> None:
        self.worker = worker

    async def start(self) -> None:
        """Reset the envs that need it."""
        await self.worker.start_episode()

    async def advance(self, rule: StopRule, lacking: int | None = None) -> int:
        """One step of every active env."""
        await self.worker.step_episode()
        return 1

    async def run(self, rule: StopRule) -> None:
        """Step until ``rule`` stops (the per-step loop: no await besides the step)."""
        step, more, active = self.worker.step_episode, rule.more, self.worker.episodes.active
        if rule.mode is CallMode.FRAGMENTS:
            took = rule.took
            while more(active):
                await step()
                took(1)
        else:
            while more(active):
                await step()


async def run_part(
    worker: StepperWorker,
    stepper: Stepper,
    leave: Resume,
    quota: SharedQuota | None = None,
) -> Plan:
    """Run the worker's part of the call begun with :meth:`Episodes.begin` (a retry resumes
    it); its plan. With a shared ``quota``: a unit at a time, until it may stop."""
    episodes = worker.episodes
    rule = episodes.rule
    assert rule is not None
    fragments = rule.mode is CallMode.FRAGMENTS
    await stepper.start()
    if quota is None:
        await stepper.run(rule)
    else:
        w = worker.worker_number
        quota.report(w, episodes.count(fragments))
        while not quota.may_stop(w):
            await stepper.advance(rule, quota.lacking(w))
            quota.report(w, episodes.count(fragments))
    async with _turn():  # the workers' collections one per turn of the loop, not all in one
        plan = worker.current_plan(fragments=fragments)
    if fragments:
        leave = Resume.FRAGMENTS
    elif rule.mode is CallMode.EPISODES:
        leave = Resume.NOTHING
    episodes.end(leave)
    return plan


_TURNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)


@contextlib.asynccontextmanager
async def _turn() -> AsyncIterator[None]:
    """One worker at a time, then a turn of the loop before the next: the workers of a call
    end together (its quota is in), and their collections back to back held the caller's loop
    for 150 ms at 10,000 envs (a web service beside the sampler waits that long)."""
    loop = asyncio.get_running_loop()
    lock = _TURNS.get(loop)
    if lock is None:
        lock = _TURNS[loop] = asyncio.Lock()
    async with lock:
        yield
        await asyncio.sleep(0)


def share_of(quota: int, n_workers: int, worker: int) -> int:
    """Worker ``worker``'s share of ``quota``: an even split, the remainder to the first ones."""
    return quota // n_workers + (worker < quota % n_workers)


def _row_copied(tree: Tree, index: Any, flat: bool) -> Tree:
    """Row ``index`` of every leaf of ``tree`` copied (``flat``: ``tree`` is one numeric array)."""
    return tree[index].copy() if flat else tree_map(lambda x: row_copy(x, index), tree)
