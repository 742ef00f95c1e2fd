"""`VLLMPolicy`: a vLLM server through its native RL routes: token ids in; ids, log-probs, weight versions out.

Generation is vLLM's token-in route `POST /inference/v1/generate` (served with `--enable-scale-out`, or
`--tokens-only`): `{"request_id", "token_ids", "sampling_params": {...vLLM SamplingParams, "logprobs": 0},
"output_mode": "tokens"}` → `{"choices": [{"token_ids", "logprobs": {"content": [{"token_id", "logprob"}]},
"finish_reason", "weight_versions": [{"version", "start", "end"}]}], "usage"}`. The ids and log-probs are the
engine's own (never re-tokenized text); `weight_versions` says which weights sampled which output tokens — several
spans when generation was paused with `mode=keep` and resumed under new weights — and becomes
`Generation.weight_spans` (`Generation.weight_version` is the oldest span's).

The control routes are those of vLLM's dev mode (`VLLM_SERVER_DEV_MODE=1`, `vllm/entrypoints/rl/online/api_router.py`
and `vllm/entrypoints/serve/dev/`): `/pause?mode=abort|wait|keep`, `/resume`, `/is_paused`, `/abort_requests`,
the weight-transfer protocol (`/init_weight_transfer_engine {"init_info"}`, `/start_weight_update`,
`/update_weights {"update_info"}`, `/finish_weight_update {"weight_version"}`, `/shutdown_weight_transfer_engine`),
`/update_weight_version {"new_version"}`, `/weight_info`, `/weight_checker {"action": "checksum"}` (sha256 per
tensor), `/collective_rpc` (a disk reload: `reload_weights(weights_path=...)`), `/sleep?level=` and `/wake_up`.
`check()` finds what a server lacks (dev mode, the token-in route, a version this client knows) and says so.

LoRA adapters (`vllm serve --enable-lora --max-lora-rank R`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`):
`/v1/load_lora_adapter {"lora_name", "lora_path"}` and `/v1/unload_lora_adapter {"lora_name"}` (both answer plain
text; `vllm/entrypoints/serve/lora/`); a request names its adapter in the token-in route's `model` field, as vLLM
selects one (`OpenAIServing._maybe_get_adapters`). The requests name the newest adapter this client loaded.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from types import EllipsisType
from typing import Any

from slime_env import Generation
from slime_env.clients.session import EpisodeSession, ServerClient
from slime_env.http import ProtocolError, RemoteError
from slime_env.policy import check_sampling_seed

MIN_VERSION = (0, 20)  # the weight-transfer protocol, pause modes and weight_versions spans (read at 0.32.0)
PAUSE_MODES = ("abort", "wait", "keep")
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
# Our (SGLang-style) sampling params -> vLLM SamplingParams fields.
_RENAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed",
           "no_stop_trim": None}
_PASS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
         "max_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "bad_words",
         "allowed_token_ids")


class VLLMServerError(RemoteError):
    """A vLLM server that cannot train: not in dev mode, too old, or without the token-in route."""


def sampling_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM `SamplingParams` for our sampling params: one log-prob (the sampled token's), special tokens and stop
    strings kept in the output (as SGLang's `no_stop_trim`)."""
    out: dict[str, Any] = {"max_tokens": 128, "logprobs": 0, "skip_special_tokens": False,
                           "include_stop_str_in_output": True, "spaces_between_special_tokens": False}
    for key, value in params.items():
        key = _RENAME.get(key, key)
        if key is None or value is None or key not in _PASS:
            continue
        if key == "top_k" and value in (-1, 0):
            continue
        if key == "stop" and isinstance(value, str):
            value = [value]
        out[key] = list(value) if isinstance(value, (tuple, set, frozenset)) else value
    return out


def parse_generate(body: Any) -> Generation:
    """A `Generation` from one `/inference/v1/generate` answer (`output_mode: tokens`); ProtocolError naming what is
    missing."""
    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise ProtocolError(f"/inference/v1/generate answer has no choices[0]: {str(body)[:200]}") from None
    ids = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    if ids is None or content is None:
        raise ProtocolError("/inference/v1/generate answer has no choices[0].token_ids / logprobs.content (the "
                            "request asks for sampling_params.logprobs=0)")
    if len(content) != len(ids):
        raise ProtocolError(f"{len(ids)} generated ids but {len(content)} log-prob entries")
    logprobs = []
    for i, (tid, entry) in enumerate(zip(ids, content)):
        if not isinstance(entry, dict) or entry.get("token_id") != tid or not isinstance(entry.get("logprob"),
                                                                                        (int, float)):
            raise ProtocolError(f"logprobs.content[{i}] is {entry!r}, not the log-prob of token {tid}")
        logprobs.append(float(entry["logprob"]))
    finish = choice.get("finish_reason")
    if finish not in _FINISH:
        raise ProtocolError(f"finish_reason {finish!r} is not stop / length / abort")
    spans = tuple(_span(s, len(ids)) for s in choice.get("weight_versions") or ())
    usage = body.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Generation(token_ids=tuple(int(t) for t in ids), logprobs=tuple(logprobs), finish_reason=_FINISH[finish],
                      weight_version=spans[0][0] if spans else None, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                      cached_tokens=int(cached), weight_spans=spans)


