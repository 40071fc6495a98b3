"""Every benchmark study runs end to end at its CI budget (``--quick``), and the runner's
fresh-process guarantees hold."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.first_run import CALL as RUN_CALL  # noqa: E402  (asyncsample run's call size)

pytestmark = pytest.mark.timeout(240)


#: Each study's CI smoke run: ``--quick`` and, for the plan studies, the fewest contenders that
#: still show the study's point (every plan study keeps its ceiling).
SMOKE: dict[str, list[str]] = {
    "throughput": ["--envs", "CartPole-v1", "NoOp-v0", "--contenders", "ceiling", "sync",
                   "asyncsample"],
    "big": ["--contenders", "ceiling", "sync", "asyncsample"],
    "scaling": ["--contenders", "ceiling", "sync", "asyncsample"],
    "overhead": ["--contenders", "sync", "asyncsample"],
    "policy": ["--envs", "HalfCheetah-v5", "--contenders", "ceiling", "sync", "asyncsample"],
    "vector": ["--contenders", "ceiling", "sync", "asyncsample-vector"],
    "host": ["--contenders", "ceiling", "asyncsample"],
    "stragglers": ["--contenders", "ceiling", "asyncsample"],
    "soak": [],
    "chaos": [],  # run by test_chaos_smoke_run_passes_its_checks alone
    "hostloop": ["--envs", "NoOp-v0", "--slot-envs", "1", "--policy-envs", "CartPole-v1",
                 "--policy-layouts", "8x1", "--lane-envs", "200"],
    "first_run": ["--cells", "sync", "ceiling", "ours-default", "--calls", str(RUN_CALL), "8000"],
    # a peer and ours (its default placement) in each client: every run a fresh interpreter
    # importing torch (tests/test_vector_env.py checks each forced placement)
    "clients": ["--contenders", "sync", "dummy", "ours"],
    "ray": ["--contenders", "ceiling", "asyncsample", "asyncsample-ray"],
    "real_envs": ["--envs", "Pong-v5", "--contenders", "ceiling", "envpool-async",
                  "asyncsample"],
    "sweep": ["--contenders", "ceiling", "envpool", "asyncsample"],
    "ab": ["--a", str(REPO), "--workloads", "CartPole-v1 4x8 random"],
    "text_envs": [],
    "seam": ["--profile", "--top", "10"],  # run by test_seam_quick_writes_every_cell alone
    "async_envs": ["--levels", "10", "--contenders", "ceiling", "gym-async", "pool-32",
                   "ours-thread", "ours-asyncio", "ours-process-batched", "--seconds", "0.5"],
}  # fmt: skip


def test_every_study_has_a_smoke_run_and_a_row_in_the_readmes() -> None:
    from benchmarks.studies import STUDIES

    names = [s.name for s in STUDIES]
    assert sorted(SMOKE) == sorted(names)
    for readme in (REPO / "benchmarks" / "README.md", REPO / "README.md"):
        text = readme.read_text()
        for name in names:
            assert f"asyncsample bench {name}" in text, (readme, name)


@pytest.mark.parametrize("name", [name for name in SMOKE if name not in ("seam", "chaos")])
def test_study_smoke_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncsample bench NAME --quick`` writes results.json and results.md to ``--out``."""
    from benchmarks.__main__ import main
    from benchmarks.studies import get

    # SB3's logger makes a folder even when it writes no file (clients' PPO.learn runs, in their
    # own processes, which inherit this): under tmp_path, not /tmp/SB3-<date>.
    monkeypatch.setenv("SB3_LOGDIR", str(tmp_path / "sb3-logs"))
    study = get(name)
    extra = ["--no-progress"] if study.is_plan else []
    code = main([name, "--quick", "--out", str(tmp_path), *extra, *SMOKE[name]])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "results.md").read_text().strip()
    if name == "first_run":  # a cell per call size, with the cores its hosts used
        rows = results["rows"]
        assert rows["ours-default, calls of 8,000"]["call"] == 8000
        assert rows["ours-default"]["call"] == RUN_CALL  # asyncsample run's call size
        assert rows["ours-default"]["cores"]["hosts"] > 0
    if name == "hostloop":  # the async-env part: a host and plain tasks that both stepped
        (lanes,) = results["lane_rows"]
        assert lanes["envs"] == 200
        for key in ("host_us_per_env_step", "plain_us_per_env_step"):
            assert 0 < lanes[key] < 10_000, lanes  # (no step counted: the window's whole CPU)
    if not study.is_plan:
        return
    assert results["study"] == name
    rates = [r["rate"] for r in results["runs"] if r.get("rate")]
    assert rates and all(rate > 0 for rate in rates)
    if name != "overhead":  # every other plan study sets its contenders against the ceiling
        ratios = results["derived"]["ratios"]
        ceilings = [r for r in results["runs"] if r["contender"] == "ceiling" and r.get("rate")]
        assert ceilings, "the ceiling ran"
        assert any(r.get("vs_ceiling") for r in ratios.values())
        assert "ceiling" in (tmp_path / "results.md").read_text()
    if name == "throughput":
        assert (tmp_path / "throughput.png").stat().st_size > 1000


