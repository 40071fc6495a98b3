"""What ``inference="host"`` costs per step inside an env host, besides the env itself.

An env host runs a worker's chunk with its agent copy (``ChunkRunner``): per worker step it
copies the observations into the chunk's rows, asks the agent, checks and stores the actions,
steps the slot's envs (``EnvGroup.step``) and records rewards, flags and episode ends. That
machinery is paid once per *slot*-step, so with one env per slot (the 8x1 layout) it is paid for
every env step. This study runs the loop in this process, with no other process and no IPC, on
the same envs as a plain ``env.step`` loop with pre-drawn actions (the ceiling's loop), and
reports the difference per slot-step: the host's own cost, which the ``host`` study's ratios to
the ceiling cannot separate from waiting and scheduling.

Run it as ``asyncsample bench hostloop`` (or ``python -m benchmarks.hostloop``). With
``PYTHONPATH=OTHER_TREE`` it measures another source tree's loop (the API it uses is old).
"""

from __future__ import annotations

import argparse
import functools
import pickle
import platform
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np

import asyncsample
import benchmarks.envs  # registers the benchmark envs
from asyncsample._engine import CallMode, StopRule
from asyncsample.agent import RandomAgent
from asyncsample.backends._chunk import ChunkRequest, chunk_rows, chunk_sets
from asyncsample.backends._chunk_loop import ChunkRunner
from asyncsample.env_group import EnvGroup, StepBuffers
from benchmarks.report import write_own_results

__all__ = ["main", "measure"]

ENVS = ["NoOp-v0", "CartPole-v1", "FixedCost-v0"]
SLOT_ENVS = [1, 4, 8, 16]
CHUNK = 64
#: The results page's section (``docs/performance.md`` copies it: ``asyncsample bench --pages``).
HEADING = "The env host's own cost per step"


def _best_of(rounds: int, fn: Callable[[], int]) -> float:
    """The fastest of ``rounds`` timings of ``fn``, in microseconds per unit it reports."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        units = fn()
        best = min(best, (time.perf_counter() - t0) / units * 1e6)
    return best


def measure(env_id: str, n_envs: int, chunks: int, rounds: int) -> dict[str, Any]:
    """Microseconds per slot-step of the chunk loop and per step of a plain loop on ``env_id``."""
    make = functools.partial(gym.make, benchmarks.envs.full_id(env_id))
    probe = make()
    obs_space, act_space = probe.observation_space, probe.action_space
    buffers = StepBuffers.allocate(obs_space, act_space, n_envs)
    group = EnvGroup(0, buffers, obs_space, act_space, None)
    group.build([[make]] * n_envs, list(range(n_envs)))
    group.reset(np.ones(n_envs, dtype=bool))
    flat = StepBuffers.allocate(obs_space, act_space, chunk_rows(CHUNK, 2) * n_envs)
    runner = ChunkRunner(group, chunk_sets(flat, CHUNK, n_envs), act_space)
    runner.install(pickle.dumps((cloudpickle.dumps(RandomAgent(act_space, seed=0)), 0)))

    def chunk_loop() -> int:
        for _ in range(chunks):
            rule = StopRule.for_call(CallMode.FRAGMENTS, CHUNK * n_envs, n_envs)
            counts, active = np.zeros(n_envs, np.int64), np.ones(n_envs, dtype=bool)
            runner.run(ChunkRequest(rule, CHUNK, counts, active))
        return chunks * CHUNK

    probe.reset(seed=0)
    act_space.seed(0)
    actions = [act_space.sample() for _ in range(1024)]

    def plain_loop() -> int:
        n = chunks * CHUNK * n_envs
        for k in range(n):
            _, _, term, trunc, _ = probe.step(actions[k & 1023])
            if term or trunc:
                probe.reset()
        return n

    chunk_loop()  # warm-up
    slot_step = _best_of(rounds, chunk_loop)
    env_step = _best_of(rounds, plain_loop)
    own = slot_step - env_step * n_envs
    probe.close()
    group.close()
    return {
        "env": env_id,
        "envs_per_slot": n_envs,
        "slot_step_us": slot_step,
        "plain_env_step_us": env_step,
        "host_own_us_per_slot_step": own,
        "host_own_us_per_env_step": own / n_envs,
        "host_own_share": own / slot_step,
    }


def table(result: dict[str, Any]) -> str:
    """The results as a markdown page."""
    lines = [
        "# asyncsample benchmarks: hostloop",
        "",
        f"{result['date']} · Python {result['python']} · asyncsample from `{result['tree']}`",
        "",
        f"## {HEADING}",
        "",
        "The host's chunk loop (`ChunkRunner`, a random agent) run in one process, against a "
        "plain `env.step` loop with pre-drawn actions on the same env (the ceiling's loop); "
        f"best of {result['rounds']} rounds of {result['chunks']} chunks of {CHUNK} steps. "
        "`own`: the loop's time per slot-step minus the plain loop's for the same env steps.",
        "",
        "| env | envs per slot | slot-step us | plain env step us | own us per slot-step "
        "| own us per env step | own share of a slot-step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['env']} | {r['envs_per_slot']} | {r['slot_step_us']:.1f} | "
            f"{r['plain_env_step_us']:.1f} | {r['host_own_us_per_slot_step']:.1f} | "
            f"{r['host_own_us_per_env_step']:.2f} | {r['host_own_share']:.1%} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hostloop", description=__doc__)
    parser.add_argument("--envs", nargs="+", default=ENVS)
    parser.add_argument("--slot-envs", nargs="+", type=int, default=SLOT_ENVS)
    parser.add_argument("--chunks", type=int, default=40, help="chunks per timed round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 chunks, 2 rounds")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "hostloop")
    args = parser.parse_args(argv)
    chunks, rounds = (2, 2) if args.quick else (args.chunks, args.rounds)
    rows = []
    for env_id in args.envs:
        for n in args.slot_envs:
            # FixedCost spends 200 us per env step: fewer chunks keep its rounds short.
            k = max(1, chunks // 8) if env_id == "FixedCost-v0" else chunks
            rows.append(measure(env_id, n, k, rounds))
            print(
                f"{env_id} {n} envs per slot: own {rows[-1]['host_own_us_per_slot_step']:.1f} "
                "us per slot-step",
                flush=True,
            )
    result = {
        "study": "hostloop",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "tree": str(Path(asyncsample.__file__).resolve().parents[1]),
        "settings": {"quick": args.quick},
        "chunks": chunks,
        "rounds": rounds,
        "rows": rows,
    }
    write_own_results(args.out, result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
