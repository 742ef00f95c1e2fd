"""`SGLangPolicy`: SGLang's native `/generate` API (engine or router), token ids in, token ids out.

The request sends `input_ids`, `sampling_params` and `return_logprob: true`; the generated ids and
their log-probs are read from `meta_info.output_token_logprobs` (never by re-tokenizing `text`).
`for_episode(session_id)` gives a per-episode view that sends `X-SMG-Routing-Key: <session_id>`
(router session affinity keeps the episode's prefix cache on one worker) and names each request
with a `rid`, so `abort()` stops that episode's in-flight request through `/abort_request`.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Mapping, Sequence
from types import EllipsisType
from typing import Any

from slime_env import Generation
from slime_env.clients.session import EpisodeSession, ServerClient
from slime_env.errors import InvalidInput
from slime_env.http import ProtocolError, RemoteError
from slime_env.policy import check_sampling_seed
from slime_env.routing import RoutedExperts

ROUTING_HEADER = "X-SMG-Routing-Key"
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def parse_generate_response(body: Any, routed_experts: tuple[int, int] | None = None) -> Generation:
    """A `Generation` from one SGLang `/generate` answer; ProtocolError naming what is missing. With
    `routed_experts=(num_layers, top_k)` its `meta_info.routed_experts` (asked for with `return_routed_experts`)
    gives the generated tokens' routing; an answer without them (an aborted request, a server started without
    `--enable-return-routed-experts`) leaves it None: the trainer routes those tokens itself and counts them."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ProtocolError(f"/generate answer has no meta_info object: {str(body)[:200]}")
    meta = body["meta_info"]
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise ProtocolError("/generate answer has no meta_info.output_token_logprobs: the server must support "
                            "return_logprob (token ids and log-probs are never recovered from text)")
    ids, logprobs = [], []
    for i, entry in enumerate(pairs):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise ProtocolError(f"output_token_logprobs[{i}] is {entry!r}, not [logprob, token_id, ...]")
        lp, tid = entry[0], entry[1]
        if not isinstance(tid, int) or isinstance(tid, bool):
            raise ProtocolError(f"output_token_logprobs[{i}] has no integer token id: {entry!r}")
        if not isinstance(lp, (int, float)) or isinstance(lp, bool):
            raise ProtocolError(f"output_token_logprobs[{i}] has no log-prob: {entry!r}")
        ids.append(tid)
        logprobs.append(float(lp))
    completion = meta.get("completion_tokens")
    if isinstance(completion, int) and completion != len(ids):
        raise ProtocolError(f"meta_info.completion_tokens={completion} but {len(ids)} output_token_logprobs")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in _FINISH:
        raise ProtocolError(f"meta_info.finish_reason {finish!r} is not stop / length / abort")
    prompt_tokens = int(meta.get("prompt_tokens") or 0)
    routed = None
    if routed_experts is not None and ids and meta.get("routed_experts") is not None:
        try:
            routed = RoutedExperts.from_sglang(meta["routed_experts"], prompt_tokens=prompt_tokens,
                                               completion_tokens=len(ids), num_layers=routed_experts[0],
                                               top_k=routed_experts[1])
        except InvalidInput as e:
            raise ProtocolError(str(e)) from None
    return Generation(token_ids=tuple(ids), logprobs=tuple(logprobs), finish_reason=_FINISH[kind],
                      text=body.get("text") or "", weight_version=_str_or_none(meta.get("weight_version")),
                      prompt_tokens=prompt_tokens, cached_tokens=int(meta.get("cached_tokens") or 0),
                      routed_experts=routed)


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


