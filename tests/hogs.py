"""The suite's own robustness check: the README's test command, run beside CPU hogs.

    python tests/hogs.py [--runs 3] [--hogs 2] [-- PYTEST_ARGS...]

Each run starts ``--hogs`` processes that spin a CPU each, runs ``python -m pytest`` (the README's
test command, with any ``PYTEST_ARGS``) from the repository root, and stops the hogs, always:
after a failed run and on Ctrl-C too. It prints each run's exit status and duration and exits 1
if any run failed. A suite whose tests wait on conditions, not on the clock, passes every run on
a loaded machine; the issue-55 check is three runs in a row beside two hogs (the defaults).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: A hog: one process that keeps one CPU busy until it is stopped.
HOG = "while True: pass"


def start_hogs(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes spinning a CPU each."""
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n)]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill ``procs`` and reap them."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def run_once(hogs: int, pytest_args: list[str]) -> tuple[int, float]:
    """One run of the suite beside ``hogs`` hogs: its exit status and seconds."""
    spinning = start_hogs(hogs)
    suite: subprocess.Popen[bytes] | None = None
    start = time.monotonic()
    try:
        suite = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args], cwd=REPO)
        status = suite.wait()
    finally:
        if suite is not None and suite.poll() is None:  # Ctrl-C: pytest got it too; wait
            try:
                suite.wait(timeout=30)
            except subprocess.TimeoutExpired:
                suite.kill()
                suite.wait()
        stop(spinning)
    return status, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--runs", type=int, default=3, help="runs in a row (default 3)")
    parser.add_argument("--hogs", type=int, default=2, help="CPU hogs beside each run (default 2)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.hogs < 0:
        parser.error(f"--runs must be >= 1 and --hogs >= 0, got {args.runs} and {args.hogs}")
    results = []
    for k in range(1, args.runs + 1):
        try:
            status, seconds = run_once(args.hogs, args.pytest_args)
        except KeyboardInterrupt:
            print(f"run {k}/{args.runs} interrupted; the hogs are stopped", flush=True)
            return 130
        results.append(status)
        verdict = "passed" if status == 0 else "FAILED"
        print(
            f"run {k}/{args.runs} beside {args.hogs} hogs: {verdict} (exit {status}) "
            f"in {seconds:.1f} s",
            flush=True,
        )
    failed = sum(1 for s in results if s != 0)
    print(f"{args.runs - failed} of {args.runs} runs passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
