"""The contenders: one function per sampler, all with the signature ``fn(spec) -> RunResult``.

Each contender builds ``spec.n_envs`` copies of ``spec.env_id``, drives them with a seeded
random agent, steps ``spec.warmup`` transitions that are not timed, then times
``spec.n_transitions`` transitions (at least; the count actually stepped is returned). Every
contender closes its envs and processes in a ``finally``. A contender whose library is
missing (or whose backend is not implemented yet) raises :class:`Skipped` with a note.

Vector envs get a seeded batched ``action_space.sample()`` each step (the same agent for
every vector peer); asyncsample uses its built-in per-worker ``RandomAgent``. With
``spec.policy`` (the policy workload) every contender is driven by the same torch MLP
(:mod:`benchmarks.policies`) instead, and asyncsample by it in ``spec.inference`` mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import multiprocessing
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from benchmarks.ceiling import ceiling
from benchmarks.runs import (
    LagProbe,
    RunResult,
    RunSpec,
    Skipped,
    TimedPhase,
    batched_actions,
    env_fns,
    timed_loop,
    timed_steps,
)
from benchmarks.torchrl_peers import TORCHRL_CONTENDERS
from benchmarks.vector_peers import VECTOR_PEERS

__all__ = [
    "CONTENDERS",
    "asyncsample_local",
    "asyncsample_process",
    "asyncsample_ray",
    "envpool_async",
    "envpool_pool",
    "gym_async",
    "gym_sync",
    "ideal_single",
    "run_contender",
    "sb3_subproc",
    "tianshou_shmem",
    "tianshou_subproc",
]


# --------------------------------------------------------------------------------------------
# Contenders


def ideal_single(spec: RunSpec) -> RunResult:
    """A plain single-process ``env.step`` loop over one env (with resets).

    Actions are drawn in advance, so this is the env's own cost; the ideal of a contender
    is ``cores`` times this rate.
    """
    env = gym.make(spec.env_id)
    try:
        env.reset(seed=spec.seed)
        env.action_space.seed(spec.seed)
        acts = [env.action_space.sample() for _ in range(1024)]

        def loop(n: int) -> None:
            for i in range(n):
                _, _, term, trunc, _ = env.step(acts[i & 1023])
                if term or trunc:
                    env.reset()

        loop(spec.warmup)
        done = 0
        with TimedPhase(spec) as phase:
            while phase.more(done):
                loop(spec.n_transitions)
                done += spec.n_transitions
        return phase.result(done)
    finally:
        env.close()


def _policy_steps(spec: RunSpec, step: Callable[[Any], Any], first_obs: Any) -> RunResult:
    """Step a vector env with the policy workload's MLP acting on the latest observations.

    Args:
        spec: The run (``spec.policy`` names the policy).
        step: Steps all envs once with the given actions and returns the new observations.
        first_obs: The observations after the reset.
    """
    from benchmarks.policies import make_policy

    policy = make_policy(spec.policy, spec.env_id, seed=spec.seed)
    obs = first_obs
    warm = 0
    while warm < spec.warmup:
        obs = step(policy.act(obs))
        warm += spec.n_envs
    done = 0
    with TimedPhase(spec) as phase:
        while phase.more(done):
            obs = step(policy.act(obs))
            done += spec.n_envs
    return phase.result(done)


def _gym_vector(
    spec: RunSpec, cls: Callable[..., gym.vector.VectorEnv], **kwargs: Any
) -> RunResult:
    """Run a gymnasium vector env in same-step autoreset mode (every step is a transition)."""
    from gymnasium.vector import AutoresetMode

    envs = None
    try:
        envs = cls(env_fns(spec), autoreset_mode=AutoresetMode.SAME_STEP, **kwargs)
        first_obs, _ = envs.reset(seed=spec.seed)
        n = spec.n_envs
        if spec.policy:
            venv = envs
            return _policy_steps(spec, lambda a: venv.step(a)[0], first_obs)

        def step(action: Any) -> int:
            envs.step(action)
            return n

        actions = batched_actions(envs.single_action_space, n, spec.seed)
        return timed_steps(spec, step, actions)
    finally:
        if envs is not None:
            envs.close()


def gym_sync(spec: RunSpec) -> RunResult:
    """gymnasium ``SyncVectorEnv``: every env stepped in this process, one after another."""
    return _gym_vector(spec, gym.vector.SyncVectorEnv)


def gym_async(spec: RunSpec) -> RunResult:
    """gymnasium ``AsyncVectorEnv(shared_memory=True)``: one process per env copy."""
    return _gym_vector(spec, gym.vector.AsyncVectorEnv, shared_memory=True)


def sb3_subproc(spec: RunSpec) -> RunResult:
    """Stable-Baselines3 ``SubprocVecEnv`` (one process per env, its default start method)."""
    try:
        from stable_baselines3.common.vec_env import SubprocVecEnv
    except Exception as exc:
        raise Skipped(f"stable-baselines3 not importable ({type(exc).__name__}: {exc})") from exc
    venv = None
    try:
        if not spec.instrument:
            # Same stepping, faster start: the forkserver imports SB3 (and torch) once
            # instead of in every child. The instrumented run keeps SB3's plain default,
            # so the memory it reports is what a user gets.
            multiprocessing.set_forkserver_preload([SubprocVecEnv.__module__])
        venv = SubprocVecEnv(env_fns(spec))
        venv.seed(spec.seed)
        first_obs = venv.reset()
        n = spec.n_envs
        if spec.policy:
            sb3 = venv
            return _policy_steps(spec, lambda a: sb3.step(a)[0], first_obs)

        def step(action: Any) -> int:
            venv.step(action)
            return n

        actions = batched_actions(venv.action_space, n, spec.seed)
        return timed_steps(spec, step, actions)
    finally:
        if venv is not None:
            venv.close()


def _tianshou(spec: RunSpec, shmem: bool) -> RunResult:
    """tianshou vector env; done envs are reset by id after each step, as its Collector does."""
    try:
        from tianshou.env import ShmemVectorEnv, SubprocVectorEnv
    except Exception as exc:
        raise Skipped(f"tianshou not importable ({type(exc).__name__}: {exc})") from exc
    cls = ShmemVectorEnv if shmem else SubprocVectorEnv
    venv = None
    try:
        venv = cls(env_fns(spec))
        for i in range(spec.n_envs):
            venv.reset(env_id=i, seed=spec.seed + i)
        n = spec.n_envs
        probe_env = gym.make(spec.env_id)
        single = probe_env.action_space
        probe_env.close()

        def step(action: Any) -> int:
            _, _, term, trunc, _ = venv.step(action)
            done = np.flatnonzero(np.logical_or(term, trunc))
            if done.size:
                venv.reset(env_id=done)
            return n

        actions = batched_actions(single, n, spec.seed)
        return timed_steps(spec, step, actions)
    finally:
        if venv is not None:
            venv.close()


def tianshou_subproc(spec: RunSpec) -> RunResult:
    """tianshou ``SubprocVectorEnv`` (pipes, one process per env)."""
    return _tianshou(spec, shmem=False)


def tianshou_shmem(spec: RunSpec) -> RunResult:
    """tianshou ``ShmemVectorEnv`` (shared-memory observations, one process per env)."""
    return _tianshou(spec, shmem=True)


def _envpool_make(spec: RunSpec, batch_size: int) -> Any:
    """EnvPool's own C++ port of ``spec.env`` (CartPole-v1, the Atari games, MuJoCo)."""
    from benchmarks.envs import ATARI, ENVPOOL_ATARI, ENVPOOL_ATARI_RAW

    if spec.env == "PongRaw-v5":  # raw frames, channel-first in EnvPool: (3, 210, 160)
        import envpool

        return envpool.make_gymnasium("Pong-v5", num_envs=spec.n_envs, batch_size=batch_size,
                                      num_threads=spec.cores, seed=spec.seed,
                                      **ENVPOOL_ATARI_RAW)  # fmt: skip
    if spec.env not in ("CartPole-v1", "HalfCheetah-v5", "Humanoid-v5", *ATARI):
        raise Skipped("EnvPool runs only its own C++ envs (CartPole, Atari, MuJoCo)")
    try:
        import envpool
    except Exception as exc:
        raise Skipped(f"envpool not importable ({type(exc).__name__}: {exc})") from exc
    return envpool.make_gymnasium(
        spec.env,
        num_envs=spec.n_envs,
        batch_size=batch_size,
        num_threads=spec.cores,
        seed=spec.seed,
        **(ENVPOOL_ATARI if spec.env in ATARI else {}),
    )


