"""slime plug-in: run any slime_env environment inside slime's own Megatron + SGLang training.

Point slime at these functions by dotted path (see docs/slime.md for a complete launch command):
- `--custom-generate-function-path slime_env.integrations.slime.generate`
- `--custom-rm-path slime_env.integrations.slime.reward`
- `--dynamic-sampling-filter-path slime_env.integrations.slime.filter_nonzero_std`
and put the env in `--custom-config-path` (every key becomes an attribute of `args`):
`slime_env_id` (required), `slime_env_kwargs` (dict), `slime_env_renderer` (chat-template family, default
auto), `slime_env_parser` (override the env's tool-call parser), `slime_env_max_turns` (default 8),
`slime_env_tokenizer` (default `args.hf_checkpoint`), `slime_env_deadline_s`, `slime_env_sglang_url`
(default `http://{sglang_router_ip}:{sglang_router_port}`).

`generate` builds the env from `sample.prompt` (chat messages, or text for the env to template — so do not
pass `--apply-chat-template`), `sample.label` and `sample.metadata`, runs the episode against SGLang's
`/generate` with token ids and a routing key per episode (`X-SMG-Routing-Key`), and fills the Sample in
place: `tokens`, `response_length`, `loss_mask`, `rollout_log_probs` (0.0 at masked positions),
`response`, `reward`, `status`, `weight_versions`, `non_generation_time`, and `metadata["slime_env"]` (per-turn
rewards, spans, timings, the env's info). A failed episode comes back in slime's safe form:
`remove_sample=True`, reward 0.0, a mask of zeros. Nothing from slime is imported: the Sample class and
its `Status` enum are taken from the object slime passes in.

A multi-agent env (`slime_env.MultiAgentEnv`, e.g. `TicTacToe-v0`) plays one episode per sample with the
SGLang policy in every seat and returns `list[Sample]`: one per trained agent (`slime_env_train_agents`,
default all), copies of `sample` filled from that agent's trajectory, all with the same non-None
`rollout_id` and `metadata["slime_env"]` naming the agent, its role and the episode id.
"""

from __future__ import annotations

import asyncio
import statistics
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_STATUS = {"completed": "COMPLETED", "truncated": "TRUNCATED", "aborted": "ABORTED", "failed": "FAILED",
           "infra_error": "FAILED"}  # slime has no status of its own for it: removed like a failure


@dataclass
class _Setup:
    env_id: str
    env_kwargs: dict[str, Any]
    renderer: Any
    parser: Any
    max_turns: int
    url: str
    deadline_s: float | None
    train_agents: list[str] | None


_SETUPS: dict[tuple, _Setup] = {}
_POLICIES: dict[tuple[int, str], Any] = {}


def _setup(args: Any) -> _Setup:
    env_id = getattr(args, "slime_env_id", None)
    if not env_id:
        raise ValueError("set slime_env_id in --custom-config-path (e.g. slime_env_id: Search-v0)")
    tokenizer_path = getattr(args, "slime_env_tokenizer", None) or getattr(args, "hf_checkpoint", None)
    family = getattr(args, "slime_env_renderer", None) or "auto"
    url = getattr(args, "slime_env_sglang_url", None) or \
        f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
    key = (tokenizer_path, family, url, repr(sorted((k, repr(v)) for k, v in vars(args).items()
                                                    if k.startswith("slime_env_"))))
    if key not in _SETUPS:
        from transformers import AutoTokenizer

        from slime_env.renderers import get_renderer

        if not tokenizer_path:
            raise ValueError("set hf_checkpoint (or slime_env_tokenizer): the chat template comes from its tokenizer")
        tok = _processor(tokenizer_path) or AutoTokenizer.from_pretrained(tokenizer_path)
        _SETUPS[key] = _Setup(env_id=env_id, env_kwargs=dict(getattr(args, "slime_env_kwargs", None) or {}),
                              renderer=get_renderer(tok, family),
                              parser=getattr(args, "slime_env_parser", None) or "env",
                              max_turns=int(getattr(args, "slime_env_max_turns", None) or 8), url=url,
                              deadline_s=getattr(args, "slime_env_deadline_s", None),
                              train_agents=getattr(args, "slime_env_train_agents", None))
    return _SETUPS[key]


def _processor(path: str) -> Any:
    """A vision model's processor (it places the images in the ids), as slime's `load_processor` finds one; None for
    a text model."""
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        return None
    return proc if getattr(proc, "image_token", None) and hasattr(proc, "replace_image_token") else None


