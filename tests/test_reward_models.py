"""Learned rewards (slime_env.trainers.run.reward_models): a classifier RM loaded here (batched forwards equal
one-at-a-time ones), slime's remote_rm protocol against a real HTTP server on 127.0.0.1 (scores, 5xx retries, timeouts),
a generative judge on an engine, the combination with the env's reward, failures recorded as failed episodes, config
errors by field, and a GRPO step of `slime-env train` whose rewards come from a classifier RM."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from aiohttp import web  # noqa: E402
from helpers import trajectories  # noqa: E402
from slime_env import Message, ScriptedPolicy, get_renderer  # noqa: E402
from slime_env.errors import InvalidInput  # noqa: E402
from slime_env.trainers.run.reward_models import (  # noqa: E402
    ClassifierRM,
    JudgeRM,
    RemoteRM,
    RewardInput,
    apply_rewards,
    check_spec,
    slime_reward,
)


def _episodes(n: int) -> list:
    out = []
    for i, t in enumerate(trajectories(n, seed=4)):
        answer = "<answer>%d</answer>" % (i * 7) if i % 2 else "I do not know."
        out.append(replace(t, response_text=answer, reward=float(i % 2), turn_rewards=[0.0, float(i % 2)],
                           messages=[Message("user", f"What is {i} * 7?"), Message("assistant", answer)]))
    return out


def _classifier(tmp_path, tok, *, seq_cls: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = (LlamaForSequenceClassification if seq_cls else LlamaForCausalLM)(cfg)
    path = tmp_path / ("rm" if seq_cls else "lm")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_a_classifier_rm_batches_concurrent_episodes_and_scores_as_one_at_a_time(tmp_path, smollm2_tok):
    rm = ClassifierRM(_classifier(tmp_path, smollm2_tok), device="cpu", batch_size=4)
    eps = _episodes(10)

    xs = [RewardInput.of_trajectory(t) for t in eps]

    async def go():
        return await asyncio.gather(*(rm.score(x) for x in xs))

    batched = asyncio.run(go())
    assert rm.forwards == 3  # 10 concurrent episodes in batches of 4
    alone = [rm._forward([rm.text(x)])[0] for x in xs]
    assert batched == pytest.approx(alone, abs=1e-4)
    assert len(set(round(s, 5) for s in batched)) > 1  # different conversations, different scores
    assert "<answer>7</answer>" in rm.text(xs[1]) and "<|im_start|>user" in rm.text(xs[1])  # the RM's template
    with pytest.raises(InvalidInput, match="not a one-label sequence-classification"):
        ClassifierRM(_classifier(tmp_path, smollm2_tok, seq_cls=False), device="cpu")


def test_rewards_combine_with_the_env_and_failures_are_recorded(tmp_path):
    class Fixed:
        async def score(self, x):
            if "know" in x.response:
                raise TimeoutError("scorer timed out")
            return 0.25

    eps = _episodes(4)
    eps[3] = replace(eps[3], status="failed", reason="env crashed")
    out = asyncio.run(apply_rewards(Fixed(), eps, weight=2.0, env_weight=0.5))
    assert out[1].reward == pytest.approx(0.5 * 1.0 + 2.0 * 0.25) and out[1].info["rm_score"] == 0.25
    assert out[1].turn_rewards == pytest.approx([0.0, 0.5 + 0.5]) and out[1].metadata["env_reward"] == 1.0
    assert out[0].status == "failed" and out[0].reason == "reward model: TimeoutError: scorer timed out"
    assert out[3] is eps[3]  # failed episodes are not scored


class _RMServer:
    """A real HTTP reward server on 127.0.0.1 speaking slime's remote_rm protocol."""

    def __init__(self):
        self.bodies, self.failures = [], 0

    async def score(self, request):
        body = await request.json()
        self.bodies.append(body)
        return web.json_response({"reward": len(body["response"]) / 100})

    async def flaky(self, request):
        self.failures += 1
        if self.failures <= 2:
            return web.Response(status=503, text="warming up")
        return web.json_response(0.5)

    async def broken(self, request):
        return web.Response(status=500, text="out of memory")

    async def slow(self, request):
        await asyncio.sleep(5)
        return web.json_response(1.0)

    async def text(self, request):
        return web.json_response({"verdict": "good"})


def test_slime_remote_rm_protocol_against_a_real_server():
    server = _RMServer()

    async def go():
        app = web.Application()
        for name in ("score", "flaky", "broken", "slow", "text"):
            app.router.add_post(f"/{name}", getattr(server, name))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        eps = _episodes(3)
        try:
            rms = {n: RemoteRM(f"{base}/{n}", timeout_s=0.5, retries=2) for n in ("score", "flaky", "broken",
                                                                                     "slow", "text")}
            out = {n: await apply_rewards(rm, eps[:2] if n != "score" else eps) for n, rm in rms.items()}
            for rm in rms.values():
                await rm.close()
            return out
        finally:
            await runner.cleanup()

    out = asyncio.run(go())
    assert [t.info["rm_score"] for t in out["score"]] == [len(t.response_text) / 100 for t in _episodes(3)]
    assert server.bodies[1] == {"prompt": "p", "response": "<answer>7</answer>", "label": None}
    assert all(t.status == "completed" and t.info["rm_score"] == 0.5 for t in out["flaky"])  # retried past the 503s
    assert all(t.status == "failed" and "answered 500" in t.reason for t in out["broken"])
    assert all(t.status == "failed" and t.reason.startswith("reward model:") for t in out["slow"])
    assert all(t.status == "failed" and "expected a number" in t.reason for t in out["text"])


