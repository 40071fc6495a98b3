"""Checkpoint and resume: :class:`SamplerState`, its file, and how a sampler is read into one
and continued from one (see [Checkpoint and resume](checkpoint.md)).

A state is read at one instant: between two calls, or between two rounds of a stream (its
producer paused, the batches it buffered kept in the state). Each env's episode in flight comes
back one of three ways, chosen per env and recorded: ``"snapshot"`` (the env has
``get_state``/``set_state``, :class:`SnapshotEnv`), ``"replay"`` (the env is wrapped by
:class:`Replayable`: rebuilt, reset from the random state its episode began with, and stepped
through the episode's actions in its host), else ``"drop"`` (reset at resume, counted and warned
about).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import inspect
import logging
import os
import struct
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, SupportsFloat, runtime_checkable

import cloudpickle
import gymnasium as gym
import numpy as np

from asyncsample._engine import Continuity
from asyncsample._tasks import run_all
from asyncsample._tree import Tree, tree_map
from asyncsample.async_env import AsyncEnv, AsyncWrapper, is_async_env
from asyncsample.backends.base import PerEnvHost
from asyncsample.env_group import EPISODE_STEPS_ATTR, SNAPSHOT_ATTR
from asyncsample.env_update import EnvSource, EnvUpdate, checked_env, make_env
from asyncsample.errors import CheckpointError, WorkerError

if TYPE_CHECKING:
    from asyncsample._core import SamplerCore
    from asyncsample.batch import EpisodeBatch
    from asyncsample.stats import SampleStats
    from asyncsample.worker import Worker

__all__ = [
    "FORMAT_VERSION",
    "EnvState",
    "Replayable",
    "ResumeReport",
    "SamplerState",
    "SnapshotEnv",
    "StreamState",
    "WorkerState",
]

logger = logging.getLogger("asyncsample")

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


def _generator(state: dict[str, Any]) -> np.random.Generator:
    """A generator in ``state`` (a ``bit_generator.state`` dict)."""
    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = state
    return np.random.Generator(bit_generator)


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
            env = source()  # a factory may make an async env
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


# -- reading a sampler --------------------------------------------------------------------------


def resumed_state(value: Any, seed: int | None) -> SamplerState | None:
    """``Sampler(resume=value)`` checked against ``seed`` (a state carries its own)."""
    if value is None:
        return None
    if not isinstance(value, SamplerState):
        raise TypeError(
            f"resume must be a SamplerState (from sampler.checkpoint() or SamplerState.load), "
            f"got {type(value).__name__}"
        )
    if seed is not None and seed != value.seed:
        raise CheckpointError(
            f"resume: the state was taken from a sampler with seed={value.seed}, this sampler "
            f"has seed={seed} (leave seed=None to take the state's)"
        )
    return value


def check_no_stream_pending(core: SamplerCore, call: str) -> None:
    """Refuse ``call`` while a resumed stream's batches wait to be yielded (never lost)."""
    stream = core.pending_stream
    if stream is not None:
        raise CheckpointError(
            f"{call}: the sampler resumed a state taken in stream(num_samples="
            f"{stream.num_samples}, fragments={stream.fragments}, fraction_samples="
            f"{stream.fraction}), which still holds {len(stream.pending)} batch(es) sampled "
            "before the checkpoint: open that stream again first, with the same arguments"
        )


def shape_of(core: SamplerCore) -> dict[str, Any]:
    """What a state and the sampler resuming it must share."""
    spec = core.env_spec
    return {
        "n_workers": core.n_workers,
        "envs_per_worker": core.envs_per_worker,
        "observation_space": spec.observation_space,
        "action_space": spec.action_space,
        "max_episode_length": core.max_episode_length,
    }


def check_shape(state: SamplerState, core: SamplerCore) -> None:
    """Refuse a state of another shape, naming the difference."""
    if not isinstance(state, SamplerState):
        raise TypeError(f"resume must be a SamplerState, got {type(state).__name__}")
    if state.format_version != FORMAT_VERSION:
        raise CheckpointError(
            f"resume: the state has format version {state.format_version}, this asyncsample "
            f"reads {FORMAT_VERSION}"
        )
    mine = shape_of(core)
    for key, theirs in state.shape.items():
        if mine.get(key) != theirs:
            raise CheckpointError(
                f"resume: the state was taken from a sampler with {key}={theirs!r}, this "
                f"sampler has {key}={mine.get(key)!r}"
            )


