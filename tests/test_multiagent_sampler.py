"""Multi-agent envs through the sampler, on every backend: batches of agent rows equal a plain
reference loop stepping the same env with the same actions; agents die and join where the
schedule says; quotas count rows; policies act for their own agents, in the caller or in the
hosts, with the same batches.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from helpers import SamplerFactory, touch

from asyncsample import EpisodeBatch, StepType
from asyncsample._tree import tree_equal, tree_leaves
from asyncsample.multiagent import (
    MultiAgentBatch,
    PolicyAgents,
    Turn,
    areference_rollout,
)
from asyncsample.multiagent.testing import DEFAULT_SCHEDULE, AsyncRosterEnv, RosterEnv
from asyncsample.seeding import worker_seeds

pytestmark = [pytest.mark.timeout(120)]

SEED, N_WORKERS, N_ENVS = 3, 2, 2
MAX_LENGTH = 12


def by_kind(agent: str) -> str:
    """Scouts share a policy; the tank and the medic have their own (their spaces differ)."""
    return agent.split("_")[0]


def _env_rows(batch: EpisodeBatch, worker: int, env: int) -> dict[tuple[int, str, int], Any]:
    """The rows of one env, keyed by (its episode, agent, agent step)."""
    infos = batch.episode_infos_by_step
    pick = np.flatnonzero((infos["worker"] == worker) & (infos["env"] == env))
    episodes = infos["joint_episode"][pick]
    rank = {e: k for k, e in enumerate(sorted(set(episodes.tolist())))}
    nxt = batch.next_observations
    out = {}
    for row, episode in zip(pick.tolist(), episodes.tolist(), strict=True):
        key = (rank[episode], str(batch.agent_ids[row]), int(batch.agent_steps[row]))
        out[key] = {
            "env_step": int(batch.env_steps[row]),
            "obs": _tree(batch.observations, row),
            "action": _tree(batch.actions, row),
            "reward": float(batch.rewards[row]),
            "next": _tree(nxt, row),
            "step_type": int(batch.step_types[row]),
        }
    return out


def _tree(tree: Any, row: int) -> Any:
    if isinstance(tree, dict):
        return {k: _tree(v, row) for k, v in tree.items()}
    return np.asarray(tree[row]).tolist()


def _reference_rows(rollout: Any) -> dict[tuple[int, str, int], Any]:
    out = {}
    for rows in rollout.rows.values():
        nxt = rows.next_observations
        for r in range(len(rows)):
            done = rows.terminations[r] or rows.truncations[r]
            kind = StepType.TERMINAL if rows.terminations[r] else StepType.TIMEOUT
            out[(int(rows.episodes[r]), str(rows.agent_ids[r]), int(rows.agent_steps[r]))] = {
                "env_step": int(rows.env_steps[r]),
                "obs": _tree(rows.observations, r),
                "action": _tree(rows.actions, r),
                "reward": float(rows.rewards[r]),
                "next": _tree(nxt, r),
                "step_type": int(
                    kind if done else StepType.FIRST if rows.agent_steps[r] == 0 else StepType.MID
                ),
            }
    return out


def _replay(joint: EpisodeBatch, worker: int, env: int, agents: tuple[str, ...]) -> Any:
    """The joint actions the sampler took in ``env``'s episodes, as the reference's actions_fn,
    and how many joint steps they hold."""
    infos = joint.episode_infos
    chosen = np.flatnonzero((infos["worker"] == worker) & (infos["env"] == env))
    slices = joint.episode_slices
    rows = [list(range(slices[e].start, slices[e].stop)) for e in chosen.tolist()]

    def actions(turn: Turn) -> dict[str, Any]:
        t = rows[turn.episode][turn.env_step]
        return {a: _leaf(joint.actions[agents.index(a)], t) for a in turn.observations}

    return actions, sum(len(r) for r in rows)


def _leaf(tree: Any, t: int) -> Any:
    if isinstance(tree, dict):
        return {k: _leaf(v, t) for k, v in tree.items()}
    return tree[t]


BACKENDS = [
    ("local", RosterEnv),
    ("process", RosterEnv),
    ("process", AsyncRosterEnv),
    ("thread", RosterEnv),
    ("asyncio", AsyncRosterEnv),
    ("ray", RosterEnv),
]


@pytest.mark.parametrize(
    ("backend", "env_fn"), BACKENDS, ids=[f"{b}-{e.__name__}" for b, e in BACKENDS]
)
async def test_rows_equal_the_reference_loop(
    make_sampler: SamplerFactory, backend: str, env_fn: Any
) -> None:
    sampler = make_sampler(
        backend,
        env_fn,
        n_workers=N_WORKERS,
        envs_per_worker=N_ENVS,
        seed=SEED,
        max_episode_length=MAX_LENGTH,
        policy_mapping=by_kind,
    )
    batch = await sampler.obtain_exact_episodes(3)
    assert isinstance(batch, MultiAgentBatch)
    assert batch.n_env_episodes == 3 * N_WORKERS  # episodes count env episodes
    assert list(batch) == ["scout", "tank", "medic"]
    await _check_against_the_reference(batch, MAX_LENGTH)


async def test_the_step_cap_truncates_the_live_agents(make_sampler: SamplerFactory) -> None:
    cap = 5  # before the schedule's end (8): the agents live after step 5 are cut there
    sampler = make_sampler(
        "local",
        RosterEnv,
        n_workers=N_WORKERS,
        envs_per_worker=N_ENVS,
        seed=SEED,
        max_episode_length=cap,
        policy_mapping=by_kind,
    )
    batch = await sampler.obtain_exact_episodes(2)
    for rows in batch.values():
        assert rows.env_steps is not None and rows.env_steps.max() < cap
    scouts = batch["scout"]
    ends = scouts.step_types[np.cumsum(scouts.lengths) - 1].astype(int)
    assert StepType.TIMEOUT in ends.tolist()  # scout_0, live at the cap
    await _check_against_the_reference(batch, cap)


async def _check_against_the_reference(batch: MultiAgentBatch, max_length: int) -> None:
    """Every env's rows equal the reference loop's, stepping RosterEnv with the env's seed and
    the sampler's joint actions."""
    _, seeds = worker_seeds(SEED, N_WORKERS, N_ENVS)
    compared = 0
    for worker in range(N_WORKERS):
        for env in range(N_ENVS):
            actions, steps = _replay(batch.joint, worker, env, DEFAULT_SCHEDULE_AGENTS)
            if not steps:
                continue
            rollout = await areference_rollout(
                RosterEnv,
                seeds[worker].seed_at(env, 0),
                actions,
                steps,
                policy_mapping=by_kind,
                max_episode_length=max_length,
            )
            want = _reference_rows(rollout)
            got: dict[Any, Any] = {}
            for rows in batch.values():
                got.update(_env_rows(rows, worker, env))
            assert got.keys() == want.keys()
            for key, row in want.items():
                np.testing.assert_equal(got[key], row, err_msg=f"{worker}/{env} {key}")
            compared += len(want)
    assert compared == batch.n_transitions


