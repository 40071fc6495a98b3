"""The sampler's core (package-internal): state, lock, start, one sampling round, updates.

:class:`~asyncsample.Sampler`, ``stream()`` and ``evaluate()`` are layers over it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import gymnasium as gym
import numpy as np

from asyncsample import _resume, _validate
from asyncsample._assembly import Plan, assemble_off_loop
from asyncsample._config import SamplerConfig
from asyncsample._engine import (
    CallMode,
    Continuity,
    Part,
    StopRule,
    run_part,
    share_of,
)
from asyncsample._env_tasks import Admission, LaneSettings
from asyncsample._memory import BatchMemory
from asyncsample._probe import (
    Probe,
    Probed,
    loop_runs_here,
    maybe_async,
    probe_spaces,
    wait_probe_closed,
)
from asyncsample._quotas import FreeQuota, LaneRound, SharedQuota
from asyncsample._recorder import Resume
from asyncsample._stream_guard import StreamGuard
from asyncsample._tasks import run_all
from asyncsample.agent import Agent, AgentUpdate, RandomAgent, distinct
from asyncsample.backends import (
    Backend,
    HostSpec,
    RestartBudget,
    chunk_capacity,
    make_backend,
    traits,
    with_trait,
)
from asyncsample.batch import EnvSpec, EpisodeBatch
from asyncsample.checkpoint import ResumeReport, SamplerState, StreamState
from asyncsample.env_update import EnvChoice
from asyncsample.errors import SamplerClosedError, WorkerError
from asyncsample.inference import Batched, Setup, check_inference, choose_inference
from asyncsample.inference.host import Host, check_chunked_host, pickle_agent
from asyncsample.inference.modes import HostMode, InferenceMode, make_mode
from asyncsample.metrics import make_metrics
from asyncsample.multiagent.routing import bind_agents
from asyncsample.seeding import worker_seeds
from asyncsample.stats import SampleStats
from asyncsample.worker import Worker, WorkerFactory

__all__ = ["AgentUpdateArg", "EnvUpdateArg", "Mode", "SamplerCore", "run_all"]

logger = logging.getLogger("asyncsample")

Mode = Literal["samples", "episodes", "fragments"]
_PARAMS = (dict, tuple, np.ndarray)

AgentUpdateArg = AgentUpdate | list[AgentUpdate]
"""An agent update for a sampler call: one for every worker, or a list of one per worker."""

EnvUpdateArg = EnvChoice | list[EnvChoice]
"""An env update for a sampler call: one for every worker, or a list of one per worker."""


class SamplerCore:
    """The state of one sampler and what every call is made of, from a checked config."""

    def __init__(self, config: SamplerConfig) -> None:
        agent, backend, test_env = config.agent, config.backend, config.test_env
        self.closed = True  # until construction succeeds: __del__ must not warn
        self.n_workers = n_workers = _validate.positive_int("n_workers", config.n_workers)
        self.envs_per_worker = _validate.positive_int("envs_per_worker", config.envs_per_worker)
        n_processes = _validate.optional_positive_int("n_processes", config.n_processes)
        self.max_episode_length = max_episode_length = _validate.optional_positive_int(
            "max_episode_length", config.max_episode_length
        )
        seed = _validate.seed("seed", config.seed)
        self.resume = resume = _resume.resumed_state(config.resume, seed)
        if resume is not None:
            seed = resume.seed
        self.resumed: ResumeReport | None = None
        self.stream_checkpoint: Callable[[], Awaitable[SamplerState]] | None = None
        """Set by an open stream: how it takes a checkpoint between two of its rounds."""
        self.pending_stream: StreamState | None = None
        """A resumed stream's rounds sampled before the checkpoint and not yet yielded."""
        self.traits = traits(backend)  # what the backend is: asked, never its name
        self.backend_name = backend
        self.step_timeout = _validate.positive_seconds("step_timeout", config.step_timeout)
        if self.step_timeout is not None and not self.traits.preempts:
            raise ValueError(
                f"step_timeout cannot be used with backend={backend!r}: a step that blocks the "
                f"event loop's thread cannot be pre-empted; use backend={with_trait('preempts')}"
            )
        self.max_restarts = _validate.nonnegative_int("max_restarts", config.max_restarts)
        self.max_concurrency = max_concurrency = _validate.optional_positive_int(
            "max_concurrency", config.max_concurrency
        )
        self.episode_timeout = _validate.positive_seconds("episode_timeout", config.episode_timeout)
        self.max_sequence_length = _validate.optional_positive_int(
            "max_sequence_length", config.max_sequence_length
        )
        self.close_timeout = _validate.seconds("close_timeout", config.close_timeout)
        self.fixed_shares = _validate.flag("fixed_shares", config.fixed_shares)
        self._probe_closing: Any = None  # the probe env's close, if late (_probe.Closing)
        self._spec: EnvSpec | None = None  # from the probe env (see env_spec)
        self._time_limited = False
        self._probe: Probe | None = None  # the probe env, built in a thread meanwhile
        self.host_threads = _validate.optional_positive_int("host_threads", config.host_threads)
        worker_class = _validate.subclass("worker_class", config.worker_class, Worker)
        worker_args = _validate.options_dict("worker_args", config.worker_args)
        if worker_args.setdefault("n_envs", self.envs_per_worker) != self.envs_per_worker:
            raise ValueError(
                f"worker_args: n_envs ({worker_args['n_envs']}) must equal envs_per_worker "
                f"({self.envs_per_worker}); set envs_per_worker instead"
            )
        backend_options = _validate.options_dict("backend_options", config.backend_options)
        self.n_processes = self.traits.hosts_started(n_processes, n_workers, backend_options)
        self._requested_processes = n_processes
        self.memory = BatchMemory()
        self.admission: Admission | None = None
        """The open stream's admission control (lane backends with ``max_policy_lag``)."""
        self._factory = WorkerFactory(
            max_episode_length=max_episode_length,
            seed=seed,
            n_workers=n_workers,
            worker_class=worker_class,
            worker_args=worker_args,
        )
        self.env_sources = self._check_envs(config.env, "env")
        self.agents = self._check_agents(agent)
        # An async agent may run in the hosts only beside async envs: where the env may be one,
        # its check waits for the probe env (_settle_kind).
        self._host_awaits = maybe_async(self.env_sources[0]) and self.traits.host_mode
        own = worker_class.compute_actions is not Worker.compute_actions
        exact = _resume.wants_exact_resume(self.env_sources, resume)
        timed = config.metrics is not None and config.metrics is not False
        shared = self.traits.shared_calls and not timed
        setup = Setup(self.traits.host_mode, self.episode_timeout, own, exact, shared)
        # The env hosts if the arguments set them (else None: this machine's CPU count).
        given = n_processes is not None or bool(
            {"n_processes", self.traits.per_host} & {*backend_options}
        )
        layout = (n_workers, self.n_processes if given else None)
        self.inference = choose_inference(config.inference, agent, setup, layout)
        options = check_inference(self.inference.given, agent, awaited=self._host_awaits)
        self._options, self._worker_class = options, worker_class  # for _settle_kind
        # Each env stepped on its own (_env_tasks): on the lane backends, and on the host
        # backends once the probe env says the envs are async envs (_settle_kind).
        self.lanes = self.traits.per_env
        self.hosted_lanes = False  # async envs in the env hosts' event loops

        lanes = None
        if self.lanes:
            options = self._check_lane_inference(options, worker_class)
            lanes = LaneSettings(self.max_restarts, self._count_restart, lambda: self.admission)
        follow = self.inference.follows  # your agent's copies in the hosts follow it
        self.mode: InferenceMode = make_mode(options, self._shared_agent_now, lanes, follow)
        if isinstance(options, Host):
            self._check_host_mode(agent, worker_class)
            if not self._host_awaits:
                check_chunked_host(self.agents, self.episode_timeout)
        kind = self.traits
        if kind.async_envs or not loop_runs_here():
            # No loop to stall (or an async env, built on the loop like every other): now.
            self._take_probe(
                probe_spaces(
                    self.env_sources[0],
                    asynchronous=True if kind.async_envs else (None if kind.async_hosts else False),
                    max_episode_length=self._factory.max_episode_length,
                    close_timeout=self.close_timeout,
                )
            )
        else:
            # Built in a thread meanwhile, read as the sampler starts; what needs no env is
            # checked now: the memory of the envs themselves (the spaces add their buffers).
            self._probe = Probe(
                self.env_sources[0],
                max_episode_length=self._factory.max_episode_length,
                either=kind.async_hosts,
                close_timeout=self.close_timeout,
            )
            self._check_memory(_NO_SPACE, _NO_SPACE, 0)
        if max_concurrency is not None and not (self.lanes or maybe_async(self.env_sources[0])):
            self._refuse_max_concurrency()  # blocking envs for sure (an id...): refused now
        self.seed, self.seeds = worker_seeds(seed, n_workers, self.envs_per_worker)
        self.agent_seeds = [s.agent_seed for s in self.seeds]
        # RandomAgents are built as the sampler starts: a constructor costs O(1) in workers.
        self._random_agents = agent is None
        self.backend_options = backend_options
        self.workers: list[Worker] = []
        self.backend: Backend | None = None
        self._lock = asyncio.Lock()  # bound to the loop of its first use
        self.stream_guard = StreamGuard()
        self.started = False
        self.closed = False
        self.last_mode: Mode | None = None
        self.warned_endless = False
        self.total_env_steps = 0
        self.streaming = False
        self.run_ahead = not self.inference.auto  # "host" runs ahead only if asked (checkpoints)
        self.test_env = None if test_env is None else _validate.env_source("test_env", test_env)
        self.restarts = 0
        self.last_stats: SampleStats | None = None
        self.metrics = make_metrics(
            config.metrics,
            backend=backend,
            n_workers=n_workers,
            env_parallel=self.traits.env_parallel(
                max_concurrency, n_workers * self.envs_per_worker, self.n_processes, self.lanes
            ),
            agent_parallel=self.n_processes if isinstance(self.mode, HostMode) else 1,
            lanes=self.lanes,  # the hosts count their env calls in flight (lane hosts' clocks)
        )

    async def start(self) -> None:
        self.check_open()
        if self.started:
            return
        async with self.locked("start"):
            await self.start_unlocked()

    @property
    def env_spec(self) -> EnvSpec:
        """The probe env's spaces and the step limit in force (waits for a probe in a thread:
        started samplers never do)."""
        if self._spec is None:
            assert self._probe is not None
            self._take_probe(self._probe.result())
        assert self._spec is not None
        return self._spec

    def _take_probe(self, probed: Probed) -> None:
        """Keep what the probe env told, once the checks that need its spaces passed."""
        self._probe_closing = probed.closing
        self._settle_kind(probed.asynchronous)
        spec = probed.spec
        self._check_memory(
            spec.observation_space,
            spec.action_space,
            self.mode.chunk_steps(lambda steps: self._chunk_capacity(steps, spec)),
        )
        self._time_limited = probed.time_limited
        bind_agents(self.agents, spec)  # a multi-agent env's agents per policy
        self._spec = spec

    def _settle_kind(self, async_envs: bool) -> None:
        """The probe env is an async env (``async_envs``): on a host backend, each env is then
        stepped on its own in the hosts' event loops (the lanes), with the lanes' checks."""
        if isinstance(self._options, Host) and self._host_awaits and not async_envs:
            # Blocking envs after all: chunks of steps in the hosts.
            check_chunked_host(self.agents, self.episode_timeout)
        if async_envs and not self.lanes:
            self.hosted_lanes = True
            self._check_lane_inference(self._options, self._worker_class)
            self.lanes = True
            self.mode.lanes = LaneSettings(
                self.max_restarts, self._count_restart, lambda: self.admission
            )
            metrics = getattr(self, "metrics", None)  # made already if the probe is read at start
            if metrics is not None:
                metrics.state.lanes = True
        if self.max_concurrency is not None and not self.lanes:
            self._refuse_max_concurrency()

    def _refuse_max_concurrency(self) -> None:
        raise ValueError(
            "max_concurrency caps the env calls in flight of async envs and of backend="
            f"{with_trait('per_env')}, got it with backend={self.backend_name!r} and blocking "
            "envs (there, n_workers x envs_per_worker envs step at once)"
        )

    def _check_memory(
        self, observation_space: gym.Space[Any], action_space: gym.Space[Any], chunk_steps: int
    ) -> None:
        _validate.memory_fits(
            observation_space,
            action_space,
            n_workers=self.n_workers,
            envs_per_worker=self.envs_per_worker,
            chunk_steps=chunk_steps,
            shared=self.traits.shared_memory,
            max_sequence_length=self.max_sequence_length,
        )

    async def start_unlocked(self) -> None:
        if self.started:
            return
        if self._spec is None and self._probe is not None:  # the probe env built meanwhile
            self._take_probe(await self._probe.wait())
        options: dict[str, Any] = {
            "n_processes": self._requested_processes or os.cpu_count() or 1,
            "step_timeout": self.step_timeout,
            "host_threads": self.host_threads,
        }
        options["close_timeout"] = self.close_timeout  # every backend bounds its closes
        if self.lanes:
            options["max_concurrency"] = self.max_concurrency
        options.update(self.backend_options)
        if self._random_agents:
            self._random_agents = False
            if self.n_workers < _OFF_LOOP_WORKERS:
                self.agents = self._make_random_agents()
            else:
                self.agents = await asyncio.to_thread(self._make_random_agents)
        if self.resume is not None:  # the envs are built with the seeds they had
            _resume.check_shape(self.resume, self)
            _resume.position_seeds(self, self.resume)
        backend = make_backend(self.backend_name, **options)
        self.backend = backend
        try:
            specs = [
                HostSpec(
                    worker=w,
                    n_envs=self.envs_per_worker,
                    observation_space=self.env_spec.observation_space,
                    action_space=self.env_spec.action_space,
                    max_episode_length=self.max_episode_length,
                    chunk_steps=self.mode.chunk_steps(self._chunk_capacity),
                    timed=self.metrics is not None,
                    lanes=self.hosted_lanes,
                    columns=True,
                )
                for w in range(self.n_workers)
            ]
            hosts = await backend.start(specs)
            workers = [self._factory(w) for w in range(self.n_workers)]
            for worker in workers:
                worker.episodes.episode_timeout = self.episode_timeout
            await run_all(
                [
                    worker.attach(
                        host, self.env_spec, self.agents[w], self.env_sources[w], self.seeds[w]
                    )
                    for w, (worker, host) in enumerate(zip(workers, hosts))
                ]
            )
            self.mode.attach(workers, self.agent_seeds)
            if self.metrics is not None:
                self.metrics.attach(workers, self.mode.merger if self.lanes else None)
        except BaseException:
            self.backend = None
            await asyncio.shield(backend.aclose())
            raise
        self.workers = workers
        self.started = True
        if self.resume is not None:
            self.resumed = await _resume.restore(self, self.resume)
            self.resume = None

    async def checkpoint(self) -> SamplerState:
        """:meth:`Sampler.checkpoint`: between two rounds of an open stream, else between calls."""
        self.check_open()
        if self.stream_checkpoint is not None:
            return await self.stream_checkpoint()
        async with self.locked("checkpoint"):
            self.check_open()
            await self.start_unlocked()
            _resume.check_no_stream_pending(self, "checkpoint")
            return await _resume.capture(self)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        backend, self.backend = self.backend, None
        if backend is not None:
            await asyncio.shield(backend.aclose())
        closing, self._probe_closing = self._probe_closing, None
        if closing is None and self._spec is None and self._probe is not None:
            closing = await self._probe_closing_now()
        # An async close bounds itself; a blocking one in its thread is abandoned here.
        await wait_probe_closed(closing, self.close_timeout)
        if self.metrics is not None:
            self.metrics.close()
        await self.mode.aclose()

    async def _probe_closing_now(self) -> Any:
        """Closed before it started: the close of the probe env still being built, if it is built
        within ``close_timeout`` (else its thread is abandoned, and closes the env when done)."""
        assert self._probe is not None
        try:
            probed = await self._probe.wait_for(self.close_timeout)
        except Exception:  # refused: what it built is closed by its thread
            return None
        if probed is None:
            warnings.warn(
                "the env built to read the spaces was not built within "
                f"close_timeout={self.close_timeout:g}s; its thread is abandoned",
                ResourceWarning,
                stacklevel=3,
            )
            return None
        return probed.closing

    def close_now(self) -> bool:
        """Release the hosts without awaiting (``__del__``); whether there was anything to."""
        if self.closed or self.backend is None:
            return False
        close_now = getattr(self.backend, "close_now", None)
        if close_now is not None:
            close_now()
        return True

    async def update_agent(self, agent_update: AgentUpdateArg) -> None:
        """:meth:`Sampler.update_agent`: at once during a stream, else under the lock."""
        self.check_open()
        self.check_agent_update(agent_update)
        if self.streaming:
            self.apply_agent_update(agent_update, reset=False)
            return
        async with self.locked("update_agent"):
            self.check_open()
            await self.start_unlocked()
            self.apply_agent_update(agent_update, reset=not self.free_shares)

    @property
    def free_shares(self) -> bool:
        """Fragments fill a quota from any env and go on across updates (lanes, no fixed shares)."""
        return self.lanes and not self.fixed_shares

    def newest_agent_version(self) -> int:
        return max(w.agent_version for w in self.workers)

    def first_agent(self) -> Agent | None:
        """Worker 0's agent (``None`` before the sampler starts)."""
        return self.workers[0].agent if self.workers else None

    async def call(
        self,
        mode: Mode,
        quota: int,
        agent_update: AgentUpdateArg,
        env_update: EnvUpdateArg,
        fraction: float = 1.0,
    ) -> EpisodeBatch:
        self.check_open()
        self.check_agent_update(agent_update)
        env_updates = self.check_env_update(env_update)
        started = None if self.metrics is None else self.metrics.call_started()
        async with self.locked(_CALLS[mode][1]):
            self.check_open()
            await self.start_unlocked()
            _resume.check_no_stream_pending(self, _CALLS[mode][1])
            if mode != "fragments" and not self.warned_endless:
                self.warn_if_endless()
            self.apply_agent_update(agent_update, reset=not self.free_shares)
            if env_updates is not None:
                await run_all(
                    [w.update_env(u) for w, u in zip(self.workers, env_updates) if u is not None]
                )
            # obtain_fragments continues the fragments of a previous obtain_fragments call.
            fragments = mode == self.last_mode == "fragments"
            resume = Resume.FRAGMENTS if fragments else Resume.NOTHING
            self.last_mode = mode
            batch, stats = await self.sample_round(mode, quota, resume=resume, fraction=fraction)
        self.total_env_steps += batch.n_transitions
        self.last_stats = stats
        if started is not None:
            self.metrics.call_ended(started)  # type: ignore[union-attr]
        return batch

    async def sample_round(
        self,
        mode: Mode,
        quota: int,
        *,
        resume: Resume = Resume.NOTHING,
        leave: Resume = Resume.NOTHING,
        fraction: float = 1.0,
        ahead: bool = False,
    ) -> tuple[EpisodeBatch, SampleStats]:
        """Run every worker's share of one call and put the pieces together, worker-major;
        ``ahead``: another round of a stream follows, which a mode may start as a part ends."""
        start, restarts = time.perf_counter(), self.restarts
        self.mode.round_starts(self.workers)
        for worker in self.workers:
            worker.finished.clear()
        free = mode == "fragments" and self.free_shares
        pool = FreeQuota(quota, self.n_workers * self.envs_per_worker) if free else None
        shared = None if pool is not None else self._shared_quota(mode, quota, fraction)
        done_at = [start] * self.n_workers
        # The workers with a share, the first ones (_share): a lane round waits for each.
        starters = sum(self._share(mode, quota, w) > 0 for w in range(self.n_workers))
        lane_round = None
        if self.lanes and leave is Resume.EPISODES and mode == "samples":
            lane_round = LaneRound(starters)

        then = leave if ahead and shared is None and mode != "episodes" else None

        async def drive(worker: Worker) -> Plan | None:
            part = Part(resume, leave, shared, then, lane_round, pool, starters)
            plan = await self._drive(worker, mode, quota, part)
            done_at[worker.worker_number] = time.perf_counter()
            return plan

        plans = await run_all([drive(w) for w in self.workers])
        end = time.perf_counter()
        batch = await assemble_off_loop(
            self.env_spec, [p for p in plans if p is not None], self.memory
        )
        stats = SampleStats.collect(
            [f for w in self.workers for f in w.finished],
            transitions=batch.n_transitions,
            seconds=time.perf_counter() - start,
            agent_version=self.newest_agent_version(),
            restarts=self.restarts - restarts,
            worker_transitions=[0 if p is None else int(p.lengths.sum()) for p in plans],
            worker_wait_seconds=[end - t for t in done_at],
        )
        if self.metrics is not None:  # folded once per round
            self.metrics.fold(self.workers, batch.agent_versions, end - start)
        return batch, stats

    def _shared_quota(self, mode: Mode, quota: int, fraction: float) -> SharedQuota | None:
        """The call's shared quota, ``None`` for the fixed shares of ``fraction_samples=1``."""
        if fraction >= 1.0 or mode == "episodes":
            return None
        shares = {w: share_of(quota, self.n_workers, w) for w in range(self.n_workers)}
        # round() first: 0.1 * 30 is 3.0000000000000004 in floating point (ceil: 4, not 3).
        minimums = {w: math.ceil(round(fraction * n, 9)) for w, n in shares.items() if n > 0}
        return SharedQuota(quota, minimums)

    def _share(self, mode: Mode, quota: int, worker: int) -> int:
        """Worker ``worker``'s share of a call: all of ``quota`` for episodes, else share_of's."""
        return quota if mode == "episodes" else share_of(quota, self.n_workers, worker)

    async def _drive(self, worker: Worker, mode: Mode, quota: int, part: Part) -> Plan | None:
        """Run one worker's part of a call, rebuilding its host after failures."""
        share = self._share(mode, quota, worker.worker_number)
        if share == 0:
            return None
        rule = StopRule.for_call(_CALLS[mode][0], share, worker.n_envs)
        worker.episodes.begin(part.resume, rule, ahead=part.then is not None)
        async with self.mode.part(worker):
            stepper = self.mode.stepper(worker, part)
            plan = await self._drive_steps(worker, stepper, part.leave, part.quota)
            await self.mode.ended(stepper)  # the plan is taken: the host may go on
            return plan

    def _count_restart(self, worker: int, failure: WorkerError) -> None:
        """Count an env rebuilt alone (the lane backends)."""
        self.restarts += 1
        if self.metrics is not None:
            self.metrics.fault(worker, failure)

    async def _drive_steps(
        self,
        worker: Worker,
        stepper: Any,
        leave: Resume,
        shared: SharedQuota | None = None,
    ) -> Plan:
        """The retry loop of :meth:`_drive` (at most ``max_restarts`` restarts in the call)."""
        w = worker.worker_number
        budget = RestartBudget(self.max_restarts)

        async def attempt(failure: WorkerError | None) -> Plan:
            if failure is not None:
                self.restarts += 1
                logger.warning(
                    "worker %d: restarting its env host (restart %d of at most %d in this "
                    "call, %d in all) after %s: %s",
                    w,
                    budget.used,
                    budget.limit,
                    worker.restarts + 1,
                    type(failure).__name__,
                    str(failure).split("\n", 1)[0],
                )
            if worker.episodes.state is Continuity.BROKEN:  # failed here, or in an earlier call
                dropped = await worker.restart_host()
                if dropped:
                    logger.info(
                        "worker %d: %d episode(s) in progress were dropped by the env-host "
                        "restart and will be redone",
                        w,
                        dropped,
                    )
            with worker.naming_factories():
                return await run_part(worker, stepper, leave, shared)

        def failed(exc: WorkerError) -> None:
            worker.episodes.state = Continuity.BROKEN
            if self.metrics is not None:
                self.metrics.fault(w, exc)

        return await budget.run(attempt, lambda exc: exc.retry, failed)

    def check_agent_update(self, agent_update: Any) -> None:
        if agent_update is None:
            return
        items = agent_update if isinstance(agent_update, list) else [agent_update]
        self.mode.check_update(agent_update)
        if isinstance(agent_update, list):
            if len(agent_update) != self.n_workers:
                raise ValueError(
                    f"agent_update: a list must hold exactly n_workers ({self.n_workers}) "
                    f"updates, one per worker, got {len(agent_update)}"
                )
            if any(isinstance(u, _PARAMS) for u in items) and self._shared_agent():
                raise ValueError(
                    "agent_update: a list of parameter sets needs a list of agents (one per "
                    "worker), but the sampler has one shared agent"
                )
        for u in items:
            if (
                u is not None
                and not isinstance(u, _PARAMS)
                and not callable(getattr(u, "get_actions", None))
            ):
                raise TypeError(
                    "agent_update must be None, parameters (dict, tuple or numpy.ndarray), an "
                    f"Agent (with get_actions), or a list of those; got {type(u).__name__}"
                )

    def _shared_agent_now(self) -> Agent:
        agent = self.workers[0].agent  # inference="batched": every worker has the same one
        assert agent is not None
        return agent

    def _make_random_agents(self) -> list[Agent]:
        space = self.env_spec.action_space
        return [RandomAgent(space, seed=seed) for seed in self.agent_seeds]

    def _shared_agent(self) -> bool:
        if self._random_agents:  # one RandomAgent per worker, once started
            return False
        agents = [w.agent for w in self.workers] if self.workers else self.agents
        return len({id(a) for a in agents}) < len(agents)

    def apply_agent_update(self, agent_update: Any, *, reset: bool = True) -> None:
        if agent_update is None:
            return
        self.mode.apply_update(
            agent_update,
            lambda: self._apply_agent_update_now(agent_update, reset=reset),
            self.workers,
            self.agent_seeds,
        )

    def _apply_agent_update_now(self, agent_update: Any, *, reset: bool) -> None:
        if isinstance(agent_update, list):
            for worker, update in zip(self.workers, agent_update):
                worker.update_agent(update, reset=reset)
            return
        seen: set[int] = set()
        for worker in self.workers:
            # Parameters go to each distinct agent once; every worker bumps its version.
            first = id(worker.agent) not in seen
            seen.add(id(worker.agent))
            apply = first or not isinstance(agent_update, _PARAMS)
            worker.update_agent(agent_update, apply=apply, reset=reset)

    def check_env_update(self, env_update: Any) -> list[Any] | None:
        if env_update is None:
            return None
        per_worker = _validate.per_worker_sources(
            "env_update", env_update, self.n_workers, self.envs_per_worker
        )
        if not self.traits.in_process:
            for update in per_worker:
                _validate.check_picklable("env_update", update)
        return per_worker

    def _check_envs(self, env: Any, name: str) -> list[Any]:
        if env is None:
            raise TypeError(f"{name} must be a gymnasium id or an env factory, got None")
        per_worker = _validate.per_worker_sources(name, env, self.n_workers, self.envs_per_worker)
        distinct = {id(item): item for item in per_worker}.values()  # a shared source: once
        for item in distinct:
            if item is None or (isinstance(item, list) and None in item):
                raise TypeError(f"{name} must not contain None")
        if not self.traits.in_process:
            for item in distinct:
                _validate.check_picklable(name, item)
        return per_worker

    def _check_lane_inference(
        self, options: Batched | Host | None, worker_class: type[Worker]
    ) -> Batched | Host | None:
        """The lane backends batch agent calls themselves: no ``host`` mode (but for async envs
        in the env hosts, whose agent copies act there) or hooks there."""
        if isinstance(options, Host) and not self.hosted_lanes:
            raise ValueError(
                f"inference='host' needs backend={with_trait('host_mode')}, got "
                f"backend={self.backend_name!r}: its envs live in this process, so the agent "
                "already runs beside them (use inference='per_worker' or 'batched')"
            )
        if isinstance(options, Batched):
            options.check_per_env(self.backend_name)
        if worker_class.compute_actions is not Worker.compute_actions or (
            worker_class.process_transition is not Worker.process_transition
        ):
            raise ValueError(
                f"worker_class {worker_class.__name__} overrides compute_actions or "
                f"process_transition, which backend={self.backend_name!r} does not call (its "
                "envs are not stepped in lockstep): wrap the agent instead"
            )
        return options

    def _check_agents(self, agent: Any) -> list[Agent]:
        if agent is None:
            return [None] * self.n_workers  # type: ignore[list-item]
        agents = agent if isinstance(agent, list) else [agent] * self.n_workers
        if isinstance(agent, list) and len(agent) != self.n_workers:
            raise ValueError(
                f"agent: a list must hold exactly n_workers ({self.n_workers}) agents, got "
                f"{len(agent)}"
            )
        for a in agents:
            _validate.has_method("agent", a, "get_actions", args="observations")
        return list(agents)

    def _check_host_mode(self, agent: Any, worker_class: type[Worker]) -> None:
        """inference="host": the backend, the worker class and the agents must allow it."""
        name = self.backend_name
        if not self.traits.host_mode:
            raise ValueError(
                "inference='host' runs the agent inside the env hosts: it needs "
                f"backend={with_trait('host_mode')}, got backend={name!r} (with {name!r} every "
                "env already lives in this process: use inference='per_worker')"
            )
        if worker_class.compute_actions is not Worker.compute_actions:
            raise ValueError(
                f"inference='host': worker_class {worker_class.__name__} overrides "
                "compute_actions, which would never be called (the agent runs in the env "
                "hosts); wrap the agent instead, or use inference='per_worker'"
            )
        if agent is not None:
            for a in distinct(self.agents):
                # TypeError naming the agent when it cannot travel
                pickle_agent(a, awaited=self._host_awaits)

    def _chunk_capacity(self, chunk_steps: int, spec: EnvSpec | None = None) -> int:
        """A host slot's chunk capacity for chunks of ``chunk_steps`` (host mode; shared memory:
        the process backend's hosts write observations into an arena)."""
        spec = self.env_spec if spec is None else spec
        obs, act, arena = spec.observation_space, spec.action_space, self.traits.shared_memory
        return chunk_capacity(obs, act, self.envs_per_worker, chunk_steps, arena=arena)

    def warn_if_endless(self) -> None:
        self.warned_endless = True
        if self.max_episode_length is None and not self._time_limited:
            warnings.warn(
                "the env has no time limit and max_episode_length is None: if its episodes "
                "never terminate, a complete-episode call never returns",
                RuntimeWarning,
                stacklevel=4,
            )

    def check_open(self) -> None:
        if self.closed:
            raise SamplerClosedError("the sampler is closed; create a new one to sample again")

    @contextlib.asynccontextmanager
    async def locked(self, call: str) -> AsyncIterator[None]:
        """Hold the sampler for ``call``; calls from other tasks queue behind the holder, and a
        call from the body of an open ``stream()`` raises :class:`SamplerBusyError` at once."""
        self.stream_guard.check(call)
        async with self._lock:
            if call != "stream":
                yield
                return
            self.stream_guard.opened()
            try:
                yield
            finally:
                self.stream_guard.closed()


#: The smallest space: what the memory check counts for envs whose spaces are not known yet.
_NO_SPACE = gym.spaces.Discrete(1)

#: From this many workers, the built-in RandomAgents are built in a thread, off the loop.
_OFF_LOOP_WORKERS = 4096

#: Each call mode's rule for the engine, and the public call's name.
_CALLS: dict[Mode, tuple[CallMode, str]] = {
    "samples": (CallMode.SAMPLES, "obtain_samples"),
    "episodes": (CallMode.EPISODES, "obtain_exact_episodes"),
    "fragments": (CallMode.FRAGMENTS, "obtain_fragments"),
}
