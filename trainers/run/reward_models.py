"""Learned rewards: reward models and LLM judges that score finished episodes (`reward:` in the run config).

`reward: {kind: ..., weight: 1.0, env_weight: 1.0, ...}` — an episode's reward becomes
`env_weight * env_reward + weight * score` (the score is added to its last turn's reward too; the env's own reward
is kept in `metadata["env_reward"]`, the score in `info["rm_score"]`). Kinds:
- `classifier`: `model: PATH` — a Hugging Face sequence-classification model with one label (e.g.
  `AutoModelForSequenceClassification`, Skywork / ArmoRM-style RMs), loaded here (`device`), scoring the episode's
  conversation rendered with the RM's own chat template. Concurrent requests are batched (`batch_size`).
- `remote`: `url: http://...` — slime's `remote_rm` protocol: POST `{"prompt", "response", "label"}`, the answer is a
  number (or `{"reward": x}` / `{"score": x}`). Concurrency `max_concurrency`, `timeout_s`, `retries` on 5xx and
  connection errors.
- `judge`: a generative judge — an engine (`url` of an SGLang-compatible server, or the run's own engine when
  omitted) answers `prompt` (a template over `{question}`, `{response}`, `{label}`), `pattern` (a regex with one
  group) finds the verdict in its answer, divided by `scale` (e.g. a 0-10 rubric score with scale 10). Greedy,
  `max_new_tokens`.
An episode whose scoring fails — the RM raised, timed out after its retries, or the judge's answer held no verdict —
is marked failed with the reason (no loss on it), never scored 0 silently. Failed episodes are not scored.
In slime: `--custom-rm-path slime_env.trainers.run.reward_models.slime_reward` with the same mapping as
`slime_env_reward`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from slime_env.errors import InvalidInput
from slime_env.trajectory import EXCLUDED_STATUSES, Trajectory
from slime_env.types import jsonable

if TYPE_CHECKING:
    from slime_env.policy import Policy
    from slime_env.renderers import TemplateRenderer

_COMMON = {"kind", "weight", "env_weight"}


@dataclass(frozen=True)
class RewardInput:
    """What a reward model reads of an episode: the task's `prompt` (text or chat messages, as given), the
    `response` (everything generated after it, as text), the `label`, and the whole conversation as `messages`."""

    prompt: str | list[dict[str, Any]]
    response: str
    label: Any = None
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def question(self) -> str:
        """The prompt's text (its last user message, for a chat prompt)."""
        if isinstance(self.prompt, str):
            return self.prompt
        users = [m.get("content", "") for m in self.prompt if m.get("role") == "user"]
        return users[-1] if users else ""

    @classmethod
    def of_trajectory(cls, t: Trajectory) -> RewardInput:
        prompt = t.task.prompt if isinstance(t.task.prompt, str) else [m.to_dict() for m in t.task.prompt]
        return cls(prompt, t.response_text, t.task.label, [m.to_dict() for m in t.messages])

    @classmethod
    def of_slime_sample(cls, sample: Any) -> RewardInput:
        """From a slime `Sample` after generation (its prompt, response and label)."""
        prompt = sample.prompt if isinstance(sample.prompt, str) else [dict(m) for m in sample.prompt]
        start = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return cls(prompt, sample.response or "", sample.label,
                   start + [{"role": "assistant", "content": sample.response or ""}])
_KEYS = {"classifier": {"model", "device", "batch_size", "max_length"},
         "remote": {"url", "max_concurrency", "timeout_s", "retries"},
         "judge": {"url", "prompt", "pattern", "scale", "max_new_tokens", "max_concurrency"}}


def check_spec(spec: object, where: str = "reward") -> None:
    """InvalidInput naming `where` and the field unless `spec` is a valid `reward:` section."""
    if not isinstance(spec, Mapping) or spec.get("kind") not in _KEYS:
        raise InvalidInput(f"{where}.kind: one of {sorted(_KEYS)}")
    kind = spec["kind"]
    unknown = sorted(set(spec) - _COMMON - _KEYS[kind])
    if unknown:
        raise InvalidInput(f"{where}: unknown field(s) {unknown} for kind {kind!r}; known: "
                           f"{sorted(_COMMON | _KEYS[kind])}")
    need = {"classifier": ["model"], "remote": ["url"], "judge": ["prompt", "pattern"]}[kind]
    missing = [k for k in need if k not in spec]
    if missing:
        raise InvalidInput(f"{where}: kind {kind!r} needs {missing}")
    if kind == "judge":
        try:
            if re.compile(spec["pattern"]).groups != 1:
                raise InvalidInput(f"{where}.pattern: needs exactly one group (the verdict), got {spec['pattern']!r}")
        except re.error as e:
            raise InvalidInput(f"{where}.pattern: not a regular expression ({e})") from None
        try:
            spec["prompt"].format(question="q", response="r", label="l")
        except (KeyError, IndexError, ValueError) as e:
            raise InvalidInput(f"{where}.prompt: a template over {{question}}, {{response}}, {{label}} only ({e!r})"
                               ) from None