DEFAULT_SCHEDULE_AGENTS = ("scout_0", "scout_1", "tank_0", "medic_0")


async def test_agents_die_and_join_where_the_schedule_says(make_sampler: SamplerFactory) -> None:
    sampler = make_sampler(
        "local", RosterEnv, n_workers=1, envs_per_worker=3, seed=1, policy_mapping=by_kind
    )
    batch = await sampler.obtain_samples(200)
    assert batch.n_transitions >= 200
    segments = 0
    for rows in batch.values():
        assert rows.agent_ids is not None and rows.env_steps is not None
        for piece in rows.split():
            agent = str(piece.agent_ids[0])
            joined, (left, how) = DEFAULT_SCHEDULE.joins[agent], DEFAULT_SCHEDULE.leaves[agent]
            # a row on exactly the joint steps the agent is live: none after it died
            np.testing.assert_array_equal(piece.env_steps, np.arange(joined, left))
            np.testing.assert_array_equal(piece.agent_steps, np.arange(left - joined))
            end = StepType.TERMINAL if how == "terminated" else StepType.TIMEOUT
            assert int(piece.step_types[-1]) == end
            assert int(piece.step_types[0]) == StepType.FIRST
            segments += 1
    # every env episode holds one segment per agent
    assert segments == batch.n_env_episodes * len(DEFAULT_SCHEDULE_AGENTS)


