"""`run_episode`: drive one policy through one env and record its token ledger."""

from __future__ import annotations

import asyncio
import math
import time
import traceback
import uuid
from collections.abc import Mapping
from typing import Any

from slime_env.env import Env
from slime_env.errors import InvalidInput
from slime_env.ledger import TokenLedger
from slime_env.parsers import get_parser
from slime_env.policy import Policy
from slime_env.renderers.template import TemplateRenderer
from slime_env.trajectory import Trajectory
from slime_env.types import Action, Generation, Message, Task, coerce_messages

_FROM_ENV = "env"


class _EpisodeEnd(Exception):
    """Internal: ends the turn loop with a status and reason."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


async def run_episode(env: Env, policy: Policy, task: Task | Mapping[str, Any] | str, *,
                      renderer: TemplateRenderer, max_turns: int = 8, max_context_tokens: int | None = None,
                      max_new_tokens: int = 1024, deadline_s: float | None = None,
                      sampling_params: Mapping[str, Any] | None = None, parser: Any = _FROM_ENV,
                      agent_id: str = "agent", seed: int | None = None, strict: bool | None = None,
                      metadata: Mapping[str, Any] | None = None) -> Trajectory:
    """Run one episode and return its `Trajectory`. Never raises for env, policy or budget problems.

    Turn k: the policy gets exactly the ledger's ids so far and at most
    `min(max_new_tokens, max_context_tokens - len(ids))` new tokens; its ids are appended as
    generated (mask 1); the env steps on the parsed `Action`; unless the episode ends, the
    renderer's bridge (turn close + observation + generation prompt) is appended as inserted (mask 0).
    Ends `completed` (env terminated), `truncated` (env truncated, `max_turns`, context budget,
    `deadline_s`), `aborted` (the policy returned finish_reason "abort") or `failed` (an exception
    in the env, the policy or the renderer, or an invalid generation), with the reason.
    The caller owns `env` (reset here, not closed). `parser` defaults to `env.parser`.
    A policy with `for_episode(session_id)` is asked for a per-episode view first; the session id
    (`metadata["session_id"]`, generated if absent) is recorded in the trajectory.
    """
    if max_turns < 1 or max_new_tokens < 1:
        raise InvalidInput(f"max_turns and max_new_tokens must be >= 1, got {max_turns} and {max_new_tokens}")
    task = Task.coerce(task)
    metadata = dict(metadata or {})
    metadata["session_id"] = str(metadata.get("session_id") or uuid.uuid4().hex)
    if callable(getattr(policy, "for_episode", None)):  # e.g. SGLang: routing key + abortable rids
        policy = policy.for_episode(metadata["session_id"])
    episode = _Episode(env, policy, task, renderer, agent_id,
                       renderer.strict if strict is None else strict, metadata)
    parse = get_parser(env.parser if parser == _FROM_ENV else parser)
    loop = asyncio.get_running_loop()
    deadline_at = None if deadline_s is None else loop.time() + deadline_s
    params = dict(sampling_params or {})
    params["stop_token_ids"] = sorted({*renderer.stop_token_ids, *(params.get("stop_token_ids") or ())})

    try:
        await episode.reset(seed, deadline_at)
        while True:
            if episode.turn >= max_turns:
                raise _EpisodeEnd("truncated", f"max_turns={max_turns} reached")
            room = max_new_tokens if max_context_tokens is None else max_context_tokens - len(episode.ledger)
            if room <= 0:
                raise _EpisodeEnd("truncated", f"context budget of {max_context_tokens} tokens exhausted")
            gen = await episode.generate({**params, "max_new_tokens": min(max_new_tokens, room)}, deadline_at)
            if gen.finish_reason == "abort":
                raise _EpisodeEnd("aborted", "the policy aborted the generation")
            content = episode.last_content
            parsed = parse(content) if parse is not None else None
            action = Action(text=content, token_ids=gen.token_ids,
                            tool_calls=parsed.tool_calls if parsed else (),
                            parse_errors=parsed.errors if parsed else (),
                            finish_reason=gen.finish_reason, agent_id=agent_id, turn=episode.turn)
            episode.parse_errors += len(action.parse_errors)
            obs, terminated, truncated = await episode.step(action, deadline_at)
            if terminated:
                raise _EpisodeEnd("completed", "")
            if truncated:
                raise _EpisodeEnd("truncated", "the env truncated the episode")
            if episode.turn >= max_turns:
                raise _EpisodeEnd("truncated", f"max_turns={max_turns} reached")
            episode.phase = "render observation"
            bridge = renderer.bridge(gen.token_ids, obs, episode.messages)
            if max_context_tokens is not None and len(episode.ledger) + len(bridge) >= max_context_tokens:
                raise _EpisodeEnd("truncated", f"the observation ({len(bridge)} tokens) leaves no room in the "
                                               f"context budget of {max_context_tokens} tokens")
            episode.insert(gen, obs, bridge)
    except _EpisodeEnd as end:
        episode.status, episode.reason = end.status, end.reason
    except TimeoutError as e:
        if deadline_at is not None and loop.time() >= deadline_at:
            episode.status, episode.reason = "truncated", f"deadline of {deadline_s}s exceeded during {episode.phase}"
        else:  # a timeout inside the env or the policy, not ours
            episode.fail(e)
    except Exception as e:  # noqa: BLE001 - any failure becomes a recorded status, never a lost episode
        episode.fail(e)
    return episode.trajectory()




class _Episode:
    """Mutable state of one running episode (ledger, conversation, timings)."""

    def __init__(self, env: Env, policy: Policy, task: Task, renderer: TemplateRenderer, agent_id: str,
                 strict: bool, metadata: dict[str, Any]):
        self.env, self.policy, self.task, self.renderer = env, policy, task, renderer
        self.agent_id, self.strict, self.metadata = agent_id, strict, metadata
        self.ledger = TokenLedger(())
        self.messages: list[Message] = []
        self.turn_rewards: list[float] = []
        self.turn = 0
        self.phase = "env.reset"
        self.status, self.reason = "failed", "episode did not start"
        self.info: dict[str, Any] = {}
        self.parse_errors = 0
        self.finish_reasons: list[str] = []
        self.weight_versions: list[str | None] = []
        self.generate_s = self.env_s = 0.0
        self.t0 = time.perf_counter()
        self.last_content = ""
        self.continuing = False  # the next generation continues the current assistant turn

    async def reset(self, seed: int | None, deadline_at: float | None) -> None:
        t = time.perf_counter()
        async with asyncio.timeout_at(deadline_at):
            result = await self.env.reset(seed=seed, options={"task": self.task})
        self.env_s += time.perf_counter() - t
        if not (isinstance(result, tuple) and len(result) == 2):
            raise InvalidInput(f"{type(self.env).__name__}.reset must return (messages, info)")
        messages, info = result
        self.messages = coerce_messages(messages, f"{type(self.env).__name__}.reset messages")
        self.info = dict(info or {})
        self.phase = "render prompt"
        self.ledger = TokenLedger(self.renderer.render_prompt(self.messages, tools=self.env.tools))

    async def generate(self, params: dict[str, Any], deadline_at: float | None) -> Generation:
        self.phase = "policy.generate"
        t = time.perf_counter()
        try:
            async with asyncio.timeout_at(deadline_at):
                gen = await self.policy.generate(self.ledger.ids, params)
        except TimeoutError:
            await self._abort_engine_request()
            raise
        finally:
            self.generate_s += time.perf_counter() - t
        self.phase = "framework"
        if not isinstance(gen, Generation):
            raise InvalidInput(f"policy.generate returned {type(gen).__name__}, not Generation")
        if len(gen.token_ids) > params["max_new_tokens"]:
            raise InvalidInput(f"policy returned {len(gen.token_ids)} tokens, more than "
                               f"max_new_tokens={params['max_new_tokens']}")
        if not gen.token_ids and gen.finish_reason != "abort":
            raise InvalidInput("policy returned no tokens")
        self.ledger.add_generated(gen.token_ids, gen.logprobs, self.turn)
        self.finish_reasons.append(gen.finish_reason)
        self.weight_versions.append(gen.weight_version)
        # The action carries this generation's text only; the conversation record joins a turn that
        # an env continued mid-way (a single assistant observation) into one assistant message.
        self.last_content = self.renderer.assistant_text(gen.token_ids)
        if self.continuing:
            self.messages[-1] = Message("assistant", self.messages[-1].content + self.last_content)
        else:
            self.messages.append(Message("assistant", self.last_content))
        return gen

    async def _abort_engine_request(self) -> None:
        """Past the deadline the engine would keep generating for nobody: abort it if the policy can."""
        abort = getattr(self.policy, "abort", None)
        if callable(abort):
            try:
                await asyncio.wait_for(abort(), 5.0)
            except Exception:  # noqa: BLE001 - best effort; the episode is already ending
                pass

    async def step(self, action: Action, deadline_at: float | None) -> tuple[list[Message], bool, bool]:
        self.phase = "env.step"
        t = time.perf_counter()
        async with asyncio.timeout_at(deadline_at):
            result = await self.env.step(action)
        self.env_s += time.perf_counter() - t
        self.phase = "framework"
        name = type(self.env).__name__
        if not (isinstance(result, tuple) and len(result) == 5):
            raise InvalidInput(f"{name}.step must return (observation, reward, terminated, truncated, info)")
        obs, reward, terminated, truncated, info = result
        obs = coerce_messages(obs, f"{name}.step observation")
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            raise InvalidInput(f"{name}.step reward must be a number, got {reward!r}") from None
        if not math.isfinite(reward):
            raise InvalidInput(f"{name}.step reward must be finite, got {reward}")
        self.turn_rewards.append(reward)
        self.info = dict(info or {})
        self.turn += 1
        if terminated or truncated:
            self.messages.extend(obs)  # kept for the record; no tokens follow the last turn
        return obs, bool(terminated), bool(truncated)

    def insert(self, gen: Generation, obs: list[Message], bridge: list[int]) -> None:
        self.phase = "render observation"
        if self.strict:
            self.renderer.check_bridge(self.messages, gen.token_ids, obs, bridge, tools=self.env.tools)
        self.ledger.add_inserted(bridge, self.turn - 1)
        self.continuing = len(obs) == 1 and obs[0].role == "assistant"
        if self.continuing:
            self.messages[-1] = Message("assistant", self.messages[-1].content + obs[0].content)
        else:
            self.messages.extend(obs)
            if self.strict:
                note = self.renderer.check_full(self.messages, self.ledger.ids, tools=self.env.tools)
                if note is not None:
                    self.metadata.setdefault("history_rewrites", []).append(note)
        self.phase = "framework"

    def fail(self, error: BaseException) -> None:
        self.status = "failed"
        self.reason = f"{self.phase} raised {type(error).__name__}: {error}"
        self.metadata["traceback"] = "".join(traceback.format_exception(error, limit=8))

    def trajectory(self) -> Trajectory:
        total = time.perf_counter() - self.t0
        led = self.ledger
        return Trajectory(
            task=self.task, prompt_ids=led.prompt_ids, response_ids=led.response_ids, loss_mask=led.loss_mask,
            rollout_logprobs=led.rollout_logprobs, spans=led.spans, turn_rewards=self.turn_rewards,
            reward=float(sum(self.turn_rewards)), status=self.status, reason=self.reason, agent_id=self.agent_id,
            num_turns=len(self.finish_reasons), messages=self.messages,
            response_text=self.renderer.decode(led.response_ids) if led.response_ids else "",
            timings={"total_s": total, "generate_s": self.generate_s, "env_s": self.env_s,
                     "framework_s": max(0.0, total - self.generate_s - self.env_s)},
            info=self.info,
            metadata={**self.metadata, "finish_reasons": self.finish_reasons,
                      "weight_versions": self.weight_versions, "parse_errors": self.parse_errors})
