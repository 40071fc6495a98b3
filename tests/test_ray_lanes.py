"""The actor of async envs on Ray (``LaneActor``): its batches of lane requests start in the
order the caller sent them, whatever order Ray runs its ``submit`` calls in (issue 33: Ray does
reorder an async actor's calls, and a cancel that overtook its step left that step to run after
the reset that followed it: an episode one observation short).

The actor class is driven directly in the test's loop (both loops, quick pass), then as a Ray
actor (slow pass).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

import cloudpickle
import pytest
from async_envs import CountingAsyncEnv

from asyncsample.backends._lane_serve import PENDING, LaneKind, LaneOptions
from asyncsample.backends._ray_actor import LaneActor
from asyncsample.backends._remote import slots_blob
from asyncsample.backends._transport import ST_OK, Op, dumps
from asyncsample.backends.base import HostSpec

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

#: An actor's method, called: ``call(name, *args)`` awaits ``actor.name(*args)``.
Call = Callable[..., Awaitable[Any]]


def _actor_args() -> tuple[bytes, LaneOptions]:
    probe = CountingAsyncEnv()
    spec = HostSpec(0, 1, probe.observation_space, probe.action_space, None, lanes=True)
    return slots_blob([spec]), LaneOptions(None, 1.0, None)


async def _reorder_scenario(call: Call) -> dict[int, Any]:
    """Build env 0 (episodes of 10 steps), reset it, then send a step (batch 1) and, as the
    caller does when it gives the step up, its cancel and a new reset (batch 2), batch 2 first;
    then one more step (batch 3). Every lane reply by key."""
    chains = cloudpickle.dumps(([[functools.partial(CountingAsyncEnv, 10)]], [0]))
    status, _ = pickle.loads(await call("serve", 0, int(Op.BUILD), chains))
    assert status == ST_OK
    replies: dict[int, Any] = {}

    async def until(key: int) -> None:
        while key not in replies:
            batches, _clocks = await call("replies")
            for body in batches:
                for k, st, value in pickle.loads(body):
                    assert st == ST_OK, value
                    replies[k] = value

    await call("submit", 0, dumps([(LaneKind.RESET, 0, 0, 0, PENDING, None, None)]))
    await until(0)
    await call(
        "submit", 2, dumps([(LaneKind.CANCEL, 1), (LaneKind.RESET, 2, 0, 0, PENDING, None, None)])
    )
    await call("submit", 1, dumps([(LaneKind.STEP, 1, 0, 0, 1, None)]))
    await until(2)
    await call("submit", 3, dumps([(LaneKind.STEP, 3, 0, 0, 1, None)]))
    await until(3)
    return replies


def _check(replies: dict[int, Any]) -> None:
    assert 1 not in replies  # the step was cancelled before it ran: no reply
    _info, obs, _final = replies[2]
    assert obs[0] == 0  # the reset's observation: step count 0
    (_reward, terminated, _truncated, _infos), obs, _final = replies[3]
    assert obs[0] == 1  # the first step after the reset (old code: 2, the cancelled step ran)
    assert not terminated


@pytest.mark.both_loops
async def test_lane_batches_start_in_the_order_sent() -> None:
    actor = LaneActor(*_actor_args())

    async def call(name: str, *args: Any) -> Any:
        return await getattr(actor, name)(*args)

    try:
        _check(await _reorder_scenario(call))
        assert actor.early == {} and actor.next_batch == 4
    finally:
        await actor.shutdown()


async def test_lane_batches_start_in_the_order_sent_on_ray(ray_cluster: Any) -> None:
    import asyncio

    handle = ray_cluster.remote(LaneActor).options(max_concurrency=10).remote(*_actor_args())

    async def call(name: str, *args: Any) -> Any:
        return await asyncio.wrap_future(getattr(handle, name).remote(*args).future())

    try:
        _check(await _reorder_scenario(call))
    finally:
        await call("shutdown")
        ray_cluster.kill(handle, no_restart=True)