async def capture(core: SamplerCore, stream: StreamState | None = None) -> SamplerState:
    """Read the started, idle sampler ``core`` (no call or stream round running) at once."""
    continuing = stream is not None or core.last_mode == "fragments"
    workers = list(
        await asyncio.gather(*(_capture_worker(core, w, continuing) for w in core.workers))
    )
    agent_states: list[Any] = []
    agent_of: list[int] = []
    seen: dict[int, int] = {}
    for worker in core.workers:
        agent = worker.agent
        if id(agent) not in seen:
            seen[id(agent)] = len(agent_states)
            getter = getattr(agent, "get_state", None)
            agent_states.append(None if getter is None else await _maybe_await(getter()))
        agent_of.append(seen[id(agent)])
    return SamplerState(
        format_version=FORMAT_VERSION,
        shape=shape_of(core),
        seed=core.seed,
        total_env_steps=core.total_env_steps,
        restarts=core.restarts,
        episodes=sum(sum(w.episodes.ends) for w in core.workers),
        last_mode=core.last_mode,
        workers=workers,
        agent_states=agent_states,
        agent_of=agent_of,
        stream=stream,
    )


async def _capture_worker(core: SamplerCore, worker: Worker, continuing: bool) -> WorkerState:
    episodes = worker.episodes
    host = worker.host
    assert host is not None
    n = worker.n_envs
    needs_reset = episodes.needs_reset.copy()
    if episodes.state is Continuity.IN_CALL:  # a call cancelled midway: the next resets all
        needs_reset[:] = True
    elif episodes.state is not Continuity.IDLE:
        raise CheckpointError(
            f"checkpoint: worker {worker.worker_number}'s envs are {episodes.state.value!r} (a "
            "chunk of steps run ahead with inference='host', or a failed env host not rebuilt "
            "yet): take the checkpoint between calls, or in a stream with "
            "inference='per_worker' or 'batched'"
        )
    # A stream of complete episodes on the lanes leaves steps running between its rounds: those
    # episodes cannot be read at this instant (the env is inside a step), so they drop.
    stepping = set(getattr(host, "in_flight", None) or ())
    if not continuing:  # the next call resets the episodes that took a step
        needs_reset |= episodes.lengths > 0
    fresh = episodes.fresh
    flight = [i for i in range(n) if not needs_reset[i]]
    idle = [i for i in range(n) if needs_reset[i] and not fresh[i]]
    envs = [EnvState("fresh") for _ in range(n)]
    stepping.intersection_update(flight)
    flight = [i for i in flight if i not in stepping]
    snap = set(await _has(host, "get_state", flight))
    rest = [i for i in flight if i not in snap]
    replay = set(await _has(host, "replay_record", rest))
    drop = sorted([i for i in rest if i not in replay] + list(stepping))
    obs = host.buffers.obs
    if snap:
        order = sorted(snap)
        for i, value in zip(order, await _call_each(host, "get_state", order)):
            envs[i] = EnvState("snapshot", snapshot=value, obs=_obs_of(obs, i))
    if replay:
        order = sorted(replay)
        for i, record in zip(order, await host.call("replay_record", envs=order)):
            envs[i] = EnvState("replay", replay=record.copy(), obs=_obs_of(obs, i))
    rngs = await _rngs(host, [*idle, *drop])
    for i in idle:
        envs[i] = EnvState("idle", rng=rngs.get(i))
    for i in drop:
        envs[i] = EnvState("drop", rng=rngs.get(i))
    carried = None
    if continuing and episodes.recorder._carry_from is not None:
        carried = _carried(worker)
    seeds = worker._seeds
    assert seeds is not None
    chains: list[list[EnvSource]] | None = [list(worker.env_chain(i)) for i in range(n)]
    built = worker._per_env(core.env_sources[worker.worker_number], "env")
    if all(len(c) == 1 and c[0] is s for c, s in zip(chains or [], built)):
        chains = None  # no env update since the sampler started: its sources rebuild them
    return WorkerState(
        agent_version=worker.agent_version,
        seeds_drawn=[seeds.drawn(i) for i in range(n)],
        envs=envs,
        lengths=episodes.lengths.copy(),
        returns=episodes.returns.copy(),
        episode_info=copy.deepcopy(episodes.episode_info),
        needs_reset=needs_reset,
        ends=list(episodes.ends),
        dropped_steps=episodes.dropped_steps,
        restarts=worker.restarts,
        carried=carried,
        chains=chains,
    )


