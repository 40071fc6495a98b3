"""The main process's CPU per env step on the lane backends (``asyncio``, ``thread``).

Run from the repository root, one source tree per argument (each run in a fresh interpreter, the
trees alternating)::

    python -m benchmarks.lanes /tmp/ab-base .
    python -m benchmarks.lanes . --metrics     # each tree with metrics off, then on
    python -m benchmarks.lanes . --profile     # one run under cProfile (top 25 by own time)

Workloads: the zero-latency async env of :mod:`benchmarks.latency_envs` on ``asyncio``, 4
workers x 16 envs, a random agent per worker; the same with one shared random agent and
``inference="batched"``, 1 worker x 8 envs. Prints, per workload and tree, the best CPU
microseconds per transition (``time.process_time``) of ``obtain_fragments`` over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

WORKLOADS = {
    "asyncio 4x16 random": (4, 16, "per_worker"),
    "asyncio 1x8 random batched": (1, 8, "batched"),
}

_RUN = """
import asyncio, cProfile, functools, json, pstats, sys, time
sys.path.insert(0, {tree!r})
import importlib.util  # this checkout's latency envs, whatever tree's benchmarks/ comes first
spec = importlib.util.spec_from_file_location("latency_envs", {envs!r})
latency_envs = sys.modules["latency_envs"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(latency_envs)
make_env = latency_envs.make_env
from asyncsample import RandomAgent, Sampler
workers, envs, inference = {workload!r}
metrics, profile, n = {metrics!r}, {profile!r}, 100_000
factory = functools.partial(make_env, False, mean=0.0)
space = factory().action_space
if inference == "batched":
    agent = RandomAgent(space, seed=0)
else:
    agent = [RandomAgent(space, seed=w) for w in range(workers)]
kw = {{}}
if metrics:
    from prometheus_client import CollectorRegistry
    kw["metrics"] = CollectorRegistry()
async def main():
    async with Sampler(factory, agent, n_workers=workers, envs_per_worker=envs, seed=0,
                       backend="asyncio", inference=inference, **kw) as s:
        await s.obtain_fragments(n // 10)
        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        cpu, done = time.process_time(), 0
        while done < n:
            done += (await s.obtain_fragments(n // 10)).n_transitions
        cpu = time.process_time() - cpu
        if prof:
            prof.disable()
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    return 1e6 * cpu / done
print(json.dumps(asyncio.run(main())))
"""


def run(tree: str, workload: tuple[int, int, str], metrics: bool, profile: bool) -> float:
    """One fresh interpreter on ``tree``: CPU microseconds per transition."""
    code = _RUN.format(
        tree=os.path.abspath(tree),
        envs=os.path.join(os.path.dirname(os.path.abspath(__file__)), "latency_envs.py"),
        workload=workload,
        metrics=metrics,
        profile=profile,
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{tree}: {out.stderr}")
    if profile:
        print(out.stderr)
    return float(json.loads(out.stdout))


def main() -> None:
    """Alternate the trees (and metrics off/on with ``--metrics``); print each best figure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("trees", nargs="*", default=["."])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--metrics", action="store_true", help="each tree off, then on")
    parser.add_argument("--profile", action="store_true", help="one run under cProfile")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    args = parser.parse_args()
    if args.profile:
        run(args.trees[0], WORKLOADS[args.workloads[0]], args.metrics, True)
        return
    sides = [(t, m) for t in args.trees for m in ((False, True) if args.metrics else (False,))]
    for name in args.workloads:
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(args.rounds):
            for tree, metrics in sides:
                best[tree, metrics] = min(
                    best[tree, metrics], run(tree, WORKLOADS[name], metrics, False)
                )
        for (tree, metrics), us in best.items():
            label = f"{tree}{' metrics' if metrics else ''}"
            print(f"{name}: {label}: {us:.2f} us CPU per transition", flush=True)


if __name__ == "__main__":
    main()
