"""asyncsample.sb3.AsyncSampleVecEnv against Stable-Baselines3's expectations of a VecEnv.

The checks follow SB3's tests/test_vec_envs.py for SubprocVecEnv (custom calls with indices,
terminal observations under VecNormalize and VecFrameStack, every observation space, Monitor
detection, seeding), rewritten here, plus a step-for-step comparison with DummyVecEnv.
"""

from __future__ import annotations

import collections
import functools
import os
import signal
import sys
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from helpers import count_loop_runs, patient_direct_reads, wait_gone
from test_vector_env import FaultyEnv, faulty

pytest.importorskip("stable_baselines3")

from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import (
    DummyVecEnv,
    VecEnv,
    VecFrameStack,
    VecNormalize,
)

from asyncsample import StepTimeoutError, WorkerCrashedError
from asyncsample.sb3 import AsyncSampleVecEnv
from asyncsample.vector import SubEnvError

# Every test builds SB3 wrappers over a fresh pool (8-12 s each on 2 loaded cores): run in CI with
# -m slow, not in the default run.
pytestmark = pytest.mark.slow

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N_ENVS = 3

WRAPPERS = [None, VecNormalize, VecFrameStack]
SPACES = collections.OrderedDict(
    [
        ("discrete", spaces.Discrete(2)),
        ("multidiscrete", spaces.MultiDiscrete([2, 3])),
        ("multibinary", spaces.MultiBinary(3)),
        ("continuous", spaces.Box(low=np.zeros(2), high=np.ones(2))),
    ]
)


class SpaceEnv(gym.Env[Any, Any]):
    """Observations and actions from ``space``; episodes of ``ep_length`` steps; renders."""

    def __init__(self, space: gym.Space[Any], render_mode: str | None = "rgb_array") -> None:
        self.action_space = space
        self.observation_space = space
        self.current_step = 0
        self.ep_length = 4
        self.render_mode = render_mode

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        super().reset(seed=seed)
        if seed is not None:
            self.observation_space.seed(seed)
        self.current_step = 0
        return self.observation_space.sample(), {"options": options} if options else {}

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        reward = float(self.np_random.random())
        self.current_step += 1
        done = self.current_step >= self.ep_length
        return self.observation_space.sample(), reward, done, done, {"step": self.current_step}

    def render(self) -> np.ndarray | None:  # type: ignore[override]
        return np.zeros((4, 4, 3), np.uint8) if self.render_mode == "rgb_array" else None

    @staticmethod
    def custom_method(dim_0: int = 1, dim_1: int = 1) -> np.ndarray:
        return np.ones((dim_0, dim_1))


class StepEnv(gym.Env[Any, Any]):
    """The observation is the step before this one; ends after ``max_steps``."""

    def __init__(self, max_steps: int) -> None:
        self.action_space = spaces.Discrete(2)
        self.observation_space = spaces.Box(np.array([0]), np.array([999]), dtype=np.int64)
        self.max_steps = max_steps
        self.current_step = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        super().reset(seed=seed)
        self.current_step = 0
        return np.array([0], dtype=np.int64), {}

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        prev = self.current_step
        self.current_step += 1
        done = self.current_step >= self.max_steps
        if self.current_step == 1000:
            os.kill(os.getpid(), signal.SIGKILL)
        return np.array([prev], dtype=np.int64), 0.0, done, done, {}


class RandomEnv(gym.Env[Any, Any]):
    """Everything drawn from ``np_random``: comparable step for step with DummyVecEnv."""

    def __init__(self, kind: str = "box") -> None:
        self.kind = kind
        box = spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.observation_space = {
            "box": box,
            "dict": spaces.Dict({"a": box, "b": spaces.Discrete(4)}),
            "tuple": spaces.Tuple((spaces.Discrete(4), box)),
        }[kind]
        self.action_space = spaces.Discrete(3)
        self.t = 0

    def _obs(self) -> Any:
        x = self.np_random.uniform(-1, 1, 3).astype(np.float32)
        k = np.int64(self.np_random.integers(4))
        return {"box": x, "dict": {"a": x, "b": k}, "tuple": (k, x)}[self.kind]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {"first": float(self.np_random.random())}

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        self.t += 1
        terminated = bool(self.np_random.random() < 0.1)
        truncated = self.t >= 9
        reward = float(action) + float(self.np_random.normal())
        return self._obs(), reward, terminated, truncated, {"t": self.t}


