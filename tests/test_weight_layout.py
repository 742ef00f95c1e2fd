"""The engine-bound weight layout, decided at the weight channel: what leaves the trainer's process is what SGLang's
own loader takes, and what the trainer's checkpoint (`save_weights`) holds, for every channel kind.

SGLang's Qwen3-MoE loader, as read from SGLang's source (sgl-project/sglang):
- `python/sglang/srt/models/qwen3_moe.py` at commit 008af3a6f95b956ea4d50986f9a921f13dced28b,
  `Qwen3MoeForCausalLM.load_weights`: the checkpoint's `q_proj` / `k_proj` / `v_proj` load into the stacked
  `qkv_proj` (shards q, k, v) and a dense MLP's `gate_proj` / `up_proj` into `gate_up_proj` (shards 0, 1) — names
  holding `mlp.experts` excepted —, then experts by `FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name=
  "gate_proj", ckpt_down_proj_name="down_proj", ckpt_up_proj_name="up_proj", num_experts)`, then the name as it is
  when the model has that parameter. **A name that none of these finds is skipped without an error.**
- `python/sglang/srt/layers/moe/fused_moe_triton/layer.py` at commit 008d7d0e947e436a572cf8243674adf264dc8836,
  `FusedMoE.make_expert_params_mapping`: for expert e, the checkpoint name part `experts.{e}.gate_proj.` loads into
  `experts.w13_` shard w1, `experts.{e}.up_proj.` into `experts.w13_` shard w3, `experts.{e}.down_proj.` into
  `experts.w2_` shard w2.
`sglang_load` below applies those rules (written here from that reading, not copied) to the parameters such a model
has, so a name SGLang would silently drop fails the test.
"""

from __future__ import annotations

import asyncio
import re

import pytest

torch = pytest.importorskip("torch")

from helpers import tiny  # noqa: E402

from slime_env.agents.weight_layout import WeightLayout, load_state, model_state  # noqa: E402


# --- SGLang's Qwen3-MoE loader, by its naming rules ----------------------------------------------------------
def sglang_params(config) -> dict[str, set]:
    """The parameters of SGLang's `Qwen3MoeForCausalLM` for `config`, each with the shards a full load fills."""
    from slime_env.trainers.megatron.moe import sparse_layers

    params: dict[str, set] = {"model.embed_tokens.weight": {None}, "model.norm.weight": {None},
                              "lm_head.weight": {None}}
    for i, sparse in enumerate(sparse_layers(config)):
        p = f"model.layers.{i}."
        params.update({p + "self_attn.qkv_proj.weight": {"q", "k", "v"}, p + "self_attn.o_proj.weight": {None},
                       p + "self_attn.q_norm.weight": {None}, p + "self_attn.k_norm.weight": {None},
                       p + "input_layernorm.weight": {None}, p + "post_attention_layernorm.weight": {None}})
        if sparse:
            e = range(config.num_experts)
            params.update({p + "mlp.gate.weight": {None},
                           p + "mlp.experts.w13_weight": {(x, s) for x in e for s in ("w1", "w3")},
                           p + "mlp.experts.w2_weight": {(x, "w2") for x in e}})
        else:
            params.update({p + "mlp.gate_up_proj.weight": {0, 1}, p + "mlp.down_proj.weight": {None}})
    return params


def sglang_load(names, config) -> tuple[dict[str, set], list[str]]:
    """(the shards of each parameter the names fill, the names skipped), by SGLang's rules (module docstring)."""
    params = sglang_params(config)
    stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    experts = [("experts.w13_" if w in ("gate_proj", "up_proj") else "experts.w2_", f"experts.{e}.{w}.", e, s)
               for e in range(config.num_experts) for s, w in (("w1", "gate_proj"), ("w2", "down_proj"),
                                                                ("w3", "up_proj"))]
    filled: dict[str, set] = {}
    skipped = []
    for name in names:
        target = None
        for param, part, shard in stacked:
            if part in name and "mlp.experts" not in name:
                target = (name.replace(part, param), shard)
                break
        else:
            for param, part, e, shard in experts:
                if part in name:
                    target = (name.replace(part, param), (e, shard))
                    break
            else:
                target = (name, None)
        if target[0] not in params:
            skipped.append(name)
            continue
        filled.setdefault(target[0], set()).add(target[1])
    return filled, skipped


