"""Quiet lockstep steps handed to a polling env host through shared memory
(``asyncsample.backends._handoff``): the protocol's cells, and the faces' results against the
caller's own process, where the host polls, naps, wakes the caller, replies with a frame, fails."""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.spaces import Box, Discrete
from gymnasium.utils.env_checker import data_equivalence

from asyncsample._info_cells import COLUMNS
from asyncsample.backends import _handoff
from asyncsample.backends._handoff import FLAG_ID, WAKE_ID, Handoff, HostHandoff
from asyncsample.backends._transport import HEADER, ST_FAIL, ST_OK
from asyncsample.vector import SubEnvError, VectorEnv, hosted

# The env-host processes cannot import this module by name: ship its envs by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


def _block() -> Any:
    return multiprocessing.get_context("spawn").RawArray("q", _handoff.CTL_SLOTS)


def test_the_cells_say_who_looks_and_what_answered() -> None:
    raw = _block()
    caller_sock, host_sock = socket.socketpair()
    try:
        host = HostHandoff(raw, host_sock)
        caller = Handoff(raw)
        woken: list[bytes] = []
        host.looking(False)
        assert not caller.send(0, woken.append)  # asleep: a frame goes instead
        host.looking(True)
        assert caller.send(3, woken.append) and not woken
        assert not caller.send(3, woken.append)  # one at a time: the first is not answered
        assert host.pending() and host.take() == 3 and not host.pending()
        assert not caller.answered()
        host.answer(ST_OK, b"")  # quiet: the buffers hold it all, no frame
        assert caller.answered() and caller.quiet() and not caller.in_cells()
        caller_sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            caller_sock.recv(64)
        # Infos of plain numbers: in the slot's info cells, no frame either.
        assert caller.send(2, woken.append)
        host.take()
        host.answer(ST_OK, COLUMNS)
        assert caller.answered() and caller.quiet() and caller.in_cells()
        with pytest.raises(BlockingIOError):
            caller_sock.recv(64)
        # The caller sleeps: the host's answer wakes it with a frame.
        assert caller.send(1, woken.append)
        host.take()
        caller.waiting(True)
        host.answer(ST_OK, b"")
        assert HEADER.unpack(caller_sock.recv(64)) == (0, WAKE_ID, 1)
        caller.waiting(False)
        # More to say (infos, a failure): the frame is sent before the answer rises.
        assert caller.send(1, woken.append)
        host.take()
        host.answer(ST_FAIL, b"why")
        assert caller.answered() and not caller.quiet()
        assert caller_sock.recv(64) == HEADER.pack(3, FLAG_ID, ST_FAIL) + b"why"
        # A host that stops looking between the caller's two looks is woken by a frame.
        host.looking(True)
        caller.ctl[_handoff.LOOKING] = 1
        original = caller.ctl

        class Flip:
            """Reads LOOKING as 1 once, then 0 (the host went to sleep meanwhile)."""

            def __init__(self) -> None:
                self.reads = 0

            def __getitem__(self, i: int) -> int:
                if i == _handoff.LOOKING:
                    self.reads += 1
                    return 1 if self.reads == 1 else 0
                return int(original[i])

            def __setitem__(self, i: int, v: int) -> None:
                original[i] = v

        caller.ctl = Flip()  # type: ignore[assignment]
        assert caller.send(0, woken.append)
        assert woken == [HEADER.pack(0, WAKE_ID, 1)]
        assert host.pending()
    finally:
        caller_sock.close()
        host_sock.close()


def test_a_napping_host_sees_the_count_without_a_frame() -> None:
    """The host's nap looks at the count between naps: a wake-up lost between two cores costs
    a nap, not a hang."""
    from asyncsample.backends._host_main import StepReader

    raw = _block()
    caller_sock, host_sock = socket.socketpair()
    try:
        host = HostHandoff(raw, host_sock)
        reader = StepReader(host_sock, 1e-3)
        caller = Handoff(raw)
        caller.send(0, lambda _: True)  # no frame: as if the wake-up were lost
        t0 = time.perf_counter()
        assert reader.nap_for(host)
        assert time.perf_counter() - t0 < 5.0
        assert host.ctl[_handoff.LOOKING] == 1  # looking again once it returns
        host.take()
        caller_sock.sendall(HEADER.pack(0, 7, 1))  # a frame: the nap says so
        assert not reader.nap_for(host)
        assert reader.read() == (7, 1, b"")
        reader.close()
    finally:
        caller_sock.close()
        host_sock.close()


