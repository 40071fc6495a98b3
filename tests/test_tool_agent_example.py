"""examples/tool_agent.py at a small size: its summary's numbers add up, episode by episode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import python_env
from test_examples import EXAMPLES, load_example

pytestmark = pytest.mark.slow


def test_tool_agent_example_summary(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    command = [sys.executable, str(EXAMPLES / "tool_agent.py"), "--envs", "24", "--episodes",
               "60", "--workers", "2", "--hosts", "1", "--json", str(out)]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=170, cwd=tmp_path, env=python_env()
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())
    example = load_example("tool_agent")
    n = summary["episodes"]
    assert n >= 60 and len(summary["tasks"]) == len(summary["rewards"]) == n
    assert len(set(summary["tasks"])) > n // 2  # tasks drawn per episode, seeded per env
    # The scripted model calls the tool once per operator (two), then answers: three turns.
    assert summary["tool_calls"] == 2 * n
    assert summary["turns"] == 3 * n
    # The verifier's reward: right only where left to right gives the usual precedence's value.
    for task, reward in zip(summary["tasks"], summary["rewards"]):
        expression, answer = example.question(task)
        a, op1, b, op2, c = expression.split()
        left_to_right = example.evaluate(f"({a} {op1} {b}) {op2} {c}")
        assert reward == float(left_to_right == answer), (task, expression)
    assert summary["mean_reward"] == pytest.approx(np.mean(summary["rewards"]))
    assert 0.0 < summary["mean_reward"] < 1.0
    assert summary["tool_calls_per_s"] == pytest.approx(summary["tool_calls"] / summary["seconds"])
    assert f"{n:,} episodes, {summary['turns']:,} turns" in done.stdout


def test_the_scripted_model_and_the_tool_agree_with_the_verifier() -> None:
    example = load_example("tool_agent")
    assert example.evaluate("2 + 3 * 4") == 14
    with pytest.raises(ValueError, match="not an integer expression"):
        example.evaluate("__import__('os')")
    messages = [
        {"role": "system", "content": example.SYSTEM},
        {"role": "user", "content": "What is 2 + 3 * 4?"},
    ]
    assert example.scripted_model(messages) == "CALL calc(2 + 3)"
    messages += [
        {"role": "assistant", "content": "CALL calc(2 + 3)"},
        {"role": "user", "content": "Tool result: 5"},
    ]
    assert example.scripted_model(messages) == "CALL calc(5 * 4)"
    messages += [
        {"role": "assistant", "content": "CALL calc(5 * 4)"},
        {"role": "user", "content": "Tool result: 20"},
    ]
    assert example.scripted_model(messages) == "ANSWER 20"
    assert example.verify("ANSWER 14", 14) == 1.0
    assert example.verify("ANSWER 20", 14) == 0.0
    assert example.verify("the answer is 14", 14) == 0.0
