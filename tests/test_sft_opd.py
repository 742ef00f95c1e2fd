"""Beyond verifiable rewards: SFT (conversations rendered with every shipped template; the trainer's supervised step;
the warm-up of `slime-env train` and `slime-env sft` on a scripted teacher's successful episodes) and on-policy
distillation (the loss against a hand computation; teachers loaded here or served by a real `serve-engine` that
speaks SGLang's prefill-scoring protocol; tokenizer checks before training)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from helpers import serve_engine, tiny, trajectories  # noqa: E402
from slime_env import get_renderer  # noqa: E402
from slime_env.conversations import Conversation, conversation_trajectory, load_conversations  # noqa: E402
from slime_env.errors import InvalidInput  # noqa: E402
from slime_env.trainers import algorithms as alg  # noqa: E402
from slime_env.trainers.batch import pack  # noqa: E402
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


def _calc_conversation(structured: bool) -> dict:
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7+5"}}</tool_call>'
    first = ({"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12*7+5"}'}}]}
             if structured else {"role": "assistant", "content": call})
    return {"messages": [{"role": "system", "content": "You have a calculator."},
                         {"role": "user", "content": "What is 12 * 7 + 5?"}, first,
                         {"role": "tool", "tool_call_id": "c1", "content": "89"},
                         {"role": "user", "content": "Now say it."},
                         {"role": "assistant", "content": "<answer>89</answer>"}],
            "tools": TOOLS}


# --- conversations as trajectories ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["smollm2", "qwen2.5", "qwen3", "llama3.1", "deepseek_r1"])
def test_a_conversation_trains_only_the_assistant_turns_under_every_shipped_template(family, tokenizers):
    tok = tokenizers[family]
    r = get_renderer(tok)
    structured = family != "smollm2"  # SmolLM2's template has no tool-call rendering: the call is in the content
    t = conversation_trajectory(_calc_conversation(structured), r)
    t.check()
    gen = [s for s in t.spans if s.kind == "generated"]
    assert len(gen) == 2 and t.num_turns == 2
    texts = [tok.decode(t.response_ids[s.start:s.end]) for s in gen]
    eot = tok.convert_ids_to_tokens(r.end_of_turn_id)
    for text in texts:  # each generated turn ends with the end-of-turn token, as a sampled turn does
        assert text.endswith(eot) and text.count(eot) == 1
    assert "12*7+5" in texts[0] and "calculator" in texts[0]
    assert texts[1].replace(eot, "").strip().endswith("<answer>89</answer>")
    masked = tok.decode([i for i, m in zip(t.response_ids, t.loss_mask) if not m])
    assert "89" in masked and "Now say it." in masked  # the tool result and the user turn are never trained on
    assert "Now say it." not in "".join(texts) and "You have a calculator." not in tok.decode(t.prompt_ids[:0])
    # the ledger is the template's own render of the conversation (Qwen3 drops earlier turns' empty <think> blocks
    # when it re-renders history; the ledger keeps what was generated, as in a rollout)
    dicts = Conversation.coerce(_calc_conversation(structured)).messages
    try:
        full = r.render_text(dicts, tools=TOOLS, add_generation_prompt=False)
    except TypeError:  # DeepSeek-R1's template takes the arguments as a JSON string
        dicts = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                         "arguments": json.dumps(c["function"]["arguments"])}}
                                      for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in dicts]
        full = r.render_text(dicts, tools=TOOLS, add_generation_prompt=False)
    if family != "qwen3":
        assert tok.decode(t.prompt_ids + t.response_ids) == full.rstrip("\n")


def test_conversation_errors_name_the_file_line_and_message(tmp_path, smollm2_tok):
    r = get_renderer(smollm2_tok)
    with pytest.raises(InvalidInput, match="does not render tool_calls"):  # never an empty turn learned silently
        conversation_trajectory(_calc_conversation(structured=True), r)
    bad = tmp_path / "data.jsonl"
    rows = [_calc_conversation(False), {"messages": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y",
                                                              "tool_calls": [{"function": {"name": "f",
                                                                                           "arguments": "{oops"}}]}]}]
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(InvalidInput, match=r"data.jsonl:2: no assistant message"):
        load_conversations(bad)
    bad.write_text(json.dumps(rows[2]) + "\n")
    with pytest.raises(InvalidInput, match=r"data.jsonl:1: messages\[1\].tool_calls\[0\].function.arguments"):
        load_conversations(bad)
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(InvalidInput, match=r"data.jsonl:1: messages\[0\]"):
        load_conversations(bad)


# --- the losses -----------------------------------------------------------------------------------------------
def test_sft_loss_and_opd_advantages_equal_hand_computations():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    assert alg.sft_loss(logp, mask).item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert alg.sft_loss(logp, mask, "seq_mean_token_mean").item() == pytest.approx((1.5 + 3.5) / 2)
    teacher = torch.tensor([[-0.5, -2.5, -9.0], [-1.0, -1.0, -1.0]])
    adv = torch.tensor([[0.3, 0.3, 0.0], [0.0, -0.2, -0.2]])
    new, kl = alg.opd_advantages(adv, logp, teacher, mask, coef=2.0)
    want_kl = torch.tensor([[-0.5, 0.5, 0.0], [0.0, -2.0, -3.0]])
    assert torch.allclose(kl, want_kl)
    assert torch.allclose(new, adv - 2.0 * want_kl)


def test_sft_step_is_the_mean_nll_of_the_masked_tokens_and_lowers_it(smollm2_tok):
    model = tiny("llama", seed=3)
    trainer = TorchTrainer(model, TrainerConfig(lr=1e-6, micro_batch_size=3), pad_id=0)
    trajs = trajectories(6, seed=5)
    batch = pack(trajs, group_size=1, pad_id=0)
    with torch.no_grad():
        lp = trainer.logprobs(model, batch)
    want = float(-(lp * batch.loss_mask).sum() / batch.loss_mask.sum())
    before = [g["lr"] for g in trainer.optimizer.param_groups]
    first = trainer.sft_step(trajs, lr=3e-3)
    assert first["sft/loss"] == pytest.approx(want, rel=1e-4)  # micro-batches of 3 reduce exactly to the mean
    assert trainer.step_count == 0 and [g["lr"] for g in trainer.optimizer.param_groups] == before
    losses = [trainer.sft_step(trajs, lr=3e-3)["sft/loss"] for _ in range(15)]
    assert losses[-1] < 0.7 * first["sft/loss"]
    assert trainer.config.loss == "rl" and trainer.sft_steps == 16


def test_opd_moves_the_student_toward_the_teacher_on_its_own_tokens():
    student, teacher = tiny("llama", seed=1), tiny("llama", seed=2)
    # one outcome for all: the env's advantages vanish, distillation is the only signal
    trajs = [replace(t, reward=1.0) for t in trajectories(8, seed=9)]
    tb = pack(trajs, group_size=1, pad_id=0)
    with torch.no_grad():
        t_lp = TorchTrainer(teacher, TrainerConfig(), pad_id=0).logprobs(teacher, tb)
    distilled = [replace(t, metadata={"teacher_logprobs": t_lp[row, -len(t.response_ids):].tolist()})
                 for row, t in enumerate(trajs)]
    trainer = TorchTrainer(student, TrainerConfig(lr=2e-3, opd_coef=1.0, micro_batch_size=8), pad_id=0)

    def reverse_kl() -> float:
        with torch.no_grad():
            s = trainer.logprobs(student, tb)
        return float(((s - t_lp) * tb.loss_mask).sum() / tb.loss_mask.sum())

    start = reverse_kl()
    m = trainer.step(distilled, 1)
    assert m["train/opd/reverse_kl"] == pytest.approx(start, rel=1e-4)  # reported on the pre-update policy
    for _ in range(20):
        trainer.step(distilled, 1)
    assert abs(reverse_kl()) < 0.5 * abs(start)
    with pytest.raises(ValueError, match="teacher's log-probs"):
        trainer.step(trajs, 1)


# --- teachers -------------------------------------------------------------------------------------------------
def test_a_served_teacher_scores_like_the_model_it_serves_and_a_mismatched_one_is_refused(tmp_path, smollm2_tok,
                                                                                           qwen25_tok):
    from slime_env.agents.default_model import default_model_path
    from slime_env.agents.transformers_policy import sequence_logprobs
    from transformers import AutoModelForCausalLM

    from slime_env.trainers.run.teacher import ServerTeacher, annotate

    ids = smollm2_tok.encode("The calculator says 12 * 7 + 5 = 89.", add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(str(default_model_path()), dtype=torch.float32)
    want = sequence_logprobs(model, ids)
    traj = trajectories(1)[0]
    with serve_engine() as url:
        async def go():
            teacher = ServerTeacher(url)
            try:
                got = await teacher.logprobs(ids)
                await teacher.check_tokenizer(smollm2_tok)
                with pytest.raises(InvalidInput, match="tokenizes differently"):
                    await teacher.check_tokenizer(qwen25_tok)
                bad = replace(traj, prompt_ids=[10 ** 9])
                scored = await annotate(teacher, [traj, bad])
                return got, scored
            finally:
                await teacher.close()

        got, scored = asyncio.run(go())
    assert got == pytest.approx(want, abs=2e-3)
    assert len(scored[0].metadata["teacher_logprobs"]) == len(traj.response_ids)
    assert scored[1].status == "failed" and scored[1].reason.startswith("teacher:")  # recorded, not lost


def test_train_configs_for_sft_and_opd_are_checked_by_field(tmp_path):
    from slime_env.trainers.run import TrainConfig

    base = {"env": "Calculator-v0",
            "train_data": {"generator": "slime_env.envs.calculator:calculator_tasks", "n": 4, "seed": 0}}
    with pytest.raises(InvalidInput, match="opd_coef > 0 and a teacher"):
        TrainConfig.from_dict({**base, "trainer": {"opd_coef": 1.0}})
    with pytest.raises(InvalidInput, match="exactly one of 'url'"):
        TrainConfig.from_dict({**base, "trainer": {"opd_coef": 1.0}, "teacher": {"url": "http://x", "model": "m"}})
    with pytest.raises(InvalidInput, match=r"warmup: unknown field\(s\) \['epochs'\]"):
        TrainConfig.from_dict({**base, "warmup": {"steps": 2, "epochs": 1, "data": {"path": "x.jsonl"}}})
    with pytest.raises(InvalidInput, match="warmup.data: give 'path'"):
        TrainConfig.from_dict({**base, "warmup": {"steps": 2, "data": {}}})
    with pytest.raises(InvalidInput, match="needs 'policy'"):
        TrainConfig.from_dict({**base, "warmup": {"steps": 2, "data": {"rollouts": {"n_samples": 2}}}})
    with pytest.raises(InvalidInput, match="loss 'dpo'"):
        TrainConfig.from_dict({**base, "trainer": {"loss": "dpo"}})


# --- evaluation ---------------------------------------------------------------------------------------------
def test_pass_at_k_equals_counting_the_k_subsets_that_hold_a_correct_sample():
    from itertools import combinations

    from slime_env.trainers.run.evaluation import pass_at_k

    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(combinations(samples, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError, match="pass@5 needs at least 5"):
        pass_at_k(4, 1, 5)


def test_set_metrics_count_pass_at_k_majority_votes_and_tool_use():
    from slime_env.trainers.run.evaluation import set_metrics

    base = trajectories(1)[0]

    def ep(answer, ok, calls=0, status="completed"):
        return replace(base, status=status, reward=float(ok),
                       info={"answer": answer, "correct": ok, "tool_stats": {"calculator": {"calls": calls}}})

    groups = [[ep("89", True, 1), ep("88", False), ep("89", True, 1), ep("7", False)],  # majority 89: right
              [ep("5", False), ep("5", False), ep("6", True, 2), ep("x", False, status="failed")],  # majority 5: wrong
              [ep("1", False), ep("2", False), ep("3", False), ep("4", True)]]  # tie: first seen (1) wins: wrong
    m = set_metrics(groups, "eval/s/")
    assert m["eval/s/accuracy"] == pytest.approx(4 / 12)
    assert m["eval/s/pass@1"] == pytest.approx((2 / 4 + 1 / 4 + 1 / 4) / 3)
    assert m["eval/s/pass@4"] == 1.0 and m["eval/s/maj@4"] == pytest.approx(1 / 3)
    assert m["eval/s/pass@2"] == pytest.approx(((1 - 1 / 6) + 0.5 + 0.5) / 3)
    assert m["eval/s/tool_calls_per_episode"] == pytest.approx(4 / 12)
    assert m["eval/s/solved_with_tool"] == pytest.approx(3 / 4) and m["eval/s/failed"] == 1


def test_eval_sets_are_checked_by_field():
    from slime_env.trainers.run import TrainConfig

    base = {"env": "Calculator-v0", "train_data": {"generator": "slime_env.envs.calculator:calculator_tasks", "n": 4}}
    data = {"generator": "slime_env.envs.calculator:calculator_tasks", "n": 4}
    for bad, match in [({"sets": {"a": {"n_samples": 4}}}, r"eval.sets.a: needs 'data'"),
                       ({"sets": {"a": {"data": data, "samples": 4}}}, r"unknown key\(s\) \['samples'\]"),
                       ({"sets": {"a": {"data": data, "n_samples": 4}}}, "at temperature 0 are one greedy answer"),
                       ({"sets": {"a": {"data": data, "env": "Nope-v9"}}}, r"eval.sets.a.env"),
                       ({"sets": {"a": {"data": data}}, "every": 0}, r"eval\.every: expected an integer >= 1, got 0"),
                       ({"held_out": {}}, r"eval: expected \{sets")]:
        with pytest.raises(InvalidInput, match=match):
            TrainConfig.from_dict({**base, "eval": bad})


# --- end to end on the real SmolLM2 ---------------------------------------------------------------------------
def _calc_config(**over) -> dict:
    """examples/calculator_sft_grpo.yaml, shrunk for CI: one RL step, 6 held-out problems, a 4-step warm-up."""
    import yaml

    cfg = yaml.safe_load((Path(__file__).parents[1] / "examples" / "calculator_sft_grpo.yaml").read_text())
    cfg["eval_data"] = {**cfg["eval_data"], "n": 6}
    cfg["warmup"] = {**cfg["warmup"], "steps": 4, "batch_size": 8}
    cfg["warmup"]["data"]["rollouts"]["max_tasks"] = 16
    return {**cfg, "steps": 1, "prompts_per_step": 2, "n_samples_per_prompt": 2, **over}


def test_a_cold_start_warm_up_teaches_the_tool_format_before_rl(tmp_path):
    """examples/calculator_sft_grpo.yaml (shrunk): SmolLM2 never writes a calculator call by itself (held-out 0);
    four SFT steps on a scripted teacher's successful episodes (no held-out problem among them) and it calls the
    tool and answers."""
    from slime_env.trainers.run import TrainConfig, train

    sampled = {"data": {"generator": "slime_env.envs.calculator:calculator_tasks", "n": 3, "seed": 3, "split": "test"},
               "n_samples": 4, "temperature": 1.0}
    cfg = TrainConfig.from_dict(_calc_config(run_dir=str(tmp_path / "run"), eval={"sets": {"sampled": sampled}}))
    logs: list[str] = []
    summary = asyncio.run(train(cfg, log=logs.append))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    warm = next(r for r in rows if "warmup/steps" in r)
    assert warm["warmup/examples"] == 16 and warm["warmup/steps"] == 4
    assert warm["warmup/loss_last"] < warm["warmup/loss_first"]
    sft_rows = [json.loads(line) for line in (tmp_path / "run" / "sft_metrics.jsonl").read_text().splitlines()]
    assert [r["sft_step"] for r in sft_rows] == [1, 2, 3, 4]
    assert summary["first_accuracy"] <= 1 / 6
    assert summary["after_warmup_accuracy"] >= summary["first_accuracy"] + 0.5
    assert warm["eval/tool_calls_per_episode"] >= 0.5
    assert rows[-1]["step"] == 1 and "train/loss" in rows[-1]  # RL went on from the warmed-up weights
    for row in (rows[0], warm, rows[-1]):  # the named set at step 0, after the warm-up and at the last step
        assert {"eval/sampled/pass@1", "eval/sampled/pass@2", "eval/sampled/pass@4",
                "eval/sampled/tool_calls_per_episode"} <= set(row)
        assert row["eval/sampled/pass@1"] == pytest.approx(row["eval/sampled/accuracy"])
        assert row["eval/sampled/pass@1"] <= row["eval/sampled/pass@2"] <= row["eval/sampled/pass@4"]
    assert "eval/sampled/maj@4" in warm  # answers once it answers: the majority vote is counted
    assert any("sampled " in line and "pass@4" in line for line in logs)


def test_a_served_teacher_plays_the_warm_up_and_only_successes_are_kept(tmp_path):
    """`policy: {url}`: episodes played by a model behind a real SGLang-protocol server (serve-engine); SmolLM2 never
    solves Calculator-v0 by itself, so rejection sampling keeps nothing and says so, with the statuses it saw."""
    from slime_env.trainers.run import TrainConfig, train

    with serve_engine() as url:
        cfg = _calc_config(run_dir=str(tmp_path / "run"), eval_data={})
        cfg["warmup"]["data"]["rollouts"] = {"policy": {"url": url}, "max_tasks": 3}
        with pytest.raises(InvalidInput, match=r"none of 3 teacher episodes completed with reward >= 1.0") as e:
            asyncio.run(train(TrainConfig.from_dict(cfg), log=lambda _: None))
    assert "'failed'" not in str(e.value)  # they were played by the server, not lost on the way
    with pytest.raises(InvalidInput, match=r"rollouts.policy: 'module:function', 'engine' or \{url: ...\}"):
        TrainConfig.from_dict({**cfg, "warmup": {**cfg["warmup"], "data": {"rollouts": {"policy": {"host": "x"}}}}})


def test_slime_env_sft_saves_a_model_folder_a_later_run_loads(tmp_path, smollm2_tok):
    import yaml

    cfg = _calc_config(run_dir=str(tmp_path / "sft"), eval_data={})
    cfg["warmup"]["steps"] = 2
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "slime_env", "sft", "--config", str(tmp_path / "sft.yaml")],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    model_dir = tmp_path / "sft" / "checkpoints" / "sft" / "model"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.get_vocab() == smollm2_tok.get_vocab() and tok.chat_template == smollm2_tok.chat_template
    assert not math.isnan(float(next(model.parameters()).detach().sum()))
    bad = {k: v for k, v in cfg.items() if k != "warmup"}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    out = subprocess.run([sys.executable, "-m", "slime_env", "sft", "--config", str(tmp_path / "bad.yaml")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1 and "needs a warmup section" in out.stderr


@pytest.mark.timeout(1200)  # ~4 min alone on two cores; a busy machine took it past the suite's 600 s
def test_a_cold_start_warm_up_teaches_search_r1_on_topics_never_trained_on(tmp_path):
    """examples/search_sft_grpo.yaml (shrunk): SmolLM2 does not search-then-answer by itself; a few SFT steps on the
    scripted searcher's successful episodes and it searches and answers held-out questions whose answers (reference
    topics) no training question has — read from the retrieved passages, not remembered."""
    import yaml

    from slime_env.trainers.run import TrainConfig, train

    cfg = yaml.safe_load((Path(__file__).parents[1] / "examples" / "search_sft_grpo.yaml").read_text())
    cfg["eval_data"] = {**cfg["eval_data"], "n": 6}
    cfg["warmup"] = {**cfg["warmup"], "steps": 5, "batch_size": 8}
    cfg["warmup"]["data"]["rollouts"]["max_tasks"] = 24
    # two passages per search instead of three (the answer is still one title among those returned): a fifth fewer
    # tokens in every SFT step and evaluation, the bulk of this test's minutes (held-out accuracy 0 -> 0.83 here)
    cfg["env_kwargs"] = {**cfg.get("env_kwargs", {}), "topk": 2}
    # two turns are all a search-then-answer takes; two rows per micro-batch keep the CPU run's memory small
    cfg.update(run_dir=str(tmp_path / "run"), steps=1, prompts_per_step=2, n_samples_per_prompt=2, max_turns=2,
               trainer={**cfg["trainer"], "micro_batch_size": 2})
    summary = asyncio.run(train(TrainConfig.from_dict(cfg), log=lambda _: None))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    warm = next(r for r in rows if "warmup/steps" in r)
    assert warm["warmup/examples"] >= 16  # the teacher's misses are dropped, not trained on
    assert summary["first_accuracy"] <= 1 / 6
    assert summary["after_warmup_accuracy"] >= summary["first_accuracy"] + 0.5
    assert warm["eval/tool_calls_per_episode"] >= 0.8 and warm["eval/solved_with_tool"] == 1.0
    assert rows[-1]["step"] == 1 and "train/loss" in rows[-1]


def test_sft_with_lora_on_trainer_ranks_in_child_processes_leaves_the_merged_model_folder(tmp_path):
    """`slime-env sft` with LoRA and `cluster.backend: process`: the rank in its child process writes the merged
    model folder beside the adapter (before, only a trainer in the run's own process did), and it is the base weights
    with the adapter folded in: only the adapted projections differ from the base."""
    import torch
    from safetensors.torch import load_file

    from slime_env.trainers.run import TrainConfig, train
    from slime_env.trainers.run.engines import resolve_model_path
    from slime_env.trainers.torch_trainer import read_hf_weights

    cfg = _calc_config(run_dir=str(tmp_path / "sft"), eval_data={}, cluster={"backend": "process"},
                       engine={"kind": "serve", "count": 1, "device": "cpu"})
    cfg["warmup"] = {**cfg["warmup"], "steps": 1, "batch_size": 4}
    cfg["warmup"]["data"]["rollouts"]["max_tasks"] = 4
    cfg["trainer"] = {**cfg["trainer"], "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
    summary = asyncio.run(train(TrainConfig.from_dict(cfg), log=lambda _: None, sft_only=True))
    where = tmp_path / "sft" / "checkpoints" / "sft"
    assert summary["model"] == str(where / "model")
    merged = read_hf_weights(where / "model")
    adapter = load_file(str(next((where / "adapter").glob("*.safetensors"))))
    assert any("q_proj" in k for k in adapter) and not any("lora" in k for k in merged)
    base = read_hf_weights(resolve_model_path("default"))
    changed = {k for k in merged if not torch.equal(merged[k].float(), base[k].float())}
    assert changed and all(("q_proj" in k or "v_proj" in k) for k in changed), sorted(changed)[:5]
