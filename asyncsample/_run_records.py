"""Runs of steps recorded: where a host's agent copy acts (``inference="host"``, async envs in env
hosts), an env takes several steps per request, answered at once
(a :class:`~asyncsample.backends.base.StepRun`), so the caller's cost is per run, not per step.
The lanes (:mod:`asyncsample._env_tasks`) and the runs' stepper (:mod:`asyncsample._env_runs`)
record them here."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from asyncsample._quotas import FreeQuota
from asyncsample._recorder import store_agent_infos
from asyncsample._tree import row_copy
from asyncsample.backends.base import StepRun

__all__ = ["RUN_STEPS", "put_infos", "put_run", "split_run", "within_quota"]

#: The most steps an env takes in one request where its host's agent copy acts and the call
#: counts steps (``obtain_fragments``): one reply per run, the caller's cost per run.
RUN_STEPS = 16


def put_run(rows: Any, t: int, i: int, run: StepRun, like: tuple[Any, Any]) -> int:
    """Record env ``i``'s run of steps from its row ``t`` (``like``: observations and actions
    shaped like the step buffers, to grow the records); how many steps it took."""
    n = len(run.rewards)
    if t + n > rows.size:
        rows.cover(t + n - 1, *like)
    end = t + n
    rows.obs[t:end, i] = run.obs
    rows.actions[t:end, i] = run.actions
    rows.rewards[t:end, i] = run.rewards
    rows.versions[t:end, i] = run.version
    put_infos(rows, t, i, n, run.infos, run.agent_infos)
    return n


def put_infos(
    rows: Any,
    t: int,
    i: int,
    n: int,
    infos: Sequence[tuple[int, dict[str, Any]]],
    agent_infos: Sequence[tuple[int, dict[str, Any]]],
) -> None:
    """Record the env and agent infos of env ``i``'s run of ``n`` steps from its row ``t``
    (``(step, info)`` where not empty)."""
    for j, info in infos:
        row = rows.env_infos.get(t + j)
        if row is None:
            row = rows.env_infos[t + j] = [{} for _ in range(rows.n_envs)]
        row[i] = info
    if agent_infos or rows.agent_infos:
        given = dict(agent_infos)
        for j in range(n):
            store_agent_infos(rows, t + j, given.get(j, {}), i)


def split_run(run: StepRun, m: int) -> tuple[StepRun, StepRun]:
    """``run``'s first ``m`` steps (not ending its episode), and the rest."""
    first = StepRun(
        run.obs[:m],
        run.actions[:m],
        run.rewards[:m],
        [(j, info) for j, info in run.infos if j < m],
        [(j, info) for j, info in run.agent_infos if j < m],
        False,
        False,
        run.version,
    )
    rest = StepRun(
        run.obs[m:],
        run.actions[m:],
        run.rewards[m:],
        [(j - m, info) for j, info in run.infos if j >= m],
        [(j - m, info) for j, info in run.agent_infos if j >= m],
        run.terminated,
        run.truncated,
        run.version,
    )
    return first, rest


def within_quota(
    run: StepRun, pool: FreeQuota, host: Any, episodes: Any, i: int
) -> tuple[StepRun, bool]:
    """The part of env ``i``'s ``run`` this call records (:meth:`FreeQuota.room`), and whether
    the run was split: its rest is left in flight for the next call to record first, and this
    call's fragment ends at the rest's first observation."""
    room = pool.room()
    if len(run.rewards) <= room:
        return run, False
    run, rest = split_run(run, room)
    carried = asyncio.get_running_loop().create_future()
    carried.set_result(rest)
    host.in_flight[i] = carried
    episodes.cut_obs[i] = row_copy(rest.obs, 0)
    return run, True
