"""LoRA (`trainer.lora`): config checks, adapter-only training with the base as reference, PEFT-format checkpoints that
`peft` loads, `slime-env export --merge`, adapter-only weight sync to the embedded engine with the adapter recorded per
generate call."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import pytest
import torch

peft = pytest.importorskip("peft")

from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig  # noqa: E402

from helpers import tiny, trajectories  # noqa: E402

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def lora_trainer(**kw) -> TorchTrainer:
    cfg = TrainerConfig(lr=5e-2, micro_batch_size=4, lora=dict(LORA), **kw)
    return TorchTrainer(tiny("llama"), cfg, pad_id=0)


def test_config_errors_name_the_lora_field(tmp_path):
    from slime_env.errors import InvalidInput
    from slime_env.trainers.run import TrainConfig

    for bad, field in [({"rank": 0}, "lora.rank"), ({"alpha": -1}, "lora.alpha"), ({"dropout": 1.5}, "lora.dropout"),
                       ({"target_modules": []}, "lora.target_modules"), ({"ranks": 4}, "lora.ranks"),
                       ({"sync": "bytes"}, "lora.sync"), ({"name": "a@b"}, "lora.name")]:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            TrainerConfig(lora=bad)
    with pytest.raises(ValueError, match="lora with estimator: ppo"):
        TrainerConfig(lora={}, estimator="ppo")
    with pytest.raises(ValueError, match="lora with estimator: ppo"):  # FSDP offers no critic either way
        TrainerConfig(lora={}, backend="fsdp", estimator="ppo")
    assert TrainerConfig(lora={}, backend="fsdp").lora.rank == 8  # built: tests/test_fsdp_lora.py
    assert TrainerConfig(lora={}, backend="megatron").lora.rank == 8  # built: tests/test_megatron_lora.py
    assert TrainerConfig(lora=None).lora is None and TrainerConfig(lora=True).lora.rank == 8
    config = tmp_path / "bad.yaml"
    config.write_text("trainer: {lora: {rank: -2}}\n")
    with pytest.raises(InvalidInput, match=r"trainer: lora\.rank must be an integer >= 1, got -2"):
        TrainConfig.from_yaml(config).sections
    with pytest.raises(ValueError, match=r"lora\.target_modules \['nope_proj'\]"):
        TorchTrainer(tiny("llama"), TrainerConfig(lora={"target_modules": ["nope_proj"]}), pad_id=0)


def test_a_target_module_typo_is_refused_before_the_run_starts(tmp_path):
    """`trainer.lora.target_modules` with a typo next to a real name: refused by name (with the nearest layer) before
    the run folder is written or the model loaded, its layer names read from the model's config on the meta device
    (before: the run started, wrote config.json, and failed after the model load with a traceback; a list with one
    typo among real names would have trained the others silently)."""
    from slime_env.errors import InvalidInput
    from slime_env.trainers.run import TrainConfig, train

    run_dir = tmp_path / "run"
    cfg = TrainConfig.from_dict({"model": "default", "env": "Calculator-v0", "steps": 1, "run_dir": str(run_dir),
                                 "train_data": {"generator": "slime_env.envs.calculator:calculator_tasks", "n": 4},
                                 "trainer": {"lora": {"rank": 4, "target_modules": ["q_proj", "v_prj"]}}})
    with pytest.raises(InvalidInput, match=r"^trainer\.lora\.target_modules: 'v_prj' is not a layer of model "
                                           r"'default'; did you mean 'v_proj'\? \(its layers: \[.*'q_proj'"):
        asyncio.run(train(cfg, log=lambda _: None))
    assert not run_dir.exists()
    cfg.sections.trainer.lora.target_modules = ["q_proj", "model.layers.0.mlp.up_proj", "all"]
    with pytest.raises(InvalidInput, match=r"'all' is not a layer"):
        asyncio.run(train(cfg, log=lambda _: None))


def test_only_the_adapter_trains_and_the_reference_is_the_base_model():
    trainer = lora_trainer(kl_coef=0.1)
    base_before = {k: v.clone() for k, v in trainer.model.get_base_model().state_dict().items() if ".lora_" not in k}
    in_optimizer = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert in_optimizer and all(".lora_" in names[id(p)] for p in in_optimizer)
    assert trainer.ref_model is None  # no second copy of the weights: the reference is the adapter switched off
    n_adapter = sum(p.numel() for p in in_optimizer)
    assert n_adapter < 0.1 * sum(p.numel() for p in trainer.model.parameters())

    from slime_env.trainers.batch import pack

    trajs = trajectories(8, seed=1)
    batch = pack(trajs, group_size=4, pad_id=0)
    ref0 = trainer.backend.reference_logprobs(batch)
    for _ in range(2):
        metrics = trainer.step(trajs, group_size=4)
    assert metrics["train/kl"] > 0  # the policy moved away from the reference
    after = {k: v for k, v in trainer.model.get_base_model().state_dict().items() if ".lora_" not in k}
    assert all(torch.equal(base_before[k], after[k]) for k in base_before)  # the base never moves
    assert torch.allclose(trainer.backend.reference_logprobs(batch), ref0)  # the reference stays the base model
    policy_lp = trainer.backend.frozen_logprobs(trainer.model, batch)
    assert not torch.allclose(policy_lp, ref0)  # the adapter changed the policy
    # the reference equals a separate base model's log-probs
    plain = TorchTrainer(tiny("llama"), TrainerConfig(micro_batch_size=4), pad_id=0)
    assert torch.allclose(plain.backend.frozen_logprobs(plain.model, batch), ref0, atol=1e-5)


def test_checkpoint_is_the_adapter_alone_in_peft_format(tmp_path):
    from peft import PeftModel

    trainer = lora_trainer()
    trainer.step(trajectories(8, seed=2), group_size=4)
    ckpt = trainer.save(tmp_path / "ckpt")
    assert not (ckpt / "model").exists()
    files = sorted(p.name for p in (ckpt / "adapter").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    assert (ckpt / "adapter" / "adapter_model.safetensors").stat().st_size < 64 * 1024  # no base weights inside

    ids = torch.tensor([[5, 9, 17, 33, 2, 61]])
    want = trainer.model(input_ids=ids).logits
    loaded = PeftModel.from_pretrained(tiny("llama"), str(ckpt / "adapter")).eval()
    assert torch.allclose(loaded(input_ids=ids).logits, want, atol=1e-5)  # peft reads our checkpoint as its own

    fresh = lora_trainer()
    fresh.load(ckpt)
    assert fresh.step_count == 1
    assert torch.allclose(fresh.model(input_ids=ids).logits, want, atol=1e-6)
    # the merged weights give the same function as the adapter on top of the base
    merged = tiny("llama")
    merged.load_state_dict(trainer.weights(), strict=False)
    assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-4)
    from transformers import AutoModelForCausalLM

    folder = trainer.save_weights(tmp_path / "merged")  # what `slime-env sft` leaves as its model folder
    reread = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert not any("lora" in k for k in reread.state_dict())
    assert torch.allclose(reread(input_ids=ids).logits, want, atol=1e-4)


def test_export_merge_writes_hf_weights_peft_agrees_with(tmp_path):
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    tiny("llama").save_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    trainer = TorchTrainer(model, TrainerConfig(lr=5e-2, micro_batch_size=4, lora=dict(LORA)), pad_id=0)
    trainer.step(trajectories(8, seed=3), group_size=4)
    ckpt = trainer.save(tmp_path / "ckpt")
    ids = torch.tensor([[5, 9, 17, 33, 2, 61]])
    want = trainer.model(input_ids=ids).logits

    out = subprocess.run([sys.executable, "-m", "slime_env", "export", str(ckpt), "--out", str(tmp_path / "merged"),
                          "--merge"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any("lora" in k for k in merged.state_dict())
    assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-4)
    # without --merge: the PEFT adapter folder itself; and a clear error for a folder that is no checkpoint
    out = subprocess.run([sys.executable, "-m", "slime_env", "export", str(ckpt), "--out", str(tmp_path / "a")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and (tmp_path / "a" / "adapter_config.json").exists()
    out = subprocess.run([sys.executable, "-m", "slime_env", "export", str(tmp_path), "--out", str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "is no trainer checkpoint" in out.stderr


def test_moe_expert_and_router_adapters_merge_as_peft_merges_them():
    """Qwen3-MoE, all-linear: peft adapts the experts' fused 3-D weights and the router (`target_parameters`); the
    adapter's deltas (merged sync, the engines' merged adapters) on those are peft's own `merge_and_unload`."""
    import copy

    from slime_env.agents.lora_adapter import MergedAdapter
    from slime_env.trainers.lora import merged_weights

    trainer = TorchTrainer(tiny("qwen3_moe"), TrainerConfig(lr=5e-2, micro_batch_size=4, lora={"rank": 4, "alpha": 8}),
                           pad_id=0)
    trainer.step(trajectories(8, seed=3), group_size=4)  # B moves off zero
    ours = merged_weights(trainer.model)
    want = copy.deepcopy(trainer.model).merge_and_unload().state_dict()
    assert ours.keys() == want.keys()
    for k in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
              "model.layers.0.mlp.gate.weight"):
        assert not torch.equal(want[k], tiny("qwen3_moe").state_dict()[k]), k
    for k in want:
        assert torch.allclose(ours[k], want[k], atol=1e-6), k
    engine_side = MergedAdapter(tiny("qwen3_moe")).merged(trainer.adapter())
    assert torch.allclose(engine_side["model.layers.2.mlp.experts.down_proj"],
                          want["model.layers.2.mlp.experts.down_proj"], atol=1e-6)


