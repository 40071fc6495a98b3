"""The bounded poll of the env hosts and the faces' caller (``_threads.BoundedSpin``)."""

from __future__ import annotations

import resource
from types import SimpleNamespace
from typing import Any

import pytest

from asyncsample.backends import _threads
from asyncsample.backends._threads import SPIN_BACKOFF, BoundedSpin


def test_a_spin_returns_what_became_ready_or_its_last_look_when_time_is_up() -> None:
    looks = iter([[], [], [(3, 1)]])
    spin = BoundedSpin(64)
    assert spin.poll(lambda timeout: next(looks), 3600.0) == [(3, 1)]  # a spin that missed it hangs
    assert spin.poll(lambda timeout: [], 0.0) == []  # nothing ready: returns once time is up


def test_no_spin_while_more_threads_are_runnable_than_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    runnable = [3]
    monkeypatch.setattr(_threads, "runnable", lambda: runnable[0])
    spin = BoundedSpin(2)
    assert not spin.allowed()  # busy: off until the next look
    runnable[0] = 1
    assert not spin.allowed()  # not looked at again within BUSY_CHECK
    assert BoundedSpin(2).allowed()  # a fresh look sees a quiet machine


def test_a_preempted_spin_turns_spinning_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_threads, "runnable", lambda: 1)
    switches = iter([5, 6])  # the kernel switched the spinning thread out once meanwhile

    def usage(who: Any) -> SimpleNamespace:
        return SimpleNamespace(ru_nivcsw=next(switches))

    monkeypatch.setattr(resource, "getrusage", usage)
    spin = BoundedSpin(2)
    assert spin.allowed()
    assert spin.poll(lambda timeout: [(1, 1)], 1.0) == [(1, 1)]
    assert not spin.allowed()  # backed off for SPIN_BACKOFF seconds
    assert SPIN_BACKOFF >= 0.1
