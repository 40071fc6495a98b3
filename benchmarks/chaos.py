"""Chaos: thousands of async episodes in flight while envs raise, hang and never answer.

A sampler on ``backend="asyncio"`` keeps ``--episodes`` async envs in flight (``--workers``
workers of equal shares), each step waiting a random latency. Meanwhile 1 in ``--raise-every``
steps raises, ``--p-hang-reset`` of the resets hang (forever, cancellably), and one env never
answers at all (every reset and step hangs). ``episode_timeout`` is set, so no straggler can hold
a call; each call is ``obtain_samples`` under ``asyncio.timeout(--deadline)``.

Checked, per call and at the end:

- every call ends by its deadline plus 5% (and returns its quota: none times out);
- no episode of a healthy env is lost: every episode an env finished without a fault in it
  (it returned ``terminated``) during a call is in that call's batch (each episode carries a
  unique id in its reset info);
- the env calls in flight never pass ``max_concurrency`` (the envs count them);
- the caller's loop lag (a task sleeping 5 ms at a time, how late it wakes) stays under 20 ms at
  the 99th percentile;
- after ``aclose()`` no task of the sampler's is left in the loop and every env built is closed.

It runs on ``asyncio`` (the envs in the caller's loop) and on ``process`` (the envs in two env
hosts' event loops). There the envs report through a :class:`FileCensus` (one log file per
process) instead of counters in the caller, and the peak of env calls in flight is the sum of
the hosts' own peaks (at least the true peak).

On ``process`` one more fault kind: 1 in ``--block-every`` steps (at most ``--blocks`` in the
run) blocks its host's event loop with ``time.sleep(--block-seconds)``, longer than a call's
deadline, as a verifier that loops or a ``requests.get`` inside ``async def step`` would. With
``step_timeout`` (``--step-timeout``, above ``episode_timeout`` so that it cuts only blocks) the
host is killed and restarted (issue 50): the calls still end by their deadline, and no healthy
episode is lost. Episodes a blocked host finished in the moment before its block (their replies
still queued behind it) die with the host: they are counted apart, as dropped with it. The
caller's own loop (``asyncio``) cannot be pre-empted, so the kind is off there.

Run: ``asyncsample bench chaos`` (writes ``benchmarks/results/chaos/results.json`` and ``.md``);
``--quick`` is the CI smoke run (256 episodes, two calls).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from asyncsample import AsyncEnv, Sampler

RESULTS = Path(__file__).resolve().parent / "results"
LAG_PROBE_S = 0.005
_CLAIM = os.O_CREAT | os.O_EXCL | os.O_WRONLY
#: How long a step reply may take to reach the caller: an episode that ended in a host this long
#: before its worker stopped may still have been cut (its reply not yet read).
CUT_MARGIN_S = 0.1


class Census:
    """What the envs of one run report: calls in flight, episodes, builds and closes."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.peak = 0
        self.built = 0
        self.n_closed = 0
        self.healthy_done: list[int] = []
        """Ids of the episodes an env finished with no fault in them (since the last read)."""
        self.faults = {"raise": 0, "hang_reset": 0, "dead_env_calls": 0, "block": 0}

    def claim_block(self, limit: int) -> bool:
        """Blocks are the hosts' only (see the module docstring)."""
        return False

    def enter(self) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)

    def leave(self) -> None:
        self.in_flight -= 1

    def fault(self, kind: str) -> None:
        self.faults[kind] += 1

    def healthy(self, episode: int, worker: int) -> None:
        self.healthy_done.append(episode)

    def closed(self) -> None:
        self.n_closed += 1

    def read(self) -> dict[str, Any]:
        """What the envs reported (as :meth:`FileCensus.read`)."""
        return {
            "built": self.built,
            "closed": self.n_closed,
            "peak": self.peak,
            "faults": dict(self.faults),
            "healthy": list(self.healthy_done),
            "finished": {},
            "dropped_with_host": set(),
            "not_closed": self.built - self.n_closed,
            "lost_with_hosts": 0,
        }


