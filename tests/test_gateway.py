"""The agent gateway: the official `openai` SDK against `Gateway` on 127.0.0.1, exact ledgers of free-form agent
calls (continuation, branches for rewritten / edited / forked histories and parallel sub-agents), private sessions,
bad requests, streaming.

Most tests drive the gateway with `ScriptedPolicy` on Qwen3's real tokenizer and chat template: a model that emits a
given tool call on cue is what the branch and parsing logic needs, and no small model does that reliably — it is a
stand-in for the engine only. `test_the_real_model_behind_the_gateway_*` runs SmolLM2-135M-Instruct itself."""

from __future__ import annotations

import asyncio
import json

import pytest

openai = pytest.importorskip("openai")

from slime_env.gateway import Gateway  # noqa: E402
from slime_env.policy import ScriptedPolicy  # noqa: E402
from slime_env.renderers import get_renderer  # noqa: E402

ADD = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                          "parameters": {"type": "object", "properties": {
                                              "a": {"type": "integer"}, "b": {"type": "integer"}},
                                              "required": ["a", "b"]}}}]
CALL = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _gateway(tok, replies, **kw) -> Gateway:
    policy = ScriptedPolicy(tok, replies, end_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    return Gateway(policy, get_renderer(tok, strict=True), "hermes", strict=True, **kw)


def run(coro):
    return asyncio.run(coro)


async def _serve(gw: Gateway, agent):
    await gw.start()
    try:
        return await agent(gw)
    finally:
        await gw.stop()


def _client(gw, s, key=None):
    return openai.AsyncOpenAI(base_url=gw.session_url(s), api_key=key or s.key, max_retries=0)


def _check_exact(t, renderer, tools=ADD):
    """The branch's ledger up to its last reply is, token for token, the chat template's full render of the
    conversation before that reply (ending at the generation prompt); the reply follows as generated; exactly the
    generated ids carry loss mask 1."""
    t.check()
    last = t.spans[-1]
    assert last.kind == "generated"
    ids = t.prompt_ids + t.response_ids
    cut = len(t.prompt_ids) + last.start
    assert renderer.encode(renderer.render_text(t.messages[:-1], tools=tools, add_generation_prompt=True)) == ids[:cut]
    assert renderer.assistant_text(ids[cut:]) == t.messages[-1].content
    generated = [s for s in t.spans if s.kind == "generated"]
    assert sum(t.loss_mask) == sum(s.end - s.start for s in generated) > 0


def test_openai_sdk_tool_call_round_trip_continues_one_exact_ledger(qwen3_tok):
    """A tool call comes back as an OpenAI tool call; the agent's next call (its own echo of our reply + the tool
    result, arguments re-serialised by the SDK) continues the same ledger; the second reply streams. One branch,
    two turns, the strict full-render check passes, the reward lands on it."""
    gw = _gateway(qwen3_tok, [CALL, "The sum is 5."])

    async def agent(gw):
        s = gw.open_session({"prompt": "What is 2 + 3?", "label": 5})
        client = _client(gw, s)
        msgs = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 2 + 3?"}]
        first = await client.chat.completions.create(model="m", messages=msgs, tools=ADD)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
        call = choice.message.tool_calls[0]
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
        assert first.usage.completion_tokens > 0 and first.usage.prompt_tokens > 0
        msgs += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        text, finish = "", None
        async for chunk in await client.chat.completions.create(model="m", messages=msgs, tools=ADD, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        assert (text, finish) == ("The sum is 5.", "stop")
        models = await client.models.list()
        assert [m.id for m in models.data] == ["slime-env"]
        return gw.close_session(s.id, reward=1.0)

    (t,) = run(_serve(gw, agent))
    assert (t.status, t.num_turns, t.reward, t.metadata["branch"], t.metadata["parent_branch"]) == \
        ("completed", 2, 1.0, 0, None)
    assert t.task.label == 5
    _check_exact(t, gw.renderer)
    assert "<tool_response>\n5\n</tool_response>" in gw.renderer.decode(t.response_ids)


def test_rewritten_edited_and_forked_histories_start_linked_branches(qwen3_tok):
    """Calls that do not extend a reply as given become new branches rendered from scratch, linked to the branch
    they share a prefix with: history rewritten (the agent summarised the first turns away), an edited reply (the
    agent changed our answer before sending it back: never attributed to the model), a fork (a second continuation
    of a reply already continued)."""
    gw = _gateway(qwen3_tok, [CALL, "It is 5.", "Fine.", "Ok.", "Sure."])

    async def agent(gw):
        s = gw.open_session("q")
        client = _client(gw, s)
        base = [{"role": "user", "content": "What is 2 + 3?"}]
        r1 = (await client.chat.completions.create(model="m", messages=base, tools=ADD)).choices[0].message
        echo = r1.model_dump(exclude_none=True)
        tool = {"role": "tool", "tool_call_id": r1.tool_calls[0].id, "content": "5"}
        await client.chat.completions.create(model="m", messages=base + [echo, tool], tools=ADD)  # continues 0
        # history rewritten: a summary replaces the first exchange
        await client.chat.completions.create(model="m", tools=ADD, messages=[
            base[0], {"role": "user", "content": "Summary: the tool said 5. Answer now."}])
        # the agent edits the model's reply before sending it back
        edited = dict(echo, content="I will add these numbers carefully.")
        await client.chat.completions.create(model="m", messages=base + [edited, tool], tools=ADD)
        # a fork: another continuation of the first reply, which branch 0 already continued
        await client.chat.completions.create(model="m", messages=base + [echo, dict(tool, content="6")], tools=ADD)
        return gw.close_session(s.id)

    trajs = run(_serve(gw, agent))
    assert [t.num_turns for t in trajs] == [2, 1, 1, 1]
    reasons = [t.metadata["branch_reason"] for t in trajs]
    assert reasons[0] == "first call"
    assert reasons[1] == "history rewritten from message 1" and trajs[1].metadata["parent_branch"] == 0
    assert reasons[2] == "the agent edited the reply at message 1" and trajs[2].metadata["fork_at"] == 1
    assert reasons[3] == "forked after the reply at message 1" and trajs[3].metadata["fork_at"] == 2
    for t in trajs:
        t.check()
    # the edited reply is prompt (mask 0) of branch 2; only that branch's own generation is trained on
    edited_prompt = gw.renderer.decode(trajs[2].prompt_ids)
    assert "I will add these numbers carefully." in edited_prompt and '"a": 2' in edited_prompt
    assert gw.renderer.decode([i for i, m in zip(trajs[2].response_ids, trajs[2].loss_mask) if m]).startswith("Ok.")


def test_parallel_sub_agents_on_one_session_get_their_own_branches(qwen3_tok):
    """Two sub-agents call concurrently on one session, each continuing its own context: two branches, each with its
    own two turns, neither mixed into the other."""
    gw = _gateway(qwen3_tok, lambda ctx: "Done." if "<tool_response>" in ctx else CALL)

    async def sub(client, topic):
        msgs = [{"role": "system", "content": f"You research {topic}."}, {"role": "user", "content": topic}]
        r = (await client.chat.completions.create(model="m", messages=msgs, tools=ADD)).choices[0].message
        msgs += [r.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": r.tool_calls[0].id,
                                                   "content": topic.upper()}]
        await client.chat.completions.create(model="m", messages=msgs, tools=ADD)

    async def agent(gw):
        s = gw.open_session("research")
        client = _client(gw, s)
        await asyncio.gather(sub(client, "apples"), sub(client, "pears"))
        return gw.close_session(s.id)

    trajs = run(_serve(gw, agent))
    assert sorted(t.num_turns for t in trajs) == [2, 2]
    for t in trajs:
        _check_exact(t, gw.renderer)
        text = gw.renderer.decode(t.prompt_ids + t.response_ids)
        mine = "apples" if "research apples" in text else "pears"
        assert mine.upper() in text and ({"apples", "pears"} - {mine}).pop() not in text


def test_sessions_are_private_bounded_and_expire(qwen3_tok):
    """A wrong key, another session's key, an unknown session and an expired one all get the same 401; a body
    over the bound gets 413; the server listens on loopback; a closed session's key stops working."""
    gw = _gateway(qwen3_tok, ["Hi."], session_ttl_s=600, max_body_bytes=20_000)
    msgs = [{"role": "user", "content": "hello"}]

    async def agent(gw):
        assert gw.base_url.startswith("http://127.0.0.1:")
        a, b = gw.open_session("a"), gw.open_session("b")
        assert a.id != b.id and a.key != b.key and len(a.key) > 40
        ok = await _client(gw, a).chat.completions.create(model="m", messages=msgs)
        assert ok.choices[0].message.content == "Hi."
        for client in (_client(gw, a, key="sk-guess"), _client(gw, a, key=b.key)):
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(model="m", messages=msgs)
        unknown = openai.AsyncOpenAI(base_url=f"{gw.base_url}/sessions/nope/v1", api_key=a.key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await unknown.chat.completions.create(model="m", messages=msgs)
        with pytest.raises(openai.APIStatusError) as big:
            await _client(gw, b).chat.completions.create(model="m",
                                                         messages=[{"role": "user", "content": "x" * 30_000}])
        assert big.value.status_code == 413
        assert len(gw.close_session(a.id)) == 1
        with pytest.raises(openai.AuthenticationError):  # closed
            await _client(gw, a).chat.completions.create(model="m", messages=msgs)
        gw.session_ttl_s = 0.2  # a session of its own expires (a short life for all would flake on a busy machine)
        c = gw.open_session("c")
        await asyncio.sleep(0.5)
        with pytest.raises(openai.AuthenticationError):  # expired
            await _client(gw, c).chat.completions.create(model="m", messages=msgs)

    run(_serve(gw, agent))


def test_bad_requests_get_openai_errors_and_leave_the_session_intact(qwen3_tok):
    gw = _gateway(qwen3_tok, ["One.", "Two."], max_context_tokens=64)
    msgs = [{"role": "user", "content": "hello"}]

    async def agent(gw):
        s = gw.open_session("x")
        client = _client(gw, s)
        bad = [({"messages": [{"content": "no role"}]}, r"messages\[0\]\.role"),
               ({"messages": msgs, "n": 2}, r"n=2: one choice per call"),
               ({"messages": msgs, "tool_choice": "required"}, r"cannot force a tool call"),
               ({"messages": [{"role": "tool", "content": "5"}]}, r"messages\[0\]\.tool_call_id"),
               ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                r"only text parts"),
               ({"messages": msgs, "tools": [{"type": "function"}]}, r"tools: expected a list"),
               ({"messages": [{"role": "user", "content": "word " * 80}]}, r"leave no room in the model's context")]
        for body, match in bad:
            with pytest.raises(openai.BadRequestError, match=match) as err:
                await client.chat.completions.create(model="m", **body)
            assert err.value.body["type"] == "invalid_request_error"
        r1 = await client.chat.completions.create(model="m", messages=msgs)
        r2 = await client.chat.completions.create(model="m", messages=msgs + [
            r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}])
        assert r2.choices[0].message.content == "Two."
        return gw.close_session(s.id)

    (t,) = run(_serve(gw, agent))
    assert t.num_turns == 2
    _check_exact(t, gw.renderer, tools=None)