@pytest.mark.parametrize("call", ["samples", "fragments"])
async def test_quotas_count_agent_rows(make_sampler: SamplerFactory, call: str) -> None:
    sampler = make_sampler(
        "local", RosterEnv, n_workers=2, envs_per_worker=2, seed=0, policy_mapping=by_kind
    )
    obtain = getattr(sampler, f"obtain_{call}")
    for quota in (5, 37, 120):
        batch = await obtain(quota)
        assert batch.n_transitions >= quota
        assert batch.n_transitions == int(batch.joint.observations["live"].sum())
        if call == "samples":  # whole env episodes: every segment ends
            for rows in batch.values():
                ends = rows.step_types[np.cumsum(rows.lengths) - 1].astype(int)
                assert set(ends.tolist()) <= {StepType.TERMINAL, StepType.TIMEOUT}


class KindAgent:
    """A deterministic agent of one kind: its action is read off its observation, and it tells
    the rows it saw in its agent infos; Discrete agents take the first allowed action."""

    def __init__(self, space: gym.Space[Any]) -> None:
        self.space = space
        self.calls: list[int] = []

    def get_actions(self, observations: Any, action_masks: Any = None) -> Any:
        leaf = observations["observation"] if isinstance(observations, dict) else observations
        n = len(leaf)
        self.calls.append(n)
        if isinstance(self.space, gym.spaces.Discrete):
            assert action_masks is not None and action_masks.shape == (n, self.space.n)
            actions = np.argmax(action_masks, axis=1).astype(np.int64)
        else:
            actions = self.box_actions(leaf, 0.1)
        return actions, {"seen": np.asarray(leaf, dtype=np.float64).sum(axis=1)}

    def box_actions(self, leaf: Any, scale: float) -> Any:
        """Each row's first observation entry, scaled, in every entry of its action."""
        low, high = self.space.low, self.space.high  # type: ignore[attr-defined]
        wide = np.broadcast_to(leaf[:, :1] * scale, (len(leaf), *self.space.shape))
        return np.clip(wide, low, high).astype(self.space.dtype)


def _agents() -> dict[str, KindAgent]:
    env = RosterEnv()
    return {by_kind(a): KindAgent(env.action_space(a)) for a in env.possible_agents}


@pytest.mark.parametrize("inference", ["per_worker", "batched", "host"])
async def test_policies_act_for_their_agents_in_any_mode(
    make_sampler: SamplerFactory, inference: str
) -> None:
    def sample() -> Any:
        return make_sampler(
            "process",
            RosterEnv,
            agent=_agents(),
            policy_mapping=by_kind,
            n_workers=2,
            envs_per_worker=2,
            seed=5,
            inference=inference,
            max_episode_length=MAX_LENGTH,
        )

    batch = await sample().obtain_exact_episodes(2)
    for policy, rows in batch.items():
        obs = rows.observations["observation"] if policy == "tank" else rows.observations
        seen = rows.agent_infos["seen"]
        np.testing.assert_allclose(seen, np.asarray(obs, dtype=np.float64).sum(axis=1))
        if policy == "tank":
            masks = np.asarray(rows.observations["action_mask"], dtype=bool)
            assert masks[np.arange(len(masks)), rows.actions].all()  # an allowed action
    reference = await make_sampler(
        "process",
        RosterEnv,
        agent=_agents(),
        policy_mapping=by_kind,
        n_workers=2,
        envs_per_worker=2,
        seed=5,
        inference="per_worker",
        max_episode_length=MAX_LENGTH,
    ).obtain_exact_episodes(2)
    for policy in reference:
        assert batch[policy].equals(reference[policy]), policy


