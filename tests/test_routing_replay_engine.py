"""Routing replay (R3), engine side: TransformersPolicy on a tiny Qwen3-MoE returns each generated token's routed
experts (continuous and static batching, a cached prefix), serve-engine answers in SGLang's `meta_info.routed_experts`
form and SGLangPolicy asks for and decodes it."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from helpers import tiny  # noqa: E402
from slime_env.agents.engine_server import EngineServer  # noqa: E402
from slime_env.agents.routing_capture import RoutingCapture  # noqa: E402
from slime_env.agents.transformers_policy import TransformersPolicy  # noqa: E402
from slime_env.clients.sglang import SGLangPolicy  # noqa: E402

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


class Tok:
    pad_token_id, eos_token_id = 0, 1

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def moe():
    return tiny("qwen3_moe")


_OPEN: list = []


def _policy(*args, **kwargs):
    """A TransformersPolicy closed after the test (its engine thread would hold the model for the rest of the run)."""
    _OPEN.append(TransformersPolicy(*args, **kwargs))
    return _OPEN[-1]


@pytest.fixture(autouse=True)
def _close_policies():
    yield
    while _OPEN:
        _OPEN.pop().close()


def reference(model, ids: list[int], gen: list[int]) -> torch.Tensor:
    """The routing of one unbatched forward over prompt + generated ids at the positions that sampled each token."""
    cap = RoutingCapture(model)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids + gen[:-1]]))
        return cap.rows(list(range(len(ids) - 1, len(ids) + len(gen) - 1)))
    finally:
        cap.close()


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_engine_returns_routed_experts_per_generated_token(moe, batching):
    policy = _policy(moe, Tok(), max_batch_size=4, batching=batching)
    assert policy.capture is not None and (policy.capture.num_layers, policy.capture.top_k) == (3, 2)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]

    async def main():
        first = await asyncio.gather(*(policy.generate(p, GREEDY, session=f"s{i}") for i, p in enumerate(prompts)))
        # the next turn of each session extends its cached prefix (continuous batching: only the new ids are run)
        nxt = [p + list(g.token_ids) + [20, 21] for p, g in zip(prompts, first)]
        second = await asyncio.gather(*(policy.generate(p, GREEDY, session=f"s{i}") for i, p in enumerate(nxt)))
        return list(zip(prompts, first)) + list(zip(nxt, second))

    agree = total = 0
    for ids, gen in asyncio.run(main()):
        r = gen.routed_experts
        assert r is not None and r.shape == (len(gen.token_ids), 3, 2)
        got = torch.from_numpy(r.to_numpy().copy())
        assert (got[:, 1] == 0).all()  # the dense middle layer: 0, as SGLang's buffer
        want = reference(moe, ids, list(gen.token_ids))
        moe_layers = got[:, [0, 2]].sort(-1).values == want[:, [0, 2]].sort(-1).values
        agree += int(moe_layers.all(-1).sum())
        total += moe_layers.shape[0] * moe_layers.shape[1]
    assert agree == total  # fp32 on a CPU: batching (left padding, a cached prefix) does not flip a decision here


def test_dense_model_has_no_capture():
    policy = _policy(tiny("llama"), Tok(), max_batch_size=2, batching="static")
    assert policy.capture is None
    out = asyncio.run(policy.generate([3, 4, 5], GREEDY))
    assert out.routed_experts is None


def test_serve_engine_answers_in_sglang_form_and_sglang_policy_decodes(moe):
    import aiohttp.web

    policy = _policy(moe, Tok(), max_batch_size=4)

    async def main():
        runner = aiohttp.web.AppRunner(EngineServer(policy, "tiny-moe").app(), access_log=None)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            direct = await policy.generate([5, 6, 7, 8], GREEDY)
            client = SGLangPolicy(url, routed_experts=(3, 2))
            via_http = await client.generate([5, 6, 7, 8], GREEDY)
            plain = await SGLangPolicy(url).generate([5, 6, 7, 8], GREEDY)  # not asked for: none
            wrong = SGLangPolicy(url, routed_experts=(4, 2))
            with pytest.raises(Exception, match="wrong layers / top_k"):
                await wrong.generate([5, 6, 7, 8], GREEDY)
            async with aiohttp.ClientSession() as http:
                body = {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY, "return_logprob": True,
                        "return_routed_experts": True}
                async with http.post(f"{url}/generate", json=body) as r:
                    raw = await r.json()
            for c in (client, wrong):
                await c.close()
            return direct, via_http, plain, raw
        finally:
            await runner.cleanup()

    direct, via_http, plain, raw = asyncio.run(main())
    assert via_http.token_ids == direct.token_ids and via_http.routed_experts == direct.routed_experts
    assert plain.routed_experts is None
    import base64

    import numpy as np
    arr = np.frombuffer(base64.b64decode(raw["meta_info"]["routed_experts"]), dtype="<i4")
    assert arr.size == (4 + 6 - 1) * 3 * 2  # SGLang's [prompt + completion - 1, layers, top_k] int32


def test_serve_engine_refuses_routed_experts_of_a_dense_model():
    import aiohttp.web

    policy = _policy(tiny("llama"), Tok(), max_batch_size=2)

    async def main():
        runner = aiohttp.web.AppRunner(EngineServer(policy, "tiny").app(), access_log=None)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with aiohttp.ClientSession() as http:
                body = {"input_ids": [5, 6], "sampling_params": GREEDY, "return_routed_experts": True}
                async with http.post(f"{url}/generate", json=body) as r:
                    return r.status, await r.json()
        finally:
            await runner.cleanup()

    status, body = asyncio.run(main())
    assert status == 400 and "no MoE routers" in body["error"]["message"]


def test_a_run_with_routing_replay_asks_its_sglang_servers_for_the_experts(tmp_path, monkeypatch):
    """`trainer.routing_replay: rollout` with SGLang-API engines: the run reads (layers, top_k) from the model folder
    and every `SGLangPolicy` it makes (replacements included) sends `return_routed_experts`; a dense model is named."""
    from slime_env.trainers.run.engines import EngineConfig, Engines, routing_shape

    from slime_env import InvalidInput

    tiny("qwen3_moe").config.save_pretrained(tmp_path / "moe")
    tiny("llama").config.save_pretrained(tmp_path / "dense")
    moe_cfg = tiny("qwen3_moe").config
    assert routing_shape(str(tmp_path / "moe")) == (moe_cfg.num_hidden_layers, moe_cfg.num_experts_per_tok)
    with pytest.raises(InvalidInput, match="is not a MoE model"):
        routing_shape(str(tmp_path / "dense"))
    engines = Engines(EngineConfig(kind="sglang", urls=["http://127.0.0.1:9"]), model_path=str(tmp_path / "moe"),
                      max_concurrency=2, run_dir=tmp_path, seed=0, device="cpu", dtype="auto")
    engines.routed_experts = routing_shape(str(tmp_path / "moe"))
    made = []
    original = SGLangPolicy.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self.routed_experts)

    monkeypatch.setattr(SGLangPolicy, "__init__", record)
    with pytest.raises(Exception):  # nothing answers at port 9: the check fails after the clients are made
        asyncio.run(engines._start_servers())
    assert made == [engines.routed_experts]
