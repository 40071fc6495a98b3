"""The sampler's own exceptions, all under :class:`AsyncSampleError` (bad arguments raise plain
``ValueError``/``TypeError``)."""

from __future__ import annotations

__all__ = [
    "AsyncSampleError",
    "CheckpointError",
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
    """

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


def _rebuild(
    cls: type[WorkerError], args: tuple[object, ...], state: dict[str, object]
) -> WorkerError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class WorkerCrashedError(WorkerError):
    """An env-host process or actor died (killed, segfault, out of memory)."""


class StepTimeoutError(WorkerError, TimeoutError):
    """A step took longer than the sampler's ``step_timeout``."""


class SamplerClosedError(AsyncSampleError, RuntimeError):
    """The sampler was closed; create a new one to sample again."""


class SamplerBusyError(AsyncSampleError, RuntimeError):
    """A call was made from the body of this sampler's own open ``stream()``, where it would
    wait forever: close the stream first, or call from a task the stream's body did not start."""


class CheckpointError(AsyncSampleError, ValueError):
    """A checkpoint cannot be taken now, or a :class:`~asyncsample.SamplerState` cannot be used:
    a file that is corrupt, truncated or of another format, or a state of another sampler's
    shape (the message names the path or the difference)."""
