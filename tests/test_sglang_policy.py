"""SGLangPolicy against `slime-env serve-engine` running the real SmolLM2 model on 127.0.0.1.

Real SGLang cannot run on these machines (no GPU, no network to fetch it), so the SGLang protocol is
exercised against our own server that speaks it (agents/engine_server.py), started as a subprocess
through the CLI. Faults are injected by a small proxy in front of it.
"""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from aiohttp import ClientSession, web  # noqa: E402
from helpers import LocalServer, serve_engine  # noqa: E402
from slime_env.agents.default_model import default_model_path, load_default_model  # noqa: E402
from slime_env.clients.sglang import SGLangPolicy, parse_generate_response  # noqa: E402
from slime_env.agents.transformers_policy import TransformersPolicy  # noqa: E402

from slime_env import Message, Task, get_renderer, make, run_episode  # noqa: E402
from slime_env.http import ProtocolError, RemoteError  # noqa: E402


@pytest.fixture(scope="module")
def engine_url():
    with serve_engine("--max-batch-size", "8") as url:
        yield url


@pytest.fixture(scope="module")
def local():
    model, tok = load_default_model()
    policy = TransformersPolicy(model, tok)
    yield model, tok, policy
    policy.close()


def prompts(tok):
    r = get_renderer(tok)
    return [r.render_prompt([Message("user", q)]) for q in ("What is 2+2?", "Name a fruit.", "Count to five.")]


def test_ids_and_logprobs_match_the_in_process_engine(engine_url, local):
    _, tok, inproc = local
    params = {"temperature": 0, "max_new_tokens": 12}

    async def main():
        remote = SGLangPolicy(engine_url)
        try:
            a = await asyncio.gather(*(remote.generate(p, params) for p in prompts(tok)))
            b = [await inproc.generate(p, params) for p in prompts(tok)]
            return a, b, remote.usage
        finally:
            await remote.close()

    remote_gens, local_gens, usage = asyncio.run(main())
    for r, loc in zip(remote_gens, local_gens):
        assert r.token_ids == loc.token_ids
        assert max(abs(x - y) for x, y in zip(r.logprobs, loc.logprobs)) < 1e-4
        assert r.weight_version == "0" and r.prompt_tokens > 0 and r.latency_s > 0
    assert usage["calls"] == 3 and usage["completion_tokens"] == sum(len(g.token_ids) for g in remote_gens)


def test_abort_one_in_flight_request(engine_url, local):
    _, tok, _ = local
    p = prompts(tok)

    async def main():
        policy = SGLangPolicy(engine_url)
        a, b = policy.for_episode("episode-a"), policy.for_episode("episode-b")
        long = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
        short = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
        ta = asyncio.create_task(a.generate(p[0], long))
        tb = asyncio.create_task(b.generate(p[1], short))
        await asyncio.sleep(1.0)
        assert a.live_rid == "episode-a-0"
        assert await a.abort()
        ga, gb = await asyncio.gather(ta, tb)
        await policy.close()
        return ga, gb

    ga, gb = asyncio.run(main())
    assert ga.finish_reason == "abort" and 0 < len(ga.token_ids) < 400
    assert gb.finish_reason == "length" and len(gb.token_ids) == 40


def test_pause_and_continue(engine_url, local):
    _, tok, _ = local

    async def main():
        policy = SGLangPolicy(engine_url)
        await policy.pause_generation()
        task = asyncio.create_task(policy.generate(prompts(tok)[0], {"temperature": 0, "max_new_tokens": 2}))
        await asyncio.sleep(0.5)
        held = not task.done()
        await policy.continue_generation()
        gen = await asyncio.wait_for(task, 60)
        ok = await policy.health()
        await policy.flush_cache()
        await policy.close()
        return held, gen, ok

    held, gen, ok = asyncio.run(main())
    assert held and len(gen.token_ids) == 2 and ok


