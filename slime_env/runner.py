"""`run_episode`: drive one policy through one env and record its token ledger."""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import time
import traceback
from collections.abc import Mapping
from typing import Any

from slime_env.env import Env
from slime_env.errors import InvalidInput, infra_cause
from slime_env.ledger import TokenLedger
from slime_env.parsers import get_parser
from slime_env.parsers.prompts import tool_prompt, with_system_section
from slime_env.policy import Policy
from slime_env.renderers.template import TemplateRenderer, VerifiedPrefix
from slime_env.trajectory import Trajectory
from slime_env.types import Action, Generation, Message, Task, coerce_messages, coerce_reward

_FROM_ENV = "env"


_session_prefix = secrets.token_hex(6)
_session_numbers = itertools.count()


def _new_session_prefix() -> None:
    global _session_prefix
    _session_prefix = secrets.token_hex(6)


os.register_at_fork(after_in_child=_new_session_prefix)  # a forked child must not repeat its parent's ids


def _new_session_id() -> str:
    """24 hex digits, unique within a process by a counter and across processes by a random prefix drawn at
    start-up and after fork (one random draw per episode would be a system call per episode)."""
    return f"{_session_prefix}{next(_session_numbers):012x}"


def _merge_env_sampling(params: dict[str, Any], own: Any, max_new_tokens: int, where: str) -> int:
    """An env's sampling params for one episode (`own`, None for none) merged over `params` in place; returns the
    per-turn budget, lowered by its `max_new_tokens`. A malformed value raises, naming `where`."""
    if own is None:
        return max_new_tokens
    if not isinstance(own, Mapping):
        raise TypeError(f"{where}: expected a mapping, got {type(own).__name__}")
    own = dict(own)
    if "max_new_tokens" in own:
        limit = own.pop("max_new_tokens")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"{where}['max_new_tokens']: expected a positive integer, got {limit!r}")
        max_new_tokens = min(max_new_tokens, limit)
    params.update(own)
    return max_new_tokens


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
    episode = Episode(env, policy, task, renderer=renderer, max_turns=max_turns,
                      max_context_tokens=max_context_tokens, max_new_tokens=max_new_tokens, deadline_s=deadline_s,
                      sampling_params=sampling_params, parser=parser, agent_id=agent_id, seed=seed, strict=strict,
                      metadata=metadata)
    result = await episode.run()
    assert result is not None  # only suspend_on_abort episodes can be suspended
    return result


