"""Unit tests of what a call records: the recorder's rows and pieces, and a chunk's records.

* :mod:`asyncsample._recorder`: time-major :class:`Rows` (growth, carry-over of running
  episodes), agent-info columns with their presence, and the :class:`Recorder`'s pieces and the
  :class:`Plan` it builds from them.
* :mod:`asyncsample.backends._chunk`: the chunk buffers (views of flat step buffers), the chunk
  capacity, the reply's agent infos, and :class:`ChunkRunner` running a chunk over real envs in
  this process, where the records can be compared with what the envs did.
"""

from __future__ import annotations

import functools
import pickle
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from envs import SCRIPT, GridWorldEnv, ScriptedAgent

from asyncsample._engine import CallMode, StopRule
from asyncsample._recorder import (
    CarriedRows,
    Recorder,
    Resume,
    Rows,
    put_row,
    put_rows,
    row_of,
    store_agent_info_block,
    store_agent_infos,
)
from asyncsample.backends._chunk import (
    CHUNK_BYTES,
    ChunkBuffers,
    ChunkReply,
    ChunkRequest,
    chunk_capacity,
)
from asyncsample.backends._chunk_loop import ChunkRunner, _pack_infos
from asyncsample.batch import StepType
from asyncsample.env_group import EnvFailureError, EnvGroup, StepBuffers

N = 3  # envs per worker
OBS = np.zeros((N, 2), dtype=np.float32)
ACTIONS = np.zeros(N, dtype=np.int64)
#: Observations and last observation of one scripted episode on the 4x4 grid world.
EPISODE_OBS, EPISODE_LAST = [0, 1, 2, 6, 10, 14], 15


def filled_rows(n_rows: int) -> Rows:
    """Rows whose observation at row ``t`` of env ``e`` is ``(t, e)`` and reward ``t + e / 10``."""
    rows = Rows(N)
    for _ in range(n_rows):
        t = rows.next_row(OBS, ACTIONS)
        rows.obs[t] = np.stack([np.full(N, t), np.arange(N)], axis=1)
        rows.actions[t] = t
        rows.rewards[t] = t + np.arange(N) / 10
    return rows


# -- Rows --------------------------------------------------------------------------------------


def test_rows_grow_and_keep_what_they_hold() -> None:
    rows = filled_rows(150)  # past the first capacity (64) twice
    assert rows.size == 150 and rows.capacity == 256
    assert rows.obs[:150, :, 0].tolist() == [[t] * N for t in range(150)]
    assert rows.rewards[149].tolist() == pytest.approx([149, 149.1, 149.2])
    start = rows.reserve(200, OBS, ACTIONS)  # several rows at once, growing as often as needed
    assert start == 150 and rows.size == 350 and rows.capacity == 512
    assert rows.actions[:150].tolist() == [[t] * N for t in range(150)]


def test_dropping_rows_moves_the_rest_to_the_front() -> None:
    rows = filled_rows(10)
    store_agent_infos(rows, 0, {"v": np.arange(N, dtype=np.float64)})
    for t in range(1, 10):
        store_agent_infos(rows, t, {"v": np.full(N, float(t))})
    rows.env_infos = {2: [{"a": 1}] * N, 7: [{"b": 2}] * N}
    rows.drop_before(6)
    assert rows.size == 4
    assert rows.obs[:4, 0, 0].tolist() == [6, 7, 8, 9]
    assert rows.rewards[:4, 1].tolist() == pytest.approx([6.1, 7.1, 8.1, 9.1])
    assert rows.agent_infos["v"][:4, 0].tolist() == [6, 7, 8, 9]
    assert rows.env_infos == {1: [{"b": 2}] * N}  # re-keyed; infos of dropped rows are gone
    rows.drop_before(0)
    assert rows.size == 4
    rows.clear()
    assert rows.size == 0 and rows.env_infos == {} and rows.capacity == 64


def test_tree_rows_are_put_and_read_leaf_by_leaf() -> None:
    dst = {"a": np.zeros((4, 2)), "b": (np.zeros((4, 2), dtype=np.int64),)}
    put_row(dst, 1, {"a": np.array([1.0, 2.0]), "b": (np.array([3, 4]),)})
    put_rows(dst, 2, {"a": np.ones((5, 2)), "b": (np.full((5, 2), 7),)}, 2)
    assert dst["a"].tolist() == [[0, 0], [1, 2], [1, 1], [1, 1]]
    assert dst["b"][0][1:].tolist() == [[3, 4], [7, 7], [7, 7]]
    row = row_of(dst, 1)
    assert row["a"].tolist() == [1, 2] and row["b"][0].tolist() == [3, 4]
    flat = np.zeros((3, 2))
    put_row(flat, 0, np.array([5.0, 6.0]))
    assert row_of(flat, 0).tolist() == [5, 6]


