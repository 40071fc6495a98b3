"""Workers: coroutines that step the envs of one worker through its env host.

garage's ``Worker`` interface made async, the small surface a user subclasses; the episode
bookkeeping and where a call stops live in :mod:`asyncsample._engine`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from asyncsample._action_check import AgentOutputCheck, check_actions, make_action_check
from asyncsample._assembly import Plan, assemble
from asyncsample._batcher import Batcher
from asyncsample._clock import AgentTimer, Pace
from asyncsample._engine import (
    CallMode,
    Continuity,
    Episodes,
    FinishedEpisode,
    StepStepper,
    StopRule,
    Transition,
    run_part,
    transition_at,
)
from asyncsample._recorder import Resume, put_row, row_of, store_agent_infos
from asyncsample._tree import Tree, tree_map
from asyncsample.agent import Agent, AgentOutput, AgentUpdate, get_actions, trusted_actions
from asyncsample.backends.base import EnvHost
from asyncsample.batch import EnvSpec, EpisodeBatch
from asyncsample.env_group import rebuild_chain
from asyncsample.env_update import EnvChoice, EnvSource, describe_chain
from asyncsample.errors import AgentRowsError, WorkerError
from asyncsample.seeding import WorkerSeeds

__all__ = [
    "FinishedEpisode",
    "FragmentWorker",
    "Transition",
    "VecWorker",
    "Worker",
    "WorkerFactory",
]


class ObsArena(Protocol):
    """Observation records in shared memory that the host's steps write into (a process
    host's ``obs_arena``, :class:`~asyncsample.backends._slot.StepArena`)."""

    rows: np.ndarray
    row: int

    def aim(self, row: int) -> None: ...

    def home(self) -> None: ...


