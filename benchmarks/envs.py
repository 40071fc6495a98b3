"""Benchmark environments, registered with gymnasium.

Every contender (and every child process it starts) makes these by id. The ids are
of the ``"module:EnvId"`` form, e.g. ``gymnasium.make("benchmarks.envs:FixedCost-v0")``:
gymnasium imports ``benchmarks.envs`` on demand, which registers the envs, in whatever
process calls ``make``. Use :data:`ENV_IDS` to get the full ids.

Costs are spent on CPU time, not on wall time. A step "busy-waits 200 us" by spinning
until its own thread has consumed 200 us of CPU (``time.thread_time``). A spin on
``time.perf_counter`` would count time the process spends descheduled: with 8 env
processes on 2 cores, a step whose process was pre-empted finishes without doing its
work, so oversubscribed contenders would beat the 2-core ideal. Pass ``clock="wall"``
to ``gymnasium.make`` for the wall-clock variant.
"""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = [
    "ATARI",
    "ENVPOOL_ATARI",
    "ENVPOOL_ATARI_RAW",
    "ENV_IDS",
    "FixedCostEnv",
    "HeavyTailEnv",
    "ImageEnv",
    "NoOpEnv",
    "NoiseImageEnv",
    "PixelObservation",
    "RAW_PIXELS",
    "full_id",
    "make_atari",
    "make_atari_raw",
    "make_pixels",
    "spin",
]

_MODULE = "benchmarks.envs"

#: Short name -> id usable with ``gymnasium.make`` in any process.
ENV_IDS: dict[str, str] = {
    "CartPole-v1": "CartPole-v1",
    "FixedCost-v0": f"{_MODULE}:FixedCost-v0",
    "HeavyTail-v0": f"{_MODULE}:HeavyTail-v0",
    "Image-v0": f"{_MODULE}:Image-v0",
    "NoOp-v0": f"{_MODULE}:NoOp-v0",
    "NoiseImage-v0": f"{_MODULE}:NoiseImage-v0",
    "Pong-v5": f"{_MODULE}:Pong-v5",
    "Breakout-v5": f"{_MODULE}:Breakout-v5",
    "PongRaw-v5": f"{_MODULE}:PongRaw-v5",
    "HalfCheetahPixels84-v5": f"{_MODULE}:HalfCheetahPixels84-v5",
    "HalfCheetahPixels256-v5": f"{_MODULE}:HalfCheetahPixels256-v5",
}

#: Raw-pixel envs (issue 35: big observations): ale-py's Pong with gymnasium's defaults (raw
#: 210x160x3 frames, frameskip 4, sticky actions) and HalfCheetah-v5 observed through its
#: ``rgb_array`` renders (:class:`PixelObservation`), by short name -> (maker, keyword args).
RAW_PIXELS: dict[str, tuple[str, dict[str, Any]]] = {
    "PongRaw-v5": ("make_atari_raw", {"game": "ALE/Pong-v5"}),
    "HalfCheetahPixels84-v5": ("make_pixels", {"env_id": "HalfCheetah-v5", "size": 84}),
    "HalfCheetahPixels256-v5": ("make_pixels", {"env_id": "HalfCheetah-v5", "size": 256}),
}

#: EnvPool options that make its Atari env match :func:`make_atari_raw` (gymnasium's defaults
#: of ``ALE/Pong-v5``): raw colour frames, EnvPool's channel-first layout ``(3, 210, 160)``.
ENVPOOL_ATARI_RAW: dict[str, Any] = {
    "img_height": 210,
    "img_width": 160,
    "gray_scale": False,
    "stack_num": 1,
    "frame_skip": 4,
    "repeat_action_probability": 0.25,
    "noop_max": 1,
    "episodic_life": False,
    "reward_clip": False,
    "use_fire_reset": False,
    "max_episode_steps": 27_000,
}

#: The Atari games, by short name: ale-py's id (under the standard preprocessing of
#: :func:`make_atari`; EnvPool knows them by the short name).
ATARI: dict[str, str] = {"Pong-v5": "ALE/Pong-v5", "Breakout-v5": "ALE/Breakout-v5"}

#: EnvPool options that make its Atari env match :func:`make_atari`'s stack.
ENVPOOL_ATARI: dict[str, Any] = {
    "use_fire_reset": False,
    "repeat_action_probability": 0.0,
    "noop_max": 30,
    "episodic_life": False,
    "reward_clip": False,
    "stack_num": 4,
    "frame_skip": 4,
    "img_height": 84,
    "img_width": 84,
    "gray_scale": True,
}


def full_id(name: str) -> str:
    """Return the importable gymnasium id for a short env name (or the name itself).

    Args:
        name: A key of :data:`ENV_IDS`, or any other gymnasium id.

    Returns:
        The id to pass to ``gymnasium.make``.
    """
    return ENV_IDS.get(name, name)


