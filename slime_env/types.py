"""Plain data types shared by every part of slime_env.

Frozen, slotted dataclasses with validation and conversion only. `Message` is what envs return,
`Action` is what envs receive, `Generation` is what policies return and `Task` is one dataset row.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from slime_env.errors import InvalidInput
from slime_env.fast_pickle import fast_pickle
from slime_env.images import ImagePart, content_parts, split_content
from slime_env.routing import RoutedExperts

Role = Literal["system", "user", "assistant", "tool", "ipython"]
ROLES: frozenset[str] = frozenset(("system", "user", "assistant", "tool", "ipython"))
FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: frozenset[str] = frozenset(("stop", "length", "abort"))


@fast_pickle
@dataclass(frozen=True, slots=True)
class Message:
    """One chat message. `role` is system/user/assistant/tool/ipython; `content` is text, or a list of text and
    image parts (`slime_env.images`): then `content` keeps the text with each image's slot in its place and `images`
    the images in order (`parts()` gives the list back).

    `name` and `tool_call_id` are passed to chat templates that use them (tool results).
    """

    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None
    images: tuple[ImagePart, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidInput(f"message role {self.role!r} is not one of {sorted(ROLES)}")
        if not isinstance(self.content, str):
            if self.images:
                raise InvalidInput("message: give images as parts of a list content, or as `images` beside a str "
                                   "content holding their slots, not both")
            text, images = split_content(self.content, f"message ({self.role}) content")
            object.__setattr__(self, "content", text)
            object.__setattr__(self, "images", images)
        elif self.images:
            images = tuple(ImagePart.coerce(im, f"message.images[{i}]") for i, im in enumerate(self.images))
            missing = [i for i, im in enumerate(images) if im.slot not in self.content]
            if missing:
                raise InvalidInput(f"message.images{missing}: no slot for them in content (use a list content)")
            object.__setattr__(self, "images", images)

    def parts(self) -> list[dict[str, Any]]:
        """The content as chat-template parts (`{"type": "text", "text"}` / `{"type": "image", "image": ImagePart}`)."""
        return content_parts(self.content, self.images)

    @classmethod
    def coerce(cls, value: Message | Mapping[str, Any], where: str = "message") -> Message:
        """Accept a `Message` or a chat dict (`{"role": ..., "content": ...}`); name `where` on error."""
        if isinstance(value, Message):
            return value
        if not isinstance(value, Mapping):
            raise InvalidInput(f"{where}: expected a Message or a dict, got {type(value).__name__}")
        try:
            return cls(role=value["role"], content=value.get("content") or "",
                       name=value.get("name"), tool_call_id=value.get("tool_call_id"),
                       images=tuple(value.get("images") or ()))
        except KeyError:
            raise InvalidInput(f"{where}: chat message has no 'role' field: {dict(value)!r}") from None
        except InvalidInput as e:
            raise InvalidInput(f"{where}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """A chat dict; with images, `content` is a list of parts whose images are JSON-ready (`ImagePart.to_dict`)."""
        content: Any = self.content
        if self.images:
            content = [p if p["type"] == "text" else p["image"].to_dict() for p in self.parts()]
        d: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


def coerce_reward(value: Any, where: str) -> float:
    """A step's reward as a finite float; InvalidInput naming `where` otherwise."""
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise InvalidInput(f"{where} must be a number, got {value!r}") from None
    if not math.isfinite(reward):
        raise InvalidInput(f"{where} must be finite, got {reward}")
    return reward


def coerce_messages(values: Sequence[Message | Mapping[str, Any]], where: str) -> list[Message]:
    """Validate a list of messages, naming `where` and the index of a bad one."""
    if type(values) is list and all(type(m) is Message for m in values):
        return values.copy()  # the common case, checked without the abstract-class machinery below
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidInput(f"{where}: expected a list of messages, got {type(values).__name__}")
    return [Message.coerce(m, f"{where}[{i}]") for i, m in enumerate(values)]


@fast_pickle
@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call parsed from assistant text. `raw` is the exact text it was parsed from."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""
    id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "raw": self.raw, "id": self.id}


@fast_pickle
@dataclass(frozen=True, slots=True)
class ParseError:
    """A malformed tool call: what went wrong and the text it concerns. Never raised, always returned."""

    message: str
    raw: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"message": self.message, "raw": self.raw}


