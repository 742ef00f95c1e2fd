"""`slime-env serve-engine`: the local transformers engine behind SGLang's native HTTP API.

A drop-in local stand-in for an SGLang server (`POST /generate` with the same request and response
JSON, plus `/health`, `/health_generate`, `/get_model_info`, `/flush_cache`, `/abort_request`,
`/update_weights_from_disk`, `/pause_generation`, `/continue_generation`, `/get_server_info` with
the engine's usage counters), so `SGLangPolicy`,
slime's rollout code and our tests can drive a real model where SGLang itself cannot run. Like SGLang it also serves
OpenAI's `/v1/chat/completions` (streamed or not), `/v1/completions` and `/v1/models` (`openai_routes`), so OpenAI
clients (`vf-eval`, the `openai` SDK) need no gateway in front; they record no ledger (that is `serve-gateway`'s job).
On a GPU the paged engine's prefix cache (by token content, no session needed) reports `cached_tokens`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from slime_env.agents.policy_loader import load_policy
from slime_env.agents.transformers_policy import TransformersPolicy

from slime_env.errors import InvalidInput
from slime_env.http import serve_forever
from slime_env.policy import check_sampling_seed


# What a distributed weight update holds in receive buffers at most (tensors not received straight into their
# parameter: another dtype, the engine-bound layout); /get_server_info reports it, so a sender sends one call.
UPDATE_BUFFER_BYTES = 512 << 20


def _bad(message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": 400}}, status=400)


async def _json(request: web.Request) -> dict[str, Any] | web.Response:
    try:
        body = await request.json()
    except Exception:  # noqa: BLE001 - any undecodable body is the client's error
        return _bad("request body is not valid JSON")
    if not isinstance(body, dict):
        return _bad("request body must be a JSON object")
    return body


def _finish_reason(finish: str, gen, stop_token_ids) -> dict[str, Any]:
    if finish == "abort":
        return {"type": "abort", "message": "Abort request"}
    if finish == "length":
        return {"type": "length", "length": len(gen.token_ids)}
    last = gen.token_ids[-1] if gen.token_ids else None
    return {"type": "stop", "matched": last if last in stop_token_ids else None}


class EngineServer:
    """aiohttp handlers over one `TransformersPolicy`."""

    def __init__(self, policy: TransformersPolicy, model_path: str, *, parser: str | None = "hermes"):
        from slime_env.agents.openai_routes import OpenAIRoutes

        self.policy = policy
        self.model_path = model_path
        self.openai = OpenAIRoutes(policy, model_path, parser=parser)
        self.groups: dict[str, tuple[Any, str]] = {}  # weight-update groups by name: (process group, backend)
        self.loras: dict[str, str] = {}  # LoRA adapters loaded by name ("name@version") -> their folder
        self.memory_calls = {"release": 0, "resume": 0}  # /release_ and /resume_memory_occupation calls served

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([
            web.post("/generate", self.generate),
            web.get("/health", self.health), web.get("/health_generate", self.health_generate),
            web.get("/get_model_info", self.model_info), web.get("/get_server_info", self.server_info),
            web.get("/flush_cache", self.flush_cache), web.post("/flush_cache", self.flush_cache),
            web.post("/abort_request", self.abort_request),
            web.post("/pause_generation", self.pause), web.post("/continue_generation", self.resume),
            web.post("/update_weights_from_disk", self.update_weights_from_disk),
            web.post("/update_weights_from_tensor", self.update_weights_from_tensor),
            web.post("/init_weights_update_group", self.init_weights_update_group),
            web.post("/update_weights_from_distributed", self.update_weights_from_distributed),
            web.post("/destroy_weights_update_group", self.destroy_weights_update_group),
            web.get("/get_weights_by_name", self.get_weights_by_name),
            web.post("/get_weights_by_name", self.get_weights_by_name),
            web.post("/get_weights_checksum", self.get_weights_checksum),
            web.post("/release_memory_occupation", self.release_memory),
            web.post("/resume_memory_occupation", self.resume_memory),
            web.post("/load_lora_adapter", self.load_lora_adapter),
            web.post("/unload_lora_adapter", self.unload_lora_adapter),
            *self.openai.routes(),
        ])
        return app

    async def generate(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        try:
            prompts, batched = self._prompts(body)
        except InvalidInput as e:
            return _bad(str(e))
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            return _bad("sampling_params must be an object")
        if params.get("sampling_seed") is not None:
            try:
                check_sampling_seed(params["sampling_seed"], "sampling_params.sampling_seed")
            except InvalidInput as e:
                return _bad(str(e))
        lora = body.get("lora_path")
        if lora is not None and (not isinstance(lora, str) or lora not in self.loras):
            return _bad(f"lora_path {lora!r} names no loaded adapter (loaded: {sorted(self.loras)})")
        rids = body.get("rid")
        if batched:
            rids = rids if isinstance(rids, list) else [None] * len(prompts)
            if len(rids) != len(prompts):
                return _bad(f"rid has {len(rids)} entries for {len(prompts)} prompts")
        else:
            rids = [rids]
        want_logprobs = bool(body.get("return_logprob", False))
        want_routed = bool(body.get("return_routed_experts", False))
        if want_routed and getattr(self.policy, "capture", None) is None:
            return _bad("return_routed_experts: this engine's model has no MoE routers to report (a dense model, or "
                        "serve-engine started with routed experts off)")
        start = body.get("logprob_start_len", -1)
        if not isinstance(start, int):
            return _bad("logprob_start_len must be an integer")
        try:
            images = self._images(body.get("image_data"), len(prompts), batched)
        except InvalidInput as e:
            return _bad(str(e))
        if params.get("max_new_tokens") == 0:  # SGLang's prefill-only scoring: the prompt's own log-probs
            results = await asyncio.gather(*(self._score(ids, rid, want_logprobs, start)
                                             for ids, rid in zip(prompts, rids)))
            return web.json_response(results if batched else results[0])
        try:
            results = await asyncio.gather(*(self._one(ids, params, rid, want_logprobs, want_routed, imgs)
                                             for ids, rid, imgs in zip(prompts, rids, images)))
        except InvalidInput as e:
            return _bad(str(e))
        return web.json_response(results if batched else results[0])

    def _images(self, data: Any, n: int, batched: bool) -> list[list[Any]]:
        """SGLang's `image_data` (one list per prompt when batched; base64, data URLs or paths) as `ImagePart`s."""
        if data is None:
            return [[] for _ in range(n)]
        if not hasattr(self.policy, "processor"):
            raise InvalidInput("image_data: this engine's model takes no images (serve a vision model: an Idefics3 / "
                               "SmolVLM folder)")
        rows = data if batched else [data]
        if not isinstance(rows, list) or len(rows) != n or not all(isinstance(r, list) for r in rows):
            raise InvalidInput(f"image_data must be a list of images{' per prompt' if batched else ''}")
        return [[_image(x, f"image_data[{i}]") for i, x in enumerate(r)] for r in rows]

    def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        if "input_ids" in body:
            ids = body["input_ids"]
            batched = bool(ids) and isinstance(ids[0], list)
            rows = ids if batched else [ids]
            for row in rows:
                if not isinstance(row, list) or not row or not all(isinstance(t, int) and t >= 0 for t in row):
                    raise InvalidInput("input_ids must be a non-empty list of non-negative ints (or a list of them)")
            return rows, batched
        if "text" in body:
            text = body["text"]
            batched = isinstance(text, list)
            rows = text if batched else [text]
            if not all(isinstance(t, str) and t for t in rows):
                raise InvalidInput("text must be a non-empty string (or a list of them)")
            return [self.policy.tokenizer.encode(t, add_special_tokens=False) for t in rows], batched
        raise InvalidInput("request needs 'input_ids' or 'text'")

    async def _one(self, ids: list[int], params: dict[str, Any], rid: str | None, logprobs: bool,
                   routed: bool = False, images: list[Any] | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        rid = rid or uuid.uuid4().hex
        gen = await self.policy.generate(ids, params, rid=rid, **({"images": images} if images else {}))
        stop_ids = set(params.get("stop_token_ids") or ()) | {self.policy.eos_id}
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": _finish_reason(gen.finish_reason, gen, stop_ids),
            "prompt_tokens": len(ids), "completion_tokens": len(gen.token_ids), "cached_tokens": gen.cached_tokens,
            "weight_version": gen.weight_version, "e2e_latency": time.perf_counter() - t0,
        }
        if gen.adapter is not None:  # the adapter its tokens came from (ours; SGLang's meta_info has none)
            meta["adapter"] = gen.adapter
        if logprobs:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(gen.logprobs, gen.token_ids)]
        if routed and gen.routed_experts is not None:
            # SGLang's form: base64 int32 [prompt + completion - 1, layers, top_k]; rows before the prompt's last token
            # are -1 (this engine records the forwards that sampled a token only)
            meta["routed_experts"] = gen.routed_experts.to_sglang(len(ids))
        return {"text": gen.text, "output_ids": list(gen.token_ids), "meta_info": meta}

    async def _score(self, ids: list[int], rid: str | None, logprobs: bool, start: int) -> dict[str, Any]:
        """No generation: with `return_logprob`, `input_token_logprobs` from position `start` on as SGLang gives them
        ([log-prob, id, None]; the first token of the prompt has no log-prob: None)."""
        t0 = time.perf_counter()
        meta: dict[str, Any] = {"id": rid or uuid.uuid4().hex, "finish_reason": {"type": "length", "length": 0},
                                "prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": 0,
                                "weight_version": self.policy.weight_version}
        if logprobs:
            if start >= 0:
                lps = [None, *await self.policy.score(ids)]
                meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps[start:], ids[start:])]
            meta["output_token_logprobs"] = []
        meta["e2e_latency"] = time.perf_counter() - t0
        return {"text": "", "output_ids": [], "meta_info": meta}

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.policy.memory_released:  # asleep on request (a colocated trainer steps): healthy, nothing to run
            return web.Response(text="")
        try:
            await asyncio.wait_for(self.policy.generate([self.policy.eos_id or 0], {"max_new_tokens": 1,
                                                                                     "temperature": 0}), 60)
        except Exception as e:  # noqa: BLE001
            return web.Response(status=503, text=f"generation failed: {e}")
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                  "is_generation": True, "weight_version": self.policy.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        p = self.policy
        return web.json_response({"max_batch_size": p.max_batch_size, "batch_window_s": p.batch_window_s,
                                  "paused": p.paused, "weight_version": p.weight_version, "usage": p.usage,
                                  # adapters are merged: the last one loaded generates every request (not SGLang's)
                                  "lora_merged": True,
                                  # a distributed update call of any size buffers at most this (not SGLang's): a
                                  # sender may send a whole update in one call
                                  "update_buffer_bytes": UPDATE_BUFFER_BYTES,
                                  "memory_calls": self.memory_calls,
                                  "memory_released": p.memory_released})

    async def flush_cache(self, request: web.Request) -> web.Response:
        await asyncio.to_thread(self.policy.flush_cache)
        return web.Response(text="Cache flushed.")

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        if body.get("abort_all"):
            return web.json_response({"success": True, "aborted": self.policy.abort_all()})
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            return _bad("abort_request needs 'rid' (a string) or 'abort_all': true")
        return web.json_response({"success": self.policy.abort(rid)})

    async def pause(self, request: web.Request) -> web.Response:
        self.policy.pause()
        return web.json_response({"success": True})

    async def resume(self, request: web.Request) -> web.Response:
        self.policy.resume()
        return web.json_response({"success": True})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return _bad("update_weights_from_disk needs 'model_path'")
        version = body.get("weight_version")
        try:
            await self.policy.update_weights(path, str(version) if version is not None else path)
        except (InvalidInput, OSError) as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        self.model_path = path
        return web.json_response({"success": True, "message": f"loaded weights from {path}",
                                  "weight_version": self.policy.weight_version})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang's route: `serialized_named_tensors` (one payload per engine TP rank; one here) of
        `slime_env.agents.weight_transfer`: CUDA IPC handles or shared memory from a process on this host."""
        from slime_env.agents.weight_transfer import deserialize_named_tensors

        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or len(payloads) != 1 or not isinstance(payloads[0], str):
            return _bad("update_weights_from_tensor needs 'serialized_named_tensors': a list of one base64 string")
        if body.get("load_format") not in (None, "direct"):
            return _bad(f"load_format {body.get('load_format')!r} is not supported (null or 'direct')")
        try:
            named = await asyncio.to_thread(deserialize_named_tensors, payloads[0])
            version = body.get("weight_version")
            await self.policy.update_weights(dict(named), str(version) if version is not None else
                                             str(int(time.time())))
        except Exception as e:  # noqa: BLE001 - an undecodable or mismatched payload is the caller's error
            return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}"}, status=400)
        return web.json_response({"success": True, "message": f"loaded {len(named)} tensors",
                                  "weight_version": self.policy.weight_version})

    # --- LoRA adapters (SGLang's routes; applied merged: slime_env.agents.lora_adapter) ----------------------------
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """SGLang's `/load_lora_adapter` (`lora_name`, `lora_path`: a PEFT folder): the adapter is merged into the
        weights between batches; its version is `weight_version` or what follows '@' in the name. The last one loaded
        is the one generating; earlier names stay accepted by `/generate` until unloaded."""
        from slime_env.agents.lora_adapter import LoRAAdapter

        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _bad("load_lora_adapter needs 'lora_name' and 'lora_path' (strings)")
        base, _, tail = name.rpartition("@")
        version = body.get("weight_version") or (tail if base else name)
        try:
            adapter = await asyncio.to_thread(LoRAAdapter.load, path, base or name)
            await self.policy.load_adapter(adapter, str(version))
        except (OSError, ValueError, InvalidInput) as e:
            return web.json_response({"success": False, "error_message": f"{type(e).__name__}: {e}"}, status=400)
        self.loras[name] = path
        return web.json_response({"success": True, "loaded_adapters": dict(self.loras),
                                  "weight_version": self.policy.weight_version})

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """SGLang's `/unload_lora_adapter` (`lora_name`). The adapter generating now stays merged until the next load
        replaces it: only a name that `/generate` no longer accepts."""
        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        name = body.get("lora_name")
        if name not in self.loras:
            return web.json_response({"success": False, "error_message": f"no adapter named {name!r} is loaded"},
                                     status=400)
        del self.loras[name]
        return web.json_response({"success": True, "loaded_adapters": dict(self.loras)})

    # --- weights over a torch.distributed group (SGLang's disaggregated update) -------------------------------
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """Join the trainer's weight-update group at rank `rank_offset` (returns once every rank has joined)."""
        from slime_env.agents.weight_transfer import open_update_group

        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        try:
            address, port = str(body["master_address"]), int(body["master_port"])
            rank, world = int(body["rank_offset"]), int(body["world_size"])
            name, backend = str(body.get("group_name", "weight_update_group")), str(body.get("backend", "nccl"))
        except (KeyError, TypeError, ValueError) as e:
            return _bad(f"init_weights_update_group needs master_address, master_port, rank_offset, world_size "
                        f"(and group_name, backend): {e!r}")
        if not 0 < rank < world:
            return _bad(f"rank_offset {rank} is not in 1..world_size-1 (world_size {world}; rank 0 is the trainer)")
        if backend not in ("nccl", "gloo"):
            return _bad(f"backend {backend!r}: 'nccl' or 'gloo'")
        if backend == "nccl" and self.policy.device.type != "cuda":
            return _bad("backend 'nccl' needs the engine on CUDA; this engine runs on the CPU (use 'gloo')")
        if name in self.groups:
            return _bad(f"group {name!r} already exists: destroy it first")
        try:
            group = await asyncio.to_thread(open_update_group, address, port, rank, world, name, backend)
        except Exception as e:  # noqa: BLE001 - unreachable master, timeout: the caller's to fix
            return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}"}, status=400)
        self.groups[name] = (group, backend)
        return web.json_response({"success": True, "message": f"joined {name!r} as rank {rank} of {world}"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """Receive `names` (with `dtypes`, `shapes`) by broadcast from rank 0 of the group, in order, and load them."""
        import torch
        from slime_env.agents.weight_transfer import broadcast

        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        name = str(body.get("group_name", "weight_update_group"))
        if name not in self.groups:
            return _bad(f"no weight-update group {name!r}: call /init_weights_update_group first")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes) and names):
            return _bad("update_weights_from_distributed needs names, dtypes and shapes: lists of one length")
        try:
            specs = [(str(n), getattr(torch, str(d).removeprefix("torch.")), [int(x) for x in shape])
                     for n, d, shape in zip(names, dtypes, shapes)]
        except (AttributeError, TypeError, ValueError) as e:
            return _bad(f"bad dtype or shape: {e}")
        group, backend = self.groups[name]
        device = self.policy.device if backend == "nccl" else torch.device("cpu")
        params = self.policy.model.state_dict(keep_vars=False)

        def receive() -> Iterator[dict[str, Any]]:
            """Runs with the engine idle. A tensor whose parameter has its dtype, shape and device is received
            straight into it (no second copy); others into buffers, handed to the load (which casts and copies)
            whenever they reach `UPDATE_BUFFER_BYTES`: a call of any size holds at most that much more memory."""
            out, held = {}, 0
            for n, dtype, shape in specs:
                p = params.get(n)
                if p is not None and p.dtype == dtype and list(p.shape) == shape and p.device == device \
                        and p.is_contiguous():
                    broadcast(p, group)
                    continue
                t = torch.empty(shape, dtype=dtype, device=device)
                broadcast(t, group)
                out[n], held = t, held + t.numel() * t.element_size()
                if held >= UPDATE_BUFFER_BYTES:
                    yield out
                    out, held = {}, 0
            if out:
                yield out

        version = body.get("weight_version")
        try:
            await self.policy.update_weights(receive, str(version) if version is not None else
                                             self.policy.weight_version, partial=True)
        except Exception as e:  # noqa: BLE001 - names or shapes that are not this model's
            return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}"}, status=400)
        return web.json_response({"success": True, "message": f"loaded {len(specs)} tensors",
                                  "weight_version": self.policy.weight_version})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        from slime_env.agents.weight_transfer import close_update_group

        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        entry = self.groups.pop(str(body.get("group_name", "weight_update_group")), None)
        if entry is None:
            return web.json_response({"success": False, "message": "no such group"}, status=400)
        await asyncio.to_thread(close_update_group, entry[0])
        return web.json_response({"success": True, "message": "destroyed"})

    def _named_parameters(self, names: Any) -> dict[str, Any] | web.Response:
        if self.policy.memory_released:
            return _bad("the engine's memory is released: POST /resume_memory_occupation first")
        params = dict(self.policy.model.state_dict())
        if isinstance(names, str):
            names = [names]
        if not isinstance(names, list) or not names:
            return _bad("give 'name' (a parameter name) or 'names' (a list of them)")
        unknown = [n for n in names if n not in params]
        if unknown:
            return _bad(f"unknown parameter(s) {unknown[:5]}; e.g. {sorted(params)[:3]}")
        return {n: params[n] for n in names}

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's check route: the first `truncate_size` values of a parameter, flattened."""
        # SGLang's clients send a JSON body even with GET; a browser sends the query string.
        body = await _json(request) if request.can_read_body else dict(request.query)
        if isinstance(body, web.Response):
            return body
        found = self._named_parameters(body.get("name"))
        if isinstance(found, web.Response):
            return found
        (t,) = found.values()
        n = int(body.get("truncate_size", 100))
        return web.json_response(t.detach().flatten()[:n].float().cpu().tolist())

    async def get_weights_checksum(self, request: web.Request) -> web.Response:
        """`{name: sha256 of the tensor's bytes in float32}` for `names` (all when omitted): whole tensors compared
        across processes without sending them."""
        import hashlib

        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        names = body.get("names") or sorted(self.policy.model.state_dict())
        found = self._named_parameters(names)
        if isinstance(found, web.Response):
            return found

        def digest() -> dict[str, str]:
            return {n: hashlib.sha256(t.detach().float().contiguous().cpu().numpy().tobytes()).hexdigest()
                    for n, t in found.items()}

        return web.json_response({"weight_version": self.policy.weight_version,
                                  "checksums": await asyncio.to_thread(digest)})

    async def release_memory(self, request: web.Request) -> web.Response:
        """SGLang's `/release_memory_occupation`: once the running requests finished, the engine's GPU memory goes
        back (the weights to pinned host memory, the K/V pool, CUDA graphs and their pool, cuBLAS's workspaces);
        until `/resume_memory_occupation` generation requests wait (none is refused) and `/health_generate`
        answers without generating. `tags` (SGLang's "weights", "kv_cache", "cuda_graph"): without "weights" the
        weights stay."""
        body = await _json(request) if request.can_read_body else {}
        if isinstance(body, web.Response):
            return body
        tags = body.get("tags")
        weights = not isinstance(tags, list) or "weights" in tags
        await asyncio.to_thread(lambda: self.policy.release_memory(until_resumed=True, weights=weights))
        self.memory_calls["release"] += 1
        return web.json_response({"success": True})

    async def resume_memory(self, request: web.Request) -> web.Response:
        """Everything `/release_memory_occupation` freed comes back (the weights with the values they had, unless a
        weight update wrote new ones meanwhile); the requests that waited run."""
        await asyncio.to_thread(self.policy.resume_memory)
        self.memory_calls["resume"] += 1
        return web.json_response({"success": True})