def test_carried_rows_put_back_what_they_kept_where_the_next_call_asks() -> None:
    rows = filled_rows(4)
    rows.versions[:4] = np.arange(4)[:, None] * 10 + np.arange(N)
    store_agent_infos(rows, 3, {"logp": np.array([-1.0, -2.0, -3.0])})
    carried = CarriedRows(N)
    assert not carried
    carried.keep(rows, np.array([3, 1]), np.array([0, 2]))  # env 0's row 3, env 2's row 1
    assert carried and carried.count == 2 and 0 in carried and 1 not in carried
    nxt = filled_rows(2)
    nxt.obs[:] = -1
    store_agent_infos(nxt, 0, {"logp": np.zeros(N)})
    carried.put_back(nxt, np.array([1, 0]), np.array([2, 0]))  # at the next call's cursors
    assert nxt.obs[0, 0].tolist() == [3, 0] and nxt.obs[1, 2].tolist() == [1, 2]
    assert nxt.obs[0, 2].tolist() == [-1, -1]  # no other row touched
    assert nxt.actions[0, 0] == 3 and nxt.versions[0, 0] == 30 and nxt.versions[1, 2] == 12
    assert nxt.agent_infos["logp"][0, 0] == -1.0
    assert not carried  # put back: kept no more


def test_carried_rows_of_trees_and_drops() -> None:
    rows = Rows(N)
    obs = {"pos": np.zeros((N, 2)), "seen": (np.zeros(N, dtype=np.int64),)}
    for t in range(2):
        rows.next_row(obs, ACTIONS)
        rows.obs["pos"][t] = t + 1
        rows.obs["seen"][0][t] = np.arange(N) + 10 * t
    carried = CarriedRows(N)
    carried.keep(rows, np.array([1, 1, 0]), np.arange(N))
    carried.drop(np.array([True, False, False]))  # env 0's episode ended meanwhile
    carried.drop(0)  # (again: nothing)
    assert carried.count == 2 and 0 not in carried
    later = Rows(N)
    later.next_row(obs, ACTIONS)
    carried.put_back(later, 0, 1, forget=False)  # one env's row: ints
    assert later.obs["pos"][0, 1].tolist() == [2, 2] and later.obs["seen"][0][0, 1] == 11
    assert 1 in carried and carried.count == 2  # kept until dropped


# -- agent-info columns ------------------------------------------------------------------------


def _agent_info_steps() -> list[dict[str, np.ndarray]]:
    """Per step: ``logp`` always, ``value`` on every other step, ``big`` once."""
    steps = []
    for t in range(6):
        infos = {"logp": np.full(N, -float(t))}
        if t % 2 == 0:
            infos["value"] = np.full((N, 2), t, dtype=np.int32)
        if t == 3:
            infos["big"] = np.ones(N, dtype=bool)
        steps.append(infos)
    return steps


def test_agent_infos_record_where_each_key_was_present() -> None:
    rows = filled_rows(6)
    for t, infos in enumerate(_agent_info_steps()):
        store_agent_infos(rows, t, infos)
    plan = _recorder_over(rows).collect(OBS, ACTIONS)
    assert set(plan.agent_infos) == {"logp", "value", "big"}
    assert plan.agent_infos["logp"][:6, 0].tolist() == [0, -1, -2, -3, -4, -5]
    assert plan.agent_infos["value"][4, 2].tolist() == [4, 4]
    # Keys missing somewhere have a presence mask; logp, on every step, has none.
    assert set(plan.agent_info_masks) == {"value", "big"}
    assert plan.agent_info_masks["value"][:6, 0].tolist() == [True, False] * 3
    assert plan.agent_info_masks["big"][:6, 0].tolist() == [False] * 3 + [True] + [False] * 2


