"""verifiers environments run here (the real `verifiers` package, the 0.4 series), ledgers exact (strict renderer).

Offline tasksets: two written the way verifiers' own examples are (tests/vf_capitals.py: weighted async rewards, a
metric, a `@vf.stop`, a `vf.Toolset`; tests/vf_codeword.py: a multi-turn `vf.Env.run()` over `interaction.turn`), and
the `openenv` taskset verifiers ships, played against OpenEnv's scaffolded echo server. The example environments of
verifiers' repository are not on PyPI (and reverse_text, gsm8k, wordle fetch datasets or NLTK data at load).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

pytest.importorskip("verifiers")

from slime_env import ScriptedPolicy, get_renderer, run_episode  # noqa: E402
from slime_env.errors import InvalidInput  # noqa: E402
from slime_env.integrations.verifiers import VerifiersEnv, require_verifiers, verifiers_tasks  # noqa: E402

CALL = '<tool_call>\n{{"name": "atlas_capital", "arguments": {{"country": "{}"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def strict(smollm2_tok):
    return get_renderer(smollm2_tok, strict=True)


def play(env, replies, task, tok, renderer, max_turns=8):
    async def main():
        try:
            return await run_episode(env, ScriptedPolicy(tok, replies), task, renderer=renderer, max_turns=max_turns)
        finally:
            await env.close()

    traj = asyncio.run(main())
    traj.check()
    return traj


def test_taskset_tasks_tools_and_weighted_rewards(smollm2_tok, strict):
    env = VerifiersEnv("vf_capitals")
    tasks = verifiers_tasks(env)
    assert [t.label for t in tasks] == ["Paris", "Tokyo", "Nairobi", "Lima"]
    assert tasks[1].messages()[0].content == "You are a geography assistant."
    traj = play(env, [CALL.format("Japan"), "<answer>Tokyo</answer>"], tasks[1], smollm2_tok, strict)
    assert traj.status == "completed", traj.reason
    assert traj.turn_rewards == [0.0, 1.25]  # correct (weight 1) + used_tool (weight 0.25)
    text = smollm2_tok.decode(traj.prompt_ids + traj.response_ids)
    assert '"name": "atlas_capital"' in smollm2_tok.decode(traj.prompt_ids)  # the toolset's tool, prefixed
    assert "Tokyo<|im_end|>" in text  # the tool ran in process; its result is the tool message


def test_rubric_detail_metrics_and_parser(smollm2_tok, strict):
    async def main():
        env = VerifiersEnv("vf_capitals", countries=["peru"])  # taskset config fields as keywords
        (task,) = verifiers_tasks(env)
        await env.reset(options={"task": task})
        from slime_env import Action, get_parser

        text = CALL.format("Peru")
        parsed = get_parser("hermes")(text)
        obs, *_ = await env.step(Action(text=text, tool_calls=parsed.tool_calls))
        out = await env.step(Action(text="<answer>Cusco</answer>"))
        await env.close()
        return obs, out, env.trace

    obs, (_, reward, terminated, _, info), trace = asyncio.run(main())
    assert obs[0].content == "Lima" and obs[0].name == "atlas_capital"
    assert terminated and reward == 0.25
    assert info["verifiers"]["rewards"] == {"correct": {"score": 0.0, "weight": 1.0},
                                            "used_tool": {"score": 1.0, "weight": 0.25}}
    assert info["verifiers"]["metrics"] == {"turns": 2.0}
    calls = trace.assistant_messages[0].tool_calls  # the trace carries the parsed call as an OpenAI tool call
    assert calls[0].name == "atlas_capital" and calls[0].arguments == '{"country": "Peru"}'


def test_stop_hook_ends_and_scores(smollm2_tok, strict):
    env = VerifiersEnv("vf_capitals")
    task = verifiers_tasks(env)[0]
    traj = play(env, [CALL.format("France")], task, smollm2_tok, strict)  # calls the tool forever
    assert traj.status == "completed"  # @vf.stop three_turns fired before the 4th call
    assert len(traj.turn_rewards) == 3 and traj.reward == 0.25


def test_multi_turn_env_run_drives_the_episode(smollm2_tok, strict):
    env = VerifiersEnv("vf_codeword")
    task = verifiers_tasks(env)[2]
    traj = play(env, ["Q", "QR", "QRS"], task, smollm2_tok, strict)
    assert traj.status == "completed", traj.reason
    assert traj.reward == 2.5  # exact (weight 2) + the run()'s own "finished" reward (weight 0.5)
    inserted = smollm2_tok.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if not m])
    assert "More letters: R." in inserted and "More letters: S." in inserted
    wrong = play(VerifiersEnv("vf_codeword"), ["Q", "QR", "QRX"], task, smollm2_tok, strict)
    assert wrong.reward == 0.5


def test_verifiers_openenv_taskset_against_openenv_echo(tmp_path, smollm2_tok, strict):
    """verifiers' own `openenv` taskset (its `run()` steps an OpenEnv client; rewards summed at the end) over
    OpenEnv's echo server; our max_turns stops it and the truncated trace is scored, as verifiers does."""
    pytest.importorskip("openenv")
    from test_openenv import uvicorn

    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env", "--output-dir", str(tmp_path)], check=True,
                   capture_output=True)
    with uvicorn("echo_env.server.app:app", tmp_path) as url:
        env = VerifiersEnv("openenv", base_url=url, resets=[{}], max_turns=3)
        task = verifiers_tasks(env)[0]
        traj = play(env, ['{"message": "hello"}', "hey"], task, smollm2_tok, strict)
    assert traj.status == "truncated"
    assert traj.reward == pytest.approx(1.3)  # 0.5 + 0.3 + 0.5: OpenEnv's per-step echo rewards
    assert '"echoed_message": "hey"' in smollm2_tok.decode(traj.response_ids)


