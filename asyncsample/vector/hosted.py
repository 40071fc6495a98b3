"""Sub-envs on the sampler's env hosts, as both vector-env faces use them.

:class:`HostedEnvs` is not an engine of its own: it places ``num_envs`` sub-envs on the hosts of a
backend (host ``h`` is one slot of the backend's pool, a "worker" in the sampler's words) and
drives them through the public :class:`~asyncsample.backends.EnvHost` protocol, as the sampler's
workers do. The hosts run the sampler's :class:`~asyncsample.env_group.EnvGroup` in the face's
autoreset mode (:attr:`HostSpec.autoreset <asyncsample.backends.HostSpec>`), so nothing here fakes
a reset: in ``"NextStep"`` mode the host resets an ended sub-env at its next step, in
``"SameStep"`` mode the last observation comes back in the host's reply (``object_rows``) or in
the buffers' ``final_obs`` rows.

What is the faces' own: the lockstep round over all hosts (one ``step`` request per host, all in
flight at once), each host's restart budget over the env's life (``max_restarts``), and the
translation of a host's :class:`~asyncsample.WorkerError` into one naming the sub-env
(:class:`SubEnvError`). Everything runs on the face's
:class:`~asyncsample.vector.portal.BlockingPortal`, except the common lockstep round, which
:mod:`asyncsample.vector._lockstep` runs from the caller's thread while the loop is idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from functools import partial
from typing import Any, NoReturn, TypeVar, cast

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from asyncsample._tree import Tree, tree_map
from asyncsample.backends import (
    Backend,
    EnvHost,
    GivenActionsHost,
    HostSpec,
    InlineHost,
    LockstepHost,
    ProcessPool,
    RestartBudget,
    backend_options,
    make_backend,
)
from asyncsample.env_group import StepInfos
from asyncsample.env_update import describe_chain, make_env
from asyncsample.errors import WorkerError
from asyncsample.metrics import make_face_metrics
from asyncsample.vector._lockstep import LockstepRounds, PendingRound, StepResult
from asyncsample.vector._sources import check_bufferable, env_sources
from asyncsample.vector.errors import (
    ClosedError,
    SubEnvAttributeError,
    SubEnvError,
    crash_like,
    reraise,
    sub_env_error_class,
    with_text,
)
from asyncsample.vector.placement import Placement, host_slices, place
from asyncsample.vector.portal import BlockingPortal

__all__ = [
    "ClosedError",
    "HostedEnvs",
    "HostedFace",
    "PendingRound",
    "StepResult",
    "SubEnvAttributeError",
    "SubEnvError",
    "env_sources",
    "finalize",
]

_T = TypeVar("_T")


class HostedEnvs(LockstepRounds):
    """``num_envs`` sub-envs on the hosts of a backend, driven in lockstep (see the module doc).

    Args:
        sources: one env source per sub-env (see :func:`env_sources`), or already wrapped by
            the face.
        n_processes: env-host processes (default: the CPU count, at most ``num_envs``).
        step_timeout: seconds a host may spend on one request before it is killed.
        max_restarts: how often each host may be rebuilt over the env's life.
        autoreset: the hosts' autoreset mode (see :data:`~asyncsample.env_group.AUTORESET_MODES`).
        group_size: sub-envs per host (default: ``num_envs / n_processes``, rounded); EnvPool-style
            stepping asks for smaller hosts, several to a process.
        backend: the backend's name.
        host_threads: intra-op threads of the numeric libraries in each env-host process
            (``None``: the libraries' defaults).
        object_rows: the gymnasium face's transport: observations and actions of spaces
            without fixed-size rows (``Text``, ``OneOf``, ``Sequence``, ``Graph``, custom)
            travel pickled in the hosts' requests and replies and are batched as gymnasium
            batches them, and final observations come home as the envs' own objects. Without
            it such spaces are refused.
        observation_space: the single observation space of the buffers (default: the first
            sub-env's), for gymnasium's ``observation_mode``.
        caller_envs: sub-envs the caller steps itself, in its own process (the last ones);
            with ``n_processes`` and ``caller_envs`` both ``None`` the placement is measured
            (see :mod:`asyncsample.vector.placement`); ``n_processes=0``: all of them.
        copy: ``False``: see :attr:`copy` (gymnasium's ``copy=False``).
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
        self.object_rows = object_rows
        self.autoreset = autoreset
        self.max_restarts = max_restarts
        self.budgets: list[RestartBudget] = []
        """Each host's restart budget over the env's life (``max_restarts``)."""
        self.closed = False
        self._chains = [[s] for s in sources]
        n_caller = self.placement.caller_envs
        #: The hosts ``[0, _remote_hosts)`` are processes; the rest step in the caller's process.
        self.slices, self._remote_hosts = host_slices(self.num_envs, self.placement, group_size)
        remote_hosts, caller_hosts = self._remote_hosts, len(self.slices) - self._remote_hosts
        self.n_procs = min(self.placement.n_processes, remote_hosts)
        self.host_of = np.repeat(np.arange(len(self.slices)), [b - a for a, b in self.slices])
        # Every sub-env of a host (read-only): the step mask of the common lockstep step.
        self._whole = [np.ones(b - a, dtype=np.bool_) for a, b in self.slices]
        for whole in self._whole:
            whole.flags.writeable = False  # shared by every round: never written
        self.portal = BlockingPortal()
        # lockstep(): the poller of the hosts' connections, and their file descriptors.
        self._poller = select.poll()
        self._polled: tuple[int, ...] = ()
        # The round lockstep_send sent and no lockstep_wait finished (see _drop_round).
        self._round: PendingRound | None = None
        self.backend: Backend | None = None
        if remote_hosts:
            options: dict[str, Any] = {"n_processes": self.n_procs, "host_threads": host_threads}
            valid = backend_options(backend)
            if "step_timeout" in valid:
                options["step_timeout"] = step_timeout
            if "pin_cpus" in valid:
                # Lockstep rounds wake every host at once: pinned, two hosts never share a CPU
                # while another idles (see asyncsample.backends._procs.host_cpus). Beside the
                # caller's own share, the scheduler keeps its freedom (the caller needs a CPU).
                options["pin_cpus"] = None if not n_caller else False
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
        self.copy = copy
        """``False``: :meth:`read_obs` of every sub-env returns the hosts' shared observation
        buffer itself where it is one array (gymnasium's ``copy=False``: the next step
        overwrites it); else (and ``True``) one copy."""
        self.metrics = make_face_metrics(metrics, backend, self)
        """The face's Prometheus metrics (:mod:`asyncsample.metrics`), ``None`` when off."""
        try:
            self.portal.call(self._start)
        except BaseException:
            self.close()
            raise

    # -- lifecycle --------------------------------------------------------------------------

    async def _start(self) -> None:
        specs = [
            HostSpec(
                h,
                b - a,
                self.single_observation_space,
                self.single_action_space,
                None,
                autoreset=self.autoreset,
                final_in_reply=self.object_rows,
                timed=self.metrics is not None,
            )
            for h, (a, b) in enumerate(self.slices)
        ]
        r = self._remote_hosts
        if self.backend is not None:
            self.hosts = list(await self.backend.start(specs[:r]))
        if self._caller_backend is not None:
            inline = await self._caller_backend.start(specs[r:])
            self._inline = [cast(InlineHost, host) for host in inline]
            self.hosts += inline
        # Capabilities, checked once: the loop-free lockstep needs it of every host process.
        direct = [host for host in self.hosts[:r] if isinstance(host, LockstepHost)]
        self._direct = direct if len(direct) == r else []
        givers = [host for host in self.hosts if isinstance(host, GivenActionsHost)]
        self._givers = givers if len(givers) == len(self.hosts) else None
        self.budgets = [RestartBudget(self.max_restarts) for _ in self.hosts]
        await asyncio.gather(*(self._build(h) for h in range(len(self.hosts))))

    def _host_chains(self, h: int) -> tuple[list[list[Any]], list[Any]]:
        a, b = self.slices[h]
        return self._chains[a:b], [None] * (b - a)

    async def _build(self, h: int) -> None:
        chains, seeds = self._host_chains(h)
        try:
            await self.hosts[h].build(chains, seeds)
        except WorkerError as exc:
            reraise(self.translate(h, exc), exc)

    def _count_fault(self, h: int, exc: WorkerError) -> None:
        if self.metrics is not None:
            self.metrics.fault(h, exc)

    async def _restart(self, h: int) -> None:
        chains, seeds = self._host_chains(h)
        await self.hosts[h].restart(chains, seeds)
        self.broken.discard(h)

    @property
    def pids(self) -> list[int]:
        """Pids of the live env-host processes (empty for a backend without processes)."""
        return [] if self._pool is None else self._pool.pids

    def close(self) -> None:
        """Stop every host (idempotent); nothing is left behind."""
        if self.closed:
            return
        if self.metrics is not None:  # the hosts' last figures, before their memory goes
            self.metrics.close()
        self.closed = True
        backends = [b for b in (self.backend, self._caller_backend) if b is not None]
        try:
            if not self.portal.loop.is_closed() and not self.portal.loop.is_running():
                for backend in backends:
                    self.portal.call(backend.aclose)
        finally:
            for backend in backends:
                with contextlib.suppress(Exception):
                    backend.close_now()  # whatever the graceful path could not do
            self._drop_round()
            self.portal.close()

    def close_now(self) -> None:
        """Kill every host at once and release everything, without the event loop."""
        if self.closed:
            return
        self.closed = True
        try:
            for backend in filter(None, (self.backend, self._caller_backend)):
                with contextlib.suppress(Exception):
                    backend.close_now()
        finally:
            self._drop_round()
            self.portal.close_now()

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

    async def _recover(self, h: int, exc: BaseException) -> dict[int, dict[str, Any]]:
        """Restart a host that crashed in a step, within budget; its new episodes' reset infos."""
        if not isinstance(exc, WorkerError):
            raise exc

        async def attempt(failure: WorkerError | None) -> dict[int, dict[str, Any]]:
            if failure is None:
                raise exc  # the step's failure
            await self._restart(h)
            return await self.hosts[h].reset(np.ones_like(self._whole[h]))

        return await self._with_restarts(h, attempt)

    async def _with_restarts(
        self, h: int, attempt: Callable[[WorkerError | None], Awaitable[_T]]
    ) -> _T:
        """``attempt`` on host ``h`` with its restart budget (a crash is retried, restarted
        first); a failure it gives up on leaves the host broken and is raised translated."""
        try:
            return await self.budgets[h].run(attempt, crash_like, partial(self._count_fault, h))
        except WorkerError as exc:
            self.broken.add(h)
            reraise(self.translate(h, exc), exc)

    # -- observations and actions -----------------------------------------------------------

    def read_obs(self, hosts: Sequence[int] | None = None) -> Tree:
        """A fresh batch of the current observations of the sub-envs of ``hosts`` (all), made
        in one copy; with :attr:`copy` false and every host, the shared buffer itself where the
        backend keeps all hosts' rows in one array (``process``)."""
        joint = None if self._pool is None or self.copy or hosts is not None else self._pool.joint
        if joint is not None:
            return joint.obs
        parts = (
            [h.buffers.obs for h in self.hosts]
            if hosts is None
            else [self.hosts[h].buffers.obs for h in hosts]
        )
        if type(parts[0]) is list:
            # Observations without fixed-size rows (unpickled from the replies: nothing else
            # holds them), batched as gymnasium batches them.
            rows = [o for part in parts for o in part]
            space = self.single_observation_space
            out: Any = create_empty_array(space, len(rows), fn=np.zeros)
            return concatenate(space, rows, out)
        if type(parts[0]) is np.ndarray:
            return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
        if len(parts) == 1:
            return tree_map(np.copy, parts[0])
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
        """Sub-env ``i``'s last observation of the episode that ended in the round ``res``: the
        env's own object when its host sent it, else its row of the ``final_obs`` buffer."""
        if i in res.final_obs:
            return res.final_obs[i]
        return self.obs_row(i, final=True)

    def write_actions(self, actions: Any, hosts: Sequence[int] | None = None) -> None:
        """Write a batch of ``num_envs`` actions into the hosts' buffers (of ``hosts``: all)."""
        n = self.num_envs
        targets = range(len(self.hosts)) if hosts is None else hosts
        first = self.hosts[0].buffers.actions
        if isinstance(first, list):
            self._write_object_actions(actions, targets)
            return
        if type(actions) is np.ndarray and isinstance(first, np.ndarray):
            # The common case (Box, Discrete, Multi* action spaces): one slice copy per host.
            if actions.ndim == 0:
                raise TypeError(self._not_a_batch(f"a single value {actions!r}", axis=False))
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

        if not isinstance(actions, (dict, tuple)) and np.ndim(actions) == 0:
            raise TypeError(self._not_a_batch(f"a single value {actions!r}", axis=False))
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
        """The message for actions that are not a batch of ``num_envs`` actions."""
        n = self.num_envs
        lead = f" (leading axis {n})" if axis else ""
        return (
            f"actions must be a batch of num_envs={n} actions{lead} for the action space "
            f"{self.single_action_space}, got {got}"
        )

    def _misfit(self, why: str) -> ValueError:
        """The error for actions that do not fit the batched action space, and why."""
        batched = batch_space(self.single_action_space, self.num_envs)
        return ValueError(f"actions do not fit the batched action space {batched}: {why}")

    def _write_object_actions(self, actions: Any, targets: Iterable[int]) -> None:
        """Actions of a space without fixed-size rows: split with gymnasium's ``iterate`` over
        the batched space, one object per sub-env, handed to the hosts as they are."""
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
        """Float actions of another float dtype than the action space's go to the envs as the
        caller gave them (``AsyncVectorEnv`` hands each sub-env its row of the caller's array:
        a ``float64`` stays a ``float64``, a value beyond ``float32`` stays finite), pickled
        with the step request instead of cast into the buffers. ``False``: not such actions."""
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
        """Refuse actions the buffers' dtype would change: floats for an integer space (a cast
        would hide a policy bug that the env itself would refuse) and finite floats that
        overflow a narrower float type."""
        space = self.single_action_space
        if not np.can_cast(actions.dtype, dtype, casting="same_kind"):
            raise ValueError(
                f"actions of dtype {actions.dtype} do not fit the action space {space} "
                f"(dtype {dtype}): a cast would change them silently, got {actions!r}"
            )
        if (
            actions.dtype.kind == "f"
            and dtype.kind == "f"
            and dtype.itemsize < actions.dtype.itemsize
        ):
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
        """Step the sub-envs in ``mask`` (default: all) of ``hosts`` (default: all).

        One ``step`` request per host, all in flight together. A host that died or timed out is
        restarted within budget: its sub-envs come back in ``restarted``, with the new episodes'
        first observations in the buffers. With ``hosts``, the result's ``obs`` is ``None``
        (other hosts may be writing theirs): read the rows with :meth:`read_obs`.
        """
        targets = range(len(self.hosts)) if hosts is None else hosts
        for h in targets:
            if h in self.broken:
                a, b = self.slices[h]
                raise RuntimeError(
                    f"sub-envs {a}..{b - 1} (env host {h}) failed earlier and were not "
                    "rebuilt: call reset() before stepping again"
                )
        stepped: list[tuple[int, np.ndarray]] = []
        for h in targets:
            if mask is None:
                stepped.append((h, self._whole[h]))
            else:
                a, b = self.slices[h]
                local = mask[a:b]
                if local.any():
                    stepped.append((h, local.copy()))
        if not stepped:
            return await self._merge([], [], whole=hosts is None)
        # The other hosts' requests go out as tasks; the first host's is awaited right here
        # (no task), and the tasks one after the other: cheaper than gather, which adds a
        # task per host and a callback per answer to the loop's work of every step.
        loop = asyncio.get_running_loop()
        hosts_ = self.hosts
        others = [loop.create_task(hosts_[h].step(local)) for h, local in stepped[1:]]
        outcomes: list[StepInfos | BaseException] = []
        try:
            h, local = stepped[0]
            try:
                outcomes.append(await hosts_[h].step(local))
            except Exception as exc:
                outcomes.append(exc)
            for task in others:
                try:
                    outcomes.append(await task)
                except Exception as exc:
                    outcomes.append(exc)
        finally:
            for task in others:
                task.cancel()  # only those still running: this step was cancelled
        if mask is None and hosts is None:
            quiet = self._quiet_result(outcomes)
            if quiet is not None:
                return quiet
        return await self._merge(stepped, outcomes, whole=hosts is None)

    def _quiet_result(self, outcomes: Sequence[StepInfos | BaseException]) -> StepResult | None:
        """The result of a lockstep step of every sub-env with no info, no reset and no failure
        anywhere (the common step), straight from the buffers; ``None`` for any other."""
        for o in outcomes:
            if type(o) is not StepInfos or o.env_infos is not None or o.reset_infos or o.final_obs:
                return None
        bufs = [host.buffers for host in self.hosts]
        if len(bufs) == 1:
            b = bufs[0]
            return StepResult(
                self.read_obs(), b.rewards.copy(), b.terminated.copy(), b.truncated.copy(),
                None, {}, {},
            )  # fmt: skip
        return StepResult(
            self.read_obs(),
            np.concatenate([b.rewards for b in bufs]),
            np.concatenate([b.terminated for b in bufs]),
            np.concatenate([b.truncated for b in bufs]),
            None,
            {},
            {},
        )

    async def _merge(
        self,
        stepped: list[tuple[int, np.ndarray]],
        outcomes: Sequence[StepInfos | BaseException],
        whole: bool,
    ) -> StepResult:
        """The hosts' answers (restarting crashed hosts) as one result, in sub-env order."""
        fresh: dict[int, dict[int, dict[str, Any]]] = {}
        failure: BaseException | None = None
        for (h, _), outcome in zip(stepped, outcomes):
            if isinstance(outcome, BaseException):
                try:
                    fresh[h] = await self._recover(h, outcome)
                except BaseException as exc:
                    failure = failure or exc
        if failure is not None:
            raise failure
        return self._combine(stepped, outcomes, whole, fresh)

    def _combine(
        self,
        stepped: list[tuple[int, np.ndarray]],
        outcomes: Sequence[StepInfos | BaseException],
        whole: bool,
        fresh: dict[int, dict[int, dict[str, Any]]] | None = None,
    ) -> StepResult:
        """The hosts' answers as one result, in sub-env order; a failed host's outcome is its
        restart, whose new episodes' reset infos are ``fresh[h]``."""
        n = self.num_envs
        res = StepResult(
            None,
            np.zeros(n, dtype=np.float64),
            np.zeros(n, dtype=np.bool_),
            np.zeros(n, dtype=np.bool_),
            None,
            {},
            {},
        )
        for (h, local), outcome in zip(stepped, outcomes):
            a, b = self.slices[h]
            if isinstance(outcome, BaseException):
                reason = str(outcome.args[0] if outcome.args else outcome)
                res.truncated[a:b] = True
                for k in range(b - a):
                    res.restarted[a + k] = reason
                infos = (fresh or {}).get(h, {})
                res.reset_infos.update({a + k: info for k, info in infos.items()})
                continue
            buf = self.hosts[h].buffers
            res.rewards[a:b][local] = buf.rewards[local]
            res.terminated[a:b][local] = buf.terminated[local]
            res.truncated[a:b][local] = buf.truncated[local]
            if outcome.env_infos is not None:
                if res.env_infos is None:
                    res.env_infos = [{} for _ in range(n)]
                for k, info in enumerate(outcome.env_infos):
                    if info and local[k]:
                        res.env_infos[a + k] = info
            res.reset_infos.update({a + k: info for k, info in outcome.reset_infos.items()})
            if outcome.final_obs:
                res.final_obs.update({a + k: o for k, o in outcome.final_obs.items()})
        if whole:
            res.obs = self.read_obs()
        return res

    async def reset(
        self, mask: np.ndarray, seeds: Sequence[int | None], options: dict[str, Any] | None
    ) -> dict[int, dict[str, Any]]:
        """Reset the sub-envs in ``mask`` with their seeds and ``options``; their reset infos.

        A host that failed earlier is rebuilt first (all its sub-envs are reset then); one that
        crashes during the reset is rebuilt within budget and tried again.
        """

        async def one(h: int) -> dict[int, dict[str, Any]]:
            a, b = self.slices[h]
            local = mask[a:b].copy()
            if h in self.broken:
                await self._restart(h)
                local[:] = True
            if not local.any():
                return {}
            host_seeds = list(seeds[a:b])

            async def attempt(failure: WorkerError | None) -> dict[int, dict[str, Any]]:
                if failure is not None:
                    await self._restart(h)
                    local[:] = True
                return await self.hosts[h].reset(local, seeds=host_seeds, options=options)

            infos = await self._with_restarts(h, attempt)
            return {a + k: info for k, info in infos.items()}

        parts = await _all(one(h) for h in range(len(self.slices)))
        return {i: info for part in parts for i, info in part.items()}

    # -- attributes -------------------------------------------------------------------------

    def _by_host(self, indices: Sequence[int]) -> dict[int, list[int]]:
        """The positions in ``indices`` of the sub-envs of each host."""
        groups: dict[int, list[int]] = {}
        for pos, i in enumerate(indices):
            groups.setdefault(int(self.host_of[i]), []).append(pos)
        return groups

    async def call(
        self, name: str, args: Sequence[Any], kwargs: dict[str, Any], indices: Sequence[int]
    ) -> list[Any]:
        """``call`` on the sub-envs ``indices`` (gymnasium's semantics); one result per index."""
        groups = self._by_host(indices)

        async def one(h: int, positions: list[int]) -> list[Any]:
            a = self.slices[h][0]
            envs = [indices[p] - a for p in positions]
            try:
                return await self.hosts[h].call(name, args, kwargs, envs=envs)
            except Exception as exc:
                self._fail(h, exc)

        hosts = list(groups)
        results = await _all(one(h, groups[h]) for h in hosts)
        out: list[Any] = [None] * len(indices)
        for h, values in zip(hosts, results):
            for p, value in zip(groups[h], values):
                out[p] = value
        return out

    async def set_attr(self, name: str, values: Sequence[Any], indices: Sequence[int]) -> None:
        """Set ``name`` to ``values[k]`` on sub-env ``indices[k]`` (through its wrappers)."""
        groups = self._by_host(indices)

        async def one(h: int, positions: list[int]) -> None:
            a = self.slices[h][0]
            envs = [indices[p] - a for p in positions]
            try:
                await self.hosts[h].set_attr(name, [values[p] for p in positions], envs=envs)
            except Exception as exc:
                self._fail(h, exc)

        await _all(one(h, ps) for h, ps in groups.items())


async def _all(coros: Iterable[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Await every coroutine to its end (none is left running); the first failure is raised."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


class HostedFace:
    """What both faces show of their hosts (a mixin: the face sets ``_hosted``)."""

    _hosted: HostedEnvs

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


def finalize(hosted: HostedEnvs) -> None:
    """Release ``hosted`` from a finalizer (an env garbage-collected without ``close()``).

    Synchronous and without the event loop: a collection can run anywhere, also inside another
    vector env's portal call, so the hosts are killed (the backend's ``close_now``), not asked.
    """
    with contextlib.suppress(Exception):
        hosted.close_now()