def test_a_block_of_agent_infos_is_stored_as_its_steps_would_be() -> None:
    steps = [{"logp": np.full(N, -float(t)), "v": np.full(N, t)} for t in range(5)]
    one_by_one, block = filled_rows(5), filled_rows(5)
    for t, infos in enumerate(steps):
        store_agent_infos(one_by_one, t, infos)
    store_agent_info_block(block, 0, 5, {k: np.stack([s[k] for s in steps]) for k in steps[0]})
    assert one_by_one.agent_infos.keys() == block.agent_infos.keys()
    for key, column in one_by_one.agent_infos.items():
        assert np.array_equal(column[:5], block.agent_infos[key][:5]), key


def test_a_key_that_changes_kind_gets_a_new_column() -> None:
    rows = filled_rows(2)
    store_agent_infos(rows, 0, {"v": np.zeros(N, dtype=np.float64)})
    store_agent_infos(rows, 1, {"v": np.array(["a"] * N)})  # a replaced agent's new dtype
    assert rows.agent_infos["v"].dtype.kind == "U"
    assert rows.agent_infos["\x00present:v"][:2, 0].tolist() == [False, True]


# -- Recorder: pieces and plans ----------------------------------------------------------------


def _recorder_over(rows: Rows) -> Recorder:
    """A recorder holding ``rows`` as one piece per env, each a whole episode from row 0."""
    recorder = Recorder(N)
    recorder.begin(Resume.NOTHING, np.zeros(N, dtype=np.int64))
    recorder.rows = rows
    for env in range(N):
        recorder.close_piece(env, rows.size, StepType.TERMINAL, np.zeros(2), {"env": env})
    return recorder


def test_pieces_become_a_plan_of_rows_envs_and_step_types() -> None:
    recorder = Recorder(N)
    recorder.begin(Resume.NOTHING, np.zeros(N, dtype=np.int64))
    recorder.rows = filled_rows(0)
    for _ in range(4):
        recorder.rows.next_row(OBS, ACTIONS)
    recorder.close_piece(1, 2, StepType.TERMINAL, np.ones(2), {"e": 1})  # rows 0-1 of env 1
    recorder.start_episodes(np.array([False, True, False]))
    recorder.close_piece(0, 4, StepType.TIMEOUT, np.ones(2), {"e": 0})  # rows 0-3 of env 0
    assert recorder.completed_steps == 6
    assert recorder.open_steps() == 4  # env 2's running episode; envs 0 and 1 start at row 4
    for _ in range(2):
        recorder.rows.next_row(OBS, ACTIONS)
    recorder.close_piece(2, 6, None, np.ones(2), {"e": 2})  # a fragment: its episode goes on
    assert recorder.completed_steps == 6  # fragments are not completed episodes
    plan = recorder.collect(OBS, ACTIONS)
    assert plan.lengths.tolist() == [2, 4, 6]
    assert plan.rows.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert plan.envs.tolist() == [1, 1, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2]
    first, mid, term, out = StepType.FIRST, StepType.MID, StepType.TERMINAL, StepType.TIMEOUT
    assert plan.step_types.tolist() == [first, term, first, mid, mid, out, first] + [mid] * 5
    assert [i["e"] for i in plan.episode_infos] == [1, 0, 2]
    assert recorder.pieces == [] and recorder.completed_steps == 0


def test_a_continued_fragment_does_not_start_with_first() -> None:
    recorder = Recorder(1)
    recorder.begin(Resume.FRAGMENTS, np.array([5]))  # the episode had taken 5 steps already
    recorder.rows = Rows(1)
    for _ in range(3):
        recorder.rows.next_row(OBS[:1], ACTIONS[:1])
    recorder.close_piece(0, 3, StepType.TERMINAL, np.zeros(2), {})
    plan = recorder.collect(OBS[:1], ACTIONS[:1])
    assert plan.step_types.tolist() == [StepType.MID, StepType.MID, StepType.TERMINAL]