def test_a_judge_reads_its_verdict_and_a_missing_verdict_fails_the_episode(smollm2_tok):
    r = get_renderer(smollm2_tok)
    seen = []

    def judge(context: str) -> str:
        seen.append(context)
        return "The answer is right. Score: 7/10" if "<answer>" in context else "I cannot tell."

    rm = JudgeRM(ScriptedPolicy(smollm2_tok, judge), r, prompt="Q: {question}\nA: {response}\nRate 0-10.",
                 pattern=r"Score:\s*(\d+)", scale=10)
    out = asyncio.run(apply_rewards(rm, _episodes(2)))
    assert out[1].info["rm_score"] == pytest.approx(0.7) and out[1].reward == pytest.approx(1.7)
    assert out[0].status == "failed" and "no verdict" in out[0].reason
    assert any("Q: p\nA: <answer>7</answer>" in c for c in seen)


def test_slime_reward_combines_the_plugin_reward_with_the_rm_and_removes_what_it_cannot_score():
    class Args:
        slime_env_reward = {"kind": "judge", "url": "http://127.0.0.1:1", "prompt": "{question}|{response}",
                            "pattern": r"(\d+)", "weight": 0.5, "env_weight": 2.0}

    class Sample:
        def __init__(self, response, reward):
            self.prompt, self.label, self.response, self.reward = "What is 2 + 2?", 4, response, reward
            self.metadata, self.remove_sample, self.loss_mask = {"slime_env": {"reward": reward}}, False, [1, 1, 0]

    import slime_env.trainers.run.reward_models as rms

    class Judge:  # the judge server's verdicts, as JudgeRM parses them; the plug-in path is what is tested here
        async def score(self, x):
            if "no idea" in x.response:
                raise ValueError("no verdict")
            assert x.question == "What is 2 + 2?" and x.messages[-1] == {"role": "assistant", "content": x.response}
            return 6.0

    key = json.dumps(Args.slime_env_reward, sort_keys=True)
    rms._SLIME_RMS[key] = Judge()
    try:
        good, bad = Sample("<answer>4</answer>", 1.0), Sample("no idea", 0.0)
        got = asyncio.run(slime_reward(Args(), [good, bad]))
    finally:
        rms._SLIME_RMS.pop(key)
    assert got == [2.0 * 1.0 + 0.5 * 6.0, 0.0]
    assert good.metadata["slime_env"]["rm_score"] == 6.0 and good.metadata["slime_env"]["env_reward"] == 1.0
    assert bad.remove_sample and bad.loss_mask == [0, 0, 0] and bad.reward == 0.0
    assert bad.metadata["slime_env"]["status_reason"] == "reward model: ValueError: no verdict"

    class NoUrl:
        slime_env_reward = {"kind": "judge", "prompt": "{question}", "pattern": r"(\d+)"}

    with pytest.raises(InvalidInput, match="a judge in slime needs its 'url'"):
        asyncio.run(slime_reward(NoUrl(), Sample("x", 0.0)))


@pytest.mark.parametrize("spec, match", [
    ({"kind": "oracle"}, r"reward.kind: one of"),
    ({"kind": "classifier"}, r"needs \['model'\]"),
    ({"kind": "remote", "url": "http://x", "model": "m"}, r"unknown field\(s\) \['model'\]"),
    ({"kind": "judge", "prompt": "{question}", "pattern": r"\d+"}, "exactly one group"),
    ({"kind": "judge", "prompt": "{answer}", "pattern": r"(\d+)"}, r"reward.prompt: a template"),
    ({"kind": "judge", "prompt": "x", "pattern": r"(\d+"}, "not a regular expression"),
])
def test_reward_configs_are_checked_by_field(spec, match):
    with pytest.raises(InvalidInput, match=match):
        check_spec(spec)


def test_a_grpo_step_trains_on_classifier_rm_rewards(tmp_path, smollm2_tok):
    from slime_env.trainers.run import TrainConfig, train

    base = {"model": "default", "env": "Calculator-v0",
            "train_data": {"generator": "slime_env.envs.calculator:calculator_tasks", "n": 8, "seed": 1,
                           "split": "train"},
            "steps": 1, "prompts_per_step": 2, "n_samples_per_prompt": 2, "max_turns": 1, "max_new_tokens": 12,
            "trainer": {"lr": 1e-6, "micro_batch_size": 8}}
    rm = {"kind": "classifier", "model": _classifier(tmp_path, smollm2_tok), "device": "cpu", "weight": 1.0,
          "env_weight": 0.0}
    asyncio.run(train(TrainConfig.from_dict({**base, "run_dir": str(tmp_path / "run"), "reward": rm}),
                      log=lambda _: None))
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["reward/scored"] == 4 and row["reward/env_reward_mean"] == 0.0
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    rewards = [t["reward"] for g in samples for t in g["trajectories"]]
    scores = [t["info"]["rm_score"] for g in samples for t in g["trajectories"]]
    assert rewards == pytest.approx(scores)  # env_weight 0: the RM's score is the whole reward, as trained on
    assert row["train/reward_mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-5)
    not_rm = {**rm, "model": _classifier(tmp_path, smollm2_tok, seq_cls=False)}
    with pytest.raises(InvalidInput, match="not a one-label"):  # before any rollout
        asyncio.run(train(TrainConfig.from_dict({**base, "run_dir": str(tmp_path / "x"), "reward": not_rm}),
                          log=lambda _: None))
