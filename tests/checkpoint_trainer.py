"""A trainer loop that checkpoints its model and its sampler together, for test_checkpoint.py.

Run as a script it trains on ``--batches`` stream batches, writing each batch it consumed to
``<out>/batch-<i>.pkl`` and, every ``--every`` batches, a checkpoint: a folder
``<out>/step-<i>`` with the model and the sampler state, then ``<out>/LATEST`` (naming it)
replaced atomically. With ``--resume`` it starts from ``LATEST``. The test kills it with SIGKILL
and starts it again; :func:`train` is also awaited in the test's own process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pickle
import sys
import time
from typing import Any

import cloudpickle
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from async_envs import RandomLengthAsyncEnv, RandomLengthEnv

from asyncsample import Replayable, Sampler, SamplerState

# The env hosts import async_envs by name (tests/ is on sys.path above, and a host inherits the
# caller's path). It must not travel by value: its classes would carry the module's registry of
# open envs (async_envs._OPEN), and pickling fails whenever one of those envs holds a lock. This
# module's own classes travel by value when a test imports it.
if __name__ != "__main__":
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

SEED = 23
NUM_SAMPLES = 24


class ObservingAgent:
    """Actions that depend only on the observation (the reproducibility contract)."""

    def get_actions(self, observations: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        return (observations[:, 1] > 0.5).astype(np.int64), {}


def blocking_env() -> RandomLengthEnv:
    return RandomLengthEnv(2, 15)


def async_env() -> RandomLengthAsyncEnv:
    return RandomLengthAsyncEnv(2, 15)


def make_sampler(backend: str, resume: SamplerState | None = None) -> Sampler:
    """The sampler of every run: async envs on ``asyncio``, blocking envs elsewhere."""
    env = async_env if backend == "asyncio" else blocking_env
    return Sampler(
        Replayable(env),
        ObservingAgent(),
        n_workers=2,
        envs_per_worker=3,
        seed=SEED,
        backend=backend,
        n_processes=2,
        resume=resume,
        fixed_shares=True,  # bit for bit: the fixed split (steps in flight would drop)
    )


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


async def train(
    backend: str,
    out: str | None,
    batches: int,
    every: int,
    *,
    fragments: bool = False,
    resume: bool = False,
    delay: float = 0.0,
) -> list[Any]:
    """Train on ``batches`` batches (from the last checkpoint with ``resume``); the batches
    consumed in this run."""
    model = {"consumed": 0, "reward_sum": 0.0}  # what the "trainer" learns
    state = None
    if resume:
        assert out is not None
        with open(os.path.join(out, "LATEST")) as f:
            step = os.path.join(out, f.read().strip())
        with open(os.path.join(step, "model.json")) as f:
            model = json.load(f)
        state = SamplerState.load(os.path.join(step, "sampler.state"))
    seen = []
    async with make_sampler(backend, state) as sampler:
        stream = sampler.stream(NUM_SAMPLES, fragments=fragments)
        async with contextlib.aclosing(stream) as it:
            async for batch in it:
                i = model["consumed"]
                model["consumed"] = i + 1
                model["reward_sum"] += float(batch.rewards.sum())
                seen.append(batch)
                if out is not None:
                    _write_atomically(os.path.join(out, f"batch-{i}.pkl"), pickle.dumps(batch))
                if out is not None and model["consumed"] % every == 0:
                    # The model and the sampler, read between the same two batches.
                    sampler_state = await sampler.checkpoint()
                    step = os.path.join(out, f"step-{model['consumed']}")
                    os.makedirs(step, exist_ok=True)
                    sampler_state.save(os.path.join(step, "sampler.state"))
                    _write_atomically(os.path.join(step, "model.json"), json.dumps(model).encode())
                    _write_atomically(os.path.join(out, "LATEST"), os.path.basename(step).encode())
                if model["consumed"] >= batches:
                    break
                if delay:
                    time.sleep(delay)  # the trainer's own work, blocking the loop
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, required=True)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--fragments", action="store_true")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop"])
    args = parser.parse_args()
    run = train(
        args.backend,
        args.out,
        args.batches,
        args.every,
        fragments=args.fragments,
        resume=args.resume,
        delay=args.delay,
    )
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(run)
    else:
        asyncio.run(run)


if __name__ == "__main__":
    main()
