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


#: A run that never finishes: it starts a grandchild, records both pids beside the run's
#: scratch directory, then sleeps.
SLEEPER = """
import json, os, subprocess, sys, time
from pathlib import Path
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
pids = Path(sys.argv[1]).parent.parent / "pids.json"
pids.write_text(json.dumps([os.getpid(), child.pid]))
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_run_past_its_timeout_is_reported_as_timed_out_and_leaves_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """suite.run_one: a run killed at its timeout says so (not "exited 0"); its tree is gone."""
    from benchmarks import suite
    from benchmarks.contenders import RunSpec

    monkeypatch.setattr(suite, "RUNNER", ("-c", SLEEPER))
    spec = RunSpec("sync", "CartPole-v1", "CartPole-v1", n_envs=1, n_transitions=1, warmup=0)
    outcome = suite.run_one(spec, 3.0, tmp_path / "work")
    assert outcome["status"] == "timeout", outcome
    assert "timed out after 3 s" in outcome["note"]
    assert outcome["wall"] >= 3.0
    run_pid, grandchild = json.loads((tmp_path / "pids.json").read_text())
    assert _gone(run_pid) and _gone(grandchild)
    assert list((tmp_path / "work").iterdir()) == []  # spec, outcome and log removed


def test_run_that_exits_without_a_result_reports_its_exit_code(tmp_path: Path) -> None:
    from benchmarks._runner import run_fresh

    outcome = run_fresh(("-c", "import sys; print('boom'); sys.exit(3)"), {}, 60.0, tmp_path)
    assert outcome["status"] == "error"
    assert "exited 3 without a result" in outcome["note"]
    assert "boom" in outcome["log_tail"]
