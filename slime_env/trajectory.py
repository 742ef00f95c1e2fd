"""`Trajectory`: the result of one agent in one episode, and its exports (JSON, slime `Sample`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from slime_env.errors import InvalidInput
from slime_env.fast_pickle import fast_pickle
from slime_env.images import VisionInputs
from slime_env.ledger import Span, check_invariants
from slime_env.routing import RoutingRecord, stream_routing
from slime_env.types import Message, Task, jsonable

Status = Literal["completed", "truncated", "aborted", "failed", "infra_error"]
STATUSES: tuple[str, ...] = ("completed", "truncated", "aborted", "failed", "infra_error")
# Episodes that never reach the loss nor their group's statistics: `failed` (the env, the policy or the framework
# raised) and `infra_error` (a cause outside the model: `slime_env.errors.InfraError`). Their reward means nothing.
EXCLUDED_STATUSES: frozenset[str] = frozenset({"failed", "infra_error"})


@fast_pickle
@dataclass(frozen=True, slots=True)
class Trajectory:
    """Token-level record of one agent's episode.

    `prompt_ids + response_ids` is every id the engine saw or produced, in order. `loss_mask[i]` is 1
    where the policy sampled `response_ids[i]` (its log-prob in `rollout_logprobs[i]`) and 0 where
    the framework inserted it (log-prob 0.0). `spans` say which turn produced which ids.
    `turn_rewards[k]` is the env's reward for turn k; `reward` is their sum. `status` is one of
    completed / truncated / aborted / failed / infra_error (a cause outside the model: a container that did not start,
    a verifier's machinery, the gateway; never trained, see `EXCLUDED_STATUSES`), with a human-readable `reason` when
    not completed.
    `timings` has `total_s`, `generate_s`, `env_s`, `framework_s`; `info` is the env's last info.
    `routing` (MoE models whose engine returns them) holds the routed experts of generated tokens, for routing
    replay (`slime_env.routing`); None otherwise. `vision` (a vision renderer's ledger) holds the images of the ids, in
    token order, and the processor's outputs for them (`VisionInputs`); None for text.
    """

    task: Task
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    spans: list[Span]
    turn_rewards: list[float]
    reward: float
    status: str
    reason: str = ""
    agent_id: str = "agent"
    num_turns: int = 0
    messages: list[Message] = field(default_factory=list)
    response_text: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    routing: RoutingRecord | None = None
    vision: VisionInputs | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise InvalidInput(f"trajectory status {self.status!r} is not one of {STATUSES}")
        if self.routing is not None and self.routing.ranges and self.routing.ranges[-1][1] > len(self.response_ids):
            raise InvalidInput(f"trajectory routing covers response offsets up to {self.routing.ranges[-1][1]} of "
                               f"{len(self.response_ids)}")

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def check(self) -> None:
        """Raise AssertionError unless the ledger invariants hold."""
        check_invariants(self.prompt_ids, self.response_ids, self.loss_mask, self.rollout_logprobs, self.spans)
        for start, end in self.routing.ranges if self.routing is not None else ():
            assert all(self.loss_mask[i] == 1 for i in range(start, end)), \
                f"routed experts recorded for response offsets {start}:{end}, which are not all generated"

    def to_slime_sample(self) -> dict[str, Any]:
        """The fields of a slime `Sample` (slime/utils/types.py), satisfying its invariants.

        A failed or infra_error episode is exported in slime's safe form: `remove_sample=True`, reward 0.0, a mask of
        zeros and log-probs 0.0, so it can never reach the loss. `status` is slime's status string (infra_error, which
        slime has no status for, is exported as failed; `metadata["status"]` keeps ours).
        With routed experts, `rollout_routed_experts` is slime's int32 `[len(tokens) - 1, layers, top_k]` (row i: the
        forward over token i), -1 where none was recorded (prompt and inserted tokens): slime's trainer replays
        every row and refuses -1, so it fails loudly rather than replay expert 0 (see docs/trainers.md).
        """
        failed = self.status in EXCLUDED_STATUSES
        n = len(self.response_ids)
        md = self.metadata
        extra = {}
        if self.routing is not None and not failed:
            extra["rollout_routed_experts"] = stream_routing(len(self.prompt_ids), n, self.routing).astype("int32")
        if self.vision is not None:  # slime's VLM fields: raw images for SGLang, processor outputs for the trainer
            extra["multimodal_inputs"] = {"images": [im.pil() for im in self.vision.images]}
            extra["multimodal_train_inputs"] = dict(self.vision.arrays)
        return {**extra,
            "tokens": self.prompt_ids + self.response_ids,
            "response_length": n,
            "loss_mask": [0] * n if failed else list(self.loss_mask),
            "rollout_log_probs": [0.0] * n if failed else list(self.rollout_logprobs),
            "reward": 0.0 if failed else float(self.reward),
            "status": "failed" if self.status == "infra_error" else self.status,
            "response": self.response_text,
            "prompt": self.task.to_dict()["prompt"],
            "label": jsonable(self.task.label),
            "metadata": self._export_metadata(),
            "index": md.get("index"),
            "group_index": md.get("group_index"),
            "rollout_id": md.get("rollout_id"),
            "remove_sample": failed,
            "session_id": md.get("session_id"),
            "weight_versions": [v for v in md.get("weight_versions", []) if v is not None],
            "non_generation_time": float(self.timings.get("total_s", 0.0) - self.timings.get("generate_s", 0.0)),
        }

    def _export_metadata(self) -> dict[str, Any]:
        return jsonable({**self.task.metadata, **self.metadata, "agent_id": self.agent_id,
                          "turn_rewards": self.turn_rewards, "num_turns": self.num_turns,
                          "status": self.status, "status_reason": self.reason,
                          "spans": [s.to_dict() for s in self.spans],
                          "timings": self.timings, "task_id": self.task.id})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of copies (changing it never changes the trajectory); `Trajectory.from_dict(t.to_dict())
        == t` for JSON-representable info."""
        return {
            "task": self.task.to_dict(), "prompt_ids": list(self.prompt_ids), "response_ids": list(self.response_ids),
            "loss_mask": list(self.loss_mask), "rollout_logprobs": list(self.rollout_logprobs),
            "spans": [s.to_dict() for s in self.spans], "turn_rewards": list(self.turn_rewards),
            "reward": self.reward, "status": self.status, "reason": self.reason, "agent_id": self.agent_id,
            "num_turns": self.num_turns, "messages": [m.to_dict() for m in self.messages],
            "response_text": self.response_text, "timings": dict(self.timings), "info": jsonable(self.info),
            "metadata": jsonable(self.metadata),
            **({"routing": self.routing.to_dict()} if self.routing is not None else {}),
            **({"vision": self.vision.to_dict()} if self.vision is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        try:
            return cls(
                task=Task.coerce(d["task"], "trajectory.task"), prompt_ids=list(d["prompt_ids"]),
                response_ids=list(d["response_ids"]), loss_mask=list(d["loss_mask"]),
                rollout_logprobs=[float(x) for x in d["rollout_logprobs"]],
                spans=[Span(**s) for s in d["spans"]], turn_rewards=[float(x) for x in d["turn_rewards"]],
                reward=float(d["reward"]), status=d["status"], reason=d.get("reason", ""),
                agent_id=d.get("agent_id", "agent"), num_turns=int(d.get("num_turns", 0)),
                messages=[Message.coerce(m, "trajectory.messages") for m in d.get("messages", [])],
                response_text=d.get("response_text", ""), timings=dict(d.get("timings", {})),
                info=dict(d.get("info", {})), metadata=dict(d.get("metadata", {})),
                routing=RoutingRecord.from_dict(d["routing"]) if d.get("routing") else None,
                vision=VisionInputs.from_dict(d["vision"]) if d.get("vision") else None)
        except KeyError as e:
            raise InvalidInput(f"trajectory record has no field {e.args[0]!r}") from None
        except TypeError as e:
            raise InvalidInput(f"trajectory record is malformed: {e}") from None
