"""The gateway under hostile, sloppy or unlucky clients (issue 46): malformed bodies and parameters are the client's
400 in its API's error shape naming the field, never a 500 or the engine's 502; seeds are bounded at every entry
and a request's own failure never takes an engine out of a pool; tool schemas are checked; branches rendered from
scratch show the agent's tool calls; calls whose client left are not recorded; expiry never drops recorded calls;
unsupported fields are refused and stop sequences reported as each API does.

The engine is `ScriptedPolicy` on real tokenizers and chat templates (Qwen3's, SmolLM2's), as in test_gateway.py."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib

import aiohttp
import pytest

openai = pytest.importorskip("openai")

from test_gateway import ADD, CALL, _client, _gateway, _serve, run  # noqa: E402

from slime_env.errors import InvalidInput  # noqa: E402
from slime_env.gateway import Gateway  # noqa: E402
from slime_env.http import RemoteError  # noqa: E402
from slime_env.policy import ScriptedPolicy  # noqa: E402
from slime_env.renderers import get_renderer  # noqa: E402

HELLO = [{"role": "user", "content": "hello"}]


async def _post(gw, s, body, path="chat/completions", raw=None, headers=None):
    """POST `body` (or the bytes `raw`) to the session's route: (status, JSON answer or text)."""
    url = f"{gw.session_url(s)}/{path}"
    data = raw if raw is not None else json.dumps(body).encode()
    head = {"Authorization": f"Bearer {s.key}", "Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as http, http.post(url, data=data, headers=head) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


def _openai_error(answer, param):
    assert isinstance(answer, dict) and answer["error"]["type"] == "invalid_request_error", answer
    assert answer["error"]["param"] == param, answer
    return answer["error"]["message"]


# --- item 1: malformed requests ------------------------------------------------------------------------------------
def test_malformed_bodies_are_400s_in_the_apis_own_shape_naming_the_field(qwen3_tok):
    gw = _gateway(qwen3_tok, ["Fine."])
    echo = {"role": "assistant", "content": "", "tool_calls": "not a list"}
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    args = json.dumps({"a": json.loads("[" * 80 + "]" * 80)})

    async def agent(gw):
        s = gw.open_session("x")
        cases = [({"messages": [*HELLO, echo, {"role": "user", "content": "go"}]}, None, "messages[1].tool_calls"),
                 ({"messages": HELLO, "stream": True, "stream_options": "yes"}, None, "stream_options"),
                 (None, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
                 (None, b'{"messages": [{"role": "user", "content": "x"}], "stop": ["\\udfff"]}', "stop[0]"),
                 ({"messages": [*HELLO, {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "c", "type": "function", "function": {"name": "add", "arguments": args}}]},
                     {"role": "tool", "tool_call_id": "c", "content": "5"}]}, None,
                  "messages[1].tool_calls[0].function.arguments.a" + "[0]" * 64),
                 ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, None, "messages[0].tool_calls")]
        for body, raw, param in cases:
            status, answer = await _post(gw, s, body, raw=raw)
            assert status == 400, (param, answer)
            _openai_error(answer, param)
        status, answer = await _post(gw, s, None, raw=deep)  # a RecursionError in json.loads before
        assert status == 400 and "nested too deeply" in answer["error"]["message"]
        # the Anthropic route answers in Anthropic's shape
        status, answer = await _post(gw, s, None, path="messages", raw=b'{"max_tokens": 8, "messages": [{"role": '
                                                                        b'"user", "content": "a\\ud800"}]}')
        assert status == 400 and answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["message"].startswith("messages[0].content: not valid Unicode")
        status, answer = await _post(gw, s, None, path="messages", raw=deep)
        assert status == 400 and answer["type"] == "error"
        # the session is intact
        assert (await _client(gw, s).chat.completions.create(model="m", messages=HELLO)).choices[0].message.content \
            == "Fine."
        return gw.close_session(s.id)

    (t,) = run(_serve(gw, agent))
    assert t.num_turns == 1


