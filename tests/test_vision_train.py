"""Vision envs end to end (issue 56), on a tiny random Idefics3 folder: two GRPO steps of VisualReasoning-v0 through
`slime-env train` on CPU (embedded `VisionPolicy`, torch trainer) whose recorded ledgers hold the images, equal the
processor's own ids and never train an image token; and `slime-env serve-engine` taking SGLang's `image_data` from
`SGLangPolicy`, driven by the slime plug-in, which fills `Sample.multimodal_inputs` / `multimodal_train_inputs`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import asyncio
from types import SimpleNamespace

import pytest
import torch

from slime_env import Trajectory
from slime_env.integrations import slime as plugin
from helpers import serve_engine
from test_slime_plugin import SAMPLING, Sample, check_invariants


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from slime_env.agents.vision_models import tiny_idefics3

    model, proc = tiny_idefics3(seed=0)
    folder = tmp_path_factory.mktemp("vlm") / "tiny-idefics3"
    model.save_pretrained(str(folder))
    proc.save_pretrained(str(folder))
    return folder, proc


@pytest.mark.slow
def test_two_cpu_steps_of_a_vision_env_through_slime_env_train(tmp_path, tiny_folder):
    folder, proc = tiny_folder
    config = tmp_path / "vlm.yaml"
    config.write_text(f"""
run_dir: {tmp_path / 'run'}
model: {folder}
env: VisualReasoning-v0
env_kwargs: {{image_size: 32}}
train_data: {{generator: "slime_env.envs.vision:visual_tasks", n: 8, seed: 1, kinds: "count,bars", size: 32}}
eval_data: {{}}
steps: 2
prompts_per_step: 2
n_samples_per_prompt: 2
max_turns: 1
max_new_tokens: 6
trainer: {{lr: 1.0e-4, micro_batch_size: 4}}
""")
    out = subprocess.run([sys.executable, "-P", "-m", "slime_env", "train", "--config", str(config)],
                         capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")})
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/tokens" in r]
    assert len(trained) == 2 and all(r["train/tokens"] > 0 for r in trained)
    assert all(abs(r["train/rollout_logprob_gap"]) < 1e-3 for r in trained)  # engine and trainer saw the same pixels
    groups = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    trajs = [Trajectory.from_dict(t) for g in groups for t in g["trajectories"]]
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    assert len(trajs) == 8  # 2 steps x 2 prompts x 2 samples
    for t in trajs:
        t.check()
        assert len(t.vision.images) == 1 and t.vision.arrays["pixel_values"].shape == (1, 1, 3, 32, 32)
        hf = [{"role": m.role, "content": [{"type": "text", "text": p["text"]} if p["type"] == "text"
                                           else {"type": "image", "image": p["image"].pil()} for p in m.parts()]}
              for m in t.messages if m.role != "assistant"]
        ref = proc.apply_chat_template(hf, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert t.prompt_ids == list(ref["input_ids"][0]) and t.prompt_ids.count(image_id) == 4
        assert not any(m for i, m in zip(t.response_ids, t.loss_mask) if i == image_id)


@pytest.mark.slow
def test_serve_engine_takes_image_data_and_the_slime_plugin_fills_multimodal_fields(tiny_folder):
    from slime_env.envs.vision.draw import draw

    folder, proc = tiny_folder
    image, question, answer = draw("count", 4, 32)
    with serve_engine("--model", str(folder), "--max-batch-size", "4") as url:
        host, port = url.removeprefix("http://").split(":")
        args = SimpleNamespace(sglang_router_ip=host, sglang_router_port=int(port), hf_checkpoint=str(folder),
                               rollout_max_response_len=8, rollout_max_context_len=512,
                               slime_env_id="VisualReasoning-v0", slime_env_max_turns=1,
                               slime_env_kwargs={"image_size": 32, "system_prompt": None})
        # slime's VLM sample: a bare image part in the prompt, the picture in multimodal_inputs
        samples = [Sample(group_index=0, index=i, prompt=[{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": question}]}], label=answer, rollout_id=3,
            metadata={"kind": "count", "seed": 4, "size": 32}, multimodal_inputs={"images": [image]})
            for i in range(2)]

        async def main():
            try:
                return await asyncio.gather(*(plugin.generate(args, s, dict(SAMPLING, max_new_tokens=8))
                                              for s in samples))
            finally:
                await plugin.close()
        out = asyncio.run(main())
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    for s in out:
        check_invariants(s)
        assert s.status == Sample.Status.COMPLETED and not s.remove_sample, s.metadata
        assert s.tokens[:-s.response_length].count(image_id) == 4
        assert len(s.multimodal_inputs["images"]) == 1
        pv = s.multimodal_train_inputs["pixel_values"]
        assert isinstance(pv, torch.Tensor) and tuple(pv.shape) == (1, 1, 3, 32, 32)
