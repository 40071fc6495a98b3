"""A/B: the same sampling workloads on two source trees of asyncsample, interleaved in one run.

Usage: ``python -m benchmarks.ab --a /path/to/old/checkout --b /path/to/new/checkout``.

Each run is a fresh interpreter with ``PYTHONPATH`` set to one tree, so both versions see the
same machine at nearly the same time (runs alternate A, B, A, B...). Workloads use only the API
both versions have: the ``Sampler`` (``obtain_fragments``, a per-worker agent) and the gymnasium
face ``VectorEnv`` (lockstep ``step``, one agent call per vector step), each with a random agent
and with the torch MLP of :mod:`benchmarks.policies`. Reported per workload: the median
steps/s of each tree, B/A, B/A of each repeat's pair of runs with a verdict (slower when every
pair is under 0.97, inconclusive when the pairs disagree: the load moved more than the
difference), and the CPU microseconds per transition of the main process and of
its env hosts (its descendants, read from ``/proc``; 0 elsewhere): less sensitive to other load
than wall-clock rates. Results go to ``--out`` as JSON and markdown.

``--metrics b`` (or ``a``, ``both``) runs that side with ``metrics=CollectorRegistry()`` (the
Sampler's and the faces' Prometheus metrics, scraped once at the end of each run): with
``--a . --b .`` (one tree), metrics off against on in one interleaved run. ``--blocks N`` sets
metrics off against on inside one process per workload instead (tree B, see
:mod:`benchmarks.ab_blocks`): ``N`` pairs of short alternating blocks, which resolve a smaller
difference than separate runs do.

``--ceiling`` also runs, in each repeat, the machine's ceiling for every workload of a gymnasium
env (:func:`benchmarks.ceiling.ceiling`: the same env, and the same policy if any, in a plain
loop side by side in as many processes as cores), so that each tree's rate is read against what
the machine allows in the same run (``A/ceiling``, ``B/ceiling``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import write_own_results

REPO_ROOT = Path(__file__).resolve().parent.parent

#: name -> (face, env id, workers, envs per worker, processes, policy?, transitions); the
#: ``"vector"`` face runs ``VectorEnv(env id, workers * envs per worker, n_processes=processes)``
#: (processes -1: its default placement);
#: ``"batched"`` and ``"host"`` are the sampler with that ``inference=`` (batched shares one agent);
#: ``"host-shared"`` is ``inference="host"`` with one agent shared by the workers (and
#: ``"process-host-shared"`` on the latency envs);
#: ``"host-stream"`` is ``inference="host"`` consumed through ``Sampler.stream(fragments=True)``;
#: ``"asyncio"``, ``"asyncio-batched"`` and ``"thread"`` are the sampler on that backend (the
#: lanes; ``-batched``: ``inference="batched"`` with one agent for every env) on the latency envs
#: of :mod:`benchmarks.async_envs` (async, or blocking for ``thread``; episodes of 100 steps):
#: the env id is the mean step latency in seconds ("0": the step awaits nothing, the lane path's
#: own cost); processes are unused but by ``"process-host"``, the same envs in that many process
#: hosts with ``inference="host"``.
WORKLOADS: dict[str, tuple[str, str, int, int, int, bool, int]] = {
    "CartPole-v1 4x8 random": ("sampler", "CartPole-v1", 4, 8, 2, False, 200_000),
    "FixedCost-v0 2x4 random": ("sampler", "benchmarks.envs:FixedCost-v0", 2, 4, 2, False, 20_000),
    "CartPole-v1 2x4 MLP": ("sampler", "CartPole-v1", 2, 4, 2, True, 40_000),
    "CartPole-v1 8x4 MLP": ("sampler", "CartPole-v1", 8, 4, 2, True, 60_000),
    "VectorEnv CartPole-v1 8 random": ("vector", "CartPole-v1", 1, 8, 2, False, 80_000),
    "VectorEnv FixedCost-v0 8 random": (
        "vector",
        "benchmarks.envs:FixedCost-v0",
        1,
        8,
        2,
        False,
        16_000,
    ),
    "VectorEnv CartPole-v1 8 MLP": ("vector", "CartPole-v1", 1, 8, 2, True, 40_000),
    # Infos of plain numbers at every step (MuJoCo's), in the default placement
    "VectorEnv HalfCheetah-v5 4 random": ("vector", "HalfCheetah-v5", 1, 4, -1, False, 40_000),
    "VectorEnv HalfCheetah-v5 4 MLP": ("vector", "HalfCheetah-v5", 1, 4, -1, True, 20_000),
    "CartPole-v1 8x4 MLP batched": ("batched", "CartPole-v1", 8, 4, 2, True, 60_000),
    "CartPole-v1 2x4 random host": ("host", "CartPole-v1", 2, 4, 2, False, 200_000),
    "CartPole-v1 2x4 MLP host": ("host", "CartPole-v1", 2, 4, 2, True, 60_000),
    "CartPole-v1 8x1 random host": ("host", "CartPole-v1", 8, 1, 2, False, 100_000),
    # Four workers a host sharing one agent: one call a step for them where the tree can
    "CartPole-v1 8x4 MLP host shared": ("host-shared", "CartPole-v1", 8, 4, 2, True, 60_000),
    "CartPole-v1 8x1 MLP host shared": ("host-shared", "CartPole-v1", 8, 1, 2, True, 30_000),
    "HalfCheetah-v5 8x4 MLP host shared": (
        "host-shared",
        "HalfCheetah-v5",
        8,
        4,
        2,
        True,
        30_000,
    ),
    "HalfCheetah-v5 2x4 MLP host": ("host", "HalfCheetah-v5", 2, 4, 2, True, 40_000),
    "HalfCheetah-v5 2x4 random host": ("host", "HalfCheetah-v5", 2, 4, 2, False, 60_000),
    "FixedCost-v0 2x4 random host": (
        "host",
        "benchmarks.envs:FixedCost-v0",
        2,
        4,
        2,
        False,
        16_000,
    ),
    "FixedCost-v0 8x1 random host": (
        "host",
        "benchmarks.envs:FixedCost-v0",
        8,
        1,
        2,
        False,
        16_000,
    ),
    # Sampler.stream(fragments=True), rounds of 256 steps per env (what a stream's run-ahead
    # changes: the hosts' idle between rounds)
    "CartPole-v1 2x4 random host stream": ("host-stream", "CartPole-v1", 2, 4, 2, False, 200_000),
    "FixedCost-v0 2x4 random host stream": (
        "host-stream",
        "benchmarks.envs:FixedCost-v0",
        2,
        4,
        2,
        False,
        16_000,
    ),
    "AsyncEnv 0 ms 4x16 random asyncio": ("asyncio", "0", 4, 16, 0, False, 100_000),
    "SleepEnv 0 ms 4x4 random thread": ("thread", "0", 4, 4, 0, False, 40_000),
    "AsyncEnv 0 ms 1x8 random asyncio batched": ("asyncio-batched", "0", 1, 8, 0, False, 100_000),
    "AsyncEnv 0 ms 10x100 random asyncio batched": (
        "asyncio-batched",
        "0",
        10,
        100,
        0,
        False,
        100_000,
    ),
    "AsyncEnv 1 ms 10x100 random asyncio batched": (
        "asyncio-batched",
        "0.001",
        10,
        100,
        0,
        False,
        100_000,
    ),
    "AsyncEnv 0 ms 10x100 MLP asyncio batched": ("asyncio-batched", "0", 10, 100, 0, True, 100_000),
    "AsyncEnv 1 ms 10x100 MLP asyncio batched": (
        "asyncio-batched",
        "0.001",
        10,
        100,
        0,
        True,
        100_000,
    ),
    # the same envs in process hosts whose agent copies act: runs of steps (RunStepper)
    "AsyncEnv 1 ms 10x100 random process host": (
        "process-host",
        "0.001",
        10,
        100,
        2,
        False,
        100_000,
    ),
    "AsyncEnv 1 ms 10x100 MLP process host": ("process-host", "0.001", 10, 100, 2, True, 100_000),
    "AsyncEnv 1 ms 10x100 MLP process host shared": (
        "process-host-shared",
        "0.001",
        10,
        100,
        2,
        True,
        100_000,
    ),
    # the same envs in process hosts, the agent in the caller: ready batches of steps
    "AsyncEnv 1 ms 10x100 random process batched": (
        "process-batched",
        "0.001",
        10,
        100,
        2,
        False,
        100_000,
    ),
    "AsyncEnv 1 ms 10x100 MLP process batched": (
        "process-batched",
        "0.001",
        10,
        100,
        2,
        True,
        100_000,
    ),
    "AsyncEnv 1 ms 10x100 random process per_worker": (
        "process-per_worker",
        "0.001",
        10,
        100,
        2,
        False,
        100_000,
    ),
    # Atari (ale-py, bench extra): big observations through the chunk buffers
    "Pong-v5 2x4 random host": ("host", "benchmarks.envs:Pong-v5", 2, 4, 2, False, 12_000),
    "Pong-v5 4x2 random host": ("host", "benchmarks.envs:Pong-v5", 4, 2, 2, False, 12_000),
    # Raw frames (issue 35: 210x160x3, 100 KB each; calls of 256 steps per env)
    "PongRaw-v5 2x4 random host": ("host", "benchmarks.envs:PongRaw-v5", 2, 4, 2, False, 20_480),
    "PongRaw-v5 2x4 random": ("sampler", "benchmarks.envs:PongRaw-v5", 2, 4, 2, False, 20_480),
    "VectorEnv PongRaw-v5 8 random": (
        "vector",
        "benchmarks.envs:PongRaw-v5",
        1,
        8,
        2,
        False,
        8_000,
    ),
}

_CHILD = """
import asyncio, json, os, sys, time, resource
def hosts_cpu():  # CPU seconds of this process's descendants (the env hosts), from /proc
    me, tick, parent, cpu = os.getpid(), os.sysconf("SC_CLK_TCK"), {{}}, {{}}
    for d in os.listdir("/proc") if os.path.isdir("/proc/self") else ():
        try:
            stat = open(f"/proc/{{d}}/stat").read() if d.isdigit() else ""
        except OSError:
            continue
        if stat:
            f = stat[stat.rfind(")") + 2:].split()
            parent[int(d)], cpu[int(d)] = int(f[1]), (int(f[11]) + int(f[12])) / tick
    total = 0.0
    for pid, seconds in cpu.items():
        up = parent.get(pid)
        while up and up != me:
            up = parent.get(up)
        total += seconds if up == me else 0.0
    return total
