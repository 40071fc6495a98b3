"""Reading a sampler into a :class:`~asyncsample.SamplerState` and continuing from one (the
logic behind ``Sampler.checkpoint()`` and ``Sampler(..., resume=)``; the state itself, its file
and the env protocols are in :mod:`asyncsample.checkpoint`; docs/checkpoint.md).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from asyncsample._engine import Continuity
from asyncsample._tasks import run_all
from asyncsample._tree import tree_map
from asyncsample.backends.base import PerEnvHost
from asyncsample.batch import EnvSpec
from asyncsample.checkpoint import (
    FORMAT_VERSION,
    Carried,
    EnvState,
    Replayable,
    ResumeReport,
    SamplerState,
    StreamState,
    WorkerState,
)
from asyncsample.env_group import EPISODE_STEPS_ATTR, SNAPSHOT_ATTR
from asyncsample.env_update import EnvSource
from asyncsample.errors import CheckpointError, WorkerError
from asyncsample.inference import InferenceChoice

if TYPE_CHECKING:
    from asyncsample.seeding import WorkerSeeds
    from asyncsample.worker import Worker

__all__ = [
    "ResumableCore",
    "RoundGate",
    "capture",
    "check_no_stream_pending",
    "check_shape",
    "continue_stream",
    "drain",
    "position_seeds",
    "restore",
    "resumed_state",
]


class _Seeds(Protocol):
    def __getitem__(self, index: int) -> WorkerSeeds: ...


class ResumableCore(Protocol):
    """What reading a sampler and continuing one need of its core (``SamplerCore``)."""

    n_workers: int
    envs_per_worker: int
    max_episode_length: int | None
    seed: int
    workers: list[Worker]
    env_sources: list[Any]
    total_env_steps: int
    restarts: int
    last_mode: Any
    pending_stream: StreamState | None
    inference: InferenceChoice

    @property
    def env_spec(self) -> EnvSpec: ...

    @property
    def seeds(self) -> _Seeds: ...


# -- reading a sampler --------------------------------------------------------------------------


def wants_exact_resume(sources: Sequence[Any], resume: SamplerState | None) -> bool:
    """Whether the sampler says it will be checkpointed and resumed: it resumes a state, or an
    env source is :class:`~asyncsample.Replayable` (only resumes use it). ``inference="auto"``
    then keeps the built-in random agent in the caller, where a checkpoint reads its state."""
    if resume is not None:
        return True
    flat = [s for item in sources for s in (item if isinstance(item, list) else [item])]
    return any(isinstance(s, Replayable) for s in flat)


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


def check_no_stream_pending(core: ResumableCore, call: str) -> None:
    """Refuse ``call`` while a resumed stream's batches wait to be yielded (never lost)."""
    stream = core.pending_stream
    if stream is not None:
        raise CheckpointError(
            f"{call}: the sampler resumed a state taken in stream(num_samples="
            f"{stream.num_samples}, fragments={stream.fragments}, fraction_samples="
            f"{stream.fraction}), which still holds {len(stream.pending)} batch(es) sampled "
            "before the checkpoint: open that stream again first, with the same arguments"
        )


def shape_of(core: ResumableCore) -> dict[str, Any]:
    """What a state and the sampler resuming it must share."""
    spec = core.env_spec
    return {
        "n_workers": core.n_workers,
        "envs_per_worker": core.envs_per_worker,
        "observation_space": spec.observation_space,
        "action_space": spec.action_space,
        "max_episode_length": core.max_episode_length,
    }


def check_shape(state: SamplerState, core: ResumableCore) -> None:
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


async def capture(core: ResumableCore, stream: StreamState | None = None) -> SamplerState:
    """Read the started, idle sampler ``core`` (no call or stream round running) at once."""
    choice = core.inference
    if choice.auto and choice.mode == "host":
        who, start = "the built-in random agents", "their seeds"
        if choice.follows:
            who, start = "copies of your agent", "the random state your agent has"
        warnings.warn(
            f"checkpoint: inference='auto' runs {who} in the env hosts ({choice.reason}), where "
            "a checkpoint does not read them: a resume continues the envs exactly, but the "
            f"agents' random draws from {start}, so a stochastic agent's batches differ from an "
            "uninterrupted run's; pass inference='per_worker' (or a Replayable env, which makes "
            "'auto' choose it) for a bit-for-bit resume",
            RuntimeWarning,
            stacklevel=3,
        )
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


async def _capture_worker(core: ResumableCore, worker: Worker, continuing: bool) -> WorkerState:
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
    if continuing and episodes.recorder.carried_from() is not None:
        carried = _carried(worker)
    seeds = core.seeds[worker.worker_number]
    chains: list[list[EnvSource]] | None = [list(worker.env_chain(i)) for i in range(n)]
    source = core.env_sources[worker.worker_number]
    built = source if isinstance(source, list) else [source] * n
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
    start = recorder.carried_from() or 0
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


def _generator(state: dict[str, Any]) -> np.random.Generator:
    """A generator in ``state`` (a ``bit_generator.state`` dict)."""
    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = state
    return np.random.Generator(bit_generator)


# -- continuing from a state --------------------------------------------------------------------


def position_seeds(core: ResumableCore, state: SamplerState) -> None:
    """Put each env's seed sequence one draw before where the state had it: building the envs as
    the sampler starts draws the seed they were last built with."""
    for w, ws in enumerate(state.workers):
        seeds = core.seeds[w]
        for i, drawn in enumerate(ws.seeds_drawn):
            seeds.set_drawn(i, max(drawn - 1, 0))


async def restore(core: ResumableCore, state: SamplerState) -> ResumeReport:
    """Bring the started sampler ``core`` (its envs just built) to ``state``."""
    report = ResumeReport()
    await asyncio.gather(
        *(
            _restore_worker(w, ws, core.seeds[w.worker_number], report)
            for w, ws in zip(core.workers, state.workers)
        )
    )
    for worker, index in zip(core.workers, state.agent_of):
        value = state.agent_states[index]
        setter = getattr(worker.agent, "set_state", None)
        if value is not None and setter is not None:
            await _maybe_await(setter(value))
    core.total_env_steps = state.total_env_steps
    core.pending_stream = state.stream
    core.restarts = state.restarts
    core.last_mode = state.last_mode
    if report.dropped:
        warnings.warn(
            f"resume: {report.dropped} episode(s) in flight were dropped ({report.dropped_steps} "
            "steps): their envs have neither get_state/set_state nor a Replayable source, or "
            "their replay diverged; they start afresh (sampler.resumed counts them)",
            RuntimeWarning,
            stacklevel=4,
        )
    return report


async def _restore_worker(
    worker: Worker, ws: WorkerState, tree: WorkerSeeds, report: ResumeReport
) -> None:
    host = worker.host
    assert host is not None
    episodes = worker.episodes
    n = worker.n_envs
    envs = ws.envs
    worker.agent_version = ws.agent_version
    worker.restarts = ws.restarts
    if ws.chains is not None:  # env updates were applied: the envs are built as they were
        built = [tree.seed_at(i, drawn - 1) for i, drawn in enumerate(ws.seeds_drawn)]
        await worker.rebuild_envs(ws.chains, built)
    worker.home()
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
        reset = getattr(worker.agent, "reset", None)
        if reset is not None:  # as the worker does for the envs it resets
            reset(mask.copy())
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
    recorder.carry_all()


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
    core: ResumableCore, num_samples: int, fragments: bool, fraction: float
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
