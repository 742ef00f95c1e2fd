"""Coding-agent CLIs as episode agents (`Harness-v0`): Claude Code, Codex CLI and OpenCode — their real binaries from
npm, installed once into a layer over a Harbor task's image — each run one episode in the task's container through
the gateway (on 127.0.0.1, reached through the harness network's relay), scored by the task's own verifier in a fresh
container.

The model is the embedded SmolLM2-135M (its replies are not useful: the reward is 0; the episode is real): every
branch's ledger must equal what the engine was sent and sampled, call by call. A scripted policy makes each harness
call its shell tool once, so the tool path (the command runs inside the workspace) is exercised exactly. A harness
whose binary is missing from the image is `infra_error`, never a 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from slime_env import Task
from slime_env.gateway import Gateway
from slime_env.renderers import get_renderer
from workspace_support import require_backend, unavailable

NAMES = ("claude-code", "codex", "opencode")
TASK = "fix-mean-script"
SHELL = {"claude-code": ("Bash", "command"), "codex": ("exec_command", "cmd"), "opencode": ("bash", "command")}


class Recording:
    """The engine, with a record of every generation it was asked for: (input ids, the generation)."""

    def __init__(self, policy):
        self.policy, self.records = policy, []
        self.context_length = getattr(policy, "context_length", None)

    async def generate(self, input_ids, params):
        gen = await self.policy.generate(input_ids, params)
        self.records.append((list(input_ids), gen))
        return gen


def _task() -> Task:
    from slime_env.envs.harbor import harbor_tasks

    return Task.coerce(next(t for t in harbor_tasks() if t["metadata"]["name"] == TASK), "task")


@pytest.fixture(scope="module")
def images():
    """Each harness installed (npm) and layered over the task's image, the three at once; what it cost, by step."""
    require_backend("docker")
    if shutil.which("npm") is None:
        unavailable("npm is not installed (.ci/host-deps installs node)")
    from slime_env.envs.harbor import environment, harbor_task
    from slime_env.envs.harness import HARNESSES
    from slime_env.envs.harness.install import TIMINGS, harness_image

    base = asyncio.run(environment.task_image(harbor_task(_task())))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(3) as pool:
        tags = dict(zip(NAMES, pool.map(lambda n: harness_image(base, HARNESSES[n]), NAMES)))
    print(f"\nharness installs and images: {time.perf_counter() - t0:.1f}s wall; {TIMINGS}")
    return tags


@pytest.fixture(scope="module")
def smollm2():
    from slime_env.agents import load_default_model

    return load_default_model()


def _episode(policy, tok, name: str, *, max_new_tokens: int = 24, **env_kw):
    from slime_env.envs.harness import HarnessEnv

    async def main():
        gw = Gateway(policy, get_renderer(tok, strict=True), "hermes", strict=True,
                     max_new_tokens=max_new_tokens)
        await gw.start()
        try:
            env = HarnessEnv(name, **{"max_turns": 2, "max_output_tokens": max_new_tokens, "timeout_s": 180, **env_kw})
            return await env.run(gw, _task())
        finally:
            await gw.stop()

    return asyncio.run(main())


def _check_ledgers(trajectories, records) -> None:
    """Every branch's ledger is what the engine saw and sampled: each generation's input ids are the branch's ids up
    to it and its tokens follow, generated (loss mask 1) with the engine's log-probs; nothing else is generated."""
    assert sum(t.num_turns for t in trajectories) == len(records) > 0
    assert sum(sum(t.loss_mask) for t in trajectories) == sum(len(g.token_ids) for _, g in records)
    for ids, gen in records:
        found = False
        for t in trajectories:
            full, n, p = t.prompt_ids + t.response_ids, len(ids), len(t.prompt_ids)
            if full[:n] == ids and full[n:n + len(gen.token_ids)] == list(gen.token_ids):
                span = range(n - p, n - p + len(gen.token_ids))
                assert all(t.loss_mask[i] == 1 for i in span)
                assert [t.rollout_logprobs[i] for i in span] == pytest.approx(list(gen.logprobs))
                found = True
        assert found, "a generation the engine made is in no branch's ledger"
    for t in trajectories:
        t.check()


