"""Faults and bad input, round 3 (issue 24): a hung step found in step_timeout in host mode,
causes kept in host mode, spaces the sampler cannot record refused up front, memory limits
checked before any work starts."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import psutil
import pytest
from envs import HangingEnv, SleepyEnv
from helpers import SamplerFactory

from asyncsample import Host, Sampler, StepTimeoutError, WorkerError
from asyncsample.backends._remote import HostDied, Incarnation, progress_poll
from asyncsample.seeding import OFF_LOOP_ENVS, worker_seeds

# The uvloop variants run in the slow pass (the default run keeps under its time budget).
pytestmark = [pytest.mark.timeout(90)]


class ValueErrorAgent:
    """Raises ``ValueError`` at its third call."""

    def __init__(self) -> None:
        self.calls = 0

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        self.calls += 1
        if self.calls == 3:
            raise ValueError("the agent's own mistake")
        return np.zeros(len(observations), dtype=np.int64), {}


class TwoArgError(Exception):
    """An exception that cannot be unpickled (its ``__init__`` needs two arguments)."""

    def __init__(self, what: str, extra: int) -> None:
        super().__init__(what)
        self.extra = extra


class UnpicklableErrorAgent(ValueErrorAgent):
    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        raise TwoArgError("cannot travel", 1)


def _original(err: BaseException) -> BaseException | None:
    """The agent's own exception: the cause of a ``WorkerError``, else the error itself."""
    return err.__cause__ if isinstance(err, WorkerError) else err


@pytest.mark.parametrize(
    ("inference", "backend"),
    [
        ("per_worker", "local"),
        ("per_worker", "process"),
        ("batched", "local"),
        ("batched", "process"),
        ("host", "process"),
    ],
)
async def test_an_agent_error_keeps_its_type_in_every_mode(
    make_sampler: SamplerFactory, inference: str, backend: str
) -> None:
    async with make_sampler(
        backend=backend, agent=ValueErrorAgent(), inference=inference, n_workers=2
    ) as s:
        with pytest.raises((ValueError, WorkerError)) as info:
            await s.obtain_samples(200)
    original = _original(info.value)
    assert isinstance(original, ValueError)
    assert str(original) == "the agent's own mistake"
    if inference == "host":
        err = info.value
        assert isinstance(err, WorkerError) and err.retry is False and err.env is None
        assert isinstance(err.__cause__, ValueError)
        assert "raised in its env host: ValueError: the agent's own mistake" in str(err)
        assert "in get_actions" in (err.remote_traceback or "")  # the agent's own frame
        assert any("raised in its env host" in n for n in getattr(original, "__notes__", ()))


async def test_an_agent_error_that_cannot_travel_is_described(
    make_sampler: SamplerFactory,
) -> None:
    async with make_sampler(
        backend="process", agent=UnpicklableErrorAgent(), inference="host", n_workers=1
    ) as s:
        with pytest.raises(WorkerError, match=r"raised in its env host: TwoArgError") as info:
            await s.obtain_samples(50)
    assert type(info.value.__cause__).__name__ == "AgentFailure"
    assert "cannot travel" in str(info.value.__cause__)
    assert info.value.retry is False


# -- spaces the sampler cannot record ---------------------------------------------------------


class CustomSpace(gym.Space[int]):
    """A space of the user's own, which the sampler cannot batch."""

    def sample(self, mask: Any = None, probability: Any = None) -> int:
        return 0

    def contains(self, x: Any) -> bool:
        return x == 0


class SpacedEnv(gym.Env[Any, Any]):
    """An env with the given spaces (never stepped: the constructor must refuse it)."""

    def __init__(self, observation_space: gym.Space[Any], action_space: gym.Space[Any]) -> None:
        self.observation_space = observation_space
        self.action_space = action_space


_BOX = gym.spaces.Box(-1, 1, (2,), np.float32)
_UNRECORDABLE = [
    # (Text, and Sequence of Box or Discrete, are recorded as columns: tests/test_text_spaces.py.)
    (
        gym.spaces.Dict({"pos": _BOX, "name": gym.spaces.Sequence(gym.spaces.Text(8))}),
        r"\['name'\] is .*\(Sequence\)",
    ),
    (
        gym.spaces.Tuple((_BOX, gym.spaces.Sequence(gym.spaces.Dict({"a": _BOX})))),
        r"\[1\] is .*\(Sequence\)",
    ),
    (gym.spaces.Graph(_BOX, gym.spaces.Discrete(3)), r" is .*\(Graph\)"),
    (gym.spaces.OneOf((_BOX, gym.spaces.Discrete(2))), r" is .*\(OneOf\)"),
    (
        gym.spaces.Dict({"a": gym.spaces.Tuple((_BOX, gym.spaces.Dict({"b": CustomSpace()})))}),
        r"\['a'\]\[1\]\['b'\] is .*\(CustomSpace\)",
    ),
]


