"""``inference="host"``: a copy of the agent inside every env host, stepping chunks of steps.

Each worker's host slot gets its own cloudpickled copy of the worker's agent (again when an
agent update passes a new object; parameter updates travel as parameters and are applied with
``set_param_values`` there). Per request, the host asks that copy for actions and steps the envs
for a chunk of worker steps, writing the step records into shared memory
(:mod:`asyncsample.backends._chunk`). The worker turns each chunk into the same recorder rows
per-step stepping makes, so batches are assembled by the same code and, with a deterministic
agent, equal those of ``"per_worker"``.

How a call maps to chunks: a chunk is at most :attr:`Host.chunk_steps` worker steps long (fewer
when the shared buffers would pass :data:`~asyncsample.backends._chunk.CHUNK_BYTES`), and the
host stops it exactly where per-step stepping stops the call (``samples``: the completed
episodes reach the share; ``exact episodes``: each env has its share of episodes and is stepped
no more; ``fragments``: the remaining steps), so no quota is ever overshot.

Reproducibility: a worker's copy is installed with the worker's agent seed from the sampler's
seed tree; an agent with a ``seed(int)`` method has it called with that seed in the host, which
is what a stochastic agent must implement to be reproducible across runs and ``n_processes``
(the built-in :class:`~asyncsample.RandomAgent` per worker carries its seeded generator over).
A copy reinstalled after a host restart gets the same seed again.

Agent versions: an update reaches the hosts before their next chunk; the chunk in flight ends
with the parameters it started with, and episodes are stamped with the version a chunk really
ran with, so ``agent_version`` and ``max_policy_lag`` stay exact. ``step_timeout`` applies per
step: a chunk of ``k`` steps may take ``k * step_timeout``.

On ``ray`` a chunk is one actor call; its records come back in the reply (through Ray's object
store when large; observation leaves compressed with the backend's ``compress_threshold``) and
are copied into the worker's local chunk buffers.

Limits: ``backend="local"`` is refused with a ``ValueError`` (its envs already live in the
caller's process: use ``"per_worker"``); async
agents are refused (``ValueError``); a ``worker_class`` that overrides ``compute_actions`` is
refused (the main process does not see the actions being chosen). Errors of the agent in the host
(and actions outside the action space) are :class:`~asyncsample.WorkerError` with the remote
traceback and ``retry=False``.
"""

from __future__ import annotations

import inspect
import math
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import cloudpickle
import numpy as np

from asyncsample._recorder import Resume, put_row, row_of, store_agent_infos
from asyncsample._tree import tree_map
from asyncsample.backends._chunk import (
    DEFAULT_CHUNK_STEPS,
    MODE_EPISODES,
    MODE_FRAGMENTS,
    MODE_SAMPLES,
    ChunkBuffers,
    ChunkReply,
    ChunkRequest,
)
from asyncsample.batch import StepType

if TYPE_CHECKING:
    from asyncsample._assembly import Plan
    from asyncsample.worker import SharedQuota, Worker

__all__ = ["Host", "HostInference", "check_host_agent", "pickle_agent"]


@dataclass(frozen=True)
class Host:
    """Options of ``inference="host"`` (pass an instance as ``Sampler(inference=...)``).

    Args:
        chunk_steps: the longest chunk, in worker steps. Longer chunks mean fewer requests;
            shorter ones apply agent updates sooner in a stream.
    """

    chunk_steps: int = DEFAULT_CHUNK_STEPS

    def __post_init__(self) -> None:
        if (
            isinstance(self.chunk_steps, bool)
            or not isinstance(self.chunk_steps, (int, np.integer))
            or self.chunk_steps < 1
        ):
            raise ValueError(f"Host: chunk_steps must be an int >= 1, got {self.chunk_steps!r}")


class ChunkHost(Protocol):
    """What a worker's env host offers for ``inference="host"``."""

    chunk: ChunkBuffers | None

    def set_agent(self, blob: bytes, version: int) -> None: ...

    def set_params(self, blob: bytes, version: int) -> None: ...

    async def run_chunk(self, request: ChunkRequest) -> tuple[ChunkReply, int]: ...

    async def sync_agent(self) -> int: ...


def check_host_agent(agent: Any, name: str = "agent") -> None:
    """Refuse agents the hosts cannot run: async ones (``ValueError``)."""
    get_actions = getattr(agent, "get_actions", None)
    if inspect.iscoroutinefunction(get_actions) or inspect.iscoroutinefunction(
        getattr(get_actions, "__call__", None)  # noqa: B004 - callable objects too
    ):
        raise ValueError(
            f"{name}: inference='host' cannot run an async agent ({type(agent).__name__} has an "
            "'async def get_actions'): the env hosts run no event loop; use inference="
            "'per_worker' or 'batched'"
        )


