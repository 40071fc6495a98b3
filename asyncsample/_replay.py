"""The episode ends of a chunk replayed column-wise (:meth:`asyncsample._engine.Episodes.replay`).

A chunk run in a host comes back as rows ``(steps, n_envs)``. Replayed step by step, each row
where an episode ends costs a returns update of every env and a call that closes the episodes;
with every env stepped, and a rule whose episode ends never stop an env, the ends are found in one
pass instead and each env's return is summed once per episode. The sums are the step-by-step
ones: float64 additions in step order, from the return carried in (an env's first episode of the
chunk) or from ``0.0`` (the ones that start in it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from asyncsample._tree import row_copy, tree_map
from asyncsample.batch import StepType

__all__ = ["replay_ends"]


class _Chunk(Protocol):
    """What is read of a chunk's records (see ``asyncsample._engine.ChunkRecords``)."""

    final_obs: Any
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray


def _sum_from_zero(column: list[float]) -> float:
    """``0.0`` plus each value in turn (float64, as numpy adds a float64 row)."""
    total = 0.0
    for value in column:
        total += value
    return total


def replay_ends(
    episodes: Any,
    chunk: _Chunk,
    steps: int,
    t0: int,
    step_infos: Mapping[int, tuple[Any, dict[int, dict[str, Any]]]],
    version: int,
    finished_episode: Callable[[float, int, int], Any],
) -> None:
    """Close the episodes that end in the first ``steps`` rows of ``chunk`` (recorded from row
    ``t0``), in row then env order as step-by-step replay does; lengths and returns of the others
    advance by the chunk. Only for every env stepped and a rule without episode quotas.

    Args:
        episodes: the worker's ``asyncsample._engine.Episodes``.
        finished_episode: makes the record of an ended episode from its return, length and
            agent version (``FinishedEpisode``; passed in: that module imports this one).
    """
    rewards = chunk.rewards[:steps]
    terminated = chunk.terminated[:steps]
    flags = terminated | chunk.truncated[:steps]
    rows, envs = np.nonzero(flags)  # row-major: by row, then env
    lengths, returns = episodes.lengths, episodes.returns
    if not len(rows):
        lengths += steps
        returns[:] = np.add.accumulate(np.concatenate([returns[None], rewards]), axis=0)[-1]
        return
    # Returns summed from the one carried in: exact up to each env's first end.
    carried = np.add.accumulate(np.concatenate([returns[None], rewards]), axis=0)
    columns: list[list[float]] | None = None  # per env, its rewards (episodes after the first)
    recorder, infos, finished = episodes.recorder, episodes.episode_info, episodes.finished
    ends, starts = episodes.ends, episodes.started_at
    now = time.perf_counter() if starts is not None else 0.0
    completed = recorder.completed_steps
    finals = chunk.final_obs
    flat = type(finals) is np.ndarray and finals.dtype != object
    base = lengths.tolist()
    last = [-1] * episodes.n_envs  # per env, the row of its last end so far
    no_infos: tuple[None, dict[int, dict[str, Any]]] = (None, {})
    rows_list, envs_list = rows.tolist(), envs.tolist()
    term = terminated[rows, envs].tolist()
    for j, i, ended_terminal in zip(rows_list, envs_list, term):
        before = last[i]
        if before < 0:
            ret, length = float(carried[j + 1, i]), base[i] + j + 1
        else:
            if columns is None:
                columns = rewards.T.tolist()
            ret, length = _sum_from_zero(columns[i][before + 1 : j + 1]), j - before
        last[i] = j
        info = infos[i]
        ends[0 if ended_terminal else 2 if info.get("deadline") else 1] += 1
        if starts is not None:
            episodes.durations.append(now - starts[i])
            starts[i] = now
        end = StepType.TERMINAL if ended_terminal else StepType.TIMEOUT
        final = (
            finals[j, i].copy() if flat else tree_map(lambda x, j=j, i=i: row_copy(x[j], i), finals)
        )
        recorder.close_piece(i, t0 + j + 1, end, final, info)
        finished.append(finished_episode(ret, length, int(info["agent_version"])))
        infos[i] = episodes.fresh_info(step_infos.get(j, no_infos)[1].get(i, {}), i, version)
        recorder.piece_position[i] = 0
    # Where the chunk leaves each env: past its last end, summed from 0.0 again.
    untouched = [i for i, j in enumerate(last) if j < 0]
    if untouched:
        lengths[untouched] += steps
        returns[untouched] = carried[steps, untouched]
    for i, j in enumerate(last):
        if j >= 0:
            lengths[i] = steps - 1 - j
            if columns is None:
                columns = rewards.T.tolist()
            returns[i] = _sum_from_zero(columns[i][j + 1 : steps])
    ended = np.unique(envs)
    if episodes.episode_timeout is not None:  # the next episodes start now (autoreset)
        episodes.deadlines[ended] = episodes.clock() + episodes.episode_timeout
    rule = episodes.rule
    if rule is not None:  # a samples quota counts the steps; no env stops (see replay)
        rule.ended(ended, recorder.completed_steps - completed, episodes.active)