class InfoEnv(gym.Env[Any, Any]):
    """Box observations; an info every third step (``{"t": step}``; ``text``: its digits, and
    ``mixed``: numbers of several types), a final step every seventh; ``pause`` seconds per
    step; raises at step ``fail`` (0: never)."""

    def __init__(self, pause: float = 0.0, fail: int = 0, info: str = "int") -> None:
        self.observation_space = Box(-10.0, 10.0, (3,), np.float32)
        self.action_space = Discrete(3)
        self.pause, self.fail, self.t, self.info = pause, fail, 0, info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.random(3).astype(np.float32), {}

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        self.t += 1
        if self.fail and self.t == self.fail:
            raise ZeroDivisionError("the env divided by zero")
        if self.pause:
            time.sleep(self.pause)
        obs = self.np_random.random(3).astype(np.float32) + float(action)
        info: dict[str, Any] = {}
        if self.t % 3 == 0:
            info = {"t": str(self.t)} if self.info == "text" else {"t": self.t}
            if self.info == "mixed":
                info.update(x=np.float32(self.t / 4), ok=self.t % 2 == 0, v=float(obs[0]))
        return obs, float(action) - 1.0, self.t % 7 == 0, False, info


@pytest.fixture
def polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts poll (and take quiet steps in shared memory) whatever this machine's CPUs."""
    monkeypatch.setattr(hosted, "spins", lambda placement: True)


def _run(env: VectorEnv, steps: int, pause: float = 0.0) -> list[Any]:
    out: list[Any] = [env.reset(seed=5)]
    rng = np.random.default_rng(0)
    for _ in range(steps):
        if pause:
            time.sleep(pause)
        out.append(env.step(rng.integers(0, env.single_action_space.n, env.num_envs)))  # type: ignore[attr-defined]
    return out


def _same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert data_equivalence(x, y), (x, y)


def _flag_steps(env: VectorEnv) -> int:
    return sum(
        host._incarnation.handoff.sent  # type: ignore[attr-defined]
        for host in env._hosted._direct
        if host._incarnation.handoff is not None  # type: ignore[attr-defined]
    )


@contextlib.contextmanager
def _beside_the_caller(
    env: Any, steps: int, pause: float = 0.0, **placement: int
) -> Iterator[VectorEnv]:
    """``steps`` seeded steps of ``env`` placed by ``placement`` (ours, yielded for more
    checks), then of ``env`` in the caller's process alone: the same results. Which of ours went
    through shared memory depends on the machine's load (a host polls only while no other
    thread wants its CPU, see BoundedSpin): the host loop's own test below forces it."""
    num = None if isinstance(env, list) else 4
    ours = VectorEnv(env, num, **placement)
    ref = VectorEnv(env, num, n_processes=0)
    try:
        got = _run(ours, steps, pause)
        yield ours
        _same(got, _run(ref, steps, pause))
    finally:
        ours.close()
        ref.close()


@pytest.mark.parametrize("caller_envs", [0, 2])
def test_quiet_steps_through_shared_memory_equal_the_callers(
    polling: None, no_leaks: None, caller_envs: int
) -> None:
    """CartPole (no infos): the steps go through the shared block and equal the caller's own."""
    with _beside_the_caller("CartPole-v1", 300, n_processes=1, caller_envs=caller_envs):
        pass


