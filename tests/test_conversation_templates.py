"""Issue 46 items 19 and 20: conversations follow the template where it moves system messages or prints tool-call
arguments as given."""

from __future__ import annotations

import pytest

from slime_env import Message, get_renderer
from slime_env.conversations import conversation_trajectory
from slime_env.errors import InvalidInput

LATE_SYSTEM = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello."},
                            {"role": "system", "content": "Now be verbose."}, {"role": "user", "content": "Hi again"},
                            {"role": "assistant", "content": "Hello again, at length."}]}


def test_deepseek_r1_late_system_message_is_hoisted_as_the_template_does(deepseek_tok):
    r = get_renderer(deepseek_tok)
    traj = conversation_trajectory(LATE_SYSTEM, r)
    text = r.decode(traj.prompt_ids + traj.response_ids)
    assert "verbose" in r.decode(traj.prompt_ids)  # in the front, where the template writes it
    assert text == r.render_text([m for m in LATE_SYSTEM["messages"]], add_generation_prompt=False)
    assert "system messages to the start: messages[3]" in traj.metadata["history_rewrites"][0]


def test_deepseek_r1_refuses_to_bridge_a_system_observation(deepseek_tok):
    r = get_renderer(deepseek_tok)
    gen = r.encode("Hello.") + [r.end_of_turn_id]
    with pytest.raises(InvalidInput, match="observation message 1 is a system message"):
        r.bridge(gen, [Message("user", "Hi again"), Message("system", "Now be verbose.")])


def _string_args_conversation():
    call = {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": '{"expression":"7-1"}'}}
    return {"messages": [{"role": "user", "content": "7-1?"},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c0", "content": "6"},
                         {"role": "assistant", "content": "6"}]}


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_string_arguments_are_trained_as_given(tokenizers, name):
    r = get_renderer(tokenizers[name])
    traj = conversation_trajectory(_string_args_conversation(), r)
    trained = r.decode([i for i, m in zip(traj.response_ids, traj.loss_mask) if m])
    assert '{"expression":"7-1"}' in trained and '{"expression": "7-1"}' not in trained


def test_object_arguments_still_go_to_templates_that_need_objects(tokenizers):
    """Llama 3.1's template would quote a string again (`tojson`): it gets the decoded object."""
    r = get_renderer(tokenizers["llama3.1"])
    traj = conversation_trajectory(_string_args_conversation(), r)
    trained = r.decode([i for i, m in zip(traj.response_ids, traj.loss_mask) if m])
    assert '"parameters": {"expression": "7-1"}' in trained and '\\"' not in trained
