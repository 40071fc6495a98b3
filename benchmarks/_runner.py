"""Run one contender in this (fresh) process: ``python -m benchmarks._runner SPEC.json OUT.json``.

The suite starts one such process per run, so every run starts clean (no leftovers of the
previous contender in memory, threads or event-loop policy), its memory is its own, and a
run that hangs can be killed with its whole process tree.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any


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
    from benchmarks.contenders import RunSpec, Skipped, run_contender

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


if __name__ == "__main__":
    sys.exit(run_file(sys.argv[1], sys.argv[2]))