class Episode:
    """One episode that can be run, aborted, and (with `suspend_on_abort`) resumed later.

    `run()` returns the `Trajectory`, or None when the episode was aborted and suspended: its env,
    ledger and partial turn are kept, and a later `run()` continues it (the rollout manager's partial
    rollouts). `abort()` stops it: through the policy's `abort()` when the per-episode policy has one
    (the engine returns the partial tokens), else by cancelling the in-flight generate call.
    `mask_offpolicy()` turns every token generated so far into `offpolicy` tokens (loss mask 0), for
    resuming under new weights. Same arguments and guarantees as `run_episode`.
    """

    def __init__(self, env: Env, policy: Policy, task: Task | Mapping[str, Any] | str, *,
                 renderer: TemplateRenderer, max_turns: int = 8, max_context_tokens: int | None = None,
                 max_new_tokens: int = 1024, deadline_s: float | None = None,
                 sampling_params: Mapping[str, Any] | None = None, parser: Any = _FROM_ENV,
                 agent_id: str = "agent", seed: int | None = None, strict: bool | None = None,
                 metadata: Mapping[str, Any] | None = None, suspend_on_abort: bool = False):
        if max_turns < 1 or max_new_tokens < 1:
            raise InvalidInput(f"max_turns and max_new_tokens must be >= 1, got {max_turns} and {max_new_tokens}")
        self.task = Task.coerce(task)
        self.metadata = dict(metadata or {})
        self.metadata["session_id"] = str(self.metadata.get("session_id") or _new_session_id())
        if callable(getattr(policy, "for_episode", None)):  # e.g. SGLang: routing key + abortable rids
            policy = policy.for_episode(self.metadata["session_id"])
        self.state = _Episode(env, policy, self.task, renderer, agent_id,
                              renderer.strict if strict is None else strict, self.metadata)
        self._parser_spec = parser
        self.parse = None  # resolved after reset: a remote env learns its parser when its session opens
        self.renderer, self.env, self.agent_id, self.seed = renderer, env, agent_id, seed
        self.max_turns, self.max_context_tokens, self.max_new_tokens = max_turns, max_context_tokens, max_new_tokens
        self.deadline_s = deadline_s
        self.suspend_on_abort = suspend_on_abort
        params = dict(sampling_params or {})
        params["stop_token_ids"] = sorted({*renderer.stop_token_ids, *(params.get("stop_token_ids") or ())})
        self.params = params
        self.started = False
        self.suspended = False
        self.done: Trajectory | None = None
        self._deadline_at: float | None = None
        self._deadline_left: float | None = None

    async def abort(self, reason: str = "aborted by the caller") -> None:
        """Stop the episode at the next safe point; an in-flight generation returns what it has."""
        await self.state.request_abort(reason)

    def mask_offpolicy(self) -> None:
        self.state.ledger.mask_offpolicy()

    @property
    def generating(self) -> bool:
        """True while the episode waits for the policy (False in env steps, suspended or finished)."""
        return self.state._generating is not None

    def _take_env_sampling(self) -> None:
        """The env's own sampling params for this episode (`Env.sampling_params`), over the run's."""
        own = getattr(self.env, "sampling_params", None)
        self.max_new_tokens = _merge_env_sampling(self.params, own, self.max_new_tokens,
                                                 f"{type(self.env).__name__}.sampling_params")

    async def run(self) -> Trajectory | None:
        if self.done is not None:
            return self.done
        ep = self.state
        loop = asyncio.get_running_loop()
        if self._deadline_at is None and self.deadline_s is not None:
            self._deadline_at = loop.time() + self.deadline_s
        if self.suspended:
            self.suspended = False
            ep.resumed += 1
            ep.abort_requested = False
            if self._deadline_left is not None:  # time spent suspended does not count against the deadline
                self._deadline_at = loop.time() + self._deadline_left
        deadline_at = self._deadline_at
        try:
            if not self.started:
                self.started = True
                parser = self.env.parser if self._parser_spec == _FROM_ENV else self._parser_spec
                await ep.reset(self.seed, deadline_at, parser)
                self.parse = get_parser(self.env.parser if self._parser_spec == _FROM_ENV else self._parser_spec)
                env_stop = list(getattr(self.env, "stop", None) or ())
                if env_stop:
                    self.params["stop"] = list(dict.fromkeys([*(self.params.get("stop") or ()), *env_stop]))
                self._take_env_sampling()
            while True:
                if ep.abort_requested:
                    raise _Abort()
                if ep.turn >= self.max_turns:
                    raise _EpisodeEnd("truncated", f"max_turns={self.max_turns} reached")
                room = self.max_new_tokens - len(ep.turn_ids)
                if self.max_context_tokens is not None:
                    room = min(room, self.max_context_tokens - len(ep.ledger))
                if room <= 0:
                    raise _EpisodeEnd("truncated", f"context budget of {self.max_context_tokens} tokens exhausted")
                params = {**self.params, "max_new_tokens": room}
                if params.get("sampling_seed") == "episode":  # reproducible: one seed per (episode, turn)
                    params["sampling_seed"] = ((self.seed or 0) * 1_000_003 + ep.turn) % (1 << 62)
                gen = await ep.generate(params, deadline_at)
                if gen.finish_reason == "abort":
                    raise _Abort()
                gen_ids = ep.close_turn()
                parsed = self.parse(ep.last_content) if self.parse is not None else None
                action = Action(text=ep.last_content, token_ids=tuple(gen_ids),
                                tool_calls=parsed.tool_calls if parsed else (),
                                parse_errors=parsed.errors if parsed else (),
                                finish_reason=gen.finish_reason, agent_id=self.agent_id, turn=ep.turn)
                ep.parse_errors += len(action.parse_errors)
                obs, terminated, truncated = await ep.step(action, deadline_at)
                if terminated:
                    raise _EpisodeEnd("completed", "")
                if truncated:
                    raise _EpisodeEnd("truncated", "the env truncated the episode")
                if ep.turn >= self.max_turns:
                    raise _EpisodeEnd("truncated", f"max_turns={self.max_turns} reached")
                ep.phase = "render observation"
                bridge = self.renderer.bridge(gen_ids, obs, ep.messages)
                if self.max_context_tokens is not None and len(ep.ledger) + len(bridge) >= self.max_context_tokens:
                    raise _EpisodeEnd("truncated", f"the observation ({len(bridge)} tokens) leaves no room in the "
                                                   f"context budget of {self.max_context_tokens} tokens")
                ep.insert(gen_ids, obs, bridge)
        except _Abort:
            if self.suspend_on_abort:
                self.suspended = True
                self._deadline_left = None if deadline_at is None else max(0.0, deadline_at - loop.time())
                return None
            ep.status, ep.reason = "aborted", ep.abort_reason or "the policy aborted the generation"
        except _EpisodeEnd as end:
            ep.status, ep.reason = end.status, end.reason
        except TimeoutError as e:
            if deadline_at is not None and loop.time() >= deadline_at:
                ep.status, ep.reason = "truncated", f"deadline of {self.deadline_s}s exceeded during {ep.phase}"
            else:  # a timeout inside the env or the policy, not ours
                ep.fail(e)
        except Exception as e:  # noqa: BLE001 - any failure becomes a recorded status, never a lost episode
            ep.fail(e)
        self.done = ep.trajectory()
        return self.done

    def trajectory(self) -> Trajectory:
        """The finished trajectory; a suspended or never-finished episode is returned as aborted."""
        if self.done is None:
            ep = self.state
            ep.status, ep.reason = "aborted", ep.abort_reason or "aborted before it finished"
            self.done = ep.trajectory()
        return self.done


