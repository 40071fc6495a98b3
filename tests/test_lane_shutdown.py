"""A host of async envs, once shut, drops the lane requests that still come: a Ray actor may run
a batch the caller sent before its shutdown after it (``tests/lane_server.py``: the host's
server driven in the test's loop). Before, the request went to its env's lane, whose idle wait
the shutdown had cancelled: ``InvalidStateError`` in the batch's call."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from lane_server import LaneServerHost

from asyncsample import RandomAgent
from asyncsample.backends._lane_serve import LaneKind

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60), pytest.mark.both_loops]


async def test_lane_requests_after_shutdown_are_dropped() -> None:
    host = LaneServerHost(RandomAgent(LaneServerHost(None).make_env().action_space, seed=3))
    await host.start()
    host.submit((LaneKind.RUN, 200, 0, 0, None, 5, False))
    assert len((await host.until(200))[0].rewards) == 5
    server = host.actor._server()
    await host.close()
    assert server.envs and all(lane.task.done() for lane in server.envs.values())  # type: ignore[union-attr]

    host.submit((LaneKind.RUN, 201, 0, 0, None, 5, False))
    host.submit((LaneKind.STEPS, 300, 0, np.array([0], dtype=np.int64).tobytes()))
    host.submit((LaneKind.RESET, 301, 0, 0, None, None, None))
    await asyncio.sleep(0.05)
    assert not server.keys and not server.out and not server.steps_out
    assert all(not lane.queue for lane in server.envs.values())
    assert all(lane.task.done() for lane in server.envs.values())  # type: ignore[union-attr]