class FaultyProxy:
    """Forwards to the engine; the first `fail` requests get `mode`: 503, 400 or a dropped connection."""

    def __init__(self, target: str, mode: str, fail: int):
        self.target, self.mode, self.fail, self.seen = target, mode, fail, 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen += 1
        body = await request.read()
        if self.seen <= self.fail:
            if self.mode == "drop":
                request.transport.close()  # the client sees the server disconnect mid-request
                return web.Response()
            return web.Response(status=503 if self.mode == "503" else 400, text=f"injected {self.mode}")
        async with ClientSession() as s:
            async with s.post(self.target + request.path, data=body,
                              headers={"content-type": "application/json"}) as r:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    async def __aenter__(self):
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.server = await LocalServer(app).__aenter__()
        self.url = self.server.url
        return self

    async def __aexit__(self, *exc):
        await self.server.__aexit__(*exc)


@pytest.mark.parametrize("mode,fail,ok,retries", [("503", 2, True, 2), ("drop", 1, True, 1),
                                                   ("400", 1, False, 0), ("503", 10, False, 2)])
def test_retries_on_5xx_and_dropped_connections_only(engine_url, local, mode, fail, ok, retries):
    _, tok, _ = local

    async def main():
        async with FaultyProxy(engine_url, mode, fail) as proxy:
            policy = SGLangPolicy(proxy.url, max_retries=2, backoff_s=0.01)
            try:
                gen = await policy.generate(prompts(tok)[0], {"temperature": 0, "max_new_tokens": 3})
                return gen, None, policy.http.retries, proxy.seen
            except RemoteError as e:
                return None, e, policy.http.retries, proxy.seen
            finally:
                await policy.close()

    gen, err, made, seen = asyncio.run(main())
    assert (gen is not None) == ok and made == retries and seen == retries + 1
    if not ok:
        assert str(err).count("injected") == 1 and (err.status == (400 if mode == "400" else 503))


def test_update_weights_from_disk_changes_outputs(engine_url, local, tmp_path):
    model, tok, _ = local
    noisy = tmp_path / "noisy"
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for v in model.state_dict().values():
            if v.dtype.is_floating_point:
                v.add_(0.05 * torch.randn_like(v))
    model.save_pretrained(str(noisy))
    model.load_state_dict(original)
    params = {"temperature": 0, "max_new_tokens": 6}

    async def main():
        policy = SGLangPolicy(engine_url)
        before = await policy.generate(prompts(tok)[0], params)
        await policy.update_weights_from_disk(str(noisy), "step-1")
        after = await policy.generate(prompts(tok)[0], params)
        info = await policy.get_model_info()
        with pytest.raises(RemoteError, match="no .safetensors"):
            await policy.update_weights_from_disk(str(tmp_path / "missing"), "x")
        await policy.update_weights_from_disk(str(default_model_path()), "step-2")
        restored = await policy.generate(prompts(tok)[0], params)
        await policy.close()
        return before, after, info, restored

    before, after, info, restored = asyncio.run(main())
    assert after.weight_version == "step-1" and after.logprobs != before.logprobs
    assert info["weight_version"] == "step-1"
    assert restored.token_ids == before.token_ids and restored.weight_version == "step-2"


def test_episode_through_sglang_records_session_and_versions(engine_url, local):
    _, tok, _ = local

    async def main():
        policy = SGLangPolicy(engine_url)
        try:
            return await run_episode(make("Calculator-v0"), policy, Task(prompt="What is 2 + 3?", label=5),
                                     renderer=get_renderer(tok), max_turns=2, max_new_tokens=24,
                                     sampling_params={"temperature": 0.7, "sampling_seed": 1})
        finally:
            await policy.close()

    traj = asyncio.run(main())
    traj.check()
    assert traj.status in ("completed", "truncated"), traj.reason
    assert set(traj.metadata["weight_versions"]) <= {"0", "step-2"}
    assert traj.to_slime_sample()["session_id"] == traj.metadata["session_id"]