class _Abort(Exception):
    """Internal: the current generation was aborted."""


class _Episode:
    """Mutable state of one running episode (ledger, conversation, timings)."""

    def __init__(self, env: Env, policy: Policy, task: Task, renderer: TemplateRenderer, agent_id: str,
                 strict: bool, metadata: dict[str, Any]):
        self.env, self.policy, self.task, self.renderer = env, policy, task, renderer
        self.agent_id, self.strict, self.metadata = agent_id, strict, metadata
        self.ledger = TokenLedger(())
        self.verified = VerifiedPrefix()  # strict mode: what full renders have proved of the ledger so far
        self.messages: list[Message] = []
        self.turn_rewards: list[float] = []
        self.turn = 0
        self.phase = "env.reset"
        self.status, self.reason = "failed", "episode did not start"
        self.info: dict[str, Any] = {}
        self.parse_errors = 0
        self.finish_reasons: list[str] = []
        self.weight_versions: list[str | None] = []  # per generate call, with its number of tokens below
        self.adapters: list[str | None] = []  # per generate call: its LoRA adapter ("name@version") or None
        self.weight_spans: list[list[list]] = []  # per generate call: [version, start, end] where the engine says
        self.call_tokens: list[int] = []
        self.generate_s = self.env_s = 0.0
        self.t0 = time.perf_counter()
        self.last_content = ""
        self.continuing = False  # the next turn continues the current assistant message (mid-turn insert)
        self.turn_ids: list[int] = []  # ids generated so far in the open turn (several calls if resumed)
        self.tools: Any = None  # set at reset: the tools the prompt renders (None once described in the system text)
        self.abort_requested = False
        self.abort_reason = ""
        self.resumed = 0
        self.turns_generated = 0
        self._generating: asyncio.Task | None = None  # the episode's task while it waits for the policy
        self._cancelled_for_abort = False

    async def reset(self, seed: int | None, deadline_at: float | None, parser: Any = None) -> None:
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
        self.tools = self.env.tools
        if self.tools and not self.renderer.renders_tools and getattr(self.env, "describe_tools", True):
            # The template has no tool section: the tools go into the system message in the parser's own format.
            self.messages = with_system_section(
                self.messages, tool_prompt(parser if isinstance(parser, str) else None, self.tools))
            self.tools = None
        self.ledger = TokenLedger(self.renderer.render_prompt(self.messages, tools=self.tools))

    async def generate(self, params: dict[str, Any], deadline_at: float | None) -> Generation:
        self.phase = "policy.generate"
        t = time.perf_counter()
        # Awaited in the episode's own task (no task per turn); an abort of a policy that cannot stop itself
        # cancels this task while it waits here, and the cancellation is taken back below.
        self._generating = asyncio.current_task()
        try:
            if deadline_at is None:
                gen = await self.policy.generate(self.ledger.ids, params)
            else:
                async with asyncio.timeout_at(deadline_at):
                    gen = await self.policy.generate(self.ledger.ids, params)
        except asyncio.CancelledError:
            if not self._cancelled_for_abort:
                raise  # our caller was cancelled, not the generation
            self._cancelled_for_abort = False
            self._generating.uncancel()
            gen = Generation((), (), "abort")  # aborted by cancellation: the policy could not stop itself
        except TimeoutError:
            await self._abort_engine_request()
            raise
        finally:
            self._generating = None
            self.generate_s += time.perf_counter() - t
        self.phase = "framework"
        if not isinstance(gen, Generation):
            raise InvalidInput(f"policy.generate returned {type(gen).__name__}, not Generation")
        if len(gen.token_ids) > params["max_new_tokens"]:
            raise InvalidInput(f"policy returned {len(gen.token_ids)} tokens, more than "
                               f"max_new_tokens={params['max_new_tokens']}")
        if not gen.token_ids and gen.finish_reason != "abort" and not self.turn_ids:
            raise InvalidInput("policy returned no tokens")
        self.ledger.add_generated(gen.token_ids, gen.logprobs, self.turn, gen.routed_experts)
        self.turn_ids.extend(gen.token_ids)
        self.finish_reasons.append(gen.finish_reason)
        self.weight_versions.append(gen.weight_version)
        self.adapters.append(gen.adapter)
        self.weight_spans.append([list(span) for span in gen.weight_spans])
        self.call_tokens.append(len(gen.token_ids))
        return gen

    def close_turn(self) -> list[int]:
        """End the open turn: its text becomes the action and the assistant message; returns its ids."""
        ids, self.turn_ids = self.turn_ids, []
        self.turns_generated += 1
        # The action carries this turn's text only; the conversation record joins a turn that an env
        # continued mid-way (a single assistant observation) into one assistant message.
        self.last_content = self.renderer.assistant_text(ids)
        if self.continuing:
            self.messages[-1] = Message("assistant", self.messages[-1].content + self.last_content)
        else:
            self.messages.append(Message("assistant", self.last_content))
        return ids

    async def request_abort(self, reason: str) -> None:
        self.abort_requested, self.abort_reason = True, reason
        task = self._generating
        if task is None or task.done():
            return
        if callable(getattr(self.policy, "abort", None)):
            await self._abort_engine_request()  # the engine returns the partial tokens, finish "abort"
        elif not self._cancelled_for_abort and task is not asyncio.current_task():
            self._cancelled_for_abort = True
            task.cancel()

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
        if deadline_at is None:
            result = await self.env.step(action)
        else:
            async with asyncio.timeout_at(deadline_at):
                result = await self.env.step(action)
        self.env_s += time.perf_counter() - t
        self.phase = "framework"
        name = type(self.env).__name__
        if not (isinstance(result, tuple) and len(result) == 5):
            raise InvalidInput(f"{name}.step must return (observation, reward, terminated, truncated, info)")
        obs, reward, terminated, truncated, info = result
        obs = coerce_messages(obs, f"{name}.step observation")
        reward = coerce_reward(reward, f"{name}.step reward")
        self.turn_rewards.append(reward)
        self.info = dict(info or {})
        self.turn += 1
        if terminated or truncated:
            self.messages.extend(obs)  # kept for the record; no tokens follow the last turn
        return obs, bool(terminated), bool(truncated)

    def insert(self, gen_ids: list[int], obs: list[Message], bridge: list[int]) -> None:
        self.phase = "render observation"
        self.continuing = len(obs) == 1 and obs[0].role == "assistant"
        before = len(self.messages)  # the history the bridge follows, for its own check below
        self.ledger.add_inserted(bridge, self.turn - 1)
        if self.continuing:
            self.messages[-1] = Message("assistant", self.messages[-1].content + obs[0].content)
        else:
            self.messages.extend(obs)
            if self.strict:
                note = self.renderer.check_full(self.messages, self.ledger.ids, tools=self.tools,
                                                verified=self.verified)
                # Agreement proves the bridge's ids too; where a template's known rewrite of history made the full
                # render differ, the bridge is checked on its own against the real history.
                if note is not None:
                    self.renderer.check_bridge(self.messages[:before], gen_ids, obs, bridge, tools=self.tools)
                    self.metadata.setdefault("history_rewrites", []).append(note)
        self.phase = "framework"

    def fail(self, error: BaseException) -> None:
        # A cause outside the model (the env says so by raising InfraError): a status the trainer leaves out, not a 0.
        self.status = "infra_error" if infra_cause(error) is not None else "failed"
        self.reason = f"{self.phase} raised {type(error).__name__}: {error}"
        self.metadata["traceback"] = "".join(traceback.format_exception(error, limit=8))

    def _env_timings(self) -> dict[str, float]:
        """Seconds the env reports of its own (`episode_timings()`, e.g. a workspace's container time): kept out of
        `info` so that a seeded step's info stays the same run to run."""
        timings = getattr(self.env, "episode_timings", None)
        if not callable(timings):
            return {}
        try:
            return {str(k): float(v) for k, v in dict(timings() or {}).items()}
        except Exception:  # noqa: BLE001 - a broken report costs the record of its timings, never the episode
            return {}

    def trajectory(self) -> Trajectory:
        total = time.perf_counter() - self.t0
        led = self.ledger
        return Trajectory(
            task=self.task, prompt_ids=led.prompt_ids, response_ids=led.response_ids, loss_mask=led.loss_mask,
            rollout_logprobs=led.rollout_logprobs, spans=led.spans, routing=led.routing(),
            turn_rewards=self.turn_rewards,
            reward=float(sum(self.turn_rewards)), status=self.status, reason=self.reason, agent_id=self.agent_id,
            num_turns=self.turns_generated + (1 if self.turn_ids else 0), messages=self.messages,
            response_text=self.renderer.decode(led.response_ids) if led.response_ids else "",
            timings={"total_s": total, "generate_s": self.generate_s, "env_s": self.env_s,
                     "framework_s": max(0.0, total - self.generate_s - self.env_s), **self._env_timings()},
            info=self.info,
            metadata={**self.metadata, "finish_reasons": self.finish_reasons,
                      "weight_versions": self.weight_versions, "weight_version_tokens": self.call_tokens,
                      **({"adapters": self.adapters} if any(self.adapters) else {}),
                      "weight_version_spans": self.weight_spans,
                      "parse_errors": self.parse_errors,
                      "resumed": self.resumed})

