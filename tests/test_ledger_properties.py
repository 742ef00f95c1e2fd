"""Property tests: random multi-turn conversations with tool calls keep the ledger exact."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from helpers import RecordingPolicy, ScriptedEnv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_env import Message, ScriptedPolicy, Task, get_renderer, run_episode
from slime_env import offline_tokenizers as ot

# Tokenizers are looked up by name inside the tests so Hypothesis does not print them in reports.
TOKENIZERS = {"smollm2": ot.smollm2, "qwen2.5": lambda: ot.qwen("2.5"), "qwen3": ot.qwen,
              "llama3.1": ot.llama3, "deepseek_r1": ot.deepseek_r1}
_loaded: dict = {}


def tokenizer(name):
    if name not in _loaded:
        _loaded[name] = TOKENIZERS[name]()
    return _loaded[name]

# Text that stresses tokenizers and templates: digits after newlines, unicode, markup-like fragments.
_FRAGMENTS = st.sampled_from(["Steps:\n\n1.", " 42", "\n", "  ", "ünï", "🙂", "<b>", "</tool_call>", "{", "\"",
                              "x = [1, 2]", "\t", "Doc 1(Title: a)", "<think>", "</answer>", "word"])
# Control, unassigned and private-use code points are excluded: SmolLM2's vocabulary has no byte tokens
# for some of them (its tokenizer drops "\x06"), so no ledger could represent them.
_CHARS = st.characters(exclude_categories=("Cc", "Cs", "Co", "Cn"))
_TEXT = st.lists(st.one_of(_FRAGMENTS, st.text(_CHARS, min_size=1, max_size=12)), min_size=1, max_size=6).map("".join)
# Generated turns start with a visible character: a reply starting with whitespace is still exact in the
# ledger, but the full render tokenizes "\n" + "\nfoo" as one merged piece (checked by text instead).
_REPLY_START = st.sampled_from(["I", "Let", "ok", "<tool_call>", "Answer", "{"])


@st.composite
def tool_call_text(draw):
    args = draw(st.dictionaries(st.sampled_from(["q", "n", "code"]), st.one_of(st.integers(), _TEXT), max_size=2))
    return "<tool_call>" + json.dumps({"name": draw(st.sampled_from(["search", "calc"])), "arguments": args}) + \
        "</tool_call>"


@st.composite
def conversations(draw, stripped: bool):
    n_turns = draw(st.integers(1, 4))
    replies, observations = [], []
    for k in range(n_turns):
        body = draw(_REPLY_START) + draw(_TEXT)
        if draw(st.booleans()):
            body += "\n" + draw(tool_call_text())
        if stripped:
            body = body.strip() or "ok"
        replies.append(body)
        if k < n_turns - 1:
            roles = draw(st.lists(st.sampled_from(["tool", "user"]), min_size=1, max_size=3))
            obs = []
            for role in roles:
                content = draw(_TEXT)
                obs.append(Message(role, content.strip() or "empty" if stripped else content))
            observations.append(obs)
    user = draw(_TEXT)
    return replies, observations, (user.strip() or "q") if stripped else user


def _run(tok, family_kwargs, replies, observations, user, strict=True):
    renderer = get_renderer(tok, strict=strict, **family_kwargs)
    env = ScriptedEnv(observations)
    policy = RecordingPolicy(ScriptedPolicy(tok, replies))
    traj = asyncio.run(run_episode(env, policy, Task(prompt=user), renderer=renderer, max_turns=10,
                                   max_new_tokens=4096))
    return renderer, policy, traj


def _assert_ledger(traj, policy):
    assert traj.status == "completed", (traj.status, traj.reason, traj.metadata.get("traceback"))
    traj.check()
    # token-in/token-out: turn k saw exactly prompt + response up to the end of the previous bridge
    gen_spans = [s for s in traj.spans if s.kind == "generated"]
    assert len(policy.inputs) == len(gen_spans) == traj.num_turns
    for inputs, span in zip(policy.inputs, gen_spans):
        assert inputs == traj.prompt_ids + traj.response_ids[:span.start]
    for i, m in enumerate(traj.loss_mask):
        assert (traj.rollout_logprobs[i] < 0) if m else (traj.rollout_logprobs[i] == 0.0)


# SLIME_ENV_HYPOTHESIS_EXAMPLES=500 for a deeper search than the default CI budget.
SETTINGS = settings(max_examples=int(os.environ.get("SLIME_ENV_HYPOTHESIS_EXAMPLES", 40)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5"])
@SETTINGS
@given(data=conversations(stripped=False))
def test_chatml_incremental_equals_full_render(name, data):
    tok = tokenizer(name)
    replies, observations, user = data
    renderer, policy, traj = _run(tok, {}, replies, observations, user)
    _assert_ledger(traj, policy)
    full = renderer.encode(renderer.render_text(traj.messages, add_generation_prompt=False))
    # The last turn ends at its end-of-turn token; the template adds "\n" after it.
    assert full == traj.tokens + renderer.encode("\n")
    assert "history_rewrites" not in traj.metadata


@SETTINGS
@given(data=conversations(stripped=True))
def test_llama31_incremental_equals_full_render(data):
    replies, observations, user = data
    renderer, policy, traj = _run(tokenizer("llama3.1"), {}, replies, observations, user)
    _assert_ledger(traj, policy)
    assert renderer.encode(renderer.render_text(traj.messages, add_generation_prompt=False)) == traj.tokens
    assert "history_rewrites" not in traj.metadata


@pytest.mark.parametrize("name,kwargs", [("qwen3", {"enable_thinking": True}), ("deepseek_r1", {})])
@SETTINGS
@given(data=conversations(stripped=False))
def test_history_rewriting_templates_keep_ledger_invariants(name, kwargs, data):
    # These templates re-render history (docs/ledger.md); strict mode records that, and the ledger stays exact.
    replies, observations, user = data
    _, policy, traj = _run(tokenizer(name), kwargs, replies, observations, user)
    _assert_ledger(traj, policy)