def pickle_agent(agent: Any, name: str = "agent") -> bytes:
    """``cloudpickle(agent)``; ``TypeError`` naming the agent if it cannot be pickled."""
    check_host_agent(agent, name)
    try:
        blob: bytes = cloudpickle.dumps(agent, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"{name}: inference='host' sends a copy of the agent to every env host, but "
            f"{type(agent).__name__} {agent!r} cannot be pickled with cloudpickle: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return blob


def pickle_params(params: Any) -> bytes:
    """Pickle a parameter update once for all hosts."""
    try:
        blob: bytes = pickle.dumps(params, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        blob = cloudpickle.dumps(params, protocol=pickle.HIGHEST_PROTOCOL)
    return blob


class HostInference:
    """The sampler's side of ``inference="host"``: installs agents, forwards updates, and runs
    each worker's part of a call as chunks.

    Args:
        options: the chunking options.
    """

    def __init__(self, options: Host) -> None:
        self.options = options

    # -- agents ---------------------------------------------------------------------------------

    def install(self, workers: list[Worker], seeds: list[int]) -> None:
        """Give every worker's host a copy of the worker's agent, seeded with ``seeds[w]``."""
        blobs: dict[int, bytes] = {}
        for worker, seed in zip(workers, seeds):
            blob = blobs.get(id(worker.agent))
            if blob is None:  # one pickle per distinct agent
                blob = blobs[id(worker.agent)] = pickle_agent(worker.agent)
            _host(worker).set_agent(_with_seed(blob, seed), worker.agent_version)

    def prepare_update(self, update: Any) -> Any:
        """What to forward for ``update`` (checked and pickled before anything is applied)."""
        if isinstance(update, list):
            return [self.prepare_update(u) for u in update]
        if update is None:
            return None
        if isinstance(update, (dict, tuple, np.ndarray)):
            return ("params", pickle_params(update))
        return ("agent", pickle_agent(update, "agent_update"))

    def forward_update(self, workers: list[Worker], prepared: Any, seeds: list[int]) -> None:
        """Send a prepared update to the hosts of ``workers`` (after the workers applied it)."""
        items = prepared if isinstance(prepared, list) else [prepared] * len(workers)
        for worker, item, seed in zip(workers, items, seeds):
            if item is None:
                continue
            kind, blob = item
            if kind == "params":
                _host(worker).set_params(blob, worker.agent_version)
            else:
                _host(worker).set_agent(_with_seed(blob, seed), worker.agent_version)

    # -- a call ---------------------------------------------------------------------------------

    async def run(
        self,
        worker: Worker,
        mode: str,
        share: int,
        leave: Resume,
        quota: SharedQuota | None = None,
    ) -> Plan:
        """One worker's part of a call (its plan), as ``Worker._run_*`` would do it step by step.

        With a shared ``quota`` (``fraction_samples < 1``) the worker asks for chunks until
        :meth:`SharedQuota.may_stop`; it decides between chunks, and each chunk asks for no more
        than what the worker's minimum or the call's total still lacks, so a worker goes past
        the point where it may stop by less than one episode (samples) or one step of its envs
        (fragments).
        """
        recorder = worker._recorder
        # The agent copy is in place before the envs are reset, so it sees the same
        # reset(mask) calls as an agent in the main process.
        await _host(worker).sync_agent()
        if quota is not None:
            return await self._run_shared(worker, mode, leave, quota)
        if mode == "samples":
            await worker.start_episode()
            while recorder.completed_steps < share:
                need = share - recorder.completed_steps
                await self._chunk(worker, MODE_SAMPLES, self._capacity(worker), need)
            plan = worker._collect_plan()
            worker._end_call(leave)
            return plan
        if mode == "episodes":
            await worker.start_episode()
            while worker._active.any():
                await self._chunk(worker, MODE_EPISODES, self._capacity(worker), 0)
            plan = worker._collect_plan()
            worker._end_call(Resume.NOTHING)
            return plan
        worker._share = share
        if worker._steps_left is None:
            worker._steps_left = math.ceil(share / worker.n_envs)
        await worker.start_episode()
        while worker._steps_left > 0:
            k = min(self._capacity(worker), worker._steps_left)
            steps = await self._chunk(worker, MODE_FRAGMENTS, k, 0)
            worker._steps_left -= steps
        plan = worker._collect_plan(fragments=True)
        worker._end_call(Resume.FRAGMENTS)
        return plan

    async def _run_shared(
        self, worker: Worker, mode: str, leave: Resume, quota: SharedQuota
    ) -> Plan:
        recorder, w = worker._recorder, worker.worker_number
        fragments = mode == "fragments"

        def count() -> int:
            return recorder.completed_steps + (recorder.open_steps() if fragments else 0)

        await worker.start_episode()
        quota.report(w, count())
        while not quota.may_stop(w):
            lacking = max(quota.minimums[w] - quota.counts[w], quota.target - quota.total, 1)
            if fragments:
                k = min(self._capacity(worker), math.ceil(lacking / worker.n_envs))
                await self._chunk(worker, MODE_FRAGMENTS, k, 0)
            else:
                await self._chunk(worker, MODE_SAMPLES, self._capacity(worker), lacking)
            quota.report(w, count())
        plan = worker._collect_plan(fragments=fragments)
        worker._end_call(Resume.FRAGMENTS if fragments else leave)
        return plan

    def _capacity(self, worker: Worker) -> int:
        chunk = _host(worker).chunk
        assert chunk is not None
        return min(chunk.capacity, self.options.chunk_steps)

    async def _chunk(self, worker: Worker, mode: int, steps: int, need: int) -> int:
        recorder = worker._recorder
        request = ChunkRequest(
            mode=mode,
            steps=steps,
            need=need,
            counts=recorder.rows.size - recorder.piece_start,
            active=worker._active.copy(),
            episodes_left=None if worker._episodes_left is None else worker._episodes_left.copy(),
        )
        reply, version = await _host(worker).run_chunk(request)
        _replay(worker, reply, version)
        return reply.steps


def _with_seed(blob: bytes, seed: int) -> bytes:
    """What a host installs: the pickled agent and the seed of this worker's copy."""
    return pickle.dumps((blob, seed), protocol=pickle.HIGHEST_PROTOCOL)


def _host(worker: Worker) -> ChunkHost:
    host: Any = worker.host
    return host  # type: ignore[no-any-return]


def _replay(worker: Worker, reply: ChunkReply, version: int) -> None:
    """Turn a chunk into recorder rows and episodes, exactly as ``Worker.step_episode`` would.

    The episodes that start in it (or had not taken a step before it) are stamped with the agent
    version the chunk ran with.
    """
    host = worker.host
    assert host is not None
    chunk = _host(worker).chunk
    assert chunk is not None
    buffers = host.buffers
    recorder = worker._recorder
    rows = recorder.rows
    active = worker._active
    lengths, returns = worker._lengths, worker._returns
    current = worker.agent_version
    worker.agent_version = version
    try:
        for i in np.flatnonzero(lengths == 0).tolist():
            worker._episode_info[i] = worker._fresh_info(worker._episode_info[i], i)
        for j in range(reply.steps):
            t = rows.next_row(buffers.obs, buffers.actions)
            put_row(rows.obs, t, row_of(chunk.obs, j))
            put_row(rows.actions, t, row_of(chunk.actions, j))
            agent_infos = reply.infos_at(j)
            if agent_infos or rows.agent_infos:
                store_agent_infos(rows, t, agent_infos)
            env_infos, reset_infos = reply.step_infos.get(j, (None, {}))
            rewards = chunk.rewards[j]
            rows.rewards[t] = rewards
            if env_infos is not None:
                rows.env_infos[t] = env_infos
            terminated = chunk.terminated[j]
            done = terminated | chunk.truncated[j]
            if worker._everyone:
                lengths += 1
                returns += rewards
            else:
                lengths[active] += 1
                returns[active] += rewards[active]
                done &= active
            if worker._records_transitions:
                last = j + 1 == reply.steps
                _record(worker, chunk, j, t, agent_infos, env_infos, done, last)
            if not done.any():
                continue
            for i in np.flatnonzero(done).tolist():
                end = StepType.TERMINAL if terminated[i] else StepType.TIMEOUT
                last = tree_map(lambda x, i=i, j=j: x[j, i].copy(), chunk.final_obs)
                info = worker._episode_info[i]
                recorder.close_piece(i, t + 1, end, last, info)
                worker.finished.append(
                    _finished(float(returns[i]), int(lengths[i]), int(info["agent_version"]))
                )
                returns[i] = 0.0
                worker._episode_info[i] = worker._fresh_info(reset_infos.get(i, {}), i)
                lengths[i] = 0
                recorder.piece_position[i] = 0
                if worker._episodes_left is not None:
                    worker._episodes_left[i] -= 1
                    if worker._episodes_left[i] <= 0:
                        active[i] = False
                        worker._everyone = False
    finally:
        worker.agent_version = current


def _finished(ret: float, length: int, version: int) -> Any:
    from asyncsample.worker import FinishedEpisode

    return FinishedEpisode(ret, length, version)


def _record(
    worker: Worker,
    chunk: ChunkBuffers,
    j: int,
    t: int,
    agent_infos: dict[str, Any],
    env_infos: list[dict[str, Any]] | None,
    done: np.ndarray,
    last: bool,
) -> None:
    """``Worker.process_transition`` for step ``j`` of a chunk (``last``: its final step)."""
    from asyncsample.worker import Transition

    host = worker.host
    assert host is not None

    def next_obs(obs_seq: np.ndarray, final_seq: np.ndarray, now: np.ndarray) -> np.ndarray:
        out = (now if last else obs_seq[j + 1]).copy()
        out[done] = final_seq[j][done]
        return out

    # The observation after step j is the one acted on at j + 1, or the host's current one
    # after the chunk's last step.
    nxt = tree_map(lambda o, f, n: next_obs(o, f, n), chunk.obs, chunk.final_obs, host.buffers.obs)
    transition = Transition(
        observations=tree_map(lambda x: x[t], worker._recorder.rows.obs),
        actions=tree_map(lambda x: x[t], worker._recorder.rows.actions),
        rewards=worker._recorder.rows.rewards[t],
        next_observations=nxt,
        terminated=chunk.terminated[j].copy(),
        truncated=chunk.truncated[j].copy(),
        env_infos=env_infos,
        agent_infos=agent_infos,
        active=worker._active.copy(),
    )
    worker.history = worker.process_transition(worker.history, transition)