def _span(raw: Any, n: int) -> tuple[str, int, int]:
    try:
        span = (str(raw["version"]), int(raw["start"]), int(raw["end"]))
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(f"weight_versions entry {raw!r} is not {{version, start, end}}") from None
    if not 0 <= span[1] <= span[2] <= n:
        raise ProtocolError(f"weight_versions span {raw!r} is outside the {n} output tokens")
    return span


class VLLMPolicy(ServerClient):
    """A `slime_env.Policy` for one vLLM server at `url` (e.g. "http://127.0.0.1:8000", no `/v1`), with the control
    calls a trainer needs (see the module docstring). `api_key` is sent as a bearer token; `connection`:
    `ServerClient`'s pool, timeouts and retries; weight-update calls are never retried."""

    def __init__(self, url: str, *, api_key: str | None = None, **connection: Any):
        super().__init__(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else None, **connection)

    async def generate(self, input_ids: Sequence[int], sampling_params_: Mapping[str, Any], *,
                       rid: str | None = None, routing_key: str | None = None,
                       adapter: str | None | EllipsisType = ...) -> Generation:
        if sampling_params_.get("sampling_seed") is not None:
            check_sampling_seed(sampling_params_["sampling_seed"])
        body = {"request_id": rid or uuid.uuid4().hex, "token_ids": list(input_ids),
                "sampling_params": sampling_params(sampling_params_), "output_mode": "tokens"}
        lora = self._adapter(adapter)  # the newest loaded unless the caller names one (None: the base model)
        if lora is not None:
            body["model"] = lora
        t0 = time.perf_counter()
        gen = parse_generate(await self.http.request("POST", "/inference/v1/generate", body))
        if lora is not None:
            # vLLM's spans carry the base model's version; a request keeps its adapter to the end, so the adapter's
            # version made every token (a new version is a new name, loaded beside it)
            gen = self._tagged(gen, lora, weight_spans=((lora.rpartition("@")[2], 0, len(gen.token_ids)),))
        return self.usage.record(gen, input_ids, time.perf_counter() - t0)

    def for_episode(self, session_id: str) -> EpisodeSession:
        return EpisodeSession(self, session_id)

    # --- what the server offers -------------------------------------------------------------------------------
    async def check(self) -> str:
        """The server's version, once it is known to offer every route training needs; else `VLLMServerError`
        naming what is missing and how to start the server."""
        try:
            version = str((await self.http.request("GET", "/version")).get("version", ""))
        except (RemoteError, AttributeError) as err:
            raise VLLMServerError(f"{self.url} is not a vLLM server (GET /version: {err})") from None
        if _version_tuple(version) < MIN_VERSION:
            raise VLLMServerError(f"{self.url} runs vLLM {version}; training through vLLM needs >= "
                                  f"{'.'.join(map(str, MIN_VERSION))} (its weight-transfer and pause routes)")
        try:
            await self.http.request("GET", "/is_paused", max_retries=0)
        except RemoteError as err:
            if err.status == 404:
                raise VLLMServerError(f"{self.url} (vLLM {version}) has no RL routes: start it with "
                                      "VLLM_SERVER_DEV_MODE=1 (it serves /pause, /update_weights, /weight_checker "
                                      "only in dev mode)") from None
            raise
        try:
            await self.http.request("POST", "/inference/v1/generate", {}, max_retries=0)
        except RemoteError as err:
            if err.status == 403:
                raise VLLMServerError(f"{self.url} (vLLM {version}) has its token-in route /inference/v1/generate "
                                      "disabled: start it with --enable-scale-out") from None
            if err.status == 404:
                raise VLLMServerError(f"{self.url} (vLLM {version}) has no /inference/v1/generate") from None
            if err.status not in (400, 422):  # 422: the route is there and refused the empty body, as it should
                raise
        return version

    async def fetch_context_length(self) -> int | None:
        """The served model's context length (`/v1/models`' `max_model_len`), None when the server gives none: the
        gateway refuses prompts past it before they reach the engine."""
        from slime_env.clients.session import served_context_length

        return await served_context_length(self.http)

    async def health(self) -> bool:
        try:
            await self.http.request("GET", "/health", expect_json=False, max_retries=0)
            return True
        except RemoteError:
            return False

    async def models(self) -> list[str]:
        return [m["id"] for m in (await self.http.request("GET", "/v1/models")).get("data", [])]

    # --- pause, resume, abort ---------------------------------------------------------------------------------
    async def pause(self, mode: str = "wait") -> None:
        """`abort` the requests in flight (they return their partial tokens), `wait` for them to finish, or `keep`
        them frozen in the queue: they go on after `resume()`, under the weights loaded meanwhile."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        await self.http.request("POST", f"/pause?mode={mode}", {}, max_retries=0)

    async def resume(self) -> None:
        await self.http.request("POST", "/resume", {}, max_retries=0)

    async def is_paused(self) -> bool:
        return bool((await self.http.request("GET", "/is_paused"))["is_paused"])

    async def abort(self, rid: str) -> None:
        await self.http.request("POST", "/abort_requests", {"request_ids": [rid]}, expect_json=False)

    async def abort_all(self) -> None:
        await self.http.request("POST", "/abort_requests", {}, expect_json=False)

    # --- weights ----------------------------------------------------------------------------------------------
    async def init_weight_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        """Join the trainer's transfer (NCCL: returns once the rendezvous is done, the trainer joins meanwhile)."""
        await self._post("/init_weight_transfer_engine", {"init_info": dict(init_info)})

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._post("/shutdown_weight_transfer_engine", {})

    async def start_weight_update(self) -> None:
        await self._post("/start_weight_update", {})

    async def update_weights(self, update_info: Mapping[str, Any]) -> None:
        """One batch of tensors (NCCL: received by broadcast while the trainer sends; IPC: handles in the body)."""
        await self._post("/update_weights", {"update_info": dict(update_info)})

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._post("/finish_weight_update", {"weight_version": weight_version})

    async def update_weight_version(self, version: str) -> None:
        await self._post("/update_weight_version", {"new_version": version})

    async def weight_version(self) -> str | None:
        return (await self.http.request("GET", "/weight_info")).get("weight_version")

    async def reload_weights(self, path: str) -> None:
        """Load the model folder `path` in place (every worker's `reload_weights(weights_path=path)`)."""
        await self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
                         expect_json=False)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, weight_version: str | None = None) -> str:
        """vLLM's `/v1/load_lora_adapter`: the PEFT folder `lora_path` as adapter `lora_name` ("name@version"); the
        requests that follow name it. `weight_version` is in the name already (vLLM's route takes no such field)."""
        body = {"lora_name": lora_name, "lora_path": str(lora_path)}
        try:
            answer = await self._post("/v1/load_lora_adapter", body, expect_json=False)
        except RemoteError as err:
            if err.status == 404 and '"error"' not in str(err):  # no route (vLLM's own refusals are ErrorResponses)
                raise VLLMServerError(f"{self.url} offers no /v1/load_lora_adapter: start it with "
                                      "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora --max-lora-rank R "
                                      "(R >= the adapter's rank)") from None
            if err.status != 400 or "already been loaded" not in str(err):
                raise RemoteError(f"load_lora_adapter({lora_name!r}) failed: {err}", err.status) from None
            # loaded before by another client (a resumed run): under a new id, so no prefix-cache block of the
            # old load is reused (vLLM's load_inplace keeps the id)
            await self._post("/v1/unload_lora_adapter", {"lora_name": lora_name}, expect_json=False)
            answer = await self._post("/v1/load_lora_adapter", body, expect_json=False)
        self._loaded(lora_name)
        return answer

    async def unload_lora_adapter(self, lora_name: str) -> str:
        """vLLM's `/v1/unload_lora_adapter` (404 for a name the server does not hold)."""
        self._forget(lora_name)
        return await self._post("/v1/unload_lora_adapter", {"lora_name": lora_name}, expect_json=False)

    async def weight_checksums(self) -> dict[str, str]:
        """`{name: sha256}` of every tensor the engine holds, names as vLLM's model has them, each prefixed with its
        worker (`dp0:pp0:pcp0:tp0:`). A server started with `--enable-lora` wraps layers (`qkv_proj.base_layer`):
        their tensors are named as unwrapped."""
        sums = (await self._post("/weight_checker", {"action": "checksum"}))["checksums"]
        return {k.replace(".base_layer.", "."): v for k, v in sums.items()}

    async def world_size(self) -> int:
        return int((await self.http.request("GET", "/get_world_size?include_dp=true"))["world_size"])

    async def sleep(self, level: int = 1) -> None:
        await self._post(f"/sleep?level={level}", {})

    async def wake_up(self) -> None:
        await self._post("/wake_up", {})

    async def _post(self, path: str, body: Any, expect_json: bool = True) -> Any:
        return await self.http.request("POST", path, body, max_retries=0, expect_json=expect_json)

    async def close(self) -> None:
        await self.http.close()


def _version_tuple(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out) or (0,)
