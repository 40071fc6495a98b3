"""The soak (``benchmarks/soak.py``) as a standing test: ~25 s of sampling in every inference
mode on the ``process`` backend while envs raise, hang and end their host, with every batch
checked step by step and nothing left behind. How long its calls took against the bound
``step_timeout`` allows is the soak's own report (``python -m benchmarks.soak``), not asserted
here: it is a duration."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: Fault rates high enough that a 25-second run meets every kind of fault.
ARGS = [
    "--minutes", "0.42",
    "--batch", "1000",
    "--step-timeout", "0.5",
    "--p-raise", "5e-4",
    "--p-hang", "1.5e-4",
    "--p-kill", "3e-4",
    "--p-exit", "3e-4",
]  # fmt: skip


async def test_the_soak_loses_nothing_and_leaves_nothing(tmp_path: Path, no_leaks: None) -> None:
    from benchmarks import soak

    result = await soak.soak(soak.parse([*ARGS, "--out", str(tmp_path / "results.json")]))
    report = soak.table(result)
    assert [m["mode"] for m in result["modes"]] == ["host", "batched", "per_worker"]
    for mode in result["modes"]:
        assert mode["calls"] >= 4, report  # every kind of call, fragments twice in a row
        assert mode["restarts"] >= 1, report
        assert mode["transitions_lost"] == mode["half_episodes"] == mode["calls_short"] == 0
        assert mode["stale_agent_steps"] == 0
    faults = result["faults_injected"]
    assert all(faults[kind] >= 1 for kind in ("raise", "hang", "kill", "exit")), report
    assert not result["processes_left"] and not result["shm_left"]
    assert [c for m in result["modes"] for c in m["hung_calls"]], report  # a hang was met
