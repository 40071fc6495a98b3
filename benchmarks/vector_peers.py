"""Vector-env peers of the vector study: PufferLib's multiprocessing vectorization and TorchRL's
``AsyncEnvPool``, stepped in lockstep with random actions as the gymnasium classes are.

- ``pufferlib``: ``pufferlib.vector.Multiprocessing`` (``pufferlib-core``, shared-memory step
  buffers, workers that busy-wait on a flag) with ``cores`` workers, the most it allows on this
  machine without ``overwork`` (its own default is one worker per env, refused above the core
  count); ``pufferlib-1w``: one worker holding every env, beside the caller (the configuration
  that was fastest on 2 cores). The envs are gymnasium's, through PufferLib's
  ``GymnasiumPufferEnv`` emulation; a step is ``send(actions)`` then ``recv()`` of all envs.
- ``torchrl-pool``: TorchRL's ``AsyncEnvPool`` (``backend="multiprocessing"``,
  ``exchange="shm"``: fixed-shape tensors in shared slots, readiness through queues) with
  ``n_envs / cores`` ``GymEnv``s per worker; a step is ``step_and_maybe_reset`` of the whole
  batch (TorchRL's autoreset).

Both are optional: ``pufferlib-core`` 3.0.23 requires another torch than the project's (its
wheel pulls torch 2.9 and CUDA), so it is not in the ``bench`` extra (``pip install --no-deps
pufferlib-core`` to measure it); TorchRL is the ``bench`` extra's. Without them these contenders
are skipped, saying why.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.runs import RunResult, RunSpec

__all__ = ["VECTOR_PEERS"]


def _puffer_env(env_id: str, buf: Any = None, seed: int = 0) -> Any:
    """PufferLib's emulation of a gymnasium env (its workers pass their buffers and seeds)."""
    import gymnasium as gym
    import pufferlib.emulation

    return pufferlib.emulation.GymnasiumPufferEnv(
        env_creator=functools.partial(gym.make, env_id), buf=buf, seed=seed
    )


def _pufferlib(spec: RunSpec, workers: int) -> RunResult:
    from benchmarks.runs import Skipped, batched_actions, timed_steps

    try:
        import pufferlib
        import pufferlib.vector
    except Exception as exc:
        raise Skipped(
            f"pufferlib not importable ({type(exc).__name__}: {exc}); pip install --no-deps "
            "pufferlib-core (its wheel pulls another torch)"
        ) from exc
    n = spec.n_envs
    workers = max(1, min(workers, n))
    while n % workers:
        workers -= 1
    venv = None
    try:
        venv = pufferlib.vector.make(
            functools.partial(_puffer_env, spec.env_id),
            backend=pufferlib.vector.Multiprocessing,
            num_envs=n,
            num_workers=workers,
            batch_size=n,
            overwork=True,
            seed=spec.seed,
        )
        venv.async_reset(spec.seed)
        venv.recv()

        def step(action: Any) -> int:
            venv.send(action)
            venv.recv()
            return n

        actions = batched_actions(venv.single_action_space, n, spec.seed)
        result = timed_steps(spec, step, actions)
        result.notes.append(
            f"pufferlib {getattr(pufferlib, '__version__', '?')}, {workers} workers"
        )
        return result
    finally:
        if venv is not None:
            venv.close()


def pufferlib_default(spec: RunSpec) -> RunResult:
    """PufferLib ``Multiprocessing`` with one worker per core (``cores``)."""
    return _pufferlib(spec, spec.cores)


def pufferlib_one_worker(spec: RunSpec) -> RunResult:
    """PufferLib ``Multiprocessing`` with one worker for every env, beside the caller."""
    return _pufferlib(spec, 1)


def _torchrl_env(env_id: str) -> Any:
    from torchrl.envs import GymEnv

    return GymEnv(env_id, categorical_action_encoding=True)


def torchrl_pool(spec: RunSpec) -> RunResult:
    """TorchRL ``AsyncEnvPool`` (multiprocessing, shared-memory exchange), lockstep."""
    from benchmarks.runs import Skipped, timed_loop

    try:
        import torch
        import torchrl
        from torchrl.envs import AsyncEnvPool
    except Exception as exc:
        raise Skipped(
            f"torchrl AsyncEnvPool not importable ({type(exc).__name__}: {exc}); "
            "pip install 'asyncsample[bench]'"
        ) from exc
    torch.set_num_threads(1)
    torch.manual_seed(spec.seed)
    n = spec.n_envs
    per_worker = max(1, n // max(1, spec.cores))
    while n % per_worker:
        per_worker -= 1
    pool = None
    try:
        pool = AsyncEnvPool(
            [functools.partial(_torchrl_env, spec.env_id)] * n,
            backend="multiprocessing",
            exchange="shm",
            envs_per_worker=per_worker,
        )
        td = pool.reset()
        spec_ = pool.full_action_spec[pool.action_key]

        def step() -> int:
            nonlocal td
            td.set(pool.action_key, spec_.rand())
            _, td = pool.step_and_maybe_reset(td)
            return n

        result = timed_loop(spec, step)
        result.notes.append(
            f"torchrl {torchrl.__version__}, {n // per_worker} workers x {per_worker} envs, "
            f"exchange {getattr(pool, 'resolved_exchange', 'shm')}"
        )
        return result
    finally:
        if pool is not None:
            pool.close()


VECTOR_PEERS = {
    "pufferlib": (pufferlib_default, "PufferLib Multiprocessing (a worker per core)"),
    "pufferlib-1w": (pufferlib_one_worker, "PufferLib Multiprocessing (1 worker)"),
    "torchrl-pool": (torchrl_pool, "TorchRL AsyncEnvPool (multiprocessing, shm)"),
}