def _carried(worker: Worker) -> Carried:
    """The rows a stream of complete episodes carries into its next round."""
    recorder = worker.episodes.recorder
    rows = recorder.rows
    start = recorder._carry_from or 0
    size = rows.size

    def cut(a: np.ndarray) -> np.ndarray:
        return np.array(a[start:size])

    return Carried(
        size=size - start,
        piece_start=recorder.piece_start - start,
        piece_position=recorder.piece_position.copy(),
        cursor=None if recorder.cursor is None else recorder.cursor - start,
        obs=tree_map(cut, rows.obs) if size > start else None,
        actions=tree_map(cut, rows.actions) if size > start else None,
        rewards=cut(rows.rewards) if size > start else np.zeros((0, worker.n_envs)),
        versions=cut(rows.versions) if size > start else np.zeros((0, worker.n_envs), np.int64),
        agent_infos={k: cut(v) for k, v in rows.agent_infos.items()},
        env_infos={t - start: v for t, v in rows.env_infos.items() if t >= start},
    )


def _obs_of(obs: Any, i: int) -> Any:
    if isinstance(obs, list):
        return copy.deepcopy(obs[i])
    return tree_map(lambda a: np.array(a[i]), obs)


async def _has(host: Any, name: str, envs: Sequence[int]) -> list[int]:
    """Which of ``envs`` have attribute ``name`` (through their wrappers)."""
    if not envs:
        return []
    try:
        found = await host.call("has_wrapper_attr", (name,), envs=list(envs))
    except WorkerError:
        return []  # not gymnasium-like: no wrapper attributes to look through
    return [i for i, yes in zip(envs, found) if yes]


async def _call_each(
    host: Any, name: str, envs: Sequence[int], args: Sequence[Any] = ()
) -> list[Any]:
    """``host.call`` of ``name`` on ``envs``, each result awaited if the env's method is a
    coroutine (hosts in other processes await it there)."""
    return [await _maybe_await(v) for v in await host.call(name, args, envs=list(envs))]


async def _rngs(host: Any, envs: Sequence[int]) -> dict[int, dict[str, Any]]:
    """The ``np_random`` states of ``envs``, where they expose one."""
    if not envs:
        return {}
    try:
        gens = await host.call("np_random", envs=list(envs))
    except WorkerError:
        return {}
    return {  # ``state`` is a new dict each time it is read
        i: dict(g.bit_generator.state)
        for i, g in zip(envs, gens)
        if isinstance(g, np.random.Generator)
    }


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


# -- continuing from a state --------------------------------------------------------------------


def position_seeds(core: SamplerCore, state: SamplerState) -> None:
    """Put each env's seed sequence one draw before where the state had it: building the envs as
    the sampler starts draws the seed they were last built with."""
    for w, ws in enumerate(state.workers):
        seeds = core.seeds[w]
        for i, drawn in enumerate(ws.seeds_drawn):
            seeds.set_drawn(i, max(drawn - 1, 0))


async def restore(core: SamplerCore, state: SamplerState) -> ResumeReport:
    """Bring the started sampler ``core`` (its envs just built) to ``state``."""
    report = ResumeReport()
    await asyncio.gather(
        *(_restore_worker(w, ws, report) for w, ws in zip(core.workers, state.workers))
    )
    for worker, index in zip(core.workers, state.agent_of):
        value = state.agent_states[index]
        setter = getattr(worker.agent, "set_state", None)
        if value is not None and setter is not None:
            await _maybe_await(setter(value))
    core.total_env_steps = state.total_env_steps
    core.pending_stream = state.stream
    core.restarts = state.restarts
    core.last_mode = state.last_mode  # type: ignore[assignment]
    if report.dropped:
        warnings.warn(
            f"resume: {report.dropped} episode(s) in flight were dropped ({report.dropped_steps} "
            "steps): their envs have neither get_state/set_state nor a Replayable source, or "
            "their replay diverged; they start afresh (sampler.resumed counts them)",
            RuntimeWarning,
            stacklevel=4,
        )
    return report


