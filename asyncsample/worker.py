"""Workers: coroutines that step the envs of one worker through its env host.

The interface is garage's ``Worker`` (``update_agent``, ``update_env``, ``start_episode``,
``step_episode``, ``collect_episode``, ``rollout``, ``shutdown``) made async: ``step_episode``
awaits the host while other workers run. :class:`VecWorker` steps ``n_envs`` envs together and
returns complete episodes; :class:`FragmentWorker` also returns the episodes still running as
fragments that continue on the next call. The sampler drives either through the same methods.

Per-step work is a handful of numpy row copies into time-major buffers, whatever ``n_envs`` is;
episodes are cut out of those buffers with one gather per field when they are collected.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncsample._action_check import make_action_check
from asyncsample._assembly import Plan, assemble, step_types_of
from asyncsample._tree import Tree, tree_leaves, tree_map
from asyncsample.agent import Agent, RandomAgent, get_actions
from asyncsample.backends.base import EnvHost
from asyncsample.batch import EnvSpec, EpisodeBatch, StepType
from asyncsample.env_group import rebuild_chain
from asyncsample.env_update import EnvSource
from asyncsample.inference import Batcher
from asyncsample.seeding import WorkerSeeds

__all__ = ["FragmentWorker", "Transition", "VecWorker", "Worker", "WorkerFactory"]


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


@dataclass
class _Piece:
    """An episode, or the part of one, recorded during the current call."""

    env: int
    start: int  # first row in the step buffers
    stop: int  # one past the last row
    position: int  # steps the episode had taken before this piece
    end: StepType | None  # TERMINAL/TIMEOUT when the episode ended, else None (a fragment)
    last_observation: Tree
    episode_info: dict[str, Any]


@dataclass
class _Rows:
    """Time-major step records of one call: row ``t`` holds step ``t`` of every env."""

    n_envs: int
    capacity: int = 0
    size: int = 0
    obs: Tree = None
    actions: Tree = None
    rewards: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    agent_infos: dict[str, np.ndarray] = field(default_factory=dict)
    env_infos: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def clear(self) -> None:
        self.size = 0
        self.env_infos = {}

    def drop_before(self, start: int) -> None:
        """Forget rows before ``start``, moving the rest to the front (episodes in progress)."""
        n = self.size - start
        if start == 0:
            return
        if n > 0:

            def shift(a: np.ndarray) -> None:
                a[:n] = a[start : self.size]  # numpy copies overlapping ranges correctly

            tree_map(shift, self.obs)
            tree_map(shift, self.actions)
            shift(self.rewards)
            for column in self.agent_infos.values():
                shift(column)
        self.env_infos = {t - start: v for t, v in self.env_infos.items() if t >= start}
        self.size = max(n, 0)

    def next_row(self, obs: Tree, actions_like: Tree) -> int:
        t = self.size
        if t >= self.capacity:
            self._grow(obs, actions_like)
        self.size = t + 1
        return t

    def _grow(self, obs: Tree, actions_like: Tree) -> None:
        new = max(64, 2 * self.capacity)

        def grow(old: np.ndarray | None, like: np.ndarray) -> np.ndarray:
            arr = np.zeros((new, *like.shape), dtype=like.dtype)
            if old is not None and self.capacity:
                arr[: self.capacity] = old[: self.capacity]
            return arr

        if self.capacity == 0:
            self.obs = tree_map(lambda x: grow(None, x), obs)
            self.actions = tree_map(lambda x: grow(None, x), actions_like)
            self.rewards = grow(None, np.zeros(self.n_envs))
        else:
            self.obs = tree_map(grow, self.obs, obs)
            self.actions = tree_map(grow, self.actions, actions_like)
            self.rewards = grow(self.rewards, self.rewards[0])
            self.agent_infos = {k: grow(v, v[0]) for k, v in self.agent_infos.items()}
        self.capacity = new


def _put(dst: Tree, index: Any, src: Tree) -> None:
    """``dst[index] = src`` leaf by leaf (one assignment for a plain array)."""
    if isinstance(dst, np.ndarray):
        dst[index] = src
    else:
        tree_map(lambda d, s: d.__setitem__(index, s), dst, src)


def _row(tree: Tree, index: int) -> Tree:
    """``tree[index]`` leaf by leaf."""
    if isinstance(tree, np.ndarray):
        return tree[index]
    return tree_map(lambda x: x[index], tree)


class Worker:
    """garage's Worker interface as an async base class.

    A worker owns ``n_envs`` envs living in an :class:`~asyncsample.backends.EnvHost`, an agent
    (shared with other workers or its own) and the bookkeeping that turns steps into episodes.
    Subclasses may override the per-step hooks :meth:`compute_actions` (pre/post-processing of
    observations and actions) and :meth:`process_transition` (record transitions into a custom
    ``history``), or any of garage's methods.

    Args:
        seed: the sampler's seed (the worker's own seeds come from the sampler's seed tree).
        max_episode_length: episodes are truncated (TIMEOUT) at this length; ``None``: never.
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
        self._seed = seed
        self._max_episode_length = max_episode_length
        self.worker_number = worker_number
        self.n_envs = n_envs
        self.agent: Agent | None = None
        self.agent_version = 0
        self.env_spec: EnvSpec | None = None
        self.host: EnvHost | None = None
        self.history: Any = None
        self.restarts = 0
        self._seeds: WorkerSeeds | None = None
        self._chains: list[list[EnvSource]] = []
        self._lengths = np.zeros(n_envs, dtype=np.int64)
        self._returns = np.zeros(n_envs, dtype=np.float64)
        self._done = np.zeros(n_envs, dtype=bool)
        self._everyone = True  # every env active: the step skips its masks
        self.finished: list[tuple[float, int, int]] = []
        """(return, length, agent version) of every episode completed since the sampler read it."""
        self._needs_reset = np.ones(n_envs, dtype=bool)
        self._active = np.ones(n_envs, dtype=bool)
        self._piece_start = np.zeros(n_envs, dtype=np.int64)
        self._piece_position = np.zeros(n_envs, dtype=np.int64)
        self._episode_info: list[dict[str, Any]] = [{} for _ in range(n_envs)]
        self._pieces: list[_Piece] = []
        self._completed_steps = 0
        self._episodes_left: np.ndarray | None = None
        self._steps_left: int | None = None
        self._carry_from: int | None = None
        self._share = 0
        self._rows = _Rows(n_envs)
        self._in_call = False
        self._broken = False
        self._action_check: Callable[[Any], np.ndarray] | None = None
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

    def update_agent(self, agent_update: Any, *, apply: bool = True, reset: bool = True) -> None:
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
                self.agent = agent_update
                self._trust_agent()
        self.agent_version += 1
        if reset:
            self._needs_reset |= self._lengths > 0

    async def update_env(self, env_update: Any) -> None:
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
            self._piece_start[mask] = self._rows.size
            self._piece_position[mask] = 0
        for i in np.flatnonzero(self._lengths == 0).tolist():
            # An episode that has not taken a step yet starts under the current agent version.
            self._episode_info[i] = self._fresh_info(self._episode_info[i], i)

    async def step_episode(self) -> bool:
        """Step every active env once; returns whether any episode completed."""
        host = self.host
        assert host is not None
        buffers = host.buffers
        rows = self._rows
        active = self._active
        t = rows.next_row(buffers.obs, buffers.actions)
        _put(rows.obs, t, buffers.obs)
        observations = _row(rows.obs, t)
        actions, agent_infos = await self.compute_actions(observations)
        actions = self._check_actions(actions)
        _put(rows.actions, t, actions)
        _put(buffers.actions, Ellipsis, actions)
        if agent_infos:
            self._store_agent_infos(t, agent_infos)
        # --- hook: inference="batched" needs to know who waits on a host ---
        if self.batcher is not None:
            self.batcher.host_wait(self.worker_number)
        infos = await host.step(active)
        if self.batcher is not None:
            self.batcher.host_done(self.worker_number)
        # --- end hook ---
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
            self._close_piece(i, t + 1, end, last)
            self.finished.append(
                (
                    float(self._returns[i]),
                    int(self._lengths[i]),
                    int(self._episode_info[i]["agent_version"]),
                )
            )
            self._returns[i] = 0.0
            self._episode_info[i] = self._fresh_info(infos.reset_infos.get(i, {}), i)
            self._lengths[i] = 0
            self._piece_position[i] = 0
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
        return assemble(self.env_spec, [self.collect_plan(fragments=fragments)])

    def collect_plan(self, *, fragments: bool = False) -> Plan:
        """Like :meth:`collect_episode`, but only where the episodes lie in the step records.

        The records stay valid until the next call begins, so the sampler can gather the
        episodes of all workers into one batch in one copy.
        """
        assert self.host is not None
        if fragments:
            stop = self._rows.size
            for i in range(self.n_envs):
                if self._active[i] and stop > self._piece_start[i]:
                    current = tree_map(lambda x, i=i: x[i].copy(), self.host.buffers.obs)
                    self._close_piece(i, stop, None, current)
                    self._piece_position[i] = self._lengths[i]
        plan = self._plan(self._pieces)
        self._pieces = []
        self._completed_steps = 0
        return plan

    async def rollout(self) -> EpisodeBatch:
        """Step until at least one episode completes; return the completed episodes."""
        self.begin_call()
        await self.start_episode()
        while not await self.step_episode():
            pass
        batch = self.collect_episode()
        self._end_call()
        return batch

    async def shutdown(self) -> None:
        """Close the envs of this worker."""
        if self.host is not None:
            await self.host.close()

    # -- per-step hooks ----------------------------------------------------------------------

    async def compute_actions(self, observations: Tree) -> tuple[Tree, dict[str, np.ndarray]]:
        """Actions and agent infos for the stacked observations of this worker's envs.

        Override to pre-process observations or post-process actions (clipping, scaling,
        exploration noise). The default asks the agent, awaiting it when it is async.
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

    # -- sampling plans (driven by the sampler) ----------------------------------------------
    #
    # The sampler calls begin_call() once, then one run_* plan. When the host fails, it calls
    # recover() and the same plan again, which resumes: episodes completed before the failure
    # are kept, the ones in progress are dropped and redone.

    def begin_call(
        self,
        *,
        keep_fragments: bool = False,
        keep_episodes: bool = False,
        episodes: int | None = None,
    ) -> None:
        """Prepare a sampler call.

        Args:
            keep_fragments: let episodes left running by the previous ``obtain_fragments`` call
                continue (any other call resets them).
            keep_episodes: let episodes left running by the previous call continue, their
                steps so far kept (a stream of complete episodes).
            episodes: for ``obtain_exact_episodes``, how many episodes this worker must return.
        """
        if self._in_call:
            # The previous call was cancelled or failed midway: nothing of it may leak.
            keep_fragments = keep_episodes = False
            self._needs_reset[:] = True
        if not (keep_fragments or keep_episodes):
            self._needs_reset |= self._lengths > 0
        self._in_call = True
        if keep_episodes and self._carry_from is not None:
            # Episodes left running keep their steps: move their rows to the front.
            self._rows.drop_before(self._carry_from)
            self._piece_start -= self._carry_from
        else:
            self._rows.clear()
            self._piece_start[:] = 0
            self._piece_position[:] = self._lengths
        self._carry_from = None
        self._pieces = []
        self._completed_steps = 0
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

    async def run_samples(self, share: int, *, keep_episodes: bool = False) -> Plan:
        """Complete episodes until their lengths reach ``share``.

        Episodes still running are discarded, or with ``keep_episodes`` carried over (with
        their steps so far) to the next call.
        """
        await self.start_episode()
        while self._completed_steps < share:
            await self.step_episode()
        plan = self.collect_plan()
        self._end_call(keep_episodes=keep_episodes)
        return plan

    async def run_episodes(self) -> Plan:
        """Run every env until it has completed its fixed share of the call's episodes."""
        await self.start_episode()
        while self._active.any():
            await self.step_episode()
        plan = self.collect_plan()
        self._end_call()
        return plan

    async def run_fragments(self, share: int) -> Plan:
        """Step every env ``ceil(share / n_envs)`` times; running episodes become fragments."""
        self._share = share
        if self._steps_left is None:
            self._steps_left = math.ceil(share / self.n_envs)
        await self.start_episode()
        while self._steps_left > 0:
            await self.step_episode()
            self._steps_left -= 1
        plan = self.collect_plan(fragments=True)
        self._end_call(keep_fragments=True)
        return plan

    async def recover(self) -> None:
        """Rebuild this worker's envs after a failure; in-progress episodes are dropped.

        Episodes completed earlier in the call are kept, so the call's plan can resume.
        """
        assert self.host is not None and self._seeds is not None
        self.restarts += 1
        self._broken = True
        await self.host.restart(self._chains, self._seeds.next_env_seeds())
        self._broken = False
        self._needs_reset[:] = True
        self._lengths[:] = 0
        self._returns[:] = 0.0
        if self._steps_left is not None:
            # Redo the steps lost with the dropped fragments, so the call still returns its share.
            missing = max(self._share - self._completed_steps, 0)
            self._steps_left = math.ceil(missing / self.n_envs)

    def _trust_agent(self) -> None:
        # The built-in RandomAgent samples from the action space itself: its actions need no
        # range check (unless a subclass post-processes them).
        self._trusted_actions = (
            type(self.agent) is RandomAgent
            and type(self).compute_actions is Worker.compute_actions
            and self.env_spec is not None
            and self.agent.action_space == self.env_spec.action_space  # type: ignore[union-attr]
        )

    @property
    def broken(self) -> bool:
        """Whether the host failed and was not rebuilt yet."""
        return self._broken

    def mark_broken(self) -> None:
        """Note that the host failed; the next call rebuilds it before stepping."""
        self._broken = True

    def _end_call(self, *, keep_fragments: bool = False, keep_episodes: bool = False) -> None:
        # The step records stay as they are until the next call begins: the plans returned
        # by this call point into them.
        self._carry_from = int(self._piece_start.min()) if keep_episodes else None
        if not (keep_episodes or keep_fragments):
            self._needs_reset |= self._lengths > 0
        self._episodes_left = None
        self._steps_left = None
        self._active[:] = True
        self._everyone = True
        self._in_call = False

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

    def _close_piece(self, env: int, stop: int, end: StepType | None, last: Tree) -> None:
        start = int(self._piece_start[env])
        self._pieces.append(
            _Piece(
                env, start, stop, int(self._piece_position[env]), end, last, self._episode_info[env]
            )
        )
        if end is not None:
            self._completed_steps += stop - start
        self._piece_start[env] = stop

    def _check_actions(self, actions: Tree) -> Tree:
        assert self.host is not None
        expected = self.host.buffers.actions
        if isinstance(expected, np.ndarray):
            actions = np.asarray(actions)
            if actions.shape == expected.shape:
                return self._check_action_values(actions)
            pairs = [(actions, expected)]
        else:
            actions = tree_map(np.asarray, actions)
            pairs = list(zip(tree_leaves(actions), tree_leaves(expected)))
        for got, want in pairs:
            if got.shape != want.shape:
                if got.ndim == 0 or got.shape[0] != self.n_envs:
                    count = "a scalar" if got.ndim == 0 else f"{got.shape[0]} actions"
                    raise ValueError(
                        f"action: the agent of worker {self.worker_number} must return exactly "
                        f"envs_per_worker ({self.n_envs}) actions, got {count}"
                    )
                raise ValueError(
                    f"action: the agent of worker {self.worker_number} returned actions of "
                    f"shape {got.shape[1:]} per env, but the action space "
                    f"{self.env_spec.action_space if self.env_spec else ''} has shape "
                    f"{want.shape[1:]}"
                )
        return self._check_action_values(actions)

    def _check_action_values(self, actions: Tree) -> Tree:
        if self._action_check is None or self._trusted_actions:
            return actions
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

    def _store_agent_infos(self, t: int, agent_infos: dict[str, Any]) -> None:
        store = self._rows.agent_infos
        for key, value in agent_infos.items():
            value = np.asarray(value)
            column = store.get(key)
            if column is None or column.shape[1:] != value.shape:
                column = np.zeros((self._rows.capacity, *value.shape), dtype=value.dtype)
                store[key] = column
            column[t] = value

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
            observations=tree_map(lambda x: x[t], self._rows.obs),
            actions=tree_map(lambda x: x[t], self._rows.actions),
            rewards=self._rows.rewards[t],
            next_observations=tree_map(next_obs, buffers.obs, buffers.final_obs),
            terminated=buffers.terminated.copy(),
            truncated=buffers.truncated.copy(),
            env_infos=env_infos,
            agent_infos=agent_infos,
            active=self._active.copy(),
        )
        self.history = self.process_transition(self.history, transition)

    def _plan(self, pieces: list[_Piece]) -> Plan:
        """Where ``pieces`` lie in the step records, for :func:`assemble`."""
        assert self.host is not None
        rows = self._rows
        buffers = self.host.buffers
        lengths = [p.stop - p.start for p in pieces]
        if pieces:
            t_idx = np.concatenate([np.arange(p.start, p.stop) for p in pieces])
            e_idx = np.repeat(np.array([p.env for p in pieces], dtype=np.int64), lengths)
        else:
            t_idx = e_idx = np.zeros(0, dtype=np.int64)
        return Plan(
            obs=rows.obs,
            actions=rows.actions,
            rewards=rows.rewards if rows.capacity else None,
            agent_infos=dict(rows.agent_infos),
            env_infos=dict(rows.env_infos),
            like_obs=buffers.obs,
            like_actions=buffers.actions,
            rows=t_idx,
            envs=e_idx,
            lengths=np.array(lengths, dtype=np.int64),
            step_types=step_types_of(
                lengths, [p.position == 0 for p in pieces], [p.end for p in pieces]
            ),
            last_observations=[p.last_observation for p in pieces],
            episode_infos=[p.episode_info for p in pieces],
        )


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
        self.begin_call(keep_fragments=True)
        plan = await self.run_fragments(self.timesteps_per_call * self.n_envs)
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