def _with_images(prompt: Any, multimodal_inputs: Any) -> Any:
    """`prompt` (chat messages) with slime's `multimodal_inputs["images"]` put into its bare `{"type": "image"}`
    parts, in order; the prompt as it is without images."""
    images = list((multimodal_inputs or {}).get("images") or []) if isinstance(multimodal_inputs, Mapping) else []
    if not images or isinstance(prompt, str):
        return prompt
    out = []
    for m in prompt:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list):
            content = [{**p, "image": images.pop(0)} if isinstance(p, Mapping) and p.get("type") == "image"
                       and p.get("image") is None and images else p for p in content]
            m = {**m, "content": content}
        out.append(m)
    return out


def _policy(url: str) -> Any:
    """One pooled SGLang client per router URL and event loop (slime runs every rollout on one loop)."""
    loop = asyncio.get_running_loop()
    key = (id(loop), url)
    if key not in _POLICIES:
        from slime_env.clients import SGLangPolicy

        _POLICIES[key] = SGLangPolicy(url)
    return _POLICIES[key]


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
    """slime's custom generate function: one slime_env episode fills `sample` (see the module docstring)."""
    from slime_env import MultiAgentEnv, make, run_episode
    from slime_env.types import Task

    try:
        setup = _setup(args)
        prompt = _with_images(sample.prompt, getattr(sample, "multimodal_inputs", None))
        metadata = dict(sample.metadata or {}) if isinstance(sample.metadata, Mapping) else {}
        task = Task.coerce({"prompt": prompt, "label": sample.label, "metadata": metadata,
                            "id": None if sample.index is None else str(sample.index)}, "sample")
        params = {k: v for k, v in dict(sampling_params).items() if k != "max_new_tokens"}
        env = make(setup.env_id, **setup.env_kwargs)
        if isinstance(env, MultiAgentEnv):
            return await _generate_multi_agent(args, sample, setup, env, task, sampling_params, params)
        try:
            traj = await run_episode(
                env, _policy(setup.url), task, renderer=setup.renderer, max_turns=setup.max_turns,
                max_new_tokens=int(sampling_params.get("max_new_tokens")
                                   or getattr(args, "rollout_max_response_len", 1024)),
                max_context_tokens=getattr(args, "rollout_max_context_len", None), deadline_s=setup.deadline_s,
                sampling_params=params, parser=setup.parser,
                metadata={"session_id": f"slime-{getattr(sample, 'rollout_id', None)}-{sample.index}",
                          "index": sample.index, "group_index": getattr(sample, "group_index", None)})
        finally:
            await env.close()
    except Exception as e:  # noqa: BLE001 - a sample that could not run is returned in slime's safe form
        return _fail(sample, f"{type(e).__name__}: {e}", traceback.format_exc(limit=6))
    _fill(sample, traj)
    return sample


async def _generate_multi_agent(args: Any, sample: Any, setup: _Setup, env: Any, task: Any,
                                sampling_params: dict[str, Any], params: dict[str, Any]) -> list[Any]:
    """One multi-agent episode; a filled copy of `sample` per trained agent (see the module docstring)."""
    import copy
    import zlib

    from slime_env import run_multi_agent_episode

    try:
        trajs = await run_multi_agent_episode(
            env, _policy(setup.url), task, renderer=setup.renderer, max_turns=setup.max_turns,
            max_new_tokens=int(sampling_params.get("max_new_tokens")
                               or getattr(args, "rollout_max_response_len", 1024)),
            max_context_tokens=getattr(args, "rollout_max_context_len", None), deadline_s=setup.deadline_s,
            sampling_params=params,
            metadata={"index": sample.index, "group_index": getattr(sample, "group_index", None)})
    finally:
        await env.close()
    agents = list(setup.train_agents or trajs)
    unknown = [a for a in agents if a not in trajs]
    if unknown:
        raise ValueError(f"slime_env_train_agents names {unknown}, not agents of {setup.env_id} ({list(trajs)})")
    episode_id = next(iter(trajs.values())).metadata["episode_id"]
    rollout_id = getattr(sample, "rollout_id", None)
    if rollout_id is None:  # siblings must share a non-None rollout_id: one derived from the episode
        rollout_id = zlib.crc32(episode_id.encode())
    out = []
    for agent in agents:
        sibling = copy.deepcopy(sample)
        _fill(sibling, trajs[agent])
        sibling.rollout_id = rollout_id
        sibling.metadata["slime_env"].update(agent_id=agent, role=trajs[agent].metadata.get("role", agent),
                                             episode_id=episode_id)
        out.append(sibling)
    return out


