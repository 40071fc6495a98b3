"""The gymnasium face: :class:`VectorEnv`, a ``gymnasium.vector.VectorEnv`` on the env hosts.

For the same seeds and actions it returns what :class:`gymnasium.vector.SyncVectorEnv` returns.
Calls are synchronous, on the face's :class:`~asyncsample.vector.portal.BlockingPortal`, except
the common lockstep ``step`` (:mod:`asyncsample.vector._lockstep`). See docs/vector.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import multiprocessing
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector import VectorEnv as _GymVectorEnv
from gymnasium.vector.utils import batch_space

from asyncsample import _validate
from asyncsample._tree import tree_map
from asyncsample.multiagent.checks import ParallelEnvSpec
from asyncsample.vector._gym_args import (
    AlreadyPending,
    NoAsyncCall,
    check_async_vector_env_options,
    check_shared_memory,
    check_spaces,
    concurrency_limit,
    observation_spaces,
)
from asyncsample.vector._infos import columns
from asyncsample.vector.agent_rows import RowLayout, VectorRows, agent_spec
from asyncsample.vector.hosted import HostedEnvs, HostedFace, PendingRound, StepResult, env_sources

__all__ = ["VectorEnv"]

_Step = tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]


class _InfoBatch:
    """Builds gymnasium vector infos for a batch of ``num_envs`` rows."""

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs

    # gymnasium's own builder (it calls itself by its private name)
    add_info = _add_info = _GymVectorEnv._add_info


def _scatter(leaf: Any, ids: np.ndarray, order: np.ndarray, n: int) -> np.ndarray:
    """Rows of ``leaf`` (one per id) placed at rows ``ids`` of an ``n``-row array."""
    arr = np.asarray(leaf)
    if arr.ndim == 0 or arr.shape[0] != len(ids):
        raise ValueError(
            f"actions must have one row per env id ({len(ids)}), got shape {arr.shape}"
        )
    out = np.zeros((n, *arr.shape[1:]), dtype=arr.dtype)
    out[ids[order]] = arr[order]
    return out


def _merge_rows(into: StepResult, res: StepResult, a: int, b: int) -> None:
    """Copy the rows ``a:b`` of one host's result into another result."""
    into.rewards[a:b] = res.rewards[a:b]
    into.terminated[a:b] = res.terminated[a:b]
    into.truncated[a:b] = res.truncated[a:b]
    if res.env_infos is not None:
        if into.env_infos is None:
            into.env_infos = [{} for _ in range(len(into.rewards))]
        into.env_infos[a:b] = res.env_infos[a:b]
    into.reset_infos.update({i: v for i, v in res.reset_infos.items() if a <= i < b})
    into.restarted.update({i: v for i, v in res.restarted.items() if a <= i < b})
    into.final_obs.update({i: v for i, v in res.final_obs.items() if a <= i < b})


