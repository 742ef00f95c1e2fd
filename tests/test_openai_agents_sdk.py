"""The OpenAI Agents SDK (`openai-agents`), unchanged, against the gateway: examples/openai_agents_sdk.py's triage
agent hands off to a calculator that calls two function tools. The SDK (import name `agents`) runs in this process,
beside our packages (`slime_env.agents`): the first test checks that `agents` is the SDK.

The gateway's engine is `ScriptedPolicy` on Qwen3's real tokenizer and template: a model that emits the hand-off and
the tool calls on cue, which no small model does reliably — a stand-in for the engine only; the SDK, its HTTP client
and the gateway are real. The train test runs SmolLM2 itself."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from slime_env import Task
from slime_env.loading import load_object

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "openai_agents_sdk.py"


@pytest.fixture(scope="module")
def sdk_example():
    return load_object(f"{EXAMPLE}:make_env").__globals__


def test_agents_is_the_sdk_and_every_slime_env_package_imports_beside_it():
    import importlib

    import agents

    assert hasattr(agents, "Runner") and hasattr(agents, "function_tool"), agents.__file__
    assert "site-packages" in Path(agents.__file__).parts and Path(agents.__file__).parent != ROOT / "agents"
    for name in ("slime_env", "slime_env.envs", "slime_env.agents", "slime_env.tools_sandbox", "slime_env.trainers"):
        assert importlib.import_module(name).__all__, name


def _call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_a_handoff_and_two_function_tools_are_recorded_as_exact_branches(sdk_example, qwen3_tok):
    from slime_env.gateway import Gateway
    from slime_env.policy import ScriptedPolicy
    from slime_env.renderers import get_renderer

    replies = [_call("transfer_to_calculator"), _call("add", a=2, b=3), _call("multiply", a=5, b=4),
               "<answer>20</answer>"]
    policy = ScriptedPolicy(qwen3_tok, replies, end_token_id=qwen3_tok.convert_tokens_to_ids("<|im_end|>"))
    renderer = get_renderer(qwen3_tok, strict=True)
    gw = Gateway(policy, renderer, "hermes", strict=True)
    env = sdk_example["make_env"]()

    async def main():
        await gw.start()
        try:
            return await env.run(gw, Task.coerce({"prompt": "What is (2 + 3) * 4?", "label": "20"}, "task"))
        finally:
            await gw.stop()

    main_t, triage = asyncio.run(main())
    assert policy.calls == 4  # the hand-off, add, multiply, the answer: every SDK call reached the engine
    # The calculator runs under its own instructions (a new system message): the gateway opens a branch for it; the
    # triage agent's hand-off call is a side branch of the same sample, with the sample's reward.
    assert main_t.status == "completed" and main_t.reward == 1.0, main_t.reason
    assert main_t.messages[0].content.startswith("Compute with the tools") and len(main_t.metadata["calls"]) == 3
    # tool results are named after their calls, on a new branch as on a continued one (the hand-off's result too)
    assert [(m.name, m.content) for m in main_t.messages if m.name][1:] == [("add", "5"), ("multiply", "20")]
    assert main_t.messages[[m.name for m in main_t.messages].index("add") - 1].role == "assistant"
    assert triage.metadata["branch_of"] and triage.reward == 1.0 and len(triage.metadata["calls"]) == 1
    assert "transfer_to_calculator" in triage.messages[-1].content
    generated = [renderer.decode(main_t.response_ids[sp.start:sp.end]) for sp in main_t.spans if sp.kind == "generated"]
    assert ['"add"' in generated[0], '"multiply"' in generated[1], generated[2].startswith("<answer>20</answer>")] \
        == [True, True, True]
    for t in (main_t, triage):  # exactly the generated ids carry loss
        t.check()
        assert sum(t.loss_mask) == sum(sp.end - sp.start for sp in t.spans if sp.kind == "generated") > 0


def test_the_agents_sdk_agent_trains_through_slime_env_train(sdk_example, tmp_path):
    # -P: the repository's root (cwd) off sys.path, where its agents/ folder would shadow the SDK
    out = subprocess.run([sys.executable, "-P", "-m", "slime_env", "train", "--config", "examples/agent_train.yaml",
                          "--env", "examples/openai_agents_sdk.py:make_env", "--steps", "1", "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] == 1][0]
    assert trained["train/tokens"] > 0 and trained["rollout/statuses"] == {"completed": 8}
    assert trained["eval/failed"] == 0