_LOCAL: dict[str, dict[str, int]] = {}
"""Per census directory, this process's env calls in flight, their peak and envs built."""


class FileCensus:
    """What envs in other processes report, through a log file per process in ``directory``
    (appends of a line: ``b`` built, ``c`` closed, ``h <id>`` a healthy episode finished,
    ``r``/``H``/``d`` a fault, ``p <n>`` a new peak of this process's calls in flight). The env
    that never answers is the first a host builds (a file created once)."""

    def __init__(self, directory: Path, caller: int) -> None:
        self.directory = str(directory)
        self.caller = caller  # the probe env is built here: never the dead one

    def _local(self) -> dict[str, int]:
        return _LOCAL.setdefault(self.directory, {"in_flight": 0, "peak": 0, "built": 0})

    def _log(self, line: str) -> None:
        with open(os.path.join(self.directory, f"{os.getpid()}.log"), "a") as f:
            f.write(line + "\n")

    def new_env(self, worker: int = -1) -> tuple[int, bool]:
        """A uid for a new env (of ``worker``), and whether it is the one that never answers."""
        local = self._local()
        local["built"] += 1
        self._log(f"b {worker}")
        dead = False
        if os.getpid() != self.caller:
            try:
                os.close(os.open(os.path.join(self.directory, "dead"), os.O_CREAT | os.O_EXCL))
                dead = True
            except FileExistsError:
                pass
        return os.getpid() * 100_000 + local["built"], dead

    def enter(self) -> None:
        local = self._local()
        local["in_flight"] += 1
        if local["in_flight"] > local["peak"]:
            local["peak"] = local["in_flight"]
            self._log(f"p {local['peak']}")

    def leave(self) -> None:
        self._local()["in_flight"] -= 1

    def fault(self, kind: str) -> None:
        self._log({"raise": "r", "hang_reset": "H", "dead_env_calls": "d"}[kind])

    def claim_block(self, limit: int) -> bool:
        """Whether this step may block its host (one of the run's ``limit`` blocks, claimed as a
        file); if so, logged with its wall time (``k <time>``)."""
        for k in range(limit):
            try:
                os.close(os.open(os.path.join(self.directory, f"block-{k}"), _CLAIM))
            except FileExistsError:
                continue
            self._log(f"k {time.time():.6f}")
            return True
        return False

    def healthy(self, episode: int, worker: int) -> None:
        self._log(f"h {episode} {worker} {time.time():.6f}")

    def closed(self) -> None:
        self._log("c")

    def read(self) -> dict[str, Any]:
        """Everything logged so far: counts, healthy episode ids, the sum of the peaks."""
        built = closed = not_closed = lost_with_hosts = 0
        peaks: dict[frozenset[str], int] = {}  # by the workers a process hosts: its lives' peak
        faults = {"raise": 0, "hang_reset": 0, "dead_env_calls": 0, "block": 0}
        healthy: list[int] = []
        finished: dict[int, tuple[int, float]] = {}  # episode -> (worker, wall time)
        dropped: set[int] = set()  # finished just before their host blocked: died with it
        for log in Path(self.directory).glob("*.log"):
            process_peak = process_built = process_closed = 0
            workers: set[str] = set()
            block: float | None = None
            ends: list[tuple[int, float]] = []
            for line in log.read_text().splitlines():
                kind, _, value = line.partition(" ")
                if kind == "b":
                    process_built += 1
                    workers.add(value)
                elif kind == "c":
                    process_closed += 1
                elif kind == "h":
                    episode, worker, when = value.split()
                    healthy.append(int(episode))
                    finished[int(episode)] = (int(worker), float(when))
                    ends.append((int(episode), float(when)))
                elif kind == "p":
                    process_peak = max(process_peak, int(value))
                elif kind == "k":
                    faults["block"] += 1
                    block = float(value)
                else:
                    faults[{"r": "raise", "H": "hang_reset", "d": "dead_env_calls"}[kind]] += 1
            # A host killed and restarted lives on in its successor (same workers): the two
            # never run at once, so the place's peak is the higher of theirs.
            place = frozenset(workers)
            peaks[place] = max(peaks.get(place, 0), process_peak)
            built += process_built
            closed += process_closed
            if block is None:
                not_closed += process_built - process_closed
            else:  # killed: its envs were never closed, its last replies never sent
                lost_with_hosts += process_built - process_closed
                dropped.update(e for e, when in ends if when >= block - CUT_MARGIN_S)
        return {
            "built": built,
            "closed": closed,
            "peak": sum(peaks.values()),
            "faults": faults,
            "healthy": healthy,
            "finished": finished,
            "dropped_with_host": dropped,
            "not_closed": not_closed,
            "lost_with_hosts": lost_with_hosts,
        }