def test_policy_agents_call_each_policy_once_on_its_live_agents() -> None:
    agents = _agents()
    router = PolicyAgents(agents, by_kind)
    env = RosterEnv()
    from asyncsample.multiagent.slots import SlotEnv

    slot_env = SlotEnv(env)
    from asyncsample.batch import EnvSpec

    router.bind_env_spec(EnvSpec(slot_env.observation_space, slot_env.action_space))
    obs = [slot_env.reset(seed=i)[0] for i in range(3)]
    stacked = {
        "agents": tuple(
            _stack([o["agents"][k] for o in obs]) for k in range(len(env.possible_agents))
        ),
        "live": np.stack([o["live"] for o in obs]),
        "action_mask": np.stack([o["action_mask"] for o in obs]),
    }
    actions, infos = router.get_actions(stacked)
    live = stacked["live"].astype(bool)
    # one call per policy, on the live agents of all three envs
    assert agents["scout"].calls == [int(live[:, :2].sum())]
    assert agents["tank"].calls == [int(live[:, 2].sum())]
    assert agents["medic"].calls == []  # not live after reset: not asked
    assert slot_env.action_space.contains(tuple(a[0] for a in actions))
    assert infos["scout/seen"].shape == (3, 2)


def _stack(values: list[Any]) -> Any:
    if isinstance(values[0], dict):
        return {k: _stack([v[k] for v in values]) for k in values[0]}
    return np.stack(values)


def test_the_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match=r"agent: expected a non-empty dict"):
        PolicyAgents({}, None)
    with pytest.raises(TypeError, match=r"agent\['a'\]: expected an agent with get_actions"):
        PolicyAgents({"a": object()}, None)


async def test_a_policy_mapping_needs_a_multi_agent_env(make_sampler: SamplerFactory) -> None:
    sampler = make_sampler("local", policy_mapping=by_kind)
    with pytest.raises(ValueError, match=r"policy_mapping: only for a multi-agent env"):
        await sampler.obtain_samples(4)


async def test_every_policy_needs_an_agent(make_sampler: SamplerFactory) -> None:
    agents = _agents()
    del agents["medic"]
    sampler = make_sampler("local", RosterEnv, agent=agents, policy_mapping=by_kind)
    with pytest.raises(ValueError, match=r"agent: no agent for policies \['medic'\]"):
        await sampler.obtain_samples(4)


async def test_default_policy_needs_shared_spaces(make_sampler: SamplerFactory) -> None:
    sampler = make_sampler("local", functools.partial(RosterEnv))
    with pytest.raises(Exception, match=r"policy_mapping: the agents of policy 'default'"):
        await sampler.obtain_samples(4)


async def test_a_stream_yields_agent_rows(make_sampler: SamplerFactory) -> None:
    sampler = make_sampler(
        "process", RosterEnv, n_workers=2, envs_per_worker=2, seed=0, policy_mapping=by_kind
    )
    seen = 0
    async with contextlib.aclosing(sampler.stream(60, fragments=True)) as batches:
        async for batch in batches:
            assert isinstance(batch, MultiAgentBatch)
            assert batch.n_transitions >= 60  # rows, joined over rounds where needed
            assert batch.n_transitions == int(batch.joint.observations["live"].sum())
            seen += 1
            if seen == 3:
                break
    single = make_sampler("local")
    async with contextlib.aclosing(single.stream(8)) as batches:
        async for batch in batches:
            assert isinstance(batch, EpisodeBatch)  # a single-agent env: as before
            break


async def test_a_policy_live_on_every_joint_step_gets_views_of_the_joint_rows(
    make_sampler: SamplerFactory,
) -> None:
    """Where a policy's agents are live on every joint step of a call, its observations are a
    view of the joint batch's (the sampler lays each slot's rows end to end), equal to the copy
    made otherwise; a death in the call makes it a copy again."""
    made = []
    for carve in (True, False):
        sampler = make_sampler(
            "local", RosterEnv, n_workers=1, envs_per_worker=2, seed=3, policy_mapping=by_kind
        )
        if carve:  # these rows are small: carve them as the memory of big ones is
            sampler._core.memory.min_bytes = 0
        # 4 joint steps of 3 live agents (2 of each env: the first death comes at step 2), then
        # more in a second call
        made.append([await sampler.obtain_fragments(n) for n in (12, 40)])
    (views, later), (copies, _) = made
    agents = views.joint.observations["agents"]
    for policy, slot in (("scout", 0), ("tank", 2)):  # a Box, and a Dict with a mask
        mine, theirs = tree_leaves(views[policy].observations), tree_leaves(agents[slot])
        assert all(np.shares_memory(a, b) for a, b in zip(mine, theirs, strict=True))
        assert tree_equal(views[policy].observations, copies[policy].observations)
        assert tree_equal(views[policy].last_observations, copies[policy].last_observations)
    # the scouts' two slots apart in memory (small rows, not carved): a gather's copy
    assert not np.shares_memory(copies["scout"].observations, agents[0])
    assert not np.shares_memory(
        copies["scout"].observations, copies.joint.observations["agents"][0]
    )
    # scout_1 dies at joint step 2: the scouts' rows of the second call are gathered copies
    assert not np.shares_memory(later["scout"].observations, later.joint.observations["agents"][0])