@pytest.mark.slow
def test_seam_quick_writes_every_cell(tmp_path: Path) -> None:
    """``asyncsample bench seam --quick --profile``: every cell ran and stepped, the targets'
    ratios are the ones its rows give, and the profile holds the caller's top functions."""
    import numpy as np

    from benchmarks.__main__ import main
    from benchmarks.latency_envs import LatencyModel
    from benchmarks.seam import CELLS, GOALS, PROCESS_CELLS

    # the study's latency: a lognormal spread that keeps the mean, ~1% of the steps 20x longer
    draws = LatencyModel(sigma=0.5).draw(np.random.default_rng(0), 200_000)
    assert draws.mean() == pytest.approx(0.050, rel=0.02)
    assert 0.007 < (draws > 10 * np.median(draws)).mean() < 0.012
    code = main(["seam", "--quick", "--out", str(tmp_path), *SMOKE["seam"]])
    results = json.loads((tmp_path / "results.json").read_text())
    cells = results["cells"]
    assert code == 0, {k: c.get("note") for k, c in cells.items()}
    assert list(cells) == [*CELLS, "profile"]
    for name, cell in cells.items():
        assert cell["status"] == "ok" and cell["steps_per_s"] > 0, name
        assert cell["n_episodes"] == 200, name
    for name in ("ours-asyncio", "tail", "profile", *PROCESS_CELLS):
        assert cells[name]["transitions"] >= 2000 * cells[name]["calls"] > 0, name
        assert cells[name]["env_steps"] > 0 and cells[name]["cpu_us_per_step"] > 0, name
        assert cells[name]["lag"]["n"] > 0, name
    targets = {t["target"].split(" (")[0]: t for t in results["targets"]}
    ratio = cells["ours-asyncio"]["steps_per_s"] / cells["plain-1"]["steps_per_s"]
    assert targets["ours-asyncio / plain-1"]["value"] == pytest.approx(ratio)
    best = max(cells[n]["steps_per_s"] for n in PROCESS_CELLS)
    process = targets["best process layout"]
    assert process["value"] == pytest.approx(best / cells["plain-2"]["steps_per_s"])
    assert process["met"] == (process["value"] >= GOALS["process_vs_plain_2"])
    tail = cells["tail"]
    assert tail["ratio_to_ideal"] == pytest.approx(tail["steps_per_s"] / (200 / 0.050))
    host = targets["caller CPU per env step, ours-process-host"]
    assert host["value"] == cells["ours-process-host"]["cpu_us_per_step"]
    memory = targets["memory per open episode, ours-asyncio / plain-1"]
    assert memory["value"] == pytest.approx(
        cells["ours-asyncio"]["bytes_per_episode"] / cells["plain-1"]["bytes_per_episode"]
    )
    assert all(t["value"] is not None for t in results["targets"])
    profile = results["profile"]
    assert len(profile) == 10 and profile[0]["tottime_s"] >= profile[-1]["tottime_s"] > 0
    text = (tmp_path / "results.md").read_text()
    assert "## Targets (issue 48)" in text and profile[0]["function"] in text
    for name in CELLS:
        assert f"| {name} | 200 |" in text


def test_seam_gc_threshold_reaches_each_cell(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--gc-threshold``: each cell's process runs with those thresholds (the spec carries
    them to the child as JSON); a negative count is refused with the option's name."""
    import dataclasses
    import gc

    from benchmarks import seam

    args = seam.parse(["--gc-threshold", "5000", "20", "30", "--cells", "plain-1"])
    (sent,) = seam.specs(args)
    spec = seam.SeamSpec(**json.loads(json.dumps(dataclasses.asdict(sent))))  # as run_file reads it
    assert spec.gc_threshold == [5000, 20, 30]
    seen: list[tuple[int, ...]] = []
    monkeypatch.setattr(seam, "_plain", lambda _: seen.append(gc.get_threshold()) or {})
    before = gc.get_threshold()
    try:
        seam.run_cell(spec)
    finally:
        gc.set_threshold(*before)
    assert seen == [(5000, 20, 30)]
    with pytest.raises(SystemExit):
        seam.parse(["--gc-threshold", "1", "-1", "2"])
    assert "--gc-threshold: expected three counts >= 0, got [1, -1, 2]" in capsys.readouterr().err