class ChaosEnv(AsyncEnv[np.ndarray, Any]):
    """An episode of 5 to 20 steps of random latency; it misbehaves as the run says."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(
        self, census: Census | FileCensus, args: argparse.Namespace, dead: bool, worker: int = -1
    ) -> None:
        self.census = census
        self.args = args
        self.dead = dead
        self.worker = worker  # (process: which worker's env, for the census)
        if isinstance(census, FileCensus):
            self.uid, self.dead = census.new_env(worker)
        else:
            self.uid = census.built
            census.built += 1
        self.rng = np.random.default_rng(args.seed * 1_000_003 + self.uid)
        self.resets = 0
        self.t = 0
        self.length = 0
        self.episode = -1
        self.faulty = False
        self.block_every = args.block_every if isinstance(census, FileCensus) else 0

    async def _hang(self) -> None:
        await asyncio.Event().wait()

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        census = self.census
        census.enter()
        try:
            self.resets += 1
            self.episode = self.uid * 1_000_000 + self.resets
            self.faulty = False
            if self.dead:
                census.fault("dead_env_calls")
                await self._hang()
            if self.rng.random() < self.args.p_hang_reset:
                census.fault("hang_reset")
                await self._hang()
            await asyncio.sleep(float(self.rng.uniform(0, 2 * self.args.latency)))
            self.t = 0
            self.length = int(self.rng.integers(5, 21))
            return np.array([0, self.episode % 1000], np.float32), {"uid": self.episode}
        finally:
            census.leave()

    async def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        census = self.census
        census.enter()
        try:
            if self.dead:
                census.fault("dead_env_calls")
                await self._hang()
            await asyncio.sleep(float(self.rng.uniform(0, 2 * self.args.latency)))
            if self.rng.integers(self.args.raise_every) == 0:
                census.fault("raise")
                self.faulty = True
                raise RuntimeError("chaos: this step raises")
            if self.block_every and self.rng.integers(self.block_every) == 0:
                if census.claim_block(self.args.blocks):
                    self.faulty = True
                    time.sleep(self.args.block_seconds)  # blocks the host's loop: it is killed
            self.t += 1
            done = self.t >= self.length
            if done and not self.faulty:
                census.healthy(self.episode, self.worker)
            return np.array([self.t, self.episode % 1000], np.float32), 1.0, done, False, {}
        finally:
            census.leave()

    async def close(self) -> None:
        self.census.closed()


async def lag_probe(samples: list[float], stop: asyncio.Event) -> None:
    """How late the loop wakes a task that sleeps ``LAG_PROBE_S`` at a time (seconds)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        start = loop.time()
        await asyncio.sleep(LAG_PROBE_S)
        samples.append(loop.time() - start - LAG_PROBE_S)


