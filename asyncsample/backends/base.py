"""The interface between a worker and the host of its envs: the whole seam.

:class:`EnvHost` is what every host does; the other protocols are capabilities some have,
checked once when a sampler or face starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import gymnasium as gym
import numpy as np

from asyncsample.backends._pacing import CallWindow
from asyncsample.env_group import EnvFailure, StepBuffers, StepInfos
from asyncsample.env_update import EnvSource
from asyncsample.errors import WorkerError

__all__ = [
    "LOGGER",
    "ActingHost",
    "BareStepHost",
    "Backend",
    "DirectReader",
    "EnvHost",
    "GivenActionsHost",
    "HostSpec",
    "InlineHost",
    "LockstepHost",
    "ProcessPool",
    "RestartBudget",
    "RunHost",
    "SentStep",
    "StepRun",
    "agent_note",
    "failure_error",
    "reject_unknown_options",
]

#: Where backends report restarts, timeouts and dead hosts (warning level).
LOGGER = logging.getLogger("asyncsample")

_T = TypeVar("_T")


@dataclass(frozen=True)
class HostSpec:
    """What a backend needs to host the envs of one worker.

    Attributes:
        worker, n_envs: the worker's index and how many envs it steps together.
        observation_space, action_space: the env's spaces (for the step buffers).
        max_episode_length: the host truncates episodes at this length (``None``: never).
        chunk_steps: ``inference="host"``: the chunk buffers' capacity in worker steps (``0``:
            no chunks, the worker asks for actions itself).
        autoreset: the env group's autoreset mode (:data:`~asyncsample.env_group.AUTORESET_MODES`).
        final_in_reply: step replies carry the final observations (the gymnasium face).
        timed: metrics are on: the host keeps a clock of its steps (:mod:`asyncsample._clock`).
        counted: with ``timed``, the host also counts its env steps and episode ends in its
            clock (a vector face reads them; a sampler counts its own, from its episodes).
        lanes: the envs are async envs, each reset and stepped on its own in the host's event
            loop (:mod:`asyncsample.backends._lane_serve`).
        columns: leaves without fixed-size rows (``Text``, ``Sequence``) get ``object`` rows
            in the step buffers beside plain arrays (:mod:`asyncsample._leaves`), not one
            object per env for the whole value (the sampler records columns; the faces do not).
    """

    worker: int
    n_envs: int
    observation_space: gym.Space[Any]
    action_space: gym.Space[Any]
    max_episode_length: int | None
    chunk_steps: int = 0
    autoreset: str = "SameStep"
    final_in_reply: bool = False
    timed: bool = False
    counted: bool = False
    lanes: bool = False
    columns: bool = False


class EnvHost(Protocol):
    """The host of one worker's envs, as the worker sees it. After any error it raises
    (:class:`~asyncsample.WorkerError`, :class:`~asyncsample.WorkerCrashedError`,
    :class:`~asyncsample.StepTimeoutError`) it must be rebuilt with :meth:`restart`."""

    buffers: StepBuffers
    """Shared with the host: the worker writes ``actions`` and reads the rest after a step."""

    async def build(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        """Build the envs: env ``i`` from ``chains[i]``, first reset with ``seeds[i]``."""
        ...

    async def update(self, updates: Sequence[EnvSource | None], seeds: Sequence[int]) -> None:
        """Apply one env update per env (``None`` keeps it); a new env object gets ``seeds[i]``."""
        ...

    async def reset(
        self,
        mask: np.ndarray,
        seeds: Sequence[int | None] | None = None,
        options: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
    ) -> dict[int, dict[str, object]]:
        """Reset the envs where ``mask`` is true; their reset infos by env index.

        ``seeds`` (per env, ``None``: no seed) replace the pending seeds for this reset; ``options``
        (one dict, or one per env) go to ``env.reset``. Defaults: pending seeds, no options.
        """
        ...

    async def call(
        self,
        name: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        envs: Sequence[int] | None = None,
    ) -> list[Any]:
        """``getattr(env, name)`` of each env in ``envs`` (default: all), called with ``args`` and
        ``kwargs`` when callable; one result per env. A failure is a WorkerError naming the env
        (``retry`` false for an ``AttributeError``)."""
        ...

    async def set_attr(
        self, name: str, values: Sequence[Any], envs: Sequence[int] | None = None
    ) -> None:
        """Set attribute ``name`` of env ``envs[k]`` (default: all) to ``values[k]``."""
        ...

    async def step(self, mask: np.ndarray) -> StepInfos:
        """Step the envs where ``mask`` is true with ``buffers.actions``, autoresetting ends."""
        ...

    async def restart(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        """Recover from a failure: replace a dead or hung host, then rebuild the envs."""
        ...

    async def close(self) -> None:
        """Close the envs. Idempotent."""
        ...


@runtime_checkable
class GivenActionsHost(EnvHost, Protocol):
    """An env host that can hand the envs actions of another dtype than its action buffer's,
    as the caller gave them (the vector-env faces: ``AsyncVectorEnv`` keeps a ``float64``)."""

    def give_actions(self, actions: list[Any] | None) -> None:
        """The next step's actions, one per env, in place of ``buffers.actions`` (``None``:
        the buffers again); the step takes them."""
        ...


@runtime_checkable
class LockstepHost(EnvHost, Protocol):
    """An env host a synchronous caller may step without the event loop (the process host),
    while the loop is not running: the vector env's lockstep step."""

    def step_nowait(self) -> SentStep | None:
        """Send a step of every env at once, or ``None``: no live connection (use
        :meth:`EnvHost.step`). Read the reply with :meth:`direct_reader`."""
        ...

    def direct_reader(self) -> DirectReader | None:
        """The connection to read this host's replies from, or ``None`` (it is dead)."""
        ...