def test_admin_routes_refuse_bad_bodies_and_non_finite_rewards(qwen3_tok):
    gw = _gateway(qwen3_tok, ["Fine."])
    gw.admin_key = "admin-key"

    async def admin(path, raw, key="admin-key"):
        head = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        async with aiohttp.ClientSession() as http, http.post(f"{gw.base_url}/admin/{path}", data=raw,
                                                             headers=head) as r:
            return r.status, await r.json()

    async def agent(gw):
        assert (await admin("sessions", b"{}", key="guess"))[0] == 401
        status, answer = await admin("sessions", b"{not json")
        assert status == 400 and "not valid JSON" in answer["error"]["message"]
        assert (await admin("sessions", b"[1, 2]"))[0] == 400
        status, opened = await admin("sessions", b'{"task": {"prompt": "hi"}}')
        assert status == 200
        sid = opened["session_id"]
        for raw in (b'{"reward": "high"}', b'{"reward": NaN}', b'{"reward": Infinity}', b'{"reward": true}',
                    b'{"reward": [1]}'):
            status, answer = await admin(f"sessions/{sid}/close", raw)
            assert status == 400 and answer["error"]["param"] == "reward", (raw, answer)
        assert sid in gw.sessions  # refused closes leave the session open
        status, closed = await admin(f"sessions/{sid}/close", b'{"reward": 0.5}')
        assert status == 200 and closed["trajectories"] == []
        status, answer = await admin(f"sessions/{sid}/close", b"{}")
        assert status == 404 and answer["error"]["type"] == "not_found_error"

    run(_serve(gw, agent))


# --- item 2: sampling parameters and seeds ---------------------------------------------------------------------------
def test_out_of_range_sampling_parameters_are_the_clients_400_not_the_engines_502(qwen3_tok):
    gw = _gateway(qwen3_tok, ["Fine."])

    async def agent(gw):
        s = gw.open_session("x")
        for key, value in [("temperature", -1), ("temperature", 2.5), ("top_p", 0), ("top_p", 5),
                           ("presence_penalty", 3), ("seed", 2**70), ("seed", -(2**63) - 1), ("seed", 1.5)]:
            status, answer = await _post(gw, s, {"messages": HELLO, key: value})
            assert status == 400, (key, value, answer)
            _openai_error(answer, key)
        status, answer = await _post(gw, s, None, raw=b'{"messages": [{"role": "user", "content": "x"}], '
                                                        b'"temperature": NaN}')
        assert status == 400 and answer["error"]["param"] == "temperature"
        for key, value in [("temperature", 1.5), ("top_p", 0), ("top_k", -1), ("top_k", 2.5)]:
            status, answer = await _post(gw, s, {"max_tokens": 8, "messages": HELLO, key: value}, path="messages")
            assert status == 400 and answer["error"]["message"].startswith(f"{key}:"), (key, answer)
        # in range, at the edges: answered
        ok = await _client(gw, s).chat.completions.create(model="m", messages=HELLO, temperature=0, top_p=1,
                                                          seed=2**63 - 1)
        assert ok.choices[0].message.content == "Fine."

    run(_serve(gw, agent))


class _Refusing:
    """An engine that refuses every request, the way a remote or local engine says the request was bad."""

    def __init__(self, error):
        self.error = error

    async def generate(self, ids, params):
        raise self.error


def test_an_engine_refusing_the_requests_parameters_is_a_400_and_an_engine_failure_a_502(qwen3_tok):
    cases = [(InvalidInput("sampling_params out of range: temperature=-1"), 400),
             (RemoteError("POST /generate answered 400: bad top_k", 400), 400),
             (RemoteError("POST /generate answered 503: overloaded", 503), 502),
             (RuntimeError("CUDA error"), 502)]
    for error, expected in cases:
        gw = Gateway(_Refusing(error), get_renderer(qwen3_tok, strict=True), "hermes", strict=True)

        async def agent(gw):
            s = gw.open_session("x")
            return await _post(gw, s, {"messages": HELLO})

        status, answer = run(_serve(gw, agent))
        assert status == expected, (error, answer)
        assert answer["error"]["type"] == ("invalid_request_error" if expected == 400 else "server_error")


