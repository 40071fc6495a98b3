"""The inference modes as strategies the sampler chooses once: where ``per_worker``,
``batched`` and ``host`` differ (chunk buffers, stepper, merged requests, agent updates)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, nullcontext
from typing import Any, Protocol

from asyncsample._batcher import Batched, Batcher
from asyncsample._engine import Episodes, Part, Stepper, StepStepper
from asyncsample._env_runs import RunStepper
from asyncsample._env_runs import fits as runs_fit
from asyncsample._env_tasks import LaneSettings, LaneStepper
from asyncsample.agent import Agent, distinct
from asyncsample.backends.base import ActingHost, PerEnvHost
from asyncsample.inference.copies import Follower, follows
from asyncsample.inference.host import (
    ChunkStepper,
    Host,
    HostWorker,
    RunAhead,
    agent_host,
    pickle_agent,
    prepare_update,
    with_seed,
)

__all__ = ["BatchedMode", "HostMode", "InferenceMode", "ModeWorker", "make_mode"]


class ModeWorker(HostWorker, Protocol):
    """What a mode needs of a worker."""

    episodes: Episodes
    batcher: Batcher | None
    env_spec: Any

    async def step_episode(self) -> bool: ...


class InferenceMode:
    """``"per_worker"``, and the base class of the other modes: each worker asks its own agent,
    one env step per request; ``lanes``: hosts step each env on its own, their ready envs'
    requests merged per agent."""

    def __init__(self, lanes: LaneSettings | None = None) -> None:
        self.lanes = lanes
        self.merger: Batcher | None = None
        """The merger of agent requests, where this mode merges them (else ``None``)."""

    def _attach_lanes(self, workers: Sequence[ModeWorker], options: Batched) -> bool:
        """With lanes: check that every host steps envs one at a time; one merger for all."""
        if self.lanes is None:
            return False
        bad = [w.worker_number for w in workers if not isinstance(w.host, PerEnvHost)]
        if bad:
            raise TypeError(f"workers {bad}: their hosts do not step envs one at a time")
        assert workers[0].env_spec is not None
        self.merger = Batcher(options, action_space=workers[0].env_spec.action_space)
        return True

    def chunk_steps(self, capacity: Callable[[int], int]) -> int:
        """The chunk capacity each host slot allocates (``0``: no chunks)."""
        return 0

    def attach(self, workers: Sequence[ModeWorker], agent_seeds: list[int]) -> None:
        """The workers exist and their envs are built."""
        self._attach_lanes(workers, Batched())

    def stepper(self, worker: ModeWorker, part: Part) -> Stepper:
        """How ``worker``'s part of a call moves its envs: one lane per env, or worker steps."""
        if self.lanes is not None:
            assert self.merger is not None
            if runs_fit(worker, part):  # type: ignore[arg-type]
                return RunStepper(worker, part, self.lanes, self.merger)  # type: ignore[arg-type]
            return LaneStepper(worker, self.merger, part, self.lanes)  # type: ignore[arg-type]
        return StepStepper(worker)

    async def ended(self, stepper: Stepper) -> None:
        """A worker's part of a call ended and its plan was taken (``stepper`` moved it)."""

    def round_starts(self, workers: Sequence[ModeWorker]) -> None:
        """A call or a stream's round begins (the agents may have changed since the last)."""

    def drop_ahead(self) -> None:
        """A stream closed: drop what was started early for a round that will not come."""

    @asynccontextmanager
    async def part(self, worker: ModeWorker) -> AsyncIterator[None]:
        """Surrounds ``worker``'s part of a call."""
        yield

    def check_update(self, agent_update: Any) -> None:
        """Refuse an update the mode cannot apply (before anything is applied)."""

    def apply_update(
        self,
        agent_update: Any,
        apply: Callable[[], None],
        workers: Sequence[ModeWorker],
        agent_seeds: list[int],
    ) -> None:
        """Apply ``agent_update`` with ``apply`` (which updates the workers' agents)."""
        apply()

    def close(self) -> None:
        """The sampler closed."""
        if self.merger is not None:
            self.merger.close()

    async def aclose(self) -> None:
        """The sampler closed: cancel the merged agent calls still awaited."""
        if self.merger is not None:
            await self.merger.aclose()
        self.close()


