"""How many threads the numeric libraries of an env host use (``host_threads``).

A host runs one env step (or one agent call) at a time, and several hosts share the machine's
cores: a library that spreads each small matrix product over every core (torch, OpenMP, MKL,
OpenBLAS do by default) only makes the hosts fight over the cores. Sample Factory and RLlib pin
their rollout workers to one intra-op thread for this reason, and so do the env hosts, by default.

Thread pools read their environment variables when the library loads, so :func:`limit` sets them
first thing in the host (for what the envs or the agent import later, torch among them), then
sizes the pools already loaded: OpenBLAS (numpy's, preloaded by the forkserver or by Ray) through
its ``*_set_num_threads`` entry point, torch through ``torch.set_num_threads``. An agent copy
unpickled later may import torch: :func:`apply_torch` runs again after every agent install.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

__all__ = ["THREAD_VARIABLES", "apply_torch", "limit", "openblas_threads"]

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
    _limit_openblas(n)
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
    counts = []
    for lib in _openblas_libraries():
        for symbol in _OPENBLAS_SETTERS:
            getter = getattr(lib, symbol.replace("_set_", "_get_"), None)
            if getter is not None:
                counts.append(int(getter()))
                break
    return counts


def _limit_openblas(n: int) -> None:
    """Resize the thread pool of every OpenBLAS already loaded in this process (best effort)."""
    for lib in _openblas_libraries():
        for symbol in _OPENBLAS_SETTERS:
            setter = getattr(lib, symbol, None)
            if setter is not None:
                setter(ctypes.c_int(n))
                break


def _openblas_libraries() -> list[ctypes.CDLL]:
    """The BLAS libraries mapped into this process (Linux only: ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "blas" in line.lower()})
    except OSError:  # not Linux: the environment variables have to do
        return []
    libraries = []
    for path in paths:
        if path.startswith("/"):
            with contextlib.suppress(OSError):
                libraries.append(ctypes.CDLL(path))
    return libraries
