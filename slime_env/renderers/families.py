"""Renderers for the model families people train, with each family's quirks stated explicitly.

All of them bridge through the chat template exactly like `TemplateRenderer`; what a family adds is
what it must know beyond the template: its stop tokens and the ways its template re-renders
earlier turns (`rewrites_history`), which strict mode records or raises on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from slime_env.renderers.template import _BASE, TemplateRenderer
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

    def _base(self, history: Sequence[Message]) -> tuple[tuple[str, str], ...]:
        # The template opens `<｜tool▁outputs▁begin｜>` only before the first tool output of the whole
        # conversation, so once the history has one, the bridge is rendered after a base that has one too.
        if any(m.role == "tool" for m in history):
            return (*_BASE, ("assistant", "A"), ("tool", "T"))
        return _BASE
