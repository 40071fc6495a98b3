"""Sub-envs on the sampler's env hosts, as both vector-env faces use them: :class:`HostedEnvs`
drives them through the public :class:`~asyncsample.backends.EnvHost` protocol (the hosts do the
autoresets) and adds the lockstep round, each host's restart budget over the env's life, and the
translation of a host's :class:`~asyncsample.WorkerError` into a :class:`SubEnvError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import Any, NoReturn, cast

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from asyncsample._tasks import wait_all
from asyncsample._tree import Tree, tree_map
from asyncsample.backends import (
    Backend,
    EnvHost,
    GivenActionsHost,
    GuestBackend,
    HostSpec,
    InlineHost,
    LockstepHost,
    ProcessPool,
    RestartBudget,
    backend_options,
    make_backend,
)
from asyncsample.env_group import StepBuffers, StepInfos
from asyncsample.env_update import describe_chain, make_env
from asyncsample.errors import WorkerError
from asyncsample.metrics import make_face_metrics
from asyncsample.vector._lockstep import LockstepRounds, PendingRound, StepResult, outcome
from asyncsample.vector._sources import check_bufferable, env_sources
from asyncsample.vector.errors import (
    ClosedError,
    SubEnvError,
    crash_like,
    reraise,
    sub_env_error_class,
    with_text,
)
from asyncsample.vector.placement import (
    CALLER_SPIN,
    HOST_SPIN,
    Placement,
    host_slices,
    place,
    spins,
)
from asyncsample.vector.portal import BlockingPortal

__all__ = ["HostedEnvs", "HostedFace", "PendingRound", "StepResult", "env_sources"]

_Infos = dict[int, dict[str, Any]]


class HostedEnvs(LockstepRounds):
    """``num_envs`` sub-envs on the hosts of a backend, driven in lockstep.

    The arguments are the faces', and ``group_size`` (sub-envs per host, for EnvPool-style
    stepping), ``object_rows`` (spaces without fixed-size rows travel pickled, else they are
    refused) and ``observation_space`` (the buffers', default: the first sub-env's).
    """

    def __init__(
        self,
        sources: list[Any],
        *,
        n_processes: int | None,
        step_timeout: float | None,
        max_restarts: int,
        autoreset: str,
        group_size: int | None = None,
        backend: str = "process",
        host_threads: int | None = 1,
        object_rows: bool = False,
        observation_space: gym.Space[Any] | None = None,
        caller_envs: int | None = None,
        copy: bool = True,
        metrics: Any = None,
    ) -> None:
        self.num_envs = len(sources)
        probe = make_env(sources[0])
        try:
            self.single_observation_space: gym.Space[Any] = (
                probe.observation_space if observation_space is None else observation_space
            )
            self.single_action_space: gym.Space[Any] = probe.action_space
            self.metadata: dict[str, Any] = dict(probe.metadata)
            self.render_mode: str | None = probe.render_mode
            self.spec = probe.spec
            if not object_rows:
                check_bufferable("observation", self.single_observation_space)
                check_bufferable("action", self.single_action_space)
            self.placement = place(
                probe,
                self.num_envs,
                n_processes=n_processes,
                caller_envs=caller_envs,
                step_timeout=step_timeout,
                batched=group_size is not None,
                backend=backend,
            )
        finally:
            probe.close()
        self.max_restarts = max_restarts
        self.budgets: list[RestartBudget] = []
        self.closed = False
        self._chains = [[s] for s in sources]
        self.slices, self._remote_hosts = host_slices(self.num_envs, self.placement, group_size)
        remote_hosts, caller_hosts = self._remote_hosts, len(self.slices) - self._remote_hosts
        self.n_procs = min(self.placement.n_processes, remote_hosts)
        self.host_of = np.repeat(np.arange(len(self.slices)), [b - a for a, b in self.slices])
        self._whole = [np.ones(b - a, dtype=np.bool_) for a, b in self.slices]
        for whole in self._whole:
            whole.flags.writeable = False  # shared by every round: never written
        self._every = list(enumerate(self._whole))
        self.portal = BlockingPortal()
        self.backend: Backend | None = None
        if remote_hosts:
            options: dict[str, Any] = {"n_processes": self.n_procs, "host_threads": host_threads}
            valid = backend_options(backend)
            if "step_timeout" in valid:
                options["step_timeout"] = step_timeout
            if "pin_cpus" in valid:
                # Lockstep rounds wake every host at once: pinned, two hosts never share a CPU
                # while another idles; beside the caller's share the scheduler keeps its freedom.
                options["pin_cpus"] = None if not self.placement.caller_envs else False
            if "spin_after_step" in valid and spins(self.placement):
                # A CPU each: the hosts wait for the next step polling, not asleep.
                options["spin_after_step"] = HOST_SPIN
                self._caller_spin = CALLER_SPIN
            self.backend = make_backend(backend, **options)
        self._pool = self.backend if isinstance(self.backend, ProcessPool) else None
        self._caller_backend: Backend | None = (
            make_backend("local", caller=True) if caller_hosts else None
        )
        self.hosts: list[EnvHost] = []
        self._inline: list[InlineHost] = []
        self._direct: list[LockstepHost] = []
        # The hosts that take actions as given (all of them, or None), and those holding some.
        self._givers: list[GivenActionsHost] | None = None
        self._given_to: set[int] = set()
        self.broken: set[int] = set()
        # The action buffer of the caller's one host when it holds every sub-env (an array).
        self._alone_actions: np.ndarray | None = None
        # Every host's rows in one allocation (see ProcessBackend.guests), if they are.
        self._joint: StepBuffers | None = None
        self.copy = copy
        """``False``: :meth:`read_obs` may return the hosts' shared buffer (``copy=False``)."""
        self.metrics = make_face_metrics(metrics, backend, self)
        timed = self.metrics is not None
        spec = partial(
            HostSpec,
            autoreset=autoreset,
            final_in_reply=object_rows,
            timed=timed,
            counted=timed,  # the face's metrics read the hosts' steps and episode ends
        )
        obs, act = self.single_observation_space, self.single_action_space
        specs = [spec(h, b - a, obs, act, None) for h, (a, b) in enumerate(self.slices)]
        try:
            self.portal.call(self._start, specs)
        except BaseException:
            self.close()
            raise

    # -- lifecycle --------------------------------------------------------------------------

    async def _start(self, specs: list[HostSpec]) -> None:
        r = self._remote_hosts
        pool, caller = self._pool, self._caller_backend
        if pool is not None and isinstance(caller, GuestBackend):
            pool.guests = specs[r:]  # the caller's rows in the hosts' joint buffers too
        if self.backend is not None:
            self.hosts = list(await self.backend.start(specs[:r]))
        if pool is not None and isinstance(caller, GuestBackend):
            caller.rows = pool.guest_buffers
        joint = None if pool is None else pool.joint
        self._joint = joint if joint is not None and len(joint.rewards) == self.num_envs else None
        if self._caller_backend is not None:
            inline = await self._caller_backend.start(specs[r:])
            self._inline = [cast(InlineHost, host) for host in inline]
            self.hosts += inline
        # Capabilities, checked once: the loop-free lockstep needs it of every host process.
        direct = [host for host in self.hosts[:r] if isinstance(host, LockstepHost)]
        self._direct = direct if len(direct) == r else []
        givers = [host for host in self.hosts if isinstance(host, GivenActionsHost)]
        self._givers = givers if len(givers) == len(self.hosts) else None
        if r == 0 and len(self._inline) == 1:  # in-process: the thin lockstep round
            self._alone = self._inline[0]
            actions = self._alone.buffers.actions
            self._alone_actions = actions if type(actions) is np.ndarray else None
        self.budgets = [RestartBudget(self.max_restarts) for _ in self.hosts]
        await asyncio.gather(*(self._build(h) for h in range(len(self.hosts))))

    def _host_chains(self, h: int) -> tuple[list[list[Any]], list[Any]]:
        a, b = self.slices[h]
        return self._chains[a:b], [None] * (b - a)

    async def _build(self, h: int) -> None:
        try:
            await self.hosts[h].build(*self._host_chains(h))
        except WorkerError as exc:
            reraise(self.translate(h, exc), exc)

    def _count_fault(self, h: int, exc: WorkerError) -> None:
        if self.metrics is not None:
            self.metrics.fault(h, exc)

    async def _restart(self, h: int) -> None:
        await self.hosts[h].restart(*self._host_chains(h))
        self.broken.discard(h)

    @property
    def pids(self) -> list[int]:
        """Pids of the live env-host processes (empty for a backend without processes)."""
        return [] if self._pool is None else self._pool.pids

    def close(self, graceful: bool = True) -> None:
        """Stop every host (idempotent); ``graceful=False`` kills them without the event loop
        (for finalizers)."""
        if self.closed:
            return
        if graceful and self.metrics is not None:  # the hosts' last figures, before they go
            self.metrics.close()
        self.closed = True
        backends = [b for b in (self.backend, self._caller_backend) if b is not None]
        try:
            if graceful and not self.portal.loop.is_closed() and not self.portal.loop.is_running():
                for backend in backends:
                    self.portal.call(backend.aclose)
        finally:
            for backend in backends:
                with contextlib.suppress(Exception):
                    backend.close_now()  # whatever the graceful path could not do
            self._drop_round()
            self.portal.close(wait=graceful)

    def check_open(self, face: str = "VectorEnv") -> None:
        """Raise :class:`ClosedError` after :meth:`close`."""
        if self.closed:
            raise ClosedError(
                f"Trying to operate on `{face}`, after a call to `close()`: the vector env is "
                "closed"
            )

    # -- errors -----------------------------------------------------------------------------

    def translate(self, h: int, exc: WorkerError) -> WorkerError:
        """``exc`` from host ``h``, naming the sub-env (or the host's sub-envs) it concerns."""
        a, b = self.slices[h]
        cause = exc.__cause__
        if crash_like(exc):
            restarts = self.budgets[h].used if self.budgets else 0
            text = (
                f"sub-envs {a}..{b - 1} (env host {h}): {exc.args[0] if exc.args else exc}"
                f" (restarted {restarts} of max_restarts={self.max_restarts} times)"
            )
            return with_text(exc, text)
        if exc.env is not None:
            message = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
            kind = SubEnvError if cause is None else sub_env_error_class(cause.__class__)
            err = kind(
                message,
                sub_env=a + exc.env,
                host=h,
                remote_traceback=exc.remote_traceback,
                factory=describe_chain(self._chains[a + exc.env]),
            )
            err.retry = exc.retry
            err.__cause__ = cause
            return err
        return with_text(exc, f"sub-envs {a}..{b - 1} (env host {h}): {exc}")

    def _fail(self, h: int, exc: BaseException) -> NoReturn:
        """Raise a host's failure, translated; a crashed host stays broken until a reset."""
        if isinstance(exc, WorkerError):
            self._count_fault(h, exc)
            if crash_like(exc):
                self.broken.add(h)
            reraise(self.translate(h, exc), exc)
        raise exc

    @property
    def restarts(self) -> list[int]:
        """How often each host was restarted."""
        return [budget.used for budget in self.budgets]

    async def _reset_host(
        self,
        h: int,
        local: np.ndarray,
        seeds: Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
        first: WorkerError | None = None,
    ) -> _Infos:
        """Reset host ``h``'s sub-envs in ``local`` within its budget: a crash (or ``first``, a
        step's) restarts it, then resets all; a failure past that leaves it broken, translated."""

        async def attempt(failure: WorkerError | None) -> _Infos:
            if failure is None and first is not None:
                raise first  # the step's failure: counted, and restarted within budget
            if failure is not None:
                await self._restart(h)
                local[:] = True
            return await self.hosts[h].reset(local, seeds=seeds, options=options)

        try:
            return await self.budgets[h].run(attempt, crash_like, partial(self._count_fault, h))
        except WorkerError as exc:
            self.broken.add(h)
            reraise(self.translate(h, exc), exc)

    # -- observations and actions -----------------------------------------------------------

    def read_obs(self, hosts: Sequence[int] | None = None) -> Tree:
        """A fresh batch of the observations of the sub-envs of ``hosts`` (all), in one copy; with
        :attr:`copy` false, the shared buffer itself where it holds all hosts' rows."""
        joint = None if hosts is not None else self._joint
        if joint is not None and type(joint.obs) is np.ndarray:
            return joint.obs.copy() if self.copy else joint.obs
        targets = range(len(self.hosts)) if hosts is None else hosts
        parts = [self.hosts[h].buffers.obs for h in targets]
        if type(parts[0]) is list:
            # Observations without fixed-size rows, batched as gymnasium batches them.
            rows = [o for part in parts for o in part]
            space = self.single_observation_space
            out: Any = create_empty_array(space, len(rows), fn=np.zeros)
            return concatenate(space, rows, out)
        if type(parts[0]) is np.ndarray:
            return np.concatenate(parts)
        return tree_map(lambda *xs: np.concatenate(xs, axis=0), *parts)

    def obs_row(self, i: int, final: bool = False) -> Any:
        """Sub-env ``i``'s current observation, or (``final``) the last one of its episode."""
        h = int(self.host_of[i])
        buf = self.hosts[h].buffers
        k = i - self.slices[h][0]
        rows = buf.final_obs if final else buf.obs
        if isinstance(rows, list):
            return rows[k]
        if type(rows) is np.ndarray:
            return rows[k].copy()
        return tree_map(lambda leaf: leaf[k].copy(), rows)

    def final_row(self, res: StepResult, i: int) -> Any:
        """Sub-env ``i``'s last observation of the episode that ended in the round ``res``."""
        if i in res.final_obs:
            return res.final_obs[i]
        return self.obs_row(i, final=True)

    def write_actions(self, actions: Any, hosts: Sequence[int] | None = None) -> None:
        """Write a batch of ``num_envs`` actions into the hosts' buffers (of ``hosts``: all)."""
        alone = self._alone_actions
        if (
            alone is not None
            and type(actions) is np.ndarray
            and actions.shape == alone.shape
            and actions.dtype == alone.dtype
            and not self._given_to
        ):
            alone[...] = actions  # in-process, actions that fit exactly: one copy, as below
            return
        n = self.num_envs
        targets = range(len(self.hosts)) if hosts is None else hosts
        first = self.hosts[0].buffers.actions
        if isinstance(first, list):
            self._write_object_actions(actions, targets)
            return
        if type(actions) is np.ndarray:
            scalar = actions.ndim == 0
        else:
            scalar = not isinstance(actions, (dict, tuple)) and np.ndim(actions) == 0
        if scalar:
            raise TypeError(self._not_a_batch(f"a single value {actions!r}", axis=False))
        if type(actions) is np.ndarray and isinstance(first, np.ndarray):
            # The common case (Box, Discrete, Multi* action spaces): one slice copy per host.
            if actions.shape[0] != n:
                raise ValueError(self._not_a_batch(f"shape {actions.shape}"))
            if actions.dtype != first.dtype:
                if self._hand_over_as_given(actions, first, targets):
                    return
                self._check_cast(actions, first.dtype)
            given, givers = self._given_to, self._givers
            try:
                for h in targets:
                    a, b = self.slices[h]
                    self.hosts[h].buffers.actions[...] = actions[a:b]
                    if h in given and givers is not None:  # for an earlier step that did not run
                        given.discard(h)
                        givers[h].give_actions(None)
            except ValueError as exc:
                raise self._misfit(str(exc)) from exc
            return

        def check(leaf: Any) -> np.ndarray:
            arr = np.asarray(leaf)
            if arr.ndim == 0 or arr.shape[0] != n:
                raise ValueError(self._not_a_batch(f"shape {arr.shape}"))
            return arr

        try:
            batch = tree_map(check, actions)
            for h in targets:
                a, b = self.slices[h]

                def put(dst: np.ndarray, src: Any, a: int = a, b: int = b) -> None:
                    dst[...] = src[a:b]

                tree_map(put, self.hosts[h].buffers.actions, batch)
        except (KeyError, IndexError, TypeError) as exc:
            raise self._misfit(f"{type(exc).__name__}: {exc}") from exc

    def _not_a_batch(self, got: str, axis: bool = True) -> str:
        n = self.num_envs
        lead = f" (leading axis {n})" if axis else ""
        return (
            f"actions must be a batch of num_envs={n} actions{lead} for the action space "
            f"{self.single_action_space}, got {got}"
        )

    def _misfit(self, why: str) -> ValueError:
        batched = batch_space(self.single_action_space, self.num_envs)
        return ValueError(f"actions do not fit the batched action space {batched}: {why}")

    def _write_object_actions(self, actions: Any, targets: Iterable[int]) -> None:
        """Actions without fixed-size rows: one object per sub-env, by gymnasium's ``iterate``."""
        try:
            rows = list(iterate(batch_space(self.single_action_space, self.num_envs), actions))
        except Exception as exc:
            raise self._misfit(f"{type(exc).__name__}: {exc}") from exc
        if len(rows) != self.num_envs:
            raise ValueError(self._not_a_batch(str(len(rows)), axis=False))
        for h in targets:
            a, b = self.slices[h]
            self.hosts[h].buffers.actions[:] = rows[a:b]

    def _hand_over_as_given(
        self, actions: np.ndarray, buffer: np.ndarray, targets: Iterable[int]
    ) -> bool:
        """Hand float actions of another float dtype to the envs as given (as ``AsyncVectorEnv``
        does: a ``float64`` stays one), not cast into the buffers; ``False``: not such actions."""
        givers = self._givers
        if givers is None or actions.dtype.kind != "f" or buffer.dtype.kind != "f":
            return False  # not floats, or hosts that cannot take them: cast (and checked)
        if actions.shape[1:] != buffer.shape[1:]:
            raise self._misfit(f"got shape {actions.shape}")
        for h in targets:
            a, b = self.slices[h]
            givers[h].give_actions(list(actions[a:b]))
            self._given_to.add(h)
        return True

    def _check_cast(self, actions: np.ndarray, dtype: np.dtype[Any]) -> None:
        """Refuse actions a cast to ``dtype`` would change: floats for an integer space (a
        policy bug the env would refuse), finite floats that overflow a narrower float type."""
        space = self.single_action_space
        if not np.can_cast(actions.dtype, dtype, casting="same_kind"):
            raise ValueError(
                f"actions of dtype {actions.dtype} do not fit the action space {space} "
                f"(dtype {dtype}): a cast would change them silently, got {actions!r}"
            )
        if dtype.kind == "f" and dtype.itemsize < actions.dtype.itemsize:
            limit = np.finfo(dtype).max
            finite = np.isfinite(actions)
            if (np.abs(actions[finite]) > limit).any():
                raise ValueError(
                    f"actions overflow the dtype {dtype} of the action space {space}: values "
                    f"beyond +-{limit} would become infinite, got {actions!r}"
                )

    # -- lockstep rounds --------------------------------------------------------------------

    async def step(
        self, mask: np.ndarray | None = None, hosts: Sequence[int] | None = None
    ) -> StepResult:
        """Step the sub-envs in ``mask`` (default: all) of ``hosts`` (default: all), one request
        per host, all in flight together; a host that died or timed out is restarted within
        budget (its sub-envs in ``restarted``). With ``hosts``, ``obs`` is ``None``: other hosts
        may be writing theirs."""
        stepped: list[tuple[int, np.ndarray]] = []
        for h in range(len(self.hosts)) if hosts is None else hosts:
            a, b = self.slices[h]
            if h in self.broken:
                raise RuntimeError(
                    f"sub-envs {a}..{b - 1} (env host {h}) failed earlier and were not "
                    "rebuilt: call reset() before stepping again"
                )
            if mask is None:
                stepped.append((h, self._whole[h]))
            elif mask[a:b].any():
                stepped.append((h, mask[a:b].copy()))
        if not stepped:
            return await self._merge([], [], whole=hosts is None)
        # The first host's request is awaited right here and the others' tasks one after the
        # other: cheaper than gather, which adds a task and a callback per host to every step.
        loop = asyncio.get_running_loop()
        others = [loop.create_task(self.hosts[h].step(local)) for h, local in stepped[1:]]
        try:
            h, local = stepped[0]
            outcomes = [await outcome(self.hosts[h].step(local))]
            outcomes += [await outcome(task) for task in others]
        finally:
            for task in others:
                task.cancel()  # only those still running: this step was cancelled
        every = mask is None and hosts is None
        return await self._merge(None if every else stepped, outcomes, whole=hosts is None)

    def _whole_result(self, outcomes: Sequence[StepInfos | BaseException]) -> StepResult | None:
        """The result of a lockstep step of every sub-env with no failure anywhere (the common
        step), straight from the buffers, the hosts' infos joined in sub-env order; ``None`` for
        any other."""
        env_infos: list[dict[str, Any]] | None = None
        reset_infos: dict[int, dict[str, Any]] = {}
        final_obs: dict[int, Any] = {}
        for (a, b), o in zip(self.slices, outcomes):
            if type(o) is not StepInfos:
                return None
            if o.env_infos is not None:
                if env_infos is None:
                    env_infos = [{} for _ in range(a)]
                env_infos += [info or {} for info in o.env_infos]
            elif env_infos is not None:
                env_infos += [{} for _ in range(b - a)]
            if o.reset_infos:
                reset_infos.update({a + k: info for k, info in o.reset_infos.items()})
            if o.final_obs:
                final_obs.update({a + k: x for k, x in o.final_obs.items()})
        joint = self._joint
        if joint is not None:  # every host's rows in one allocation: a copy each
            rewards, terminated = joint.rewards.copy(), joint.terminated.copy()
            truncated = joint.truncated.copy()
        else:
            bufs = [host.buffers for host in self.hosts]
            rewards = np.concatenate([b.rewards for b in bufs])
            terminated = np.concatenate([b.terminated for b in bufs])
            truncated = np.concatenate([b.truncated for b in bufs])
        return StepResult(
            self.read_obs(),
            rewards,
            terminated,
            truncated,
            env_infos,
            reset_infos,
            {},
            final_obs,
        )

    async def _merge(
        self,
        stepped: list[tuple[int, np.ndarray]] | None,
        outcomes: Sequence[StepInfos | BaseException],
        whole: bool = True,
    ) -> StepResult:
        """The hosts' answers (restarting crashed hosts) as one result (see :meth:`_combine`)."""
        fresh: dict[int, _Infos] = {}
        failure: BaseException | None = None
        for (h, _), o in zip(self._every if stepped is None else stepped, outcomes):
            if isinstance(o, BaseException):
                try:
                    if not isinstance(o, WorkerError):
                        raise o
                    fresh[h] = await self._reset_host(h, np.ones_like(self._whole[h]), first=o)
                except BaseException as exc:
                    failure = failure or exc
        if failure is not None:
            raise failure
        return self._combine(stepped, outcomes, whole, fresh)

    def _combine(
        self,
        stepped: list[tuple[int, np.ndarray]] | None,
        outcomes: Sequence[StepInfos | BaseException],
        whole: bool = True,
        fresh: dict[int, _Infos] | None = None,
    ) -> StepResult:
        """The hosts' answers to the steps ``stepped`` (``None``: every sub-env, the common
        round, whose quiet result comes straight from the buffers) as one result, in sub-env
        order; a failed host's outcome is its restart, with its reset infos in ``fresh[h]``."""
        if stepped is None:
            whole_result = self._whole_result(outcomes)
            if whole_result is not None:
                return whole_result
            stepped = self._every
        n = self.num_envs
        res = StepResult.empty(n)
        for (h, local), got in zip(stepped, outcomes):
            a, b = self.slices[h]
            if isinstance(got, BaseException):
                reason = str(got.args[0] if got.args else got)
                res.truncated[a:b] = True
                res.restarted.update(dict.fromkeys(range(a, b), reason))
                infos = (fresh or {}).get(h, {})
                res.reset_infos.update({a + k: info for k, info in infos.items()})
                continue
            buf = self.hosts[h].buffers
            res.rewards[a:b][local] = buf.rewards[local]
            res.terminated[a:b][local] = buf.terminated[local]
            res.truncated[a:b][local] = buf.truncated[local]
            if got.env_infos is not None:
                if res.env_infos is None:
                    res.env_infos = [{} for _ in range(n)]
                for k, info in enumerate(got.env_infos):
                    if info and local[k]:
                        res.env_infos[a + k] = info
            res.reset_infos.update({a + k: info for k, info in got.reset_infos.items()})
            if got.final_obs:
                res.final_obs.update({a + k: o for k, o in got.final_obs.items()})
        if whole:
            res.obs = self.read_obs()
        return res

    async def reset(
        self, mask: np.ndarray, seeds: Sequence[int | None], options: dict[str, Any] | None
    ) -> _Infos:
        """Reset the sub-envs in ``mask`` with their seeds and ``options``; their reset infos.

        A host that failed earlier is rebuilt first (all its sub-envs are reset then); one that
        crashes during the reset is rebuilt within budget and tried again.
        """

        async def one(h: int) -> _Infos:
            a, b = self.slices[h]
            local = mask[a:b].copy()
            if h in self.broken:
                await self._restart(h)
                local[:] = True
            if not local.any():
                return {}
            infos = await self._reset_host(h, local, list(seeds[a:b]), options)
            return {a + k: info for k, info in infos.items()}

        if len(self.slices) == 1:  # one host (in-process, say): no task to gather it with
            return await one(0)
        parts = await wait_all(one(h) for h in range(len(self.slices)))
        return {i: info for part in parts for i, info in part.items()}

    # -- attributes -------------------------------------------------------------------------

    async def _on_hosts(
        self,
        indices: Sequence[int],
        fn: Callable[[EnvHost, list[int], list[int]], Awaitable[list[Any] | None]],
    ) -> list[Any]:
        """``fn(host, its envs, their positions in indices)`` on each host of the sub-envs
        ``indices`` at once, errors translated; the results (if any) in the order of indices."""
        groups: dict[int, list[int]] = {}
        for pos, i in enumerate(indices):
            groups.setdefault(int(self.host_of[i]), []).append(pos)

        async def one(h: int, positions: list[int]) -> list[Any] | None:
            a = self.slices[h][0]
            try:
                return await fn(self.hosts[h], [indices[p] - a for p in positions], positions)
            except Exception as exc:
                self._fail(h, exc)

        results = await wait_all(one(h, ps) for h, ps in groups.items())
        out: list[Any] = [None] * len(indices)
        for positions, values in zip(groups.values(), results):
            for p, value in zip(positions, values or ()):
                out[p] = value
        return out

    async def call(
        self, name: str, args: Sequence[Any], kwargs: dict[str, Any], indices: Sequence[int]
    ) -> list[Any]:
        """``call`` on the sub-envs ``indices`` (gymnasium's semantics); one result per index."""
        return await self._on_hosts(
            indices, lambda host, envs, _: host.call(name, args, kwargs, envs=envs)
        )

    async def set_attr(self, name: str, values: Sequence[Any], indices: Sequence[int]) -> None:
        """Set ``name`` to ``values[k]`` on sub-env ``indices[k]`` (through its wrappers)."""
        await self._on_hosts(
            indices, lambda host, envs, ps: host.set_attr(name, [values[p] for p in ps], envs=envs)
        )


