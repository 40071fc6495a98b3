"""Agents as rows: the row tracker's rules on hand-made joint steps, the policy mapping, the
pending observations per policy with their action masks, and the row columns.

The steps here are written out by hand (no env), so each rule is checked on its own: the
reference loop's suite (tests/test_multiagent_reference.py) checks them on a stepping env.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from asyncsample import StepType
from asyncsample._tree import tree_equal
from asyncsample.errors import AgentStepError, AsyncSampleError, PolicyMappingError
from asyncsample.multiagent import (
    DEFAULT_POLICY,
    AgentRows,
    JointTransition,
    RowTracker,
    action_mask_of,
    check_parallel_env,
    group_policies,
)
from asyncsample.multiagent.rows import gather_slots
from asyncsample.multiagent.testing import RosterEnv, Schedule

pytestmark = pytest.mark.timeout(60)

SPEC = check_parallel_env(RosterEnv())


def by_kind(agent: Any) -> str:
    return str(agent).split("_")[0]


def obs_of(agent: str, value: float) -> Any:
    """An observation of ``agent``'s space holding ``value``."""
    if agent == "tank_0":
        mask = np.array([1, 1, 0, 1], dtype=np.int8)
        return {"observation": np.full(2, value, np.float32), "action_mask": mask}
    if agent == "medic_0":
        return np.full(5, value / 100, np.float64)
    return np.full(3, value, np.float32)


def action_of(agent: str) -> Any:
    return np.zeros(2, np.float32) if agent == "medic_0" else 1


def joint(
    env: int,
    acting: list[str],
    value: float,
    *,
    joining: tuple[str, ...] = (),
    terminated: tuple[str, ...] = (),
    truncated: tuple[str, ...] = (),
) -> JointTransition:
    """The step of ``env`` where ``acting`` act, ``joining`` appear, the others go on."""
    listed = [*acting, *joining]
    return JointTransition(
        env=env,
        actions={a: action_of(a) for a in acting},
        observations={a: obs_of(a, value) for a in listed},
        rewards={a: value for a in listed},
        terminations={a: a in terminated for a in listed},
        truncations={a: a in truncated for a in listed},
        infos={a: {"v": value} for a in listed},
    )


def tracker(n_envs: int = 1, **kwargs: Any) -> RowTracker:
    kwargs.setdefault("policy_mapping", by_kind)
    return RowTracker(SPEC, n_envs, **kwargs)


def reset(t: RowTracker, env: int, agents: list[str], value: float = 0.0) -> None:
    t.reset(env, {a: obs_of(a, value) for a in agents}, {a: {} for a in agents})


def all_rows(outcomes: list[Any], policy: str) -> AgentRows:
    return AgentRows.concatenate(*[o.rows[policy] for o in outcomes if policy in o.rows])


# --- the policy mapping ---------------------------------------------------------------------


def test_policies_group_agents_in_env_order() -> None:
    groups = group_policies(SPEC, by_kind)
    assert groups.policies == ("scout", "tank", "medic")
    assert groups.agents_of["scout"] == ("scout_0", "scout_1")
    assert groups.policy_of["medic_0"] == "medic"
    assert groups.action_spaces["tank"] is SPEC.action_spaces["tank_0"]
    as_dict = group_policies(SPEC, {a: by_kind(a) for a in SPEC.possible_agents})
    assert as_dict == groups
    one_each = group_policies(SPEC, lambda agent: agent)
    assert one_each.policies == SPEC.possible_agents


def test_one_shared_policy_is_the_default_where_spaces_agree() -> None:
    same = {"possible_agents": ("a", "b")}
    space = gym.spaces.Box(0, 1, (2,))
    spec = type(SPEC)(
        same["possible_agents"], {"a": space, "b": space}, {"a": space, "b": space}, False
    )
    assert group_policies(spec).agents_of == {DEFAULT_POLICY: ("a", "b")}