class Worker:
    """garage's Worker interface as an async base class.

    A worker owns ``n_envs`` envs living in an env host, an agent (shared or its own) and its
    episodes' bookkeeping (:attr:`episodes`). Subclasses may override the per-step hooks
    :meth:`compute_actions` and :meth:`process_transition`, or any of garage's methods.

    Args:
        seed: unused (garage's signature): the worker's seeds come from the sampler's seed tree.
        max_episode_length: the episode length limit the host applies (TIMEOUT), or ``None``.
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
        del seed  # garage's signature
        self.max_episode_length = max_episode_length
        self.worker_number = worker_number
        self.n_envs = n_envs
        self.agent: Agent | None = None
        self.agent_version = 0
        self.env_spec: EnvSpec | None = None
        self.host: EnvHost | None = None
        self.history: Any = None
        self.restarts = 0
        self.episodes = Episodes(worker_number, n_envs)
        """The episodes' bookkeeping and the current call's records (see :mod:`._engine`)."""
        self.finished: list[FinishedEpisode] = self.episodes.finished
        """Every episode completed since the sampler read it."""
        self._seeds: WorkerSeeds | None = None
        self._chains: list[list[EnvSource]] = []
        self._action_check: Callable[[Any], np.ndarray] | None = None
        self._output_check = AgentOutputCheck(worker_number, n_envs)
        self._trusted_actions = False
        # process_transition is only called when a subclass overrides it.
        self.records_transitions = type(self).process_transition is not Worker.process_transition
        self.batcher: Batcher | None = None  # inference="batched", set by the sampler
        self.agent_timer: AgentTimer | None = None  # metrics on, set by the sampler
        self.agent_pace = Pace()  # which of its agent calls the metrics time
        self._arena: ObsArena | None = None  # where the host writes observations (process)
        self.agent_calls = 0  # metrics on: compute_actions calls (the metrics read it)

    def __getstate__(self) -> None:
        raise ValueError(
            "Workers are not picklable: they hold a connection to their env host. Pickle the "
            "sampler's construction arguments instead."
        )

    async def attach(
        self,
        host: EnvHost,
        env_spec: EnvSpec,
        agent: Agent,
        env: EnvSource | Sequence[EnvSource],
        seeds: WorkerSeeds,
    ) -> None:
        """Give the worker its host, spaces, agent and envs (one source, or one per env), and
        build the envs in the host."""
        self.host = host
        self.env_spec = env_spec
        self._action_check = make_action_check(env_spec.action_space)
        self.agent = agent
        self._trust_agent()
        self._seeds = seeds
        self._chains = [[s] for s in self._per_env(env, "env")]
        arena: ObsArena | None = getattr(host, "obs_arena", None)
        rows = self.episodes.recorder.rows
        if arena is not None and rows.arena is None:  # the records are the host's arena
            self._arena = arena
            rows.use_arena(arena.rows, 2)  # a step's row and the next, which the step writes
        with self.naming_factories():
            await host.build(self._chains, await seeds.next_env_seeds_off_loop())
        self.episodes.needs_reset[:] = True

    @contextlib.contextmanager
    def naming_factories(self) -> Iterator[None]:
        """A :class:`WorkerError` raised inside names the failing env's factory (the remote
        traceback may not)."""
        try:
            yield
        except WorkerError as exc:
            if exc.env is not None and 0 <= exc.env < len(self._chains):
                exc.name_factory(describe_chain(self._chains[exc.env]))
            raise

    async def restart_host(self) -> int:
        """Rebuild this worker's envs after a failure; returns how many episodes in progress
        were dropped (those completed earlier in the call are kept)."""
        assert self.host is not None and self._seeds is not None
        self.restarts += 1
        self.episodes.state = Continuity.BROKEN
        self._home()
        with self.naming_factories():
            await self.host.restart(self._chains, await self._seeds.next_env_seeds_off_loop())
        self.episodes.state = Continuity.IN_CALL
        return self.episodes.recovered()

    async def rebuild_envs(
        self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]
    ) -> None:
        """Build every env again from ``chains`` (a source, then its updates) with ``seeds``:
        a resume's envs, as they were when the checkpoint was taken."""
        assert self.host is not None
        self._chains = [list(c) for c in chains]
        self._home()
        with self.naming_factories():
            await self.host.build(self._chains, seeds)
        self.episodes.needs_reset[:] = True
        self.episodes.fresh[:] = True

    def home(self) -> None:
        """Bring the host's observations back to its step buffer before requests other than a
        step (a resume's resets, attribute calls and replayed steps)."""
        self._home()

    def env_chain(self, i: int) -> list[EnvSource]:
        """What env ``i`` is built from: its source, then the updates applied to it since."""
        return self._chains[i]

    def next_env_seed(self, i: int) -> int:
        """A fresh seed for env ``i`` rebuilt alone (the next child of its seed tree)."""
        assert self._seeds is not None
        return self._seeds.next_env_seed(i)

    def current_plan(self, *, fragments: bool = False) -> Plan:
        """Like :meth:`collect_episode`, but only where the episodes lie in the step records
        (valid until the next call begins), for the sampler to gather in one copy."""
        assert self.host is not None
        buffers = self.host.buffers
        return self.episodes.collect(buffers.obs, buffers.actions, fragments=fragments)

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

    def update_agent(
        self, agent_update: AgentUpdate, *, apply: bool = True, reset: bool = True
    ) -> None:
        """Apply an agent update: parameters (dict, tuple, ndarray) or a new agent.

        Any update but ``None`` bumps :attr:`agent_version` and, unless ``reset`` is false
        (updates during a stream), makes the next call start fresh episodes. ``apply=False``
        only bumps the version (a shared agent's parameters are set once for all workers).
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
            self.episodes.needs_reset |= self.episodes.lengths > 0

    async def update_env(self, env_update: EnvChoice) -> None:
        """Apply an env update (one for all envs, or a list of exactly ``n_envs``)."""
        if env_update is None:
            return
        updates = self._per_env(env_update, "env_update")
        assert self.host is not None and self._seeds is not None
        self._chains = [rebuild_chain(c, u) for c, u in zip(self._chains, updates)]
        self._home()
        with self.naming_factories():
            await self.host.update(updates, await self._seeds.next_env_seeds_off_loop())
        self.episodes.needs_reset[:] = True
        self.episodes.fresh[:] = True

    async def start_episode(self) -> None:
        """Reset the envs with an episode in progress or a pending update (not those just
        autoreset)."""
        assert self.host is not None
        episodes = self.episodes
        mask = episodes.needs_reset.copy()
        if mask.any():
            self._home()
            infos = await self.host.reset(mask)
            episodes.started(mask, infos)
            self._reset_agent(mask)
        episodes.stamp_unstarted(self.agent_version)

    async def step_episode(self) -> bool:
        """Step every active env once; returns whether any episode completed."""
        host = self.host
        assert host is not None
        buffers = host.buffers
        episodes = self.episodes
        rows = episodes.recorder.rows
        active = episodes.active
        t = rows.next_row(buffers.obs, buffers.actions)
        arena = self._arena
        if arena is None:
            put_row(rows.obs, t, buffers.obs)
            observations = row_of(rows.obs, t)
        else:  # row t is in the host's arena: the last step wrote it there, or a copy now
            observations, into = self._arena_row(arena, t)
        timer = self.agent_timer
        try:
            if timer is None:
                output = await self.compute_actions(observations)
            else:  # metrics on: counted, and timed at the worker's pace
                self.agent_calls += 1
                pace = self.agent_pace
                pace.left -= 1
                if pace.left:
                    output = await self.compute_actions(observations)
                else:
                    weight = pace.timed()
                    start = time.perf_counter()
                    output = await self.compute_actions(observations)
                    pace.last = seconds = time.perf_counter() - start
                    timer.took(seconds, weight)
        except AgentRowsError as exc:
            # The worker's envs step together: a failed row fails the step as an env fault
            # does here (the host is restarted; the call goes on within max_restarts).
            exc.check_rows(self.n_envs, f"the {self.n_envs} envs of worker {self.worker_number}")
            row = next(iter(exc.failures))
            fault = exc.row_fault(row, worker=self.worker_number, env=row)
            raise fault from fault.__cause__
        actions, agent_infos = self._output_check.output(output)
        assert self.env_spec is not None
        actions = check_actions(
            actions,
            buffers.actions,
            worker=self.worker_number,
            action_space=self.env_spec.action_space,
            values=None if self._trusted_actions else self._action_check,
            hint=" Clip or map the agent's actions in Worker.compute_actions if the policy is "
            "unbounded.",
        )
        put_row(rows.actions, t, actions)
        put_row(buffers.actions, Ellipsis, actions)
        if agent_infos or rows.agent_infos:
            store_agent_infos(rows, t, agent_infos)
        batcher = self.batcher
        if batcher is not None:  # inference="batched" needs to know who waits on a host
            batcher.host_wait(self.worker_number)
        if arena is not None:
            arena.aim(into)  # the step writes its observations into row t + 1 of the records
        infos = await host.step(active)  # the one place a worker steps its envs
        if batcher is not None:
            batcher.host_done(self.worker_number)
        rows.rewards[t] = buffers.rewards
        rows.versions[t] = self.agent_version
        if infos.env_infos is not None:
            rows.env_infos[t] = infos.env_infos
        done = np.logical_or(buffers.terminated, buffers.truncated, out=episodes.done)
        if episodes.everyone:
            episodes.lengths += 1
            episodes.returns += buffers.rewards
        else:
            episodes.lengths[active] += 1
            episodes.returns[active] += buffers.rewards[active]
            done &= active
        if self.records_transitions:
            self._record(t, agent_infos, infos.env_infos, done)
        ended = bool(np.count_nonzero(done))
        if ended:
            episodes.close_episodes(
                np.flatnonzero(done),
                t,
                buffers.terminated,
                buffers.final_obs,
                infos.reset_infos,
                self.agent_version,
            )
            self._reset_agent(done)
        if episodes.episode_timeout is not None and await self._cut_late(t):
            return True
        return ended

    def _arena_row(self, arena: ObsArena, t: int) -> tuple[np.ndarray, int]:
        """Row ``t``'s observations, in the arena (copied there unless the last step wrote them
        there), and the arena row the step should write the next ones to (-1: none, the host's
        step buffer: past the arena's end, or the records left it)."""
        rows = self.episodes.recorder.rows
        records = rows.obs
        if not rows.on_arena or arena.row != rows.base + t:
            assert self.host is not None
            put_row(records, t, self.host.buffers.obs)
        at = rows.arena_row(t)
        return records[t], at + 1 if at >= 0 else -1

    def _home(self) -> None:
        """A request other than a step goes to the host: its observations go home first."""
        if self._arena is not None:
            self._arena.home()

    async def _cut_late(self, t: int) -> bool:
        """End the episodes past their deadline (``episode_timeout``) after step ``t`` as
        truncated, ``episode_infos["deadline"]`` true, and reset their envs; whether any was."""
        episodes = self.episodes
        late = episodes.late()
        if not len(late):
            return False
        assert self.host is not None
        mask = np.zeros(self.n_envs, dtype=bool)
        mask[late] = True
        final = tree_map(np.copy, self.host.buffers.obs)  # the reset overwrites these rows
        self._home()
        reset_infos = await self.host.reset(mask)
        for i in late.tolist():
            episodes.episode_info[i]["deadline"] = True
        no = np.zeros(self.n_envs, dtype=bool)
        episodes.close_episodes(late, t, no, final, reset_infos, self.agent_version)
        self._reset_agent(mask)
        return True

    def collect_episode(self, *, fragments: bool = False) -> EpisodeBatch:
        """The episodes completed since the last collection, as one batch; with ``fragments``
        also the episodes still running, which continue in the next call."""
        assert self.env_spec is not None
        return assemble(self.env_spec, [self.current_plan(fragments=fragments)])

    async def rollout(self) -> EpisodeBatch:
        """Step until at least one episode completes; return the completed episodes."""
        self.episodes.begin(Resume.NOTHING, None)
        await self.start_episode()
        while not await self.step_episode():
            pass
        batch = self.collect_episode()
        self.episodes.end(Resume.NOTHING)
        return batch

    async def shutdown(self) -> None:
        """Close the envs of this worker."""
        if self.host is not None:
            await self.host.close()

    async def compute_actions(self, observations: Tree) -> AgentOutput:
        """Actions and agent infos for the stacked observations of this worker's envs.

        Override to pre-process observations or post-process actions (clipping, scaling,
        exploration noise); the output is checked before anything is recorded.
        """
        assert self.agent is not None
        if self.batcher is not None:
            return await self.batcher.get_actions(self.worker_number, observations)
        return await get_actions(self.agent, observations)

    def process_transition(self, history: Any, transition: Transition) -> Any:
        """Record one step into :attr:`history` (``None`` at first); return the new history.
        Only called when a subclass overrides it."""
        return history

    def _trust_agent(self) -> None:
        # The range check is skipped for a trusted agent, unless compute_actions is overridden.
        self._trusted_actions = (
            type(self).compute_actions is Worker.compute_actions
            and self.env_spec is not None
            and trusted_actions(self.agent, self.env_spec.action_space)
        )

    def _reset_agent(self, mask: np.ndarray) -> None:
        reset = getattr(self.agent, "reset", None)
        if reset is not None:
            reset(mask.copy())

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

        nxt: Tree = tree_map(next_obs, buffers.obs, buffers.final_obs)
        transition = transition_at(
            self.episodes, t, nxt, buffers.terminated, buffers.truncated, env_infos, agent_infos
        )
        self.history = self.process_transition(self.history, transition)


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
        share = self.timesteps_per_call * self.n_envs
        self.episodes.begin(
            Resume.FRAGMENTS, StopRule.for_call(CallMode.FRAGMENTS, share, self.n_envs)
        )
        plan = await run_part(self, StepStepper(self), Resume.FRAGMENTS)
        assert self.env_spec is not None
        return assemble(self.env_spec, [plan])


@dataclass(frozen=True)
class WorkerFactory:
    """Builds the workers of a sampler (garage's WorkerFactory); ``worker_args`` are extra
    keyword arguments for ``worker_class``."""

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
