"""Chunks of several slots of one env host run side by side, one agent call a step for all
(``asyncsample.backends._chunk_loop.run_joint``), with the results of each slot alone."""

from __future__ import annotations

import functools
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
from async_envs import CountingAsyncEnv
from envs import NoisyEnv, first_to_claim
from helpers import SamplerFactory

from asyncsample import AgentRowsError
from asyncsample._engine import CallMode, StopRule
from asyncsample.agent import RandomAgent
from asyncsample.backends import ChunkReply, ChunkRequest
from asyncsample.backends._chunk import chunk_rows, chunk_sets
from asyncsample.backends._chunk_loop import ChunkRunner, run_joint, split_output
from asyncsample.env_group import EnvFailureError, EnvGroup, StepBuffers

pytestmark = pytest.mark.timeout(120)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Linear:
    """Deterministic: the action of a row depends on that row alone. Logs each call's rows."""

    def __init__(self, log: str | None = None) -> None:
        self.log = log

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        obs = np.asarray(observations)
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{len(obs)}\n")
        actions = (np.floor((obs[:, 0] + 1.0) * 1.5)).clip(0, 2).astype(np.int64)
        return actions, {"first": obs[:, 0].copy()}

    def get_param_values(self) -> dict[str, int]:
        return {}

    def set_param_values(self, params: Any) -> None:
        pass


class Seeded(Linear):
    def seed(self, seed: int) -> None:
        pass


class Recurrent(Linear):
    def reset(self, mask: Any = None) -> None:
        pass


class Quiet(Linear):
    """Linear's actions without agent infos: the merged output is checked at once."""

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return super().get_actions(observations)[0], {}


class OneAtATime(Linear):
    merge_rows = False


class FailsRow(Linear):
    """Fails the first row it sees whose first observation is above 0.5, once (``flag``)."""

    def __init__(self, flag: str) -> None:
        super().__init__()
        self.flag = flag

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        actions, infos = super().get_actions(observations)
        rows = np.flatnonzero(np.asarray(observations)[:, 0] > 0.5)
        if len(rows) and first_to_claim(self.flag):
            raise AgentRowsError(actions, infos, {int(rows[0]): RuntimeError("lost")})
        return actions, infos


def runner(
    worker: int, agent: Any, n_envs: int = 2, seed: int = 0, capacity: int = 8
) -> ChunkRunner:
    """A chunk runner of ``worker`` over ``n_envs`` reset NoisyEnvs with a copy of ``agent``
    (or of the agent pickled in ``agent``: copies of one pickle, as the sampler sends them)."""
    env = NoisyEnv()
    obs, act = env.observation_space, env.action_space
    group = EnvGroup(worker, StepBuffers.allocate(obs, act, n_envs), obs, act, 30)
    group.build([[NoisyEnv]] * n_envs, [seed + i for i in range(n_envs)])
    group.reset(np.ones(n_envs, dtype=bool))
    flat = StepBuffers.allocate(obs, act, chunk_rows(capacity) * n_envs)
    chunk_runner = ChunkRunner(group, chunk_sets(flat, capacity, n_envs), act)
    blob = agent if isinstance(agent, bytes) else cloudpickle.dumps(agent)
    chunk_runner.install(pickle.dumps((blob, 100 + worker)))  # each its worker's seed
    return chunk_runner


def request(steps: int, n_envs: int = 2) -> ChunkRequest:
    rule = StopRule.for_call(CallMode.FRAGMENTS, steps * n_envs, n_envs)
    return ChunkRequest(rule, 8, np.zeros(n_envs, np.int64), np.ones(n_envs, dtype=bool))


def records(r: ChunkRunner, reply: ChunkReply) -> list[np.ndarray]:
    chunk = r.chunks[0]
    n = reply.steps
    return [chunk.obs[:n], chunk.actions[:n], chunk.rewards[:n], chunk.terminated[:n]]


