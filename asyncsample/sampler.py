"""The async sampler: the public calls, over :mod:`asyncsample._core` (docs/architecture.md)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from asyncsample import _validate, streaming
from asyncsample._config import SamplerConfig
from asyncsample._core import AgentUpdateArg, EnvUpdateArg, SamplerCore
from asyncsample.agent import Agent
from asyncsample.backends import Backend
from asyncsample.batch import EnvSpec, EpisodeBatch
from asyncsample.checkpoint import ResumeReport, SamplerState
from asyncsample.env_update import EnvSource
from asyncsample.evaluation import Evaluation, TestEnvs
from asyncsample.inference import Batched, Batcher, Host, InferenceChoice
from asyncsample.metrics import SamplerMetrics
from asyncsample.multiagent.joint import MultiAgentBatch
from asyncsample.multiagent.policies import PolicyMapping
from asyncsample.multiagent.routing import PolicyAgents
from asyncsample.multiagent.sampling import JointCalls, joint_calls
from asyncsample.stats import SampleStats
from asyncsample.worker import VecWorker, Worker, WorkerFactory

__all__ = ["AgentUpdateArg", "EnvUpdateArg", "Sampler"]


class Sampler:
    """Collects episodes from ``n_workers`` worker coroutines whose envs live in env hosts.

    See [Concepts](concepts.md) and [the sampler contract](contract.md).

    Args:
        env: a gymnasium id, a zero-argument callable returning a ``gymnasium.Env``, a
            ``gymnasium.Env`` (deep-copied per env), an :class:`EnvUpdate`, or a list of exactly
            ``n_workers`` of those (one per worker; an inner list gives one per env).
        agent: one :class:`Agent` shared by all workers, a list of ``n_workers`` agents, or
            ``None`` for a :class:`RandomAgent` per worker seeded from ``seed``; for a
            multi-agent env also a dict ``{policy_id: Agent}`` (see [Multi-agent
            envs](multiagent.md)).
        n_workers: worker coroutines.
        envs_per_worker: env copies stepped together by one worker.
        n_processes: how many env hosts (processes, or Ray actors) to start at most (default:
            the CPU count).
        max_episode_length: episodes are truncated (TIMEOUT) at this many steps.
        seed: root of every seed; ``None`` draws one (see :attr:`seed`).
        backend: ``"process"``, ``"local"`` (in the event loop's thread), ``"ray"``,
            ``"asyncio"`` (envs whose ``reset``/``step`` are coroutines) or ``"thread"``
            (blocking envs in a pool of threads); see [Backends](backends.md).
        step_timeout: seconds after which a step counts as a worker failure; also how long
            an event loop that runs envs may stand still (at least 1 s) before the env that
            blocks it is named and its host killed (see faults.md, "A blocked event loop").
        max_restarts: per worker and call, how often a failed env host is rebuilt before the
            error is raised (on ``"asyncio"`` and ``"thread"``: per env and call).
        worker_class: the :class:`Worker` subclass to run (garage's ``worker_class``).
        worker_args: extra keyword arguments for ``worker_class``.
        backend_options: extra keyword arguments for the backend (e.g. Ray resources).
        test_env: the env :meth:`evaluate` uses by default (default: the training env).
        inference: ``"auto"`` (the sampler picks the fastest mode that gives the same
            batches, :attr:`inference` says which and why), ``"per_worker"``, ``"batched"``,
            ``"host"``, or an :class:`~asyncsample.Batched` or :class:`~asyncsample.Host` with
            options; see [Where the policy runs](inference.md).
        host_threads: intra-op threads of the numeric libraries (torch, OpenMP, MKL, OpenBLAS)
            in each env host; ``None`` leaves the libraries' defaults. Ignored by ``local``.
        max_concurrency: ``"asyncio"``: the env calls in flight at once (``None``: no cap);
            ``"thread"``: the thread pool's size (default: 4 per core).
        max_sequence_length: the most items a value of a ``Sequence`` space (observations or
            actions) is expected to hold, for the up-front memory check only (a longer one is
            recorded all the same); ``None``: 1,024. A ``Text`` space is sized from its own
            ``max_length``. See [Agentic episodes](agentic.md#data-layout).
        episode_timeout: seconds after its start at which an episode still running ends as
            truncated (``TIMEOUT``, ``episode_infos["deadline"]`` true); not with
            ``inference="host"``. See [Deadlines](contract.md#deadlines-episode_timeout).
        close_timeout: seconds a restart, an env update or :meth:`aclose` waits at most for an
            env's ``close()``; see [Timeouts](faults.md#timeouts).
        metrics: a ``prometheus_client.CollectorRegistry``, or ``True`` for its default one,
            keeps the [metrics](metrics.md) (the ``metrics`` extra); ``None`` keeps none.
        resume: a :class:`SamplerState` (from :meth:`checkpoint`) to continue from, as the
            sampler starts; see [Checkpoint and resume](checkpoint.md).
        fixed_shares: envs stepped one at a time (async envs on any backend, ``"thread"``):
            ``False`` (the default): :meth:`obtain_fragments` returns once its quota is in,
            whichever envs filled it, and the steps still in flight open the next call's
            fragments (an agent update between calls does not reset them); ``True``: every env
            takes a fixed share of each call, so batches are reproducible for a seed, and a call
            waits for its slowest env. Lockstep backends always use fixed shares. See
            [Heavy tails](contract.md#heavy-tails-fixed_shares).
        policy_mapping: a multi-agent env (a PettingZoo ``ParallelEnv`` factory, or its async
            twin): agent id -> policy id, a callable or a dict; ``None``: every agent is
            policy ``"default"``. Calls then return a :class:`~asyncsample.MultiAgentBatch`
            of agent rows per policy; see [Multi-agent envs](multiagent.md).
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
        inference: str | Batched | Host = "auto",
        host_threads: int | None = 1,
        max_concurrency: int | None = None,
        max_sequence_length: int | None = None,
        episode_timeout: float | None = None,
        close_timeout: float = 10.0,
        metrics: Any = None,
        resume: SamplerState | None = None,
        fixed_shares: bool = False,
        policy_mapping: PolicyMapping = None,
    ) -> None:
        # Every argument by name: SamplerConfig's fields are this signature's (a test holds it).
        arguments = {name: value for name, value in locals().items() if name != "self"}
        if isinstance(agent, Mapping):  # a multi-agent env's agent per policy
            arguments["agent"] = PolicyAgents(agent, policy_mapping)
        self._core = core = SamplerCore(SamplerConfig(**arguments))
        self._policy_mapping = policy_mapping
        self._joint: JointCalls | bool | None = False  # multi-agent calls, once the env is known
        self._test_envs = TestEnvs(type(self))
        self.n_workers: int = core.n_workers
        self.envs_per_worker: int = core.envs_per_worker
        self.n_processes: int = core.n_processes
        """Env hosts the backend starts (``1`` for ``local``; see [Backends](backends.md))."""
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
        self.inference: InferenceChoice = core.inference
        """The inference mode in force and why (``inference="auto"``: the sampler's choice)."""

    @classmethod
    def from_worker_factory(
        cls,
        worker_factory: WorkerFactory,
        agents: Agent | list[Agent] | None,
        envs: EnvSource | list[Any],
        **kwargs: Any,
    ) -> Sampler:
        """Build a sampler from a :class:`WorkerFactory` (garage's constructor); its
        ``worker_args["n_envs"]``, if given, sets ``envs_per_worker``."""
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
        """The sampler's Prometheus metrics (``None`` unless ``metrics=`` was given)."""
        return self._core.metrics

    @property
    def resumed(self) -> ResumeReport | None:
        """How the episodes in flight came back, once a sampler built with ``resume=`` started."""
        return self._core.resumed

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

    async def __aenter__(self) -> Sampler:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the backend and build every worker's envs (the first call does it if needed)."""
        await self._core.start()
        await self._joint_calls()

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

    async def obtain_samples(
        self,
        num_samples: int,
        agent_update: AgentUpdateArg = None,
        env_update: EnvUpdateArg = None,
        *,
        fraction_samples: float = 1.0,
    ) -> EpisodeBatch | MultiAgentBatch:
        """Complete episodes whose lengths add up to at least ``num_samples``.

        Worker ``w`` steps its envs until its completed episodes reach its share; episodes still
        running then are discarded. See [the sampler contract](contract.md#the-three-calls).

        Calls on one sampler run one at a time: a call made while another (or an open
        :meth:`stream`) runs waits until that one is done, so a short call behind a long one
        costs the long one's time. Consumers that must not wait for each other use a sampler
        each, or share one stream (see [Concurrency](contract.md#concurrency)).

        Args:
            num_samples: the quota of transitions, an int of at least 1.
            agent_update: applied before sampling: ``None``, parameters (a ``dict``, ``tuple``
                or ``numpy.ndarray``) for ``set_param_values``, an agent that replaces it, or a
                list of exactly ``n_workers`` of those (see
                [Agent updates](contract.md#agent-updates)).
            env_update: applied before sampling: ``None``, an :class:`EnvUpdate`, a
                ``gymnasium.Env``, a gymnasium id or a zero-argument factory, or a list of one
                per worker (see [Env updates](contract.md#env-updates)).
            fraction_samples: in ``(0, 1]``; below 1, fast workers fill in for slow ones and the
                batch is not reproducible (see
                [Stragglers](contract.md#stragglers-fraction_samples)).

        Returns:
            At least ``num_samples`` transitions; :attr:`last_stats` describes the call.

        Raises:
            TypeError: an argument or update of the wrong type (or not picklable), before any
                env is stepped.
            ValueError: an argument out of range or an update list of the wrong length, before
                any env is stepped; or an observation or action that does not fit its space.
            WorkerError: an env kept failing after ``max_restarts`` restarts of its worker in
                this call (:class:`WorkerCrashedError`, :class:`StepTimeoutError`), or your
                agent's mistake in an env host (``retry=False``).
            SamplerClosedError: the sampler was closed.
            SamplerBusyError: called from the body of this sampler's own open :meth:`stream`.
        """
        num_samples = _validate.positive_int("num_samples", num_samples)
        fraction = _validate.fraction("fraction_samples", fraction_samples)
        joint = await self._joint_calls()
        if joint is not None:
            return await joint.call(
                self._core.call, "samples", num_samples, agent_update, env_update, fraction
            )
        return await self._core.call("samples", num_samples, agent_update, env_update, fraction)

    async def obtain_exact_episodes(
        self,
        n_eps_per_worker: int,
        agent_update: AgentUpdateArg = None,
        env_update: EnvUpdateArg = None,
    ) -> EpisodeBatch | MultiAgentBatch:
        """Exactly ``n_eps_per_worker`` complete episodes from every worker, worker-major.

        The episodes are assigned to envs in advance (not the first ``n`` to finish); each call
        starts fresh episodes. It queues behind a call in progress, as every call does (see
        [Concurrency](contract.md#concurrency)). Arguments, returns and errors as in
        :meth:`obtain_samples`.
        """
        n_eps_per_worker = _validate.positive_int("n_eps_per_worker", n_eps_per_worker)
        joint = await self._joint_calls()
        if joint is not None:
            return await joint.call(
                self._core.call, "episodes", n_eps_per_worker, agent_update, env_update
            )
        return await self._core.call("episodes", n_eps_per_worker, agent_update, env_update)

    async def obtain_fragments(
        self,
        num_samples: int,
        agent_update: AgentUpdateArg = None,
        env_update: EnvUpdateArg = None,
        *,
        fraction_samples: float = 1.0,
    ) -> EpisodeBatch | MultiAgentBatch:
        """At least ``num_samples`` transitions of complete episodes and running fragments.

        Each worker steps all its envs ``ceil(share / envs_per_worker)`` times; fragments of
        episodes still running (ending in ``FIRST`` or ``MID``) continue in the next
        ``obtain_fragments`` call. Where envs step one at a time (``asyncio``, ``thread``, async
        envs in the hosts) and ``fixed_shares=False`` (the default), the call instead returns as
        soon as ``num_samples`` transitions are in, whichever envs filled it, and the steps in
        flight open the next call's fragments (``fraction_samples`` is then ignored); see
        [Heavy tails](contract.md#heavy-tails-fixed_shares). It queues behind a call in
        progress, as every call does (see [Concurrency](contract.md#concurrency)). Arguments
        and errors as in :meth:`obtain_samples`; see
        [the sampler contract](contract.md#obtain_fragmentsnum_samples).
        """
        num_samples = _validate.positive_int("num_samples", num_samples)
        fraction = _validate.fraction("fraction_samples", fraction_samples)
        joint = await self._joint_calls()
        if joint is not None:
            return await joint.call(
                self._core.call, "fragments", num_samples, agent_update, env_update, fraction
            )
        return await self._core.call("fragments", num_samples, agent_update, env_update, fraction)

    async def _joint_calls(self) -> JointCalls | None:
        """The calls of a multi-agent env (``None``: a single-agent env), once its kind is
        known: the sampler starts first if it has not."""
        if self._joint is False:
            await self._core.start()
            self._joint = joint_calls(self._core.env_spec, self._policy_mapping, self._core.memory)
        assert self._joint is not True
        return self._joint

    async def update_agent(self, agent_update: AgentUpdateArg) -> None:
        """Apply an agent update now; it bumps the agent version of the workers it touches.

        During a :meth:`stream` it takes effect at the next step boundary without resetting the
        episodes in progress; otherwise it waits for the call in progress, and the next call
        starts fresh episodes.

        Args:
            agent_update: as in :meth:`obtain_samples`; with ``inference="host"`` it also
                reaches the agent copies in the hosts.

        Raises:
            TypeError: an update of the wrong kind, or one that cloudpickle cannot pickle
                (``inference="host"``).
            ValueError: a list of the wrong length, a list of parameter sets for one shared
                agent, or an update the inference mode refuses; raised before anything changes.
            SamplerClosedError: the sampler was closed.
        """
        await self._core.update_agent(agent_update)

    async def checkpoint(self) -> SamplerState:
        """Read everything the sampler needs to continue, at one instant: a
        :class:`SamplerState` for ``Sampler(..., resume=state)``.

        Between calls it waits for the call in progress (and starts the sampler if needed);
        during a :meth:`stream` (from its body) it holds the stream's rounds at the next
        boundary and keeps the batches sampled but not yet yielded in the state. See
        [Checkpoint and resume](checkpoint.md).

        Raises:
            CheckpointError: chunks run ahead (``inference="host"`` in a stream), or an env
                host failed and is not rebuilt yet.
            SamplerClosedError: the sampler was closed.
        """
        return await self._core.checkpoint()

    def stream(
        self,
        num_samples: int,
        *,
        fragments: bool = False,
        agent_update: AgentUpdateArg = None,
        max_policy_lag: int | None = None,
        buffer_size: int = 2,
        fraction_samples: float = 1.0,
    ) -> AsyncGenerator[Any, None]:
        """Yield batches of at least ``num_samples`` transitions while sampling goes on.

        Use it as ``async with contextlib.aclosing(sampler.stream(n)) as it: async for b in it``.
        Sampling runs in a background task at most ``buffer_size`` batches ahead; episodes in
        progress carry over between batches, and :meth:`update_agent` is the one call allowed
        from the stream's body. An update takes effect at the next env step, but the batches
        already sampled keep their version: the next ``buffer_size + 1`` batches after it can
        carry the old one. The arguments are checked when the first batch is asked for. See
        [the sampler contract](contract.md).

        Args:
            num_samples: transitions per yielded batch, at least (an int of at least 1).
            fragments: yield fragments of running episodes too, as :meth:`obtain_fragments`.
            agent_update: applied once, before the first round.
            max_policy_lag: ``None`` or an int ``k >= 0``: drop the episodes that started more
                than ``k`` agent versions before the newest.
            buffer_size: batches kept ready ahead of the consumer (an int of at least 1).
            fraction_samples: in ``(0, 1]``, applied to every round as in :meth:`obtain_samples`.

        Raises:
            TypeError, ValueError: a bad argument (when the first batch is asked for).
            WorkerError: as in :meth:`obtain_samples`, where the next batch is awaited.
            SamplerClosedError: the sampler was closed.
            SamplerBusyError: opened from the body of this sampler's own open stream.
        """
        options: dict[str, Any] = {
            "fragments": fragments,
            "agent_update": agent_update,
            "max_policy_lag": max_policy_lag,
            "buffer_size": buffer_size,
            "fraction_samples": fraction_samples,
        }
        if self._joint is None:  # a started sampler of a single-agent env
            return streaming.stream(self._core, num_samples, **options)
        return self._rows_stream(num_samples, options)

    async def _rows_stream(
        self, num_samples: int, options: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        """:meth:`stream` before the env's kind is known: for a multi-agent env, batches of
        at least ``num_samples`` agent rows (the engine's rounds joined until they hold them)."""
        joint = await self._joint_calls()
        quota = num_samples if joint is None else joint.steps_for(num_samples)
        async with contextlib.aclosing(streaming.stream(self._core, quota, **options)) as rounds:
            if joint is None:
                async for batch in rounds:
                    yield batch
                return
            async for rows in joint.rows_of_rounds(rounds, num_samples):
                yield rows

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

        The test envs live in their own env hosts on the same backend, so evaluating never
        disturbs the training envs' episodes or seeds.

        Args:
            n_episodes: how many episodes.
            agent: the agent to evaluate (default: worker 0's agent).
            env: the test env (default: the sampler's ``test_env`` or training env).
            deterministic: ask the agent for deterministic actions (``get_actions(obs,
                deterministic=True)`` or ``get_deterministic_actions``, where it has them).
            render: also return the ``rgb_array`` frames of the first episode.

        Returns:
            The episodes' returns and lengths, the frames, and the batch (:class:`Evaluation`).

        Raises:
            TypeError: an argument of the wrong type.
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
