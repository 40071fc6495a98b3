"""The built-in RandomAgent: its draws do not depend on how they are batched or copied."""

from __future__ import annotations

from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest

from asyncsample import RandomAgent

SPACES = [
    gym.spaces.Discrete(3, start=2),
    gym.spaces.Box(-1.0, 2.0, (3,), np.float32),
    gym.spaces.Box(np.array([-1.0, 0.0]), np.array([1.0, 5.0]), dtype=np.float64),
]
#: Rows per call: small ones, one across a block's end, one larger than a block.
SIZES = [1, 4, 7, 1000, 3, 1024, 2500, 5, 1, 1]


def one_call_each(space: gym.Space[Any], seed: int, sizes: list[int]) -> list[np.ndarray]:
    """What the agent returned before it drew ahead: one generator call per ``get_actions``."""
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        if isinstance(space, gym.spaces.Discrete):
            out.append((rng.random(n) * int(space.n)).astype(np.int64) + int(space.start))
        else:
            assert isinstance(space, gym.spaces.Box)
            draw = rng.uniform(space.low, space.high, size=(n, *space.shape))
            out.append(draw.astype(space.dtype))
    return out


@pytest.mark.parametrize("space", SPACES, ids=str)
def test_draws_ahead_give_the_actions_of_one_draw_per_call(space: gym.Space[Any]) -> None:
    agent = RandomAgent(space, seed=7)
    want = one_call_each(space, 7, SIZES)
    for n, expected in zip(SIZES, want):
        actions, infos = agent.get_actions(np.zeros((n, 1)))
        assert infos == {}
        assert actions.dtype == expected.dtype
        np.testing.assert_array_equal(actions, expected)
        assert all(space.contains(a) for a in actions[:50])


@pytest.mark.parametrize("space", SPACES, ids=str)
def test_a_copy_taken_mid_block_goes_on_with_the_same_actions(space: gym.Space[Any]) -> None:
    # What inference="host" does: the agent is cloudpickled into each env host.
    agent = RandomAgent(space, seed=3)
    for n in SIZES[:3]:
        agent.get_actions(np.zeros((n, 1)))
    copy = cloudpickle.loads(cloudpickle.dumps(agent))
    want = one_call_each(space, 3, SIZES)[3:]
    for n, expected in zip(SIZES[3:], want):
        np.testing.assert_array_equal(copy.get_actions(np.zeros((n, 1)))[0], expected)
        np.testing.assert_array_equal(agent.get_actions(np.zeros((n, 1)))[0], expected)
