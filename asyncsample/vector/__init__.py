"""The vector-env faces: asyncsample's env hosts behind gymnasium's and SB3's vector APIs.

* :mod:`asyncsample.vector.env`: :class:`VectorEnv`, a ``gymnasium.vector.VectorEnv``;
* :mod:`asyncsample.vector.sb3`: ``AsyncSampleVecEnv``, a Stable-Baselines3 ``VecEnv`` (imported
  on its own: it needs SB3);
* :mod:`asyncsample.vector.hosted`: what both faces stand on, sub-envs placed on the hosts of a
  backend and driven through the public ``EnvHost`` protocol (restarts, error translation);
* :mod:`asyncsample.vector.placement`: where a face steps its sub-envs (the caller's process,
  env hosts or both), decided from what it measures or forced (:class:`Placement`);
* :mod:`asyncsample.vector.errors`: :class:`SubEnvError` and the faces' other errors;
* :mod:`asyncsample.vector.portal`: the blocking portal that runs the faces' coroutines for
  synchronous callers.
"""

from __future__ import annotations

from asyncsample.vector.env import VectorEnv
from asyncsample.vector.errors import SubEnvAttributeError, SubEnvError
from asyncsample.vector.placement import Placement

__all__ = ["Placement", "SubEnvAttributeError", "SubEnvError", "VectorEnv"]
