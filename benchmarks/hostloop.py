"""What ``inference="host"`` costs per step inside an env host, besides the env itself.

An env host runs a worker's chunk with its agent copy (``ChunkRunner``): per worker step it
copies the observations into the chunk's rows, asks the agent, checks and stores the actions,
steps the slot's envs (``EnvGroup.step``) and records rewards, flags and episode ends. That
machinery is paid once per *slot*-step, so with one env per slot (the 8x1 layout) it is paid for
every env step. This study runs the loop in this process, with no other process and no IPC, on
the same envs as a plain ``env.step`` loop with pre-drawn actions (the ceiling's loop), and
reports the difference per slot-step: the host's own cost, which the ``host`` study's ratios to
the ceiling cannot separate from waiting and scheduling.

Its second part does the same for the ``policy`` study: one of the two env hosts of each of its
layouts with its torch MLP (the host's slots side by side, one agent call a step), against the
loop each of the ceiling's processes runs on the same envs (``SyncVectorEnv`` plus the MLP). The
ratio bounds what the layout reaches of the ceiling when requests, the caller and waiting cost
nothing.

Run it as ``asyncsample bench hostloop`` (or ``python -m benchmarks.hostloop``). With
``PYTHONPATH=OTHER_TREE`` it measures another source tree's loop (the API it uses is old).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
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
from asyncsample.backends._chunk_loop import ChunkRunner, run_joint
from asyncsample.env_group import EnvGroup, StepBuffers
from benchmarks.report import write_own_results

__all__ = ["main", "measure", "measure_lanes", "measure_policy"]

ENVS = ["NoOp-v0", "CartPole-v1", "FixedCost-v0"]
SLOT_ENVS = [1, 4, 8, 16]
CHUNK = 64
POLICY_ENVS = ["CartPole-v1", "HalfCheetah-v5"]
#: The policy study's layouts (workers x envs per worker, over 2 env hosts).
POLICY_LAYOUTS = ["2x4", "8x1", "2x16", "4x8", "8x4"]
#: The results page's sections (``docs/performance.md`` copies them: ``asyncsample bench --pages``).
HEADING = "The env host's own cost per step"
POLICY_HEADING = "A host with a policy, against the ceiling's loop"
LANE_HEADING = "A host of async envs, against plain asyncio tasks"
#: The async-env part: envs, mean step latency (s) and steps per run (the seam study's calls of
#: 10 steps per env); 2,000 envs of 10 ms keep both loops busy (an ideal of 200,000 steps/s).
LANE_ENVS, LANE_MEAN, LANE_RUN = 2000, 0.01, 10


def _best_of(rounds: int, *fns: Callable[[], int]) -> list[float]:
    """Per function of ``fns``, the fastest of ``rounds`` timings, in microseconds per unit it
    reports; the functions take turns within each round, so that a machine whose speed drifts
    gives each of them its fast minutes alike."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            units = fn()
            best[k] = min(best[k], (time.perf_counter() - t0) / units * 1e6)
    return best


def _runners(env_id: str, slots: int, n_envs: int, agent: Any) -> list[ChunkRunner]:
    """``slots`` chunk runners of ``n_envs`` envs of ``env_id`` each, with copies of ``agent``
    installed as a host installs them (one shared agent: copies that act alike run side by
    side, see :func:`~asyncsample.backends._chunk_loop.run_joint`)."""
    make = functools.partial(gym.make, benchmarks.envs.full_id(env_id))
    probe = make()
    obs_space, act_space = probe.observation_space, probe.action_space
    probe.close()
    blob = pickle.dumps((cloudpickle.dumps(agent), 0))
    runners = []
    for slot in range(slots):
        buffers = StepBuffers.allocate(obs_space, act_space, n_envs)
        group = EnvGroup(slot, buffers, obs_space, act_space, None)
        group.build([[make]] * n_envs, list(range(n_envs)))
        group.reset(np.ones(n_envs, dtype=bool))
        flat = StepBuffers.allocate(obs_space, act_space, chunk_rows(CHUNK, 2) * n_envs)
        runner = ChunkRunner(group, chunk_sets(flat, CHUNK, n_envs), act_space)
        runner.install(blob)
        runners.append(runner)
    return runners


def _chunk_loop(runners: list[ChunkRunner], chunks: int) -> Callable[[], int]:
    """``chunks`` chunks of every runner, side by side; the loop counts slot-steps."""
    n_envs = runners[0].group.n_envs

    def loop() -> int:
        for _ in range(chunks):
            rule = StopRule.for_call(CallMode.FRAGMENTS, CHUNK * n_envs, n_envs)
            requests = [
                ChunkRequest(rule.copy(), CHUNK, np.zeros(n_envs, np.int64), np.ones(n_envs, bool))
                for _ in runners
            ]
            for reply in run_joint(runners, requests):
                if isinstance(reply, Exception):
                    raise reply
        return chunks * CHUNK * len(runners)

    return loop


