"""Multi-agent envs in the vector faces: a row per possible agent of each env.

Each face's rows are checked against a plain loop over the same PettingZoo-style envs with the
same seeds and actions (``plain_rows``): the project's RosterEnv with two agents of one space
(one joins late, one dies early: the rows of an agent dying and joining), and
Knights-Archers-Zombies where PettingZoo's butterfly envs are installed. The SB3 face's tests
are marked slow (importing SB3 and torch costs each pytest worker seconds, as for
tests/test_sb3_vec_env.py); its gymnasium twins stay in the default run.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from asyncsample import VectorEnv
from asyncsample.errors import AsyncSampleError, ParallelEnvError
from asyncsample.multiagent.testing import RosterEnv, Schedule

pytestmark = pytest.mark.timeout(60)

#: Two agents of one space: scout_1 joins on step 2 (acts from step 3), scout_0 is terminated
#: on step 4 (its row is absent after it), scout_1 truncated on step 6, which ends the episode.
SCOUTS = Schedule(
    joins={"scout_0": 0, "scout_1": 2},
    leaves={"scout_0": (4, "terminated"), "scout_1": (6, "truncated")},
)
make_scouts = functools.partial(RosterEnv, SCOUTS)
N_ENVS, STEPS = 2, 15  # two whole episodes and a part of the third

#: The placements of the face: in the caller's process, on a host process, mixed.
PLACEMENTS: dict[str, dict[str, int]] = {
    "in-process": {"n_processes": 0},
    "hosts": {"n_processes": 1},
    "mixed": {"n_processes": 1, "caller_envs": 1},
}


def row_actions(rng: np.random.Generator, n_rows: int, n: int) -> np.ndarray:
    return rng.integers(0, n, size=n_rows)


class PlainRows:
    """The rows of ``n_envs`` envs stepped in a plain loop over their agent dicts.

    ``same_step``: an env that ends is reset in the same step and a done agent's row shows
    zeros (its last observation in ``final``); else it is reset at its next step (reward 0, no
    flags) and a done agent's row shows its last observation.
    """

    def __init__(self, make: Callable[[], Any], n_envs: int, same_step: bool) -> None:
        self.envs = [make() for _ in range(n_envs)]
        self.agents = list(self.envs[0].possible_agents)
        self.k = len(self.agents)
        space = self.envs[0].observation_space(self.agents[0])
        self.zeros = np.zeros(space.shape, dtype=space.dtype)
        self.same_step = same_step
        self.pending = [False] * n_envs

    def _obs_rows(self, observations: dict[str, Any]) -> list[Any]:
        return [observations.get(a, self.zeros) for a in self.agents]

    def reset(self, seeds: list[int]) -> tuple[np.ndarray, np.ndarray]:
        obs, mask = [], []
        for env, seed in zip(self.envs, seeds, strict=True):
            o, _ = env.reset(seed=seed)
            obs += self._obs_rows(o)
            mask += [a in o for a in self.agents]
        return np.stack(obs), np.array(mask)

    def step(self, actions: np.ndarray) -> dict[str, Any]:
        rows: dict[str, list[Any]] = {k: [] for k in ("obs", "rew", "term", "trunc", "mask")}
        final: dict[int, Any] = {}
        for e, env in enumerate(self.envs):
            base = e * self.k
            if self.pending[e]:  # NextStep: this step resets the env
                self.pending[e] = False
                o, _ = env.reset()
                rows["obs"] += self._obs_rows(o)
                rows["rew"] += [0.0] * self.k
                rows["term"] += [False] * self.k
                rows["trunc"] += [False] * self.k
                rows["mask"] += [a in o for a in self.agents]
                continue
            acting = list(env.agents)
            o, r, te, tr, _ = env.step({a: actions[base + self.agents.index(a)] for a in acting})
            term = [a in acting and bool(te[a]) for a in self.agents]
            trunc = [a in acting and bool(tr[a]) for a in self.agents]
            rows["rew"] += [float(r[a]) if a in acting else 0.0 for a in self.agents]
            rows["term"] += term
            rows["trunc"] += trunc
            obs = self._obs_rows(o)
            if not self.same_step:
                rows["obs"] += obs
                rows["mask"] += [a in o for a in self.agents]
                self.pending[e] = not env.agents
                continue
            for s in range(self.k):
                if term[s] or trunc[s]:
                    final[base + s] = obs[s]
                    obs[s] = self.zeros
            if not env.agents:
                o, _ = env.reset()
                obs = self._obs_rows(o)
            rows["obs"] += obs
            rows["mask"] += [a in env.agents for a in self.agents]
        out: dict[str, Any] = {k: np.array(v) for k, v in rows.items()}
        out["obs"] = np.stack(rows["obs"])
        out["final"] = final
        return out


def check_finals(infos: dict[str, Any], final: dict[int, Any], n_rows: int) -> None:
    """SameStep: ``final_obs`` holds exactly the done rows' last observations."""
    if not final:
        assert "final_obs" not in infos
        return
    assert np.flatnonzero(infos["_final_obs"]).tolist() == sorted(final)
    for r, obs in final.items():
        np.testing.assert_array_equal(infos["final_obs"][r], obs)
    assert len(infos["final_obs"]) == n_rows


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_rows_equal_a_plain_loop(placement: str, mode: str, no_leaks: None) -> None:
    same_step = mode == "SameStep"
    plain = PlainRows(make_scouts, N_ENVS, same_step)
    rng = np.random.default_rng(0)
    with contextlib.closing(
        VectorEnv(make_scouts, N_ENVS, autoreset_mode=mode, **PLACEMENTS[placement])
    ) as envs:
        assert envs.num_envs == N_ENVS * 2
        assert envs.single_observation_space == make_scouts().observation_space("scout_0")
        assert envs.single_action_space == make_scouts().action_space("scout_0")
        assert envs.observation_space.shape == (4, 3)
        obs, infos = envs.reset(seed=3)
        want_obs, want_mask = plain.reset([3, 4])
        np.testing.assert_array_equal(obs, want_obs)
        np.testing.assert_array_equal(infos["mask"], want_mask)
        assert infos["_mask"].all()
        np.testing.assert_array_equal(infos["step"][infos["_step"]], 0)
        seen = {"absent": 0, "joined": 0, "died": 0}
        previous = want_mask
        for _ in range(STEPS):
            actions = row_actions(rng, envs.num_envs, 3)
            obs, rewards, term, trunc, infos = envs.step(actions)
            want = plain.step(actions)
            np.testing.assert_array_equal(obs, want["obs"])
            np.testing.assert_array_equal(rewards, want["rew"])
            np.testing.assert_array_equal(term, want["term"])
            np.testing.assert_array_equal(trunc, want["trunc"])
            mask = infos["mask"]
            np.testing.assert_array_equal(mask, want["mask"])
            assert rewards.dtype == np.float64 and term.dtype == trunc.dtype == np.bool_
            # An absent agent's row is zeros: observation, reward and flags. (SameStep: a done
            # agent's row is unmasked and shows what follows, NextStep: its last observation.)
            done = term | trunc
            absent = ~mask & ~done
            assert not obs[absent].any() and not rewards[absent].any()
            if same_step:
                assert not obs[done & ~mask].any()
            # The action mask of the rows that act next (Discrete agents), zeros elsewhere.
            acting = mask if same_step else mask & ~done
            np.testing.assert_array_equal(infos["_action_mask"], acting)
            assert not infos["action_mask"][~acting].any()
            assert (infos["action_mask"][acting].sum(axis=1) == 2).all()  # one action masked
            if same_step:
                check_finals(infos, want["final"], envs.num_envs)
            seen["absent"] += int(absent.sum())
            seen["joined"] += int((mask & ~previous).sum())
            seen["died"] += int(term.sum())
            previous = acting
        assert all(seen.values()), seen