async def chaos(args: argparse.Namespace, backend: str = "asyncio") -> dict[str, Any]:
    """One run on ``backend``; the result dict of the checks and numbers."""
    per_worker = args.episodes // args.workers
    census: Census | FileCensus
    tmp = None
    if backend == "asyncio":
        census = Census()
    else:  # the envs live in the env hosts: they report through files
        tmp = tempfile.TemporaryDirectory(prefix="asyncsample-chaos-")
        census = FileCensus(Path(tmp.name), os.getpid())
    dead_slot = 0

    def factory(worker: int = -1) -> ChaosEnv:
        # In this process: the probe is env 0; env 1 is worker 0's first env: it never answers.
        dead = isinstance(census, Census) and census.built == 1 + dead_slot
        return ChaosEnv(census, args, dead=dead, worker=worker)

    # On process each worker's envs know their worker (see the lost episodes below).
    env: Any = factory
    if backend == "process":
        env = [functools.partial(factory, w) for w in range(args.workers)]

    before = asyncio.all_tasks()
    lags: list[float] = []
    stop = asyncio.Event()
    probe = asyncio.create_task(lag_probe(lags, stop))
    options: dict[str, Any] = {}
    if backend == "process":
        options = {"n_processes": 2, "step_timeout": args.step_timeout}
    sampler = Sampler(
        env,
        backend=backend,
        n_workers=args.workers,
        envs_per_worker=per_worker,
        max_concurrency=args.max_concurrency,
        episode_timeout=args.episode_timeout,
        max_restarts=args.max_restarts,
        close_timeout=2.0,
        max_episode_length=100,  # the episodes end by 20 steps; this says they end at all
        seed=args.seed,
        inference="per_worker",  # the agent in the caller, as the study's results were taken
        **options,
    )
    calls: list[dict[str, Any]] = []
    lost_total = 0
    seen: set[int] = set()
    t0 = time.perf_counter()
    try:
        await sampler.start()
        for k in range(args.calls):
            seen.update(census.read()["healthy"])  # finished before this call
            start = time.perf_counter()
            try:
                async with asyncio.timeout(args.deadline):
                    batch = await sampler.obtain_samples(args.quota)
                timed_out = False
            except TimeoutError:
                timed_out = True
            seconds = time.perf_counter() - start
            ended = time.time()
            read = census.read()
            healthy = [u for u in read["healthy"] if u not in seen]
            seen.update(healthy)
            lost = cut = with_host = 0
            if not timed_out:
                got = set(batch.episode_infos["uid"].tolist())
                missing = [u for u in healthy if u not in got]
                with_host = sum(u in read["dropped_with_host"] for u in missing)
                missing = [u for u in missing if u not in read["dropped_with_host"]]
                if read["finished"] and sampler.last_stats is not None:
                    # In a host, an episode can end after its worker met its share and cut the
                    # step (the cancel travels to the host): the sampler gave up on it first.
                    # A worker stopped when its wait before the call's end began.
                    waits = sampler.last_stats.worker_wait_seconds
                    stopped = [ended - wait - CUT_MARGIN_S for wait in waits]
                    late = [
                        u
                        for u in missing
                        if read["finished"][u][1] >= stopped[read["finished"][u][0]]
                    ]
                    cut = len(late)
                    missing = [u for u in missing if u not in set(late)]
                lost = len(missing)
                lost_total += lost
            calls.append(
                {
                    "call": k,
                    "seconds": seconds,
                    "timed_out": timed_out,
                    "transitions": 0 if timed_out else batch.n_transitions,
                    "episodes": 0 if timed_out else len(batch.lengths),
                    "deadline_cuts": 0
                    if timed_out
                    else int(batch.episode_infos.get("deadline", np.zeros(0, bool)).sum()),
                    "healthy_finished": len(healthy),
                    "healthy_lost": lost,
                    "healthy_cut_at_share": cut,
                    "healthy_dropped_with_blocked_host": with_host,
                    "restarts": 0 if sampler.last_stats is None else sampler.last_stats.restarts,
                }
            )
    finally:
        await sampler.aclose()
        stop.set()
        await probe
    total_s = time.perf_counter() - t0
    await asyncio.sleep(0)
    left = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()]
    final = census.read()
    if tmp is not None:
        tmp.cleanup()
    lag_ms = np.array(lags) * 1e3 if lags else np.zeros(1)
    p99 = float(np.percentile(lag_ms, 99))
    bound = args.deadline * 1.05
    ok = {
        # The loop's lag is a timing: a check of the full run only, not of the CI smoke run
        # (on a shared machine, other work delays the loop's wake-ups too).
        **({} if args.quick else {"loop_lag_p99_under_20ms": p99 < 20.0}),
        "calls_by_deadline": all(c["seconds"] <= bound for c in calls),
        "no_call_timed_out": not any(c["timed_out"] for c in calls),
        "no_healthy_episode_lost": lost_total == 0,
        "max_concurrency_kept": final["peak"] <= args.max_concurrency,
        "nothing_left_after_aclose": not left and final["not_closed"] == 0,
    }
    return {
        "study": "chaos",
        "backend": backend,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "load_average": os.getloadavg(),
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "episodes_in_flight": per_worker * args.workers,
        "seconds": total_s,
        "calls": calls,
        "faults": final["faults"],
        "restarts": sum(c["restarts"] for c in calls),
        "peak_env_calls_in_flight": final["peak"],
        "loop_lag_ms": {
            "p50": float(np.percentile(lag_ms, 50)),
            "p99": p99,
            "max": float(lag_ms.max()),
        },
        "tasks_left": [repr(t) for t in left],
        "envs_built": final["built"],
        "envs_closed": final["closed"],
        "envs_not_closed": final["not_closed"],
        "envs_gone_with_killed_hosts": final["lost_with_hosts"],
        "healthy_episodes_lost": lost_total,
        "checks": ok,
        "ok": all(ok.values()),
    }


