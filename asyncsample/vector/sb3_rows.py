"""A multi-agent env in the SB3 face: one row per possible agent of every env.

The SB3 part of :mod:`asyncsample.vector.agent_rows`: :class:`SB3Rows` shows the results of an
env-level :class:`~asyncsample.vector.sb3.AsyncSampleVecEnv` (one sub-env per multi-agent env,
autoreset in the same step, as SB3 does it) as rows, with SB3's conventions: a list of one info
dict per row, ``done`` per row, the last observation of a done row in
``info["terminal_observation"]``. A module of its own so that the gymnasium face's layer needs
no SB3.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Generic, Protocol, TypeVar

import gymnasium as gym
import numpy as np

from asyncsample._tree import Tree, tree_map
from asyncsample.multiagent.slots import REWARDS, TERMINATED, TRUNCATED
from asyncsample.multiagent.tracker import ACTION_MASK
from asyncsample.vector.agent_rows import MASK, RowLayout

__all__ = ["SB3Rows"]

_AGENT_INFOS = "agent_infos"
_VecStep = tuple[Any, np.ndarray, np.ndarray, list[dict[str, Any]]]


class EnvLevelVecEnv(Protocol):
    """What :class:`SB3Rows` reads of the env-level face besides its calls: its reset infos."""

    reset_infos: list[dict[str, Any]]


_Face = TypeVar("_Face", bound=EnvLevelVecEnv)


class SB3Rows(Generic[_Face]):
    """The SB3 face of a multi-agent env's rows over an env-level SB3 face, ``envs``.

    Row ``e * n_slots + s`` is agent ``possible_agents[s]`` of env ``e``. A row whose agent is
    done reports ``done`` with its last observation in ``info["terminal_observation"]`` (and
    ``TimeLimit.truncated`` for a truncation) and shows what follows: the reset's observation
    when its env ended, else zeros (the agent is absent). ``info["mask"]`` marks the rows of
    live agents, whose actions the next step takes; the others' actions are ignored.

    Args:
        envs: the env-level face (one sub-env per multi-agent env).
        layout: the rows.
    """

    def __init__(self, envs: _Face, layout: RowLayout) -> None:
        self.envs = envs
        self.layout = layout
        space = layout.single_observation_space
        self._dict_keys = list(space.spaces) if isinstance(space, gym.spaces.Dict) else None
        self._live = np.zeros((layout.n_envs, layout.n_slots), dtype=np.bool_)
        self._zeros = np.zeros(layout.n_slots, dtype=np.float64)
        self._flags = np.zeros(layout.n_slots, dtype=np.bool_)

    def _format(self, rows: Tree) -> Tree:
        keys = self._dict_keys
        return rows if keys is None else OrderedDict((k, rows[k]) for k in keys)

    def env_seeds_and_options(
        self, seeds: list[int | None], options: list[dict[str, Any]]
    ) -> tuple[list[int | None], list[dict[str, Any]]]:
        """The env-level seeds and options of rows' ones: an env takes its first row's."""
        k = self.layout.n_slots
        return list(seeds[::k]), list(options[::k])

    def reset_rows(self, obs: Any) -> tuple[Tree, list[dict[str, Any]]]:
        """The rows of an env-level reset's observation, and each row's reset info."""
        layout = self.layout
        live = np.asarray(obs["live"], dtype=np.bool_)
        self._live = live
        infos = [i for e in range(layout.n_envs) for i in self._reset_infos(e, live[e])]
        return self._format(layout.rows(obs["agents"])), infos

    def step_rows(self, result: _VecStep, reset_infos: list[dict[str, Any]]) -> _VecStep:
        """The rows of an env-level step's result (:class:`SB3Rows`); the reset infos of the
        rows of envs that ended go into ``reset_infos`` (the face's, one per row)."""
        obs, _, ended, env_infos = result
        layout = self.layout
        k = layout.n_slots
        live = np.asarray(obs["live"], dtype=np.bool_)
        zeros, flags = self._zeros, self._flags
        rewards = np.stack([info.get(REWARDS, zeros) for info in env_infos])
        terminated = np.stack([info.get(TERMINATED, flags) for info in env_infos])
        truncated = np.stack([info.get(TRUNCATED, flags) for info in env_infos])
        restarted = [e for e, info in enumerate(env_infos) if "restarted" in info]
        for e in restarted:  # a host restart ended the live agents' episodes
            truncated[e] |= self._live[e]
        done_grid = terminated | truncated
        done = layout.flat(done_grid)
        rows = layout.rows(obs["agents"])
        mask = layout.flat(live)
        infos = self._row_infos(env_infos, mask, obs, truncated & ~terminated)
        if done.any():
            alone = done & ~layout.per_row(np.asarray(ended, dtype=np.bool_))
            for r in np.flatnonzero(alone).tolist():
                infos[r]["terminal_observation"] = tree_map(lambda leaf, r=r: leaf[r].copy(), rows)
            if alone.any():
                tree_map(lambda leaf: leaf.__setitem__(alone, 0), rows)
            for r in np.flatnonzero(done & ~alone).tolist():
                e, s = divmod(r, k)
                final = env_infos[e]["terminal_observation"]["agents"][s]
                infos[r]["terminal_observation"] = final
            for e in np.flatnonzero(ended).tolist():
                reset_infos[e * k : (e + 1) * k] = self._reset_infos(e, live[e])
        for e in restarted:
            for r in range(e * k, (e + 1) * k):
                infos[r]["restarted"] = env_infos[e]["restarted"]
        self._live = live
        return self._format(rows), layout.flat(rewards).astype(np.float32), done, infos

    def _row_infos(
        self,
        env_infos: list[dict[str, Any]],
        mask: np.ndarray,
        obs: Any,
        truncated: np.ndarray | None = None,
    ) -> list[dict[str, Any]]:
        """One info dict per row: ``mask``, ``TimeLimit.truncated`` (a step's), the action mask
        of a Discrete agent's live row, then the agent's own info."""
        layout = self.layout
        k = layout.n_slots
        masks = mask.tolist()
        if truncated is None:
            infos: list[dict[str, Any]] = [{MASK: m} for m in masks]
        else:
            cut = layout.flat(truncated).tolist()
            infos = [{MASK: m, "TimeLimit.truncated": t} for m, t in zip(masks, cut, strict=True)]
        if layout.has_action_mask and ACTION_MASK in obs:
            width = int(layout.single_action_space.n)  # type: ignore[attr-defined]
            action_masks = layout.flat(np.asarray(obs[ACTION_MASK]))[:, :width]
            for r in np.flatnonzero(mask).tolist():
                infos[r][ACTION_MASK] = action_masks[r].copy()
        slots = layout.spec.slots
        for e, info in enumerate(env_infos):
            for agent, own in (info.get(_AGENT_INFOS) or {}).items():
                infos[e * k + slots[agent]].update(own)
        return infos

    def _reset_infos(self, e: int, live: np.ndarray) -> list[dict[str, Any]]:
        """The reset info of each row of env ``e``: ``mask`` and the agent's own."""
        infos: list[dict[str, Any]] = [{MASK: m} for m in live.tolist()]
        own = self.envs.reset_infos[e].get(_AGENT_INFOS) or {}
        for agent, info in own.items():
            infos[self.layout.spec.slots[agent]].update(info)
        return infos

    def per_row(self, results: list[Any], rows: list[int]) -> list[Any]:
        """Results of the envs of ``rows`` (one per env, in order of first appearance) as one
        per row."""
        envs = list(dict.fromkeys(self.layout.env_of(rows)))
        by_env = dict(zip(envs, results, strict=True))
        return [by_env[e] for e in self.layout.env_of(rows)]