def test_copies_alike_share_a_key_and_others_keep_their_own() -> None:
    blob = cloudpickle.dumps(Linear())
    a, b = runner(0, blob), runner(1, blob)
    assert a.copy_key is not None and a.copy_key == b.copy_key  # seeds differ: not in the key
    assert runner(2, cloudpickle.dumps(Linear("x"))).copy_key != a.copy_key  # another agent
    for agent in (Seeded(), Recurrent(), OneAtATime()):
        assert runner(0, agent).copy_key is None
    assert runner(0, RandomAgent(NoisyEnv().action_space, seed=0)).copy_key is None
    own = runner(0, blob)
    own.install(pickle.dumps((blob, None)))  # a worker's own agent: as it would go on alone
    assert own.copy_key is None
    before = a.copy_key
    a.set_params(pickle.dumps({"w": 1}))
    assert a.copy_key not in (None, before)
    b.set_params(pickle.dumps({"w": 1}))
    assert a.copy_key == b.copy_key


@pytest.mark.parametrize("agent", [Linear, Quiet])
def test_side_by_side_gives_each_slot_its_chunk_alone(tmp_path: Path, agent: type[Linear]) -> None:
    log = str(tmp_path / "calls")
    steps = [6, 4, 8]  # the second stops first: the others go on with fewer rows
    alone = [runner(w, agent(), seed=10 * w) for w in range(3)]
    replies = [r.run(request(s)) for r, s in zip(alone, steps)]
    blob = cloudpickle.dumps(agent(log))
    joint = [runner(w, blob, seed=10 * w) for w in range(3)]
    results = run_joint(joint, [request(s) for s in steps])
    for r_alone, reply, r_joint, result in zip(alone, replies, joint, results):
        assert isinstance(result, ChunkReply)
        assert result.steps == reply.steps
        for x, y in zip(records(r_alone, reply), records(r_joint, result)):
            np.testing.assert_array_equal(x, y)
        if agent is Linear:
            np.testing.assert_array_equal(result.agent_infos["first"], reply.agent_infos["first"])  # type: ignore[call-overload,index]
        else:
            assert not result.agent_infos and not reply.agent_infos
        np.testing.assert_array_equal(r_alone.group.buffers.obs, r_joint.group.buffers.obs)
    calls = [int(n) for n in Path(log).read_text().split()]
    assert calls == [6] * 4 + [4] * 2 + [2] * 2  # one call a step, every slot still going


def test_a_failed_row_fails_its_own_slot_only(tmp_path: Path) -> None:
    blob = cloudpickle.dumps(FailsRow(str(tmp_path / "flag")))
    runners = [runner(w, blob, seed=10 * w) for w in range(3)]
    results = run_joint(runners, [request(8)] * 3)
    failed = [r for r in results if isinstance(r, EnvFailureError)]
    assert len(failed) == 1 and failed[0].failure.retry and failed[0].failure.env is not None
    assert "lost" in str(failed[0].failure.error)
    assert all(r.steps == 8 for r in results if isinstance(r, ChunkReply))


def test_an_action_out_of_the_space_fails_its_own_slot_as_it_would_alone() -> None:
    class OutOfSpace(Quiet):
        def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
            actions, infos = super().get_actions(observations)
            if len(actions) == 3:  # the merged call of the 3 slots: the second's row
                actions[1] = 7
            return actions, infos

    blob = cloudpickle.dumps(OutOfSpace())
    results = run_joint([runner(w, blob, n_envs=1) for w in range(3)], [request(5, 1)] * 3)
    assert [r.steps for r in results if isinstance(r, ChunkReply)] == [5, 5]
    failed = results[1]
    assert isinstance(failed, EnvFailureError) and not failed.failure.retry
    message = str(failed.failure.error)
    assert "worker 1" in message and "outside the action space Discrete(3)" in message, message