class VectorEnv(HostedFace, _GymVectorEnv[Any, Any, np.ndarray]):
    """A gymnasium vector env whose sub-envs live ``num_envs / n_processes`` to an env host.

    A drop-in for ``AsyncVectorEnv`` (docs/vector.md describes every argument). Its
    ``shared_memory``, ``copy``, ``context``, ``daemon``, ``worker``, ``observation_mode`` and
    ``max_concurrency`` are checked as it checks them; ``context`` and ``daemon`` change nothing,
    a custom ``worker`` is refused, ``max_concurrency`` caps the processes.

    Args:
        env: a gymnasium id, a zero-argument factory, or a list of ``num_envs`` factories
            (``env_fns``: its ``AsyncVectorEnv`` name).
        num_envs: number of sub-envs (default, for a list of factories: its length).
        n_processes: ``0``: every sub-env in the caller's process; ``k``: on ``k`` env-host
            processes; ``None``: decided from what the face measures (see :attr:`placement`).
        seed: seeds the first ``reset()`` that is given no seed (sub-env ``i`` gets ``seed + i``).
        autoreset_mode: ``"NextStep"`` (default), ``"SameStep"`` or ``"Disabled"``.
        step_timeout: seconds a host may spend on one request before it is killed and rebuilt.
        max_restarts: how often each host may be rebuilt over the env's life.
        batch_size: how many sub-envs EnvPool-style :meth:`recv` returns.
        host_threads: intra-op threads of the numeric libraries in each env-host process.
        caller_envs: the last ``caller_envs`` sub-envs step in the caller's process.
        metrics: as :class:`~asyncsample.Sampler`'s (``docs/metrics.md``).
    """

    def __init__(
        self,
        env: Any = None,
        num_envs: int | None = None,
        *,
        n_processes: int | None = None,
        seed: int | None = None,
        autoreset_mode: str | AutoresetMode | None = None,
        step_timeout: float | None = None,
        max_restarts: int = 3,
        batch_size: int | None = None,
        host_threads: int | None = 1,
        shared_memory: bool = True,
        copy: bool = True,
        context: str | None = None,
        daemon: bool = True,
        worker: Any = None,
        observation_mode: Any = "same",
        env_fns: Any = None,
        max_concurrency: int | None = None,
        caller_envs: int | None = None,
        metrics: Any = None,
    ) -> None:
        if env_fns is not None:  # AsyncVectorEnv(env_fns=...), as gymnasium.make_vec calls it
            if env is not None:
                raise TypeError("give env or env_fns (its AsyncVectorEnv name), not both")
            env = env_fns
        if env is None:
            raise TypeError("env is required: a gymnasium id, a factory or a list of factories")
        if num_envs is None:
            if not isinstance(env, (list, tuple)):
                raise TypeError("num_envs is required when env is a single gymnasium id or factory")
            num_envs = len(env)  # AsyncVectorEnv(env_fns): one sub-env per factory
        num = _validate.positive_int("num_envs", num_envs)
        host_threads = _validate.optional_positive_int("host_threads", host_threads)
        check_async_vector_env_options(
            shared_memory, copy, context, daemon, worker, observation_mode
        )
        n_processes = _validate.optional_nonnegative_int("n_processes", n_processes)
        caller_envs = _validate.optional_nonnegative_int("caller_envs", caller_envs)
        n_processes = concurrency_limit(max_concurrency, n_processes, num)
        _validate.nonnegative_int("max_restarts", max_restarts)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        step_timeout = _validate.positive_seconds("step_timeout", step_timeout)
        try:
            mode = AutoresetMode("NextStep" if autoreset_mode is None else autoreset_mode)
        except ValueError:
            raise ValueError(
                "autoreset_mode must be an AutoresetMode or one of "
                f"{[m.value for m in AutoresetMode]}, got {autoreset_mode!r}"
            ) from None
        batch = _validate.optional_positive_int("batch_size", batch_size)
        if batch is not None and batch > num:
            raise ValueError(f"batch_size must be <= num_envs={num}, got {batch}")
        sources = env_sources(env, num)
        single_obs, batched_obs = observation_spaces(observation_mode, sources)
        hosted = HostedEnvs(
            sources,
            n_processes=n_processes,
            step_timeout=step_timeout,
            max_restarts=max_restarts,
            autoreset=mode.value,
            group_size=None if batch is None else math.gcd(num, batch),
            host_threads=host_threads,
            object_rows=True,
            observation_space=single_obs,
            caller_envs=caller_envs,
            copy=bool(copy),
            metrics=metrics,
        )
        spec = agent_spec(hosted.single_observation_space)
        several = isinstance(env, (list, tuple)) and len({id(s) for s in sources}) > 1
        setup = (hosted, mode, batch, seed, observation_mode, max_concurrency, batched_obs)
        if spec is None:
            self._setup(*setup)
            self._check_spaces(bool(shared_memory), several)
            return
        # A multi-agent env: the env-level face steps the envs, this one shows their rows.
        self.closed = True  # until it shows the rows: nothing of its own to close
        self._show_rows(_EnvLevel(setup, (bool(shared_memory), several)), spec, batch, hosted)
        self.closed = False

    def _setup(
        self,
        hosted: HostedEnvs,
        mode: AutoresetMode,
        batch: int | None,
        seed: int | None,
        observation_mode: Any,
        max_concurrency: int | None,
        batched_obs: Any,
    ) -> None:
        """The face's state over ``hosted``, once built (the arguments as checked)."""
        num = hosted.num_envs
        self._rows: VectorRows[VectorEnv] | None = None
        self.autoreset_mode = mode
        self.num_envs = num
        self.observation_mode = observation_mode
        self.max_concurrency = max_concurrency
        self._own(hosted)
        self.batch_size = num if batch is None else batch
        self.metadata = {**hosted.metadata, "autoreset_mode": mode}
        self.render_mode = hosted.render_mode
        self.single_observation_space = hosted.single_observation_space
        self.single_action_space = hosted.single_action_space
        self.observation_space = (
            batch_space(self.single_observation_space, num) if batched_obs is None else batched_obs
        )
        self.action_space = batch_space(self.single_action_space, num)
        self._initial_seed = None if seed is None else int(seed)
        # DISABLED: sub-envs whose episode ended and that the caller has not reset yet.
        self._ended = np.zeros(num, dtype=np.bool_)
        # NEXT_STEP: sub-envs reset by a host restart, not stepped at their next step (their
        # autoreset step, which shows their reset info).
        self._fresh = np.zeros(num, dtype=np.bool_)
        self._maybe_fresh = False  # False: no sub-env in _fresh (the common step skips a test)
        self._fresh_infos: dict[int, dict[str, Any]] = {}
        # The call sent by step_async, reset_async or call_async, and what it was.
        self._pending: asyncio.Task[Any] | PendingRound | None = None
        self._pending_kind = ""
        self._pending_args: Any = None
        # EnvPool-style send/recv: requests in flight and answers not yet received, by host.
        self._inflight: dict[int, asyncio.Future[StepResult]] = {}
        self._answered: list[int] = []

    def _check_spaces(self, shared_memory: bool, several: bool) -> None:
        """``AsyncVectorEnv``'s checks of the spaces (closed on a failure)."""
        observation_mode = self.observation_mode
        try:
            if shared_memory:
                check_shared_memory(self.single_observation_space)
            if several or observation_mode != "same":
                check_spaces(
                    self.call("observation_space"),
                    self.call("action_space"),
                    self.single_observation_space,
                    self.single_action_space,
                    observation_mode,
                )
        except BaseException:
            self.close()
            raise

    def _show_rows(
        self, envs: VectorEnv, spec: ParallelEnvSpec, batch: int | None, hosted: HostedEnvs
    ) -> None:
        """Show ``envs``, the env-level face of multi-agent envs, as one row per possible agent
        of each (:mod:`asyncsample.vector.agent_rows`); ``envs`` is closed on a failure."""
        try:
            if batch is not None:
                raise ValueError(
                    f"batch_size: EnvPool-style send/recv does not take a multi-agent env; got "
                    f"batch_size={batch} with a multi-agent env (leave it None)"
                )
            layout = RowLayout(spec, envs.num_envs)
        except BaseException:
            envs.close()
            raise
        self._rows = VectorRows(envs, layout)
        self._hosted = hosted
        self.autoreset_mode = envs.autoreset_mode
        self.observation_mode = envs.observation_mode
        self.max_concurrency = envs.max_concurrency
        self.num_envs = self.batch_size = layout.n_rows
        self.metadata = envs.metadata
        self.render_mode = envs.render_mode
        self.single_observation_space = layout.single_observation_space
        self.single_action_space = layout.single_action_space
        self.observation_space = batch_space(self.single_observation_space, layout.n_rows)
        self.action_space = batch_space(self.single_action_space, layout.n_rows)

    @property
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """The ``np_random_seed`` of every sub-env."""
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]
        """The ``np_random`` generator of every sub-env (copies from their hosts)."""
        return self.get_attr("np_random")

    # -- reset ------------------------------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the sub-envs (all, or those in ``options["reset_mask"]``).

        Args:
            seed: ``None``, an int (sub-env ``i`` gets ``seed + i``) or one seed per sub-env.
            options: passed to every reset sub-env; ``"reset_mask"`` (a bool array of shape
                ``(num_envs,)``) selects the sub-envs to reset and is not passed on.
        """
        if self._rows is not None:
            seed, options = self._rows.reset_args(seed, options)
            return self._rows.reset_rows(self._rows.envs.reset(seed=seed, options=options))
        hosted = self._idle()
        mask, seeds, options = self._reset_args(seed, options)
        return self._reset_done(mask, hosted.portal.call(hosted.reset, mask, seeds, options))

    def reset_async(
        self,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        """Send the reset (see :meth:`reset`); :meth:`reset_wait` returns its results."""
        if self._rows is not None:
            self._rows.envs.reset_async(*self._rows.reset_args(seed, options))
            return
        hosted = self._free("reset_async")
        mask, seeds, options = self._reset_args(seed, options)
        self._pending = hosted.portal.start(hosted.reset, mask, seeds, options)
        self._pending_kind, self._pending_args = "reset", mask

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """The results of the reset sent by :meth:`reset_async` (see :meth:`step_wait`)."""
        if self._rows is not None:
            return self._rows.reset_rows(self._rows.envs.reset_wait(timeout))
        return self._reset_done(self._pending_args, self._wait("reset", timeout))

    def _reset_args(
        self, seed: Any, options: Any
    ) -> tuple[np.ndarray, list[int | None], dict[str, Any] | None]:
        """Check :meth:`reset`'s arguments; the mask of sub-envs, their seeds, the options."""
        n = self.num_envs
        if seed is None and self._initial_seed is not None:
            seed = self._initial_seed
        self._initial_seed = None
        if seed is None:
            seeds: list[int | None] = [None] * n
        elif isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            seeds = [int(seed) + i for i in range(n)]
        elif isinstance(seed, (list, tuple)):
            if len(seed) != n:
                raise ValueError(
                    f"seed: a list of seeds must have num_envs={n} entries, got {len(seed)}"
                )
            seeds = list(seed)
        else:
            raise TypeError(f"seed must be None, an int or a list of ints, got {seed!r}")
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"options must be a dict or None, got {type(options).__name__}")
        mask = np.ones(n, dtype=np.bool_)
        if options is not None and "reset_mask" in options:
            # gymnasium's checks and messages, word for word.
            options = dict(options)
            mask = options.pop("reset_mask")
            if not isinstance(mask, np.ndarray):
                raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
            if mask.shape != (n,):
                raise ValueError(
                    f"`options['reset_mask']` must have shape `({n},)`, got {mask.shape}"
                )
            if mask.dtype != np.bool_:
                raise TypeError(
                    f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}"
                )
            if not mask.any():
                raise ValueError(
                    "`options['reset_mask']` must contain a boolean array with at least one "
                    f"True value, got reset_mask={mask}"
                )
        return mask, seeds, options

    def _reset_done(
        self, mask: np.ndarray, reset_infos: dict[int, dict[str, Any]]
    ) -> tuple[Any, dict[str, Any]]:
        self._last_reset = reset_infos
        self._ended[mask] = False
        self._fresh[mask] = False
        infos: dict[str, Any] = {}
        for i in np.flatnonzero(mask).tolist():
            self._fresh_infos.pop(i, None)
            infos = self._add_info(infos, reset_infos.get(i, {}), i)
        return self._hosted.read_obs(), infos

    def _free(self, what: str) -> HostedEnvs:
        """The hosts, for a call ``what``: refused on a closed env or while a call is pending."""
        self._hosted.check_open()
        if self._pending is not None:
            raise AlreadyPending(
                f"Calling `{what}` while waiting for a pending call to `{self._pending_kind}` "
                "to complete (step_async was called twice without step_wait in between, or "
                "another call is pending)",
                str(self._pending_kind),
            )
        return self._hosted

    def _wait(self, kind: str, timeout: float | None) -> Any:
        """The outcome of the pending ``kind`` call (see :meth:`step_wait`)."""
        self._hosted.check_open()
        task = self._pending
        if task is None or self._pending_kind != kind:
            raise NoAsyncCall(
                f"Calling `{kind}_wait` without any prior call to `{kind}_async`.", kind
            )
        try:
            result = self._outcome(task, timeout)
        except TimeoutError:
            raise multiprocessing.TimeoutError(
                f"The call to `{kind}_wait` has timed out after {timeout} second(s)."
            ) from None
        finally:
            if task.done():
                self._pending = None
        return result

    def _outcome(self, task: asyncio.Task[Any] | PendingRound, timeout: float | None) -> Any:
        """The result of a pending call, waited for at most ``timeout`` (``TimeoutError``)."""
        hosted = self._hosted
        if isinstance(task, PendingRound):
            return hosted.lockstep_wait(task, timeout)
        return hosted.portal.wait(task, timeout)

    # -- step -------------------------------------------------------------------------------

    def step(self, actions: Any) -> _Step:
        """Step every sub-env with its action (see the module doc for the autoreset modes)."""
        if self._rows is not None:
            rows = self._rows
            return rows.step_rows(rows.envs.step(rows.layout.slot_actions(actions)))
        hosted = self._free("step")
        mask = self._send(actions)
        return self._finish(hosted.lockstep(mask), mask)

    def step_async(self, actions: Any) -> None:
        """Send the actions (as :meth:`step` sends them); the hosts step meanwhile."""
        if self._rows is not None:
            self._rows.envs.step_async(self._rows.layout.slot_actions(actions))
            return
        hosted = self._free("step_async")
        mask = self._send(actions)
        self._pending = hosted.lockstep_send(mask)
        self._pending_kind, self._pending_args = "step", mask

    def step_wait(self, timeout: float | None = None) -> _Step:
        """Wait for the step sent by :meth:`step_async` and return its results.

        Raises:
            multiprocessing.TimeoutError: ``timeout`` seconds passed first (the step is still
                pending: wait again).
        """
        if self._rows is not None:
            return self._rows.step_rows(self._rows.envs.step_wait(timeout))
        return self._finish(self._wait("step", timeout), self._pending_args)

    def _send(self, actions: Any) -> np.ndarray | None:
        """Check the state and write the actions; the step mask (``None``: every sub-env)."""
        if self.autoreset_mode == AutoresetMode.DISABLED and self._ended.any():
            done = np.flatnonzero(self._ended).tolist()
            raise RuntimeError(
                f"sub-envs {done} ended their episodes and autoreset_mode is DISABLED: reset them "
                "with reset(options={'reset_mask': mask}) before stepping"
            )
        self._hosted.write_actions(actions)
        return self._step_mask()

    def _step_mask(self) -> np.ndarray | None:
        """Which sub-envs a step steps: ``None`` for all (the sub-envs in ``_fresh`` are not)."""
        if not self._maybe_fresh:
            return None
        if self._fresh.any():
            return ~self._fresh
        self._maybe_fresh = False
        return None

    def _finish(self, res: StepResult, mask: np.ndarray | None) -> _Step:
        mode = self.autoreset_mode
        infos: dict[str, Any] = {}
        if mask is None and mode == AutoresetMode.NEXT_STEP and not res.restarted:
            # No restart now or pending (no mask): what _infos adds, without the rows with nothing
            if res.env_infos is not None or res.reset_infos:
                infos = self._next_step_infos(res)
        elif not res.quiet or mask is not None:
            infos = self._infos(res, list(range(self.num_envs)), _InfoBatch(self.num_envs))
        elif mode == AutoresetMode.DISABLED:  # the common step: what _infos does, on whole arrays
            np.logical_or(res.terminated, res.truncated, out=self._ended)
        elif mode == AutoresetMode.SAME_STEP:
            done = res.terminated | res.truncated
            if done.any():
                infos = self._finals(res, done)
        return res.obs, res.rewards, res.terminated, res.truncated, infos

    def _next_step_infos(self, res: StepResult) -> dict[str, Any]:
        """What :meth:`_infos` builds for a next-step round of every sub-env with no restart
        and none pending: each sub-env's step info, then its reset info, in sub-env order (an
        empty info adds nothing, so only the rows with one are visited)."""
        infos: dict[str, Any] = {}
        add = self._add_info
        env_infos, resets = res.env_infos, res.reset_infos
        if env_infos is None:
            rows = sorted(resets)
        else:
            rows = [i for i, info in enumerate(env_infos) if info or i in resets]
            if getattr(add, "__func__", None) is _GymVectorEnv._add_info:  # no subclass's own
                # The step infos a key at a time where their keys repeat (see _infos); every
                # row then has all of them, so the reset infos, added after each row's step
                # info, change the same cells and make the same keys as added after them all.
                built = columns(self.num_envs, env_infos, rows)
                if built is not None:
                    for i in rows:
                        reset_info = resets.get(i)
                        if reset_info:
                            built = add(built, reset_info, i)
                    return built  # type: ignore[no-any-return]
        for i in rows:
            if env_infos is not None:
                infos = add(infos, env_infos[i], i)
            reset_info = resets.get(i)
            if reset_info:
                infos = add(infos, reset_info, i)
        return infos

    def _finals(self, res: StepResult, done: np.ndarray) -> dict[str, Any]:
        """What :meth:`_infos` builds for a quiet same-step round in which the sub-envs
        ``done`` ended their episodes, without a call per row."""
        hosted = self._hosted
        final = np.full(self.num_envs, None, dtype=object)
        for i in np.flatnonzero(done).tolist():
            final[i] = hosted.final_row(res, i)
        return {
            "final_obs": final,
            "_final_obs": done,
            "final_info": {},
            "_final_info": done.copy(),
        }

    def _infos(self, res: StepResult, ids: list[int], batch: Any) -> dict[str, Any]:
        """The vector info of sub-envs ``ids`` (row ``k`` of ``batch`` is ``ids[k]``); updates
        the autoreset state of those sub-envs."""
        hosted = self._hosted
        mode = self.autoreset_mode
        infos: dict[str, Any] = {}
        where = np.asarray(ids, dtype=np.int64)
        done = res.terminated[where] | res.truncated[where]
        # Only the rows with something to add (an empty info adds nothing).
        wanted = done | self._fresh[where]
        env_infos = res.env_infos
        if env_infos is not None or res.reset_infos or res.restarted:
            special = res.reset_infos.keys() | res.restarted.keys()
            for k, i in enumerate(ids):
                if i in special or (env_infos is not None and env_infos[i]):
                    wanted[k] = True
        same_step = mode == AutoresetMode.SAME_STEP
        for k in np.flatnonzero(wanted).tolist():
            i = ids[k]
            reset_info = res.reset_infos.get(i, {})
            if i in res.restarted:
                if same_step:
                    final = {"final_obs": hosted.obs_row(i), "final_info": {}}
                    infos = batch.add_info(infos, final, k)
                infos = batch.add_info(infos, {"restarted": res.restarted[i]}, k)
                if same_step:
                    infos = batch.add_info(infos, reset_info, k)
            elif self._fresh[i]:
                infos = batch.add_info(infos, self._fresh_infos.pop(i, {}), k)
            else:
                # In NEXT_STEP mode, a sub-env its host reset in this step was not stepped.
                info = res.info(i)
                if same_step and done[k]:
                    info = {"final_obs": hosted.final_row(res, i), "final_info": info}
                infos = batch.add_info(infos, info, k)
                infos = batch.add_info(infos, reset_info, k)
        self._fresh[where] = False
        if mode == AutoresetMode.DISABLED:
            self._ended[where] = done
        for i in ids:
            if i in res.restarted:
                if mode == AutoresetMode.NEXT_STEP:
                    self._fresh[i] = True
                    self._maybe_fresh = True
                    self._fresh_infos[i] = res.reset_infos.get(i, {})
                elif mode == AutoresetMode.DISABLED:
                    self._ended[i] = True
        return infos

    def _idle(self) -> HostedEnvs:
        """The hosts, once checked open and with no call pending: a call sent and never waited
        for is finished (its results are lost), EnvPool-style steps are waited for."""
        hosted = self._hosted
        hosted.check_open()
        task, self._pending = self._pending, None
        if task is not None:
            with contextlib.suppress(Exception):
                result = self._outcome(task, None)
                if self._pending_kind == "step":
                    self._finish(result, self._pending_args)  # keep the state in step
        waiting = list(self._inflight.values())
        if waiting:
            with contextlib.suppress(Exception):
                hosted.portal.call(asyncio.wait, waiting)
        self._inflight.clear()
        self._answered.clear()
        return hosted

    # -- EnvPool-style asynchronous stepping --------------------------------------------------

    def _no_rows(self, what: str) -> None:
        if self._rows is not None:
            raise TypeError(
                f"{what}: EnvPool-style send/recv does not take a multi-agent env (its rows are "
                "stepped in lockstep: use step)"
            )

    def async_reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        """Reset every sub-env; :meth:`recv` returns their first observations, a batch at a time."""
        self._no_rows("async_reset")
        self.reset(seed=seed, options=options)
        res = StepResult.empty(self.num_envs)
        res.reset_infos = self._last_reset
        loop = self._hosted.portal.loop
        for h in range(len(self._hosted.slices)):
            fut: asyncio.Future[StepResult] = loop.create_future()
            fut.set_result(res)
            self._inflight[h] = fut
            self._answered.append(h)

    def send(self, actions: Any, env_ids: Any) -> None:
        """Send ``actions[k]`` to sub-env ``env_ids[k]`` (the sub-envs of earlier :meth:`recv`
        batches); their hosts start at once."""
        self._no_rows("send")
        hosted = self._free("send")
        if self.autoreset_mode == AutoresetMode.DISABLED:
            raise ValueError("send/recv needs autoreset_mode NextStep or SameStep, not Disabled")
        ids = np.asarray(env_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0 or ids.min() < 0 or ids.max() >= self.num_envs:
            raise ValueError(f"env_ids must be sub-env indices in [0, {self.num_envs}), got {ids}")
        hosts = sorted({int(hosted.host_of[i]) for i in ids})
        covered = sorted(ids.tolist())
        expected = [i for h in hosts for i in range(*hosted.slices[h])]
        if covered != expected:
            raise ValueError(
                "env_ids must be the sub-envs of one or more earlier recv() batches (sub-envs are "
                f"sent a host at a time: groups {[hosted.slices[h] for h in hosts]}), got {ids}"
            )
        if any(h in self._inflight for h in hosts):
            raise ValueError(
                f"env_ids include sub-envs whose last step was not received yet: {ids}"
            )
        # Rows of ``actions`` follow ``env_ids``; put them in sub-env order for the buffers.
        order = np.argsort(ids, kind="stable")
        full = tree_map(lambda leaf: _scatter(leaf, ids, order, self.num_envs), actions)
        hosted.write_actions(full, hosts)
        mask = self._step_mask()
        hosted.portal.call(self._launch, hosts, mask)

    async def _launch(self, hosts: list[int], mask: np.ndarray | None) -> None:
        """Start one step task per host in ``hosts``; their requests go out before returning."""
        for h in hosts:
            task = asyncio.get_running_loop().create_task(self._hosted.step(mask, [h]))
            task.add_done_callback(functools.partial(self._on_answer, h))
            self._inflight[h] = task
        await asyncio.sleep(0)

    def _on_answer(self, h: int, task: asyncio.Future[StepResult]) -> None:
        if self._inflight.get(h) is task:
            self._answered.append(h)

    def recv(self) -> _Step:
        """The first ``batch_size`` sub-envs answered, as :meth:`step` returns them; row ``k`` is
        sub-env ``info["env_id"][k]``."""
        self._no_rows("recv")
        hosted = self._hosted
        hosted.check_open()
        size = [b - a for a, b in hosted.slices]
        if sum(size[h] for h in self._answered) < self.batch_size:
            if sum(size[h] for h in self._inflight) < self.batch_size:
                raise RuntimeError(
                    f"recv() needs at least batch_size={self.batch_size} sub-envs sent "
                    "(call async_reset() first, then send() what recv() returned)"
                )
            waiting = [t for h, t in self._inflight.items() if h not in self._answered]

            async def enough() -> None:
                pending = set(waiting)
                while sum(size[h] for h in self._answered) < self.batch_size and pending:
                    _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)

            hosted.portal.call(enough)
        chosen: list[int] = []
        count = 0
        while count < self.batch_size:
            h = self._answered.pop(0)
            chosen.append(h)
            count += size[h]
        results = [self._inflight.pop(h) for h in chosen]
        for fut in results:
            error = fut.exception()
            if error is not None:
                raise error
        ids = [i for h in chosen for i in range(*hosted.slices[h])]
        where = np.asarray(ids, dtype=np.int64)
        merged = results[0].result()
        for h, fut in zip(chosen, results):
            res = fut.result()
            if res is not merged:
                a, b = hosted.slices[h]
                _merge_rows(merged, res, a, b)
        infos = self._infos(merged, ids, _InfoBatch(len(ids)))
        infos["env_id"] = where.copy()
        return (
            hosted.read_obs(chosen),
            merged.rewards[where],
            merged.terminated[where],
            merged.truncated[where],
            infos,
        )

    # -- calls ------------------------------------------------------------------------------

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call ``name`` on every sub-env (or read it, if it is not callable); with a
        multi-agent env, once on each env, its result on each of its rows."""
        if self._rows is not None:
            return self._rows.per_row_results(self._rows.envs.call(name, *args, **kwargs))
        hosted = self._idle()
        return tuple(hosted.portal.call(hosted.call, name, args, kwargs, range(self.num_envs)))

    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Send :meth:`call`; :meth:`call_wait` returns its results."""
        if self._rows is not None:
            self._rows.envs.call_async(name, *args, **kwargs)
            return
        hosted = self._free("call_async")
        self._pending = hosted.portal.start(hosted.call, name, args, kwargs, range(self.num_envs))
        self._pending_kind = "call"

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """The results of the call sent by :meth:`call_async` (see :meth:`step_wait`)."""
        if self._rows is not None:
            return self._rows.per_row_results(self._rows.envs.call_wait(timeout))
        return tuple(self._wait("call", timeout))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """The attribute ``name`` of every sub-env (called if it is a method, as gymnasium does)."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | object) -> None:
        """Set ``name`` on every sub-env: one value for all, or a list with one per sub-env (with
        a multi-agent env, one per row: the rows of an env hold one value)."""
        if self._rows is not None:
            self._rows.envs.set_attr(name, self._rows.per_env_values(values))
            return
        hosted = self._idle()
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(
                f"values: a list must have num_envs={self.num_envs} entries, got {len(values)}"
            )
        hosted.portal.call(hosted.set_attr, name, list(values), range(self.num_envs))

    def render(self) -> tuple[Any, ...]:
        """The frames rendered by every sub-env."""
        return self.call("render")

    def close_extras(self, **kwargs: Any) -> None:
        """Stop the env hosts; ``kwargs`` (``AsyncVectorEnv``'s ``timeout``, ``terminate``)
        change nothing: hosts that do not exit when asked are killed."""
        if self._rows is not None:
            self._rows.envs.close(**kwargs)
            return
        if self._pending is not None:
            warnings.warn(  # AsyncVectorEnv's warning, word for word
                f"Calling `close` while waiting for a pending call to `{self._pending_kind}` to "
                "complete.",
                UserWarning,
                stacklevel=3,
            )
        self._pending = None
        self._release()

    def __repr__(self) -> str:
        spec = self._hosted.spec
        what = f"{spec.id}, " if spec is not None else ""
        return f"asyncsample.VectorEnv({what}num_envs={self.num_envs}, {self._where()})"


class _EnvLevel(VectorEnv):
    """The env-level face of multi-agent envs (one sub-env per env), whose results a
    :class:`VectorRows` shows as rows: built from :class:`VectorEnv`'s own checked arguments."""

    def __init__(self, setup: tuple[Any, ...], checks: tuple[bool, bool]) -> None:
        self._setup(*setup)
        self._check_spaces(*checks)