def serve(model: str = "default", host: str = "127.0.0.1", port: int = 30000, max_batch_size: int = 16,
          batch_window_s: float = 0.02, device: str = "auto", dtype: str = "auto",
          mem_fraction: float | None = None, parser: str | None = "hermes") -> None:
    """Load the model and serve until interrupted. Prints `listening on http://HOST:PORT` when ready.
    `mem_fraction`: of the free GPU memory, for the paged engine's K/V pool (None: the engine's default)."""
    policy, path = load_policy(model, max_batch_size=max_batch_size, batch_window_s=batch_window_s, device=device,
                               dtype=dtype, paged_options=None if mem_fraction is None else
                               {"kv_memory_fraction": mem_fraction})

    async def close() -> None:
        policy.close()

    serve_forever(EngineServer(policy, path, parser=parser).app, host=host, port=port, backlog=4096, on_exit=close)


def _image(value: Any, where: str) -> Any:
    """One `image_data` entry: a data URL, a file path, or base64 of the encoded image (what slime sends)."""
    import base64
    import binascii
    from pathlib import Path

    from slime_env.images import ImagePart

    if isinstance(value, str) and not value.startswith("data:") and not (len(value) < 1024 and Path(value).is_file()):
        try:
            value = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInput(f"{where}: neither a data URL, a file, nor base64 of an image") from None
    return ImagePart.coerce(value, where)
