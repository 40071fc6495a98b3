"""The benchmark suite and the soak benchmark run end to end (tiny versions)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

pytestmark = pytest.mark.timeout(240)


def test_benchmark_suite_quick_run(tmp_path: Path) -> None:
    from benchmarks.__main__ import main

    code = main(
        [
            "--quick",
            "--envs", "CartPole-v1", "NoOp-v0",
            "--contenders", "sync", "asyncsample",
            "--groups", "ideal", "main",
            "--out", str(tmp_path),
            "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rates = [r["rate"] for r in results["runs"] if r.get("rate")]
    assert rates and all(rate > 0 for rate in rates)
    table = (tmp_path / "results.md").read_text()
    assert "SyncVectorEnv" in table and "asyncsample" in table
    assert (tmp_path / "throughput.png").stat().st_size > 1000


def test_soak_loses_nothing(tmp_path: Path) -> None:
    from benchmarks.soak import main

    out = tmp_path / "soak.json"
    code = main(["--minutes", "0.15", "--batch", "800", "--p-raise", "2e-3", "--p-kill", "5e-4",
                 "--p-hang", "0", "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0
    assert result["transitions_lost"] == 0
    assert result["calls_short_of_quota"] == 0
    assert sum(result["faults_injected"].values()) >= 1
    assert result["restarts"] >= 1
