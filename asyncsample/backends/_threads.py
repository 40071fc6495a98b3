"""How many threads the numeric libraries of an env host use (``host_threads``).

Several hosts share the machine's cores, and a library that spreads each small product over every
core (torch, OpenMP, MKL, OpenBLAS by default) only makes them fight. Pools read their environment
variables when the library loads, so :func:`limit` sets them first thing in the host, then resizes
the pools already loaded (OpenBLAS, torch); :func:`apply_torch` runs again after every agent
install, which may import torch.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = [
    "BUSY_CHECK",
    "BUSY_LOOKS",
    "SPIN_BACKOFF",
    "SPIN_BACKOFF_FIRST",
    "THREAD_VARIABLES",
    "BoundedSpin",
    "apply_torch",
    "limit",
    "openblas_threads",
    "runnable",
]

#: Seconds between two looks at the machine's runnable threads (see :func:`runnable`), for the
#: hosts' and the faces' polling, which stops while the machine is busy.
BUSY_CHECK = 0.05
#: Looks in a row that must see more threads runnable than CPUs before the polling stops. One
#: look is an instant: with the caller and a host polling on a quiet 2-CPU VM, a kernel thread's
#: turn makes it read 3 runnable now and then, and a single look that stopped the polling for
#: half a second kept the hosts asleep most of a run (CartPole-v1 x1 on a host: 67 us a step,
#: the host asleep at 14,804 of 20,000 steps; with three looks in a row, 42 us; 2026-11-28).
BUSY_LOOKS = 3


def runnable() -> int:
    """The threads runnable on this machine now, this one included (``/proc/loadavg``'s fourth
    field; 0 where there is none: then nothing is known to compete)."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return 0


#: Seconds a :class:`BoundedSpin` stays off after a preempted spin, doubling with each preempted
#: spin in a row up to :data:`SPIN_BACKOFF`. A quiet 2-CPU VM preempts about one 1-ms spin in 400
#: (a kernel thread's turn: 2026-11-28), thousands of spins a second: a second off each time kept
#: the hosts' poll off most of the run (a 55-us HalfCheetah-v5 step took 190-270 us through a
#: host instead of 110). A process that wants the CPU preempts every spin and meets the ceiling
#: within ten of them.
SPIN_BACKOFF_FIRST = 0.002
#: The longest a :class:`BoundedSpin` stays off after preempted spins (see above).
SPIN_BACKOFF = 1.0
_RUSAGE_WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
_Ready = TypeVar("_Ready")


class BoundedSpin:
    """The bounded poll of the hosts (waiting for the next step request) and of the faces'
    caller (waiting for the replies): where the waiter has a CPU of its own, polling for a few
    hundred microseconds saves the kernel wake-up a blocking wait costs.

    A poller takes a CPU another process may want, so it polls only while the machine is not
    busy: ``BUSY_LOOKS`` looks in a row at :func:`runnable`, one every ``BUSY_CHECK`` seconds,
    that see more threads runnable than ``n_cpus`` stop it until a look sees no more. And a
    spin during which the kernel switched this thread out (``ru_nivcsw`` moved: something else
    wanted the CPU) turns it off for a while: ``SPIN_BACKOFF_FIRST`` seconds, doubled for each
    preempted spin in a row up to ``SPIN_BACKOFF`` (one spin that is not preempted starts over)."""

    __slots__ = ("_backoff", "_busy", "_cpus", "_look", "_resume")

    def __init__(self, n_cpus: int) -> None:
        self._cpus = n_cpus
        self._resume = 0.0  # time.perf_counter() from which a wait spins again
        self._look = 0.0  # time.perf_counter() of the next look at runnable()
        self._busy = 0  # looks in a row that saw more threads runnable than CPUs
        self._backoff = SPIN_BACKOFF_FIRST  # seconds off after the next preempted spin

    def allowed(self) -> bool:
        """Whether a spin may run now: not while backed off after preempted spins, nor while
        the machine is busy (``BUSY_LOOKS`` looks in a row, until a look sees it quiet)."""
        now = time.perf_counter()
        if now < self._resume:
            return False
        if now >= self._look:
            self._look = now + BUSY_CHECK
            self._busy = self._busy + 1 if runnable() > self._cpus else 0
        return self._busy < BUSY_LOOKS

    def poll(self, poll: Callable[[int], _Ready], seconds: float) -> _Ready:
        """Call ``poll(0)`` until it returns something true or ``seconds`` passed; its last
        result. A preempted spin backs off (see the class)."""
        clock, usage = time.perf_counter, resource.getrusage
        switches = usage(_RUSAGE_WHO).ru_nivcsw
        end = clock() + seconds
        ready = poll(0)
        while not ready and clock() < end:
            ready = poll(0)
        if usage(_RUSAGE_WHO).ru_nivcsw != switches:
            self._resume = clock() + self._backoff
            self._backoff = min(2 * self._backoff, SPIN_BACKOFF)
        else:
            self._backoff = SPIN_BACKOFF_FIRST
        return ready


#: The environment variables the thread pools of the common numeric libraries read.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)

# OpenBLAS's setter under the names its builds export (plain, 64-bit ints, numpy's scipy build).
_OPENBLAS_SETTERS = (
    "openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
)


def limit(n: int | None) -> None:
    """Give every numeric library of this process ``n`` threads (``None``: leave them be)."""
    if n is None:
        return
    for name in THREAD_VARIABLES:
        os.environ[name] = str(n)
    for setter in _openblas("set"):
        setter(ctypes.c_int(n))
    apply_torch(n)


def apply_torch(n: int | None) -> None:
    """``torch.set_num_threads(n)`` if torch is loaded here (importing it is not our call)."""
    if n is None:
        return
    torch = sys.modules.get("torch")
    set_num_threads = getattr(torch, "set_num_threads", None)
    if set_num_threads is not None and torch.get_num_threads() != n:  # type: ignore[union-attr]
        set_num_threads(n)


def openblas_threads() -> list[int]:
    """The thread count of every OpenBLAS loaded in this process (for checks and reports)."""
    return [int(getter()) for getter in _openblas("get")]


def _openblas(verb: str) -> Iterator[Callable[..., Any]]:
    """``openblas_<verb>_num_threads`` of every OpenBLAS mapped here (read in /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "blas" in line.lower()})
    except OSError:  # not Linux: the environment variables have to do
        return
    for path in (p for p in paths if p.startswith("/")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in _OPENBLAS_SETTERS:
            function = getattr(lib, symbol.replace("_set_", f"_{verb}_"), None)
            if function is not None:
                yield function
                break