def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """One run's column of the results page's table."""
    a = result["args"]
    calls = result["calls"]
    secs = [c["seconds"] for c in calls]
    f = result["faults"]
    lag = result["loop_lag_ms"]
    checks = result["checks"]

    def mark(name: str) -> str:
        return "yes" if checks[name] else "**NO**"

    return [
        ("episodes in flight", f"{result['episodes_in_flight']:,}"),
        ("calls", f"{len(calls)} x obtain_samples({a['quota']:,}), deadline {a['deadline']:g} s"),
        (
            "call seconds (median, max)",
            f"{statistics.median(secs):.2f}, {max(secs):.2f} (bound {a['deadline'] * 1.05:.2f})",
        ),
        ("every call by its deadline + 5%", mark("calls_by_deadline")),
        ("calls that timed out", str(sum(c["timed_out"] for c in calls))),
        (
            "faults",
            f"{f['raise']} steps raised (1 in {a['raise_every']}), {f['hang_reset']} resets "
            f"hung ({a['p_hang_reset']:.0%}), {f['dead_env_calls']} calls of the env that never "
            "answers",
        ),
        (
            "blocked event loops",
            (
                f"{f.get('block', 0)} (time.sleep({a['block_seconds']:g}) in a step; host "
                f"killed past step_timeout {a['step_timeout']:g} s)"
            )
            if result["backend"] == "process"
            else "- (the caller's loop cannot be pre-empted)",
        ),
        ("env rebuilds", str(result["restarts"])),
        (
            "episodes cut by episode_timeout",
            f"{sum(c['deadline_cuts'] for c in calls)} (episode_timeout {a['episode_timeout']} s)",
        ),
        (
            "healthy episodes finished / lost",
            f"{sum(c['healthy_finished'] for c in calls):,} / {result['healthy_episodes_lost']}",
        ),
        (
            "ended in a host as their worker stopped (cut, not lost)",
            str(sum(c.get("healthy_cut_at_share", 0) for c in calls)),
        ),
        (
            "ended just before their host blocked (dropped with it, not lost)",
            str(sum(c.get("healthy_dropped_with_blocked_host", 0) for c in calls)),
        ),
        (
            "env calls in flight, peak",
            f"{result['peak_env_calls_in_flight']:,} (max_concurrency {a['max_concurrency']:,}): "
            + mark("max_concurrency_kept"),
        ),
        (
            "caller's loop lag p50 / p99 / max",
            f"{lag['p50']:.1f} / {lag['p99']:.1f} / {lag['max']:.1f} ms "
            + (
                f"(p99 < 20 ms: {mark('loop_lag_p99_under_20ms')})"
                if "loop_lag_p99_under_20ms" in checks
                else "(not checked in the smoke run: a timing)"
            ),
        ),
        (
            "left after aclose()",
            f"{len(result['tasks_left'])} tasks, {result.get('envs_not_closed', 0)} envs not "
            f"closed (besides {result.get('envs_gone_with_killed_hosts', 0)} killed with "
            "their blocked hosts)",
        ),
    ]