def test_running_episodes_keep_their_rows_into_the_next_call() -> None:
    recorder = Recorder(2)
    recorder.begin(Resume.NOTHING, np.zeros(2, dtype=np.int64))
    rows = recorder.rows
    for t in range(5):
        row = rows.next_row(OBS[:2], ACTIONS[:2])
        rows.obs[row] = t
    recorder.close_piece(0, 3, StepType.TERMINAL, np.zeros(2), {})  # env 0: rows 0-2
    recorder.collect(OBS[:2], ACTIONS[:2])
    recorder.end(Resume.EPISODES)  # env 0 from row 3, env 1 from row 0, still running
    recorder.begin(Resume.EPISODES, np.array([2, 5]))
    assert rows.size == 5 and recorder.piece_start.tolist() == [3, 0]  # nothing to drop: row 0
    recorder.close_piece(1, 5, StepType.TERMINAL, np.zeros(2), {})
    recorder.end(Resume.EPISODES)  # now env 0's rows (from 3) are the oldest still needed
    recorder.begin(Resume.EPISODES, np.array([2, 0]))
    assert rows.size == 2 and rows.obs[:2, 0, 0].tolist() == [3, 4]
    assert recorder.piece_start.tolist() == [0, 2]
    recorder.end(Resume.NOTHING)
    recorder.begin(Resume.NOTHING, np.array([7, 1]))  # a fresh call forgets them
    assert rows.size == 0 and recorder.piece_position.tolist() == [7, 1]


# -- chunk buffers, capacity and replies -------------------------------------------------------


def test_chunk_buffers_are_views_of_flat_step_buffers() -> None:
    space = gym.spaces.Dict({"x": gym.spaces.Box(-1, 1, (2,)), "n": gym.spaces.Discrete(3)})
    flat = StepBuffers.allocate(space, gym.spaces.Discrete(2), 4 * N)
    chunk = ChunkBuffers.from_flat(flat, 4, N)
    assert chunk.obs["x"].shape == (4, N, 2) and chunk.rewards.shape == (4, N)
    chunk.obs["x"][2, 1] = [0.5, -0.5]
    chunk.rewards[3, 2] = 7.0
    chunk.terminated[1, 0] = True
    assert flat.obs["x"][2 * N + 1].tolist() == [0.5, -0.5]  # the same memory
    assert flat.rewards[3 * N + 2] == 7.0 and flat.terminated[1 * N + 0]


def test_chunk_capacity_is_the_steps_asked_unless_rows_are_large() -> None:
    small = gym.spaces.Box(-1, 1, (4,), np.float32)
    assert chunk_capacity(small, gym.spaces.Discrete(2), N, 64) == 64
    frame = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)
    capacity = chunk_capacity(frame, gym.spaces.Discrete(2), 16, 64)
    assert 1 <= capacity < 64
    assert capacity * 16 * 2 * 84 * 84 * 4 <= CHUNK_BYTES  # obs and final obs fit the budget
    # With an observation arena the chunk's observations go there: final observations count.
    assert chunk_capacity(frame, gym.spaces.Discrete(2), 16, 64, arena=True) == 64
    huge = gym.spaces.Box(0, 255, (4096, 4096), np.uint8)
    assert chunk_capacity(huge, gym.spaces.Discrete(2), 1, 64) == 1  # never below one step
    # No arena fits two chunks of such rows: the budget without one.
    assert chunk_capacity(huge, gym.spaces.Discrete(2), 64, 64, arena=True) == 1


def test_agent_infos_of_a_chunk_are_stacked_when_they_can_be() -> None:
    same = [{"logp": np.full(N, -float(j))} for j in range(3)]
    stacked = _pack_infos(same)
    assert isinstance(stacked, dict) and stacked["logp"].shape == (3, N)
    reply = ChunkReply(3, stacked)
    assert reply.infos_at(2)["logp"].tolist() == [-2.0] * N
    ragged = [{"logp": np.zeros(N)}, {}, {"logp": np.zeros(N), "v": np.ones(N)}]
    listed = _pack_infos(ragged)
    assert isinstance(listed, list) and [j for j, _ in listed] == [0, 2]
    reply = ChunkReply(3, listed)
    assert reply.infos_at(1) == {} and set(reply.infos_at(2)) == {"logp", "v"}
    assert _pack_infos([]) == [] and _pack_infos([{}, {}]) == []


# -- ChunkRunner over real envs ----------------------------------------------------------------


class ResettingAgent(ScriptedAgent):
    """The scripted agent; records the masks of its ``reset`` calls and returns agent infos."""

    def __init__(self) -> None:
        super().__init__()
        self.resets: list[list[bool]] = []

    def get_actions(self, observations: np.ndarray) -> Any:
        actions, _ = super().get_actions(observations)
        return actions, {"obs_seen": np.asarray(observations, dtype=np.int64)}

    def reset(self, mask: np.ndarray) -> None:
        self.resets.append(mask.tolist())