@pytest.mark.parametrize("info", ["mixed", "text"])
def test_steps_with_infos_equal_the_callers(
    polling: None, no_leaks: None, info: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Infos every third step, episodes ending every seventh: numbers cross in the info cells,
    text in a frame the answer points to, and every result equals the caller's own (the infos'
    dtypes too)."""
    from asyncsample._info_cells import InfoCells

    reads = []
    read = InfoCells.read
    monkeypatch.setattr(InfoCells, "read", lambda self: reads.append(1) or read(self))
    fns = [lambda: InfoEnv(info=info)] * 3
    with _beside_the_caller(fns, 60, n_processes=1, caller_envs=1):
        pass
    # An info at an episode's steps 3 and 6; the seventh ends it, the eighth resets (next-step
    # autoreset): 15 of the 60 steps.
    assert len(reads) == (0 if info == "text" else 15)


def test_a_sleeping_host_and_a_sleeping_caller_are_woken(polling: None, no_leaks: None) -> None:
    """Steps longer than the caller's spin (it sleeps, the host's answers wake it), then a pause
    longer than the host's (it sleeps, and the caller's next step, a frame, wakes it)."""
    fns = [lambda: InfoEnv(pause=0.004)] * 2
    with _beside_the_caller(fns, 25, n_processes=1) as ours:
        block = ours._hosted._direct[0]._incarnation.handoff.ctl  # type: ignore[attr-defined]
        assert block[_handoff.WAITING] == 0  # the caller says when it no longer sleeps
        end = time.monotonic() + 5.0
        while block[_handoff.LOOKING] and time.monotonic() < end:
            time.sleep(0.01)
        assert block[_handoff.LOOKING] == 0  # asleep past its spin
        flagged = _flag_steps(ours)
        obs = ours.step(np.zeros(2, np.int64))[0]
        assert obs.shape == (2, 3) and _flag_steps(ours) == flagged  # a frame woke it


def test_a_failure_in_a_handed_over_step_is_the_frames(polling: None, no_leaks: None) -> None:
    """An env that raises in a step taken from the shared block: the face names it as when the
    step came as a frame."""
    env = VectorEnv([lambda: InfoEnv(), lambda: InfoEnv(fail=4)], n_processes=1)
    try:
        env.reset(seed=0)
        for _ in range(3):
            env.step(np.zeros(2, np.int64))
        with pytest.raises(SubEnvError, match="divided by zero"):
            env.step(np.zeros(2, np.int64))
    finally:
        env.close()


def test_the_host_loop_takes_flag_steps_between_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's loop (``_host_main._serve``, in a thread here, its spin always allowed): a
    step frame, then steps handed over quietly, one with infos (its frame follows the answer),
    one that fails (a failure frame), a frame again after its nap, and ``exit``."""
    from asyncsample.backends import _host_main
    from asyncsample.backends._slot import HostSlot
    from asyncsample.backends._threads import BoundedSpin
    from asyncsample.backends._transport import SLOT, Op, load_failure
    from asyncsample.backends.base import HostSpec

    monkeypatch.setattr(BoundedSpin, "allowed", lambda self: True)
    probe = InfoEnv()
    slot = HostSlot.allocate(HostSpec(0, 2, probe.observation_space, probe.action_space, None))
    slot.group.build([[InfoEnv], [lambda: InfoEnv(fail=5)]], [1, 2])
    slot.reset(np.ones(2, np.bool_))
    raw = _block()
    caller_sock, host_sock = socket.socketpair()
    reader = _host_main.StepReader(host_sock, 0.5)
    flag = HostHandoff(raw, host_sock)
    flag.looking(False)  # as a host that has served nothing yet: asleep in its first read
    thread = threading.Thread(
        target=_host_main._serve, args=(host_sock, reader, [slot], None, flag), daemon=True
    )
    thread.start()
    caller = Handoff(raw)
    frames = caller_sock.makefile("rb")

    def frame() -> tuple[int, int, bytes]:
        length, rid, status = HEADER.unpack(frames.read(HEADER.size))
        return rid, status, frames.read(length)

    def answered() -> None:
        end = time.monotonic() + 10.0
        while not caller.answered():
            assert time.monotonic() < end, "the host did not answer the flag step"

    try:
        assert not caller.send(0, lambda _: True)  # asleep: refused, a frame goes instead
        body = SLOT.pack(0) + b"\x01\x01"
        caller_sock.sendall(HEADER.pack(len(body), 7, Op.STEP) + body)
        assert frame() == (7, ST_OK, b"")  # step 1: quiet
        for t in (2, 3, 4):
            end = time.monotonic() + 10.0
            while not caller.send(0, lambda _: True):  # it looks again once it spins
                assert time.monotonic() < end
            answered()
            if t == 3:  # infos every third step: a frame says so
                assert not caller.quiet()
                rid, status, payload = frame()
                assert (rid, status) == (FLAG_ID, ST_OK)
                assert pickle.loads(payload) == ([{"t": 3}, {"t": 3}], {})
            else:
                assert caller.quiet()
        assert slot.group.buffers.rewards.tolist() == [-1.0, -1.0]  # the buffers' actions: 0
        while not caller.send(0, lambda _: True):
            pass
        answered()  # step 5 of the second env raises
        rid, status, payload = frame()
        assert (rid, status) == (FLAG_ID, ST_FAIL)
        assert isinstance(load_failure(payload).error, ZeroDivisionError)
        caller_sock.sendall(HEADER.pack(0, 0, Op.EXIT))
        thread.join(10.0)
        assert not thread.is_alive()
    finally:
        frames.close()
        caller_sock.close()
        host_sock.close()
