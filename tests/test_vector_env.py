"""asyncsample.VectorEnv against gymnasium's own expectations of a vector env.

The checks follow gymnasium's tests/vector suite (sync and async must agree step for step; the
three autoreset modes; final observations and infos; call/get_attr/set_attr), rewritten here with
our VectorEnv in place of AsyncVectorEnv and SyncVectorEnv as the reference.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.spaces import Box, Dict, Discrete, Tuple
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from helpers import (
    count_loop_runs,
    new_shm_entries,
    patient_direct_reads,
    shm_entries,
    wait_gone,
)
from helpers import host_processes as our_processes

from asyncsample import StepTimeoutError, WorkerCrashedError
from asyncsample.vector import SubEnvError, VectorEnv, _lockstep

# The env-host processes cannot import this module by name: ship its envs by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP]


class RandomEpisodesEnv(gym.Env[Any, Any]):
    """Random observations, rewards, episode ends and infos, all drawn from ``np_random``.

    ``kind`` picks the observation space: a Box, a Discrete, a Dict or a Tuple. Reset options
    ``{"shift": k}`` shift the first observation; they show in the reset info.
    """

    def __init__(self, kind: str = "box") -> None:
        self.kind = kind
        self.observation_space = {
            "box": Box(-2.0, 2.0, (3,), np.float32),
            "discrete": Discrete(7),
            "dict": Dict({"pos": Box(-2.0, 2.0, (2,), np.float32), "id": Discrete(5)}),
            "tuple": Tuple((Discrete(4), Box(-2.0, 2.0, (2, 2), np.float64))),
        }[kind]
        self.action_space = Box(-1.0, 1.0, (2,), np.float32)
        self.t = 0

    def _obs(self, shift: float = 0.0) -> Any:
        rng = self.np_random
        if self.kind == "box":
            return (rng.uniform(-1, 1, 3) + shift).astype(np.float32)
        if self.kind == "discrete":
            return np.int64(rng.integers(7))
        if self.kind == "dict":
            return {
                "pos": (rng.uniform(-1, 1, 2) + shift).astype(np.float32),
                "id": np.int64(rng.integers(5)),
            }
        return (np.int64(rng.integers(4)), rng.uniform(-1, 1, (2, 2)) + shift)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        super().reset(seed=seed)
        self.t = 0
        shift = float((options or {}).get("shift", 0.0))
        info: dict[str, Any] = {"shift": shift} if options else {}
        if self.np_random.random() < 0.5:
            info["start"] = int(self.np_random.integers(100))
        return self._obs(shift), info

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        self.t += 1
        rng = self.np_random
        reward = float(np.sum(action)) + float(rng.normal())
        terminated = bool(rng.random() < 0.08)
        truncated = self.t >= 12
        info: dict[str, Any] = {}
        if rng.random() < 0.3:
            info["t"] = self.t
        if rng.random() < 0.2:
            info["noise"] = rng.normal(size=2)
        if rng.random() < 0.1:
            info["nested"] = {"a": self.t, "b": "x"}
        return self._obs(), reward, terminated, truncated, info


def count_env(max_count: int = 3) -> gym.Env[Any, Any]:
    return CountEnv(max_count)


class CountEnv(gym.Env[Any, Any]):
    """Observation counts steps since reset (or from the reset seed); ends at ``max_count``."""

    def __init__(self, max_count: int = 3) -> None:
        self.observation_space = Discrete(10)
        self.action_space = Discrete(5)
        self.max_count = max_count
        self.count = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        super().reset(seed=seed)
        self.count = seed if seed is not None else 0
        return self.count, {}

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        self.count += 1
        return self.count, int(action), self.count == self.max_count, False, {}


class FaultyEnv(gym.Env[Any, Any]):
    """Box observations; ``fault`` at step ``at``: "raise", "kill" (SIGKILL its host) or "hang"."""

    def __init__(self, fault: str = "", at: int = 3) -> None:
        self.observation_space = Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = Discrete(2)
        self.fault = fault
        self.at = at
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        self.t += 1
        if self.fault and self.t == self.at:
            if self.fault == "raise":
                raise ZeroDivisionError("the env divided by zero")
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "hang":
                threading.Event().wait()
        return np.full(2, self.t / 100, np.float32), 1.0, False, False, {}

    def arm(self, fault: str, at: int) -> str:
        self.fault, self.at, self.t = fault, at, 0
        return f"armed {fault}"


class RenderEnv(CountEnv):
    """A CountEnv that renders an RGB frame showing its count."""

    metadata = {"render_modes": ["rgb_array"]}  # noqa: RUF012

    def __init__(self) -> None:
        super().__init__(5)
        self.render_mode = "rgb_array"

    def render(self) -> np.ndarray:
        return np.full((4, 4, 3), self.count, np.uint8)


def assert_same(ours: Any, theirs: Any, what: str) -> None:
    assert data_equivalence(ours, theirs, exact=True), f"{what} differ:\n{ours!r}\n{theirs!r}"


@pytest.fixture
def no_leaks():  # type: ignore[no-untyped-def]
    """Fail if a test leaves a child process or a /dev/shm entry behind."""
    before_procs = set(our_processes())
    before_shm = shm_entries()
    yield
    gc.collect()
    left = wait_gone([p for p in our_processes() if p not in before_procs])
    assert not left, f"child processes left behind: {left}"
    assert not new_shm_entries(before_shm)


# -- the same results as SyncVectorEnv ----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("kind", ["box", "discrete", "dict", "tuple"])
def test_equal_to_sync(
    kind: str, mode: AutoresetMode, no_leaks: None, placed: dict[str, int]
) -> None:
    """100 random steps, seeded and optioned resets, partial resets: exactly SyncVectorEnv."""
    n = 5
    fns = [lambda: RandomEpisodesEnv(kind) for _ in range(n)]
    ours = VectorEnv(fns, n, **placed, autoreset_mode=mode)
    sync = SyncVectorEnv(fns, autoreset_mode=mode)
    try:
        assert ours.num_envs == sync.num_envs
        assert ours.observation_space == sync.observation_space
        assert ours.single_observation_space == sync.single_observation_space
        assert ours.action_space == sync.action_space
        assert ours.single_action_space == sync.single_action_space
        assert ours.metadata["autoreset_mode"] == mode

        assert_same(ours.reset(seed=7), sync.reset(seed=7), "first reset")
        ours.action_space.seed(3)
        for t in range(100):
            actions = ours.action_space.sample()
            assert_same(ours.step(actions), sync.step(actions), f"step {t}")
            if t == 40:
                seeds = [11, None, 13, None, 15]
                got = ours.reset(seed=seeds, options={"shift": 1.0})
                assert_same(got, sync.reset(seed=seeds, options={"shift": 1.0}), "reset")
            if t == 70:
                # An unseeded reset in the middle of episodes, some of which just ended.
                assert_same(ours.reset(), sync.reset(), "unseeded reset")
            if t == 85:
                mask = np.array([True, False, True, False, False])
                options = {"reset_mask": mask, "shift": -1.0}
                got = ours.reset(seed=3, options=dict(options))
                assert_same(got, sync.reset(seed=3, options=dict(options)), "partial reset")
    finally:
        ours.close()
        sync.close()


class SteadyInfoEnv(gym.Env[Any, Any]):
    """Every step's info has the same keys (as ALE's and MuJoCo's), of every kind gymnasium
    batches apart: Python and numpy scalars, an array, an object; one key's type changes with
    the step (an int or a float) and, with ``nested``, a nested dict; resets report some of
    the keys and one of their own."""

    def __init__(self, nested: bool = False) -> None:
        self.observation_space = Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = Discrete(3)
        self.nested = nested
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {"lives": 3, "started": True}

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        self.t += 1
        rng = self.np_random
        info: dict[str, Any] = {
            "lives": int(rng.integers(4)),
            "x": float(rng.normal()),
            "frame": np.int32(self.t),
            "ok": np.bool_(rng.random() < 0.5),
            "flag": bool(action),
            "pos": rng.normal(size=2).astype(np.float32),
            "name": f"e{self.t}",
            "mixed": self.t if self.t % 3 else self.t / 7,
        }
        if self.nested:
            info["terms"] = {"a": self.t}
        obs = np.full(2, self.t / 20, np.float32)
        return obs, float(action), bool(rng.random() < 0.05), self.t >= 15, info


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_steady_infos_equal_to_sync(nested: bool, no_leaks: None, placed: dict[str, int]) -> None:
    """Infos with the same keys at every step (built a key at a time, see vector/_infos.py),
    episode ends with reset infos among them: SyncVectorEnv's, keys in the same order."""
    n = 4
    fns = [lambda: SteadyInfoEnv(nested) for _ in range(n)]
    ours = VectorEnv(fns, n, **placed)
    sync = SyncVectorEnv(fns)
    try:
        assert_same(ours.reset(seed=1), sync.reset(seed=1), "reset")
        rng = np.random.default_rng(0)
        for t in range(60):
            actions = rng.integers(0, 3, n)
            got, want = ours.step(actions), sync.step(actions)
            assert_same(got, want, f"step {t}")
            assert list(got[4]) == list(want[4]), f"step {t}: the infos' keys in another order"
    finally:
        ours.close()
        sync.close()


