"""Renderers for the model families people train, with each family's quirks stated explicitly.

All of them bridge through the chat template exactly like `TemplateRenderer`; what a family adds is
what it must know beyond the template: its stop tokens and the ways its template re-renders
earlier turns (`rewrites_history`), which strict mode records or raises on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from slime_env.renderers.template import TemplateRenderer
from slime_env.types import Message


def _ids(tokenizer: Any, *tokens: str) -> list[int]:
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in tokens if t in vocab]


class ChatMLRenderer(TemplateRenderer):
    """ChatML: Qwen2.5 (and Qwen2), SmolLM2, and other `<|im_start|>role ... <|im_end|>` templates.

    Prefix-stable: a full render of the conversation equals the ledger token for token, so strict
    mode raises on any difference. Turns end with `<|im_end|>`; `<|endoftext|>` also stops.
    """

    family = "chatml"

    def _default_stop_ids(self) -> list[int]:
        return _ids(self.tokenizer, "<|im_end|>", "<|endoftext|>")


class Qwen3Renderer(TemplateRenderer):
    """Qwen3 hybrid thinking (the original Qwen3 release template).

    Qwen3's template is not prefix-stable. When the history is rendered again it (1) removes the
    `<think>` block of assistant turns that precede the last user query and (2) removes the empty
    `<think>\\n\\n</think>\\n\\n` the generation prompt inserts when `enable_thinking=False`.
    The ledger keeps what was generated and what the model saw when it generated it — the tokens
    the policy's log-probs belong to — which is also what the engine's prefix cache holds. Strict
    mode records each rewrite in the trajectory (`on_history_rewrite="keep"`) or raises ("error").
    `enable_thinking` is passed to the template on every render.
    """

    family = "qwen3"
    rewrites_history = ("drops <think> blocks of assistant turns before the last user query",
                        "drops the empty <think></think> the generation prompt adds when enable_thinking=False")

    def __init__(self, tokenizer: Any, *, enable_thinking: bool = True,
                 template_kwargs: Mapping[str, Any] | None = None, **kw: Any):
        super().__init__(tokenizer, template_kwargs={"enable_thinking": enable_thinking, **(template_kwargs or {})},
                         **kw)
        self.enable_thinking = enable_thinking

    def _default_stop_ids(self) -> list[int]:
        return _ids(self.tokenizer, "<|im_end|>", "<|endoftext|>")


class Llama3Renderer(TemplateRenderer):
    """Llama 3.1 / 3.2 / 3.3 instruct templates (`<|start_header_id|>role<|end_header_id|>`).

    The template `| trim`s every message's content, so a generated turn that starts or ends with
    whitespace renders differently once it is history; the ledger keeps the generated tokens.
    A tool result string is rendered through `tojson` (quoted) by the template itself. Turns end
    with `<|eot_id|>`; `<|eom_id|>` (tool call in ipython mode) and `<|end_of_text|>` also stop.
    Llama 3.2's template writes today's date unless `template_kwargs={"date_string": ...}`.
    """

    family = "llama3"
    rewrites_history = ("trims whitespace around every message's content",)

    def _default_stop_ids(self) -> list[int]:
        return _ids(self.tokenizer, "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


class DeepSeekR1Renderer(TemplateRenderer):
    """DeepSeek-R1 (V3 tokenizer). Every assistant turn is re-rendered as the text after its last
    `</think>`, and all system messages are hoisted to the start, so only the ledger keeps the
    reasoning the model generated. After tool outputs the template adds no generation prompt."""

    family = "deepseek_r1"
    rewrites_history = ("keeps only the text after </think> of every assistant turn",
                        "moves all system messages to the start")
    hoists_system = True

    def _base(self, history: Sequence[Message]) -> tuple[tuple[str, str], ...]:
        # The template opens `<｜tool▁outputs▁begin｜>` only before the first tool output of the whole
        # conversation, so once the history has one, the bridge is rendered after a base that has one too.
        base = super()._base(history)
        return (*base, ("assistant", "A"), ("tool", "T")) if any(m.role == "tool" for m in history) else base


class Qwen35Renderer(Qwen3Renderer):
    """Qwen3.5 (hybrid thinking, Qwen3-Coder-style XML tool calls: `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV
    \\n</parameter>\\n</function>\\n</tool_call>`). Its generation prompt opens `<think>\\n`
    (`<think>\\n\\n</think>\\n\\n` with `enable_thinking=False`). Re-rendered history: reasoning of turns before the
    last user query is dropped, every message's content is `| trim`-med, and a non-string tool-call argument is written
    with Python's `str` unless it is a mapping or a list (`True`, `None`, `1.5`), where Qwen3.6 writes JSON (`true`,
    `null`). A system message anywhere but first is refused by the template itself ("System message must be at the
    beginning.")."""

    family = "qwen3_5"
    rewrites_history = ("drops <think> blocks of assistant turns before the last user query",
                        "trims whitespace around every message's content",
                        "drops the empty <think></think> the generation prompt adds when enable_thinking=False")


class Qwen36Renderer(Qwen35Renderer):
    """Qwen3.6: Qwen3.5's template with tool-call arguments written as JSON (`true`, `null`) and reasoning of earlier
    turns kept when `template_kwargs={"preserve_thinking": True}`."""

    family = "qwen3_6"


class DeepSeekV31Renderer(TemplateRenderer):
    """DeepSeek-V3.1 (V3 tokenizer). `enable_thinking` is the template's `thinking` switch: the generation prompt is
    `<｜Assistant｜><think>` with it, `<｜Assistant｜></think>` without. Tool calls:
    `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`, ARGS
    the arguments string as given (the template concatenates it). After tool outputs the template adds no generation
    prompt: the model answers right after `<｜tool▁output▁end｜>`. History: every assistant turn keeps only the text
    after its first `</think>`, and system messages are hoisted to the front (refused after the first turn)."""

    family = "deepseek_v31"
    rewrites_history = ("keeps only the text after the first </think> of earlier assistant turns",
                        "moves all system messages to the start")
    hoists_system = True

    def __init__(self, tokenizer: Any, *, enable_thinking: bool = False,
                 template_kwargs: Mapping[str, Any] | None = None, **kw: Any):
        super().__init__(tokenizer, template_kwargs={"thinking": enable_thinking, **(template_kwargs or {})}, **kw)
        self.enable_thinking = enable_thinking

    def _default_stop_ids(self) -> list[int]:
        return _ids(self.tokenizer, "<｜end▁of▁sentence｜>")


class GLM45Renderer(TemplateRenderer):
    """GLM-4.5 / 4.6 (`[gMASK]<sop>`, `<|system|>`, `<|user|>`, `<|assistant|>`, `<|observation|>`). A turn has no
    end-of-turn token: the model stops on the next header (`<|user|>` or `<|observation|>`), which the bridge then
    does not write again; `conversation_trajectory` trains that header as the turn's last token. History: reasoning is
    kept only after the last user message (earlier turns get an empty `<think></think>`), content is `strip()`-ped."""

    family = "glm45"
    rewrites_history = ("drops reasoning of turns before the last user message (writes <think></think>)",
                        "strips whitespace around assistant content")
    stop_closes_turn = True
    call_parser = "glm45"

    def _default_stop_ids(self) -> list[int]:
        return _ids(self.tokenizer, "<|user|>", "<|observation|>", "<|endoftext|>")


class MiniMaxM2Renderer(TemplateRenderer):
    """MiniMax-M2 (`]~!b[]~b]system`, `]~b]user`, `]~b]ai`, `]~b]tool`; turns end with `[e~[`). Tool calls are
    `<minimax:tool_call>\\n<invoke name="NAME"><parameter name="K">V</parameter>…</invoke>\\n</minimax:tool_call>`;
    the template refuses a tool message unless the assistant turn before it carries `tool_calls`, so the bridge gives
    the sentinel turn the calls parsed from the generated turn. Reasoning is kept only after the last user message;
    a default system prompt is written when there is none."""

    family = "minimax_m2"
    rewrites_history = ("drops reasoning of turns before the last user message",
                        "strips newlines around reasoning and content")
    tool_calls_end = "</minimax:tool_call>"
    call_parser = "minimax_m2"

    def _default_stop_ids(self) -> list[int]:
        return _ids(self.tokenizer, "[e~[")


class GptOssRenderer(TemplateRenderer):
    """gpt-oss (harmony). The generation prompt is `<|start|>assistant`; the model writes channels (`analysis`,
    `commentary to=functions.NAME`, `final`) and stops on `<|return|>` (an answer) or `<|call|>` (a tool call). The
    template renders history differently from what was generated: a final answer ends with `<|end|>` (the bridge does
    not add it after `<|return|>`), analysis is dropped once a final answer follows, a call is written
    `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>`, and a tool result
    `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>"…"<|end|>` (JSON-quoted). Reasoning is the
    message's `thinking`; a system message anywhere but first is dropped by the template, so it is refused."""

    family = "gpt_oss"
    rewrites_history = ("drops analysis (reasoning) once a final answer follows",
                        "renders a final answer generated with <|return|> with <|end|>",
                        "moves the recipient of a call into the header (<|start|>assistant to=functions.NAME)")
    tool_calls_end = "<|call|>"
    call_parser = "gpt_oss"
    stop_closes_turn = True
    closing_tokens = ("<|end|>",)
    drops_late_system = True
    reasoning_key = "thinking"

    def _default_stop_ids(self) -> list[int]:
        return _ids(self.tokenizer, "<|return|>", "<|call|>")

    def _structured(self, d: dict) -> dict:
        text = d.get("content") or ""
        if "<|channel|>" not in text:
            return d
        from slime_env.parsers.families import harmony_messages

        analysis, final, calls = harmony_messages(text)
        out: dict[str, Any] = {"role": "assistant", "content": final}
        if analysis:
            out["thinking"] = analysis
        if calls:
            out["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
            if not final:
                out.pop("content")
        return out