def test_seeds_are_bounded_at_serve_engine_and_sglang_policy_and_a_requests_failure_keeps_the_engine_up():
    """serve-engine answers a seed beyond 64 bits with a 400 (it was torch's `Overflow when unpacking long long`,
    a 500 the client retried 3x), `SGLangPolicy` refuses it before sending, and an engine pool keeps an engine that
    answers one request with a 5xx but still passes its health check."""
    from slime_env.agents.engine_pool import EnginePool
    from slime_env.agents.engine_server import EngineServer
    from slime_env.clients.sglang import SGLangPolicy

    from slime_env import Generation

    class NoModel:  # the seed is checked before any generation
        async def generate(self, *a, **k):
            raise AssertionError("the engine was asked to generate")

    async def engine_answers():
        runner = aiohttp.web.AppRunner(EngineServer(NoModel(), "m").app(), access_log=None)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        out = []
        try:
            async with aiohttp.ClientSession() as http:
                for seed in (2**70, "7", True):
                    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "sampling_seed": seed}}
                    async with http.post(f"{url}/generate", json=body) as r:
                        out.append((r.status, (await r.json())["error"]["message"]))
            policy = SGLangPolicy(url, max_retries=3)
            with pytest.raises(InvalidInput, match="outside the 64-bit seed range"):
                await policy.generate([1, 2], {"sampling_seed": 2**70})
            assert policy.http.retries == 0
            await policy.close()
        finally:
            await runner.cleanup()
        return out

    for status, message in run(engine_answers()):
        assert status == 400 and "sampling_params.sampling_seed" in message

    class Engine:
        def __init__(self, url, answer, healthy=True):
            self.url, self.answer, self.healthy, self.calls = url, answer, healthy, 0

        async def generate(self, ids, params, **kw):
            self.calls += 1
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

        async def health(self):
            return self.healthy

    gen = Generation(token_ids=(1,), logprobs=(0.0,), finish_reason="stop")
    choke = RemoteError("POST /generate answered 500: Overflow when unpacking long long", 500)

    async def pool_cases():
        # both engines choke on this request but generate otherwise: the request fails, both stay up
        a, b = Engine("http://a", choke), Engine("http://b", choke)
        pool = EnginePool([a, b], wait_for_engine_s=1)
        with pytest.raises(RemoteError, match="Overflow"):
            await pool.generate([1], {})
        assert pool.up() == [a, b] and a.calls == b.calls == 1 and not pool.events
        # the client's 4xx and a refusal before sending never count either
        for error in (RemoteError("answered 400", 400), InvalidInput("seed")):
            c = Engine("http://c", error)
            pool = EnginePool([c], wait_for_engine_s=1)
            with pytest.raises(type(error)):
                await pool.generate([1], {})
            assert pool.up() == [c]
        # one engine chokes, another answers: it fails over without taking the first out
        a, b = Engine("http://a", choke), Engine("http://b", gen)
        pool = EnginePool([a, b], wait_for_engine_s=1)
        keys = [k for k in map(str, range(50)) if pool.engines[zlib.crc32(k.encode()) % 2] is a]
        assert (await pool.generate([1], {}, routing_key=keys[0])) == gen and pool.up() == [a, b]
        # an engine that answers 5xx and fails its health check is down, as before
        d, e = Engine("http://d", choke, healthy=False), Engine("http://e", gen)
        pool = EnginePool([d, e], wait_for_engine_s=1)
        keys = [k for k in map(str, range(50)) if pool.engines[zlib.crc32(k.encode()) % 2] is d]
        assert (await pool.generate([1], {}, routing_key=keys[0])) == gen and pool.up() == [e]

    run(pool_cases())


# --- item 3: tool schemas ----------------------------------------------------------------------------------------
def test_tool_schemas_are_checked_and_a_bad_one_names_the_tool_and_field(qwen3_tok):
    gw = _gateway(qwen3_tok, ["Fine."])

    def fn(parameters, name="add"):
        return [{"type": "function", "function": {"name": name, "description": "d", "parameters": parameters}}]

    async def agent(gw):
        s = gw.open_session("x")
        bad = [(fn("not a schema"), "tools[0].function.parameters"), (fn(5), "tools[0].function.parameters"),
               (fn({"type": "banana"}), "tools[0].function.parameters.type"),
               (fn({"type": "array", "items": {}}), "tools[0].function.parameters.type"),
               (fn({"type": "object", "properties": {"a": {"type": "int"}}}),
                "tools[0].function.parameters.properties.a.type"),
               (fn({"type": "object", "properties": {"a": 5}}), "tools[0].function.parameters.properties.a"),
               (fn({"type": "object", "required": "a"}), "tools[0].function.parameters.required"),
               (ADD + fn({"type": "object"}, name=""), "tools[1].function.name")]
        for tools, param in bad:
            status, answer = await _post(gw, s, {"messages": HELLO, "tools": tools})
            assert status == 400, (param, answer)
            _openai_error(answer, param)
        for schema, field in [("nope", "tools[0].input_schema"), ({"type": "banana"}, "tools[0].input_schema.type")]:
            status, answer = await _post(gw, s, {"max_tokens": 8, "messages": HELLO, "tools": [
                {"name": "add", "description": "d", "input_schema": schema}]}, path="messages")
            assert status == 400 and answer["error"]["message"].startswith(field), answer
        ok = await _client(gw, s).chat.completions.create(model="m", messages=HELLO, tools=ADD + fn({}, name="ping"))
        assert ok.choices[0].message.content == "Fine."

    run(_serve(gw, agent))


