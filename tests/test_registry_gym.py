"""Registry, entry-point plugins, and the Gymnasium mirror (`gymnasium.make("slime_env/<id>")`)."""

from __future__ import annotations

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env
from helpers import ScriptedEnv

import slime_env
from slime_env import RegistryError, get_renderer, make, register, registry_ids, spec
from slime_env.errors import InvalidInput


def test_register_make_and_list():
    register("TestScripted-v0", "helpers:ScriptedEnv", description="scripted", observations=())
    assert "TestScripted-v0" in registry_ids()
    env = make("TestScripted-v0", fail_at=2)
    assert isinstance(env, ScriptedEnv) and env.fail_at == 2
    assert spec("TestScripted-v0").description == "scripted"
    register("TestScripted-v0", "helpers:ScriptedEnv")  # same entry point again: harmless
    with pytest.raises(RegistryError, match="already registered"):
        register("TestScripted-v0", "helpers:FixedIdsPolicy")


def test_errors_name_the_problem():
    with pytest.raises(RegistryError, match="no env registered as 'calculator-v1'.*Calculator-v0"):
        make("calculator-v1")
    with pytest.raises(InvalidInput, match="must start with a letter"):
        register("9bad", "helpers:ScriptedEnv")
    register("TestNotAnEnv-v0", "helpers:FixedIdsPolicy")
    with pytest.raises(InvalidInput, match="cannot make 'TestNotAnEnv-v0'"):
        make("TestNotAnEnv-v0")
    register("TestWrongType-v0", lambda: object())
    with pytest.raises(RegistryError, match="not a slime_env.Env"):
        make("TestWrongType-v0")
    register("TestMissing-v0", "no_such_module:Env")
    with pytest.raises(InvalidInput, match="cannot import module 'no_such_module'"):
        make("TestMissing-v0")


def test_builtin_env_comes_from_the_entry_point():
    assert "Calculator-v0" in registry_ids()
    assert spec("Calculator-v0").entry_point == "slime_env.envs.calculator:CalculatorEnv"


def test_gymnasium_make_and_check_env():
    assert "slime_env/Calculator-v0" in gymnasium.registry
    env = gymnasium.make("slime_env/Calculator-v0")
    try:
        check_env(env.unwrapped, skip_render_check=True)
        obs, info = env.reset(seed=3)
        assert "What is" in obs and info["label"] == env.unwrapped.env.task.label
        obs2, _ = env.reset(seed=3)
        assert obs2 == obs  # seeded resets are reproducible
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*21"}}</tool_call>'
        obs, reward, terminated, truncated, _ = env.step(call)
        assert obs == "tool: 42" and reward == 0.0 and not terminated
        obs, reward, terminated, truncated, info = env.step(f"<answer>{info['label']}</answer>")
        assert reward == 1.0 and terminated and info["correct"]
    finally:
        env.close()


def test_gymnasium_env_with_renderer_shows_template_text(smollm2_tok):
    env = gymnasium.make("slime_env/Calculator-v0", renderer=get_renderer(smollm2_tok))
    try:
        obs, _ = env.reset(seed=1, options={"task": {"prompt": "What is 1+1?", "label": 2}})
        assert obs.startswith("<|im_start|>system\n") and obs.endswith("<|im_start|>assistant\n")
        obs, *_ = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>')
        assert obs == "<|im_end|>\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"
    finally:
        env.close()