@pytest.mark.parametrize(
    ("mapping", "words"),
    [
        (None, ["policy 'default' must share their observation space", "lambda agent: agent"]),
        ({"scout_0": "s"}, ["none for ['scout_1', 'tank_0', 'medic_0']"]),
        (lambda agent: {"id": agent}, ["hashable", "dict"]),
        (lambda agent: None, ["not None", "'scout_0'"]),
        (lambda agent: 1 / 0, ["raised ZeroDivisionError for agent 'scout_0'"]),
        (["scout"], ["expected a callable", "got list"]),
        (lambda agent: "all" if agent != "medic_0" else "m", ["'scout_0' has Box", "'tank_0'"]),
    ],
    ids=["default", "missing", "unhashable", "none", "raises", "type", "spaces differ"],
)
def test_a_bad_policy_mapping_is_named(mapping: Any, words: list[str]) -> None:
    with pytest.raises(PolicyMappingError) as caught:
        group_policies(SPEC, mapping)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, AsyncSampleError)
    assert str(caught.value).startswith("policy_mapping: ")
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


# --- the rules ------------------------------------------------------------------------------


def test_a_dying_agent_ends_its_segment_and_gets_no_more_rows() -> None:
    t = tracker()
    reset(t, 0, ["scout_0", "scout_1", "tank_0"])
    out = [t.step(**vars(joint(0, ["scout_0", "scout_1", "tank_0"], 1.0, terminated=("scout_1",))))]
    assert t.live_agents(0) == ["scout_0", "tank_0"]
    out.append(t.step(**vars(joint(0, ["scout_0", "tank_0"], 2.0, truncated=("tank_0",)))))
    out.append(t.step(**vars(joint(0, ["scout_0"], 3.0, terminated=("scout_0",)))))
    assert [len(o.ended) for o in out] == [0, 0, 1] and out[-1].ended.tolist() == [0]
    scouts = all_rows(out, "scout")
    assert scouts.agent_ids.tolist() == ["scout_0", "scout_1", "scout_0", "scout_0"]
    dead = scouts.segment(0, "scout_1", 0)
    assert len(dead) == 1 and dead.terminations.tolist() == [True]
    alive = scouts.segment(0, "scout_0", 0)
    assert alive.env_steps.tolist() == [0, 1, 2] and alive.agent_steps.tolist() == [0, 1, 2]
    assert alive.step_types.tolist() == [StepType.FIRST, StepType.MID, StepType.TERMINAL]
    tank = all_rows(out, "tank")
    assert tank.truncations.tolist() == [False, True] and tank.step_types[-1] == StepType.TIMEOUT
    assert not t.running[0] and t.env_steps[0] == 3


def test_a_joining_agent_starts_a_segment_from_the_next_step() -> None:
    t = tracker()
    reset(t, 0, ["scout_0"])
    out = [t.step(**vars(joint(0, ["scout_0"], 1.0, joining=("medic_0",))))]
    assert "medic" not in out[0].rows  # it joined: no row yet
    assert t.live_agents(0) == ["scout_0", "medic_0"]
    out.append(t.step(**vars(joint(0, ["scout_0", "medic_0"], 2.0))))
    out.append(
        t.step(**vars(joint(0, ["scout_0", "medic_0"], 3.0, terminated=("scout_0", "medic_0"))))
    )
    medic = all_rows(out, "medic")
    assert medic.env_steps.tolist() == [1, 2] and medic.agent_steps.tolist() == [0, 1]
    assert medic.step_types.tolist() == [StepType.FIRST, StepType.TERMINAL]
    np.testing.assert_array_equal(medic.observations[0], obs_of("medic_0", 1.0))  # joined with
    np.testing.assert_array_equal(medic.next_observations[0], medic.observations[1])
    assert medic.rewards.tolist() == [2.0, 3.0]  # the reward of the joining step is nobody's


def test_an_agent_joining_and_done_at_once_has_no_segment() -> None:
    t = tracker()
    reset(t, 0, ["scout_0"])
    out = t.step(**vars(joint(0, ["scout_0"], 1.0, joining=("medic_0",), terminated=("medic_0",))))
    assert "medic" not in out.rows and t.live_agents(0) == ["scout_0"]
    assert t.finished[0, SPEC.index("medic_0")]


