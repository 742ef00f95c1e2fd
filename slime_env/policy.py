"""The `Policy` protocol and `ScriptedPolicy`, a deterministic policy for tests and demos."""

from __future__ import annotations

import asyncio
import itertools
import operator
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from slime_env.errors import InvalidInput
from slime_env.token_codec import TokenCodec
from slime_env.types import Generation


@runtime_checkable
class Policy(Protocol):
    """Anything that generates tokens: SGLang, an OpenAI-compatible server, a local model, a script.

    `generate(input_ids, sampling_params)` continues `input_ids` (the episode's whole ledger; do not
    mutate or keep it) and returns the sampled ids with their log-probs. `sampling_params` follows
    SGLang's names: `max_new_tokens`, `temperature`, `top_p`, `top_k`, `stop`, `stop_token_ids`.
    A generation stopped by a stop token includes that token; one stopped by a stop string keeps it.
    Optionally, `for_episode(session_id)` returns the policy one episode should use (session
    affinity, abortable requests); `run_episode` calls it when present.
    """

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any]) -> Generation: ...


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a sampling seed is a 64-bit integer (torch, SGLang, OpenAI's `seed`)


def check_sampling_seed(value: Any, where: str = "sampling_seed") -> int:
    """`value` as a sampling seed: an integer in [-2**63, 2**63 - 1]; InvalidInput naming `where` otherwise. Every
    entry that takes a seed from outside checks it, so a client's seed is its own error, never an engine's 5xx."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # ints and integer types such as numpy's; not floats or strings
    except TypeError:
        raise InvalidInput(f"{where}: expected an integer seed, got {value!r}") from None
    if not SEED_MIN <= value <= SEED_MAX:
        raise InvalidInput(f"{where}: {value} is outside the 64-bit seed range [-2**63, 2**63 - 1]")
    return value


Reply = str | Callable[[str], str]


class ScriptedPolicy:
    """Replies from a list (in call order, cycling) or from `fn(context_text) -> reply`.

    Each reply is tokenized with the real tokenizer and followed by `end_token_id` (default: the
    tokenizer's eos). SGLang semantics are honoured: `max_new_tokens` cuts the reply ("length"),
    the first stop string ends it and is kept ("stop", no end token), a stop token id ends it.
    Log-probs are synthetic but deterministic (a hash of token and position mapped into
    [-3, -0.01]): real numbers for the ledger, not a model's.
    """

    def __init__(self, tokenizer: Any, replies: Sequence[str] | Callable[[str], str], *,
                 end_token_id: int | None = None, latency_s: float = 0.0):
        if isinstance(replies, str) or (not callable(replies) and not isinstance(replies, Sequence)):
            raise InvalidInput("ScriptedPolicy replies must be a list of strings or a function")
        if not callable(replies) and not replies:
            raise InvalidInput("ScriptedPolicy needs at least one reply")
        self.tokenizer = tokenizer
        self._codec = TokenCodec(tokenizer)
        self._replies = replies
        self._counter = itertools.count()
        self.end_token_id = end_token_id if end_token_id is not None else tokenizer.eos_token_id
        self.latency_s = latency_s
        self.calls = 0

    def reply_for(self, input_ids: Sequence[int]) -> str:
        if callable(self._replies):
            reply = self._replies(self._codec.decode(input_ids))
        else:
            reply = self._replies[next(self._counter) % len(self._replies)]
        if not isinstance(reply, str):
            raise InvalidInput(f"ScriptedPolicy reply must be str, got {type(reply).__name__}")
        return reply

    def plan(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any]) -> tuple[list[int], str]:
        """The ids this policy answers with, and the finish reason (before any latency or abort)."""
        text = self.reply_for(input_ids)
        ended_by_string = False
        stops = sampling_params.get("stop") or ()
        cut = min((text.find(s) + len(s) for s in ([stops] if isinstance(stops, str) else stops) if s in text),
                  default=-1)
        if cut >= 0:
            text, ended_by_string = text[:cut], True
        ids = self._codec.encode(text)
        if not ended_by_string and self.end_token_id is not None:
            ids.append(self.end_token_id)
        stop_ids = set(sampling_params.get("stop_token_ids") or ())
        for i, t in enumerate(ids):
            if t in stop_ids:
                return ids[:i + 1], "stop"
        return ids, "stop"

    def finish(self, input_ids: Sequence[int], ids: list[int], finish: str,
               sampling_params: Mapping[str, Any]) -> Generation:
        limit = sampling_params.get("max_new_tokens")
        if limit is not None and len(ids) > limit:
            ids, finish = ids[:max(0, int(limit))], "length"
        logprobs = tuple(_synthetic_logprob(t, len(input_ids) + i) for i, t in enumerate(ids))
        return Generation(token_ids=tuple(ids), logprobs=logprobs, finish_reason=finish,
                          text=self._codec.decode(ids), prompt_tokens=len(input_ids))

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any],
                       images: Sequence[Any] = ()) -> Generation:
        """`images` (a vision ledger's) are accepted and not looked at: a script answers from the text."""
        self.calls += 1
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        ids, finish = self.plan(input_ids, sampling_params)
        return self.finish(input_ids, ids, finish, sampling_params)

    def for_episode(self, session_id: str) -> ScriptedSession:
        """A per-episode view whose `abort()` cuts the reply short, as an engine would."""
        return ScriptedSession(self)


class ScriptedSession:
    """One episode's view of a `ScriptedPolicy`: tokens "stream" evenly over `latency_s`; `abort()`
    returns the part produced so far (finish_reason "abort"), and the next call continues the reply."""

    def __init__(self, policy: ScriptedPolicy):
        self.policy = policy
        self._pending: tuple[list[int], str] | None = None
        self._abort = asyncio.Event()

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any],
                       images: Sequence[Any] = ()) -> Generation:
        p = self.policy
        p.calls += 1
        self._abort.clear()
        ids, finish = self._pending or p.plan(input_ids, sampling_params)
        self._pending = None
        if p.latency_s:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            try:
                await asyncio.wait_for(self._abort.wait(), p.latency_s)
            except TimeoutError:
                pass
            else:
                k = min(len(ids) - 1, int(len(ids) * (loop.time() - t0) / p.latency_s))
                limit = sampling_params.get("max_new_tokens")
                k = max(0, min(k, int(limit)) if limit is not None else k)
                self._pending = (ids[k:], finish)
                gen = p.finish(input_ids, ids[:k], "stop", sampling_params)
                return Generation(gen.token_ids, gen.logprobs, "abort", gen.text, prompt_tokens=len(input_ids))
        return p.finish(input_ids, ids, finish, sampling_params)

    async def abort(self) -> None:
        self._abort.set()


def _synthetic_logprob(token: int, position: int) -> float:
    return -0.01 - 2.99 * zlib.crc32(f"{token}:{position}".encode()) / 0xFFFFFFFF