def test_core_does_not_import_the_other_packages():
    import subprocess
    import sys

    code = ("import sys, slime_env; slime_env.registry_ids(); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('envs', 'agents', 'tools_sandbox', 'trainers') "
            "or m.startswith(('slime_env.envs', 'slime_env.agents', 'slime_env.tools_sandbox', "
            "'slime_env.trainers'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert slime_env.__version__


def test_every_registered_env_has_a_one_sentence_description():
    """`slime-env list` shows what each env is, in a whole sentence (Agent-v0's was cut at the end of a line), not a
    pointer elsewhere."""
    from slime_env.registry import describe

    for env_id in registered_ids():
        text = describe(spec(env_id))
        assert text and "\n" not in text and "module docstring" not in text, (env_id, text)
        assert text.endswith((".", ")", "!", "?")) and text.count("(") == text.count(")"), (env_id, text)
        assert text.count("`") % 2 == 0, (env_id, text)


NEEDS_WORKSPACE = {"Workspace-v0", "Harbor-v0", "Terminal-v0"}


def registered_ids() -> list[str]:
    """Every id the installed distributions register (the `slime_env.envs` entry points: ours, core and `envs`,
    and any plugin's), not the ones tests register on purpose."""
    from importlib.metadata import entry_points

    from slime_env.registry import ENTRY_POINT_GROUP

    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def test_multi_agent_envs_are_registered_and_refused_by_gymnasium_with_a_reason():
    multi = [i for i in registry_ids() if spec(i).multi_agent]
    assert {"TicTacToe-v0", "RockPaperScissors-v0"} <= set(multi)
    assert isinstance(make("TicTacToe-v0"), slime_env.MultiAgentEnv)
    with pytest.raises(slime_env.InvalidInput, match="multi-agent env"):
        gymnasium.make("slime_env/TicTacToe-v0")


def test_every_registered_env_passes_gymnasiums_checker_or_is_refused_with_the_reason():
    """Every registered id (core ones such as Agent-v0 included, not only `envs.*`) either resets without arguments
    from an offline default task source and passes Gymnasium's checker, or `gymnasium.make` refuses it saying why
    Gymnasium cannot drive it (multi-agent envs, agent programs) — never an AttributeError on reset or a bare
    missing-argument error."""
    ids = registered_ids()
    assert {"Agent-v0", "Calculator-v0", "TicTacToe-v0"} <= set(ids) and len(ids) >= 10
    refused = {}
    for env_id in ids:
        try:
            env = gymnasium.make(f"slime_env/{env_id}")
        except InvalidInput as e:
            assert "Gymnasium" in str(e) and "cannot" in str(e) and env_id in str(e), (env_id, str(e))
            refused[env_id] = str(e)
            continue
        try:
            if env_id in NEEDS_WORKSPACE:
                from workspace_support import require_backend, workspace_image

                workspace_image()  # its default task runs in a container from this image
                if env_id == "Terminal-v0":
                    require_backend("bwrap")  # its workspaces are bubblewrap's
            check_env(env.unwrapped, skip_render_check=True)
            obs, _ = env.reset(seed=1)
            assert isinstance(obs, str) and obs, env_id
        finally:
            env.close()
    agent_programs = {"Agent-v0", "Harness-v0"}  # a harness binary drives the episode, not reset/step
    assert all("agent program" in refused[i] for i in agent_programs) and "multi-agent" in refused["TicTacToe-v0"]
    assert set(refused) == agent_programs | {i for i in ids if spec(i).multi_agent}


def test_agent_v0_is_refused_by_gymnasium_with_the_reason_even_with_an_agent():
    async def agent(base_url, api_key, task):
        return "5"

    with pytest.raises(InvalidInput, match=r"Agent-v0 runs an agent program .* AgentEnv.run\(gateway, task\)"):
        gymnasium.make("slime_env/Agent-v0", agent=agent).reset(seed=1)  # AttributeError: 'task_from' before
    assert isinstance(make("Agent-v0", agent=agent), slime_env.AgentEnv)  # the async env is made as before


def test_tasks_are_accepted_in_gymnasium_make_as_a_list_or_a_path(tmp_path):
    import json

    rows = [{"prompt": "What is 40 + 2?", "label": 42}, {"prompt": "What is 5 * 5?", "label": 25}]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for tasks in (rows, str(path)):
        env = gymnasium.make("slime_env/Math-v0", tasks=tasks)
        try:
            seen = {env.reset(seed=s)[0] for s in range(12)}
            assert any("40 + 2" in o for o in seen) and any("5 * 5" in o for o in seen)
            assert all("40 + 2" in o or "5 * 5" in o for o in seen)
        finally:
            env.close()
    from slime_env.errors import InvalidInput

    with pytest.raises(InvalidInput, match=r"MathEnv\(tasks=...\): no tasks"):
        slime_env.make("Math-v0", tasks=[])


def test_vector_envs_over_two_copies():
    from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

    # Text observations of any length cannot live in fixed-size shared memory: AsyncVectorEnv pickles them
    for make_vec in (SyncVectorEnv, lambda fns: AsyncVectorEnv(fns, shared_memory=False)):
        vec = make_vec([lambda: gymnasium.make("slime_env/Calculator-v0")] * 2)
        try:
            obs, _ = vec.reset(seed=[1, 2])
            assert len(obs) == 2 and all("What is" in o for o in obs)
            obs, rewards, terminated, truncated, _ = vec.step(["<answer>0</answer>", "<answer>0</answer>"])
            assert len(rewards) == 2 and all(terminated | truncated)
        finally:
            vec.close()