def _fill(sample: Any, traj: Any) -> None:
    exported = traj.to_slime_sample()
    sample.tokens = exported["tokens"]
    sample.response_length = exported["response_length"]
    sample.loss_mask = exported["loss_mask"]
    sample.rollout_log_probs = exported["rollout_log_probs"]
    sample.response = exported["response"]
    sample.reward = exported["reward"]
    sample.remove_sample = exported["remove_sample"]
    sample.status = type(sample).Status[_STATUS[traj.status]]
    if hasattr(sample, "weight_versions"):
        sample.weight_versions = exported["weight_versions"]
    if hasattr(sample, "non_generation_time"):
        sample.non_generation_time = exported["non_generation_time"]
    if hasattr(sample, "session_id"):
        sample.session_id = exported["session_id"]
    if "multimodal_inputs" in exported:  # a vision ledger: slime's raw images and its trainer's processor outputs
        import torch

        sample.multimodal_inputs = exported["multimodal_inputs"]
        arrays = exported["multimodal_train_inputs"]
        sample.multimodal_train_inputs = {k: torch.from_numpy(v) for k, v in arrays.items()}  # slime moves tensors
    if "rollout_routed_experts" in exported and hasattr(sample, "rollout_routed_experts"):
        sample.rollout_routed_experts = exported["rollout_routed_experts"]  # MoE routing replay (slime's R3 field)
    metadata = dict(sample.metadata or {}) if isinstance(sample.metadata, Mapping) else {}
    metadata["slime_env"] = {**exported["metadata"], "status": traj.status, "info": exported["metadata"].get("info")
                             or traj.to_dict()["info"], "reward": exported["reward"]}
    sample.metadata = metadata


def _fail(sample: Any, reason: str, trace: str) -> Any:
    """slime's safe form for a hard failure: removed from the loss, reward 0.0, consistent lengths."""
    tokens = list(sample.tokens or [])
    sample.tokens = tokens
    sample.response_length = 0
    sample.loss_mask = []
    sample.rollout_log_probs = []
    sample.response = ""
    sample.reward = 0.0
    sample.remove_sample = True
    sample.status = type(sample).Status.FAILED
    metadata = dict(sample.metadata or {}) if isinstance(sample.metadata, Mapping) else {}
    metadata["slime_env"] = {"status": "failed", "status_reason": reason, "traceback": trace, "reward": 0.0}
    sample.metadata = metadata
    return sample


def _env_reward(sample: Any) -> float:
    if sample.reward is not None and not isinstance(sample.reward, dict):
        return float(sample.reward)
    stored = (sample.metadata or {}).get("slime_env", {}) if isinstance(sample.metadata, Mapping) else {}
    return float(stored.get("reward", 0.0))


async def reward(args: Any, sample: Any, **kwargs: Any) -> float | list[float]:
    """`--custom-rm-path slime_env.integrations.slime.reward`: the env's reward, computed during `generate`.

    slime's one-sample signature `(args, sample)` (its contract tests check the names); a list is accepted too.
    """
    if isinstance(sample, (list, tuple)):
        return await group_reward(args, list(sample))
    return _env_reward(sample)


async def group_reward(args: Any, samples: list[Any], **kwargs: Any) -> list[float]:
    """`--custom-rm-path slime_env.integrations.slime.group_reward` with `--group-rm`: slime's `(args, samples)`."""
    return [_env_reward(s) for s in samples]


async def close() -> None:
    """Close the pooled SGLang connections opened on this event loop (at the end of a rollout process)."""
    loop_id = id(asyncio.get_running_loop())
    for key in [k for k in _POLICIES if k[0] == loop_id]:
        await _POLICIES.pop(key).close()


def filter_nonzero_std(args: Any, samples: list[Any], **kwargs: Any) -> bool:
    """slime's dynamic sampling filter: keep a group only if its rewards differ (GRPO learns nothing else)."""
    rewards = [float(s.reward if not isinstance(s.reward, dict) else s.reward.get("score", 0.0))
               for s in samples if s.reward is not None]
    return len(rewards) > 1 and statistics.pstdev(rewards) > 0