def wrap(venv: VecEnv, wrapper: Any) -> VecEnv:
    if wrapper is VecFrameStack:
        return VecFrameStack(venv, n_stack=2)
    if wrapper is VecNormalize:
        keys = ["a"] if isinstance(venv.observation_space, spaces.Dict) else None
        return VecNormalize(venv, norm_obs_keys=keys)
    return venv


def assert_obs_equal(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_obs_equal(a[k], b[k])
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_obs_equal(x, y)
    else:
        assert type(a) is type(b)
        assert np.asarray(a).dtype == np.asarray(b).dtype
        assert np.array_equal(a, b), (a, b)


def assert_info_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys(), (a, b)
    for k in a:
        if k == "terminal_observation":
            assert_obs_equal(a[k], b[k])
        elif k == "episode":
            assert a[k]["r"] == b[k]["r"] and a[k]["l"] == b[k]["l"]
        else:
            assert a[k] == b[k], (k, a[k], b[k])


# -- the same results as DummyVecEnv ------------------------------------------------------------


# SB3's VecNormalize and VecFrameStack take no Tuple observations, VecFrameStack no Discrete key.
SAME_AS_DUMMY = [
    ("box", None),
    ("box", VecNormalize),
    ("box", VecFrameStack),
    ("dict", None),
    ("dict", VecNormalize),
    ("tuple", None),
]


@pytest.mark.parametrize(
    ("kind", "wrapper"),
    SAME_AS_DUMMY,
    ids=[f"{k}-{w.__name__ if w else 'plain'}" for k, w in SAME_AS_DUMMY],
)
def test_same_as_dummy(kind: str, wrapper: Any, no_leaks: None, placed: dict[str, int]) -> None:
    fns = [lambda: Monitor(RandomEnv(kind)) for _ in range(4)]
    base = AsyncSampleVecEnv(fns, **placed)
    theirs = wrap(DummyVecEnv(fns), wrapper)
    try:
        ours = wrap(base, wrapper)
        assert ours.observation_space == theirs.observation_space
        assert ours.action_space == theirs.action_space
        assert ours.seed(5) == theirs.seed(5)
        ours.set_options({"x": 1})
        theirs.set_options({"x": 1})
        assert_obs_equal(ours.reset(), theirs.reset())
        assert ours.reset_infos == theirs.reset_infos
        rng = np.random.default_rng(1)
        for t in range(120):
            actions = rng.integers(0, 3, 4)
            ours.step_async(actions)
            theirs.step_async(actions)
            o1, r1, d1, i1 = ours.step_wait()
            o2, r2, d2, i2 = theirs.step_wait()
            assert_obs_equal(o1, o2)
            assert r1.dtype == r2.dtype and np.array_equal(r1, r2), t
            assert d1.dtype == d2.dtype and np.array_equal(d1, d2), t
            for x, y in zip(i1, i2):
                assert_info_equal(x, y)
        assert ours.reset_infos == theirs.reset_infos
        # Seeds are used once: the next reset is unseeded.
        assert base._seeds == [None] * 4
    finally:
        base.close()
        theirs.close()


def test_quiet_step_async_step_wait_run_no_event_loop(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch, placed: dict[str, int]
) -> None:
    """step_async/step_wait pay what step pays: a step with no episode end sends and reads
    without the portal's loop, with the results DummyVecEnv returns."""
    fns = [functools.partial(StepEnv, 50)] * 4
    ours = AsyncSampleVecEnv(fns, **placed)
    theirs = DummyVecEnv(fns)
    try:
        assert_obs_equal(ours.reset(), theirs.reset())
        runs = count_loop_runs(ours, monkeypatch)
        patient_direct_reads(monkeypatch)  # counted by loop runs, not by a 50 ms wait
        for t in range(20):
            actions = np.full(4, t % 2, np.int64)
            ours.step_async(actions)
            with pytest.raises(RuntimeError, match="twice"):
                ours.step_async(actions)
            o1, r1, d1, i1 = ours.step_wait()
            o2, r2, d2, i2 = theirs.step(actions)
            assert_obs_equal(o1, o2)
            assert np.array_equal(r1, r2) and np.array_equal(d1, d2), t
            for x, y in zip(i1, i2):
                assert_info_equal(x, y)
        assert runs[0] == 0, "a quiet step_async/step_wait ran the event loop"
        with pytest.raises(RuntimeError, match="without step_async"):
            ours.step_wait()
        ours.step_async(np.zeros(4, np.int64))
        assert_obs_equal(ours.reset(), theirs.reset())  # finishes the pending step first
    finally:
        ours.close()
        theirs.close()


# -- SB3's own checks, for SubprocVecEnv --------------------------------------------------------


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=["plain", "VecNormalize", "VecFrameStack"])
def test_custom_calls(wrapper: Any, no_leaks: None, placed: dict[str, int]) -> None:
    space = spaces.Box(low=np.zeros(2), high=np.ones(2))
    base = AsyncSampleVecEnv([lambda: SpaceEnv(space)] * N_ENVS, **placed)
    try:
        venv = wrap(base, wrapper)
        venv.seed(0)
        explicit = venv.render(mode="rgb_array")
        assert np.array_equal(venv.render(), explicit)
        with pytest.warns(UserWarning):
            venv.render(mode="something_else")
        results = venv.env_method("custom_method", 1, indices=None, dim_1=2)
        assert len(results) == N_ENVS and all((r == np.ones((1, 2))).all() for r in results)
        for i in range(N_ENVS):
            assert venv.set_attr("current_step", i, indices=i) is None
        assert venv.get_attr("current_step") == [0, 1, 2]
        subset = venv.env_method("custom_method", 1, indices=[0, 2], dim_1=3)
        assert len(subset) == 2 and all((r == np.ones((1, 3))).all() for r in subset)
        venv.set_attr("current_step", 42, indices=None)
        assert venv.get_attr("current_step") == [42] * N_ENVS
        venv.reset()
        venv.set_attr("current_step", 12, indices=[0, 1])
        assert venv.get_attr("current_step") == [12, 12, 0]
        assert venv.get_attr("current_step", indices=[0, 2]) == [12, 0]
        venv.reset()
        venv.set_attr("current_step", 12, indices=[0, -1])
        assert venv.get_attr("current_step") == [12, 0, 12]
        assert venv.get_attr("current_step", indices=[-1]) == [12]
        assert venv.has_attr("current_step") and not venv.has_attr("no_such_thing")
    finally:
        base.close()


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=["plain", "VecNormalize", "VecFrameStack"])
def test_terminal_observation(wrapper: Any, no_leaks: None, placed: dict[str, int]) -> None:
    step_nums = [i + 5 for i in range(N_ENVS)]
    fns = [functools.partial(StepEnv, n) for n in step_nums]
    base = AsyncSampleVecEnv(fns, **placed)
    try:
        venv = wrap(base, wrapper)
        zero = np.zeros(N_ENVS, dtype=np.int64)
        prev_b = venv.reset()
        for step_num in range(1, max(step_nums) + 1):
            obs_b, _, done_b, info_b = venv.step(zero)
            assert len(obs_b) == len(done_b) == len(info_b) == N_ENVS
            for prev, obs, done, info, last in zip(prev_b, obs_b, done_b, info_b, step_nums):
                assert done == (step_num == last)
                assert info["TimeLimit.truncated"] is False  # terminated and truncated
                if not done:
                    assert "terminal_observation" not in info
                    continue
                terminal = info["terminal_observation"]
                assert np.all(prev < terminal) and np.all(obs < prev)
                if wrapper is not VecNormalize:
                    assert np.all(prev + 1 == terminal) and np.all(obs == 0)
            prev_b = obs_b
    finally:
        base.close()


