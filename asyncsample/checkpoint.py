"""Checkpoint and resume: :class:`SamplerState` and its file, and the env protocols that bring
episodes in flight back (see [Checkpoint and resume](checkpoint.md)); reading a sampler into a
state and continuing from one is :mod:`asyncsample._resume`'s.

A state is read at one instant: between two calls, or between two rounds of a stream (its
producer paused, the batches it buffered kept in the state). Each env's episode in flight comes
back one of three ways, chosen per env and recorded: ``"snapshot"`` (the env has
``get_state``/``set_state``, :class:`SnapshotEnv`), ``"replay"`` (the env is wrapped by
:class:`Replayable`: rebuilt, reset from the random state its episode began with, and stepped
through the episode's actions in its host), else ``"drop"`` (reset at resume, counted and warned
about).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import struct
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, SupportsFloat, runtime_checkable

import cloudpickle
import gymnasium as gym
import numpy as np

from asyncsample._tree import Tree
from asyncsample.async_env import AsyncEnv, AsyncWrapper, is_async_env
from asyncsample.env_update import EnvSource, EnvUpdate, checked_env, make_env
from asyncsample.errors import CheckpointError
from asyncsample.multiagent.slots import as_slot_env

if TYPE_CHECKING:
    from asyncsample.batch import EpisodeBatch
    from asyncsample.stats import SampleStats

__all__ = [
    "FORMAT_VERSION",
    "HOW",
    "Carried",
    "EnvState",
    "ReplayRecord",
    "Replayable",
    "ResumeReport",
    "SamplerState",
    "SnapshotEnv",
    "StreamState",
    "WorkerState",
]

FORMAT_VERSION = 1
"""The version of :class:`SamplerState` and of its file; a file of another version is refused."""

_MAGIC = b"asyncsample-state\n"
_HEADER = struct.Struct(">IQ32s")  # format version, payload length, SHA-256 of the payload

#: What comes back of an env's episode at resume (:attr:`EnvState.how`).
HOW = ("fresh", "idle", "snapshot", "replay", "drop")


# -- the env's side: the two protocols ---------------------------------------------------------


@runtime_checkable
class SnapshotEnv(Protocol):
    """An env whose whole state (its wrappers', its random generator's) it can hand out and take
    back: an episode in flight is restored from :meth:`get_state` at resume. Either method may be
    a coroutine (async envs). The state must be picklable (cloudpickle); the observation the
    next step acts on is kept by the sampler, so ``set_state`` need not return it."""

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> Any: ...


@dataclass
class ReplayRecord:
    """What a :class:`Replayable` env recorded of its episode in flight.

    Attributes:
        seed, options: what its ``reset`` got.
        rng: the state of its ``np_random`` just before that reset (``None``: not seeded yet).
        actions: the actions it took since, in order.
    """

    seed: int | None
    options: dict[str, Any] | None
    rng: dict[str, Any] | None
    actions: list[Any] = field(default_factory=list)

    def copy(self) -> ReplayRecord:
        """A copy the env's next steps leave alone (its actions are copies already)."""
        return ReplayRecord(self.seed, self.options, self.rng, list(self.actions))


def _rng_state(env: Any) -> dict[str, Any] | None:
    """The bit generator state of ``env``'s ``np_random`` (``None``: not seeded yet)."""
    base = getattr(env, "unwrapped", env)
    rng = getattr(base, "_np_random", None)
    return None if rng is None else copy.deepcopy(rng.bit_generator.state)


class _ReplayWrapper(gym.Wrapper[Any, Any, Any, Any]):
    """Records what replaying the episode in flight needs (one list append per step)."""

    def __init__(self, env: gym.Env[Any, Any]) -> None:
        super().__init__(env)
        self._record = ReplayRecord(None, None, None)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        self._record = ReplayRecord(seed, options, _rng_state(self.env))
        return self.env.reset(seed=seed, options=options)

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        self._record.actions.append(copy.copy(action))
        return self.env.step(action)

    def replay_record(self) -> ReplayRecord:
        """The record of the episode in flight."""
        return self._record


class _AsyncReplayWrapper(AsyncWrapper[Any, Any]):
    """:class:`_ReplayWrapper` for async envs."""

    def __init__(self, env: AsyncEnv[Any, Any]) -> None:
        super().__init__(env)
        self._record = ReplayRecord(None, None, None)

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        self._record = ReplayRecord(seed, options, _rng_state(self.env))
        return await self.env.reset(seed=seed, options=options)

    async def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        self._record.actions.append(copy.copy(action))
        return await self.env.step(action)

    def replay_record(self) -> ReplayRecord:
        """The record of the episode in flight."""
        return self._record


@dataclass(frozen=True)
class Replayable:
    """An env source whose envs are replayable: their outcomes depend only on their seed (their
    ``np_random``) and the actions. A checkpoint then restores their episodes in flight by
    replay: the env is rebuilt, its ``np_random`` set back to where the episode began, reset with
    the episode's seed and options, and stepped through the episode's actions in its host (the
    steps before the checkpoint are not recorded again).

    Use it where the env source goes: ``Sampler(Replayable("CartPole-v1"), ...)``. It costs one
    list append per step. An env that also has ``get_state``/``set_state`` is restored by them.

    Args:
        source: a gymnasium id or a zero-argument factory of a blocking or async env.
    """

    source: EnvSource

    def __call__(self) -> Any:
        source = self.source
        if callable(source) and not isinstance(source, (str, gym.Env, EnvUpdate)):
            env = as_slot_env(source())  # a factory may make an async env
            if is_async_env(env):
                return _AsyncReplayWrapper(env)
            return _ReplayWrapper(checked_env(env, source))
        return _ReplayWrapper(make_env(source))


