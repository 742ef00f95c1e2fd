"""SWE tasks without Docker: the scripted SWE teacher, Harbor-v0's workspace factories, local bwrap workspaces
(`slime_env.envs.swe.local`; the bwrap test needs root, bwrap and the sdists in $SLIME_ENV_SWE_SDISTS)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from slime_env import Task
from slime_env.envs.swe import reward as reward_mod
from slime_env.envs.swe.patches import reverting_edits
from slime_env.envs.swe.task import find_tasks, load_task
from slime_env.envs.swe.teacher import teacher_calls, teacher_reply

TASKS = Path(__file__).resolve().parents[1] / "examples" / "swe_tasks"


def _calls(reply: str) -> dict:
    return json.loads(re.fullmatch(r"<tool_call>(.*)</tool_call>", reply, re.S).group(1))


def test_teacher_finds_its_task_by_the_statement_and_plays_search_view_edits_submit():
    task = load_task(find_tasks(TASKS)[0])
    context = ("<|im_start|>system\nTools ... </tool_call> ...<|im_end|>\n"
               f"<|im_start|>user\n{task.instruction}<|im_end|>")
    script = teacher_calls(task)
    replies = []
    for _ in range(len(script) + 1):
        reply = teacher_reply(context)
        replies.append(reply)
        context += f"\n<|im_start|>assistant\n{reply}<|im_end|>\n<|im_start|>tool\nok<|im_end|>"
    assert replies[:-1] == script and replies[-1] == script[-1]  # then submit again
    names = [_calls(r)["name"] for r in script]
    assert names[0] == "search" and names[-1] == "submit" and "str_replace_editor" in names
    edits = [_calls(r)["arguments"] for r in script if _calls(r)["arguments"].get("command") == "str_replace"]
    assert [(e["path"], e["old_str"], e["new_str"]) for e in edits] == [
        (f"/repo/{p}", old, new) for p, old, new in reverting_edits(task.bug_patch)]
    assert _calls(teacher_reply("no known statement here"))["name"] == "submit"


def test_harbor_env_uses_the_workspace_factories(monkeypatch):
    from slime_env.envs.harbor.env import HarborEnv

    made, closed, seen = [], [], {}

    class FakeWs:
        workdir = "/repo"

        async def close(self):
            closed.append(self)

    async def workspace(task):
        made.append(FakeWs())
        return made[-1]

    async def fresh(spec):
        return FakeWs()

    async def fake_reward(task, ws, *, start_workspace=None, **kw):
        seen["start"] = start_workspace
        return reward_mod.SweReward(1.0, "resolved", "ok")

    monkeypatch.setattr("slime_env.envs.swe.swe_reward", fake_reward)
    env = HarborEnv(workspace=workspace, reward_workspace=fresh)
    folder = find_tasks(TASKS)[0]
    task = Task(prompt="fix it", metadata={"harbor_task": str(folder)})

    async def go():
        state = await env.setup_state(task)
        assert state["workspace"] is made[0]
        reward, info = await env.verify(task, state["workspace"])
        await env.cleanup_state(state)
        return reward, info

    reward, info = asyncio.run(go())
    assert reward == 1.0 and info["swe"]["status"] == "resolved" and seen["start"] is fresh and closed == made


def test_swe_reward_leaves_the_image_to_a_given_start_workspace(monkeypatch):
    async def no_docker(*a, **k):
        raise AssertionError("ensure_image called")

    monkeypatch.setattr(reward_mod, "ensure_image", no_docker)
    task = load_task(find_tasks(TASKS)[0])

    async def start(spec):
        raise RuntimeError("no workspace here")

    with pytest.raises(RuntimeError, match="no workspace here"):
        asyncio.run(reward_mod.run_hidden_tests(task, {}, start_workspace=start))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap") or not os.environ.get("SLIME_ENV_SWE_SDISTS"),
                    reason="needs root, bwrap and $SLIME_ENV_SWE_SDISTS (bench/learn_swe_gpu.py --fetch-sdists DIR)")
def test_a_task_checks_on_local_bwrap_workspaces(tmp_path, monkeypatch):
    from slime_env.envs.swe import local

    folder = next(f for f in find_tasks(TASKS) if load_task(f).repo == "cachetools")
    local.stage(tmp_path / "stage", os.environ["SLIME_ENV_SWE_SDISTS"], repos=["cachetools"], hide=[str(TASKS)],
                python=shutil.which("python3"), log=lambda m: None)
    monkeypatch.setenv(local.STAGE_ENV, str(tmp_path / "stage"))
    out = asyncio.run(local.check_task(folder))
    assert out["ok"], out["why"]
