"""The Stable-Baselines3 face: a ``VecEnv`` whose sub-envs live on asyncsample's env hosts.

``pip install 'asyncsample[sb3]'``; Stable-Baselines3 is imported only by this module, so
``import asyncsample`` does not need it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array

from asyncsample import _validate
from asyncsample.multiagent.checks import ParallelEnvSpec
from asyncsample.vector._sb3_access import SB3EnvFactory
from asyncsample.vector.agent_rows import RowLayout, agent_spec
from asyncsample.vector.hosted import HostedEnvs, HostedFace, PendingRound, StepResult, env_sources
from asyncsample.vector.sb3_rows import SB3Rows

try:
    from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "asyncsample.sb3 needs Stable-Baselines3: pip install 'asyncsample[sb3]'"
    ) from exc

__all__ = ["AsyncSampleVecEnv"]


class AsyncSampleVecEnv(HostedFace, VecEnv):
    """An SB3 ``VecEnv`` stepping its sub-envs in asyncsample's env-host processes.

    A drop-in for ``SubprocVecEnv``, with ``DummyVecEnv``'s results for the same seeds and
    actions. A restarted sub-env's step reports ``done=True`` with ``info["restarted"]``,
    ``info["TimeLimit.truncated"] = True`` and its new episode's first observation as its
    ``terminal_observation``.

    Args:
        env_fns: one zero-argument factory per sub-env (as for ``SubprocVecEnv``), or a single
            factory or gymnasium id together with ``num_envs``.
        num_envs: number of sub-envs when ``env_fns`` is a single factory or id.
        n_processes: ``0``: in the caller's process (``DummyVecEnv``'s way); ``k``: on ``k``
            env-host processes; ``None``: decided as :class:`asyncsample.VectorEnv` decides it.
        step_timeout: seconds a host may spend on one step before it is killed and rebuilt.
        max_restarts: how often each host may be rebuilt over the env's life.
        start_method: ``SubprocVecEnv``'s, checked as it checks it; changes nothing (env hosts
            always start from asyncsample's forkserver).
        caller_envs: how many sub-envs (the last ones) the caller steps itself.
        metrics: as :class:`~asyncsample.Sampler`'s (``docs/metrics.md``).
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env[Any, Any]]] | Callable[[], gym.Env[Any, Any]] | str,
        num_envs: int | None = None,
        *,
        n_processes: int | None = None,
        step_timeout: float | None = None,
        max_restarts: int = 3,
        start_method: str | None = None,
        caller_envs: int | None = None,
        metrics: Any = None,
    ) -> None:
        if start_method is not None:
            multiprocessing.get_context(start_method)  # SubprocVecEnv's check and error
        if isinstance(env_fns, (list, tuple)):
            if not env_fns:
                raise ValueError("env_fns must hold at least one env factory, got an empty list")
            if num_envs is not None and num_envs != len(env_fns):
                raise ValueError(
                    f"num_envs={num_envs} does not match the {len(env_fns)} factories in env_fns"
                )
            n = len(env_fns)
        else:
            if num_envs is None:
                raise TypeError("num_envs is required when env_fns is a single factory or id")
            n = _validate.positive_int("num_envs", num_envs)
        n_processes = _validate.optional_nonnegative_int("n_processes", n_processes)
        caller_envs = _validate.optional_nonnegative_int("caller_envs", caller_envs)
        _validate.nonnegative_int("max_restarts", max_restarts)
        step_timeout = _validate.positive_seconds("step_timeout", step_timeout)
        sources = env_sources(list(env_fns) if isinstance(env_fns, (list, tuple)) else env_fns, n)
        hosted = HostedEnvs(
            [SB3EnvFactory(s) for s in sources],
            n_processes=n_processes,
            step_timeout=step_timeout,
            max_restarts=max_restarts,
            autoreset="SameStep",
            caller_envs=caller_envs,
            metrics=metrics,
        )
        spec = agent_spec(hosted.single_observation_space)
        if spec is None:
            self._setup(hosted)
            return
        # A multi-agent env: the env-level face steps the envs, this one shows their rows.
        self._show_rows(_EnvLevel(hosted), spec, hosted)

    def _setup(self, hosted: HostedEnvs) -> None:
        """The face's state over ``hosted``, once built."""
        self._rows: SB3Rows[_EnvLevel] | None = None
        self._own(hosted)
        self._sent: PendingRound | None = None
        self.closed = False
        try:
            super().__init__(
                hosted.num_envs, hosted.single_observation_space, hosted.single_action_space
            )
        except BaseException:
            hosted.close()
            raise
        space = self.observation_space
        # A Dict space's keys, in its order (observations are OrderedDicts of them), else None.
        self._dict_keys = list(space.spaces) if isinstance(space, gym.spaces.Dict) else None

    def _show_rows(self, envs: _EnvLevel, spec: ParallelEnvSpec, hosted: HostedEnvs) -> None:
        """Show ``envs``, the env-level face of multi-agent envs, as one row per possible agent
        of each (:mod:`asyncsample.vector.sb3_rows`); ``envs`` is closed on a failure."""
        try:
            layout = RowLayout(spec, envs.num_envs, "env_fns")
            self._rows = SB3Rows(envs, layout)
            self._hosted = hosted
            self._sent = None
            self.closed = False
            super().__init__(
                layout.n_rows, layout.single_observation_space, layout.single_action_space
            )
        except BaseException:
            envs.close()
            raise
        self._dict_keys = None

    # -- observations -----------------------------------------------------------------------

    def _format_obs(self, obs: Any) -> Any:
        # SB3's layout: an OrderedDict for Dict spaces, a tuple for Tuple spaces, else an array.
        keys = self._dict_keys
        if keys is not None:
            return OrderedDict((k, obs[k]) for k in keys)
        return obs

    # -- VecEnv -----------------------------------------------------------------------------

    def reset(self) -> Any:
        """Reset every sub-env with the seeds and options set beforehand (used once); with a
        multi-agent env, each env with its first row's."""
        if self._rows is not None:
            rows, envs = self._rows, self._rows.envs
            envs.set_env_seeds_and_options(*rows.env_seeds_and_options(self._seeds, self._options))
            obs, self.reset_infos = rows.reset_rows(envs.reset())
            self._reset_seeds()
            self._reset_options()
            return obs
        hosted = self._idle()
        n = self.num_envs
        seeds = list(self._seeds)
        # One reset per distinct options dict (SB3 passes options only when non-empty).
        groups: dict[int, tuple[Any, list[int]]] = {}
        for i, opts in enumerate(self._options):
            groups.setdefault(id(opts) if opts else 0, (opts or None, []))[1].append(i)
        infos: dict[int, dict[str, Any]] = {}
        for opts, members in groups.values():
            sub = np.zeros(n, dtype=np.bool_)
            sub[members] = True
            infos.update(hosted.portal.call(hosted.reset, sub, seeds, opts))
        for i in range(n):
            self.reset_infos[i] = infos.get(i, {})
        self._reset_seeds()
        self._reset_options()
        return self._format_obs(hosted.read_obs())

    def step(
        self, actions: np.ndarray | tuple[Any, ...]
    ) -> tuple[Any, np.ndarray, np.ndarray, list[dict[str, Any]]]:
        """Step every sub-env (one lockstep round)."""
        if self._rows is not None:
            rows = self._rows
            return rows.step_rows(
                rows.envs.step(rows.layout.slot_actions(actions)), self.reset_infos
            )
        self._send(actions, "step was called while a step_async is waiting for step_wait")
        return self._finish(self._hosted.lockstep())

    def step_async(self, actions: np.ndarray | tuple[Any, ...]) -> None:
        """Send the actions (as :meth:`step` sends them); :meth:`step_wait` collects the step."""
        if self._rows is not None:
            self._rows.envs.step_async(self._rows.layout.slot_actions(actions))
            return
        self._send(actions, "step_async was called twice without step_wait in between")
        self._sent = self._hosted.lockstep_send()

    def _send(self, actions: Any, busy: str) -> None:
        """Write the actions; ``busy``: the error while a ``step_async`` waits for its wait."""
        if self._sent is not None:
            raise RuntimeError(busy)
        self._check_open()
        n = self.num_envs
        if isinstance(actions, list) and len(actions) == n:
            # SB3 also accepts one action per sub-env in a list (DummyVecEnv indexes it).
            out: Any = create_empty_array(self.action_space, n)
            actions = concatenate(self.action_space, actions, out)
        self._hosted.write_actions(actions)

    def step_wait(self) -> tuple[Any, np.ndarray, np.ndarray, list[dict[str, Any]]]:
        """Results of the step sent by :meth:`step_async`, autoresetting finished sub-envs."""
        if self._rows is not None:
            return self._rows.step_rows(self._rows.envs.step_wait(), self.reset_infos)
        self._check_open()
        task, self._sent = self._sent, None
        if task is None:
            raise RuntimeError("step_wait was called without step_async")
        return self._finish(self._hosted.lockstep_wait(task))

    def _check_open(self) -> None:
        self._hosted.check_open("AsyncSampleVecEnv")

    def _idle(self) -> HostedEnvs:
        """The hosts, once checked open and with no step pending: a step sent by ``step_async``
        and never waited for is finished (its results are lost)."""
        self._check_open()
        task, self._sent = self._sent, None
        if task is not None:
            with contextlib.suppress(Exception):
                self._hosted.lockstep_wait(task)
        return self._hosted

    def _finish(self, res: StepResult) -> tuple[Any, np.ndarray, np.ndarray, list[dict[str, Any]]]:
        hosted = self._hosted
        n = self.num_envs
        dones = res.terminated | res.truncated
        rewards = res.rewards.astype(np.float32)
        env_infos, restarted = res.env_infos, res.restarted
        if not restarted and env_infos is None and not np.count_nonzero(dones):
            # The common step: new dicts that share nothing, so DummyVecEnv's deep copy is moot.
            quiet = [{"TimeLimit.truncated": False} for _ in range(n)]
            return self._format_obs(res.obs), rewards, dones, quiet
        # DummyVecEnv's deep copy, of what needs one: the envs' own infos (in one copy, which
        # keeps what they share); the keys added below are new objects or immutable.
        infos = [{} for _ in range(n)] if env_infos is None else deepcopy(env_infos)
        truncated = (res.truncated & ~res.terminated).tolist()
        for i in np.flatnonzero(dones).tolist():
            self.reset_infos[i] = res.reset_infos.get(i, {})
        ended = dones.tolist()
        for i, info in enumerate(infos):
            if i in restarted:
                info["restarted"] = restarted[i]
                info["TimeLimit.truncated"] = True
                info["terminal_observation"] = hosted.obs_row(i)
            else:
                info["TimeLimit.truncated"] = truncated[i]
                if ended[i]:
                    info["terminal_observation"] = hosted.obs_row(i, final=True)
        return self._format_obs(res.obs), rewards, dones, infos

    def __repr__(self) -> str:
        return f"asyncsample.sb3.AsyncSampleVecEnv(num_envs={self.num_envs}, {self._where()})"

    def close(self) -> None:
        """Stop the env hosts; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._sent = None
        if self._rows is not None:
            self._rows.envs.close()
            return
        self._release()

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """The attribute of the selected sub-envs (through their wrappers)."""
        return self._call("_asyncsample_get", (attr_name,), indices)

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Set the attribute on the selected sub-envs (on their outermost wrapper, as SB3 does)."""
        self._call("_asyncsample_setattr", (attr_name, value), indices)

    def env_method(
        self,
        method_name: str,
        *method_args: Any,
        indices: VecEnvIndices = None,
        **method_kwargs: Any,
    ) -> list[Any]:
        """Call a method of the selected sub-envs; one result per sub-env."""
        return self._call("_asyncsample_method", (method_name, method_args, method_kwargs), indices)

    def env_is_wrapped(
        self, wrapper_class: type[gym.Wrapper[Any, Any, Any, Any]], indices: VecEnvIndices = None
    ) -> list[bool]:
        """Whether each selected sub-env is wrapped with ``wrapper_class``."""
        return [bool(r) for r in self._call("_asyncsample_is_wrapped", (wrapper_class,), indices)]

    def get_images(self) -> Sequence[np.ndarray | None]:
        """The ``rgb_array`` frames of every sub-env."""
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"The render mode is {self.render_mode}, but this method assumes it is "
                "`rgb_array` to obtain images.",
                stacklevel=2,
            )
            return [None for _ in range(self.num_envs)]
        return self.env_method("render")

    def _call(self, name: str, args: tuple[Any, ...], indices: VecEnvIndices) -> list[Any]:
        """One of :class:`~asyncsample.vector._sb3_access.SB3Access`'s methods on the selected
        sub-envs; one result each (with a multi-agent env, once on each env of the selected
        rows, its result on each of them)."""
        out = [int(i) for i in self._get_indices(indices)]
        for i in out:
            if not -self.num_envs <= i < self.num_envs:
                raise IndexError(f"indices: {i} is out of range for {self.num_envs} sub-envs")
        chosen = [i % self.num_envs for i in out]
        if self._rows is not None:
            rows = self._rows
            envs = list(dict.fromkeys(rows.layout.env_of(chosen)))
            return rows.per_row(rows.envs.call_envs(name, args, envs), chosen)
        hosted = self._idle()
        return hosted.portal.call(hosted.call, name, args, {}, chosen)


class _EnvLevel(AsyncSampleVecEnv):
    """The env-level face of multi-agent envs (one sub-env per env), whose results an
    :class:`SB3Rows` shows as rows."""

    def __init__(self, hosted: HostedEnvs) -> None:
        self._setup(hosted)

    def set_env_seeds_and_options(self, seeds: list[Any], options: list[Any]) -> None:
        """The seeds and options of each env's next reset (the rows' face gives them)."""
        self._seeds, self._options = seeds, options

    def call_envs(self, name: str, args: tuple[Any, ...], envs: list[int]) -> list[Any]:
        """:meth:`AsyncSampleVecEnv._call` on the envs ``envs`` (for the rows' face)."""
        return self._call(name, args, envs)