def test_adapter_sync_reaches_the_embedded_engine_and_is_recorded(smollm2_tok):
    from slime_env.agents import TransformersPolicy

    trainer = lora_trainer()
    engine_model = tiny("llama")
    policy = TransformersPolicy(engine_model, smollm2_tok, seed=0, batching="static")
    trainer.step(trajectories(8, seed=4), group_size=4)

    async def main():
        await trainer.sync(policy, version="1")
        gen = await policy.generate([5, 9, 17], {"max_new_tokens": 3, "temperature": 0})
        return gen

    gen = asyncio.run(main())
    assert gen.weight_version == "1" and gen.adapter == "policy@1"
    ids = torch.tensor([[5, 9, 17, 33, 2, 61]])
    with torch.no_grad():
        assert torch.allclose(engine_model(input_ids=ids).logits, trainer.model(input_ids=ids).logits, atol=1e-4)
    # a second version merges into the base again (not on top of the first)
    trainer.step(trajectories(8, seed=5), group_size=4)
    asyncio.run(trainer.sync(policy, version="2"))
    with torch.no_grad():
        assert torch.allclose(engine_model(input_ids=ids).logits, trainer.model(input_ids=ids).logits, atol=1e-4)
    policy.close()


def test_adapter_loads_while_the_paged_engine_has_released_its_memory(smollm2_tok):
    """The colocated cycle of a LoRA run on the paged engine: the K/V pool released (SGLang's sleep: the trainer runs),
    an adapter version merged while it is released, the pool resumed: decoding runs under the new adapter, the cached
    prefixes of the old weights are gone (a hit would reuse K/V computed without the adapter), and a later version
    again merges into the base, not on top of the last."""
    from slime_env.agents import TransformersPolicy

    trainer = lora_trainer()
    engine_model = tiny("llama")
    policy = TransformersPolicy(engine_model, smollm2_tok, max_batch_size=4, paged=True,
                                paged_options={"max_kv_tokens": 1024})
    prompt, greedy = [5, 9, 17, 33], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def cycle(version, seed):
        policy.release_memory()
        trainer.step(trajectories(8, seed=seed), group_size=4)
        await trainer.sync(policy, version=version)
        policy.resume_memory()
        return await policy.generate(prompt, greedy)

    async def main():
        before = await policy.generate(prompt, greedy)
        return before, await cycle("1", 4), await cycle("2", 5)

    before, one, two = asyncio.run(main())
    assert (one.adapter, two.adapter) == ("policy@1", "policy@2") and before.adapter is None
    ids = torch.tensor([prompt + list(two.token_ids)])
    with torch.no_grad():
        want = torch.log_softmax(trainer.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
    want = want.gather(1, torch.tensor(two.token_ids)[:, None])[:, 0]
    # the engine's log-probs of its own tokens are the trainer's (adapter v2 on, over the same prompt as before:
    # K/V cached under older weights would show here)
    assert two.logprobs == pytest.approx(want.tolist(), abs=1e-4)
    policy.close()


def test_adapter_bytes_are_a_small_part_of_the_weights():
    from slime_env.trainers.weight_sync import InPlace

    class Sink:
        async def update_weights(self, weights, version):
            pass

        async def load_adapter(self, adapter, version):
            pass

    trainer = lora_trainer()
    channel = InPlace(Sink())
    full = asyncio.run(channel.push(trainer.weights(), "1"))
    adapter = asyncio.run(channel.push_adapter(trainer.adapter(), "1"))
    n_adapter = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert adapter["sync/bytes"] == 4 * n_adapter
    assert adapter["sync/bytes"] < 0.2 * full["sync/bytes"]


def test_train_cli_with_a_lora_section(tmp_path):
    """`slime-env train` for 2 steps with `trainer.lora` and a KL term: adapter checkpoints, adapter-only syncs
    (bytes in the metrics), every generate call's adapter recorded with its weight version."""
    import json

    config = tmp_path / "lora.yaml"
    config.write_text(f"""
run_dir: {tmp_path / 'run'}
env: ReasoningGym-v0
env_kwargs: {{dataset: chain_sum, answer_formats: [answer_tag, last_number], \
system_prompt: "Reply <answer>N</answer>."}}
train_data: {{reasoning_gym: {{dataset: chain_sum, size: 8, seed: 1, \
config: {{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}}}}}
eval_data: {{reasoning_gym: {{dataset: chain_sum, size: 2, seed: 2, \
config: {{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}}}}}
steps: 2
prompts_per_step: 2
n_samples_per_prompt: 2
max_new_tokens: 8
eval_every: 2
save_every: 2
trainer: {{lr: 1.0e-4, micro_batch_size: 4, kl_coef: 0.01, \
lora: {{rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}}}}
""")
    out = subprocess.run([sys.executable, "-m", "slime_env", "train", "--config", str(config)], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/reward_mean" in r]
    assert len(trained) == 2
    synced = [r for r in rows if "sync/bytes" in r]
    assert synced and all(r["sync/bytes"] < 2e6 for r in synced)  # the adapter, not the 135M model's 540 MB
    ckpt = run / "checkpoints" / "step_2"
    assert (ckpt / "adapter" / "adapter_model.safetensors").exists() and not (ckpt / "model").exists()
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    step2 = [t for s in samples if s["step"] == 2 for t in s["trajectories"]]
    md = step2[0]["metadata"]
    assert md["adapters"] == [f"policy@{v}" for v in md["weight_versions"]] and md["weight_versions"][0] == "1"


def test_serve_engine_loads_adapters_by_name_and_version(tmp_path):
    """The real `slime-env serve-engine` (SmolLM2-135M): adapters through SGLang's `/load_lora_adapter` route from the
    trainer's channel, merged there; requests name the newest; old versions unloaded past `keep_adapters`, and the
    folder of a version no engine holds any more removed (the channel's own folder: emptied first, gone once empty)."""
    import copy

    from helpers import serve_engine
    from slime_env.agents import load_default_model
    from slime_env.clients.sglang import SGLangPolicy
    from slime_env.http import RemoteError
    from slime_env.trainers.weight_sync import FromTensor

    model, tok = load_default_model()
    trainer = TorchTrainer(copy.deepcopy(model), TrainerConfig(lr=1e-2, micro_batch_size=4, lora=dict(LORA)),
                           pad_id=0)
    prompt = tok.encode("The capital of France is", add_special_tokens=False)

    async def main(url):
        client = SGLangPolicy(url)
        channel = FromTensor(lambda: [client], trainer.weight_layout())
        folder = tmp_path / "weight_sync" / "adapters"
        (folder / "policy@9").mkdir(parents=True)  # a killed run's version
        channel.own_adapter_folder(folder)
        out = []
        for v in ("1", "2", "3"):
            trainer.step(trajectories(8, seed=int(v)), group_size=4)
            stats = await channel.push_adapter(trainer.adapter(), v)
            out.append((stats, await client.generate(prompt, {"max_new_tokens": 4, "temperature": 0})))
        assert client.loras == ["policy@2", "policy@3"]  # keep_adapters = 2: policy@1 unloaded
        assert sorted(p.name for p in folder.iterdir()) == ["policy@2", "policy@3"]
        await channel.close()  # what the engine still holds stays (vLLM may re-read it)
        assert sorted(p.name for p in folder.iterdir()) == ["policy@2", "policy@3"]
        await client.unload_lora_adapters(keep=0)
        await channel.close()
        assert not folder.exists()
        with pytest.raises(RemoteError, match="names no loaded adapter"):
            await client.http.request("POST", "/generate", {"input_ids": prompt, "lora_path": "policy@1",
                                                            "sampling_params": {"max_new_tokens": 1}}, max_retries=0)
        await client.close()
        return out

    with serve_engine() as url:
        out = asyncio.run(main(url))
    for v, (stats, gen) in zip("123", out):
        assert gen.adapter == f"policy@{v}" and gen.weight_version == v
        assert 0 < stats["sync/bytes"] < 2e6
    stats, gen = out[-1]
    ids = torch.tensor([prompt + list(gen.token_ids)])
    with torch.no_grad():
        lp = torch.log_softmax(trainer.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
    want = lp.gather(-1, torch.tensor(gen.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(gen.logprobs), want, atol=1e-3)  # the engine samples the trained policy


def test_sglang_lora_routes_request_shape():
    """Against a TEST DOUBLE of SGLang's HTTP routes (SGLang cannot run here): the request bodies follow SGLang's
    `LoadLoRAAdapterReqInput` / `UnloadLoRAAdapterReqInput` (lora_name, lora_path) and `/generate`'s `lora_path`."""
    from aiohttp import web

    from helpers import LocalServer
    from slime_env.agents.lora_adapter import LoRAAdapter
    from slime_env.clients.sglang import SGLangPolicy
    from slime_env.trainers.weight_sync import Distributed

    seen: list[tuple[str, dict]] = []

    async def record(request):
        body = await request.json()
        seen.append((request.path, body))
        if request.path == "/generate":  # SGLang's meta_info: the base model's weight_version, no adapter field
            return web.json_response({"text": "x", "meta_info": {"output_token_logprobs": [[-0.5, 7, None]],
                                      "finish_reason": {"type": "length"}, "weight_version": "default"}})
        return web.json_response({"success": True, "error_message": "", "loaded_adapters": {}})

    app = web.Application()
    app.add_routes([web.post(p, record) for p in ("/load_lora_adapter", "/unload_lora_adapter", "/generate")])
    adapter = LoRAAdapter("policy",
                          {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 4),
                           "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(4, 2)},
                          {"r": 2, "lora_alpha": 4, "peft_type": "LORA", "target_modules": ["q_proj"]})

    async def main():
        async with LocalServer(app) as server:
            client = SGLangPolicy(server.url)
            channel = Distributed(lambda: [client], backend="gloo")  # the adapter path needs no group
            for v in ("5", "6", "7"):
                await channel.push_adapter(adapter, v)
            gen = await client.generate([1, 2], {"max_new_tokens": 1})
            await client.close()
            return gen, channel.adapter_folder

    gen, folder = asyncio.run(main())
    loads = [b for p, b in seen if p == "/load_lora_adapter"]
    assert [b["lora_name"] for b in loads] == ["policy@5", "policy@6", "policy@7"]
    assert loads[0]["lora_path"] == str(folder / "policy@5")
    assert [b for p, b in seen if p == "/unload_lora_adapter"] == [{"lora_name": "policy@5"}]
    # the channel's temporary folder: an unloaded version's folder goes, the ones the engine holds stay
    assert sorted(p.name for p in folder.iterdir()) == ["policy@6", "policy@7"]
    assert (folder / "policy@7" / "adapter_config.json").exists()
    shutil.rmtree(folder)
    assert [b["lora_path"] for p, b in seen if p == "/generate"] == ["policy@7"]
    assert gen.adapter == "policy@7" and gen.weight_version == "7"
