"""Tests of the batch data types: StepType, EnvSpec, EpisodeBatch and stack_infos."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import pickle
import warnings
from typing import Any

import gymnasium
import numpy as np
import pytest

from asyncsample.batch import EnvSpec, EpisodeBatch, StepType, stack_infos

LENGTHS = [10, 20, 7, 25, 25, 40, 10, 5]
N_STEPS = sum(LENGTHS)  # 142
N_EPS = len(LENGTHS)
MEL = 100


def _step_types(lengths: list[int], last: StepType = StepType.TERMINAL) -> np.ndarray:
    types: list[StepType] = []
    for n in lengths:
        types += [StepType.FIRST] + [StepType.MID] * (n - 2) + [last]
    return np.array(types, dtype=StepType)


@pytest.fixture
def spec() -> EnvSpec:
    obs_space = gymnasium.spaces.Box(low=1.0, high=np.inf, shape=(4, 3, 2), dtype=np.float32)
    act_space = gymnasium.spaces.MultiDiscrete([2, 5])
    return EnvSpec(obs_space, act_space, max_episode_length=MEL)


@pytest.fixture
def fields(spec: EnvSpec) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    obs = rng.uniform(1.0, 2.0, size=(N_STEPS, 4, 3, 2)).astype(np.float32)
    actions = np.tile(np.array([[1, 3]]), (N_STEPS, 1))
    return {
        "env_spec": spec,
        "episode_infos": {
            "task_one_hot": np.eye(N_EPS)[:, :4],
            "seed": np.arange(N_EPS),
        },
        "observations": obs,
        "last_observations": rng.uniform(1.0, 2.0, size=(N_EPS, 4, 3, 2)).astype(np.float32),
        "actions": actions,
        "rewards": np.arange(N_STEPS, dtype=np.float64),
        "env_infos": {"goal": np.tile([[1, 1]], (N_STEPS, 1)), "foo": np.arange(N_STEPS)},
        "agent_infos": {"prev_action": actions.copy(), "hidden": np.arange(N_STEPS)},
        "step_types": _step_types(LENGTHS),
        "lengths": np.array(LENGTHS),
    }


@pytest.fixture
def batch(fields: dict[str, Any]) -> EpisodeBatch:
    return EpisodeBatch(**fields)


# ------------------------------------------------------------------------------- StepType


@pytest.mark.parametrize(
    ("step_cnt", "mel", "done", "expected"),
    [
        (1, 5, False, StepType.FIRST),
        (2, 5, False, StepType.MID),
        (2, None, False, StepType.MID),
        (5, 5, False, StepType.TIMEOUT),
        (5, 5, True, StepType.TIMEOUT),
        (1, 5, True, StepType.TERMINAL),
        (1, None, True, StepType.TERMINAL),
    ],
)
def test_get_step_type(step_cnt: int, mel: int | None, done: bool, expected: StepType) -> None:
    assert StepType.get_step_type(step_cnt, mel, done) is expected


def test_get_step_type_rejects_zero() -> None:
    with pytest.raises(ValueError, match="Expect step_cnt to be >= 1"):
        StepType.get_step_type(0, 5, False)


def test_step_type_values() -> None:
    assert [int(s) for s in StepType] == [0, 1, 2, 3]
    assert [s.name for s in StepType] == ["FIRST", "MID", "TERMINAL", "TIMEOUT"]


def test_env_spec_defaults_and_is_frozen() -> None:
    spec = EnvSpec(gymnasium.spaces.Discrete(3), gymnasium.spaces.Discrete(2))
    assert spec.max_episode_length is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.max_episode_length = 5  # type: ignore[misc]


# ------------------------------------------------------------------------------- construction


def test_fields_are_stored_as_given(fields: dict[str, Any]) -> None:
    batch = EpisodeBatch(**fields)
    for name, value in fields.items():
        assert getattr(batch, name) is value
    assert batch.episode_infos_by_episode is fields["episode_infos"]
    assert batch.n_transitions == N_STEPS
    assert batch.n_episodes == N_EPS


def test_field_order_matches_garage() -> None:
    assert [f.name for f in dataclasses.fields(EpisodeBatch)] == [
        "env_spec",
        "episode_infos",
        "observations",
        "last_observations",
        "actions",
        "rewards",
        "env_infos",
        "agent_infos",
        "step_types",
        "lengths",
        "agent_versions",  # ours, after garage's fields (optional: None for hand-built batches)
        "agent_ids",  # ours, multi-agent envs' row columns (None for single-agent envs)
        "env_steps",
        "agent_steps",
    ]


def test_is_frozen(batch: EpisodeBatch) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.rewards = np.zeros(N_STEPS)  # type: ignore[misc]


def test_integer_step_types_accepted(fields: dict[str, Any]) -> None:
    fields["step_types"] = fields["step_types"].astype(np.int8)
    batch = EpisodeBatch(**fields)
    assert batch.step_types.dtype == np.int8


def test_object_step_types_of_numpy_ints_accepted(fields: dict[str, Any]) -> None:
    as_numpy_ints = np.empty(N_STEPS, dtype=object)
    as_numpy_ints[:] = [np.int64(s) for s in fields["step_types"]]
    fields["step_types"] = as_numpy_ints
    assert EpisodeBatch(**fields).step_types is as_numpy_ints


def test_flat_observations_soft_match(fields: dict[str, Any]) -> None:
    fields["observations"] = fields["observations"].reshape(N_STEPS, 24)
    fields["last_observations"] = fields["last_observations"].reshape(N_EPS, 24)
    batch = EpisodeBatch(**fields)
    assert batch.observations.shape == (N_STEPS, 24)


def test_observation_dtype_not_checked(fields: dict[str, Any]) -> None:
    fields["observations"] = fields["observations"].astype(np.float64)
    assert EpisodeBatch(**fields).observations.dtype == np.float64


def _replace(fields: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**fields, **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lengths": np.array([LENGTHS])}, "lengths has shape"),
        ({"lengths": np.array(LENGTHS, dtype=np.float32)}, "lengths has dtype float32"),
        ({"lengths": np.array([*LENGTHS[:-1], 0, 5])}, "lengths has entry 0"),
        ({"lengths": np.array([*LENGTHS[:-1], 4])}, "lengths sum to 141, but .* 142 transitions"),
        ({"rewards": np.zeros((2, 71))}, r"rewards has shape \(2, 71\)"),
        ({"rewards": list(range(N_STEPS))}, "rewards is of type list"),
        ({"observations": np.ones((N_STEPS, 4, 3), np.float32)}, "Each observation has shape"),
        ({"observations": np.ones((N_STEPS - 1, 4, 3, 2))}, "observations has batch size 141"),
        (
            {"last_observations": np.ones((N_EPS, 4, 3), np.float32)},
            "last_observations must have the same number of entries",
        ),
        ({"last_observations": np.ones((7, 4, 3, 2))}, "last_observations has batch size 7"),
        ({"actions": np.ones((N_STEPS, 3), dtype=np.int64)}, "Each action has shape"),
        ({"actions": np.ones((N_STEPS - 1, 2), dtype=np.int64)}, "actions has batch size 141"),
        ({"env_infos": {"bar": [1] * N_STEPS}}, "Entry 'bar' in env_infos is of type list"),
        ({"agent_infos": {"bar": [1] * N_STEPS}}, "Entry 'bar' in agent_infos is of type list"),
        ({"episode_infos": {"bar": [1] * N_EPS}}, "Entry 'bar' in episode_infos is of type list"),
        (
            {"env_infos": {"goal": np.ones((N_STEPS - 1, 2))}},
            "Entry 'goal' in env_infos has batch size 141",
        ),
        (
            {"agent_infos": {"hidden": np.ones(N_STEPS - 1)}},
            "Entry 'hidden' in agent_infos has batch size 141",
        ),
        (
            {"env_infos": {"t": {"goal": np.ones(3)}}},
            r"Entry 'goal' in env_infos\['t'\] has batch size 3",
        ),
        ({"env_infos": {"scalar": np.array(1.0)}}, "Entry 'scalar' in env_infos has batch size"),
        ({"step_types": _step_types(LENGTHS)[:2]}, "step_types has batch size 2"),
        ({"step_types": _step_types(LENGTHS).astype(np.float32)}, "step_types has dtype float32"),
        ({"step_types": np.full(N_STEPS, 4)}, "step_types has values from 4 to 4"),
        ({"step_types": np.array(["x"] * N_STEPS, dtype=object)}, "step_types holds objects"),
        (
            {"episode_infos": {"task_one_hot": np.ones((7, 4))}},
            "Entry 'task_one_hot' in episode_infos",
        ),
        (
            {"episode_infos": {"task_one_hot": np.ones((3, 4))}},
            "Entry 'task_one_hot' in episode_infos",
        ),
    ],
)
def test_validation_errors(fields: dict[str, Any], changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EpisodeBatch(**_replace(fields, **changes))


def test_empty_batch_is_valid(spec: EnvSpec) -> None:
    batch = EpisodeBatch(
        env_spec=spec,
        episode_infos={},
        observations=np.zeros((0, 4, 3, 2)),
        last_observations=np.zeros((0, 4, 3, 2)),
        actions=np.zeros((0, 2), dtype=np.int64),
        rewards=np.zeros(0),
        env_infos={},
        agent_infos={},
        step_types=np.zeros(0, dtype=np.int8),
        lengths=np.zeros(0, dtype=np.int64),
    )
    assert batch.n_episodes == 0
    assert batch.returns.shape == (0,)
    assert batch.split() == []
    assert batch.padded_rewards.shape == (0, MEL)


# ------------------------------------------------------------------------------- views


def test_episode_infos_by_step(batch: EpisodeBatch) -> None:
    by_step = batch.episode_infos_by_step
    assert by_step["seed"].shape == (N_STEPS,)
    assert by_step["task_one_hot"].shape == (N_STEPS, 4)
    np.testing.assert_array_equal(by_step["seed"], np.repeat(np.arange(N_EPS), LENGTHS))


def test_next_observations(batch: EpisodeBatch) -> None:
    nxt = batch.next_observations
    assert nxt.shape == batch.observations.shape
    start = 0
    for i, n in enumerate(LENGTHS):
        np.testing.assert_array_equal(
            nxt[start : start + n - 1], batch.observations[start + 1 : start + n]
        )
        np.testing.assert_array_equal(nxt[start + n - 1], batch.last_observations[i])
        start += n


def test_returns(batch: EpisodeBatch) -> None:
    bounds = np.cumsum([0, *LENGTHS])
    expected = [batch.rewards[a:b].sum() for a, b in itertools.pairwise(bounds)]
    assert batch.returns.dtype == np.float64
    np.testing.assert_allclose(batch.returns, expected)


def test_lists(batch: EpisodeBatch) -> None:
    obs_list = batch.observations_list
    act_list = batch.actions_list
    assert [len(o) for o in obs_list] == LENGTHS
    assert [len(a) for a in act_list] == LENGTHS
    np.testing.assert_array_equal(np.concatenate(obs_list), batch.observations)
    np.testing.assert_array_equal(np.concatenate(act_list), batch.actions)
    assert [s.stop - s.start for s in batch.episode_slices] == LENGTHS


def test_padding(batch: EpisodeBatch) -> None:
    padded = {
        "observations": (batch.padded_observations, batch.observations),
        "next_observations": (batch.padded_next_observations, batch.next_observations),
        "actions": (batch.padded_actions, batch.actions),
        "rewards": (batch.padded_rewards, batch.rewards),
        "step_types": (batch.padded_step_types, batch.step_types),
        "env_info goal": (batch.padded_env_infos["goal"], batch.env_infos["goal"]),
        "agent_info hidden": (batch.padded_agent_infos["hidden"], batch.agent_infos["hidden"]),
    }
    for name, (pad, flat) in padded.items():
        assert pad.shape == (N_EPS, MEL, *flat.shape[1:]), name
        start = 0
        for i, n in enumerate(LENGTHS):
            np.testing.assert_array_equal(pad[i, :n], flat[start : start + n], err_msg=name)
            assert not np.any(pad[i, n:]), name
            start += n
    valids = batch.valids
    assert valids.shape == (N_EPS, MEL)
    np.testing.assert_array_equal(valids.sum(axis=1), LENGTHS)
    for i, n in enumerate(LENGTHS):
        assert np.all(valids[i, :n] == 1)
        assert np.all(valids[i, n:] == 0)


def test_padding_without_limit_uses_longest(fields: dict[str, Any]) -> None:
    spec = fields["env_spec"]
    fields["env_spec"] = EnvSpec(spec.observation_space, spec.action_space, None)
    batch = EpisodeBatch(**fields)
    assert batch.padded_rewards.shape == (N_EPS, max(LENGTHS))
    assert batch.valids.shape == (N_EPS, max(LENGTHS))


def test_padding_warns_when_episode_exceeds_limit(fields: dict[str, Any]) -> None:
    spec = fields["env_spec"]
    fields["env_spec"] = EnvSpec(spec.observation_space, spec.action_space, 30)
    batch = EpisodeBatch(**fields)
    with pytest.warns(UserWarning, match="exceeds max_episode_length"):
        padded = batch.padded_observations
    assert padded.shape == (N_EPS, 40, 4, 3, 2)


# ------------------------------------------------------------------------------- combining


def test_split_and_concatenate_round_trip(batch: EpisodeBatch) -> None:
    parts = batch.split()
    assert len(parts) == N_EPS
    assert [p.n_transitions for p in parts] == LENGTHS
    for i, part in enumerate(parts):
        assert part.n_episodes == 1
        assert part.lengths[0] == LENGTHS[i]
        assert part.episode_infos["seed"].tolist() == [i]
        np.testing.assert_array_equal(part.last_observations[0], batch.last_observations[i])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        joined = EpisodeBatch.concatenate(*parts)
    assert joined.equals(batch)


def test_concatenate_needs_a_batch() -> None:
    with pytest.raises(ValueError, match="at least one"):
        EpisodeBatch.concatenate()


def test_concatenate_keeps_uncommon_keys_with_masks(fields: dict[str, Any]) -> None:
    a = EpisodeBatch(**fields)
    b = EpisodeBatch(
        **_replace(fields, env_infos={"goal": fields["env_infos"]["goal"]}, agent_infos={})
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        joined = EpisodeBatch.concatenate(a, b)
    assert list(joined.env_infos) == ["goal", "foo", "_foo"]
    assert joined.n_episodes == 2 * N_EPS
    assert joined.env_infos["goal"].shape == (2 * N_STEPS, 2)
    assert "_goal" not in joined.env_infos
    # Integer keys are filled with zero where absent; the mask says where they were present.
    assert joined.env_infos["foo"].tolist() == list(range(N_STEPS)) + [0] * N_STEPS
    assert joined.env_infos["_foo"].tolist() == [True] * N_STEPS + [False] * N_STEPS
    assert list(joined.agent_infos) == ["prev_action", "_prev_action", "hidden", "_hidden"]
    assert joined.agent_infos["prev_action"].shape == (2 * N_STEPS, 2)
    assert not joined.agent_infos["_hidden"][N_STEPS:].any()


def test_concatenate_fills_masked_rows_after_dtype_promotion(fields: dict[str, Any]) -> None:
    ints = np.arange(N_STEPS)
    mask = ints % 2 == 0
    a = EpisodeBatch(**_replace(fields, env_infos={"k": np.where(mask, ints, 0), "_k": mask}))
    b = EpisodeBatch(**_replace(fields, env_infos={"k": np.full(N_STEPS, 0.5)}))
    joined = EpisodeBatch.concatenate(a, b)
    assert joined.env_infos["k"].dtype == np.float64
    # a's absent rows were 0 as integers; as floats they are NaN like any absent float.
    assert np.isnan(joined.env_infos["k"][:N_STEPS][~mask]).all()
    np.testing.assert_array_equal(joined.env_infos["k"][:N_STEPS][mask], ints[mask])
    assert joined.env_infos["_k"].tolist() == [*mask.tolist(), *[True] * N_STEPS]
    assert not EpisodeBatch.concatenate(b, b).env_infos.keys() - {"k"}


def test_concatenate_refuses_a_key_that_is_a_dict_and_an_array(fields: dict[str, Any]) -> None:
    a = EpisodeBatch(**_replace(fields, env_infos={"k": {"x": np.zeros(N_STEPS)}}))
    b = EpisodeBatch(**_replace(fields, env_infos={"k": np.zeros(N_STEPS)}))
    with pytest.raises(ValueError, match=r"env_infos\['k'\] is a dict"):
        EpisodeBatch.concatenate(a, b)


def test_from_list_keeps_sparse_keys_of_per_step_dicts(spec: EnvSpec) -> None:
    def path(n: int, infos: list[dict[str, Any]], episode: dict[str, Any]) -> dict[str, Any]:
        return {
            "observations": np.ones((n, 4, 3, 2)),
            "actions": np.zeros((n, 2), dtype=np.int64),
            "rewards": np.ones(n),
            "dones": [False] * (n - 1) + [True],
            "env_infos": infos,
            "episode_infos": episode,
        }

    paths = [
        path(2, [{"a": 1}, {"a": 2, "b": 0.5}], {"seed": 1}),
        path(1, [{"a": 3}], {"seed": 2, "success": True}),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = EpisodeBatch.from_list(spec, paths)
    assert batch.env_infos["a"].tolist() == [1, 2, 3]
    np.testing.assert_array_equal(batch.env_infos["b"], [np.nan, 0.5, np.nan])
    assert batch.env_infos["_b"].tolist() == [False, True, False]
    assert batch.episode_infos["success"].tolist() == [False, True]
    assert batch.episode_infos["_success"].tolist() == [False, True]
    assert EpisodeBatch.from_list(spec, batch.to_list()).equals(batch)


def test_to_list(batch: EpisodeBatch) -> None:
    paths = batch.to_list()
    assert len(paths) == N_EPS
    nxt = batch.next_observations
    start = 0
    for i, (path, n) in enumerate(zip(paths, LENGTHS, strict=True)):
        assert set(path) == {
            "episode_infos",
            "observations",
            "next_observations",
            "actions",
            "rewards",
            "env_infos",
            "agent_infos",
            "step_types",
        }
        steps = slice(start, start + n)
        np.testing.assert_array_equal(path["observations"], batch.observations[steps])
        np.testing.assert_array_equal(path["next_observations"], nxt[steps])
        np.testing.assert_array_equal(path["next_observations"][-1], batch.last_observations[i])
        np.testing.assert_array_equal(path["actions"], batch.actions[steps])
        np.testing.assert_array_equal(path["rewards"], batch.rewards[steps])
        np.testing.assert_array_equal(path["step_types"], batch.step_types[steps])
        for key in batch.env_infos:
            np.testing.assert_array_equal(path["env_infos"][key], batch.env_infos[key][steps])
        for key in batch.agent_infos:
            np.testing.assert_array_equal(path["agent_infos"][key], batch.agent_infos[key][steps])
        assert path["episode_infos"]["seed"] == i
        start += n


def test_from_list_round_trip(batch: EpisodeBatch) -> None:
    rebuilt = EpisodeBatch.from_list(batch.env_spec, batch.to_list())
    assert rebuilt.equals(batch)


def test_from_list_with_extra_observation_and_dones(spec: EnvSpec) -> None:
    rng = np.random.default_rng(1)
    paths: list[dict[str, Any]] = [
        {
            "observations": rng.uniform(size=(n + 1, 4, 3, 2)),
            "actions": np.zeros((n, 2), dtype=np.int64),
            "rewards": np.ones(n),
            "dones": [False] * (n - 1) + [terminal],
            "env_infos": [{"k": t} for t in range(n)],
        }
        for n, terminal in [(3, True), (2, False), (1, True)]
    ]
    batch = EpisodeBatch.from_list(spec, paths)
    assert batch.lengths.tolist() == [3, 2, 1]
    np.testing.assert_array_equal(batch.observations[:3], paths[0]["observations"][:3])
    np.testing.assert_array_equal(batch.last_observations[0], paths[0]["observations"][3])
    first, mid, terminal = StepType.FIRST, StepType.MID, StepType.TERMINAL
    assert batch.step_types.tolist() == [first, mid, terminal, first, mid, terminal]
    assert batch.env_infos["k"].tolist() == [0, 1, 2, 0, 1, 0]
    assert batch.episode_infos == {}


def test_from_list_last_observation_fallbacks(spec: EnvSpec) -> None:
    obs = np.arange(2 * 24, dtype=np.float64).reshape(2, 4, 3, 2)
    nxt = obs + 100
    base = {"observations": obs, "actions": np.zeros((2, 2)), "rewards": np.zeros(2)}
    with_next = EpisodeBatch.from_list(
        spec, [{**base, "next_observations": nxt, "step_types": np.array([0, 3])}]
    )
    np.testing.assert_array_equal(with_next.last_observations[0], nxt[-1])
    without = EpisodeBatch.from_list(spec, [{**base, "step_types": np.array([0, 3])}])
    np.testing.assert_array_equal(without.last_observations[0], obs[-1])


def test_from_list_errors(spec: EnvSpec) -> None:
    with pytest.raises(ValueError, match="at least one path"):
        EpisodeBatch.from_list(spec, [])
    path = {"observations": np.zeros((1, 24)), "actions": np.zeros((1, 2)), "rewards": np.zeros(1)}
    with pytest.raises(ValueError, match="neither 'step_types' nor 'dones'"):
        EpisodeBatch.from_list(spec, [path])


# ------------------------------------------------------------------------------- equality


def test_equals(batch: EpisodeBatch, fields: dict[str, Any]) -> None:
    twin = EpisodeBatch(**copy.deepcopy(fields))
    assert twin.equals(batch)
    assert batch.equals(twin)
    assert pickle.loads(pickle.dumps(batch)).equals(batch)
    rewards = fields["rewards"].copy()
    rewards[17] += 1.0
    assert not EpisodeBatch(**_replace(fields, rewards=rewards)).equals(batch)
    assert not batch.equals("not a batch")


def test_equals_is_strict_about_dtype_and_keys(batch: EpisodeBatch, fields: dict[str, Any]) -> None:
    int_types = EpisodeBatch(**_replace(fields, step_types=fields["step_types"].astype(np.int64)))
    assert not int_types.equals(batch)
    fewer_infos = EpisodeBatch(**_replace(fields, env_infos={"goal": fields["env_infos"]["goal"]}))
    assert not fewer_infos.equals(batch)
    spec = fields["env_spec"]
    other_spec = EnvSpec(spec.observation_space, spec.action_space, MEL + 1)
    assert not EpisodeBatch(**_replace(fields, env_spec=other_spec)).equals(batch)


def test_eq_is_identity(batch: EpisodeBatch, fields: dict[str, Any]) -> None:
    same = EpisodeBatch(**fields)
    assert same.equals(batch)  # the same contents (equals compares those) ...
    assert (batch == same) is False and batch != same  # ... but == is identity, a plain bool
    assert len({batch, same, batch}) == 2  # hashed by identity too


def test_equals_treats_nan_as_equal(fields: dict[str, Any]) -> None:
    rewards = fields["rewards"].copy()
    rewards[0] = np.nan
    a = EpisodeBatch(**_replace(fields, rewards=rewards))
    b = EpisodeBatch(**_replace(fields, rewards=rewards.copy()))
    assert a.equals(b)


# ------------------------------------------------------------------------------- nested spaces


@pytest.fixture
def dict_spec() -> EnvSpec:
    obs_space = gymnasium.spaces.Dict(
        {
            "pos": gymnasium.spaces.Box(-1.0, 1.0, shape=(3,)),
            "mode": gymnasium.spaces.Discrete(4),
        }
    )
    act_space = gymnasium.spaces.Tuple(
        (gymnasium.spaces.Discrete(2), gymnasium.spaces.Box(-1.0, 1.0, shape=(2,)))
    )
    return EnvSpec(obs_space, act_space, max_episode_length=6)


def _dict_batch(spec: EnvSpec, lengths: list[int], **changes: Any) -> EpisodeBatch:
    t, n = sum(lengths), len(lengths)
    obs = {"pos": np.arange(3 * t, dtype=np.float32).reshape(t, 3), "mode": np.arange(t) % 4}
    last = {"pos": -np.ones((n, 3), np.float32), "mode": np.full(n, 3)}
    fields: dict[str, Any] = {
        "env_spec": spec,
        "episode_infos": {},
        "observations": obs,
        "last_observations": last,
        "actions": (np.arange(t) % 2, np.zeros((t, 2), np.float32)),
        "rewards": np.ones(t, np.float32),
        "env_infos": {"task": {"goal": np.arange(t)}},
        "agent_infos": {},
        "step_types": _step_types(lengths, StepType.TIMEOUT),
        "lengths": np.array(lengths),
    }
    fields.update(changes)
    return EpisodeBatch(**fields)


def test_dict_observation_batch(dict_spec: EnvSpec) -> None:
    batch = _dict_batch(dict_spec, [4, 2])
    nxt = batch.next_observations
    assert set(nxt) == {"pos", "mode"}
    assert nxt["mode"].tolist() == [1, 2, 3, 3, 5 % 4, 3]
    padded = batch.padded_observations
    assert padded["pos"].shape == (2, 6, 3)
    assert padded["mode"].shape == (2, 6)
    assert not padded["pos"][1, 2:].any()
    actions = batch.padded_actions
    assert isinstance(actions, tuple) and actions[1].shape == (2, 6, 2)
    assert batch.padded_env_infos["task"]["goal"].shape == (2, 6)
    parts = batch.split()
    assert parts[1].observations["pos"].shape == (2, 3)
    assert EpisodeBatch.concatenate(*parts).equals(batch)
    assert EpisodeBatch.from_list(dict_spec, batch.to_list()).equals(batch)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"observations": {"pos": np.zeros((6, 3))}}, r"Each observation has keys \['pos'\]"),
        (
            {"observations": {"pos": np.zeros((6, 2)), "mode": np.zeros(6)}},
            r"Each observation\['pos'\] has shape \(2,\)",
        ),
        (
            {"observations": {"pos": np.zeros((5, 3)), "mode": np.zeros(6)}},
            r"observations\['pos'\] has batch size 5",
        ),
        (
            {"last_observations": {"pos": np.zeros((2, 3)), "mode": np.zeros((2, 2))}},
            r"last_observations must have the same number of entries.*\['mode'\]",
        ),
        ({"actions": (np.zeros(6),)}, "Each action has 1 parts"),
        ({"actions": np.zeros((6, 2))}, "Each action has shape"),
    ],
)
def test_nested_validation_errors(dict_spec: EnvSpec, change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _dict_batch(dict_spec, [4, 2], **change)


# ------------------------------------------------------------------------------- stack_infos


def test_stack_infos_empty() -> None:
    assert stack_infos([], name="env_infos") == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert stack_infos([{}, {}, {}], name="env_infos") == {}


def test_stack_infos_stacks_common_keys() -> None:
    infos = [{"a": 1.0, "b": np.array([i, i]), "n": {"c": i}} for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = stack_infos(infos, name="env_infos")
    assert out["a"].shape == (3,)
    np.testing.assert_array_equal(out["b"], [[0, 0], [1, 1], [2, 2]])
    np.testing.assert_array_equal(out["n"]["c"], [0, 1, 2])


def test_stack_infos_keeps_partial_keys_with_masks() -> None:
    infos = [
        {"a": 0, "b": 1.5, "n": {"x": 0, "y": 1}},
        {"a": 1, "n": {"x": 1}},
        {"a": 2, "c": "s", "n": {"x": 2}},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = stack_infos(infos, name="env_infos")
    assert list(out) == ["a", "b", "_b", "n", "c", "_c"]  # order of first appearance
    assert out["a"].tolist() == [0, 1, 2]
    np.testing.assert_array_equal(out["b"], [1.5, np.nan, np.nan])  # floats: NaN
    assert out["_b"].tolist() == [True, False, False]
    assert out["c"].tolist() == ["", "", "s"]  # strings: empty
    assert out["_c"].tolist() == [False, False, True]
    assert list(out["n"]) == ["x", "y", "_y"]
    assert out["n"]["y"].tolist() == [1, 0, 0]  # integers: zero
    assert out["n"]["_y"].tolist() == [True, False, False]
    objects = stack_infos([{"o": [1, 2]}, {}, {"o": [3]}])
    assert objects["o"].tolist() == [[1, 2], None, [3]]  # objects: None


def test_stack_infos_ragged_values_become_objects() -> None:
    out = stack_infos([{"r": np.zeros(2)}, {"r": np.zeros(3)}], name="agent_infos")
    assert out["r"].dtype == object
    assert out["r"].shape == (2,)
    assert [len(v) for v in out["r"]] == [2, 3]