class SGLangPolicy(ServerClient):
    """A `slime_env.Policy` for an SGLang server or router at `url` (e.g. "http://127.0.0.1:30000").

    `connection`: `ServerClient`'s pool, timeouts, retries and headers (size `max_connections` to your episode
    concurrency). Also the control calls a trainer needs (`health`, `flush_cache`, `pause_generation`,
    `continue_generation`, `update_weights_from_disk`, `update_weights_from_tensor`, `abort`, `abort_all`,
    `get_model_info`).
    `routed_experts=(num_hidden_layers, num_experts_per_tok)` of a served MoE model asks every request for its
    routed experts (`return_routed_experts`; the server needs `--enable-return-routed-experts`) for routing replay.
    """

    def __init__(self, url: str, *, routed_experts: tuple[int, int] | None = None, **connection: Any):
        if routed_experts is not None and (len(routed_experts) != 2 or min(routed_experts) < 1):
            raise InvalidInput(f"routed_experts must be (num_hidden_layers, num_experts_per_tok), "
                               f"got {routed_experts!r}")
        super().__init__(url, **connection)
        self.routed_experts = tuple(routed_experts) if routed_experts is not None else None

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                       rid: str | None = None, routing_key: str | None = None,
                       adapter: str | None | EllipsisType = ..., images: Sequence[Any] = ()) -> Generation:
        """`images` (a vision ledger's `ImagePart`s, in token order) go as SGLang's `image_data`: base64 PNGs, as slime
        sends them; the ids already hold each image's token run."""
        if sampling_params.get("sampling_seed") is not None:  # the caller's error, before any engine sees it
            check_sampling_seed(sampling_params["sampling_seed"])
        body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                                "return_logprob": True, "rid": rid or uuid.uuid4().hex}
        if self.routed_experts is not None:
            body["return_routed_experts"] = True
        if images:
            body["image_data"] = [base64.b64encode(im.png).decode("ascii") for im in images]
        lora = self._adapter(adapter)  # the newest loaded unless the caller names one (None: the base model)
        if lora is not None:  # the adapter by name, as SGLang selects one per request
            body["lora_path"] = lora
        headers = {ROUTING_HEADER: routing_key} if routing_key else None
        t0 = time.perf_counter()
        answer = await self.http.request("POST", "/generate", body, headers=headers)
        gen = parse_generate_response(answer, self.routed_experts)
        if lora is not None:  # its tokens' version is the adapter's (SGLang's weight_version is the base model's)
            gen = self._tagged(gen, answer["meta_info"].get("adapter") or lora)
        return self.usage.record(gen, input_ids, time.perf_counter() - t0)

    def for_episode(self, session_id: str) -> EpisodeSession:
        """A per-episode policy: routing key `session_id`, one rid per call, `abort()` for the live one."""
        return EpisodeSession(self, session_id, routing_key=session_id)

    # --- control calls ----------------------------------------------------------------------------
    async def health(self) -> bool:
        try:
            await self.http.request("GET", "/health_generate", expect_json=False)
            return True
        except RemoteError:
            return False

    async def flush_cache(self) -> None:
        await self.http.request("POST", "/flush_cache", expect_json=False)

    async def pause_generation(self) -> None:
        await self.http.request("POST", "/pause_generation", {}, expect_json=False)

    async def continue_generation(self) -> None:
        await self.http.request("POST", "/continue_generation", {}, expect_json=False)

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict[str, Any]:
        return await self._update_weights("update_weights_from_disk", {"model_path": model_path}, weight_version,
                                          f"update_weights_from_disk({model_path!r})")

    async def update_weights_from_tensor(self, named_tensors, weight_version: str | None = None) -> dict[str, Any]:
        """Weights from this host's memory (CUDA IPC or shared memory; `slime_env.clients.tensor_payload`), SGLang's
        `/update_weights_from_tensor`. The tensors must stay alive until this returns."""
        from slime_env.clients.tensor_payload import serialize_named_tensors

        body = {"serialized_named_tensors": [serialize_named_tensors(list(named_tensors))], "flush_cache": True}
        return await self._update_weights("update_weights_from_tensor", body, weight_version,
                                          "update_weights_from_tensor")

    async def _update_weights(self, route: str, body: dict[str, Any], weight_version: str | None,
                              what: str) -> dict[str, Any]:
        if weight_version is not None:
            body["weight_version"] = weight_version
        # Never retried: a repeated group join or broadcast receive would wait for a sender that already sent.
        result = await self.http.request("POST", f"/{route}", body, max_retries=0)
        if isinstance(result, dict) and result.get("success") is False:
            raise RemoteError(f"{what} failed: {result.get('message')}")
        return result

    async def load_lora_adapter(self, lora_name: str, lora_path: str, weight_version: str | None = None
                                ) -> dict[str, Any]:
        """SGLang's `/load_lora_adapter`: the PEFT folder `lora_path` as adapter `lora_name` ("name@version"); the
        requests that follow name it (`lora_path` of `/generate`)."""
        body: dict[str, Any] = {"lora_name": lora_name, "lora_path": lora_path}
        if weight_version is not None:
            body["weight_version"] = weight_version  # serve-engine reads it; SGLang ignores unknown fields
        result = await self.http.request("POST", "/load_lora_adapter", body, max_retries=0)
        if isinstance(result, dict) and result.get("success") is False:
            raise RemoteError(f"load_lora_adapter({lora_name!r}) failed: {result.get('error_message')}")
        self._loaded(lora_name)
        return result

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """SGLang's `/unload_lora_adapter`."""
        result = await self.http.request("POST", "/unload_lora_adapter", {"lora_name": lora_name}, max_retries=0)
        self._forget(lora_name)
        return result

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict[str, Any]:
        """Join the trainer's weight-update group (returns once every rank joined; the trainer joins meanwhile)."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        return await self._update_weights("init_weights_update_group", body, None, "init_weights_update_group")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = "weight_update_group",
                                              weight_version: str | None = None) -> dict[str, Any]:
        """Receive these tensors by broadcast from the group's rank 0 (which sends them meanwhile), in order."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": True}
        return await self._update_weights("update_weights_from_distributed", body, weight_version,
                                          f"update_weights_from_distributed({len(names)} tensors)")

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self.http.request("POST", "/destroy_weights_update_group", {"group_name": group_name},
                                expect_json=False)

    async def get_weights_checksum(self, names: list[str] | None = None) -> dict[str, Any]:
        """`{"weight_version", "checksums": {name: sha256}}` (serve-engine's route; SGLang has none)."""
        return await self.http.request("POST", "/get_weights_checksum", {"names": names} if names else {})

    async def get_server_info(self) -> dict[str, Any]:
        return await self.http.request("GET", "/get_server_info")

    async def release_memory_occupation(self) -> None:
        await self.http.request("POST", "/release_memory_occupation", {}, expect_json=False)

    async def resume_memory_occupation(self) -> None:
        await self.http.request("POST", "/resume_memory_occupation", {}, expect_json=False)

    async def abort(self, rid: str) -> None:
        await self.http.request("POST", "/abort_request", {"rid": rid}, expect_json=False)

    async def abort_all(self) -> None:
        await self.http.request("POST", "/abort_request", {"abort_all": True}, expect_json=False)

    async def get_model_info(self) -> dict[str, Any]:
        return await self.http.request("GET", "/get_model_info")

    async def fetch_context_length(self) -> int | None:
        """The served model's context length (`/v1/models`' `max_model_len`), None when the server gives none: the
        gateway refuses prompts past it before they reach the engine."""
        from slime_env.clients.session import served_context_length

        return await served_context_length(self.http)

    async def close(self) -> None:
        await self.http.close()