sys.path.append({bench_root!r})  # after PYTHONPATH: asyncsample comes from the tree
import benchmarks.envs  # registers the benchmark envs
from asyncsample import Sampler
face, env_id, workers, envs, procs, policy, n = {args!r}
metrics = {metrics!r}
registry = None
if metrics:  # only then: a tree without metrics= still runs the other side
    from prometheus_client import CollectorRegistry, generate_latest
    registry = CollectorRegistry()
kw = {{}} if registry is None else {{"metrics": registry}}
agent = None
lanes = face in (
    "asyncio", "asyncio-batched", "thread", "process-host", "process-batched", "process-per_worker",
    "process-host-shared",
)
if lanes:  # the latency envs of the async_envs study, this tree's or (older) ours
    import functools
    from benchmarks.async_envs import make_env
    env_id = functools.partial(make_env, face == "thread", mean=float(env_id))
if policy:
    import gymnasium as gym
    import importlib.util  # this checkout's policies, whatever tree's benchmarks/ comes first
    spec = importlib.util.spec_from_file_location("ab_policies", {policies!r})
    policies = importlib.util.module_from_spec(spec); spec.loader.exec_module(policies)
    MLPAgent = policies.MLPAgent
    probe = env_id() if lanes else gym.make(env_id)
    agent = [MLPAgent(probe.observation_space, probe.action_space, seed=w) for w in range(workers)]