class BatchedMode(InferenceMode):
    """``"batched"``: one shared agent; the workers' concurrent calls become one call."""

    def __init__(
        self, options: Batched, shared_agent: Callable[[], Agent], lanes: LaneSettings | None
    ) -> None:
        super().__init__(lanes)
        self.options = options
        self.shared_agent = shared_agent
        self.batcher: Batcher | None = None
        """The merger, by the name ``Sampler._batcher`` reads (tests and benchmarks)."""

    def attach(self, workers: Sequence[ModeWorker], agent_seeds: list[int]) -> None:
        """One batcher for every worker (or every lane)."""
        if self._attach_lanes(workers, self.options):
            self.batcher = self.merger
            return
        self.batcher = self.merger = Batcher(self.options, self.shared_agent)
        for worker in workers:
            worker.batcher = self.merger

    @asynccontextmanager
    async def part(self, worker: ModeWorker) -> AsyncIterator[None]:
        """The batcher waits for this worker's rows while it takes part."""
        batcher = self.merger
        assert batcher is not None
        batcher.join(worker.worker_number)
        try:
            yield
        finally:
            # A worker done with its part leaves, so the others' flushes do not wait for it.
            batcher.leave(worker.worker_number)

    def check_update(self, agent_update: Any) -> None:
        """One shared agent: one update, not a list."""
        if isinstance(agent_update, list):
            raise ValueError(
                "agent_update: inference='batched' shares one agent between all workers; pass "
                "one update (parameters or an agent), not a list"
            )

    def apply_update(
        self,
        agent_update: Any,
        apply: Callable[[], None],
        workers: Sequence[ModeWorker],
        agent_seeds: list[int],
    ) -> None:
        """Never while the batcher's thread runs the agent."""
        with nullcontext() if self.merger is None else self.merger.exclusive():
            apply()


