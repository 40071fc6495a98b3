"""Seeds for every worker, env and agent, drawn from one ``numpy.random.SeedSequence`` tree."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator

import numpy as np

__all__ = ["OFF_LOOP_ENVS", "WorkerSeeds", "worker_seeds"]

#: From this many envs per worker, their seeds are drawn in a thread, off the event loop.
OFF_LOOP_ENVS = 4096


class WorkerSeeds:
    """The seeds of one worker: one for its agent, and for each env a new seed per (re)build,
    from its own spawned child, the same on every run and backend."""

    def __init__(self, sequence: np.random.SeedSequence, n_envs: int) -> None:
        self._sequence = sequence
        self._n_envs = n_envs
        # Made on first use (as sequence.spawn(1 + n_envs) would): a million envs build at once.
        self._envs: dict[int, np.random.SeedSequence] = {}

    @functools.cached_property
    def agent_seed(self) -> int:
        """The seed of the worker's built-in ``RandomAgent`` (drawn on first use)."""
        return _to_int(_child(self._sequence, 0))

    def next_env_seed(self, env: int) -> int:
        """The seed for the next (re)build of env ``env``."""
        if not 0 <= env < self._n_envs:
            raise IndexError(f"env {env} out of range for {self._n_envs} envs")
        child = self._envs.get(env)
        if child is None:
            child = self._envs[env] = _child(self._sequence, 1 + env)
        return _to_int(child.spawn(1)[0])

    def drawn(self, env: int) -> int:
        """How many seeds env ``env`` has drawn so far (its position in the seed tree)."""
        child = self._envs.get(env)
        return 0 if child is None else int(child.n_children_spawned)

    def seed_at(self, env: int, k: int) -> int:
        """The ``k``-th seed env ``env`` draws (from 0), without drawing it."""
        base = _child(self._sequence, 1 + env)
        return _to_int(_child(base, k))

    def set_drawn(self, env: int, drawn: int) -> None:
        """Put env ``env``'s sequence where it stands after ``drawn`` seeds (a resume)."""
        base = _child(self._sequence, 1 + env)
        self._envs[env] = np.random.SeedSequence(
            base.entropy,
            spawn_key=base.spawn_key,
            pool_size=base.pool_size,
            n_children_spawned=drawn,
        )

    def next_env_seeds(self) -> list[int]:
        """The next seed of every env, in env order."""
        return [self.next_env_seed(i) for i in range(self._n_envs)]

    async def next_env_seeds_off_loop(self) -> list[int]:
        """:meth:`next_env_seeds`, in a thread when there are many (about 50 us each)."""
        if self._n_envs < OFF_LOOP_ENVS:
            return self.next_env_seeds()
        return await asyncio.to_thread(self.next_env_seeds)


class _LazySeeds:
    """The seeds of ``n_workers`` workers, each made on first use (as ``root.spawn`` would)."""

    def __init__(self, root: np.random.SeedSequence, n_workers: int, n_envs: int) -> None:
        self._root = root
        self._n_workers = n_workers
        self._n_envs = n_envs
        self._made: dict[int, WorkerSeeds] = {}

    def __getitem__(self, index: int) -> WorkerSeeds:
        if not 0 <= index < self._n_workers:
            raise IndexError(f"worker {index} out of range for {self._n_workers} workers")
        seeds = self._made.get(index)
        if seeds is None:
            seeds = self._made[index] = WorkerSeeds(_child(self._root, index), self._n_envs)
        return seeds

    def __iter__(self) -> Iterator[WorkerSeeds]:
        return (self[i] for i in range(self._n_workers))


def worker_seeds(seed: int | None, n_workers: int, n_envs: int) -> tuple[int, _LazySeeds]:
    """The seed in use (drawn when ``seed`` is None) and the seeds of each worker."""
    if seed is None:
        seed = _to_int(np.random.SeedSequence())
    return seed, _LazySeeds(np.random.SeedSequence(seed), n_workers, n_envs)


def _child(sequence: np.random.SeedSequence, index: int) -> np.random.SeedSequence:
    """The ``index``-th child ``sequence.spawn`` gives, made without spawning the ones before."""
    return np.random.SeedSequence(
        sequence.entropy,
        spawn_key=(*sequence.spawn_key, index),
        pool_size=sequence.pool_size,
    )


def _to_int(sequence: np.random.SeedSequence) -> int:
    return int(sequence.generate_state(1, np.uint32)[0])
