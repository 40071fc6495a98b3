"""Where the sub-envs of a vector-env face step: in the caller's process, on env hosts, or both.

:func:`choose` predicts one lockstep step of each placement from the probe env's step time and
the cost of a host round trip (see :func:`_predict`), and leaves the caller's process only when
that is predicted ``_MARGIN`` faster: measurement noise on a loaded machine cannot tip a cheap env
onto hosts; on a busy machine (:func:`machine_busy`) it stays there whatever the envs cost. The
round trip is estimated once per interpreter from two threads over a socket pair (starting a
process would cost about a second), each woken by the other's message as a host that sleeps
between steps is (:func:`hop_seconds`); a host that polls (:func:`spins`) is not woken, and its
round trip is estimated from the same threads taking turns on one CPU (:func:`polled_hop_seconds`).
Every sub-env in the caller's process pays a cache refill after the caller's work between steps
(``_COLD``). The polled round trip and the refill count for envs of at least ``_MIN_HOP`` only.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncsample._info_cells import columnar
from asyncsample.backends import traits
from asyncsample.backends._threads import BUSY_CHECK, runnable

__all__ = [
    "BUSY_CHECK",
    "CALLER_SPIN",
    "HOST_SPIN",
    "Placement",
    "choose",
    "host_slices",
    "machine_busy",
    "place",
    "polled_hop_seconds",
    "probe_step",
    "probe_step_seconds",
    "runnable",
    "spins",
]

LOGGER = logging.getLogger("asyncsample")

#: Another placement must be predicted this much faster than the caller's process.
_MARGIN = 1.2
#: A host round trip, in thread wake-up round trips (measured against the process backend's
#: lockstep step of a no-op env, 2026-11-25).
_HOP_FACTOR = 4.0
_MIN_HOP = 40e-6
#: A host that sleeps between steps is woken by each request: inside a training loop (the
#: caller runs its policy between steps) its round trip is this many back-to-back ones (a
#: no-op env's host round trip: 50 us back to back, 75 us with 0.3 ms between steps, 143 us
#: with 2 ms; 2026-11-27). Hosts that poll instead (see :func:`spins`) are not asleep.
_WAKE_FACTOR = 2.0
#: Where the caller and every host process have a CPU each (:func:`spins`): how long a host
#: polls for the next step request after its reply before it sleeps (it must outlast the
#: caller's policy between two steps, a few hundred microseconds), and how long the caller
#: polls for the replies after stepping its own share before it sleeps.
HOST_SPIN = 1e-3
CALLER_SPIN = 2e-4
#: A host that polls (see :func:`spins`) is never woken: its round trip is the transport and the
#: two sides' work, which the probe times as two threads taking turns on one CPU (a switch each
#: way, no CPU woken from idle; 3-5 us on the 2-CPU machine, 2026-11-28), times this: a no-op
#: env's host round trip that does not wait for a sleeping CPU is ~50 us there (back to back,
#: 2026-11-27; see _WAKE_FACTOR).
_POLLED_FACTOR = 12.0
#: A polling host takes a quiet step (no infos, every observation in the shared buffers)
#: through shared memory, without a frame either way (see ``backends._handoff``): its round trip
#: is this share of the polled estimate (CartPole-v1 x1 on a polling host 25.2 us a step against
#: 12.5 us in the caller's process, where the polled estimate was ~123 us; 2026-11-30).
_FLAG_SHARE = 0.125
#: Inside a training loop the caller's process steps its sub-envs right after its own work (the
#: policy), with the env's code and data out of the caches: in a CleanRL-shaped PPO loop,
#: HalfCheetah-v5 under CleanRL's wrappers took 190 us a step in the caller's process against a
#: probe step of 80-100 us (one env; four took 480 us against 320; 2026-11-28), while a host
#: that steps nothing else keeps them warm. The placement with every sub-env in the caller's
#: process is predicted one probe step longer, at most this much, for envs whose step costs at
#: least _MIN_HOP (see _costly).
_COLD = 100e-6
#: The probe env is stepped for at most this long (and at most _PROBE_STEPS steps).
_PROBE_BUDGET = 0.02
_PROBE_STEPS = 50
#: A quiet env resets with an info (a frame) at most once per this many steps.
_NOISY_RESETS = 8

_hop: float | None = None
_polled_hop: float | None = None


@dataclass(frozen=True)
class Placement:
    """Where the sub-envs of a face step.

    Attributes:
        caller_envs: sub-envs stepped in the caller's process (the last ones).
        n_processes: env-host processes for the others (0: none).
        reason: why (measured, or forced by the arguments).
        env_step: the probe env's measured step time in seconds (``None``: not measured).
        hop: the estimated round trip to a host that sleeps between steps, in seconds (``None``:
            not measured).
        polled_hop: the estimated round trip to a host that polls (:func:`spins`), in seconds
            (``None``: not measured).
    """

    caller_envs: int
    n_processes: int
    reason: str
    env_step: float | None = None
    hop: float | None = None
    polled_hop: float | None = None

    @property
    def kind(self) -> str:
        """``"in-process"``, ``"hosts"`` or ``"mixed"``."""
        if self.n_processes == 0:
            return "in-process"
        return "mixed" if self.caller_envs else "hosts"

    def describe(self, num_envs: int) -> str:
        """One line for the log and ``repr``."""
        hosts = f"on {self.n_processes} env-host processes"
        if self.kind == "in-process":
            where = f"all {num_envs} sub-envs in the caller's process"
        elif self.kind == "hosts":
            where = f"{num_envs} sub-envs {hosts}"
        else:
            where = f"{self.caller_envs} sub-envs in the caller's process and "
            where += f"{num_envs - self.caller_envs} {hosts}"
        return f"{where} ({self.reason})"


def hop_seconds() -> float:
    """The estimated cost of a round trip to a host that sleeps between requests on this machine
    (measured once: two threads over a socket pair, each woken by the other's message as a
    sleeping host and its caller are)."""
    global _hop
    if _hop is None:
        times = _thread_round_trips(pinned=False)
        _hop = max(_MIN_HOP, _HOP_FACTOR * statistics.median(times[20:]))
    return _hop


def polled_hop_seconds() -> float:
    """The estimated cost of a round trip to a host that polls for the next request (see
    :func:`spins`) on this machine: no wake-up, so predicted from the probe's threads taking
    turns on one CPU (``_POLLED_FACTOR``; measured once). Where a thread cannot be pinned, from
    the fastest tenth of the unpinned round trips (those that woke no idle CPU)."""
    global _polled_hop
    if _polled_hop is None:
        times = _thread_round_trips(pinned=True)
        _polled_hop = max(_MIN_HOP, _POLLED_FACTOR * statistics.quantiles(times[20:], n=10)[0])
    return _polled_hop


def _thread_round_trips(pinned: bool) -> list[float]:
    """200 round trips of a byte between this thread and an echo thread over a socket pair;
    ``pinned``: both on the CPU this thread is on (this thread's affinity is put back)."""
    a, b = socket.socketpair()
    here: set[int] | None = None
    if pinned and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            allowed = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {_current_cpu(allowed)})
            here = allowed  # the echo thread inherits the one CPU

    def echo() -> None:
        while True:
            data = b.recv(1)
            if not data or data == b"q":
                return
            b.send(data)

    thread = threading.Thread(target=echo, name="asyncsample-hop-probe", daemon=True)
    thread.start()
    times: list[float] = []
    try:
        for _ in range(200):
            t0 = time.perf_counter()
            a.send(b"x")
            a.recv(1)
            times.append(time.perf_counter() - t0)
        a.send(b"q")
        thread.join(1.0)
    finally:
        a.close()
        b.close()
        if here is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, here)
    return times


