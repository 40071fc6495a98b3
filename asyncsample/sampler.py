"""The async sampler: lifecycle and the public calls.

Argument checks live in :mod:`asyncsample._validate`, ``stream()`` in
:mod:`asyncsample.streaming`, ``evaluate()``'s helpers in :mod:`asyncsample.evaluation`, and what a
worker records in :mod:`asyncsample._recorder`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Sequence
from typing import Any, Literal, TypeVar

import gymnasium as gym
import numpy as np

from asyncsample import _validate, evaluation, streaming
from asyncsample._assembly import Plan, assemble
from asyncsample._recorder import Resume
from asyncsample._tree import tree_leaves
from asyncsample.agent import Agent, AgentUpdate, RandomAgent
from asyncsample.backends import BACKENDS, Backend, HostSpec, make_backend
from asyncsample.batch import EnvSpec, EpisodeBatch
from asyncsample.env_update import EnvChoice, EnvSource, make_env
from asyncsample.errors import SamplerClosedError, WorkerError
from asyncsample.evaluation import Evaluation
from asyncsample.inference import Batched, Batcher, Host, HostInference, check_inference
from asyncsample.seeding import worker_seeds
from asyncsample.stats import SampleStats
from asyncsample.worker import SharedQuota, VecWorker, Worker, WorkerDriver, WorkerFactory

__all__ = ["AgentUpdateArg", "EnvUpdateArg", "Sampler"]

logger = logging.getLogger("asyncsample")

Mode = Literal["samples", "episodes", "fragments"]
_PARAMS = (dict, tuple, np.ndarray)
_T = TypeVar("_T")

AgentUpdateArg = AgentUpdate | list[AgentUpdate]
"""An agent update for a sampler call: one for every worker, or a list of one per worker."""

EnvUpdateArg = EnvChoice | list[EnvChoice]
"""An env update for a sampler call: one for every worker, or a list of one per worker."""


class Sampler:
    """Collects episodes from ``n_workers`` worker coroutines whose envs live in env hosts.

    Args:
        env: a gymnasium id, a zero-argument callable returning a ``gymnasium.Env``, a
            ``gymnasium.Env`` (deep-copied per env), an :class:`EnvUpdate`, or a list of exactly
            ``n_workers`` of those (one per worker; an inner list gives one per env).
        agent: one :class:`Agent` shared by all workers, a list of ``n_workers`` agents, or
            ``None`` for a :class:`RandomAgent` per worker seeded from ``seed``.
        n_workers: worker coroutines.
        envs_per_worker: env copies stepped together by one worker.
        n_processes: how many env hosts (processes, or Ray actors) to start at most (default:
            the CPU count); the attribute of that name reports how many are actually started.
        max_episode_length: episodes are truncated (TIMEOUT) at this many steps.
        seed: root of every seed; ``None`` draws one (see :attr:`seed`).
        backend: ``"process"``, ``"local"`` (in the event loop's thread) or ``"ray"``.
        step_timeout: seconds after which a step counts as a worker failure.
        max_restarts: per worker and call, how often a failed env host is rebuilt before the
            error is raised.
        worker_class: the :class:`Worker` subclass to run (garage's ``worker_class``).
        worker_args: extra keyword arguments for ``worker_class``.
        backend_options: extra keyword arguments for the backend (e.g. Ray resources).
        test_env: the env :meth:`evaluate` uses by default (default: the training env).
        inference: where the policy runs: ``"per_worker"`` (each worker calls its agent) or
            ``"batched"`` (one shared agent; the workers' concurrent calls become one call on
            the stacked observations), or an :class:`asyncsample.inference.Batched` with
            batching options, or ``"host"`` (a copy of the agent in every env host, stepping
            chunks of steps; ``process`` and ``ray`` backends; see
            :mod:`asyncsample.inference.host`), or an :class:`asyncsample.inference.Host` with
            chunking options.
        host_threads: intra-op threads of the numeric libraries (torch, OpenMP, MKL, OpenBLAS)
            in each env host (process or Ray actor); ``None`` leaves the libraries' defaults.
            One by default: hosts share the cores, and a library that spreads each small
            product over all of them makes the hosts fight over them. Ignored by ``local``.

    Env-host restarts are logged as warnings, and episodes dropped by a restart or by
    ``max_policy_lag`` at info level, on ``logging.getLogger("asyncsample")``.
    """

    def __init__(
        self,
        env: EnvSource | list[Any],
        agent: Agent | list[Agent] | None = None,
        *,
        n_workers: int = 2,
        envs_per_worker: int = 1,
        n_processes: int | None = None,
        max_episode_length: int | None = None,
        seed: int | None = None,
        backend: str = "process",
        step_timeout: float | None = None,
        max_restarts: int = 3,
        worker_class: type[Worker] = VecWorker,
        worker_args: dict[str, Any] | None = None,
        backend_options: dict[str, Any] | None = None,
        test_env: EnvSource | None = None,
        inference: str | Batched | Host = "per_worker",
        host_threads: int | None = 1,
    ) -> None:
        self._closed = True  # until construction succeeds: __del__ must not warn
        n_workers = _validate.positive_int("n_workers", n_workers)
        envs_per_worker = _validate.positive_int("envs_per_worker", envs_per_worker)
        n_processes = _validate.optional_positive_int("n_processes", n_processes)
        max_episode_length = _validate.optional_positive_int(
            "max_episode_length", max_episode_length
        )
        seed = _validate.seed("seed", seed)
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise ValueError(
                f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
            )
        step_timeout = _validate.positive_seconds("step_timeout", step_timeout)
        if step_timeout is not None and backend == "local":
            raise ValueError(
                "step_timeout cannot be used with backend='local': a step that blocks the "
                "event loop's thread cannot be pre-empted; use backend='process'"
            )
        max_restarts = _validate.nonnegative_int("max_restarts", max_restarts)
        host_threads = _validate.optional_positive_int("host_threads", host_threads)
        if not (isinstance(worker_class, type) and issubclass(worker_class, Worker)):
            raise TypeError(f"worker_class must be a subclass of Worker, got {worker_class!r}")
        worker_args = _validate.options_dict("worker_args", worker_args)
        if worker_args.setdefault("n_envs", envs_per_worker) != envs_per_worker:
            raise ValueError(
                f"worker_args: n_envs ({worker_args['n_envs']}) must equal envs_per_worker "
                f"({envs_per_worker}); set envs_per_worker instead"
            )
        backend_options = _validate.options_dict("backend_options", backend_options)

        self.n_workers = n_workers
        self.envs_per_worker = envs_per_worker
        self.n_processes = _hosts_started(backend, n_processes, n_workers, backend_options)
        """Env hosts the backend starts: ``min(n_processes or cpu count, n_workers)`` processes
        or actors (worker ``w`` lives on host ``w % n_processes``; Ray's ``workers_per_actor``
        option sets ``ceil(n_workers / workers_per_actor)``); ``1`` for ``local``, whose envs all
        live in this process."""
        self._requested_processes = n_processes
        self.max_episode_length = max_episode_length
        self.backend_name = backend
        self.step_timeout = step_timeout
        self.host_threads = host_threads
        self.max_restarts = int(max_restarts)
        self._factory = WorkerFactory(
            max_episode_length=max_episode_length,
            seed=seed,
            n_workers=n_workers,
            worker_class=worker_class,
            worker_args=worker_args,
        )
        self._env_sources = self._check_envs(env, "env")
        self._agents = self._check_agents(agent)
        # --- hook: inference= (validated before any work) ---
        self._inference = check_inference(inference, agent)
        self._batcher: Batcher | None = None
        # --- hook: inference="host" (the agent runs in the env hosts; see inference/host.py) ---
        self._host: HostInference | None = None
        if isinstance(self._inference, Host):
            self._host = HostInference(self._inference)
            self._inference = None
            self._check_host_mode(agent, worker_class)
        self._env_spec, self._time_limited = self._probe_env(self._env_sources[0])
        self.seed, self._seeds = worker_seeds(seed, n_workers, envs_per_worker)
        if agent is None:
            space = self._env_spec.action_space
            self._agents = [RandomAgent(space, seed=s.agent_seed) for s in self._seeds]
        self._backend_options = backend_options
        self.workers: list[Worker] = []
        self._backend: Backend | None = None
        self._lock: asyncio.Lock | None = None
        self._lock_holder: tuple[asyncio.Task[Any] | None, str] | None = None
        self._started = False
        self._closed = False
        self._last_mode: Mode | None = None
        self._warned_endless = False
        self._total_env_steps = 0
        self._streaming = False
        self._evaluators: dict[bool, tuple[Sampler, Any]] = {}
        self._test_env: EnvSource | None = None
        if test_env is not None:
            self._test_env = _validate.env_source("test_env", test_env)
        self.restarts = 0
        """Env-host restarts so far (after env failures or crashes)."""
        self.last_stats: SampleStats | None = None
        """Statistics of the last call, or of the batch a stream yielded last."""

    @classmethod
    def from_worker_factory(
        cls,
        worker_factory: WorkerFactory,
        agents: Agent | list[Agent] | None,
        envs: EnvSource | list[Any],
        **kwargs: Any,
    ) -> Sampler:
        """Build a sampler from a :class:`WorkerFactory` (garage's constructor).

        ``worker_args["n_envs"]``, if given, sets ``envs_per_worker``; ``kwargs`` are the other
        constructor arguments (``backend``, ``n_processes``...).
        """
        worker_args = dict(worker_factory.worker_args)
        kwargs.setdefault("envs_per_worker", worker_args.pop("n_envs", 1))
        return cls(
            envs,
            agents,
            n_workers=worker_factory.n_workers,
            max_episode_length=worker_factory.max_episode_length,
            seed=worker_factory.seed,
            worker_class=worker_factory.worker_class,
            worker_args=worker_args,
            **kwargs,
        )

    # -- properties ---------------------------------------------------------------------------

    @property
    def env_spec(self) -> EnvSpec:
        """The spaces of the envs and the episode length limit in force."""
        return self._env_spec

    @property
    def total_env_steps(self) -> int:
        """Transitions returned by this sampler so far."""
        return self._total_env_steps

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Sampler:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the backend and build every worker's envs (the first call does it if needed)."""
        self._check_open()
        async with self._locked("start"):
            await self._start()

    async def _start(self) -> None:
        if self._started:
            return
        options: dict[str, Any] = {
            "n_processes": self._requested_processes or os.cpu_count() or 1,
            "step_timeout": self.step_timeout,
            "host_threads": self.host_threads,
        }
        options.update(self._backend_options)
        backend = make_backend(self.backend_name, **options)
        self._backend = backend
        try:
            specs = [
                HostSpec(
                    worker=w,
                    n_envs=self.envs_per_worker,
                    observation_space=self._env_spec.observation_space,
                    action_space=self._env_spec.action_space,
                    max_episode_length=self.max_episode_length,
                    chunk_steps=self._chunk_steps(),  # --- hook: inference="host" ---
                )
                for w in range(self.n_workers)
            ]
            hosts = await backend.start(specs)
            workers = [self._factory(w) for w in range(self.n_workers)]
            await _run_all(
                [
                    worker.attach(
                        host, self._env_spec, self._agents[w], self._env_sources[w], self._seeds[w]
                    )
                    for w, (worker, host) in enumerate(zip(workers, hosts))
                ]
            )
            if self._host is not None:  # --- hook: inference="host": agents to the hosts ---
                self._host.install(workers, [s.agent_seed for s in self._seeds])
        except BaseException:
            self._backend = None
            await asyncio.shield(backend.aclose())
            raise
        self.workers = workers
        if isinstance(self._inference, Batched):  # --- hook: inference="batched" ---
            self._batcher = Batcher(self._shared_agent_now, self._inference)
            for worker in workers:
                worker.batcher = self._batcher
        self._started = True

    async def aclose(self) -> None:
        """Stop every worker and env host and release their resources. Idempotent."""
        if self._closed:
            return
        self._closed = True
        backend, self._backend = self._backend, None
        evaluators, self._evaluators = [e for e, _ in self._evaluators.values()], {}
        for evaluator in evaluators:
            await evaluator.aclose()
        if backend is not None:
            await asyncio.shield(backend.aclose())
        if self._batcher is not None:  # --- hook: inference="batched" ---
            self._batcher.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        if getattr(self, "_backend", None) is not None:
            warnings.warn(
                f"unclosed {self!r}: use 'async with Sampler(...)' or 'await sampler.aclose()'",
                ResourceWarning,
                stacklevel=2,
            )
            close_now = getattr(self._backend, "close_now", None)
            if close_now is not None:
                close_now()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._started else "not started")
        return (
            f"<Sampler backend={self.backend_name!r} n_workers={self.n_workers} "
            f"envs_per_worker={self.envs_per_worker} {state}>"
        )

    # -- sampling -----------------------------------------------------------------------------

    async def obtain_samples(
        self,
        num_samples: int,
        agent_update: AgentUpdateArg = None,
        env_update: EnvUpdateArg = None,
        *,
        fraction_samples: float = 1.0,
    ) -> EpisodeBatch:
        """Complete episodes whose lengths add up to at least ``num_samples``.

        Worker ``w`` steps its envs until the lengths of its completed episodes reach its share
        ``num_samples // n_workers + (w < num_samples % n_workers)``; every episode completing
        on that last step is kept, episodes still running are discarded. Worker-major order.

        Args:
            fraction_samples: in ``(0, 1]``. Below 1, a worker only has to reach
                ``ceil(fraction_samples * share)`` and fast workers go on past their share
                while the call's total is short of ``num_samples``; the call ends as soon as the
                total is reached and every worker has its minimum, so a straggler no longer
                holds the call. The split between workers then depends on timing: the batch is
                not reproducible for a fixed seed (``episode_infos["worker"]`` and
                ``last_stats.worker_transitions`` say who contributed what). ``1.0`` (default)
                is the fixed, reproducible split, where no worker goes past its share. A worker
                whose share is 0 (``num_samples < n_workers``) takes no part either way.
        """
        num_samples = _validate.positive_int("num_samples", num_samples)
        fraction = _validate.fraction("fraction_samples", fraction_samples)
        return await self._call("samples", num_samples, agent_update, env_update, fraction)

    async def obtain_exact_episodes(
        self,
        n_eps_per_worker: int,
        agent_update: AgentUpdateArg = None,
        env_update: EnvUpdateArg = None,
    ) -> EpisodeBatch:
        """Exactly ``n_eps_per_worker`` complete episodes from every worker, worker-major.

        Env ``i`` of a worker runs ``n // envs_per_worker + (i < n % envs_per_worker)`` of them.
        """
        n_eps_per_worker = _validate.positive_int("n_eps_per_worker", n_eps_per_worker)
        return await self._call("episodes", n_eps_per_worker, agent_update, env_update)

    async def obtain_fragments(
        self,
        num_samples: int,
        agent_update: AgentUpdateArg = None,
        env_update: EnvUpdateArg = None,
        *,
        fraction_samples: float = 1.0,
    ) -> EpisodeBatch:
        """At least ``num_samples`` transitions of complete episodes and running fragments.

        Each worker steps all its envs ``ceil(share / envs_per_worker)`` times. Fragments of
        episodes still running continue in the next ``obtain_fragments`` call (any other call or
        update resets them).

        Args:
            fraction_samples: in ``(0, 1]``. Below 1, a worker only has to return
                ``ceil(fraction_samples * share)`` transitions (steps x envs) and fast workers
                keep stepping while the call's total is short of ``num_samples``; the call ends
                as soon as the total is reached and every worker has its minimum. Every worker
                stops at a step boundary, so its fragments continue correctly in the next call.
                The split between workers then depends on timing (not reproducible for a fixed
                seed); ``1.0`` (default) is the fixed, reproducible split.
        """
        num_samples = _validate.positive_int("num_samples", num_samples)
        fraction = _validate.fraction("fraction_samples", fraction_samples)
        return await self._call("fragments", num_samples, agent_update, env_update, fraction)

    async def update_agent(self, agent_update: AgentUpdateArg) -> None:
        """Apply an agent update now; it bumps the agent version of the workers it touches.

        During a :meth:`stream` it takes effect at the next step boundary without resetting the
        episodes in progress; otherwise the next call starts fresh episodes.
        """
        self._check_open()
        self._check_agent_update(agent_update)
        if self._streaming:
            self._apply_agent_update(agent_update, reset=False)
            return
        async with self._locked("update_agent"):
            self._check_open()
            await self._start()
            self._apply_agent_update(agent_update)

    def stream(
        self,
        num_samples: int,
        *,
        fragments: bool = False,
        agent_update: AgentUpdateArg = None,
        max_policy_lag: int | None = None,
        buffer_size: int = 2,
        fraction_samples: float = 1.0,
    ) -> AsyncGenerator[EpisodeBatch, None]:
        """Yield batches of at least ``num_samples`` transitions while sampling goes on.

        Use it as ``async with contextlib.aclosing(sampler.stream(n)) as it: async for b in it``.
        Sampling runs in a background task, at most ``buffer_size`` batches ahead of the
        consumer: a slow consumer pauses the workers. Episodes in progress carry over from one
        batch to the next (complete episodes only, unless ``fragments``). :meth:`update_agent`
        takes effect at the next step; each episode records the agent version it started under,
        and ``max_policy_lag=k`` drops episodes that started more than ``k`` versions before
        the newest. Closing the stream stops the background sampling; batches buffered but
        never yielded are dropped and not counted. Other calls wait until the stream closes;
        a sampling call from the task that holds the open stream raises ``RuntimeError`` (it
        could never proceed). The arguments are checked when the first batch is asked for.

        ``fraction_samples`` (in ``(0, 1]``) applies to every sampling round as in
        :meth:`obtain_samples` (or :meth:`obtain_fragments` with ``fragments``): below 1, fast
        workers fill in for slow ones and the split between workers depends on timing.
        """
        return streaming.stream(
            self,
            num_samples,
            fragments=fragments,
            agent_update=agent_update,
            max_policy_lag=max_policy_lag,
            buffer_size=buffer_size,
            fraction_samples=fraction_samples,
        )

    async def evaluate(
        self,
        n_episodes: int = 10,
        *,
        agent: Agent | None = None,
        env: EnvSource | None = None,
        deterministic: bool = True,
        render: bool = False,
    ) -> Evaluation:
        """Run ``n_episodes`` evaluation episodes on separate test envs.

        The test envs (``env``, else the sampler's ``test_env``, else its training env) live in
        their own env hosts on the same backend, so evaluating never disturbs the training
        envs' episodes or seeds. With ``deterministic`` the agent is asked for deterministic
        actions (``get_actions(obs, deterministic=True)`` or ``get_deterministic_actions``,
        where it has them).

        Args:
            n_episodes: how many episodes.
            agent: the agent to evaluate (default: worker 0's agent).
            env: the test env (default: the sampler's ``test_env`` or training env).
            deterministic: ask the agent for deterministic actions.
            render: also return the ``rgb_array`` frames of the first episode (for a video).
        """
        return await evaluation.evaluate(
            self,
            n_episodes,
            agent=agent,
            env=env,
            deterministic=deterministic,
            render=render,
        )

    async def _call(
        self,
        mode: Mode,
        quota: int,
        agent_update: AgentUpdateArg,
        env_update: EnvUpdateArg,
        fraction: float = 1.0,
    ) -> EpisodeBatch:
        self._check_open()
        self._check_agent_update(agent_update)
        env_updates = self._check_env_update(env_update)
        async with self._locked(_CALL_NAMES[mode]):
            self._check_open()
            await self._start()
            if mode != "fragments" and not self._warned_endless:
                self._warn_if_endless()
            self._apply_agent_update(agent_update)
            if env_updates is not None:
                await _run_all(
                    [w.update_env(u) for w, u in zip(self.workers, env_updates) if u is not None]
                )
            # obtain_fragments continues the fragments of a previous obtain_fragments call.
            resume = Resume.NOTHING
            if mode == "fragments" and self._last_mode == "fragments":
                resume = Resume.FRAGMENTS
            self._last_mode = mode
            batch, stats = await self._sample(mode, quota, resume=resume, fraction=fraction)
        self._total_env_steps += batch.n_transitions
        self.last_stats = stats
        return batch

    async def _sample(
        self,
        mode: Mode,
        quota: int,
        *,
        resume: Resume = Resume.NOTHING,
        leave: Resume = Resume.NOTHING,
        fraction: float = 1.0,
    ) -> tuple[EpisodeBatch, SampleStats]:
        """Run every worker's share of one call and put the pieces together, worker-major.

        ``resume`` says what the call continues from the previous one; ``leave`` what a
        ``samples`` call leaves running for the next (``Resume.EPISODES`` in a stream).
        ``fraction`` below 1 (``fraction_samples``) shares the quota between the workers (see
        :class:`SharedQuota`); 1 keeps the fixed per-worker shares.
        """
        start, restarts = time.perf_counter(), self.restarts
        for worker in self.workers:
            worker.finished.clear()
        shared = self._shared_quota(mode, quota, fraction)
        done_at = [start] * self.n_workers

        async def drive(worker: WorkerDriver) -> Plan | None:
            plan = await self._drive(worker, mode, quota, resume, leave, shared)
            done_at[worker.worker_number] = time.perf_counter()
            return plan

        plans = await _run_all([drive(w) for w in self.workers])
        end = time.perf_counter()
        batch = await _assemble(self._env_spec, [p for p in plans if p is not None])
        stats = SampleStats.collect(
            [f for w in self.workers for f in w.finished],
            transitions=batch.n_transitions,
            seconds=time.perf_counter() - start,
            agent_version=max(w.agent_version for w in self.workers),
            restarts=self.restarts - restarts,
            worker_transitions=[0 if p is None else int(p.lengths.sum()) for p in plans],
            worker_wait_seconds=[end - t for t in done_at],
        )
        return batch, stats

    def _share(self, quota: int, worker: int) -> int:
        return quota // self.n_workers + (worker < quota % self.n_workers)

    def _shared_quota(self, mode: Mode, quota: int, fraction: float) -> SharedQuota | None:
        """The call's shared quota when ``fraction_samples < 1`` (``None``: fixed shares)."""
        if fraction >= 1.0 or mode == "episodes":
            return None
        shares = {w: self._share(quota, w) for w in range(self.n_workers)}
        # round() first: 0.1 * 30 is 3.0000000000000004 in floating point (ceil: 4, not 3).
        minimums = {w: math.ceil(round(fraction * n, 9)) for w, n in shares.items() if n > 0}
        return SharedQuota(quota, minimums)

    async def _drive(
        self,
        worker: WorkerDriver,
        mode: Mode,
        quota: int,
        resume: Resume,
        leave: Resume,
        shared: SharedQuota | None = None,
    ) -> Plan | None:
        """Run one worker's part of a call, rebuilding its host after failures."""
        w = worker.worker_number
        share = quota if mode == "episodes" else self._share(quota, w)
        if share == 0:
            return None
        worker._begin_call(resume, episodes=share if mode == "episodes" else None)
        if self._batcher is None:
            return await self._drive_steps(worker, mode, share, leave, shared)
        self._batcher.join(w)  # inference="batched": the batcher waits for this worker's rows
        try:
            return await self._drive_steps(worker, mode, share, leave, shared)
        finally:
            # A worker done with its part (also one that stopped at its minimum under
            # fraction_samples) leaves, so the flushes of the others do not wait for it.
            self._batcher.leave(w)

    async def _drive_steps(
        self,
        worker: WorkerDriver,
        mode: Mode,
        share: int,
        leave: Resume,
        shared: SharedQuota | None = None,
    ) -> Plan:
        """The retry loop of :meth:`_drive`: run the worker's plan, recovering after failures."""
        w = worker.worker_number
        needs_recovery = worker._needs_recovery
        restarts = 0
        while True:
            try:
                if needs_recovery:
                    dropped = await worker._recover()
                    needs_recovery = False
                    if dropped:
                        logger.info(
                            "worker %d: %d episode(s) in progress were dropped by the env-host "
                            "restart and will be redone",
                            w,
                            dropped,
                        )
                if self._host is not None:  # --- hook: inference="host": chunks ---
                    return await self._host.run(worker, mode, share, leave, shared)  # type: ignore[arg-type]
                if mode == "samples":
                    return await worker._run_samples(share, leave=leave, quota=shared)
                if mode == "episodes":
                    return await worker._run_episodes()
                return await worker._run_fragments(share, quota=shared)
            except WorkerError as exc:
                worker._mark_broken()
                if not exc.retry or restarts >= self.max_restarts:
                    raise
                restarts += 1
                self.restarts += 1
                logger.warning(
                    "worker %d: restarting its env host (restart %d of at most %d in this "
                    "call, %d in all) after %s: %s",
                    w,
                    restarts,
                    self.max_restarts,
                    worker.restarts + 1,
                    type(exc).__name__,
                    str(exc).split("\n", 1)[0],
                )
                needs_recovery = True

    # -- updates ------------------------------------------------------------------------------

    def _check_agent_update(self, agent_update: Any) -> None:
        if agent_update is None:
            return
        items = agent_update if isinstance(agent_update, list) else [agent_update]
        if isinstance(agent_update, list) and self._inference is not None:  # --- hook ---
            raise ValueError(
                "agent_update: inference='batched' shares one agent between all workers; pass "
                "one update (parameters or an agent), not a list"
            )
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

    def _shared_agent(self) -> bool:
        agents = [w.agent for w in self.workers] if self.workers else self._agents
        return len({id(a) for a in agents}) < len(agents)

    def _apply_agent_update(self, agent_update: Any, *, reset: bool = True) -> None:
        if agent_update is None:
            return
        if self._host is not None:  # --- hook: inference="host": updates travel to the hosts ---
            prepared = self._host.prepare_update(agent_update)  # checked before anything applies
            self._apply_agent_update_now(agent_update, reset=reset)
            seeds = [s.agent_seed for s in self._seeds]
            self._host.forward_update(self.workers, prepared, seeds)
            return
        if self._batcher is not None:  # --- hook: never while the batcher's thread runs the agent
            with self._batcher.exclusive():
                self._apply_agent_update_now(agent_update, reset=reset)
            return
        self._apply_agent_update_now(agent_update, reset=reset)

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

    def _check_env_update(self, env_update: Any) -> list[Any] | None:
        if env_update is None:
            return None
        per_worker = _validate.per_worker_sources(
            "env_update", env_update, self.n_workers, self.envs_per_worker
        )
        if self.backend_name != "local":
            for update in per_worker:
                _validate.check_picklable("env_update", update)
        return per_worker

    # -- construction checks ------------------------------------------------------------------

    def _check_envs(self, env: Any, name: str) -> list[Any]:
        if env is None:
            raise TypeError(f"{name} must be a gymnasium id or an env factory, got None")
        per_worker = _validate.per_worker_sources(name, env, self.n_workers, self.envs_per_worker)
        for item in per_worker:
            if item is None or (isinstance(item, list) and None in item):
                raise TypeError(f"{name} must not contain None")
        if self.backend_name != "local":
            for item in per_worker:
                _validate.check_picklable(name, item)
        return per_worker

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
            if not callable(getattr(a, "get_actions", None)):
                raise TypeError(
                    f"agent must have a get_actions(observations) method, got {type(a).__name__}"
                )
        return list(agents)

    def _check_host_mode(self, agent: Any, worker_class: type[Worker]) -> None:
        """inference="host": the backend, the worker class and the agents must allow it."""
        if self.backend_name == "local":
            raise ValueError(
                "inference='host' runs the agent inside the env hosts: it needs "
                "backend='process' or 'ray', got backend='local' (with 'local' every env "
                "already lives in this process: use inference='per_worker')"
            )
        if worker_class.compute_actions is not Worker.compute_actions:
            raise ValueError(
                f"inference='host': worker_class {worker_class.__name__} overrides "
                "compute_actions, which would never be called (the agent runs in the env "
                "hosts); wrap the agent instead, or use inference='per_worker'"
            )
        if agent is not None:
            from asyncsample.inference.host import pickle_agent

            for a in {id(a): a for a in self._agents}.values():
                pickle_agent(a)  # TypeError naming the agent when it cannot travel

    def _chunk_steps(self) -> int:
        """The chunk capacity of each host slot (``0`` unless inference="host")."""
        if self._host is None:
            return 0
        from asyncsample.backends._chunk import chunk_capacity

        return chunk_capacity(
            self._env_spec.observation_space,
            self._env_spec.action_space,
            self.envs_per_worker,
            self._host.options.chunk_steps,
        )

    def _probe_env(self, source: Any) -> tuple[EnvSpec, bool]:
        """Build one env in this process to read its spaces (as gymnasium's vector envs do)."""
        first = source[0] if isinstance(source, list) else source
        try:
            env = make_env(first)
        except Exception as exc:
            raise ValueError(f"env: could not build an env from {first!r}: {exc}") from exc
        try:
            limit = _time_limit(env)
            spec = EnvSpec(
                observation_space=env.observation_space,
                action_space=env.action_space,
                max_episode_length=self._factory.max_episode_length or limit,
            )
        finally:
            env.close()
        return spec, limit is not None

    def _warn_if_endless(self) -> None:
        self._warned_endless = True
        if self.max_episode_length is None and not self._time_limited:
            warnings.warn(
                "the env has no time limit and max_episode_length is None: if its episodes "
                "never terminate, a complete-episode call never returns",
                RuntimeWarning,
                stacklevel=4,
            )

    # -- helpers ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SamplerClosedError("the sampler is closed; create a new one to sample again")

    @contextlib.asynccontextmanager
    async def _locked(self, call: str) -> AsyncIterator[None]:
        """Hold the sampler for ``call``; calls from other tasks queue behind the holder.

        A call from the task that holds an open stream could never get the sampler: it raises
        ``RuntimeError`` instead of waiting forever.
        """
        if self._lock is None:
            self._lock = asyncio.Lock()
        task = asyncio.current_task()
        holder = self._lock_holder
        if holder is not None and holder[1] == "stream" and holder[0] is task:
            raise RuntimeError(
                f"{call}() was called from the task that holds an open stream() of this "
                "sampler: it would wait for the stream to close, forever. Close the stream "
                "first (leave its 'async for' loop or aclose() it), or make the call from "
                "another task (it then runs when the stream closes)"
            )
        async with self._lock:
            self._lock_holder = (task, call)
            try:
                yield
            finally:
                self._lock_holder = None


def _time_limit(env: gym.Env) -> int | None:
    """The episode limit of a ``TimeLimit`` wrapper around ``env``, if any."""
    while isinstance(env, gym.Wrapper):
        if isinstance(env, gym.wrappers.TimeLimit):
            return int(env._max_episode_steps)
        env = env.env
    return None


_CALL_NAMES: dict[Mode, str] = {
    "samples": "obtain_samples",
    "episodes": "obtain_exact_episodes",
    "fragments": "obtain_fragments",
}


def _hosts_started(
    backend: str, n_processes: int | None, n_workers: int, options: dict[str, Any]
) -> int:
    """How many env hosts ``backend`` starts for ``n_workers`` (its placement: ``w % n``)."""
    if backend == "local":
        return 1
    n_processes = options.get("n_processes", n_processes)  # the option overrides, as in _start
    per_actor = options.get("workers_per_actor")
    if backend == "ray" and per_actor is not None:
        return math.ceil(n_workers / _validate.positive_int("workers_per_actor", per_actor))
    return min(n_processes or os.cpu_count() or 1, n_workers)


async def _run_all(coros: Sequence[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run ``coros`` concurrently; the first error cancels the others and is raised as itself.

    A cancellation of the caller cancels them all and waits for them, so nothing keeps running.
    """
    tasks: list[asyncio.Task[_T]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as group_error:
        error = group_error.exceptions[0]
        raise error from error.__cause__
    return [t.result() for t in tasks]


#: Batches larger than this are put together in a thread: numpy releases the GIL while it
#: copies, so the event loop keeps running (a 28 MB image batch takes ~10 ms to copy).
ASSEMBLE_IN_THREAD_BYTES = 1 << 20


async def _assemble(env_spec: EnvSpec, plans: list[Plan]) -> EpisodeBatch:
    """:func:`assemble`, off the event loop's thread when the batch is large."""
    size = sum(len(p.rows) for p in plans) * sum(
        leaf[0].nbytes for leaf in tree_leaves(plans[0].like_obs)
    )
    if size < ASSEMBLE_IN_THREAD_BYTES:
        return assemble(env_spec, plans)
    fut = asyncio.get_running_loop().run_in_executor(None, assemble, env_spec, plans)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        # The copy reads the workers' step records: let it finish before anything reuses them.
        await asyncio.wait({fut})
        raise