def test_an_error_of_the_merged_call_fails_every_slot_in_it() -> None:
    class Broken(Linear):
        def get_actions(self, observations: Any) -> Any:
            raise KeyError("boom")

    blob = cloudpickle.dumps(Broken())
    results = run_joint([runner(w, blob) for w in range(2)], [request(3)] * 2)
    assert all(isinstance(r, EnvFailureError) and not r.failure.retry for r in results)
    assert all("boom" in str(r.failure.error) for r in results)  # type: ignore[union-attr]


def test_an_output_not_split_by_rows_is_asked_of_each_copy() -> None:
    assert split_output(([0, 1, 2], {}), [1, 2]) is None  # a list: not rows of arrays
    assert split_output((np.zeros(3), {"x": np.zeros(2)}), [1, 2]) is None  # infos short
    parts = split_output((np.arange(3), {"x": np.arange(3) * 2}), [1, 2])
    assert parts is not None
    np.testing.assert_array_equal(parts[1][0], [1, 2])
    np.testing.assert_array_equal(parts[1][1]["x"], [2, 4])

    class Listed(Linear):
        def get_actions(self, observations: Any) -> Any:
            actions, infos = super().get_actions(observations)
            return actions.tolist(), infos

    alone = runner(0, Listed()).run(request(3))
    blob = cloudpickle.dumps(Listed())
    results = run_joint([runner(w, blob) for w in range(2)], [request(3)] * 2)
    assert [r.steps for r in results] == [alone.steps] * 2  # type: ignore[union-attr]


@pytest.mark.sampler_defaults(backend="process", env=NoisyEnv, max_episode_length=30, seed=3)
async def test_a_hosts_workers_share_its_calls_with_the_batches_of_per_worker(
    make_sampler: SamplerFactory, tmp_path: Path
) -> None:
    log = str(tmp_path / "calls")
    common = {"n_workers": 4, "envs_per_worker": 2, "n_processes": 1}
    host = make_sampler(agent=Linear(log), inference="host", **common)
    ours = [await host.obtain_fragments(400) for _ in range(2)]
    own = make_sampler(agent=Linear(), inference="per_worker", **common)
    theirs = [await own.obtain_fragments(400) for _ in range(2)]
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a.observations, b.observations)
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.rewards, b.rewards)
    calls = [int(n) for n in Path(log).read_text().split()]
    assert max(calls) == 8  # the four workers' rows in one call


class FakeReader:
    """Frames readable at once, as a host's reader would hand them over."""

    def __init__(self, frames: list[tuple[int, int, bytes]]) -> None:
        self.frames = list(frames)

    def buffered(self) -> bool:
        return bool(self.frames)

    def read(self) -> tuple[int, int, bytes]:
        return self.frames.pop(0)

    def wait_readable(self, seconds: float) -> None:
        pass


class FakeSlot:
    def __init__(self, key: bytes | None, going: bool = True) -> None:
        self.copy_key = key
        self.going = going

    def chunk_request(self, body: Any) -> bytes:
        return bytes(body)


def test_a_host_takes_each_slots_next_request_and_keeps_the_order_of_the_rest() -> None:
    from collections import deque

    from asyncsample.backends._host_main import _partners
    from asyncsample.backends._transport import SLOT, Op

    def frame(rid: int, op: int, slot: int) -> tuple[int, int, bytes]:
        return rid, op, SLOT.pack(slot) + b"r%d" % rid

    slots = [FakeSlot(b"k"), FakeSlot(b"k"), FakeSlot(b"k"), FakeSlot(b"other"), FakeSlot(b"k")]
    frames = [
        frame(10, Op.PARAMS, 1),  # slot 1's next request is not a chunk: its chunk waits
        frame(11, Op.CHUNK, 1),
        frame(12, Op.CHUNK, 2),
        frame(13, Op.CHUNK, 3),  # another agent
        frame(14, Op.CHUNK, 2),  # slot 2's second chunk: after its first
        frame(15, Op.EXIT, 0),
        frame(16, Op.CHUNK, 4),  # past the end
    ]
    backlog: deque[Any] = deque()
    taken = _partners(FakeReader(frames), backlog, slots, 0, True)  # type: ignore[arg-type]
    assert [(rid, slot) for rid, slot, _ in taken] == [(12, slots[2])]
    assert taken[0][2] == b"r12"
    assert [f[0] for f in backlog] == [10, 11, 13, 14, 15, 16]


