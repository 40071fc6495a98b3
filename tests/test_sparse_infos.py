"""Info keys that only some steps carry reach the batch (issue 16), on `local` and `process`.

The rule (asyncsample.batch, "Info keys"): keys on every step are stacked; keys only on episodes'
last steps go to ``episode_infos`` (masked where some episodes lack them); any other sparse key
stays per step, filled where absent, with a ``"_" + key`` mask.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from helpers import SamplerFactory

from asyncsample import EpisodeBatch, Sampler, StepType
from asyncsample._assembly import Plan, assemble
from asyncsample.batch import EnvSpec

# The envs below must reach the env-host processes, which cannot import this module by name.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.timeout(90), pytest.mark.sampler_defaults(seed=7)]


class SparseInfoEnv(gym.Env):
    """Episodes of seeded random length whose infos are dense, periodic, nested and final.

    Every step's info has ``total`` (the env's step count over all episodes) and ``nested``
    (``{"a": total}``, plus ``"c"`` on even totals); ``every_third`` (a float) when ``total`` is
    a multiple of 3; ``success`` (a bool) only on the last step of an episode the env ends; and
    ``extra`` on every step if the env was built with ``extra=True``.
    """

    def __init__(self, extra: bool = False, stop: float = 0.15) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.extra = extra
        self.stop = stop
        self.total = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        super().reset(seed=seed)
        return self.np_random.uniform(-1, 1, 2).astype(np.float32), {}

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        self.total += 1
        obs = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        terminated = bool(self.np_random.random() < self.stop)
        info: dict[str, Any] = {"total": self.total, "nested": {"a": self.total}}
        if self.total % 2 == 0:
            info["nested"]["c"] = np.array([self.total, -self.total])
        if self.total % 3 == 0:
            info["every_third"] = self.total / 3
        if terminated:
            info["success"] = bool(obs[0] > 0)
        if self.extra:
            info["extra"] = np.full(2, self.total, dtype=np.int32)
        return obs, float(action) + float(obs[0]), terminated, False, info


class ReusedInfoEnv(gym.Env):
    """Returns the same info dict every step, holding an array it updates in place."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0
        self.position = np.zeros(2)
        self.info: dict[str, Any] = {"position": self.position}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        super().reset(seed=seed)
        return np.zeros(2, np.float32), self.info

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        self.t += 1
        self.position += 1.0
        self.info["t"] = self.t
        return np.zeros(2, np.float32), 0.0, self.t % 4 == 0, False, self.info


def cartpole_with_stats() -> gym.Env:
    return gym.wrappers.RecordEpisodeStatistics(gym.make("CartPole-v1"))


def sparse_env() -> gym.Env:
    return SparseInfoEnv()


def sparse_env_extra() -> gym.Env:
    return SparseInfoEnv(extra=True)


