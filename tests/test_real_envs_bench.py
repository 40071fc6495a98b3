"""The real-env benchmark (Atari and MuJoCo vs EnvPool, scaling sweep) runs end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The `test` extra installs them: a missing one is an error, not a skip.
import ale_py  # noqa: E402, F401
import cv2  # noqa: E402, F401
import envpool  # noqa: E402
import mujoco  # noqa: E402, F401


def test_gymnasium_atari_stack_matches_envpool_spaces() -> None:
    """The wrapper stack gives EnvPool's observation layout: (4, 84, 84) uint8, same actions."""

    from benchmarks.real_envs import ENVPOOL_ATARI, make_env

    env = make_env("Pong-v5")
    pool = envpool.make_gymnasium("Pong-v5", num_envs=1, batch_size=1, **ENVPOOL_ATARI)
    try:
        obs, _ = env.reset(seed=0)
        assert obs.shape == (4, 84, 84) and obs.dtype.name == "uint8"
        assert env.observation_space.shape == pool.observation_space.shape
        assert env.action_space == pool.action_space
    finally:
        env.close()
        pool.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_envs_quick_run(tmp_path: Path) -> None:
    """``--quick``: every group runs, every contender measures, the report and charts exist."""
    from benchmarks.real_envs import main

    assert main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "real_envs.json").read_text())
    assert results["machine"]["cpu_model"] and len(results["machine"]["loadavg_start"]) == 3
    runs = results["runs"]
    assert all(len(r["loadavg"]) == 3 for r in runs)
    failed = [(r["key"], r.get("note")) for r in runs if r["status"] == "error"]
    assert not failed
    ok = [r for r in runs if r["status"] == "ok"]
    assert {r["spec"]["contender"] for r in ok} >= {"ideal", "envpool-async", "sync", "asyncsample"}
    for r in ok:
        assert r["rate"] > 0 and r["transitions"] >= r["spec"]["n_transitions"]
        frame_skip = 4 if r["spec"]["env"] == "Pong-v5" else 1
        assert r["frames_rate"] == pytest.approx(frame_skip * r["rate"])
    ours = [r for r in ok if r["spec"]["contender"] == "asyncsample"]
    assert ours and all(r["lag"]["n"] > 0 for r in ours)
    # the env hosts are processes of the run: their PSS is counted
    assert all(r["pss"]["n_children"] >= 2 and r["pss"]["children_pss"] > 0 for r in ours)
    assert any(r["spec"]["policy"] for r in ours) and any(not r["spec"]["policy"] for r in ours)
    assert {f["env"] for f in results["footprints"]} >= {"Pong-v5", "CartPole-v1"}
    assert len(results["derived"]["targets"]) >= 3
    table = (tmp_path / "real_envs.md").read_text()
    assert "EnvPool async" in table and "Which to pick" in table and "How the cost grows" in table
    for png in ("real_envs_scaling.png", "real_envs_main.png"):
        assert (tmp_path / png).stat().st_size > 1000
