"""Unit tests of the episode engine: the stop rules and the replay of a chunk into the records."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from asyncsample._engine import CallMode, Continuity, Episodes, StopRule, share_of
from asyncsample._quotas import SharedQuota
from asyncsample._recorder import Resume
from asyncsample._tree import tree_equal


def test_rules_stop_where_the_modes_say() -> None:
    samples = StopRule.for_call(CallMode.SAMPLES, 10, 2)
    active = np.ones(2, dtype=bool)
    assert samples.more(active)
    assert not samples.ended(np.array([0]), 7, active)
    assert samples.more(active)
    samples.ended(np.array([1]), 3, active)
    assert not samples.more(active)

    fragments = StopRule.for_call(CallMode.FRAGMENTS, 5, 2)  # ceil(5 / 2) steps of both envs
    assert fragments.steps == 3
    fragments.took(3)
    assert not fragments.more(active)
    fragments.recovered(completed_steps=2, n_envs=2)  # a restart dropped the fragments
    assert fragments.steps == 2  # ceil((5 - 2) / 2)

    episodes = StopRule.for_call(CallMode.EPISODES, 3, 2)  # env 0: 2 episodes, env 1: 1
    assert episodes.episodes_left is not None
    assert episodes.episodes_left.tolist() == [2, 1]
    assert episodes.ended(np.array([1]), 5, active)  # env 1 is done: inactive
    assert active.tolist() == [True, False]
    assert not episodes.ended(np.array([0]), 5, active)
    assert episodes.more(active)
    assert episodes.ended(np.array([0]), 5, active)
    assert not episodes.more(active)


def test_a_rule_travels_as_a_copy() -> None:
    rule = StopRule.for_call(CallMode.EPISODES, 4, 2)
    sent = pickle.loads(pickle.dumps(rule.copy()))
    sent.ended(np.array([0, 1]), 2, np.ones(2, dtype=bool))
    assert rule.episodes_left is not None and rule.episodes_left.tolist() == [2, 2]
    limited = StopRule.for_call(CallMode.FRAGMENTS, 100, 4).limited(lacking=6, n_envs=4)
    assert limited.steps == 2
    assert StopRule.for_call(CallMode.SAMPLES, 100, 4).limited(6, 4).need == 6


def test_shared_quota_and_shares() -> None:
    quota = SharedQuota(10, {0: 3, 1: 3})
    quota.report(0, 8)
    assert not quota.may_stop(0)  # the total is short
    assert quota.lacking(1) == 3
    quota.report(1, 3)
    assert quota.may_stop(0) and quota.may_stop(1)
    assert [share_of(10, 3, w) for w in range(3)] == [4, 3, 3]


def _chunk(rewards: np.ndarray, terminated: np.ndarray) -> SimpleNamespace:
    k, n = rewards.shape
    obs = np.arange(k * n, dtype=np.float32).reshape(k, n, 1)
    return SimpleNamespace(
        obs=obs,
        final_obs=obs + 100,
        actions=np.zeros((k, n), dtype=np.int64),
        rewards=rewards,
        terminated=terminated,
        truncated=np.zeros_like(terminated),
    )


@pytest.mark.parametrize("mode", [CallMode.SAMPLES, CallMode.EPISODES, CallMode.FRAGMENTS])
def test_replay_equals_step_by_step(mode: CallMode) -> None:
    rng = np.random.default_rng(3)
    k, n = 40, 3
    rewards = rng.normal(size=(k, n)) * 1e3
    terminated = rng.random((k, n)) < 0.2
    like = (np.zeros((n, 1), dtype=np.float32), np.zeros(n, dtype=np.int64))

    def fresh() -> Episodes:
        episodes = Episodes(0, n)
        episodes.begin(
            Resume.NOTHING, StopRule.for_call(mode, 40 if mode is CallMode.SAMPLES else 12, n)
        )
        episodes.started(np.ones(n, dtype=bool), {})
        return episodes

    whole = fresh()
    whole.replay(_chunk(rewards, terminated), k, {}, {}, 0, like)
    by_step = fresh()
    for j in range(k):
        if not by_step.active.any():
            break
        chunk = _chunk(rewards[j : j + 1], terminated[j : j + 1])
        chunk.obs, chunk.final_obs = chunk.obs + j * n, chunk.final_obs + j * n
        by_step.replay(chunk, 1, {}, {}, 0, like)
    # The same episodes, lengths and (bit-for-bit) returns; the same records.
    assert whole.finished == by_step.finished
    assert whole.lengths.tolist() == by_step.lengths.tolist()
    assert whole.returns.tobytes() == by_step.returns.tobytes()
    assert whole.active.tolist() == by_step.active.tolist()
    a, b = whole.recorder, by_step.recorder
    assert [(p.env, p.start, p.stop, p.end) for p in a.pieces] == [
        (p.env, p.start, p.stop, p.end) for p in b.pieces
    ]
    rows = min(a.rows.size, b.rows.size)
    assert np.array_equal(a.rows.obs[:rows], b.rows.obs[:rows])
    assert np.array_equal(a.rows.rewards[:rows], b.rows.rewards[:rows])


@pytest.mark.parametrize("mode", [CallMode.SAMPLES, CallMode.FRAGMENTS])
@pytest.mark.parametrize("everyone", [True, False])
@pytest.mark.parametrize("tree", [False, True])
def test_replay_in_one_pass_equals_the_loop_by_step(
    mode: CallMode, everyone: bool, tree: bool
) -> None:
    """A chunk's ends are closed in one pass where no end stops an env (replay's fast path):
    the same episodes, returns bit for bit, last observations, infos and counts as the loop
    over its steps (which a per-step ``record`` callback makes replay take)."""
    rng = np.random.default_rng(11)
    k, n = 50, 4
    rewards = rng.normal(size=(k, n)) * 1e3
    terminated = rng.random((k, n)) < 0.15
    truncated = (rng.random((k, n)) < 0.05) & ~terminated
    terminated[3, :] = True  # several envs ending on one step
    like_obs: Any = np.zeros((n, 1), dtype=np.float32)

    def chunk() -> SimpleNamespace:
        made = _chunk(rewards, terminated)
        made.truncated = truncated
        if tree:
            made.obs = {"a": made.obs, "b": (made.obs * 2,)}
            made.final_obs = {"a": made.final_obs, "b": (made.final_obs * 2,)}
        return made

    if tree:
        like_obs = {"a": like_obs, "b": (like_obs,)}
    like = (like_obs, np.zeros(n, dtype=np.int64))
    step_infos = {3: (None, {1: {"seed": 7}}), 20: (None, {0: {"x": 1}})}

    def replayed(record: Any) -> Episodes:
        episodes = Episodes(0, n)
        episodes.begin(Resume.NOTHING, StopRule.for_call(mode, 10_000, n))
        episodes.started(np.ones(n, dtype=bool), {})
        episodes.returns[:] = [0.1, 0.2, 0.3, 0.4]  # a running episode's return so far
        episodes.lengths[:] = [2, 0, 5, 1]
        episodes.episode_info = [episodes.fresh_info({}, i, 1) for i in range(n)]
        if not everyone:
            episodes.active[2] = False
            episodes.everyone = False
        episodes.replay(chunk(), k, {}, step_infos, 3, like, record)
        return episodes

    one_pass, by_step = replayed(None), replayed(lambda *args: None)
    assert one_pass.finished == by_step.finished and len(one_pass.finished) > 10
    assert one_pass.lengths.tolist() == by_step.lengths.tolist()
    assert one_pass.returns.tobytes() == by_step.returns.tobytes()
    assert one_pass.ends == by_step.ends
    assert one_pass.episode_info == by_step.episode_info
    assert one_pass.rule is not None and by_step.rule is not None
    assert (one_pass.rule.need, one_pass.rule.steps) == (by_step.rule.need, by_step.rule.steps)
    a, b = one_pass.recorder, by_step.recorder
    assert a.completed_steps == b.completed_steps
    assert len(a.pieces) == len(b.pieces)
    for p, q in zip(a.pieces, b.pieces, strict=True):
        assert (p.env, p.start, p.stop, p.position, p.end, p.episode_info) == (
            q.env,
            q.start,
            q.stop,
            q.position,
            q.end,
            q.episode_info,
        )
        assert tree_equal(p.last_observation, q.last_observation)
    if not everyone:  # the inactive env took no step and closed nothing
        assert 2 not in {p.env for p in a.pieces}
        assert one_pass.lengths[2] == 5 and one_pass.returns[2] == 0.3


@pytest.mark.parametrize(
    ("before", "ahead", "keeps", "after"),
    [
        (Continuity.IDLE, False, True, Continuity.IN_CALL),
        (Continuity.IN_CALL, False, False, Continuity.IN_CALL),  # the last call was cancelled
        (Continuity.BROKEN, False, False, Continuity.BROKEN),  # rebuilt before a step
        (Continuity.RAN_AHEAD, False, False, Continuity.IN_CALL),  # not a stream's next round
        (Continuity.RAN_AHEAD, True, True, Continuity.TAKING_OVER),
        (Continuity.TAKING_OVER, True, False, Continuity.IN_CALL),  # cancelled before settling
    ],
)
def test_a_call_continues_only_from_a_clean_end(
    before: Continuity, ahead: bool, keeps: bool, after: Continuity
) -> None:
    """Episodes in progress survive into the next call only from IDLE, or from RAN_AHEAD into
    a stream's next round (whose stepper then settles the chunk run ahead)."""
    episodes = Episodes(0, 2)
    episodes.needs_reset[:] = False
    episodes.lengths[:] = [3, 0]
    episodes.state = before
    episodes.begin(Resume.EPISODES, StopRule.for_call(CallMode.SAMPLES, 10, 2), ahead=ahead)
    assert episodes.state is after
    assert episodes.needs_reset.tolist() == ([False, False] if keeps else [True, True])
    episodes.end(Resume.EPISODES)
    ends = {Continuity.TAKING_OVER: Continuity.RAN_AHEAD, Continuity.BROKEN: Continuity.BROKEN}
    assert episodes.state is ends.get(after, Continuity.IDLE)
