"""Math: answer extraction and verification (a table of 112 pairs), timeouts, rewards, loaders, and the
Math-v0 / MathTool-v0 / ReasoningGym-v0 envs driven by the ScriptedPolicy with a real tokenizer."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import slime_env
from slime_env.envs.math import MathReward, MathVerifier, extract_answer, load_math_tasks, slime_reward
from slime_env.envs.math.rewards import slime_group_reward
from slime_env.envs.math.reasoning_gym_env import reasoning_gym_tasks, write_tasks_jsonl
from slime_env.envs.math.verifier import fast_check
from slime_env import ScriptedPolicy, get_renderer, load_tasks, run_episode
from slime_env.errors import InvalidInput
from sandbox_support import make_sandbox

PAIRS = [line.rstrip("\n").split("\t") for line in
         (Path(__file__).parent / "data" / "math_answer_pairs.tsv").read_text().splitlines()
         if line.strip() and not line.startswith("#")]


@pytest.fixture(scope="module")
def verifier(runner):
    v = MathVerifier(workers=2, timeout_s=5.0)
    runner.run(v.warm_up())
    yield v
    v.close()


def test_the_table_has_enough_pairs_of_both_kinds():
    assert len(PAIRS) >= 100
    assert sum(p[2] == "1" for p in PAIRS) >= 40 and sum(p[2] == "0" for p in PAIRS) >= 40


def test_verdicts_match_the_table(runner, verifier):
    async def main():
        return await asyncio.gather(*(verifier.verify(r.replace("\\n", "\n"), g) for r, g, _ in PAIRS))

    verdicts = runner.run(main())
    wrong = [(r, g, want, v) for (r, g, want), v in zip(PAIRS, verdicts) if v.correct != (want == "1")]
    assert not wrong, wrong
    assert {v.method for v in verdicts} >= {"fast", "math_verify", "choice"}
    assert all(v.status in ("ok", "no_answer") for v in verdicts)


def _agreeing_fast_verdicts(groups) -> int:
    """Every verdict the fast path gives on pairs within each group is math-verify's own; returns how many."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    decided = 0
    for group in groups:
        for g in group:
            for a in group:
                fast = fast_check(g, a)
                if fast is not None:
                    decided += 1
                    # no time limits: math-verify's own (5 s, SIGALRM) turn a slow answer on a busy machine into False
                    gold = parse(f"\\boxed{{{g}}}", parsing_timeout=None)
                    answer = parse(f"\\boxed{{{a}}}", parsing_timeout=None)
                    assert fast == verify(gold, answer, timeout_seconds=None), (g, a)
    return decided


def test_fast_path_agrees_with_math_verify():
    values = ["3", "-3", "03", "3.0", "3.5", "0.5", "1/2", "2/4", "\\frac{1}{2}", "\\dfrac{3}{6}", "-\\frac{1}{2}",
              "\\frac{-1}{2}", "7", "10", "0", "-0", "2/3", "0.666667", "1000", "999"]
    assert _agreeing_fast_verdicts([values]) > 200


def test_expression_and_set_fast_paths_agree_with_math_verify():
    exprs = ["x^2+2x+1", "(x+1)^2", "(x+1)(x+1)", "x^2+1", "2x+3", "3+2x", "2(x+1)+1", "x(x-1)", "x^2-x",
             "\\frac{x}{2}", "\\frac{1}{2}x", "\\frac{x^2-1}{x-1}", "x+1", "a+b", "b+a", "ab", "ba", "a-b",
             "(a+b)^2", "a^2+2ab+b^2", "2^{10}", "1024", "10^3", "\\frac{6}{8}", "3/4", "x^{2}", "x\\cdot x",
             "-x^2", "(-x)^2", "y+1", "\\sqrt{8}", "2\\sqrt{2}", "\\sqrt{2}", "\\frac{\\sqrt{2}}{2}",
             "\\frac{1}{\\sqrt{2}}", "\\sqrt[3]{8}", "2", "\\pi", "\\frac{\\pi}{2}", "\\frac{2\\sqrt{3}\\pi}{3}",
             "\\frac{\\sqrt{12}\\pi}{3}", "\\sqrt{x^2}", "x\\sqrt{2}"]
    sets = ["\\{1,2,3\\}", "\\{3,2,1\\}", "\\{1,2\\}", "\\{-1,1\\}", "\\{1,-1\\}", "\\{\\frac{1}{2},2\\}",
            "\\{2,\\frac{2}{4}\\}", "\\{1,2,4\\}"]
    assert _agreeing_fast_verdicts([exprs, sets]) > 400


