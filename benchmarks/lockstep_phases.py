"""Where a lockstep step of the vector face goes, inside the CleanRL loop and with a gap.

Usage::

    python -m benchmarks.lockstep_phases                       # HalfCheetah-v5 x4, 4 iterations
    python -m benchmarks.lockstep_phases --env CartPole-v1 --envs 8 --contenders sync ours-inproc

A profile of the clients study's cells (issue 34), in two parts, each contender in a fresh
process (:func:`benchmarks._runner.run_fresh` is not used: one run is a few seconds):

- **loop**: :func:`benchmarks.clients.run_cleanrl` with the vector env's ``step`` timed, and for
  ours each phase of its lockstep round: ``send`` (the host processes' requests written),
  ``caller share`` (the caller's own sub-envs stepped), ``wait`` (the hosts' replies read after
  that), ``combine`` (the result built); for every contender the sub-envs' own ``step`` in the
  caller's process (their CleanRL wrappers included), per call.
- **gap**: the face alone (same sub-envs, a fixed action), with a busy wait of ``--gaps``
  milliseconds between steps standing for the caller's policy: what the time between steps does
  to each phase (a host process whose CPU went idle is woken by the request).

Results: ``--out`` (``benchmarks/results/lockstep_phases/``), JSON and markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.report import write_own_results

__all__ = ["PHASES", "main", "run_gap", "run_loop"]

#: The lockstep round's phases (methods of :class:`asyncsample.vector._lockstep.LockstepRounds`,
#: and the face's ``_combine``) and their names in the tables.
PHASES = {
    "_send_round": "send",
    "_step_inline": "caller share",
    "_read_direct": "wait",
    "_combine": "combine",
}


class _Timers:
    """Seconds and calls per name, of the functions wrapped by :meth:`wrap`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time every call of ``owner.attr`` (a class's method or an object's) as ``name``."""
        fn = getattr(owner, attr)
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += clock() - start
                self.calls[name] += 1

        setattr(owner, attr, timed)

    def micros(self) -> dict[str, float]:
        """Microseconds per call of each name."""
        return {k: 1e6 * s / self.calls[k] for k, s in self.seconds.items() if self.calls[k]}

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def _time_phases(timers: _Timers) -> None:
    from asyncsample.vector import _lockstep, hosted

    for attr, name in PHASES.items():
        owner = hosted.HostedEnvs if attr == "_combine" else _lockstep.LockstepRounds
        timers.wrap(owner, attr, name)


def run_loop(contender: str, env_id: str, n: int, iterations: int) -> dict[str, Any]:
    """The CleanRL loop of :mod:`benchmarks.clients` with the step and its phases timed."""
    import benchmarks.clients as clients

    timers = _Timers()
    _time_phases(timers)
    make_vector, make_env = clients._cleanrl_vector, clients._cleanrl_env

    def vector(*args: Any) -> Any:
        envs = make_vector(*args)
        timers.wrap(envs, "step", "vector step")
        return envs

    def env(env_id: str) -> Callable[[], Any]:
        thunk = make_env(env_id)

        def timed_thunk() -> Any:
            made = thunk()
            timers.wrap(made, "step", "sub-env step (caller)")
            return made

        return timed_thunk

    clients._cleanrl_vector, clients._cleanrl_env = vector, env  # type: ignore[assignment]
    sps = clients.run_cleanrl(contender, env_id, n, iterations)
    placement = clients._CHOSEN[-1] if clients._CHOSEN else ""
    return {"sps": sps, "micros": timers.micros(), "placement": placement}


def run_gap(
    env_id: str, n: int, placement: dict[str, int], gap: float, steps: int
) -> dict[str, Any]:
    """The face alone, ``steps`` steps of a fixed action with a busy wait of ``gap`` seconds
    between them (after as many to warm up); its phases per step."""
    import asyncsample

    timers = _Timers()
    _time_phases(timers)
    envs = asyncsample.VectorEnv(env_id, n, **placement)
    try:
        timers.wrap(envs, "step", "vector step")
        envs.reset(seed=0)
        envs.action_space.seed(0)
        action = envs.action_space.sample()
        clock = time.perf_counter
        for k in range(2 * steps):
            if k == steps:
                timers.clear()
            envs.step(action)
            end = clock() + gap
            while clock() < end:
                pass
        return {"micros": timers.micros(), "placement": envs.placement.describe(n)}
    finally:
        envs.close()


def _fresh(kind: str, args: list[Any]) -> dict[str, Any]:
    """``run_loop(*args)`` or ``run_gap(*args)`` in a fresh interpreter (one torch thread)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import benchmarks.envs; "
        "from benchmarks import lockstep_phases as p; "
        f"print(json.dumps(p.run_{kind}(*json.loads(sys.argv[2]))))"
    )
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, root, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{kind} {args} failed: {done.stderr.strip().splitlines()[-3:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


_COLUMNS = ["vector step", *PHASES.values(), "sub-env step (caller)"]


def _row(label: str, micros: dict[str, float], extra: str = "") -> str:
    cells = [f"{micros[c]:,.0f}" if c in micros else "-" for c in _COLUMNS]
    return f"| {label} | {extra} | " + " | ".join(cells) + " |"


def main(argv: Sequence[str] | None = None) -> int:
    """Run both parts and write the tables."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lockstep_phases", description=__doc__
    )
    parser.add_argument("--env", default="HalfCheetah-v5")
    parser.add_argument("--envs", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=4, help="timed CleanRL iterations")
    parser.add_argument(
        "--contenders", nargs="+", default=["sync", "ours-inproc", "ours-mixed", "ours"]
    )
    parser.add_argument("--gaps", nargs="*", type=float, default=[0.0, 0.5, 1.5, 3.0])
    parser.add_argument("--gap-steps", type=int, default=1000)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "lockstep_phases"
    )
    args = parser.parse_args(argv)
    n = args.envs
    loop = {c: _fresh("loop", [c, args.env, n, args.iterations]) for c in args.contenders}
    placements = {"in-process": {"n_processes": 0}, "mixed": {"caller_envs": n // 2}}
    if n < 2:
        placements = {"in-process": {"n_processes": 0}, "hosts": {"n_processes": 1}}
    gap = {
        f"{name} {g:g} ms": _fresh("gap", [args.env, n, kw, g / 1000, args.gap_steps])
        for name, kw in placements.items()
        for g in args.gaps
    }
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "env": args.env,
        "envs": n,
        "iterations": args.iterations,
        "loop": loop,
        "gap": gap,
    }
    header = "| " + " | ".join(["run", "", *_COLUMNS]) + " |"
    rule = "|---|---|" + "---:|" * len(_COLUMNS)
    lines = [
        f"# Lockstep phases: {args.env} x{n}",
        "",
        f"{result['date']} · Python {result['python']} · {result['cpus']} CPUs · microseconds "
        "per call of each phase (see `benchmarks/lockstep_phases.py`).",
        "",
        f"## Inside the CleanRL loop ({args.iterations} iterations)",
        "",
        header.replace("|  |", "| SPS |", 1),
        rule,
        *(_row(c, r["micros"], f"{r['sps']:,.0f}") for c, r in loop.items()),
        "",
        *(f"- {c}: {r['placement']}" for c, r in loop.items() if r["placement"]),
        "",
        f"## The face alone, a busy wait between steps ({args.gap_steps} steps)",
        "",
        header.replace("|  |", "| |", 1),
        rule,
        *(_row(label, r["micros"]) for label, r in gap.items()),
    ]
    write_own_results(args.out, result, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