async def _restore_worker(worker: Worker, ws: WorkerState, report: ResumeReport) -> None:
    host = worker.host
    assert host is not None
    episodes = worker.episodes
    worker._home()
    n = worker.n_envs
    envs = ws.envs
    worker.agent_version = ws.agent_version
    worker.restarts = ws.restarts
    if ws.chains is not None:  # env updates were applied: the envs are built as they were
        tree = worker._seeds
        assert tree is not None
        worker._chains = [list(c) for c in ws.chains]
        built = [tree.seed_at(i, drawn - 1) for i, drawn in enumerate(ws.seeds_drawn)]
        with worker.naming_factories():
            await host.build(worker._chains, built)
    # 1. random generators back where they were (a replay: where its episode began)
    where, gens = [], []
    for i, e in enumerate(envs):
        rng = e.replay.rng if e.replay is not None else e.rng
        if rng is not None and e.how != "snapshot":
            where.append(i)
            gens.append(_generator(rng))
    if where:
        await host.set_attr("np_random", gens, where)
    # 2. every env but the fresh ones reset now, as its episode began (or from its generator)
    mask = np.array([e.how != "fresh" for e in envs], dtype=bool)
    if mask.any():
        seeds: list[int | None] = [None] * n
        options: list[dict[str, Any] | None] = [None] * n
        for i, e in enumerate(envs):
            if e.replay is not None:
                seeds[i], options[i] = e.replay.seed, e.replay.options
        infos = await host.reset(mask, seeds=seeds, options=options)
        episodes.started(mask, infos)
        worker._reset_agent(mask)
    # 3. the episodes in flight: replayed through their actions, or their snapshot set
    diverged = await _replay(worker, envs)
    snapped = [i for i, e in enumerate(envs) if e.how == "snapshot"]
    if snapped:
        await host.set_attr(SNAPSHOT_ATTR, [envs[i].snapshot for i in snapped], snapped)
        await host.set_attr(EPISODE_STEPS_ATTR, [int(ws.lengths[i]) for i in snapped], snapped)
        for i in snapped:
            _put_obs(host.buffers, i, envs[i].obs)
    # 4. the bookkeeping
    flight = np.array([e.how in ("snapshot", "replay") for e in envs], dtype=bool)
    flight[diverged] = False
    episodes.lengths[flight] = ws.lengths[flight]
    episodes.returns[flight] = ws.returns[flight]
    for i in np.flatnonzero(flight).tolist():
        episodes.episode_info[i] = ws.episode_info[i]
    episodes.needs_reset[:] = ws.needs_reset
    episodes.needs_reset[~mask] = True  # fresh: reset with their build seed
    episodes.needs_reset[mask & ~flight] = False  # idle and dropped: reset just now
    if diverged:
        episodes.needs_reset[diverged] = True
    episodes.ends[:] = ws.ends
    dropped = [i for i, e in enumerate(envs) if e.how == "drop"] + diverged
    dropped_steps = int(sum(int(ws.lengths[i]) for i in dropped))
    episodes.dropped_steps = ws.dropped_steps + dropped_steps
    fresh = np.array([e.how == "fresh" for e in envs], dtype=bool)
    episodes.fresh[:] = fresh
    if ws.carried is not None:
        _restore_carried(worker, ws.carried, [i for i in range(n) if not flight[i]])
    report.snapshot += len(snapped)
    report.replay += int(flight.sum()) - len(snapped)
    report.dropped += len(dropped)
    report.dropped_steps += dropped_steps


async def _replay(worker: Worker, envs: list[EnvState]) -> list[int]:
    """Step the replayed envs through their episodes' actions; those whose observation then
    differs from the one recorded (they are reset at the next call)."""
    host = worker.host
    assert host is not None
    replays = {i: e.replay for i, e in enumerate(envs) if e.replay is not None}
    if not replays:
        return []
    buffers = host.buffers
    diverged: set[int] = set()
    if isinstance(host, PerEnvHost):  # each env replays on its own (no wait for the slowest)

        async def lane(i: int, actions: list[Any]) -> None:
            for action in actions:
                _, terminated, truncated, _ = await host.step_one(i, action)
                if terminated or truncated:
                    diverged.add(i)
                    return

        await run_all([lane(i, r.actions) for i, r in replays.items() if r.actions])
    longest = 0 if isinstance(host, PerEnvHost) else max(len(r.actions) for r in replays.values())
    for t in range(longest):
        mask = np.zeros(worker.n_envs, dtype=bool)
        for i, record in replays.items():
            if t < len(record.actions) and i not in diverged:
                mask[i] = True
                _put_action(buffers.actions, i, record.actions[t])
        if not mask.any():
            break
        await host.step(mask)
        ended = (np.asarray(buffers.terminated) | np.asarray(buffers.truncated)) & mask
        diverged.update(np.flatnonzero(ended).tolist())
    for i in replays:
        if i not in diverged and not _same(_obs_of(buffers.obs, i), envs[i].obs):
            diverged.add(i)
    return sorted(diverged)


def _put_action(actions: Any, i: int, action: Any) -> None:
    if isinstance(actions, list):
        actions[i] = action
    elif isinstance(actions, np.ndarray):
        actions[i] = action
    else:
        tree_map(lambda a, x: a.__setitem__(i, x), actions, action)