def test_extraction_takes_the_last_answer():
    assert extract_answer("\\boxed{1} ... wait, \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert extract_answer("Answer: 5\n\n#### 6") == "6"
    assert extract_answer("<answer>\\boxed{7}</answer>") == "7"
    assert extract_answer("\\boxed{unclosed") is None
    assert extract_answer("Answer: 3", ("boxed",)) is None
    with pytest.raises(ValueError, match="unknown answer formats"):
        extract_answer("x", ("latex",))


def test_a_pathological_answer_times_out_and_the_pool_recovers(runner):
    v = MathVerifier(workers=1, timeout_s=1.5)
    try:
        runner.run(v.warm_up())
        t0 = time.monotonic()
        verdict = runner.run(v.verify("\\boxed{9^{9^{9^{9}}}}", "2"))  # sympy would compute for minutes
        took = time.monotonic() - t0
        assert verdict.status == "timeout" and not verdict.correct and "1.5s" in verdict.reason
        assert took < 5
        after = runner.run(v.verify("\\boxed{\\sin^2 x + \\cos^2 x}", "1"))  # a replacement worker answers
        assert after.correct and after.method == "math_verify" and v.stats["timeout"] == 1
    finally:
        v.close()


def test_a_verifier_left_unclosed_exits_quietly_with_its_workers():
    """A program that exits without `close()` while its workers still start (they import math-verify for seconds)
    prints nothing at exit — it printed a worker's `BrokenPipeError` traceback, the worker writing "ready" into the
    closed pipe — and leaves no worker behind. The run below reads stderr until every process holding it (the
    workers inherit it) has exited."""
    import subprocess
    import sys

    code = ("import asyncio\n"
            "from slime_env.envs.math.verifier import MathVerifier\n"
            "async def main():\n"
            "    v = MathVerifier(workers=2)\n"
            "    task = asyncio.ensure_future(v._pooled(('1', '1'), '1'))\n"
            "    await asyncio.sleep(0.05)\n"
            "    print(' '.join(str(w.process.pid) for w in v._all))\n"
            "    task.cancel()\n"
            "asyncio.run(main())\n")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert len(out.stdout.split()) == 2
    # and a worker whose parent is gone before it is ready leaves quietly on its own
    worker = subprocess.Popen([sys.executable, "-c", "from slime_env.envs.math.verifier import _worker_main; "
                                                     "_worker_main()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    worker.stdout.close()
    _, err = worker.communicate(timeout=120)
    assert (worker.returncode, err) == (0, b"")


def test_the_verifier_never_raises(runner, verifier):
    odd = [("", "1"), ("\\boxed{\\frac{1}{0}}", "1"), ("\\boxed{}}}{{", "x"), ("\\boxed{\\undefinedmacro{3}}", "3"),
           ("\\boxed{1}", None), ("\\boxed{1}", ["1", "one"]), ("\\boxed{" + "(" * 500 + "}", "2"),
           ("\x00\\boxed{1}", "1")]
    async def main():
        return await asyncio.gather(*(verifier.verify(r, g) for r, g in odd))

    verdicts = runner.run(main())
    assert all(v.status in ("ok", "no_answer", "error", "timeout") for v in verdicts)
    assert verdicts[5].correct  # a list label: its first answer is the gold one


def test_rewards(runner, verifier):
    binary, pm1 = MathReward(verifier=verifier), MathReward(mode="pm1", verifier=verifier)
    penalised = MathReward(format_penalty=0.5, verifier=verifier)
    think = MathReward(require_think_close=True, verifier=verifier)

    def score(reward, text, label="4"):
        return runner.run(reward(text, label))[0]

    assert score(binary, "\\boxed{4}") == 1.0 and score(binary, "\\boxed{5}") == 0.0
    assert score(pm1, "\\boxed{4}") == 1.0 and score(pm1, "\\boxed{5}") == -1.0
    assert score(penalised, "no answer") == -0.5 and score(penalised, "\\boxed{5}") == 0.0
    assert score(think, "<think>\\boxed{4}</think> so \\boxed{4}") == 1.0
    assert score(think, "<think>maybe \\boxed{4}") == 0.0  # never closed its thinking
    assert score(think, "<think>\\boxed{4}</think> so \\boxed{5}") == 0.0
    with pytest.raises(ValueError, match="mode"):
        MathReward(mode="weird")


def test_slime_reward_takes_one_sample_or_a_list(runner):
    args = SimpleNamespace(math_reward_mode="pm1")
    samples = [SimpleNamespace(response="\\boxed{6}", label="6"), SimpleNamespace(response="\\boxed{7}", label="6")]
    assert runner.run(slime_reward(args, samples[0])) == 1.0
    assert runner.run(slime_reward(args, samples)) == [1.0, -1.0]
    assert runner.run(slime_group_reward(args, samples)) == [1.0, -1.0]


def test_loaders_read_the_common_layouts(tmp_path):
    rows = [{"prompt": "1+1?", "label": "2"},
            {"prompt": [{"role": "user", "content": "2+2?"}], "label": 4},
            {"question": "Tom has 3 apples and buys 4.", "answer": "3 + 4 = 7\n#### 7"},
            {"problem": "Compute 1/2+1/4.", "solution": "It is $\\boxed{\\frac{3}{4}}$."}]
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tasks = load_math_tasks(path)
    assert [t.label for t in tasks] == ["2", "4", "7", "\\frac{3}{4}"]
    assert tasks[1].messages()[0].content == "2+2?"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "label": "1"}) + "\n" + json.dumps({"text": "no layout"}) + "\n")
    with pytest.raises(InvalidInput, match=r"bad\.jsonl:2: no known math layout"):
        load_math_tasks(bad)