def test_seam_loop_lag_sets_the_paced_cells(capsys: pytest.CaptureFixture[str]) -> None:
    """``--loop-lag``: the paced cell's sampler gets it (its layout says so); without it the
    cell keeps its own; a lag that is not positive is refused with the option's name."""
    from benchmarks import seam

    (paced,) = seam.specs(seam.parse(["--loop-lag", "0.001", "--cells", "ours-asyncio-paced"]))
    assert paced.paced_lag() == 0.001 and "loop_lag=0.001" in paced.layout()
    (own,) = seam.specs(seam.parse(["--cells", "ours-asyncio-paced"]))
    assert own.paced_lag() == seam.PACED_CELLS["ours-asyncio-paced"]
    with pytest.raises(SystemExit):
        seam.parse(["--loop-lag", "0"])
    assert "--loop-lag: expected seconds > 0, got 0.0" in capsys.readouterr().err


def test_chaos_smoke_run_passes_its_checks(tmp_path: Path) -> None:
    """``asyncsample bench chaos --quick`` (the study's CI run, on asyncio and on process):
    results.json and results.md written, faults were injected and every check held. The one
    smoke run of the study (test_study_smoke_run ran the same run again for its files)."""
    from benchmarks.__main__ import main

    code = main(["chaos", "--quick", "--out", str(tmp_path), *SMOKE["chaos"]])
    summary = json.loads((tmp_path / "results.json").read_text())
    assert code == 0, [r["checks"] for r in summary["runs"]]
    assert (tmp_path / "results.md").read_text().strip()
    assert [r["backend"] for r in summary["runs"]] == ["asyncio", "process"]
    for result in summary["runs"]:
        assert result["faults"]["raise"] >= 1 and result["faults"]["dead_env_calls"] >= 1
        assert result["healthy_episodes_lost"] == 0
        assert sum(c["healthy_finished"] for c in result["calls"]) > 0
        assert result["peak_env_calls_in_flight"] <= result["args"]["max_concurrency"]
        assert result["envs_not_closed"] == 0 and result["envs_closed"] > 0
        assert not result["tasks_left"]
    # the blocking-env kind (process only): a host's loop blocked past every call's deadline
    # was killed (every call by its deadline above), its envs gone with it
    blocked = summary["runs"][1]
    assert blocked["faults"]["block"] == 1 and blocked["envs_gone_with_killed_hosts"] > 0


def test_torchrl_collector_drives_the_policy(tmp_path: Path) -> None:
    pytest.importorskip("torchrl")
    from benchmarks.__main__ import main

    code = main(["policy", "--quick", "--no-progress", "--out", str(tmp_path),
                 "--contenders", "torchrl-collector"])  # fmt: skip
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    runs = [r for r in results["runs"] if r["contender"] == "torchrl-collector"]
    assert runs and all(r.get("rate", 0) > 0 for r in runs), runs


def test_soak_loses_nothing(tmp_path: Path) -> None:
    from benchmarks.soak import main

    out = tmp_path / "results.json"
    code = main(["--minutes", "0.15", "--batch", "800", "--p-raise", "2e-3", "--p-kill", "5e-4",
                 "--p-hang", "0", "--out", str(out)])  # fmt: skip
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
from typing import Any
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
    from benchmarks.runs import RunSpec

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


