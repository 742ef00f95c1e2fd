"""`slime-env train` on a vision env (issue 56): two GRPO steps of VisualReasoning-v0 on CPU with the embedded engine
(`VisionPolicy`) and the torch trainer, on a tiny random Idefics3 folder; the recorded ledgers hold the images, equal
the processor's own ids, and never train an image token."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slime_env import Trajectory


@pytest.mark.slow
def test_two_cpu_steps_of_a_vision_env_through_slime_env_train(tmp_path):
    from slime_env.agents.vision_models import tiny_idefics3

    model, proc = tiny_idefics3(seed=0)
    folder = tmp_path / "tiny-idefics3"
    model.save_pretrained(str(folder))
    proc.save_pretrained(str(folder))
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