# --- item 4: branches rendered from scratch show the agent's tool calls ---------------------------------------------
@pytest.mark.parametrize("family", ["smollm2", "qwen3"])
def test_branches_rendered_from_scratch_show_the_agents_tool_calls(family, smollm2_tok, qwen3_tok):
    """SmolLM2's template ignores structured `tool_calls` (and has no tool section), Qwen3's renders them: either
    way, a branch rendered from scratch — an edited tool-call reply, a rewritten history that keeps an earlier call,
    a sub-agent with tool calls of its own — shows every call in the form the model generates (hermes), and its
    `messages` render to exactly its ids."""
    tok = smollm2_tok if family == "smollm2" else qwen3_tok
    end = tok.convert_tokens_to_ids("<|im_end|>")
    gw = Gateway(ScriptedPolicy(tok, [CALL, "It is 5.", "Ok.", "Sure.", "Yes."], end_token_id=end),
                 get_renderer(tok, strict=True), "hermes", strict=True)

    async def agent(gw):
        s = gw.open_session("q")
        client = _client(gw, s)
        base = [{"role": "user", "content": "What is 2 + 3?"}]
        r1 = (await client.chat.completions.create(model="m", messages=base, tools=ADD)).choices[0].message
        echo = r1.model_dump(exclude_none=True)
        tool = {"role": "tool", "tool_call_id": r1.tool_calls[0].id, "content": "5"}
        await client.chat.completions.create(model="m", messages=base + [echo, tool], tools=ADD)  # continues
        edited = dict(echo, content="I will add carefully.")  # the agent edits our tool-call reply
        await client.chat.completions.create(model="m", messages=base + [edited, tool], tools=ADD)
        rewritten = [{"role": "user", "content": "Add 2 and 3."}, echo, tool]  # history rewritten, the call kept
        await client.chat.completions.create(model="m", messages=rewritten, tools=ADD)
        own = {"role": "assistant", "content": "", "tool_calls": [  # an agent-written call (a sub-agent's)
            {"id": "x1", "type": "function", "function": {"name": "add", "arguments": '{"a": 7, "b": 8}'}}]}
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "7+8?"}, own,
                                                                  {"role": "tool", "tool_call_id": "x1",
                                                                   "content": "15"}], tools=ADD)
        return gw.close_session(s.id)

    trajs = run(_serve(gw, agent))
    assert [t.num_turns for t in trajs] == [2, 1, 1, 1]
    r = gw.renderer
    for t in trajs:
        t.check()
        ids = t.prompt_ids + t.response_ids
        cut = len(t.prompt_ids) + t.spans[-1].start
        tools = ADD if r.renders_tools else None
        assert r.encode(r.render_text(t.messages[:-1], tools=tools, add_generation_prompt=True)) == ids[:cut]
        calls = [m for m in t.messages[:-1] if m.role == "assistant"]
        assert calls and all("<tool_call>" in m.content and '"name": "add"' in m.content for m in calls), t.messages
    prompt = [r.decode(t.prompt_ids) for t in trajs[1:]]
    assert "I will add carefully.\n<tool_call>\n" in prompt[0] and '"arguments": {"a": 2, "b": 3}' in prompt[0]
    assert CALL in prompt[1]  # our own reply, as the model generated it
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 8}}\n</tool_call>' in prompt[2]
    # the edited text is prompt (loss mask 0); only the branch's own generation is trained on
    assert r.decode([i for i, m in zip(trajs[1].response_ids, trajs[1].loss_mask) if m]).startswith("Ok.")