def test_streamed_chunks_reassemble_to_the_non_streamed_completion(qwen3_tok):
    """The same reply (a text and a tool call) fetched plain and streamed (with usage and log-probs) gives the same
    message, finish reason, usage and per-token log-probs."""

    async def fetch(stream: bool):
        gw = _gateway(qwen3_tok, [CALL])

        async def agent(gw):
            s = gw.open_session("x")
            kw = dict(model="m", messages=[{"role": "user", "content": "2+3?"}], tools=ADD, logprobs=True)
            client = _client(gw, s)
            if not stream:
                c = await client.chat.completions.create(**kw)
                m = c.choices[0]
                return (m.message.content,
                        [(t.id, t.function.name, t.function.arguments) for t in m.message.tool_calls],
                        m.finish_reason, c.usage.model_dump(), [x.logprob for x in m.logprobs.content])
            content, calls, finish, usage = "", [], None, None
            async for ch in await client.chat.completions.create(**kw, stream=True,
                                                                stream_options={"include_usage": True}):
                usage = ch.usage.model_dump() if ch.usage else usage
                for c in ch.choices:
                    content += c.delta.content or ""
                    calls += [(t.id, t.function.name, t.function.arguments) for t in c.delta.tool_calls or ()]
                    finish = c.finish_reason or finish
            lps = [lp for t in gw.close_session(s.id) for lp, m in zip(t.rollout_logprobs, t.loss_mask) if m]
            return content, calls, finish, usage, lps

        return await _serve(gw, agent)

    plain, streamed = run(fetch(False)), run(fetch(True))
    assert plain[0] == streamed[0] == "Let me add." and plain[2] == streamed[2] == "tool_calls"
    assert [c[1:] for c in plain[1]] == [c[1:] for c in streamed[1]] == [("add", '{"a": 2, "b": 3}')]
    assert plain[3] == streamed[3] and plain[4] == pytest.approx(streamed[4])