# --- envs with the ScriptedPolicy -----------------------------------------------------------------------

def test_math_env_single_turn(runner, smollm2_tok):
    renderer = get_renderer(smollm2_tok, strict=True)

    def episode(reply, label):
        env = slime_env.make("Math-v0")
        return runner.run(run_episode(env, ScriptedPolicy(smollm2_tok, [reply]),
                                      {"prompt": "1/2 + 1/4?", "label": label}, renderer=renderer))

    good = episode("1/2 + 1/4 = 3/4, so \\boxed{\\frac{3}{4}}", "0.75")
    bad = episode("\\boxed{\\frac{2}{4}}", "0.75")
    assert good.status == bad.status == "completed"
    assert good.reward == 1.0 and good.info["verdict"]["extracted"] == "\\frac{3}{4}"
    assert bad.reward == 0.0 and bad.info["correct"] is False
    assert good.num_turns == 1 and set(good.loss_mask) == {1}


@pytest.mark.parametrize("tool_format", ["hermes", "fenced"])
def test_math_tool_env_runs_code_and_masks_its_output(runner, smollm2_tok, tool_format):
    sandbox = make_sandbox("bwrap")
    code = "print(sum(i*i for i in range(11)))"
    call = (f'<tool_call>{{"name": "python", "arguments": {{"code": "{code}"}}}}</tool_call>' if tool_format == "hermes"
            else f"```python\n{code}\n```")
    loop = "while True: pass"
    loop_call = (f'<tool_call>{{"name": "python", "arguments": {{"code": "{loop}"}}}}</tool_call>'
                 if tool_format == "hermes" else f"```python\n{loop}\n```")
    env = slime_env.make("MathTool-v0", tool_format=tool_format, sandbox=sandbox, tool_timeout_s=1.0)
    policy = ScriptedPolicy(smollm2_tok, [loop_call, call, "The sum is \\boxed{385}."])
    traj = runner.run(run_episode(env, policy, {"prompt": "Sum of squares 0..10?", "label": "385"},
                                  renderer=get_renderer(smollm2_tok, strict=True), max_turns=5))
    assert traj.status == "completed" and traj.reward == 1.0, traj.reason
    assert traj.num_turns == 3 and traj.info["tool_calls"] == 2
    inserted = smollm2_tok.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 0])
    generated = smollm2_tok.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 1])
    assert "385" in inserted and "timed out after 1s" in inserted  # tool output: masked
    assert "385" not in generated.split("\\boxed")[0]  # the model never wrote the number before answering
    traj.check()
    runner.run(sandbox.close())


def test_math_tool_env_cuts_long_output_and_bounds_tool_calls(runner, smollm2_tok):
    sandbox = make_sandbox("bwrap")
    spam = '<tool_call>{"name": "python", "arguments": {"code": "print(\'z\' * 100000)"}}</tool_call>'
    env = slime_env.make("MathTool-v0", sandbox=sandbox, max_tool_calls=2, output_budget_tokens=50)
    traj = runner.run(run_episode(env, ScriptedPolicy(smollm2_tok, [spam]), {"prompt": "?", "label": "1"},
                                  renderer=get_renderer(smollm2_tok), max_turns=6))
    assert traj.status == "truncated" and traj.num_turns == 2 and traj.reward == 0.0
    tool_messages = [m.content for m in traj.messages if m.role == "tool"]
    assert tool_messages and all(len(m) < 300 and "characters cut" in m for m in tool_messages)
    runner.run(sandbox.close())


def test_reasoning_gym_env(runner, smollm2_tok, tmp_path):
    tasks = reasoning_gym_tasks("basic_arithmetic", size=4, seed=7)
    path = write_tasks_jsonl(tmp_path / "rg.jsonl", "basic_arithmetic", size=4, seed=7)
    loaded = load_tasks(path)
    assert [t.label for t in loaded] == [t.label for t in tasks]
    renderer = get_renderer(smollm2_tok)

    def episode(task, reply):
        env = slime_env.make("ReasoningGym-v0", dataset="basic_arithmetic")
        return runner.run(run_episode(env, ScriptedPolicy(smollm2_tok, [reply]), task, renderer=renderer))

    right = episode(loaded[0], f"<answer>{loaded[0].label}</answer>")
    wrong = episode(loaded[1], "<answer>not a number</answer>")
    none = episode(loaded[2], "I give up")
    assert right.reward == 1.0 and right.info["correct"]
    assert wrong.reward == 0.0 and none.reward == 0.0 and none.info["answer"] is None
    sampled = runner.run(run_episode(slime_env.make("ReasoningGym-v0", dataset="chain_sum", size=10, seed=1),
                                     ScriptedPolicy(smollm2_tok, ["<answer>0</answer>"]),
                                     {"prompt": "State the final answer: 1 + 2 =", "label": "3"}, renderer=renderer))
    assert sampled.status == "completed" and sampled.reward == 0.0