class InlineHost(GivenActionsHost, Protocol):
    """An env host whose envs live in the caller's process (``make_backend("local",
    caller=True)``): a synchronous caller steps them itself, in its own thread."""

    def step_now(self, mask: np.ndarray, everyone: bool | None = None) -> StepInfos:
        """:meth:`EnvHost.step`, synchronously (``everyone``: ``mask`` is all true)."""
        ...


class DirectReader(Protocol):
    """A host connection whose replies a synchronous caller may read without the event loop."""

    fd: int
    """The file descriptor to wait on (``select``) for replies."""

    def read_now(self) -> bool:
        """Read what arrived and resolve the calls it answers; ``False``: use the loop now
        (end of stream, an error, or writes still queued)."""
        ...


class SentStep(Protocol):
    """A step request sent by :meth:`LockstepHost.step_nowait`."""

    def done(self) -> bool:
        """Whether its outcome is known (the reply was read, or the host is dead)."""
        ...

    def result_now(self) -> StepInfos | None:
        """What :meth:`EnvHost.step` returns, if the reply is in and is not a failure; else
        ``None`` (await :meth:`wait`)."""
        ...

    async def wait(self) -> StepInfos:
        """What :meth:`EnvHost.step` returns or raises for this request (in the event loop)."""
        ...


class Backend(Protocol):
    """Starts and stops the hosts of all workers."""

    async def start(self, specs: Sequence[HostSpec]) -> list[EnvHost]:
        """Start one host per spec, in order."""
        ...

    async def aclose(self) -> None:
        """Stop every host and release every resource. Idempotent; a host call in flight or
        made afterwards raises :class:`~asyncsample.SamplerClosedError`."""
        ...

    def close_now(self) -> None:
        """Synchronous last resort (an unclosed sampler being collected): release everything
        without waiting for envs to close. Idempotent."""
        ...


@runtime_checkable
class ProcessPool(Backend, Protocol):
    """A backend whose hosts are processes of this machine with shared-memory step buffers."""

    joint: StepBuffers | None
    """Every host's step buffers in one allocation, in host order, then the guests' rows
    (``None``: not so)."""
    guests: list[HostSpec]
    """Hosts in the caller's process whose rows :attr:`joint` also holds (set before ``start``)."""
    guest_buffers: list[StepBuffers]
    """The guests' rows of :attr:`joint` once started (empty: they have none there)."""

    @property
    def pids(self) -> list[int]:
        """Pids of the live host processes."""
        ...


@runtime_checkable
class GuestBackend(Backend, Protocol):
    """A backend of hosts in the caller's process that step in buffers they are given: the
    rows a :class:`ProcessPool` keeps for its guests, so one copy reads every host's rows."""

    rows: list[StepBuffers]
    """The hosts' buffers, set before ``start`` (empty: buffers of their own)."""


