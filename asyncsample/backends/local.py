"""The ``local`` backend: envs stepped in the event loop's thread, no IPC.

For cheap envs and debugging. A step blocks the loop for as long as the env takes, so
``step_timeout`` cannot be honoured here (the sampler rejects it).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from asyncsample.backends.base import EnvHost, HostSpec, failure_error
from asyncsample.env_group import EnvFailureError, EnvGroup, StepBuffers, StepInfos
from asyncsample.env_update import EnvSource

__all__ = ["LocalBackend", "LocalHost"]


class LocalHost:
    """Hosts one worker's envs in the main process."""

    def __init__(self, spec: HostSpec) -> None:
        self.spec = spec
        self.buffers = StepBuffers.allocate(spec.observation_space, spec.action_space, spec.n_envs)
        self._group = EnvGroup(
            spec.worker,
            self.buffers,
            spec.observation_space,
            spec.action_space,
            spec.max_episode_length,
        )

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except EnvFailureError as exc:
            failure = exc.failure
            if not failure.retry:
                # The caller's own mistake, raised where it happened: no host boundary to cross.
                raise failure.error from None
            raise failure_error(self.spec.worker, failure) from failure.error

    async def build(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        self._call(self._group.build, chains, seeds)

    async def update(self, updates: Sequence[EnvSource | None], seeds: Sequence[int]) -> None:
        self._call(self._group.update, updates, seeds)

    async def reset(self, mask: np.ndarray) -> dict[int, dict[str, object]]:
        result: dict[int, dict[str, object]] = self._call(self._group.reset, mask)
        return _snapshot(result) if result else result

    async def step(self, mask: np.ndarray) -> StepInfos:
        result: StepInfos = self._call(self._group.step, mask)
        if result.env_infos is not None or result.reset_infos:
            result = StepInfos(_snapshot(result.env_infos), _snapshot(result.reset_infos))
        # Let other tasks run between steps: a call is many steps, the loop must not wait for
        # all of them.
        await asyncio.sleep(0)
        return result

    async def restart(self, chains: Sequence[Sequence[EnvSource]], seeds: Sequence[int]) -> None:
        await self.build(chains, seeds)

    async def close(self) -> None:
        self._group.close()


_SCALARS = frozenset({int, float, bool, str, bytes, complex, type(None)})


def _snapshot(infos: Any) -> Any:
    """A copy of info dicts with the values the process backend would deliver.

    Envs may reuse their info dict or mutate arrays they put in it; without a copy the batch
    would show their latest values, unlike every other backend (which pickle the infos). Plain
    dicts, lists and arrays are copied directly and immutable scalars shared, which costs less
    than a pickle round trip; anything else is deep-copied.
    """
    kind = type(infos)
    if kind in _SCALARS:
        return infos
    if kind is dict:
        return {k: v if type(v) in _SCALARS else _snapshot(v) for k, v in infos.items()}
    if kind is list:
        return [_snapshot(v) for v in infos]
    if kind is tuple:
        return tuple(_snapshot(v) for v in infos)
    if kind is np.ndarray:
        return infos.copy()
    if isinstance(infos, np.generic):  # numpy scalars are immutable
        return infos
    return copy.deepcopy(infos)


class LocalBackend:
    """Creates a :class:`LocalHost` per worker."""

    def __init__(self, **_options: object) -> None:
        self._hosts: list[LocalHost] = []

    async def start(self, specs: Sequence[HostSpec]) -> list[EnvHost]:
        self._hosts = [LocalHost(spec) for spec in specs]
        return list(self._hosts)

    async def aclose(self) -> None:
        for host in self._hosts:
            await host.close()
        self._hosts = []
