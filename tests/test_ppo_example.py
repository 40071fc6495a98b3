"""examples/ppo_torch.py: GAE across fragments (by hand), episode returns across fragments, and
(slow) the PPO run reaching the 475 target."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import gymnasium as gym
import numpy as np
import pytest

from asyncsample import EnvSpec, EpisodeBatch, StepType

if importlib.util.find_spec("torch") is None:  # found, not imported: torch takes seconds
    pytest.skip("torch is not installed", allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ppo_torch.py"
F, M, TERM, TIME = StepType.FIRST, StepType.MID, StepType.TERMINAL, StepType.TIMEOUT


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("asyncsample_example_ppo_torch", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fragments(
    pieces: list[tuple[list[StepType], list[float]]], workers: list[int], envs: list[int]
) -> EpisodeBatch:
    """A batch of fragments with the given step types and rewards (observations are zeros)."""
    n = sum(len(types) for types, _ in pieces)
    return EpisodeBatch(
        env_spec=EnvSpec(
            gym.spaces.Box(-np.inf, np.inf, (4,), dtype=np.float32), gym.spaces.Discrete(2)
        ),
        episode_infos={"worker": np.array(workers), "env": np.array(envs)},
        observations=np.zeros((n, 4), np.float32),
        last_observations=np.zeros((len(pieces), 4), np.float32),
        actions=np.zeros(n, np.int64),
        rewards=np.array([r for _, rewards in pieces for r in rewards]),
        env_infos={},
        agent_infos={},
        step_types=np.array([t for types, _ in pieces for t in types], dtype=object),
        lengths=np.array([len(types) for types, _ in pieces]),
    )


def test_gae_bootstraps_on_timeout_and_cuts_but_not_on_terminal() -> None:
    ppo = load()
    batch = fragments(
        [
            ([F, TERM], [1.0, 1.0]),  # ended: the value after it is 0
            ([F, TIME], [1.0, 1.0]),  # time limit: bootstrap from V(last obs) = 10
            ([M, M], [1.0, 1.0]),  # cut by the batch mid-episode: bootstrap too
            ([F], [0.0]),  # a one-step piece of a new episode, cut
        ],
        workers=[0, 0, 1, 1],
        envs=[0, 1, 0, 1],
    )
    values = np.array([2.0, 4.0, 2.0, 4.0, 2.0, 4.0, 1.0])
    last_values = np.array([1000.0, 10.0, 10.0, 8.0])  # 1000 must be ignored (TERMINAL)
    adv, returns = ppo.gae(batch, values, last_values, gamma=0.5, lam=0.5)
    # By hand, gamma = lambda = 0.5 (so gamma * lambda = 0.25):
    #   TERMINAL: delta_1 = 1 - 4 = -3;            delta_0 = 1 + 0.5*4 - 2 = 1;  A_0 = 1 - 0.75
    #   TIMEOUT:  delta_1 = 1 + 0.5*10 - 4 = 2;    delta_0 = 1;                  A_0 = 1 + 0.5
    #   cut (MID): the same as TIMEOUT;  one-step cut: delta = 0 + 0.5*8 - 1 = 3
    expected = np.array([0.25, -3.0, 1.5, 2.0, 1.5, 2.0, 3.0])
    np.testing.assert_allclose(adv, expected)
    np.testing.assert_allclose(returns, expected + values)


def test_episode_returns_add_fragments_per_worker_and_env() -> None:
    ppo = load()
    returns = ppo.EpisodeReturns()
    first = fragments(
        [([F, M], [1.0, 1.0]), ([F, M, TERM], [1.0, 1.0, 1.0]), ([M], [5.0])],
        workers=[0, 0, 1],
        envs=[0, 1, 0],  # worker 1's piece continues an episode whose start was never seen
    )
    assert returns.add(first) == [3.0]
    second = fragments(
        [([M, TIME], [1.0, 1.0]), ([TERM], [1.0]), ([TERM], [2.0]), ([M, M], [1.0, 1.0])],
        workers=[0, 0, 0, 1],
        envs=[0, 0, 1, 0],
    )
    # worker 0 env 0: 2 + 2 = 4, then a new one-step episode (1); env 1: a one-step episode (2).
    assert returns.add(second) == [4.0, 1.0, 2.0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ppo_reaches_475_on_cartpole() -> None:
    ppo = load()
    (result,) = ppo.main(["--reproducible", "--seed", "0", "--steps", "150000"])
    assert result["reached"], f"no 475 within 150k steps: {result['curve']['window_return']}"
    assert result["steps_to_target"] <= 150_000
    assert result["final_evaluation"]["mean_return"] >= 475.0
    window = result["curve"]["window_return"]
    assert window[0] < 100.0 < 475.0 <= window[-1]  # it learned, from near random play
