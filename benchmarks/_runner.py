"""Every benchmark run in a fresh process: the parent's :func:`run_fresh`, the suite's child.

``python -m benchmarks._runner SPEC.json OUT.json`` runs one suite contender in this (fresh)
process. The suite starts one such process per run (every plan study's) with
:func:`run_fresh`, so every run starts clean (no leftovers of the previous
contender in memory, threads or event-loop policy), its memory is its own, and a run that
hangs is killed with its whole process tree and reported as timed out.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_file(spec_path: str, out_path: str) -> int:
    """Read a :class:`~benchmarks.contenders.RunSpec` as JSON, run it, write the outcome.

    The outcome is ``{"status": "ok"|"skipped"|"error", ...}`` with the result's fields.

    Args:
        spec_path: JSON file holding the spec's fields.
        out_path: Where to write the outcome as JSON.

    Returns:
        0, also when the contender was skipped or failed (the outcome says so).
    """
    warnings.simplefilter("ignore")  # gymnasium's checker warnings are not results
    from benchmarks.contenders import run_contender
    from benchmarks.runs import RunSpec, Skipped

    spec = RunSpec(**json.loads(Path(spec_path).read_text()))
    outcome: dict[str, Any]
    try:
        result = run_contender(spec)
        outcome = {"status": "ok", **result.to_dict()}
    except Skipped as exc:
        outcome = {"status": "skipped", "note": str(exc)}
    except BaseException as exc:  # report every failure instead of dying silently
        outcome = {
            "status": "error",
            "note": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=20),
        }
    Path(out_path).write_text(json.dumps(outcome))
    return 0


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """Kill a run process we started (its own session) and every descendant of it.

    The process is killed before its descendants so it cannot start new ones meanwhile; its
    session's process group catches any started between the listing and the kill. The run
    process itself is reaped through ``proc`` only (reaping it with psutil would leave Popen
    without its exit status: it would then report ``returncode`` 0, as if it had exited well).
    """
    try:
        victims = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        victims = []
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for victim in victims:
        with contextlib.suppress(psutil.Error):
            victim.kill()
    proc.wait()
    psutil.wait_procs(victims, timeout=5)


def run_fresh(
    command: Sequence[str], spec: dict[str, Any], timeout: float, workdir: Path
) -> dict[str, Any]:
    """Run ``python COMMAND SPEC.json OUT.json`` in a fresh process with a time limit.

    The one runner of the benchmark studies: the spec goes in as a
    JSON file, the child writes its outcome (``{"status": "ok"|"skipped"|"error", ...}``) as
    JSON, and a child that outlives ``timeout`` is killed with its whole process tree.

    Args:
        command: The interpreter arguments before the two file names, e.g.
            ``["-m", "benchmarks._runner"]``.
        spec: The run's fields (JSON-able).
        timeout: Seconds (start-up included) before the process tree is killed.
        workdir: Scratch directory for the spec, outcome and log files (removed afterwards).

    Returns:
        The child's outcome, or ``{"status": "timeout", ...}`` when it was killed, or
        ``{"status": "error", ...}`` when it exited (with its exit code) without an outcome;
        plus ``wall`` (seconds of the whole process) and, unless ok, ``log_tail`` (its output).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="run-", suffix=".json", dir=workdir)
    os.close(fd)
    spec_path = Path(name)
    out_path = spec_path.with_suffix(".out.json")
    log_path = spec_path.with_suffix(".log")
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    timed_out = False
    t0 = time.perf_counter()
    try:
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, *command, str(spec_path), str(out_path)],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the kill reaches every child
            )
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_tree(proc)
            except BaseException:
                _kill_tree(proc)
                raise
        wall = time.perf_counter() - t0
        outcome: dict[str, Any] | None = None
        with contextlib.suppress(OSError, ValueError):  # none, or cut short by the kill
            outcome = json.loads(out_path.read_text())
        if outcome is not None:
            if timed_out:  # the result was written, the process then failed to exit
                outcome["exit_note"] = f"killed at the {timeout:.0f} s timeout after its result"
        elif timed_out:
            outcome = {"status": "timeout", "note": f"timed out after {timeout:.0f} s (killed)"}
        else:
            outcome = {
                "status": "error",
                "note": f"the run process exited {proc.returncode} without a result",
            }
        if outcome.get("status") != "ok":
            outcome["log_tail"] = log_path.read_text(errors="replace")[-3000:]
        outcome["wall"] = wall
        return outcome
    finally:
        for path in (spec_path, out_path, log_path):
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(run_file(sys.argv[1], sys.argv[2]))
