"""Evaluation on separate test envs: deterministic episodes, returns, lengths and video frames."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, cast

import gymnasium as gym
import numpy as np

from asyncsample._tree import Tree
from asyncsample.agent import Agent, AgentOutput, get_actions
from asyncsample.batch import EpisodeBatch
from asyncsample.env_update import EnvId, EnvSource, make_env

__all__ = ["DeterministicAgent", "Evaluation", "RenderFrames", "RenderingEnvFactory"]


@dataclass(frozen=True)
class Evaluation:
    """The result of :meth:`Sampler.evaluate`.

    Attributes:
        returns: undiscounted return of each episode.
        lengths: length of each episode.
        frames: with ``render=True``, the ``rgb_array`` frames of the first episode, shape
            ``(length + 1, H, W, 3)`` (the reset frame, then one per step), else ``None``.
        batch: the episodes themselves.
    """

    returns: np.ndarray
    lengths: np.ndarray
    frames: np.ndarray | None
    batch: EpisodeBatch

    @property
    def mean_return(self) -> float:
        """Mean of :attr:`returns`."""
        return float(np.mean(self.returns))


class DeterministicAgent:
    """Asks ``agent`` for its deterministic actions when its ``get_actions`` takes
    ``deterministic=True`` (or it has ``get_deterministic_actions``); otherwise passes through."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        method = getattr(agent, "get_deterministic_actions", None)
        self._kwargs: dict[str, Any] = {}
        if method is None:
            try:
                params = inspect.signature(agent.get_actions).parameters
            except (TypeError, ValueError):
                params = {}  # type: ignore[assignment]
            if "deterministic" in params:
                self._kwargs = {"deterministic": True}
        self._method = method

    async def get_actions(self, observations: Tree) -> AgentOutput:
        """The agent's deterministic actions."""
        if self._method is not None:
            result = self._method(observations)
            if inspect.isawaitable(result):
                result = await result
            return cast(AgentOutput, result)
        if self._kwargs:
            result = self.agent.get_actions(observations, **self._kwargs)
            if inspect.isawaitable(result):
                result = await result
            return result
        return await get_actions(self.agent, observations)

    def reset(self, do_resets: Any = None) -> None:
        """Forward resets to the wrapped agent."""
        reset = getattr(self.agent, "reset", None)
        if reset is not None:
            reset(do_resets)


class RenderFrames(gym.Wrapper[Any, Any, Any, Any]):
    """Puts ``env.render()`` (an ``rgb_array``) into the info of every reset and step as
    ``"frame"``, so frames travel back from any env host with the infos."""

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        return obs, {**info, "frame": self.env.render()}

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, {**info, "frame": self.env.render()}


@dataclass(frozen=True)
class RenderingEnvFactory:
    """Builds an env that renders ``rgb_array`` frames into its infos (picklable)."""

    source: EnvSource

    def __call__(self) -> gym.Env:
        if isinstance(self.source, str):
            env = gym.make(self.source, render_mode="rgb_array")
        elif isinstance(self.source, EnvId):
            env = self.source(render_mode="rgb_array")
        else:
            env = make_env(self.source)
        if env.render_mode != "rgb_array":
            raise ValueError(
                f"render=True needs an env with render_mode 'rgb_array'; {self.source!r} built "
                f"one with render_mode {env.render_mode!r}"
            )
        return RenderFrames(env)


def frames_of_first_episode(batch: EpisodeBatch) -> np.ndarray:
    """The reset frame and step frames of the first episode of a rendered batch."""
    first = batch.select([0])
    return np.concatenate([first.episode_infos["frame"][:1], first.env_infos["frame"]])