def assert_sglang_takes(names, config) -> None:
    filled, skipped = sglang_load(names, config)
    assert skipped == [], f"SGLang would skip {skipped[:4]}"
    want = sglang_params(config)
    assert {k: v for k, v in filled.items()} == want, "SGLang would keep some of its initial weights"


def test_transformers_fused_names_are_what_sglang_skips_and_the_layout_is_what_it_loads():
    """The bug this layout fixes: the fused in-memory expert names reach no SGLang parameter (silently)."""
    hf = tiny("qwen3_moe")
    state = hf.state_dict()
    _, skipped = sglang_load(state, hf.config)
    assert skipped and all(".mlp.experts." in n for n in skipped)
    sent = WeightLayout.of(hf.config).engine_tensors(state)
    assert_sglang_takes([n for n, _ in sent], hf.config)
    # and back: the model takes the engine-bound layout whole (a checkpoint) or in parts (buckets of an update)
    assert all(torch.equal(a, state[k]) for k, a in model_state(dict(sent), hf).items())
    other = tiny("qwen3_moe", seed=1)
    half = [n for n, _ in sent].index("model.layers.0.mlp.experts.2.up_proj.weight")  # a layer's experts cut in two
    assert load_state(other, dict(sent[:half]), partial=True)[1] == []
    assert load_state(other, dict(sent[half:]), partial=True)[1] == []
    assert all(torch.equal(v, state[k]) for k, v in other.state_dict().items())
    assert load_state(tiny("qwen3_moe", seed=2), dict(sent)) == ([], [])  # whole: nothing missing


def test_an_unknown_fused_model_type_is_refused_by_name():
    import copy

    hf = tiny("qwen3_moe")
    config = copy.deepcopy(hf.config)
    config.model_type = "made_up_moe"
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj: model type 'made_up_moe' keeps its experts fused"):
        WeightLayout.of(config).engine_tensors(hf.state_dict())


# --- every channel kind, through a real serve-engine --------------------------------------------------------
class Recording:
    """An engine client that notes the names each weight call carries (then makes the call)."""

    def __init__(self, inner):
        self.inner, self.sent, self.calls = inner, {}, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                              weight_version=None):
        self.sent.setdefault("distributed", []).extend(names)
        self.calls.append(len(names))
        return await self.inner.update_weights_from_distributed(names, dtypes, shapes, group_name, weight_version)

    async def update_weights_from_tensor(self, named_tensors, weight_version=None):
        named_tensors = list(named_tensors)
        self.sent["tensor"] = {n: t.detach().clone() for n, t in named_tensors}
        return await self.inner.update_weights_from_tensor(named_tensors, weight_version)

    async def update_weights_from_disk(self, model_path, weight_version=None):
        from slime_env.trainers.torch_trainer import read_hf_weights

        self.sent["disk"] = read_hf_weights(model_path)
        return await self.inner.update_weights_from_disk(model_path, weight_version)


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory, smollm2_tok):
    """A tiny Qwen3-MoE (SmolLM2's tokenizer) served by `slime-env serve-engine`."""
    from slime_env.agents.launcher import ServeProcess
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    folder = tmp_path_factory.mktemp("moe")
    config = Qwen3MoeConfig(vocab_size=len(smollm2_tok), hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                            num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], tie_word_embeddings=False,
                            max_position_embeddings=128)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    smollm2_tok.save_pretrained(folder)
    process = ServeProcess(model=str(folder), log_path=folder / "engine.log")
    url = asyncio.run(process.start())
    yield folder, url
    process.stop()


def _digests(weights) -> dict[str, str]:
    import hashlib

    return {n: hashlib.sha256(t.detach().float().contiguous().cpu().numpy().tobytes()).hexdigest()
            for n, t in weights.items()}