def spin(seconds: float, clock: str = "cpu") -> None:
    """Busy-wait for ``seconds``.

    Args:
        seconds: How long to spin.
        clock: ``"cpu"`` spins on this thread's CPU time (honest when cores are
            oversubscribed); ``"wall"`` spins on ``time.perf_counter``.
    """
    now = time.thread_time if clock == "cpu" else time.perf_counter
    end = now() + seconds
    while now() < end:
        pass


class _VectorObsEnv(gym.Env[np.ndarray, np.int64]):
    """Small Box(4,) float32 observations, Discrete(2) actions, no terminations."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self._obs = np.zeros(4, dtype=np.float32)
        self._t = 0

    def _next_obs(self) -> np.ndarray:
        self._t += 1
        obs = self._obs.copy()
        obs[self._t % 4] = 0.5
        return obs

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Reset the env; ``seed`` seeds ``np_random`` (gymnasium convention)."""
        super().reset(seed=seed)
        self._t = 0
        return self._obs.copy(), {}

    def _cost(self) -> None:
        """Spend this step's cost (none here)."""

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Spend the step's cost; reward 1, never terminates (TimeLimit truncates)."""
        self._cost()
        return self._next_obs(), 1.0, False, False, {}


class FixedCostEnv(_VectorObsEnv):
    """Each step busy-waits ``step_cost`` seconds (default 200 us)."""

    def __init__(self, step_cost: float = 200e-6, clock: str = "cpu") -> None:
        super().__init__()
        self.step_cost = step_cost
        self.clock = clock

    def _cost(self) -> None:
        spin(self.step_cost, self.clock)


class HeavyTailEnv(_VectorObsEnv):
    """Heavy-tailed step cost with the same mean as :class:`FixedCostEnv` (200 us).

    Most steps cost ``fast`` (50 us); with probability ``p_slow`` (one in ten) a step
    costs ``slow`` (1.55 ms): 0.9 * 50 + 0.1 * 1550 = 200 us. Which steps are slow is
    drawn from the env's own seeded ``np_random``, so a seeded run is reproducible.
    """

    def __init__(
        self,
        fast: float = 50e-6,
        slow: float = 1.55e-3,
        p_slow: float = 0.1,
        clock: str = "cpu",
    ) -> None:
        super().__init__()
        self.fast = fast
        self.slow = slow
        self.p_slow = p_slow
        self.clock = clock

    def _cost(self) -> None:
        slow = self.np_random.random() < self.p_slow
        spin(self.slow if slow else self.fast, self.clock)


class NoOpEnv(_VectorObsEnv):
    """Does nothing: measures the pure per-step overhead of a sampler."""

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Return a constant observation (a fresh copy, as gymnasium asks) at once."""
        return self._obs.copy(), 0.0, False, False, {}


class ImageEnv(gym.Env[np.ndarray, np.int64]):
    """84x84x4 uint8 observations (an Atari frame stack), cheap steps, Discrete(4)."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 255, shape=(84, 84, 4), dtype=np.uint8)
        self.action_space = spaces.Discrete(4)
        self._frame = np.zeros((84, 84, 4), dtype=np.uint8)
        self._t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Reset the env; ``seed`` seeds ``np_random``."""
        super().reset(seed=seed)
        self._t = 0
        self._frame[:] = self.np_random.integers(0, 256, dtype=np.uint8)
        return self._frame.copy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Change one row of one channel and return a fresh copy of the frame."""
        self._t += 1
        self._frame[self._t % 84, :, self._t % 4] = self._t % 256
        return self._frame.copy(), float(action == self._t % 4), False, False, {}


class NoiseImageEnv(ImageEnv):
    """:class:`ImageEnv` whose frames are random noise (one row redrawn per step).

    The worst case for compression (the Ray backend compresses large observations): noise
    does not compress, where the flat frames of ``Image-v0`` (and Atari screens) do.
    """

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Fill the frame with noise; ``seed`` seeds ``np_random``."""
        gym.Env.reset(self, seed=seed)
        self._t = 0
        self._frame[:] = self.np_random.integers(0, 256, size=self._frame.shape, dtype=np.uint8)
        return self._frame.copy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Redraw one row with noise and return a fresh copy of the frame."""
        self._t += 1
        row = self._frame[self._t % 84]
        row[:] = self.np_random.integers(0, 256, size=row.shape, dtype=np.uint8)
        return self._frame.copy(), float(action == self._t % 4), False, False, {}