class Parity(Linear):
    """Deterministic on the async envs' observations (step count first)."""

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        obs = np.asarray(observations)
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{len(obs)}\n")
        return (obs[:, 0].astype(np.int64) % 2), {}


def four_workers_one_host(make_sampler: SamplerFactory, env: Any, agent: Any, **kwargs: Any) -> Any:
    """A sampler of 4 workers x 2 async envs of 10 steps (``env(10)``) on one process host,
    ``agent``'s copies acting there."""
    return make_sampler(
        "process",
        functools.partial(env, 10),
        agent,
        inference="host",
        n_workers=4,
        envs_per_worker=2,
        n_processes=1,
        seed=3,
        **kwargs,
    )


async def test_the_lanes_of_a_hosts_workers_share_its_calls(
    make_sampler: SamplerFactory, tmp_path: Path
) -> None:
    """Async envs in a process host: the envs of workers alike that are ready in one pass of the
    host's loop get their actions from one call."""
    log = str(tmp_path / "calls")
    sampler = four_workers_one_host(make_sampler, CountingAsyncEnv, Parity(log), fixed_shares=True)
    batch = await sampler.obtain_fragments(400)
    assert batch.n_transitions == 400
    t = np.concatenate([e.observations[:, 0] for e in batch.split()]).astype(np.int64)
    np.testing.assert_array_equal(
        np.concatenate([e.actions for e in batch.split()]), t % 2
    )  # each env's rows acted on as the agent would alone
    calls = [int(n) for n in Path(log).read_text().split()]
    assert max(calls) > 2  # rows of several workers (2 envs each) in one call


class ShiftedParity(Parity):
    """Acts ``(step + shift) % 2``; ``shift`` is its parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = 0

    def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        obs = np.asarray(observations)
        return (obs[:, 0].astype(np.int64) + self.shift) % 2, {}

    def get_param_values(self) -> dict[str, int]:  # type: ignore[override]
        return {"shift": self.shift}

    def set_param_values(self, params: Any) -> None:
        self.shift = int(params["shift"])


@pytest.mark.parametrize("fixed_shares", [True, False])
async def test_an_update_reaches_every_lane_of_the_shared_copy(
    make_sampler: SamplerFactory, fixed_shares: bool
) -> None:
    """Each step is taken with the parameters of the version it is stamped with, while the
    hosts' copies are updated one slot after another; without fixed shares, also the steps in
    flight between calls (asked under the older version; see tests/test_lane_updates.py)."""
    sampler = four_workers_one_host(
        make_sampler,
        functools.partial(CountingAsyncEnv, latency=0.001),
        ShiftedParity(),
        fixed_shares=fixed_shares,
    )
    batches = [await sampler.obtain_fragments(200)]
    for shift in (1, 0, 1):
        batches.append(await sampler.obtain_fragments(200, agent_update={"shift": shift}))
    for batch in batches:
        assert batch.agent_versions is not None
        t = batch.observations[:, 0].astype(np.int64)
        np.testing.assert_array_equal(batch.actions, (t + batch.agent_versions) % 2)


class LateReader(FakeReader):
    """Frames readable only ``delay`` seconds after it is made, as a slow caller sends them."""

    def __init__(self, frames: list[tuple[int, int, bytes]], delay: float) -> None:
        super().__init__(frames)
        self.ready_at = time.monotonic() + delay
        self.waits = 0

    def buffered(self) -> bool:
        return time.monotonic() >= self.ready_at and bool(self.frames)

    def wait_readable(self, seconds: float) -> None:
        self.waits += 1
        time.sleep(min(seconds, max(self.ready_at - time.monotonic(), 0.0)))


def test_a_host_waits_for_the_first_chunks_of_the_workers_that_start_the_call() -> None:
    """A part's first request names the workers that start the call (``starters``): the host
    waits for their slots' first chunks (which come, one worker after another) and not for the
    others'."""
    from collections import deque

    from asyncsample.backends._host_main import JOIN_WAIT, START_WAIT, _partners
    from asyncsample.backends._transport import SLOT, Op

    slots = [FakeSlot(b"k") for _ in range(4)]
    for w, slot in enumerate(slots):
        slot.worker = w  # type: ignore[attr-defined]
    late = 4 * JOIN_WAIT
    assert late < START_WAIT / 2
    reader = LateReader([(11, Op.CHUNK, SLOT.pack(1) + b"r11")], late)
    backlog: deque[Any] = deque()
    # Workers 0 and 1 start this call (2 and 3 have no share): slot 1's chunk comes late and is
    # taken; nothing is waited for once it is in.
    taken = _partners(reader, backlog, slots, 0, True, 2)  # type: ignore[arg-type]
    assert [rid for rid, _, _ in taken] == [11]
    assert reader.waits >= 1
    reader = LateReader([], 0.0)
    assert _partners(reader, deque(), slots, 0, True, 1) == []  # type: ignore[arg-type]
    assert reader.waits == 0  # worker 0 alone starts: nobody to wait for


