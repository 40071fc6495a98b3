"""The envs of one worker: :class:`EnvGroup` checks what each env returned, applies the time
limit and writes the rows of the :class:`StepBuffers`, for every host (in lockstep,
:meth:`EnvGroup.step`, or env by env, :meth:`EnvGroup.finish`), so all backends agree.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array

from asyncsample import _leaves
from asyncsample._clock import CLOCK_SIZE, timed_group_step
from asyncsample._info_cells import INFO_SPACE, InfoCells, info_rows
from asyncsample._memory import carve
from asyncsample._step_fields import StepFields
from asyncsample._tree import Tree, tree_map
from asyncsample.env_update import EnvSource, EnvUpdate, SetTaskUpdate, apply_env_update, make_env

__all__ = [
    "AUTORESET_MODES",
    "EnvFailure",
    "EnvGroup",
    "PENDING_SEED",
    "StepBuffers",
    "StepInfos",
    "fixed_rows",
    "lockstep_infos",
    "rebuild_chain",
]


#: How a group restarts an env whose episode ended (gymnasium's ``AutoresetMode`` values): in the
#: step that ended it (the last observation to ``final_obs``: the sampler's mode), in its next
#: step instead of stepping it (reward 0, both flags false), or never (the caller resets it).
AUTORESET_MODES = ("SameStep", "NextStep", "Disabled")

#: "Use the env's pending seed": the default of a reset.
PENDING_SEED = object()

_FIXED_SPACES = (
    gym.spaces.Box,
    gym.spaces.Discrete,
    gym.spaces.MultiBinary,
    gym.spaces.MultiDiscrete,
)


def fixed_rows(space: gym.Space[Any]) -> bool:
    """Whether ``space``'s values fit fixed-size array rows (else they travel pickled)."""
    if isinstance(space, gym.spaces.Dict):
        return all(fixed_rows(sub) for sub in space.spaces.values())
    if isinstance(space, gym.spaces.Tuple):
        return all(fixed_rows(sub) for sub in space.spaces)
    return isinstance(space, _FIXED_SPACES)


_REWARD_SPACE = gym.spaces.Box(-np.inf, np.inf, (), np.float64)
_FLAG_SPACE = gym.spaces.Box(0, 1, (), np.bool_)  # type: ignore[arg-type]


@dataclass
class StepBuffers(StepFields):
    """The arrays one worker step reads and writes (:class:`StepFields`), each with a leading
    axis of ``n_envs``: ``obs`` is what each env shows now, ``actions`` are written by the
    worker before a step, the rest are results of the last step.

    Attributes:
        clock: with metrics on, the host's timings (:mod:`asyncsample._clock`); else ``None``.
        infos: shared, the cells numeric infos cross in (:mod:`asyncsample._info_cells`).

    A space without fixed-size rows (:func:`fixed_rows`) gets a list of ``n_envs`` objects.
    """

    clock: np.ndarray | None = None
    infos: InfoCells | None = None

    @classmethod
    def allocate(
        cls,
        observation_space: gym.Space[Any],
        action_space: gym.Space[Any],
        n_envs: int,
        make: Callable[[gym.Space[Any], int], Any] | None = None,
        timed: bool = False,
        columns: bool = False,
        info_cells: bool = False,
    ) -> StepBuffers:
        """Buffers made by ``make(space, n)`` (default: in-process); ``timed``: also a
        :attr:`clock` (allocated after the rows, so views made in the same order agree);
        ``info_cells``: also :attr:`infos` (allocated last); ``columns``:
        a space whose leaves are recorded in columns gets ``object`` rows for its ``Text`` and
        ``Sequence`` leaves (:func:`asyncsample._leaves.allocate`), not one list."""
        make = make or _zeros

        def buffers(space: gym.Space[Any]) -> Any:
            if fixed_rows(space):
                return make(space, n_envs)
            if columns and _leaves.columnar(space):
                return _leaves.allocate(space, n_envs, make)
            return [None] * n_envs

        return cls(
            obs=buffers(observation_space),
            final_obs=buffers(observation_space),
            actions=buffers(action_space),
            rewards=make(_REWARD_SPACE, n_envs),
            terminated=make(_FLAG_SPACE, n_envs),
            truncated=make(_FLAG_SPACE, n_envs),
            clock=make(_REWARD_SPACE, CLOCK_SIZE) if timed else None,
            infos=InfoCells(make(INFO_SPACE, info_rows(n_envs)), n_envs) if info_cells else None,
        )


