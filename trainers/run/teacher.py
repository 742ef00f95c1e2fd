"""Teachers for on-policy distillation: the log-prob a teacher model gives each token the student sampled.

The run config's `teacher:` section picks one:
- `{url: http://host:port}` — an engine server (SGLang, or our `serve-engine`) scores a trajectory with one
  `/generate` call: its tokens as `input_ids`, `max_new_tokens: 0`, `return_logprob: true`, `logprob_start_len: 0`,
  read from `meta_info.input_token_logprobs` (slime's `--opd-type sglang` protocol). Retried on transient errors.
- `{model: PATH}` — a Hugging Face model this process loads (`device`: auto | cpu | cuda) and runs one forward per
  trajectory (slime's `--opd-type megatron`: the teacher next to the trainer).

Before training, `check_tokenizer` proves the teacher tokenizes like the student (a local teacher's vocabulary is
compared; a server is asked to score a probe text and its ids are compared), since per-token log-probs of
different tokenizations mean nothing. `annotate(teacher, trajectories)` puts each trajectory's response log-probs in
`metadata["teacher_logprobs"]` (what `slime_env.trainers.batch.pack` reads); a trajectory the teacher cannot score is
returned `failed` with the reason (no loss on it), never scored silently.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from slime_env.errors import InvalidInput
from slime_env.trajectory import EXCLUDED_STATUSES, Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from slime_env.http import HttpClient

PROBE = "Teacher probe: 12 * 7 + 5 = 89; <tool_call>{\"name\": \"x\"}</tool_call> ünïcödé"


class Teacher(Protocol):
    """Scores token sequences: `logprobs(ids)` is log p(ids[t] | ids[:t]) for t = 1 .. len(ids) - 1."""

    async def logprobs(self, ids: Sequence[int]) -> list[float]: ...

    async def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None: ...

    async def close(self) -> None: ...


async def input_logprobs(client: HttpClient, url: str, body: Mapping[str, Any]) -> list[list[Any]]:
    """`meta_info.input_token_logprobs` of a prefill-only `/generate` of `body` (its `input_ids` or `text`, and e.g. a
    `lora_path`) on the SGLang-compatible server at `url` (`client`: its `slime_env.http.HttpClient`)."""
    from slime_env.http import ProtocolError

    out = await client.request("POST", "/generate", {
        **body, "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "return_logprob": True, "logprob_start_len": 0})
    rows = (out.get("meta_info") or {}).get("input_token_logprobs") if isinstance(out, Mapping) else None
    if not isinstance(rows, list):
        raise ProtocolError(f"{url}/generate gave no meta_info.input_token_logprobs (does it support "
                            "max_new_tokens 0 with return_logprob and logprob_start_len?)")
    return rows


def token_logprobs(rows: Sequence[Sequence[Any]], ids: Sequence[int], url: str) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 from `input_logprobs` rows, which must follow `ids` one for one."""
    from slime_env.http import ProtocolError

    if len(rows) != len(ids) or any(r[1] != t for r, t in zip(rows, ids)):
        raise ProtocolError(f"{url}: input_token_logprobs do not follow the {len(ids)} ids sent")
    return [float(r[0]) for r in rows[1:]]


class ServerTeacher:
    """A teacher behind an SGLang-compatible `/generate` (see the module docstring)."""

    def __init__(self, url: str, *, max_concurrency: int = 32, timeout_s: float = 300.0, max_retries: int = 3):
        from slime_env.http import HttpClient

        self.url = url
        self.client = HttpClient(url, timeout_s=timeout_s, max_retries=max_retries)
        self._sem = asyncio.Semaphore(max_concurrency)

    async def _score(self, body: dict[str, Any]) -> list[list[Any]]:
        async with self._sem:
            return await input_logprobs(self.client, self.url, body)

    async def logprobs(self, ids: Sequence[int]) -> list[float]:
        return token_logprobs(await self._score({"input_ids": list(ids)}), ids, self.url)

    async def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        rows = await self._score({"text": PROBE})
        theirs = [r[1] for r in rows]
        ours = tokenizer.encode(PROBE, add_special_tokens=False)
        if theirs != ours and theirs[1:] != ours:  # a server may prepend its BOS to text
            raise InvalidInput(f"teacher {self.url} tokenizes differently from the student (probe {PROBE!r}: "
                               f"{theirs[:12]}... vs {ours[:12]}...); OPD compares per-token log-probs, so both "
                               "must share one tokenizer")

    async def close(self) -> None:
        await self.client.close()


class LocalTeacher:
    """A Hugging Face causal LM loaded here (see the module docstring); one forward at a time, off the event loop."""

    def __init__(self, path: str, *, device: str = "auto"):
        import torch
        from slime_env.agents.default_model import resolve_device
        from slime_env.trainers.run.engines import resolve_model_path
        from transformers import AutoModelForCausalLM

        self.path = resolve_model_path(path)
        self.device = resolve_device(device)[0]
        dtype = torch.bfloat16 if str(self.device).startswith("cuda") else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype).to(self.device).eval()
        self._lock = asyncio.Lock()

    async def logprobs(self, ids: Sequence[int]) -> list[float]:
        from slime_env.agents.transformers_policy import sequence_logprobs

        async with self._lock:
            return await asyncio.to_thread(sequence_logprobs, self.model, list(ids))

    async def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        from transformers import AutoTokenizer

        theirs = AutoTokenizer.from_pretrained(self.path)
        if theirs.get_vocab() != tokenizer.get_vocab():
            raise InvalidInput(f"teacher {self.path}: its tokenizer's vocabulary differs from the student's; OPD "
                               "compares per-token log-probs, so both must share one tokenizer")

    async def close(self) -> None:
        self.model = None


def check_spec(spec: object, where: str = "teacher") -> None:
    """InvalidInput naming `where` unless `spec` is a valid `teacher:` section."""
    keys = set(spec) if isinstance(spec, Mapping) else set()
    if len(keys & {"url", "model"}) != 1 or keys - {"url", "model", "device", "max_concurrency"}:
        raise InvalidInput(f"{where}: give exactly one of 'url' (an engine server) or 'model' (a local HF model), "
                           f"with optional 'device' / 'max_concurrency'; got {sorted(keys) or spec!r}")


def make_teacher(spec: Mapping[str, Any], where: str = "teacher") -> Teacher:
    """The teacher of a `teacher:` config section (`url` or `model`, see the module docstring)."""
    check_spec(spec, where)
    if "url" in spec:
        return ServerTeacher(str(spec["url"]), max_concurrency=int(spec.get("max_concurrency", 32)))
    return LocalTeacher(str(spec["model"]), device=str(spec.get("device", "auto")))


async def annotate(teacher: Teacher, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """`trajectories` with the teacher's log-prob of every response token in `metadata["teacher_logprobs"]`; one
    the teacher failed to score comes back `failed` with the reason. Failed ones are passed through as they are."""

    async def one(t: Trajectory) -> Trajectory:
        if t.status in EXCLUDED_STATUSES:
            return t
        if not t.response_ids:
            return dataclasses.replace(t, metadata={**t.metadata, "teacher_logprobs": []})
        try:
            lps = await teacher.logprobs(t.prompt_ids + t.response_ids)
        except Exception as e:  # noqa: BLE001 - one episode's scoring failure is its status, not the batch's
            return dataclasses.replace(t, status="failed", reason=f"teacher: {type(e).__name__}: {e}")
        return dataclasses.replace(t, metadata={**t.metadata, "teacher_logprobs": lps[-len(t.response_ids):]})

    return list(await asyncio.gather(*(one(t) for t in trajectories)))