def test_disabled_mode_resets_whole_envs(no_leaks: None) -> None:
    plain = PlainRows(make_scouts, N_ENVS, same_step=False)
    with contextlib.closing(
        VectorEnv(make_scouts, N_ENVS, n_processes=0, autoreset_mode="Disabled")
    ) as envs:
        envs.reset(seed=0)
        plain.reset([0, 1])
        actions = np.ones(envs.num_envs, dtype=np.int64)
        for _ in range(SCOUTS.length):
            obs, rewards, term, trunc, infos = envs.step(actions)
            want = plain.step(actions)
            np.testing.assert_array_equal(obs, want["obs"])
            np.testing.assert_array_equal(rewards, want["rew"])
        # Every env ended: no row of it is live after the step (the documented recipe).
        live = (infos["mask"] & ~(term | trunc)).reshape(N_ENVS, -1)
        ended = ~live.any(axis=1)
        assert ended.all()
        with pytest.raises(RuntimeError, match="ended their episodes"):
            envs.step(actions)
        partial = np.array([True, False, False, False])
        with pytest.raises(ValueError, match="rows of one env reset together"):
            envs.reset(options={"reset_mask": partial})
        obs, infos = envs.reset(options={"reset_mask": np.repeat(ended, 2)})
        np.testing.assert_array_equal(infos["mask"], [True, False, True, False])
        assert not obs[~infos["mask"]].any()
        envs.step(actions)


