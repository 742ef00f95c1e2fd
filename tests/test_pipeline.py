"""The training pipeline across processes: `slime-env train` against `serve-engine` servers with SGLang's weight-sync
routes (a real torch.distributed group over gloo), engine faults, placement on a local Ray cluster, and the config
checks that run before any training.

The engines are real HTTP servers on 127.0.0.1 (`slime-env serve-engine` processes on the real SmolLM2-135M
weights); they speak SGLang's API, which is what these tests exercise — SGLang itself cannot run here."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os

import pytest

torch = pytest.importorskip("torch")

from slime_env.trainers.run import TrainConfig, train  # noqa: E402

from slime_env.errors import InvalidInput  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE = {
    "model": "default", "env": "ReasoningGym-v0",
    "env_kwargs": {"dataset": "chain_sum", "system_prompt": "Answer with <answer>N</answer>.",
                   "answer_formats": ["answer_tag", "last_number"]},
    "train_data": {"reasoning_gym": {"dataset": "chain_sum", "size": 64, "seed": 1,
                                     "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}},
    "steps": 2, "prompts_per_step": 2, "n_samples_per_prompt": 4, "max_new_tokens": 16, "eval_every": 100,
    "temperature": 1.0, "max_concurrency": 8,
    "trainer": {"estimator": "grpo", "lr": 1e-4, "micro_batch_size": 8},
}


def _config(tmp_path, **over) -> TrainConfig:
    return TrainConfig.from_dict({**BASE, "run_dir": str(tmp_path / "run"), **over})


def _digest(t) -> str:
    return hashlib.sha256(t.detach().float().contiguous().cpu().numpy().tobytes()).hexdigest()


def _digests(weights) -> dict[str, str]:
    return {n: _digest(t) for n, t in weights.items()}


def _saved(folder, stack: contextlib.ExitStack) -> dict:
    """The tensors of a saved HF model folder by name, each read from its file when called: a model's weights held
    whole in this process, beside the trainer ranks and engines of these tests, made the suite's memory peak."""
    from safetensors import safe_open

    folder = folder / "model" if (folder / "model").is_dir() else folder
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        opened = stack.enter_context(safe_open(str(f), "pt"))
        tensors.update({name: functools.partial(opened.get_tensor, name) for name in opened.keys()})
    return tensors


def _saved_digests(folder) -> dict[str, str]:
    with contextlib.ExitStack() as stack:
        return {name: _digest(read()) for name, read in _saved(folder, stack).items()}


def _saved_difference(folder, reference) -> tuple[bool, float]:
    """Whether the two saved folders hold the same weight names, and the largest absolute difference between them."""
    with contextlib.ExitStack() as stack:
        a, b = _saved(folder, stack), _saved(reference, stack)
        return a.keys() == b.keys(), max((a[n]() - b[n]()).abs().max().item() for n in a.keys() & b.keys())


def test_two_serve_engines_get_the_trainers_weights_over_a_gloo_group_after_every_step(tmp_path, smollm2_tok):
    from slime_env.agents import TransformersPolicy, load_default_model

    seen = []

    async def check(step, engines, trainer):
        weights = trainer.weights()
        want = _digests(weights)
        for engine in engines.pool.up():
            got = await engine.get_weights_checksum()
            assert got["weight_version"] == str(step)
            assert got["checksums"] == {n: d for n, d in want.items() if n in got["checksums"]}
            assert set(want) - set(got["checksums"]) <= {"lm_head.weight"}  # tied to the embedding
        # A greedy generation through the pool equals the in-process engine on the same weights.
        model, tok = load_default_model()
        model.load_state_dict({k: v.detach().clone() for k, v in weights.items()}, strict=False)
        local = TransformersPolicy(model, tok, batching="static")
        prompt = tok.encode("Tell me about the moon.")
        try:
            ours = await local.generate(prompt, {"temperature": 0.0, "max_new_tokens": 12})
        finally:
            local.close()
        for engine in engines.pool.up():
            theirs = await engine.generate(prompt, {"temperature": 0.0, "max_new_tokens": 12})
            assert theirs.token_ids == ours.token_ids
        seen.append((step, len(engines.pool.up()), trainer.step_count))

    cfg = _config(tmp_path, engine={"kind": "serve", "count": 2, "weight_sync": "distributed"})
    summary = asyncio.run(train(cfg, on_step=check, log=lambda _: None))
    assert seen == [(1, 2, 1), (2, 2, 2)]
    rows = [json.loads(line) for line in open(summary["metrics"])]
    assert all(r["sync/bytes"] > 0 and r["engines/up"] == 2 for r in rows)


