"""`run_episode`: drive one policy through one env and record its token ledger."""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
from collections.abc import Mapping
from typing import Any

from slime_env.env import Env
from slime_env.episode_state import EpisodeEnd, EpisodeState, TurnAborted, merge_env_sampling, take_turn
from slime_env.errors import InvalidInput
from slime_env.parsers import get_parser
from slime_env.policy import Policy
from slime_env.renderers.template import TemplateRenderer
from slime_env.trajectory import Trajectory
from slime_env.types import Task

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
        self.state = EpisodeState(env, policy, self.task, renderer, agent_id,
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
        return self.state.generating

    def _take_env_sampling(self) -> None:
        """The env's own sampling params for this episode (`Env.sampling_params`), over the run's."""
        own = getattr(self.env, "sampling_params", None)
        self.max_new_tokens = merge_env_sampling(self.params, own, self.max_new_tokens,
                                                f"{type(self.env).__name__}.sampling_params")

    async def run(self) -> Trajectory | None:
        if self.done is not None:
            return self.done
        ep, loop = self.state, asyncio.get_running_loop()
        deadline_at = self._start_clock(loop)
        try:
            if not self.started:
                await self._start(deadline_at)
            while True:
                await self._turn(deadline_at)
        except TurnAborted:
            if self.suspend_on_abort:
                self.suspended = True
                self._deadline_left = None if deadline_at is None else max(0.0, deadline_at - loop.time())
                return None
            ep.status, ep.reason = "aborted", ep.abort_reason or "the policy aborted the generation"
        except EpisodeEnd as end:
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

    def _start_clock(self, loop: asyncio.AbstractEventLoop) -> float | None:
        """This run's deadline (loop time): a resumed episode is not charged for the time it was suspended."""
        if self._deadline_at is None and self.deadline_s is not None:
            self._deadline_at = loop.time() + self.deadline_s
        if self.suspended:
            self.suspended = False
            self.state.resumed += 1
            self.state.abort_requested = False
            if self._deadline_left is not None:
                self._deadline_at = loop.time() + self._deadline_left
        return self._deadline_at

    async def _start(self, deadline_at: float | None) -> None:
        """Reset the env; its parser, stop strings and sampling params join the run's."""
        self.started = True
        parser = self.env.parser if self._parser_spec == _FROM_ENV else self._parser_spec
        await self.state.reset(self.seed, deadline_at, parser)
        self.parse = get_parser(self.env.parser if self._parser_spec == _FROM_ENV else self._parser_spec)
        env_stop = list(getattr(self.env, "stop", None) or ())
        if env_stop:
            self.params["stop"] = list(dict.fromkeys([*(self.params.get("stop") or ()), *env_stop]))
        self._take_env_sampling()

    async def _turn(self, deadline_at: float | None) -> None:
        """One turn: the policy's, the env's step on its action and, unless the episode ends, the observation."""
        ep = self.state
        if ep.abort_requested:
            raise TurnAborted()
        if ep.turn >= self.max_turns:
            raise EpisodeEnd("truncated", f"max_turns={self.max_turns} reached")
        params = dict(self.params)
        if params.get("sampling_seed") == "episode":  # reproducible: one seed per (episode, turn)
            params["sampling_seed"] = ((self.seed or 0) * 1_000_003 + ep.turn) % (1 << 62)
        action = await take_turn(ep, params, self.parse, max_new_tokens=self.max_new_tokens,
                                 max_context_tokens=self.max_context_tokens, deadline_at=deadline_at)
        obs, terminated, truncated = await ep.step(action, deadline_at)
        if terminated:
            raise EpisodeEnd("completed", "")
        if truncated:
            raise EpisodeEnd("truncated", "the env truncated the episode")
        if ep.turn >= self.max_turns:
            raise EpisodeEnd("truncated", f"max_turns={self.max_turns} reached")
        ep.observe(list(action.token_ids), obs, self.max_context_tokens)

    def trajectory(self) -> Trajectory:
        """The finished trajectory; a suspended or never-finished episode is returned as aborted."""
        if self.done is None:
            ep = self.state
            ep.status, ep.reason = "aborted", ep.abort_reason or "aborted before it finished"
            self.done = ep.trajectory()
        return self.done
