"""The window of env calls in the caller's loop (``backends._pacing.CallWindow``): a fixed cap
(``max_concurrency``), and the lag target that shrinks it while the loop is behind and grows it
back once the loop is on time (``backend_options["loop_lag"]``, on ``asyncio`` and ``thread``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import numpy as np
import pytest
from async_envs import CountingAsyncEnv
from helpers import SamplerFactory, wait_until

from asyncsample.backends import _pacing
from asyncsample.backends._pacing import CallWindow

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


async def _enter(window: CallWindow, order: list[int], k: int) -> None:
    if not window.enter_now():
        await window.enter()
    order.append(k)


async def test_a_fixed_window_lets_in_its_size_then_the_waiters_in_order() -> None:
    window = CallWindow(2, None)
    order: list[int] = []
    await _enter(window, order, 0)
    await _enter(window, order, 1)
    waiters = [asyncio.ensure_future(_enter(window, order, k)) for k in (2, 3, 4)]
    await asyncio.sleep(0.01)
    assert order == [0, 1] and window.running == 2 and window.waiting == 3
    window.leave()
    await asyncio.sleep(0)
    assert order == [0, 1, 2] and window.running == 2
    window.leave()
    window.leave()
    await asyncio.gather(*waiters)
    assert order == [0, 1, 2, 3, 4] and window.running == 2


async def test_a_cancelled_wait_holds_no_place_and_passes_on_one_it_was_given() -> None:
    window = CallWindow(1, None)
    order: list[int] = []
    await _enter(window, order, 0)
    first = asyncio.ensure_future(_enter(window, order, 1))
    second = asyncio.ensure_future(_enter(window, order, 2))
    await asyncio.sleep(0)
    window.leave()  # the place goes to the first waiter ...
    first.cancel()  # ... cancelled before it ran: the place goes on to the second
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 5)
    assert order == [0, 2] and window.running == 1 and window.waiting == 0


async def test_a_cancelled_waiter_ahead_never_keeps_a_free_place_shut() -> None:
    window = CallWindow(1, None)
    order: list[int] = []
    await _enter(window, order, 0)
    dead = asyncio.ensure_future(_enter(window, order, 1))
    await asyncio.sleep(0)
    dead.cancel()
    with pytest.raises(asyncio.CancelledError):
        await dead
    window.size = 2  # room again, with the cancelled wait still first in line
    await asyncio.wait_for(_enter(window, order, 2), 5)
    assert order == [0, 2] and window.running == 2


async def test_a_lagging_loop_shrinks_the_window_and_an_on_time_one_grows_it_back() -> None:
    window = CallWindow(None, 0.002)
    assert window.size == _pacing.START  # a slow start: not thousands of first steps at once
    order: list[int] = []
    for k in range(40):
        await _enter(window, order, k)
    assert window.running == 40
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end and not window.shrinks:
        time.sleep(0.02)  # the loop held 20 ms at a time: every look of the window is late
        await asyncio.sleep(0)
    assert window.shrinks >= 1
    assert window.size <= 40 * _pacing.SHRINK
    shrunk = window.size
    waiters = [asyncio.ensure_future(_enter(window, order, k)) for k in range(40, 60)]
    # The loop on time again, calls waiting: the window grows back and lets them in.
    await wait_until(lambda: window.size > shrunk, "the window grows", timeout=20)
    for _ in range(40):
        window.leave()
    await asyncio.wait_for(asyncio.gather(*waiters), 20)
    assert sorted(order) == list(range(60))
    for _ in range(20):
        window.leave()
    await wait_until(lambda: window._timer is None, "no look once no call runs", timeout=5)


class ByObservation:
    """Actions a function of the observation: batches that do not depend on which env's step
    came first (a random agent's draws would, so fixed shares do not promise them)."""

    def get_actions(self, observations: np.ndarray) -> Any:
        return (observations[:, 0] % 2).astype(np.int64), {}


class BusyAsyncEnv(CountingAsyncEnv):
    """A step that waits 5 ms, then holds the loop 1 ms (an env's own Python)."""

    async def step(self, action: Any) -> Any:
        await asyncio.sleep(0.005)
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass
        return await super().step(action)


async def test_envs_that_keep_the_loop_behind_run_fewer_at_once_with_the_same_batches(
    make_sampler: SamplerFactory,
) -> None:
    """100 envs that each hold the loop 1 ms after a 5 ms wait (16 times what the loop has):
    the window shrinks, and with fixed shares the batch is an unpaced sampler's (the default)."""
    batches = []
    for loop_lag in (_pacing.LOOP_LAG, None):  # a lag target, and no window (the default)
        options = {"backend_options": {"loop_lag": loop_lag}} if loop_lag else {}
        sampler = make_sampler(
            "asyncio",
            functools.partial(BusyAsyncEnv, 7),
            ByObservation(),
            n_workers=10,
            envs_per_worker=10,
            seed=3,
            fixed_shares=True,
            **options,
        )
        batches.append(await sampler.obtain_fragments(600))
        window = sampler._core.backend._window
        if loop_lag is None:
            assert window is None
        else:
            assert window is not None and window.shrinks >= 1 and window.size < 100
    paced, unpaced = batches
    for name in ("observations", "actions", "rewards", "step_types"):
        np.testing.assert_array_equal(getattr(paced, name), getattr(unpaced, name), err_msg=name)


async def test_loop_lag_must_be_positive_seconds(make_sampler: SamplerFactory) -> None:
    with pytest.raises(ValueError, match="loop_lag"):
        sampler = make_sampler(
            "asyncio", functools.partial(CountingAsyncEnv, 3), backend_options={"loop_lag": -1}
        )
        await sampler.obtain_samples(4)


async def test_the_wait_for_a_place_is_not_the_steps_time(make_sampler: SamplerFactory) -> None:
    """``step_timeout`` times the env's call from its place in the window: three envs of 0.2 s
    steps one at a time (``max_concurrency=1``) wait up to 0.4 s for their turn, and no step
    times out at 0.3 s."""
    sampler = make_sampler(
        "asyncio",
        functools.partial(CountingAsyncEnv, 4, 0.2),
        ByObservation(),
        n_workers=1,
        envs_per_worker=3,
        max_concurrency=1,
        step_timeout=0.3,
        fixed_shares=True,
    )
    batch = await sampler.obtain_fragments(6)
    assert batch.n_transitions == 6
    assert sampler.restarts == 0
