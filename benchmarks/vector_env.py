"""asyncsample.VectorEnv against gymnasium's vector envs: random actions, 8 envs, 2 processes.

Three pairings, each timed on the same fixed random action sequence, no policy in the loop
(agent steps per second = vector steps x 8):

* CartPole-v1: ``VectorEnv`` vs ``AsyncVectorEnv(shared_memory=True)`` (one process per env),
* FixedCost-v0 (200 us of CPU per step): ``VectorEnv`` vs ``SyncVectorEnv`` (the 2-core ideal
  is 2x; what a process pool can win over stepping in-process),
* Image-v0 (84x84x4 uint8 observations): ``VectorEnv`` vs ``AsyncVectorEnv(shared_memory=True)``.

Run::

    python -m benchmarks.vector_env                     # writes benchmarks/results/vector_env.*
    python -m benchmarks.vector_env --seconds 3 --repeats 3

Each contender is measured ``repeats`` times for about ``seconds`` each (after a warm-up), the
best run is kept (the machine is shared: the best run is the least disturbed one), and the load
average is recorded with the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import psutil

from benchmarks.envs import full_id

RESULTS = Path(__file__).resolve().parent / "results"
N_ENVS = 8
N_PROCESSES = 2

PAIRS = [
    ("CartPole-v1", "AsyncVectorEnv(shared_memory=True)", 2.0),
    ("FixedCost-v0", "SyncVectorEnv", 1.4),
    ("Image-v0", "AsyncVectorEnv(shared_memory=True)", 1.5),
]


def make_peer(name: str, env_id: str) -> Any:
    fns = [lambda: gym.make(env_id) for _ in range(N_ENVS)]
    if name == "SyncVectorEnv":
        return gym.vector.SyncVectorEnv(fns)
    return gym.vector.AsyncVectorEnv(fns, shared_memory=True)


def make_ours(env_id: str) -> Any:
    from asyncsample.vector import VectorEnv

    return VectorEnv(env_id, N_ENVS, n_processes=N_PROCESSES)


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and every live descendant so far."""
    total = 0.0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


def measure(make: Callable[[], Any], seconds: float, repeats: int) -> tuple[float, float, float]:
    """Best vector steps per second over ``repeats`` timed runs of about ``seconds`` each, the
    CPU time all processes spent per vector step over all runs (a figure the machine's other
    load disturbs far less than wall time: it shows what each step costs, not who got the cores),
    and the part of it the main process spent (on 2 cores, taken from the envs' processes).
    """
    env = make()
    try:
        env.reset(seed=0)
        rng = np.random.default_rng(0)
        actions = [env.action_space.sample() for _ in range(256)]
        rng.shuffle(actions)
        for a in actions[:50]:  # warm-up
            env.step(a)
        best = 0.0
        total_steps = 0
        cpu_start = cpu_seconds()
        main_start = time.process_time()
        for _ in range(repeats):
            steps = 0
            start = time.perf_counter()
            while True:
                for a in actions[:64]:
                    env.step(a)
                steps += 64
                elapsed = time.perf_counter() - start
                if elapsed >= seconds:
                    break
            best = max(best, steps / elapsed)
            total_steps += steps
        main_cpu = (time.process_time() - main_start) / total_steps
        return best, (cpu_seconds() - cpu_start) / total_steps, main_cpu
    finally:
        env.close()


def run(seconds: float, repeats: int) -> dict[str, Any]:
    rows = []
    load_before = os.getloadavg()
    for env_name, peer, target in PAIRS:
        env_id = full_id(env_name)
        ours, ours_cpu, ours_main = measure(
            lambda env_id=env_id: make_ours(env_id), seconds, repeats
        )
        theirs, theirs_cpu, theirs_main = measure(
            lambda env_id=env_id, peer=peer: make_peer(peer, env_id), seconds, repeats
        )
        rows.append(
            {
                "env": env_name,
                "peer": peer,
                "ours_steps_per_s": ours * N_ENVS,
                "peer_steps_per_s": theirs * N_ENVS,
                "ratio": ours / theirs,
                "target": target,
                "ours_cpu_us_per_agent_step": ours_cpu / N_ENVS * 1e6,
                "peer_cpu_us_per_agent_step": theirs_cpu / N_ENVS * 1e6,
                "ours_main_cpu_us_per_step": ours_main * 1e6,
                "peer_main_cpu_us_per_step": theirs_main * 1e6,
            }
        )
        print(
            f"{env_name:13s} VectorEnv {ours * N_ENVS:9.0f} agent steps/s, {peer} "
            f"{theirs * N_ENVS:9.0f}: {ours / theirs:.2f}x (target {target}x); CPU per agent "
            f"step {ours_cpu / N_ENVS * 1e6:.0f} us vs {theirs_cpu / N_ENVS * 1e6:.0f} us; main "
            f"process CPU per vector step {ours_main * 1e6:.0f} us vs {theirs_main * 1e6:.0f} us",
            flush=True,
        )
    return {
        "n_envs": N_ENVS,
        "n_processes": N_PROCESSES,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "gymnasium": gym.__version__,
        "seconds": seconds,
        "repeats": repeats,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# asyncsample.VectorEnv vs gymnasium vector envs ({result['n_envs']} envs, "
        f"{result['n_processes']} processes, random actions, no policy)",
        "",
        "| env | VectorEnv agent steps/s | peer | peer agent steps/s | ratio | target "
        "| CPU us per agent step (ours / peer) | main-process CPU us per vector step "
        "(ours / peer) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['env']} | {r['ours_steps_per_s']:.0f} | {r['peer']} | "
            f"{r['peer_steps_per_s']:.0f} | {r['ratio']:.2f}x | {r['target']}x | "
            f"{r['ours_cpu_us_per_agent_step']:.0f} / {r['peer_cpu_us_per_agent_step']:.0f} | "
            f"{r['ours_main_cpu_us_per_step']:.0f} / {r['peer_main_cpu_us_per_step']:.0f} |"
        )
    before = ", ".join(f"{x:.1f}" for x in result["load_average_before"])
    after = ", ".join(f"{x:.1f}" for x in result["load_average_after"])
    lines += [
        "",
        f"{result['cpus']} CPUs; load average (1, 5, 15 min) {before} before, {after} after. "
        f"Best of {result['repeats']} runs of {result['seconds']}s each.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = run(args.seconds, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vector_env.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "vector_env.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
