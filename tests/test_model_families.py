"""The newer model families: Qwen3.5, Qwen3.6, DeepSeek-V3.1, gpt-oss (real tokenizers), GLM-4.5/4.6 and MiniMax-M2
(text only: their vocabularies are not on PyPI, so a stand-in tokenizer — Qwen3.5's vocabulary plus the family's
control tokens as added tokens — carries the ids, and what is compared is what the template writes).

Each family's shipped template (`slime_env/chat_templates/README.md` gives the sources) on one conversation with a
system prompt, reasoning, tool calls with every JSON type in the arguments, parallel calls (gpt-oss: one call per
message, as its template allows), consecutive tool messages and a follow-up user turn: the SFT trajectory, the
rollout bridges against the template on the real history, the family's parser on what the template writes, and the
same ids as the independent renderer libraries `renderers` (verifiers) and `tml-renderers` (Thinking Machines) where
they cover the family. docs/ledger.md has the table and says who is right where they disagree.
"""

from __future__ import annotations

import copy
import json
import os
import re
from importlib.util import find_spec

import pytest

from slime_env import Message, get_renderer
from slime_env import offline_tokenizers as ot
from slime_env.conversations import Conversation, conversation_trajectory
from slime_env.errors import InvalidInput, RenderError
from slime_env.parsers import get_parser
from slime_env.renderers import detect_family