def test_every_channel_sends_sglangs_names_and_the_checkpoints_tensors(moe_engine, tmp_path):
    """A TorchTrainer on a Qwen3-MoE pushes to a real serve-engine over every channel kind (gloo broadcast, shared
    memory, a model folder) and through `trainer.sync`: each sends names SGLang's loader takes whole, exactly the
    tensors of the trainer's own checkpoint (`save_weights`), and the engine ends with the trainer's weights."""
    from transformers import AutoModelForCausalLM

    from slime_env.clients.sglang import SGLangPolicy
    from slime_env.trainers import weight_sync as ws
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig, read_hf_weights

    folder, url = moe_engine
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = TorchTrainer(model, TrainerConfig(), pad_id=0)
    layout = trainer.weight_layout()
    checkpoint = read_hf_weights(trainer.save_weights(tmp_path / "ckpt"))

    async def main():
        client = Recording(SGLangPolicy(url))
        channels = {"distributed": ws.Distributed(lambda: [client], backend="gloo", layout=layout),
                    "tensor": ws.FromTensor(lambda: [client], layout),
                    "disk": ws.FromDisk(lambda: [client], folder=tmp_path / "sync", layout=layout)}
        try:
            for version, (kind, channel) in enumerate(channels.items(), start=1):
                with torch.no_grad():  # new weights each time: the engine must really take them
                    for p in model.parameters():
                        p.add_(0.01)
                try:
                    await channel.push(trainer.weights(), str(version))
                finally:
                    await channel.close()
                sent = client.sent[kind]
                names = list(sent)
                assert_sglang_takes(names, model.config)
                checkpoint_now = read_hf_weights(trainer.save_weights(tmp_path / f"ckpt_{kind}"))
                assert sorted(names) == sorted(checkpoint) == sorted(checkpoint_now), kind
                if kind != "distributed":  # the broadcast's tensors went into the engine: checked there below
                    assert all(torch.equal(sent[n], checkpoint_now[n]) for n in names), kind
                got = await client.get_weights_checksum()
                assert got["weight_version"] == str(version)
                assert got["checksums"] == _digests(trainer.weights()), kind
            # the library API goes through the same channels
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
            client.sent.clear()
            assert await trainer.sync(client, version="lib-tensor") == "lib-tensor"
            assert sorted(client.sent["tensor"]) == sorted(checkpoint)
            assert (await client.get_weights_checksum())["checksums"] == _digests(trainer.weights())
            await trainer.sync(client, version="lib-disk", path=tmp_path / "lib")
            assert sorted(client.sent["disk"]) == sorted(checkpoint)
        finally:
            await client.close()

    asyncio.run(main())


def test_disk_sync_keeps_only_the_loaded_version_and_removes_its_own_folder(moe_engine, tmp_path):
    """Every disk sync writes a full model folder: once the engine has loaded a version, the one before it is gone
    (a run of many steps would otherwise fill the disk), and closing removes the temporary folder the channel made. A
    folder the caller named stays, holding the newest version; a scratch folder (a run's `run_dir/weight_sync`) is
    emptied of what a killed run left there when the channel opens it, and removed at close."""
    from transformers import AutoModelForCausalLM

    from slime_env.clients.sglang import SGLangPolicy
    from slime_env.trainers import weight_sync as ws
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig

    folder, url = moe_engine
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = TorchTrainer(model, TrainerConfig(), pad_id=0)

    async def main():
        client = SGLangPolicy(url)
        own = ws.FromDisk(lambda: [client], layout=trainer.weight_layout())
        named = ws.FromDisk(lambda: [client], folder=tmp_path / "sync", layout=trainer.weight_layout())
        (tmp_path / "run" / "weight_sync" / "weights_7").mkdir(parents=True)  # a killed run's version
        scratch = ws.FromDisk(lambda: [client], folder=tmp_path / "run" / "weight_sync", scratch=True,
                              layout=trainer.weight_layout())
        try:
            for channel in (own, named, scratch):
                root = channel.versions.root
                for version in ("a", "b", "c"):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(0.01)
                    await channel.push(trainer.weights(), version)
                    assert sorted(p.name for p in root.iterdir()) == [f"weights_{version}"]
                    got = await client.get_weights_checksum()
                    assert (got["weight_version"], got["checksums"]) == (version, _digests(trainer.weights()))
                await channel.close()
                assert root.exists() == (channel is named)
        finally:
            await client.close()

    asyncio.run(main())