@pytest.mark.parametrize(("space", "where"), _UNRECORDABLE)
@pytest.mark.parametrize("backend", ["local", "process"])
def test_an_observation_space_that_cannot_be_recorded_is_refused(
    space: gym.Space[Any], where: str, backend: str
) -> None:
    env = functools.partial(SpacedEnv, space, gym.spaces.Discrete(2))
    with pytest.raises(ValueError, match=r"env: observation_space" + where) as info:
        Sampler(env, backend=backend)
    message = str(info.value)
    assert "records Box, Discrete, MultiDiscrete, MultiBinary and Text" in message
    assert "ObservationWrapper" in message


@pytest.mark.parametrize(("space", "where"), _UNRECORDABLE)
def test_an_action_space_that_cannot_be_recorded_is_refused(
    space: gym.Space[Any], where: str
) -> None:
    env = functools.partial(SpacedEnv, _BOX, space)
    with pytest.raises(ValueError, match=r"env: action_space" + where) as info:
        Sampler(env, backend="local")
    assert "ActionWrapper" in str(info.value)


async def test_nested_recordable_spaces_are_accepted() -> None:
    space = gym.spaces.Dict(
        {
            "a": gym.spaces.Tuple((_BOX, gym.spaces.MultiBinary(3))),
            "b": gym.spaces.MultiDiscrete([2, 3]),
        }
    )
    env = functools.partial(SpacedEnv, space, gym.spaces.Discrete(2))
    await Sampler(env, backend="local").aclose()


# -- limits up front --------------------------------------------------------------------------


class _Memory:
    def __init__(self, available: int) -> None:
        self.available = available


def _with_memory(monkeypatch: pytest.MonkeyPatch, available: int, shm_free: int) -> None:
    """Pretend this machine has ``available`` bytes of memory and ``shm_free`` in /dev/shm."""
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(available))
    real = shutil.disk_usage

    def disk_usage(path: Any) -> Any:
        usage = real(path)
        return usage._replace(free=shm_free) if str(path) == "/dev/shm" else usage

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


@pytest.mark.parametrize("backend", ["local", "process"])
async def test_a_million_cartpoles_per_worker_are_refused_at_once(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    _with_memory(monkeypatch, available=16 << 30, shm_free=8 << 30)
    with _calls() as calls, pytest.raises(ValueError, match="envs_per_worker=1000000") as info:
        Sampler("CartPole-v1", envs_per_worker=10**6, backend=backend)
    assert calls[0] < 20_000  # at once: no work per env (a million envs would be millions)
    message = str(info.value)
    assert "2,000,000 envs" in message and "16.0 GiB is available" in message
    assert re.search(r"need about \d+\.\d GiB of memory", message)


async def test_shared_memory_is_checked_for_the_process_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _with_memory(monkeypatch, available=1 << 40, shm_free=1 << 20)
    box = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)
    env = functools.partial(SpacedEnv, box, gym.spaces.Discrete(4))
    refused = r"shared memory in /dev/shm, but only 1\.0 MiB"
    with pytest.raises(ValueError, match=refused):  # no loop runs there: by the constructor
        await asyncio.to_thread(Sampler, env, envs_per_worker=64, backend="process")
    # In a loop the spaces are read in a thread meanwhile: refused as it starts, before any host.
    sampler = Sampler(env, envs_per_worker=64, backend="process")
    with pytest.raises(ValueError, match=refused):
        await sampler.start()
    assert sampler._backend is None
    await sampler.aclose()
    await Sampler(env, envs_per_worker=64, backend="local").aclose()  # ordinary memory: fits


