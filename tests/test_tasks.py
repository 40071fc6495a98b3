"""The one gather helper (``asyncsample._tasks``): who gets cancelled, what is raised, and that
nothing is left running."""

from __future__ import annotations

import asyncio

import pytest

from asyncsample._tasks import run_all, wait_all


class Boom(Exception):
    pass


async def _fail_soon() -> None:
    await asyncio.sleep(0.01)
    raise Boom("first")


async def _record(ended: list[str], name: str, delay: float) -> str:
    try:
        await asyncio.sleep(delay)
    except asyncio.CancelledError:
        ended.append(f"{name} cancelled")
        raise
    ended.append(f"{name} done")
    return name


async def test_results_keep_the_order_given() -> None:
    ended: list[str] = []
    coros = [_record(ended, "slow", 0.03), _record(ended, "fast", 0.0)]
    assert await run_all(coros) == ["slow", "fast"]
    assert await wait_all([_record(ended, "a", 0.02), _record(ended, "b", 0.0)]) == ["a", "b"]
    assert await run_all([]) == [] and await wait_all([]) == []


async def test_run_all_first_error_cancels_the_rest_and_is_raised_as_itself() -> None:
    ended: list[str] = []
    with pytest.raises(Boom, match="first"):
        await run_all([_fail_soon(), _record(ended, "other", 5.0)])
    assert ended == ["other cancelled"]  # ended, not left running


async def test_wait_all_lets_every_coroutine_finish_then_raises_the_first_error() -> None:
    ended: list[str] = []
    with pytest.raises(Boom, match="first"):
        await wait_all([_record(ended, "other", 0.05), _fail_soon()])
    assert ended == ["other done"]


@pytest.mark.parametrize("helper", [run_all, wait_all])
async def test_the_callers_cancellation_cancels_and_awaits_them_all(helper: object) -> None:
    ended: list[str] = []
    assert callable(helper)
    task = asyncio.ensure_future(helper([_record(ended, "a", 5.0), _record(ended, "b", 5.0)]))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(ended) == ["a cancelled", "b cancelled"]