def step_kwargs(step: JointTransition, **changes: Any) -> dict[str, Any]:
    kwargs = vars(step) | changes
    return kwargs


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"actions": {"scout_0": 1}}, ["no action for live agent 'tank_0'"]),
        (
            {"actions": {"scout_0": 1, "tank_0": 1, "medic_0": np.zeros(2)}},
            ["action for agent 'medic_0', which has not joined"],
        ),
        ({"rewards": {"scout_0": 1.0}}, ["live agent 'tank_0' is missing from the step's rewards"]),
        (
            {"terminations": {"tank_0": False}},
            ["'scout_0' is missing from the step's terminations"],
        ),
        (
            {"observations": {"scout_0": 0, "tank_0": 0, "ghost": 0}},
            ["observations hold agent 'ghost'", "possible_agents"],
        ),
    ],
    ids=["missing action", "action for a non-member", "missing reward", "missing flag", "unknown"],
)
def test_a_step_breaking_a_rule_is_named(change: dict[str, Any], words: list[str]) -> None:
    t = tracker()
    reset(t, 0, ["scout_0", "tank_0"])
    with pytest.raises(AgentStepError) as caught:
        t.step(**step_kwargs(joint(0, ["scout_0", "tank_0"], 1.0), **change))
    assert caught.value.env == 0 and str(caught.value).startswith("env 0, episode 0, step 0: ")
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))
    assert t.env_steps[0] == 0 and t.live_agents(0) == ["scout_0", "tank_0"]  # unchanged


def test_a_dead_agent_may_neither_act_nor_come_back() -> None:
    t = tracker()
    reset(t, 0, ["scout_0", "scout_1"])
    t.step(**vars(joint(0, ["scout_0", "scout_1"], 1.0, terminated=("scout_1",))))
    with pytest.raises(AgentStepError, match="action for agent 'scout_1', which is done"):
        t.step(**vars(joint(0, ["scout_0", "scout_1"], 2.0)))
    with pytest.raises(AgentStepError, match="'scout_1' is back after it was done") as caught:
        t.step(**vars(joint(0, ["scout_0"], 2.0, joining=("scout_1",))))
    assert caught.value.agent == "scout_1"


def test_stepping_outside_an_episode_is_refused() -> None:
    t = tracker(2)
    with pytest.raises(AgentStepError, match="never reset"):
        t.step(**vars(joint(0, ["scout_0"], 1.0)))
    reset(t, 0, ["scout_0"])
    t.step(**vars(joint(0, ["scout_0"], 1.0, terminated=("scout_0",))))
    with pytest.raises(AgentStepError, match="its episode has ended"):
        t.step(**vars(joint(0, ["scout_0"], 1.0)))
    with pytest.raises(AgentStepError, match="out of range"):
        t.step(**vars(joint(2, ["scout_0"], 1.0)))
    with pytest.raises(AgentStepError, match="no agent"):
        t.reset(1, {}, {})
    with pytest.raises(AgentStepError, match="reset's observations hold agent 'ghost'"):
        t.reset(0, {"scout_0": obs_of("scout_0", 0), "ghost": 0}, {})
    assert t.episodes.tolist() == [0, -1] and not t.running[0]  # unchanged


def test_max_episode_length_truncates_every_live_agent() -> None:
    t = tracker(max_episode_length=2)
    reset(t, 0, ["scout_0", "tank_0"])
    first = t.step(**vars(joint(0, ["scout_0", "tank_0"], 1.0)))
    last = t.step(**vars(joint(0, ["scout_0", "tank_0"], 2.0, joining=("medic_0",))))
    assert first.ended.size == 0 and last.ended.tolist() == [0]
    assert last.rows["scout"].truncations.tolist() == [True]
    assert last.rows["tank"].step_types.tolist() == [StepType.TIMEOUT]
    assert not t.live.any()  # the joiner never joined: the episode is over
    reset(t, 0, ["scout_0"])
    assert t.episodes[0] == 1 and t.env_steps[0] == 0