@pytest.mark.parametrize("name", NAMES)
def test_a_harness_runs_one_real_episode_with_smollm2(name, images, smollm2):
    """One turn (Claude Code's --max-turns, OpenCode's steps; Codex has no turn limit, and SmolLM2 makes no
    parseable call, so its turn ends on the first reply); OpenCode's title call is a branch of its own. Greedy, with
    room for SmolLM2 to end its reply itself: a reply cut at the limit makes Claude Code ask again for the rest (up to
    three times), each call another prefill."""
    from slime_env.agents import TransformersPolicy

    model, tok = smollm2
    recording = None

    async def main():
        from slime_env.envs.harness import HarnessEnv

        nonlocal recording
        policy = TransformersPolicy(model, tok, max_batch_size=2)
        recording = Recording(policy)  # its engine on this episode's loop
        gw = Gateway(recording, get_renderer(tok, strict=True), "hermes", strict=True, max_new_tokens=48,
                     overrides={"temperature": 0.0})
        await gw.start()
        try:
            return await HarnessEnv(name, max_turns=1, max_output_tokens=48, timeout_s=400).run(gw, _task())
        finally:
            await gw.stop()
            policy.close()

    trajectories = asyncio.run(main())
    main_t = trajectories[0]
    assert main_t.status == "completed", main_t.reason
    record = main_t.metadata["workspace"]
    assert record["harbor"]["status"] == "ok" and record["harbor"]["mode"] == "isolated"  # the task's verifier ran
    assert main_t.reward == record["harbor"]["rewards"]["reward"]
    assert main_t.metadata["calls"][0]["prompt_tokens"] < 4096  # the short system prompt took
    _check_ledgers(trajectories, recording.records)


def _scripted(tok, name: str):
    from slime_env.policy import ScriptedPolicy

    tool, arg = SHELL[name]
    call = {"name": tool, "arguments": {arg: "hostname > /tmp/ran-in; cat /tmp/ran-in",
                                        **({"description": "where"} if name == "opencode" else {})}}

    def reply(context: str) -> str:
        # the agent's own loop (tools in its system message) calls once, then stops; a title call gets a title
        if "<tools>" not in context or "<|im_start|>tool" in context:
            return "Done."
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    return ScriptedPolicy(tok, reply)


def test_each_harness_runs_its_shell_tool_inside_the_workspace(images, smollm2_tok):
    """A scripted policy has each harness's own loop call its shell tool once (the three at once): the command runs
    in the workspace (its hostname comes back), the reply to it continues the branch, the ledgers are exact."""

    async def main():
        from slime_env.envs.harness import HarnessEnv

        runs = []
        for name in NAMES:
            recording = Recording(_scripted(smollm2_tok, name))
            recording.context_length = 8192
            gw = Gateway(recording, get_renderer(smollm2_tok, strict=True), "hermes", strict=True, max_new_tokens=128)
            await gw.start()
            runs.append((recording, gw, HarnessEnv(name, max_turns=3, max_output_tokens=128, timeout_s=300)))
        try:
            return await asyncio.gather(*(env.run(gw, _task()) for _, gw, env in runs)), [r for r, _, _ in runs]
        finally:
            for _, gw, _ in runs:
                await gw.stop()

    episodes, recordings = asyncio.run(main())
    for name, trajectories, recording in zip(NAMES, episodes, recordings):
        assert trajectories[0].status == "completed", (name, trajectories[0].reason)
        texts = [smollm2_tok.decode(t.response_ids) for t in trajectories]
        ran = [t for t in texts if "<tool_call>" in t]
        # the command's output, the workspace's hostname, then the model's next reply on the same branch
        assert ran and "workspace" in ran[0].split("</tool_call>", 1)[1] and ran[0].endswith("Done.<|im_end|>"), name
        _check_ledgers(trajectories, recording.records)