class RewardModel(Protocol):
    """What scores an episode (`ClassifierRM`, `RemoteRM`, `JudgeRM`)."""

    async def score(self, x: RewardInput) -> float:
        """The episode's score (the run combines it with the env's reward)."""
        ...

    async def close(self) -> None:
        """Release the model, its clients; idempotent."""
        ...


class ClassifierRM:
    """A one-label sequence-classification model loaded here (see the module docstring)."""

    def __init__(self, path: str, *, device: str = "auto", batch_size: int = 16, max_length: int = 4096):
        import torch
        from slime_env.agents.default_model import resolve_device
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        config = AutoConfig.from_pretrained(path)
        archs = [a for a in (config.architectures or []) if a.endswith("ForSequenceClassification")]
        if not archs or getattr(config, "num_labels", 1) != 1:
            raise InvalidInput(f"reward.model {path}: not a one-label sequence-classification reward model "
                               f"(architectures {config.architectures}, "
                               f"num_labels {getattr(config, 'num_labels', None)})")
        self.device = resolve_device(device)[0]
        dtype = torch.bfloat16 if str(self.device).startswith("cuda") else torch.float32
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.max_length = batch_size, max_length
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.forwards = 0  # batched forward passes run (for tests and metrics)

    def text(self, x: RewardInput) -> str:
        """The episode as the RM reads it: its conversation in the RM's chat template (plain turns without one)."""
        messages = x.messages
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return "\n\n".join(f"{m['role']}: {m['content']}" for m in messages)

    async def score(self, x: RewardInput) -> float:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((self.text(x), fut))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        # Everything that arrived while the last batch ran forms the next one: concurrent episodes share forwards.
        while self._pending:
            await asyncio.sleep(0)
            batch, self._pending = self._pending[:self.batch_size], self._pending[self.batch_size:]
            try:
                scores = await asyncio.to_thread(self._forward, [text for text, _ in batch])
            except Exception as e:  # noqa: BLE001 - every waiting episode gets the reason
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut), s in zip(batch, scores):
                if not fut.done():
                    fut.set_result(s)

    def _forward(self, texts: list[str]) -> list[float]:
        import torch

        enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length,
                             add_special_tokens=False)
        with torch.inference_mode():
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
        self.forwards += 1
        return logits[:, 0].float().tolist()

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self.model = None


class RemoteRM:
    """slime's `remote_rm` protocol over HTTP (see the module docstring)."""

    def __init__(self, url: str, *, max_concurrency: int = 64, timeout_s: float = 120.0, retries: int = 3):
        from slime_env.http import HttpClient

        self.url = url.rstrip("/")
        self.client = HttpClient(self.url, timeout_s=timeout_s, max_retries=retries)
        self._sem = asyncio.Semaphore(max_concurrency)

    async def score(self, x: RewardInput) -> float:
        async with self._sem:
            out = await self.client.request("POST", "", {"prompt": x.prompt, "response": x.response,
                                                         "label": jsonable(x.label)})
        value = out.get("reward", out.get("score")) if isinstance(out, Mapping) else out
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{self.url} answered {out!r}: expected a number, or {{'reward': x}} / {{'score': x}}")
        return float(value)

    async def close(self) -> None:
        await self.client.close()


class JudgeRM:
    """A generative judge on an engine (see the module docstring)."""

    def __init__(self, policy: Policy, renderer: TemplateRenderer, *, prompt: str, pattern: str, scale: float = 1.0,
                 max_new_tokens: int = 64, max_concurrency: int = 64, owned: bool = False):
        self.policy, self.renderer, self.prompt = policy, renderer, prompt
        self.pattern, self.scale, self.max_new_tokens = re.compile(pattern), float(scale), max_new_tokens
        self._sem = asyncio.Semaphore(max_concurrency)
        self._owned = owned

    async def score(self, x: RewardInput) -> float:
        from slime_env.types import Message

        text = self.prompt.format(question=x.question, response=x.response, label=x.label)
        ids = self.renderer.render_prompt([Message("user", text)])
        async with self._sem:
            gen = await self.policy.generate(ids, {"temperature": 0.0, "max_new_tokens": self.max_new_tokens,
                                                   "stop_token_ids": list(self.renderer.stop_token_ids)})
        verdict = self.renderer.assistant_text(gen.token_ids)
        found = self.pattern.search(verdict)
        if not found:
            raise ValueError(f"no verdict matching {self.pattern.pattern!r} in the judge's answer {verdict[:200]!r}")
        return float(found.group(1)) / self.scale

    async def close(self) -> None:
        if self._owned and hasattr(self.policy, "close"):
            result = self.policy.close()
            if asyncio.iscoroutine(result):
                await result