DATE = "2026-01-01"
ARGS = {"s": "Paris", "i": 3, "f": -1.5, "b": True, "n": None, "l": [1, "x"], "o": {"k": False}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"s": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
CALLS = [{"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
         {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": -5}}}]


def conversation(family: str) -> dict:
    """The test conversation in the shape `family`'s template takes."""
    reasoning = {"gpt_oss": "thinking"}.get(family, "reasoning_content")
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris, and 2 + -5?"},
            {"role": "assistant", "content": "", reasoning: "Two tools.", "tool_calls": copy.deepcopy(CALLS)},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c1", "content": "-3"},
            {"role": "assistant", "content": "Sunny; -3.", reasoning: "Both back."},
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "You're welcome.", reasoning: "Polite."}]
    if family == "gpt_oss":  # "We assume max 1 tool call per message" (its template): parallel calls are two turns
        first, second = (dict(msgs[2], tool_calls=CALLS[:1]),
                         {"role": "assistant", "content": "", "tool_calls": CALLS[1:]})
        msgs = msgs[:2] + [first, msgs[3], second, msgs[4]] + msgs[5:]
    if family == "deepseek_v31":  # its template concatenates the arguments: a JSON string
        for m in msgs:
            for c in m.get("tool_calls", ()):
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
    return {"messages": msgs, "tools": TOOLS}


def _stand_in(template: str, controls: list[str]):
    tok = ot.qwen("3.5")
    tok.add_special_tokens({"additional_special_tokens": controls})
    tok.chat_template = ot.chat_template(template)
    return tok


BUILDERS = {
    "qwen3_5": lambda: ot.qwen("3.5"), "qwen3_6": lambda: ot.qwen("3.6"), "deepseek_v31": ot.deepseek_v31,
    "gpt_oss": ot.gpt_oss,
    "glm45": lambda: _stand_in("glm4_6", ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                                          "<|observation|>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]),
    "minimax_m2": lambda: _stand_in("minimax_m2", ["]~!b[", "]~b]", "[e~[", "<minimax:tool_call>",
                                                   "</minimax:tool_call>"]),
}
FAMILIES = list(BUILDERS)
PARSER = {"qwen3_5": "qwen3_5", "qwen3_6": "qwen3_coder", "deepseek_v31": "deepseek_v31", "gpt_oss": "gpt_oss",
          "glm45": "glm45", "minimax_m2": "minimax_m2"}
_toks: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _tokenizers_go_with_the_module():
    """The families' tokenizers are built once for this module and let go after it: a module global outlives its
    module in a test worker, and these eight held 0.8 GB for the rest of the suite."""
    yield
    _toks.clear()


def tok(family):
    if family not in _toks:
        _toks[family] = BUILDERS[family]()
    return _toks[family]


def renderer(family, **kw):
    if family == "gpt_oss":
        kw.setdefault("template_kwargs", {"strftime_now": lambda fmt: DATE})
    return get_renderer(tok(family), **kw)


def test_each_template_is_detected_as_its_family():
    for family, template in [("qwen3_5", "qwen3_5"), ("qwen3_6", "qwen3_6"), ("deepseek_v31", "deepseek_v3_1"),
                             ("gpt_oss", "gpt_oss"), ("glm45", "glm4_6"), ("minimax_m2", "minimax_m2"),
                             ("deepseek_r1", "deepseek_r1"), ("qwen3", "qwen3")]:
        assert detect_family(ot.chat_template(template)) == family, template


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_template_renders_like_transformers(family):
    t = tok(family)
    r = get_renderer(t)  # gpt-oss: today's date on both sides (transformers does not pass a function through)
    msgs = list(Conversation.coerce(conversation(family)).messages)
    if family == "deepseek_v31":
        msgs = [dict(m, tool_calls=[dict(c, function={"name": c["function"]["name"],
                                                      "arguments": c["function"]["raw"]}) for c in m["tool_calls"]])
                if m.get("tool_calls") else m for m in msgs]
    kw = {}
    for k in (2, 5, len(msgs)):
        ours = r.render_text(msgs[:k], tools=TOOLS, add_generation_prompt=k < len(msgs))
        assert ours == t.apply_chat_template(msgs[:k], tools=TOOLS, add_generation_prompt=k < len(msgs),
                                             tokenize=False, **kw)


# What each template writes for the arguments: Qwen3.5 Python's str of a bool or None, the others JSON.
WRITTEN = {"qwen3_5": ["\nTrue\n", "\nNone\n", "\n-1.5\n", '\n[1, "x"]\n', '\n{"k": false}\n'],
           "qwen3_6": ["\ntrue\n", "\nnull\n", "\n-1.5\n", '\n[1, "x"]\n', '\n{"k": false}\n'],
           "deepseek_v31": ['"b": true, "n": null'], "gpt_oss": ['"b": true, "n": null'],
           "glm45": ["<arg_value>true</arg_value>", "<arg_value>null</arg_value>",
                     '<arg_value>{"k": false}</arg_value>'],
           "minimax_m2": ['"b">true<', '"n">null<', '"o">{"k": false}<']}


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_trajectory_trains_exactly_the_assistant_turns(family):
    r = renderer(family)
    traj = conversation_trajectory(conversation(family), r)
    traj.check()
    trained = [i for i, m in zip(traj.response_ids, traj.loss_mask) if m]
    inserted = [i for i, m in zip(traj.response_ids, traj.loss_mask) if not m]
    text, obs = r.decode(trained), r.decode(traj.prompt_ids + inserted)
    for piece in WRITTEN[family]:
        assert piece in text
    for name in ("get_weather", "add"):
        assert name in text
    assert "Sunny; -3." in text and "You're welcome." in text
    for piece in ("sunny", "-3", "Thanks!", "Be brief."):  # tool results, user turns, the system prompt: no loss
        assert piece in obs and piece not in text.replace("Sunny; -3.", "")
    # each trained turn ends on one of the family's stop tokens
    ends = [traj.response_ids[s.end - 1] for s in traj.spans if s.kind == "generated"]
    assert ends and all(e in r.stop_token_ids for e in ends)
    # the ledger is the template's own render of the conversation, up to this template's declared rewrites
    history = traj.messages + [Message("user", "next")]
    ids = traj.prompt_ids + traj.response_ids + r.bridge(traj.response_ids, [Message("user", "next")], traj.messages)
    note = r.check_full(history, ids, tools=TOOLS)
    assert note is None or r.rewrites_history


def test_consecutive_tool_messages_are_one_observation_block():
    for family, opener in [("qwen3_5", "<|im_start|>user"), ("qwen3_6", "<|im_start|>user"),
                           ("glm45", "<|observation|>"), ("minimax_m2", "]~b]tool")]:
        r = renderer(family)
        traj = conversation_trajectory(conversation(family), r)
        first = next(s for s in traj.spans if s.kind == "inserted")
        bridge = r.decode(traj.response_ids[first.start:first.end])
        # (GLM's opener is the stop token the turn generated: the bridge does not write it again)
        assert bridge.count(opener) == (family != "glm45") and bridge.index("sunny") < bridge.index("-3"), family


@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_bridges_equal_the_template_on_the_real_history(family):
    """Every bridge of the conversation, as a rollout makes it, against the template applied to the real history
    (for MiniMax-M2 and gpt-oss the history's calls are parsed back into `tool_calls`, as their templates need)."""
    r = renderer(family, strict=True)
    traj = conversation_trajectory(conversation(family), r)
    gen = [s for s in traj.spans if s.kind == "generated"]
    ins = [s for s in traj.spans if s.kind == "inserted"]
    msgs, turn = traj.messages, 0
    for k, span in enumerate(ins):
        cut = [i for i, m in enumerate(msgs) if m.role == "assistant"][k]
        nxt = [i for i, m in enumerate(msgs) if m.role == "assistant"][k + 1]
        generated = traj.response_ids[gen[k].start:gen[k].end]
        bridge = traj.response_ids[span.start:span.end]
        r.check_bridge(msgs[:cut + 1], generated, msgs[cut + 1:nxt], bridge, tools=TOOLS)
        turn += 1
    assert turn == len(ins) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_parser_reads_what_the_template_writes(family):
    r = renderer(family)
    traj = conversation_trajectory(conversation(family), r)
    gen = [s for s in traj.spans if s.kind == "generated"]
    calls = []
    for s in gen:
        text = r.assistant_text(traj.response_ids[s.start:s.end])
        result = get_parser(PARSER[family])(text)
        assert not result.errors, result.errors
        calls += [(c.name, c.arguments) for c in result.tool_calls]
    assert calls == [("get_weather", ARGS), ("add", {"a": 2, "b": -5})]


def test_qwen35_and_qwen36_disagree_on_booleans_and_nulls_and_qwen_coder_reads_only_qwen36():
    coder = get_parser("qwen3_coder")
    for family, expected in [("qwen3_5", "True"), ("qwen3_6", True)]:
        traj = conversation_trajectory(conversation(family), renderer(family))
        text = renderer(family).decode(traj.response_ids[:traj.spans[0].end])
        assert coder(text).tool_calls[0].arguments["b"] == expected


def test_minimax_bridge_of_a_tool_result_needs_the_calls_of_the_generated_turn():
    """MiniMax-M2's template refuses a tool message after an assistant turn without `tool_calls` (raise_exception);
    the bridge gives its sentinel turn the calls it parses from the generated turn."""
    r = renderer("minimax_m2")
    reply = ('<minimax:tool_call>\n<invoke name="add">\n<parameter name="a">2</parameter>\n</invoke>\n'
             '</minimax:tool_call>')
    gen = r.encode(reply) + [r.end_of_turn_id]
    history = [Message("user", "2+?"), Message("assistant", reply)]
    bridge = r.bridge(gen, [Message("tool", "4")], history)
    assert r.decode(bridge) == "\n]~b]tool\n<response>4</response>[e~[\n]~b]ai\n<think>\n"  # after its [e~[
    r.check_bridge(history, gen, [Message("tool", "4")], bridge)


def test_gpt_oss_turn_closed_by_return_or_call_gets_no_second_close():
    r = renderer("gpt_oss")
    ret, call, end = (tok("gpt_oss").convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>", "<|end|>"))
    answer = r.encode("<|channel|>final<|message|>4") + [ret]
    bridge = r.bridge(answer, [Message("user", "more")], [Message("user", "q"), Message("assistant", "x")])
    assert bridge[0] != end and r.decode(bridge) == "<|start|>user<|message|>more<|end|><|start|>assistant"
    text = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2}'
    bridge = r.bridge(r.encode(text) + [call], [Message("tool", "4")],
                      [Message("user", "q"), Message("assistant", text)])
    assert r.decode(bridge) == '<|start|>functions.add to=assistant<|channel|>commentary<|message|>"4"<|end|>' \
                               "<|start|>assistant"


def test_glm_turn_ends_on_the_next_header():
    r = renderer("glm45")
    obs = tok("glm45").convert_tokens_to_ids("<|observation|>")
    assert r.end_of_turn_id is None and obs in r.stop_token_ids
    gen = r.encode("\n<think></think>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
    bridge = r.bridge(gen + [obs], [Message("tool", "4")])
    assert bridge[0] != obs and r.decode(bridge) == "\n<tool_response>\n4\n</tool_response><|assistant|>"
    traj = conversation_trajectory(conversation("glm45"), r)
    ends = [r.decode([traj.response_ids[s.end - 1]]) for s in traj.spans if s.kind == "generated"]
    assert ends == ["<|observation|>", "<|user|>", "<|user|>"]


def test_qwen35_refuses_a_system_message_after_the_first_turn():
    r = renderer("qwen3_5")
    with pytest.raises(Exception, match="System message must be at the beginning"):
        r.bridge(r.encode("ok") + [r.end_of_turn_id], [Message("system", "Now be verbose.")])


# --- cross-checks against independent renderer libraries ---------------------------------------------------------
PLAIN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
TOOLY = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                                              "function": {"name": "get_weather", "arguments": ARGS}}]},
         {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]


def _tooly(family):
    msgs = copy.deepcopy(TOOLY)
    if family == "deepseek_v31":
        f = msgs[1]["tool_calls"][0]["function"]
        f["arguments"] = json.dumps(f["arguments"])
    return msgs


# family -> the `renderers` config that mirrors the same model's template
SAME_AS_RENDERERS = {"qwen3_5": "Qwen35RendererConfig", "qwen3_6": "Qwen36RendererConfig",
                     "glm45": "GLM45RendererConfig", "gpt_oss": "GptOssRendererConfig"}
# gpt-oss: `renderers` renders through openai-harmony, which differs from the template in three places of glue
HARMONY_VS_TEMPLATE = [("# Instructions\n\nBe brief.<|end|>", "# Instructions\n\nBe brief.\n\n<|end|>"),
                       ("<|channel|>commentary<|message|>", "<|channel|>commentary json<|message|>")]


@pytest.mark.parametrize("family", list(SAME_AS_RENDERERS))
def test_same_ids_as_verifiers_renderers(family, monkeypatch):
    R = pytest.importorskip("renderers")
    if family == "gpt_oss":  # openai-harmony reads o200k_base from here instead of downloading it (same sha256)
        monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", os.path.join(os.path.dirname(find_spec("tml_renderers").origin),
                                                                   "data"))
        config = R.GptOssRendererConfig(conversation_start_date=DATE)
    else:
        config = getattr(R, SAME_AS_RENDERERS[family])()
    theirs = R.create_renderer(tok(family), config)
    r = renderer(family)
    for msgs, tools in [(PLAIN, None), (_tooly(family), TOOLS)]:
        ids = theirs.render_ids(copy.deepcopy(msgs), tools=tools, add_generation_prompt=True)
        ours = r.render_text(msgs, tools=tools, add_generation_prompt=True)
        if family == "gpt_oss" and tools:  # tool results differ more (see docs/ledger.md): the call header only
            assert "<|channel|>commentary<|message|>" in r.decode(ids) and "commentary json<|message|>" in ours
        elif family == "gpt_oss":  # the known differences, and nothing else
            text = r.decode(ids).removesuffix("<|channel|>analysis<|message|>")  # harmony prefills the channel
            for harmony, template in HARMONY_VS_TEMPLATE:
                text = text.replace(harmony, template)
            assert text == ours
        else:
            assert ids == r.encode(ours)