# -- the state ----------------------------------------------------------------------------------


@dataclass
class EnvState:
    """One env at the checkpoint.

    Attributes:
        how: ``"fresh"`` (built, never reset: its build seed comes back), ``"idle"`` (its next
            call resets it), or for an episode in flight ``"snapshot"``, ``"replay"``, ``"drop"``.
        rng: ``"idle"``/``"drop"``: its ``np_random``'s state (``None``: not exposed).
        snapshot: ``"snapshot"``: what ``get_state()`` returned.
        replay: ``"replay"``: the episode's :class:`ReplayRecord`.
        obs: ``"snapshot"``/``"replay"``: the observation its next step acts on.
    """

    how: str
    rng: dict[str, Any] | None = None
    snapshot: Any = None
    replay: ReplayRecord | None = None
    obs: Any = None


@dataclass
class Carried:
    """A stream of complete episodes: the rows of the episodes it carries into the next round."""

    size: int
    piece_start: np.ndarray
    piece_position: np.ndarray
    cursor: np.ndarray | None
    obs: Tree
    actions: Tree
    rewards: np.ndarray
    versions: np.ndarray
    agent_infos: dict[str, np.ndarray]
    env_infos: dict[int, list[dict[str, Any]]]


@dataclass
class WorkerState:
    """One worker at the checkpoint: its seed tree's position, agent version, episodes."""

    agent_version: int
    seeds_drawn: list[int]
    envs: list[EnvState]
    lengths: np.ndarray
    returns: np.ndarray
    episode_info: list[dict[str, Any]]
    needs_reset: np.ndarray
    ends: list[int]
    dropped_steps: int
    restarts: int
    carried: Carried | None = None
    chains: list[list[EnvSource]] | None = None
    """Each env's source and the env updates applied since, if any were."""


@dataclass
class StreamState:
    """The stream a checkpoint was taken in: its arguments and the rounds it had sampled but not
    yet yielded (a resumed stream with the same arguments yields them first)."""

    num_samples: int
    fragments: bool
    fraction: float
    pending: list[tuple[EpisodeBatch, SampleStats]]


@dataclass
class ResumeReport:
    """How a resumed sampler got its episodes in flight back: counts by way, and the episodes
    dropped (also counted in the metrics' dropped steps, and warned about)."""

    snapshot: int = 0
    replay: int = 0
    dropped: int = 0
    dropped_steps: int = 0


@dataclass
class SamplerState:
    """Everything a sampler needs to continue where it stood: take it with
    ``await sampler.checkpoint()``, continue with ``Sampler(..., resume=state)``.

    Picklable; :meth:`save` writes it atomically, :meth:`load` refuses a damaged file.

    Attributes:
        format_version: :data:`FORMAT_VERSION` when it was made.
        shape: what a sampler resuming it must match (workers, envs per worker, spaces, limit).
        seed: the root seed.
        total_env_steps, restarts: the sampler's counters.
        episodes: episodes completed so far.
        last_mode: the last call's mode (``obtain_fragments`` continues ``"fragments"``).
        workers: each worker's :class:`WorkerState`.
        agent_states: per distinct agent with ``get_state``, its state (``agent_of[w]``: index).
        stream: the stream it was taken in, if any.
    """

    format_version: int
    shape: dict[str, Any]
    seed: int
    total_env_steps: int
    restarts: int
    episodes: int
    last_mode: str | None
    workers: list[WorkerState]
    agent_states: list[Any]
    agent_of: list[int]
    stream: StreamState | None = None

    def counts(self) -> dict[str, int]:
        """How many envs are in each :attr:`EnvState.how`."""
        out = dict.fromkeys(HOW, 0)
        for w in self.workers:
            for e in w.envs:
                out[e.how] += 1
        return out

    def save(self, path: str | os.PathLike[str]) -> int:
        """Write the state to ``path`` atomically (a temporary file in the same folder, flushed
        to disk, then renamed over it); returns the bytes written. A header holds the format
        version, the length and a SHA-256 checksum of the payload."""
        payload = cloudpickle.dumps(self, protocol=5)
        digest = hashlib.sha256(payload).digest()
        data = _MAGIC + _HEADER.pack(FORMAT_VERSION, len(payload), digest) + payload
        target = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(target))
        fd, tmp = tempfile.mkstemp(prefix=".asyncsample-state-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):  # the rename itself, on disk
            dir_fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return len(data)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SamplerState:
        """Read a state :meth:`save` wrote.

        Raises:
            CheckpointError: the file is not a sampler state, is truncated or corrupt (its
                checksum does not match), or has another format version; the message names the
                path and what is wrong.
        """
        name = os.fspath(path)
        with open(name, "rb") as f:
            data = f.read()
        head = len(_MAGIC) + _HEADER.size
        if not data.startswith(_MAGIC):
            raise CheckpointError(f"{name!r} is not a sampler state file (no asyncsample header)")
        if len(data) < head:
            raise CheckpointError(
                f"{name!r} is truncated: {len(data)} bytes, shorter than the header ({head})"
            )
        version, length, digest = _HEADER.unpack_from(data, len(_MAGIC))
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{name!r} has format version {version}; this asyncsample reads version "
                f"{FORMAT_VERSION}"
            )
        payload = data[head:]
        if len(payload) != length:
            raise CheckpointError(
                f"{name!r} is truncated or overlong: its header says {length} bytes of state, "
                f"the file holds {len(payload)}"
            )
        if hashlib.sha256(payload).digest() != digest:
            raise CheckpointError(f"{name!r} is corrupt: its checksum does not match its content")
        state = cloudpickle.loads(payload)
        if not isinstance(state, cls):
            raise CheckpointError(f"{name!r} holds a {type(state).__name__}, not a SamplerState")
        return state
