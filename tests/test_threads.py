"""The bounded poll of the env hosts and the faces' caller (``_threads.BoundedSpin``)."""

from __future__ import annotations

import resource
from types import SimpleNamespace
from typing import Any

import pytest

from asyncsample.backends import _threads
from asyncsample.backends._threads import (
    BUSY_CHECK,
    BUSY_LOOKS,
    SPIN_BACKOFF,
    SPIN_BACKOFF_FIRST,
    BoundedSpin,
)


def test_a_spin_returns_what_became_ready_or_its_last_look_when_time_is_up() -> None:
    looks = iter([[], [], [(3, 1)]])
    spin = BoundedSpin(64)
    assert spin.poll(lambda timeout: next(looks), 3600.0) == [(3, 1)]  # a spin that missed it hangs
    assert spin.poll(lambda timeout: [], 0.0) == []  # nothing ready: returns once time is up


def test_no_spin_while_more_threads_are_runnable_than_cpus_look_after_look(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """BUSY_LOOKS looks in a row, BUSY_CHECK seconds apart, that see more threads runnable than
    CPUs stop the polling until a look sees no more; one such look (a kernel thread's turn
    beside two pollers) does not."""
    runnable = [3]
    monkeypatch.setattr(_threads, "runnable", lambda: runnable[0])
    now = [1000.0]
    monkeypatch.setattr(_threads, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    spin = BoundedSpin(2)
    for _ in range(BUSY_LOOKS - 1):
        assert spin.allowed()  # busy, but not yet for BUSY_LOOKS looks in a row
        now[0] += BUSY_CHECK
    assert not spin.allowed()  # the BUSY_LOOKS-th busy look in a row: off
    runnable[0] = 1
    assert not spin.allowed()  # not looked at again within BUSY_CHECK
    now[0] += BUSY_CHECK
    assert spin.allowed()  # the next look sees a quiet machine
    runnable[0] = 3
    now[0] += BUSY_CHECK
    assert spin.allowed()  # one busy look after a quiet one: still polling
    runnable[0] = 2
    now[0] += BUSY_CHECK
    assert spin.allowed()  # as many runnable as CPUs (the caller and a host polling) is quiet


def test_preempted_spins_in_a_row_back_off_longer_and_a_clean_one_starts_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One preempted spin (a kernel thread's turn, about one 1-ms spin in 400 on a quiet VM) costs
    SPIN_BACKOFF_FIRST seconds of sleeping waits; each further one in a row doubles that, up to
    SPIN_BACKOFF (another process wanting the CPU preempts every spin)."""
    monkeypatch.setattr(_threads, "runnable", lambda: 1)
    now = [1000.0]
    monkeypatch.setattr(_threads, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    preempted = [True]
    looks = [0, 0]  # getrusage calls, switches so far

    def usage(who: Any) -> SimpleNamespace:
        looks[0] += 1
        if looks[0] % 2 == 0 and preempted[0]:  # a spin's second look: switched out meanwhile
            looks[1] += 1
        return SimpleNamespace(ru_nivcsw=looks[1])

    monkeypatch.setattr(resource, "getrusage", usage)
    spin = BoundedSpin(2)

    def off_for() -> float:
        """Spin once (ready at once), then the seconds until spinning is allowed again."""
        assert spin.allowed()
        assert spin.poll(lambda timeout: [(1, 1)], 1.0) == [(1, 1)]
        start = now[0]
        while not spin.allowed():
            now[0] += SPIN_BACKOFF_FIRST / 4
        return now[0] - start

    first = off_for()
    assert 0.99 * SPIN_BACKOFF_FIRST <= first < 1.5 * SPIN_BACKOFF_FIRST
    assert off_for() >= 1.99 * SPIN_BACKOFF_FIRST  # a second in a row: twice as long
    longest = 0.0
    for _ in range(20):
        longest = off_for()
    assert 0.99 * SPIN_BACKOFF <= longest < 1.1 * SPIN_BACKOFF  # capped
    preempted[0] = False
    assert off_for() == 0.0  # a clean spin: no backoff
    preempted[0] = True
    assert off_for() < SPIN_BACKOFF_FIRST * 1.5  # and the next preempted one starts over