@pytest.mark.parametrize("name", list(SPACES))
def test_single_spaces(name: str, no_leaks: None) -> None:
    space = SPACES[name]
    check_spaces(space, lambda obs: check_obs(obs, space))


def test_dict_and_tuple_spaces(no_leaks: None) -> None:
    dict_space = spaces.Dict(SPACES)

    def dict_ok(obs: Any) -> None:
        assert isinstance(obs, collections.OrderedDict)
        assert obs.keys() == dict_space.spaces.keys()
        for key, values in obs.items():
            check_obs(values, dict_space.spaces[key])

    check_spaces(dict_space, dict_ok)
    tuple_space = spaces.Tuple(tuple(SPACES.values()))

    def tuple_ok(obs: Any) -> None:
        assert isinstance(obs, tuple) and len(obs) == len(tuple_space.spaces)
        for values, inner in zip(obs, tuple_space.spaces):
            check_obs(values, inner)

    check_spaces(tuple_space, tuple_ok)


def check_obs(obs: Any, space: gym.Space[Any]) -> None:
    assert obs.shape[0] == N_ENVS
    for value in obs:
        assert space.contains(value)


def check_spaces(space: gym.Space[Any], obs_ok: Any) -> None:
    venv = AsyncSampleVecEnv([lambda: SpaceEnv(space)] * N_ENVS, n_processes=2)
    try:
        obs_ok(venv.reset())
        dones = [False] * N_ENVS
        while not any(dones):
            actions = [venv.action_space.sample() for _ in range(N_ENVS)]
            obs, _, dones, _ = venv.step(actions)
            obs_ok(obs)
    finally:
        venv.close()