def test_the_real_model_behind_the_gateway_answers_the_openai_sdk_with_an_exact_ledger():
    """SmolLM2-135M-Instruct (the embedded engine) behind the gateway in strict mode (every bridge and full render
    checked as the calls come): three chat turns of the official SDK make one branch whose ledger is the chat
    template's full render of the conversation, with the engine's own log-probs."""
    from slime_env.agents import TransformersPolicy, load_default_model

    model, tok = load_default_model()
    policy = TransformersPolicy(model, tok, max_batch_size=2)
    try:
        _the_real_model_behind_the_gateway(Gateway(policy, get_renderer(tok, strict=True), strict=True,
                                                   max_new_tokens=12))
    finally:
        policy.close()  # its engine thread holds the model for the rest of the run otherwise


def _the_real_model_behind_the_gateway(gw) -> None:

    async def agent(gw):
        s = gw.open_session("chat")
        client = _client(gw, s)
        msgs = [{"role": "user", "content": "Name a colour."}]
        for follow_up in ("Another one?", "And one more?"):
            r = await client.chat.completions.create(model="m", messages=msgs, temperature=0.7, max_tokens=12)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": follow_up}]
        await client.chat.completions.create(model="m", messages=msgs, temperature=0.7, max_tokens=12)
        return gw.close_session(s.id)

    (t,) = run(_serve(gw, agent))
    assert t.num_turns == 3 and t.metadata["branch_reason"] == "first call"
    t.check()
    lps = [lp for lp, m in zip(t.rollout_logprobs, t.loss_mask) if m]
    assert all(lp <= 0.0 for lp in lps) and any(lp < 0.0 for lp in lps)
    # the model may sample a non-canonical split of its own text, so the ledger is compared as text here: the
    # template's render of the conversation before the last reply, then that reply as generated (ended by the end
    # token or cut by max_tokens)
    r, ids = gw.renderer, t.prompt_ids + t.response_ids
    cut = len(t.prompt_ids) + t.spans[-1].start
    assert r.decode(ids[:cut]) == r.render_text(t.messages[:-1], add_generation_prompt=True)
    assert r.assistant_text(ids[cut:]) == t.messages[-1].content
    assert [m.role for m in t.messages] == ["user", "assistant"] * 3