def _put_obs(buffers: Any, i: int, obs: Any) -> None:
    if isinstance(buffers.obs, list):
        buffers.obs[i] = obs
    else:
        tree_map(lambda a, x: a.__setitem__(i, x), buffers.obs, obs)


def _same(a: Any, b: Any) -> bool:
    try:
        leaves_a, leaves_b = [], []
        tree_map(lambda x: leaves_a.append(np.asarray(x)), a)
        tree_map(lambda x: leaves_b.append(np.asarray(x)), b)
        return len(leaves_a) == len(leaves_b) and all(
            x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(leaves_a, leaves_b)
        )
    except Exception:
        return bool(a == b)


def _restore_carried(worker: Worker, carried: Carried, gone: list[int]) -> None:
    """Put the rows a stream carries into the next round back (``gone``: envs whose episode did
    not come back: their rows are left out)."""
    recorder = worker.episodes.recorder
    rows = recorder.rows
    rows.clear()
    if carried.size:
        assert worker.host is not None
        buffers = worker.host.buffers
        t0 = rows.reserve(carried.size, buffers.obs, buffers.actions)
        assert t0 == 0
        tree_map(lambda d, s: d.__setitem__(slice(0, carried.size), s), rows.obs, carried.obs)
        tree_map(
            lambda d, s: d.__setitem__(slice(0, carried.size), s), rows.actions, carried.actions
        )
        rows.rewards[: carried.size] = carried.rewards
        rows.versions[: carried.size] = carried.versions
        for key, column in carried.agent_infos.items():
            full = np.zeros((rows.capacity, *column.shape[1:]), dtype=column.dtype)
            full[: carried.size] = column
            rows.agent_infos[key] = full
        rows.env_infos = dict(carried.env_infos)
    recorder.piece_start[:] = carried.piece_start
    recorder.piece_position[:] = carried.piece_position
    if carried.cursor is not None:
        recorder.cursor = carried.cursor.copy()
    end = carried.size if carried.cursor is None else carried.cursor
    for i in gone:
        recorder.piece_start[i] = end if isinstance(end, int) else end[i]
        recorder.piece_position[i] = 0
    recorder._carry_from = 0


# -- a stream's rounds, paused at a boundary ----------------------------------------------------


class RoundGate:
    """Lets a checkpoint pause a stream's producer between two rounds (never inside one)."""

    def __init__(self) -> None:
        self._go = asyncio.Event()
        self._go.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.putting: Any = None  # a round's result waiting for room in the queue

    async def enter(self) -> None:
        """Before a round: wait while a checkpoint holds the stream."""
        await self._go.wait()
        self._idle.clear()

    def left(self) -> None:
        """A round ended."""
        self._idle.set()

    async def pause(self) -> None:
        """Hold the producer at its next boundary (now, if it is between rounds)."""
        self._go.clear()
        await self._idle.wait()

    def release(self) -> None:
        """Let the producer go on."""
        self._go.set()


def continue_stream(
    core: SamplerCore, num_samples: int, fragments: bool, fraction: float
) -> list[Any] | None:
    """A stream opening on a sampler resumed from a state taken in a stream: that stream's
    rounds not yet yielded (then it continues its episodes), or ``None`` (no such state).

    Raises:
        CheckpointError: the stream's arguments differ from those of the stream of the state.
    """
    stream = core.pending_stream
    if stream is None:
        return None
    given = (num_samples, fragments, fraction)
    taken = (stream.num_samples, stream.fragments, stream.fraction)
    if given != taken:
        raise CheckpointError(
            f"stream: the sampler resumed a state taken in stream(num_samples={taken[0]}, "
            f"fragments={taken[1]}, fraction_samples={taken[2]:g}); open it with those "
            f"arguments to continue it, got num_samples={given[0]}, fragments={given[1]}, "
            f"fraction_samples={given[2]:g}"
        )
    core.pending_stream = None
    return list(stream.pending)


def drain(queue: asyncio.Queue[Any], putting: Any) -> list[Any]:
    """The items of a paused stream's ``queue`` (left in it), then the one being put.

    Raises:
        CheckpointError: the stream's sampling failed (the error is raised by the stream too).
    """
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    for item in items:
        queue.put_nowait(item)
    if putting is not None:
        items.append(putting)
    for item in items:
        if isinstance(item, BaseException):
            raise CheckpointError(f"checkpoint: the stream's sampling failed: {item!r}") from item
    return items