def _close(runners: list[ChunkRunner]) -> None:
    for runner in runners:
        runner.group.close()


def measure(env_id: str, n_envs: int, chunks: int, rounds: int) -> dict[str, Any]:
    """Microseconds per slot-step of the chunk loop and per step of a plain loop on ``env_id``."""
    probe = gym.make(benchmarks.envs.full_id(env_id))
    act_space = probe.action_space
    runners = _runners(env_id, 1, n_envs, RandomAgent(act_space, seed=0))
    chunk_loop = _chunk_loop(runners, chunks)

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
    slot_step, env_step = _best_of(rounds, chunk_loop, plain_loop)
    own = slot_step - env_step * n_envs
    probe.close()
    _close(runners)
    return {
        "env": env_id,
        "envs_per_slot": n_envs,
        "slot_step_us": slot_step,
        "plain_env_step_us": env_step,
        "host_own_us_per_slot_step": own,
        "host_own_us_per_env_step": own / n_envs,
        "host_own_share": own / slot_step,
    }


def measure_policy(env_id: str, layout: str, chunks: int, rounds: int) -> dict[str, Any]:
    """One of two env hosts of the policy study's ``layout`` (workers x envs, half the workers
    a host) with its MLP: the host's chunks side by side, against the ceiling's loop for the
    same envs (``SyncVectorEnv`` of a host's envs plus the MLP, one call a step), per env step.
    """
    from benchmarks.policies import make_policy  # torch: only for this part

    workers, n_envs = (int(k) for k in layout.split("x"))
    slots = max(1, workers // 2)
    agent = make_policy("mlp", env_id, 0)
    runners = _runners(env_id, slots, n_envs, agent)
    if slots > 1 and (runners[0].copy_key is None or runners[0].copy_key != runners[1].copy_key):
        raise RuntimeError(f"{layout}: the MLP's copies do not run side by side")
    host_loop = _chunk_loop(runners, max(1, chunks // slots))
    make = functools.partial(gym.make, benchmarks.envs.full_id(env_id))
    sync = gym.vector.SyncVectorEnv([make] * (slots * n_envs))
    obs, _ = sync.reset(seed=0)
    steps = max(1, chunks // slots) * CHUNK

    def ceiling_loop() -> int:
        nonlocal obs
        for _ in range(steps):
            obs, *_ = sync.step(agent.get_actions(obs)[0])
        return steps * slots * n_envs

    host_loop()  # warm-up
    ceiling_loop()
    host, ceiling = _best_of(rounds, host_loop, ceiling_loop)
    host /= n_envs  # per env step (the loop counts slot-steps)
    sync.close()
    _close(runners)
    return {
        "env": env_id,
        "layout": layout,
        "slots_per_host": slots,
        "envs_per_slot": n_envs,
        "host_us_per_env_step": host,
        "ceiling_loop_us_per_env_step": ceiling,
        "host_vs_ceiling_loop": ceiling / host,
    }


async def _plain_round(n_envs: int, mean: float, seconds: float) -> float:
    """The seam study's ``plain-1`` loop: a task per env awaiting its steps with random actions
    (a generator each); CPU microseconds per env step over ``seconds`` (:func:`_window`)."""
    from benchmarks.latency_envs import make_env

    envs = [make_env(False, mean=mean, sigma=0.5) for _ in range(n_envs)]
    steps = [0]

    async def forever(env: Any, rng: np.random.Generator) -> None:
        await env.reset(seed=0)
        while True:
            *_, terminated, truncated, _ = await env.step(int(rng.integers(2)))
            steps[0] += 1
            if terminated or truncated:
                await env.reset()

    tasks = [
        asyncio.ensure_future(forever(e, np.random.default_rng(k))) for k, e in enumerate(envs)
    ]
    try:
        return await _window(lambda: steps[0], seconds)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _lanes_round(n_envs: int, mean: float, run_steps: int, seconds: float) -> float:
    """One host of async envs (:class:`LaneServer`, a worker slot of ``n_envs`` envs) in this
    loop, serving RUN requests of ``run_steps`` that its built-in random agent acts for, sent as
    a caller sends them (each reply answered at once by the env's next run, or by its reset
    once its episode ended); CPU microseconds per env step, as :func:`_plain_round`."""
    import multiprocessing as mp

    from asyncsample.backends._lane_serve import LaneKind, LaneOptions, LaneServer
    from asyncsample.backends._transport import (
        ST_OK,
        Op,
        own_slot_buffers,
        slot_buffers,
        with_version,
    )
    from asyncsample.backends.base import HostSpec, StepRun
    from asyncsample.inference.host import with_seed
    from benchmarks.latency_envs import make_env

    spec = HostSpec(
        0, n_envs, gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2), 200, lanes=True
    )
    _, raw = own_slot_buffers(spec, mp.get_context())
    buffers = slot_buffers(spec.observation_space, spec.action_space, n_envs, raw)
    steps, live = [0], [True]
    keys: dict[int, int] = {}  # each request's env
    asked: list[tuple[Any, ...]] = []  # the requests of this pass of the loop
    numbers = itertools.count(1)
    loop = asyncio.get_running_loop()

    def ask(kind: int, i: int) -> None:
        key = next(numbers)
        keys[key] = i
        if kind == LaneKind.RUN:
            asked.append((LaneKind.RUN, key, 0, i, None, run_steps, False))
        else:
            asked.append((LaneKind.RESET, key, 0, i, None, None, None))

    class Host(LaneServer):
        def _flush(self) -> None:  # the caller's side: each reply asks the env's next request
            for key, status, value in self.out:
                if status != ST_OK:
                    raise RuntimeError(f"env {keys[key]}: status {status}: {value!r}")
                i = keys.pop(key)
                if type(value) is StepRun:
                    steps[0] += len(value.rewards)
                    ended = value.terminated or value.truncated
                    ask(LaneKind.RESET if ended else LaneKind.RUN, i)
                else:
                    ask(LaneKind.RUN, i)
            super()._flush()
            if asked and live[0]:
                loop.call_soon(self._handled, pickle.dumps(list(asked)))
                asked.clear()

        def _handled(self, payload: bytes) -> None:  # (not once the window closed: shut)
            if live[0]:
                self.handle(payload)

    server = Host([spec], [buffers], LaneOptions(None, 5.0, None), lambda payload: None)
    make = functools.partial(make_env, False, mean=mean, sigma=0.5)
    body = cloudpickle.dumps(([[make] for _ in range(n_envs)], list(range(n_envs))))
    agent = cloudpickle.dumps(RandomAgent(spec.action_space, seed=0))
    for op, payload in ((Op.BUILD, body), (Op.AGENT, with_version(0, with_seed(agent, 0)))):
        status, reply = await server.call(0, op, payload)
        if status != ST_OK:
            raise RuntimeError(f"the host refused {op.name}: {reply!r}")
    for i in range(n_envs):
        ask(LaneKind.RESET, i)
    server.handle(pickle.dumps(list(asked)))
    asked.clear()
    try:
        return await _window(lambda: steps[0], seconds)
    finally:
        live[0] = False
        await server.shut()


async def _window(count: Callable[[], int], seconds: float) -> float:
    """CPU microseconds per counted step over ``seconds``, after warm-up (a third as long)."""
    await asyncio.sleep(seconds / 3)
    s0, c0 = count(), time.process_time()
    await asyncio.sleep(seconds)
    return 1e6 * (time.process_time() - c0) / max(1, count() - s0)


def measure_lanes(
    n_envs: int, mean: float, run_steps: int, seconds: float, rounds: int
) -> dict[str, Any]:
    """A host of async envs (``backend="process"`` with async envs, ``inference="host"``) and the
    plain asyncio tasks of the seam study, on ``n_envs`` of its minimal env, in turn in fresh
    uvloop loops of this process: CPU per env step of each, best of ``rounds``."""
    import uvloop

    lanes, plain = [], []
    for _ in range(rounds):
        plain.append(uvloop.run(_plain_round(n_envs, mean, seconds)))
        lanes.append(uvloop.run(_lanes_round(n_envs, mean, run_steps, seconds)))
    host, tasks = min(lanes), min(plain)
    return {
        "envs": n_envs,
        "mean_s": mean,
        "run_steps": run_steps,
        "seconds": seconds,
        "host_us_per_env_step": host,
        "plain_us_per_env_step": tasks,
        "host_own_us_per_env_step": host - tasks,
        "plain_vs_host": tasks / host,
    }


def _section(heading: str, text: str, columns: str, align: str) -> list[str]:
    """A section of the page after the first: its heading, its text and its table's head."""
    return ["", f"## {heading}", "", text, "", columns, align]


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
        f"best of {result['rounds']} rounds of {result['chunks']} chunks of {CHUNK} steps (the "
        "two loops in turn in each round). "
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
    policy = result.get("policy_rows") or []
    if policy:
        lines += _section(
            POLICY_HEADING,
            "One of the two env hosts of each layout of the `policy` study (workers x envs per "
            "worker, half the workers a host) with its torch MLP, the host's chunks side by side "
            '(one agent call a step for its slots, as `inference="host"` runs them), in one '
            "process: no requests, no caller, no waiting. Against the ceiling's loop for the "
            "same envs (`SyncVectorEnv` of a host's envs plus the MLP, one call a step), which "
            "each of the ceiling's two processes runs. Microseconds per env step, best of "
            f"{result['rounds']} rounds (the two loops in turn in each). `bound`: the ceiling's "
            "loop / the host's: the share "
            "of the ceiling that two such hosts reach when nothing else costs anything.",
            "| env | layout | slots x envs a host | host us per env step "
            "| ceiling's loop us per env step | bound (of the ceiling) |",
            "|---|---|---|---:|---:|---:|",
        )
        for r in policy:
            lines.append(
                f"| {r['env']} | {r['layout']} | {r['slots_per_host']} x {r['envs_per_slot']} | "
                f"{r['host_us_per_env_step']:.2f} | {r['ceiling_loop_us_per_env_step']:.2f} | "
                f"{r['host_vs_ceiling_loop']:.2f} |"
            )
    lanes = result.get("lane_rows") or []
    if lanes:
        lines += _section(
            LANE_HEADING,
            "A host of async envs (`LaneServer`, one worker slot) in this process, serving RUN "
            "requests that its built-in random agent acts for, each reply answered at once by "
            "the env's next run (or reset), as a caller sends them; against the seam study's "
            "`plain-1` loop (a task per env, random actions), on the seam study's minimal env "
            "(`Box(4,)`, lognormal latency, 200-step episodes). The two in turn in fresh uvloop "
            f"loops, best of {result['rounds']} rounds; CPU microseconds per env step (a "
            "latency short enough that neither loop keeps up). `bound`: plain / host, the share "
            "of plain tasks' rate a host reaches where its CPU is the limit.",
            "| envs | mean latency | steps per run | host us per env step | plain us per env step "
            "| host's own us per env step | bound |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        )
        for r in lanes:
            lines.append(
                f"| {r['envs']:,} | {1e3 * r['mean_s']:g} ms | {r['run_steps']} | "
                f"{r['host_us_per_env_step']:.2f} | {r['plain_us_per_env_step']:.2f} | "
                f"{r['host_own_us_per_env_step']:.2f} | {r['plain_vs_host']:.2f} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hostloop", description=__doc__)
    parser.add_argument("--envs", nargs="+", default=ENVS)
    parser.add_argument("--slot-envs", nargs="+", type=int, default=SLOT_ENVS)
    parser.add_argument("--policy-envs", nargs="*", default=POLICY_ENVS, help="none: no MLP part")
    parser.add_argument("--policy-layouts", nargs="+", default=POLICY_LAYOUTS)
    parser.add_argument("--chunks", type=int, default=40, help="chunks per timed round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--lane-envs", nargs="*", type=int, default=[LANE_ENVS], help="none: no async-env part"
    )
    parser.add_argument("--lane-mean", type=float, default=LANE_MEAN, help="seconds")
    parser.add_argument("--lane-run", type=int, default=LANE_RUN, help="steps per run")
    parser.add_argument("--lane-seconds", type=float, default=3.0, help="each loop's window")
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
    policy_rows = []
    for env_id in args.policy_envs:
        for layout in args.policy_layouts:
            # HalfCheetah spends about 50 us per env step: fewer chunks keep its rounds short.
            k = max(1, chunks // 4) if env_id.startswith("HalfCheetah") else chunks
            policy_rows.append(measure_policy(env_id, layout, k, rounds))
            print(
                f"{env_id} {layout} with the MLP: host "
                f"{policy_rows[-1]['host_us_per_env_step']:.1f} us per env step, ceiling's "
                f"loop {policy_rows[-1]['ceiling_loop_us_per_env_step']:.1f}",
                flush=True,
            )
    lane_rows = []
    for n in args.lane_envs:
        seconds = 0.3 if args.quick else args.lane_seconds
        lane_rows.append(measure_lanes(n, args.lane_mean, args.lane_run, seconds, rounds))
        print(
            f"{n} async envs: host {lane_rows[-1]['host_us_per_env_step']:.1f} us per env step, "
            f"plain tasks {lane_rows[-1]['plain_us_per_env_step']:.1f}",
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
        "policy_rows": policy_rows,
        "lane_rows": lane_rows,
    }
    write_own_results(args.out, result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
