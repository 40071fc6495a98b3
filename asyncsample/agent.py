"""The Agent protocol (garage's vectorised Policy) and the built-in :class:`RandomAgent`."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import batch_space

from asyncsample._tree import Tree

__all__ = [
    "Agent",
    "AgentOutput",
    "AgentParams",
    "AgentUpdate",
    "RandomAgent",
    "distinct",
    "get_actions",
    "trusted_actions",
]

_T = TypeVar("_T")

AgentOutput = tuple[Tree, dict[str, np.ndarray]]
"""What ``get_actions`` returns: one action per env, and a dict of per-env agent infos."""

AgentParams = dict[str, Any] | tuple[Any, ...] | np.ndarray
"""Parameters for ``set_param_values`` (what ``get_param_values`` returned)."""


@runtime_checkable
class Agent(Protocol):
    """What a worker asks for actions.

    ``get_actions`` receives the stacked observations of one worker's envs (leading axis
    ``envs_per_worker``) and returns one action per env and a dict of per-env agent infos. It may
    be ``async def``; the worker awaits it. Optional methods, used when present:
    ``reset(do_resets)``, ``get_param_values()`` and ``set_param_values(params)``.

    An agent that fails some rows and not the others (one request per env, and one of them
    timed out) raises :class:`~asyncsample.AgentRowsError` with the output of every row and the
    failed rows' causes: each failed row is that env's fault alone (its episode is dropped and
    the env rebuilt, within ``max_restarts``), the other rows go on. With envs stepped in
    lockstep the worker's host is restarted instead, as for any env fault there.

    Where envs are stepped one at a time, the rows of the envs ready in one pass of the event
    loop are merged into one call; an agent with a class attribute ``merge_rows = False`` is
    called once per env instead, so that no env waits for another's reply
    (:class:`~asyncsample.llm.ChatAgent` is one).
    """

    def get_actions(self, observations: Tree) -> AgentOutput | Awaitable[AgentOutput]:
        """Actions and agent infos for a batch of observations."""


async def get_actions(agent: Agent, observations: Tree) -> AgentOutput:
    """Call ``agent.get_actions``, awaiting it when it is a coroutine."""
    result = agent.get_actions(observations)
    if type(result) is not tuple and inspect.isawaitable(result):
        result = await result
    return result


AgentUpdate = AgentParams | Agent | None
"""One worker's agent update: parameters, a new agent, or ``None`` (keep the agent)."""


