"""run_episode: statuses, budgets, failures, token-in/token-out."""

from __future__ import annotations

import asyncio

import pytest
from helpers import FixedIdsPolicy, RecordingPolicy, ScriptedEnv, task

from slime_env import Generation, Message, ScriptedPolicy, Task, get_renderer, run_episode
from slime_env.errors import InvalidInput


@pytest.fixture(scope="module")
def renderer(smollm2_tok):
    return get_renderer(smollm2_tok, strict=True)


def run(coro):
    return asyncio.run(coro)


def test_completed_episode_records_everything(smollm2_tok, renderer):
    env = ScriptedEnv([[Message("tool", "42")]], rewards=[0.25, 0.75])
    policy = RecordingPolicy(ScriptedPolicy(smollm2_tok, ['<tool_call>{"name": "calc", "arguments": {}}</tool_call>',
                                                          "done"]))
    traj = run(run_episode(env, policy, task("q"), renderer=renderer, metadata={"index": 7}))
    assert traj.status == "completed" and traj.reason == ""
    assert traj.turn_rewards == [0.25, 0.75] and traj.reward == 1.0 and traj.num_turns == 2
    assert [s.kind for s in traj.spans] == ["generated", "inserted", "generated"]
    assert [s.turn for s in traj.spans] == [0, 0, 1]
    traj.check()
    # the env got the parsed tool call and the exact generated ids
    first = env.actions[0]
    assert first.tool_calls[0].name == "calc" and first.parse_errors == ()
    gen0 = traj.spans[0]
    assert list(first.token_ids) == traj.response_ids[gen0.start:gen0.end]
    assert first.text.endswith("</tool_call>")  # the end-of-turn token is not part of the text
    assert policy.inputs[1] == traj.prompt_ids + traj.response_ids[:traj.spans[2].start]
    assert renderer.decode(traj.response_ids[traj.spans[1].start:traj.spans[1].end]) == \
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert traj.metadata["index"] == 7 and traj.metadata["finish_reasons"] == ["stop", "stop"]
    assert [m.role for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    t = traj.timings
    assert t["total_s"] >= t["generate_s"] + t["env_s"] and t["framework_s"] >= 0


def test_generated_ids_are_never_re_encoded(smollm2_tok, renderer):
    # A non-canonical tokenization (one id per character) must reach the ledger untouched.
    odd = [renderer.encode(c)[0] for c in "hello"] + [renderer.end_of_turn_id]
    assert odd[:-1] != renderer.encode("hello")
    env = ScriptedEnv([[Message("user", "again")]])
    traj = run(run_episode(env, FixedIdsPolicy([odd, odd]), task(), renderer=renderer))
    assert traj.status == "completed", traj.reason
    assert traj.response_ids[:len(odd)] == odd and traj.response_ids[-len(odd):] == odd


def test_max_turns_truncates(smollm2_tok, renderer):
    env = ScriptedEnv([[Message("user", "more")]] * 10)
    traj = run(run_episode(env, ScriptedPolicy(smollm2_tok, ["x"]), task(), renderer=renderer, max_turns=3))
    assert traj.status == "truncated" and "max_turns=3" in traj.reason
    assert traj.num_turns == 3 and len(env.actions) == 3
    assert traj.spans[-1].kind == "generated"  # no dangling observation after the last turn
    traj.check()


def test_context_budget_clamps_and_truncates(smollm2_tok, renderer):
    env = ScriptedEnv([[Message("user", "more")]] * 10)
    policy = RecordingPolicy(ScriptedPolicy(smollm2_tok, ["word " * 60]))
    prompt_len = len(renderer.render_prompt([Message("user", "Hello?")]))
    budget = prompt_len + 50
    traj = run(run_episode(env, policy, task(), renderer=renderer, max_context_tokens=budget, max_new_tokens=40))
    assert traj.status == "truncated" and "context budget" in traj.reason
    assert len(traj.tokens) <= budget
    assert policy.params[0]["max_new_tokens"] == 40
    assert all(p["max_new_tokens"] <= budget - len(i) for p, i in zip(policy.params, policy.inputs))
    assert traj.metadata["finish_reasons"][0] == "length"
    traj.check()


def test_observation_that_does_not_fit_truncates(smollm2_tok, renderer):
    env = ScriptedEnv([[Message("tool", "long " * 200)]])
    prompt_len = len(renderer.render_prompt([Message("user", "Hello?")]))
    traj = run(run_episode(env, ScriptedPolicy(smollm2_tok, ["hi"]), task(), renderer=renderer,
                           max_context_tokens=prompt_len + 50))
    assert traj.status == "truncated" and "observation" in traj.reason
    assert traj.spans[-1].kind == "generated"


def test_deadline_truncates(smollm2_tok, renderer):
    env = ScriptedEnv([[Message("user", "more")]] * 100)
    policy = ScriptedPolicy(smollm2_tok, ["x"], latency_s=0.05)
    traj = run(run_episode(env, policy, task(), renderer=renderer, max_turns=100, deadline_s=0.3))
    assert traj.status == "truncated" and "deadline of 0.3s" in traj.reason
    assert 1 <= traj.num_turns < 10
    assert traj.timings["total_s"] < 1.0
    traj.check()


class _Boom:
    async def generate(self, input_ids, sampling_params):
        raise ConnectionError("engine went away")


class _InnerTimeout:
    async def generate(self, input_ids, sampling_params):
        raise TimeoutError("http read timeout")


class _TooMany:
    async def generate(self, input_ids, sampling_params):
        n = sampling_params["max_new_tokens"] + 1
        return Generation(tuple([5] * n), tuple([-1.0] * n))


class _Abort:
    async def generate(self, input_ids, sampling_params):
        return Generation((5, 6), (-1.0, -1.0), "abort")


@pytest.mark.parametrize("policy,status,reason", [
    (_Boom(), "failed", "policy.generate raised ConnectionError: engine went away"),
    (_InnerTimeout(), "failed", "policy.generate raised TimeoutError: http read timeout"),
    (_TooMany(), "failed", "more than max_new_tokens"),
    (_Abort(), "aborted", "aborted"),
])
def test_policy_problems_become_statuses(renderer, policy, status, reason):
    traj = run(run_episode(ScriptedEnv(), policy, task(), renderer=renderer, max_new_tokens=8))
    assert traj.status == status and reason in traj.reason
    traj.check()
    assert traj.to_slime_sample()["remove_sample"] == (status == "failed")


def test_aborted_generation_keeps_partial_tokens(renderer):
    traj = run(run_episode(ScriptedEnv(), _Abort(), task(), renderer=renderer))
    assert traj.response_ids == [5, 6] and traj.loss_mask == [1, 1]


def test_env_exceptions_become_failed(smollm2_tok, renderer):
    env = ScriptedEnv([[Message("user", "a")]] * 3, fail_at=1)
    traj = run(run_episode(env, ScriptedPolicy(smollm2_tok, ["x"]), task(), renderer=renderer))
    assert traj.status == "failed" and traj.reason == "env.step raised RuntimeError: env exploded at step 1"
    assert "Traceback" in traj.metadata["traceback"]
    assert traj.num_turns == 2
    traj.check()


class _BadEnv(ScriptedEnv):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    async def reset(self, *, seed=None, options=None):
        if self.mode == "reset":
            raise ValueError("no such task")
        if self.mode == "reset-shape":
            return "just text"
        return [Message("user", "q")], {}

    async def step(self, action):
        if self.mode == "reward":
            return [], float("nan"), True, False, {}
        if self.mode == "obs":
            return [{"content": "no role"}], 0.0, False, False, {}
        return [], 0.0, True, False, {}


@pytest.mark.parametrize("mode,reason", [
    ("reset", "env.reset raised ValueError: no such task"),
    ("reset-shape", "must return (messages, info)"),
    ("reward", "reward must be finite"),
    ("obs", "_BadEnv.step observation[0]: chat message has no 'role' field"),
])
def test_env_contract_violations_are_named(smollm2_tok, renderer, mode, reason):
    traj = run(run_episode(_BadEnv(mode), ScriptedPolicy(smollm2_tok, ["x"]), task(), renderer=renderer))
    assert traj.status == "failed" and reason in traj.reason, traj.reason
    traj.check()


def test_mid_turn_insert_continues_the_assistant_turn(smollm2_tok, renderer):
    info = "\n\n<information>Doc 1(Title: Paris) capital of France</information>\n\n"
    env = ScriptedEnv([[Message("assistant", info)]], rewards=[0.0, 1.0])
    policy = ScriptedPolicy(smollm2_tok, ["<search>capital of France</search> trailing", "<answer>Paris</answer>"])
    traj = run(run_episode(env, policy, task(), renderer=renderer, parser="search_r1",
                           sampling_params={"stop": ["</search>"]}))
    assert traj.status == "completed", traj.reason
    assert env.actions[0].tool_calls[0].arguments == {"query": "capital of France"}
    assert env.actions[0].text == "<search>capital of France</search>"  # cut at the stop string, kept
    text = renderer.decode(traj.response_ids)
    assert text == "<search>capital of France</search>" + info + "<answer>Paris</answer><|im_end|>"
    assert [m.role for m in traj.messages] == ["user", "assistant"]
    assert env.actions[1].text == "<answer>Paris</answer>"


def test_stop_token_ids_reach_the_policy(smollm2_tok, renderer):
    policy = RecordingPolicy(ScriptedPolicy(smollm2_tok, ["x"]))
    run(run_episode(ScriptedEnv(), policy, task(), renderer=renderer, sampling_params={"stop_token_ids": [7]}))
    assert set(policy.params[0]["stop_token_ids"]) == {7, *renderer.stop_token_ids}


def test_bad_arguments_raise(smollm2_tok, renderer):
    with pytest.raises(InvalidInput):
        run(run_episode(ScriptedEnv(), ScriptedPolicy(smollm2_tok, ["x"]), task(), renderer=renderer, max_turns=0))
    with pytest.raises(InvalidInput, match="no 'prompt' field"):
        run(run_episode(ScriptedEnv(), ScriptedPolicy(smollm2_tok, ["x"]), {"question": "q"}, renderer=renderer))


def test_task_from_dict_and_chat_prompt(smollm2_tok, renderer):
    chat = {"prompt": [{"role": "system", "content": "sys"}, {"role": "user", "content": "u"}], "label": 3,
            "metadata": {"source": "t"}, "id": 5}
    traj = run(run_episode(ScriptedEnv(), ScriptedPolicy(smollm2_tok, ["x"]), chat, renderer=renderer))
    assert traj.task == Task(prompt=(Message("system", "sys"), Message("user", "u")), label=3,
                             metadata={"source": "t"}, id="5")
    assert renderer.decode(traj.prompt_ids).startswith("<|im_start|>system\nsys<|im_end|>")


def test_empty_observation_starts_a_new_assistant_turn(smollm2_tok, renderer):
    env = ScriptedEnv([[]])
    traj = run(run_episode(env, ScriptedPolicy(smollm2_tok, ["one", "two"]), task(), renderer=renderer))
    assert traj.status == "completed", traj.reason
    assert [m.content for m in traj.messages if m.role == "assistant"] == ["one", "two"]
    assert renderer.decode(traj.response_ids) == "one<|im_end|>\n<|im_start|>assistant\ntwo<|im_end|>"


def test_suspended_time_does_not_count_against_the_deadline(smollm2_tok, renderer):
    from slime_env import Episode

    async def main():
        env = ScriptedEnv([[Message("user", "more")]])
        policy = ScriptedPolicy(smollm2_tok, ["a long reply " * 4, "done"], latency_s=0.2)
        ep = Episode(env, policy, task(), renderer=renderer, deadline_s=1.0, suspend_on_abort=True)
        run = asyncio.create_task(ep.run())
        await asyncio.sleep(0.1)
        await ep.abort()
        assert await run is None and ep.suspended
        await asyncio.sleep(1.2)  # longer than the whole deadline, while suspended
        return await ep.run()

    traj = asyncio.run(main())
    assert traj.status == "completed", traj.reason
    assert traj.metadata["resumed"] == 1
    assert renderer.decode(traj.response_ids).count("a long reply") == 4
    traj.check()


class _Forever:
    """A policy that cannot stop itself (no `abort()`): only cancelling its call ends it."""

    started: asyncio.Event | None = None

    async def generate(self, input_ids, sampling_params):
        self.started.set()
        await asyncio.Event().wait()


def test_abort_of_a_policy_without_abort_cancels_only_the_generation(renderer):
    from slime_env import Episode

    async def main():
        policy = _Forever()
        policy.started = asyncio.Event()
        ep = Episode(ScriptedEnv(), policy, task(), renderer=renderer)
        running = asyncio.create_task(ep.run())
        await policy.started.wait()
        await ep.abort("stop now")
        traj = await running  # the episode's task itself goes on and returns
        assert not running.cancelled() and running.cancelling() == 0
        return traj

    traj = asyncio.run(main())
    assert traj.status == "aborted" and traj.reason == "stop now"


def test_cancelling_the_caller_still_cancels_the_episode(renderer):
    from slime_env import Episode

    async def main():
        policy = _Forever()
        policy.started = asyncio.Event()
        running = asyncio.create_task(Episode(ScriptedEnv(), policy, task(), renderer=renderer).run())
        await policy.started.wait()
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    asyncio.run(main())


def test_episode_seeded_sampling_gives_each_turn_its_own_seed(smollm2_tok):
    """`sampling_seed: "episode"` becomes a number per (episode seed, turn): the same on a rerun, new each turn."""
    import asyncio

    from helpers import RecordingPolicy, ScriptedEnv

    from slime_env import Message, ScriptedPolicy, get_renderer, run_episode

    def run(seed):
        policy = RecordingPolicy(ScriptedPolicy(smollm2_tok, ["a", "b", "c"]))
        env = ScriptedEnv([[Message("user", "go on")], [Message("user", "and")]])
        asyncio.run(run_episode(env, policy, "hi", renderer=get_renderer(smollm2_tok), max_turns=3, seed=seed,
                                sampling_params={"sampling_seed": "episode", "temperature": 1.0}))
        return [p["sampling_seed"] for p in policy.params]

    first, again, other = run(5), run(5), run(6)
    assert first == again and len(set(first)) == 3 and all(isinstance(s, int) for s in first)
    assert set(first).isdisjoint(other)


class _PlannedEnv(ScriptedEnv):
    """Two turns; each episode's length plan (`Env.sampling_params`) comes from its task."""

    async def reset(self, *, seed=None, options=None):
        out = await super().reset(seed=seed, options=options)
        self.sampling_params = self.task_from(options).metadata["plan"]
        return out


def test_an_envs_own_sampling_params_plan_each_episodes_length_on_a_real_model(smollm2_tok, renderer):
    """`Env.sampling_params` set in reset: merged over the run's, its max_new_tokens lowering the per-turn budget, on
    the real SmolLM2 engine: each turn runs to the plan (finish "length") unless the chat template's end of turn comes
    first (ignore_eos ignores the end-of-sequence token alone)."""
    from slime_env.agents import TransformersPolicy, load_default_model

    model, tok = load_default_model()
    policy = RecordingPolicy(TransformersPolicy(model, tok, batching="static"))
    try:
        for plan, want in ((5, 5), (9, 9), (40, 12)):  # the run's budget (12) still bounds a longer plan
            env = _PlannedEnv([[Message("user", "go on")]])
            t = Task(prompt="Count.", metadata={"plan": {"max_new_tokens": plan, "ignore_eos": True}})
            policy.params.clear()
            traj = run(run_episode(env, policy, t, renderer=renderer, max_new_tokens=12,
                                   sampling_params={"temperature": 1.0}))
            assert traj.status == "completed", traj.reason
            lengths = [s.end - s.start for s in traj.spans if s.kind == "generated"]
            for n, reason in zip(lengths, traj.metadata["finish_reasons"]):
                # the end of turn may be the plan's last token itself: then it stops at exactly `want`
                assert (n, reason) == (want, "length") or (n <= want and reason == "stop"), (lengths, traj.metadata)
            assert [(p["max_new_tokens"], p["ignore_eos"], p["temperature"]) for p in policy.params] == \
                [(want, True, 1.0)] * 2
        bad = _PlannedEnv()
        traj = run(run_episode(bad, policy, Task(prompt="x", metadata={"plan": {"max_new_tokens": 0}}),
                               renderer=renderer))
        assert traj.status == "failed" and \
            "_PlannedEnv.sampling_params['max_new_tokens']: expected a positive integer, got 0" in traj.reason
    finally:
        policy.inner.close()


def test_a_wrapper_passes_its_envs_sampling_params_on_or_plans_itself(smollm2_tok, renderer):
    from slime_env.env import Wrapper

    class Planner(Wrapper):
        async def reset(self, *, seed=None, options=None):
            out = await self.env.reset(seed=seed, options=options)
            self.sampling_params = {**self.env.sampling_params, "top_k": 5}
            return out

    t = Task(prompt="x", metadata={"plan": {"max_new_tokens": 3, "ignore_eos": True}})
    for wrapper, want in ((Wrapper, {"max_new_tokens": 3, "ignore_eos": True}),
                          (Planner, {"max_new_tokens": 3, "ignore_eos": True, "top_k": 5})):
        policy = RecordingPolicy(ScriptedPolicy(smollm2_tok, ["ab"]))
        traj = run(run_episode(wrapper(_PlannedEnv()), policy, t, renderer=renderer, max_new_tokens=8))
        assert traj.status == "completed", traj.reason
        assert {k: policy.params[0].get(k) for k in want} == want
