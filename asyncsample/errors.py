"""The sampler's own exceptions, all under :class:`AsyncSampleError` (bad arguments raise plain
``ValueError``/``TypeError``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "AgentRowsError",
    "AgentStepError",
    "AsyncSampleError",
    "ChatRequestError",
    "ChatTimeoutError",
    "CheckpointError",
    "LoopBlockedError",
    "ParallelEnvError",
    "PolicyMappingError",
    "SamplerBusyError",
    "SamplerClosedError",
    "StepTimeoutError",
    "WorkerCrashedError",
    "WorkerError",
]


class AsyncSampleError(Exception):
    """Base class of every error the sampler raises while sampling."""


class WorkerError(AsyncSampleError):
    """An env raised in ``reset`` or ``step``, or its host failed.

    Attributes:
        worker: index of the worker whose env failed.
        env: index of the env within that worker, or ``None`` when the whole host failed.
        remote_traceback: the traceback text from the process that raised, if any.
        retry: whether restarting the host may help (``False`` for the caller's own mistakes).
        factory: where the failing env came from (its gymnasium id, or its factory's name).
        charged: whether the failure counts against the env's ``max_restarts`` (``False`` for
            the other envs of a host killed for one env's blocked loop: they lose their
            episodes in progress and are rebuilt, but it was not their fault).
    """

    charged = True

    def __init__(
        self,
        message: str,
        *,
        worker: int,
        env: int | None = None,
        remote_traceback: str | None = None,
        retry: bool = True,
        factory: str | None = None,
    ) -> None:
        self.message = message
        self.worker = worker
        self.env = env
        self.remote_traceback = remote_traceback
        self.retry = retry
        self.factory = factory
        super().__init__(self._text())

    def _text(self) -> str:
        where = f"worker {self.worker}" + (f", env {self.env}" if self.env is not None else "")
        text = f"{where}: {self.message}" + made_by(self.factory)
        if self.remote_traceback:
            text += f"\n\nRemote traceback:\n{self.remote_traceback.rstrip()}"
        return text

    def name_factory(self, factory: str) -> None:
        """Name the failing env's factory in the message, once (the host may not know it)."""
        if self.factory is None and self.env is not None and "message" in self.__dict__:
            self.factory = factory
            self.args = (self._text(), *self.args[1:])

    def __reduce__(self):  # type: ignore[no-untyped-def]  # keeps the keyword-only fields
        return (_rebuild, (type(self), self.args, self.__dict__))


def made_by(factory: str | None) -> str:
    """The end of an error's first line that names where the env came from (or nothing)."""
    return f" (env made by {factory})" if factory else ""


def _rebuild(cls: type[Exception], args: tuple[object, ...], state: dict[str, object]) -> Exception:
    """An exception of ``cls`` unpickled with its ``args`` and attributes (keyword-only
    arguments, which the default pickling of exceptions would lose)."""
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class WorkerCrashedError(WorkerError):
    """An env-host process or actor died (killed, segfault, out of memory)."""


class StepTimeoutError(WorkerError, TimeoutError):
    """A step took longer than the sampler's ``step_timeout``."""


class AgentRowsError(AsyncSampleError):
    """Raised by an agent's ``get_actions`` that failed some rows and not the others.

    An agent that sends one request per env (an LLM behind HTTP) may lose one reply to a
    timeout or an error while the others arrive. Raising this instead of returning makes each
    failed row that env's fault alone: its episode in progress is dropped and the env rebuilt,
    as when the env raises (it spends that env's ``max_restarts``), while the other rows take
    ``actions`` and ``agent_infos`` and go on. Where envs are stepped in lockstep (blocking envs
    on ``process``, ``local``, ``ray``) the worker's env host is restarted, as for any env fault
    there, so its other episodes in progress are lost too.

    Args:
        actions: one action per row it was given, as ``get_actions`` returns them; the failed
            rows' entries are placeholders, never checked, recorded or stepped.
        agent_infos: a dict of per-row arrays (or ``None``), as ``get_actions`` returns them.
        failures: per failed row (its index in the observations given), the exception that
            failed it; at least one.

    Attributes:
        actions: see Args.
        agent_infos: see Args.
        failures: see Args.
    """

    def __init__(
        self,
        actions: Any,
        agent_infos: dict[str, Any] | None,
        failures: Mapping[int, BaseException],
    ) -> None:
        if not failures:
            raise ValueError("failures: AgentRowsError needs at least one failed row, got none")
        self.actions = actions
        self.agent_infos = agent_infos
        self.failures = dict(sorted(failures.items()))
        first, cause = next(iter(self.failures.items()))
        super().__init__(
            f"the agent failed {len(self.failures)} row(s) of its call ({sorted(self.failures)});"
            f" row {first}: {type(cause).__name__}: {cause}"
        )

    def check_rows(self, n: int, rows: str) -> None:
        """Raise ``ValueError`` unless every failed row is one of the ``n`` rows of the call
        (``rows`` describes them, for the message)."""
        bad = [j for j in self.failures if not 0 <= j < n]
        if bad:
            raise ValueError(
                f"AgentRowsError.failures: rows {bad} are not rows of the agent's call ({rows})"
            )

    def row_fault(self, row: int, *, worker: int, env: int | None) -> WorkerError:
        """The :class:`WorkerError` of failed row ``row`` as the fault of env ``env`` of worker
        ``worker`` (retried: the env is rebuilt); its ``__cause__`` is the row's exception."""
        cause = self.failures[row]
        fault = WorkerError(
            f"the agent failed this env's row: {type(cause).__name__}: {cause}",
            worker=worker,
            env=env,
        )
        fault.__cause__ = cause
        return fault

    def __reduce__(self):  # type: ignore[no-untyped-def]  # crosses processes whole
        return (type(self), (self.actions, self.agent_infos, self.failures))


class ChatRequestError(AsyncSampleError):
    """A chat-completions request of :class:`~asyncsample.llm.ChatAgent` failed.

    As the cause of a row's fault (:class:`AgentRowsError`): the server answered an error
    status after the retries, or a reply that is not a chat completion, or the connection
    failed. Raised by the call itself for a status that no retry or rebuild can fix (401, 403,
    404: a wrong key, URL or model).

    Attributes:
        status: the HTTP status of the last attempt (``None``: no reply).
        body: the start of the last reply's body, if any.
        attempts: how many times the request was sent.
    """

    def __init__(
        self, message: str, *, status: int | None = None, body: str = "", attempts: int = 1
    ) -> None:
        self.status = status
        self.body = body
        self.attempts = attempts
        super().__init__(message)

    def __reduce__(self):  # type: ignore[no-untyped-def]  # keeps the keyword-only fields
        return (_rebuild, (type(self), self.args, self.__dict__))


class ChatTimeoutError(ChatRequestError, TimeoutError):
    """A chat-completions request got no whole reply within the agent's ``timeout``."""


class LoopBlockedError(StepTimeoutError):
    """An env blocked the event loop it runs in (a synchronous call inside ``async def step``)
    for longer than ``step_timeout``; the message names the env, the worker and the line.

    Attributes:
        report: where the loop stood still (see ``asyncsample.backends._watchdog.BlockReport``).
    """

    report: object = None


class SamplerClosedError(AsyncSampleError, RuntimeError):
    """The sampler was closed; create a new one to sample again."""


class SamplerBusyError(AsyncSampleError, RuntimeError):
    """A call was made from the body of this sampler's own open ``stream()``, where it would
    wait forever: close the stream first, or call from a task the stream's body did not start."""


class CheckpointError(AsyncSampleError, ValueError):
    """A checkpoint cannot be taken now, or a :class:`~asyncsample.SamplerState` cannot be used:
    a file that is corrupt, truncated or of another format, or a state of another sampler's
    shape (the message names the path or the difference)."""


class ParallelEnvError(AsyncSampleError, TypeError):
    """A multi-agent env, or its factory, is not a PettingZoo ``ParallelEnv`` (nor its async
    twin) the multi-agent layer can use; the message names the argument, what was expected and
    what was given (:func:`asyncsample.multiagent.check_parallel_env`)."""


class PolicyMappingError(AsyncSampleError, ValueError):
    """A ``policy_mapping`` (agent id -> policy id) that does not fit the env: not a callable
    nor a mapping, an agent it leaves out, an unhashable policy id, or agents of one policy
    with different observation or action spaces."""


class AgentStepError(AsyncSampleError, ValueError):
    """A joint step of a multi-agent env that breaks the rules of agents as rows: an action for
    an agent that is not live, a live agent missing from a result dict, an agent that comes
    back after it was done in the same episode, an agent the env never declared.

    Attributes:
        env: the index of the env whose step it was.
        agent: the agent id concerned, or ``None`` when the step as a whole is wrong.
    """

    def __init__(self, message: str, *, env: int, agent: object = None) -> None:
        self.env = env
        self.agent = agent
        super().__init__(message)

    def __reduce__(self):  # type: ignore[no-untyped-def]  # keeps the keyword-only fields
        return (_rebuild, (type(self), self.args, self.__dict__))
