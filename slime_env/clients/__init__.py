"""Clients of engine servers, for the core and every package above it (no engine code, no torch at import).

- `SGLangPolicy(url)`: SGLang's native `/generate` (engine or router; `serve-engine` speaks it too), session
  affinity, abort, and SGLang's weight-update routes (`update_weights_from_distributed` / `_from_tensor` /
  `_from_disk`).
- `VLLMPolicy(url)`: vLLM's RL routes in dev mode: token-in `/inference/v1/generate` with log-probs and weight-version
  spans, pause / resume / abort, the weight-transfer protocol, checksums.
- `OpenAIPolicy(base_url, model)`: OpenAI-compatible `/completions` (vLLM too, frozen), exact ids or refusal.
- `EpisodeSession`: the per-episode view of a policy (one rid per call, abort of the live one); `Usage`.
- `session.ServerClient`: the one construction SGLang's and vLLM's clients share (pool, timeouts, retries, usage,
  loaded adapters).
- `tensor_payload`: the same-host tensor payload of `update_weights_from_tensor`.

`slime_env.agents` re-exports the two policies beside the engines; `slime_env.integrations` uses them from here.
"""

from slime_env.loading import lazy_exports

_EXPORTS = {
    "SGLangPolicy": "slime_env.clients.sglang", "parse_generate_response": "slime_env.clients.sglang",
    "OpenAIPolicy": "slime_env.clients.openai", "EpisodeSession": "slime_env.clients.session",
    "Usage": "slime_env.clients.session", "VLLMPolicy": "slime_env.clients.vllm",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
