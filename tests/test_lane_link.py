"""The caller's side of a host of async envs (``backends/_lane_link.py``): each reply settles its
request's future through the request's owner; a request given up is cancelled in the host and
its late reply dropped; a dead host fails every waiter through its owner."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest

from asyncsample.backends._lane_link import LaneLink
from asyncsample.backends._lane_serve import LaneKind
from asyncsample.backends._transport import ST_OK

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class Owner:
    """Settles each request with its value (as ``RemoteLanes.settle`` does, without a host)."""

    def sinks_step(self, i: int, future: asyncio.Future[Any]) -> bool:
        return False  # no call in progress takes the replies

    def settle(self, i: int, status: int, value: Any, future: asyncio.Future[Any]) -> None:
        if status == ST_OK:
            future.set_result((i, value))
        else:
            future.set_exception(value)


def _link() -> tuple[LaneLink, list[Any]]:
    sent: list[Any] = []
    link = LaneLink(lambda body: sent.append(pickle.loads(body)), asyncio.get_running_loop())
    return link, sent


def _submit(link: LaneLink, i: int) -> tuple[int, asyncio.Future[Any]]:
    return link.submit(Owner(), 0, 0, i)  # type: ignore[arg-type]


async def test_replies_reach_their_waiters_in_any_order() -> None:
    link, _ = _link()
    keys, futures = zip(*(_submit(link, i) for i in range(3)))
    link.replied(pickle.dumps([(keys[2], ST_OK, "c"), (keys[0], ST_OK, "a")]))
    assert [f.done() for f in futures] == [True, False, True]


async def test_request_keys_are_unique_in_the_process() -> None:
    # A step's key stands for its future (SinkStep): no two links may hand out the same one.
    (first, _), (second, _) = _submit(_link()[0], 0), _submit(_link()[0], 0)
    assert first != second


async def test_a_request_given_up_is_cancelled_in_the_host_and_its_reply_dropped() -> None:
    link, sent = _link()
    keys, futures = zip(*(_submit(link, i) for i in range(2)))
    await asyncio.sleep(0)
    futures[0].cancel()
    link.cancel(keys[0])
    await asyncio.sleep(0)
    assert sent[-1] == [(LaneKind.CANCEL, keys[0])]
    link.replied(pickle.dumps([(keys[0], ST_OK, "late"), (keys[1], ST_OK, "b")]))
    assert futures[0].cancelled() and futures[1].result() == (1, "b")
    link.cancel(keys[1])  # answered already: nothing to cancel
    await asyncio.sleep(0)
    assert sent[-1] == [(LaneKind.CANCEL, keys[0])]


async def test_a_dead_host_fails_every_waiter_through_its_owner() -> None:
    link, _ = _link()
    keys, futures = zip(*(_submit(link, i) for i in range(3)))
    link.replied(pickle.dumps([(keys[1], ST_OK, "b")]))
    link.fail(ConnectionError("host died"))
    assert futures[1].result() == (1, "b")
    assert all(isinstance(futures[i].exception(), ConnectionError) for i in (0, 2))
    _, later = _submit(link, 3)  # a request after the death fails at once
    assert isinstance(later.exception(), ConnectionError)