def make_reward_model(spec: Mapping[str, Any], *, policy: Policy | None = None,
                      renderer: TemplateRenderer | None = None, where: str = "reward") -> RewardModel:
    """The scorer of a `reward:` section; a judge without `url` runs on `policy` (the run's engine)."""
    check_spec(spec, where)
    kind = spec["kind"]
    if kind == "classifier":
        return ClassifierRM(str(spec["model"]), device=str(spec.get("device", "auto")),
                            batch_size=int(spec.get("batch_size", 16)), max_length=int(spec.get("max_length", 4096)))
    if kind == "remote":
        return RemoteRM(str(spec["url"]), max_concurrency=int(spec.get("max_concurrency", 64)),
                        timeout_s=float(spec.get("timeout_s", 120.0)), retries=int(spec.get("retries", 3)))
    owned = "url" in spec
    if owned:
        from slime_env.clients.sglang import SGLangPolicy

        policy = SGLangPolicy(str(spec["url"]))
    if policy is None or renderer is None:
        raise InvalidInput(f"{where}: a judge without 'url' needs the run's engine")
    return JudgeRM(policy, renderer, prompt=spec["prompt"], pattern=spec["pattern"],
                   scale=float(spec.get("scale", 1.0)), max_new_tokens=int(spec.get("max_new_tokens", 64)),
                   max_concurrency=int(spec.get("max_concurrency", 64)), owned=owned)


async def apply_rewards(rm: RewardModel, trajectories: Sequence[Trajectory], *, weight: float = 1.0,
                        env_weight: float = 1.0) -> list[Trajectory]:
    """`trajectories` with the combined reward (see the module docstring); a scoring failure marks its episode
    failed with the reason."""

    async def one(t: Trajectory) -> Trajectory:
        if t.status in EXCLUDED_STATUSES:
            return t
        try:
            score = await rm.score(RewardInput.of_trajectory(t))
        except Exception as e:  # noqa: BLE001 - one episode's scoring failure is its status, not the batch's
            return dataclasses.replace(t, status="failed", reason=f"reward model: {type(e).__name__}: {e}")
        turns = [env_weight * r for r in t.turn_rewards] or [0.0]
        turns[-1] += weight * score
        return dataclasses.replace(t, reward=env_weight * t.reward + weight * score, turn_rewards=turns,
                                   info={**t.info, "rm_score": score},
                                   metadata={**t.metadata, "env_reward": t.reward})

    return list(await asyncio.gather(*(one(t) for t in trajectories)))


_SLIME_RMS: dict[str, Any] = {}


async def slime_reward(args: Any, sample: Any, **kwargs: Any) -> float | list[float]:
    """`--custom-rm-path slime_env.trainers.run.reward_models.slime_reward` in slime: the env's reward (the slime_env
    plug-in's `reward`) combined with the reward model of `slime_env_reward` in `--custom-config-path` (the same mapping
    as the `reward:` section; a judge needs its `url`). A sample the RM fails to score comes back in slime's safe form
    (`remove_sample`, reward 0.0, a mask of zeros) with the reason in `metadata["slime_env"]`."""
    from slime_env.integrations import slime as plugin

    if isinstance(sample, (list, tuple)):
        return list(await asyncio.gather(*(slime_reward(args, s, **kwargs) for s in sample)))
    spec = getattr(args, "slime_env_reward", None)
    check_spec(spec, "slime_env_reward")
    if spec["kind"] == "judge" and "url" not in spec:
        raise InvalidInput("slime_env_reward: a judge in slime needs its 'url' (an SGLang-compatible server)")
    key = json.dumps(spec, sort_keys=True)
    if key not in _SLIME_RMS:
        _SLIME_RMS[key] = make_reward_model(spec, where="slime_env_reward")
    env_reward = await plugin.reward(args, sample)
    if getattr(sample, "remove_sample", False):
        return env_reward
    meta = dict(sample.metadata or {}) if isinstance(sample.metadata, Mapping) else {}
    record = dict(meta.get("slime_env") or {})
    try:
        score = await _SLIME_RMS[key].score(RewardInput.of_slime_sample(sample))
    except Exception as e:  # noqa: BLE001 - the sample leaves the loss with the reason, the batch goes on
        sample.remove_sample, sample.reward = True, 0.0
        sample.loss_mask = [0] * len(sample.loss_mask or [])
        meta["slime_env"] = {**record, "status_reason": f"reward model: {type(e).__name__}: {e}", "reward": 0.0}
        sample.metadata = meta
        return 0.0
    total = float(spec.get("env_weight", 1.0)) * env_reward + float(spec.get("weight", 1.0)) * score
    meta["slime_env"] = {**record, "env_reward": env_reward, "rm_score": score, "reward": total}
    sample.metadata = meta
    return total
