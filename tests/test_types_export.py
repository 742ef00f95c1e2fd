"""Data types validate their input; trajectories export to slime Samples and round-trip through JSON."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers import ScriptedEnv, task

from slime_env import Generation, Message, ScriptedPolicy, Task, Trajectory, get_renderer, run_episode
from slime_env.errors import InvalidInput

# Exactly the slime Sample fields of ../shared/SLIME_CONTRACT.md §2 that a generate function fills.
SLIME_FIELDS = {"tokens", "response_length", "loss_mask", "rollout_log_probs", "reward", "status", "response",
                "prompt", "label", "metadata", "index", "group_index", "rollout_id", "remove_sample", "session_id",
                "weight_versions", "non_generation_time"}
SLIME_STATUSES = {"pending", "completed", "truncated", "aborted", "failed"}


def test_message_and_task_errors_name_the_field():
    with pytest.raises(InvalidInput, match="role 'bot'"):
        Message("bot", "x")
    with pytest.raises(InvalidInput, match=r"prompt\[1\]: chat message has no 'role'"):
        Task.coerce({"prompt": [{"role": "user", "content": "a"}, {"content": "b"}]})
    with pytest.raises(InvalidInput, match="task.metadata: expected a dict"):
        Task.coerce({"prompt": "a", "metadata": [1]})
    with pytest.raises(InvalidInput, match="3 token ids but 2 log-probs"):
        Generation((1, 2, 3), (0.0, 0.0))
    with pytest.raises(InvalidInput, match="finish_reason 'eos'"):
        Generation((1,), (0.0,), "eos")
    assert Task.coerce("hi").messages(system="s") == [Message("system", "s"), Message("user", "hi")]


def _episode(tok, env, replies, **kw):
    renderer = get_renderer(tok)
    return asyncio.run(run_episode(env, ScriptedPolicy(tok, replies), task("What?", label=["a", "b"]),
                                   renderer=renderer, **kw))


def _check_slime_invariants(sample):
    assert set(sample) == SLIME_FIELDS
    n = sample["response_length"]
    assert len(sample["loss_mask"]) == len(sample["rollout_log_probs"]) == n
    assert sample["status"] in SLIME_STATUSES
    assert isinstance(sample["reward"], float)
    for m, lp in zip(sample["loss_mask"], sample["rollout_log_probs"]):
        assert m in (0, 1) and (m == 1 or lp == 0.0)
    json.dumps(sample)  # everything is plain JSON


def test_slime_sample_of_a_completed_episode(smollm2_tok):
    env = ScriptedEnv([[Message("tool", "r")]], rewards=[0.0, 1.0])
    traj = _episode(smollm2_tok, env, ["a", "b"], metadata={"index": 3, "group_index": 1})
    s = traj.to_slime_sample()
    _check_slime_invariants(s)
    assert s["tokens"] == traj.prompt_ids + traj.response_ids
    assert s["tokens"][-s["response_length"]:] == traj.response_ids
    assert s["loss_mask"] == traj.loss_mask and s["reward"] == 1.0 and s["status"] == "completed"
    assert s["remove_sample"] is False and s["index"] == 3 and s["group_index"] == 1
    assert s["response"] == "a<|im_end|>\n<|im_start|>tool\nr<|im_end|>\n<|im_start|>assistant\nb<|im_end|>"
    assert s["label"] == ["a", "b"] and s["prompt"] == "What?"
    assert s["metadata"]["turn_rewards"] == [0.0, 1.0] and s["metadata"]["spans"][1]["kind"] == "inserted"
    assert 0 <= s["non_generation_time"] <= traj.timings["total_s"]


def test_slime_sample_of_a_failed_episode_is_safe(smollm2_tok):
    env = ScriptedEnv([[Message("tool", "r")]], fail_at=1)
    traj = _episode(smollm2_tok, env, ["a", "b"])
    assert traj.status == "failed" and sum(traj.loss_mask) > 0
    s = traj.to_slime_sample()
    _check_slime_invariants(s)
    assert s["remove_sample"] is True and s["reward"] == 0.0
    assert set(s["loss_mask"]) == {0} and set(s["rollout_log_probs"]) == {0.0}
    assert "env exploded" in s["metadata"]["status_reason"]


def test_failed_before_any_token_still_exports(smollm2_tok):
    class NoReset(ScriptedEnv):
        async def reset(self, *, seed=None, options=None):
            raise OSError("disk gone")

    s = _episode(smollm2_tok, NoReset(), ["a"]).to_slime_sample()
    _check_slime_invariants(s)
    assert s["response_length"] == 0 and s["remove_sample"] is True


def test_to_dict_from_dict_round_trip(smollm2_tok):
    env = ScriptedEnv([[Message("tool", "ünï 🙂", name="calc")]])
    traj = _episode(smollm2_tok, env, ["x", "y"])
    back = Trajectory.from_dict(json.loads(json.dumps(traj.to_dict())))
    assert back == traj
    with pytest.raises(InvalidInput, match="no field 'prompt_ids'"):
        Trajectory.from_dict({k: v for k, v in traj.to_dict().items() if k != "prompt_ids"})
    with pytest.raises(InvalidInput, match="status 'done'"):
        Trajectory.from_dict({**traj.to_dict(), "status": "done"})


def test_to_dict_hands_out_copies(smollm2_tok):
    """Changing the exported dict (a user post-processing records) never changes the trajectory."""
    traj = _episode(smollm2_tok, ScriptedEnv([[Message("user", "again")]]), ["x", "y"])
    before = json.dumps(traj.to_dict())
    d = traj.to_dict()
    for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "turn_rewards"):
        d[key].append(0)
    d["timings"]["total_s"] = -1.0
    d["info"]["x"] = 1
    d["metadata"]["x"] = 1
    d["spans"][0]["start"] = 99
    d["messages"][0]["content"] = "changed"
    assert json.dumps(traj.to_dict()) == before
