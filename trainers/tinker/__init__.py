"""A Tinker-compatible training API (`slime-env serve-tinker`): the `tinker` SDK and `tinker-cookbook` recipes run
unchanged against our trainer and engine.

- `server.TinkerServer` / `server.start`: the HTTP routes and the futures protocol of the SDK (tinker 0.38).
- `backend.TinkerBackend`: a thin adapter over our trainers: a training client is a `SplitStepTrainer`
  (`slime_env.trainers.split_step`; `TorchTrainer` with a LoRA over the shared base model), sampler weights reach
  the embedded engine (`slime_env.agents.TransformersPolicy`) through the weight-sync channel (`push_adapter`).
- `sampler.ServerSampler`: `--sampler-url`, an engine server (SGLang, serve-engine, vLLM) sampling instead, the
  adapters pushed to it through the same channel.
- `ranks`: over several ranks (torchrun), rank 0's training calls broadcast to the others, which run them too.
- `losses`: cross_entropy, importance_sampling, ppo, cispo, dro as pure functions (a trainer's `DatumLoss`).
- `wire`: the SDK's protobuf request / responses.

Needs the `tinker` extra (`tinker`, `peft`). Never imported by the core `slime_env` modules.
"""

from slime_env.trainers.tinker.backend import TinkerBackend
from slime_env.trainers.tinker.server import TinkerServer, start

__all__ = ["TinkerBackend", "TinkerServer", "start"]
