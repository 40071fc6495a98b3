"""A host of async envs with ``inference="host"`` stamps each step with the agent version whose
parameters picked its action, also where a parameter update reaches the host while a step asked
before it waits for its agent call, or before a run asked earlier starts.

The host's server (``tests/lane_server.py``: driven in the test's loop) is given the requests
in the orders that raced: before, a run whose first agent call was still merging when the
update came acted with the new parameters, and the caller stamped it with the version it asked
under.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import numpy as np
import pytest
from lane_server import LaneServerHost

from asyncsample._batcher import Batcher
from asyncsample.backends._lane_serve import LaneKind
from asyncsample.backends._transport import ST_OK
from asyncsample.backends.base import StepRun

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60), pytest.mark.both_loops]

# No cloudpickle by value: the host runs in this process, so its agent copies are of this
# module's classes (AwaitedShifted's class attributes are the test's).


class Shifted:
    """Acts ``(step + shift) % 2``, ``shift`` its one parameter."""

    def __init__(self) -> None:
        self.shift = 0

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, Any]]:
        obs = np.asarray(observations)
        return (obs[:, 0].astype(np.int64) + self.shift) % 2, {}

    def get_param_values(self) -> dict[str, int]:
        return {"shift": self.shift}

    def set_param_values(self, params: Any) -> None:
        self.shift = int(params["shift"])


class AwaitedShifted(Shifted):
    """``Shifted`` awaited, its shift read after its call has waited for ``release`` (a future
    the test sets: an LLM's call may take seconds)."""

    release: ClassVar[asyncio.Future[None] | None] = None
    waiting: ClassVar[asyncio.Event | None] = None

    async def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, Any]]:  # type: ignore[override]
        assert AwaitedShifted.release is not None and AwaitedShifted.waiting is not None
        AwaitedShifted.waiting.set()
        await AwaitedShifted.release
        return super().get_actions(observations)


async def acted(host: LaneServerHost, key: int) -> tuple[int, int]:
    """``(the version that acted, the action)`` of ``ACT`` request ``key``'s reply."""
    _reward, _term, _trunc, _info, action, _extra, version = (await host.until(key))[0]
    return version, int(action)


async def act(host: LaneServerHost, key: int, slot: int = 0) -> tuple[int, int]:
    """An ``ACT`` step of slot ``slot``'s env asked under version 0: see :func:`acted`."""
    host.submit((LaneKind.ACT, key, slot, 0, None, 0))
    return await acted(host, key)


def run_request(key: int) -> tuple[Any, ...]:
    """A run of up to 5 steps of slot 0's env, its agent's calls merged."""
    return (LaneKind.RUN, key, 0, 0, None, 5, True)


async def check_run(host: LaneServerHost, key: int, version: int, steps: int) -> None:
    """Run ``key``'s reply is of ``version`` and ``steps`` steps, each step's action the one the
    parameters of that version pick (version v has shift v % 2)."""
    run: StepRun = (await host.until(key))[0]
    assert (run.version, len(run.rewards)) == (version, steps)
    t = np.asarray(run.obs)[:, 0].astype(np.int64)
    np.testing.assert_array_equal(run.actions, (t + run.version) % 2)


@pytest.fixture
async def host() -> AsyncIterator[LaneServerHost]:
    h = LaneServerHost(Shifted())
    await h.start()
    yield h
    await h.close()


async def test_a_run_whose_agent_call_is_merging_keeps_its_version(host: LaneServerHost) -> None:
    """The update comes while the run's first agent call waits for the end of the pass: the
    call is answered with the old parameters, the run stops before its next step and is stamped
    with the old version; the next run is of the new version."""
    host.submit(run_request(1))
    update = host.update(1, {"shift": 1})  # its task runs after the run's, before the merged call
    await check_run(host, 1, version=0, steps=1)
    assert (await update)[0] == ST_OK
    host.submit(run_request(2))
    await check_run(host, 2, version=1, steps=5)


async def test_a_run_asked_before_an_update_it_follows_is_of_the_new_version(
    host: LaneServerHost,
) -> None:
    """The update is in place before the run starts: the run is stamped with the new version
    (the caller asked it under the old one)."""
    assert (await host.update(1, {"shift": 1}))[0] == ST_OK
    host.submit(run_request(1))
    await check_run(host, 1, version=1, steps=5)


async def test_a_step_asked_under_an_old_version_names_the_one_that_acted(
    host: LaneServerHost,
) -> None:
    """An ``ACT`` step asked under version 0 after the update to version 1: its reply names
    version 1 (with 0, as asked, it names none)."""
    host.submit((LaneKind.ACT, 1, 0, 0, None, 0))
    update = host.update(1, {"shift": 1})
    assert await acted(host, 1) == (0, 0)  # its observation 0, under shift 0
    assert (await update)[0] == ST_OK
    assert await act(host, 2) == (1, 0)  # its observation 1, under shift 1


async def test_the_slots_alike_stop_sharing_a_copy_its_own_slot_updates() -> None:
    """Slot 1's envs were served by slot 0's copy (alike); once slot 0 is updated, slot 1's
    steps keep slot 1's parameters (version 0)."""
    host = LaneServerHost(Shifted(), n_slots=2)
    await host.start()
    try:
        host.submit((LaneKind.ACT, 1, 0, 0, None, 0))
        host.submit((LaneKind.ACT, 2, 1, 0, None, 0))
        await host.until(1)  # one merged call for both: slot 0's copy, shared
        await host.until(2)
        assert (await host.update(1, {"shift": 1}, slot=0))[0] == ST_OK
        assert await act(host, 3, slot=1) == (0, 1)  # its observation 1, under shift 0
        assert await act(host, 4, slot=0) == (1, 0)  # its observation 1, under shift 1
    finally:
        await host.close()


async def test_an_update_waits_for_a_running_awaited_agent_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An async agent's call is running (awaited) when the update comes: the update waits for
    it (awaiting it, not polling), so the step it answers acts with the old parameters."""
    looks = [0]
    calls_on = Batcher.calls_on

    def counted(self: Batcher, agent: Any) -> bool:
        looks[0] += 1
        return calls_on(self, agent)

    monkeypatch.setattr(Batcher, "calls_on", counted)
    loop = asyncio.get_running_loop()
    AwaitedShifted.release, AwaitedShifted.waiting = loop.create_future(), asyncio.Event()
    host = LaneServerHost(AwaitedShifted())
    await host.start()
    try:
        host.submit((LaneKind.ACT, 1, 0, 0, None, 0))
        await AwaitedShifted.waiting.wait()  # the agent's call runs
        update = host.update(1, {"shift": 1})
        await asyncio.sleep(0.05)
        assert not update.done()  # held by the call in flight
        assert looks[0] < 10  # not a look per pass of the loop while the call runs
        AwaitedShifted.release.set_result(None)
        assert await acted(host, 1) == (0, 0)  # its observation 0, under shift 0
        assert (await update)[0] == ST_OK
        assert await act(host, 2) == (1, 0)  # its observation 1, under shift 1
    finally:
        AwaitedShifted.release = AwaitedShifted.waiting = None
        await host.close()