def vector():
    from asyncsample import VectorEnv
    where = {{"n_processes": procs}} if procs >= 0 else {{}}  # -1: the default placement
    venv = VectorEnv(env_id, workers * envs, **where, **kw)
    obs, _ = venv.reset(seed=0)
    venv.action_space.seed(0)
    act = (lambda o: agent[0].act(o)) if policy else (lambda o: venv.action_space.sample())
    for _ in range(max(n // 10 // (workers * envs), 1)):  # warm-up
        obs = venv.step(act(obs))[0]
    cpu0, t0, done, kids0 = time.process_time(), time.perf_counter(), 0, hosts_cpu()
    while done < n:
        obs = venv.step(act(obs))[0]
        done += workers * envs
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    kids[0] = hosts_cpu() - kids0
    scrape()
    venv.close()
    return done, wall, cpu
async def main():
    inference = {{"batched": "batched", "host": "host", "asyncio-batched": "batched",
                  "process-host": "host", "process-batched": "batched",
                  "host-shared": "host", "process-host-shared": "host"}}.get(face, "per_worker")
    one = inference == "batched" or face.endswith("host-shared")
    shared = agent[0] if one and agent else agent
    if inference == "batched" and not policy:  # batched needs one agent: the built-in random one
        from asyncsample import RandomAgent
        shared = RandomAgent(env_id().action_space, seed=0)
    where = {{"backend": face.split("-")[0]}} if lanes else {{"n_processes": procs}}
    if face.startswith("process-"):
        where["n_processes"] = procs
    async with Sampler(env_id, shared, n_workers=workers, envs_per_worker=envs,
                       seed=0, inference=inference, **where, **kw) as s:
        await s.obtain_fragments(max(n // 10, workers * envs))  # warm-up
        cpu0, t0, done, kids0 = time.process_time(), time.perf_counter(), 0, hosts_cpu()
        while done < n:
            done += (await s.obtain_fragments(max(n // 10, workers * envs))).n_transitions
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        kids[0] = hosts_cpu() - kids0
        scrape()
    return done, wall, cpu
async def streamed():
    import contextlib
    size = workers * envs * 256
    async with Sampler(env_id, agent, n_workers=workers, envs_per_worker=envs,
                       n_processes=procs, seed=0, inference="host", **kw) as s:
        async with contextlib.aclosing(s.stream(size, fragments=True)) as batches:
            k = done = 0
            async for batch in batches:
                k += 1
                if k == 2:  # the first two rounds warm up
                    cpu0, t0, kids0 = time.process_time(), time.perf_counter(), hosts_cpu()
                elif k > 2:
                    done += batch.n_transitions
                    if done >= n:
                        break
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        kids[0] = hosts_cpu() - kids0
        scrape()
    return done, wall, cpu
scraped, kids = [0.0], [0.0]
def scrape():  # what a scraper would read: the steps counted (checks the metrics ran)
    if registry is None:
        return
    text = generate_latest(registry).decode()
    scraped[0] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("asyncsample_env_steps_total{{"))
if face == "vector":
    done, wall, cpu = vector()
else:
    done, wall, cpu = asyncio.run(streamed() if face == "host-stream" else main())
import asyncsample
print(json.dumps({{"steps_per_s": done / wall, "main_cpu_us": 1e6 * cpu / done,
                  "metrics_steps": scraped[0], "hosts_cpu_us": 1e6 * kids[0] / done,
                  "module": asyncsample.__file__}}))
"""


def run_once(
    tree: Path, workload: tuple[str, str, int, int, int, bool, int], metrics: bool = False
) -> dict[str, Any]:
    """One fresh-interpreter run of ``workload`` on the asyncsample found in ``tree``, with its
    Prometheus metrics on if ``metrics``."""
    code = _CHILD.format(
        bench_root=str(REPO_ROOT),
        policies=str(REPO_ROOT / "benchmarks" / "policies.py"),
        args=list(workload),
        metrics=metrics,
    )
    # Absolute: the child runs in /tmp, and its env hosts must import the same tree.
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=tempfile.gettempdir(),  # not a checkout: the tree's asyncsample must win
    )
    if done.returncode != 0:
        raise RuntimeError(f"run failed on {tree}: {done.stderr.strip().splitlines()[-3:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result.pop("module")).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the run on {tree} imported another asyncsample")
    if metrics and not result["metrics_steps"] > 0:
        raise RuntimeError(f"the run on {tree} with metrics on counted no steps")
    return result


#: The faces whose workloads step a gymnasium env (the others step the latency envs).
GYM_FACES = ("sampler", "vector", "batched", "host", "host-shared", "host-stream")


def ceiling_once(workload: tuple[str, str, int, int, int, bool, int]) -> dict[str, float]:
    """The machine's ceiling for ``workload``: its env (and policy) in a plain loop per core."""
    from benchmarks.ceiling import ceiling
    from benchmarks.runs import RunSpec

    _, env_id, workers, per, _, policy, transitions = workload
    n_envs = workers * per
    spec = RunSpec(
        contender="ceiling",
        env=env_id,
        env_id=env_id,
        n_envs=n_envs,
        n_transitions=transitions,
        warmup=min(transitions // 10, 10_000),
        cores=os.cpu_count() or 1,
        policy="mlp" if policy else "",
    )
    result = ceiling(spec)
    return {"steps_per_s": result.transitions / result.seconds}


#: What "slower" means here: B under this fraction of A's rate (issue 31: no workload slower by
#: more than 3%).
TOLERANCE = 0.97


def paired_ratios(sides: dict[str, list[dict[str, float]]]) -> list[float]:
    """B/A of each repeat's two runs (run back to back, so they saw nearly the same load)."""
    return [b["steps_per_s"] / a["steps_per_s"] for a, b in zip(sides["a"], sides["b"])]


def verdict(pairs: list[float]) -> str:
    """``"slower"`` when every repeat has B under :data:`TOLERANCE` of A, ``"not slower"`` when
    none has, else ``"inconclusive"``: the repeats disagree, the machine's load moved more than
    the difference (run it again with more ``--repeats`` on a quiet machine)."""
    if all(r < TOLERANCE for r in pairs):
        return "slower"
    if all(r >= TOLERANCE for r in pairs):
        return "not slower"
    return "inconclusive"


def main(argv: list[str] | None = None) -> int:
    """Run every workload ``--repeats`` times on both trees, alternating, and write the results."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__)
    parser.add_argument("--a", type=Path, help="source tree A (the baseline; not with --blocks)")
    parser.add_argument("--b", type=Path, default=REPO_ROOT, help="source tree B (default: here)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=list(WORKLOADS),
        default=[w for w in WORKLOADS if "Pong" not in w],
        help="default: all but the Atari ones (they need the bench extra's ale-py)",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "ab")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 1/50 of each workload's transitions"
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="each workload's transitions times this (longer runs: a smaller difference told "
        "from the noise of short ones)",
    )
    parser.add_argument(
        "--metrics",
        choices=["off", "a", "b", "both"],
        default="off",
        help="the side(s) that run with metrics=CollectorRegistry() (with --a . --b .: metrics "
        "off against on, one tree)",
    )
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="also the machine's ceiling of each gymnasium-env workload, once per repeat",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        metavar="N",
        help="metrics off against on in one process per workload, on tree B: N pairs of "
        "alternating blocks (benchmarks.ab_blocks)",
    )
    args = parser.parse_args(argv)
    if args.blocks is not None:
        return blocks_main(args)
    if args.a is None:
        parser.error("--a: a source tree is required (the baseline), got none")
    metrics_on = {"a": args.metrics in ("a", "both"), "b": args.metrics in ("b", "both")}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    load = [os.getloadavg()[0]]
    for r in range(args.repeats):
        for name in args.workloads:
            order = ("a", "b") if r % 2 == 0 else ("b", "a")
            for side in order:
                tree = args.a if side == "a" else args.b
                res = run_once(tree, _scaled(name, args), metrics_on[side])
                runs.setdefault(name, {"a": [], "b": []})[side].append(res)
                load.append(os.getloadavg()[0])
                print(f"{name} [{side}] {res['steps_per_s']:,.0f} steps/s", file=sys.stderr)
            if args.ceiling and WORKLOADS[name][0] in GYM_FACES:
                top = ceiling_once(_scaled(name, args))
                runs[name].setdefault("ceiling", []).append(top)
                load.append(os.getloadavg()[0])
                print(f"{name} [ceiling] {top['steps_per_s']:,.0f} steps/s", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for name, sides in runs.items():

        def med(side: str, key: str, sides: dict[str, list[dict[str, float]]] = sides) -> float:
            return statistics.median(x[key] for x in sides[side])

        rows.append(
            {
                "workload": name,
                "a_steps_per_s": med("a", "steps_per_s"),
                "b_steps_per_s": med("b", "steps_per_s"),
                "ratio": med("b", "steps_per_s") / med("a", "steps_per_s"),
                "pair_ratios": (pairs := paired_ratios(sides)),
                "verdict": verdict(pairs),
                "a_main_cpu_us": med("a", "main_cpu_us"),
                "b_main_cpu_us": med("b", "main_cpu_us"),
                "a_hosts_cpu_us": med("a", "hosts_cpu_us"),
                "b_hosts_cpu_us": med("b", "hosts_cpu_us"),
                "runs": sides,
            }
        )
        if sides.get("ceiling"):
            top = med("ceiling", "steps_per_s")
            rows[-1]["ceiling_steps_per_s"] = top
            rows[-1]["a_of_ceiling"] = rows[-1]["a_steps_per_s"] / top
            rows[-1]["b_of_ceiling"] = rows[-1]["b_steps_per_s"] / top
    machine = _machine(load)
    results = {"machine": machine, "metrics": args.metrics, "scale": args.scale, "rows": rows}
    on = [side.upper() for side in ("a", "b") if metrics_on[side]]
    lines = [
        f"A = `{args.a}`, B = `{args.b}`"
        + (f" (metrics on in {' and '.join(on)})" if on else "")
        + f"; {args.repeats} alternating runs each"
        + (f" of {args.scale:g}x the transitions" if args.scale != 1.0 and not args.quick else "")
        + ", medians; "
        f"{machine['cores']} cores, Python {machine['python']}, {machine['date']}, load average "
        f"{min(load):.1f}-{max(load):.1f} during the run.",
        "",
        "| workload | A steps/s | B steps/s | B/A | B/A per repeat | verdict | A main CPU us/step "
        "| B main CPU us/step | A hosts CPU us/step | B hosts CPU us/step"
        + (" | ceiling steps/s | A/ceiling | B/ceiling |" if args.ceiling else " |"),
        "|---|---:|---:|---:|---|---|---:|---:|---:|---:|"
        + ("---:|---:|---:|" if args.ceiling else ""),
    ]
    for row in rows:
        top = ""
        if args.ceiling:
            top = " - | - | - |"
            if "ceiling_steps_per_s" in row:
                top = (
                    f" {row['ceiling_steps_per_s']:,.0f} | {row['a_of_ceiling']:.2f} | "
                    f"{row['b_of_ceiling']:.2f} |"
                )
        lines.append(
            f"| {row['workload']} | {row['a_steps_per_s']:,.0f} | {row['b_steps_per_s']:,.0f} | "
            f"{row['ratio']:.2f}x | {' '.join(f'{r:.2f}' for r in row['pair_ratios'])} | "
            f"{row['verdict']} | {row['a_main_cpu_us']:.1f} | {row['b_main_cpu_us']:.1f} | "
            f"{row['a_hosts_cpu_us']:.1f} | {row['b_hosts_cpu_us']:.1f} |{top}"
        )
    write_own_results(args.out, results, "\n".join(lines))
    return 0


def blocks_main(args: argparse.Namespace) -> int:
    """``--blocks N``: each workload's metrics off against on in one process (see
    :mod:`benchmarks.ab_blocks`), written as JSON and markdown."""
    from benchmarks.ab_blocks import BUDGET, run_workload

    if args.blocks < 1:
        raise SystemExit(
            f"--blocks: a number of pairs of at least 1 was expected, got {args.blocks}"
        )
    load = [os.getloadavg()[0]]
    rows = []
    for name in args.workloads:
        rows.append({"workload": name, **run_workload(args.b, _scaled(name, args), args.blocks)})
        load.append(os.getloadavg()[0])
        row = rows[-1]
        print(f"{name}: on/off {row['ratio']:.3f}, {row['verdict']}", file=sys.stderr)
    results = {"machine": _machine(load), "blocks": args.blocks, "budget": BUDGET, "rows": rows}
    m = results["machine"]
    lines = [
        f"Metrics off against on, tree `{args.b}`: each workload in one process holding both "
        f"copies, {args.blocks} pairs of alternating blocks; {m['cores']} cores, Python "
        f"{m['python']}, {m['date']}, load average {min(load):.1f}-{max(load):.1f} during the run. "
        f"On/off: the median of the pairs' ratios of steps/s, with its 95% confidence interval; "
        f"the budget is {BUDGET:.2f}.",
        "",
        "| workload | off steps/s | on steps/s | on/off | 95% interval | verdict | off main CPU "
        "us/step | on main CPU us/step |",
        "|---|---:|---:|---:|---|---|---:|---:|",
    ]
    for row in rows:
        span = "-".join(f"{x:.3f}" for x in row["interval"] or ()) or "n/a"
        lines.append(
            f"| {row['workload']} | {row['off_steps_per_s']:,.0f} | {row['on_steps_per_s']:,.0f} "
            f"| {row['ratio']:.3f} | {span} | {row['verdict']} | "
            f"{row['off_main_cpu_us']:.2f} | {row['on_main_cpu_us']:.2f} |"
        )
    write_own_results(args.out, results, "\n".join(lines))
    return 0


def _scaled(name: str, args: argparse.Namespace) -> tuple[str, str, int, int, int, bool, int]:
    """Workload ``name`` with its transitions cut for ``--quick`` or times ``--scale``."""
    workload = WORKLOADS[name]
    if args.quick:
        return (*workload[:-1], max(1_000, workload[-1] // 50))
    if args.scale != 1.0:
        return (*workload[:-1], max(1_000, round(workload[-1] * args.scale)))
    return workload


def _machine(load: list[float]) -> dict[str, Any]:
    """The machine's description for the results."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "load_average_min_max": [min(load), max(load)],
    }


if __name__ == "__main__":
    raise SystemExit(main())
