"""The sampler's observable behaviour (garage's sampler tests, ported), on every backend."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import warnings

import gymnasium as gym
import numpy as np
import pytest
from envs import (
    SCRIPT,
    AlwaysFailingEnv,
    AsyncScriptedAgent,
    BadShapeEnv,
    ConstantAgent,
    FailingEnv,
    GridWorldEnv,
    NoisyEnv,
    ParamAgent,
    PointEnv,
    ScriptedAgent,
)
from helpers import SamplerFactory

from asyncsample import (
    EpisodeBatch,
    FragmentWorker,
    NewEnvUpdate,
    Sampler,
    SamplerClosedError,
    SetTaskUpdate,
    StepType,
    Transition,
    VecWorker,
    WorkerError,
    WorkerFactory,
)
from asyncsample._config import SamplerConfig
from asyncsample._engine import share_of

pytestmark = pytest.mark.timeout(60)

SCRIPTED_OBS = [0, 1, 2, 6, 10, 14]
SCRIPTED_ACTIONS = [2, 2, 1, 1, 1, 2]
SCRIPTED_REWARDS = [0, 0, 0, 0, 0, 1]


@pytest.fixture(params=["local", "process", "ray"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param


def grid(desc: str = "4x4"):
    return functools.partial(GridWorldEnv, desc)


def assert_scripted(batch: EpisodeBatch) -> None:
    for ep in batch.split():
        assert ep.observations.tolist() == SCRIPTED_OBS
        assert ep.actions.tolist() == SCRIPTED_ACTIONS
        assert ep.rewards.tolist() == SCRIPTED_REWARDS
        assert ep.last_observations.tolist() == [15]
        assert [StepType(s) for s in ep.step_types] == [StepType.FIRST] + [StepType.MID] * 4 + [
            StepType.TERMINAL
        ]


def per_worker_lengths(batch: EpisodeBatch, n_workers: int) -> list[int]:
    workers = batch.episode_infos["worker"]
    return [int(batch.lengths[workers == w].sum()) for w in range(n_workers)]


async def test_obtain_samples_scripted_trajectories(
    backend: str, make_sampler: SamplerFactory
) -> None:
    async with make_sampler(backend, agent=ScriptedAgent(), n_workers=4, envs_per_worker=3) as s:
        batch = await s.obtain_samples(100)
    assert_scripted(batch)
    # Each worker's share is 25: its complete episodes reach it, and at most the episodes that
    # completed on that last step (one per env) go beyond it.
    for total in per_worker_lengths(batch, 4):
        assert 25 <= total < 25 + 3 * 6
    assert s.total_env_steps == batch.n_transitions


async def test_output_is_worker_major(backend: str, make_sampler: SamplerFactory) -> None:
    async with make_sampler(backend, env=NoisyEnv, n_workers=3, envs_per_worker=2, seed=3) as s:
        batch = await s.obtain_samples(300)
    workers = batch.episode_infos["worker"]
    assert workers.tolist() == sorted(workers.tolist())
    assert set(workers.tolist()) == {0, 1, 2}
    assert set(batch.episode_infos["env"].tolist()) == {0, 1}


async def test_obtain_exact_episodes_per_worker_and_env(
    backend: str, make_sampler: SamplerFactory
) -> None:
    agents = [ConstantAgent(w % 4) for w in range(8)]
    async with make_sampler(
        backend, agent=agents, n_workers=8, envs_per_worker=2, max_episode_length=15
    ) as s:
        batch = await s.obtain_exact_episodes(3)
    assert batch.n_episodes == 24
    for k, ep in enumerate(batch.split()):
        worker = k // 3
        assert ep.episode_infos["worker"][0] == worker
        assert set(ep.actions.tolist()) == {worker % 4}
        assert ep.agent_infos["action_copy"].tolist() == ep.actions.tolist()
    # Env 0 of each worker runs 2 of the 3 episodes, env 1 runs 1.
    envs = batch.episode_infos["env"].reshape(8, 3)
    assert (np.sort(envs, axis=1) == [0, 0, 1]).all()


async def test_max_episode_length_gives_timeout_with_true_last_observation(
    backend: str, make_sampler: SamplerFactory
) -> None:
    async with make_sampler(
        backend, env=grid("no_goal"), agent=ConstantAgent(1), n_workers=2, max_episode_length=5
    ) as s:
        batch = await s.obtain_exact_episodes(2)
    assert batch.lengths.tolist() == [5] * 4
    for ep in batch.split():
        # Walking down from cell 0: 4, 8, 12, then stuck at 12 on the bottom row.
        assert ep.observations.tolist() == [0, 4, 8, 12, 12]
        assert ep.last_observations.tolist() == [12]
        assert StepType(ep.step_types[-1]) == StepType.TIMEOUT
        assert StepType(ep.step_types[0]) == StepType.FIRST
    assert s.env_spec.max_episode_length == 5


async def test_env_truncation_gives_timeout(backend: str, make_sampler: SamplerFactory) -> None:
    env = functools.partial(gym.wrappers.TimeLimit, GridWorldEnv("no_goal"), 7)
    async with make_sampler(backend, env=env, agent=ConstantAgent(2), n_workers=1) as s:
        batch = await s.obtain_exact_episodes(2)
        assert s.env_spec.max_episode_length == 7
    assert batch.lengths.tolist() == [7, 7]
    assert [StepType(t) for t in batch.step_types[[6, 13]]] == [StepType.TIMEOUT] * 2


async def test_one_step_episodes_are_terminal(backend: str, make_sampler: SamplerFactory) -> None:
    async with make_sampler(
        backend, env=grid("hole_first"), agent=ConstantAgent(2), n_workers=2
    ) as s:
        batch = await s.obtain_samples(10)
    assert set(batch.lengths.tolist()) == {1}
    assert {StepType(t) for t in batch.step_types} == {StepType.TERMINAL}


async def test_fragments_sizes_and_continuation(backend: str, make_sampler: SamplerFactory) -> None:
    n_workers, n_envs = 2, 5
    async with make_sampler(
        backend, agent=ScriptedAgent(), n_workers=n_workers, envs_per_worker=n_envs
    ) as s:
        batches = [await s.obtain_fragments(16) for _ in range(5)]
    for batch in batches:
        # share 8 per worker -> ceil(8 / 5) = 2 steps of 5 envs = 10 transitions per worker.
        assert batch.n_transitions == 20
        assert 16 <= batch.n_transitions < 16 + n_workers * n_envs
    # Glue the fragments of each (worker, env) together: they form the scripted episode.
    streams: dict[tuple[int, int], list[int]] = {}
    for batch in batches:
        for ep in batch.split():
            key = (int(ep.episode_infos["worker"][0]), int(ep.episode_infos["env"][0]))
            types = [StepType(t) for t in ep.step_types]
            stream = streams.setdefault(key, [])
            if types[0] == StepType.MID:
                assert stream and len(stream) % 6 != 0  # continues an open episode
            else:
                assert types[0] in (StepType.FIRST, StepType.TERMINAL)
                assert len(stream) % 6 == 0
            if types[-1] in (StepType.FIRST, StepType.MID):
                # Cut by the call: the last observation is where the env is now.
                position = (len(stream) + len(types)) % 6
                assert ep.last_observations.tolist() == [SCRIPTED_OBS[position]]
            stream.extend(ep.observations.tolist())
    for stream in streams.values():
        assert stream == (SCRIPTED_OBS * 2)[: len(stream)]
        assert len(stream) == 10


async def test_other_calls_reset_fragments(backend: str, make_sampler: SamplerFactory) -> None:
    async with make_sampler(backend, agent=ScriptedAgent(), n_workers=1, envs_per_worker=2) as s:
        await s.obtain_fragments(4)  # 2 steps of each env
        await s.obtain_samples(6)
        batch = await s.obtain_fragments(4)
    assert batch.observations.tolist() == [0, 1, 0, 1]
    assert [StepType(t) for t in batch.step_types] == [StepType.FIRST, StepType.MID] * 2


async def test_agent_update_resets_fragments_and_bumps_version(
    backend: str, make_sampler: SamplerFactory
) -> None:
    agent = ParamAgent()
    async with make_sampler(backend, agent=[agent], n_workers=1) as s:
        first = await s.obtain_fragments(3)
        second = await s.obtain_fragments(3, agent_update=np.asarray(SCRIPT))
    assert first.episode_infos["agent_version"].tolist() == [0]
    assert second.episode_infos["agent_version"].tolist() == [1]
    assert second.observations.tolist() == [0, 1, 2]  # restarted, not continued


async def test_vec_worker_matches_single_env_workers(
    backend: str, make_sampler: SamplerFactory
) -> None:
    maps = ["4x4", "hole_first", "no_goal", "4x4", "hole_first"]
    envs = [grid(m) for m in maps]
    async with make_sampler(
        backend, env=envs, agent=ScriptedAgent(), n_workers=5, max_episode_length=9
    ) as singles:
        a = await singles.obtain_samples(100)
    async with make_sampler(
        backend,
        env=[envs],
        agent=ScriptedAgent(),
        n_workers=1,
        envs_per_worker=5,
        max_episode_length=9,
    ) as vec:
        b = await vec.obtain_samples(100)

    def episodes(batch: EpisodeBatch) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
        return {(tuple(e.actions.tolist()), tuple(e.observations.tolist())) for e in batch.split()}

    assert episodes(a) == episodes(b)
    assert len(episodes(a)) == 3  # goal, 1-step hole, 9-step truncation


async def test_env_update_gives_each_worker_its_task(
    backend: str, make_sampler: SamplerFactory
) -> None:
    goals = [(float(i), -float(i)) for i in range(4)]
    updates = [SetTaskUpdate(PointEnv, {"goal": g}) for g in goals]
    async with make_sampler(backend, env=PointEnv, n_workers=4, max_episode_length=16, seed=0) as s:
        batch = await s.obtain_samples(161, env_update=updates)
        with pytest.raises(ValueError, match="n_workers"):
            await s.obtain_samples(10, env_update=updates + updates[:1])
    for ep in batch.split():
        w = int(ep.episode_infos["worker"][0])
        assert ep.episode_infos["goal"][0].tolist() == list(goals[w])
        assert ep.env_infos["task"]["goal"][0].tolist() == list(goals[w])
    assert np.var([e.rewards.mean() for e in batch.split()]) > 1e-2


async def test_init_with_env_updates_and_new_env_update(
    backend: str, make_sampler: SamplerFactory
) -> None:
    updates = [SetTaskUpdate(PointEnv, {"goal": (2.0, 2.0)}) for _ in range(2)]
    async with make_sampler(backend, env=updates, n_workers=2, max_episode_length=10, seed=1) as s:
        batch = await s.obtain_samples(40)
        assert {tuple(g) for g in batch.episode_infos["goal"].tolist()} == {(2.0, 2.0)}
        batch = await s.obtain_samples(40, env_update=NewEnvUpdate(lambda: PointEnv((3.0, 0.0))))
        assert {tuple(g) for g in batch.episode_infos["goal"].tolist()} == {(3.0, 0.0)}
        # Per-env updates inside the per-worker list.
        inner = [[lambda: PointEnv((0.5, 0.5)), lambda: PointEnv((-0.5, 0.5))]] * 2
        with pytest.raises(ValueError, match="envs_per_worker"):
            await s.obtain_samples(40, env_update=inner)
    async with make_sampler(
        backend, env=PointEnv, n_workers=2, envs_per_worker=2, max_episode_length=10
    ) as s:
        batch = await s.obtain_exact_episodes(2, env_update=inner)
        goals = batch.episode_infos["goal"][batch.episode_infos["env"] == 1]
        assert {tuple(g) for g in goals.tolist()} == {(-0.5, 0.5)}


async def test_list_length_errors_before_any_work(
    backend: str, make_sampler: SamplerFactory
) -> None:
    async with make_sampler(backend, agent=ScriptedAgent(), n_workers=3) as s:
        with pytest.raises(ValueError, match="n_workers"):
            await s.obtain_samples(10, agent_update=[None, None])
        with pytest.raises(ValueError, match="list of agents"):
            await s.obtain_samples(10, agent_update=[np.asarray(SCRIPT)] * 3)
        with pytest.raises(ValueError, match="n_workers"):
            await s.obtain_exact_episodes(1, env_update=[grid()] * 4)
        with pytest.raises(TypeError, match="env_update"):
            await s.obtain_samples(10, env_update=42)
        assert s.total_env_steps == 0
        batch = await s.obtain_samples(10)
    assert_scripted(batch)


@pytest.mark.parametrize("bad", [True, 2.0, "3", None])
async def test_quota_type_errors(bad: object, make_sampler: SamplerFactory) -> None:
    async with make_sampler("local", agent=ScriptedAgent()) as s:
        for call in (s.obtain_samples, s.obtain_exact_episodes, s.obtain_fragments):
            with pytest.raises(TypeError, match="must be an int"):
                await call(bad)  # type: ignore[arg-type]


async def test_quota_value_errors_and_numpy_ints(make_sampler: SamplerFactory) -> None:
    async with make_sampler("local", agent=ScriptedAgent()) as s:
        with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
            await s.obtain_samples(0)
        with pytest.raises(ValueError, match="n_eps_per_worker must be >= 1, got -1"):
            await s.obtain_exact_episodes(-1)
        batch = await s.obtain_exact_episodes(np.int64(2))
    assert batch.n_episodes == 4


async def test_same_seed_same_batches_different_seed_different(
    backend: str, make_sampler: SamplerFactory
) -> None:
    async def run(seed: int) -> list[EpisodeBatch]:
        async with make_sampler(
            backend, env="CartPole-v1", n_workers=3, envs_per_worker=2, seed=seed
        ) as s:
            return [
                await s.obtain_samples(500),
                await s.obtain_exact_episodes(3),
                await s.obtain_fragments(200),
                await s.obtain_fragments(200),
            ]

    a, b, c = await run(7), await run(7), await run(8)
    assert all(x.equals(y) for x, y in zip(a, b))
    assert not a[0].equals(c[0])


async def test_async_agent(backend: str, make_sampler: SamplerFactory) -> None:
    async with make_sampler(
        backend, agent=AsyncScriptedAgent(), n_workers=2, envs_per_worker=2
    ) as s:
        batch = await s.obtain_samples(30)
    assert_scripted(batch)


async def test_custom_worker_hooks(backend: str, make_sampler: SamplerFactory) -> None:
    class FlippingWorker(VecWorker):
        """Post-processes actions (maps 'left' to 'right') and records rewards."""

        async def compute_actions(self, observations):
            actions, infos = await super().compute_actions(observations)
            return np.where(actions == 0, 2, actions), infos

        def process_transition(self, history, transition: Transition):
            history = history or []
            history.append(float(transition.rewards[transition.active].sum()))
            return history

    async with make_sampler(
        backend,
        agent=ConstantAgent(0),
        n_workers=2,
        worker_class=FlippingWorker,
        env=grid("no_goal"),
        max_episode_length=4,
    ) as s:
        batch = await s.obtain_exact_episodes(1)
        histories = [w.history for w in s.workers]
    assert set(batch.actions.tolist()) == {2}
    assert [len(h) for h in histories] == [4, 4]


async def test_from_worker_factory(backend: str) -> None:
    factory = WorkerFactory(
        max_episode_length=16,
        seed=100,
        n_workers=2,
        worker_class=FragmentWorker,
        worker_args={"n_envs": 3},
    )
    async with Sampler.from_worker_factory(
        factory, ScriptedAgent(), grid(), backend=backend, n_processes=2
    ) as s:
        assert s.envs_per_worker == 3
        assert all(isinstance(w, FragmentWorker) for w in s.workers)
        batch = await s.obtain_samples(40)
    assert_scripted(batch)
    with pytest.raises(ValueError, match="Worker number is too big"):
        factory(2)
    assert factory.prepare_worker_messages(5) == [5, 5]
    with pytest.raises(ValueError, match="Length of list"):
        factory.prepare_worker_messages([1, 2, 3])


async def test_concurrent_calls_are_queued(backend: str, make_sampler: SamplerFactory) -> None:
    async with make_sampler(backend, agent=ScriptedAgent(), n_workers=2, envs_per_worker=2) as s:
        batches = await asyncio.gather(*(s.obtain_samples(24) for _ in range(6)))
    for batch in batches:
        assert_scripted(batch)
        assert batch.n_transitions >= 24
    assert s.total_env_steps == sum(b.n_transitions for b in batches)


async def test_closed_sampler(backend: str, make_sampler: SamplerFactory) -> None:
    s = make_sampler(backend, agent=ScriptedAgent())
    await s.obtain_samples(6)
    await s.aclose()
    await s.aclose()
    with pytest.raises(SamplerClosedError):
        await s.obtain_samples(6)
    never_started = make_sampler(backend, agent=ScriptedAgent())
    await never_started.aclose()
    with pytest.raises(SamplerClosedError):
        await never_started.obtain_fragments(6)


async def test_wrong_number_of_actions(make_sampler: SamplerFactory) -> None:
    class TooFew:
        def get_actions(self, observations):
            return np.zeros(len(observations) - 1, dtype=np.int64), {}

    async with make_sampler("local", agent=TooFew(), envs_per_worker=3) as s:
        with pytest.raises(ValueError, match=r"action.*worker 0.*exactly envs_per_worker \(3\)"):
            await s.obtain_samples(10)


async def test_observation_that_does_not_fit(backend: str, make_sampler: SamplerFactory) -> None:
    async with make_sampler(backend, env=BadShapeEnv, n_workers=1) as s:
        with pytest.raises((ValueError, WorkerError), match=r"observation.*worker 0, env 0"):
            await s.obtain_samples(10)
        assert s.restarts == 0  # the caller's mistake: never retried


@pytest.mark.parametrize("where", ["step", "reset"])
async def test_env_exception_is_retried_and_quota_still_met(
    backend: str, where: str, tmp_path, make_sampler: SamplerFactory
) -> None:
    env = functools.partial(FailingEnv, str(tmp_path / "failed"), 3, where)
    async with make_sampler(backend, env=env, n_workers=2, seed=0, envs_per_worker=2) as s:
        batch = await s.obtain_samples(200)
        assert s.restarts == 1
    for total in per_worker_lengths(batch, 2):
        assert total >= 100
    for ep in batch.split():
        assert StepType(ep.step_types[-1]) in (StepType.TERMINAL, StepType.TIMEOUT)


async def test_env_exception_past_the_budget(backend: str, make_sampler: SamplerFactory) -> None:
    async with make_sampler(backend, env=AlwaysFailingEnv, n_workers=2, max_restarts=2) as s:
        with pytest.raises(WorkerError, match=r"worker \d, env 0") as info:
            await s.obtain_samples(50)
        assert isinstance(info.value.__cause__, ValueError)
        assert "this env always fails" in str(info.value)
        assert s.restarts >= 2
    assert s.closed


async def test_warns_when_episodes_may_never_end(make_sampler: SamplerFactory) -> None:
    async with make_sampler("local", env=grid(), agent=ScriptedAgent()) as s:
        with pytest.warns(RuntimeWarning, match="no time limit"):
            await s.obtain_samples(6)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            await s.obtain_samples(6)  # once only


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        Sampler("CartPole-v1", backend="threads")
    with pytest.raises(ValueError, match="unknown gymnasium env id 'NoSuchEnv-v0'"):
        Sampler("NoSuchEnv-v0")
    with pytest.raises(TypeError, match="n_workers must be an int"):
        Sampler("CartPole-v1", n_workers=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="envs_per_worker must be >= 1"):
        Sampler("CartPole-v1", envs_per_worker=0)
    with pytest.raises(ValueError, match="step_timeout cannot be used with backend='local'"):
        Sampler("CartPole-v1", backend="local", step_timeout=1.0)
    with pytest.raises(ValueError, match=r"env: a list must hold exactly n_workers \(2\)"):
        Sampler(["CartPole-v1"] * 3)
    with pytest.raises(TypeError, match="agent must have a get_actions"):
        Sampler("CartPole-v1", agent=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="env must be a gymnasium id"):
        Sampler(42)  # type: ignore[arg-type]


def test_unpicklable_env_factory() -> None:
    import threading

    lock = threading.Lock()

    def factory() -> gym.Env:
        _ = lock  # a lock cannot be pickled
        return NoisyEnv()

    with pytest.raises(TypeError, match="env must be picklable"):
        Sampler(factory, backend="process")
    Sampler(factory, backend="local")  # nothing to pickle in-process


def test_quota_split_is_fixed() -> None:
    assert [share_of(10, 3, w) for w in range(3)] == [4, 3, 3]
    assert sum(share_of(11, 3, w) for w in range(3)) == 11


class ImageEnv(NoisyEnv):
    """84x84x4 uint8 observations (an Atari frame stack) drawn from the env's own generator."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_space = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.np_random.integers(0, 255, (84, 84, 4), dtype=np.uint8), {}

    def step(self, action):
        _, r, term, trunc, info = super().step(action)
        return self.np_random.integers(0, 255, (84, 84, 4), dtype=np.uint8), r, term, trunc, info


async def test_large_image_batches_agree_across_backends(make_sampler: SamplerFactory) -> None:
    # Over 1 MiB of observations per call: batches are put together in a thread.
    async def run(backend: str) -> list[EpisodeBatch]:
        async with make_sampler(
            backend, env=ImageEnv, n_workers=2, envs_per_worker=3, seed=11, max_episode_length=40
        ) as s:
            return [await s.obtain_fragments(120), await s.obtain_samples(120)]

    local, process = await run("local"), await run("process")
    assert local[0].observations.nbytes > 1 << 20
    assert all(a.equals(b) for a, b in zip(local, process))


def test_the_config_carries_every_argument_of_the_public_signature() -> None:
    # Sampler builds a SamplerConfig once and the core reads it: an argument added to one and
    # not the other would be dropped or fail at construction.
    params = list(inspect.signature(Sampler.__init__).parameters)[1:]
    assert [f.name for f in dataclasses.fields(SamplerConfig)] == params