def _tml_ids(renderer_obj, msgs):
    from tml_renderers import chat

    spans, _ = renderer_obj.render_for_completion(chat.OpenAIMessage.from_oss_messages(copy.deepcopy(msgs)))
    return [int(x) for s in spans for x in re.findall(r"\d+", str(s).split("tokens: [", 1)[1].split("]", 1)[0])]


@pytest.mark.parametrize("family,make", [("qwen3_5", "Qwen35"), ("deepseek_v31", "DeepSeekV31"),
                                         ("gpt_oss", "GptOss")])
def test_same_ids_as_thinking_machines_tml_renderers(family, make):
    tml = pytest.importorskip("tml_renderers.renderers")
    theirs = getattr(tml, make)(current_date=DATE) if family == "gpt_oss" else getattr(tml, make)()
    r = renderer(family)
    for msgs in (PLAIN, _tooly(family)):  # tml takes no tool list: the tool-call history only
        ids, ours = _tml_ids(theirs, msgs), r.render_text(msgs, add_generation_prompt=True)
        if family == "qwen3_5" and msgs is not PLAIN:  # tml writes nested arguments as compact JSON; tojson does not
            assert r.decode(ids) == ours.replace('[1, "x"]', '[1,"x"]').replace('{"k": false}', '{"k":false}')
        else:
            assert ids == r.encode(ours)