def test_an_engine_killed_mid_step_loses_no_episode_and_returns_with_the_new_weights(tmp_path):
    """kill -9 one of two engines while step 2 generates: every episode of the step comes back exactly once and
    completed, the step trains, the engine is restarted and rejoins once the step's weights reached it."""
    batches: list[list] = []
    state = {}

    async def on_step(step, engines, trainer):
        if step == 1:
            async def kill_soon():
                await asyncio.sleep(0.3)  # step 2's rollouts are under way
                state["killed"] = engines.processes[0].url
                engines.processes[0].kill()

            state["task"] = asyncio.ensure_future(kill_soon())
        if step == 2:
            restarted = next(e for e in engines.pool.engines if e.url == state["killed"])
            assert engines.processes[0].starts == 2 and engines.pool.state[restarted.url] == "up"
            gen = await restarted.generate([1, 2, 3], {"temperature": 0.0, "max_new_tokens": 2})
            assert gen.weight_version == "2"  # its first generation back uses the step's weights
            got = await restarted.get_weights_checksum(["model.norm.weight"])
            assert got["checksums"]["model.norm.weight"] == _digests(
                {"model.norm.weight": trainer.weights()["model.norm.weight"]})["model.norm.weight"]
            state["failovers"] = engines.pool.failovers

    import slime_env.trainers.run.recorder as tl

    original = tl._save_samples

    def record(path, step, groups):  # every group of every step (sample_groups keeps all)
        batches.append([(g.group_index, [t.metadata["index"] for t in g.trajectories],
                         [t.status for t in g.trajectories]) for g in groups])
        return original(path, step, groups)

    tl._save_samples = record
    try:
        cfg = _config(tmp_path, steps=2, prompts_per_step=4, n_samples_per_prompt=4, max_new_tokens=48,
                      max_concurrency=16, sample_groups=100,
                      engine={"kind": "serve", "count": 2, "weight_sync": "distributed", "health_interval_s": 0.5})
        asyncio.run(train(cfg, on_step=on_step, log=lambda _: None))
    finally:
        tl._save_samples = original
    assert "killed" in state and state["failovers"] >= 1
    for step_groups in batches:
        indices = [i for _, idx, _ in step_groups for i in idx]
        assert len(step_groups) == 4 and len(indices) == 16 == len(set(indices))  # none lost, none twice
        assert all(s == "completed" or s == "truncated" for _, _, st in step_groups for s in st)


# --- the config is checked before anything trains -------------------------------------------------------------
def test_bad_engine_and_cluster_configs_are_refused_by_field(tmp_path):
    with pytest.raises(InvalidInput, match=r"engine\.kind: 'tgi' is not one of"):
        _config(tmp_path, engine={"kind": "tgi"})
    with pytest.raises(InvalidInput, match=r"engine\.urls: kind 'sglang' needs"):
        _config(tmp_path, engine={"kind": "sglang"})
    with pytest.raises(InvalidInput, match=r"engine\.weight_sync: the OpenAI routes have no weight update.*kind: vllm"):
        _config(tmp_path, engine={"kind": "openai", "urls": ["http://x"], "weight_sync": "disk"})
    with pytest.raises(InvalidInput, match=r"cluster\.trainer asks for 2 trainer ranks; backend 'local'"):
        _config(tmp_path, cluster={"trainer": {"nodes": 1, "gpus_per_node": 2}})
    with pytest.raises(InvalidInput, match=r"cluster\.rollout gives 4 engines .* engine\.count is 2"):
        _config(tmp_path, engine={"kind": "serve", "count": 2}, trainer={"backend": "megatron"},
                cluster={"backend": "ray", "rollout": {"gpus": 4, "gpus_per_engine": 1}})
    with pytest.raises(InvalidInput, match=r"cluster\.trainer has 2 ranks; trainer\.backend 'torch'"):
        _config(tmp_path, engine={"kind": "serve"}, cluster={"backend": "ray", "trainer": {"gpus_per_node": 2}})
    with pytest.raises(InvalidInput, match=r"trainer\.tp x cp x pp 4 does not divide the 2 trainer ranks"):
        _config(tmp_path, engine={"kind": "serve"}, trainer={"backend": "megatron", "cp": 2, "pp": 2},
                cluster={"backend": "ray", "trainer": {"gpus_per_node": 2}})
    with pytest.raises(InvalidInput, match=r"engine\.gpus places engines on this host; cluster\.backend ray"):
        _config(tmp_path, engine={"kind": "serve", "gpus": [1]}, cluster={"backend": "ray"})
    with pytest.raises(InvalidInput, match=r"cluster\.trainer\.nodes: expected an integer"):
        _config(tmp_path, cluster={"trainer": {"nodes": 0}})
    with pytest.raises(InvalidInput, match=r"cluster\.backend: 'slurm' is not one of \['local', 'process', 'ray'\]"):
        _config(tmp_path, cluster={"backend": "slurm"})
    with pytest.raises(InvalidInput, match=r"cluster\.backend process runs the trainer in other processes; "
                                           r"engine\.kind 'embedded'"):
        _config(tmp_path, engine={"kind": "embedded"}, cluster={"backend": "process"})
    with pytest.raises(InvalidInput, match=r"cluster\.trainer\.nodes 2: backend 'process' runs on this host"):
        _config(tmp_path, trainer={"backend": "megatron"}, cluster={"backend": "process", "trainer": {"nodes": 2}})
    with pytest.raises(InvalidInput, match=r"with backend 'process' engines go on this host's GPUs by engine\.gpus"):
        _config(tmp_path, cluster={"backend": "process", "rollout": {"gpus": 2}})
    with pytest.raises(InvalidInput, match=r"engine\.kind vllm is not offered with cluster\.backend process"):
        _config(tmp_path, engine={"kind": "vllm", "urls": ["http://x"]}, cluster={"backend": "process"})


