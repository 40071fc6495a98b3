"""Where the vector-env faces step their sub-envs: the decision, its report and what forces it.

That the results are the same in every placement is checked where the faces are checked
against gymnasium and SB3 (tests/test_vector_env.py and tests/test_sb3_vec_env.py run their
equality, autoreset, call and fault checks in each placement).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv
from helpers import host_processes as our_processes

from asyncsample.backends._host_main import StepReader
from asyncsample.backends._transport import HEADER, Op
from asyncsample.backends.process import ProcessBackend
from asyncsample.vector import SubEnvError, VectorEnv, placement
from asyncsample.vector.placement import (
    Placement,
    choose,
    machine_busy,
    probe_step,
    probe_step_seconds,
    runnable,
    spins,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class BusyEnv(gym.Env[np.ndarray, int]):
    """Costs ``cost`` seconds of CPU a step (a busy wait, as a simulator costs)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, cost: float = 0.0, fail_at: int = 0) -> None:
        self.cost = cost
        self.fail_at = fail_at
        self.steps = 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return self.np_random.uniform(-1, 1, 2).astype(np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        end = time.perf_counter() + self.cost
        while time.perf_counter() < end:
            pass
        self.steps += 1
        if self.fail_at and self.steps == self.fail_at:
            raise ValueError("the busy env broke")
        obs = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        return obs, float(action), bool(obs[0] > 0.9), False, {}


@pytest.fixture
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decisions as on a quiet machine (a busy one is a test's own case), for the tests of
    the decision itself; the faces' tests see the machine as it is."""
    monkeypatch.setattr(placement, "machine_busy", lambda n_cpus: False)


# -- the decision, from its two measurements ---------------------------------------------------


@pytest.mark.usefixtures("quiet_machine")
@pytest.mark.parametrize(
    ("n", "step_us", "hop_us", "cpus", "want"),
    [
        (4, 8, 50, 2, (4, 0)),  # CartPole-like: the hop costs more than 4 steps save
        (8, 8, 50, 2, (8, 0)),
        (1, 60, 50, 2, (1, 0)),  # one env: nothing to share
        (4, 60, 50, 2, (2, 1)),  # HalfCheetah-like: the caller steps half, one host the rest
        (4, 500, 50, 2, (2, 1)),
        (8, 500, 50, 4, (2, 3)),  # more cores: more hosts, the caller keeps a share
        (4, 500, 50, 1, (4, 0)),  # one core: hosts would only add the hop
        (64, 8, 50, 2, (32, 1)),  # many cheap envs: the caller and one host, half each
    ],
)
def test_choose_predicts_the_fastest_placement(
    n: int, step_us: float, hop_us: float, cpus: int, want: tuple[int, int]
) -> None:
    got = choose(n, step_us * 1e-6, hop=hop_us * 1e-6, n_cpus=cpus)
    assert (got.caller_envs, got.n_processes) == want
    assert f"probe step {step_us:.1f} us" in got.reason


@pytest.mark.usefixtures("quiet_machine")
@pytest.mark.parametrize(
    ("n", "step_us", "want"),
    [
        (4, 6, (4, 0)),  # CartPole-v1 in CleanRL's wrappers: in-process, polling or not
        (8, 6.5, (8, 0)),
        # HalfCheetah-v5, one env: on one polling host, where it stays warm (CleanRL-shaped
        # loop, 2026-11-28: 1.10-1.23x SyncVectorEnv on a host, 0.98-1.08x in the caller's
        # process, whose step after the policy took 190 us against the probe's 80-100)
        (1, 115, (0, 1)),
        (4, 115, (2, 1)),  # HalfCheetah-v5, 4 envs: mixed, its host polling
    ],
)
def test_a_polling_host_is_predicted_with_its_own_round_trip(
    n: int, step_us: float, want: tuple[int, int]
) -> None:
    """The round trip a sleeping host costs inside a loop (its wake-up) decides nothing where
    the host will poll: measured 250 us asleep, 40 us polling (2 CPUs: a caller's share and one
    host, which polls), HalfCheetah-v5 goes to one polling host alone and mixed with 4 sub-envs;
    the cheap envs stay in the caller."""
    got = choose(n, step_us * 1e-6, hop=250e-6, polled_hop=40e-6, n_cpus=2)
    assert (got.caller_envs, got.n_processes) == want
    assert got.hop == 250e-6 and got.polled_hop == 40e-6
    assert "host round trip ~250 us (~40 us polling)" in got.reason
    if got.kind != "in-process":
        assert "(hosts polling)" in got.reason
        assert spins(got, 2)
    asleep = choose(n, step_us * 1e-6, hop=250e-6, n_cpus=2)  # as before: 250 us either way
    assert asleep.kind == "in-process"


@pytest.mark.parametrize(("n", "want"), [(8, (4, 1)), (4, (4, 0)), (1, (1, 0))])
def test_quiet_steps_put_a_cheap_env_beside_a_polling_host(n: int, want: tuple[int, int]) -> None:
    """A probe whose steps had no infos: a polling host takes them through shared memory, an
    eighth of the polled round trip (CartPole-v1's 6.5 us against ~123 us polled, 2026-11-30:
    x8 splits 4 and 4 with one host; x4 and x1 stay in the caller). Steps with infos
    still pay the frames, so the same env with infos stays in the caller."""
    got = choose(n, 6.5e-6, hop=250e-6, polled_hop=123e-6, n_cpus=2, busy=False, quiet=True)
    assert (got.caller_envs, got.n_processes) == want
    assert got.polled_hop == pytest.approx(123e-6 / 8)
    if got.kind == "mixed":
        assert "(hosts polling)" in got.reason and spins(got, 2)
    loud = choose(n, 6.5e-6, hop=250e-6, polled_hop=123e-6, n_cpus=2, busy=False)
    assert loud.kind == "in-process"


def test_the_probe_says_whether_its_steps_were_quiet() -> None:
    """CartPole-v1 returns empty infos and HalfCheetah-like envs plain numbers (they cross in the
    info cells): quiet. A string, a nested dict or a reset info at every step are frames."""
    env = gym.make("CartPole-v1")
    seconds, quiet = probe_step(env)
    assert seconds is not None and seconds > 0 and quiet
    env.close()

    class Talky(gym.Wrapper[Any, Any, Any, Any]):
        def __init__(self, env: Any, info: dict[str, Any], reset_info: bool = False) -> None:
            super().__init__(env)
            self.info, self.reset_info = info, reset_info

        def step(self, action: Any) -> Any:
            obs, reward, _, truncated, _ = self.env.step(action)
            return obs, reward, self.reset_info, truncated, dict(self.info)

        def reset(self, **kwargs: Any) -> Any:
            obs, _ = self.env.reset(**kwargs)
            return obs, dict(self.info)

    numbers = {"x": np.float64(1.0), "n": 3, "ok": True}
    for info, reset_info, quiet in [
        (numbers, False, True),  # one reset with an info, the probe's first
        (numbers, True, False),  # an episode of one step each: a reset info every step
        ({"x": "text"}, False, False),
        ({"episode": {"r": 1.0}}, False, False),
    ]:
        env = Talky(gym.make("CartPole-v1"), info, reset_info)
        assert probe_step(env)[1] is quiet, (info, reset_info)
        env.close()


def test_hosts_need_cpus_no_other_thread_wants(monkeypatch: pytest.MonkeyPatch) -> None:
    """One more runnable thread than the caller's: not busy for the caller alone, but a host
    would wait for a CPU (mixed was 0.82x Sync so, hosts 0.51x, in-process 0.92x)."""
    looked: list[int] = []

    def busy(n_cpus: int) -> bool:
        looked.append(n_cpus)
        return n_cpus < 2  # two threads runnable, this one included

    monkeypatch.setattr(placement, "machine_busy", busy)
    got = choose(4, 115e-6, hop=250e-6, polled_hop=40e-6, n_cpus=2)
    assert (got.caller_envs, got.n_processes) == (4, 0)
    assert "other threads want the CPUs they would take" in got.reason
    assert looked == [2, 1]  # the machine, then the CPU left to one polling host (looked once)
    # Hosts only (they sleep, the caller waits): the other thread would take one host's CPU.
    looked.clear()
    got = choose(4, 87e-6, hop=40e-6, polled_hop=200e-6, n_cpus=2)
    assert (got.caller_envs, got.n_processes) == (4, 0)
    assert "env-host process(es)" in got.reason and looked == [2, 1]
    monkeypatch.setattr(placement, "machine_busy", lambda n_cpus: False)
    assert choose(4, 115e-6, hop=250e-6, polled_hop=40e-6, n_cpus=2).kind == "mixed"
    assert choose(4, 87e-6, hop=40e-6, polled_hop=200e-6, n_cpus=2).kind == "hosts"


def test_the_polled_round_trip_is_measured_once_and_leaves_the_affinity_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(placement, "_polled_hop", None)
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    polled = placement.polled_hop_seconds()
    assert placement._MIN_HOP <= polled < 0.1
    assert placement.polled_hop_seconds() == polled  # measured once
    if before is not None:
        assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize(("n", "step_us"), [(4, 110), (8, 500), (64, 8)])
def test_a_busy_machine_keeps_every_sub_env_in_the_callers_process(n: int, step_us: float) -> None:
    got = choose(n, step_us * 1e-6, hop=50e-6, n_cpus=2, busy=True)
    assert (got.caller_envs, got.n_processes) == (n, 0)
    assert "the machine is busy (more threads runnable than its 2 CPUs)" in got.reason


def test_the_machine_is_busy_when_more_threads_than_cpus_are_runnable() -> None:
    assert runnable() >= 1  # this thread, at least (Linux)
    assert not machine_busy(10_000)
    assert machine_busy(0)


def test_an_env_that_cannot_be_probed_goes_to_hosts() -> None:
    class Broken(BusyEnv):
        def step(self, action: int) -> Any:
            raise RuntimeError("no")

    assert probe_step_seconds(Broken()) is None
    got = choose(4, None)
    assert got.kind == "hosts" and "could not be stepped" in got.reason


def test_the_probe_is_stepped_within_its_budget() -> None:
    env = BusyEnv(0.004)
    step = probe_step_seconds(env)
    assert step is not None and step >= 0.004
    # Its budget (20 ms) is a few of these steps: not _PROBE_STEPS of them (the first always).
    assert 1 <= env.steps < placement._PROBE_STEPS


# -- what the faces do with it -------------------------------------------------------------------


def test_cheap_envs_step_in_the_callers_process_and_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = set(our_processes())
    with caplog.at_level(logging.INFO, logger="asyncsample"):
        env = VectorEnv("CartPole-v1", 4, seed=0)
    try:
        assert env.placement.kind == "in-process" and env.n_processes == 0
        assert env.pids == [] and set(our_processes()) == before  # no process started
        assert "placement='in-process'" in repr(env) and "caller_envs=4" in repr(env)
        assert any(
            "all 4 sub-envs in the caller's process (probe step" in r.getMessage()
            for r in caplog.records
        )
        sync = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4)
        assert np.array_equal(env.reset()[0], sync.reset(seed=0)[0])
        for _ in range(50):
            a = np.array([0, 1, 1, 0])
            ours, theirs = env.step(a), sync.step(a)
            assert all(np.array_equal(x, y) for x, y in zip(ours[:4], theirs[:4]))
    finally:
        env.close()


def test_costly_envs_leave_the_callers_process(caplog: pytest.LogCaptureFixture) -> None:
    """On the machine as it is: a busy one (other threads want the CPUs) keeps them in."""
    with caplog.at_level(logging.INFO, logger="asyncsample"):
        env = VectorEnv([lambda: BusyEnv(0.002)] * 4)
    try:
        assert env.placement.env_step is not None and env.placement.env_step >= 0.002
        reason = env.placement.reason
        if "the machine is busy" in reason or "other threads want the CPUs" in reason:
            assert env.placement.kind == "in-process" and env.pids == []
        else:
            assert env.placement.kind in ("hosts", "mixed")
            assert env.n_processes >= 1 and len(env.pids) == env.n_processes
            assert any("env-host processes" in r.getMessage() for r in caplog.records)
    finally:
        env.close()


def test_forced_placements_win_over_the_measurement() -> None:
    cheap = "CartPole-v1"
    env = VectorEnv(cheap, 4, n_processes=2)
    try:
        assert env.placement.kind == "hosts" and env.placement.reason == "forced: n_processes=2"
    finally:
        env.close()
    env = VectorEnv([lambda: BusyEnv(0.002)] * 4, n_processes=0)
    try:
        assert env.placement.kind == "in-process" and env.placement.env_step is None
    finally:
        env.close()
    env = VectorEnv(cheap, 4, caller_envs=3)
    try:
        assert (env.placement.kind, env.placement.caller_envs, env.n_processes) == ("mixed", 3, 1)
    finally:
        env.close()
    # A step_timeout can only be honoured by hosts: the measurement is not asked.
    env = VectorEnv(cheap, 2, step_timeout=10.0)
    try:
        assert env.placement.kind == "hosts" and "step_timeout" in env.placement.reason
    finally:
        env.close()


def test_a_raising_sub_env_in_the_callers_share_is_named() -> None:
    fns = [lambda: BusyEnv(), lambda: BusyEnv(), lambda: BusyEnv(fail_at=3)]
    env = VectorEnv(fns, n_processes=1, caller_envs=2)
    try:
        env.reset(seed=0)
        for _ in range(2):
            env.step(np.zeros(3, np.int64))
        with pytest.raises(SubEnvError) as info:
            env.step(np.zeros(3, np.int64))
        assert info.value.sub_env == 2 and isinstance(info.value, ValueError)
        assert "the busy env broke" in str(info.value)
        assert "in step" in (info.value.remote_traceback or "")
        with pytest.raises(RuntimeError, match=r"sub-envs 1..2 .*call reset\(\) before stepping"):
            env.step(np.zeros(3, np.int64))
        obs, _ = env.reset()  # rebuilds the caller's share
        assert obs.shape == (3, 2)
        env.step(np.zeros(3, np.int64))
    finally:
        env.close()


def test_sb3_face_places_as_the_gymnasium_face() -> None:
    pytest.importorskip("stable_baselines3")
    from asyncsample.sb3 import AsyncSampleVecEnv

    env = AsyncSampleVecEnv("CartPole-v1", 4)
    try:
        assert env.placement.kind == "in-process"
        assert "placement='in-process'" in repr(env)
        assert env.reset().shape == (4, 4)
    finally:
        env.close()
    env = AsyncSampleVecEnv("CartPole-v1", 4, caller_envs=1)
    try:
        assert env.placement.kind == "mixed" and env.pids
    finally:
        env.close()


# -- the spin: hosts and caller poll where each has a CPU -----------------------------------------


@pytest.mark.parametrize(
    ("caller_envs", "n_processes", "cpus", "want"),
    [
        (2, 1, 2, True),  # mixed on 2 CPUs: the caller and its one host, a CPU each
        (0, 1, 2, True),
        (0, 2, 2, False),  # hosts on every CPU: the caller would share one with a poller
        (4, 0, 2, False),  # in-process: nothing to wait for
        (2, 3, 4, True),
        (2, 1, 1, False),
    ],
)
def test_spin_only_where_the_caller_and_every_host_have_a_cpu(
    caller_envs: int, n_processes: int, cpus: int, want: bool
) -> None:
    assert spins(Placement(caller_envs, n_processes, "test"), cpus) is want


def test_a_spinning_face_steps_as_sync_vector_env() -> None:
    env = VectorEnv([lambda: BusyEnv(0.0001)] * 4, caller_envs=2, n_processes=1)
    try:
        assert env.placement.kind == "mixed"
        sync = SyncVectorEnv([lambda: BusyEnv(0.0001)] * 4)
        assert np.array_equal(env.reset(seed=3)[0], sync.reset(seed=3)[0])
        for t in range(200):
            a = np.array([t % 2, 1, 0, t % 3 == 0], dtype=np.int64)
            ours, theirs = env.step(a), sync.step(a)
            assert all(np.array_equal(x, y) for x, y in zip(ours[:4], theirs[:4]))
            if t % 50 == 0:
                time.sleep(0.003)  # past the hosts' spin: they sleep, and are woken
    finally:
        env.close()


def _frame(rid: int) -> bytes:
    return HEADER.pack(1, rid, int(Op.STEP)) + b"x"


def test_the_step_reader_returns_for_a_buffered_frame_a_new_one_or_the_end() -> None:
    ours, theirs = socket.socketpair()
    reader = StepReader(ours, spin=3600.0)  # a wait that missed what is readable would hang
    try:
        theirs.sendall(_frame(1) + _frame(2))
        assert reader.read() == (1, int(Op.STEP), b"x")
        reader.wait_spinning()  # the second frame is in the reader's buffer already
        assert reader.read() == (2, int(Op.STEP), b"x")

        def later() -> None:
            time.sleep(0.01)
            theirs.sendall(_frame(3))

        thread = threading.Thread(target=later)
        thread.start()
        reader.wait_spinning()  # polled in the socket
        thread.join()
        assert reader.read() == (3, int(Op.STEP), b"x")
        theirs.close()
        reader.wait_spinning()  # the end of the stream is readable too
        assert reader.read() is None
    finally:
        reader.close()
        ours.close()


def test_a_reader_without_spin_returns_at_once() -> None:
    ours, theirs = socket.socketpair()
    reader = StepReader(ours)
    try:
        reader.wait_spinning()  # nothing readable: spin 0 returns (a hang would fail the test)
        assert ours.getblocking()
    finally:
        reader.close()
        ours.close()
        theirs.close()


def test_the_spin_option_is_checked() -> None:
    with pytest.raises(ValueError, match="spin_after_step must be a finite number of seconds"):
        ProcessBackend(spin_after_step=-1.0)
    with pytest.raises(TypeError, match="spin_after_step must be a number of seconds or None"):
        ProcessBackend(spin_after_step="1")  # type: ignore[arg-type]