def test_a_missing_harness_binary_is_an_infra_error_not_a_zero(images, smollm2_tok):
    from dataclasses import replace

    from slime_env.envs.harness import HARNESSES, HarnessEnv
    from slime_env.policy import ScriptedPolicy

    broken = replace(HARNESSES["opencode"], binary="node_modules/opencode-linux-x64/bin/not-there")

    async def main():
        gw = Gateway(ScriptedPolicy(smollm2_tok, ["Done."]), get_renderer(smollm2_tok, strict=True), "hermes")
        await gw.start()
        try:
            env = HarnessEnv("opencode", timeout_s=60)
            env.harness = broken  # the image has the real binary; the description names a path it lacks
            env.agent = __import__("slime_env.envs.harness", fromlist=["x"]).harness_agent(broken)
            return await env.run(gw, _task())
        finally:
            await gw.stop()

    (traj,) = asyncio.run(main())
    assert traj.status == "infra_error" and traj.reward == 0.0
    assert "binary is not in the workspace image" in traj.reason


def test_bad_harness_settings_name_the_field():
    from slime_env import InvalidInput
    from slime_env.envs.harness import Bounds, HarnessEnv

    with pytest.raises(InvalidInput, match="harness must be one of"):
        HarnessEnv("cursor")
    with pytest.raises(InvalidInput, match="max_turns"):
        Bounds(max_turns=0)
    with pytest.raises(InvalidInput, match="timeout_s"):
        Bounds(timeout_s=float("nan"))
    assert os.environ.get("SLIME_ENV_NEVER_SET") is None


def test_messages_refuses_unknown_fields_and_takes_claude_codes_shape(smollm2_tok):
    """What Claude Code sends on /v1/messages: a system message mid-conversation (its environment context),
    `output_config.effort` (a hint, accepted), `metadata`, `cache_control` on blocks. An unknown field, a structured
    output format and server-side context editing are refused in Anthropic's error body, naming the field."""
    import urllib.error
    import urllib.request

    from slime_env.policy import ScriptedPolicy

    async def main():
        gw = Gateway(ScriptedPolicy(smollm2_tok, ["Hi."]), get_renderer(smollm2_tok, strict=True), "hermes")
        await gw.start()
        s = gw.open_session()
        url = gw.session_url(s, api="anthropic") + "/v1/messages"

        def post(body):
            req = urllib.request.Request(url, json.dumps(body).encode(), {"x-api-key": s.key,
                                                                            "content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        base = {"model": "m", "max_tokens": 16, "metadata": {"user_id": "u"}, "output_config": {"effort": "high"},
                "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                             {"role": "system", "content": [{"type": "text", "text": "cwd: /app"}]}]}
        try:
            return [await asyncio.to_thread(post, b) for b in (
                base, {**base, "frobnicate": 1}, {**base, "output_config": {"format": {"type": "json_schema"}}},
                {**base, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}})]
        finally:
            await gw.stop()

    ok, unknown, fmt, ctx = asyncio.run(main())
    assert ok[0] == 200 and ok[1]["content"][0]["text"] == "Hi."
    for (status, body), field in ((unknown, "frobnicate"), (fmt, "output_config"), (ctx, "context_management")):
        assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith(f"{field}:")


def test_harness_run_cli_names_a_bad_harness_or_task(tmp_path):
    from typer.testing import CliRunner

    from slime_env.envs.harbor.env import EXAMPLES
    from slime_env.envs.harness.cli import harness_app

    bad = CliRunner().invoke(harness_app, ["run", "cursor", str(EXAMPLES / TASK)])
    assert bad.exit_code == 2 and "harness must be one of" in bad.output
    missing = CliRunner().invoke(harness_app, ["run", "codex", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "nope" in missing.output