def test_where_the_libraries_disagree():
    """`renderers` has no DeepSeek-V3.1 (its deepseek-v3 writes V3's `function<｜tool▁sep｜>NAME` + ```json blocks and
    no `</think>`), and its minimax-m2 writes MiniMax-M2.5's default system prompt; tml's DeepSeekV31 agrees with
    V3.1's template (`<｜Assistant｜></think>`)."""
    R = pytest.importorskip("renderers")
    r = renderer("deepseek_v31")
    ours = r.render_text(PLAIN, add_generation_prompt=True)
    theirs = R.create_renderer(tok("deepseek_v31"), R.DeepSeekV3RendererConfig()).render_ids(
        copy.deepcopy(PLAIN), add_generation_prompt=True)
    assert ours.endswith("<｜Assistant｜></think>") and not r.decode(theirs).endswith("</think>")
    mm = R.create_renderer(tok("minimax_m2"), R.MiniMaxM2RendererConfig())
    no_system = PLAIN[1:]
    assert "MiniMax-M2.5" in tok("minimax_m2").decode(mm.render_ids(copy.deepcopy(no_system),
                                                                    add_generation_prompt=True))
    assert "You are a helpful assistant." in renderer("minimax_m2").render_text(no_system)


def test_tokenizers_equal_tml_renderers_own():
    tokz = pytest.importorskip("tml_renderers.tokenizers")
    texts = ["Hello world", "  two  spaces  ", "Steps:\n\n1. go", "ünïcödé 🙂", "中文测试，你好世界！",
             "I'm can't WE'LL", "x = [1, 2, 3]\n\tdef f():\n\t\treturn 42", "a\u0301e\u0301 naïve", "1234567890",
             "😀😀 $%^&*()"]
    for family, theirs in [("qwen3_5", tokz.Qwen35Tokenizer()), ("deepseek_v31", tokz.DeepSeekV31Tokenizer()),
                           ("gpt_oss", tokz.HarmonyTokenizer())]:
        for s in texts:
            assert tok(family).encode(s, add_special_tokens=False) == theirs.encode_ordinary(s), (family, s)