@dataclass(slots=True)
class RestartBudget:
    """How often a host may be rebuilt after failures: per call for the sampler, per host for
    the vector-env faces (``limit``: ``max_restarts``; ``used``: restarts so far)."""

    limit: int
    used: int = 0

    async def run(
        self,
        attempt: Callable[[WorkerError | None], Awaitable[_T]],
        retryable: Callable[[WorkerError], bool],
        failed: Callable[[WorkerError], None] | None = None,
    ) -> _T:
        """``attempt(None)``, then ``attempt(error)`` (it rebuilds the host) after each
        ``retryable`` :class:`~asyncsample.WorkerError` within budget; ``failed`` sees each first.
        """
        failure: WorkerError | None = None
        while True:
            try:
                return await attempt(failure)
            except WorkerError as exc:
                if failed is not None:
                    failed(exc)
                if not retryable(exc) or self.used >= self.limit:
                    raise
                self.used += 1
                failure = exc


def agent_note(worker: int) -> str:
    """The note an agent's exception raised inside a host carries (see ``failure_error``)."""
    return f"the agent of worker {worker} raised in its env host"


def failure_error(worker: int, failure: EnvFailure) -> BaseException:
    """The exception a worker raises for an env failure reported by its host.

    The caller's own mistakes (an observation outside the space, an agent that raised) are not
    worth a restart: ``retry=False``. The rebuilt original exception is the ``__cause__``.
    """
    error = failure.error
    what = f"{type(error).__name__}: {error}"
    if failure.env is None and agent_note(worker) in getattr(error, "__notes__", ()):
        what = f"{agent_note(worker)}: {what}"  # the agent's own exception, rebuilt here
    err = WorkerError(
        what,
        worker=worker,
        env=failure.env,
        remote_traceback=failure.traceback or None,
        retry=failure.retry,
    )
    err.__cause__ = failure.error
    return err


def reject_unknown_options(
    backend: str, unknown: Mapping[str, object], valid: Sequence[str]
) -> None:
    """Raise ``TypeError`` naming the unknown options of ``backend`` and the valid ones."""
    if unknown:
        raise TypeError(
            f"backend {backend!r} got unknown option(s) {', '.join(map(repr, sorted(unknown)))}; "
            f"valid options: {', '.join(valid)}"
        )


# -- per-env stepping (the lanes' capability) -------------------------------------------------


class DeadlinePassed(Exception):
    """The episode's deadline (``episode_timeout``) passed during a call; it was cancelled.

    Attributes:
        running: the call could not be stopped (a blocking env's, in a thread) and still runs:
            its env is tied up until it returns, so the lane abandons it and rebuilds the env.
    """

    def __init__(self, running: bool = False) -> None:
        super().__init__()
        self.running = running


@runtime_checkable
class PerEnvHost(Protocol):
    """A host that resets and steps each env on its own (``asyncio``, ``thread``): the engine
    runs one lane per env. ``in_flight``: steps a stream's round left running, by env."""

    buffers: StepBuffers
    in_flight: dict[int, Any]

    async def reset_one(
        self, i: int, seed: Any = ..., options: Any = None, deadline: float | None = None
    ) -> dict[str, Any]:
        """Reset env ``i`` (its pending seed by default); its reset info. Raises
        :class:`DeadlinePassed` when the loop time ``deadline`` comes first."""
        ...

    async def step_one(
        self, i: int, action: Any, deadline: float | None = None, timed: int = 0
    ) -> tuple[float, bool, bool, dict[str, Any]]:
        """Step env ``i``: ``(reward, terminated, truncated, info)``, the time limit applied;
        ``timed``: with metrics on, time this step, standing for that many (see
        :meth:`timed_envs`)."""
        ...

    def timed_envs(self) -> Collection[int]:
        """With metrics on, the envs whose every step the lanes of the next call time (a host
        in this process: as many as its timing's gap asks, another set each call); empty where
        the host samples its own steps (in other processes) or metrics are off."""
        ...

    def watch_lanes(self, lanes: Sequence[asyncio.Future[Any]]) -> None:
        """The lane tasks of a call: with metrics on, a host in this process counts its env
        calls running from where they are suspended (no mark per step); else nothing."""
        ...

    async def rebuild_one(self, i: int, chain: Sequence[EnvSource], seed: int) -> None:
        """Build env ``i`` again (after its fault), closing the old one in the background."""
        ...

    async def drop_in_flight(self, envs: Sequence[int] | None = None) -> list[int]:
        """Cancel the carried steps of ``envs`` (default: all); which envs had one."""
        ...


