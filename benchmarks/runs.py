"""What every contender shares: the run's spec and result, the timed window with its CPU and
memory accounts, the loop-lag probe, and the timed step loops of the vector peers.

Its own module so that the peers' modules (:mod:`benchmarks.ceiling`,
:mod:`benchmarks.vector_peers`, :mod:`benchmarks.torchrl_peers`) and
:mod:`benchmarks.contenders`, which lists them, import it without importing each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import psutil

__all__ = [
    "CpuAccount",
    "LagProbe",
    "MemoryMonitor",
    "RunResult",
    "RunSpec",
    "Skipped",
    "TimedPhase",
    "batched_actions",
    "env_fns",
    "timed_loop",
    "timed_steps",
]


class Skipped(Exception):
    """A contender cannot run here (library missing, env unsupported, not implemented)."""


@dataclass
class RunSpec:
    """What one run measures.

    Attributes:
        contender: Key of :data:`CONTENDERS`.
        env: Short env name (a key of ``benchmarks.envs.ENV_IDS``) or a gymnasium id.
        env_id: The id passed to ``gymnasium.make`` (``"benchmarks.envs:FixedCost-v0"``).
        n_envs: Env copies (for asyncsample: ``n_workers * envs_per_worker``).
        n_transitions: Transitions to time (at least this many are stepped).
        warmup: Transitions stepped before timing starts.
        seed: Seed of envs and agent.
        n_workers: asyncsample worker coroutines.
        envs_per_worker: asyncsample envs per worker.
        n_processes: asyncsample env-host processes (process backend).
        cores: CPU budget (threads for EnvPool).
        fragment_steps: asyncsample steps per env per ``obtain_fragments`` call.
        instrument: Sample memory (and, for asyncsample, event-loop lag) during the run.
        memory_interval: Seconds between memory samples.
        min_seconds: Keep stepping past ``n_transitions`` until the timed phase lasted
            this long (fast contenders get a measurement long enough to be stable).
        policy: ``""``: random actions; ``"mlp"``: the policy workload's torch MLP;
            ``"cnn"``: the Nature-CNN (Atari).
        inference: asyncsample's ``inference`` with a policy: ``"per_worker"``,
            ``"batched"`` (lockstep), ``"batched-threaded"``, ``"eager"`` or
            ``"eager-threaded"``.
        batch_size: EnvPool async's ``batch_size`` (0: half the envs).
        call: asyncsample's call: ``"fragments"`` (``obtain_fragments``) or ``"samples"``.
        fraction: asyncsample's ``fraction_samples``.
        slow_worker: With ``slow_cost``, the worker whose envs are stragglers (-1: none).
        slow_cost: Step cost of the straggler's envs (``FixedCost-v0``'s ``step_cost``).
        episode_length: asyncsample's ``max_episode_length`` (0: the env's own).
    """

    contender: str
    env: str
    env_id: str
    n_envs: int
    n_transitions: int
    warmup: int
    seed: int = 0
    n_workers: int = 1
    envs_per_worker: int = 1
    n_processes: int = 2
    cores: int = 2
    fragment_steps: int = 128
    instrument: bool = False
    memory_interval: float = 0.5
    min_seconds: float = 1.0
    policy: str = ""
    inference: str = "per_worker"
    batch_size: int = 0
    call: str = "fragments"
    fraction: float = 1.0
    slow_worker: int = -1
    slow_cost: float = 0.0
    episode_length: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Return the spec as a JSON-able dict."""
        return asdict(self)


