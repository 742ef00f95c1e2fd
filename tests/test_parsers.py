"""Tool-call parsers: formats they accept, errors they report, and that none ever raises."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_env import ParseResult, get_parser, parser_names, register_parser
from slime_env.errors import InvalidInput


def test_hermes_several_calls_and_errors():
    text = ('think\n<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>\n'
            '<tool_call>{"name": "calc", "arguments": "{\\"e\\": \\"1+1\\"}"}</tool_call>'
            '<tool_call>{"name": "bad", "arguments": {</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call><tool_call>[1]</tool_call>'
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call><tool_call>{"name": "cut"')
    r = get_parser("hermes")(text)
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("search", {"q": "x"}), ("calc", {"e": "1+1"})]
    assert r.tool_calls[0].raw.startswith("<tool_call>") and r.tool_calls[0].raw.endswith("</tool_call>")
    messages = [e.message for e in r.errors]
    assert len(messages) == 5
    assert "not valid JSON" in messages[0] and "no string 'name'" in messages[1]
    assert "must be a JSON object" in messages[2] and "must be an object" in messages[3]
    assert "not closed" in messages[4] and r.errors[4].raw.startswith("<tool_call>")


def test_qwen3_coder():
    text = ("<tool_call>\n<function=run>\n<parameter=code>\nprint(1)\n</parameter>\n"
            "<parameter=n>\n3\n</parameter>\n<parameter=flag>\ntrue\n</parameter>\n</function>\n</tool_call>"
            "<tool_call><function=x>junk</function></tool_call><tool_call>no function</tool_call>")
    r = get_parser("qwen3_coder")(text)
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("run", {"code": "print(1)", "n": 3, "flag": True})]
    assert len(r.errors) == 2 and "unexpected text" in r.errors[0].message
    assert "no complete <function" in r.errors[1].message


def test_search_r1_first_match_wins():
    p = get_parser("search_r1")
    r = p("<think>hmm</think><search> capital of France </search> then <answer>Paris</answer>")
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("search", {"query": "capital of France"})]
    r = p("<answer>Paris</answer><search>x</search>")
    assert r.tool_calls[0].arguments == {"answer": "Paris"}
    r = p("I don't know <search>unclosed")
    assert r.tool_calls == () and "no <search>" in r.errors[0].message


def test_python_block():
    r = get_parser("python_block")("a\n```python\nprint(1)\n```\nb\n```py\nx=2\n```\n```python\nopen")
    assert [c.arguments["code"] for c in r.tool_calls] == ["print(1)\n", "x=2\n"]
    assert len(r.errors) == 1 and "not closed" in r.errors[0].message


def test_registry_and_import_paths():
    assert {"hermes", "qwen3_coder", "search_r1", "python_block"} <= set(parser_names())
    assert get_parser(None) is None
    assert get_parser("slime_env.parsers.hermes:parse")("<tool_call>{\"name\": \"a\"}</tool_call>").tool_calls
    with pytest.raises(InvalidInput, match="unknown parser"):
        get_parser("nope")
    with pytest.raises(InvalidInput, match="already registered"):
        register_parser("hermes", lambda t: ParseResult())


def test_user_parser_bugs_become_parse_errors():
    def broken(text):
        raise KeyError("oops")

    r = get_parser(broken)("anything")
    assert r.tool_calls == () and "raised KeyError" in r.errors[0].message
    r = get_parser(lambda t: "not a result")("x")
    assert "not ParseResult" in r.errors[0].message


_MARKUP = st.sampled_from(["<tool_call>", "</tool_call>", "<function=", "<parameter=", "</parameter>",
                           "</function>", "<search>", "</search>", "<answer>", "</answer>", "```python\n",
                           "```", "{", "}", '"name"', ":", '"arguments"', "[", "]", "\n", ">", "\\", "\x00"])
_ANY = st.lists(st.one_of(_MARKUP, st.text(max_size=8)), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_ANY)
def test_no_parser_raises_on_any_text(text):
    for name in ("hermes", "qwen3_coder", "search_r1", "python_block"):
        result = get_parser(name)(text)
        assert isinstance(result, ParseResult)
        for call in result.tool_calls:
            assert isinstance(call.name, str) and isinstance(call.arguments, dict) and call.raw in text
