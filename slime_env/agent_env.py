"""`AgentEnv`: any agent program — OpenAI Agents SDK, LangGraph, smolagents, your own loop — as an RL environment.

The program is `agent(base_url, api_key, task)`: it talks to an OpenAI-compatible endpoint (the gateway, one private
session per episode) however it likes — its own tools, memory, sub-agents and stop rule — and returns whatever it
returns. `reward(task, result, trajectories)` scores the outcome. The gateway records every call as exact token
ledgers; each episode gives one trajectory per branch of its session (`slime_env.gateway`): the sample's main
trajectory (the branch of its last call) and, after it, side branches marked `metadata["branch_of"]`, which share the
sample's reward and advantage. A crash, a timeout or an agent that never calls the model becomes a status with its
reason. A cause outside the model becomes `infra_error` (never trained, never a 0): the agent or the reward raising
`InfraError` (a harness binary missing, a verifier's container that did not start), or a host fault on the session
(the engine failing a call, the gateway stopping) after which the agent made no successful call.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from slime_env.errors import InvalidInput, infra_cause
from slime_env.loading import load_object
from slime_env.trajectory import Trajectory
from slime_env.types import Task, coerce_reward


class AgentEnv:
    """An agent program as an env (module docstring). `agent`: `async (base_url, api_key, task) -> result` (or a
    plain function, run in a thread; or an import path "pkg.mod:fn" / "path/to/file.py:fn"); `reward`: `(task,
    result, trajectories) -> float` (or async; default: 0.0); `parser`: the model family's tool-call parser
    (`slime_env.parsers` name; default "hermes"); `deadline_s`: the episode's wall-clock limit; `strict`: the
    gateway checks every rendered bridge against the chat template's full render (a mismatch fails the call);
    `api`: the `base_url` the agent gets — "openai" (`.../v1`, for OpenAI clients) or "anthropic" (the session root:
    Anthropic clients add `/v1/messages`)."""

    scored_statuses: tuple[str, ...] = ("completed",)  # episodes the reward is asked about (others score 0)

    def __init__(self, agent: Callable[..., Any] | str, reward: Callable[..., Any] | str | None = None, *,
                 parser: str | None = "hermes", deadline_s: float | None = None, strict: bool = True,
                 api: str = "openai"):
        if api not in ("openai", "anthropic"):
            raise InvalidInput(f"AgentEnv api must be 'openai' or 'anthropic', got {api!r}")
        self.api = api
        self.agent = load_object(agent) if isinstance(agent, str) else agent
        self.reward = load_object(reward) if isinstance(reward, str) else reward
        if not callable(self.agent):
            raise InvalidInput(f"AgentEnv agent must be callable, got {type(self.agent).__name__}")
        if self.reward is not None and not callable(self.reward):
            raise InvalidInput(f"AgentEnv reward must be callable, got {type(self.reward).__name__}")
        self.parser, self.deadline_s, self.strict = parser, deadline_s, strict

    async def close(self) -> None:
        return None

    async def run(self, gateway: Any, task: Task, *, metadata: dict[str, Any] | None = None,
                  deadline_s: float | None = None) -> list[Trajectory]:
        """One episode: a private session on `gateway`, the agent run against it (within the deadline), the session's
        branches scored. Returns the main trajectory first, then the side branches."""
        session = gateway.open_session(task)
        url = gateway.session_url(session, api=self.api)
        status, reason, result = "completed", "", None
        limit = deadline_s if deadline_s is not None else self.deadline_s
        try:
            call = self._call(url, session.key, task)
            result = await asyncio.wait_for(call, limit) if limit is not None else await call
        except TimeoutError:
            status, reason = "truncated", f"deadline of {limit}s exceeded while the agent ran"
        except Exception as e:  # noqa: BLE001 - the agent's crash is the episode's status, never a lost sample
            status = "infra_error" if infra_cause(e) is not None else "failed"
            reason = f"the agent raised {type(e).__name__}: {e}"
        fault = last_host_fault(session)
        if fault is not None and status in ("completed", "truncated", "failed"):
            # what the agent did last was meet the host's failure (it made no successful call after it): its outcome
            # (a crash, a give-up, the deadline spent on retries) is not the model's
            status, reason = "infra_error", f"{fault}, and the agent made no call after it ({reason or 'it returned'})"
        branches = gateway.close_session(session.id, status=status, reason=reason)
        if not branches:
            return [empty_trajectory(task, "failed" if status == "completed" else status,
                           reason or "the agent never called the model", metadata)]
        score = 0.0
        if status in self.scored_statuses and self.reward is not None:
            try:
                value = self.reward(task, result, branches)
                score = coerce_reward(await value if inspect.isawaitable(value) else value, "AgentEnv reward")
            except Exception as e:  # noqa: BLE001
                status = "infra_error" if infra_cause(e) is not None else "failed"
                reason = f"the reward raised {type(e).__name__}: {e}"
        # the branch of the last call holds the agent's final context: the sample's main trajectory
        last = max(range(len(branches)), key=lambda i: branches[i].metadata["calls"][-1]["at"]
                   if branches[i].metadata["calls"] else -1.0)
        order = [last] + [i for i in range(len(branches)) if i != last]
        out = []
        for k, i in enumerate(order):
            t = branches[i]
            st, why = (t.status, t.reason) if t.status == "failed" and status != "infra_error" else (status, reason)
            meta = {**t.metadata, **(metadata or {}), **({"branch_of": t.metadata["session"]} if k else {})}
            out.append(replace(t, reward=score, turn_rewards=[0.0] * max(len(t.turn_rewards) - 1, 0) + [score],
                               status=st, reason=why, metadata=meta))
        return split_episode_time(out)


    async def _call(self, url: str, key: str, task: Task) -> Any:
        if inspect.iscoroutinefunction(self.agent):
            return await self.agent(url, key, task)
        # a blocking program calls the gateway served by this event loop: it runs in a thread
        result = await asyncio.to_thread(self.agent, url, key, task)
        return await result if inspect.isawaitable(result) else result


class GatewayPool:
    """The started gateways `AgentEnv` episodes share, one per (parser, strict): `await get(env)`, `await close()`.
    `policy`, `renderer` and `options` (`Gateway`'s keywords) are the same for all; `strict` turns strict mode on
    whatever the env says."""

    def __init__(self, policy: Any, renderer: Any, *, strict: bool = False, **options: Any):
        self.policy, self.renderer, self.strict, self.options = policy, renderer, strict, options
        self._gateways: dict[tuple[str | None, bool], Any] = {}
        self._lock = asyncio.Lock()

    async def get(self, env: AgentEnv) -> Any:
        from slime_env.gateway import Gateway

        key = (env.parser, env.strict)
        async with self._lock:  # concurrent episodes start one gateway, not one each
            if key not in self._gateways:
                gw = Gateway(self.policy, self.renderer, env.parser, strict=env.strict or self.strict, **self.options)
                await gw.start()
                self._gateways[key] = gw
            return self._gateways[key]

    async def close(self) -> None:
        for gw in self._gateways.values():
            await gw.stop()
        self._gateways.clear()


def last_host_fault(session: Any) -> str | None:
    """The host fault (`AgentSession.host_faults`: the engine failing a call, the gateway stopping) that came after
    the session's last recorded call, else None (none, or the agent called the model successfully since)."""
    faults = getattr(session, "host_faults", None)
    if not faults:
        return None
    calls = [c["at"] for b in session.conversation.branches for c in b.calls]
    last_call = max(calls, default=float("-inf"))
    after = [what for at, what in faults if at >= last_call]
    return after[-1] if after else None


def split_episode_time(trajectories: list[Trajectory]) -> list[Trajectory]:
    """One episode's branches (the main trajectory first) with its wall time counted once: the gateway gives every
    branch the whole session's `total_s`, so summed over a batch an episode of three branches counted three times
    (and its generation share a third of the truth). A side branch keeps only its own generation time
    (`total_s = generate_s`); the main trajectory keeps the rest of the episode (never less than its own
    generation)."""
    if len(trajectories) < 2:
        return trajectories
    main, *sides = trajectories
    side_gen = sum(float(t.timings.get("generate_s", 0.0)) for t in sides)
    own = float(main.timings.get("generate_s", 0.0))
    total = max(own, float(main.timings.get("total_s", 0.0)) - side_gen)
    return [replace(main, timings={**main.timings, "total_s": total})] + [
        replace(t, timings={**t.timings, "total_s": float(t.timings.get("generate_s", 0.0))}) for t in sides]


def empty_trajectory(task: Task, status: str, reason: str, metadata: dict[str, Any] | None) -> Trajectory:
    """A trajectory with no tokens that records why an episode never ran (its status and reason)."""
    return Trajectory(task=task, prompt_ids=[], response_ids=[], loss_mask=[], rollout_logprobs=[], spans=[],
                      turn_rewards=[], reward=0.0, status=status, reason=reason, metadata=dict(metadata or {}))