def test_the_instrumented_run_is_not_counted_when_plain_runs_exist() -> None:
    """Its probes cost CPU: the rates come from the other runs; a config run once keeps it."""
    from benchmarks.suite import aggregate

    def rec(key: str, rate: float, instrumented: bool, steal: float = 0.0) -> dict[str, object]:
        cpu = {
            "own_cores": 1.9,
            "main_cores": 0.1,
            "host_cores": 1.8,
            "foreign_cores": 0.0,
            "steal_cores": steal,
        }
        return {
            "key": key,
            "contender": "asyncsample",
            "label": key,
            "env": "E",
            "n_envs": 8,
            "layout": "2x4",
            "n_workers": 2,
            "envs_per_worker": 4,
            "n_processes": 2,
            "status": "ok",
            "rate": rate,
            "instrumented": instrumented,
            "cpu": cpu,
            "lag": {"p99": 1.0} if instrumented else None,
        }

    runs = [rec("a", 70.0, True), rec("a", 100.0, False), rec("a", 90.0, False)]
    out = aggregate([*runs, rec("b", 50.0, True), rec("c", 10.0, False, steal=0.3)])
    assert out["a"]["rates"] == [100.0, 90.0] and out["a"]["median"] == 95.0
    assert out["a"]["lag"] == {"p99": 1.0}  # the probes' figures are kept
    assert out["b"]["rates"] == [50.0]  # run once: its only run counts
    assert out["c"]["disturbed"]  # the hypervisor's steal counts as others' CPU
    assert not out["a"]["disturbed"]


def test_ab_metrics_on_against_off_smoke(tmp_path: Path) -> None:
    """``ab --metrics b`` on one tree: B runs with metrics on (checked to have counted steps)."""
    from benchmarks.__main__ import main

    code = main(["ab", "--quick", "--out", str(tmp_path), "--a", str(REPO), "--b", str(REPO),
                 "--metrics", "b", "--workloads", "CartPole-v1 4x8 random",
                 "VectorEnv CartPole-v1 8 random"])  # fmt: skip
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["metrics"] == "b"
    for row in results["rows"]:
        assert all(run["metrics_steps"] > 0 for run in row["runs"]["b"])
        assert all(run["metrics_steps"] == 0 for run in row["runs"]["a"])
    assert "(metrics on in B)" in (tmp_path / "results.md").read_text()


def test_ab_async_envs_workloads_smoke(tmp_path: Path) -> None:
    """The async-envs workloads run (the lanes: ``asyncio`` per worker and batched, ``thread``;
    random and MLP), and each row
    carries its pairs' ratios, a verdict and both processes' CPU per step."""
    from benchmarks.__main__ import main

    workloads = [
        "AsyncEnv 0 ms 4x16 random asyncio",
        "SleepEnv 0 ms 4x4 random thread",
        "AsyncEnv 1 ms 10x100 MLP asyncio batched",
    ]
    code = main(["ab", "--quick", "--repeats", "2", "--out", str(tmp_path), "--a", str(REPO),
                 "--b", str(REPO), "--workloads", *workloads])  # fmt: skip
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [row["workload"] for row in results["rows"]] == workloads
    for row in results["rows"]:
        assert len(row["pair_ratios"]) == 2 and all(r > 0 for r in row["pair_ratios"])
        assert row["verdict"] in ("slower", "not slower", "inconclusive")
        for side in ("a", "b"):
            assert all(
                run["steps_per_s"] > 0 and run["main_cpu_us"] > 0 for run in row["runs"][side]
            )
            assert all(run["hosts_cpu_us"] == 0 for run in row["runs"][side])  # no env hosts
    assert "verdict" in (tmp_path / "results.md").read_text()


def test_ab_counts_the_env_hosts_cpu(tmp_path: Path) -> None:
    """A process-backend workload's hosts are the run's descendants: their CPU is counted."""
    from benchmarks.__main__ import main

    code = main(["ab", "--quick", "--repeats", "1", "--out", str(tmp_path), "--a", str(REPO),
                 "--b", str(REPO), "--workloads", "CartPole-v1 2x4 random host"])  # fmt: skip
    assert code == 0
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert all(run["hosts_cpu_us"] > 0 for side in ("a", "b") for run in row["runs"][side])


def test_ab_ceiling_reads_each_tree_against_the_machine_in_the_same_run(tmp_path: Path) -> None:
    """``ab --ceiling``: each repeat also runs the ceiling of a gymnasium-env workload (the same
    env and policy, a plain loop per core), and the row gives both trees' share of it; a
    latency-env workload has no ceiling."""
    from benchmarks.__main__ import main

    workloads = ["CartPole-v1 2x4 MLP host", "AsyncEnv 0 ms 1x8 random asyncio batched"]
    code = main(["ab", "--quick", "--repeats", "2", "--ceiling", "--out", str(tmp_path),
                 "--a", str(REPO), "--b", str(REPO), "--workloads", *workloads])  # fmt: skip
    assert code == 0
    host, lanes = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(host["runs"]["ceiling"]) == 2
    assert host["ceiling_steps_per_s"] > 0
    assert host["b_of_ceiling"] == pytest.approx(
        host["b_steps_per_s"] / host["ceiling_steps_per_s"]
    )
    assert "ceiling" not in lanes["runs"] and "b_of_ceiling" not in lanes
    table = (tmp_path / "results.md").read_text()
    assert "| B/ceiling |" in table and table.rstrip().endswith("| - | - | - |")