def test_tool_calls_without_a_text_form_on_a_template_that_ignores_them_are_refused(smollm2_tok):
    end = smollm2_tok.convert_tokens_to_ids("<|im_end|>")
    gw = Gateway(ScriptedPolicy(smollm2_tok, ["Fine."], end_token_id=end), get_renderer(smollm2_tok, strict=True),
                 "mistral", strict=True)
    own = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "x1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}

    async def agent(gw):
        s = gw.open_session("x")
        return await _post(gw, s, {"messages": [*HELLO, own, {"role": "tool", "tool_call_id": "x1", "content": "1"}]})

    status, answer = run(_serve(gw, agent))
    assert status == 400 and "does not render tool calls" in _openai_error(answer, "messages[1].tool_calls")


def test_call_text_is_what_each_parser_reads_back():
    from slime_env.parsers import get_parser
    from slime_env.parsers.prompts import CALL_TEXTS, call_text

    calls = [{"name": "add", "arguments": {"a": 2, "b": "x y", "c": [1, {"d": None}]}},
             {"name": "ping", "arguments": {}}]
    for parser in CALL_TEXTS:
        got = get_parser(parser)(call_text(parser, "Let me see.", calls))
        assert [(c.name, c.arguments) for c in got.tool_calls] == [(c["name"], c["arguments"]) for c in calls], parser
        assert not got.errors
    assert call_text("mistral", "", calls) is None and call_text(None, "", calls) is None


# --- item 5: abandoned attempts -------------------------------------------------------------------------------------
class _SlowAt(ScriptedPolicy):
    """A scripted engine that takes `delay_s` on the calls numbered in `slow` (0-based), so a client times out."""

    def __init__(self, tok, replies, slow, delay_s, **kw):
        super().__init__(tok, replies, **kw)
        self.slow, self.delay_s, self.started, self.cancelled = set(slow), delay_s, 0, 0

    async def generate(self, ids, params):
        n, self.started = self.started, self.started + 1
        if n in self.slow:
            try:
                await asyncio.sleep(self.delay_s)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return await super().generate(ids, params)


def test_a_call_whose_client_timed_out_and_retried_is_not_recorded(qwen3_tok):
    """The OpenAI SDK's timeout + retry, on a first call and on a continuation: the attempts the client gave up on
    are cancelled at the engine and not recorded (they were branches trained with the episode's reward); the retries
    make one branch of two turns."""
    policy = _SlowAt(qwen3_tok, [CALL, "It is 5."], slow=[0, 2], delay_s=6.0,
                     end_token_id=qwen3_tok.convert_tokens_to_ids("<|im_end|>"))
    gw = Gateway(policy, get_renderer(qwen3_tok, strict=True), "hermes", strict=True)

    async def agent(gw):
        s = gw.open_session("q")
        client = openai.AsyncOpenAI(base_url=gw.session_url(s), api_key=s.key, timeout=2.0, max_retries=1)
        msgs = [{"role": "user", "content": "What is 2 + 3?"}]
        r1 = (await client.chat.completions.create(model="m", messages=msgs, tools=ADD)).choices[0].message
        msgs += [r1.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": r1.tool_calls[0].id,
                                                    "content": "5"}]
        r2 = (await client.chat.completions.create(model="m", messages=msgs, tools=ADD)).choices[0].message
        assert r2.content == "It is 5."
        await asyncio.sleep(0.2)
        return gw.close_session(s.id)

    (t,) = run(_serve(gw, agent))
    assert (t.num_turns, t.metadata["branch_reason"], t.metadata["abandoned_calls"]) == (2, "first call", 2)
    assert policy.started == 4 and policy.cancelled == 2
    t.check()


def test_concurrent_first_calls_are_a_first_call_and_a_fork_of_it(qwen3_tok):
    policy = _SlowAt(qwen3_tok, ["One.", "Two."], slow=[0, 1], delay_s=0.3,
                     end_token_id=qwen3_tok.convert_tokens_to_ids("<|im_end|>"))
    gw = Gateway(policy, get_renderer(qwen3_tok, strict=True), "hermes", strict=True)

    async def agent(gw):
        s = gw.open_session("q")
        client = _client(gw, s)
        await asyncio.gather(*(client.chat.completions.create(model="m", messages=HELLO) for _ in range(2)))
        return gw.close_session(s.id)

    trajs = run(_serve(gw, agent))
    meta = sorted((t.metadata["branch_reason"], t.metadata["parent_branch"], t.metadata["branch"]) for t in trajs)
    first = next(m for m in meta if m[0] == "first call")
    fork = next(m for m in meta if m[0] != "first call")
    assert first[1] is None and fork == (f"forked: branch {first[2]} was answering another call", first[2], fork[2])


