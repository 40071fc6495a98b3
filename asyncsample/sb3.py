"""The Stable-Baselines3 face, at its public import path (see :mod:`asyncsample.vector.sb3`).

``from asyncsample.sb3 import AsyncSampleVecEnv``; Stable-Baselines3 is imported only here (and
by the module this re-exports), so ``import asyncsample`` does not need it.
"""

from __future__ import annotations

from asyncsample.vector.sb3 import AsyncSampleVecEnv

__all__ = ["AsyncSampleVecEnv"]