def table(results: list[dict[str, Any]]) -> str:
    """The results page's table: a column per backend."""
    columns = [rows(r) for r in results]
    head = "| chaos | " + " | ".join(f"`{r['backend']}`" for r in results) + " |"
    lines = [head, "|---" * (len(results) + 1) + "|"]
    for k, (label, _) in enumerate(columns[0]):
        lines.append(f"| {label} | " + " | ".join(col[k][1] for col in columns) + " |")
    verdict = "passed" if all(r["ok"] for r in results) else "FAILED"
    lines += [
        "",
        "On `process` the envs live in two env hosts' event loops; the peak of env calls in "
        "flight there is the sum of the hosts' peaks. All checks: " + verdict + ".",
    ]
    return "\n".join(lines)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The study's options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="the CI smoke run's budget")
    parser.add_argument("--episodes", type=int, default=2048, help="async envs in flight")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--quota", type=int, default=30_000, help="transitions per call")
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds per call")
    # 2,048 envs at 0.3 s a call ask the loop for about 6,800 steps/s: below what one loop
    # steps, so the lag measures the sampler's slices of the loop, not a saturated loop.
    parser.add_argument("--latency", type=float, default=0.3, help="mean seconds per env call")
    parser.add_argument("--raise-every", type=int, default=350)
    parser.add_argument("--p-hang-reset", type=float, default=0.01)
    parser.add_argument("--episode-timeout", type=float, default=10.0)
    parser.add_argument("--max-concurrency", type=int, default=1024)
    parser.add_argument("--max-restarts", type=int, default=10)
    parser.add_argument(
        "--block-every", type=int, default=5_000, help="process: 1 in N steps blocks its host"
    )
    parser.add_argument("--blocks", type=int, default=3, help="process: at most N blocks a run")
    parser.add_argument("--block-seconds", type=float, default=600.0)
    parser.add_argument(
        "--step-timeout", type=float, default=11.0, help="process (above episode_timeout)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument(
        "--backends", nargs="+", choices=("asyncio", "process"), default=["asyncio", "process"]
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "chaos")
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes, args.workers, args.calls = 256, 4, 2
        args.quota, args.deadline, args.max_concurrency = 3_000, 20.0, 128
        args.latency, args.episode_timeout = 0.05, 5.0
        args.block_every, args.blocks, args.block_seconds, args.step_timeout = 300, 1, 60.0, 6.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point: 0 when every check passed on every backend."""
    args = parse(argv)
    logging.getLogger("asyncsample").setLevel(logging.ERROR)  # a warning per env rebuild
    run = asyncio.run
    if args.loop == "uvloop":
        try:
            import uvloop

            run = uvloop.run
        except ImportError:
            pass
    results = [run(chaos(args, backend)) for backend in args.backends]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "study": "chaos",
        "machine": results[0]["machine"],
        "runs": results,
        "ok": all(r["ok"] for r in results),
    }
    from benchmarks.report import write_own_results

    write_own_results(out, summary, table(results))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
