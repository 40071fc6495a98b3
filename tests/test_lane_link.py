"""The caller's side of a host of async envs (``backends/_lane_link.py``): a batch of replies is
handed to its waiters a slice per pass of the loop, so one big batch never holds the caller's
loop; nothing is lost or reordered, and a dead host fails the waiters of the rest."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest

from asyncsample.backends import _lane_link
from asyncsample.backends._lane_link import LaneLink
from asyncsample.backends._lane_serve import LaneKind
from asyncsample.backends._transport import ST_OK

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class Owner:
    """Settles each request with its value (as ``RemoteLanes.settle`` does, without a host)."""

    def settle(self, i: int, status: int, value: Any, future: asyncio.Future[Any]) -> None:
        if status == ST_OK:
            future.set_result((i, value))
        else:
            future.set_exception(value)


def _link() -> tuple[LaneLink, list[Any]]:
    sent: list[Any] = []
    link = LaneLink(lambda body: sent.append(pickle.loads(body)), asyncio.get_running_loop())
    return link, sent


def _submit(link: LaneLink, i: int) -> asyncio.Future[Any]:
    return link.submit(Owner(), 0, 0, i)[1]  # type: ignore[arg-type]


async def test_a_big_batch_of_replies_is_handed_over_a_slice_per_pass() -> None:
    link, sent = _link()
    n = 2 * _lane_link.REPLIES_PER_PASS + 10
    futures = [_submit(link, i) for i in range(n)]
    await asyncio.sleep(0)  # the requests' flush
    assert [len(batch) for batch in sent] == [n]
    order: list[int] = []
    for i, future in enumerate(futures):
        future.add_done_callback(lambda f, i=i: order.append(i))
    link.replied(pickle.dumps([(i, ST_OK, i * 10) for i in range(n)]))
    handed = [sum(f.done() for f in futures)]
    while handed[-1] < n:
        await asyncio.sleep(0)
        handed.append(sum(f.done() for f in futures))
    per = _lane_link.REPLIES_PER_PASS
    assert handed[:3] == [per, 2 * per, n]
    await asyncio.sleep(0)  # the last slice's done callbacks
    assert order == list(range(n))
    assert [f.result() for f in futures] == [(i, i * 10) for i in range(n)]


async def test_a_small_batch_is_handed_over_at_once() -> None:
    link, _ = _link()
    futures = [_submit(link, i) for i in range(3)]
    link.replied(pickle.dumps([(2, ST_OK, "c"), (0, ST_OK, "a")]))
    assert [f.done() for f in futures] == [True, False, True]


async def test_a_request_given_up_is_cancelled_in_the_host_and_its_reply_dropped() -> None:
    link, sent = _link()
    futures = [_submit(link, i) for i in range(2)]
    await asyncio.sleep(0)
    futures[0].cancel()
    link.cancel(0)
    await asyncio.sleep(0)
    assert sent[-1] == [(LaneKind.CANCEL, 0)]
    link.replied(pickle.dumps([(0, ST_OK, "late"), (1, ST_OK, "b")]))
    assert futures[0].cancelled() and futures[1].result() == (1, "b")
    link.cancel(1)  # answered already: nothing to cancel
    await asyncio.sleep(0)
    assert sent[-1] == [(LaneKind.CANCEL, 0)]


async def test_a_dead_host_fails_the_waiters_of_a_batch_not_handed_over() -> None:
    link, _ = _link()
    n = _lane_link.REPLIES_PER_PASS + 5
    futures = [_submit(link, i) for i in range(n)]
    link.replied(pickle.dumps([(i, ST_OK, i) for i in range(n)]))
    link.fail(ConnectionError("host died"))
    await asyncio.sleep(0)
    done = [f for f in futures if not f.exception()]
    assert len(done) == _lane_link.REPLIES_PER_PASS
    assert all(isinstance(f.exception(), ConnectionError) for f in futures[len(done) :])