def test_distributed_sends_one_call_to_engines_that_bound_their_own_buffers_else_buckets(moe_engine):
    """serve-engine reports `update_buffer_bytes` (it receives into the parameters, and buffers the rest — here the
    experts, one matrix each — up to that bound): the whole update goes in one call. With `one_call` off (what an
    SGLang server, which buffers each call whole, gets) the update is split into `bucket_bytes` buckets. Either way
    every tensor is sent once and the engine ends with the trainer's weights."""
    from transformers import AutoModelForCausalLM

    from slime_env.clients.sglang import SGLangPolicy
    from slime_env.trainers import weight_sync as ws
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig

    folder, url = moe_engine
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = TorchTrainer(model, TrainerConfig(), pad_id=0)
    total = sum(t.numel() * 4 for t in trainer.weights().values())

    async def main():
        client = Recording(SGLangPolicy(url))
        assert isinstance((await client.get_server_info())["update_buffer_bytes"], int)
        try:
            for one_call in (True, False):
                channel = ws.Distributed(lambda: [client], backend="gloo", layout=trainer.weight_layout(),
                                         bucket_bytes=total // 5, one_call=one_call)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01)
                client.sent.clear(), client.calls.clear()
                try:
                    await channel.push(trainer.weights(), f"v{one_call}")
                finally:
                    await channel.close()
                assert len(client.calls) == 1 if one_call else len(client.calls) >= 3, client.calls
                assert len(set(client.sent["distributed"])) == len(client.sent["distributed"]) == sum(client.calls)
                got = await client.get_weights_checksum()
                assert got["weight_version"] == f"v{one_call}"
                assert got["checksums"] == _digests(trainer.weights())
        finally:
            await client.close()

    asyncio.run(main())


def test_in_place_sync_hands_over_the_models_own_layout(smollm2_tok):
    """The embedded engine is a model of the trainer's class in the same process: it gets the fused tensors."""
    hf = tiny("qwen3_moe")

    class Embedded:
        async def update_weights(self, state, version):
            self.state, self.version = state, version

    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig

    engine = Embedded()
    asyncio.run(TorchTrainer(hf, TrainerConfig(), pad_id=0).sync(engine, version="3"))
    assert engine.version == "3" and engine.state.keys() == hf.state_dict().keys()
    assert any(re.search(r"experts\.gate_up_proj$", k) for k in engine.state)


def test_the_megatron_trainers_checkpoint_and_channels_agree(tmp_path):
    """MegatronTrainer (CPU, gloo) on a Qwen3-MoE: its checkpoint folder and every channel kind carry SGLang's
    names and the same tensors."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'slime_env[megatron]')")
    from slime_env.trainers.megatron import init_parallel
    from slime_env.trainers.megatron_trainer import MegatronTrainer
    from slime_env.trainers.torch_trainer import TrainerConfig, read_hf_weights

    init_parallel(1)
    hf = tiny("qwen3_moe")
    trainer = MegatronTrainer(hf, TrainerConfig(backend="megatron"), pad_id=0)
    checkpoint = read_hf_weights(trainer.save_weights(tmp_path / "ckpt"))
    assert_sglang_takes(list(checkpoint), hf.config)

    class Server:  # records what the channels send (no engine behind it)
        def __init__(self):
            self.sent = {}

        async def update_weights_from_tensor(self, named, weight_version=None):
            self.sent["tensor"] = dict(named)

        async def update_weights_from_disk(self, path, weight_version=None):
            self.sent["disk"] = read_hf_weights(path)

    server = Server()
    asyncio.run(trainer.sync(server, version="1"))
    asyncio.run(trainer.sync(server, version="2", path=tmp_path / "sync"))
    for kind in ("tensor", "disk"):
        sent = server.sent[kind]
        assert sorted(sent) == sorted(checkpoint), kind
        assert all(torch.equal(sent[n].contiguous(), checkpoint[n]) for n in sent), kind
