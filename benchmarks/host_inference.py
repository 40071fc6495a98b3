"""``inference="host"`` (the agent inside the env hosts) against the ratios it is built for.

Run from the repository root::

    python -m benchmarks.host_inference            # about 3 minutes
    python -m benchmarks.host_inference --seconds 2 # shorter runs

Every asyncsample run uses the built-in seeded random agent (``agent=None``), so in ``"host"``
mode the agent runs in the env hosts, and loops ``obtain_fragments`` (no episode thrown away:
steps/s is the sampler's throughput). Measured:

- FixedCost-v0 (200 us of CPU per step) and HeavyTail-v0 (same mean, heavy tail): steps/s as a
  percentage of the 2-core ideal (2 x a plain single-process ``env.step`` loop), ``"host"`` and
  ``"per_worker"`` side by side. Targets: 92% and 90%.
- CartPole-v1, 8 envs: ``"host"`` against gymnasium's ``AsyncVectorEnv(shared_memory=True)``
  stepped with random actions. Target: >= 4x.
- The main process's CPU (user + system, all threads) per second of wall time while sampling
  FixedCost-v0 with ``"host"``. Target: under 10% of one core.
- ``backend="ray"`` against ``backend="process"``, both ``"host"``: CartPole-v1, 4 workers x 32
  envs, 2 actors / processes. Target: >= 0.7x.

On a busy machine the %-of-ideal figures measure the machine more than the sampler, so every run
also reports the hosts' CPU efficiency: steps per CPU second the env hosts consumed, as a
fraction of what a plain single-process loop does per CPU second (1.0: the hosts spend all their
CPU on the envs themselves). It does not depend on how much CPU other processes took.

The load of the machine (``os.getloadavg``) is recorded before and after every run: the numbers
are only as good as the machine was quiet. Results: ``benchmarks/results/host_inference.json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from benchmarks.envs import full_id

RESULTS = Path(__file__).resolve().parent / "results"


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def ideal_rate(env_id: str, seconds: float) -> float:
    """Steps per CPU second of a plain ``env.step`` loop over one env (one core's worth)."""
    env = gym.make(env_id)
    env.reset(seed=0)
    env.action_space.seed(0)
    actions = [env.action_space.sample() for _ in range(1024)]
    steps, start = 0, time.perf_counter()
    cpu0 = time.thread_time()
    while time.perf_counter() - start < seconds:
        for i in range(256):
            _, _, term, trunc, _ = env.step(actions[i])
            if term or trunc:
                env.reset()
        steps += 256
    cpu = time.thread_time() - cpu0
    env.close()
    # Per CPU second (the env spends CPU time): what one fully used core does.
    return steps / cpu


async def sampler_rate(
    env_id: str,
    inference: str,
    *,
    n_workers: int,
    envs_per_worker: int,
    n_processes: int,
    seconds: float,
    call_steps: int,
    backend: str = "process",
) -> dict[str, float]:
    """Steps/s of ``obtain_fragments(call_steps)`` in a loop, and the main process's CPU share."""
    import psutil

    from asyncsample import Sampler

    async with Sampler(
        env_id,
        None,
        n_workers=n_workers,
        envs_per_worker=envs_per_worker,
        n_processes=n_processes,
        seed=0,
        backend=backend,
        inference=inference,
    ) as s:
        for _ in range(2):  # warm-up: hosts started, buffers grown
            await s.obtain_fragments(call_steps)
        pids = list(getattr(s._backend, "pids", []))
        hosts = [psutil.Process(p) for p in pids]

        def host_cpu() -> float:
            return sum(sum(h.cpu_times()[:2]) for h in hosts)

        load = _load()
        steps = 0
        h0 = host_cpu() if hosts else 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            steps += (await s.obtain_fragments(call_steps)).n_transitions
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        hcpu = host_cpu() - h0 if hosts else float("nan")
    return {
        "steps_per_s": steps / wall,
        "main_cpu_share": cpu / wall,
        "steps_per_host_cpu_s": steps / hcpu if hosts else float("nan"),
        "load_before": load,
        "load_after": _load(),
    }


def async_vector_rate(env_id: str, n_envs: int, seconds: float) -> float:
    """Steps/s of gymnasium's ``AsyncVectorEnv`` (shared memory) stepped with random actions."""
    envs = gym.vector.AsyncVectorEnv([lambda: gym.make(env_id) for _ in range(n_envs)])
    try:
        envs.reset(seed=0)
        envs.action_space.seed(0)
        for _ in range(50):
            envs.step(envs.action_space.sample())
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            envs.step(envs.action_space.sample())
            steps += n_envs
        return steps / (time.perf_counter() - start)
    finally:
        envs.close()


def ray_vs_process(seconds: float) -> dict[str, Any]:
    """CartPole-v1, 4 workers x 32 envs, 2 hosts: ``"host"`` on ray against process.

    The process run comes first, before Ray starts (its idle daemons would slow it).
    """
    import ray

    layout = {"n_workers": 4, "envs_per_worker": 32, "n_processes": 2, "call_steps": 8192}
    proc = asyncio.run(sampler_rate("CartPole-v1", "host", seconds=seconds, **layout))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = asyncio.run(
            sampler_rate("CartPole-v1", "host", seconds=seconds, backend="ray", **layout)
        )
    finally:
        ray.shutdown()
    out = {"process": proc, "ray": on_ray, "x_process": on_ray["steps_per_s"] / proc["steps_per_s"]}
    print("ray vs process", out, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="length of each timed run")
    parser.add_argument("--no-ray", action="store_true", help="skip the ray run")
    args = parser.parse_args()
    seconds = args.seconds
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_at_start": _load(),
        },
        "runs": {},
    }
    runs = results["runs"]
    layout = {"n_workers": 4, "envs_per_worker": 8, "n_processes": 2, "call_steps": 2048}
    for name in ("FixedCost-v0", "HeavyTail-v0"):
        env_id = full_id(name)
        single = ideal_rate(env_id, seconds / 2)
        ideal = single * (os.cpu_count() or 1)
        row: dict[str, Any] = {"single_core_steps_per_s": single, "ideal_steps_per_s": ideal}
        for inference in ("host", "per_worker"):
            r = asyncio.run(sampler_rate(env_id, inference, seconds=seconds, **layout))
            r["pct_of_ideal"] = 100 * r["steps_per_s"] / ideal
            r["host_cpu_efficiency"] = r["steps_per_host_cpu_s"] / single
            row[inference] = r
            print(name, inference, {k: round(v, 3) for k, v in r.items()}, flush=True)
        runs[name] = row
    cart = {"n_workers": 2, "envs_per_worker": 4, "n_processes": 2, "call_steps": 4096}
    host = asyncio.run(sampler_rate("CartPole-v1", "host", seconds=seconds, **cart))
    vec = async_vector_rate("CartPole-v1", 8, seconds)
    runs["CartPole-v1 8 envs"] = {
        "host": host,
        "async_vector_env_steps_per_s": vec,
        "x_async_vector_env": host["steps_per_s"] / vec,
    }
    print("CartPole 8 envs", host, vec, flush=True)
    if not args.no_ray:
        runs["CartPole-v1 4x32 ray vs process"] = ray_vs_process(seconds)
    results["machine"]["load_at_end"] = _load()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "host_inference.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "host_inference.md").write_text(_markdown(results))
    print(_markdown(results))