def test_errors_name_the_input(monkeypatch):
    env = VerifiersEnv("vf_codeword")
    monkeypatch.setattr(env.vf_env.taskset, "INFINITE", True)
    with pytest.raises(InvalidInput, match="infinite: pass limit="):
        verifiers_tasks(env)
    assert len(verifiers_tasks(env, limit=2)) == 2
    with pytest.raises(InvalidInput, match=r"needs a task from verifiers_tasks"):
        asyncio.run(env.reset(options={"task": "What is the capital of Chile?"}))
    stale = verifiers_tasks(env, limit=1)[0].to_dict()
    stale["metadata"]["verifiers"]["key"] = "0" * 64
    with pytest.raises(InvalidInput, match=r"key differs"):
        asyncio.run(env.reset(options={"task": stale}))
    assert require_verifiers().startswith("0.4")


# --- out: our envs as verifiers environments, run by verifiers' own eval loop against our gateway ----------------
GUESS_ENV = str((__import__("pathlib").Path(__file__).parents[1] / "examples" / "guess_number_env.py").resolve())


def solve(context: str) -> str:
    """Calculator-v0's player: one calculator call on the question, then the answer from the tool's result."""
    import re

    results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", context)
    if results:
        return f"<answer>{results[-1]}</answer>"
    question = re.findall(r"What is (.*?)\?", context)[-1]
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % question


def guesser(context: str) -> str:
    import re

    lo, hi = 1, 100
    for guess, hint in re.findall(r"<guess>(\d+)</guess><\|im_end\|>\n<\|im_start\|>user\n(\w+)", context):
        lo, hi = (int(guess) + 1, hi) if hint == "higher" else (lo, int(guess) - 1)
    return f"<guess>{(lo + hi) // 2}</guess>"


def vf_eval(package_dir, taskset_id, policy, tok, monkeypatch, **taskset):
    """verifiers' own `run_eval` (what `vf eval` runs) on `taskset_id`, its model calls sent to one session of our
    gateway; returns the episodes and the gateway's trajectories."""
    import verifiers.v1 as vf
    from verifiers.v1.cli.eval.runner import run_eval
    from verifiers.v1.configs.cli.eval import EvalConfig

    from slime_env import Gateway, Task

    monkeypatch.syspath_prepend(str(package_dir))

    async def main():
        gateway = Gateway(policy, get_renderer(tok), "hermes", strict=True)
        await gateway.start()
        try:
            session = gateway.open_session(Task("verifiers eval"))
            monkeypatch.setenv("SLIME_ENV_GATEWAY_KEY", session.key)
            config = EvalConfig(env=vf.resolve_env_config({"taskset": {"id": taskset_id, **taskset}}), model="policy",
                                client=vf.EvalClientConfig(base_url=gateway.session_url(session),
                                                           api_key_var="SLIME_ENV_GATEWAY_KEY"),
                                push=False, rich=None, output_dir=package_dir / "outputs", max_concurrent=1)
            episodes = await run_eval(config)
            return episodes, gateway.close_session(session.id)
        finally:
            await gateway.stop()

    return asyncio.run(main())