@fast_pickle
@dataclass(frozen=True, slots=True)
class Action:
    """The assistant turn exactly as generated.

    `text` is the decoded content (without the end-of-turn token), `token_ids` the sampled ids,
    `tool_calls` and `parse_errors` what the episode's parser found in `text`.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    parse_errors: tuple[ParseError, ...] = ()
    finish_reason: str = "stop"
    agent_id: str = "agent"
    turn: int = 0


@fast_pickle
@dataclass(frozen=True, slots=True)
class Generation:
    """What a policy returns for one call.

    `token_ids` and `logprobs` have equal length (log-prob of each sampled token under the sampling
    distribution). `finish_reason` is "stop", "length" or "abort". `text` is informational only:
    the ledger never re-tokenizes it. `weight_version`: the weights the tokens came from; `adapter`: the LoRA
    adapter they came from ("name@version", None without one). `weight_spans`, where the engine reports them
    (vLLM), are `(version, start, end)`: output tokens `[start, end)` were sampled by weights `version` — several
    spans when a weight update came mid-generation; `weight_version` is then the oldest.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str = "stop"
    text: str = ""
    weight_version: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    latency_s: float = 0.0
    adapter: str | None = None
    routed_experts: RoutedExperts | None = None  # MoE: row j = the experts of the forward that sampled token j
    weight_spans: tuple[tuple[str, int, int], ...] = ()

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise InvalidInput(f"Generation: {len(self.token_ids)} token ids but {len(self.logprobs)} log-probs")
        if self.routed_experts is not None and self.routed_experts.num_tokens != len(self.token_ids):
            raise InvalidInput(f"Generation: {len(self.token_ids)} token ids but routed experts for "
                               f"{self.routed_experts.num_tokens} tokens")
        if self.finish_reason not in FINISH_REASONS:
            raise InvalidInput(f"Generation: finish_reason {self.finish_reason!r} is not one of "
                               f"{sorted(FINISH_REASONS)}")


@fast_pickle
@dataclass(frozen=True, slots=True)
class Task:
    """One dataset row: a prompt (text or chat messages), a label and free-form metadata."""

    prompt: str | tuple[Message, ...]
    label: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    id: str | None = None

    @classmethod
    def coerce(cls, value: Task | str | Mapping[str, Any], where: str = "task") -> Task:
        """Accept a `Task`, a prompt string, or a dict with `prompt` (and optional `label`, `metadata`, `id`)."""
        if isinstance(value, Task):
            return value
        if isinstance(value, str):
            return cls(prompt=value)
        if not isinstance(value, Mapping):
            raise InvalidInput(f"{where}: expected a Task, str or dict, got {type(value).__name__}")
        if "prompt" not in value:
            raise InvalidInput(f"{where}: no 'prompt' field (fields: {sorted(value)})")
        prompt = value["prompt"]
        if not isinstance(prompt, str):
            prompt = tuple(coerce_messages(prompt, f"{where}.prompt"))
        metadata = value.get("metadata") or {}
        if not isinstance(metadata, Mapping):
            raise InvalidInput(f"{where}.metadata: expected a dict, got {type(metadata).__name__}")
        task_id = value.get("id")
        return cls(prompt=prompt, label=value.get("label"), metadata=dict(metadata),
                   id=None if task_id is None else str(task_id))

    def messages(self, system: str | None = None) -> list[Message]:
        """The prompt as chat messages (a text prompt becomes one user message)."""
        msgs = [Message("user", self.prompt)] if isinstance(self.prompt, str) else list(self.prompt)
        if system is not None and not (msgs and msgs[0].role == "system"):
            msgs.insert(0, Message("system", system))
        return msgs

    def to_dict(self) -> dict[str, Any]:
        prompt = self.prompt if isinstance(self.prompt, str) else [m.to_dict() for m in self.prompt]
        return {"prompt": prompt, "label": jsonable(self.label), "metadata": jsonable(dict(self.metadata)),
                "id": self.id}


def jsonable(value: Any) -> Any:
    """`value` round-tripped through JSON (its `repr` where JSON cannot carry it): records hold plain data only."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return repr(value)