@runtime_checkable
class BareStepHost(PerEnvHost, Protocol):
    """A :class:`PerEnvHost` in other processes (async envs in the env hosts) whose steps the
    lanes await as bare futures, no coroutine per step: a lane that gives up on one says so."""

    def step_soon(
        self, i: int, action: Any, deadline: float | None = None
    ) -> asyncio.Future[tuple[float, bool, bool, dict[str, Any] | None]]:
        """:meth:`PerEnvHost.step_one` as a future, settled by the host's reply (an empty
        info: ``None``)."""
        ...

    def abandon(self, i: int) -> None:
        """The awaiter of env ``i``'s request was cancelled: the host cancels the request."""
        ...


class DirectStepHost(PerEnvHost, Protocol):
    """A :class:`PerEnvHost` in the caller's process whose envs' steps a lane may await itself,
    a coroutine less per step than :meth:`PerEnvHost.step_one` (in :attr:`window`, if any)."""

    window: CallWindow | None

    def direct_steps(self, windowed: bool = False) -> list[Any] | None:
        """The envs, whose ``step`` a lane may await itself now (``windowed``: taking its place
        in :attr:`window` itself); ``None``: through ``step_one`` (a timeout or metrics wrap
        each step, or a window the lane does not take its place in)."""
        ...

    def step_error(self, i: int, exc: BaseException) -> WorkerError:
        """The error for env ``i``'s ``exc`` raised by its step (raised again if not the env's
        own)."""
        ...

    def finish_step(self, i: int, result: Any) -> tuple[float, bool, bool, dict[str, Any]]:
        """Env ``i``'s step returned ``result``: ``step_one``'s outcome."""
        ...


@dataclass(slots=True)
class StepRun:
    """Up to ``k`` steps of one env taken in its host with its agent copy's actions, answered at
    once (:meth:`ActingHost.run_soon`): the caller's cost is per run, not per step.

    Attributes:
        obs, actions: per step, stacked: the observation each action was chosen for, the action
            (in the host, blocks of the run's length, or lists where rows are not plain
            arrays; a reply frame stacks the blocks of all its runs once).
        rewards: per step.
        infos, agent_infos: ``(step, info)`` for the steps whose env or agent info is not empty.
        terminated, truncated: the last step's flags (a run stops at its episode's end).
        version: the agent version its steps ran under (the host's stamp).
    """

    obs: Any
    actions: Any
    rewards: list[float]
    infos: list[tuple[int, dict[str, Any]]]
    agent_infos: list[tuple[int, dict[str, Any]]]
    terminated: bool
    truncated: bool
    version: int = -1


@runtime_checkable
class ActingHost(BareStepHost, Protocol):
    """A :class:`BareStepHost` whose envs' actions its own agent copies pick (async envs in the
    env hosts with ``inference="host"``): a request per step (:meth:`act_soon`), or per run of
    steps (:meth:`run_soon`), the actions in the reply."""

    def act_soon(
        self, i: int, version: int, deadline: float | None = None
    ) -> asyncio.Future[tuple[float, bool, bool, dict[str, Any], Any, dict[str, Any], int]]:
        """Step env ``i`` with its agent copy's action for its observation, asked under agent
        ``version``: ``(reward, terminated, truncated, info, action, agent_infos, acted)``,
        ``acted`` the version that picked the action, or -1 where it is ``version`` (an update
        that reached the host first acts for a step asked before it)."""
        ...

    def run_soon(
        self, i: int, steps: int, merged: bool, deadline: float | None = None
    ) -> asyncio.Future[StepRun]:
        """Let env ``i`` take up to ``steps`` steps with its agent copy's actions, stopping at
        its episode's end or where the copy changes: a future of their :class:`StepRun`,
        stamped by the host with the version its steps ran under. ``merged``: the copy's calls
        merge the envs' rows (reproducible batches); else the built-in random agent may draw
        each row on the spot."""
        ...

    async def sync_agent(self) -> int:
        """Send the agent and parameters the host lacks; the agent version in force there."""
        ...


@runtime_checkable
class RunHost(ActingHost, Protocol):
    """An :class:`ActingHost` whose resets are bare futures too (the runs' stepper asks each env
    for its next request from a callback, no coroutine per env)."""

    def reset_soon(self, i: int) -> asyncio.Future[dict[str, Any]]:
        """Reset env ``i`` with its pending seed: a future of its reset info."""
        ...
