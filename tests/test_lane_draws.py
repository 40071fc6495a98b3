"""A host's runs with the built-in random agent act with the rows it would draw one step at a
time: a run takes the rows of its longest length at once and gives back those its episode's end
left (``tests/lane_server.py``: the host's server driven in the test's loop)."""

from __future__ import annotations

import numpy as np
import pytest
from lane_server import LaneServerHost

from asyncsample import RandomAgent
from asyncsample.backends._lane_serve import PENDING, LaneKind
from asyncsample.backends.base import StepRun

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60), pytest.mark.both_loops]


async def test_runs_act_with_the_random_agents_rows_drawn_one_at_a_time() -> None:
    host = LaneServerHost(RandomAgent(LaneServerHost(None).make_env().action_space, seed=5))
    await host.start()
    try:
        actions: list[int] = []
        ends = 0
        for key in range(200, 240):  # runs of 7 steps; episodes of 50 end every 8th run early
            host.submit((LaneKind.RUN, key, 0, 0, None, 7, False))
            run: StepRun = (await host.until(key))[0]
            actions.extend(int(a) for a in run.actions)
            if run.terminated or run.truncated:
                ends += 1
                host.submit((LaneKind.RESET, 1000 + key, 0, 0, PENDING, None, None))
                await host.until(1000 + key)
    finally:
        await host.close()
    assert ends >= 4 and len(actions) == 40 * 7 - ends * 6
    expected = RandomAgent(host.make_env().action_space, seed=5).row_sampler()
    assert expected is not None
    assert actions == [int(expected()) for _ in actions]
    assert np.unique(actions).size > 1
