"""What a step request's round trip to another process costs by itself: a socket or shared memory.

Usage::

    python -m benchmarks.handoff                  # no work, and 2 HalfCheetah-v5 steps a request
    python -m benchmarks.handoff --env CartPole-v1 --work 0 4

Two processes, each on a CPU of its own when the machine has two free: the caller sends a
request, the other side does ``--work`` env steps and answers, and the caller times the round
trip, back to back and with a busy wait of ``--gaps`` milliseconds between requests (the policy
of a training loop). Both sides poll, never sleep, in each of the two ways a request can travel:

- ``socket``: a byte over a socket pair, each side polling its end with ``poll(0)`` (how our env
  hosts and the face's caller poll: their requests are frames on a socket);
- ``shared memory``: a counter in shared memory that each side spins on (PufferLib's handoff: no
  system call).

A profile of the vector study's cheap-env cells (issue 34): it gives the floor of each handoff
under our hosts' own work per request. Results: ``--out``, JSON and markdown.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import select
import socket
import statistics
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import write_own_results

__all__ = ["MODES", "main", "round_trips"]

#: The two ways a request travels (see the module doc).
MODES = ("socket", "shared memory")


def _serve(mode: str, sock: socket.socket, name: str, env_id: str, work: int) -> None:
    """The far side: wait for a request polling, step the env ``work`` times, answer."""
    import gymnasium as gym

    memory = shared_memory.SharedMemory(name)
    flags = np.ndarray((2,), np.int64, memory.buf)  # [request, reply]
    env = gym.make(env_id)
    env.reset(seed=0)
    action = env.action_space.sample()
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    seen = 0
    try:
        while True:
            if mode == "socket":
                while not poller.poll(0):
                    pass
                if sock.recv(1) == b"q":
                    return
            else:
                while flags[0] == seen:
                    pass
                seen = int(flags[0])
                if seen < 0:
                    return
            for _ in range(work):
                if any(env.step(action)[2:4]):
                    env.reset()
            if mode == "socket":
                sock.send(b"r")
            else:
                flags[1] = seen
    finally:
        del flags
        memory.close()


def round_trips(
    mode: str, env_id: str, work: int, gaps: Sequence[float], n: int
) -> dict[str, list[float]]:
    """Seconds of ``n`` round trips (after ``n // 4`` to warm up) for each gap in ``gaps``."""
    ours, theirs = socket.socketpair()
    memory = shared_memory.SharedMemory(create=True, size=16)
    flags = np.ndarray((2,), np.int64, memory.buf)
    flags[:] = 0
    far = mp.get_context("spawn").Process(
        target=_serve, args=(mode, theirs, memory.name, env_id, work), daemon=True
    )
    far.start()
    poller = select.poll()
    poller.register(ours, select.POLLIN)
    clock, seq, out = time.perf_counter, 0, {}
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    try:
        if len(allowed) >= 2:  # a CPU each, this process's own put back at the end
            cpus = sorted(allowed)
            os.sched_setaffinity(0, {cpus[0]})
            os.sched_setaffinity(far.pid or 0, {cpus[1]})
        for gap in gaps:
            times = []
            for k in range(n + n // 4):
                start = clock()
                if mode == "socket":
                    ours.send(b"x")
                    while not poller.poll(0):
                        pass
                    ours.recv(1)
                else:
                    seq += 1
                    flags[0] = seq
                    while flags[1] != seq:
                        if not far.is_alive():
                            raise RuntimeError("the far side died")
                if k >= n // 4:
                    times.append(clock() - start)
                end = clock() + gap
                while clock() < end:
                    pass
            out[f"{gap * 1e3:g} ms"] = times
    finally:
        if mode == "socket":
            ours.send(b"q")
        else:
            flags[0] = -1
        far.join(10)
        if far.is_alive():
            far.kill()
        del flags
        memory.close()
        memory.unlink()
        ours.close()
        theirs.close()
        if len(allowed) >= 2:
            os.sched_setaffinity(0, allowed)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every mode, work and gap; write the table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handoff", description=__doc__)
    parser.add_argument("--env", default="HalfCheetah-v5")
    parser.add_argument("--work", nargs="+", type=int, default=[0, 2], help="env steps a request")
    parser.add_argument("--gaps", nargs="+", type=float, default=[0.0, 0.2, 0.5, 1.5])
    parser.add_argument("--n", type=int, default=1200, help="timed round trips per cell")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "handoff")
    args = parser.parse_args(argv)
    gaps = [g / 1000 for g in args.gaps]
    cells: list[dict[str, Any]] = []
    for work in args.work:
        for mode in MODES:
            for gap, times in round_trips(mode, args.env, work, gaps, args.n).items():
                us = [1e6 * t for t in times]
                cells.append(
                    {
                        "mode": mode,
                        "work": work,
                        "gap": gap,
                        "median_us": statistics.median(us),
                        "p90_us": float(np.percentile(us, 90)),
                    }
                )
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "env": args.env,
        "n": args.n,
        "cells": cells,
    }
    lines = [
        f"# Handoff: a request's round trip to another process ({args.env} steps as its work)",
        "",
        f"{result['date']} · Python {result['python']} · {result['cpus']} CPUs · {args.n} round "
        "trips a cell, both sides polling (see `benchmarks/handoff.py`); microseconds, median "
        "(p90).",
        "",
        "| env steps a request | gap between requests | socket, polled | shared memory, spun |",
        "|---:|---|---:|---:|",
    ]
    for work in args.work:
        for gap in (f"{g:g} ms" for g in args.gaps):
            by = {c["mode"]: c for c in cells if c["work"] == work and c["gap"] == gap}
            row = [f"{by[m]['median_us']:.0f} ({by[m]['p90_us']:.0f})" for m in MODES]
            lines.append(f"| {work} | {gap} | {row[0]} | {row[1]} |")
    write_own_results(args.out, result, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
