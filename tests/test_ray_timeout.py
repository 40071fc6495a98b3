"""``step_timeout`` per step on Ray with ``inference="host"`` (issue 24, item 1).

An actor runs a whole chunk in one call; while it does, the caller asks it how far the chunk has
got (``EnvActor.progress``, in a concurrency group of its own) and fails the chunk when that count
stands still for ``step_timeout``, as the ``process`` backend does with its shared counter. Ray
start-up is slow: every test here is in the slow run (``ray_cluster``), on both loops. A hung
step of a chunk failed or restarted, and a slow one that keeps going, are checked on Ray and on
``process`` alike in ``tests/test_faults_round3.py``.
"""

from __future__ import annotations

import asyncio
import functools
import pickle
import sys
from typing import Any

import cloudpickle
import numpy as np
import pytest
from envs import NoisyEnv, SleepyEnv
from helpers import SamplerFactory

from asyncsample import Host, Sampler, StepTimeoutError
from asyncsample.backends import HostSpec
from asyncsample.backends._ray_actor import FAIL, EnvActor
from asyncsample.backends._remote import PendingCall, slots_blob
from asyncsample.backends.ray import _Actor

pytestmark = [pytest.mark.timeout(120), pytest.mark.both_loops]


def _host_sampler(
    make_sampler: SamplerFactory,
    env: Any,
    chunk_steps: int,
    n_workers: int = 1,
    max_restarts: int = 0,
) -> Sampler:
    """A host-mode Ray sampler of ``n_workers`` workers of one env each, all on one actor,
    ``step_timeout=0.5``."""
    return make_sampler(
        backend="ray",
        env=env,
        inference=Host(chunk_steps=chunk_steps),
        n_workers=n_workers,
        envs_per_worker=1,
        n_processes=1,
        step_timeout=0.5,
        max_restarts=max_restarts,
    )


async def test_time_queued_behind_another_workers_chunk_does_not_count(
    ray_cluster: Any, make_sampler: SamplerFactory
) -> None:
    # Two workers on one actor, chunks of 4 steps of 0.3 s (1.2 s each): the second chunk waits
    # 1.2 s for the first, more than step_timeout, and its clock only starts with it.
    env = functools.partial(SleepyEnv, 0.3)
    async with _host_sampler(make_sampler, env, 4, n_workers=2) as s:
        batch = await s.obtain_fragments(16)
        assert s.restarts == 0
    assert batch.lengths.sum() == 16


class GilHoggingEnv(SleepyEnv):
    """Steps of 0.1 s (the caller sees them end), then its ``hang_at``-th step runs one long C
    loop that never lets go of the GIL (seconds on any machine, and bounded, should a kill not
    land): the actor's progress thread cannot answer meanwhile."""

    def __init__(self, hang_at: int) -> None:
        super().__init__(0.1)
        self.hang_at = hang_at
        self.steps = 0

    def step(self, action: Any) -> Any:
        self.steps += 1
        result = super().step(action)  # the 0.1 s first: the look sees the step before end
        if self.steps == self.hang_at:
            sum(range(10**9))  # one C call, the GIL held throughout
        return result


# The actors unpickle GilHoggingEnv: ship this module by value, as conftest does the envs.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


async def test_a_step_that_holds_the_gil_is_found_within_twice_step_timeout(
    ray_cluster: Any, make_sampler: SamplerFactory
) -> None:
    # The look at the counter the actor cannot answer is waited for one more step_timeout. A
    # verdict that waited for the answer would come after the C loop (seconds), which ends: the
    # counter would have moved on, and the chunk would finish without an error.
    sampler = _host_sampler(make_sampler, functools.partial(GilHoggingEnv, 5), 64)
    async with sampler as s:
        with pytest.raises(StepTimeoutError) as info:
            await s.obtain_fragments(64)
    assert "step 5 of a chunk took longer than step_timeout=0.5s" in str(info.value)


class _FakeRay:
    """Just enough of the ray module for an :class:`_Actor` that is never called."""

    @staticmethod
    def is_initialized() -> bool:
        return True


async def test_an_unanswered_look_at_the_counter_defers_the_verdict_for_one_timeout() -> None:
    # An env that hangs holding the GIL keeps the actor from answering: the verdict waits for an
    # answer at most one more step_timeout, then the chunk fails.
    actor = _Actor(_FakeRay(), None, 0, asyncio.get_running_loop())
    call = PendingCall("chunk", 0, 0.5, actor.loop.create_future())
    assert not actor._defer_timeout(call)
    actor.polling[call] = actor.loop.time()
    assert actor._defer_timeout(call)
    actor.polling[call] = actor.loop.time() - 0.6
    assert not actor._defer_timeout(call)
    call.future.cancel()


def test_the_actor_reports_the_steps_of_the_running_chunk_only() -> None:
    # The actor class without Ray: the count is relative to the chunk's start, 0 between chunks.
    probe = NoisyEnv()
    spec = HostSpec(0, 1, probe.observation_space, probe.action_space, None, chunk_steps=8)
    actor = EnvActor(slots_blob([spec]), None, "zlib")
    runner = actor.slots[0].runner
    assert runner is not None
    runner.chunk.progress[0] = 7  # never reset: what earlier chunks left
    assert actor.progress(0) == 0
    actor.chunk_start[0] = 3
    assert actor.progress(0) == 4
    actor.chunk_start.clear()
    # A chunk that fails (no agent installed here) still ends: the count is 0 again.
    reply = actor.run_chunk(0, b"not a chunk request")
    assert pickle.loads(reply)[0] == FAIL
    assert actor.chunk_start == {} and actor.progress(0) == 0


async def test_batches_with_the_progress_thread_are_those_of_the_process_backend(
    ray_cluster: Any, make_sampler: SamplerFactory
) -> None:
    # The actor with a progress group runs every other call on one thread, in order: the same
    # batches as the process backend (3 workers on 2 actors, a step_timeout that never fires).
    batches = []
    for backend in ("process", "ray"):
        async with make_sampler(
            backend=backend,
            env=NoisyEnv,
            inference=Host(chunk_steps=16),
            n_workers=3,
            envs_per_worker=2,
            n_processes=2,
            max_episode_length=40,
            seed=7,
            step_timeout=30.0,
        ) as s:
            batches.append(
                (await s.obtain_samples(150), await s.obtain_fragments(60), s.total_env_steps)
            )
    (samples_p, fragments_p, steps_p), (samples_r, fragments_r, steps_r) = batches
    assert steps_p == steps_r
    for a, b in ((samples_p, samples_r), (fragments_p, fragments_r)):
        assert np.array_equal(a.observations, b.observations)
        assert np.array_equal(a.actions, b.actions)
        assert np.array_equal(a.rewards, b.rewards)
        assert np.array_equal(a.lengths, b.lengths)