def test_protocol_errors_are_named():
    with pytest.raises(ProtocolError, match="no meta_info"):
        parse_generate_response({"text": "x"})
    with pytest.raises(ProtocolError, match="output_token_logprobs: the server must support return_logprob"):
        parse_generate_response({"text": "x", "meta_info": {"finish_reason": {"type": "stop"}}})
    with pytest.raises(ProtocolError, match=r"\[1\] has no log-prob"):
        parse_generate_response({"meta_info": {"output_token_logprobs": [[-1.0, 5, None], [None, 6, None]],
                                               "finish_reason": {"type": "stop"}}})
    with pytest.raises(ProtocolError, match="completion_tokens=3 but 1"):
        parse_generate_response({"meta_info": {"output_token_logprobs": [[-1.0, 5]], "completion_tokens": 3,
                                               "finish_reason": {"type": "stop"}}})
    with pytest.raises(ProtocolError, match="finish_reason"):
        parse_generate_response({"meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "eos"}}})
    g = parse_generate_response({"text": "hi", "meta_info": {"output_token_logprobs": [[-0.5, 7, "hi"]],
                                                             "finish_reason": {"type": "length"},
                                                             "weight_version": 3, "cached_tokens": 4}})
    assert (g.token_ids, g.logprobs, g.finish_reason, g.weight_version, g.cached_tokens) == \
        ((7,), (-0.5,), "length", "3", 4)


def test_deadline_aborts_the_engine_request(engine_url, local):
    _, tok, _ = local

    async def main():
        class OneLongTurn(SGLangPolicy):
            """No stop string ends the turn: the deadline lands mid-generation whatever the machine's speed."""

            async def generate(self, input_ids, sampling_params, **kw):
                params = {k: v for k, v in sampling_params.items() if k not in ("stop", "stop_token_ids")}
                return await super().generate(input_ids, params, **kw)

        policy = OneLongTurn(engine_url)
        try:
            before = (await policy.http.request("GET", "/get_server_info"))["usage"]
            # 5 s: the request has surely reached the server when the deadline fires, even on a loaded CI
            # machine (with 1 s it once had not, and an abort that overtakes its request finds nothing); its
            # 2,000 tokens take far longer than that to decode.
            traj = await run_episode(make("Calculator-v0"), policy, Task(prompt="What is 2 + 3?", label=5),
                                     renderer=get_renderer(tok), max_new_tokens=2000, deadline_s=5.0,
                                     sampling_params={"temperature": 0, "ignore_eos": True})
            for _ in range(300):  # the engine records the abort when its batch ends
                after = (await policy.http.request("GET", "/get_server_info"))["usage"]
                if after["aborted"] > before["aborted"]:
                    break
                await asyncio.sleep(0.1)
            return traj, before, after
        finally:
            await policy.close()

    traj, before, after = asyncio.run(main())
    assert traj.status == "truncated" and "deadline of 5.0s exceeded during policy.generate" in traj.reason
    assert after["aborted"] == before["aborted"] + 1
    # the aborted request stopped early instead of generating its 2,000 tokens for nobody
    assert after["completion_tokens"] - before["completion_tokens"] < 2000


def test_update_weights_from_tensor_through_shared_memory_equals_the_in_process_engine(engine_url, local):
    """A trainer's `sync` with no path sends the weights from memory (SGLang's /update_weights_from_tensor; shared
    memory on CPU, CUDA IPC on a GPU); the server's next generation equals the in-process engine's on them."""
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig

    model, tok, policy_local = local
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for v in model.state_dict().values():
            if v.dtype.is_floating_point:
                v.add_(0.05 * torch.randn_like(v, generator=torch.Generator().manual_seed(3)))
    params = {"temperature": 0, "max_new_tokens": 6}

    async def main():
        remote = SGLangPolicy(engine_url)
        before = await remote.generate(prompts(tok)[0], params)
        version = await TorchTrainer(model, TrainerConfig(), pad_id=tok.pad_token_id).sync(remote, version="mem-1")
        after = await remote.generate(prompts(tok)[0], params)
        here = await policy_local.generate(prompts(tok)[0], params)  # the local engine holds `model` itself
        with pytest.raises(RemoteError, match="serialized_named_tensors"):
            await remote.http.request("POST", "/update_weights_from_tensor", {"serialized_named_tensors": "x"})
        await remote.update_weights_from_tensor(list(original.items()), weight_version="restored")
        restored = await remote.generate(prompts(tok)[0], params)
        await remote.close()
        return version, before, after, here, restored

    try:
        version, before, after, here, restored = asyncio.run(main())
    finally:
        model.load_state_dict(original)
    assert version == "mem-1" and after.weight_version == "mem-1" and after.logprobs != before.logprobs
    assert after.token_ids == here.token_ids
    assert after.logprobs == pytest.approx(here.logprobs, abs=1e-4)
    assert restored.token_ids == before.token_ids and restored.weight_version == "restored"


def test_pooled_sessions_close_with_their_event_loop_without_close(engine_url):
    """slime drives the plug-in from a plain asyncio program and never calls our close(): the pooled aiohttp
    session must still be closed when the loop shuts down (no "Unclosed client session", no leaked socket)."""
    import subprocess
    import sys

    code = f"""
import asyncio
from slime_env.agents import SGLangPolicy
keep = []
async def main():
    policy = SGLangPolicy({engine_url!r})
    info = await policy.get_model_info()
    keep.append(policy)  # a module-level pool, as the slime plug-in keeps one
    print("model", bool(info))
asyncio.run(main())
print("loop closed")
"""
    out = subprocess.run([sys.executable, "-X", "dev", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loop closed" in out.stdout
    assert "Unclosed" not in out.stderr, out.stderr[-2000:]


def test_openai_routes_on_serve_engine_itself(engine_url, local):
    """`serve-engine` answers the `openai` SDK as SGLang does, with no gateway in front (before: /v1/* was 404):
    greedy chat and plain completions generate what the in-process engine generates for the same ids, a stream
    reassembles to the same reply, and a bad field is the SDK's BadRequestError naming it."""
    openai = pytest.importorskip("openai")
    _, tok, inproc = local
    client = openai.OpenAI(base_url=f"{engine_url}/v1", api_key="unused")
    question = [{"role": "user", "content": "What is 2+2?"}]
    ids = get_renderer(tok).render_prompt([Message("user", "What is 2+2?")])
    want = asyncio.run(inproc.generate(ids, {"temperature": 0, "max_new_tokens": 8}))
    text = tok.decode(want.token_ids, skip_special_tokens=True)

    chat = client.chat.completions.create(model="m", messages=question, temperature=0, max_tokens=8)
    assert chat.choices[0].message.content == text and chat.usage.prompt_tokens == len(ids)
    assert chat.usage.completion_tokens == len(want.token_ids)
    stream = client.chat.completions.create(model="m", messages=question, temperature=0, max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    plain = client.completions.create(model="m", prompt=list(ids), temperature=0, max_tokens=8, logprobs=1)
    assert plain.choices[0].text == tok.decode(want.token_ids)
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert [m.id for m in client.models.list().data] == [str(default_model_path())]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="m", messages=question, temperature=5)


def test_a_gateway_in_front_of_an_engine_server_refuses_prompts_past_its_models_context(engine_url, local):
    """The gateway asks the engine server its model's context (`/v1/models`' `max_model_len`, as vLLM and SGLang say
    it) at start and answers a longer prompt with a 400 naming the limit, before the engine sees it (before: only an
    in-process engine's limit was known; 15,025 tokens of empty messages kept a served engine busy for two minutes
    while every other session waited)."""
    openai = pytest.importorskip("openai")
    from slime_env.gateway import Gateway

    _, tok, _ = local

    async def main():
        policy = SGLangPolicy(engine_url)
        gateway = Gateway(policy, get_renderer(tok), "hermes")
        await gateway.start()
        try:
            session = gateway.open_session()
            client = openai.AsyncOpenAI(base_url=gateway.session_url(session), api_key=session.key, max_retries=0)
            with pytest.raises(openai.BadRequestError, match="context of 8192 tokens"):
                await client.chat.completions.create(model="m", max_tokens=4,
                                                     messages=[{"role": "user", "content": ""}] * 3000)
            ok = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=2, temperature=0)
            await client.close()
            return gateway.max_context_tokens, ok
        finally:
            await gateway.stop()
            await policy.close()

    limit, ok = asyncio.run(main())
    assert limit == 8192 and ok.choices[0].message is not None