@dataclass
class StepInfos:
    """The small, picklable part of a step's answer.

    Attributes:
        env_infos: one info dict per env (empty if not stepped); ``None`` if all are empty.
        reset_infos: info dicts from the autoresets this step did, by env index.
        final_obs: with ``final_in_reply``, by env index, the last observations that their
            buffer row cannot hold exactly; else ``None``.
    """

    env_infos: list[dict[str, Any]] | None
    reset_infos: dict[int, dict[str, Any]]
    final_obs: dict[int, Any] | None = None


@dataclass
class EnvFailure:
    """What an env raised, in a form that crosses process boundaries."""

    env: int | None
    error: BaseException
    traceback: str
    retry: bool = True  # False for the caller's own mistakes (bad observation shapes)


class EnvFailureError(Exception):
    """Raised by :class:`EnvGroup` methods; carries an :class:`EnvFailure`."""

    def __init__(self, failure: EnvFailure) -> None:
        super().__init__(str(failure.error))
        self.failure = failure


def rebuild_chain(chain: list[EnvSource], update: EnvSource) -> list[EnvSource]:
    """The sources that rebuild an env after ``update`` (what a restart replays)."""
    if not isinstance(update, EnvUpdate):
        return [update]
    if isinstance(update, SetTaskUpdate):
        return [c for c in chain if not isinstance(c, SetTaskUpdate)] + [update]
    return [*chain, update]