class HostMode(InferenceMode):
    """``"host"``: a copy of the agent in every env host, one chunk of steps per request; with
    ``lanes`` (async envs in the hosts), one step per request, each env on its own, the host's
    copy acting on the envs ready in a pass of its loop."""

    def __init__(
        self, options: Host, lanes: LaneSettings | None = None, follow: bool = False
    ) -> None:
        super().__init__(lanes)
        self.options = options
        self.ahead: dict[int, RunAhead] = {}
        """By worker number, the chunk sent for a stream's next round (see :class:`RunAhead`)."""
        self.follower = Follower() if follow else None
        """``inference="auto"`` with your agent: the hosts' copies follow its parameters."""

    def chunk_steps(self, capacity: Callable[[int], int]) -> int:
        """The chunk capacity for :attr:`Host.chunk_steps` (none with lanes: no chunks)."""
        return 0 if self.lanes is not None else capacity(self.options.chunk_steps)

    def attach(self, workers: Sequence[ModeWorker], agent_seeds: list[int]) -> None:
        """Every worker's host gets a copy of the worker's agent, seeded with its agent seed
        (see :meth:`_seeds`)."""
        if self.lanes is not None:
            bad = [w.worker_number for w in workers if not isinstance(w.host, ActingHost)]
            if bad:
                raise TypeError(f"workers {bad}: their hosts cannot run the agent per env")
        blobs: dict[int, bytes] = {}
        for worker, seed in zip(workers, self._seeds(workers, agent_seeds)):
            blob = blobs.get(id(worker.agent))
            if blob is None:  # one pickle per distinct agent
                blob = blobs[id(worker.agent)] = pickle_agent(
                    worker.agent, awaited=self.lanes is not None
                )
            agent_host(worker).set_agent(with_seed(blob, seed), worker.agent_version)
        self._remember(workers)

    def _seeds(self, workers: Sequence[ModeWorker], agent_seeds: list[int]) -> list[int | None]:
        """The seed each worker's copy is installed with (``None``: as pickled). Copies that
        follow your agents (``"auto"``) keep the random state of an agent that is a worker's
        own, as it would go on in your process; the copies of an agent shared by several
        workers get the workers' seeds, so that they do not draw the same numbers."""
        if self.follower is None:
            return list(agent_seeds)
        holders = Counter(id(w.agent) for w in workers)
        return [s if holders[id(w.agent)] > 1 else None for w, s in zip(workers, agent_seeds)]

    def _remember(self, workers: Sequence[ModeWorker]) -> None:
        if self.follower is not None:
            for agent in distinct(w.agent for w in workers):
                self.follower.remember(agent)

    def check_update(self, agent_update: Any) -> None:
        """With copies that follow your agent (``"auto"``), a new agent must let them follow."""
        if self.follower is None:
            return
        for item in agent_update if isinstance(agent_update, list) else [agent_update]:
            if callable(getattr(item, "get_actions", None)) and not follows(item):
                raise ValueError(
                    f"agent_update: inference='auto' runs copies of your agent in the env hosts "
                    f"and keeps them equal to it with get_param_values and set_param_values, "
                    f"which the new agent ({type(item).__name__}) lacks; give it both, or pass "
                    f"inference='host' (its copies then change only by agent_update) or "
                    f"'per_worker' to Sampler"
                )

    def round_starts(self, workers: Sequence[ModeWorker]) -> None:
        """Send the parameters of every agent changed in place since they were last sent
        (``inference="auto"``)."""
        if self.follower is None:
            return
        for agent in distinct(w.agent for w in workers):
            params = self.follower.changed(agent)
            if params is not None:
                kind, blob = prepare_update(params)
                for worker in workers:
                    if worker.agent is agent:
                        _send(worker, kind, blob)

    def stepper(self, worker: ModeWorker, part: Part) -> Stepper:
        """One chunk per request, the next round's first chunk sent as the part ends; with
        lanes, one lane per env, the host's agent copy acting."""
        if self.lanes is not None:
            if runs_fit(worker, part):  # type: ignore[arg-type]
                return RunStepper(worker, part, self.lanes)  # type: ignore[arg-type]
            return LaneStepper(worker, None, part, self.lanes)  # type: ignore[arg-type]
        return ChunkStepper(
            worker, self.options.chunk_steps, self.ahead, part.then, part.quota, part.starters
        )

    async def ended(self, stepper: Stepper) -> None:
        """Start the stream's next round in the host (see :meth:`ChunkStepper.ended`)."""
        if isinstance(stepper, ChunkStepper):
            await stepper.ended()

    def drop_ahead(self) -> None:
        """The stream closed: drop the chunks run ahead (their workers' next call starts afresh)."""
        for ahead in self.ahead.values():
            ahead.sent.abandon()
        self.ahead.clear()

    def close(self) -> None:
        """The hosts are gone: what was run ahead is dropped quietly."""
        self.drop_ahead()

    def apply_update(
        self,
        agent_update: Any,
        apply: Callable[[], None],
        workers: Sequence[ModeWorker],
        agent_seeds: list[int],
    ) -> None:
        """Check and pickle (a refused update changes nothing), apply, then send to the hosts."""
        prepared = prepare_update(agent_update, awaited=self.lanes is not None)
        apply()
        items = prepared if isinstance(prepared, list) else [prepared] * len(workers)
        for worker, item, seed in zip(workers, items, self._seeds(workers, agent_seeds)):
            if item is not None:
                kind, blob = item
                _send(worker, kind, blob, seed)
        self._remember(workers)


def _send(worker: ModeWorker, kind: str, blob: bytes, seed: int | None = None) -> None:
    """Send ``worker``'s host new parameters (``kind`` ``"params"``) or a new agent, before its
    next chunk."""
    host = agent_host(worker)
    if kind == "params":
        host.set_params(blob, worker.agent_version)
    else:
        host.set_agent(with_seed(blob, seed), worker.agent_version)
    if host.chunk is not None:  # a queued NextChunk must not run before the update
        host.chunk.epoch[0] += 1


def make_mode(
    options: Batched | Host | None,
    shared_agent: Callable[[], Agent],
    lanes: LaneSettings | None = None,
    follow: bool = False,
) -> InferenceMode:
    """The strategy for :func:`~asyncsample.inference.check_inference`'s options; ``follow``:
    the hosts' copies follow the caller's agents (see :class:`HostMode`)."""
    if isinstance(options, Host):
        return HostMode(options, lanes, follow)
    if isinstance(options, Batched):
        return BatchedMode(options, shared_agent, lanes)
    return InferenceMode(lanes)