def _actor(spec: RunSpec, single: gym.Space, rows: int) -> Callable[[Any], Any]:
    """``obs -> actions`` for ``rows`` envs: the policy, or seeded random actions."""
    if spec.policy:
        from benchmarks.policies import make_policy

        return make_policy(spec.policy, spec.env_id, seed=spec.seed).act
    actions = batched_actions(single, rows, spec.seed)
    return lambda obs: actions.sample()


def _envpool(spec: RunSpec, asynchronous: bool) -> RunResult:
    """Time EnvPool synchronously (``step``) or asynchronously (``send``/``recv``).

    EnvPool resets a done env on its next step (the action is ignored, reward 0): that step is
    not a transition and is not counted.
    """
    n = spec.n_envs
    batch = (spec.batch_size or max(1, n // 2)) if asynchronous else n
    pool = _envpool_make(spec, batch)
    try:
        act = _actor(spec, pool.action_space, batch)
        resetting = np.zeros(n, dtype=bool)
        if asynchronous:
            pool.async_reset()
            obs, *_, info = pool.recv()
            ids = np.asarray(info["env_id"])
        else:
            obs, _ = pool.reset()
            ids = np.arange(n)

        def step() -> int:
            nonlocal obs, ids
            if asynchronous:
                pool.send(act(obs), ids)
                obs, _, term, trunc, info = pool.recv()
                ids = np.asarray(info["env_id"])
            else:
                obs, _, term, trunc, _ = pool.step(act(obs))
            real = len(ids) - int(resetting[ids].sum())
            resetting[ids] = np.logical_or(term, trunc)
            return real

        return timed_loop(spec, step)
    finally:
        with contextlib.suppress(Exception):
            pool.close()


def envpool_pool(spec: RunSpec) -> RunResult:
    """EnvPool synchronous (``batch_size == num_envs``), ``cores`` threads, its own envs only.

    The Atari games run with :data:`~benchmarks.envs.ENVPOOL_ATARI`, the preprocessing of the
    gymnasium stack.
    """
    return _envpool(spec, asynchronous=False)


def envpool_async(spec: RunSpec) -> RunResult:
    """EnvPool asynchronous: ``send``/``recv`` with ``batch_size`` (default half) of the envs.

    Each ``recv`` returns the first ``batch_size`` envs to finish their step; the agent acts
    on those while the others step.
    """
    return _envpool(spec, asynchronous=True)


def _count(batch: Any) -> int:
    """Number of transitions in an ``EpisodeBatch``."""
    lengths = getattr(batch, "lengths", None)
    if lengths is not None:
        return int(np.sum(lengths))
    return len(batch.actions)


def _missing_part(exc: BaseException) -> str | None:
    """Describe a not-yet-written part of asyncsample found in ``exc``'s chain, if any.

    That is a ``NotImplementedError``, or a ``ModuleNotFoundError`` for an ``asyncsample``
    submodule (a backend module that does not exist yet).
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, NotImplementedError):
            return f"NotImplementedError: {seen}"
        if isinstance(seen, ModuleNotFoundError) and (seen.name or "").startswith("asyncsample"):
            return f"ModuleNotFoundError: {seen}"
        seen = seen.__cause__ or seen.__context__
    return None


async def _asyncsample_run(spec: RunSpec, backend: str) -> RunResult:
    """The asyncsample measurement, inside a running event loop."""
    import asyncsample

    probe = LagProbe()
    idle: dict[str, Any] | None = None
    if spec.instrument:
        probe.start()
        await asyncio.sleep(0.3)
        await probe.stop()
        idle = probe.summary()
    kwargs: dict[str, Any] = {
        "n_workers": spec.n_workers,
        "envs_per_worker": spec.envs_per_worker,
        "backend": backend,
        "seed": spec.seed,
    }
    if backend in ("process", "ray"):
        kwargs["n_processes"] = spec.n_processes
    if spec.episode_length:
        kwargs["max_episode_length"] = spec.episode_length
    agent: Any = None
    if spec.policy:
        from benchmarks.policies import make_policy

        agent = make_policy(spec.policy, spec.env_id, seed=spec.seed)
    elif spec.inference.startswith(("batched", "eager")):
        # one shared agent for the merged calls: the built-in RandomAgent, seeded
        probe_env = gym.make(spec.env_id)
        agent = asyncsample.RandomAgent(probe_env.action_space, seed=spec.seed)
        probe_env.close()
    kwargs["inference"] = _inference(spec.inference)
    notes: list[str] = []
    env: Any = spec.env_id
    if spec.slow_worker >= 0:  # stragglers: one worker's envs cost slow_cost a step
        env = [
            functools.partial(gym.make, spec.env_id, step_cost=spec.slow_cost)
            if w == spec.slow_worker
            else functools.partial(gym.make, spec.env_id)
            for w in range(spec.n_workers)
        ]
    try:
        sampler = asyncsample.Sampler(env, agent, **kwargs)
    except ValueError as exc:
        if ":" not in spec.env_id or "env" not in str(exc):
            raise
        # gymnasium.make accepts "module:EnvId" (it imports the module); gymnasium.spec does not.
        sampler = asyncsample.Sampler(functools.partial(gym.make, spec.env_id), agent, **kwargs)
        notes.append(
            "Sampler rejected gymnasium's 'module:EnvId' id form (gymnasium.make imports the "
            "module, gymnasium.spec does not); it was given functools.partial(gym.make, id)"
        )
    if sampler.inference.auto:
        notes.append(f"inference='auto' chose {sampler.inference.describe()}")
    obtain = sampler.obtain_samples if spec.call == "samples" else sampler.obtain_fragments
    held = calls = 0

    async def call(n: int) -> int:
        nonlocal held, calls
        if spec.fraction >= 1.0:
            return _count(await obtain(n))
        batch = await obtain(n, fraction_samples=spec.fraction)
        stats = sampler.last_stats
        if stats is not None:  # each worker reached its minimum, and the call its n
            shares = [n // spec.n_workers + (w < n % spec.n_workers)
                      for w in range(spec.n_workers)]  # fmt: skip
            mins = [math.ceil(round(spec.fraction * share, 9)) for share in shares]
            per_worker = list(stats.worker_transitions)
            held += all(c >= m for c, m in zip(per_worker, mins, strict=False)) and (
                _count(batch) >= n
            )
            calls += 1
        return _count(batch)

    try:
        chunk = spec.n_envs * spec.fragment_steps
        warm = 0
        while warm < spec.warmup:
            warm += await call(min(chunk, spec.warmup))
        if spec.instrument:
            probe.start()
        done = 0
        try:
            with TimedPhase(spec) as phase:
                while phase.more(done):
                    done += await call(chunk)
        finally:
            await probe.stop()
        if calls:
            notes.append(f"fraction_samples guarantees held in {held} of {calls} calls")
        batcher = getattr(sampler, "_batcher", None)
        if batcher is not None and batcher.stats.calls:
            st = batcher.stats
            notes.append(
                f"{st.rows / st.calls:.1f} rows ({st.mean_workers:.2f} workers) per agent call"
            )
    finally:
        await sampler.aclose()
    lag = None
    if spec.instrument:
        lag = probe.summary()
        lag["idle"] = idle
    return phase.result(done, lag=lag, notes=notes)


def _inference(name: str) -> Any:
    """The ``Sampler(inference=...)`` value of a spec's inference name."""
    if name in ("auto", "per_worker", "host"):
        return name
    from asyncsample.inference import Batched

    flush, _, threaded = name.partition("-")
    return Batched(
        flush="lockstep" if flush == "batched" else "eager",  # type: ignore[arg-type]
        threaded=threaded == "threaded",
    )


def _asyncsample(spec: RunSpec, backend: str) -> RunResult:
    """Run asyncsample in ``asyncio`` with uvloop; skip if it is missing or not implemented."""
    try:
        import asyncsample

        asyncsample.Sampler  # noqa: B018 - the contract's entry point must exist
    except Exception as exc:
        raise Skipped(f"asyncsample not importable ({type(exc).__name__}: {exc})") from exc
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            result = runner.run(_asyncsample_run(spec, backend))
    except Exception as exc:
        missing = _missing_part(exc)
        if missing is not None:
            raise Skipped(f"asyncsample backend {backend!r} not available yet: {missing}") from exc
        raise
    if loop_factory is None:
        result.notes.append("uvloop not installed: ran on the default asyncio loop")
    return result


def asyncsample_process(spec: RunSpec) -> RunResult:
    """asyncsample ``backend="process"``: ``n_workers x envs_per_worker`` over ``n_processes``."""
    return _asyncsample(spec, "process")


def asyncsample_ray(spec: RunSpec) -> RunResult:
    """asyncsample ``backend="ray"``: the same layout, ``n_processes`` Ray actors (local Ray)."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise Skipped(f"ray is not installed: {exc}") from exc
    return _asyncsample(spec, "ray")


def asyncsample_local(spec: RunSpec) -> RunResult:
    """asyncsample ``backend="local"``: envs stepped in the event loop's thread (one core)."""
    return _asyncsample(spec, "local")


def asyncsample_vector(spec: RunSpec) -> RunResult:
    """``asyncsample.VectorEnv``: gymnasium's vector-env face, as a drop-in replacement of
    ``AsyncVectorEnv`` gets it: in its default placement (in the caller's process, on env
    hosts or both, as it measures); ``asyncsample-vector-hosts``: forced onto ``cores`` env-host
    processes (``n_envs / cores`` each), the face's only layout before it placed itself.
    """
    try:
        from asyncsample.vector import VectorEnv
    except ImportError as exc:
        raise Skipped(f"asyncsample.VectorEnv is not available: {exc}") from exc

    def make(fns: list[Callable[[], gym.Env]], **kwargs: Any) -> gym.vector.VectorEnv:
        return VectorEnv(spec.env_id, len(fns), **placement, **kwargs)

    placement: dict[str, int] = {}
    if spec.contender == "asyncsample-vector-hosts":
        placement = {"n_processes": spec.cores}
    result = _gym_vector(spec, make)
    return result


#: Contender key -> (function, human label).
CONTENDERS: dict[str, tuple[Callable[[RunSpec], RunResult], str]] = {
    "ideal": (ideal_single, "plain env.step loop (1 process)"),
    "sync": (gym_sync, "gymnasium SyncVectorEnv"),
    "async": (gym_async, "gymnasium AsyncVectorEnv (shm)"),
    "sb3": (sb3_subproc, "SB3 SubprocVecEnv"),
    "tianshou-subproc": (tianshou_subproc, "tianshou SubprocVectorEnv"),
    "tianshou-shmem": (tianshou_shmem, "tianshou ShmemVectorEnv"),
    "envpool": (envpool_pool, "EnvPool sync (C++ threads)"),
    "envpool-async": (envpool_async, "EnvPool async (C++ threads)"),
    "asyncsample": (asyncsample_process, "asyncsample process"),
    "asyncsample-ray": (asyncsample_ray, "asyncsample ray"),
    "asyncsample-local": (asyncsample_local, "asyncsample local"),
    "asyncsample-vector": (asyncsample_vector, "asyncsample VectorEnv"),
    "asyncsample-vector-hosts": (asyncsample_vector, "asyncsample VectorEnv (hosts)"),
}

# The contenders of modules of their own.
CONTENDERS["ceiling"] = (ceiling, "ceiling: loops side by side")
CONTENDERS.update(TORCHRL_CONTENDERS)
CONTENDERS.update(VECTOR_PEERS)


def run_contender(spec: RunSpec) -> RunResult:
    """Run ``spec.contender`` on ``spec``.

    Raises:
        Skipped: The contender cannot run here.
        KeyError: Unknown contender.
    """
    fn, _ = CONTENDERS[spec.contender]
    return fn(spec)