def test_engines_on_gpus_of_their_own_see_only_their_gpu_and_get_weights_over_nccl(tmp_path, monkeypatch):
    """`engine.gpus` places the engines this run starts: each sees only its GPU (CUDA_VISIBLE_DEVICES, mapped
    through this process's own list), and `weight_sync: auto` is NCCL when no engine shares the trainer's GPU, CUDA
    IPC when one does. GPUs are faked here (CI has none); the placement runs for real in
    tests/gpu/test_pipeline_gpu.py on two GPUs."""
    from types import SimpleNamespace

    from slime_env.trainers.run.engines import EngineConfig, Engines

    with pytest.raises(InvalidInput, match=r"engine\.gpus: only engines this run starts"):
        EngineConfig.from_dict({"kind": "sglang", "urls": ["http://x"], "gpus": [1]})
    with pytest.raises(InvalidInput, match=r"engine\.gpus: GPU indices"):
        EngineConfig.from_dict({"kind": "serve", "gpus": [-1]})
    with pytest.raises(InvalidInput, match=r"engine\.device: 'cuda:x'"):
        EngineConfig.from_dict({"kind": "serve", "device": "cuda:x"})
    assert EngineConfig.from_dict({"kind": "serve", "device": "cuda:1"}).gpus == [1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,7")

    def engines(**cfg) -> Engines:
        e = Engines(EngineConfig.from_dict({"kind": "serve", **cfg}), model_path="m", max_concurrency=4,
                    run_dir=tmp_path, seed=0, device="cuda", dtype="bfloat16")
        e.pool = SimpleNamespace(targets=lambda: [])
        return e

    apart = engines(count=3, gpus=[1, 3])
    assert [apart._gpu_env(i) for i in range(3)] == [{"CUDA_VISIBLE_DEVICES": v} for v in ("3", "7", "3")]
    channel = apart.channel()
    assert type(channel).__name__ == "Distributed" and channel.backend == "nccl"
    with pytest.raises(InvalidInput, match=r"engine\.gpus: \[0, 1\] puts some engine\(s\) on the trainer's GPU 0"):
        engines(count=2, gpus=[0, 1]).channel()  # no one channel reaches both
    assert type(engines(count=1).channel()).__name__ == "FromTensor"
    assert engines(count=1)._gpu_env(0) == {}
    with pytest.raises(InvalidInput, match=r"engine\.gpus: GPU 4 is not there \(this process sees 4"):
        engines(gpus=[4])._gpu_env(0)
    with pytest.raises(InvalidInput, match=r"engine\.gpus: \[0, 1\] puts some engine\(s\) on the trainer's GPU 0"):
        engines(count=2, gpus=[0, 1], weight_sync="distributed").channel()
    with pytest.raises(InvalidInput, match=r"engine\.gpus: \[1\] puts the engine\(s\) off the trainer's GPU 0"):
        engines(gpus=[1], weight_sync="tensor").channel()
    disk = engines(gpus=[1], weight_sync="disk").channel(save=lambda p: p)
    assert type(disk).__name__ == "FromDisk"
    # Trainer ranks on GPUs 0 and 1 (cluster.backend process): engines on those GPUs take CUDA IPC, each from the
    # rank on its GPU; engines apart take NCCL; a mix is refused, naming both GPUs.
    colocated = engines(count=2, gpus=[0, 1])
    colocated.processes = [SimpleNamespace(url="http://e0"), SimpleNamespace(url="http://e1")]
    assert colocated.channel_kind({0, 1}) == "tensor"
    assert [colocated.pusher(u, 2) for u in ("http://e0", "http://e1", "http://elsewhere")] == [0, 1, 0]
    assert engines(count=2, gpus=[2, 3]).channel_kind({0, 1}) == "distributed"
    with pytest.raises(InvalidInput, match=r"engine\.gpus: \[1, 2\] puts some engine\(s\) on the trainer's "
                                           r"GPUs \[0, 1\]"):
        engines(count=2, gpus=[1, 2]).channel_kind({0, 1})
    assert disk.versions.root == tmp_path.resolve() / "weight_sync"  # the run's folder, shared wherever the run dir is
    asyncio.run(disk.close())  # its folder goes with it
    assert not disk.versions.root.exists()


def test_an_unreachable_engine_url_is_refused_before_training(tmp_path):
    cfg = _config(tmp_path, engine={"kind": "sglang", "urls": ["http://127.0.0.1:9"], "health_timeout_s": 5})
    with pytest.raises(InvalidInput, match=r"engine\.urls\[0\]: http://127\.0\.0\.1:9 does not answer"):
        asyncio.run(train(cfg, log=lambda _: None))


def test_an_engine_serving_another_model_is_refused_before_training(tmp_path, smollm2_tok):
    from slime_env.agents.launcher import ServeProcess
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=len(smollm2_tok), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=True)
    torch.manual_seed(0)
    folder = tmp_path / "other"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    smollm2_tok.save_pretrained(folder)
    other = ServeProcess(model=str(folder), log_path=tmp_path / "other.log")
    url = asyncio.run(other.start())
    try:
        cfg = _config(tmp_path, engine={"kind": "sglang", "urls": [url]})
        with pytest.raises(InvalidInput, match=r"engine\.urls\[0\]: .* serves other weights than the trainer's"):
            asyncio.run(train(cfg, log=lambda _: None))
    finally:
        other.stop()


