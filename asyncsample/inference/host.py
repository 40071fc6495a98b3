"""``inference="host"``: a copy of the agent inside every env host, stepping chunks of steps.

Each host slot runs a seeded copy of its worker's agent for a chunk of steps per request,
stopping where per-step stepping would stop the call; the worker replays the chunk into the same
records, so batches equal ``"per_worker"``'s for a deterministic agent. On ``process`` chunks are
pipelined (:meth:`ChunkStepper.run`) and run ahead between a stream's rounds (:class:`RunAhead`).
"""

from __future__ import annotations

import functools
import inspect
import math
import pickle
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import cloudpickle
import numpy as np

from asyncsample import _validate
from asyncsample._assembly import Plan
from asyncsample._engine import (
    CallMode,
    Continuity,
    Episodes,
    RecordStep,
    StopRule,
    Transition,
    transition_at,
)
from asyncsample._quotas import QuotaView, SharedQuota
from asyncsample._recorder import Resume, row_of
from asyncsample._tree import Tree, tree_map
from asyncsample.agent import distinct
from asyncsample.backends import (
    DEFAULT_CHUNK_STEPS,
    AgentHost,
    ChunkBuffers,
    ChunkReply,
    ChunkRequest,
    EnvHost,
    NextChunk,
    SentChunk,
)
from asyncsample.backends.base import LOGGER
from asyncsample.errors import AsyncSampleError

__all__ = [
    "ChunkStepper",
    "Host",
    "RunAhead",
    "agent_host",
    "check_chunked_host",
    "check_host_agent",
    "pickle_agent",
    "prepare_update",
    "with_seed",
]


@dataclass(frozen=True)
class Host:
    """Options of ``inference="host"`` (pass an instance as ``Sampler(inference=...)``).

    Args:
        chunk_steps: the longest chunk, in worker steps. Longer chunks mean fewer requests;
            shorter ones apply agent updates sooner in a stream.
    """

    chunk_steps: int = DEFAULT_CHUNK_STEPS

    def __post_init__(self) -> None:
        _validate.positive_int("chunk_steps", self.chunk_steps)


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


def check_chunked_host(agents: list[Any], episode_timeout: float | None) -> None:
    """``inference="host"`` over blocking envs runs chunks of steps in the hosts: no async
    agent (the hosts run no event loop) and no ``episode_timeout`` (no look between steps)."""
    for a in distinct(agents):
        if a is not None:
            check_host_agent(a)
    if episode_timeout is not None:
        raise ValueError(
            "episode_timeout needs inference='per_worker' or 'batched' (the sampler "
            "checks deadlines between steps; with inference='host' a chunk of steps "
            f"runs in the env host), got episode_timeout={episode_timeout!r} with "
            "inference='host'"
        )


def pickle_agent(agent: Any, name: str = "agent", awaited: bool = False) -> bytes:
    """``cloudpickle(agent)``; ``TypeError`` naming the agent if it cannot be pickled.
    ``awaited``: the hosts run an event loop (async envs), so an async agent is welcome."""
    if not awaited:
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