async def test_host_mode_counts_its_chunk_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    box = gym.spaces.Box(0, 255, (84, 84), np.uint8)
    env = functools.partial(SpacedEnv, box, gym.spaces.Discrete(4))
    # 2 workers x 8 envs x (2 x 7056 + 18) bytes: 226 KiB of step buffers, 64 times that in chunks
    _with_memory(monkeypatch, available=1 << 40, shm_free=1 << 20)
    await Sampler(env, envs_per_worker=8, backend="process").aclose()
    host = functools.partial(Sampler, env, envs_per_worker=8, backend="process", inference="host")
    with pytest.raises(ValueError, match="step and chunk buffers"):
        await asyncio.to_thread(host)  # no loop runs there: by the constructor
    sampler = host()  # in a loop: as it starts
    with pytest.raises(ValueError, match="step and chunk buffers"):
        await sampler.start()
    await sampler.aclose()


@contextlib.contextmanager
def _calls() -> Iterator[list[int]]:
    """Count the Python and C function calls this thread makes in the block (``calls[0]``): work
    that grows with the number of envs shows as calls, on a loaded machine as on a quiet one."""
    calls = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    sys.setprofile(count)
    try:
        yield calls
    finally:
        sys.setprofile(None)


async def test_a_large_sampler_is_built_without_stalling_the_loop() -> None:
    """Building a sampler in a running loop (what blocks the loop) does the same work for
    100,000 envs per worker as for one: no call per env (the spaces are read in a thread)."""
    built = []
    for n in (1, 1, 100_000):  # the first one imports and caches what a build needs
        with _calls() as calls:
            try:
                sampler = Sampler("CartPole-v1", envs_per_worker=n, backend="process")
            except ValueError as exc:  # a small machine: refused at once, with the reason
                assert "need about" in str(exc)
                sampler = None
        built.append(calls[0])
        if sampler is not None:
            await sampler.aclose()
    assert built[2] < built[1] + 1_000, built  # per env: 100,000 calls at the least


def test_lazy_seeds_are_the_seeds_spawn_gives() -> None:
    _, seeds = worker_seeds(7, 2, 5)
    root = np.random.SeedSequence(7)
    for worker, child in zip(seeds, root.spawn(2), strict=True):
        agent, *envs = child.spawn(1 + 5)
        assert worker.agent_seed == int(agent.generate_state(1, np.uint32)[0])
        expected = [int(e.spawn(1)[0].generate_state(1, np.uint32)[0]) for e in envs]
        assert worker.next_env_seeds() == expected
    assert worker_seeds(7, 1, 10**7)[1][0].next_env_seed(10**7 - 1) > 0  # no spawning of all


async def test_many_env_seeds_are_drawn_off_the_loop() -> None:
    n = OFF_LOOP_ENVS  # the fewest that are drawn in a thread (fewer are drawn inline)
    _, (threaded,) = worker_seeds(3, 1, n)
    _, (inline,) = worker_seeds(3, 1, n)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)  # (a loop of sleep(0) fights the thread for the GIL)

    ticker = asyncio.create_task(tick())
    seeds = await threaded.next_env_seeds_off_loop()
    ticker.cancel()
    assert seeds == inline.next_env_seeds()
    assert ticks > 1  # the loop kept running while they were drawn
    assert await threaded.next_env_seeds_off_loop() == inline.next_env_seeds()  # next ones


# -- item 1: step_timeout means one step in host mode --------------------------------------------