# --- item 6: expiry ---------------------------------------------------------------------------------------------------
def test_expiry_never_drops_recorded_calls_and_a_long_call_refreshes_the_ttl(qwen3_tok, caplog):
    policy = _SlowAt(qwen3_tok, ["Hi."], slow=[2], delay_s=2.0,
                     end_token_id=qwen3_tok.convert_tokens_to_ids("<|im_end|>"))
    gw = Gateway(policy, get_renderer(qwen3_tok, strict=True), "hermes", strict=True, session_ttl_s=600)

    async def agent(gw):
        a, b, idle = gw.open_session("a"), gw.open_session("b"), gw.open_session("idle")
        for s in (a, b):
            await _client(gw, s).chat.completions.create(model="m", messages=HELLO)
        for s in (a, b, idle):
            s.expires_at = time.monotonic() - 1.0  # idle past their TTL
        with caplog.at_level(logging.WARNING, logger="slime_env.gateway"):
            gw.open_session("c")  # it used to purge a and b, recorded calls and all
        assert a.id in gw.sessions and b.id in gw.sessions and idle.id not in gw.sessions
        assert sum("expired" in r.message and "1 recorded calls" in r.message for r in caplog.records) == 2
        with pytest.raises(openai.AuthenticationError):  # an expired session takes no calls
            await _client(gw, a).chat.completions.create(model="m", messages=HELLO)
        (ta,) = gw.close_session(a.id, reward=1.0)  # it answered 404 (KeyError in process) before
        collected = gw.collect_expired()
        assert list(collected) == [b.id] and b.id not in gw.sessions
        (tb,) = collected[b.id]
        assert (ta.status, ta.num_turns, ta.reward, tb.status, tb.num_turns) == ("completed", 1, 1.0, "truncated", 1)
        assert "expired" in tb.reason
        # a call longer than the TTL (2s > 1s) leaves the session alive: the TTL counts from its end too
        gw.session_ttl_s = 1.0
        d = gw.open_session("d")
        client = _client(gw, d)
        r = await client.chat.completions.create(model="m", messages=HELLO)
        await client.chat.completions.create(model="m", messages=HELLO + [
            r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}])
        return gw.close_session(d.id)

    (t,) = run(_serve(gw, agent))
    assert t.num_turns == 2


# --- item 7: unsupported fields, stop sequences, 413 -----------------------------------------------------------------
def test_fields_that_would_change_the_sample_are_refused_and_harmless_ones_accepted(qwen3_tok):
    gw = _gateway(qwen3_tok, ["Fine."])

    async def agent(gw):
        s = gw.open_session("x")
        for key, value in [("response_format", {"type": "json_object"}), ("logit_bias", {"15": 5}),
                           ("parallel_tool_calls", False), ("reasoning_effort", "high"), ("audio", {"voice": "x"})]:
            status, answer = await _post(gw, s, {"messages": HELLO, key: value})
            assert status == 400, (key, answer)
            _openai_error(answer, key)
        status, answer = await _post(gw, s, {"max_tokens": 8, "messages": HELLO,
                                             "thinking": {"type": "enabled", "budget_tokens": 1024}}, path="messages")
        assert status == 400 and answer["error"]["message"].startswith("thinking:")
        ok = await _client(gw, s).chat.completions.create(
            model="m", messages=HELLO, response_format={"type": "text"}, logit_bias={}, user="u", metadata={"k": "v"},
            store=False, parallel_tool_calls=True)
        assert ok.choices[0].message.content == "Fine."

    run(_serve(gw, agent))


