"""Images in the token ledger (issue 56): validation, renderers equal to transformers' own processors (Idefics3 /
SmolVLM, Qwen2.5-VL, Qwen3-VL), the embedded engine generating with pixels, the torch trainer's log-probs with the same
pixels, the prefix cache keyed by image content, a multi-turn episode whose tool returns an image, the slime export.
Models are tiny and random (agents/vision_models.py); `test_vision_train.py` runs `slime-env train`."""

from __future__ import annotations

import asyncio
import io
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

import slime_env
from slime_env import InvalidInput, Message, ScriptedPolicy, Trajectory, run_episode
from slime_env.agents.vision_models import qwen_vl_processor, smolvlm_processor, tiny_idefics3
from slime_env.agents.vision_policy import VisionPolicy
from slime_env.envs.vision import visual_tasks
from slime_env.envs.vision.draw import search_scene
from slime_env.images import ImagePart
from slime_env.renderers import get_renderer
from slime_env.renderers.vision import Idefics3Renderer, QwenVLRenderer
from slime_env.trainers.batch import pack
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig


def _img(seed: int, h: int = 40, w: int = 50) -> np.ndarray:
    return (np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")


@pytest.fixture(scope="module")
def tiny():
    model, proc = tiny_idefics3(seed=0)
    return model, proc, Idefics3Renderer(proc)


@pytest.fixture(scope="module")
def engine(tiny):
    import copy

    model, proc, _ = tiny
    policy = VisionPolicy(copy.deepcopy(model), proc, seed=0)
    yield policy
    policy.close()


def _hf(messages: list[Message]) -> list[dict]:
    """The messages as transformers' processors take them (PIL images in the parts)."""
    out = []
    for m in messages:
        parts = [{"type": "text", "text": p["text"]} if p["type"] == "text"
                 else {"type": "image", "image": p["image"].pil()} for p in m.parts()]
        out.append({"role": m.role, "content": parts})
    return out


def test_image_parts_are_validated_and_named(tmp_path, smollm2_tok):
    arr = _img(0)
    path = tmp_path / "a.png"
    Image.fromarray(arr).save(path)
    parts = [ImagePart.coerce(x) for x in (arr, Image.fromarray(arr), str(path), path.read_bytes())]
    assert len({p.sha256 for p in parts}) == 1 and parts[0].width == 50 and parts[0].height == 40
    assert ImagePart.coerce(parts[0].data_url()) == parts[0]
    with pytest.raises(InvalidInput, match=r"message \(user\) content\[1\]: an image array must be uint8"):
        Message("user", ["look", arr.astype("float32")])
    with pytest.raises(InvalidInput, match="no image file at"):
        Message("user", [{"type": "image", "image": str(tmp_path / "missing.png")}])
    with pytest.raises(InvalidInput, match=r"content\[0\]: cannot decode image"):
        Message("user", [b"not a png"])
    with pytest.raises(InvalidInput, match="part type 'audio'"):
        Message("user", [{"type": "audio"}])
    big = io.BytesIO()
    Image.new("RGB", (5000, 4000)).save(big, format="PNG")
    with pytest.raises(InvalidInput, match="over 16777216"):
        ImagePart.coerce(big.getvalue(), "task.image")
    m = Message("tool", ["cell:", arr, "end"])
    assert Message.coerce(m.to_dict()) == m and m.images == (parts[0],)
    with pytest.raises(InvalidInput, match="message 1 holds an image, but the chatml renderer renders text only"):
        get_renderer(smollm2_tok).render_prompt([Message("system", "s"), m])


def test_idefics3_renderer_equals_the_processor_prompt_bridge_and_full_render(tiny):
    _, proc, r = tiny
    a, b = _img(1), _img(2, 30, 20)
    prompt = [Message("system", "Be brief."), Message("user", [a, "How many circles?"])]
    ids = r.render_prompt(prompt)
    ref = proc.apply_chat_template(_hf(prompt), add_generation_prompt=True, tokenize=True, return_dict=True,
                                   return_tensors="np")
    assert ids == ref["input_ids"][0].tolist()
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_id) == 4  # (32/8)^2 / 2^2
    gen = r.encode(" 3") + [r.end_of_turn_id]
    obs = [Message("tool", ["zoomed:", b])]
    bridge = r.bridge(gen, obs, prompt + [Message("assistant", " 3")])
    full = prompt + [Message("assistant", " 3")] + obs
    ref = proc.apply_chat_template(_hf(prompt) + [{"role": "assistant", "content": [{"type": "text", "text": "3"}]}]
                                   + _hf(obs), add_generation_prompt=True, tokenize=True, return_dict=True,
                                   return_tensors="np")
    assert ids + gen + bridge == ref["input_ids"][0].tolist()
    assert r.check_full(full, ids + gen + bridge) is None
    vision = r.image_inputs([*prompt[1].images, *obs[0].images])
    assert np.array_equal(vision.arrays["pixel_values"], ref["pixel_values"])
    assert vision.tokens == (7, 7)  # <fake><global-img> 4 x <image> <fake>


