"""Workers: coroutines that step the envs of one worker through its env host.

The interface is garage's ``Worker`` (``update_agent``, ``update_env``, ``start_episode``,
``step_episode``, ``collect_episode``, ``rollout``, ``shutdown``) made async: ``step_episode``
awaits the host while other workers run. :class:`VecWorker` steps ``n_envs`` envs together and
returns complete episodes; :class:`FragmentWorker` also returns the episodes still running as
fragments that continue on the next call.

This is the small surface a user subclasses. What a worker records lives in
:mod:`asyncsample._recorder`; how the sampler runs a call through a worker is the private
:class:`WorkerDriver` protocol below.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from asyncsample._action_check import AgentOutputCheck, check_actions, make_action_check
from asyncsample._assembly import Plan, assemble
from asyncsample._recorder import Recorder, Resume, put_row, row_of, store_agent_infos
from asyncsample._tree import Tree, tree_map
from asyncsample.agent import Agent, AgentOutput, AgentUpdate, RandomAgent, get_actions
from asyncsample.backends.base import EnvHost
from asyncsample.batch import EnvSpec, EpisodeBatch, StepType
from asyncsample.env_group import rebuild_chain
from asyncsample.env_update import EnvChoice, EnvSource
from asyncsample.inference import Batcher
from asyncsample.seeding import WorkerSeeds

__all__ = [
    "FinishedEpisode",
    "FragmentWorker",
    "SharedQuota",
    "Transition",
    "VecWorker",
    "Worker",
    "WorkerDriver",
    "WorkerFactory",
]


class FinishedEpisode(NamedTuple):
    """Return, length and agent version of one completed episode (for the call's statistics)."""

    ret: float
    length: int
    agent_version: int


class SharedQuota:
    """The quota of one call with ``fraction_samples < 1``, shared by the workers of the call.

    Each worker reports, after every step, how many transitions it would return if it stopped
    now (complete-episode transitions for ``obtain_samples``, steps x envs for fragments). A
    worker may stop once it has its own minimum *and* the call's total has reached the target:
    fast workers therefore keep going past their share while the total is short, and the last
    worker to stop has both conditions hold for everyone. The object lives beside the worker
    coroutines in the event loop's thread on every backend, so it needs no lock.

    Args:
        target: the call's ``num_samples``.
        minimums: per worker taking part, ``ceil(fraction_samples * share)``.
    """

    def __init__(self, target: int, minimums: Mapping[int, int]) -> None:
        self.target = target
        self.minimums = dict(minimums)
        self.counts = dict.fromkeys(self.minimums, 0)
        self.total = 0

    def report(self, worker: int, count: int) -> None:
        """Worker ``worker`` would now return ``count`` transitions (it may go down: restarts)."""
        self.total += count - self.counts[worker]
        self.counts[worker] = count

    def may_stop(self, worker: int) -> bool:
        """Whether ``worker`` has its minimum and the call's total has reached the target."""
        return self.counts[worker] >= self.minimums[worker] and self.total >= self.target


@dataclass
class Transition:
    """One worker step over all of its envs, as :meth:`Worker.process_transition` sees it.

    Rows of envs that were not stepped (``active`` false) hold stale values.
    """

    observations: Tree
    actions: Tree
    rewards: np.ndarray
    next_observations: Tree
    terminated: np.ndarray
    truncated: np.ndarray
    env_infos: list[dict[str, Any]] | None
    agent_infos: dict[str, np.ndarray]
    active: np.ndarray


class Worker:
    """garage's Worker interface as an async base class.

    A worker owns ``n_envs`` envs living in an :class:`~asyncsample.backends.EnvHost`, an agent
    (shared with other workers or its own) and the bookkeeping that turns steps into episodes.
    Subclasses may override the per-step hooks :meth:`compute_actions` (pre/post-processing of
    observations and actions) and :meth:`process_transition` (record transitions into a custom
    ``history``), or any of garage's methods. The methods whose names start with ``_`` are how
    the sampler drives a worker (:class:`WorkerDriver`); they are not part of the user surface.

    Args:
        seed: the sampler's seed (the worker's own seeds come from the sampler's seed tree).
        max_episode_length: the episode length limit the host applies (TIMEOUT); ``None``:
            never.
        worker_number: this worker's index.
        n_envs: env copies stepped together.
    """

    def __init__(
        self,
        *,
        seed: int | None,
        max_episode_length: int | None,
        worker_number: int,
        n_envs: int = 1,
    ) -> None:
        del seed  # the worker's seeds come from the sampler's seed tree (garage's signature)
        self.max_episode_length = max_episode_length
        self.worker_number = worker_number
        self.n_envs = n_envs
        self.agent: Agent | None = None
        self.agent_version = 0
        self.env_spec: EnvSpec | None = None
        self.host: EnvHost | None = None
        self.history: Any = None
        self.restarts = 0
        """Env-host restarts of this worker so far."""
        self.finished: list[FinishedEpisode] = []
        """Every episode completed since the sampler read it."""
        self._seeds: WorkerSeeds | None = None
        self._chains: list[list[EnvSource]] = []
        self._lengths = np.zeros(n_envs, dtype=np.int64)
        self._returns = np.zeros(n_envs, dtype=np.float64)
        self._done = np.zeros(n_envs, dtype=bool)
        self._everyone = True  # every env active: the step skips its masks
        self._needs_reset = np.ones(n_envs, dtype=bool)
        self._active = np.ones(n_envs, dtype=bool)
        self._episode_info: list[dict[str, Any]] = [{} for _ in range(n_envs)]
        self._recorder = Recorder(n_envs)
        self._episodes_left: np.ndarray | None = None
        self._steps_left: int | None = None
        self._share = 0
        self._in_call = False
        self._broken = False
        self._action_check: Callable[[Any], np.ndarray] | None = None
        self._output_check = AgentOutputCheck(worker_number, n_envs)
        self._trusted_actions = False
        self._records_transitions = type(self).process_transition is not Worker.process_transition
        # --- hook: inference="batched" (the sampler sets it; None: ask the agent directly) ---
        self.batcher: Batcher | None = None

    def __getstate__(self) -> None:
        raise ValueError(
            "Workers are not picklable: they hold a connection to their env host. Pickle the "
            "sampler's construction arguments instead."
        )

    # -- wiring (called by the sampler) ------------------------------------------------------

    async def attach(
        self,
        host: EnvHost,
        env_spec: EnvSpec,
        agent: Agent,
        env: EnvSource | Sequence[EnvSource],
        seeds: WorkerSeeds,
    ) -> None:
        """Give the worker its host, spaces, agent and envs, and build the envs in the host.

        Args:
            env: one env source for all envs, or a list of exactly ``n_envs`` of them.
        """
        self.host = host
        self.env_spec = env_spec
        self._action_check = make_action_check(env_spec.action_space)
        self.agent = agent
        self._trust_agent()
        self._seeds = seeds
        sources = self._per_env(env, "env")
        self._chains = [[s] for s in sources]
        await host.build(self._chains, seeds.next_env_seeds())
        self._needs_reset[:] = True

    def _per_env(self, value: Any, name: str) -> list[Any]:
        if isinstance(value, list):
            if len(value) != self.n_envs:
                raise ValueError(
                    f"If separate environments are passed for each worker, there must be "
                    f"exactly n_envs ({self.n_envs}) environments, but received {len(value)} "
                    f"environments ({name} of worker {self.worker_number})."
                )
            return list(value)
        return [value] * self.n_envs

    # -- garage's interface ------------------------------------------------------------------

    def update_agent(
        self, agent_update: AgentUpdate, *, apply: bool = True, reset: bool = True
    ) -> None:
        """Apply an agent update: parameters (dict, tuple, ndarray) or a new agent.

        ``None`` keeps the agent. Any other update bumps :attr:`agent_version` and, unless
        ``reset`` is false (updates during a stream), makes the next call start fresh episodes.
        ``apply=False`` only bumps the version (the sampler sets the parameters of a shared
        agent once for all workers).
        """
        if agent_update is None:
            return
        if apply:
            if isinstance(agent_update, (dict, tuple, np.ndarray)):
                assert self.agent is not None
                set_params = getattr(self.agent, "set_param_values", None)
                if set_params is None:
                    raise TypeError(
                        f"agent_update is a parameter set ({type(agent_update).__name__}) but "
                        f"the agent of worker {self.worker_number} has no set_param_values"
                    )
                set_params(agent_update)
            else:
                if agent_update is not self.agent:
                    self._output_check.forget()
                self.agent = agent_update
                self._trust_agent()
        self.agent_version += 1
        if reset:
            self._needs_reset |= self._lengths > 0

    async def update_env(self, env_update: EnvChoice) -> None:
        """Apply an env update (one for all envs, or a list of exactly ``n_envs``)."""
        if env_update is None:
            return
        updates = self._per_env(env_update, "env_update")
        assert self.host is not None and self._seeds is not None
        self._chains = [rebuild_chain(c, u) for c, u in zip(self._chains, updates)]
        await self.host.update(updates, self._seeds.next_env_seeds())
        self._needs_reset[:] = True

    async def start_episode(self) -> None:
        """Reset the envs that need it: those with an episode in progress or a pending update.

        Envs already at the start of an episode (just autoreset) are not reset again.
        """
        assert self.host is not None
        mask = self._needs_reset.copy()
        if mask.any():
            infos = await self.host.reset(mask)
            self._needs_reset &= ~mask
            self._lengths[mask] = 0
            self._returns[mask] = 0.0
            for i in np.flatnonzero(mask).tolist():
                self._episode_info[i] = infos.get(i, {})  # empty infos do not travel
            self._reset_agent(mask)
            self._recorder.start_episodes(mask)
        for i in np.flatnonzero(self._lengths == 0).tolist():
            # An episode that has not taken a step yet starts under the current agent version.
            self._episode_info[i] = self._fresh_info(self._episode_info[i], i)

    async def step_episode(self) -> bool:
        """Step every active env once; returns whether any episode completed."""
        host = self.host
        assert host is not None
        buffers = host.buffers
        recorder = self._recorder
        rows = recorder.rows
        active = self._active
        t = rows.next_row(buffers.obs, buffers.actions)
        put_row(rows.obs, t, buffers.obs)
        observations = row_of(rows.obs, t)
        actions, agent_infos = self._output_check.output(await self.compute_actions(observations))
        actions = self._check_actions(actions)
        put_row(rows.actions, t, actions)
        put_row(buffers.actions, Ellipsis, actions)
        if agent_infos or rows.agent_infos:
            store_agent_infos(rows, t, agent_infos)
        batcher = self.batcher
        if batcher is not None:  # inference="batched" needs to know who waits on a host
            batcher.host_wait(self.worker_number)
        infos = await host.step(active)  # the one place a worker steps its envs
        if batcher is not None:
            batcher.host_done(self.worker_number)
        rows.rewards[t] = buffers.rewards
        if infos.env_infos is not None:
            rows.env_infos[t] = infos.env_infos
        done = np.logical_or(buffers.terminated, buffers.truncated, out=self._done)
        if self._everyone:
            self._lengths += 1
            self._returns += buffers.rewards
        else:
            self._lengths[active] += 1
            self._returns[active] += buffers.rewards[active]
            done &= active
        if self._records_transitions:
            self._record(t, agent_infos, infos.env_infos, done)
        if not np.count_nonzero(done):
            return False
        for i in np.flatnonzero(done).tolist():
            end = StepType.TERMINAL if buffers.terminated[i] else StepType.TIMEOUT
            last = tree_map(lambda x, i=i: x[i].copy(), buffers.final_obs)
            info = self._episode_info[i]
            recorder.close_piece(i, t + 1, end, last, info)
            self.finished.append(
                FinishedEpisode(
                    float(self._returns[i]), int(self._lengths[i]), int(info["agent_version"])
                )
            )
            self._returns[i] = 0.0
            self._episode_info[i] = self._fresh_info(infos.reset_infos.get(i, {}), i)
            self._lengths[i] = 0
            recorder.piece_position[i] = 0
            if self._episodes_left is not None:
                self._episodes_left[i] -= 1
                if self._episodes_left[i] <= 0:
                    active[i] = False
                    self._everyone = False
        self._reset_agent(done)
        return True

    def collect_episode(self, *, fragments: bool = False) -> EpisodeBatch:
        """The episodes completed since the last collection, as one batch.

        Args:
            fragments: also return the episodes still running as fragments (``FIRST``/``MID``
                at the end, ``last_observations`` = the current observation); they continue
                in the next call.
        """
        assert self.env_spec is not None
        return assemble(self.env_spec, [self._collect_plan(fragments=fragments)])

    async def rollout(self) -> EpisodeBatch:
        """Step until at least one episode completes; return the completed episodes."""
        self._begin_call(Resume.NOTHING)
        await self.start_episode()
        while not await self.step_episode():
            pass
        batch = self.collect_episode()
        self._end_call(Resume.NOTHING)
        return batch

    async def shutdown(self) -> None:
        """Close the envs of this worker."""
        if self.host is not None:
            await self.host.close()

    # -- per-step hooks ----------------------------------------------------------------------

    async def compute_actions(self, observations: Tree) -> AgentOutput:
        """Actions and agent infos for the stacked observations of this worker's envs.

        Override to pre-process observations or post-process actions (clipping, scaling,
        exploration noise). The default asks the agent, awaiting it when it is async. What it
        returns is checked (an ``(actions, agent_infos)`` tuple, one row per env) before
        anything is recorded.
        """
        assert self.agent is not None
        if self.batcher is not None:  # --- hook: inference="batched" ---
            return await self.batcher.get_actions(self.worker_number, observations)
        return await get_actions(self.agent, observations)

    def process_transition(self, history: Any, transition: Transition) -> Any:
        """Record one step into a custom history; return the new history.

        Called after every step with :attr:`history` (``None`` at first), only when a subclass
        overrides it, so the default costs nothing.
        """
        return history

    # -- the driver (used by the sampler only) -----------------------------------------------
    #
    # The sampler calls _begin_call() once, then one _run_* plan. When the host fails, it calls
    # _recover() and the same plan again, which resumes: episodes completed before the failure
    # are kept, the ones in progress are dropped and redone.

    def _begin_call(self, resume: Resume, *, episodes: int | None = None) -> None:
        """Prepare a sampler call that continues ``resume`` from the previous one.

        Args:
            episodes: for ``obtain_exact_episodes``, how many episodes this worker must return.
        """
        if self._in_call or self._broken:
            # The previous call was cancelled or failed midway: nothing of it may leak.
            resume = Resume.NOTHING
            self._needs_reset[:] = True
        if resume is Resume.NOTHING:
            self._needs_reset |= self._lengths > 0
        self._in_call = True
        self._recorder.begin(resume, self._lengths)
        self._steps_left = None
        self._active[:] = True
        self._episodes_left = None
        if episodes is not None:
            e = self.n_envs
            self._episodes_left = np.array(
                [episodes // e + (i < episodes % e) for i in range(e)], dtype=np.int64
            )
            self._active[:] = self._episodes_left > 0
        self._everyone = bool(self._active.all())

    async def _run_samples(
        self, share: int, *, leave: Resume = Resume.NOTHING, quota: SharedQuota | None = None
    ) -> Plan:
        """Complete episodes until their lengths reach ``share``.

        Episodes still running are discarded, or with ``leave=Resume.EPISODES`` carried over
        (with their steps so far) to the next call. With a shared ``quota``
        (``fraction_samples < 1``) the worker steps until :meth:`SharedQuota.may_stop` instead;
        it decides at step boundaries only, so the step it is in when the call's quota is met
        completes and is recorded once, and it takes no step after that.
        """
        await self.start_episode()
        recorder = self._recorder
        if quota is None:
            while recorder.completed_steps < share:
                await self.step_episode()
        else:
            w = self.worker_number
            quota.report(w, recorder.completed_steps)
            while not quota.may_stop(w):
                await self.step_episode()
                quota.report(w, recorder.completed_steps)
        plan = self._collect_plan()
        self._end_call(leave)
        return plan

    async def _run_episodes(self) -> Plan:
        """Run every env until it has completed its fixed share of the call's episodes."""
        await self.start_episode()
        while self._active.any():
            await self.step_episode()
        plan = self._collect_plan()
        self._end_call(Resume.NOTHING)
        return plan

    async def _run_fragments(self, share: int, *, quota: SharedQuota | None = None) -> Plan:
        """Step every env ``ceil(share / n_envs)`` times; running episodes become fragments.

        With a shared ``quota`` (``fraction_samples < 1``) the worker steps until
        :meth:`SharedQuota.may_stop`, counting the transitions it would return (completed
        pieces and open fragments, steps x envs), and stops at a step boundary.
        """
        self._share = share
        if quota is not None:
            await self.start_episode()
            recorder, w = self._recorder, self.worker_number
            quota.report(w, recorder.completed_steps + recorder.open_steps())
            while not quota.may_stop(w):
                await self.step_episode()
                quota.report(w, recorder.completed_steps + recorder.open_steps())
            plan = self._collect_plan(fragments=True)
            self._end_call(Resume.FRAGMENTS)
            return plan
        if self._steps_left is None:
            self._steps_left = math.ceil(share / self.n_envs)
        await self.start_episode()
        while self._steps_left > 0:
            await self.step_episode()
            self._steps_left -= 1
        plan = self._collect_plan(fragments=True)
        self._end_call(Resume.FRAGMENTS)
        return plan

    async def _recover(self) -> int:
        """Rebuild this worker's envs after a failure; in-progress episodes are dropped.

        Episodes completed earlier in the call are kept, so the call's plan can resume.
        Returns how many episodes in progress were dropped.
        """
        assert self.host is not None and self._seeds is not None
        self.restarts += 1
        self._broken = True
        await self.host.restart(self._chains, self._seeds.next_env_seeds())
        self._broken = False
        dropped = int(np.count_nonzero(self._lengths))
        self._needs_reset[:] = True
        self._lengths[:] = 0
        self._returns[:] = 0.0
        if self._steps_left is not None:
            # Redo the steps lost with the dropped fragments, so the call still returns its share.
            missing = max(self._share - self._recorder.completed_steps, 0)
            self._steps_left = math.ceil(missing / self.n_envs)
        return dropped

    @property
    def _needs_recovery(self) -> bool:
        """Whether the host failed and was not rebuilt yet."""
        return self._broken

    def _mark_broken(self) -> None:
        """Note that the host failed; the next call rebuilds it before stepping."""
        self._broken = True

    def _collect_plan(self, *, fragments: bool = False) -> Plan:
        """Like :meth:`collect_episode`, but only where the episodes lie in the step records.

        The records stay valid until the next call begins, so the sampler can gather the
        episodes of all workers into one batch in one copy.
        """
        assert self.host is not None
        recorder = self._recorder
        if fragments:
            stop = recorder.rows.size
            for i in range(self.n_envs):
                if self._active[i] and stop > recorder.piece_start[i]:
                    current = tree_map(lambda x, i=i: x[i].copy(), self.host.buffers.obs)
                    recorder.close_piece(i, stop, None, current, self._episode_info[i])
                    recorder.piece_position[i] = self._lengths[i]
        return recorder.collect(self.host.buffers.obs, self.host.buffers.actions)

    def _end_call(self, leave: Resume) -> None:
        # The step records stay as they are until the next call begins: the plans returned
        # by this call point into them.
        self._recorder.end(leave)
        if leave is Resume.NOTHING:
            self._needs_reset |= self._lengths > 0
        self._episodes_left = None
        self._steps_left = None
        self._active[:] = True
        self._everyone = True
        self._in_call = False

    def _trust_agent(self) -> None:
        # The built-in RandomAgent samples from the action space itself: its actions need no
        # range check (unless a subclass post-processes them).
        self._trusted_actions = (
            isinstance(self.agent, RandomAgent)
            and type(self.agent) is RandomAgent
            and type(self).compute_actions is Worker.compute_actions
            and self.env_spec is not None
            and self.agent.action_space == self.env_spec.action_space
        )

    # -- bookkeeping -------------------------------------------------------------------------

    def _fresh_info(self, info: dict[str, Any], env: int) -> dict[str, Any]:
        return {
            **info,
            "worker": self.worker_number,
            "env": env,
            "agent_version": self.agent_version,
        }

    def _reset_agent(self, mask: np.ndarray) -> None:
        reset = getattr(self.agent, "reset", None)
        if reset is not None:
            reset(mask.copy())

    def _check_actions(self, actions: Tree) -> Tree:
        assert self.host is not None and self.env_spec is not None
        return check_actions(
            actions,
            self.host.buffers.actions,
            worker=self.worker_number,
            action_space=self.env_spec.action_space,
            values=None if self._trusted_actions else self._action_check,
            hint=" Clip or map the agent's actions in Worker.compute_actions if the policy is "
            "unbounded.",
        )
        bad = self._action_check(actions)
        if len(bad):
            i = int(bad[0])
            value = tree_map(lambda a: a[i], actions)
            raise ValueError(
                f"action: the agent of worker {self.worker_number} returned an action outside "
                f"the action space {self.env_spec.action_space if self.env_spec else ''} for "
                f"env {i}: {value!r}. Clip or map the agent's actions in "
                "Worker.compute_actions if the policy is unbounded."
            )
        return actions

    def _record(
        self,
        t: int,
        agent_infos: dict[str, Any],
        env_infos: list[dict[str, Any]] | None,
        done: np.ndarray,
    ) -> None:
        assert self.host is not None
        buffers = self.host.buffers

        def next_obs(obs: np.ndarray, final: np.ndarray) -> np.ndarray:
            out = obs.copy()
            out[done] = final[done]
            return out

        transition = Transition(
            observations=tree_map(lambda x: x[t], self._recorder.rows.obs),
            actions=tree_map(lambda x: x[t], self._recorder.rows.actions),
            rewards=self._recorder.rows.rewards[t],
            next_observations=tree_map(next_obs, buffers.obs, buffers.final_obs),
            terminated=buffers.terminated.copy(),
            truncated=buffers.truncated.copy(),
            env_infos=env_infos,
            agent_infos=agent_infos,
            active=self._active.copy(),
        )
        self.history = self.process_transition(self.history, transition)


class WorkerDriver(Protocol):
    """How the sampler runs one call through a worker (private: not for subclasses).

    ``_begin_call`` once, then one ``_run_*`` plan; after a :class:`~asyncsample.WorkerError`
    the sampler calls ``_mark_broken``, then ``_recover`` and the same plan again, which resumes.
    """

    worker_number: int
    agent: Agent | None
    agent_version: int
    restarts: int
    finished: list[FinishedEpisode]

    def _begin_call(self, resume: Resume, *, episodes: int | None = None) -> None: ...

    async def _run_samples(
        self, share: int, *, leave: Resume = Resume.NOTHING, quota: SharedQuota | None = None
    ) -> Plan: ...

    async def _run_episodes(self) -> Plan: ...

    async def _run_fragments(self, share: int, *, quota: SharedQuota | None = None) -> Plan: ...

    async def _recover(self) -> int: ...

    @property
    def _needs_recovery(self) -> bool: ...

    def _mark_broken(self) -> None: ...

    def update_agent(
        self, agent_update: AgentUpdate, *, apply: bool = True, reset: bool = True
    ) -> None: ...

    async def update_env(self, env_update: EnvChoice) -> None: ...


class VecWorker(Worker):
    """Steps ``n_envs`` envs together and returns complete episodes (garage's VecWorker)."""


class FragmentWorker(Worker):
    """Returns partial episodes that continue across calls (garage's FragmentWorker).

    Args:
        timesteps_per_call: how many times :meth:`rollout` steps every env.
    """

    def __init__(
        self,
        *,
        seed: int | None,
        max_episode_length: int | None,
        worker_number: int,
        n_envs: int = 1,
        timesteps_per_call: int = 1,
    ) -> None:
        super().__init__(
            seed=seed,
            max_episode_length=max_episode_length,
            worker_number=worker_number,
            n_envs=n_envs,
        )
        self.timesteps_per_call = timesteps_per_call

    async def rollout(self) -> EpisodeBatch:
        """Step every env ``timesteps_per_call`` times; return completed episodes and fragments."""
        self._begin_call(Resume.FRAGMENTS)
        plan = await self._run_fragments(self.timesteps_per_call * self.n_envs)
        assert self.env_spec is not None
        return assemble(self.env_spec, [plan])


@dataclass(frozen=True)
class WorkerFactory:
    """Builds the workers of a sampler (garage's WorkerFactory).

    Args:
        max_episode_length: passed to every worker.
        seed: the sampler's seed.
        n_workers: how many workers to build.
        worker_class: the :class:`Worker` subclass to build.
        worker_args: extra keyword arguments for ``worker_class``.
    """

    max_episode_length: int | None = None
    seed: int | None = None
    n_workers: int = 2
    worker_class: type[Worker] = VecWorker
    worker_args: dict[str, Any] = field(default_factory=dict)

    def prepare_worker_messages(
        self, objs: Any, preprocess: Callable[[Any], Any] = lambda x: x
    ) -> list[Any]:
        """One message per worker: a list must have exactly ``n_workers`` items."""
        if isinstance(objs, list):
            if len(objs) != self.n_workers:
                raise ValueError(
                    f"Length of list doesn't match number of workers: expected {self.n_workers}, "
                    f"got {len(objs)}"
                )
            return [preprocess(o) for o in objs]
        return [preprocess(objs) for _ in range(self.n_workers)]

    def __call__(self, worker_number: int) -> Worker:
        """Build worker ``worker_number``."""
        if worker_number >= self.n_workers:
            raise ValueError(
                f"Worker number is too big: {worker_number} >= n_workers ({self.n_workers})"
            )
        return self.worker_class(
            worker_number=worker_number,
            seed=self.seed,
            max_episode_length=self.max_episode_length,
            **self.worker_args,
        )
