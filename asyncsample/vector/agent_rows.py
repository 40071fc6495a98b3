"""A multi-agent env in the vector faces: one row per possible agent of every env.

PufferLib's emulation and SuperSuit's vector wrappers show a PettingZoo ``ParallelEnv`` to
single-agent training code as a vector env with a fixed row per possible agent: ``num_envs`` is
envs x possible agents (env-major, slot-minor), an absent agent's row holds zeros, and a mask
says which rows hold an agent. The faces do the same, as a thin layer over their own env-level
machinery: the hosts already step each multi-agent env as one
:class:`~asyncsample.multiagent.slots.SlotEnv` (every slot's observation, the live mask, each
agent's reward and flags as info columns), so an env-level face steps them as usual (every
backend and placement, its autoresets, restarts and error translation), and this layer only
reshapes its batches: actions ``(rows, ...)`` into one batch per slot, observations and columns
``(envs, slots, ...)`` into rows, with numpy over whole arrays.

:class:`RowLayout` is that reshaping and the check that all agents share one observation and
one action space; :class:`VectorRows` is the gymnasium face's part (autoreset modes, vector
infos with ``_key`` masks). The SB3 face's part is :mod:`asyncsample.vector.sb3_rows`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from asyncsample._tree import Tree, tree_map
from asyncsample.errors import ParallelEnvError
from asyncsample.multiagent.checks import ParallelEnvSpec
from asyncsample.multiagent.slots import REWARDS, TERMINATED, TRUNCATED, SlotSpace
from asyncsample.multiagent.tracker import ACTION_MASK

__all__ = ["MASK", "RowLayout", "VectorRows", "agent_spec"]

#: The info key of the rows holding an agent (PufferLib's name).
MASK = "mask"
#: The info key of the agents' own infos in a :class:`~asyncsample.multiagent.slots.SlotEnv`'s.
_AGENT_INFOS = "agent_infos"

_Step = tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]


def agent_spec(space: gym.Space[Any]) -> ParallelEnvSpec | None:
    """The multi-agent spec of an env whose observation space is ``space`` (``None``: the env
    is a single-agent one)."""
    return space.agent_spec if isinstance(space, SlotSpace) else None


class RowLayout:
    """The rows of ``n_envs`` envs of ``spec``'s agents: row ``e * n_slots + s`` is slot ``s``
    (``possible_agents[s]``) of env ``e``.

    Args:
        spec: the multi-agent env's agents and spaces.
        n_envs: the number of envs.
        name: the argument that gave the env, for the error.

    Raises:
        ParallelEnvError: the possible agents do not all share one observation space and one
            action space (a row's spaces are the agents' common ones).
    """

    def __init__(self, spec: ParallelEnvSpec, n_envs: int, name: str = "env") -> None:
        agents = spec.possible_agents
        first = agents[0]
        for kind, spaces in (
            ("observation", spec.observation_spaces),
            ("action", spec.action_spaces),
        ):
            other = next((a for a in agents if spaces[a] != spaces[first]), None)
            if other is not None:
                raise ParallelEnvError(
                    f"{name}: a multi-agent env in a vector env has a row per possible agent, so "
                    f"all its possible agents must share one {kind} space; got {first!r} with "
                    f"{spaces[first]} and {other!r} with {spaces[other]}. Pad the agents to "
                    "common spaces first (SuperSuit's pad_observations_v0 and "
                    "pad_action_space_v0), or give each kind of agent an env of its own"
                )
        self.spec = spec
        self.n_envs = n_envs
        self.n_slots = len(agents)
        self.n_rows = n_envs * self.n_slots
        self.single_observation_space: gym.Space[Any] = spec.observation_spaces[first]
        self.single_action_space: gym.Space[Any] = spec.action_spaces[first]
        self.has_action_mask = isinstance(self.single_action_space, gym.spaces.Discrete)

    def env_of(self, rows: Sequence[int]) -> list[int]:
        """The env of each row."""
        return [int(r) // self.n_slots for r in rows]

    def slot_actions(self, actions: Tree) -> tuple[Tree, ...]:
        """One batch of ``n_envs`` actions per slot, from one action per row.

        Raises:
            ValueError: a leaf of ``actions`` has not ``n_rows`` rows.
        """
        n, k = self.n_envs, self.n_slots

        def split(leaf: Any) -> np.ndarray:
            arr = np.asarray(leaf)
            if arr.ndim == 0 or arr.shape[0] != self.n_rows:
                raise ValueError(
                    f"actions: expected one action per row ({self.n_rows} rows: {n} envs x "
                    f"{k} possible agents), got shape {arr.shape}"
                )
            return arr.reshape(n, k, *arr.shape[1:])

        grid = tree_map(split, actions)
        return tuple(tree_map(lambda leaf, s=s: leaf[:, s], grid) for s in range(k))

    def rows(self, slots: Sequence[Tree]) -> Tree:
        """The rows of per-slot batches (each leaf ``(n_envs, ...)``): one ``(n_rows, ...)``."""

        def stack(*leaves: np.ndarray) -> np.ndarray:
            grid = np.stack(leaves, axis=1)
            return grid.reshape(self.n_rows, *grid.shape[2:])

        return tree_map(stack, *slots)

    def flat(self, grid: np.ndarray) -> np.ndarray:
        """An ``(n_envs, n_slots, ...)`` array as ``(n_rows, ...)``."""
        return grid.reshape(self.n_rows, *grid.shape[2:])

    def per_row(self, values: np.ndarray) -> np.ndarray:
        """An ``(n_envs, ...)`` array repeated for each row of its env."""
        return np.repeat(values, self.n_slots, axis=0)

    def columns(self, info: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The agents' rewards, ``terminated`` and ``truncated`` ``(n_envs, n_slots)`` in a
        vector info of the env-level face (zeros for the envs without them), or ``None``."""
        rewards = info.get(REWARDS)
        if rewards is None:
            return None
        return rewards, info[TERMINATED], info[TRUNCATED]

    def agent_infos(self, info: dict[str, Any]) -> dict[str, Any]:
        """The agents' own infos of a vector info of the env-level face, as a vector info of
        rows: each key (and its ``_key`` mask) on the rows of the agents that had it."""
        per_agent = info.get(_AGENT_INFOS)
        out: dict[str, Any] = {}
        if not per_agent:
            return out
        for agent, sub in per_agent.items():
            slot = self.spec.slots.get(agent)
            if slot is not None and isinstance(sub, dict):  # not an "_agent" mask
                self._spread(out, sub, slot)
        return out

    def _spread(self, out: dict[str, Any], sub: dict[str, Any], slot: int) -> None:
        """Copy an agent's vector info (leaves ``(n_envs, ...)``) into the rows of its slot."""
        for key, value in sub.items():
            if isinstance(value, dict):
                self._spread(out.setdefault(key, {}), value, slot)
                continue
            arr = np.asarray(value)
            into = out.get(key)
            if into is None:
                if arr.dtype == object:
                    into = np.full((self.n_rows, *arr.shape[1:]), None, dtype=object)
                else:
                    into = np.zeros((self.n_rows, *arr.shape[1:]), dtype=arr.dtype)
                out[key] = into
            elif into.dtype != arr.dtype and into.dtype != object:
                into = out[key] = into.astype(np.result_type(into.dtype, arr.dtype))
            into[slot :: self.n_slots] = arr


