"""Faults and bad input, round 3 (issue 24): causes kept in host mode, spaces the sampler cannot
record refused up front, memory limits checked before any work starts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import SamplerFactory

from asyncsample import WorkerError

pytestmark = [pytest.mark.timeout(90), pytest.mark.both_loops]


class ValueErrorAgent:
    """Raises ``ValueError`` at its third call."""

    def __init__(self) -> None:
        self.calls = 0

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        self.calls += 1
        if self.calls == 3:
            raise ValueError("the agent's own mistake")
        return np.zeros(len(observations), dtype=np.int64), {}


class TwoArgError(Exception):
    """An exception that cannot be unpickled (its ``__init__`` needs two arguments)."""

    def __init__(self, what: str, extra: int) -> None:
        super().__init__(what)
        self.extra = extra


class UnpicklableErrorAgent(ValueErrorAgent):
    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        raise TwoArgError("cannot travel", 1)


def _original(err: BaseException) -> BaseException | None:
    """The agent's own exception: the cause of a ``WorkerError``, else the error itself."""
    return err.__cause__ if isinstance(err, WorkerError) else err


@pytest.mark.parametrize(
    ("inference", "backend"),
    [
        ("per_worker", "local"),
        ("per_worker", "process"),
        ("batched", "local"),
        ("batched", "process"),
        ("host", "process"),
    ],
)
async def test_an_agent_error_keeps_its_type_in_every_mode(
    make_sampler: SamplerFactory, inference: str, backend: str
) -> None:
    async with make_sampler(
        backend=backend, agent=ValueErrorAgent(), inference=inference, n_workers=2
    ) as s:
        with pytest.raises((ValueError, WorkerError)) as info:
            await s.obtain_samples(200)
    original = _original(info.value)
    assert isinstance(original, ValueError)
    assert str(original) == "the agent's own mistake"
    if inference == "host":
        err = info.value
        assert isinstance(err, WorkerError) and err.retry is False and err.env is None
        assert isinstance(err.__cause__, ValueError)
        assert "raised in its env host: ValueError: the agent's own mistake" in str(err)
        assert "in get_actions" in (err.remote_traceback or "")  # the agent's own frame
        assert any("raised in its env host" in n for n in getattr(original, "__notes__", ()))


async def test_an_agent_error_that_cannot_travel_is_described(
    make_sampler: SamplerFactory,
) -> None:
    async with make_sampler(
        backend="process", agent=UnpicklableErrorAgent(), inference="host", n_workers=1
    ) as s:
        with pytest.raises(WorkerError, match=r"raised in its env host: TwoArgError") as info:
            await s.obtain_samples(50)
    assert type(info.value.__cause__).__name__ == "AgentFailure"
    assert "cannot travel" in str(info.value.__cause__)
    assert info.value.retry is False