def test_ab_blocks_metrics_off_against_on_in_one_process(tmp_path: Path) -> None:
    """``ab --blocks N``: each workload's two copies (off, on) in one process, N pairs of
    alternating blocks; the on copy alone counted its steps, and each row has the pairs' ratios,
    the median's interval and a verdict."""
    from benchmarks.__main__ import main

    workloads = ["CartPole-v1 4x8 random", "AsyncEnv 0 ms 4x16 random asyncio",
                 "VectorEnv CartPole-v1 8 random"]  # fmt: skip
    code = main(["ab", "--quick", "--blocks", "6", "--out", str(tmp_path),
                 "--workloads", *workloads])  # fmt: skip
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [row["workload"] for row in results["rows"]] == workloads
    for row in results["rows"]:
        assert len(row["pair_ratios"]) == 6 and len(row["blocks"]["on"]) == 6
        low, high = row["interval"]  # 6 pairs: the extremes, 97% coverage
        assert low == min(row["pair_ratios"]) and high == max(row["pair_ratios"])
        assert 0 < row["metrics_steps"] <= 1.1 * row["steps"]["on"]
        assert row["steps"]["off"] > 0 and row["off_main_cpu_us"] > 0
        assert row["verdict"] in ("within budget", "over budget", "unresolved")
    assert "95% interval" in (tmp_path / "results.md").read_text()


def test_ab_blocks_median_interval_and_verdict() -> None:
    from benchmarks.ab_blocks import median_interval, verdict

    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # under 6: no 95% interval
    assert median_interval([float(x) for x in range(6)]) == (0.0, 5.0)
    assert median_interval([float(x) for x in range(20)]) == (5.0, 14.0)  # the 6th and 15th
    assert median_interval([float(x) for x in range(40)]) == (13.0, 26.0)  # 14th and 27th
    assert verdict(None) == "too few pairs"
    assert verdict((0.981, 1.01)) == "within budget"
    assert verdict((0.95, 0.979)) == "over budget"
    assert verdict((0.97, 1.01)) == "unresolved"