class EnvGroup:
    """Steps the ``n_envs`` envs of one worker with same-step autoreset.

    Args:
        worker: index of the worker these envs belong to (for error messages).
        buffers: the :class:`StepBuffers` to read actions from and write results to.
        observation_space, action_space: the declared spaces (observations are checked).
        max_episode_length: steps after which the host truncates an episode, or ``None``.
        autoreset: one of :data:`AUTORESET_MODES` (the sampler uses ``"SameStep"``).
        final_in_reply: also return final observations in :attr:`StepInfos.final_obs` (the
            gymnasium face); always on for observations without fixed-size rows.
        counted: with metrics on (the buffers' clock), also count the env steps and episode
            ends there (a vector face's host).
    """

    def __init__(
        self,
        worker: int,
        buffers: StepBuffers,
        observation_space: gym.Space[Any],
        action_space: gym.Space[Any],
        max_episode_length: int | None,
        autoreset: str = "SameStep",
        final_in_reply: bool = False,
        counted: bool = False,
    ) -> None:
        if autoreset not in AUTORESET_MODES:
            raise ValueError(f"autoreset must be one of {AUTORESET_MODES}, got {autoreset!r}")
        self.worker = worker
        self.buffers = buffers
        self.observation_space = observation_space
        self.action_space = action_space
        self.max_episode_length = max_episode_length
        self._limit = max_episode_length or _NO_LIMIT  # the steps at which an episode is cut
        self.n_envs = len(buffers.rewards)
        self.envs: list[gym.Env | None] = [None] * self.n_envs
        # Each env's observation that no buffer row holds yet; else None.
        self._obs: list[Any] = [None] * self.n_envs
        self._lengths = [0] * self.n_envs
        self._misfits: list[int] = []  # envs whose observation a plain buffer row awaits
        self._seeds: list[int | None] = [None] * self.n_envs
        # The leaf spaces of observations with Text/Sequence leaves in object rows, else None.
        self._obs_leaves: Tree = None
        if not isinstance(buffers.obs, list) and _leaves.has_variable(observation_space):
            self._obs_leaves = _leaves.leaf_spaces(observation_space)
        self._flat_obs = isinstance(buffers.obs, np.ndarray) and self._obs_leaves is None
        self._object_obs = isinstance(buffers.obs, list)
        self._final_in_reply = final_in_reply or self._object_obs
        self._obs_shape = tuple(observation_space.shape or ())
        self._same_step = autoreset == "SameStep"
        self._next_step = autoreset == "NextStep"
        # "NextStep"/"Disabled": envs whose episode ended and that were not reset since.
        self._ended = [False] * self.n_envs
        self.last_ended: list[int] = []  # the envs whose episode ended in the last step
        self.last_stepped = 0  # how many envs the last step stepped (for the metrics' clock)
        self._everyone = list(range(self.n_envs))
        self.malformed_retry = False  # True: a malformed step rebuilds the env (the lanes)
        if buffers.clock is not None:  # metrics on: the host times its steps
            self.step = timed_group_step(  # type: ignore[method-assign]
                self, self.step, buffers.clock, counted=counted
            )

    # -- building ---------------------------------------------------------------------------

    def build(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        """(Re)build every env from its chain of sources; each gets its seed at its next reset."""
        self.close()
        for i, chain in enumerate(chains):
            self._guard(i, self._build_one, i, chain, seeds[i])

    def _build_one(self, i: int, chain: Sequence[EnvSource], seed: int) -> None:
        env: gym.Env | None = make_env(chain[0])
        for update in chain[1:]:
            env, _ = apply_env_update(env, update)
        self.place(i, env, seed)

    def place(self, i: int, env: Any, seed: int | None, fresh: bool = True) -> None:
        """Env ``i`` is now ``env``, whose next reset gets ``seed``; ``fresh``: a rebuild."""
        self.envs[i] = env
        self._seeds[i] = seed
        if fresh:
            self._lengths[i] = 0
            self._ended[i] = False

    def update(self, updates: Sequence[EnvSource | None], seeds: Sequence[int]) -> None:
        """Apply one update per env; an env that becomes a new object gets its new seed."""
        for i, update in enumerate(updates):
            if update is not None:
                self._guard(i, self._update_one, i, update, seeds[i])

    def _update_one(self, i: int, update: EnvSource, seed: int) -> None:
        old = self.envs[i]
        env, _ = apply_env_update(old, update)
        self.envs[i] = env
        if env is not old:
            self._seeds[i] = seed

    # -- stepping ---------------------------------------------------------------------------

    def reset(
        self,
        mask: np.ndarray,
        seeds: Sequence[int | None] | None = None,
        options: Sequence[dict[str, Any] | None] | None = None,
    ) -> dict[int, dict[str, Any]]:
        """Reset the envs in ``mask`` (``seeds``, ``options``: per env); their non-empty infos."""
        infos: dict[int, dict[str, Any]] = {}
        requested = seeds is not None or options is not None
        for i in np.flatnonzero(mask).tolist():
            seed = PENDING_SEED if seeds is None else seeds[i]
            info = self._reset_one(i, seed, None if options is None else options[i], requested)
            if info:
                infos[i] = info
        self._store_pending()
        return infos

    def _reset_one(
        self,
        i: int,
        seed: int | object | None = PENDING_SEED,
        options: dict[str, Any] | None = None,
        requested: bool = False,
    ) -> dict[str, Any]:
        env = self.envs[i]
        assert env is not None
        kwargs = self.reset_kwargs(i, seed, options, requested)
        return self.finish_reset(i, self._guard(i, env.reset, **kwargs))

    # -- one env: before and after its own reset or step -----------------------------------

    def reset_kwargs(
        self,
        i: int,
        seed: int | object | None = PENDING_SEED,
        options: dict[str, Any] | None = None,
        requested: bool = False,
    ) -> dict[str, Any]:
        """The keyword arguments of env ``i``'s next ``reset`` (its pending seed by default)."""
        pending, self._seeds[i] = self._seeds[i], None
        if seed is PENDING_SEED:
            seed = pending
        if options is None and not requested:  # requested: options=None too, as gymnasium's
            return {"seed": seed}
        return {"seed": seed, "options": options}

    def finish_reset(self, i: int, result: Any) -> dict[str, Any]:
        """Env ``i``'s reset returned ``result``: check it, keep its observation; its info."""
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            what = "a tuple (observation, info)"
            self._raise_malformed(i, "the reset's result", what, result, "reset")
        obs, info = result
        if info is not None and type(info) is not dict and not isinstance(info, Mapping):
            self._raise_malformed(i, "info", "a dict", info, "reset")
        self._lengths[i] = 0
        self._ended[i] = False
        self._keep_obs(i, obs)
        return dict(info) if info else {}

    def finish(
        self, i: int, result: Any, out: np.ndarray | None = None, row: int = 0
    ) -> tuple[Any, bool, bool, dict[str, Any]]:
        """Env ``i``, stepped on its own (the lanes), returned ``result``: check and write it as
        :meth:`step` does; ``(reward, terminated, truncated, info)`` with the time limit.
        ``out``: flat observations only, the observation goes to its row ``row``, not to the
        buffers' row ``i`` (a host's run of steps keeps them in a block of its own and writes
        the buffers' row as it ends: one copy per step, not two)."""
        try:
            o, r, term, trunc, info = result
        except (TypeError, ValueError):
            self._checked_step(i, result)  # not 5 values: raises
            raise
        if (type(result), type(r), type(term), type(trunc)) not in _FAST_STEPS or (
            info and type(info) is not dict
        ):
            o, r, term, trunc, info = self._checked_step(i, result)
        if self._flat_obs and getattr(o, "shape", ()) == self._obs_shape:
            if out is None:
                self.buffers.obs[i] = o  # the row holds it: no second reference kept
            else:
                out[row] = o
            self._obs[i] = None
        else:
            self._keep_obs(i, o)
            self._store_pending([i])
            if out is not None:
                out[row] = self.buffers.obs[i]
        n = self._lengths[i] + 1
        self._lengths[i] = n
        if n >= self._limit:
            trunc = True
        if term or trunc:
            buf = self.buffers
            buf.terminated[i] = term
            buf.truncated[i] = trunc
            self._put(buf.final_obs, i, o)
        return r, term, trunc, info or {}

    def step_results(
        self, indices: list[int], results: Sequence[tuple[float, bool, bool, dict[str, Any]]]
    ) -> tuple[StepInfos, list[int]]:
        """:func:`lockstep_infos` of the envs stepped one by one, kept for the host's clock."""
        infos, done = lockstep_infos(self.n_envs, indices, results)
        self.last_ended = done
        self.last_stepped = len(indices)
        return infos, done

    def _keep_obs(self, i: int, o: Any) -> None:
        if not self._flat_obs:
            self._obs[i] = o
        elif getattr(o, "shape", ()) == self._obs_shape:
            self.buffers.obs[i] = o  # the row holds it: no second reference kept
            self._obs[i] = None
        else:
            self._obs[i] = o
            self._misfits.append(i)

    def _checked_step(self, i: int, result: Any) -> tuple[Any, Any, bool, bool, Any]:
        """``result`` if gymnasium allows it, else a malformed error (the checks' definition)."""
        if not isinstance(result, (tuple, list)) or len(result) != 5:
            what = "a tuple (observation, reward, terminated, truncated, info)"
            self._raise_malformed(i, "the step's result", what, result)
        obs, reward, terminated, truncated, info = result
        if not _real(reward):
            self._raise_malformed(i, "reward", "a real number", reward)
        for name, flag in (("terminated", terminated), ("truncated", truncated)):
            if not isinstance(flag, (bool, np.bool_)) and not (
                isinstance(flag, (numbers.Integral, np.integer)) and flag in (0, 1)
            ):
                self._raise_malformed(i, name, "a bool", flag)
        if info is not None and not isinstance(info, Mapping):
            self._raise_malformed(i, "info", "a dict", info)
        return obs, reward, bool(terminated), bool(truncated), info

    def step(
        self, mask: np.ndarray, given: Sequence[Any] | None = None, everyone: bool | None = None
    ) -> StepInfos:
        """Step the envs where ``mask`` is true with the buffers' actions (or ``given``, one per
        env; ``everyone``: ``mask`` is all true); an ended episode's last observation goes to
        ``final_obs`` and the env is reset as :data:`AUTORESET_MODES` says."""
        # The hot path: plain Python per env, one numpy write per field at the end; a step off
        # the fast path (exact types) gets :meth:`_checked_step`.
        buf = self.buffers
        envs = self.envs
        obs = self._obs
        lengths = self._lengths
        if everyone is None:
            everyone = bool(mask.all())
        indices = self._everyone if everyone else np.flatnonzero(mask).tolist()
        if given is None:
            actions = self._actions_for(indices, everyone)
        else:
            actions = list(given) if everyone else [given[i] for i in indices]
        obs_out = buf.obs if self._flat_obs else None
        obs_shape = self._obs_shape
        limit = self._limit
        rewards: list[Any] = []
        terms: list[bool] = []
        truncs: list[bool] = []
        env_infos: list[dict[str, Any]] | None = None
        done: list[int] = []
        finals: list[Any] = []
        misfits = self._misfits
        ended = self._ended
        deferred = not self._same_step
        reset_infos: dict[int, dict[str, Any]] = {}
        i = -1
        try:
            for i, action in zip(indices, actions):
                if deferred and ended[i]:
                    # The reset deferred from the step that ended the episode: reward 0, both
                    # flags false, the first observation (gymnasium's next-step autoreset).
                    if not self._next_step:
                        err = RuntimeError(
                            f"env {i} of worker {self.worker} ended its episode and autoreset is "
                            "'Disabled': it must be reset before it is stepped again"
                        )
                        raise EnvFailureError(EnvFailure(i, err, "", retry=False))
                    info = self._reset_one(i)
                    if info:
                        reset_infos[i] = info
                    rewards.append(0.0)
                    terms.append(False)
                    truncs.append(False)
                    continue
                result = envs[i].step(action)  # type: ignore[union-attr]
                try:
                    o, r, term, trunc, info = result
                except (TypeError, ValueError):
                    self._checked_step(i, result)  # not 5 values: raises
                    raise
                if (type(result), type(r), type(term), type(trunc)) not in _FAST_STEPS or (
                    info and type(info) is not dict
                ):
                    o, r, term, trunc, info = self._checked_step(i, result)
                if obs_out is None:
                    obs[i] = o
                elif getattr(o, "shape", ()) == obs_shape:
                    obs_out[i] = o  # the row holds it: no second reference kept
                    obs[i] = None
                else:
                    obs[i] = o
                    misfits.append(i)
                rewards.append(r)
                n = lengths[i] + 1
                lengths[i] = n
                if info:
                    if env_infos is None:
                        env_infos = [{} for _ in range(self.n_envs)]
                    env_infos[i] = info
                if n >= limit:
                    trunc = True
                terms.append(term)
                truncs.append(trunc)
                if term or trunc:
                    done.append(i)
                    finals.append(o)
        except EnvFailureError:
            raise
        except Exception as exc:
            raise EnvFailureError(EnvFailure(i, exc, traceback.format_exc())) from exc
        if len(indices) == 1:  # one env (a worker of one, a lane): a third of a list's cost
            k = indices[0]
            buf.rewards[k], buf.terminated[k], buf.truncated[k] = rewards[0], terms[0], truncs[0]
        elif indices:
            where: Any = slice(None) if everyone else indices
            buf.rewards[where] = rewards
            buf.terminated[where] = terms
            buf.truncated[where] = truncs
        self.last_ended = done
        self.last_stepped = len(indices)
        finals_out: dict[int, Any] | None = None
        if done and deferred:
            for i in done:
                ended[i] = True
        elif done:
            if self._final_in_reply:
                # A final observation its buffer row holds exactly (an array of the row's dtype
                # and shape) is read from there: only the others travel in the reply.
                row = buf.final_obs if self._flat_obs else None
                finals_out = {
                    i: o
                    for i, o in zip(done, finals)
                    if row is None
                    or type(o) is not np.ndarray
                    or o.dtype != row.dtype
                    or o.shape != obs_shape
                } or None
            try:
                self._write(buf.final_obs, done, finals)
            except (ValueError, TypeError, IndexError) as exc:
                self._raise_bad_observation(exc)
            for i in done:
                info = self._reset_one(i)
                if info:  # empty infos need not travel
                    reset_infos[i] = info
        if obs_out is None or self._misfits:
            self._store_pending()
        return StepInfos(env_infos, reset_infos, finals_out)

    # -- attributes (the vector-env faces: call, get_attr, set_attr, render) -----------------

    def call(
        self, name: str, args: Sequence[Any], kwargs: dict[str, Any], envs: Sequence[int]
    ) -> list[Any]:
        """``getattr(env, name)(*args, **kwargs)`` (or its value if not callable) per env."""
        return [self._guard_attr(i, _call_attr, self._env(i), name, args, kwargs) for i in envs]

    def set_attr(self, name: str, values: Sequence[Any], envs: Sequence[int]) -> None:
        """Set attribute ``name`` of env ``envs[k]`` to ``values[k]`` (through its wrappers);
        :data:`EPISODE_STEPS_ATTR` sets the steps of the env's episode in flight and
        :data:`SNAPSHOT_ATTR` hands ``values[k]`` to the env's ``set_state`` (a resume)."""
        if name == EPISODE_STEPS_ATTR:
            for i, value in zip(envs, values):
                self._lengths[i] = int(value)
            return
        if name == SNAPSHOT_ATTR:
            for i, value in zip(envs, values):
                self._guard_attr(i, _call_attr, self._env(i), "set_state", (value,), {})
            return
        for i, value in zip(envs, values):
            self._guard_attr(i, _set_attr, self._env(i), name, value)

    def _env(self, i: int) -> gym.Env:
        env = self.envs[i]
        if env is None:
            err = RuntimeError(f"env {i} of worker {self.worker} is not built")
            raise EnvFailureError(EnvFailure(i, err, "", retry=False))
        return env

    def _guard_attr(self, i: int, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            retry = not isinstance(exc, AttributeError)
            failure = EnvFailure(i, exc, traceback.format_exc(), retry=retry)
            raise EnvFailureError(failure) from exc

    def _actions_for(self, indices: list[int], everyone: bool) -> list[Any]:
        actions = self.buffers.actions
        if isinstance(actions, list):  # an action space without fixed-size rows
            return actions[:] if everyone else [actions[i] for i in indices]
        if isinstance(actions, np.ndarray):
            if actions.ndim == 1:
                # Numpy scalars, as gymnasium's vector envs hand them over (an item each for a
                # few: ``list`` of an array costs 0.8 us for one).
                if len(indices) <= 4:
                    return [actions[i] for i in indices]
                return list(actions) if everyone else list(actions[indices])
            # A copy: envs may keep the action they were given, and the buffer is reused.
            return list(actions.copy() if everyone else actions[indices])
        return [tree_map(lambda a, i=i: _copied(a[i]), actions) for i in indices]

    def store(self, i: int) -> None:
        """Write env ``i``'s observation into its buffer row if it was kept aside."""
        if self._obs[i] is not None:
            self._store_pending([i])

    def _store_pending(self, indices: list[int] | None = None) -> None:
        """Write the observations kept aside into the buffers (``indices``: those envs')."""
        out = self.buffers.obs
        if self._flat_obs:
            misfits, self._misfits = self._misfits, []
            for i in misfits:
                self._put(out, i, self._obs[i])
        elif indices is not None:
            for i in indices:
                self._put(out, i, self._obs[i])
        elif self._object_obs:
            out[:] = self._obs
        elif self._obs_leaves is not None:
            for i, o in enumerate(self._obs):
                if o is not None:
                    self._put(out, i, o)
        else:
            try:
                concatenate(self.observation_space, self._obs, out)
            except (ValueError, TypeError, IndexError) as exc:
                self._raise_bad_observation(exc)

    def _put(self, out: Tree, i: int, o: Any) -> None:
        try:
            if self._obs_leaves is not None:
                _leaves.put(out, self._obs_leaves, i, o)
            elif isinstance(out, np.ndarray):
                if np.shape(o) != self._obs_shape:
                    raise ValueError(f"shape {np.shape(o)}")
                out[i] = o
            elif isinstance(out, list):
                out[i] = o
            else:
                tree_map(lambda leaf, x: leaf.__setitem__(i, x), out, o)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            self._raise_bad_observation(exc)

    def _write(self, out: Tree, indices: list[int], items: list[Any]) -> None:
        if self._obs_leaves is not None:
            for i, item in zip(indices, items):
                _leaves.put(out, self._obs_leaves, i, item)
        elif isinstance(out, np.ndarray):
            shape = self._obs_shape
            if all(type(o) is np.ndarray and o.shape == shape for o in items):
                for i, item in zip(indices, items):  # a few rows: cheaper than fancy indexing
                    out[i] = item
            else:
                out[indices] = items
        elif isinstance(out, list):  # observations without fixed-size rows
            for i, item in zip(indices, items):
                out[i] = item
        else:
            tree_map(lambda leaf, *vals: leaf.__setitem__(indices, np.stack(vals)), out, *items)

    def _raise_malformed(
        self, i: int, field: str, expected: str, value: Any, what: str = "step"
    ) -> NoReturn:
        err = TypeError(
            f"env {i} of worker {self.worker} returned a malformed {what}: {field} must be "
            f"{expected}, got {type(value).__name__} {value!r:.80}"
        )
        raise EnvFailureError(EnvFailure(i, err, "", retry=self.malformed_retry))

    def _raise_bad_observation(self, exc: Exception) -> None:
        expected = _shapes(self.observation_space)
        for i, o in enumerate(self._obs):
            if o is None:  # in its buffer row already: it fit
                continue
            got = _obs_shapes(o, self.observation_space)
            if got != expected:
                err = ValueError(
                    f"observation of worker {self.worker}, env {i} does not fit the observation "
                    f"space {self.observation_space}: expected shape {expected}, got {got}"
                )
                raise EnvFailureError(EnvFailure(i, err, "", retry=False)) from exc
        err = ValueError(
            f"observations of worker {self.worker} could not be stored for the observation "
            f"space {self.observation_space}: {exc}"
        )
        raise EnvFailureError(EnvFailure(None, err, traceback.format_exc(), retry=False)) from exc

    def _guard(self, i: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except EnvFailureError:
            raise
        except Exception as exc:
            raise EnvFailureError(EnvFailure(i, exc, traceback.format_exc())) from exc

    def close(self) -> None:
        """Close every env, ignoring errors from envs that are already broken."""
        for i, env in enumerate(self.envs):
            if env is not None:
                with contextlib.suppress(Exception):
                    env.close()
            self.envs[i] = None


def _call_attr(env: gym.Env, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    getter = getattr(env, "get_wrapper_attr", None)
    value = getter(name) if getter is not None else getattr(env, name)
    return value(*args, **kwargs) if callable(value) else value


def _set_attr(env: gym.Env, name: str, value: Any) -> None:
    setter = getattr(env, "set_wrapper_attr", None)
    if setter is not None:
        setter(name, value)
    else:
        setattr(env, name, value)


#: The name ``set_attr`` reads as the step count of an env's episode in flight, from which its
#: ``max_episode_length`` counts on: set by a resume that restored the episode from a snapshot.
EPISODE_STEPS_ATTR = "__asyncsample_episode_steps__"
#: The name ``set_attr`` reads as "call the env's ``set_state`` with the value" (a resume that
#: restores snapshots: one request per worker, not one per env).
SNAPSHOT_ATTR = "__asyncsample_snapshot__"

_NO_LIMIT = 1 << 62  # the time limit of a group without max_episode_length
# The types of a step's (result, reward, terminated, truncated) that need no closer look.
_FAST_STEPS = frozenset(
    itertools.product((tuple,), (float, int, np.float64, np.float32), *[(bool, np.bool_)] * 2)
)


def _real(value: Any) -> bool:
    if isinstance(value, (str, bytes, complex, np.complexfloating)):
        return False
    if isinstance(value, numbers.Real):
        return True
    return isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "biuf"


def _copied(value: Any) -> Any:
    """A copy of an array (a ``str`` of a text leaf is immutable: itself)."""
    return value.copy() if isinstance(value, np.ndarray) else value


def _zeros(space: gym.Space[Any], n: int) -> Any:
    return carve(space, n, lambda leaf, rows: create_empty_array(leaf, rows, fn=np.zeros))


def _shapes(space: gym.Space[Any]) -> Any:
    if isinstance(space, gym.spaces.Dict):
        return {k: _shapes(s) for k, s in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        return tuple(_shapes(s) for s in space.spaces)
    return tuple(space.shape or ())


def _obs_shapes(obs: Any, space: gym.Space[Any]) -> Any:
    if isinstance(space, gym.spaces.Dict):
        if not isinstance(obs, dict) or set(obs) != set(space.spaces):
            return f"{type(obs).__name__} {sorted(obs) if isinstance(obs, dict) else ''}".strip()
        return {k: _obs_shapes(obs[k], s) for k, s in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        if not isinstance(obs, tuple) or len(obs) != len(space.spaces):
            return f"{type(obs).__name__}"
        return tuple(_obs_shapes(o, s) for o, s in zip(obs, space.spaces))
    return tuple(np.shape(obs))


def lockstep_infos(
    n_envs: int, indices: list[int], results: Sequence[tuple[float, bool, bool, dict[str, Any]]]
) -> tuple[StepInfos, list[int]]:
    """The envs of ``indices`` of ``n_envs`` were stepped one by one (:meth:`EnvGroup.finish`'s
    ``results``) as one lockstep step: its infos, and the envs whose episode ended (to reset)."""
    env_infos: list[dict[str, Any]] | None = None
    done = []
    for i, (_, terminated, truncated, info) in zip(indices, results):
        if info:
            if env_infos is None:
                env_infos = [{} for _ in range(n_envs)]
            env_infos[i] = info
        if terminated or truncated:
            done.append(i)
    return StepInfos(env_infos, {}), done