def prepare_update(update: Any, awaited: bool = False) -> Any:
    """What to forward to the hosts for ``update`` (checked and pickled once for all hosts);
    ``awaited``: see :func:`pickle_agent`."""
    if isinstance(update, list):
        return [prepare_update(u, awaited) for u in update]
    if update is None:
        return None
    if not isinstance(update, (dict, tuple, np.ndarray)):
        return ("agent", pickle_agent(update, "agent_update", awaited))
    try:
        return ("params", pickle.dumps(update, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return ("params", cloudpickle.dumps(update, protocol=pickle.HIGHEST_PROTOCOL))


class HostWorker(Protocol):
    """What ``inference="host"`` needs of a worker (its public surface)."""

    worker_number: int
    n_envs: int
    agent: Any
    agent_version: int
    host: EnvHost | None
    episodes: Episodes
    records_transitions: bool
    history: Any

    async def start_episode(self) -> None: ...

    def current_plan(self, *, fragments: bool) -> Plan: ...

    def process_transition(self, history: Any, transition: Transition) -> Any: ...


@dataclass
class RunAhead:
    """The first chunk of a stream's next round, sent as a worker's part of a round ends (the
    hosts would otherwise idle between rounds); the next round takes it over if its own first
    ``request`` is the same, else it is abandoned and the envs start fresh episodes."""

    sent: SentChunk
    request: ChunkRequest


class PipelinedHost(AgentHost, Protocol):
    """A host that pipelines chunks (the ``process`` backend): two sets of chunk buffers, and
    requests sent without awaiting their replies."""

    chunks: list[ChunkBuffers]

    async def send_chunk(self, request: ChunkRequest | NextChunk) -> SentChunk: ...


class ChunkQuota(QuotaView):
    """How the workers of a call with ``fraction_samples < 1`` share its quota in chunks.

    Per-step stepping stops every worker at the step where the call's total is met. A chunk
    cannot be stopped from outside once it runs, so each worker used to ask its chunk for all the
    call's total still lacked: every worker started with a chunk for the whole quota, and
    ``obtain_fragments(200, fraction_samples=0.99)`` returned 777 transitions from 4 workers of
    3 envs (``obtain_samples``: 777 too). Now a chunk asks for what the worker's minimum still
    lacks plus an equal slice (one per worker) of what the call would still lack once every
    worker has delivered its running chunk (:attr:`running`) and its minimum (:meth:`ask`). A
    worker with nothing to ask for waits for the others' chunks (:meth:`wait`). So the total
    passes the quota by at most what the chunks round up (steps of whole envs, whole episodes),
    as with per-step stepping.
    """

    def __init__(self, quota: SharedQuota) -> None:
        super().__init__(quota)
        self.running: dict[int, int] = {}
        """Per worker with a chunk out: the transitions that chunk was asked for."""

    def ask(self, worker: int) -> int:
        """The transitions ``worker``'s next chunk asks for (0: none is needed of it now)."""
        quota = self.quota
        counts, minimums, running = quota.counts, quota.minimums, self.running
        own = max(minimums[worker] - counts[worker], 0)
        projected = sum(max(counts[w] + running.get(w, 0), m) for w, m in minimums.items())
        lacking = quota.target - projected
        return own if lacking <= 0 else own + math.ceil(lacking / len(minimums))

    def started(self, worker: int, transitions: int) -> None:
        self.running[worker] = transitions

    def finished(self, worker: int, count: int) -> None:
        """Worker ``worker``'s chunk is replayed (or failed); it now has ``count``."""
        self.running.pop(worker, None)
        self.report(worker, count)

    async def wait(self, worker: int) -> None:
        """While the quota does not let ``worker`` stop and it has nothing to ask for."""
        await self.wait_while(worker, lambda: self.ask(worker) <= 0)


class ChunkStepper:
    """One chunk of steps per request, run by the host's agent copy under a copy of the call's
    :class:`~asyncsample._engine.StopRule`, then replayed into the worker's records."""

    def __init__(
        self,
        worker: HostWorker,
        chunk_steps: int,
        ahead: dict[int, RunAhead] | None = None,
        then: Resume | None = None,
        quota: SharedQuota | None = None,
        starters: int = 0,
    ) -> None:
        self.worker = worker
        self._starters = starters  # for the part's first request (see ChunkRequest.starters)
        self.quota = None if quota is None else ChunkQuota.of(quota)
        """The call's shared quota (``fraction_samples < 1``), as the chunks share it."""
        self.ahead = {} if ahead is None else ahead
        self.then = then
        """What the part leaves for a stream's next round (``None``: no round follows)."""
        self._taken: RunAhead | None = None
        self._ran: StopRule | None = None  # the rule of a part run by run() on a pipe
        self.host = agent_host(worker)
        chunk = self.host.chunk
        assert chunk is not None
        self.chunk = chunk
        self.capacity = min(chunk.capacity, chunk_steps)
        host: Any = self.host
        sets: list[ChunkBuffers] = getattr(host, "chunks", [])
        self.pipe: PipelinedHost | None = host if len(sets) > 1 else None
        if chunk.arena is not None:  # the observation records live where the host writes
            worker.episodes.recorder.rows.use_arena(chunk.arena, self.capacity + 1)

    async def start(self) -> None:
        """Reset the envs that need it once the agent copy is in place; take over a run-ahead."""
        stale, self._taken = self._taken, None
        if stale is not None:  # taken over by a try that failed: the retry restarted the host
            stale.sent.abandon()
        await self.host.sync_agent()
        if self.worker.episodes.state is Continuity.TAKING_OVER:
            await self._take_over()
        await self.worker.start_episode()

    async def _take_over(self) -> None:
        """Keep the chunk run ahead if it is the part's first request; else wait for it and, if it
        ran, drop the episodes in progress (their envs moved past the records)."""
        episodes = self.worker.episodes
        episodes.state = Continuity.IN_CALL
        ahead = self.ahead.pop(self.worker.worker_number, None)
        rule = episodes.rule
        if (
            ahead is not None
            and self.pipe is not None
            and rule is not None
            and not episodes.needs_reset.any()
            and _same_request(ahead.request, self._request(rule, 0))
        ):
            self._taken = ahead
            return
        if ahead is None:  # dropped with an earlier stream: start afresh, as any call would
            episodes.recovered()
            return
        try:
            ran = (await ahead.sent.wait()).steps > 0
        finally:
            ahead.sent.abandon()
        if ran:
            dropped = episodes.recovered()
            LOGGER.info(
                "worker %d: the chunk run ahead for this round was not taken over; %d "
                "episode(s) in progress were dropped",
                self.worker.worker_number,
                dropped,
            )

    async def advance(self, rule: StopRule, lacking: int | None = None) -> int:
        """One chunk, stopping where ``rule`` (or, given ``lacking``, its limit) stops; with the
        call's shared quota, for this worker's part of what the call lacks (:class:`ChunkQuota`)."""
        if self.quota is not None:
            return await self._advance_shared(self.quota, rule)
        limited = None if lacking is None else rule.limited(lacking, self.worker.n_envs)
        request = self._first(self._request(rule if limited is None else limited, 0))
        reply, version = await self.host.run_chunk(request)
        self._replay(reply, version)
        if lacking is None:
            rule.took(reply.steps)
        return reply.steps

    async def _advance_shared(self, quota: ChunkQuota, rule: StopRule) -> int:
        """One chunk for what :meth:`ChunkQuota.ask` gives this worker (none if it may stop)."""
        worker = self.worker
        w, n_envs, episodes = worker.worker_number, worker.n_envs, worker.episodes
        fragments = rule.mode is CallMode.FRAGMENTS
        quota.report(w, episodes.count(fragments))
        await quota.wait(w)
        ask = quota.ask(w)
        if ask <= 0:  # the quota lets it stop
            return 0
        limited = rule.limited(ask, n_envs)
        # What the chunk delivers: its steps of every env (fragments), its need (samples), at
        # most a step of every env per step of the chunk.
        steps = limited.steps if fragments else math.ceil(ask / n_envs)
        quota.started(w, min(steps, self.capacity) * n_envs)
        try:
            reply, version = await self.host.run_chunk(self._first(self._request(limited, 0)))
            self._replay(reply, version)
        finally:
            quota.finished(w, episodes.count(fragments))
        return reply.steps

    async def run(self, rule: StopRule) -> None:
        """Chunks until ``rule`` stops (pipelined on a :class:`PipelinedHost`)."""
        if self.pipe is not None:
            await self._run_pipelined(self.pipe, rule)
            self._ran = rule
            return
        active = self.worker.episodes.active
        while rule.more(active):
            await self.advance(rule)

    async def _run_pipelined(self, host: PipelinedHost, rule: StopRule) -> None:
        """Chunks until ``rule`` stops, the next chunk's request always queued in the host.

        At most two requests are out, one per set, answered in order; a reply of no steps after an
        agent update is followed by the next request. Requests still out at the end are abandoned.
        """
        episodes = self.worker.episodes
        active = episodes.active
        sets, epoch = host.chunks, self.chunk.epoch
        out: deque[tuple[SentChunk, int, int | None]] = deque()  # (request, set, NextChunk epoch)
        taken, self._taken = self._taken, None
        if taken is not None:  # the first chunk was run ahead (set 0)
            out.append((taken.sent, 0, taken.request.epoch))
        try:
            if not rule.more(active):
                return
            if taken is None:
                out.append((await host.send_chunk(self._first(self._request(rule, 0))), 0, None))
            if self._may_follow(rule):
                out.append(await self._follow(host, 1))
            while out:
                sent, b, sent_epoch = out.popleft()
                reply = await sent.wait()
                if reply.steps:
                    self._replay(reply, sent.version, sets[b])
                    rule.took(reply.steps)
                if not rule.more(active):
                    return
                if not reply.steps and sent_epoch == int(epoch[0]):
                    # Not skipped for an update: the host's rule and ours disagree.
                    raise RuntimeError(
                        f"worker {self.worker.worker_number}: its env host ran no steps of a "
                        "chunk the call still needs (the host's stop rule went out of step)"
                    )
                if out:  # the next chunk runs in the other set: queue the one after it
                    if self._may_follow(rule):
                        out.append(await self._follow(host, b))
                else:
                    out.append((await host.send_chunk(self._request(rule, b)), b, None))
                    if self._may_follow(rule):
                        out.append(await self._follow(host, 1 - b))
        finally:
            for sent, _, _ in out:
                sent.abandon()

    async def ended(self) -> None:
        """The part ended and its plan was taken: if a stream's round follows, send its first chunk
        (:class:`RunAhead`), unless that round resets an env first or the host refuses it."""
        done, then, host = self._ran, self.then, self.pipe
        if done is None or then is None or host is None:
            return
        worker = self.worker
        episodes = worker.episodes
        rule = StopRule.for_call(done.mode, done.share, worker.n_envs)
        start = episodes.next_start(then, rule)
        if start is None:
            return
        counts, active = start
        epoch, row = int(self.chunk.epoch[0]), episodes.recorder.next_arena_row()
        request = ChunkRequest(rule, self.capacity, counts, active, 0, epoch, row)
        try:
            sent = await host.send_chunk(request)
        except AsyncSampleError:
            return
        old = self.ahead.pop(worker.worker_number, None)
        if old is not None:  # never two: a part takes over (or drops) its own first
            old.sent.abandon()
        self.ahead[worker.worker_number] = RunAhead(sent, request)
        episodes.state = Continuity.RAN_AHEAD

    def _first(self, request: ChunkRequest) -> ChunkRequest:
        """``request``, carrying the call's starters if it is the part's first sent."""
        request.starters, self._starters = self._starters, 0
        return request

    def _request(self, rule: StopRule, buffer: int) -> ChunkRequest:
        """A request carrying the worker's state (the first chunk of a part)."""
        episodes = self.worker.episodes
        recorder = episodes.recorder
        rows = recorder.rows
        return ChunkRequest(
            rule=rule.copy(),
            steps=self.capacity,
            counts=rows.size - recorder.piece_start,
            active=episodes.active.copy(),
            buffer=buffer,
            obs_row=rows.arena_row(rows.size),
        )

    async def _follow(self, host: PipelinedHost, buffer: int) -> tuple[SentChunk, int, int]:
        """Send a :class:`NextChunk` into set ``buffer``; its epoch is read before the agent syncs,
        so an update made meanwhile only makes the host skip it."""
        epoch = int(self.chunk.epoch[0])
        return await host.send_chunk(NextChunk(self.capacity, buffer, epoch)), buffer, epoch

    def _may_follow(self, rule: StopRule) -> bool:
        """Whether the part may need a chunk after the next one."""
        return rule.mode is not CallMode.FRAGMENTS or rule.steps > self.capacity

    def _replay(self, reply: ChunkReply, version: int, chunk: ChunkBuffers | None = None) -> None:
        worker = self.worker
        buffers = self.host.buffers
        chunk = self.chunk if chunk is None else chunk
        row = reply.obs_row
        if row >= 0:  # the host wrote the observations into the arena
            chunk = chunk.with_arena_obs(row, row + reply.steps + 1)
        record: RecordStep | None = None
        if worker.records_transitions:
            record = functools.partial(self._record, chunk, reply.steps)
        current = worker.agent_version
        worker.agent_version = version  # what process_transition sees during the chunk
        try:
            worker.episodes.replay(
                chunk,
                reply.steps,
                reply.agent_infos,
                reply.step_infos,
                version,
                (buffers.obs, buffers.actions),
                record,
                row,
            )
        finally:
            worker.agent_version = current

    def _record(
        self,
        chunk: ChunkBuffers,
        steps: int,
        j: int,
        t: int,
        agent_infos: dict[str, Any],
        env_infos: list[dict[str, Any]] | None,
        done: np.ndarray,
    ) -> None:
        """``Worker.process_transition`` for step ``j`` of a chunk of ``steps`` steps."""
        worker = self.worker
        last = j + 1 == steps

        def next_obs(obs_seq: np.ndarray, final_seq: np.ndarray, now: np.ndarray) -> np.ndarray:
            out = (now if last else obs_seq[j + 1]).copy()
            out[done] = final_seq[j][done]
            return out

        # After the chunk's last step: the host's current observation, or, where the host may
        # already run the next chunk (pipelining), the spare row it wrote it to.
        now = self.host.buffers.obs if self.pipe is None else row_of(chunk.obs, steps)
        nxt: Tree = tree_map(next_obs, chunk.obs, chunk.final_obs, now)
        transition = transition_at(
            worker.episodes, t, nxt, chunk.terminated[j], chunk.truncated[j], env_infos, agent_infos
        )
        worker.history = worker.process_transition(worker.history, transition)


def _same_request(a: ChunkRequest, b: ChunkRequest) -> bool:
    """Whether two chunk requests ask for the same chunk (rule, steps, state, set)."""
    ra, rb = a.rule, b.rule
    if (ra.mode, ra.share, ra.need, ra.steps) != (rb.mode, rb.share, rb.need, rb.steps):
        return False
    pairs: list[tuple[Any, Any]] = [(ra.episodes_left, rb.episodes_left), (a.steps, b.steps)]
    pairs += [(a.buffer, b.buffer), (a.counts, b.counts), (a.active, b.active)]
    return all(np.array_equal(x, y) for x, y in pairs)  # None and None are equal too


def with_seed(blob: bytes, seed: int | None) -> bytes:
    """What a host installs: the pickled agent and the seed of this worker's copy (``None``:
    the copy keeps the random state it was pickled with)."""
    return pickle.dumps((blob, seed), protocol=pickle.HIGHEST_PROTOCOL)


def agent_host(worker: HostWorker) -> AgentHost:
    """The worker's host, which ``inference="host"`` knows is an :class:`AgentHost`."""
    host: Any = worker.host
    return host  # type: ignore[no-any-return]