def test_a_weight_update_group_with_impossible_ranks_is_refused_by_the_engine(tmp_path):
    from slime_env.agents.default_model import default_model_path
    from slime_env.agents.launcher import ServeProcess
    from slime_env.clients.sglang import SGLangPolicy

    from slime_env.http import RemoteError

    engine = ServeProcess(model=str(default_model_path()), log_path=tmp_path / "e.log")
    url = asyncio.run(engine.start())

    async def main():
        client = SGLangPolicy(url)
        try:
            with pytest.raises(RemoteError, match="rank_offset 3 is not in 1..world_size-1"):
                await client.init_weights_update_group("127.0.0.1", 1, 3, 2, backend="gloo")
            with pytest.raises(RemoteError, match="no weight-update group 'nope'"):
                await client.update_weights_from_distributed(["x"], ["float32"], [[1]], group_name="nope")
        finally:
            await client.close()

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_ray_placement_with_two_trainer_ranks_and_two_engines_equals_the_one_process_run(tmp_path, megatron_local_run):
    """colocate: false on a local Ray cluster: 2 trainer ranks and 2 engine actors, against the same run with one
    trainer process (the module's, its first step); seeded sampling makes the rollouts identical, so the training must
    be. The two ranks are laid
    out as DP=2, then as examples/long_context_megatron_train.yaml's trainer section shrunk to two ranks: CP=2 (each
    trajectory split over both) and PP=2 (SmolLM2's 30 layers in two stages, its tied embedding on both) under its
    full recompute."""
    pytest.importorskip("ray")
    pytest.importorskip("megatron.core")
    import yaml

    example = yaml.safe_load(open(os.path.join(ROOT, "examples", "long_context_megatron_train.yaml")))["trainer"]
    shrunk = {"recompute": example["recompute"], "recompute_layers": example["recompute_layers"]}
    assert example["cp"] == 2 and example["pp"] == 2
    layouts = {"dp": (_RAY2, {}), "cp": (_RAY2, {**shrunk, "cp": example["cp"]}),
               "pp": (_RAY2, {**shrunk, "pp": example["pp"]})}
    # the one-process run's first step (its second changes nothing before it: a constant learning rate)
    local_rows, local_w = megatron_local_run["rows"][:1], megatron_local_run["weights_after_step_1"]
    for name, (cluster, trainer) in layouts.items():
        saved = tmp_path / name / "weights_after_step_1"

        def grab(step, engines, trainer, saved=saved):
            assert len(engines.pool.up()) == 2
            # the ranks write the folder (rank 0's gather): shipping the weights to this process over Ray held four
            # copies at once, the suite's memory peak
            trainer.save_weights(saved)

        cfg = TrainConfig.from_dict({**BASE, "run_dir": str(tmp_path / name), "seed_sampling": True, "cluster": cluster,
                                     "steps": 1, "engine": {"kind": "serve", "count": 2},
                                     "trainer": {**BASE["trainer"], "backend": "megatron", **trainer}})
        summary = asyncio.run(train(cfg, on_step=grab, log=lambda _: None))
        rows = [json.loads(line) for line in open(summary["metrics"])]
        assert len(rows) == 1, name
        for a, b in zip(rows, local_rows):
            assert a["train/reward_mean"] == b["train/reward_mean"], name
            assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5), name
            assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5), name
        same_names, difference = _saved_difference(saved, local_w)
        assert same_names and difference < 1e-4, (name, difference)