def test_lockstep_phases_times_each_phase(tmp_path: Path) -> None:
    """``benchmarks.lockstep_phases``: the CleanRL loop and the face alone with a gap, each
    lockstep phase of the mixed placement timed, no phase for Sync."""
    from benchmarks.lockstep_phases import PHASES, main

    code = main(["--env", "CartPole-v1", "--envs", "2", "--iterations", "1", "--contenders",
                 "sync", "ours-mixed", "--gaps", "0.5", "--gap-steps", "50",
                 "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "results.json").read_text())
    mixed, sync = result["loop"]["ours-mixed"]["micros"], result["loop"]["sync"]["micros"]
    assert all(mixed[name] > 0 for name in PHASES.values())
    assert mixed["vector step"] > mixed["caller share"] > 0
    assert not set(PHASES.values()) & set(sync) and sync["vector step"] > 0
    assert sorted(result["gap"]) == ["in-process 0.5 ms", "mixed 0.5 ms"]
    assert result["gap"]["mixed 0.5 ms"]["micros"]["wait"] > 0
    assert "## Inside the CleanRL loop" in (tmp_path / "results.md").read_text()


def test_handoff_times_both_ways_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``benchmarks.handoff``: every mode, work and gap has a round trip; the far process is
    gone, the shared memory it made unlinked and this process's CPUs put back afterwards."""
    import os
    from multiprocessing import shared_memory

    from benchmarks.handoff import MODES, main

    made: list[str] = []  # its own segments: other tests running beside it make theirs

    class Recorded(shared_memory.SharedMemory):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if kwargs.get("create"):
                made.append(self.name)

    monkeypatch.setattr(shared_memory, "SharedMemory", Recorded)
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    code = main(["--env", "CartPole-v1", "--work", "0", "1", "--gaps", "0", "0.1", "--n", "40",
                 "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    cells = json.loads((tmp_path / "results.json").read_text())["cells"]
    assert {(c["mode"], c["work"], c["gap"]) for c in cells} == {
        (m, w, g) for m in MODES for w in (0, 1) for g in ("0 ms", "0.1 ms")
    }
    assert all(0 < c["median_us"] <= c["p90_us"] for c in cells)
    if before is not None:
        assert os.sched_getaffinity(0) == before
    import multiprocessing

    assert not multiprocessing.active_children()
    assert made and not [n for n in made if (Path("/dev/shm") / n.lstrip("/")).exists()]
    assert "| socket, polled |" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_frames_reports_host_mode_against_the_ceiling(tmp_path: Path) -> None:
    """``benchmarks.frames --quick``: raw-frame Pong in host mode and the ceiling in one run,
    their ratio and the CPU per step of each side."""
    pytest.importorskip("ale_py")
    from benchmarks.frames import main

    assert main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["provenance"]["command"] and len(result["host_over_ceiling"]) == 1
    host, ceiling = result["runs"]["host"][0], result["runs"]["ceiling"][0]
    assert host["steps_per_s"] > 0 and ceiling["steps_per_s"] > 0
    assert host["hosts_cpu_us"] > 0 and host["main_cpu_us"] > 0
    assert "## Target (issue 53, item 3)" in (tmp_path / "results.md").read_text()


def test_ab_verdict() -> None:
    from benchmarks.ab import verdict

    assert verdict([0.90, 0.96]) == "slower"
    assert verdict([0.97, 1.2]) == "not slower"
    assert verdict([0.72, 1.11, 0.96]) == "inconclusive"  # the 8x1 host pairs of 8fbdba7


def test_group_step_prints_each_trees_cost(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks.group_step`` times ``EnvGroup.step`` of a tree in a fresh interpreter."""
    from benchmarks.group_step import main

    main([str(REPO)], rounds=1, blocks=1, steps=2_000)  # the study's 5 x 20,000: 27 s of CPU
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"{REPO}: ") and float(line.split()[1]) > 0


@pytest.mark.slow
def test_multiagent_reports_ours_against_the_ceiling(tmp_path: Path) -> None:
    """``benchmarks.multiagent`` on 8 Pistonball envs: the two-loop ceiling and our sampler in
    host mode, their rates in agent transitions and env steps, and the target rows."""
    pytest.importorskip("pettingzoo.butterfly")
    from benchmarks.multiagent import main

    argv = ["--quick", "--envs", "8", "--warmup", "0", "--seconds", "0.5", "--policies",
            "random", "--cells", "ceiling", "ours-host", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["provenance"]["command"] and result["n_envs"] == 8
    runs = result["runs"]["random"]
    ceiling, ours = runs["ceiling"][0], runs["ours-host"][0]
    assert ceiling["rows_per_s"] == pytest.approx(20 * ceiling["env_steps_per_s"])  # 20 pistons
    assert ours["rows_per_s"] > 0 and ours["main_cpu_us"] > 0 and ours["workers_cpu_us"] > 0
    assert "| ours-host / ceiling |" in (tmp_path / "results.md").read_text()


def test_first_run_rates_each_round_against_its_own_loops() -> None:
    from benchmarks.first_run import summarize

    def cell(rate: float, lag: float | None = None, hosts: float = 0.0) -> dict[str, Any]:
        ours = {"lag": {"p99_ms": lag}, "call": 4000, "cores": {"caller": 0.2, "hosts": hosts}}
        return {"steps_per_s": rate, "layout": "x", **(ours if lag else {})}

    rounds = [  # the machine twice as fast in the second round
        {"sync": cell(100.0), "ceiling": cell(200.0), "ours": cell(150.0, 1.0, 1.5)},
        {"sync": cell(200.0), "ceiling": cell(400.0), "ours": cell(200.0, 3.0, 1.2)},
        {"sync": cell(110.0), "ceiling": cell(220.0), "ours": cell(120.0, 2.0, 1.4)},
    ]
    rows = summarize(rounds)
    ours = rows["ours"]
    assert (ours["steps_per_s"], ours["min"], ours["max"]) == (150.0, 120.0, 200.0)
    # each round's own ratio, then the median: 1.5, 1.0, 1.09 -> 1.09 (the medians': 1.36)
    assert ours["vs_sync"] == {"median": pytest.approx(120 / 110), "min": 1.0, "max": 1.5}
    assert ours["of_ceiling"] == {"median": pytest.approx(120 / 220), "min": 0.5, "max": 0.75}
    assert ours["lag"] == {"p99_ms": 2.0}
    assert ours["call"] == 4000 and ours["cores"] == {"caller": 0.2, "hosts": 1.4}
    assert "lag" not in rows["sync"] and rows["sync"]["vs_sync"]["median"] == 1.0
