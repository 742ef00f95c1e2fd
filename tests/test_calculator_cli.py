"""The built-in Calculator env, the CLI and the README demo."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from slime_env.envs.calculator import CalculatorError, evaluate

from slime_env import Action, ToolCall, make

ROOT = Path(__file__).resolve().parents[1]


def test_evaluate_is_safe_arithmetic():
    assert evaluate("(3 + 4) * 2 - 1") == 13 and evaluate("7 / 2") == 3.5 and evaluate("-2 ** 3") == -8
    for bad in ("__import__('os')", "x + 1", "2 ** 10000", "1 / 0", "(" * 300, "[1]", "1\x00", "2.0 ** 60 ** 2",
                "(-8) ** 0.5", "-" * 100000 + "1"):
        with pytest.raises(CalculatorError):
            evaluate(bad)


def test_calculator_env_flow():
    async def main():
        env = make("Calculator-v0", max_steps=3, format_penalty=0.1)
        msgs, info = await env.reset(options={"task": {"prompt": "What is 6*7?", "label": 42}})
        assert msgs[0].role == "system" and msgs[1].content == "What is 6*7?" and info["label"] == 42
        call = ToolCall("calculator", {"expression": "6*7"})
        obs, r, term, trunc, _ = await env.step(Action("..", tool_calls=(call, ToolCall("rm", {}))))
        assert [m.content for m in obs] == ["42", "error: unknown tool 'rm'; the only tool is 'calculator'"]
        assert (r, term, trunc) == (0.0, False, False)
        obs, r, term, trunc, _ = await env.step(Action("no idea"))
        assert obs[0].role == "user" and not term
        obs, r, term, trunc, info = await env.step(Action("<answer>42.0</answer>"))
        assert (r, term, info["correct"]) == (1.0, True, True)
        await env.reset(options={"task": {"prompt": "q", "label": 1}})
        _, r, term, _, _ = await env.step(Action("<answer>2</answer>"))
        assert (r, term) == (0.0, True)

    asyncio.run(main())


def _cli(*args):
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "slime_env", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


def test_cli_help_and_list():
    out = _cli("--help")
    assert out.returncode == 0 and "list" in out.stdout and "demo" in out.stdout
    out = _cli("list")
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines == sorted(lines)  # one line per env, by id
    assert "Calculator-v0\tarithmetic questions answered with the help of a calculator tool." in lines


def test_scripted_demo_shows_the_ledger():
    out = _cli("demo", "--episodes", "3", "--scripted")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("status completed") == 3
    assert "reward 1.00" in out.stdout and "reward 0.00" in out.stdout  # one right, one wrong answer
    assert "<|im_start|>tool" in out.stdout


def test_model_demo_runs_the_real_model():
    pytest.importorskip("torch")
    out = _cli("demo", "--episodes", "2", "--max-new-tokens", "12", "--max-turns", "2")
    assert out.returncode == 0, out.stderr
    assert "TransformersPolicy (SmolLM2-135M-Instruct)" in out.stdout
    assert out.stdout.count("status ") == 2 and "2 episodes in" in out.stdout