def test_several_envs_step_in_one_batch() -> None:
    t = tracker(3)
    for env in range(3):
        reset(t, env, ["scout_0", "scout_1"], value=env)
    out = t.apply(
        [
            joint(2, ["scout_0", "scout_1"], 20.0),
            joint(0, ["scout_0", "scout_1"], 0.5, terminated=("scout_0", "scout_1")),
        ]
    )
    rows = out.rows["scout"]
    assert rows.envs.tolist() == [2, 2, 0, 0]  # steps in the order given, agents in slot order
    assert rows.agent_ids.tolist() == ["scout_0", "scout_1"] * 2
    assert rows.observations[:, 0].tolist() == [2.0, 2.0, 0.0, 0.0]
    assert out.ended.tolist() == [0] and t.running.tolist() == [False, True, True]
    assert t.env_steps.tolist() == [1, 0, 1]
    with pytest.raises(AgentStepError, match="two joint steps of one env"):
        t.apply([joint(1, ["scout_0", "scout_1"], 1.0)] * 2)
    with pytest.raises(AgentStepError, match="env 0: stepped while not in an episode"):
        t.apply([joint(1, ["scout_0", "scout_1"], 1.0), joint(0, ["scout_0"], 1.0)])
    assert t.env_steps.tolist() == [1, 0, 1]  # the good step of the refused batch did not apply


# --- what the policies are asked, with the action masks --------------------------------------


def test_requests_stack_each_policys_agents_with_their_masks() -> None:
    t = tracker(2)
    mask = np.array([1, 0, 1], dtype=np.int8)
    for env in range(2):
        agents = ["scout_0", "scout_1", "tank_0", "medic_0"]
        t.reset(
            env,
            {a: obs_of(a, env) for a in agents},
            {"scout_0": {"action_mask": mask}, "scout_1": {}, "tank_0": {}},
        )
    requests = t.requests()
    assert list(requests) == ["scout", "tank", "medic"]
    scouts = requests["scout"]
    assert scouts.envs.tolist() == [0, 0, 1, 1]
    assert scouts.agent_ids.tolist() == ["scout_0", "scout_1"] * 2
    assert scouts.observations.shape == (4, 3)
    assert scouts.action_masks is not None
    assert scouts.action_masks.tolist() == [[True, False, True], [True, True, True]] * 2
    tank = requests["tank"]
    assert tank.observations["action_mask"].shape == (2, 4)  # from the observation
    assert tank.action_masks is not None and tank.action_masks[0].tolist() == [1, 1, 0, 1]
    assert requests["medic"].action_masks is None
    assert list(t.requests([1])["tank"].envs) == [1]
    split = scouts.split(np.array([2, 0, 1, 2]))
    assert split == {0: {"scout_0": 2, "scout_1": 0}, 1: {"scout_0": 1, "scout_1": 2}}


def test_the_mask_an_agent_acted_under_is_on_its_row() -> None:
    t = tracker()
    first, second = np.array([1, 0, 0], np.int8), np.array([0, 0, 1], np.int8)
    t.reset(0, {"scout_0": obs_of("scout_0", 0)}, {"scout_0": {"action_mask": first}})
    step = joint(0, ["scout_0"], 1.0)
    out1 = t.step(**step_kwargs(step, infos={"scout_0": {"action_mask": second}}))
    out2 = t.step(**step_kwargs(step, infos={"scout_0": {}}))
    rows = AgentRows.concatenate(out1.rows["scout"], out2.rows["scout"])
    assert rows.action_masks is not None
    assert rows.action_masks.tolist() == [[True, False, False], [False, False, True]]
    assert t.action_masks(0) == {"scout_0": None}  # the last info had none
    assert rows.env_infos["_action_mask"].tolist() == [True, False]


def test_action_mask_of_reads_the_observation_first() -> None:
    obs = {"action_mask": [1, 0]}
    assert action_mask_of(obs, {"action_mask": [0, 1]}).tolist() == [True, False]
    assert action_mask_of(np.zeros(2), {"action_mask": [0, 1]}).tolist() == [False, True]
    assert action_mask_of(np.zeros(2), None) is None and action_mask_of({}, {}) is None


# --- the columns ----------------------------------------------------------------------------