class EnvLevelFace(Protocol):
    """What :class:`VectorRows` asks of the env-level face besides its calls: its mode."""

    autoreset_mode: AutoresetMode


_Face = TypeVar("_Face", bound=EnvLevelFace)


class VectorRows(Generic[_Face]):
    """The gymnasium face of a multi-agent env's rows over an env-level face, ``envs``.

    The rows' results follow the face's autoreset mode (docs/vector.md, "Multi-agent envs"):

    * ``"NextStep"`` and ``"Disabled"``: a row's observation is its agent's (its last one on
      the step the agent is done); ``mask`` marks the rows of agents live after the step or
      done on it. An env whose episode ended is reset on its next step (``"NextStep"``): every
      row then shows the reset, reward 0 and no flags.
    * ``"SameStep"``: a row whose agent is done shows what follows: the reset's observation
      when its env ended, else zeros; its last observation is in ``info["final_obs"]``;
      ``mask`` marks the rows of live agents.

    Args:
        envs: the env-level face (one sub-env per multi-agent env).
        layout: the rows.
    """

    def __init__(self, envs: _Face, layout: RowLayout) -> None:
        self.envs = envs
        self.layout = layout
        self.same_step = envs.autoreset_mode == AutoresetMode.SAME_STEP
        self._live = np.zeros((layout.n_envs, layout.n_slots), dtype=np.bool_)

    # -- arguments ----------------------------------------------------------------------------

    def reset_args(
        self, seed: int | Sequence[int | None] | None, options: dict[str, Any] | None
    ) -> tuple[Any, dict[str, Any] | None]:
        """The env-level seed and options of a reset of rows: a list of seeds has one per row
        (an env takes its first row's); ``reset_mask`` selects whole envs (all their rows)."""
        layout = self.layout
        if isinstance(seed, (list, tuple)):
            if len(seed) != layout.n_rows:
                raise ValueError(
                    f"seed: a list of seeds must have num_envs={layout.n_rows} entries (one per "
                    f"row; an env takes its first row's), got {len(seed)}"
                )
            seed = list(seed[:: layout.n_slots])
        if options is not None and isinstance(options, dict) and "reset_mask" in options:
            mask = options["reset_mask"]
            if isinstance(mask, np.ndarray) and mask.shape == (layout.n_rows,):
                grid = mask.reshape(layout.n_envs, layout.n_slots)
                envs = grid.any(axis=1)
                partial = np.flatnonzero(envs & ~grid.all(axis=1))
                if partial.size:
                    e = int(partial[0])
                    rows = list(range(e * layout.n_slots, (e + 1) * layout.n_slots))
                    raise ValueError(
                        f"options['reset_mask']: the rows of one env reset together; env {e} "
                        f"(rows {rows}) has only some of them selected: {grid[e].tolist()}"
                    )
                options = {**options, "reset_mask": envs}
            elif isinstance(mask, np.ndarray) and mask.ndim == 1:
                raise ValueError(
                    f"`options['reset_mask']` must have shape `({layout.n_rows},)`, got "
                    f"{mask.shape}"
                )
        return seed, options

    # -- results ------------------------------------------------------------------------------

    def reset_rows(self, result: tuple[Any, dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
        """The rows of an env-level reset's result."""
        obs, info = result
        live = np.asarray(obs["live"], dtype=np.bool_)
        self._live = live
        infos = self.layout.agent_infos(info)
        self._add_masks(infos, obs, self.layout.flat(live))
        return self.layout.rows(obs["agents"]), infos

    def step_rows(self, result: _Step) -> _Step:
        """The rows of an env-level step's result (module docstring, :class:`VectorRows`)."""
        obs, _, _, _, info = result
        layout = self.layout
        n, k = layout.n_envs, layout.n_slots
        live = np.asarray(obs["live"], dtype=np.bool_)
        rewards = np.zeros((n, k), dtype=np.float64)
        terminated = np.zeros((n, k), dtype=np.bool_)
        truncated = np.zeros((n, k), dtype=np.bool_)
        _take(layout.columns(info), info, REWARDS, rewards, terminated, truncated)
        final_info = info.get("final_info")
        if final_info is not None:  # SameStep: the ended envs' last step
            _take(layout.columns(final_info), final_info, REWARDS, rewards, terminated, truncated)
        restarted = info.get("_restarted")
        if restarted is not None:  # a host restart ended the live agents' episodes
            truncated[restarted] |= self._live[restarted]
        done = layout.flat(terminated | truncated)
        rows = layout.rows(obs["agents"])
        infos = layout.agent_infos(info)
        if self.same_step:
            mask = layout.flat(live)
            if done.any():
                ended = info.get("_final_obs")
                ended = np.zeros(n, dtype=np.bool_) if ended is None else ended
                self._finals(infos, rows, info, done, layout.per_row(ended), final_info)
        else:
            mask = layout.flat(live) | done
        if restarted is not None:
            infos["restarted"] = layout.per_row(info["restarted"])
            infos["_restarted"] = layout.per_row(restarted)
        self._add_masks(infos, obs, mask, layout.flat(live))
        self._live = live
        return rows, layout.flat(rewards), layout.flat(terminated), layout.flat(truncated), infos

    def _finals(
        self,
        infos: dict[str, Any],
        rows: Tree,
        info: dict[str, Any],
        done: np.ndarray,
        ended: np.ndarray,
        final_info: dict[str, Any] | None,
    ) -> None:
        """SameStep: the done rows' last observations into ``final_obs``; the rows whose agent
        is done while its env goes on show zeros."""
        layout = self.layout
        k = layout.n_slots
        final = np.full(layout.n_rows, None, dtype=object)
        alone = done & ~ended  # done while the env goes on: the row holds the last observation
        for r in np.flatnonzero(alone).tolist():
            final[r] = tree_map(lambda leaf, r=r: leaf[r].copy(), rows)
        for r in np.flatnonzero(done & ended).tolist():
            final[r] = info["final_obs"][r // k]["agents"][r % k]
        if alone.any():
            tree_map(lambda leaf: leaf.__setitem__(alone, 0), rows)
        infos["final_obs"] = final
        infos["_final_obs"] = done
        infos["final_info"] = {} if final_info is None else layout.agent_infos(final_info)
        infos["_final_info"] = done.copy()

    def _add_masks(
        self,
        infos: dict[str, Any],
        obs: Any,
        mask: np.ndarray,
        acting: np.ndarray | None = None,
    ) -> None:
        """``mask`` (every row has it) and, for Discrete agents, the action masks of the rows
        whose agent acts next (``acting``, default ``mask``)."""
        infos[MASK] = mask
        infos["_" + MASK] = np.ones(self.layout.n_rows, dtype=np.bool_)
        if self.layout.has_action_mask and ACTION_MASK in obs:
            acting = mask if acting is None else acting
            masks = self.layout.flat(np.asarray(obs[ACTION_MASK]))
            width = int(self.layout.single_action_space.n)  # type: ignore[attr-defined]
            masks = masks[:, :width].copy()
            masks[~acting] = 0
            infos[ACTION_MASK] = masks
            infos["_" + ACTION_MASK] = acting.copy()

    # -- calls --------------------------------------------------------------------------------

    def per_row_results(self, results: Sequence[Any]) -> tuple[Any, ...]:
        """One result per env as one per row (each row gets its env's)."""
        k = self.layout.n_slots
        return tuple(r for r in results for _ in range(k))

    def per_env_values(self, values: Any) -> Any:
        """``set_attr``'s values: one for all, or one per row (the rows of an env must agree)."""
        if not isinstance(values, (list, tuple)):
            return values
        layout = self.layout
        if len(values) != layout.n_rows:
            raise ValueError(
                f"values: a list must have num_envs={layout.n_rows} entries (one per row), got "
                f"{len(values)}"
            )
        k = layout.n_slots
        out = []
        for e in range(layout.n_envs):
            first = values[e * k]
            for v in values[e * k + 1 : (e + 1) * k]:
                if v is not first and not _equal(v, first):
                    raise ValueError(
                        f"values: the rows of env {e} (rows {e * k}..{(e + 1) * k - 1}) must "
                        f"hold one value (an attribute is the env's), got {first!r} and {v!r}"
                    )
            out.append(first)
        return out


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def _take(
    cols: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
    info: dict[str, Any],
    key: str,
    rewards: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
) -> None:
    """Copy the env-level columns ``cols`` into the ``(n_envs, n_slots)`` arrays, on the envs
    whose info had them (``info["_" + key]``)."""
    if cols is None:
        return
    which = info["_" + key]
    rewards[which] = cols[0][which]
    terminated[which] = cols[1][which]
    truncated[which] = cols[2][which]
