"""Soak: sample for minutes in every inference mode while envs raise, hang and kill their host.

For each inference mode (``host``, ``batched``, ``per_worker``; ``process`` backend) a sampler
runs a share of the budget: calls of every kind in turn (``obtain_samples``, two
``obtain_fragments`` in a row so that fragments continue across calls and across restarts,
``obtain_exact_episodes``), each with an agent update. Meanwhile its envs, at random from a
generator seeded by the sampler's seed tree, raise, hang (found by ``step_timeout``), SIGKILL
their host or end it with ``os._exit``.

Every batch is checked, every step of it: each observation is ``[step index, episode id]``, so a
lost, repeated, foreign or reordered step shows as a gap; step types must be FIRST, MID...,
TERMINAL/TIMEOUT (a fragment may start with MID only where the previous fragments call cut that
very episode, at that very step); every call returns its quota; every step carries the agent
version of its call. At the end no child process and no shared-memory segment may be left, and
the longest call must stay under a bound derived from ``step_timeout`` (a hung step costs
``step_timeout`` plus a new host, never a chunk's worth of timeouts).

Run: ``python -m benchmarks.soak --minutes 3`` or ``asyncsample bench soak`` (writes
``benchmarks/results/soak/results.json`` and ``.md``). ``tests/test_soak.py`` runs it for ~25 s.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import psutil

from asyncsample import EpisodeBatch, Host, Sampler, StepType

# The hosts receive the env and the agent by value (this module may run as __main__ or be
# imported by the tests, and the hosts never import it).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("host", "batched", "per_worker")
FAULTS = ("raise", "hang", "kill", "exit")
CALLS = ("samples", "fragments", "fragments", "episodes")
#: Seconds a call may take beyond its usual length per fault met in it (a new host, rebuilt
#: envs, redone steps), on a busy 2-core machine.
RESTART_S = 2.0
#: The usual call's length counts this many times in the bound (steady calls vary).
BASE_FACTOR = 3.0
#: The floor of the usual call's length in the bound, in seconds.
BASE_FLOOR_S = 2.0
#: Longest episode (TIMEOUT after it).
MAX_EPISODE = 200
#: Prefixes of the /dev/shm entries Python's multiprocessing makes (heap arenas, shared memory,
#: semaphores).
SHM_PREFIXES = ("pym-", "psm_", "sem.mp-", "wnsm_")


class FaultyEnv(gym.Env):  # type: ignore[type-arg]
    """An env whose observation is ``[step index, episode id]``; it injects faults at random.

    Faults are drawn from a generator seeded by the first seed the env is reset with (the
    sampler's seed tree gives every (re)built env its own), so the episode data stays a pure
    function of the step index. Each fault is logged (one line appended to ``log``) before it
    happens, so the soak can count them.
    """

    def __init__(self, log: str, p: Sequence[float], step_s: float) -> None:
        self.observation_space = gym.spaces.Box(0, np.inf, (2,), np.float64)
        self.action_space = gym.spaces.Discrete(2)
        self.log = log
        self.p = np.cumsum(p)
        self.step_s = step_s
        self.faults: np.random.Generator | None = None
        self.t = 0
        self.episode = 0.0

    def _record(self, kind: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"{kind} {os.getpid()}\n")

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        if self.faults is None:
            self.faults = np.random.default_rng(seed)
        self.t = 0
        self.episode = float(self.np_random.integers(1, 1 << 40))
        return np.array([0.0, self.episode]), {}

    def step(self, action: Any) -> Any:
        assert self.faults is not None
        u = self.faults.random()
        if u < self.p[-1]:
            kind = FAULTS[int(np.searchsorted(self.p, u, side="right"))]
            self._record(kind)
            if kind == "raise":
                raise RuntimeError("injected env exception")
            if kind == "hang":
                time.sleep(3600)
            if kind == "kill":
                os.kill(os.getpid(), 9)
            os._exit(3)
        if self.step_s:
            time.sleep(self.step_s)
        self.t += 1
        done = bool(self.np_random.random() < 0.02)
        return np.array([float(self.t), self.episode]), 1.0, done, False, {}


class SoakAgent:
    """Random actions from its own seeded generator; reports its version in the agent infos."""

    def __init__(self) -> None:
        self.version = 0
        self.rng = np.random.default_rng(0)

    def seed(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def get_actions(self, observations: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        n = len(observations)
        return self.rng.integers(2, size=n), {"version": np.full(n, self.version, np.int64)}

    def get_param_values(self) -> dict[str, int]:
        return {"version": self.version}

    def set_param_values(self, params: dict[str, int]) -> None:
        self.version = int(params["version"])


@dataclass
class Tally:
    """What the checks found in one mode's calls (every count must end at 0 but the first)."""

    transitions: int = 0
    lost: int = 0  # steps missing, repeated or foreign in an episode, or a wrong last observation
    half: int = 0  # episodes returned without their start or end, or with wrong step types
    short: int = 0  # calls short of their quota (or, for fragments, over their bound)
    stale: int = 0  # steps whose agent version is not their call's
    problems: list[str] = field(default_factory=list)

    def bad(self, what: str, count: int, detail: str) -> None:
        setattr(self, what, getattr(self, what) + count)
        if len(self.problems) < 20:
            self.problems.append(detail)


def check_batch(
    batch: EpisodeBatch,
    call: str,
    quota: int,
    n_envs: int,
    version: int,
    cut: dict[float, float],
    tally: Tally,
) -> None:
    """Check every step of ``batch``; ``cut`` maps the episodes the previous fragments call cut
    to the step index they continue at (updated for the next call)."""
    n = batch.n_transitions
    tally.transitions += n
    if call == "episodes":
        if batch.n_episodes != quota:  # the episodes per worker x the workers
            tally.bad("short", 1, f"{call}: {batch.n_episodes} episodes, wanted {quota}")
    elif n < quota or (call == "fragments" and n >= quota + n_envs):
        tally.bad("short", 1, f"{call}: {n} transitions for a quota of {quota}")
    versions = batch.agent_infos.get("version")
    if versions is None or (versions != version).any():
        tally.bad("stale", n, f"{call}: agent versions {np.unique(versions)} != {version}")
    fragments = call == "fragments"
    next_cut: dict[float, float] = {}
    for i, steps in enumerate(batch.episode_slices):
        obs = batch.observations[steps]
        types = batch.step_types[steps]
        length = len(obs)
        t0, episode = float(obs[0, 0]), float(obs[0, 1])
        first, last = StepType(types[0]), StepType(types[-1])
        ended = last in (StepType.TERMINAL, StepType.TIMEOUT)
        if t0 == 0:
            start_ok = first == StepType.FIRST or (length == 1 and first != StepType.MID)
        else:  # only a fragment that continues one the previous call cut, where it cut it
            start_ok = fragments and first == StepType.MID and cut.get(episode) == t0
        middle = types[1:-1] if length > 2 else types[:0]
        if not start_ok or (middle != StepType.MID).any() or (not ended and not fragments):
            tally.bad("half", 1, f"{call}: episode {episode:.0f} from t={t0:.0f}, types {types}")
        expected = np.arange(t0, t0 + length)
        wrong = int(np.sum(obs[:, 0] != expected)) + int(np.sum(obs[:, 1] != episode))
        last_obs = batch.last_observations[i]
        wrong += int(last_obs[0] != t0 + length) + int(last_obs[1] != episode)
        if ended and last == StepType.TIMEOUT and t0 + length != MAX_EPISODE:
            wrong += 1
        if wrong:
            tally.bad("lost", wrong, f"{call}: episode {episode:.0f}: {wrong} steps out of place")
        if not ended:
            next_cut[episode] = t0 + length
    cut.clear()
    if fragments:
        cut.update(next_cut)


def memory() -> dict[str, float]:
    """RSS in MiB of this process (``main``) and of its children (``children``, summed)."""
    me = psutil.Process()
    children = 0.0
    for child in me.children(recursive=True):
        try:
            children += child.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return {"main": me.memory_info().rss / 2**20, "children": children}


def shm_entries() -> set[str]:
    """The multiprocessing entries of /dev/shm (see :data:`SHM_PREFIXES`)."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {e for e in os.listdir("/dev/shm") if e.startswith(SHM_PREFIXES)}


def host_children() -> list[int]:
    """Pids of this process's children that host envs (not multiprocessing's own helpers)."""
    from asyncsample.backends.process import support_process_pids

    support = support_process_pids()
    pids = []
    for child in psutil.Process().children(recursive=True):
        if child.pid in support:
            continue
        try:
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                pids.append(child.pid)
        except psutil.Error:
            continue
    return pids


def fault_counts(log: str) -> dict[str, int]:
    """Faults logged so far, by kind."""
    try:
        with open(log) as f:
            kinds = [line.split()[0] for line in f if line.strip()]
    except FileNotFoundError:
        kinds = []
    return {k: kinds.count(k) for k in FAULTS}


async def soak_mode(mode: str, args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """Run one inference mode for ``seconds``; its figures and what its checks found."""
    fd, log = tempfile.mkstemp(prefix=f"asyncsample-soak-{mode}-")
    os.close(fd)
    p = (args.p_raise, args.p_hang, args.p_kill, args.p_exit)

    def factory() -> gym.Env:  # type: ignore[type-arg]
        return FaultyEnv(log, p, args.step_s)

    inference: Any = Host(chunk_steps=args.chunk_steps) if mode == "host" else mode
    workers, envs = args.workers, args.envs_per_worker
    sampler = Sampler(
        factory,
        SoakAgent(),
        n_workers=workers,
        envs_per_worker=envs,
        backend="process",
        n_processes=args.processes,
        inference=inference,
        max_episode_length=MAX_EPISODE,
        step_timeout=args.step_timeout,
        max_restarts=1000,
        seed=args.seed,
    )
    tally = Tally()
    cut: dict[float, float] = {}
    calls: list[dict[str, Any]] = []
    version = 0
    try:
        async with sampler:
            await sampler.obtain_samples(args.batch // 4, agent_update={"version": version})
            mem_start = memory()
            faults_start = fault_counts(log)
            restarts_start = sampler.restarts
            start = time.perf_counter()
            deadline = start + seconds
            i = 0
            while time.perf_counter() < deadline:
                call = CALLS[i % len(CALLS)]
                i += 1
                version += 1
                update = {"version": version}
                before = fault_counts(log)
                t = time.perf_counter()
                if call == "samples":
                    quota = args.batch
                    batch = await sampler.obtain_samples(quota, agent_update=update)
                elif call == "fragments":
                    quota = args.batch
                    batch = await sampler.obtain_fragments(quota, agent_update=update)
                else:
                    per_worker = max(1, args.batch // (workers * 60))
                    quota = per_worker * workers
                    batch = await sampler.obtain_exact_episodes(per_worker, agent_update=update)
                took = time.perf_counter() - t
                after = fault_counts(log)
                met = {k: after[k] - before[k] for k in FAULTS}
                calls.append({"call": call, "seconds": took, "faults": met})
                check_batch(batch, call, quota, workers * envs, version, cut, tally)
            elapsed = time.perf_counter() - start
            mem_end = memory()
            restarts = sampler.restarts - restarts_start
            faults_end = fault_counts(log)
    finally:
        os.unlink(log)
    faults = {k: faults_end[k] - faults_start[k] for k in FAULTS}
    usual = statistics.median(c["seconds"] for c in calls) if calls else 0.0
    base = max(BASE_FLOOR_S, BASE_FACTOR * usual)
    worst_ratio = 0.0
    longest = max(calls, key=lambda c: c["seconds"]) if calls else None
    over = []
    for c in calls:
        met = c["faults"]
        bound = base + met["hang"] * args.step_timeout + sum(met.values()) * RESTART_S
        c["bound"] = bound
        worst_ratio = max(worst_ratio, c["seconds"] / bound)
        if c["seconds"] > bound:
            over.append(c)
    return {
        "mode": mode,
        "seconds": elapsed,
        "calls": len(calls),
        "transitions": tally.transitions,
        "steps_per_second": tally.transitions / elapsed if elapsed else 0.0,
        "faults_injected": faults,
        "restarts": restarts,
        "transitions_lost": tally.lost,
        "half_episodes": tally.half,
        "calls_short": tally.short,
        "stale_agent_steps": tally.stale,
        "problems": tally.problems,
        "usual_call_s": usual,
        "longest_call": longest,
        "calls_over_bound": over,
        "hung_calls": [c for c in calls if c["faults"]["hang"]],
        "worst_call_to_bound": worst_ratio,
        "memory_mib_start": mem_start,
        "memory_mib_end": mem_end,
        "rss_growth_mib": {
            "main": mem_end["main"] - mem_start["main"],
            "children": mem_end["children"] - mem_start["children"],
        },
    }


class _Counter(logging.Handler):
    """Counts the sampler's log records by level (a soak logs a warning per restart)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[record.levelname] = self.counts.get(record.levelname, 0) + 1


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Soak every mode in ``args.modes`` for an equal share of ``args.minutes``; the figures,
    the leak check, and ``ok``: whether every check passed.

    The sampler's log records (a warning per restart) are counted, not printed.
    """
    shm_before = shm_entries()
    # Processes that were children before (a Ray cluster the test suite started, say) are not
    # the soak's to close.
    children_before = set(host_children())
    share = args.minutes * 60 / len(args.modes)
    logger = logging.getLogger("asyncsample")
    counter = _Counter()
    propagate, level = logger.propagate, logger.level
    logger.addHandler(counter)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        modes = [await soak_mode(mode, args, share) for mode in args.modes]
    finally:
        logger.removeHandler(counter)
        logger.propagate, logger.level = propagate, level
    # Closing a sampler waits for its hosts: any process or segment left now is a leak.
    deadline = time.monotonic() + 5.0
    left = [p for p in host_children() if p not in children_before]
    while left and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        left = [p for p in host_children() if p not in children_before]
    shm_left = sorted(shm_entries() - shm_before)
    ok = (
        not left
        and not shm_left
        and all(
            m["transitions_lost"] == m["half_episodes"] == m["calls_short"] == 0
            and m["stale_agent_steps"] == 0
            and not m["calls_over_bound"]
            and m["calls"] > 0
            for m in modes
        )
    )
    totals = {
        key: sum(m[key] for m in modes)
        for key in ("calls", "transitions", "restarts", "transitions_lost", "half_episodes")
    }
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        # Over every mode:
        **totals,
        "calls_short_of_quota": sum(m["calls_short"] for m in modes),
        "faults_injected": {k: sum(m["faults_injected"][k] for m in modes) for k in FAULTS},
        "longest_call_s": max(
            (m["longest_call"]["seconds"] for m in modes if m["calls"]), default=0
        ),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "modes": modes,
        "log_records": counter.counts,
        "processes_left": left,
        "shm_left": shm_left,
        "ok": ok,
    }


def table(result: dict[str, Any]) -> str:
    """A markdown table: one column per mode."""
    modes = result["modes"]

    def row(name: str, fn: Any) -> str:
        return f"| {name} | " + " | ".join(fn(m) for m in modes) + " |"

    def faults(m: dict[str, Any]) -> str:
        f = m["faults_injected"]
        return f"{f['raise']} raises, {f['hang']} hangs, {f['kill']} SIGKILLs, {f['exit']} exits"

    def longest(m: dict[str, Any]) -> str:
        c = m["longest_call"]
        if c is None:
            return "-"
        met = ", ".join(f"{v} {k}" for k, v in c["faults"].items() if v) or "no fault"
        return f"{c['seconds']:.2f} s ({c['call']}, {met}; bound {c['bound']:.1f} s)"

    lines = [
        "| soak | " + " | ".join(f"`{m['mode']}`" for m in modes) + " |",
        "| --- |" + " --- |" * len(modes),
        row("duration", lambda m: f"{m['seconds']:.0f} s, {m['calls']} calls"),
        row(
            "transitions",
            lambda m: f"{m['transitions']:,} ({m['steps_per_second']:,.0f} steps/s)",
        ),
        row("faults injected", faults),
        row("restarts", lambda m: str(m["restarts"])),
        row("steps lost, repeated or out of place", lambda m: str(m["transitions_lost"])),
        row("half-made episodes", lambda m: str(m["half_episodes"])),
        row("calls short of their quota", lambda m: str(m["calls_short"])),
        row("steps with another call's agent version", lambda m: str(m["stale_agent_steps"])),
        row("usual call (median)", lambda m: f"{m['usual_call_s']:.2f} s"),
        row("longest call", longest),
        row("calls over their bound", lambda m: str(len(m["calls_over_bound"]))),
        row(
            "RSS growth (main; hosts)",
            lambda m: (
                f"{m['rss_growth_mib']['main']:+.1f}; {m['rss_growth_mib']['children']:+.1f} MiB"
            ),
        ),
    ]
    left = result["processes_left"]
    shm = result["shm_left"]
    lines.append("")
    lines.append(
        f"Left behind after close: {len(left)} processes, {len(shm)} /dev/shm entries. "
        f"All checks: {'passed' if result['ok'] else 'FAILED'}."
    )
    return "\n".join(lines)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The soak's options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="budget, over every mode")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--envs-per-worker", type=int, default=4)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4000, help="transitions per call")
    parser.add_argument("--chunk-steps", type=int, default=64, help='inference="host" chunks')
    parser.add_argument("--step-s", type=float, default=1e-4, help="seconds per env step")
    parser.add_argument("--p-raise", type=float, default=2e-4)
    parser.add_argument("--p-hang", type=float, default=2e-5)
    parser.add_argument("--p-kill", type=float, default=3e-5)
    parser.add_argument("--p-exit", type=float, default=3e-5)
    parser.add_argument("--step-timeout", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak" / "results.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point: 0 when every check passed."""
    args = parse(argv)
    try:
        import uvloop

        result = uvloop.run(soak(args))
    except ImportError:
        result = asyncio.run(soak(args))
    from benchmarks.report import write_json

    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    md = table(result)
    args.out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