def test_calls_give_each_row_its_envs_result(no_leaks: None) -> None:
    with contextlib.closing(VectorEnv(make_scouts, N_ENVS, n_processes=0)) as envs:
        envs.reset(seed=5)
        seeds = envs.get_attr("np_random_seed")
        assert len(seeds) == envs.num_envs
        assert seeds[0] == seeds[1] != seeds[2] == seeds[3]
        envs.set_attr("marker", [1, 1, 2, 2])
        assert envs.get_attr("marker") == (1, 1, 2, 2)
        with pytest.raises(ValueError, match="rows of env 0"):
            envs.set_attr("marker", [1, 2, 3, 3])
        with pytest.raises(TypeError, match="send/recv"):
            envs.send(np.zeros(2, dtype=np.int64), [0, 1])
        envs.step_async(np.zeros(envs.num_envs, dtype=np.int64))
        obs, *_ = envs.step_wait()
        assert obs.shape == (4, 3)


@pytest.mark.parametrize("face", ["gymnasium", pytest.param("sb3", marks=pytest.mark.slow)])
def test_agents_of_different_spaces_are_refused(face: str, no_leaks: None) -> None:
    # RosterEnv's four agents: two scouts, a tank with a Dict observation, a medic with a Box
    # action.
    if face == "gymnasium":
        build: Callable[[], Any] = functools.partial(VectorEnv, RosterEnv, 2, n_processes=0)
        name = "env"
    else:
        sb3 = pytest.importorskip("asyncsample.sb3")
        build = functools.partial(sb3.AsyncSampleVecEnv, [RosterEnv] * 2, n_processes=0)
        name = "env_fns"
    with pytest.raises(ParallelEnvError) as caught:
        build()
    assert isinstance(caught.value, AsyncSampleError) and isinstance(caught.value, TypeError)
    text = str(caught.value)
    assert text.startswith(f"{name}: ")
    assert "share one observation space" in text
    assert "'scout_0' with Box(-10.0, 10.0, (3,), float32)" in text
    assert "'tank_0' with Dict(" in text
    assert "pad_observations_v0" in text and "pad_action_space_v0" in text
    only_actions = Schedule(  # one observation space, two action spaces
        joins={"scout_0": 0, "medic_0": 0},
        leaves={"scout_0": (2, "terminated"), "medic_0": (3, "terminated")},
    )
    with pytest.raises(ParallelEnvError, match="share one observation space"):
        VectorEnv(functools.partial(RosterEnv, only_actions), 1, n_processes=0)


