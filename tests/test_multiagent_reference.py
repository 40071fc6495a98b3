"""The agent-death suite: the reference loop on the project's own env, whose agents die and join
at known steps (asyncsample.multiagent.testing.DEFAULT_SCHEDULE).

Each agent's segment ends where it died (terminated or truncated, as scheduled); no row appears
for a dead agent; a joining agent's segment starts on the step after it joined; the env resets
when all its agents are done. The blocking env and its async twin give the same rows, on
asyncio's default loop and on uvloop (async tests run under both in the default run).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import uvloop

from asyncsample import StepType
from asyncsample._tree import tree_equal
from asyncsample.errors import AgentStepError, ParallelEnvError
from asyncsample.multiagent import (
    AgentRows,
    RandomActions,
    Rollout,
    Turn,
    areference_rollout,
    check_parallel_env,
    reference_rollout,
)
from asyncsample.multiagent.testing import DEFAULT_SCHEDULE, AsyncRosterEnv, RosterEnv, Schedule

pytestmark = [pytest.mark.both_loops, pytest.mark.timeout(60)]

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
ENVS: dict[str, Callable[[], Any]] = {"sync": RosterEnv, "async": AsyncRosterEnv}
SPEC = check_parallel_env(RosterEnv())
EPISODE = DEFAULT_SCHEDULE.length  # 8 joint steps


def per_agent(agent: Any) -> Any:
    return agent


def rollout(kind: str, loop: str = "asyncio", n_steps: int = 3 * EPISODE, **kwargs: Any) -> Rollout:
    kwargs.setdefault("policy_mapping", per_agent)
    return reference_rollout(
        ENVS[kind],
        7,
        RandomActions(SPEC, 11),
        n_steps,
        loop_factory=LOOPS[loop],
        **kwargs,
    )


def assert_same_rows(a: AgentRows, b: AgentRows) -> None:
    for name in (
        "envs",
        "agent_ids",
        "agent_slots",
        "episodes",
        "env_steps",
        "agent_steps",
        "observations",
        "actions",
        "rewards",
        "next_observations",
        "terminations",
        "truncations",
        "env_infos",
        "action_masks",
    ):
        assert tree_equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("kind", list(ENVS))
def test_each_segment_ends_where_its_agent_died(kind: str, loop: str) -> None:
    result = rollout(kind, loop)
    assert result.joint_steps == 3 * EPISODE and result.env_episodes == 3
    assert list(result.rows) == list(SPEC.possible_agents)
    for agent, rows in result.rows.items():
        _, how = DEFAULT_SCHEDULE.leaves[agent]
        expected_steps = list(DEFAULT_SCHEDULE.env_steps(agent))
        segments = rows.segments()
        assert list(segments) == [(0, agent, episode) for episode in range(3)]
        for idx in segments.values():
            seg = rows.select(idx)
            assert seg.env_steps.tolist() == expected_steps, agent
            assert seg.agent_steps.tolist() == list(range(len(expected_steps)))
            # Only the last row ends the segment, the way the schedule says.
            assert seg.terminations.tolist() == [False] * (len(seg) - 1) + [how == "terminated"]
            assert seg.truncations.tolist() == [False] * (len(seg) - 1) + [how == "truncated"]
            last = StepType.TERMINAL if how == "terminated" else StepType.TIMEOUT
            assert seg.step_types.tolist() == [StepType.FIRST] + [StepType.MID] * (len(seg) - 2) + [
                last
            ]
            # The segment is continuous: each next observation is the next row's observation.
            for i in range(len(seg) - 1):
                assert tree_equal(_row(seg.next_observations, i), _row(seg.observations, i + 1)), (
                    agent,
                    i,
                )


def _row(tree: Any, i: int) -> Any:
    if isinstance(tree, dict):
        return {k: _row(v, i) for k, v in tree.items()}
    return tree[i]


@pytest.mark.parametrize("kind", list(ENVS))
def test_no_row_for_a_dead_agent_and_joins_start_new_segments(kind: str) -> None:
    result = rollout(kind)
    for agent, rows in result.rows.items():
        join = DEFAULT_SCHEDULE.joins[agent]
        leave, _ = DEFAULT_SCHEDULE.leaves[agent]
        assert (rows.env_steps >= join).all() and (rows.env_steps < leave).all(), agent
        assert len(rows) == 3 * (leave - join)
    # scout_1 dies on step 2: nothing of it on steps 3..8 of any episode.
    assert result.rows["scout_1"].env_steps.max() == 1
    # medic_0 joins on step 3: its first row is at env step 3, agent step 0.
    medic = result.rows["medic_0"]
    assert medic.env_steps[medic.agent_steps == 0].tolist() == [3, 3, 3]
    # 19 rows per episode, counted per joint step: 3, 3, 2, 3, 3, 2, 2, 1.
    every = AgentRows.concatenate(*[_as_one_policy(r) for r in result.rows.values()])
    per_step = np.bincount(every.env_steps, minlength=EPISODE) // 3
    assert per_step.tolist() == [3, 3, 2, 3, 3, 2, 2, 1] and len(every) == 3 * 19


def _as_one_policy(rows: AgentRows) -> AgentRows:
    """The rows with their policy renamed, so rows of several policies can be counted as one."""
    fields = {**vars(rows), "policy": "all"}
    fields["observations"] = np.zeros(len(rows))
    fields["next_observations"] = np.zeros(len(rows))
    fields["actions"] = np.zeros(len(rows))
    fields["action_masks"] = None
    fields["env_infos"] = {}
    return AgentRows(**fields)


def test_action_masks_reach_the_actions_and_the_rows() -> None:
    result = rollout("sync")
    for agent in ("scout_0", "scout_1", "tank_0"):
        rows = result.rows[agent]
        assert rows.action_masks is not None
        taken = rows.action_masks[np.arange(len(rows)), rows.actions]
        assert taken.all(), agent  # every action sampled was allowed by its mask...
        assert (rows.rewards >= 1.0).all(), agent  # ...and the env agrees
    tank = result.rows["tank_0"]
    assert tank.action_masks is not None
    np.testing.assert_array_equal(tank.action_masks, tank.observations["action_mask"] == 1)
    assert result.rows["medic_0"].action_masks is None


def test_a_mask_ignored_costs_the_env_reward() -> None:
    def first_action(turn: Turn) -> dict[Any, Any]:
        return {a: np.zeros(2, np.float32) if a == "medic_0" else 0 for a in turn.observations}

    result = reference_rollout(RosterEnv, 0, first_action, EPISODE, policy_mapping=per_agent)
    for agent in ("scout_0", "tank_0"):
        rows = result.rows[agent]
        assert rows.action_masks is not None
        np.testing.assert_array_equal(rows.rewards < 0, ~rows.action_masks[:, 0])


@pytest.mark.parametrize("loop", list(LOOPS))
def test_the_blocking_env_and_its_async_twin_give_the_same_rows(loop: str) -> None:
    sync, twin = rollout("sync", loop), rollout("async", loop)
    assert list(sync.rows) == list(twin.rows)
    for policy in sync.rows:
        assert_same_rows(sync.rows[policy], twin.rows[policy])


async def test_awaited_in_a_running_loop_it_gives_the_same_rows() -> None:
    awaited = await areference_rollout(
        AsyncRosterEnv, 7, RandomActions(SPEC, 11), 3 * EPISODE, policy_mapping=per_agent
    )
    plain = await asyncio.to_thread(rollout, "sync", "uvloop")
    for policy in plain.rows:
        assert_same_rows(awaited.rows[policy], plain.rows[policy])
    with pytest.raises(RuntimeError, match="await areference_rollout"):
        reference_rollout(RosterEnv, 0, RandomActions(SPEC), 1, policy_mapping=per_agent)


def test_the_seed_decides_the_rows() -> None:
    a, b = rollout("sync"), rollout("sync")
    for policy in a.rows:
        assert_same_rows(a.rows[policy], b.rows[policy])
    other = reference_rollout(
        RosterEnv, 8, RandomActions(SPEC, 11), 3 * EPISODE, policy_mapping=per_agent
    )
    assert not tree_equal(a.rows["scout_0"].observations, other.rows["scout_0"].observations)


def test_rows_group_by_policy() -> None:
    result = rollout("sync", policy_mapping=lambda agent: agent.split("_")[0])
    assert list(result.rows) == ["scout", "tank", "medic"]
    scouts = result.rows["scout"]
    assert set(scouts.agent_ids.tolist()) == {"scout_0", "scout_1"}
    assert len(scouts) == 3 * (7 + 2)
    # Within a policy: step by step, agents in slot order.
    first = scouts.select(scouts.episodes == 0)
    assert first.agent_ids[:4].tolist() == ["scout_0", "scout_1", "scout_0", "scout_1"]


def test_max_episode_length_cuts_episodes_and_resets_the_env() -> None:
    result = rollout("sync", n_steps=12, max_episode_length=4)
    assert result.env_episodes == 3
    scout = result.rows["scout_0"]
    assert scout.episodes.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert scout.truncations.tolist() == ([False] * 3 + [True]) * 3
    medic = result.rows["medic_0"]  # joins on step 3, acts on step 4, which is the last
    assert medic.env_steps.tolist() == [3] * 3 and medic.truncations.all()
    assert result.rows["scout_1"].env_steps.tolist() == [0, 1] * 3


def test_the_env_s_own_truncation_ends_every_live_agent() -> None:
    result = reference_rollout(
        lambda: RosterEnv(max_cycles=4),
        0,
        RandomActions(SPEC, 0),
        8,
        policy_mapping=per_agent,
    )
    assert result.env_episodes == 2
    assert result.rows["scout_0"].truncations.tolist() == ([False] * 3 + [True]) * 2
    assert result.rows["medic_0"].env_steps.tolist() == [3, 3]


def test_a_custom_schedule() -> None:
    schedule = Schedule(
        joins={"scout_0": 0, "tank_0": 1},
        leaves={"scout_0": (1, "terminated"), "tank_0": (3, "truncated")},
    )
    spec = check_parallel_env(RosterEnv(schedule))
    assert spec.possible_agents == ("scout_0", "tank_0")
    result = reference_rollout(
        lambda: RosterEnv(schedule), 0, RandomActions(spec), 6, policy_mapping=per_agent
    )
    assert result.env_episodes == 2
    assert result.rows["scout_0"].env_steps.tolist() == [0, 0]
    assert result.rows["tank_0"].env_steps.tolist() == [1, 2, 1, 2]
    assert result.rows["tank_0"].step_types.tolist() == [StepType.FIRST, StepType.TIMEOUT] * 2


def test_a_bad_actions_fn_or_env_fn_is_named() -> None:
    def none_for_tank(turn: Turn) -> dict[Any, Any]:
        return {a: 0 for a in turn.observations if a != "tank_0"}

    with pytest.raises(ValueError, match=r"missing: \[.tank_0.\]"):  # the env refuses first
        reference_rollout(RosterEnv, 0, none_for_tank, 1, policy_mapping=per_agent)
    with pytest.raises(ParallelEnvError, match=r"^env_fn: "):
        reference_rollout(RosterEnv(), 0, none_for_tank, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_steps"):
        reference_rollout(RosterEnv, 0, none_for_tank, -1)


class LenientRoster(RosterEnv):
    """Steps whatever it is given, so the tracker's check is what refuses the actions."""

    def _check_actions(self, actions: Any) -> None:
        pass


def test_an_action_for_a_dead_agent_is_refused_by_the_tracker() -> None:
    def always_scout_1(turn: Turn) -> dict[Any, Any]:
        actions = RandomActions(SPEC, 0)(turn)
        return {**actions, "scout_1": 0}

    with pytest.raises(AgentStepError, match="action for agent 'scout_1', which is done"):
        reference_rollout(LenientRoster, 0, always_scout_1, EPISODE, policy_mapping=per_agent)