def test_idefics3_renderer_with_image_splitting_equals_the_processor():
    proc = smolvlm_processor(image_size=32, image_seq_len=4, splitting=True)
    r = Idefics3Renderer(proc)
    msgs = [Message("user", [_img(3, 70, 100), "Read it.", _img(4, 20, 20)])]
    ref = proc.apply_chat_template(_hf(msgs), add_generation_prompt=True, tokenize=True, return_dict=True,
                                   return_tensors="np")
    assert r.render_prompt(msgs) == ref["input_ids"][0].tolist()
    assert "<row_2_col_3>" in r.decode(r.render_prompt(msgs))


@pytest.mark.parametrize("version", ["2.5", "3"])
def test_qwen_vl_renderers_equal_the_processor(version):
    proc = qwen_vl_processor(version)
    r = get_renderer(proc)
    assert isinstance(r, QwenVLRenderer)
    prompt = [Message("user", [_img(5, 56, 84), "Compare", _img(6, 112, 56)])]
    ids = r.render_prompt(prompt)
    ref = proc.apply_chat_template(_hf(prompt), add_generation_prompt=True, tokenize=True, return_dict=True,
                                   return_tensors="np")
    assert ids == ref["input_ids"][0].tolist()
    gen = r.encode("Left.") + [r.end_of_turn_id]
    obs = [Message("user", [_img(7, 28, 28), "and this?"])]
    bridge = r.bridge(gen, obs, prompt + [Message("assistant", "Left.")])
    full = _hf(prompt) + [{"role": "assistant", "content": "Left."}] + _hf(obs)
    ref = proc.apply_chat_template(full, add_generation_prompt=True, tokenize=True, return_dict=True,
                                   return_tensors="np")
    assert ids + gen + bridge == ref["input_ids"][0].tolist()
    vision = r.image_inputs([*prompt[0].images, *obs[0].images])
    assert np.array_equal(vision.arrays["image_grid_thw"], ref["image_grid_thw"])
    assert np.allclose(vision.arrays["pixel_values"], ref["pixel_values"])
    pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert sum(vision.tokens) == ref["input_ids"][0].tolist().count(pad)


def _episodes(policy, renderer, n=2, seed=1):
    tasks = visual_tasks(n, seed=seed, kinds="count,bars", size=32)

    async def go():
        return [await run_episode(slime_env.make("VisualReasoning-v0", image_size=32), policy, task,
                                  renderer=renderer, max_new_tokens=6, strict=True,
                                  sampling_params={"temperature": 1.0}) for task in tasks]
    return asyncio.run(go())


def test_engine_and_trainer_log_probs_agree_on_the_same_images(tiny, engine):
    model, proc, r = tiny
    trajs = _episodes(engine, r)
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    for t in trajs:
        t.check()
        assert t.status == "completed" and t.vision is not None and len(t.vision.images) == 1
        assert image_id in t.prompt_ids and image_id not in [i for i, m in zip(t.response_ids, t.loss_mask) if m]
    trainer = TorchTrainer(model, TrainerConfig(), pad_id=proc.tokenizer.pad_token_id)
    batch = pack(trajs, group_size=2, pad_id=proc.tokenizer.pad_token_id)
    assert batch.vision["pixel_values"].shape == (2, 1, 3, 32, 32)
    with torch.no_grad():
        lp = trainer.logprobs(model.eval(), batch)
    gap = float(((lp - batch.rollout_logprobs).abs() * batch.loss_mask).max())
    assert batch.loss_mask.sum() > 0 and gap < 1e-4, gap
    # other pixels behind the same ids score differently: the images reach the trainer's forward
    mirrored = replace(batch, vision={**batch.vision, "pixel_values": batch.vision["pixel_values"].flip(-1)})
    with torch.no_grad():
        other = trainer.logprobs(model.eval(), mirrored)
    assert float(((other - batch.rollout_logprobs).abs() * batch.loss_mask).max()) > 1e-3