def test_knights_archers_zombies_rows(no_leaks: None) -> None:
    # PettingZoo's own env: four agents of one space, truncated together at max_cycles.
    pettingzoo = pytest.importorskip("pettingzoo")
    env_id = "butterfly/knights_archers_zombies-v11"
    try:
        pettingzoo.make("parallel", env_id).close()
    except (ImportError, AttributeError) as exc:  # no registry (older releases), no extra
        pytest.skip(f"{env_id} cannot be made: {exc}")
    make = functools.partial(pettingzoo.make, "parallel", env_id, max_cycles=12)
    plain = PlainRows(make, 2, same_step=False)
    rng = np.random.default_rng(1)
    with contextlib.closing(VectorEnv(make, 2, n_processes=0)) as envs:
        assert envs.num_envs == 8
        obs, infos = envs.reset(seed=7)
        want_obs, want_mask = plain.reset([7, 8])
        np.testing.assert_array_equal(obs, want_obs)
        np.testing.assert_array_equal(infos["mask"], want_mask)
        ended = 0
        for _ in range(14):
            actions = row_actions(rng, 8, 6)
            obs, rewards, term, trunc, infos = envs.step(actions)
            want = plain.step(actions)
            np.testing.assert_array_equal(obs, want["obs"])
            np.testing.assert_array_equal(rewards, want["rew"])
            np.testing.assert_array_equal(term, want["term"])
            np.testing.assert_array_equal(trunc, want["trunc"])
            np.testing.assert_array_equal(infos["mask"], want["mask"])
            ended += int(trunc.sum())
        assert ended == 8  # every row's agent truncated at max_cycles, then reset


@pytest.mark.slow  # imports SB3 and torch (seconds); the gymnasium twin is in the default run
@pytest.mark.parametrize("placement", ["in-process", "hosts"])
def test_sb3_rows_equal_a_plain_loop(placement: str, no_leaks: None) -> None:
    sb3 = pytest.importorskip("asyncsample.sb3")
    plain = PlainRows(make_scouts, N_ENVS, same_step=True)
    rng = np.random.default_rng(2)
    envs = sb3.AsyncSampleVecEnv(make_scouts, N_ENVS, **PLACEMENTS[placement])
    try:
        assert envs.num_envs == 4
        envs.seed(10)  # rows 10..13: an env takes its first row's seed
        obs = envs.reset()
        want_obs, want_mask = plain.reset([10, 12])
        np.testing.assert_array_equal(obs, want_obs)
        np.testing.assert_array_equal([i["mask"] for i in envs.reset_infos], want_mask)
        assert obs.shape == (4, 3)
        for _ in range(STEPS):
            actions = row_actions(rng, envs.num_envs, 3)
            obs, rewards, dones, infos = envs.step(actions)
            want = plain.step(actions)
            np.testing.assert_array_equal(obs, want["obs"])
            np.testing.assert_array_equal(rewards, want["rew"].astype(np.float32))
            np.testing.assert_array_equal(dones, want["term"] | want["trunc"])
            np.testing.assert_array_equal([i["mask"] for i in infos], want["mask"])
            truncated = [i["TimeLimit.truncated"] for i in infos]
            np.testing.assert_array_equal(truncated, want["trunc"] & ~want["term"])
            done_rows = np.flatnonzero(dones).tolist()
            assert sorted(want["final"]) == done_rows
            for r in done_rows:
                np.testing.assert_array_equal(infos[r]["terminal_observation"], want["final"][r])
            for info in infos:
                assert ("action_mask" in info) == bool(info["mask"])
        assert envs.get_attr("render_mode") == [None] * 4
        assert envs.env_is_wrapped(object, indices=[1, 3]) == [False, False]
    finally:
        envs.close()