def test_env_is_wrapped(no_leaks: None, placed: dict[str, int]) -> None:
    space = spaces.Box(low=np.zeros(2), high=np.ones(2))
    fns = [lambda: SpaceEnv(space), lambda: Monitor(SpaceEnv(space))]
    venv = AsyncSampleVecEnv(fns, **placed)
    try:
        assert venv.env_is_wrapped(Monitor) == [False, True]
        assert venv.env_is_wrapped(Monitor, indices=1) == [True]
        assert VecFrameStack(venv, n_stack=2).env_is_wrapped(Monitor) == [False, True]
    finally:
        venv.close()


def test_seeding(no_leaks: None, placed: dict[str, int]) -> None:
    space = spaces.Box(low=np.zeros(2), high=np.ones(2))
    venv = AsyncSampleVecEnv([lambda: SpaceEnv(space)] * N_ENVS, **placed)
    try:
        venv.seed()
        obs = venv.reset()
        _, rewards, _, _ = venv.step(np.array([venv.action_space.sample() for _ in range(3)]))
        assert not np.allclose(obs[0], obs[1]) and not np.allclose(obs[1], obs[2])
        assert not np.allclose(rewards[0], rewards[1]) and not np.allclose(rewards[1], rewards[2])
        venv.seed(3)
        first = venv.reset()
        venv.seed(3)
        assert np.array_equal(venv.reset(), first)
        assert not np.array_equal(venv.reset(), first)  # the seeds were used once
    finally:
        venv.close()


def test_render_mode_and_make_vec_env(no_leaks: None) -> None:
    """SB3 reads ``render_mode`` through get_attr inside VecEnv.__init__; make_vec_env works."""
    venv = make_vec_env("CartPole-v1", n_envs=2, seed=0, vec_env_cls=AsyncSampleVecEnv)
    try:
        assert isinstance(venv, AsyncSampleVecEnv)
        # make_vec_env asks for rgb_array frames; SB3's base class derives its render modes.
        assert venv.render_mode == "rgb_array"
        assert venv.metadata == {"render_modes": ["human", "rgb_array"]}
        assert venv.env_is_wrapped(Monitor) == [True, True]
        assert venv.reset().shape == (2, 4)
    finally:
        venv.close()
    space = spaces.Discrete(2)
    venv = AsyncSampleVecEnv([lambda: SpaceEnv(space)] * 2, n_processes=1)
    try:
        assert venv.render_mode == "rgb_array"
        assert [f.shape for f in venv.get_images()] == [(4, 4, 3)] * 2
    finally:
        venv.close()


def test_close_twice_and_nothing_left(no_leaks: None) -> None:
    venv = AsyncSampleVecEnv("CartPole-v1", 4, n_processes=2)
    pids = venv.pids
    venv.reset()
    venv.close()
    venv.close()
    assert not wait_gone(pids)


def test_crashed_host_is_restarted(no_leaks: None) -> None:
    fns = [functools.partial(StepEnv, 5000)] * 2
    venv = AsyncSampleVecEnv(fns, n_processes=2, max_restarts=1)
    try:
        venv.reset()
        venv.set_attr("current_step", 999, indices=1)  # dies at its next step
        obs, rewards, dones, infos = venv.step(np.zeros(2, np.int64))
        assert dones.tolist() == [False, True] and rewards.tolist() == [0.0, 0.0]
        assert "SIGKILL" in infos[1]["restarted"]
        assert infos[1]["TimeLimit.truncated"] is True
        assert obs[1].tolist() == [0] and infos[1]["terminal_observation"].tolist() == [0]
        venv.set_attr("current_step", 999, indices=1)
        with pytest.raises(WorkerCrashedError, match=r"sub-envs 1\.\.1.*max_restarts=1"):
            venv.step(np.zeros(2, np.int64))
    finally:
        venv.close()


# -- faults of one sub-env, in every placement (the faulty one is the caller's when mixed) ------


class ResetFailsEnv(FaultyEnv):
    """Its second reset raises ``KeyError``."""

    def __init__(self) -> None:
        super().__init__()
        self.resets = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        self.resets += 1
        if self.resets == 2:
            raise KeyError("the reset broke")
        return super().reset(seed=seed, options=options)


