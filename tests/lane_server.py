"""A host of async envs driven in the test's own loop: its server (a ``LaneActor``, the Ray
actor class, called directly) given whole-worker requests and lane requests in the orders a
test picks, and its lane replies by key."""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any

import cloudpickle
from async_envs import CountingAsyncEnv

from asyncsample.backends._lane_serve import PENDING, LaneKind, LaneOptions
from asyncsample.backends._ray_actor import LaneActor
from asyncsample.backends._remote import slots_blob
from asyncsample.backends._transport import ST_OK, Op, with_version
from asyncsample.backends.base import HostSpec
from asyncsample.inference.host import with_seed


class LaneServerHost:
    """Slots of one env each (``make_env``; by default episodes of 50 steps), each with a copy
    of one pickled ``agent`` at version 0 and its worker's seed, as the sampler installs them
    (copies alike share one copy and its calls); no ``step_timeout``, metrics off."""

    def __init__(
        self, agent: Any, n_slots: int = 1, make_env: Callable[[], Any] | None = None
    ) -> None:
        self.make_env = make_env or functools.partial(CountingAsyncEnv, 50)
        probe = self.make_env()
        specs = [
            HostSpec(w, 1, probe.observation_space, probe.action_space, None, lanes=True)
            for w in range(n_slots)
        ]
        self.actor = LaneActor(slots_blob(specs), LaneOptions(None, 1.0, None))
        self.agent = agent
        self.n_slots = n_slots
        self.replies: dict[int, Any] = {}

    async def start(self) -> None:
        """Build each slot's env, install its agent copy, reset the env (keys 100, 101, ...)."""
        agent = cloudpickle.dumps(self.agent)
        chains = cloudpickle.dumps(([[self.make_env]], [0]))
        for w in range(self.n_slots):
            await self.serve(w, Op.BUILD, chains)
            await self.serve(w, Op.AGENT, with_version(0, with_seed(agent, 7 + w)))
            self.submit((LaneKind.RESET, 100 + w, w, 0, PENDING, None, None))
            await self.until(100 + w)

    async def serve(self, worker: int, op: int, body: bytes) -> None:
        status, payload = pickle.loads(await self.actor.serve(worker, int(op), body))
        assert status == ST_OK, payload

    def update(self, version: int, params: Any, slot: int = 0) -> Any:
        """Slot ``slot``'s parameter update, its task started now (not awaited)."""
        body = with_version(version, pickle.dumps(params))
        return self.actor._server().call(slot, Op.PARAMS, body)

    def submit(self, request: tuple[Any, ...]) -> None:
        """One lane request (``(kind, key, slot, env, ...)``, see ``LaneKind``), started now."""
        self.actor._server().handle(pickle.dumps([request]))

    async def until(self, key: int) -> Any:
        """The value of request ``key``'s reply (``(value, observation, final observation)``:
        the actor's replies carry the rows)."""
        while key not in self.replies:
            batches, _clocks = await self.actor.replies()
            for body in batches:
                for k, status, value in pickle.loads(body):
                    assert status == ST_OK, value
                    self.replies[k] = value
        return self.replies[key]

    async def close(self) -> None:
        await self.actor.shutdown()