_RAY2 = {"backend": "ray", "trainer": {"nodes": 1, "gpus_per_node": 2}, "num_cpus": 8}


async def _engines_hold_the_trainers_weights(step, engines, trainer, checks: list, folder) -> None:
    trainer.save_weights(folder / f"step{step}")  # a multi-rank trainer's ranks write them: not held here whole
    want = _saved_digests(folder / f"step{step}")
    for engine in engines.pool.up():
        got = await engine.get_weights_checksum()
        assert got["weight_version"] == str(step)
        common = want.keys() & got["checksums"].keys()
        assert want.keys() ^ got["checksums"].keys() <= {"lm_head.weight"}  # tied to the embedding
        assert {n: got["checksums"][n] for n in common} == {n: want[n] for n in common}
    checks.append((step, trainer.step_count, want))


@pytest.fixture(scope="module")
def megatron_local_run(tmp_path_factory):
    """The reference both multi-rank tests compare with, run once: two steps of a Megatron trainer in the run's own
    process against two serve engines, seeded sampling; its metrics rows, the file of its weights after step 1, and the
    checks that both engines held them."""
    pytest.importorskip("megatron.core")
    checks, where = [], tmp_path_factory.mktemp("local")

    async def check(step, engines, trainer):
        await _engines_hold_the_trainers_weights(step, engines, trainer, checks, where)

    cfg = TrainConfig.from_dict({**BASE, "run_dir": str(where / "run"), "seed_sampling": True,
                                 "engine": {"kind": "serve", "count": 2},
                                 "trainer": {**BASE["trainer"], "backend": "megatron"}})
    summary = asyncio.run(train(cfg, on_step=check, log=lambda _: None))
    checks = [(step, count, None) for step, count, _ in checks]  # the digests were compared on the way
    return {"rows": [json.loads(line) for line in open(summary["metrics"])], "checks": checks,
            "weights_after_step_1": where / "step1"}  # on disk, not held while the module's other runs go


