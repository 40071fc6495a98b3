"""The real-env studies (``real_envs``, ``sweep``) on the shared plan layer: envs, plan."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def test_the_test_extra_installs_the_real_envs() -> None:
    """The `test` extra installs them: a missing one is an error, not a skip. (Found, not
    imported: EnvPool's import alone takes seconds, paid by the tests that use it.)"""
    import importlib.util

    missing = [
        m for m in ("ale_py", "cv2", "envpool", "mujoco") if importlib.util.find_spec(m) is None
    ]
    assert missing == []


@pytest.mark.slow  # EnvPool's import and Atari's start-up: seconds
def test_gymnasium_atari_stack_matches_envpool_spaces() -> None:
    """The registered stack gives EnvPool's observation layout: (4, 84, 84) uint8, same actions."""
    import envpool
    import gymnasium as gym

    from benchmarks.envs import ENVPOOL_ATARI, full_id

    env = gym.make(full_id("Pong-v5"))
    pool = envpool.make_gymnasium("Pong-v5", num_envs=1, batch_size=1, **ENVPOOL_ATARI)
    try:
        obs, _ = env.reset(seed=0)
        assert obs.shape == (4, 84, 84) and obs.dtype.name == "uint8"
        assert env.observation_space.shape == pool.observation_space.shape
        assert env.action_space == pool.action_space
    finally:
        env.close()
        pool.close()


def test_plan_has_every_inference_mode_the_ceiling_and_timeouts_that_grow_with_the_envs() -> None:
    """The default plans: each mode's layouts, random and policy, a ceiling per cell."""
    from benchmarks import studies, suite

    s = studies.settings_for(studies.get("real_envs"), quick=False)
    keys = {c.key for c in suite.plan(s)["real"]}
    for key in (
        "asyncsample|Pong-v5|8|2x4/P2||per_worker|s128",
        "asyncsample|Pong-v5|8|4x2/P2||per_worker|s128",
        "asyncsample|Pong-v5|8|2x4/P2|cnn|batched|s128",
        "asyncsample|Pong-v5|8|2x4/P2|cnn|host|s128",
        "asyncsample|HalfCheetah-v5|32|2x16/P2|mlp|host|s128",
        "asyncsample|HalfCheetah-v5|32|4x8/P2|mlp|per_worker|s128",
        "asyncsample|Pong-v5|8|8x1/P2||host|s128",
        "envpool-async|Pong-v5|8|",
        "ceiling|Pong-v5|2|",  # two plain loops (random agent)
        "ceiling|Pong-v5|8||cnn|",  # two SyncVectorEnv(4) + CNN loops
        "ceiling|HalfCheetah-v5|32||mlp|",
    ):
        assert key in keys, key
    sweep = suite.plan(studies.settings_for(studies.get("sweep"), quick=False))["sweep"]
    pong512 = next(c for c in sweep if c.env == "Pong-v5" and c.n_envs == 512)
    cart8 = next(c for c in sweep if c.env == "CartPole-v1" and c.n_envs == 8)
    assert not any(c.contender == "async" and c.n_envs > 64 and c.env == "Pong-v5" for c in sweep)
    assert suite.run_timeout(pong512, s) > s.timeout + 400 > suite.run_timeout(cart8, s)


# Slow: imports torch (seconds of a default-run worker's CPU). The benchmarks' policies are run
# by the studies' smoke runs in the slow pass (test_study_smoke_run[real_envs]: Pong-v5's cnn
# rows); the default run keeps the plans and pages of the study (the tests around it).
@pytest.mark.slow
def test_cnn_policy_acts_on_atari_frames() -> None:
    pytest.importorskip("torch")
    import numpy as np

    from benchmarks.envs import full_id
    from benchmarks.policies import make_policy

    policy = make_policy("cnn", full_id("Pong-v5"))
    actions = policy.act(np.zeros((3, 4, 84, 84), dtype=np.uint8))
    assert actions.shape == (3,) and actions.dtype.kind == "i"


def test_pages_are_in_step_with_the_results_files() -> None:
    """README, benchmarks/README and docs/performance.md hold what ``--pages`` writes."""
    from benchmarks import pages

    assert pages.update(check=True) == []


def test_pages_copy_a_section_under_the_name_and_date_of_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from benchmarks import pages

    study = tmp_path / "results" / "stragglers"
    study.mkdir(parents=True)
    (study / "results.json").write_text(
        json.dumps({"study": "stragglers", "machine": {"date": "2026-11-24T03:00:00+00:00"}})
    )
    (study / "results.md").write_text(
        "# title\n\n## Stragglers: x\n\nintro\n\n### FixedCost-v0, 16 envs\n\n| a |\n|---|\n"
        "| 1 |\n\n## Notes\n\n- not copied\n"
    )
    monkeypatch.setattr(pages, "RESULTS", tmp_path / "results")
    page = pages.REPO / "docs" / "performance.md"
    text = (
        "<!-- results: stragglers#Stragglers: x -->\nold\n<!-- /results -->\n"
        "<!-- results: ray#anything -->\n<!-- /results -->\n<!-- studies -->\n<!-- /studies -->\n"
    )
    out = pages.render(page, text)
    assert "run of 2026-11-24" in out and "**FixedCost-v0, 16 envs**" in out and "| 1 |" in out
    assert "old" not in out and "not copied" not in out
    assert "Awaits a quiet run: `asyncsample bench ray`" in out
    assert "| stragglers | `asyncsample bench stragglers` |" in out
    assert pages.render(page, out) == out  # a second pass changes nothing


def test_raw_pixel_envs_are_planned_random_agent_only_with_their_ceiling() -> None:
    """Issue 35's rows: raw-frame Pong (with EnvPool at the same settings) and HalfCheetah's
    84x84 and 256x256 renders (no EnvPool), random agent only, each with its ceiling."""
    from benchmarks import studies, suite

    s = studies.settings_for(studies.get("real_envs"), quick=False)
    configs = suite.plan(s)["real"]
    keys = {c.key for c in configs}
    for key in (
        "asyncsample|PongRaw-v5|8|2x4/P2||host|s128",
        "asyncsample|PongRaw-v5|8|2x4/P2||per_worker|s128",
        "envpool|PongRaw-v5|8|",
        "envpool-async|PongRaw-v5|8|",
        "ceiling|PongRaw-v5|2|",
        "asyncsample|HalfCheetahPixels84-v5|8|2x4/P2||host|s6",
        "asyncsample|HalfCheetahPixels256-v5|8|2x4/P2||per_worker|s6",
        "ceiling|HalfCheetahPixels256-v5|2|",
    ):
        assert key in keys, key
    raw = [c for c in configs if c.env in suite.RAW_ENVS]
    assert raw and not any(c.policy for c in raw)
    pixels = next(c for c in raw if c.env == "HalfCheetahPixels84-v5" and c.contender == "envpool")
    assert suite.pre_skip(pixels, s) is not None


@pytest.mark.slow  # EnvPool's import and Atari's start-up: seconds
def test_raw_pong_matches_envpool_at_the_same_settings() -> None:
    pytest.importorskip("ale_py")
    envpool = pytest.importorskip("envpool")
    import gymnasium as gym

    from benchmarks.envs import ENVPOOL_ATARI_RAW, full_id

    env = gym.make(full_id("PongRaw-v5"))
    pool = envpool.make_gymnasium("Pong-v5", num_envs=1, **ENVPOOL_ATARI_RAW)
    try:
        obs, _ = env.reset(seed=0)
        frames, _ = pool.reset()
        assert obs.shape == (210, 160, 3) and obs.dtype.name == "uint8"
        assert frames.shape[1:] == (3, 210, 160)  # EnvPool's channel-first layout
        assert env.action_space == pool.action_space
    finally:
        env.close()
        pool.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_raw_pixel_rows_smoke_run(tmp_path: Path) -> None:
    """The new rows run end to end at the CI budget: raw Pong against EnvPool and the ceiling,
    HalfCheetah's 84x84 renders against the ceiling."""
    pytest.importorskip("ale_py")
    pytest.importorskip("mujoco")
    import json

    from benchmarks.__main__ import main

    code = main(["real_envs", "--quick", "--no-progress", "--out", str(tmp_path), "--envs",
                 "PongRaw-v5", "HalfCheetahPixels84-v5", "--contenders", "ceiling", "envpool",
                 "asyncsample"])  # fmt: skip
    assert code == 0
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    for env in ("PongRaw-v5", "HalfCheetahPixels84-v5"):
        rates = [r["rate"] for r in runs if r.get("env") == env and r.get("rate")]
        assert len(rates) >= 3, env  # the ceiling and asyncsample (and EnvPool for Pong)
