"""Which worker lives on which member of a pool (processes, Ray actors), for every backend:
worker ``w`` on member ``w % n``, in slot ``w // n``, so that one worker's agent compute
overlaps the next one's env compute."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Placement", "placement", "pool_size"]

_T = TypeVar("_T")


def pool_size(n_processes: int | None, n_workers: int, workers_per_actor: int | None = None) -> int:
    """How many members a pool of ``n_workers`` gets: ``ceil(n_workers / workers_per_actor)``
    (Ray's option), else ``n_processes`` (default: the CPU count), at most one per worker."""
    if workers_per_actor is not None:
        return math.ceil(n_workers / workers_per_actor)
    return min(n_processes or os.cpu_count() or 1, n_workers)


@dataclass(frozen=True)
class Placement:
    """``n_workers`` workers (or groups of sub-envs) over ``n_members`` pool members."""

    n_workers: int
    n_members: int

    def member(self, worker: int) -> int:
        """The member that hosts ``worker``."""
        return worker % self.n_members

    def slot(self, worker: int) -> int:
        """``worker``'s slot (index among the workers) in its member."""
        return worker // self.n_members

    def workers(self, member: int) -> range:
        """The workers of ``member``, in slot order."""
        return range(member, self.n_workers, self.n_members)

    def split(self, items: Sequence[_T]) -> list[list[_T]]:
        """``items`` (one per worker) grouped per member, each in slot order."""
        return [[items[w] for w in self.workers(m)] for m in range(self.n_members)]


def placement(
    n_workers: int, n_processes: int | None = None, workers_per_actor: int | None = None
) -> Placement:
    """Where ``n_workers`` workers live in a pool sized by :func:`pool_size`."""
    return Placement(n_workers, pool_size(n_processes, n_workers, workers_per_actor))