@pytest.fixture(params=["process", "ray"])
def backend(request: pytest.FixtureRequest) -> str:
    """The backends that run chunks of steps in their hosts (Ray's variants are slow)."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return str(request.param)


def _one_env(
    make_sampler: SamplerFactory,
    env: Any,
    chunk_steps: int,
    backend: str,
    n_workers: int = 1,
    max_restarts: int = 0,
) -> Sampler:
    """A host-mode sampler of ``n_workers`` workers of one env each, all on one host,
    ``step_timeout=0.5``."""
    return make_sampler(
        backend=backend,
        env=env,
        inference=Host(chunk_steps=chunk_steps),
        n_workers=n_workers,
        envs_per_worker=1,
        n_processes=1,
        step_timeout=0.5,
        max_restarts=max_restarts,
    )


async def test_a_hung_step_of_a_chunk_fails_in_step_timeout(
    tmp_path: Any, make_sampler: SamplerFactory, backend: str
) -> None:
    # The env hangs 8 s in the 5th step of a 64-step chunk: found after 0.5 s. A limit of the
    # chunk's 64 x 0.5 s would let the hang end and the chunk finish: no error at all.
    env = functools.partial(HangingEnv, 5, 8.0, str(tmp_path / "hung"))
    async with _one_env(make_sampler, env, 64, backend) as s:
        with pytest.raises(StepTimeoutError) as info:
            await s.obtain_fragments(64)
    message = str(info.value)
    assert "step 5 of a chunk took longer than step_timeout=0.5s" in message, message
    assert "was killed" in message, message
    assert info.value.worker == 0


async def test_a_hung_step_of_a_chunk_is_restarted_in_step_timeout(
    tmp_path: Any, make_sampler: SamplerFactory, backend: str
) -> None:
    # An 8 s hang, once (the flag): the host is killed at 0.5 s and a new one finishes the call.
    # Judged by the chunk's 64 x 0.5 s (before: 32 s to notice a hang for good), the hang would
    # end within it: no restart. Both workers lived on the host: each counts the restart.
    env = functools.partial(HangingEnv, 9, 8.0, str(tmp_path / "hung"))
    async with _one_env(make_sampler, env, 64, backend, n_workers=2, max_restarts=2) as s:
        await s.obtain_fragments(8)  # the host is up, nobody has hung yet
        batch = await s.obtain_fragments(200)
        assert s.last_stats is not None and s.last_stats.restarts == 2
    assert batch.lengths.sum() >= 200


@pytest.mark.slow  # seconds of deliberate waiting; the slow pass runs it
async def test_a_slow_step_that_keeps_going_does_not_time_out(
    make_sampler: SamplerFactory, backend: str
) -> None:
    # 16 steps of 0.3 s in one chunk: 4.8 s, every step well within step_timeout=0.5 (no
    # restarts allowed: a chunk judged as a whole would fail the call).
    async with _one_env(make_sampler, functools.partial(SleepyEnv, 0.3), 16, backend) as s:
        batch = await s.obtain_fragments(16)
        assert s.restarts == 0
    assert batch.lengths.sum() == 16


# How Ray judges each step (by asking the actor): tests/test_ray_timeout.py.


class _Clock:
    """A loop whose time and timers the test drives: ``call_later`` only records."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.now = 0.0
        self.timers: list[tuple[float, Any, tuple[Any, ...]]] = []

    def create_future(self) -> asyncio.Future[Any]:
        return self.loop.create_future()

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, fn: Any, *args: Any) -> Any:
        self.timers.append((self.now + delay, fn, args))
        return _Handle()

    def advance_to_next(self) -> None:
        """Move the time to the next timer and fire it."""
        when, fn, args = self.timers.pop(0)
        self.now = when
        fn(*args)


class _Handle:
    def cancel(self) -> None:
        pass


class _Host(Incarnation):
    def describe(self) -> str:
        return "fake host"

    def _kill(self) -> None:
        pass


async def test_a_chunk_is_judged_by_how_long_its_step_counter_stands_still() -> None:
    clock = _Clock()
    host = _Host(clock)  # type: ignore[arg-type]
    counter = np.zeros(1, np.int64)
    counter[0] = 7  # earlier chunks' steps
    call = host.new_call("chunk", 3, 1.0, counter)
    assert clock.timers[0][0] == pytest.approx(progress_poll(1.0)) == pytest.approx(0.1)
    # Steps of 0.9 s each, for far longer than the timeout: never killed.
    for step in range(1, 40):
        while clock.now < step * 0.9 - 1e-9:
            clock.advance_to_next()
            assert not host.dead
        counter[0] += 1
    assert clock.now > 30.0 and not host.dead
    # Then a step hangs: killed between 1.0 and 1.1 s after the last step ended.
    hang = clock.now
    while not host.dead:
        clock.advance_to_next()
    assert 1.0 <= clock.now - hang <= 1.0 + progress_poll(1.0) + 1e-9
    assert call.timed_out
    assert "step 40 of a chunk of worker 3 took longer than step_timeout=1s" in host.reason
    with pytest.raises(HostDied):
        call.future.result()


async def test_a_call_without_a_counter_keeps_one_timeout_for_the_whole_call() -> None:
    clock = _Clock()
    host = _Host(clock)  # type: ignore[arg-type]
    call = host.new_call("step", 0, 2.0)
    assert [t[0] for t in clock.timers] == [2.0]
    clock.advance_to_next()
    assert host.dead and call.timed_out
    assert "a step of worker 0 took longer than step_timeout=2s" in host.reason