# --- AgentEnv: an agent program as an env ---------------------------------------------------------------------
def _agent_env(**kw):
    from slime_env import AgentEnv

    return AgentEnv(**kw)


async def _episode(env, gw, task="What is 2 + 3?"):
    from slime_env import Task

    await gw.start()
    try:
        return await env.run(gw, Task.coerce({"prompt": task, "label": "5"}), metadata={"index": 7})
    finally:
        await gw.stop()


def test_agent_env_statuses_for_crashes_timeouts_silence_and_bad_rewards(qwen3_tok):
    """Whatever the agent program does, the episode ends with trajectories and a reason: a crash after a call is
    failed (the call it made is kept), a program past its deadline is truncated, one that never calls the model
    is one failed trajectory, a reward that raises fails the episode; a blocking (sync) program runs in a thread."""

    async def crashes(url, key, task):
        await openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": task.prompt}])
        raise KeyError("tool registry")

    async def sleeps(url, key, task):
        await asyncio.sleep(30)

    async def silent(url, key, task):
        return "I know it: 5"

    def blocking(url, key, task):  # the sync SDK, in a thread
        r = openai.OpenAI(base_url=url, api_key=key, max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": task.prompt}])
        return r.choices[0].message.content

    def bad_reward(task, result, trajectories):
        return float("nan")

    cases = [(dict(agent=crashes), "failed", "the agent raised KeyError: 'tool registry'", 1),
             (dict(agent=sleeps, deadline_s=0.3), "truncated", "deadline of 0.3s exceeded", 0),
             (dict(agent=silent), "failed", "the agent never called the model", 0),
             (dict(agent=blocking, reward=bad_reward), "failed", "the reward raised InvalidInput", 1),
             (dict(agent=blocking, reward=lambda task, result, trajs: result == "Five."), "completed", "", 1)]
    for kw, status, reason, turns in cases:
        (t,) = run(_episode(_agent_env(**kw), _gateway(qwen3_tok, ["Five."])))
        assert (t.status, t.num_turns, t.metadata["index"]) == (status, turns, 7), kw
        assert reason in t.reason, (kw, t.reason)
        t.check()
    assert t.reward == 1.0


def test_agent_side_branches_follow_their_main_trajectory_and_share_its_advantage(qwen3_tok):
    """An agent that summarises its context mid-way leaves two branches: the main trajectory (its last call's) first,
    the summarised-away one after it marked `branch_of`, both with the sample's reward; GRPO over two such samples
    gives both branches of a sample the same advantage, computed over the samples (not the branches)."""
    from slime_env.trainers.batch import pack

    async def summarising(url, key, task):
        client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        msgs = [{"role": "user", "content": task.prompt}]
        await client.chat.completions.create(model="m", messages=msgs, tools=ADD)
        summary = [{"role": "user", "content": f"{task.prompt} (a tool said 5)"}]
        r2 = await client.chat.completions.create(model="m", messages=summary, tools=ADD)
        return r2.choices[0].message.content

    trajs = []
    for reply in ("It is 5.", "It is 6."):
        env = _agent_env(agent=summarising, reward=lambda task, result, t: float(result == "It is 5."))
        trajs += run(_episode(env, _gateway(qwen3_tok, [CALL, reply])))
    assert [t.metadata.get("branch_of") is not None for t in trajs] == [False, True, False, True]
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0, 0.0]
    assert trajs[0].metadata["branch_reason"] == "no earlier call shares its first message"
    batch = pack(trajs, group_size=2, pad_id=0)
    adv = [float(batch.advantages[i][batch.loss_mask[i] > 0][0]) for i in range(4)]
    assert adv[0] == adv[1] > 0 > adv[2] == adv[3] and adv[0] == pytest.approx(-adv[2])
    with pytest.raises(ValueError, match="do not form groups of 2"):
        pack(trajs[1:], group_size=2, pad_id=0)  # a side branch before its main trajectory


