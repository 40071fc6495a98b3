"""The Stable-Baselines3 face's public import path; ``import asyncsample`` does not import SB3."""

from __future__ import annotations

from asyncsample.vector.sb3 import AsyncSampleVecEnv

__all__ = ["AsyncSampleVecEnv"]