def test_a_raising_sub_env_is_named_and_rebuilt_by_reset(
    no_leaks: None, placed: dict[str, int]
) -> None:
    venv = AsyncSampleVecEnv([faulty(), faulty("raise", 2)], **placed)
    try:
        venv.reset()
        venv.step(np.zeros(2, np.int64))
        with pytest.raises(SubEnvError) as info:
            venv.step(np.zeros(2, np.int64))
        assert info.value.sub_env == 1 and isinstance(info.value, ZeroDivisionError)
        assert "sub-env 1" in str(info.value) and "the env divided by zero" in str(info.value)
        with pytest.raises(RuntimeError, match=r"call reset\(\) before stepping"):
            venv.step(np.zeros(2, np.int64))
        assert venv.reset().shape == (2, 2)  # rebuilds what failed
        assert venv.step(np.zeros(2, np.int64))[1].tolist() == [1.0, 1.0]
    finally:
        venv.close()


def test_a_reset_error_names_the_sub_env(no_leaks: None, placed: dict[str, int]) -> None:
    venv = AsyncSampleVecEnv([faulty(), ResetFailsEnv], **placed)
    try:
        venv.reset()
        with pytest.raises(SubEnvError) as info:
            venv.reset()
        assert info.value.sub_env == 1 and isinstance(info.value, KeyError)
        assert "sub-env 1" in str(info.value) and "the reset broke" in str(info.value)
        assert venv.reset().shape == (2, 2)  # a rebuilt env: its first reset again
    finally:
        venv.close()


def test_a_host_killed_in_mixed_placement_is_restarted(no_leaks: None) -> None:
    venv = AsyncSampleVecEnv(
        [faulty("kill", 2), faulty()], n_processes=1, caller_envs=1, max_restarts=1
    )
    try:
        venv.reset()
        old = venv.pids
        venv.step(np.zeros(2, np.int64))
        _, rewards, dones, infos = venv.step(np.zeros(2, np.int64))
        assert dones.tolist() == [True, False] and rewards.tolist() == [0.0, 1.0]
        assert "SIGKILL" in infos[0]["restarted"] and infos[0]["TimeLimit.truncated"] is True
        assert "restarted" not in infos[1]  # the caller's sub-env went on
        assert len(venv.pids) == 1 and venv.pids != old
    finally:
        venv.close()


@pytest.mark.timeout(300)
def test_step_timeout_kills_and_restarts_the_host(no_leaks: None) -> None:
    # 30 s: a host's build counts against step_timeout too, and a host importing SB3 (and
    # torch) took 18-23 s to build on a 2-core machine at a load average of 10
    venv = AsyncSampleVecEnv(
        [faulty("hang", 2), faulty()], n_processes=2, step_timeout=30.0, max_restarts=1
    )
    try:
        venv.reset()
        venv.step(np.zeros(2, np.int64))
        _, rewards, dones, infos = venv.step(np.zeros(2, np.int64))
        assert dones.tolist() == [True, False] and rewards.tolist() == [0.0, 1.0]
        assert "step_timeout=30s" in infos[0]["restarted"]
        assert infos[0]["TimeLimit.truncated"] is True and "restarted" not in infos[1]
        venv.env_method("arm", "hang", 1)  # both hang now; host 0 has spent its budget
        with pytest.raises(StepTimeoutError, match=r"sub-envs 0\.\.0"):
            venv.step(np.zeros(2, np.int64))
    finally:
        venv.close()


def test_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="num_envs is required"):
        AsyncSampleVecEnv("CartPole-v1")
    with pytest.raises(ValueError, match="num_envs=3 does not match"):
        AsyncSampleVecEnv([lambda: gym.make("CartPole-v1")] * 2, 3)
    with pytest.raises(ValueError, match="env_fns must hold"):
        AsyncSampleVecEnv([])
    with pytest.raises(ValueError, match="cannot find context for 'teleport'"):
        AsyncSampleVecEnv([lambda: gym.make("CartPole-v1")], start_method="teleport")


def test_start_method_as_subproc_vec_env_takes_it() -> None:
    env = AsyncSampleVecEnv([lambda: gym.make("CartPole-v1")] * 2, start_method="spawn")
    try:
        assert env.reset().shape == (2, 4)
    finally:
        env.close()


def test_calls_after_close_say_the_env_is_closed() -> None:
    """reset() included (it used to fail with "Event loop is closed")."""
    env = AsyncSampleVecEnv([lambda: gym.make("CartPole-v1")] * 2, n_processes=1)
    env.reset()
    env.close()
    for call in (
        env.reset,
        lambda: env.step(np.zeros(2, np.int64)),
        lambda: env.get_attr("spec"),
        lambda: env.env_method("render"),
    ):
        with pytest.raises(RuntimeError, match=r"after a call to `close\(\)`"):
            call()
