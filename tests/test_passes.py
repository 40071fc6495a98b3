"""The loop's pass queue (``asyncsample/_passes.py``): pieces of work run in order, about
``SLICE_S`` of them per pass of the loop, one piece's error never stops the others, each loop has
its own queue, and a queue never keeps its loop alive."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from typing import Any

import pytest

from asyncsample._passes import SLICE_S, pass_queue


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_pieces_run_in_order_and_leave_the_rest_to_the_next_pass() -> None:
    loop = asyncio.get_running_loop()
    ran: list[str] = []

    def first() -> None:
        ran.append("first")
        loop.call_soon(ran.append, "other callback")  # ready before the queue's next pass
        _busy(2 * SLICE_S)

    queue = pass_queue(loop)
    queue.put(first)
    queue.put(ran.append, "second")
    queue.put(ran.append, "third")
    while len(ran) < 4:
        await asyncio.sleep(0)
    assert ran == ["first", "other callback", "second", "third"]


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_pieces_error_goes_to_the_loops_handler_and_the_rest_run() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    ran: list[int] = []

    def broken() -> None:
        raise RuntimeError("a bug in a piece")

    try:
        queue = pass_queue(loop)
        queue.put(broken)
        queue.put(ran.append, 1)
        while not ran:
            await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert ran == [1]
    assert [str(c["exception"]) for c in errors] == ["a bug in a piece"]


def test_each_loop_has_its_own_queue_whichever_was_asked_last() -> None:
    a, b = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        qa, qb = pass_queue(a), pass_queue(b)
        assert qa is not qb
        assert [pass_queue(a), pass_queue(b), pass_queue(a)] == [qa, qb, qa]
    finally:
        a.close()
        b.close()


def test_a_queue_never_keeps_its_loop_alive() -> None:
    loop = asyncio.new_event_loop()
    pass_queue(loop).put(print)  # scheduled on the loop, never run: the loop closes first
    gone = weakref.ref(loop)
    loop.close()
    del loop
    gc.collect()
    assert gone() is None
