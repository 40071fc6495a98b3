"""The vector-env faces: asyncsample's env hosts behind gymnasium's and SB3's vector APIs.

:class:`VectorEnv` is a ``gymnasium.vector.VectorEnv``; ``asyncsample.vector.sb3`` holds the
Stable-Baselines3 ``VecEnv`` (imported on its own: it needs SB3). docs/architecture.md maps the
modules.
"""

from __future__ import annotations

from asyncsample.vector.env import VectorEnv
from asyncsample.vector.errors import SubEnvAttributeError, SubEnvError
from asyncsample.vector.placement import Placement

__all__ = ["Placement", "SubEnvAttributeError", "SubEnvError", "VectorEnv"]
