"""The errors of the vector-env faces, and how a host's error becomes one that names sub-envs."""

from __future__ import annotations

from typing import Any, NoReturn

from gymnasium.error import ClosedEnvironmentError

from asyncsample.errors import (
    AsyncSampleError,
    StepTimeoutError,
    WorkerCrashedError,
    WorkerError,
    made_by,
)

__all__ = [
    "ClosedError",
    "SubEnvAttributeError",
    "SubEnvError",
    "crash_like",
    "reraise",
    "sub_env_error_class",
    "with_text",
]


class SubEnvError(WorkerError):
    """A sub-env of a :class:`~asyncsample.VectorEnv` (or of the SB3 face) raised.

    Attributes:
        sub_env: index of the sub-env in the vector env.
        worker: index of the env host that held it; ``env``: the same as ``sub_env``.
        remote_traceback: the traceback text from the env-host process.
        factory: where the sub-env came from (its gymnasium id, or its factory's module and
            qualified name).
    """

    def __init__(
        self,
        message: str,
        *,
        sub_env: int,
        host: int,
        remote_traceback: str | None = None,
        factory: str | None = None,
    ) -> None:
        text = f"sub-env {sub_env} (env host {host}): {message}" + made_by(factory)
        if remote_traceback:
            text += f"\n\nRemote traceback:\n{remote_traceback.rstrip()}"
        AsyncSampleError.__init__(self, text)
        self.sub_env = sub_env
        self.worker = host
        self.env = sub_env
        self.remote_traceback = remote_traceback
        self.retry = True
        self.factory = factory


class SubEnvAttributeError(SubEnvError, AttributeError):
    """A sub-env has no such attribute (also an ``AttributeError``, as SB3's ``has_attr`` and
    gymnasium expect)."""


_ERROR_CLASSES: dict[type[BaseException], type[SubEnvError]] = {}


def sub_env_error_class(cause: type[BaseException]) -> type[SubEnvError]:
    """:class:`SubEnvError` that is also a ``cause`` (``except ValueError`` still catches a
    sub-env's ``ValueError``, as with gymnasium's vector envs, which re-raise the env's own
    exception); plain :class:`SubEnvError` where the two classes cannot be combined."""
    kind = _ERROR_CLASSES.get(cause)
    if kind is None:
        kind = _ERROR_CLASSES[cause] = _combined_error_class(cause)
    return kind


def _combined_error_class(cause: type[BaseException]) -> type[SubEnvError]:
    if issubclass(cause, AttributeError):
        return SubEnvAttributeError
    if not issubclass(cause, Exception) or issubclass(cause, AsyncSampleError):
        return SubEnvError
    try:
        combined = type(f"SubEnvError[{cause.__name__}]", (SubEnvError, cause), {})
        combined.__module__ = __name__
        # The combined class is built here, not importable: it pickles as a plain SubEnvError.
        combined.__reduce__ = _reduce_sub_env_error  # type: ignore[method-assign,assignment]
        probe = combined("probe", sub_env=0, host=0)
        if "probe" not in str(probe):  # a cause with a __str__ of its own (UnicodeError...)
            return SubEnvError
    except Exception:  # a cause whose __init__ or layout does not fit
        return SubEnvError
    return combined


def _reduce_sub_env_error(err: SubEnvError) -> Any:
    plain = SubEnvError.__new__(SubEnvError)
    Exception.__init__(plain, *err.args)
    plain.__dict__.update(err.__dict__)
    return plain.__reduce_ex__(2)


class ClosedError(ClosedEnvironmentError, RuntimeError):
    """A call on a closed vector env: gymnasium's ``ClosedEnvironmentError``, also a
    ``RuntimeError`` (what SB3 code and earlier versions of the faces raised)."""


def crash_like(exc: BaseException) -> bool:
    return isinstance(exc, (WorkerCrashedError, StepTimeoutError))


def with_text(exc: WorkerError, text: str) -> WorkerError:
    """A copy of ``exc`` (same class and fields) with a message that names sub-envs."""
    err = type(exc).__new__(type(exc))
    Exception.__init__(err, text)
    err.__dict__.update(exc.__dict__)
    return err


def reraise(err: BaseException, original: BaseException) -> NoReturn:
    """Raise ``err``, chained to the env's own exception when there is one."""
    raise err from (err.__cause__ if err.__cause__ is not None else original)