def make_atari(game: str = "ALE/Pong-v5", **kwargs: Any) -> gym.Env[Any, Any]:
    """An Atari game under the standard preprocessing, as EnvPool, SB3 and CleanRL users run it.

    ale-py's env at ``frameskip=1`` without sticky actions under
    ``AtariPreprocessing(noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True)`` and
    ``FrameStackObservation(4)``: ``(4, 84, 84)`` uint8 observations, EnvPool's layout with
    :data:`ENVPOOL_ATARI`.

    Args:
        game: ale-py's id.
        **kwargs: Ignored (gymnasium passes ``render_mode`` and the like).
    """
    import ale_py
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = gym.make(
        game,
        frameskip=1,
        repeat_action_probability=0.0,
        full_action_space=False,
        max_num_frames_per_episode=108_000,
    )
    env = AtariPreprocessing(
        env,
        noop_max=30,
        frame_skip=4,
        screen_size=84,
        terminal_on_life_loss=False,
        grayscale_obs=True,
        scale_obs=False,
    )
    return FrameStackObservation(env, 4)


def make_atari_raw(game: str = "ALE/Pong-v5", **kwargs: Any) -> gym.Env[Any, Any]:
    """An Atari game as ``gymnasium.make`` gives it: raw ``(210, 160, 3)`` uint8 frames, 100 KB
    each, ale-py's v5 defaults (frameskip 4, sticky actions 0.25), no preprocessing.

    Args:
        game: ale-py's id.
        **kwargs: Ignored (gymnasium passes ``render_mode`` and the like).
    """
    import ale_py

    gym.register_envs(ale_py)
    return gym.make(game)


class PixelObservation(gym.Wrapper[np.ndarray, Any, Any, Any]):
    """Observe an env through its ``rgb_array`` render: each observation is ``env.render()``,
    ``(size, size, 3)`` uint8 (what pixel-based control learns from)."""

    def __init__(self, env: gym.Env[Any, Any], size: int) -> None:
        super().__init__(env)
        self.observation_space = spaces.Box(0, 255, (size, size, 3), np.uint8)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Reset the env; the first render is the observation."""
        _, info = self.env.reset(seed=seed, options=options)
        return self._frame(), info

    def step(self, action: Any) -> tuple[np.ndarray, Any, bool, bool, dict[str, Any]]:
        """Step the env; the render after the step is the observation."""
        _, reward, terminated, truncated, info = self.env.step(action)
        return self._frame(), reward, terminated, truncated, info

    def _frame(self) -> np.ndarray:
        frame = self.env.render()
        assert isinstance(frame, np.ndarray)
        return frame


def make_pixels(env_id: str = "HalfCheetah-v5", size: int = 84, **kwargs: Any) -> gym.Env[Any, Any]:
    """A MuJoCo env observed through ``size x size`` renders (:class:`PixelObservation`).

    Rendering needs an OpenGL platform: ``MUJOCO_GL`` defaults to ``egl`` here (on a machine
    without a GPU, Mesa's software EGL: ``osmesa`` is the other headless choice where it is
    installed), and Mesa's software rasteriser to one thread (``LP_NUM_THREADS=1``), so that a
    loop's rendering stays on its own core as every other env's stepping does.

    Args:
        env_id: gymnasium's id of the MuJoCo env.
        size: width and height of the renders.
        **kwargs: Ignored (gymnasium passes ``render_mode`` and the like).
    """
    import os

    os.environ.setdefault("MUJOCO_GL", "egl")
    os.environ.setdefault("LP_NUM_THREADS", "1")
    env = gym.make(env_id, render_mode="rgb_array", width=size, height=size)
    return PixelObservation(env, size)


def _register() -> None:
    """Register the envs (idempotent: a re-import does not warn)."""
    entries = {
        "FixedCost-v0": (f"{_MODULE}:FixedCostEnv", 200),
        "HeavyTail-v0": (f"{_MODULE}:HeavyTailEnv", 200),
        "Image-v0": (f"{_MODULE}:ImageEnv", 100),
        "NoOp-v0": (f"{_MODULE}:NoOpEnv", 200),
        "NoiseImage-v0": (f"{_MODULE}:NoiseImageEnv", 100),
    }
    for env_id, (entry_point, length) in entries.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry_point, max_episode_steps=length)
    for name, (maker, kwargs) in RAW_PIXELS.items():
        if name not in gym.registry:
            gym.register(id=name, entry_point=f"{_MODULE}:{maker}", kwargs=kwargs,
                         order_enforce=False, disable_env_checker=True)  # fmt: skip
    for name, game in ATARI.items():  # the game's own frame limit ends its episodes
        if name not in gym.registry:
            gym.register(id=name, entry_point=f"{_MODULE}:make_atari", kwargs={"game": game},
                         order_enforce=False, disable_env_checker=True)  # fmt: skip


_register()