def test_stop_sequences_are_cut_from_the_content_and_reported_as_each_api_does(qwen3_tok):
    """OpenAI cuts the stop string from the content (finish `stop`); Anthropic reports `stop_reason:
    "stop_sequence"` and the sequence; the ledger keeps what was generated, and the echoed reply continues it."""
    anthropic = pytest.importorskip("anthropic")
    gw = _gateway(qwen3_tok, ["The answer is 5. END and more", "Done.", "It is 5. STOP here", "Ok."])

    async def agent(gw):
        s = gw.open_session("x")
        client = _client(gw, s)
        r = await client.chat.completions.create(model="m", messages=HELLO, stop=["END", "NEVER"])
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("The answer is 5. ", "stop")
        msgs = HELLO + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        await client.chat.completions.create(model="m", messages=msgs)
        ac = anthropic.AsyncAnthropic(base_url=gw.session_url(s, api="anthropic"), api_key=s.key, max_retries=0)
        m = await ac.messages.create(model="m", max_tokens=32, messages=[{"role": "user", "content": "q"}],
                                     stop_sequences=["STOP"])
        assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "STOP", "It is 5. ")
        async with ac.messages.stream(model="m", max_tokens=32, messages=[{"role": "user", "content": "q2"}],
                                      stop_sequences=["Ok."]) as stream:
            final = await stream.get_final_message()
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "Ok.")
        return gw.close_session(s.id)

    trajs = run(_serve(gw, agent))
    assert trajs[0].num_turns == 2
    text = gw.renderer.decode(trajs[0].response_ids)
    assert text.startswith("The answer is 5. END") and "more<|im_end|>" in text


def test_an_oversized_body_gets_a_413_in_the_apis_error_shape_and_serve_gateway_sets_the_bound(qwen3_tok):
    import inspect

    from slime_env.agents.cli import serve_gateway

    gw = _gateway(qwen3_tok, ["Hi."], max_body_bytes=20_000)

    async def agent(gw):
        s = gw.open_session("x")
        big = [{"role": "user", "content": "x" * 30_000}]
        status, answer = await _post(gw, s, {"messages": big})
        assert status == 413 and answer["error"]["code"] == "request_too_large" and "20000" in \
            answer["error"]["message"]
        status, answer = await _post(gw, s, {"max_tokens": 8, "messages": big}, path="messages")
        assert status == 413 and answer["error"]["type"] == "request_too_large"

    run(_serve(gw, agent))
    assert inspect.signature(serve_gateway).parameters["max_body_bytes"].default.default == 4 << 20


def test_strict_mode_refuses_a_prompt_that_dropped_a_tool_call_of_the_history(smollm2_tok):
    from slime_env.errors import RenderMismatch
    from slime_env.gateway import Conversation
    from slime_env.types import Message

    r = get_renderer(smollm2_tok, strict=True)
    conv = Conversation(r, None, strict=True, parser_name="hermes")
    messages = [{"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "name": "add", "arguments": {}}]},
                {"role": "tool", "tool_call_id": "c", "content": "5"}]
    shown = [Message("user", "2+3?"), Message("assistant", '<tool_call>\n{"name": "add", "arguments": {}}\n'
                                                           "</tool_call>"), Message("tool", "5", name="add")]
    dropped = [shown[0], Message("assistant", ""), shown[2]]
    conv._check_calls_shown(messages, shown, None, r.render_text(shown))
    with pytest.raises(RenderMismatch, match=r"dropped tool call 'add' of messages\[1\]"):
        conv._check_calls_shown(messages, dropped, None, r.render_text(dropped))


def test_a_prompt_past_the_engines_context_is_a_400_naming_the_limit_and_the_session_lives_on(qwen3_tok, smollm2_tok):
    """A gateway in front of a policy that knows its model's context (the embedded engine: the config's
    max_position_embeddings) refuses a prompt that leaves no room in it — before, 3,000 empty messages (15,025 tokens
    against SmolLM2's 8,192) held the engine for two minutes while every other session waited."""
    from helpers import tiny

    from slime_env.agents import TransformersPolicy

    engine = TransformersPolicy(tiny("llama"), smollm2_tok, batching="static")
    try:
        assert engine.context_length == 128  # the tiny model's max_position_embeddings
    finally:
        engine.close()
    policy = ScriptedPolicy(qwen3_tok, ["Fine."], end_token_id=qwen3_tok.convert_tokens_to_ids("<|im_end|>"))
    policy.context_length = 256
    gw = Gateway(policy, get_renderer(qwen3_tok, strict=True), "hermes", strict=True)
    flood = [{"role": "user", "content": ""} for _ in range(300)]

    async def agent(gw):
        s = gw.open_session("x")
        status, answer = await _post(gw, s, {"messages": flood})
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert "context of 256 tokens" in _openai_error(answer, "messages")
        reply = await _client(gw, s).chat.completions.create(model="m", messages=HELLO)
        assert reply.choices[0].message.content == "Fine."
        return gw.close_session(s.id)

    (t,) = run(_serve(gw, agent))
    assert t.num_turns == 1  # the refused call recorded nothing