def test_rows_concatenate_select_and_split_into_segments() -> None:
    t = tracker(2)
    out = []
    for env in range(2):
        reset(t, env, ["scout_0", "scout_1"])
    out.append(t.apply([joint(e, ["scout_0", "scout_1"], 1.0) for e in range(2)]))
    out.append(
        t.apply([joint(e, ["scout_0", "scout_1"], 2.0, terminated=("scout_1",)) for e in range(2)])
    )
    rows = all_rows(out, "scout")
    assert len(rows) == 8 and rows.policy == "scout"
    segments = rows.segments()
    assert list(segments) == [
        (0, "scout_0", 0),
        (0, "scout_1", 0),
        (1, "scout_0", 0),
        (1, "scout_1", 0),
    ]
    assert all(rows.select(idx).agent_steps.tolist() == [0, 1] for idx in segments.values())
    picked = rows.select(rows.dones)
    assert picked.agent_ids.tolist() == ["scout_1", "scout_1"] and picked.envs.tolist() == [0, 1]
    assert tree_equal(
        AgentRows.concatenate(rows.select(slice(0, 3)), rows.select(slice(3, 8))).observations,
        rows.observations,
    )
    assert len(rows.segment(5, "scout_0", 0)) == 0
    with pytest.raises(ValueError, match="one policy"):
        AgentRows.concatenate(rows, out[0].rows["scout"].__class__(**{**vars(rows), "policy": "x"}))
    with pytest.raises(ValueError, match="at least one"):
        AgentRows.concatenate()


def test_non_string_agent_ids_are_an_object_column() -> None:
    space = gym.spaces.Discrete(2)
    spec = type(SPEC)((0, 1), {0: space, 1: space}, {0: space, 1: space}, False)
    t = RowTracker(spec)
    t.reset(0, {0: 0, 1: 1}, {})
    out = t.step(
        0,
        {0: 1, 1: 0},
        {0: 1, 1: 0},
        {0: 1.0, 1: 0.0},
        {0: True, 1: True},
        {0: False, 1: False},
        {},
    )
    rows = out.rows[DEFAULT_POLICY]
    assert rows.agent_ids.dtype == object and rows.agent_ids.tolist() == [0, 1]
    assert rows.keys() == [(0, 0, 0), (0, 1, 0)]


def test_bad_tracker_arguments() -> None:
    with pytest.raises(ValueError, match="n_envs"):
        RowTracker(SPEC, 0, policy_mapping=by_kind)
    with pytest.raises(ValueError, match="max_episode_length"):
        RowTracker(SPEC, 1, policy_mapping=by_kind, max_episode_length=0)
    with pytest.raises(PolicyMappingError):
        RowTracker(SPEC)


def test_a_schedule_that_would_end_early_is_refused() -> None:
    with pytest.raises(ValueError, match="no agent is live after step 2"):
        Schedule(
            joins={"scout_0": 0, "medic_0": 3},
            leaves={"scout_0": (2, "terminated"), "medic_0": (5, "terminated")},
        )
    with pytest.raises(ValueError, match="leave after it joins"):
        Schedule(joins={"scout_0": 2}, leaves={"scout_0": (2, "terminated")})
    with pytest.raises(ValueError, match="'terminated' or 'truncated'"):
        Schedule(joins={"scout_0": 0}, leaves={"scout_0": (2, "died")})


