"""Envs that observe and act in text and token sequences, for the tests of the columns of
``Text`` and ``Sequence`` spaces (``tests/test_text_spaces.py``) and the text study.

Each layout (:data:`LAYOUTS`) has an async env and its blocking twin built on the same logic,
so one seed gives the same episodes on every backend; every value is drawn from the env's own
``np_random``. The env info carries a tool output (text) and the agent answers with a reply
(text), token ids (ragged) and per-token log-probabilities (ragged).
"""

from __future__ import annotations

import asyncio
from typing import Any

import gymnasium as gym
import numpy as np

from asyncsample.async_env import AsyncEnv

TEXT = gym.spaces.Text(64)
TOKENS = gym.spaces.Sequence(gym.spaces.Discrete(50))
EMBED = gym.spaces.Sequence(gym.spaces.Box(-1.0, 1.0, (2,), np.float32))
REPLY = gym.spaces.Text(32)

#: Observation and action spaces of each layout.
LAYOUTS: dict[str, tuple[gym.Space[Any], gym.Space[Any]]] = {
    "text": (TEXT, REPLY),
    "tokens": (TOKENS, REPLY),
    "embed": (EMBED, REPLY),
    "dict": (
        gym.spaces.Dict(
            {"prompt": TEXT, "tokens": TOKENS, "x": gym.spaces.Box(0.0, 9.0, (2,), np.float32)}
        ),
        gym.spaces.Dict({"reply": REPLY, "ids": TOKENS}),
    ),
    "tuple": (gym.spaces.Tuple((TEXT, EMBED)), gym.spaces.Tuple((REPLY, TOKENS))),
}


class _Logic:
    """Episodes of 2 to 5 steps; an observation's text and sequences drawn from ``np_random``."""

    def __init__(self, layout: str) -> None:
        self.layout = layout
        self.observation_space, self.action_space = LAYOUTS[layout]
        self.t = 0
        self.length = 2

    def begin(self, rng: np.random.Generator) -> tuple[Any, dict[str, Any]]:
        self.t = 0
        self.length = int(rng.integers(2, 6))
        return self.observe(rng, ""), {"task": f"task-{int(rng.integers(100))}"}

    def observe(self, rng: np.random.Generator, said: str) -> Any:
        n = int(rng.integers(0, 6))
        text = f"t{self.t} {said} " + "é" * n  # non-ascii: bytes and characters differ
        tokens = rng.integers(0, 50, n).astype(np.int64)
        embed = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
        if self.layout == "text":
            return text
        if self.layout == "tokens":
            return tokens
        if self.layout == "embed":
            return embed
        if self.layout == "dict":
            x = np.array([self.t, n], dtype=np.float32)
            return {"prompt": text, "tokens": tokens, "x": x}
        return (text, embed)

    def advance(
        self, rng: np.random.Generator, action: Any
    ) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.t += 1
        said = reply_of(action)
        obs = self.observe(rng, said)
        info = {
            "tool": f"ran {said}"[: 8 + self.t],
            "t": self.t,
            "seen": rng.integers(0, 9, self.t),
        }
        return obs, float(len(said)), self.t >= self.length, False, info


def reply_of(action: Any) -> str:
    """The text of an action of any layout."""
    if isinstance(action, dict):
        return str(action["reply"])
    if isinstance(action, tuple):
        return str(action[0])
    return str(action)


class TextAsyncEnv(AsyncEnv[Any, Any]):
    """The async env of ``layout`` (each step yields to the loop once)."""

    def __init__(self, layout: str = "dict") -> None:
        self.logic = _Logic(layout)
        self.observation_space = self.logic.observation_space
        self.action_space = self.logic.action_space

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        await super().reset(seed=seed)
        await asyncio.sleep(0)
        return self.logic.begin(self.np_random)

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        await asyncio.sleep(0)
        return self.logic.advance(self.np_random, action)

    async def close(self) -> None:
        pass


class TextEnv(gym.Env[Any, Any]):
    """The blocking twin of :class:`TextAsyncEnv`."""

    def __init__(self, layout: str = "dict") -> None:
        self.logic = _Logic(layout)
        self.observation_space = self.logic.observation_space
        self.action_space = self.logic.action_space

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        return self.logic.begin(self.np_random)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        return self.logic.advance(self.np_random, action)


def _text_of(obs: Any) -> str:
    if isinstance(obs, str):
        return obs
    if isinstance(obs, dict):
        return str(obs["prompt"])
    if isinstance(obs, tuple):
        return str(obs[0])
    return f"{len(obs)}:{float(np.asarray(obs).sum()):.3f}"


def answer(obs: Any, layout: str) -> tuple[Any, np.ndarray, np.ndarray]:
    """The deterministic agent's action for one observation, its token ids and logprobs."""
    text = _text_of(obs)
    reply = f"r{len(text)}"
    ids = np.arange(len(text) % 4, dtype=np.int64)
    logprobs = -np.arange(len(text) % 3, dtype=np.float32) / 2
    if layout == "dict":
        return {"reply": reply, "ids": ids}, ids, logprobs
    if layout == "tuple":
        return (reply, ids), ids, logprobs
    return reply, ids, logprobs


def _row(tree: Any, i: int) -> Any:
    if isinstance(tree, dict):
        return {k: _row(v, i) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_row(v, i) for v in tree)
    return tree[i]


class TextAgent:
    """Answers each observation by :func:`answer` (depends on its input only); agent infos:
    the reply's token ids and logprobs (ragged) and the reply (text)."""

    def __init__(self, layout: str) -> None:
        self.layout = layout

    def get_actions(self, observations: Any) -> tuple[Any, dict[str, Any]]:
        leaf = observations
        while isinstance(leaf, (dict, tuple)):
            leaf = next(iter(leaf.values())) if isinstance(leaf, dict) else leaf[0]
        n = len(leaf)
        out = [answer(_row(observations, i), self.layout) for i in range(n)]
        actions: Any
        if self.layout == "dict":
            actions = {"reply": [o[0]["reply"] for o in out], "ids": [o[0]["ids"] for o in out]}
        elif self.layout == "tuple":
            actions = ([o[0][0] for o in out], [o[0][1] for o in out])
        else:
            actions = [o[0] for o in out]
        infos = {
            "token_ids": [o[1] for o in out],
            "logprobs": [o[2] for o in out],
            "said": [str(o[0] if isinstance(o[0], str) else reply_of(o[0])) for o in out],
        }
        return actions, infos