def _markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "# inference='host' (python -m benchmarks.host_inference)",
        "",
        f"{m['cpus']} CPUs, Python {m['python']}; load average (1 min) {m['load_at_start']} at "
        f"the start, {m.get('load_at_end')} at the end: other processes were using the cores, "
        "so these are lower bounds.",
        "",
        "| env | mode | steps/s | % of 2-core ideal | host CPU efficiency | main-process CPU "
        "| load before/after |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("FixedCost-v0", "HeavyTail-v0"):
        row = results["runs"][name]
        for mode in ("host", "per_worker"):
            r = row[mode]
            lines.append(
                f"| {name} | {mode} | {r['steps_per_s']:,.0f} | {r['pct_of_ideal']:.0f}% | "
                f"{100 * r['host_cpu_efficiency']:.0f}% | {100 * r['main_cpu_share']:.1f}% | "
                f"{r['load_before']}/{r['load_after']} |"
            )
    cart = results["runs"]["CartPole-v1 8 envs"]
    lines += [
        "",
        "Targets: FixedCost >= 92%, HeavyTail >= 90% of the ideal; main-process CPU < 10% of a "
        "core with 200 us envs (FixedCost, host).",
        "",
        f"CartPole-v1, 8 envs (2 workers x 4, 2 hosts): host {cart['host']['steps_per_s']:,.0f} "
        f"steps/s, AsyncVectorEnv(8) {cart['async_vector_env_steps_per_s']:,.0f} steps/s: "
        f"{cart['x_async_vector_env']:.1f}x (target >= 4x).",
        "",
    ]
    rvp = results["runs"].get("CartPole-v1 4x32 ray vs process")
    if rvp is not None:
        lines += [
            f"CartPole-v1, 4 workers x 32 envs, 2 hosts, inference='host': ray "
            f"{rvp['ray']['steps_per_s']:,.0f} steps/s, process "
            f"{rvp['process']['steps_per_s']:,.0f} steps/s: {rvp['x_process']:.2f}x "
            "(target >= 0.7x).",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
