"""The real-env benchmark (Atari and MuJoCo vs EnvPool, scaling sweep) runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["machine"]["cpu_model"] and len(results["machine"]["loadavg_start"]) == 3
    runs = results["runs"]
    assert all(len(r["loadavg"]) == 3 for r in runs)
    failed = [(r["key"], r.get("note")) for r in runs if r["status"] == "error"]
    assert not failed
    ok = [r for r in runs if r["status"] == "ok"]
    assert {r["spec"]["contender"] for r in ok} >= {
        "ideal", "envpool-async", "sync", "asyncsample", "asyncsample-batched", "asyncsample-host"
    }  # fmt: skip
    for r in ok:
        if r["spec"]["contender"].startswith("asyncsample"):
            shm = r["pss"]["shm_pss"]
            assert 0 < shm <= r["pss"]["total_pss"] and r["buffers"]["step_bytes"] > 0
            host = r["spec"]["contender"] == "asyncsample-host"
            assert (r["buffers"]["chunk_bytes"] > 0) == host
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
    slopes = {x["contender"]: x for x in results["derived"]["memory_slope"]}
    assert {"asyncsample", "asyncsample-host"} <= set(slopes)
    assert all("hosts_per_env" in slopes[c] for c in ("asyncsample", "asyncsample-host"))
    table = (tmp_path / "results.md").read_text()
    assert "EnvPool async" in table and "Which to pick" in table and "How the cost grows" in table
    assert "Which `inference` mode" in table
    for png in ("real_envs_scaling.png", "real_envs_main.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_plan_has_every_inference_mode_and_timeouts_that_grow_with_the_envs() -> None:
    """The default plan: the layouts of each mode, one torch thread in hosts, scaled timeouts."""
    import pickle

    import cloudpickle

    from benchmarks.real_envs import (
        OneTorchThread,
        Settings,
        estimate_plan,
        make_policy,
        plan,
        run_timeout,
    )

    s = Settings()
    runs = plan(s)
    keys = {spec.key for specs in runs.values() for spec in specs}
    for key in (
        "asyncsample|Pong-v5|8|random|2x4/P2",
        "asyncsample|Pong-v5|8|random|4x2/P2",
        "asyncsample-batched|Pong-v5|8|policy|2x4/P2",
        "asyncsample-host|Pong-v5|8|policy|2x4/P2",
        "asyncsample-host|HalfCheetah-v5|32|policy|2x16/P2",
        "asyncsample-host|HalfCheetah-v5|32|policy|4x8/P2",
        "asyncsample-host|Pong-v5|512|random|2x256/P2",
    ):
        assert key in keys
    pong512 = next(sp for sp in runs["sweep"] if sp.env == "Pong-v5" and sp.n_envs == 512)
    cart8 = next(sp for sp in runs["sweep"] if sp.env == "CartPole-v1" and sp.n_envs == 8)
    assert run_timeout(pong512, s) > s.timeout + 400 > run_timeout(cart8, s)
    est = estimate_plan(s, {})
    assert set(est) == {"ideal", "main", "sweep", "footprint"} and all(v > 0 for v in est.values())

    agent = OneTorchThread(make_policy("HalfCheetah-v5"))
    blob = cloudpickle.dumps(agent)  # as inference="host" ships it to the hosts
    copy = pickle.loads(blob)
    assert copy.get_actions(np.zeros((3, 17), dtype=np.float32))[0].shape == (3, 6)
    # In a fresh process (torch at 2 threads, as in an env host) unpickling sets one thread.
    code = (
        "import pickle, sys, torch; torch.set_num_threads(2); "
        "pickle.loads(sys.stdin.buffer.read()); print(torch.get_num_threads())"
    )
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True,
                         check=True, cwd=REPO, timeout=120)  # fmt: skip
    assert out.stdout.decode().split()[-1] == "1"