class FailingRosterEnv(RosterEnv):
    """A RosterEnv whose step 3 raises once (while ``flag`` does not exist), mid-episode."""

    def __init__(self, flag: str) -> None:
        super().__init__()
        self.flag = flag
        self.calls = 0

    def step(self, actions: Any) -> Any:
        self.calls += 1
        if self.calls == 3 and not os.path.exists(self.flag):
            touch(self.flag)
            raise RuntimeError("the env broke mid-episode")
        return super().step(actions)


@pytest.mark.parametrize("backend", ["local", "process"])
async def test_a_failing_env_loses_its_agents_segments_and_nothing_else(
    make_sampler: SamplerFactory, backend: str, tmp_path: Any
) -> None:
    flag = str(tmp_path / "failed")
    sampler = make_sampler(
        backend,
        functools.partial(FailingRosterEnv, flag),
        n_workers=1,
        envs_per_worker=2,
        seed=2,
        policy_mapping=by_kind,
    )
    batch = await sampler.obtain_samples(150)
    assert os.path.exists(flag)  # the env did fail
    assert sampler.restarts == 1  # its host (process) or the env (local) was rebuilt once
    # every segment whole, as the schedule has it: the broken episode left no half-made rows
    segments = 0
    for rows in batch.values():
        for piece in rows.split():
            agent = str(piece.agent_ids[0])
            joined, (left, _) = DEFAULT_SCHEDULE.joins[agent], DEFAULT_SCHEDULE.leaves[agent]
            np.testing.assert_array_equal(piece.env_steps, np.arange(joined, left))
            segments += 1
    assert segments == batch.n_env_episodes * len(DEFAULT_SCHEDULE_AGENTS)


class ScaledAgent(KindAgent):
    """A KindAgent with one parameter, the scale of its Box actions."""

    def __init__(self, space: gym.Space[Any]) -> None:
        super().__init__(space)
        self.scale = 0.1

    def get_param_values(self) -> float:
        return self.scale

    def set_param_values(self, scale: float) -> None:
        self.scale = scale

    def get_actions(self, observations: Any, action_masks: Any = None) -> Any:
        actions, infos = super().get_actions(observations, action_masks)
        if not isinstance(self.space, gym.spaces.Discrete):
            actions = self.box_actions(observations, self.scale)
        return actions, infos


@pytest.mark.parametrize("inference", ["per_worker", "host"])
async def test_an_update_sets_the_parameters_of_the_policies_it_names(
    make_sampler: SamplerFactory, inference: str
) -> None:
    env = RosterEnv()
    agents = {by_kind(a): ScaledAgent(env.action_space(a)) for a in env.possible_agents}
    sampler = make_sampler(
        "process",
        RosterEnv,
        agent=agents,
        policy_mapping=by_kind,
        n_workers=1,
        envs_per_worker=2,
        seed=0,
        inference=inference,
        max_episode_length=MAX_LENGTH,
    )
    before = await sampler.obtain_exact_episodes(1)
    after = await sampler.obtain_exact_episodes(1, agent_update={"medic": 0.0})
    np.testing.assert_array_equal(after["medic"].actions, 0.0)  # the update reached the medic
    assert np.abs(before["medic"].actions).max() > 0
    assert after["scout"].agent_versions is not None
    assert after["scout"].agent_versions.min() > before["scout"].agent_versions.max()