def test_kimi_k2_tokenizer_and_parser():
    tokz = pytest.importorskip("tml_renderers.tokenizers")
    t, theirs = ot.kimi_k2(), tokz.KimiK2InstructTokenizer()
    for s in ["Hello world", "中文测试，你好世界！", "I'm can't WE'LL", "x = [1, 2]\n\n\tok", "😀 naïve"]:
        assert t.encode(s, add_special_tokens=False) == theirs.encode_ordinary(s), s
    assert t.convert_tokens_to_ids(["<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_call_argument_begin|>"]) == \
        [163586, 163595, 163598]
    text = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
            + json.dumps(ARGS) + "<|tool_call_end|><|tool_calls_section_end|>")
    generated = t.decode(t.encode(text, add_special_tokens=False))
    assert [(c.name, c.arguments) for c in get_parser("kimi_k2")(generated).tool_calls] == [("get_weather", ARGS)]
    with pytest.raises(InvalidInput):
        get_renderer(t)  # no template of its own at hand: pass chat_template=


# --- issue 58: token fidelity -------------------------------------------------------------------------------------
def _trained(r, traj) -> str:
    return r.decode([i for i, m in zip(traj.response_ids, traj.loss_mask) if m])


@pytest.mark.parametrize("key", ["thinking", "reasoning_content"])
def test_gpt_oss_sft_trains_the_reasoning_the_template_writes(key):
    """Item 1: gpt-oss's template reads `thinking`; either key reaches it, and the analysis channel is trained."""
    r = renderer("gpt_oss")
    msgs = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4", key: "add two and two"}]
    traj = conversation_trajectory({"messages": msgs}, r)
    assert _trained(r, traj) == ("<|channel|>analysis<|message|>add two and two<|end|><|start|>assistant"
                                 "<|channel|>final<|message|>4<|return|>")
    template = r.render_text([msgs[0], {**msgs[1], "thinking": "add two and two"}], add_generation_prompt=False)
    assert r.decode(traj.prompt_ids + traj.response_ids) == template
    # a call turn's analysis, which the template drops once a final answer follows: trained as the model wrote it
    call = {"id": "c0", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    tooly = [msgs[0], {"role": "assistant", "content": "", key: "use add", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c0", "content": "4"}, msgs[1]]
    traj = conversation_trajectory({"messages": tooly}, r)
    assert _trained(r, traj).startswith("<|channel|>analysis<|message|>use add<|end|><|start|>assistant to=")
    assert "drops analysis" in traj.metadata["history_rewrites"][0]
    both = [msgs[0], {**msgs[1], "thinking": "a", "reasoning_content": "b"}]
    with pytest.raises(InvalidInput, match=r"messages\[1\] has both 'thinking' and 'reasoning_content'"):
        conversation_trajectory({"messages": both}, r)


def test_gpt_oss_refuses_a_second_call_to_the_same_function_by_name():
    """Item 2: the template writes one call per message; a second `get_weather` call was dropped while its name was
    still in the turn."""
    call = lambda i, city: {"id": f"c{i}", "type": "function",  # noqa: E731
                            "function": {"name": "get_weather", "arguments": {"city": city}}}
    msgs = [{"role": "user", "content": "Paris and Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [call(0, "Paris"), call(1, "Oslo")]},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            {"role": "assistant", "content": "Sunny, rain."}]
    conv = Conversation.coerce({"messages": msgs}, where="calls.jsonl:7")
    with pytest.raises(InvalidInput, match=r"calls.jsonl:7: messages\[1\].tool_calls\[1\] \('get_weather'\): "
                                           r"the gpt_oss chat template writes at most 1 call"):
        conversation_trajectory(conv, renderer("gpt_oss"))


def test_gpt_oss_refuses_a_system_message_after_the_first():
    """Item 3: the template renders only messages[0] as the system (developer) message and drops any later one
    without a word; DeepSeek's hoists them instead, but hoisting would train text gpt-oss's template never writes."""
    r = renderer("gpt_oss")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "system", "content": "Now be verbose."},
            {"role": "user", "content": "Hi again"}, {"role": "assistant", "content": "Hello again."}]
    assert "verbose" not in r.render_text(msgs, add_generation_prompt=False)  # what the template does with it
    conv = Conversation.coerce({"messages": msgs}, where="late.jsonl:2")
    with pytest.raises(InvalidInput, match=r"late.jsonl:2: messages\[3\] is a system message after the first"):
        conversation_trajectory(conv, r)
    gen = r.encode("<|channel|>final<|message|>Hello.") + [r.stop_token_ids[0]]
    with pytest.raises(InvalidInput, match="observation message 0 is a system message: the gpt_oss template renders"):
        r.bridge(gen, [Message("system", "Now be verbose.")], [Message("user", "Hi"), Message("assistant", "x")])


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_6"])
def test_qwen35_late_system_with_tool_calls_fails_with_the_templates_own_message(family):
    """Item 4: the template's "System message must be at the beginning" (before: a raw jinja TypeError from the
    retry with string arguments), naming the conversation."""
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [CALLS[0]]},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
            {"role": "system", "content": "Now be verbose."}, {"role": "user", "content": "Again"},
            {"role": "assistant", "content": "Sunny."}]
    conv = Conversation.coerce({"messages": msgs}, where="qwen.jsonl:4")
    with pytest.raises(RenderError, match="qwen.jsonl:4: .*System message must be at the beginning"):
        conversation_trajectory(conv, renderer(family))


def test_glm_refusal_of_a_late_system_message_names_the_conversation():
    """Item 6: GLM's turn ends on the next header, and a system header is not one of its stop tokens."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "system", "content": "Now be verbose."}, {"role": "user", "content": "Hi again"},
            {"role": "assistant", "content": "Hello again."}]
    conv = Conversation.coerce({"messages": msgs}, where="glm.jsonl:9")
    with pytest.raises(InvalidInput, match=r"glm.jsonl:9: messages\[2\]: the glm45 template writes none of its stop "
                                           r"tokens .* between assistant turn messages\[1\] and this system message"):
        conversation_trajectory(conv, renderer("glm45"))