class StalledReader(FakeReader):
    """Its first look finds nothing and takes ``stall`` seconds (the host was not run meanwhile),
    during which its frames came."""

    def __init__(self, frames: list[tuple[int, int, bytes]], stall: float) -> None:
        super().__init__(frames)
        self.stall = stall
        self.looks = 0

    def buffered(self) -> bool:
        self.looks += 1
        if self.looks == 1:
            time.sleep(self.stall)
            return False
        return bool(self.frames)


def test_a_first_chunk_that_came_while_the_host_stood_still_is_taken() -> None:
    """Past the deadline a host still takes the partners' chunks that came before it looked at
    its clock: a host descheduled between its look at the frames and at its clock (a busy
    machine) does not run alone beside a chunk it has."""
    from collections import deque

    from asyncsample.backends._host_main import START_WAIT, _partners
    from asyncsample.backends._transport import SLOT, Op

    slots = [FakeSlot(b"k") for _ in range(2)]
    for w, slot in enumerate(slots):
        slot.worker = w  # type: ignore[attr-defined]
    reader = StalledReader([(11, Op.CHUNK, SLOT.pack(1) + b"r11")], 2 * START_WAIT)
    taken = _partners(reader, deque(), slots, 0, True, 2)  # type: ignore[arg-type]
    assert [rid for rid, _, _ in taken] == [11]


@pytest.mark.sampler_defaults(backend="process", env=NoisyEnv, max_episode_length=30, seed=3)
async def test_a_parts_first_chunk_request_names_the_workers_that_start_the_call(
    make_sampler: SamplerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncsample.backends.process import ProcessHost

    sent: list[tuple[int, int]] = []
    send = ProcessHost.send_chunk

    async def spy(self: ProcessHost, request: Any) -> Any:
        if isinstance(request, ChunkRequest):
            sent.append((self.worker, request.starters))
        return await send(self, request)

    monkeypatch.setattr(ProcessHost, "send_chunk", spy)
    sampler = make_sampler(
        agent=Linear(), inference="host", n_workers=4, envs_per_worker=2, n_processes=1
    )
    await sampler.obtain_fragments(400)  # 50 steps of each env: a chunk each, then another
    firsts = {w: s for w, s in reversed(sent)}
    assert firsts == {0: 4, 1: 4, 2: 4, 3: 4}  # every worker has a share
    assert sum(s for _, s in sent) == 16  # only a part's first request names them
    sent.clear()
    await sampler.obtain_samples(3)  # workers 0, 1 and 2 have a share, 3 none
    assert {w: s for w, s in reversed(sent)} == {0: 3, 1: 3, 2: 3}
    assert sum(s for _, s in sent) == 9
