"""examples/sb3_ppo.py: SB3 PPO learns CartPole-v1 on AsyncSampleVecEnv (slow: minutes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sb3_ppo.py"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sb3_ppo_reaches_475_on_cartpole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # SB3's logger makes a folder even when it writes no file: under tmp_path, not /tmp/SB3-<date>.
    monkeypatch.setenv("SB3_LOGDIR", str(tmp_path / "sb3-logs"))
    spec = importlib.util.spec_from_file_location("asyncsample_example_sb3_ppo", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    mean, std = module.train(steps=100_000, seed=0)
    assert mean >= 475, f"mean evaluation return {mean:.1f} +/- {std:.1f}, wanted >= 475"