def test_batch_memory_carves_leaves_end_to_end_and_views_them_whole() -> None:
    """Leaves made together lie end to end in one block, so a gather of every row of them is a
    view; a block is handed out again only once nothing holds any view of it."""
    from asyncsample._memory import MIN_BYTES, BatchMemory, adjacent_rows

    memory = BatchMemory(keep=3)
    shape = (4, MIN_BYTES // 4)
    leaves = memory.empty_many([(shape, np.uint8)] * 3 + [((4,), np.int8)])
    for k, leaf in enumerate(leaves[:3]):
        leaf[:] = k
    whole = adjacent_rows(leaves[:3])
    assert whole is not None and whole.shape == (12, MIN_BYTES // 4)
    assert np.shares_memory(whole, leaves[0]) and (whole[4:8] == 1).all()
    assert adjacent_rows([leaves[1], leaves[0]]) is None  # not in memory order
    assert adjacent_rows([leaves[0], np.zeros(shape, np.uint8)]) is None
    rows = np.tile(np.arange(4), 3)
    which = np.repeat(np.arange(3), 4)
    gathered = gather_slots(leaves[:3], rows, which, memory, view=True)
    assert np.shares_memory(gathered, leaves[0])  # every row in order: a view
    copied = gather_slots(leaves[:3], rows[::-1].copy(), which, memory, view=True)
    assert not np.shares_memory(copied, leaves[0]) and (copied[:4] == 0).all()
    assert not np.shares_memory(gather_slots(leaves[:3], rows, which, memory), leaves[0])
    address = leaves[0].__array_interface__["data"][0]
    held = gathered[5:6]
    del leaves, leaf, whole, gathered
    other = memory.empty_many([(shape, np.uint8)] * 3)  # the first block is held by `held`
    assert other[0].__array_interface__["data"][0] != address
    reused = memory.reused
    del held
    again = memory.empty_many([(shape, np.uint8)] * 3)  # now nothing holds it
    assert memory.reused == reused + 1 and again[0].__array_interface__["data"][0] == address
    small = memory.empty((3,), np.float64)  # small arrays are plain np.empty
    assert small.base is None


def test_arrays_that_lie_end_to_end_by_chance_are_not_joined() -> None:
    """Two arrays of their own may sit one after the other in memory (shared blocks allocated
    in turn): a view of both would reach past the first's owner, so they are not joined."""
    from asyncsample._memory import adjacent_rows

    memory = bytes(48)
    first = np.frombuffer(memory, np.float32, count=6).reshape(2, 3)
    second = np.frombuffer(memory, np.float32, count=6, offset=24).reshape(2, 3)
    assert (
        first.__array_interface__["data"][0] + first.nbytes
        == (second.__array_interface__["data"][0])
    )
    assert adjacent_rows([first, second]) is None
    block = np.zeros((4, 3), np.float32)
    joined = adjacent_rows([block[0:2], block[2:4]])  # one owner: a view
    assert joined is not None and np.shares_memory(joined, block)


@pytest.mark.parametrize("shared", [False, True])
def test_step_buffers_lay_a_tuple_of_equal_slots_end_to_end(shared: bool) -> None:
    """A multi-agent env's joint observation holds one leaf per agent slot: when the slots'
    spaces are equal, their buffers are one block, so a policy's rows of them are a view in the
    hosts and the caller (no copy of every observation per step); other tuples stay apart."""
    import multiprocessing

    import gymnasium as gym

    from asyncsample._memory import adjacent_rows
    from asyncsample.backends._transport import shared_buffers, view_buffers
    from asyncsample.env_group import StepBuffers

    slot = gym.spaces.Box(0, 255, (6, 5, 3), np.uint8)
    obs_space = gym.spaces.Dict(
        {
            "agents": gym.spaces.Tuple([slot] * 4),
            "mixed": gym.spaces.Tuple([slot, gym.spaces.Box(0, 1, (2,), np.float32)]),
        }
    )
    act_space = gym.spaces.Tuple([gym.spaces.Box(-1, 1, (1,), np.float32)] * 4)
    if shared:
        made, raw = shared_buffers(obs_space, act_space, 3, multiprocessing.get_context("spawn"))
        buffers = view_buffers(obs_space, act_space, 3, raw)  # the host's view of them
    else:
        buffers = StepBuffers.allocate(obs_space, act_space, 3)
    agents = list(buffers.obs["agents"])
    assert all(leaf.shape == (3, 6, 5, 3) and leaf.dtype == np.uint8 for leaf in agents)
    for k, leaf in enumerate(agents):
        leaf[:] = k
    whole = adjacent_rows(agents)
    assert whole is not None and whole.shape == (12, 6, 5, 3)
    assert (whole[3:6] == 1).all() and (whole[9:] == 3).all()
    gathered = gather_slots(agents, np.tile(np.arange(3), 4), np.repeat(np.arange(4), 3), view=True)
    assert np.shares_memory(gathered, agents[0])
    assert adjacent_rows(list(buffers.final_obs["agents"])) is not None
    assert adjacent_rows(list(buffers.actions)) is not None
    mixed = buffers.obs["mixed"]
    assert mixed[0].shape == (3, 6, 5, 3) and mixed[1].shape == (3, 2)
    if shared:  # the caller's and the host's views are one memory
        agents[2][1, 0, 0, 0] = 77
        assert made.obs["agents"][2][1, 0, 0, 0] == 77
        assert made.obs["agents"][1][1, 0, 0, 0] == 1
