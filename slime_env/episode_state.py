"""`EpisodeState` and `take_turn`: one agent's ledger and conversation in a running episode, and the policy turn that
grows them — shared by the single-agent loop (`runner.Episode`) and the multi-agent one (`multi_agent`).

A turn: the policy gets exactly the ledger's ids and at most `min(max_new_tokens, max_context_tokens - len(ids))` new
tokens (appended as generated, mask 1); the turn closes into the agent's assistant message and a parsed `Action`; the
env's answer comes back through `observe` as inserted tokens (mask 0). The loops own the env calls and the endings.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Mapping
from typing import Any

from slime_env.env import Env
from slime_env.errors import InvalidInput, infra_cause
from slime_env.ledger import TokenLedger
from slime_env.parsers import Parser
from slime_env.parsers.prompts import tool_prompt, with_system_section
from slime_env.policy import Policy
from slime_env.renderers.template import TemplateRenderer, VerifiedPrefix
from slime_env.trajectory import Trajectory
from slime_env.types import Action, Generation, Message, Task, coerce_messages, coerce_reward

class EpisodeEnd(Exception):
    """Ends an episode's turn loop with a trajectory status and its reason."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


class TurnAborted(Exception):
    """The turn's generation was aborted (by the engine or the caller); its tokens so far stay in the ledger."""


def merge_env_sampling(params: dict[str, Any], own: Any, max_new_tokens: int, where: str) -> int:
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


async def take_turn(state: EpisodeState, params: Mapping[str, Any], parse: Parser | None, *, max_new_tokens: int,
                    max_context_tokens: int | None, deadline_at: float | None, who: str | None = None) -> Action:
    """One policy turn of one agent: generate within the budget, close the turn, parse it into its `Action`.

    No budget left raises `EpisodeEnd("truncated")`; a generation that finishes "abort" raises `TurnAborted` with the
    turn left open (a resumed episode continues it). `who` names the agent in reasons (multi-agent episodes).
    """
    room = max_new_tokens - len(state.turn_ids)
    if max_context_tokens is not None:
        room = min(room, max_context_tokens - len(state.ledger))
    if room <= 0:
        raise EpisodeEnd("truncated", f"context budget of {max_context_tokens} tokens exhausted" if who is None else
                         f"agent {who!r} exhausted the context budget of {max_context_tokens} tokens")
    gen = await state.generate({**params, "max_new_tokens": room}, deadline_at)
    if gen.finish_reason == "abort":
        raise TurnAborted()
    ids = state.close_turn()
    parsed = parse(state.last_content) if parse is not None else None
    action = Action(text=state.last_content, token_ids=tuple(ids), tool_calls=parsed.tool_calls if parsed else (),
                    parse_errors=parsed.errors if parsed else (), finish_reason=gen.finish_reason,
                    agent_id=state.agent_id, turn=state.turn)
    state.parse_errors += len(action.parse_errors)
    return action