def test_info_columns_are_what_gymnasium_adds_row_by_row() -> None:
    """vector/_infos.columns against gymnasium's _add_info: some rows or all, alike or mixed
    types, and what it leaves to gymnasium (other keys, a nested dict, final_obs, a "_" key)."""
    from asyncsample.vector._infos import columns

    n = 5
    gym_add = SyncVectorEnv([lambda: CountEnv() for _ in range(n)])._add_info

    def row(i: int, **extra: Any) -> dict[str, Any]:
        return {"a": i, "b": np.float32(i / 2), "c": np.arange(i, i + 3), "d": str(i), **extra}

    def gymnasium(infos: list[dict[str, Any]], rows: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i in rows:
            out = gym_add(out, infos[i], i)
        return out

    cases = [
        ([row(i) for i in range(n)], list(range(n))),
        ([row(i) for i in range(n)], [1, 3]),
        ([row(i, e=(i if i % 2 else i / 3)) for i in range(n)], list(range(n))),
        ([row(i, e=(i if i % 2 else i / 3)) for i in range(n)], [0, 1, 4]),
        ([row(i, e=np.bool_(i % 2)) for i in range(n)], list(range(n))),
        ([{"a": True} for _ in range(n)], list(range(n))),
        ([{} for _ in range(n)], list(range(n))),
        ([row(i) for i in range(n)], [2]),  # one row (a single sub-env with infos)
        ([row(i, e=np.bool_(i % 2)) for i in range(n)], [4]),
    ]
    for infos, rows in cases:
        got, want = columns(n, infos, rows), gymnasium(infos, rows)
        assert_same(got, want, f"rows {rows}")
        assert list(got) == list(want)
        assert all(got[k].dtype == want[k].dtype for k in want if hasattr(want[k], "dtype"))
        masks = [got[k] for k in got if k.startswith("_")]
        assert len({id(m) for m in masks}) == len(masks)  # each key its own mask, as gymnasium's
    left = [
        [row(0), row(1, extra=1)],
        [row(0, n={"x": 1}), row(1, n={"x": 2})],
        [row(0, final_obs=1), row(1, final_obs=2)],
        [row(0, _a=1), row(1, _a=2)],
    ]
    for infos in left:
        assert columns(n, infos, [0, 1]) is None
    for infos in left[1:]:  # one row: what gymnasium treats apart is still left to it
        assert columns(n, infos, [1]) is None
    one = [{"a": 1.5, "b": np.arange(2)}]  # num_envs 1: the whole batch is one row
    want_one = SyncVectorEnv([lambda: CountEnv()])._add_info({}, one[0], 0)
    got_one = columns(1, one, [0])
    assert_same(got_one, want_one, "num_envs 1")
    assert list(got_one) == list(want_one)


def test_equal_to_sync_cartpole_by_id(no_leaks: None, placed: dict[str, int]) -> None:
    """A registered id, more sub-envs than processes, the constructor's seed."""
    ours = VectorEnv("CartPole-v1", 6, **placed, seed=5)
    sync = SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(6)])
    try:
        assert_same(ours.reset(), sync.reset(seed=5), "reset")
        assert ours.np_random_seed == tuple(range(5, 11))
        rng = np.random.default_rng(0)
        for t in range(200):
            actions = rng.integers(0, 2, 6)
            assert_same(ours.step(actions), sync.step(actions), f"step {t}")
        kind = {0: "in-process", 2: "hosts", 1: "mixed"}[placed["n_processes"]]
        assert repr(ours) == (
            f"asyncsample.VectorEnv(CartPole-v1, num_envs=6, n_processes={placed['n_processes']}"
            f", caller_envs={ours.placement.caller_envs}, placement={kind!r})"
        )
        assert ours.placement.kind == kind
    finally:
        ours.close()


def test_episode_statistics_and_any_action_batch_equal_to_sync(
    no_leaks: None, placed: dict[str, int]
) -> None:
    """CleanRL's CartPole (episode statistics in the step info at every episode end), with
    actions given as the action space's dtype, another integer dtype, a list, stepped and
    sent with step_async: exactly SyncVectorEnv in every placement (in-process: the thin round
    and the general one alike)."""

    def make() -> gym.Env[Any, Any]:
        return gym.wrappers.RecordEpisodeStatistics(gym.make("CartPole-v1"))

    ours = VectorEnv([make] * 4, **placed)
    sync = SyncVectorEnv([make] * 4)
    try:
        assert_same(ours.reset(seed=3), sync.reset(seed=3), "reset")
        rng = np.random.default_rng(0)
        ended = 0
        for t in range(300):
            actions: Any = rng.integers(0, 2, 4)
            if t % 5 == 1:
                actions = actions.astype(np.int32)
            elif t % 5 == 2:
                actions = actions.tolist()
            if t % 7 == 3:
                ours.step_async(actions)
                got = ours.step_wait()
            else:
                got = ours.step(actions)
            theirs = sync.step(actions)
            for infos in (got[4], theirs[4]):  # the episodes' wall time differs, of course
                for key in ("t", "_t"):
                    infos.get("episode", {}).pop(key, None)
            assert_same(got, theirs, f"step {t}")
            ended += int("episode" in theirs[4])
        assert ended > 10  # the infos were exercised
    finally:
        ours.close()
        sync.close()


# -- autoreset modes (gymnasium's test_autoreset_mode, in our words) ----------------------------


def counting(mode: AutoresetMode, placed: dict[str, int] | None = None) -> VectorEnv:
    placed = {"n_processes": 2} if placed is None else placed
    env = VectorEnv([count_env] * 3, 3, autoreset_mode=mode, **placed)
    env.set_attr("max_count", [2, 3, 3])
    return env


def test_next_step_autoreset(no_leaks: None, placed: dict[str, int]) -> None:
    env = counting(AutoresetMode.NEXT_STEP, placed)
    try:
        obs, info = env.reset()
        assert obs.tolist() == [0, 0, 0] and info == {}
        expected = [
            ([1, 1, 1], [1, 2, 3], [False, False, False]),
            ([2, 2, 2], [1, 2, 3], [True, False, False]),
            ([0, 3, 3], [0, 2, 3], [False, True, True]),  # sub-env 0 reset: action ignored
            ([1, 0, 0], [1, 0, 0], [False, False, False]),
        ]
        for want_obs, want_rew, want_term in expected:
            obs, rew, term, trunc, info = env.step(np.array([1, 2, 3]))
            assert obs.tolist() == want_obs
            assert rew.tolist() == want_rew
            assert term.tolist() == want_term
            assert not trunc.any() and info == {}
    finally:
        env.close()


def test_same_step_autoreset(no_leaks: None, placed: dict[str, int]) -> None:
    env = counting(AutoresetMode.SAME_STEP, placed)
    try:
        env.reset()
        obs, rew, term, _, info = env.step(np.array([1, 2, 3]))
        assert obs.tolist() == [1, 1, 1] and info == {}
        obs, rew, term, _, info = env.step(np.array([1, 2, 3]))
        assert obs.tolist() == [0, 2, 2] and term.tolist() == [True, False, False]
        assert rew.tolist() == [1, 2, 3]
        assert info["final_obs"][0] == 2 and info["_final_obs"].tolist() == [True, False, False]
        assert info["final_info"] == {} and info["_final_info"].tolist() == [True, False, False]
        obs, rew, term, _, info = env.step(np.array([1, 2, 3]))
        assert obs.tolist() == [1, 0, 0] and term.tolist() == [False, True, True]
        assert info["final_obs"][1] == 3 and info["final_obs"][2] == 3
        assert info["_final_obs"].tolist() == [False, True, True]
    finally:
        env.close()