def _current_cpu(allowed: set[int]) -> int:
    """The CPU this thread runs on (the 39th field of ``/proc/thread-self/stat``), else the
    first of ``allowed``."""
    try:
        with open("/proc/thread-self/stat", "rb") as f:
            cpu = int(f.read().rsplit(b")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return min(allowed)
    return cpu if cpu in allowed else min(allowed)


def probe_step_seconds(env: Any) -> float | None:
    """The median step time of ``env`` (reset first, random actions, reset at episode ends),
    or ``None`` when it cannot be stepped so (then nothing is decided from it)."""
    return probe_step(env)[0]


def probe_step(env: Any) -> tuple[float | None, bool]:
    """:func:`probe_step_seconds`, and whether a polling host would take its steps without a
    frame (a quiet env): every step's info empty or plain numbers (they cross in the info
    cells, see :mod:`asyncsample._info_cells`), and resets with an info (whose replies are
    frames) at most one step in :data:`_NOISY_RESETS`."""
    columns_only, noisy = True, 0
    try:
        noisy += bool(env.reset()[1])
        # A copy, seeded: the env's own space may be shared (a class attribute) with the
        # sub-envs and the face, whose random stream the probe must not move.
        space = copy.deepcopy(env.action_space)
        space.seed(0)
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < _PROBE_STEPS and (
            not times or time.perf_counter() - start < _PROBE_BUDGET
        ):
            action = space.sample()
            t0 = time.perf_counter()
            _, _, terminated, truncated, info = env.step(action)
            times.append(time.perf_counter() - t0)
            columns_only = columns_only and (not info or columnar(info))
            if terminated or truncated:
                noisy += bool(env.reset()[1])
    except Exception:
        return None, False
    return statistics.median(times), columns_only and noisy * _NOISY_RESETS <= len(times)


def machine_busy(n_cpus: int, looks: int = 5) -> bool:
    """Whether more threads than ``n_cpus`` are runnable, this one included (the median of
    ``looks`` looks, 2 ms apart): other processes want the CPUs the hosts would take."""
    seen = []
    for k in range(looks):
        if k:
            time.sleep(0.002)
        seen.append(runnable())
    return statistics.median(seen) > n_cpus


def cpus() -> int:
    """The CPUs this process may run on."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        return max(1, len(getaffinity(0)))
    return os.cpu_count() or 1


def spins(placement: Placement, n_cpus: int | None = None) -> bool:
    """Whether the caller and every host process of ``placement`` have a CPU each: then a
    host waits for the next step polling (``HOST_SPIN``) and the caller for the replies
    (``CALLER_SPIN``), not sleeping; with fewer CPUs a poller would take a CPU from one of them."""
    n_cpus = cpus() if n_cpus is None else n_cpus
    return 0 < placement.n_processes < n_cpus


def _costly(t: float) -> bool:
    """Whether an env of step ``t`` is predicted with the cold step in the caller and a polling
    host's own round trip: at least ``_MIN_HOP``. A cheap env's refill is a few microseconds (the
    probe cannot tell it from noise), and inside the CleanRL-shaped loop a polling host's round
    trip costs more than the polled estimate (HalfCheetah-v5 x1 on a host: 225 us a step for a
    100-us env), which an expensive env's cold step in the caller outweighs and a cheap env's
    share does not (CartPole-v1 mixed: 0.72x and 0.88x SyncVectorEnv with 4 and 8 envs)."""
    return t >= _MIN_HOP


def _predict(
    n: int, t: float, hop: float, m: int, n_cpus: int, polled: float | None = None
) -> tuple[float, int]:
    """Predicted lockstep step with ``m`` of ``n`` sub-envs in the caller, and the processes
    ``P``: ``n * t + min(t, _COLD)`` all in the caller (its first step cold; ``n * t`` where
    not :func:`_costly`), else
    ``hop + ceil((n - m) / P) * t`` on the hosts, and with a caller's share (it sends, steps its
    share, then reads and joins the replies: its own side of the round trip) ``max(m * t + hop,
    that)`` (the share's cold step overlaps the hosts' step, which bounds a mixed step where the
    rule picks one; with half the hop there, CartPole-v1 x8 was split 5 and 3, 66.5 us a step,
    where 4 and 4 took 56.7 us: 2026-11-30). Where the caller and every host
    have a CPU each, the hosts poll (:func:`spins`) and the round trip is ``polled`` (``None``:
    ``hop``); else they sleep between steps and it is ``_WAKE_FACTOR`` times ``hop``."""
    if m == n:
        return n * t + (min(t, _COLD) if _costly(t) else 0.0), 0
    spare = n_cpus if m == 0 else n_cpus - 1
    procs = max(1, min(spare, n - m))
    if procs >= n_cpus:
        hop *= _WAKE_FACTOR
    elif polled is not None:
        hop = polled
    hosts = hop + math.ceil((n - m) / procs) * t
    if m == 0:
        return hosts, procs
    return max(m * t + hop, hosts), procs


def choose(
    num_envs: int,
    env_step: float | None,
    *,
    hop: float | None = None,
    polled_hop: float | None = None,
    n_cpus: int | None = None,
    busy: bool | None = None,
    quiet: bool = False,
) -> Placement:
    """The placement for ``num_envs`` sub-envs whose probe stepped in ``env_step`` seconds;
    every one in the caller's process on a ``busy`` machine (``None``: looked at, see
    :func:`machine_busy`; then a placement with hosts is also passed over where more threads
    are runnable than the CPUs its hosts leave: given, the machine is taken as quiet but for
    this thread). ``hop`` and ``polled_hop``: the round trips to a sleeping and to a
    polling host (``None``: ``hop`` measured, see :func:`hop_seconds`, and serving as both; a
    ``hop`` given without ``polled_hop`` serves as both too). ``quiet``: the probe's steps had
    no infos, so a polling host takes them through shared memory (``_FLAG_SHARE`` of the polled
    round trip, whatever the env's step costs)."""
    if env_step is None:
        return Placement(0, min(cpus(), num_envs), "the probe env could not be stepped: hosts")
    if hop is None:
        hop = hop_seconds()
        if polled_hop is None:
            polled_hop = polled_hop_seconds()
    polled = hop if polled_hop is None else polled_hop
    if quiet:
        polled *= _FLAG_SHARE
    n_cpus = cpus() if n_cpus is None else n_cpus
    us = f"probe step {env_step * 1e6:.1f} us, host round trip ~{hop * 1e6:.0f} us"
    if n_cpus > 1 and polled != hop:
        us += f" (~{polled * 1e6:.0f} us polling)"
    given_busy = busy is not None
    if busy is None:
        busy = machine_busy(n_cpus)
    if busy:
        # Measured in the CleanRL-shaped loop (HalfCheetah-v5, 4 envs, 2 CPUs, load average 6,
        # 2026-11-27): in-process 1.05x SyncVectorEnv, mixed 0.62x (hosts polling) and 0.78x
        # (asleep). A host waits for a CPU at every step; the caller's process does not hop.
        why = f"{us}: the machine is busy (more threads runnable than its {n_cpus} CPUs)"
        return Placement(num_envs, 0, why, env_step, hop, polled)
    best_m, (best, best_procs) = num_envs, _predict(num_envs, env_step, hop, num_envs, n_cpus)
    # A polling host with its own round trip for a costly or quiet env, else the sleeping one.
    polling = polled if quiet or _costly(env_step) else hop
    inproc = best
    crowded: dict[int, bool] = {}  # host processes -> whether their CPUs are wanted already
    passed_over = None
    # From the largest caller's share down: of two placements predicted alike, the one with
    # fewer processes (the caller's core does work a host would do).
    for m in range(num_envs - 1, -1, -1):
        if m > 0 and n_cpus < 2:
            continue
        pred, procs = _predict(num_envs, env_step, hop, m, n_cpus, polling)
        if pred * _MARGIN < inproc and pred < best:
            if not given_busy:
                # The hosts need a CPU each that no other thread wants, beside the caller's
                # while it steps a share (a host that waits for a CPU at every step, or keeps
                # backing off its poll, wakes on the caller's instead: with another process
                # running on a 2-CPU machine, mixed HalfCheetah-v5 x4 was 0.82x Sync, hosts
                # 0.51x, in-process 0.92x, 2026-11-28). Runnable threads, the caller's
                # included, may then be at most the CPUs the hosts leave (plus the caller's,
                # idle while hosts alone step).
                room = n_cpus - procs + (m == 0)
                if room not in crowded:
                    crowded[room] = machine_busy(room)
                if crowded[room]:
                    passed_over = passed_over or (pred, procs)
                    continue
            best_m, best, best_procs = m, pred, procs
    if best_m == num_envs and passed_over is not None:
        pred, procs = passed_over
        why = f"{us}: predicted {pred * 1e6:.0f} us a step on {procs} env-host process(es) "
        why += f"against {inproc * 1e6:.0f} in-process, but other threads want the CPUs they "
        why += "would take"
    elif best_m == num_envs:
        why = f"{us}: the hop would cost more than it saves"
    else:
        how = "polling" if best_procs < n_cpus else "asleep between steps"
        why = f"{us}: predicted {best * 1e6:.0f} us a step (hosts {how}) against "
        why += f"{inproc * 1e6:.0f} in-process"
    return Placement(best_m, best_procs, why, env_step, hop, polled)


def place(
    probe: Any,
    num_envs: int,
    *,
    n_processes: int | None,
    caller_envs: int | None,
    step_timeout: float | None,
    batched: bool,
    backend: str = "process",
) -> Placement:
    """The placement of a face's ``num_envs`` sub-envs: forced by the arguments, or measured on
    the face's ``probe`` env (see :func:`choose`); logged. A ``ValueError`` for arguments that
    contradict each other."""
    n = num_envs
    if caller_envs is not None and not 0 <= caller_envs <= n:
        raise ValueError(f"caller_envs must be in [0, num_envs={n}], got {caller_envs}")
    if n_processes == 0:
        if caller_envs not in (None, n):
            raise ValueError(
                f"n_processes=0 steps every sub-env in the caller's process: caller_envs must "
                f"be None or num_envs={n}, got {caller_envs}"
            )
        caller_envs = n
    shared = caller_envs is not None and caller_envs > 0
    if shared and step_timeout is not None:
        raise ValueError(
            f"step_timeout={step_timeout!r} needs every sub-env on an env host (a step in the "
            f"caller's process cannot be pre-empted): give n_processes >= 1, not "
            f"{'n_processes=0' if caller_envs == n else f'caller_envs={caller_envs}'}"
        )
    if shared and batched and caller_envs != n:
        raise ValueError(
            f"batch_size (send/recv) cannot be combined with caller_envs={caller_envs}: use "
            "n_processes=0 (every sub-env in the caller's process) or hosts only"
        )
    if not traits(backend).lockstep and caller_envs is None:
        caller_envs = 0  # the measured costs are those of the loop-free lockstep's hosts
    if caller_envs == n:
        why = "forced: n_processes=0" if n_processes == 0 else f"forced: caller_envs={n}"
        placement = Placement(n, 0, why)
    elif caller_envs:
        procs = min(n_processes or max(1, cpus() - 1), n - caller_envs)
        placement = Placement(caller_envs, procs, f"forced: caller_envs={caller_envs}")
    elif n_processes is not None:
        placement = Placement(0, min(n_processes, n), f"forced: n_processes={n_processes}")
    elif caller_envs == 0:
        placement = Placement(0, min(cpus(), n), "forced: caller_envs=0")
    elif step_timeout is not None:
        why = "step_timeout is set: only a host process can be timed out"
        placement = Placement(0, min(cpus(), n), why)
    elif batched:
        placement = Placement(0, min(cpus(), n), "batch_size: hosts answer independently")
    else:
        step, quiet = probe_step(probe)
        placement = choose(n, step, quiet=quiet)
    LOGGER.info("vector env: %s", placement.describe(n))
    return placement


def host_slices(
    num_envs: int, placement: Placement, group_size: int | None
) -> tuple[list[tuple[int, int]], int]:
    """The sub-env ranges of the hosts of ``placement`` (the processes' first, then the
    caller's; of ``group_size`` sub-envs each if given) and how many are processes."""
    n_caller = placement.caller_envs
    n_remote = num_envs - n_caller
    size = group_size
    remote = 0 if n_remote == 0 else (placement.n_processes if size is None else n_remote // size)
    caller = 0 if n_caller == 0 else (1 if size is None else n_caller // size)
    bounds = np.linspace(0, n_remote, remote + 1).round().astype(int).tolist()
    bounds += (n_remote + np.linspace(0, n_caller, caller + 1)[1:]).round().astype(int).tolist()
    return [(bounds[h], bounds[h + 1]) for h in range(remote + caller)], remote
