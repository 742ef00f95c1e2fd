"""The OpenAI Responses API on the gateway (`/sessions/{id}/v1/responses`, what Codex CLI and `client.responses.create`
speak), driven by the official `openai` SDK: function calls round-tripped through `function_call_output` items and
`previous_response_id` on one exact ledger, the SDK's own stream parsing, reasoning items that a stateless client
echoes back onto the same branch, refusals in OpenAI's error body, and SmolLM2 itself behind it.

Tool calls come from `ScriptedPolicy` on the real tokenizers and chat templates (SmolLM2's, which has no tool section,
so the gateway writes the tools into the system message; Qwen3's for `<think>` reasoning): no small model emits a
given call on cue. `test_smollm2_*` runs the embedded model."""

from __future__ import annotations

import asyncio
import json

import pytest

openai = pytest.importorskip("openai")

from slime_env.gateway import Gateway  # noqa: E402
from slime_env.policy import ScriptedPolicy  # noqa: E402
from slime_env.renderers import get_renderer  # noqa: E402

ADD = [{"type": "function", "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}]
CALL = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
THINK = "<think>\nThe user wants a sum; the add tool does it.\n</think>\n\n"
MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done", "response.output_item.done"]


def _gateway(tok, replies, **kw) -> Gateway:
    policy = ScriptedPolicy(tok, replies, end_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    return Gateway(policy, get_renderer(tok, strict=True), "hermes", strict=True, **kw)


async def _serve(gw: Gateway, agent):
    await gw.start()
    try:
        return await agent(gw)
    finally:
        await gw.stop()


def _client(gw, s):
    return openai.AsyncOpenAI(base_url=gw.session_url(s), api_key=s.key, max_retries=0)


def _echo(output) -> list[dict]:
    """Output items as a stateless client sends them back (Codex: no ids, no status, reasoning without its text)."""
    items = []
    for o in output:
        d = o.model_dump(exclude_none=True)
        d.pop("id", None), d.pop("status", None)
        if d["type"] == "reasoning":
            d.pop("content", None)
        items.append(d)
    return items


def _check_ledger(t, renderer, usages) -> None:
    """The branch's ledger is the gateway's record, strictly: up to its last reply it is, token for token, the chat
    template's full render of the conversation (the tools in the system message, as rendered); each call's prompt and
    completion tokens are those its response reported; exactly the generated ids carry loss mask 1."""
    t.check()
    ids = t.prompt_ids + t.response_ids
    cut = len(t.prompt_ids) + t.spans[-1].start
    assert renderer.encode(renderer.render_text(t.messages[:-1], add_generation_prompt=True)) == ids[:cut]
    assert renderer.assistant_text(ids[cut:]) == t.messages[-1].content
    assert [(c["prompt_tokens"], c["completion_tokens"]) for c in t.metadata["calls"]] == \
        [(u.input_tokens, u.output_tokens) for u in usages]
    generated = [s for s in t.spans if s.kind == "generated"]
    assert sum(t.loss_mask) == sum(s.end - s.start for s in generated) == sum(u.output_tokens for u in usages)


def test_responses_sdk_function_call_round_trip_streams_and_continues_one_exact_ledger(smollm2_tok):
    """`responses.create` with instructions and a function tool gets a message and a `function_call` item; the agent
    sends the items back with a `function_call_output` (streamed: the SDK parses the real event sequence), then
    continues by `previous_response_id`. One branch, three turns, strict checks pass, the ledger is the record."""
    gw = _gateway(smollm2_tok, [CALL, "The sum is 5.", "You are welcome."])

    async def agent(gw):
        s = gw.open_session({"prompt": "What is 2 + 3?", "label": 5})
        client = _client(gw, s)
        first = await client.responses.create(model="m", instructions="Use tools.", input="What is 2 + 3?", tools=ADD)
        assert (first.status, [o.type for o in first.output]) == ("completed", ["message", "function_call"])
        assert first.output_text == "Let me add."
        call = first.output[1]
        assert (call.name, json.loads(call.arguments)) == ("add", {"a": 2, "b": 3}) and call.call_id.startswith("call_")
        items = [{"role": "user", "content": [{"type": "input_text", "text": "What is 2 + 3?"}]},
                 *_echo(first.output), {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
        kinds, text, second = [], "", None
        async for event in await client.responses.create(model="m", instructions="Use tools.", input=items,
                                                         tools=ADD, stream=True):
            kinds.append(event.type)
            text += event.delta if event.type == "response.output_text.delta" else ""
            second = event.response if event.type == "response.completed" else second
        deltas = kinds.count("response.output_text.delta")
        assert deltas > 1 and kinds == ["response.created", "response.in_progress", *MESSAGE_EVENTS[:2],
                                        *["response.output_text.delta"] * deltas, *MESSAGE_EVENTS[3:],
                                        "response.completed"]
        assert text == second.output_text == "The sum is 5." and second.usage.output_tokens > 0
        third = await client.responses.create(model="m", instructions="Use tools.", previous_response_id=second.id,
                                              input="Thanks!", tools=ADD)
        assert third.output_text == "You are welcome." and third.previous_response_id == second.id
        return gw.close_session(s.id, reward=1.0), [first.usage, second.usage, third.usage]

    (t,), usages = asyncio.run(_serve(gw, agent))
    assert (t.status, t.num_turns, t.reward, t.metadata["branch_reason"]) == ("completed", 3, 1.0, "first call")
    _check_ledger(t, gw.renderer, usages)
    rendered = gw.renderer.decode(t.prompt_ids + t.response_ids)
    assert "Use tools." in rendered and '"name": "add"' in rendered  # instructions, tools in the system message
    assert "<|im_start|>tool\n5<|im_end|>" in rendered and "<|im_start|>user\nThanks!" in rendered


def test_reasoning_items_stream_and_a_stateless_echo_continues_the_branch(qwen3_tok):
    """A Qwen3 reply that thinks first gives a `reasoning` item (its text; `encrypted_content` carries the reply as
    recorded), a message and a function call, streamed through the SDK's accumulating `responses.stream`; the agent
    sends what Codex CLI sends (developer input messages, `store: false`, `client_metadata`, ...) and echoes the items
    back without ids or reasoning text, as Codex does, and continues the same branch."""
    gw = _gateway(qwen3_tok, [THINK + CALL, "The sum is 5."])

    async def agent(gw):
        s = gw.open_session("x")
        client = _client(gw, s)
        codex = dict(tools=ADD, store=False, include=["reasoning.encrypted_content"], reasoning={"summary": "auto"},
                     parallel_tool_calls=True, prompt_cache_key="thread-1", extra_body={"client_metadata": {"a": "b"}})
        opening = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
                   {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2 + 3?"}]}]
        async with client.responses.stream(model="m", input=opening, **codex) as stream:
            kinds = [event.type async for event in stream]
            first = await stream.get_final_response()
        assert [o.type for o in first.output] == ["reasoning", "message", "function_call"]
        assert first.output[0].content[0].text == "The user wants a sum; the add tool does it."
        assert first.output_text == "Let me add." and first.output[0].encrypted_content
        assert {"response.reasoning_text.delta", "response.reasoning_text.done",
                "response.function_call_arguments.delta", "response.function_call_arguments.done"} <= set(kinds)
        items = [*opening, *_echo(first.output),
                 {"type": "function_call_output", "call_id": first.output[2].call_id, "output": "5"}]
        second = await client.responses.create(model="m", input=items, **codex)
        assert second.output_text == "The sum is 5."
        with pytest.raises(openai.BadRequestError, match="not found"):  # store: false keeps no record
            await client.responses.create(model="m", input="Again?", previous_response_id=second.id)
        return gw.close_session(s.id), [first.usage, second.usage]

    (t,), usages = asyncio.run(_serve(gw, agent))
    assert t.num_turns == 2 and t.metadata["branch_reason"] == "first call"
    t.check()
    assert THINK.strip() in gw.renderer.decode(t.response_ids)
    assert [(c["prompt_tokens"], c["completion_tokens"]) for c in t.metadata["calls"]] == \
        [(u.input_tokens, u.output_tokens) for u in usages]


def test_built_in_tools_unknown_fields_and_unhonourable_options_get_openai_errors(smollm2_tok):
    """Built-in tools (web_search, file_search, computer use), unknown fields, forced tool choice, a reasoning effort,
    an unknown `previous_response_id`: a 400 in OpenAI's error body naming the field; nothing is recorded."""
    gw = _gateway(smollm2_tok, ["unused"])
    refused = [({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_value"),
               ({"tools": [*ADD, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[1].type",
                "unsupported_value"),
               ({"tools": [{"type": "computer_use_preview", "display_width": 1024, "display_height": 768,
                            "environment": "linux"}]}, "tools[0].type", "unsupported_value"),
               ({"extra_body": {"frobnicate": True}}, "frobnicate", "unknown_parameter"),
               ({"tools": ADD, "tool_choice": "required"}, "tool_choice", None),
               ({"reasoning": {"effort": "high"}}, "reasoning.effort", None),
               ({"previous_response_id": "resp_nope"}, "previous_response_id", "previous_response_not_found"),
               ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", None)]

    async def agent(gw):
        s = gw.open_session("x")
        client = _client(gw, s)
        for kw, param, code in refused:
            kw = {"input": "Hi", **kw}
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model="m", **kw)
            error = e.value.body
            assert e.value.status_code == 400 and (error["param"], error["code"]) == (param, code), kw
            assert error["type"] == "invalid_request_error" and error["message"]
        return s

    s = asyncio.run(_serve(gw, agent))
    assert s.calls == 0 and not s.conversation.branches and gw.policy.calls == 0


@pytest.fixture(scope="module")
def smollm2_gateway():
    from slime_env.agents import TransformersPolicy, load_default_model

    model, tok = load_default_model()
    policy = TransformersPolicy(model, tok, max_batch_size=2)
    yield Gateway(policy, get_renderer(tok, strict=True), strict=True, max_new_tokens=8)
    policy.close()


def test_smollm2_answers_plain_and_streamed_responses_on_one_exact_ledger(smollm2_gateway):
    """The embedded SmolLM2-135M-Instruct behind the Responses route in strict mode: a plain call, then a streamed one
    continuing by `previous_response_id`; the streamed deltas spell the completed text, and the branch's ledger is the
    template's render of the conversation with the engine's own log-probs."""
    gw = smollm2_gateway

    async def agent(gw):
        s = gw.open_session("chat")
        client = _client(gw, s)
        first = await client.responses.create(model="m", instructions="Be brief.", input="Name a colour.",
                                              temperature=0.7, max_output_tokens=8)
        assert first.status in ("completed", "incomplete") and first.output[0].type == "message"
        text, final = "", None
        async for event in await client.responses.create(model="m", instructions="Be brief.", input="Another one?",
                                                         previous_response_id=first.id, temperature=0.7,
                                                         max_output_tokens=8, stream=True):
            text += event.delta if event.type == "response.output_text.delta" else ""
            final = event.response if event.type in ("response.completed", "response.incomplete") else final
        assert text == final.output_text
        return gw.close_session(s.id), [first.usage, final.usage]

    (t,), usages = asyncio.run(_serve(gw, agent))
    assert t.num_turns == 2 and t.metadata["branch_reason"] == "first call"
    assert [m.role for m in t.messages] == ["system", "user", "assistant", "user", "assistant"]
    t.check()
    lps = [lp for lp, m in zip(t.rollout_logprobs, t.loss_mask) if m]
    assert all(lp <= 0.0 for lp in lps) and any(lp < 0.0 for lp in lps)
    # the model may sample a non-canonical split of its own text, so the ledger is compared as text (as in
    # test_gateway's SmolLM2 test); the calls' token counts are the responses' usage
    r, ids = gw.renderer, t.prompt_ids + t.response_ids
    cut = len(t.prompt_ids) + t.spans[-1].start
    assert r.decode(ids[:cut]) == r.render_text(t.messages[:-1], add_generation_prompt=True)
    assert r.assistant_text(ids[cut:]) == t.messages[-1].content
    assert [(c["prompt_tokens"], c["completion_tokens"]) for c in t.metadata["calls"]] == \
        [(u.input_tokens, u.output_tokens) for u in usages]
