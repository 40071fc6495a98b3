"""The six arrays every record of env steps lays out, in one place.

A worker's step buffers (:class:`~asyncsample.env_group.StepBuffers`, leading axis ``n_envs``)
and a chunk's records (:class:`~asyncsample.backends.ChunkBuffers`, leading axes
``(rows, n_envs)``) extend it; the engine replays any of them (:meth:`Episodes.replay
<asyncsample._engine.Episodes.replay>`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncsample._tree import Tree

__all__ = ["StepFields"]


@dataclass
class StepFields:
    """The arrays of env steps, each with the leading axes its subclass names.

    Attributes:
        obs: the observation each env's action was chosen for (after an autoreset, the new
            episode's first one).
        final_obs: where an env's episode ended, its true last observation.
        actions: the actions the envs were stepped with.
        rewards, terminated, truncated: what the steps returned (with the time limit).
    """

    obs: Tree
    final_obs: Tree
    actions: Tree
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