class _Blocks:
    """``draw(n)`` handed out from blocks of rows drawn ahead; for uniform draws the rows are
    exactly those of one ``draw(n)`` per call, whatever the block size (``row_bytes`` sets it)."""

    def __init__(
        self, draw: Any, row_bytes: int, dtype: np.dtype[Any], shape: tuple[int, ...]
    ) -> None:
        self.draw = draw
        self.block = max(1, min(DRAW_BLOCK_ROWS, DRAW_BLOCK_BYTES // max(row_bytes, 1)))
        self.rows: np.ndarray | None = None
        self.pos = 0
        self.dtype, self.shape = dtype, shape  # of a row
        self._taken: tuple[np.ndarray | None, int] = (None, 0)

    def __call__(self, n: int) -> np.ndarray:
        rows, pos = self.rows, self.pos
        if rows is not None and pos + n <= len(rows):
            self.pos = pos + n
            return rows[pos : pos + n]
        head = rows[pos:] if rows is not None else rows
        need = n - (0 if head is None else len(head))
        self.rows = self.draw(max(self.block, need))
        self.pos = need
        tail = self.rows[:need]
        return tail if head is None or not len(head) else np.concatenate([head, tail])

    def one(self) -> Any:
        """The next row alone: ``self(1)[0]`` without the slice (a lane takes one per step)."""
        rows, pos = self.rows, self.pos
        if rows is not None and pos < len(rows):
            self.pos = pos + 1
            return rows[pos]
        return self(1)[0]

    def take(self, n: int) -> np.ndarray:
        """``n`` rows at once for a run of up to ``n`` steps (a host's run of one env): one draw
        per run, not per step; :meth:`give_back` returns those the run did not use."""
        block = self(n)
        self._taken = (self.rows, self.pos)
        return block

    def give_back(self, block: np.ndarray, used: int) -> None:
        """Hand back the rows of ``block`` (the last :meth:`take`) past its first ``used``: the
        next draws give them, so the rows are those drawn one at a time. Unless rows were drawn
        since (another env's, while this one's step awaited): then they are skipped, as fresh
        uniform rows would be."""
        unused, (rows, pos) = len(block) - used, self._taken
        if unused <= 0 or rows is None or rows is not self.rows or pos != self.pos:
            return
        if unused <= self.pos:  # (they are the last rows handed out)
            self.pos -= unused
        else:  # some came from a block drawn before the current one
            self.rows, self.pos = np.concatenate([block[used:], self.rows[self.pos :]]), 0
        self._taken = (None, 0)


#: The most rows of draws a :class:`RandomAgent` takes from its generator at a time.
DRAW_BLOCK_ROWS = 1024
#: The most bytes of draws it keeps ahead.
DRAW_BLOCK_BYTES = 64 << 10


class RandomAgent:
    """Samples actions uniformly from ``action_space`` (one env's), one per env, from its own
    generator seeded with ``seed`` (``None``: from the OS)."""

    def __init__(self, action_space: gym.Space[Any], seed: int | None = None) -> None:
        self.action_space = action_space
        self._rng = np.random.default_rng(seed)
        self._batched: dict[int, gym.Space[Any]] = {}
        self._sample = self._direct_sampler(action_space)

    def _direct_sampler(self, space: gym.Space[Any]) -> _Blocks | None:
        """Block draws for the common spaces (gymnasium's ``sample()`` is several times slower)."""
        rng = self._rng
        if isinstance(space, gym.spaces.Discrete):
            start, k = int(space.start), int(space.n)
            # floor(U * k) for U uniform in [0, 1): 2x faster than rng.integers for small n.

            def floor(n: int) -> np.ndarray:
                return (rng.random(n) * k).astype(np.int64) + start

            return _Blocks(floor, 1, np.dtype(np.int64), ())
        if (
            isinstance(space, gym.spaces.Box)
            and space.is_bounded("both")
            and np.issubdtype(space.dtype, np.floating)
        ):
            low, high, dtype, shape = space.low, space.high, space.dtype, space.shape
            return _Blocks(
                lambda n: rng.uniform(low, high, size=(n, *shape)).astype(dtype, copy=False),
                int(np.prod(shape)) * dtype.itemsize,
                dtype,
                shape,
            )
        return None

    def _space(self, n: int) -> gym.Space[Any]:
        space = self._batched.get(n)
        if space is None:  # one numpy call for all rows, seeded from the agent's generator
            space = batch_space(self.action_space, n)
            space.seed(int(self._rng.integers(2**32)))
            self._batched[n] = space
        return space

    def get_actions(self, observations: Tree) -> AgentOutput:
        """Uniform random actions for every row of ``observations``; no agent infos."""
        leaf = observations
        while isinstance(leaf, (dict, tuple)):
            leaf = next(iter(leaf.values())) if isinstance(leaf, dict) else leaf[0]
        if self._sample is not None:
            return self._sample(len(leaf)), {}
        return self._space(len(leaf)).sample(), {}

    def row_sampler(self) -> Callable[[], Any] | None:
        """One env's action at a time, the rows :meth:`get_actions` would give in a call of
        many; ``None`` for spaces whose rows differ by how many are drawn at once (those not
        drawn in blocks: spaces other than Discrete and a bounded float Box)."""
        return None if self._sample is None else self._sample.one

    def run_sampler(self) -> _Blocks | None:
        """Rows a run of steps at a time (``take(n)``, ``give_back``), with the rows
        :meth:`row_sampler` would give one at a time; ``None`` where that is ``None``."""
        return self._sample

    def reset(self, do_resets: Any = None) -> None:
        """Nothing to reset: the agent is stateless."""

    def get_state(self) -> dict[str, Any]:
        """Its random generators' states (a sampler checkpoint keeps them)."""
        blocks = self._sample
        return {
            "rng": self._rng.bit_generator.state,
            "spaces": {n: s.np_random.bit_generator.state for n, s in self._batched.items()},
            "drawn": None if blocks is None or blocks.rows is None else blocks.rows[blocks.pos :],
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`get_state` returned."""
        for n, space_state in state["spaces"].items():
            self._space(n).np_random.bit_generator.state = space_state
        self._rng.bit_generator.state = state["rng"]
        if self._sample is not None:  # the draws it had made ahead and not handed out yet
            drawn = state["drawn"]
            self._sample.rows = None if drawn is None else np.array(drawn)
            self._sample.pos = 0


def distinct(agents: Iterable[_T]) -> list[_T]:
    """Each object of ``agents`` once, in the order first seen (one agent may serve several
    workers)."""
    return list({id(a): a for a in agents}.values())


def row_draw(agent: object, action_space: gym.Space[Any]) -> Callable[[], Any] | None:
    """One env's action from ``agent``, drawn on the spot, where that is what a batched call
    would give it: a :class:`RandomAgent` (not a subclass) of exactly ``action_space`` whose
    draws come in blocks (Discrete, bounded float Box). Its rows are the same drawn one at a
    time or many at once, so a lane may take its row without waiting for a merged call."""
    draws = run_draws(agent, action_space)
    return None if draws is None else draws.one


def run_draws(agent: object, action_space: gym.Space[Any]) -> _Blocks | None:
    """:func:`row_draw`'s rows a run of steps at a time (``take(n)``, then ``give_back``)."""
    if not trusted_actions(agent, action_space):
        return None
    return cast(RandomAgent, agent).run_sampler()


def trusted_actions(agent: object, action_space: gym.Space[Any]) -> bool:
    """Whether ``agent``'s actions may skip the range check: a :class:`RandomAgent` (not a
    subclass) of exactly ``action_space``."""
    return type(agent) is RandomAgent and agent.action_space == action_space
