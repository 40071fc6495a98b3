"""A host of async envs with ``inference="host"`` stamps each step with the agent version whose
parameters picked its action, also where a parameter update reaches the host while a step asked
before it waits for its agent call, or before a run asked earlier starts.

The host's server (``tests/lane_server.py``: driven in the test's loop) is given the requests
in the orders that raced: before, a run whose first agent call was still merging when the
update came acted with the new parameters, and the caller stamped it with the version it asked
under.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from typing import Any

import cloudpickle
import numpy as np
import pytest
from lane_server import LaneServerHost

from asyncsample.backends._lane_serve import LaneKind
from asyncsample.backends._transport import ST_OK
from asyncsample.backends.base import StepRun

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60), pytest.mark.both_loops]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


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


def acted_as_stamped(run: StepRun) -> None:
    """Each step's action is the one the parameters of the run's version pick (version v has
    shift v % 2)."""
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
    host.submit((LaneKind.RUN, 1, 0, 0, None, 5, True))
    update = host.update(1, {"shift": 1})  # its task runs after the run's, before the merged call
    (run, _obs, _final) = await host.until(1)
    assert (await update)[0] == ST_OK
    assert run.version == 0 and len(run.rewards) == 1
    acted_as_stamped(run)
    host.submit((LaneKind.RUN, 2, 0, 0, None, 5, True))
    (run, _obs, _final) = await host.until(2)
    assert run.version == 1 and len(run.rewards) == 5
    acted_as_stamped(run)


async def test_a_run_asked_before_an_update_it_follows_is_of_the_new_version(
    host: LaneServerHost,
) -> None:
    """The update is in place before the run starts: the run is stamped with the new version
    (the caller asked it under the old one)."""
    assert (await host.update(1, {"shift": 1}))[0] == ST_OK
    host.submit((LaneKind.RUN, 1, 0, 0, None, 5, True))
    (run, _obs, _final) = await host.until(1)
    assert run.version == 1 and len(run.rewards) == 5
    acted_as_stamped(run)


async def test_a_step_asked_under_an_old_version_names_the_one_that_acted(
    host: LaneServerHost,
) -> None:
    """An ``ACT`` step asked under version 0 after the update to version 1: its reply names
    version 1 (with 0, as asked, it names none)."""
    host.submit((LaneKind.ACT, 1, 0, 0, None, 0))
    update = host.update(1, {"shift": 1})
    _reward, _term, _trunc, _info, action, _extra, acted = (await host.until(1))[0]
    assert (await update)[0] == ST_OK
    assert (acted, int(action)) == (0, 0)  # its observation 0, under shift 0
    host.submit((LaneKind.ACT, 2, 0, 0, None, 0))
    _reward, _term, _trunc, _info, action, _extra, acted = (await host.until(2))[0]
    assert (acted, int(action)) == (1, 0)  # its observation 1, under shift 1


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
        host.submit((LaneKind.ACT, 3, 1, 0, None, 0))
        _reward, _term, _trunc, _info, action, _extra, acted = (await host.until(3))[0]
        assert (acted, int(action)) == (0, 1)  # its observation 1, under shift 0
        host.submit((LaneKind.ACT, 4, 0, 0, None, 0))
        _reward, _term, _trunc, _info, action, _extra, acted = (await host.until(4))[0]
        assert (acted, int(action)) == (1, 0)  # its observation 1, under shift 1
    finally:
        await host.close()