def test_anthropic_sdk_messages_with_tool_use_continue_the_same_ledger(qwen3_tok):
    """The official `anthropic` SDK against the Messages route: a `tool_use` block comes back with its input, the
    agent's `tool_result` continues the same branch (strict checks pass), the second reply streams; a wrong key is
    refused; the ledger is the one the OpenAI route would have made."""
    anthropic = pytest.importorskip("anthropic")
    gw = _gateway(qwen3_tok, [CALL, "The sum is 5."])
    tools = [{"name": "add", "description": "Add two integers.", "input_schema": ADD[0]["function"]["parameters"]}]

    async def agent(gw):
        s = gw.open_session("What is 2 + 3?")
        client = anthropic.AsyncAnthropic(base_url=gw.session_url(s, api="anthropic"), api_key=s.key, max_retries=0)
        msgs = [{"role": "user", "content": "What is 2 + 3?"}]
        first = await client.messages.create(model="m", max_tokens=64, system="Use tools.", messages=msgs, tools=tools)
        assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["text", "tool_use"]
        use = first.content[1]
        assert (use.name, use.input) == ("add", {"a": 2, "b": 3}) and first.content[0].text == "Let me add."
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
        async with client.messages.stream(model="m", max_tokens=64, system="Use tools.", messages=msgs,
                                          tools=tools) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "end_turn" and final.content[0].text == "The sum is 5."
        bad = anthropic.AsyncAnthropic(base_url=gw.session_url(s, api="anthropic"), api_key="sk-no", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            await bad.messages.create(model="m", max_tokens=8, messages=msgs)
        with pytest.raises(anthropic.BadRequestError, match="max_tokens: required"):
            await client.messages.create(model="m", max_tokens=0, messages=msgs)
        return gw.close_session(s.id)

    (t,) = run(_serve(gw, agent))
    assert t.num_turns == 2 and t.metadata["branch_reason"] == "first call"
    _check_exact(t, gw.renderer)


def test_serve_gateway_in_front_of_a_serve_engine_process(tmp_path):
    """`slime-env serve-gateway --engine URL` as its own process in front of a `slime-env serve-engine` process (real
    SmolLM2 weights, SGLang's /generate): sessions are opened and closed over /admin with the admin key (refused
    without it), the OpenAI SDK chats through the session URL, and the closed session's trajectory comes back as
    JSON whose ledger holds the engine's log-probs."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import httpx
    from slime_env.agents.default_model import default_model_path
    from slime_env.agents.launcher import ServeProcess

    from slime_env import Trajectory

    engine = ServeProcess(model=str(default_model_path()), log_path=tmp_path / "engine.log")
    url = asyncio.run(engine.start())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "SLIME_ENV_GATEWAY_ADMIN_KEY": "admin-test-key"}
    gw = subprocess.Popen([sys.executable, "-m", "slime_env", "serve-gateway", "--engine", url, "--port", str(port),
                           "--max-new-tokens", "8"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.post(f"{base}/admin/sessions", timeout=2).status_code == 401:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.post(f"{base}/admin/sessions", headers={"Authorization": "Bearer guess"},
                             timeout=10).status_code == 401
        admin = {"Authorization": "Bearer admin-test-key"}
        opened = httpx.post(f"{base}/admin/sessions", json={"task": {"prompt": "hi", "label": "x"}},
                               headers=admin, timeout=10).json()
        client = openai.OpenAI(base_url=opened["openai_base_url"], api_key=opened["api_key"], max_retries=0)
        msgs = [{"role": "user", "content": "Say hello."}]
        r = client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
        client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
        closed = httpx.post(f"{base}/admin/sessions/{opened['session_id']}/close", json={"reward": 0.5},
                               headers=admin, timeout=10).json()
        (t,) = [Trajectory.from_dict(d) for d in closed["trajectories"]]
        t.check()
        assert (t.num_turns, t.reward, t.task.label) == (2, 0.5, "x")
        assert any(lp < 0 for lp, m in zip(t.rollout_logprobs, t.loss_mask) if m)
        with pytest.raises(openai.AuthenticationError):  # closed
            client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
    finally:
        gw.terminate()
        gw.wait(timeout=30)
        engine.stop()


def test_a_langgraph_react_agent_trains_through_the_gateway_unchanged(qwen3_tok):
    """LangGraph's prebuilt ReAct agent on `langchain-openai`'s ChatOpenAI, pointed at a session URL: it calls the
    tool the model asks for, sends the result back, gets the answer; the gateway records one branch of two turns
    that passes the exact-ledger check, scored through `AgentEnv`."""
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool as lc_tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    seen = []

    @lc_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    async def react(url, key, task):
        llm = ChatOpenAI(base_url=url, api_key=key, model="policy", max_retries=0, temperature=1.0)
        agent = create_react_agent(llm, [add])
        out = await agent.ainvoke({"messages": [("user", task.prompt)]})
        return out["messages"][-1].content

    env = _agent_env(agent=react, reward=lambda task, result, trajs: float("5" in result))
    gw = _gateway(qwen3_tok, [CALL, "The sum is 5."])
    (t,) = run(_episode(env, gw))
    assert seen == [(2, 3)] and (t.status, t.reward, t.num_turns) == ("completed", 1.0, 2)
    assert t.metadata["branch_reason"] == "first call"
    t.check()
    text = gw.renderer.decode(t.prompt_ids + t.response_ids)
    assert '"name": "add"' in text and "<tool_response>\n5\n</tool_response>" in text


def test_agent_env_hands_anthropic_clients_the_session_root_and_refuses_other_apis():
    from slime_env import AgentEnv, InvalidInput, Task

    seen = []

    async def agent(base_url, api_key, task):
        seen.append((base_url, api_key))

    class Gw:  # the calls AgentEnv makes around the agent (the real gateway's URLs are tested above)
        def open_session(self, task):
            return type("S", (), {"id": "s1", "key": "sk-1"})()

        def session_url(self, session, api="openai"):
            return f"http://gw/sessions/{session.id}" + ("/v1" if api == "openai" else "")

        def close_session(self, session_id, **kw):
            return []

    for api in ("openai", "anthropic"):
        t = asyncio.run(AgentEnv(agent, api=api).run(Gw(), Task.coerce({"prompt": "q"}, "t")))[0]
        assert t.status == "failed" and "never called the model" in t.reason
    assert seen == [("http://gw/sessions/s1/v1", "sk-1"), ("http://gw/sessions/s1", "sk-1")]
    with pytest.raises(InvalidInput, match="api must be 'openai' or 'anthropic'"):
        AgentEnv(agent, api="gemini")