class EpisodeState:
    """The mutable state of one agent in one running episode: its ledger, conversation, rewards, timings and status.

    `generate`, `close_turn`, `observe` grow the ledger turn by turn; `reset` and `step` call a single-agent `Env`
    (a multi-agent episode passes `env=None`, calls its env itself and keeps one state per agent); `trajectory()` is
    the record.
    """

    def __init__(self, env: Env | None, policy: Policy, task: Task, renderer: TemplateRenderer, agent_id: str,
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
        self.images: list[Any] = []  # the ImageParts of the ledger, in token order (vision renderers)

    async def reset(self, seed: int | None, deadline_at: float | None, parser: Any = None) -> None:
        """Reset the (single-agent) env and render the prompt: the ledger starts from it."""
        env = self.env
        assert env is not None, "a multi-agent episode calls its env itself"
        t = time.perf_counter()
        async with asyncio.timeout_at(deadline_at):
            result = await env.reset(seed=seed, options={"task": self.task})
        self.env_s += time.perf_counter() - t
        if not (isinstance(result, tuple) and len(result) == 2):
            raise InvalidInput(f"{type(env).__name__}.reset must return (messages, info)")
        messages, info = result
        self.messages = coerce_messages(messages, f"{type(env).__name__}.reset messages")
        self.info = dict(info or {})
        self.phase = "render prompt"
        self.tools = env.tools
        if self.tools and not self.renderer.renders_tools and getattr(env, "describe_tools", True):
            # The template has no tool section: the tools go into the system message in the parser's own format.
            self.messages = with_system_section(
                self.messages, tool_prompt(parser if isinstance(parser, str) else None, self.tools))
            self.tools = None
        self.ledger = TokenLedger(self.renderer.render_prompt(self.messages, tools=self.tools))
        self.images = [im for m in self.messages for im in m.images]

    async def generate(self, params: dict[str, Any], deadline_at: float | None) -> Generation:
        self.phase = "policy.generate"
        t = time.perf_counter()
        # Awaited in the episode's own task (no task per turn); an abort of a policy that cannot stop itself
        # cancels this task while it waits here, and the cancellation is taken back below.
        self._generating = asyncio.current_task()
        extra = {"images": tuple(self.images)} if self.images else {}  # the ledger's images, for a VLM engine
        try:
            if deadline_at is None:
                gen = await self.policy.generate(self.ledger.ids, params, **extra)
            else:
                async with asyncio.timeout_at(deadline_at):
                    gen = await self.policy.generate(self.ledger.ids, params, **extra)
        except TypeError as e:
            if extra and "images" in str(e):
                raise InvalidInput(f"{type(self.policy).__name__} takes no images (the ledger holds "
                                   f"{len(self.images)}): use a vision engine (VisionPolicy, SGLangPolicy)") from e
            raise
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

    @property
    def generating(self) -> bool:
        """True while the episode waits for the policy."""
        return self._generating is not None

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
        """Step the (single-agent) env on the action: its reward and observation; ends the turn."""
        env = self.env
        assert env is not None, "a multi-agent episode calls its env itself"
        self.phase = "env.step"
        t = time.perf_counter()
        if deadline_at is None:
            result = await env.step(action)
        else:
            async with asyncio.timeout_at(deadline_at):
                result = await env.step(action)
        self.env_s += time.perf_counter() - t
        self.phase = "framework"
        name = type(env).__name__
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

    def observe(self, gen_ids: list[int], obs: list[Message], max_context_tokens: int | None,
                who: str | None = None) -> None:
        """Insert the observation after the turn that generated `gen_ids`, with the prompt for the next turn (mask 0);
        one that leaves no room in the context budget raises `EpisodeEnd("truncated")`."""
        self.phase = "render observation"
        bridge = self.renderer.bridge(gen_ids, obs, self.messages)
        if max_context_tokens is not None and len(self.ledger) + len(bridge) >= max_context_tokens:
            whose = "the observation" if who is None else f"agent {who!r}'s observation"
            raise EpisodeEnd("truncated", f"{whose} ({len(bridge)} tokens) leaves no room in the context budget of "
                                          f"{max_context_tokens} tokens")
        self.insert(gen_ids, obs, bridge)

    def insert(self, gen_ids: list[int], obs: list[Message], bridge: list[int]) -> None:
        self.phase = "render observation"
        self.continuing = len(obs) == 1 and obs[0].role == "assistant"
        before = len(self.messages)  # the history the bridge follows, for its own check below
        self.ledger.add_inserted(bridge, self.turn - 1)
        if self.continuing:
            if obs[0].images:
                raise InvalidInput("a mid-turn assistant insert cannot hold images")
            self.messages[-1] = Message("assistant", self.messages[-1].content + obs[0].content)
        else:
            self.messages.extend(obs)
            self.images += [im for m in obs for im in m.images]
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
            info=self.info, vision=self.renderer.image_inputs(self.images) if self.images else None,
            metadata={**self.metadata, "finish_reasons": self.finish_reasons,
                      "weight_versions": self.weight_versions, "weight_version_tokens": self.call_tokens,
                      **({"adapters": self.adapters} if any(self.adapters) else {}),
                      "weight_version_spans": self.weight_spans,
                      "parse_errors": self.parse_errors,
                      "resumed": self.resumed})