class SometimesInfoAgent:
    """Action 0; ``value`` always, ``sometimes`` only when env 0's first obs entry is > 0.

    Agent infos are per row (all envs of a worker step), so with one env per worker the
    presence of ``sometimes`` follows that env's observation.
    """

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def get_actions(self, observations: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        n = len(observations)
        infos = {"value": observations[:, 0].astype(np.float64)}
        if observations[0, 0] > 0:
            infos["sometimes"] = observations[:, 1].astype(np.float32)
        return np.zeros(n, dtype=np.int64), infos


class SometimesObsAgent(SometimesInfoAgent):
    """Like :class:`SometimesInfoAgent`, for CartPole (float observations of 4 entries)."""

    def get_actions(self, observations: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        _, infos = super().get_actions(observations)
        return (observations[:, 2] > 0).astype(np.int64), infos


@pytest.fixture(params=["local", "process"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def check_episode_statistics(batch: EpisodeBatch) -> None:
    """``episode`` is in episode_infos only, and its r/l are the batch's returns and lengths."""
    assert "episode" not in batch.env_infos
    assert "_episode" not in batch.env_infos
    ended = np.isin(batch.step_types[np.cumsum(batch.lengths) - 1], (2, 3))
    if not ended.any():  # no episode ended in this batch: no statistics at all
        assert "episode" not in batch.episode_infos
        return
    episode = batch.episode_infos["episode"]
    assert [k for k in episode if not k.startswith("_")] == ["r", "l", "t"]
    has = batch.episode_infos.get("_episode", np.ones(batch.n_episodes, dtype=bool))
    # Only episodes that ended in this batch can carry their statistics.
    assert not (has & ~ended).any()
    # Whole episodes (not continuations of an earlier call's fragment) match the batch itself.
    whole = has & (batch.step_types[np.cumsum(batch.lengths) - batch.lengths] != StepType.MID)
    np.testing.assert_allclose(episode["r"][whole], batch.returns[whole])
    np.testing.assert_array_equal(episode["l"][whole], batch.lengths[whole])
    if "_episode" in batch.episode_infos:  # children are masked too, as in gymnasium
        assert [k for k in episode if k.startswith("_")] == ["_r", "_l", "_t"]
        assert episode["_r"].tolist() == has.tolist()
    assert np.isnan(episode["r"][~has]).all()
    assert (episode["l"][~has] == 0).all()


# ------------------------------------------------------------------- RecordEpisodeStatistics


async def test_record_episode_statistics_samples_and_exact(
    backend: str, make_sampler: SamplerFactory
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the old "Dropped ..." warning is gone
        async with make_sampler(backend, cartpole_with_stats, n_workers=2, envs_per_worker=2) as s:
            for _ in range(2):
                batch = await s.obtain_samples(300)
                check_episode_statistics(batch)
                assert "_episode" not in batch.episode_infos  # every episode is complete
                batch = await s.obtain_exact_episodes(3)
                check_episode_statistics(batch)
                assert batch.n_episodes == 6
                assert "_episode" not in batch.episode_infos


async def test_episodes_cut_by_the_sampler_lack_statistics(
    backend: str, make_sampler: SamplerFactory
) -> None:
    # max_episode_length truncates in the sampler: the env (and its wrapper) never sees an
    # episode end there, so those episodes have no statistics and are masked out.
    async with make_sampler(backend, cartpole_with_stats, n_workers=2, max_episode_length=15) as s:
        batch = await s.obtain_samples(400)
    check_episode_statistics(batch)
    has = batch.episode_infos["_episode"]
    last = batch.step_types[np.cumsum(batch.lengths) - 1]
    cut = (last == StepType.TIMEOUT) & (batch.lengths == 15)
    assert cut.any() and has.any()
    assert not has[cut].any()
    assert has[last == StepType.TERMINAL].all()


async def test_fragments_carry_episode_end_keys_into_the_call_where_they_end(
    backend: str,
    make_sampler: SamplerFactory,
) -> None:
    async with make_sampler(backend, cartpole_with_stats, n_workers=2, envs_per_worker=2) as s:
        running: dict[tuple[int, int], tuple[float, int]] = {}
        ended_in_later_call = 0
        for call in range(6):
            batch = await s.obtain_fragments(40)
            check_episode_statistics(batch)
            has = batch.episode_infos.get("_episode", np.ones(batch.n_episodes, dtype=bool))
            if "episode" not in batch.episode_infos:
                has = np.zeros(batch.n_episodes, dtype=bool)
            for i, ep in enumerate(batch.split()):
                key = (int(ep.episode_infos["worker"][0]), int(ep.episode_infos["env"][0]))
                ret, length = running.pop(key, (0.0, 0))
                if ep.step_types[0] == StepType.MID:
                    assert length > 0  # a continuation of the previous call's fragment
                else:
                    assert length == 0
                ret += float(ep.rewards.sum())
                length += ep.n_transitions
                if ep.step_types[-1] in (StepType.TERMINAL, StepType.TIMEOUT):
                    # The whole episode's statistics arrive with its last fragment.
                    assert has[i]
                    assert batch.episode_infos["episode"]["l"][i] == length
                    assert batch.episode_infos["episode"]["r"][i] == pytest.approx(ret)
                    ended_in_later_call += call > 0 and ep.step_types[0] == StepType.MID
                else:
                    assert not has[i]
                    running[key] = (ret, length)
        assert ended_in_later_call > 0


async def test_stream_carries_episodes_with_their_statistics_and_masks(
    backend: str, make_sampler: SamplerFactory
) -> None:
    # A stream of complete episodes carries the running ones (their rows, agent-info presence
    # included) into the next round; each yielded batch is a concatenation of rounds.
    async with make_sampler(backend, cartpole_with_stats, SometimesObsAgent(), n_workers=2) as s:
        async with contextlib.aclosing(s.stream(150)) as stream:
            seen = 0
            async for batch in stream:
                check_episode_statistics(batch)
                assert "_episode" not in batch.episode_infos
                present = batch.observations[:, 0] > 0
                assert batch.agent_infos["_sometimes"].tolist() == present.tolist()
                np.testing.assert_array_equal(
                    batch.agent_infos["sometimes"][present], batch.observations[present, 1]
                )
                seen += 1
                if seen == 3:
                    break


# ------------------------------------------------------------------- sparse step keys


def check_sparse_env_infos(batch: EpisodeBatch) -> None:
    infos = batch.env_infos
    total = infos["total"]
    assert "_total" not in infos
    # Every third step: float, NaN where absent, mask true exactly on multiples of 3.
    assert infos["_every_third"].tolist() == (total % 3 == 0).tolist()
    np.testing.assert_array_equal(infos["every_third"][total % 3 == 0], total[total % 3 == 0] / 3)
    assert np.isnan(infos["every_third"][total % 3 != 0]).all()
    # Nested: "a" everywhere, "c" on even totals, with its own mask inside the nested dict.
    nested = infos["nested"]
    assert "_nested" not in infos
    np.testing.assert_array_equal(nested["a"], total)
    assert nested["_c"].tolist() == (total % 2 == 0).tolist()
    even = total % 2 == 0
    np.testing.assert_array_equal(nested["c"][even], np.stack([total[even], -total[even]], 1))
    assert (nested["c"][~even] == 0).all()
    # A key only on the env's own episode ends: per episode, masked where the episode was cut.
    assert "success" not in infos
    last = batch.step_types[np.cumsum(batch.lengths) - 1]
    assert "success" in batch.episode_infos
    has = batch.episode_infos["_success"] if "_success" in batch.episode_infos else None
    terminal = last == StepType.TERMINAL
    if has is None:
        assert terminal.all()
    else:
        assert has.tolist() == terminal.tolist()


async def test_periodic_nested_and_final_keys(backend: str, make_sampler: SamplerFactory) -> None:
    async with make_sampler(
        backend, sparse_env, n_workers=2, envs_per_worker=2, max_episode_length=12
    ) as s:
        for batch in (
            await s.obtain_samples(200),
            await s.obtain_exact_episodes(4),
            await s.obtain_fragments(60),
            await s.obtain_fragments(60),
        ):
            check_sparse_env_infos(batch)


async def test_key_emitted_by_some_envs_of_a_worker(
    backend: str, make_sampler: SamplerFactory
) -> None:
    envs = [[sparse_env_extra, sparse_env], [sparse_env, sparse_env_extra]]
    async with make_sampler(backend, envs, n_workers=2, envs_per_worker=2) as s:
        batch = await s.obtain_samples(200)
    by_step = batch.episode_infos_by_step
    expected = (by_step["worker"] == by_step["env"]).tolist()  # worker 0 env 0, worker 1 env 1
    assert batch.env_infos["_extra"].tolist() == expected
    assert any(expected) and not all(expected)
    extra = batch.env_infos["extra"]
    assert extra.dtype == np.int32 and extra.shape == (batch.n_transitions, 2)
    mask = batch.env_infos["_extra"]
    np.testing.assert_array_equal(extra[mask][:, 0], batch.env_infos["total"][mask])
    assert (extra[~mask] == 0).all()


async def test_sparse_agent_infos(backend: str, make_sampler: SamplerFactory) -> None:
    async with make_sampler(backend, sparse_env, SometimesInfoAgent(), n_workers=2) as s:
        for batch in (await s.obtain_samples(150), await s.obtain_fragments(50)):
            infos = batch.agent_infos
            assert "_value" not in infos
            np.testing.assert_array_equal(infos["value"], batch.observations[:, 0])
            present = batch.observations[:, 0] > 0
            assert infos["_sometimes"].tolist() == present.tolist()
            np.testing.assert_array_equal(
                infos["sometimes"][present], batch.observations[present, 1]
            )
            assert np.isnan(infos["sometimes"][~present]).all()


# ------------------------------------------------------------------- backends agree


async def test_backends_give_the_same_batch(make_sampler: SamplerFactory) -> None:
    envs = [[sparse_env_extra, sparse_env], [sparse_env, sparse_env_extra]]
    results: dict[str, list[EpisodeBatch]] = {}
    for backend in ("local", "process"):
        async with make_sampler(
            backend,
            envs,
            SometimesInfoAgent(),
            n_workers=2,
            envs_per_worker=2,
            max_episode_length=10,
        ) as s:
            results[backend] = [
                await s.obtain_samples(120),
                await s.obtain_exact_episodes(3),
                await s.obtain_fragments(50),
                await s.obtain_fragments(50),
            ]
    for local, process in zip(results["local"], results["process"], strict=True):
        assert "_every_third" in local.env_infos and "success" in local.episode_infos
        assert local.equals(process)


async def test_infos_are_snapshots_on_every_backend(
    backend: str, make_sampler: SamplerFactory
) -> None:
    # The local backend must not keep references to what the env mutates later: it copies
    # infos as the process backend's pickling does.
    async with make_sampler(backend, ReusedInfoEnv, n_workers=1, max_episode_length=50) as s:
        batch = await s.obtain_samples(12)
    t = batch.env_infos["t"]
    assert t.tolist() == list(range(1, 13))
    np.testing.assert_array_equal(batch.env_infos["position"], np.stack([t, t], 1))
    # Reset infos too: each episode keeps the position its reset saw.
    np.testing.assert_array_equal(batch.episode_infos["position"][:, 0], [0, 4, 8])


# ------------------------------------------------------------------- assembly of agent infos


def _plan(
    agent_infos: dict[str, np.ndarray],
    masks: dict[str, np.ndarray],
    lengths: list[int],
    ends: list[StepType | None],
) -> Plan:
    """A one-env plan of consecutive episodes over rows 0..sum(lengths)-1."""
    rows = sum(lengths)
    step_types = []
    for n, end in zip(lengths, ends, strict=True):
        step_types += [StepType.FIRST] + [StepType.MID] * (n - 1)
        if end is not None:
            step_types[-1] = end
    return Plan(
        obs=np.zeros((rows, 1, 2), np.float32),
        actions=np.zeros((rows, 1), np.int64),
        rewards=np.ones((rows, 1)),
        agent_infos=agent_infos,
        env_infos={},
        like_obs=np.zeros((1, 2), np.float32),
        like_actions=np.zeros(1, np.int64),
        rows=np.arange(rows),
        envs=np.zeros(rows, np.int64),
        lengths=np.array(lengths, np.int64),
        step_types=np.array(step_types, np.uint8),
        last_observations=[np.zeros(2, np.float32)] * len(lengths),
        episode_infos=[{"worker": 0, "env": 0, "agent_version": 0}] * len(lengths),
        agent_info_masks=masks,
    )


def test_agent_info_only_on_last_steps_goes_to_episode_infos() -> None:
    spec = EnvSpec(gym.spaces.Box(-1, 1, (2,)), gym.spaces.Discrete(2))
    lengths, ends = [2, 3, 2], [StepType.TERMINAL, StepType.TIMEOUT, None]
    final = np.array([0, 1, 0, 0, 1, 0, 0], bool)[:, None]  # the last steps of episodes 0, 1
    plan = _plan(
        {"final": np.arange(7.0)[:, None], "dense": np.arange(7)[:, None]},
        {"final": final},
        lengths,
        ends,
    )
    batch = assemble(spec, [plan])
    assert list(batch.agent_infos) == ["dense"]
    np.testing.assert_array_equal(batch.agent_infos["dense"], np.arange(7))
    assert batch.episode_infos["final"].tolist()[:2] == [1.0, 4.0]
    assert np.isnan(batch.episode_infos["final"][2])  # a fragment: no last step here
    assert batch.episode_infos["_final"].tolist() == [True, True, False]
    # The same key on a step that is not an episode's last stays a sparse step key.
    final[2] = True
    batch = assemble(spec, [plan])
    assert "final" not in batch.episode_infos
    assert batch.agent_infos["_final"].tolist() == final[:, 0].tolist()
    # A plan without the key contributes absent rows; a key no row has is left out.
    other = _plan({"dense": np.zeros((2, 1), np.int64)}, {}, [2], [StepType.TERMINAL])
    batch = assemble(spec, [plan, other])
    assert batch.agent_infos["_final"].tolist() == [*final[:, 0].tolist(), False, False]
    gone = _plan(
        {"old": np.ones((2, 1))}, {"old": np.zeros((2, 1), bool)}, [2], [StepType.TERMINAL]
    )
    assert "old" not in assemble(spec, [gone]).agent_infos


# ------------------------------------------------------------------- batch methods


@pytest.fixture(scope="module")
def sparse_batch() -> EpisodeBatch:
    import asyncio

    async def sample() -> EpisodeBatch:
        async with Sampler(  # a module-scoped fixture: make_sampler is per test
            [[sparse_env_extra, sparse_env]],
            SometimesInfoAgent(),
            backend="local",
            seed=7,
            n_workers=1,
            envs_per_worker=2,
            max_episode_length=8,
        ) as s:
            await s.obtain_fragments(30)
            return await s.obtain_fragments(30)

    batch = asyncio.run(sample())
    # Make sure the batch exercises every kind of key.
    assert "_extra" in batch.env_infos and "_every_third" in batch.env_infos
    assert "_success" in batch.episode_infos and "_sometimes" in batch.agent_infos
    return batch


def test_split_select_and_concatenate_keep_masks(sparse_batch: EpisodeBatch) -> None:
    batch = sparse_batch
    assert EpisodeBatch.concatenate(*batch.split()).equals(batch)
    chosen = [0, 2, 3]
    picked = batch.select(chosen)
    slices = batch.episode_slices
    steps = np.concatenate([np.arange(slices[i].start, slices[i].stop) for i in chosen])
    assert picked.env_infos["_extra"].tolist() == batch.env_infos["_extra"][steps].tolist()
    assert picked.episode_infos["_success"].tolist() == (
        batch.episode_infos["_success"][chosen].tolist()
    )
    assert EpisodeBatch.concatenate(
        batch.select([0, 1]), batch.select(range(2, batch.n_episodes))
    ).equals(batch)


def test_to_list_from_list_round_trip(sparse_batch: EpisodeBatch) -> None:
    batch = sparse_batch
    again = EpisodeBatch.from_list(batch.env_spec, batch.to_list())
    assert again.equals(batch)


def test_concatenate_with_a_batch_without_the_sparse_keys(sparse_batch: EpisodeBatch) -> None:
    batch = sparse_batch
    plain = dataclass_replace(
        batch,
        env_infos={"total": batch.env_infos["total"]},
        agent_infos={},
        episode_infos={k: batch.episode_infos[k] for k in ("worker", "env", "agent_version")},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        joined = EpisodeBatch.concatenate(batch, plain)
    t, n = batch.n_transitions, batch.n_episodes
    assert list(batch.env_infos) == [
        "total",
        "nested",
        "extra",
        "_extra",
        "every_third",
        "_every_third",
    ]
    assert list(joined.env_infos) == [
        "total",
        "nested",
        "_nested",
        "extra",
        "_extra",
        "every_third",
        "_every_third",
    ]
    assert (
        joined.env_infos["_extra"].tolist() == [*batch.env_infos["_extra"].tolist()] + [False] * t
    )
    assert joined.env_infos["_nested"].tolist() == [True] * t + [False] * t
    assert joined.env_infos["nested"]["_a"].tolist() == [True] * t + [False] * t
    assert np.isnan(joined.env_infos["every_third"][t:]).all()
    assert joined.episode_infos["_success"].tolist() == [
        *batch.episode_infos["_success"].tolist(),
        *[False] * n,
    ]
    assert joined.agent_infos["_value"].tolist() == [True] * t + [False] * t
    # Splitting the joined batch and joining again changes nothing.
    assert EpisodeBatch.concatenate(*joined.split()).equals(joined)
    # The other order gives the same keys, masks first false.
    flipped = EpisodeBatch.concatenate(plain, batch)
    assert flipped.env_infos["_extra"].tolist() == [False] * t + batch.env_infos["_extra"].tolist()


def test_padding_masks_and_fills(sparse_batch: EpisodeBatch) -> None:
    batch = sparse_batch
    padded = batch.padded_env_infos
    valids = batch.valids.astype(bool)
    mask = padded["_every_third"]
    assert mask.shape == valids.shape
    assert mask[valids].tolist() == batch.env_infos["_every_third"].tolist()
    assert not mask[~valids].any()
    assert np.isnan(padded["every_third"][~mask]).all()
    assert (padded["total"][~valids] == 0).all()  # a dense key pads with zero, as in garage
    agent = batch.padded_agent_infos
    assert not agent["_sometimes"][~valids].any()
    assert np.isnan(agent["sometimes"][~agent["_sometimes"]]).all()


def test_equals_sees_masks(sparse_batch: EpisodeBatch) -> None:
    batch = sparse_batch
    mask = batch.env_infos["_extra"].copy()
    mask[0] = not mask[0]
    other = dataclass_replace(batch, env_infos={**batch.env_infos, "_extra": mask})
    assert not batch.equals(other)
    assert batch.equals(dataclass_replace(batch))


def dataclass_replace(batch: EpisodeBatch, **changes: Any) -> EpisodeBatch:
    import dataclasses

    return dataclasses.replace(batch, **changes)