def runner(agent: Any, capacity: int = 20, n_envs: int = 2) -> ChunkRunner:
    """A chunk runner over ``n_envs`` 4x4 grid worlds, built and reset, with ``agent``."""
    obs_space, act_space = gym.spaces.Discrete(16), gym.spaces.Discrete(4)
    buffers = StepBuffers.allocate(obs_space, act_space, n_envs)
    group = EnvGroup(0, buffers, obs_space, act_space, None)
    group.build([[functools.partial(GridWorldEnv, "4x4")]] * n_envs, list(range(n_envs)))
    group.reset(np.ones(n_envs, dtype=bool))
    chunk = ChunkBuffers.from_flat(
        StepBuffers.allocate(obs_space, act_space, capacity * n_envs), capacity, n_envs
    )
    run = ChunkRunner(group, [chunk], act_space)
    run.install(pickle.dumps((cloudpickle.dumps(agent), 0)))
    return run


def request(mode: CallMode, share: int, steps: int, n_envs: int = 2) -> ChunkRequest:
    return ChunkRequest(
        rule=StopRule.for_call(mode, share, n_envs),
        steps=steps,
        counts=np.zeros(n_envs, dtype=np.int64),
        active=np.ones(n_envs, dtype=bool),
    )


def test_a_chunk_records_every_step_and_stops_where_the_call_would() -> None:
    run = runner(ResettingAgent())
    reply = run.run(request(CallMode.SAMPLES, 12, steps=20))
    # Both envs end their 6-step episode at step 6: 12 samples, the call's share; no 7th step.
    assert reply.steps == 6
    chunk = run.chunk
    for env in range(2):
        assert chunk.obs[:6, env].tolist() == EPISODE_OBS
        assert chunk.actions[:6, env].tolist() == [SCRIPT[o] for o in EPISODE_OBS]
        assert chunk.final_obs[5, env] == EPISODE_LAST  # the true last observation
        assert chunk.rewards[:6, env].tolist() == [0, 0, 0, 0, 0, 1]
    assert chunk.terminated[:6].tolist() == [[False, False]] * 5 + [[True, True]]
    assert run.group.buffers.obs.tolist() == [0, 0]  # reset in the same step: the next start
    assert isinstance(reply.agent_infos, dict)
    assert reply.agent_infos["obs_seen"][:, 0].tolist() == EPISODE_OBS
    assert run.agent.resets == [[True, True]]


def test_a_chunk_stops_at_its_size_and_the_next_one_goes_on() -> None:
    run = runner(ScriptedAgent(), capacity=4)
    first = run.run(request(CallMode.SAMPLES, 12, steps=10))
    assert first.steps == 4  # the chunk's capacity
    assert run.chunk.obs[:4, 0].tolist() == EPISODE_OBS[:4]
    again = request(CallMode.SAMPLES, 12, steps=10)
    again.counts[:] = 4
    second = run.run(again)
    assert second.steps == 2
    assert run.chunk.obs[:2, 1].tolist() == EPISODE_OBS[4:]


def test_an_episodes_call_stops_stepping_an_env_once_it_has_its_episodes() -> None:
    run = runner(ScriptedAgent())
    # Three episodes over two envs: env 0 runs two, env 1 one.
    reply = run.run(request(CallMode.EPISODES, 3, steps=20))
    assert reply.steps == 12
    assert run.chunk.obs[:12, 0].tolist() == EPISODE_OBS * 2
    # Env 1 ended its one episode at step 6; its later rows are stale (it was not stepped).
    assert run.chunk.terminated[:6, 1].tolist() == [False] * 5 + [True]
    assert run.chunk.terminated[:12, 0].tolist() == ([False] * 5 + [True]) * 2


def test_the_request_rule_is_not_consumed() -> None:
    run = runner(ScriptedAgent())
    req = request(CallMode.SAMPLES, 12, steps=20)
    run.run(req)
    assert req.rule.need == 12 and req.active.all()  # the worker's copy is its own


def test_an_agent_error_in_a_chunk_is_not_retried() -> None:
    class Raising(ScriptedAgent):
        def get_actions(self, observations: np.ndarray) -> Any:
            raise KeyError("boom")

    run = runner(Raising())
    with pytest.raises(EnvFailureError) as info:
        run.run(request(CallMode.SAMPLES, 12, steps=5))
    failure = info.value.failure
    assert failure.retry is False and isinstance(failure.error, KeyError)
    assert "the agent of worker 0 raised in its env host" in failure.error.__notes__
    assert "KeyError" in failure.traceback
