"""Asynchronous training on one GPU (run on the GPU machine): the paged engine generates on its own CUDA stream while
the trainer's thread trains on the default one. After every step of an `overlap` and a `full` run the engine's
weights are exactly the trainer's (cast to the engine's bf16), every batch is as stale as its mode says, and the
engine's greedy tokens after the run equal the model's own forward on those weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from slime_env.trainers.run import TrainConfig, train


@pytest.mark.parametrize("mode", ["overlap", "full"])
def test_async_on_one_gpu_keeps_the_engine_on_the_trainers_weights(tmp_path, model_folder, mode):
    checked = []

    def check(step, engines, trainer):
        policy = engines.policy
        assert policy.paged and policy.weight_version == str(step)
        engine_params = dict(policy.model.named_parameters())
        for name, t in trainer.weights().items():
            if name in engine_params:
                assert torch.equal(engine_params[name].detach(), t.detach().to(engine_params[name].dtype)), name
        checked.append(step)

    cfg = TrainConfig.from_dict({
        "run_dir": str(tmp_path / "run"), "model": model_folder, "env": "ArithmeticRetry-v0",
        "env_kwargs": {"digits": [2, 1], "ops": "+-", "max_attempts": 3}, "max_turns": 3,
        "train_data": {"generator": "slime_env.envs.math.retry_env:arithmetic_tasks", "digits": [2, 1], "ops": "+-",
                       "size": 256, "seed": 11, "split": "train"},
        "steps": 4, "prompts_per_step": 8, "n_samples_per_prompt": 4, "max_new_tokens": 16, "eval_every": 100,
        "max_concurrency": 64, "device": "cuda", "engine": {"kind": "embedded"},  # async on a GPU: serve unless named
        "trainer": {"lr": 1e-4, "micro_batch_size": 16}, "async": {"mode": mode, "in_flight": 64}})
    asyncio.run(train(cfg, on_step=check, log=print))
    assert checked == [1, 2, 3, 4]
    import json

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["async/staleness_max"] <= 1 for r in rows if r["step"] > 0)
    if mode == "overlap":
        assert [r["async/staleness_max"] for r in rows if r["step"] > 0] == [0.0, 1.0, 1.0, 1.0]


def test_paged_engine_on_its_stream_is_exact_beside_a_busy_default_stream(model_folder):
    """Greedy tokens of the engine while another thread keeps the default stream busy with matmuls equal the model's
    own forward (the engine's stream must not read half-written inputs or race the other thread's memory)."""
    import threading

    from slime_env.agents.policy_loader import load_policy

    policy, _ = load_policy(model_folder, max_batch_size=16, device="cuda", dtype="bfloat16", seed=0)
    stop = threading.Event()

    def busy() -> None:
        a = torch.randn(4096, 4096, device="cuda")
        while not stop.is_set():
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()

    worker = threading.Thread(target=busy)
    worker.start()
    try:
        prompts = [[1 + (7 * i + j) % 500 for j in range(5 + 3 * i)] for i in range(12)]

        async def run():
            return await asyncio.gather(*(policy.generate(p, {"temperature": 0.0, "max_new_tokens": 12})
                                          for p in prompts))

        gens = asyncio.run(run())
    finally:
        stop.set()
        worker.join()
    model = policy.model
    exact = total = 0
    for p, g in zip(prompts, gens):  # teacher-forced: each engine token against the model's own logits there
        ids = torch.tensor([p + list(g.token_ids)], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, len(p) - 1:-1].float()
        got = torch.tensor(g.token_ids, device="cuda")
        gap = logits.max(-1).values - logits.gather(-1, got[:, None])[:, 0]
        assert float(gap.max()) < 0.25, (p, g.token_ids, gap.tolist())  # bf16 near-ties at most
        exact += int((gap == 0).sum())
        total += len(g.token_ids)
    assert exact >= 0.9 * total
    policy.close()