def test_fsdp_trainer_takes_the_pixel_inputs_too(tiny, engine):
    import copy

    import torch.distributed as dist

    from slime_env.trainers.fsdp_trainer import FSDPTrainer

    model, proc, r = tiny
    trajs = _episodes(engine, r, seed=2)
    # a group an earlier module of this worker made (megatron's parallel state holds its subgroups) is left alone:
    # destroying it broke test_ppo's megatron tests after this module ("group is not registered")
    ours = not dist.is_initialized()
    trainer = FSDPTrainer(copy.deepcopy(model), TrainerConfig(backend="fsdp"), pad_id=proc.tokenizer.pad_token_id)
    try:  # one rank (a loopback gloo group): the same forward with the pixels, sharded
        metrics = trainer.step(trajs, 2)
        assert abs(metrics["train/rollout_logprob_gap"]) < 1e-4 and metrics["train/tokens"] > 0
    finally:
        if ours and dist.is_initialized():
            dist.destroy_process_group()


def test_prefix_cache_never_matches_two_images_behind_the_same_ids(tiny, engine):
    _, proc, r = tiny
    a, b = Message("user", [_img(10), "What is it?"]), Message("user", [_img(11), "What is it?"])
    ids_a, ids_b = r.render_prompt([a]), r.render_prompt([b])
    assert ids_a == ids_b  # same size: the same placeholder ids, different pixels
    first = ids_a.index(proc.tokenizer.convert_tokens_to_ids("<image>"))
    greedy = {"max_new_tokens": 4, "temperature": 0.0}

    async def go():
        g1 = await engine.generate(ids_a, greedy, images=a.images, session="s")
        ext = ids_a + list(g1.token_ids)
        again = await engine.generate(ext, greedy, images=a.images, session="s")  # same image: its KV is reused
        ext_b = ids_b + list(g1.token_ids)
        other = await engine.generate(ext_b, greedy, images=b.images, session="s")  # other image, same ids
        fresh = await engine.generate(ext_b, greedy, images=b.images, session="fresh")
        return again, other, fresh
    again, other, fresh = asyncio.run(go())
    assert again.cached_tokens > first + 4
    assert other.cached_tokens <= first  # nothing past the first image token came from image a's KV
    assert other.token_ids == fresh.token_ids and np.allclose(other.logprobs, fresh.logprobs, atol=1e-5)
    with pytest.raises(InvalidInput, match="image tokens but no images were given"):
        asyncio.run(engine.generate(ids_a, greedy))


def test_multi_turn_episode_whose_tool_returns_an_image_is_exact_and_exports_to_slime(tiny):
    _, proc, r = tiny
    env = slime_env.make("VisualSearch-v0", size=128, overview=32)
    task = env.sample_task(random.Random(3))
    _, row, col, digit = search_scene(task.metadata["seed"], 128)
    policy = ScriptedPolicy(proc.tokenizer, [f" <zoom>{row} {col}</zoom>", f" <answer>{digit}</answer>"],
                     end_token_id=r.end_of_turn_id)
    traj = asyncio.run(run_episode(env, policy, task, renderer=r, max_new_tokens=24, max_turns=3, strict=True))
    traj.check()
    assert traj.status == "completed" and traj.reward == 1.0 and traj.num_turns == 2
    assert len(traj.vision.images) == 2 and traj.vision.arrays["pixel_values"].shape[:2] == (1, 2)
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    in_response = [m for i, m in zip(traj.response_ids, traj.loss_mask) if i == image_id]
    assert len(in_response) == 4 and not any(in_response)  # the tool's image: inserted, never trained
    assert "history_rewrites" not in traj.metadata  # strict mode's full render after the zoom agreed, image included
    sample = traj.to_slime_sample()
    assert len(sample["multimodal_inputs"]["images"]) == 2
    assert np.array_equal(sample["multimodal_train_inputs"]["pixel_values"], traj.vision.arrays["pixel_values"])
    back = Trajectory.from_dict(traj.to_dict())
    assert back.vision.images == traj.vision.images and back.messages == traj.messages
    assert np.array_equal(back.vision.arrays["pixel_values"], traj.vision.arrays["pixel_values"])