@dataclass
class RunResult:
    """What one run measured.

    Attributes:
        transitions: Transitions stepped in the timed phase.
        seconds: Wall time of the timed phase.
        memory: :meth:`MemoryMonitor.summary` of the timed phase, if instrumented.
        lag: :meth:`LagProbe.summary` (asyncsample only), if instrumented.
        cpu: :attr:`CpuAccount.result`: cores used by the contender's processes and by
            everything else on the machine during the timed phase.
        notes: Free-form remarks.
    """

    transitions: int
    seconds: float
    memory: dict[str, Any] | None = None
    lag: dict[str, Any] | None = None
    cpu: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Transitions per second."""
        return self.transitions / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """Return the result as a JSON-able dict (with ``rate``)."""
        out = asdict(self)
        out["rate"] = self.rate
        return out


# --------------------------------------------------------------------------------------------
# Instruments


def _uss_of(proc: psutil.Process) -> tuple[int | None, int | None]:
    """USS and PSS of a process (None where they cannot be read).

    PSS splits the shared pages among the processes that map them, so the PSS of a process
    tree adds up to what the tree costs (RSS counts a forked child's shared pages twice).
    """
    try:
        info = proc.memory_full_info()
    except (psutil.AccessDenied, AttributeError, NotImplementedError, OSError):
        return None, None
    return int(getattr(info, "uss", 0)) or None, int(getattr(info, "pss", 0)) or None


class MemoryMonitor:
    """Memory of this process and all its descendants during a phase.

    A background thread samples RSS every ``interval`` (cheap: ``/proc/PID/statm``) and keeps
    the peaks. USS (``memory_full_info`` walks every mapping of the target under its mmap
    lock; sampled at 2 Hz it visibly slowed asyncsample on Image-v0 and raised its loop lag)
    is read once, when the phase ends, after its time was taken. Disabled monitors cost
    nothing.
    """

    def __init__(self, enabled: bool = True, interval: float = 0.5) -> None:
        """Create the monitor.

        Args:
            enabled: When False, :meth:`summary` returns None and no thread runs.
            interval: Seconds between RSS samples.
        """
        self.enabled = enabled
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._main = psutil.Process(os.getpid())
        self._procs: list[psutil.Process] = [self._main]
        self._peaks: dict[int, dict[str, Any]] = {}
        self._total_rss = 0
        self._total_uss: int | None = None
        self._samples = 0

    def _refresh(self) -> None:
        """Find the current descendants (costly: it scans /proc, so not on every sample)."""
        with contextlib.suppress(psutil.Error):
            self._procs = [self._main, *self._main.children(recursive=True)]

    def sample(self, uss: bool = False) -> None:
        """Take one sample of RSS (and of USS when ``uss``) now."""
        total_rss = 0
        total_uss: int | None = 0
        for proc in self._procs:
            try:
                rss = int(proc.memory_info().rss)
                peak = self._peaks.get(proc.pid)
                if peak is None:
                    peak = {"pid": proc.pid, "name": proc.name(), "rss_peak": 0, "uss": None,
                            "pss": None}  # fmt: skip
                    self._peaks[proc.pid] = peak
            except psutil.Error:
                continue
            total_rss += rss
            peak["rss_peak"] = max(peak["rss_peak"], rss)
            if uss:
                peak["uss"], peak["pss"] = _uss_of(proc)
                total_uss = (
                    None if total_uss is None or peak["uss"] is None else (total_uss + peak["uss"])
                )
        self._total_rss = max(self._total_rss, total_rss)
        if uss:
            self._total_uss = total_uss
        self._samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> MemoryMonitor:
        if self.enabled:
            self._refresh()
            self.sample()
            self._thread = threading.Thread(target=self._loop, name="mem-monitor", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            with contextlib.suppress(Exception):
                self._refresh()
                self.sample(uss=True)

    def summary(self) -> dict[str, Any] | None:
        """RSS peaks and end-of-phase USS: main process, children (each and summed), total."""
        if not self.enabled or not self._samples:
            return None
        main = self._peaks.get(self._main.pid, {"rss_peak": 0, "uss": None})
        children = [p for pid, p in self._peaks.items() if pid != self._main.pid]
        ussv = [c["uss"] for c in children]
        pssv = [c.get("pss") for c in children]
        return {
            "samples": self._samples,
            "main_rss": main["rss_peak"],
            "main_uss": main["uss"],
            "n_children": len(children),
            "children_rss_sum": sum(c["rss_peak"] for c in children),
            "children_uss_sum": sum(ussv) if all(u is not None for u in ussv) else None,
            "children_rss_max": max((c["rss_peak"] for c in children), default=0),
            "total_rss_peak": self._total_rss,
            "total_uss": self._total_uss,
            "total_pss": (main.get("pss") or 0) + sum(p or 0 for p in pssv) or None,
            "children": sorted(children, key=lambda c: c["pid"]),
        }


def _tree_cpu(root: psutil.Process) -> dict[int, float]:
    """CPU seconds (user + system) of ``root`` and each of its descendants, by pid."""
    out: dict[int, float] = {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        procs = [root]
    for proc in procs:
        try:
            t = proc.cpu_times()
            out[proc.pid] = t.user + t.system
        except psutil.Error:
            continue
    return out


def _machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot."""
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return busy, getattr(t, "steal", 0.0)


class CpuAccount:
    """Who used the CPUs during a phase: this process tree, everyone else, the hypervisor.

    ``own_cores`` is the CPU the contender's processes used per second of wall time (at
    most the core count), ``main_cores`` the part of it used by the main process (the
    sampler, and the policy where it runs there), ``host_cores`` the rest (env processes);
    ``foreign_cores`` is what other processes on the machine used
    meanwhile (the measurement was disturbed when it is well above zero); ``steal_cores``
    is time the hypervisor gave to other machines.
    """

    def __init__(self) -> None:
        """Create an account; call :meth:`start` and :meth:`stop` around the phase."""
        self._root = psutil.Process(os.getpid())
        self._t0 = 0.0
        self._tree0: dict[int, float] = {}
        self._mach0 = (0.0, 0.0)
        self.result: dict[str, float] | None = None

    def start(self) -> None:
        """Snapshot the counters."""
        self._tree0 = _tree_cpu(self._root)
        self._mach0 = _machine_cpu()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        """Snapshot again and compute the shares."""
        wall = time.perf_counter() - self._t0
        busy1, steal1 = _machine_cpu()
        tree1 = _tree_cpu(self._root)
        if wall <= 0:
            return
        own = sum(cpu - self._tree0.get(pid, 0.0) for pid, cpu in tree1.items())
        busy = busy1 - self._mach0[0]
        pid = self._root.pid
        main = tree1.get(pid, 0.0) - self._tree0.get(pid, 0.0)
        self.result = {
            "own_cores": own / wall,
            "main_cores": main / wall,
            "host_cores": (own - main) / wall,
            "foreign_cores": max(0.0, busy - own) / wall,
            "steal_cores": (steal1 - self._mach0[1]) / wall,
        }


class TimedPhase:
    """The timed phase of a run: wall time, CPU account and (if instrumented) memory.

    Use as ``with TimedPhase(spec) as phase: ...`` with ``while phase.more(done)``
    inside; then :meth:`result`.
    """

    def __init__(self, spec: RunSpec) -> None:
        """Create the phase for ``spec``."""
        self.spec = spec
        self.memory = MemoryMonitor(spec.instrument, spec.memory_interval)
        self.cpu = CpuAccount()
        self.t0 = 0.0
        self.seconds = 0.0

    def __enter__(self) -> TimedPhase:
        self.memory.__enter__()
        self.cpu.start()
        self.t0 = time.perf_counter()
        return self

    def more(self, done: int) -> bool:
        """True until ``n_transitions`` are done and ``min_seconds`` have passed."""
        if done < self.spec.n_transitions:
            return True
        return time.perf_counter() - self.t0 < self.spec.min_seconds

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpu.stop()
        self.memory.__exit__(*exc)

    def result(self, transitions: int, **kwargs: Any) -> RunResult:
        """The :class:`RunResult` of the phase."""
        return RunResult(
            transitions=transitions,
            seconds=self.seconds,
            memory=self.memory.summary(),
            cpu=self.cpu.result,
            **kwargs,
        )


class LagProbe:
    """Event-loop lag: a task sleeps ``interval`` in a loop and records how late each wake-up is."""

    def __init__(self, interval: float = 1e-3) -> None:
        """Create the probe.

        Args:
            interval: The sleep of each round, in seconds.
        """
        self.interval = interval
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        clock = time.perf_counter
        while True:
            t = clock()
            await asyncio.sleep(self.interval)
            self.lags.append(clock() - t - self.interval)

    def start(self) -> None:
        """Start probing in the running loop."""
        self.lags = []
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop probing."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def summary(self) -> dict[str, Any]:
        """p50/p99/max of the lag in milliseconds, and the number of wake-ups."""
        if not self.lags:
            return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
        arr = np.asarray(self.lags) * 1e3
        return {
            "n": int(arr.size),
            "p50_ms": float(np.percentile(arr, 50)),
            "p99_ms": float(np.percentile(arr, 99)),
            "max_ms": float(arr.max()),
        }


# --------------------------------------------------------------------------------------------
# Helpers


def env_fns(spec: RunSpec) -> list[Callable[[], gym.Env]]:
    """Picklable env factories, one per env copy."""
    return [functools.partial(gym.make, spec.env_id) for _ in range(spec.n_envs)]


def batched_actions(single: gym.Space, n: int, seed: int) -> gym.Space:
    """The seeded batched action space that the vector peers sample from."""
    space = gym.vector.utils.batch_space(single, n)
    space.seed(seed)
    return space


def timed_steps(spec: RunSpec, step: Callable[[Any], int], actions: gym.Space) -> RunResult:
    """Step a vector env: warm-up untimed, then ``spec.n_transitions`` or more timed.

    Args:
        spec: The run.
        step: Steps all envs once with the given batched action and returns how many
            real transitions that produced.
        actions: The seeded batched action space.

    Returns:
        The timed result.
    """
    return timed_loop(spec, lambda: step(actions.sample()))


def timed_loop(spec: RunSpec, step: Callable[[], int]) -> RunResult:
    """Call ``step`` (it returns the real transitions it made): warm-up untimed, then timed."""
    warm = 0
    while warm < spec.warmup:
        warm += step()
    done = 0
    with TimedPhase(spec) as phase:
        while phase.more(done):
            done += step()
    return phase.result(done)