def test_disabled_autoreset(no_leaks: None, placed: dict[str, int]) -> None:
    env = counting(AutoresetMode.DISABLED, placed)
    sync = SyncVectorEnv([count_env] * 3, autoreset_mode=AutoresetMode.DISABLED)
    sync.set_attr("max_count", [2, 3, 3])
    try:
        assert env.metadata["autoreset_mode"] == AutoresetMode.DISABLED
        assert_same(env.reset(), sync.reset(), "reset")
        actions = np.array([1, 2, 3])
        for _ in range(2):
            assert_same(env.step(actions), sync.step(actions), "step")
        with pytest.raises(RuntimeError, match=r"sub-envs \[0\].*reset_mask"):
            env.step(actions)
        mask = np.array([True, False, False])
        got = env.reset(options={"reset_mask": mask})
        assert got[0].tolist() == [0, 2, 2]
        assert_same(got, sync.reset(options={"reset_mask": mask}), "partial reset")
        *_, term, _, _ = sync.step(actions)
        assert_same(env.step(actions)[2], term, "terminations")
    finally:
        env.close()


def test_final_obs_and_info_same_step(no_leaks: None, placed: dict[str, int]) -> None:
    """The final observation is the env's own last one (sent home in the host's reply, so a
    Python ``int`` stays an ``int``, as with gymnasium's vector envs), and the final info is its
    last step info."""

    class Ends(CountEnv):
        def step(self, action: Any):  # type: ignore[no-untyped-def]
            obs, *rest, _info = super().step(action)
            return obs, *rest, {"action": int(action), "obs": obs}

    env = VectorEnv([lambda: Ends(2)], 1, **placed, autoreset_mode="SameStep")
    try:
        env.reset()
        env.step(np.array([4]))
        obs, _, term, _, info = env.step(np.array([3]))
        assert term.tolist() == [True] and obs.tolist() == [0]
        final = info["final_obs"][0]
        assert final == 2 and type(final) is int
        assert info["final_info"]["action"].tolist() == [3]
        assert info["final_info"]["_obs"].tolist() == [True]
    finally:
        env.close()


def test_reset_mask_is_checked(no_leaks: None) -> None:
    """gymnasium's reset_mask checks, with its messages word for word."""
    env = counting(AutoresetMode.NEXT_STEP)
    try:
        env.reset()
        with pytest.raises(
            ValueError, match=r"^`options\['reset_mask'\]` must have shape `\(3,\)`, got \(1,\)$"
        ):
            env.reset(options={"reset_mask": np.array([True])})
        with pytest.raises(
            TypeError, match=r"^`options\['reset_mask'\]` must have `dtype=np.bool_`, got int64$"
        ):
            env.reset(options={"reset_mask": np.array([1, 1, 0])})
        with pytest.raises(
            TypeError,
            match=r"^`options\['reset_mask'\]` must be a numpy array, got <class 'list'>$",
        ):
            env.reset(options={"reset_mask": [True, True, False]})
        with pytest.raises(
            ValueError, match=r"must contain a boolean array with at least one True value"
        ):
            env.reset(options={"reset_mask": np.zeros(3, bool)})
        with pytest.raises(ValueError, match=r"seed.*num_envs=3"):
            env.reset(seed=[1, 2])
    finally:
        env.close()


# -- calls, attributes, rendering ---------------------------------------------------------------


def test_call_get_attr_set_attr_render(no_leaks: None, placed: dict[str, int]) -> None:
    env = VectorEnv([RenderEnv] * 3, 3, **placed)
    try:
        assert env.render_mode == "rgb_array"
        env.reset(seed=[1, 2, 3])
        assert env.get_attr("count") == (1, 2, 3)
        env.set_attr("max_count", 7)
        assert env.get_attr("max_count") == (7, 7, 7)
        env.set_attr("max_count", [4, 5, 6])
        assert env.get_attr("max_count") == (4, 5, 6)
        with pytest.raises(ValueError, match=r"values.*num_envs=3"):
            env.set_attr("max_count", [1, 2])
        frames = env.render()
        assert [f[0, 0, 0] for f in frames] == [1, 2, 3]
        assert env.call("render")[2].shape == (4, 4, 3)
        assert env.np_random_seed == (1, 2, 3)
        # A method with arguments; an attribute nobody has names the sub-env.
        assert env.call("step", 0)[0][0] == 2
        with pytest.raises(SubEnvError, match=r"sub-env 0 .*AttributeError.*no_such_thing"):
            env.get_attr("no_such_thing")
        with pytest.raises(AttributeError):  # what gymnasium and SB3 code catch
            env.get_attr("no_such_thing")
    finally:
        env.close()


def test_step_async_step_wait(no_leaks: None, placed: dict[str, int]) -> None:
    env = counting(AutoresetMode.NEXT_STEP, placed)
    try:
        env.reset()
        env.step_async(np.array([1, 1, 1]))
        with pytest.raises(RuntimeError, match="twice"):
            env.step_async(np.array([1, 1, 1]))
        obs, *_ = env.step_wait()
        assert obs.tolist() == [1, 1, 1]
        with pytest.raises(RuntimeError, match="without any prior call to `step_async`"):
            env.step_wait()
        with pytest.raises(ValueError, match=r"actions.*num_envs=3"):
            env.step(np.array([1, 1]))
    finally:
        env.close()


def test_step_wait_in_a_running_loop_after_step_async_outside(
    no_leaks: None, placed: dict[str, int]
) -> None:
    """``step_async`` from plain code, ``step_wait`` from a coroutine: the round is finished in
    the face's loop, the sub-envs in the caller's process stepped too."""
    env = counting(AutoresetMode.NEXT_STEP, placed)
    try:
        env.reset()
        env.step_async(np.array([1, 1, 1]))

        async def wait() -> Any:
            return env.step_wait()

        obs, *_ = asyncio.run(wait())
        assert obs.tolist() == [1, 1, 1]
        assert env.step(np.array([1, 1, 1]))[0].tolist() == [2, 2, 2]
    finally:
        env.close()


def test_gymnasium_error_types_and_async_calls(no_leaks: None, placed: dict[str, int]) -> None:
    """AsyncVectorEnv's async methods, its error types and its timeouts."""
    env = counting(AutoresetMode.NEXT_STEP, placed)
    try:
        env.reset_async(seed=[1, 2, 3])
        with pytest.raises(AlreadyPendingCallError):
            env.step_async(np.array([1, 1, 1]))
        with pytest.raises(NoAsyncCallError):
            env.step_wait()
        obs, _ = env.reset_wait(timeout=10)
        assert obs.tolist() == [1, 2, 3]
        with pytest.raises(NoAsyncCallError):
            env.reset_wait()
        env.step_async(np.array([1, 1, 1]))
        assert env.step_wait(timeout=10)[0].tolist() == [2, 3, 4]
        env.call_async("max_count")
        assert env.call_wait(timeout=10) == (2, 3, 3)
        with pytest.raises(TypeError):  # a single action for a batch, as gymnasium
            env.step(0)
    finally:
        env.close()
    with pytest.raises(ClosedEnvironmentError):
        env.step(np.array([1, 1, 1]))


class OtherActions(CountEnv):
    def __init__(self) -> None:
        super().__init__()
        self.action_space = Discrete(2)


class SlowEnv(CountEnv):
    def step(self, action: Any):  # type: ignore[no-untyped-def]
        threading.Event().wait(0.5)
        return super().step(action)


def test_wait_past_its_timeout_raises_what_async_vector_env_raises(no_leaks: None) -> None:
    env = VectorEnv([SlowEnv] * 2, 2, n_processes=1)
    try:
        env.reset()
        env.step_async(np.array([1, 1]))
        with pytest.raises(multiprocessing.TimeoutError):
            env.step_wait(timeout=0.05)
        obs, *_ = env.step_wait()  # still pending: wait again
        assert obs.tolist() == [1, 1]
    finally:
        env.close()


