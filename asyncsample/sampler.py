"""The async sampler: the public calls.

The state and what every call is made of (lock, start, one sampling round, updates) live in
:mod:`asyncsample._core`; ``stream()`` in :mod:`asyncsample.streaming` and ``evaluate()`` in
:mod:`asyncsample.evaluation`, layers over the core. Argument checks live in
:mod:`asyncsample._validate`; the rules of a worker's part of a call in :mod:`asyncsample._engine`.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncGenerator
from typing import Any

from asyncsample import _validate, streaming
from asyncsample._core import AgentUpdateArg, EnvUpdateArg, SamplerCore
from asyncsample.agent import Agent
from asyncsample.backends import Backend
from asyncsample.batch import EnvSpec, EpisodeBatch
from asyncsample.env_update import EnvSource
from asyncsample.evaluation import Evaluation, TestEnvs
from asyncsample.inference import Batched, Batcher, Host
from asyncsample.metrics import SamplerMetrics
from asyncsample.stats import SampleStats
from asyncsample.worker import VecWorker, Worker, WorkerFactory

__all__ = ["AgentUpdateArg", "EnvUpdateArg", "Sampler"]


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
        backend: ``"process"``, ``"local"`` (in the event loop's thread), ``"ray"``,
            ``"asyncio"`` (envs whose ``reset``/``step`` are coroutines, an
            :class:`~asyncsample.AsyncEnv`, living in the event loop) or ``"thread"`` (blocking
            envs stepped in a bounded pool of threads). On the last two a worker's envs are not
            stepped in lockstep: each env runs its own episodes (see :mod:`asyncsample._env_tasks`).
        step_timeout: seconds after which a step counts as a worker failure.
        max_restarts: per worker and call, how often a failed env host is rebuilt before the
            error is raised; on ``"asyncio"`` and ``"thread"``, where a fault is the env's
            alone, per env and call, how often that env is rebuilt.
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
        max_concurrency: ``"asyncio"``: the env calls in flight at once across the sampler
            (``None``: no cap); ``"thread"``: the thread pool's size (default: 4 per core).
        episode_timeout: seconds after its start at which an episode still running ends as
            truncated (``TIMEOUT``, ``episode_infos["deadline"]`` true). On ``"asyncio"`` and
            ``"thread"`` a step in flight at the deadline is cancelled (the env is reset before
            its next use; on ``"thread"`` that reset waits for the step still running in its
            thread); on the lockstep backends the deadline is checked after each step
            (not with ``inference="host"``, which runs chunks of steps in the hosts). On
            ``"asyncio"`` and ``"thread"`` it counts from the start of the episode's reset, so a
            reset that hangs is cut too.
        close_timeout: seconds a restart, an env update or :meth:`aclose` waits at most for an
            env's ``close()`` (default 10). On ``"asyncio"`` a close still running then is
            cancelled; on ``"thread"`` a close (or step) stuck in its thread is abandoned with a
            ``ResourceWarning``. ``"process"`` and ``"ray"`` kill a host that has not exited
            within ``min(close_timeout, 2 s)`` of being asked to; ``"local"`` closes envs in the
            loop's thread, where a blocking close cannot be bounded.
            (not with ``inference="host"``, which runs chunks of steps in the hosts).
        metrics: ``None`` (default) keeps no metrics; a ``prometheus_client.CollectorRegistry``,
            or ``True`` for its default registry, keeps the ``asyncsample_*`` metrics of
            :mod:`asyncsample.metrics` (``docs/metrics.md``): steps, episodes, faults, the
            env and agent latencies, and which side holds the run back. Needs the ``metrics``
            extra.

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
        max_concurrency: int | None = None,
        episode_timeout: float | None = None,
        close_timeout: float = 10.0,
        metrics: Any = None,
    ) -> None:
        self._core = core = SamplerCore(
            env,
            agent,
            n_workers=n_workers,
            envs_per_worker=envs_per_worker,
            n_processes=n_processes,
            max_episode_length=max_episode_length,
            seed=seed,
            backend=backend,
            step_timeout=step_timeout,
            max_restarts=max_restarts,
            worker_class=worker_class,
            worker_args=worker_args,
            backend_options=backend_options,
            test_env=test_env,
            inference=inference,
            host_threads=host_threads,
            max_concurrency=max_concurrency,
            episode_timeout=episode_timeout,
            close_timeout=close_timeout,
            metrics=metrics,
        )
        self._test_envs = TestEnvs(type(self))
        self.n_workers: int = core.n_workers
        self.envs_per_worker: int = core.envs_per_worker
        self.n_processes: int = core.n_processes
        """Env hosts the backend starts: ``min(n_processes or cpu count, n_workers)`` processes
        or actors (worker ``w`` lives on host ``w % n_processes``; Ray's ``workers_per_actor``
        option sets ``ceil(n_workers / workers_per_actor)``); ``1`` for ``local``, whose envs all
        live in this process."""
        self.max_episode_length: int | None = core.max_episode_length
        self.backend_name: str = core.backend_name
        self.step_timeout: float | None = core.step_timeout
        self.max_restarts: int = core.max_restarts
        self.host_threads: int | None = core.host_threads
        self.max_concurrency: int | None = core.max_concurrency
        self.close_timeout: float = core.close_timeout
        self.episode_timeout: float | None = core.episode_timeout
        self.seed: int = core.seed
        """The root seed (drawn when ``seed=None`` was passed)."""

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
        return self._core.env_spec

    @property
    def total_env_steps(self) -> int:
        """Transitions returned by this sampler so far."""
        return self._core.total_env_steps

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._core.closed

    @property
    def workers(self) -> list[Worker]:
        """The workers (empty until the sampler starts)."""
        return self._core.workers

    @property
    def restarts(self) -> int:
        """Env-host restarts so far (after env failures or crashes)."""
        return self._core.restarts

    @property
    def metrics(self) -> SamplerMetrics | None:
        """The sampler's Prometheus metrics (``None`` unless ``metrics=`` was given); its
        ``verdict`` says where the last call's (or streamed round's) time went."""
        return self._core.metrics

    @property
    def last_stats(self) -> SampleStats | None:
        """Statistics of the last call, or of the batch a stream yielded last."""
        return self._core.last_stats

    @property
    def _backend(self) -> Backend | None:
        # The running backend, for tests and benchmarks that inspect its hosts.
        return self._core.backend

    @property
    def _batcher(self) -> Batcher | None:
        # inference="batched": the batcher, for tests and benchmarks that read its statistics.
        batcher: Batcher | None = getattr(self._core.mode, "batcher", None)
        return batcher

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Sampler:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the backend and build every worker's envs (the first call does it if needed)."""
        await self._core.start()

    async def aclose(self) -> None:
        """Stop every worker and env host and release their resources. Idempotent."""
        if self._core.closed:
            return
        await self._test_envs.aclose()
        await self._core.aclose()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None and core.close_now():
            warnings.warn(
                f"unclosed {self!r}: use 'async with Sampler(...)' or 'await sampler.aclose()'",
                ResourceWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        core = self._core
        state = "closed" if core.closed else ("running" if core.started else "not started")
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
            num_samples: the quota of transitions, an int of at least 1 (numpy ints accepted,
                ``bool`` not).
            agent_update: applied before sampling: ``None`` keeps the agent; parameters
                (a ``dict``, ``tuple`` or ``numpy.ndarray``) go to ``set_param_values`` of each
                distinct agent once; an agent replaces it; a list holds one update per worker
                (exactly ``n_workers``). It bumps the agent version and resets the episodes in
                progress of the workers it reaches.
            env_update: applied before sampling: ``None`` keeps the envs; an
                :class:`EnvUpdate` is called with the old env and returns the new one; a
                ``gymnasium.Env`` (deep-copied per env), a gymnasium id or a zero-argument
                factory replaces them; a list holds one per worker (exactly ``n_workers``), a
                list inside it one per env (exactly ``envs_per_worker``). An updated env starts
                a new episode.
            fraction_samples: in ``(0, 1]``. Below 1, a worker only has to reach
                ``ceil(fraction_samples * share)`` and fast workers go on past their share
                while the call's total is short of ``num_samples``; the call ends as soon as the
                total is reached and every worker has its minimum, so a straggler no longer
                holds the call. The split between workers then depends on timing: the batch is
                not reproducible for a fixed seed (``episode_infos["worker"]`` and
                ``last_stats.worker_transitions`` say who contributed what). ``1.0`` (default)
                is the fixed, reproducible split, where no worker goes past its share. A worker
                whose share is 0 (``num_samples < n_workers``) takes no part either way.

        Returns:
            At least ``num_samples`` transitions of complete episodes (each ends in
            ``TERMINAL`` or ``TIMEOUT``), worker-major; :attr:`last_stats` describes the call.

        Raises:
            TypeError: a quota or argument of the wrong type, or an update of the wrong kind (or
                that cloudpickle cannot pickle), before any env is stepped.
            ValueError: a quota below 1 or an argument out of range, or an update list of the
                wrong length, before any env is stepped; or, while sampling, an observation or
                action that does not fit its space (your code's mistake: not retried).
            WorkerError: an env kept failing after ``max_restarts`` restarts of its worker in
                this call (its subclasses :class:`WorkerCrashedError`, a host died, and
                :class:`StepTimeoutError`, a step outlived ``step_timeout``), or your agent's
                mistake in an env host (``retry=False``, not retried).
            SamplerClosedError: the sampler was closed.
            SamplerBusyError: called from the body of this sampler's own open :meth:`stream`.
        """
        num_samples = _validate.positive_int("num_samples", num_samples)
        fraction = _validate.fraction("fraction_samples", fraction_samples)
        return await self._core.call("samples", num_samples, agent_update, env_update, fraction)

    async def obtain_exact_episodes(
        self,
        n_eps_per_worker: int,
        agent_update: AgentUpdateArg = None,
        env_update: EnvUpdateArg = None,
    ) -> EpisodeBatch:
        """Exactly ``n_eps_per_worker`` complete episodes from every worker, worker-major.

        Env ``i`` of a worker runs ``n // envs_per_worker + (i < n % envs_per_worker)`` of them
        (not the first ``n`` to finish, which would favour short episodes). Each call starts fresh
        episodes.

        Args:
            n_eps_per_worker: episodes per worker, an int of at least 1.
            agent_update: applied before sampling: ``None`` keeps the agent; parameters
                (a ``dict``, ``tuple`` or ``numpy.ndarray``) go to ``set_param_values`` of each
                distinct agent once; an agent replaces it; a list holds one update per worker
                (exactly ``n_workers``). It bumps the agent version and resets the episodes in
                progress of the workers it reaches.
            env_update: applied before sampling: ``None`` keeps the envs; an
                :class:`EnvUpdate` is called with the old env and returns the new one; a
                ``gymnasium.Env`` (deep-copied per env), a gymnasium id or a zero-argument
                factory replaces them; a list holds one per worker (exactly ``n_workers``), a
                list inside it one per env (exactly ``envs_per_worker``). An updated env starts
                a new episode.

        Returns:
            ``n_workers * n_eps_per_worker`` complete episodes, worker-major.

        Raises:
            TypeError: a quota or argument of the wrong type, or an update of the wrong kind (or
                that cloudpickle cannot pickle), before any env is stepped.
            ValueError: a quota below 1 or an argument out of range, or an update list of the
                wrong length, before any env is stepped; or, while sampling, an observation or
                action that does not fit its space (your code's mistake: not retried).
            WorkerError: an env kept failing after ``max_restarts`` restarts of its worker in
                this call (its subclasses :class:`WorkerCrashedError`, a host died, and
                :class:`StepTimeoutError`, a step outlived ``step_timeout``), or your agent's
                mistake in an env host (``retry=False``, not retried).
            SamplerClosedError: the sampler was closed.
            SamplerBusyError: called from the body of this sampler's own open :meth:`stream`.
        """
        n_eps_per_worker = _validate.positive_int("n_eps_per_worker", n_eps_per_worker)
        return await self._core.call("episodes", n_eps_per_worker, agent_update, env_update)

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
            num_samples: the quota of transitions, an int of at least 1.
            agent_update: applied before sampling: ``None`` keeps the agent; parameters
                (a ``dict``, ``tuple`` or ``numpy.ndarray``) go to ``set_param_values`` of each
                distinct agent once; an agent replaces it; a list holds one update per worker
                (exactly ``n_workers``). It bumps the agent version and resets the episodes in
                progress of the workers it reaches.
            env_update: applied before sampling: ``None`` keeps the envs; an
                :class:`EnvUpdate` is called with the old env and returns the new one; a
                ``gymnasium.Env`` (deep-copied per env), a gymnasium id or a zero-argument
                factory replaces them; a list holds one per worker (exactly ``n_workers``), a
                list inside it one per env (exactly ``envs_per_worker``). An updated env starts
                a new episode.
            fraction_samples: in ``(0, 1]``. Below 1, a worker only has to return
                ``ceil(fraction_samples * share)`` transitions (steps x envs) and fast workers
                keep stepping while the call's total is short of ``num_samples``; the call ends
                as soon as the total is reached and every worker has its minimum. Every worker
                stops at a step boundary, so its fragments continue correctly in the next call.
                The split between workers then depends on timing (not reproducible for a fixed
                seed); ``1.0`` (default) is the fixed, reproducible split.

        Returns:
            At least ``num_samples`` and fewer than ``num_samples + n_workers *
            envs_per_worker`` transitions (with ``fraction_samples=1``), worker-major: the
            episodes completed during the call, whole, and the episodes still running as
            fragments (ending in ``FIRST`` or ``MID``; their ``last_observations`` row is the
            current observation).

        Raises:
            TypeError: a quota or argument of the wrong type, or an update of the wrong kind (or
                that cloudpickle cannot pickle), before any env is stepped.
            ValueError: a quota below 1 or an argument out of range, or an update list of the
                wrong length, before any env is stepped; or, while sampling, an observation or
                action that does not fit its space (your code's mistake: not retried).
            WorkerError: an env kept failing after ``max_restarts`` restarts of its worker in
                this call (its subclasses :class:`WorkerCrashedError`, a host died, and
                :class:`StepTimeoutError`, a step outlived ``step_timeout``), or your agent's
                mistake in an env host (``retry=False``, not retried).
            SamplerClosedError: the sampler was closed.
            SamplerBusyError: called from the body of this sampler's own open :meth:`stream`.
        """
        num_samples = _validate.positive_int("num_samples", num_samples)
        fraction = _validate.fraction("fraction_samples", fraction_samples)
        return await self._core.call("fragments", num_samples, agent_update, env_update, fraction)

    async def update_agent(self, agent_update: AgentUpdateArg) -> None:
        """Apply an agent update now; it bumps the agent version of the workers it touches.

        During a :meth:`stream` it takes effect at the next step boundary without resetting the
        episodes in progress (it is the one call allowed from the stream's body); otherwise it
        waits for the call in progress, if any, and the next call starts fresh episodes.

        Args:
            agent_update: ``None`` (nothing), parameters (a ``dict``, ``tuple`` or
                ``numpy.ndarray``) for ``set_param_values`` of each distinct agent once, an
                agent that replaces it, or a list of exactly ``n_workers`` of those, one per
                worker (a list of parameter sets needs one agent per worker). With
                ``inference="host"`` the update also reaches the agent copies in the hosts.

        Raises:
            TypeError: an update of the wrong kind, or (``inference="host"``) an agent that
                cloudpickle cannot pickle.
            ValueError: a list of the wrong length, a list of parameter sets for one shared
                agent, or an update the inference mode refuses (an async agent with
                ``inference="host"``); raised before anything changes.
            SamplerClosedError: the sampler was closed.
        """
        await self._core.update_agent(agent_update)

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
        a sampling call from the stream's own body (or from a task the body started) raises
        :class:`SamplerBusyError` at once (it could never proceed). The arguments are checked
        when the first batch is asked for.

        Args:
            num_samples: transitions per yielded batch, at least (an int of at least 1).
            fragments: yield fragments of running episodes too (as :meth:`obtain_fragments`)
                instead of complete episodes only.
            agent_update: applied once, before the first round (as in :meth:`obtain_samples`);
                later updates go through :meth:`update_agent`.
            max_policy_lag: ``None`` or an int ``k >= 0``: drop, from each batch, the episodes
                that started more than ``k`` agent versions before the newest. On ``asyncio``
                and ``thread`` (complete episodes) it also holds back starting new episodes
                while the versions of a worker's open episodes would spread by more than ``k``.
            buffer_size: batches kept ready ahead of the consumer (an int of at least 1); when
                they are, sampling pauses.
            fraction_samples: in ``(0, 1]``, applied to every sampling round as in
                :meth:`obtain_samples` (or :meth:`obtain_fragments` with ``fragments``): below 1,
                fast workers fill in for slow ones and the split between workers depends on
                timing.

        Returns:
            An async generator of :class:`EpisodeBatch`; each carries, per step, the agent
            version it was sampled under (``agent_versions``).

        Raises:
            TypeError: an argument of the wrong type (when the first batch is asked for).
            ValueError: an argument out of range (when the first batch is asked for).
            WorkerError: as in :meth:`obtain_samples`, raised where the next batch is awaited.
            SamplerClosedError: the sampler was closed.
            SamplerBusyError: opened from the body of this sampler's own open stream.
        """
        return streaming.stream(
            self._core,
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

        Returns:
            The episodes' returns and lengths, the frames with ``render``, and the batch
            itself (:class:`Evaluation`).

        Raises:
            TypeError: an argument of the wrong type (``n_episodes`` not an int, an ``agent``
                without ``get_actions``, an ``env`` that is not an env source).
            ValueError: ``n_episodes`` below 1, or ``render`` with an env whose render mode is
                not ``rgb_array``.
            WorkerError: a test env kept failing after ``max_restarts`` restarts.
            SamplerClosedError: the sampler was closed.
        """
        return await self._test_envs.evaluate(
            self._core,
            n_episodes,
            agent=agent,
            env=env,
            deterministic=deterministic,
            render=render,
        )
