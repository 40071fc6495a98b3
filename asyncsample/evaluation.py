"""Evaluation on separate test envs: deterministic episodes, returns, lengths and video frames."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import gymnasium as gym
import numpy as np

from asyncsample import _validate
from asyncsample._tree import Tree
from asyncsample.agent import Agent, AgentOutput, get_actions
from asyncsample.async_env import is_async_env
from asyncsample.batch import EpisodeBatch
from asyncsample.env_update import EnvId, EnvSource, make_env
from asyncsample.multiagent.slots import as_slot_env

if TYPE_CHECKING:
    from asyncsample._core import SamplerCore

__all__ = ["DeterministicAgent", "Evaluation", "RenderFrames", "RenderingEnvFactory", "TestEnvs"]


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
    """Asks ``agent`` for deterministic actions (``get_deterministic_actions``, or
    ``get_actions(..., deterministic=True)``) where it has them; otherwise passes through."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._method = getattr(agent, "get_deterministic_actions", None)
        if self._method is None:
            try:
                params = inspect.signature(agent.get_actions).parameters
            except (TypeError, ValueError):
                params = {}  # type: ignore[assignment]
            if "deterministic" in params:
                self._method = functools.partial(cast(Any, agent).get_actions, deterministic=True)

    async def get_actions(self, observations: Tree) -> AgentOutput:
        """The agent's deterministic actions."""
        if self._method is None:
            return await get_actions(self.agent, observations)
        result = self._method(observations)
        if inspect.isawaitable(result):
            result = await result
        return cast(AgentOutput, result)

    def reset(self, do_resets: Any = None) -> None:
        reset = getattr(self.agent, "reset", None)
        if reset is not None:
            reset(do_resets)


class RenderFrames(gym.Wrapper[Any, Any, Any, Any]):
    """Puts ``env.render()`` into every reset's and step's info as ``"frame"``."""

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
            built = as_slot_env(self.source()) if callable(self.source) else None
            if built is not None and is_async_env(built):
                raise TypeError(
                    f"evaluate(render=True): {self.source!r} builds an async env, which has no "
                    "render() to call between its steps; pass render=False, or have the env "
                    "put its frames in its step infos"
                )
            env = make_env(self.source) if built is None else make_env(lambda: built)
        if env.render_mode != "rgb_array":
            raise ValueError(
                f"render=True needs an env with render_mode 'rgb_array'; {self.source!r} built "
                f"one with render_mode {env.render_mode!r}"
            )
        return RenderFrames(env)


class Evaluator(Protocol):
    """What evaluation needs of the one-worker sampler it builds (a :class:`Sampler`)."""

    async def obtain_exact_episodes(
        self, n_eps_per_worker: int, agent_update: Any = None
    ) -> Any: ...

    async def aclose(self) -> None: ...


class TestEnvs:
    """The test envs of one sampler: a one-worker sampler per ``render`` setting, built on
    first use and kept until the test env changes; ``make_sampler`` is the ``Sampler`` class."""

    def __init__(self, make_sampler: Callable[..., Evaluator]) -> None:
        self.make_sampler = make_sampler
        self.evaluators: dict[bool, tuple[Evaluator, Any]] = {}

    async def aclose(self) -> None:
        evaluators, self.evaluators = [e for e, _ in self.evaluators.values()], {}
        for evaluator in evaluators:
            await evaluator.aclose()

    async def evaluate(
        self,
        core: SamplerCore,
        n_episodes: int = 10,
        *,
        agent: Agent | None = None,
        env: EnvSource | None = None,
        deterministic: bool = True,
        render: bool = False,
    ) -> Evaluation:
        """The body of :meth:`Sampler.evaluate` (see there) over the sampler's ``core``."""
        n_episodes = _validate.positive_int("n_episodes", n_episodes)
        deterministic = _validate.flag("deterministic", deterministic)
        render = _validate.flag("render", render)
        _validate.has_method("agent", agent, "get_actions", args="observations", optional=True)
        core.check_open()
        source = env if env is not None else core.test_env
        if source is None:
            source = core.env_sources[0]
            source = source[0] if isinstance(source, list) else source
        source = _validate.env_source("env", source)
        if agent is None:
            await core.start()
            agent = core.first_agent()
        assert agent is not None
        evaluator_agent: Agent = DeterministicAgent(agent) if deterministic else agent
        key = source.id if isinstance(source, EnvId) else source
        evaluator, evaluated = self.evaluators.get(render, (None, None))
        if evaluator is not None and evaluated != key:
            await evaluator.aclose()
            evaluator = None
        if evaluator is None:
            evaluator = self.make_sampler(
                RenderingEnvFactory(source) if render else source,
                evaluator_agent,
                n_workers=1,
                envs_per_worker=min(n_episodes, core.envs_per_worker * core.n_workers),
                n_processes=1,
                max_episode_length=core.max_episode_length,
                seed=int(np.random.SeedSequence([core.seed, 1]).generate_state(1)[0]),
                backend=core.backend_name,
                step_timeout=core.step_timeout,
                max_restarts=core.max_restarts,
                host_threads=core.host_threads,
                backend_options=core.backend_options,
                max_concurrency=core.max_concurrency,
                episode_timeout=core.episode_timeout,
                close_timeout=core.close_timeout,
            )
            self.evaluators[render] = (evaluator, key)
        batch = await evaluator.obtain_exact_episodes(n_episodes, agent_update=evaluator_agent)
        if not isinstance(batch, EpisodeBatch):
            raise TypeError(
                "evaluate() takes single-agent envs only: for a multi-agent env, sample the "
                "test env with obtain_exact_episodes on a Sampler of its own"
            )
        frames = None
        if render:  # the first episode's reset frame, then its step frames
            first = batch.select([0])
            frames = np.concatenate([first.episode_infos["frame"][:1], first.env_infos["frame"]])
        return Evaluation(
            returns=batch.returns, lengths=batch.lengths.copy(), frames=frames, batch=batch
        )
