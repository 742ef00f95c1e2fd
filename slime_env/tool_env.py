"""`ToolEnv`: a multi-turn tool-use env from a list of functions (or MCP servers) and a rubric.

Each assistant turn the env's parser finds the tool calls; each call is validated against its
tool's schema, the calls of one turn run concurrently (at most `max_parallel_calls` at once), each
under its own timeout, and every result — value, exception, timeout, bad arguments, unknown tool —
comes back as a `tool` message carrying the call's id and the tool's name. A turn for which
`is_done` holds (by default: no tool call and no malformed one) ends the episode and is scored by
the rubric. `StatefulToolEnv` adds per-episode state handed to tools as hidden arguments.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from slime_env.env import Env, StepResult
from slime_env.errors import InvalidInput
from slime_env.tools import Tool, ToolArgumentError, ToolError, ToolOutput, as_tool
from slime_env.types import Action, Message, ParseError, Task, ToolCall, coerce_reward

DEFAULT_SYSTEM_PROMPT = ("You can call tools to help you. When you have the final answer, reply without a tool "
                         "call and put the answer in <answer></answer>.")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@runtime_checkable
class ToolSource(Protocol):
    """Tools that come from somewhere else (an MCP server): listed per episode.

    `episode_tools()` returns the tools for one episode and a coroutine function that releases what
    was opened for it (a per-episode connection), or None when nothing needs releasing.
    """

    async def episode_tools(self) -> tuple[list[Tool], Callable[[], Awaitable[None]] | None]: ...


@dataclass(frozen=True, slots=True)
class ToolRecord:
    """One tool call of an episode: what was asked, what came back, how it ended.

    `status`: "ok", "error" (the tool raised), "timeout", "invalid" (arguments did not match the
    schema) or "unknown" (no such tool). `data`: what the tool kept beside its text (`ToolOutput.data`).
    """

    turn: int
    id: str
    name: str
    arguments: Any
    status: str
    output: str
    latency_s: float
    data: Any = None

    def to_dict(self) -> dict[str, Any]:
        d = {"turn": self.turn, "id": self.id, "name": self.name, "arguments": self.arguments,
             "status": self.status, "output": self.output, "latency_s": self.latency_s}
        if self.data is not None:
            d["data"] = self.data
        return d


class Rubric:
    """A weighted sum of reward functions: `reward = Σ weight_i · fn_i(...)`.

    Each function (plain or async) is called with the keyword arguments it names among `task`,
    `label`, `answer` (the final assistant text), `messages` (the conversation), `tool_calls`
    (`ToolRecord`s), `state` and `info`, or all of them if it takes `**kwargs`; it returns a number.
    `score(context)` returns the reward and each function's unweighted score by name.
    """

    CONTEXT = ("task", "label", "answer", "messages", "tool_calls", "state", "info")

    def __init__(self, *funcs: Callable[..., Any] | tuple[Callable[..., Any], float],
                 weights: Sequence[float] | None = None):
        pairs = [f if isinstance(f, tuple) else (f, None) for f in funcs]
        if weights is not None:
            if len(weights) != len(pairs):
                raise InvalidInput(f"Rubric: {len(pairs)} functions but {len(weights)} weights")
            pairs = [(fn, w) for (fn, _), w in zip(pairs, weights)]
        self.funcs: list[tuple[str, Callable[..., Any], float, tuple[str, ...] | None]] = []
        for fn, weight in pairs:
            if not callable(fn):
                raise InvalidInput(f"Rubric: {fn!r} is not callable")
            name = getattr(fn, "__name__", type(fn).__name__)
            while any(name == n for n, *_ in self.funcs):
                name += "_"
            self.funcs.append((name, fn, 1.0 if weight is None else float(weight), _wanted(fn, self.CONTEXT)))

    async def score(self, context: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
        total, scores = 0.0, {}
        for name, fn, weight, wanted in self.funcs:
            kwargs = dict(context) if wanted is None else {k: context.get(k) for k in wanted}
            value = fn(**kwargs)
            if inspect.isawaitable(value):
                value = await value
            scores[name] = coerce_reward(value, f"reward function {name!r}")
            total += weight * scores[name]
        return total, scores


def _wanted(fn: Callable[..., Any], known: Sequence[str]) -> tuple[str, ...] | None:
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    unknown = [n for n, p in params.items() if n not in known and p.default is p.empty
               and p.kind not in (p.VAR_POSITIONAL,)]
    if unknown:
        raise InvalidInput(f"reward function {getattr(fn, '__name__', fn)!r} asks for {unknown}; "
                           f"it can ask for {list(known)}")
    return tuple(n for n in params if n in known)


def final_answer(text: str) -> str | None:
    """The text inside the last `<answer>...</answer>` of `text`, stripped; None without one."""
    found = _ANSWER.findall(text or "")
    return found[-1].strip() if found else None


def exact_answer(answer: str, label: Any) -> float:
    """1.0 when the `<answer>` equals the label (case- and space-insensitive; numbers compared as numbers)."""
    got = final_answer(answer)
    if got is None or label is None:
        return 0.0
    labels = label if isinstance(label, (list, tuple)) else [label]
    return float(any(_same(got, str(want)) for want in labels))


def answer_format(answer: str) -> float:
    """1.0 when the final turn holds exactly one non-empty `<answer>...</answer>`."""
    found = _ANSWER.findall(answer or "")
    return float(len(found) == 1 and bool(found[0].strip()))


def _same(got: str, want: str) -> bool:
    norm = lambda s: " ".join(s.lower().replace(",", "").split()).rstrip(".")  # noqa: E731
    a, b = norm(got), norm(want)
    if a == b:
        return True
    try:
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
    except ValueError:
        return False


class ToolEnv(Env):
    """A tool-use env: `ToolEnv(tools=[fn, ...], rubric=Rubric(...))`, or subclass it.

    `tools`: functions (schemas from their signatures and docstrings), `Tool`s, or `ToolSource`s (MCP),
    resolved per episode at `reset`. `system_prompt` is put before the task prompt (None: none; the
    default asks for `<answer>`). `rubric` (a `Rubric` or one reward function) scores the final turn.
    `max_turns` truncates the episode (None: the runner's limit). `tool_timeout_s` bounds each call
    (a tool's own `timeout_s` wins); `max_output_chars` cuts long results.
    Hooks to override: `is_done`, `is_truncated`, `finish`, `turn_reward`, `no_tool_message`, `format_result`,
    `tool_message`, `unknown_tool_message`, `setup_state` / `cleanup_state`.
    `info` of every step carries `tool_calls` (this episode's count) and `tool_stats` (per tool: calls,
    errors, timeouts, invalid, latency_s); the final step adds `rubric` (each function's score).
    With a chat template that renders no tools (SmolLM2's), the runner writes the tools into the system message
    in the parser's own format (`slime_env.parsers.prompts`); `describe_tools = False` leaves that to the env.
    """

    parser = "hermes"
    describe_tools = True

    def __init__(self, tools: Sequence[Callable[..., Any] | Tool | ToolSource] = (), *,
                 system_prompt: str | None = DEFAULT_SYSTEM_PROMPT, rubric: Rubric | Callable[..., Any] | None = None,
                 parser: str | None = None, max_turns: int | None = None, tool_timeout_s: float = 30.0,
                 max_parallel_calls: int = 8, max_output_chars: int = 8000, tasks: Any = None,
                 hidden_args: Sequence[str] = ()):
        if max_parallel_calls < 1 or tool_timeout_s <= 0 or max_output_chars < 16:
            raise InvalidInput("ToolEnv: max_parallel_calls >= 1, tool_timeout_s > 0 and max_output_chars >= 16 "
                               f"are required, got {max_parallel_calls}, {tool_timeout_s}, {max_output_chars}")
        self.set_tasks(tasks)
        if parser is not None:
            self.parser = parser
        self.system_prompt = system_prompt
        self.rubric = rubric if isinstance(rubric, Rubric) or rubric is None else Rubric(rubric)
        self.max_turns, self.tool_timeout_s = max_turns, tool_timeout_s
        self.max_parallel_calls, self.max_output_chars = max_parallel_calls, max_output_chars
        self._sources = [t for t in tools if isinstance(t, ToolSource) and not isinstance(t, Tool)]
        self._local = [as_tool(t, hidden=hidden_args) for t in tools if t not in self._sources]
        self._set_tools(self._local)
        self.state: dict[str, Any] = {}
        self.task: Task | None = None
        self.turn = 0
        self.history: list[Message] = []
        self.tool_history: list[ToolRecord] = []
        self._stats: dict[str, dict[str, float]] = {}
        self._releases: list[Callable[[], Awaitable[None]]] = []
        self._state_open = False

    # --- episode ----------------------------------------------------------------------------------
    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        await self._release()
        self.task = self.task_from(options, seed)
        self.turn, self.tool_history, self._stats = 0, [], {}
        info: dict[str, Any] = {}
        if self._sources:
            tools = list(self._local)
            for source in self._sources:
                listed, release = await source.episode_tools()
                if release is not None:
                    self._releases.append(release)
                tools += listed
                # tools a source lists but cannot offer (an MCP tool that needs task-augmented calls): name -> why
                info.setdefault("skipped_tools", {}).update(getattr(source, "skipped_tools", None) or {})
            self._set_tools(tools)
        self.state = dict(await self.setup_state(self.task) or {})
        self._state_open = True
        self.history = self.task.messages(system=self.system_prompt)
        return list(self.history), {k: v for k, v in info.items() if v}

    async def step(self, action: Action) -> StepResult:
        if self.task is None:
            raise RuntimeError(f"{type(self).__name__}.step called before reset")
        self.turn += 1
        self.history.append(Message("assistant", action.text))
        if self.is_done(action):
            obs, reward, terminated, truncated, info = await self.finish(action)
            return obs, reward + self.turn_reward(action), terminated, truncated, info
        obs = await self.run_tools(action)
        if not obs:
            obs = [self.no_tool_message()]
        self.history.extend(obs)
        return obs, self.turn_reward(action), False, self.is_truncated(), self.step_info()

    async def close(self) -> None:
        await self._release()

    # --- hooks ------------------------------------------------------------------------------------
    def is_done(self, action: Action) -> bool:
        """Whether this turn is the final answer (default: it has no tool call, well-formed or not)."""
        return not action.tool_calls and not action.parse_errors

    def is_truncated(self) -> bool:
        """Whether the episode is cut after this (non-final) turn (default: `max_turns` reached)."""
        return self.max_turns is not None and self.turn >= self.max_turns

    async def finish(self, action: Action) -> StepResult:
        """The final step: the rubric's reward, `terminated`."""
        info = self.step_info()
        reward = 0.0
        if self.rubric is not None:
            reward, info["rubric"] = await self.rubric.score(self.reward_context(action, info))
        return [], reward, True, False, info

    def reward_context(self, action: Action, info: Mapping[str, Any]) -> dict[str, Any]:
        assert self.task is not None
        return {"task": self.task, "label": self.task.label, "answer": action.text, "messages": list(self.history),
                "tool_calls": list(self.tool_history), "state": self.state, "info": info}

    def turn_reward(self, action: Action) -> float:
        """A reward for every turn, added to the step's (default 0)."""
        return 0.0

    def no_tool_message(self) -> Message:
        """The observation after a turn that is neither done nor has a tool call (custom `is_done`)."""
        return Message("user", f"Call one of the tools ({', '.join(self.tool_names)}) or give your final answer.")

    def unknown_tool_message(self, name: str) -> str:
        return f"error: unknown tool {name!r}; the tools are: {', '.join(self.tool_names)}"

    def format_result(self, result: Any) -> str:
        """A tool's return value as the text the model reads (strings as they are, the rest as JSON)."""
        if isinstance(result, str):
            return result
        if result is None:
            return "(no output)"
        try:
            return json.dumps(result, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            return str(result)

    def tool_message(self, record: ToolRecord) -> Message:
        """The observation for one call: a `tool` message with the call's id and the tool's name."""
        return Message("tool", record.output, name=record.name, tool_call_id=record.id)

    def parse_error_message(self, error: ParseError) -> Message:
        return Message("tool", f"error: {error.message}")

    async def setup_state(self, task: Task) -> Mapping[str, Any] | None:
        """Per-episode state (a sandbox session, a database connection), kept in `self.state`."""
        return None

    async def cleanup_state(self, state: dict[str, Any]) -> None:
        """Release what `setup_state` opened; called at `close()` and before the next `reset`."""
        return None

    # --- tools ------------------------------------------------------------------------------------
    @property
    def tool_names(self) -> list[str]:
        return list(self._by_name)

    def step_info(self) -> dict[str, Any]:
        return {"tool_calls": len(self.tool_history), "tool_stats": {k: dict(v) for k, v in self._stats.items()}}

    async def run_tools(self, action: Action) -> list[Message]:
        """Run the turn's calls concurrently; their messages in call order, then one per malformed call."""
        gate = asyncio.Semaphore(self.max_parallel_calls)
        records = await asyncio.gather(*(self._call(call, i, gate) for i, call in enumerate(action.tool_calls)))
        self.tool_history.extend(records)
        return [self.tool_message(r) for r in records] + [self.parse_error_message(e) for e in action.parse_errors]

    async def _call(self, call: ToolCall, index: int, gate: asyncio.Semaphore) -> ToolRecord:
        call_id = call.id or f"call_{self.turn}_{index}"
        tool = self._by_name.get(call.name)
        if tool is None:
            return self._record(call, call_id, "unknown", self.unknown_tool_message(call.name), 0.0)
        try:
            arguments = tool.validate(call.arguments)
        except ToolArgumentError as e:
            return self._record(call, call_id, "invalid", f"error: {e}", 0.0)
        timeout = tool.timeout_s if tool.timeout_s is not None else self.tool_timeout_s
        data = None
        async with gate:
            t0 = time.perf_counter()
            try:
                async with asyncio.timeout(timeout):
                    result = await tool.call(arguments, self.state)
                if isinstance(result, ToolOutput):
                    status, text, data = "ok", result.text, result.data
                else:
                    status, text = "ok", self.format_result(result)
            except TimeoutError:
                status, text = "timeout", f"error: {call.name} timed out after {timeout:g}s"
            except ToolError as e:
                status, text = "error", f"error: {e}"
            except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation
                status, text = "error", f"error: {call.name} raised {type(e).__name__}: {e}"
            latency = time.perf_counter() - t0
        return self._record(call, call_id, status, text, latency, data)

    def _record(self, call: ToolCall, call_id: str, status: str, text: str, latency: float,
                data: Any = None) -> ToolRecord:
        if len(text) > self.max_output_chars:
            # the head and the tail: how a command ended (a shell's exit code, "the output was too long") is last
            tail = min(1000, self.max_output_chars // 4)
            head = self.max_output_chars - tail
            cut = len(text) - head - tail
            text = f"{text[:head]}\n[... {cut} characters cut ...]\n{text[-tail:]}" if tail else text[:head]
        key = call.name if call.name in self._by_name else "unknown_tool"  # model-chosen names stay bounded
        s = self._stats.setdefault(key, {"calls": 0, "errors": 0, "timeouts": 0, "invalid": 0, "latency_s": 0.0})
        s["calls"] += 1
        s["errors"] += status in ("error", "unknown")
        s["timeouts"] += status == "timeout"
        s["invalid"] += status == "invalid"
        s["latency_s"] += latency
        return ToolRecord(self.turn, call_id, call.name, call.arguments, status, text, latency, data)

    def _set_tools(self, tools: Sequence[Tool]) -> None:
        by_name: dict[str, Tool] = {}
        for t in tools:
            if t.name in by_name:
                raise InvalidInput(f"{type(self).__name__}: two tools are named {t.name!r}")
            by_name[t.name] = t
        self._by_name = by_name
        self.tools = tuple(t.schema for t in tools) or None

    async def _release(self) -> None:
        releases, self._releases = self._releases, []
        errors = []
        if self._state_open:
            self._state_open = False
            try:
                await self.cleanup_state(self.state)
            except Exception as e:  # noqa: BLE001 - release the rest first
                errors.append(e)
        for release in releases:
            try:
                await release()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]


class StatefulToolEnv(ToolEnv):
    """A `ToolEnv` whose tools get per-episode state as hidden arguments.

    Parameters named in `hidden_args` are left out of the schemas the model sees; `setup_state(task)`
    returns them (e.g. `{"db": connection}`) at every `reset` and each call receives `self.state[name]`;
    `cleanup_state(state)` releases them at `close()` (and before the next `reset`), also after a failure.
    """

    def __init__(self, tools: Sequence[Callable[..., Any] | Tool | ToolSource] = (), *,
                 hidden_args: Sequence[str] = (), **kwargs: Any):
        if not hidden_args:
            raise InvalidInput("StatefulToolEnv needs hidden_args (the names setup_state provides)")
        self.hidden_args = tuple(hidden_args)
        super().__init__(tools, hidden_args=self.hidden_args, **kwargs)

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        out = await super().reset(seed=seed, options=options)
        needed = {h for t in self._by_name.values() for h in t.hidden}
        missing = sorted(needed - set(self.state))
        if missing:
            await self._release()
            raise InvalidInput(f"{type(self).__name__}.setup_state did not provide {missing} "
                               f"(hidden arguments of its tools)")
        return out


__all__ = ["Rubric", "StatefulToolEnv", "ToolEnv", "ToolRecord", "ToolSource", "answer_format", "exact_answer",
           "final_answer"]