def test_float_actions_for_an_integer_space_are_refused(no_leaks: None) -> None:
    """A cast would hide a policy bug (gymnasium hands the env the floats, which it refuses)."""
    env = VectorEnv("CartPole-v1", 2, n_processes=1)
    try:
        env.reset(seed=0)
        with pytest.raises(ValueError, match=r"dtype float64 do not fit the action space"):
            env.step(np.array([0.5, 1.7]))
        env.step(np.array([0, 1]))  # the env still works
    finally:
        env.close()


class ActionEchoEnv(gym.Env[np.ndarray, Any]):
    """Reports the action it was handed: its type and value (in the info)."""

    def __init__(self) -> None:
        self.observation_space = Box(-1.0, 1.0, (1,), np.float32)
        self.action_space = Box(0.0, 1.0, (), np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        info = {"type": type(action).__name__, "value": float(action)}
        return np.zeros(1, np.float32), 0.0, False, False, info


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_float_actions_reach_the_envs_as_given(
    dtype: Any, no_leaks: None, placed: dict[str, int]
) -> None:
    """Floats of another dtype than the space's reach each sub-env as AsyncVectorEnv hands
    them over (its row of the caller's array, nothing cast): a float64 stays a float64, 1e40
    stays finite, 0.1 stays 0.1."""
    fns = [ActionEchoEnv] * 4
    ours = VectorEnv(fns, **placed)
    ref = SyncVectorEnv(fns)
    try:
        ours.reset(seed=0)
        ref.reset(seed=0)
        for actions in ([0.1, 0.25, 1e-3, 0.5], [1e4, -0.0, 0.3, 2.5]):
            batch = np.array(actions, dtype=dtype)
            got, want = ours.step(batch)[4], ref.step(batch)[4]
            assert list(got["type"]) == list(want["type"]) == [np.dtype(dtype).type.__name__] * 4
            assert got["value"].tolist() == want["value"].tolist()
        if dtype is np.float64:
            info = ours.step(np.array([1e40, 0.0, 0.0, 0.0]))[4]
            assert info["value"][0] == 1e40  # not inf: nothing was cast to float32
        same = np.full(4, 0.75, dtype=ours.single_action_space.dtype)
        got = ours.step(same)[4]  # the buffers again: no given actions of a step before
        assert got["value"].tolist() == [0.75] * 4
    finally:
        ours.close()
        ref.close()


def test_async_vector_env_arguments(no_leaks: None) -> None:
    """AsyncVectorEnv's arguments are accepted; what cannot apply is refused, saying why."""
    env = VectorEnv(
        "CartPole-v1",
        2,
        n_processes=1,
        shared_memory=False,
        copy=False,
        context="spawn",
        daemon=False,
        observation_mode="same",
    )
    env.close()
    with pytest.raises(ValueError, match="custom worker function cannot be used"):
        VectorEnv("CartPole-v1", 2, worker=lambda *args: None)
    with pytest.raises(ValueError, match="context must be None or one of"):
        VectorEnv("CartPole-v1", 2, context="teleport")
    with pytest.raises(ValueError, match="Invalid `observation_mode`"):
        VectorEnv("CartPole-v1", 2, observation_mode="mixed")
    with pytest.raises(TypeError, match="Expected both elements of observation_mode"):
        VectorEnv("CartPole-v1", 2, observation_mode=(Discrete(2), "box"))
    with pytest.raises(TypeError, match="shared_memory"):
        VectorEnv("CartPole-v1", 2, shared_memory="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("copy", [True, False])
def test_a_mixed_placement_returns_every_sub_env_from_one_allocation(
    copy: bool, no_leaks: None
) -> None:
    """The caller's sub-envs step in rows of the hosts' shared buffers (one allocation): a step
    reads every sub-env in one copy, or, with ``copy=False``, returns that buffer itself (which
    held only the hosts' rows before 2026-11-30), with the caller's process's results."""
    ours = VectorEnv("CartPole-v1", 4, caller_envs=2, n_processes=1, copy=copy)
    ref = VectorEnv("CartPole-v1", 4, n_processes=0)
    try:
        assert ours._hosted._joint is not None
        got, want = ours.reset(seed=3), ref.reset(seed=3)
        assert data_equivalence(got, want)
        first = got[0]
        for k in range(40):
            actions = np.array([k % 2, 1, 0, (k // 3) % 2])
            got, want = ours.step(actions), ref.step(actions)
            assert got[0].shape == (4, 4)
            assert data_equivalence(got, want)
            assert (got[0] is first) is not copy  # copy=False: the shared buffer each time
            first = got[0]
    finally:
        ours.close()
        ref.close()


class TimedEnv(CountEnv):
    """Steps and resets take 0.05 s; their start and end times (``time.monotonic``, the same
    clock in every process) are in the info."""

    def __init__(self) -> None:
        super().__init__(max_count=10)

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        time.sleep(0.05)
        *rest, info = fn(*args, **kwargs)
        return (*rest, {**info, "start": start, "end": time.monotonic()})

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        return self._timed(super().reset, seed=seed, options=options)

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        return self._timed(super().step, action)


def most_at_once(infos: list[dict[str, Any]]) -> int:
    """The most sub-envs whose (start, end) intervals overlap, over the calls' vector infos."""
    events = sorted(
        (t, +1 if which == "start" else -1)
        for info in infos
        for which in ("start", "end")
        for t in info[which][info["_" + which]]
    )
    now = top = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        now += delta
        top = max(top, now)
    return top


@pytest.mark.parametrize(("limit", "n_processes"), [(1, None), (2, None), (2, 2), (3, 3)])
def test_max_concurrency_caps_the_sub_envs_stepping_at_once(
    limit: int, n_processes: int | None, no_leaks: None
) -> None:
    """gymnasium 1.4's ``AsyncVectorEnv(max_concurrency=...)``: at most that many sub-envs in
    ``reset`` or ``step`` at once; the results are unchanged."""
    env = VectorEnv([TimedEnv] * 6, n_processes=n_processes, max_concurrency=np.int64(limit))
    try:
        assert env.max_concurrency == limit and env.n_processes <= limit
        obs, info = env.reset(seed=0)
        infos = [info]
        for _ in range(3):
            obs, _, _, _, info = env.step(np.ones(6, np.int64))
            infos.append(info)
        env.step_async(np.ones(6, np.int64))
        infos.append(env.step_wait()[4])
        assert obs.tolist() == [3, 4, 5, 6, 7, 8]
        assert 1 <= most_at_once(infos) <= limit
    finally:
        env.close()


def test_max_concurrency_is_checked_as_gymnasium_checks_it() -> None:
    for bad in ("2", 1.5, None.__class__):
        with pytest.raises(ValueError, match="`max_concurrency` must be an integer or None"):
            VectorEnv("CartPole-v1", 2, max_concurrency=bad)  # type: ignore[arg-type]
    for bad in (0, -1):
        with pytest.raises(ValueError, match="`max_concurrency` must be a positive or None"):
            VectorEnv("CartPole-v1", 2, max_concurrency=bad)
    with pytest.raises(ValueError, match=r"n_processes=3 .* more than max_concurrency=2"):
        VectorEnv("CartPole-v1", 4, n_processes=3, max_concurrency=2)


class TextObservations(CountEnv):
    """A Dict observation with a Text part: no fixed-size row in the shared buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_space = Dict({"n": Discrete(10), "name": gym.spaces.Text(8)})

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        n, info = super().reset(seed=seed, options=options)
        return {"n": n, "name": f"reset{n}"}, info

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        n, *rest = super().step(action)
        return {"n": n, "name": "x" * n}, *rest


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_text_observations_are_the_envs_not_placeholders(
    mode: AutoresetMode, no_leaks: None, placed: dict[str, int]
) -> None:
    """They used to come back as placeholder strings (``'00000000'``), silently. Observations
    without fixed-size rows now travel pickled and are batched as gymnasium batches them: the
    same as ``SyncVectorEnv``, final observations included."""
    fns = [lambda: TextObservations(), lambda: TextObservations()]
    env = VectorEnv(fns, **placed, autoreset_mode=mode)
    sync = SyncVectorEnv(fns, autoreset_mode=mode)
    try:
        assert env.observation_space == sync.observation_space
        obs, info = env.reset(seed=[1, 0])
        sync_obs, sync_info = sync.reset(seed=[1, 0])
        assert data_equivalence(obs, sync_obs) and data_equivalence(info, sync_info)
        assert obs["name"] == ("reset1", "reset0")
        for t in range(5):
            actions = np.array([t % 5, 1])
            got = env.step(actions)
            want = sync.step(actions)
            for a, b in zip(got, want):
                assert data_equivalence(a, b), (t, a, b)
    finally:
        env.close()
        sync.close()


class GraphObservations(CountEnv):
    def __init__(self) -> None:
        super().__init__()
        self.observation_space = gym.spaces.Graph(Box(0.0, 1.0, (2,)), None)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        super().reset(seed=seed, options=options)
        return self.observation_space.sample(), {}

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        _, *rest = super().step(action)
        return self.observation_space.sample(), *rest


def test_graph_observations_need_shared_memory_off(no_leaks: None) -> None:
    """``shared_memory=True`` (the default) refuses what ``AsyncVectorEnv``'s shared memory
    cannot hold, with gymnasium's own errors; ``shared_memory=False`` runs them."""
    with pytest.raises(TypeError, match="dynamic shape"):
        VectorEnv([lambda: GraphObservations()] * 2, n_processes=1)
    env = VectorEnv([lambda: GraphObservations()] * 2, n_processes=1, shared_memory=False)
    try:
        obs, _ = env.reset(seed=0)
        assert obs in env.observation_space and len(obs) == 2
        obs, *_ = env.step(np.array([1, 2]))
        assert obs in env.observation_space
    finally:
        env.close()


class Word(gym.Space[str]):
    """A custom space: gymnasium batches it as a tuple, its shared memory refuses it."""

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        return "w"

    def contains(self, x: Any) -> bool:
        return isinstance(x, str)


class WordEnv(gym.Env[str, str]):
    def __init__(self) -> None:
        self.observation_space = Word()
        self.action_space = Word()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        return "start", {}

    def step(self, action: str):  # type: ignore[no-untyped-def]
        return f"got {action}", 0.0, action == "stop", False, {}


def test_custom_spaces_travel_pickled(no_leaks: None, placed: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="shared_memory=False"):
        VectorEnv([WordEnv] * 3, **placed)
    env = VectorEnv([WordEnv] * 3, **placed, shared_memory=False, autoreset_mode="SameStep")
    try:
        assert isinstance(env.observation_space, Tuple) and len(env.observation_space) == 3
        obs, _ = env.reset()
        assert obs == ("start",) * 3
        obs, _, term, _, info = env.step(("a", "stop", "c"))
        assert obs == ("got a", "start", "got c") and term.tolist() == [False, True, False]
        assert info["final_obs"][1] == "got stop" and info["_final_obs"].tolist() == [0, 1, 0]
        with pytest.raises(ValueError, match="num_envs=3"):
            env.step(("a", "b"))
    finally:
        env.close()


def test_observation_mode_different(no_leaks: None, placed: dict[str, int]) -> None:
    """Sub-envs whose observation spaces differ in bounds only, batched as gymnasium does."""

    class Bounded(CountEnv):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.observation_space = Discrete(n)

    fns = [lambda: Bounded(10), lambda: Bounded(12)]
    with pytest.raises(RuntimeError, match="not equivalent"):
        VectorEnv(fns, **placed)
    env = VectorEnv(fns, **placed, observation_mode="different")
    try:
        assert env.observation_space == gym.spaces.MultiDiscrete([10, 12])
        assert env.single_observation_space == Discrete(10)
        obs, _ = env.reset(seed=[1, 2])
        assert obs.tolist() == [1, 2]
    finally:
        env.close()


class NeedsOptions(CountEnv):
    def reset(self, seed, options):  # type: ignore[no-untyped-def,override]
        if seed == 7:
            raise ValueError("Error in reset")
        return super().reset(seed=seed, options=options)


def test_requested_resets_pass_options_and_env_errors_keep_their_type(
    no_leaks: None, placed: dict[str, int]
) -> None:
    """A reset the caller asks for passes ``options=`` (``None`` too), as gymnasium does; a
    sub-env's exception is a ``SubEnvError`` that is also of the env's own type."""
    env = VectorEnv([NeedsOptions] * 2, **placed)
    try:
        obs, _ = env.reset(seed=[0, 0])
        assert obs.tolist() == [0, 0]
        with pytest.raises(ValueError, match="Error in reset") as info:
            env.reset(seed=[7, 0])
        assert isinstance(info.value, SubEnvError) and info.value.sub_env == 0
    finally:
        env.close()


def test_sub_envs_with_different_spaces_are_refused(no_leaks: None) -> None:
    with pytest.raises(RuntimeError, match="observation spaces are not equivalent"):
        VectorEnv(
            [lambda: RandomEpisodesEnv("box"), lambda: RandomEpisodesEnv("discrete")],
            2,
            n_processes=1,
        )
    with pytest.raises(RuntimeError, match="action space different"):
        VectorEnv([lambda: CountEnv(), lambda: OtherActions()], 2, n_processes=1)


def test_step_async_and_step_equal_to_sync(no_leaks: None, placed: dict[str, int]) -> None:
    """step_async/step_wait (sent without running the loop) and step, mixed: SyncVectorEnv."""
    ours = VectorEnv("CartPole-v1", 4, **placed)
    sync = SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(4)])
    try:
        assert_same(ours.reset(seed=1), sync.reset(seed=1), "reset")
        rng = np.random.default_rng(1)
        for t in range(120):
            actions = rng.integers(0, 2, 4)
            if t % 3:
                ours.step_async(actions)
                got = ours.step_wait()
            else:
                got = ours.step(actions)
            assert_same(got, sync.step(actions), f"step {t}")
    finally:
        ours.close()
        sync.close()


def test_interrupted_step_leaves_a_working_env(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt while a step waits for its hosts (outside the event loop, in the
    lockstep step's ``poll``), and one in the portal's event loop while a reset's requests
    are in flight: later resets and steps are exact."""
    ours = VectorEnv("CartPole-v1", 4, n_processes=2)
    sync = SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(4)])

    def interrupt(*args: Any) -> Any:
        raise KeyboardInterrupt

    try:
        ours.reset(seed=0)
        with monkeypatch.context() as patch:
            patch.setattr(ours._hosted, "_wait_readable", interrupt)
            with pytest.raises(KeyboardInterrupt):
                ours.step(np.zeros(4, dtype=np.int64))
        ours._hosted.portal.loop.call_soon(interrupt)
        with pytest.raises(KeyboardInterrupt):
            ours.reset(seed=1)
        assert_same(ours.reset(seed=2), sync.reset(seed=2), "reset after the interrupts")
        rng = np.random.default_rng(2)
        for t in range(60):
            actions = rng.integers(0, 2, 4)
            assert_same(ours.step(actions), sync.step(actions), f"step {t}")
    finally:
        ours.close()
        sync.close()


class SlowAt(CountEnv):
    """Steps take 0.12 s at ``at`` (longer than the lockstep round waits outside the loop)."""

    def __init__(self, at: int = 2) -> None:
        super().__init__(max_count=7)
        self.at = at

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        if self.count + 1 == self.at:
            time.sleep(0.12)
        return super().step(action)


@pytest.mark.parametrize("call", ["step", "step_async"])
def test_quiet_lockstep_steps_run_no_event_loop(
    call: str, no_leaks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The common step sends and reads without the portal's loop; a slow host, infos and
    episode ends go through the loop, with the same results as ``SyncVectorEnv``. The same for
    ``step_async`` then ``step_wait`` (with or without a timeout): they pay what ``step`` pays."""
    fns = [lambda: SlowAt(2), lambda: SlowAt(3), lambda: SlowAt(9)]
    ours = VectorEnv(fns, n_processes=3, autoreset_mode="SameStep")
    sync = SyncVectorEnv(fns, autoreset_mode="SameStep")
    try:
        assert_same(ours.reset(seed=1), sync.reset(seed=1), "reset")
        runs = count_loop_runs(ours, monkeypatch)
        direct_wait = _lockstep._DIRECT_WAIT
        actions = np.array([1, 1, 1])
        quiet_steps = 0
        for t in range(12):
            # The sync env's sub-envs mirror ours: which of ours is slow at this step.
            slow = any(e.count + 1 == e.at for e in sync.envs)
            if slow:  # its host answers after 0.12 s, past the 50 ms the step waits directly
                monkeypatch.setattr(_lockstep, "_DIRECT_WAIT", direct_wait)
            else:  # a quiet step waits for its replies however loaded the machine is
                patient_direct_reads(monkeypatch)
            before = runs[0]
            if call == "step":
                got = ours.step(actions)
            else:
                ours.step_async(actions)
                got = ours.step_wait(timeout=30 if t % 2 else None)
            assert_same(got, sync.step(actions), f"step {t}")
            if not slow and not got[4]:
                quiet_steps += 1
                assert runs[0] == before, f"step {t} ran the event loop"
            elif slow:
                assert runs[0] > before, f"step {t} (slow) did not hand the round to the loop"
        assert quiet_steps >= 3 and runs[0] > 0
    finally:
        ours.close()
        sync.close()


# Without a step_timeout the loop-free step sends bare requests; with one, ordinary calls.
STEP_TIMEOUTS = pytest.mark.parametrize("step_timeout", [None, 60.0], ids=["bare", "timed"])


@STEP_TIMEOUTS
def test_step_wait_timeout_on_a_loop_free_round(step_timeout: float | None, no_leaks: None) -> None:
    """A wait past its timeout leaves the round pending (in the loop, where the hosts'
    ``step_timeout`` timers run); ``timeout=0`` returns replies that are already in, as
    ``AsyncVectorEnv`` does; the results are ``SyncVectorEnv``'s throughout."""
    fns = [lambda: SlowAt(2), lambda: SlowAt(9)]
    ours = VectorEnv(fns, n_processes=1, step_timeout=step_timeout)
    sync = SyncVectorEnv(fns)
    try:
        assert_same(ours.reset(seed=0), sync.reset(seed=0), "reset")
        actions = np.array([1, 1])
        # Step 1 is quick: wait for its reply to be in, then take it without waiting.
        ours.step_async(actions)
        pending = ours._pending
        assert pending is not None and not isinstance(pending, asyncio.Task)
        assert pending.readers is not None  # sent without the loop
        select.select(list(pending.readers), [], [], 30)
        assert_same(ours.step_wait(timeout=0), sync.step(actions), "step 1")
        # Step 2 takes 0.12 s: a 0.01 s wait times out, twice, and the step stays pending.
        ours.step_async(actions)
        for _ in range(2):
            with pytest.raises(multiprocessing.TimeoutError, match=r"`step_wait` has timed out"):
                ours.step_wait(timeout=0.01)
        with pytest.raises(AlreadyPendingCallError):
            ours.step_async(actions)
        assert_same(ours.step_wait(timeout=30), sync.step(actions), "step 2")
        with pytest.raises(NoAsyncCallError):
            ours.step_wait()
        for t in range(3, 10):
            ours.step_async(actions)
            assert_same(ours.step_wait(), sync.step(actions), f"step {t}")
    finally:
        ours.close()
        sync.close()


@STEP_TIMEOUTS
def test_step_async_then_other_calls_or_close(
    step_timeout: float | None, no_leaks: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A step sent and never waited for: another call finishes it first (its results are
    lost, the episode state is kept), ``close`` warns, and a garbage-collected env leaves
    nothing behind; asyncio logs no outcome that nobody retrieved."""
    ours = VectorEnv(count_env, 3, n_processes=2, step_timeout=step_timeout)
    try:
        ours.reset()
        ours.step_async(np.array([1, 1, 1]))
        assert ours.call("count") == (1, 1, 1)
        ours.step_async(np.array([1, 1, 1]))
        obs, _ = ours.reset(seed=[4, 5, 6])  # the step happened, then the reset
        assert obs.tolist() == [4, 5, 6]
        ours.step_async(np.array([1, 1, 1]))
        with pytest.warns(UserWarning, match="pending call to `step`"):
            ours.close()
        with pytest.raises(ClosedEnvironmentError):
            ours.step_wait()
    finally:
        ours.close()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        dropped = VectorEnv(count_env, 3, n_processes=2, step_timeout=step_timeout)
        dropped.reset()
        dropped.step_async(np.array([1, 1, 1]))
        del dropped
        gc.collect()
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


def test_killed_host_during_step_async_is_restarted(no_leaks: None) -> None:
    """A host that dies while the caller works between step_async and step_wait: the loop
    finishes the round (restart within budget), as for step."""
    fns = [faulty(), faulty("kill", 2)]
    env = VectorEnv(fns, 2, n_processes=2, max_restarts=1)
    try:
        env.reset(seed=0)
        old = env.pids
        env.step_async(np.zeros(2, np.int64))
        env.step_wait()
        env.step_async(np.zeros(2, np.int64))
        assert not wait_gone([old[1]])  # the caller's own work: the host dies meanwhile
        _, rew, _, trunc, info = env.step_wait()
        assert trunc.tolist() == [False, True] and rew.tolist() == [1.0, 0.0]
        assert "SIGKILL" in info["restarted"][1]
        assert env.pids[0] == old[0] and env.pids[1] != old[1]
        env.step_async(np.zeros(2, np.int64))
        assert env.step_wait()[1].tolist() == [1.0, 0.0]  # its autoreset step
        env.call("arm", "raise", 1)
        env.step_async(np.zeros(2, np.int64))
        with pytest.raises(SubEnvError, match="sub-env 0"):
            env.step_wait()
        with pytest.raises(NoAsyncCallError):  # the failed step is over
            env.step_wait()
    finally:
        env.close()


async def test_step_async_inside_a_running_event_loop(
    no_leaks: None, placed: dict[str, int]
) -> None:
    """From a coroutine the round goes through the portal (its loop in a helper thread)."""
    env = VectorEnv("CartPole-v1", 4, **placed)
    sync = SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(4)])
    try:
        assert_same(env.reset(seed=3), sync.reset(seed=3), "reset")
        for t in range(20):
            actions = np.full(4, t % 2, np.int64)
            env.step_async(actions)
            await asyncio.sleep(0)
            assert_same(env.step_wait(timeout=30), sync.step(actions), f"step {t}")
    finally:
        env.close()
        sync.close()


# -- lifecycle ----------------------------------------------------------------------------------


def test_close_twice_and_nothing_left(no_leaks: None) -> None:
    env = VectorEnv("CartPole-v1", 4, n_processes=2)
    pids = env.pids
    assert len(pids) == 2
    env.reset(seed=0)
    env.close()
    env.close()
    assert env.closed
    assert not wait_gone(pids)
    with pytest.raises(RuntimeError, match="closed"):
        env.step(np.zeros(4, np.int64))


def test_garbage_collected_env_leaves_nothing(no_leaks: None) -> None:
    env = VectorEnv("CartPole-v1", 2, n_processes=2)
    env.reset(seed=0)
    pids = env.pids
    del env
    gc.collect()
    assert not wait_gone(pids)


def test_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="num_envs must be an int"):
        VectorEnv("CartPole-v1", 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_envs must be >= 1"):
        VectorEnv("CartPole-v1", 0)
    with pytest.raises(ValueError, match="n_processes must be >= 0"):
        VectorEnv("CartPole-v1", 2, n_processes=-1)
    with pytest.raises(ValueError, match=r"caller_envs must be in \[0, num_envs=2\], got 3"):
        VectorEnv("CartPole-v1", 2, caller_envs=3)
    with pytest.raises(ValueError, match=r"n_processes=0.*caller_envs must be None or num_envs=2"):
        VectorEnv("CartPole-v1", 2, n_processes=0, caller_envs=1)
    with pytest.raises(ValueError, match=r"step_timeout=1.0 needs every sub-env on an env host"):
        VectorEnv("CartPole-v1", 2, n_processes=0, step_timeout=1.0)
    with pytest.raises(ValueError, match=r"step_timeout=1.0 .* not caller_envs=1"):
        VectorEnv("CartPole-v1", 2, caller_envs=1, step_timeout=1.0)
    with pytest.raises(ValueError, match=r"batch_size .* caller_envs=1"):
        VectorEnv("CartPole-v1", 4, caller_envs=1, batch_size=2)
    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        VectorEnv("CartPole-v1", 2, max_restarts=-1)
    with pytest.raises(ValueError, match="autoreset_mode must be"):
        VectorEnv("CartPole-v1", 2, autoreset_mode="Sometimes")
    with pytest.raises(ValueError, match="step_timeout must be"):
        VectorEnv("CartPole-v1", 2, step_timeout=0)
    with pytest.raises(ValueError, match=r"env: a list of factories must have num_envs=3"):
        VectorEnv([count_env, count_env], 3)
    with pytest.raises(TypeError, match=r"env\[1\] must be a gymnasium id"):
        VectorEnv([count_env, 5], 2)


async def test_used_inside_a_running_event_loop(no_leaks: None, placed: dict[str, int]) -> None:
    """A synchronous API called from a coroutine: it blocks that loop, and works."""
    env = VectorEnv("CartPole-v1", 4, **placed, seed=1)
    sync = SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(4)])
    try:
        assert_same(env.reset(), sync.reset(seed=1), "reset")
        for _ in range(30):
            actions = np.ones(4, np.int64)
            assert_same(env.step(actions), sync.step(actions), "step")
        await asyncio.sleep(0)
        assert env.get_attr("np_random_seed") == (1, 2, 3, 4)
    finally:
        env.close()


# -- faults -------------------------------------------------------------------------------------


def faulty(fault: str = "", at: int = 3) -> Any:
    return lambda: FaultyEnv(fault, at)


def test_env_that_raises_names_the_sub_env(no_leaks: None, placed: dict[str, int]) -> None:
    fns = [faulty(), faulty(), faulty(), faulty("raise", 2)]
    env = VectorEnv(fns, 4, **placed)
    try:
        env.reset()
        env.step(np.zeros(4, np.int64))
        with pytest.raises(SubEnvError) as info:
            env.step(np.zeros(4, np.int64))
        err = info.value
        assert err.sub_env == 3
        assert "sub-env 3" in str(err) and "ZeroDivisionError: the env divided by zero" in str(err)
        assert "Remote traceback" in str(err) and "in step" in (err.remote_traceback or "")
        assert isinstance(err.__cause__, ZeroDivisionError)
        with pytest.raises(RuntimeError, match=r"call reset\(\) before stepping"):
            env.step(np.zeros(4, np.int64))
        # reset() rebuilds the failed host's sub-envs; the env is usable again.
        obs, _ = env.reset()
        assert obs.shape == (4, 2)
        obs, rew, *_ = env.step(np.zeros(4, np.int64))
        assert rew.tolist() == [1.0] * 4
    finally:
        env.close()


class MalformedEnv(FaultyEnv):
    """Its 2nd step returns a malformed ``what``: a reward that is a list, an info that is a
    list, four items instead of five, an observation outside its space."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        obs, reward, terminated, truncated, info = super().step(action)
        if self.t != 2:
            return obs, reward, terminated, truncated, info
        if self.what == "reward":
            return obs, [reward], terminated, truncated, info
        if self.what == "info":
            return obs, reward, terminated, truncated, [info]
        if self.what == "short":
            return obs, reward, terminated, truncated
        return np.zeros(5, np.float32), reward, terminated, truncated, info


MALFORMED = {
    "reward": (TypeError, "reward must be a real number, got list"),
    "info": (TypeError, "info must be a dict, got list"),
    "short": (TypeError, "must be a tuple (observation, reward, terminated, truncated, info)"),
    "obs": (ValueError, "does not fit the observation space"),
}


@pytest.mark.parametrize("what", list(MALFORMED))
def test_a_malformed_sub_env_step_names_the_sub_env(
    what: str, no_leaks: None, placed: dict[str, int]
) -> None:
    """In every placement (the last sub-env, the malformed one, is the caller's when mixed)."""
    env = VectorEnv([faulty(), lambda: MalformedEnv(what)], 2, **placed)
    kind, text = MALFORMED[what]
    try:
        env.reset(seed=0)
        env.step(np.zeros(2, np.int64))
        with pytest.raises(SubEnvError) as info:
            env.step(np.zeros(2, np.int64))
        assert info.value.sub_env == 1 and isinstance(info.value, kind)
        assert "sub-env 1" in str(info.value) and text in str(info.value)
        with pytest.raises(RuntimeError, match=r"call reset\(\) before stepping"):
            env.step(np.zeros(2, np.int64))
        env.reset(seed=1)  # rebuilt: usable again
        assert env.step(np.zeros(2, np.int64))[1].tolist() == [1.0, 1.0]
    finally:
        env.close()


def test_a_host_killed_in_mixed_placement_is_restarted(no_leaks: None) -> None:
    """Sub-env 0 on the one host, sub-env 1 in the caller's process: the host's death costs
    sub-env 0 its episode only, and the caller's sub-env steps on."""
    env = VectorEnv([faulty("kill", 2), faulty()], 2, n_processes=1, caller_envs=1, max_restarts=1)
    try:
        env.reset(seed=0)
        old = env.pids
        env.step(np.zeros(2, np.int64))
        obs, rew, term, trunc, info = env.step(np.zeros(2, np.int64))
        assert trunc.tolist() == [True, False] and rew.tolist() == [0.0, 1.0] and not term.any()
        assert "SIGKILL" in info["restarted"][0] and info["_restarted"].tolist() == [True, False]
        assert obs[1].tolist() == pytest.approx([0.02, 0.02])  # the caller's sub-env went on
        assert len(env.pids) == 1 and env.pids != old
        assert env.step(np.zeros(2, np.int64))[1].tolist() == [0.0, 1.0]  # its autoreset step
        assert env.step(np.zeros(2, np.int64))[1].tolist() == [1.0, 1.0]
    finally:
        env.close()


@pytest.mark.parametrize(
    ("fault", "n_processes"), [("raise", 2), ("raise", 0), ("kill", 2)], ids=lambda v: str(v)
)
def test_a_fault_in_send_recv_mode_reaches_recv(
    fault: str, n_processes: int, no_leaks: None
) -> None:
    """Sub-env 3 (the second group of two) raises, or kills its host, at its 2nd step: recv
    raises the error naming it, or returns the group restarted; the first group is served
    meanwhile (a host being restarted answers later than the other)."""
    fns = [faulty(), faulty(), faulty(), faulty(fault, 2)]
    env = VectorEnv(fns, 4, n_processes=n_processes, batch_size=2, max_restarts=1)
    try:
        env.async_reset(seed=0)
        seen = 0  # batches of sub-envs 2 and 3: their reset, step 1, then the faulty step 2
        deadline = time.monotonic() + 30.0  # generous: a restarted host answers later
        while True:
            assert time.monotonic() < deadline, f"sub-env 3 not back after {seen} answers"
            try:
                _, rew, _, trunc, batch = env.recv()
            except SubEnvError as err:
                assert fault == "raise" and seen == 2
                assert err.sub_env == 3 and isinstance(err, ZeroDivisionError)
                return
            ids = batch["env_id"].tolist()
            if ids == [2, 3]:
                seen += 1
                if seen == 3:  # the answer to the step that killed the host
                    assert fault == "kill"
                    assert trunc.tolist() == [True, True] and rew.tolist() == [0.0, 0.0]
                    assert "SIGKILL" in batch["restarted"][1]
                    return
            env.send(np.zeros(2, np.int64), batch["env_id"])
    finally:
        env.close()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_killed_host_is_restarted(mode: AutoresetMode, no_leaks: None) -> None:
    fns = [faulty(), faulty(), faulty("kill", 2), faulty()]
    env = VectorEnv(fns, 4, n_processes=2, autoreset_mode=mode, max_restarts=1)
    try:
        env.reset(seed=0)
        old = env.pids
        env.step(np.zeros(4, np.int64))
        obs, rew, term, trunc, info = env.step(np.zeros(4, np.int64))
        # Host 1 (sub-envs 2 and 3) died: they start new episodes, reported as truncated.
        assert trunc.tolist() == [False, False, True, True]
        assert rew.tolist() == [1.0, 1.0, 0.0, 0.0] and not term.any()
        assert info["_restarted"].tolist() == [False, False, True, True]
        assert "SIGKILL" in info["restarted"][2]
        assert obs[2:].tolist() == [[0.0, 0.0]] * 2  # the new episodes' first observations
        if mode == AutoresetMode.SAME_STEP:
            assert info["_final_obs"].tolist() == [False, False, True, True]
        assert env.pids[0] == old[0] and env.pids[1] != old[1]
        obs, rew, term, trunc, info = env.step(np.zeros(4, np.int64))
        if mode == AutoresetMode.NEXT_STEP:
            # The next step is the autoreset step: no new reset, the same first observation.
            assert rew.tolist() == [1.0, 1.0, 0.0, 0.0]
            assert obs[2:].tolist() == [[0.0, 0.0]] * 2
        else:
            assert rew.tolist() == [1.0] * 4
        assert not trunc.any()
        # Every sub-env dies at its next step: host 0 is restarted, host 1 has spent its
        # budget (max_restarts=1), so its crash is raised.
        assert env.call("arm", "kill", 1) == ("armed kill",) * 4
        with pytest.raises(WorkerCrashedError, match=r"sub-envs 2\.\.3 \(env host 1\).*SIGKILL"):
            env.step(np.zeros(4, np.int64))
    finally:
        env.close()


def test_killed_host_without_restarts_raises(no_leaks: None) -> None:
    fns = [faulty("kill", 2), faulty()]
    env = VectorEnv(fns, 2, n_processes=2, max_restarts=0)
    try:
        env.reset()
        env.step(np.zeros(2, np.int64))
        with pytest.raises(WorkerCrashedError, match=r"sub-envs 0\.\.0 .*max_restarts=0"):
            env.step(np.zeros(2, np.int64))
    finally:
        env.close()


def test_step_timeout_kills_and_restarts_the_host(no_leaks: None) -> None:
    fns = [faulty("hang", 2), faulty()]
    env = VectorEnv(fns, 2, n_processes=2, step_timeout=1.5, max_restarts=1)
    try:
        env.reset()
        env.step(np.zeros(2, np.int64))
        _, _, _, trunc, info = env.step(np.zeros(2, np.int64))
        assert trunc.tolist() == [True, False]
        assert "step_timeout=1.5s" in info["restarted"][0]
        env.step(np.zeros(2, np.int64))  # the autoreset step of sub-env 0's new episode
        env.call("arm", "hang", 1)  # both hang now; host 0 has spent its budget
        with pytest.raises(StepTimeoutError, match=r"sub-envs 0\.\.0"):
            env.step(np.zeros(2, np.int64))
    finally:
        env.close()


# -- EnvPool-style send/recv --------------------------------------------------------------------


@pytest.mark.parametrize("n_processes", [2, 0], ids=["hosts", "in-process"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_send_recv_matches_each_env_stepped_alone(
    mode: AutoresetMode, n_processes: int, no_leaks: None
) -> None:
    """recv returns batch_size sub-envs at a time; each one's story is its own env's (also
    with every sub-env in the caller's process: its groups answer one after another)."""
    n = 6
    env = VectorEnv(
        [lambda: RandomEpisodesEnv("dict")] * n,
        n,
        n_processes=n_processes,
        batch_size=2,
        autoreset_mode=mode,
    )
    ref = SyncVectorEnv([lambda: RandomEpisodesEnv("dict")] * n, autoreset_mode=mode)
    try:
        assert env.n_processes == n_processes and len(env.pids) == n_processes
        env.async_reset(seed=0)
        ref_obs, _ = ref.reset(seed=0)
        # The reference steps one sub-env at a time: a 1-env SyncVectorEnv per sub-env.
        singles = [
            SyncVectorEnv([lambda: RandomEpisodesEnv("dict")], autoreset_mode=mode)
            for _ in range(n)
        ]
        for i, single in enumerate(singles):
            single.reset(seed=i)
        expected: dict[int, Any] = {
            i: ({k: v[i : i + 1] for k, v in ref_obs.items()}, 0.0, False, False) for i in range(n)
        }
        rng = np.random.default_rng(1)
        counts = np.zeros(n, dtype=int)
        for _ in range(120):
            obs, rew, term, trunc, info = env.recv()
            ids = info["env_id"]
            assert len(ids) == 2 and rew.shape == (2,)
            for k, i in enumerate(ids.tolist()):
                want_obs, want_rew, want_term, want_trunc = expected[i]
                assert_same({key: v[k : k + 1] for key, v in obs.items()}, want_obs, f"obs {i}")
                assert (rew[k], term[k], trunc[k]) == (want_rew, want_term, want_trunc)
                counts[i] += 1
            actions = rng.uniform(-1, 1, (2, 2)).astype(np.float32)
            for k, i in enumerate(ids.tolist()):
                o, r, te, tr, _ = singles[i].step(actions[k : k + 1])
                expected[i] = (o, float(r[0]), bool(te[0]), bool(tr[0]))
            env.send(actions, ids)
        assert counts.sum() == 240 and (counts > 0).all()
        with pytest.raises(ValueError, match="not received yet"):
            env.send(np.zeros((2, 2), np.float32), ids)
    finally:
        env.close()
        ref.close()


def test_send_recv_arguments(no_leaks: None) -> None:
    env = VectorEnv("CartPole-v1", 4, n_processes=2, batch_size=2)
    try:
        with pytest.raises(RuntimeError, match="async_reset"):
            env.recv()
        env.async_reset(seed=0)
        _, _, _, _, info = env.recv()
        with pytest.raises(ValueError, match="sent a host at a time"):
            env.send(np.zeros(1, np.int64), info["env_id"][:1])
        with pytest.raises(ValueError, match=r"env_ids must be sub-env indices"):
            env.send(np.zeros(1, np.int64), [9])
        env.send(np.zeros(2, np.int64), info["env_id"])
        # A lockstep reset in between drains what is in flight.
        obs, _ = env.reset(seed=1)
        assert obs.shape == (4, 4)
    finally:
        env.close()
    with pytest.raises(ValueError, match="batch_size must be <= num_envs=4"):
        VectorEnv("CartPole-v1", 4, batch_size=5)


@pytest.mark.slow  # a fresh interpreter or a deliberate wait: CI runs it with -m slow
def test_exit_without_close_leaves_nothing(tmp_path: Any) -> None:
    """A script that never closes its VectorEnv: its env hosts end with it."""
    import subprocess

    script = tmp_path / "forget.py"
    script.write_text(
        "from asyncsample.vector import VectorEnv\n"
        "env = VectorEnv('CartPole-v1', 4, n_processes=2)\n"
        "env.reset(seed=0)\n"
        "print(*env.pids, flush=True)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": root},
        check=True,
    )
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    assert not wait_gone(pids)


def test_quiet_lockstep_step_sends_bare_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a step_timeout the common step costs no call object (no future, no timer) on
    the process backend: its requests go out bare and the batches are gymnasium's."""
    from asyncsample.backends import _remote

    made: list[str] = []
    original = _remote.Incarnation.new_call

    def counting(self: Any, label: str, *args: Any, **kwargs: Any) -> Any:
        made.append(label)
        return original(self, label, *args, **kwargs)

    fns = [lambda: gym.make("CartPole-v1") for _ in range(4)]
    ours = VectorEnv(fns, n_processes=2, autoreset_mode=AutoresetMode.SAME_STEP)
    ref = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    try:
        assert data_equivalence(ours.reset(seed=3), ref.reset(seed=3))
        monkeypatch.setattr(_remote.Incarnation, "new_call", counting)
        patient_direct_reads(monkeypatch)  # a reply late on a loaded machine changes nothing
        for t in range(60):  # episodes end on the way: final observations in the infos
            actions = np.array([t % 2, 1, 0, (t // 3) % 2])
            assert data_equivalence(ours.step(actions), ref.step(actions))
        assert "step" not in made
    finally:
        ours.close()
        ref.close()