class HostedFace:
    """What both faces show of their hosts (a mixin: the face sets ``_hosted``)."""

    _hosted: HostedEnvs

    def _own(self, hosted: HostedEnvs) -> None:
        """Keep ``hosted``; a face collected without ``close()`` kills its hosts."""
        self._hosted = hosted
        self._finalizer = weakref.finalize(self, _finalize, hosted)

    def _release(self) -> None:
        """Stop the hosts (the face's ``close``)."""
        self._finalizer.detach()
        self._hosted.close()

    @property
    def n_processes(self) -> int:
        """Number of env-host processes."""
        return self._hosted.n_procs

    @property
    def pids(self) -> list[int]:
        """Pids of the live env-host processes."""
        return self._hosted.pids

    @property
    def placement(self) -> Placement:
        """Where the sub-envs step (the caller's share, the host processes) and why."""
        return self._hosted.placement

    def _where(self) -> str:
        """The placement, as ``repr`` shows it."""
        where = self.placement
        return (
            f"n_processes={self.n_processes}, caller_envs={where.caller_envs}, "
            f"placement={where.kind!r}"
        )


def _finalize(hosted: HostedEnvs) -> None:
    """Release ``hosted`` from a finalizer (an env garbage-collected without ``close()``): the
    hosts are killed, not asked, since a collection can run inside another portal call."""
    with contextlib.suppress(Exception):
        hosted.close(graceful=False)