def test_trainer_ranks_in_child_processes_equal_the_one_process_run_and_leave_nothing_behind(tmp_path,
                                                                                             megatron_local_run):
    """cluster.backend process: two Megatron trainer ranks (DP=2) as child processes of the run, rank 0 pushing the
    weights from its own process over a gloo group to two serve engines (or, `weight_sync: tensor`, each rank to the
    engine it is paired with, as colocated GPUs pair them), against the same run with the trainer in the run's
    process (the module's). Seeded sampling makes the rollouts identical, so the training must be; after every step
    both engines hold the trainer's weights, and after the run no rank process is left."""
    runs, groups = {}, []
    two = {"backend": "process", "trainer": {"gpus_per_node": 2}}
    for name, cluster, sync in (("process", two, "auto"), ("process_tensor", two, "tensor")):
        checks = []

        async def check(step, engines, trainer, checks=checks):
            await _engines_hold_the_trainers_weights(step, engines, trainer, checks, tmp_path / "weights" / name)
            groups.append(trainer)

        cfg = TrainConfig.from_dict({**BASE, "run_dir": str(tmp_path / name), "seed_sampling": True,
                                     "cluster": cluster, "engine": {"kind": "serve", "count": 2, "weight_sync": sync},
                                     "trainer": {**BASE["trainer"], "backend": "megatron"}})
        summary = asyncio.run(train(cfg, on_step=check, log=lambda _: None))
        runs[name] = ([json.loads(line) for line in open(summary["metrics"])], checks)
    local_rows, local_checks = megatron_local_run["rows"], megatron_local_run["checks"]
    for name, (rows, checks) in runs.items():
        assert [c[:2] for c in checks] == [c[:2] for c in local_checks] == [(1, 1), (2, 2)], name
        assert len(rows) == len(local_rows) == 2, name
        for a, b in zip(rows, local_rows):
            assert a["train/reward_mean"] == b["train/reward_mean"], name
            assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5), name
            assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5), name
            assert a["sync/bytes"] == b["sync/bytes"] > 0, name
            assert a["sync/ranks"] == (2 if name == "process_tensor" else 1), name  # who pushed
    ranks = groups[-1].ranks
    assert len(ranks) == 2 and all(r.proc.poll() is not None for r in ranks)  # closed with the run
    assert all((tmp_path / "process" / f"trainer_rank{r}.log").is_file() for r in range(2))


def test_a_trainer_rank_that_dies_ends_the_run_with_its_exit_code(tmp_path):
    """A trainer rank killed (SIGKILL) after step 1 of a run with cluster.backend process: the next step fails naming
    the rank, its exit code and its log; the run ends with that reason instead of waiting."""
    def kill_rank(step, engines, trainer):
        if step == 1:
            trainer.ranks[0].proc.kill()

    cfg = _config(tmp_path, steps=3, cluster={"backend": "process"}, engine={"kind": "serve", "count": 1})
    with pytest.raises(RuntimeError, match=r"step 2 failed \(RankDied: trainer rank 0 \(pid \d+\) exited with code -9 "
                                           r"during step\(\); the end of .*trainer_rank0\.log"):
        asyncio.run(train(cfg, on_step=kill_rank, log=lambda _: None))


def test_a_run_whose_last_engine_is_gone_fails_with_the_reason_after_saving(tmp_path):
    """One SGLang-style engine given by URL (the run did not start it, so nobody restarts it) dies during step 2:
    its requests find no engine, the run ends with that reason, and the trainer after step 1 is saved."""
    from slime_env.agents.default_model import default_model_path
    from slime_env.agents.launcher import ServeProcess

    engine = ServeProcess(model=str(default_model_path()), log_path=tmp_path / "engine.log")
    url = asyncio.run(engine.start())

    def kill_after_step_1(step, engines, trainer):
        if step == 1:
            engine.kill()

    try:
        cfg = _config(tmp_path, steps=3, engine={"kind": "sglang", "urls": [url], "wait_for_engine_s": 2,
                                                 "health_interval_s": 0.5})
        with pytest.raises(RuntimeError, match=r"every engine is gone \(http://127\.0\.0\.1:\d+: .*\); the trainer "
                                               r"after step 1 is saved"):
            asyncio.run(train(cfg, on_step=kill_after_step_1, log=lambda _: None))
    finally:
        engine.stop()
    saved = tmp_path / "run" / "checkpoints"
    assert (saved / "latest").read_text() == "step_1" and (saved / "step_1" / "model").is_dir()


def test_a_colocated_sync_run_with_offload_frees_the_engine_servers_memory_around_each_step(tmp_path):
    """`trainer.offload` with serve engines (SGLang's routes): each step releases every engine's memory before the
    trainer steps and resumes it before the weights arrive (SGLang frees its weights too), so the engines hold the new
    weights after every step; an async run, which generates meanwhile, never releases."""
    pytest.importorskip("megatron.core")
    for mode, want in (("off", 1), ("overlap", 0)):
        seen = []

        async def check(step, engines, trainer, seen=seen):
            for engine in engines.pool.up():
                info = await engine.get_server_info()
                got = await engine.get_weights_checksum()
                seen.append((step, info["memory_calls"], got["weight_version"]))

        cfg = _config(tmp_path / mode, engine={"kind": "serve", "count": 2}, **{"async": {"mode": mode}},
                      trainer={**BASE["trainer"], "backend": "megatron", "offload": True})
        asyncio.run(train(cfg, on_step=check, log=lambda _: None))
        assert seen == [(s, {"release": want * s, "resume": want * s}, str(s)) for s in (1, 2) for _ in range(2)], mode