def test_exported_env_runs_under_vf_eval_against_our_gateway(tmp_path, smollm2_tok):
    """`slime-env export-verifiers Calculator-v0`, then verifiers' own command, `vf-eval calculator_v0`, with its
    model client pointed at a session of our gateway: every episode scored by our env, every call an exact ledger."""
    import json
    import os
    import shutil

    from slime_env import Gateway, Task

    out = subprocess.run([sys.executable, "-m", "slime_env", "export-verifiers", "Calculator-v0",
                          "--out", str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "calculator_v0" in out and (tmp_path / "calculator_v0" / "__init__.py").exists()
    vf_eval_cmd = shutil.which("vf-eval", path=os.path.dirname(sys.executable)) or shutil.which("vf-eval")

    async def main():
        gateway = Gateway(ScriptedPolicy(smollm2_tok, solve), get_renderer(smollm2_tok), "hermes", strict=True)
        await gateway.start()
        try:
            session = gateway.open_session(Task("vf-eval"))
            proc = await asyncio.create_subprocess_exec(
                vf_eval_cmd, "calculator_v0", "-m", "policy", "--client.base-url", gateway.session_url(session),
                "--client.api-key-var", "SLIME_ENV_GATEWAY_KEY", "--env.taskset.num-tasks", "2", "--no-push",
                "-o", str(tmp_path / "outputs"), cwd=tmp_path, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(tmp_path), "SLIME_ENV_GATEWAY_KEY": session.key})
            log, _ = await proc.communicate()
            return proc.returncode, log.decode(), gateway.close_session(session.id)
        finally:
            await gateway.stop()

    code, log, trajs = asyncio.run(main())
    assert code == 0, log[-3000:]
    (traces,) = (tmp_path / "outputs").rglob("traces.jsonl")
    episodes = [json.loads(line) for line in traces.read_text().splitlines()]
    assert len(episodes) == 2
    for episode in episodes:
        (trace,) = episode["traces"]
        assert trace["rewards"]["slime_env"] == {"score": 1.0, "weight": 1.0}
        assert trace["info"]["slime_env"]["steps"] == 2 and trace["info"]["slime_env"]["info"]["correct"]
    assert len(trajs) == 2  # one gateway branch per rollout, exact ledgers
    for t in trajs:
        t.check()
        assert t.status == "completed" and len(t.metadata["calls"]) == 2


def test_exported_text_env_ledger_equals_a_direct_run(tmp_path, smollm2_tok, monkeypatch):
    """A multi-turn text env (examples/guess_number_env.py) through verifiers' eval loop and our gateway: the recorded
    tokens are the ones `run_episode` records when it runs the env directly."""
    from slime_env import make
    from slime_env.integrations.verifiers_export import write_verifiers_package

    env_id = f"{GUESS_ENV}:GuessEnv"
    write_verifiers_package(env_id, tmp_path, name="guess_number")
    episodes, (traj,) = vf_eval(tmp_path, "guess_number", ScriptedPolicy(smollm2_tok, guesser), smollm2_tok,
                                monkeypatch, num_tasks=1, seed=5)
    (trace,) = episodes[0].traces
    assert trace.reward == 1.0
    env = make(env_id)
    task = env.sample_task(__import__("random").Random(5))

    async def direct():
        return await run_episode(env, ScriptedPolicy(smollm2_tok, guesser), task,
                                 renderer=get_renderer(smollm2_tok, strict=True), max_turns=10)

    ours = asyncio.run(direct())
    traj.check()
    assert ours.reward == 1.0 and len(traj.metadata["calls"]) == len(ours.turn_rewards)
    assert traj.prompt_ids + traj.response_ids == ours.prompt_ids + ours.response_ids
    assert traj.loss_mask == ours.loss_mask
