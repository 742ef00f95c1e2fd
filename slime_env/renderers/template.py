"""The generic renderer: bridges the token ledger using any Hugging Face chat template.

How a bridge is computed (never re-rendering history): the template renders a small fixed base
conversation, then an assistant turn whose content is a sentinel, then the new messages with the
generation prompt. Everything after the sentinel is what the template writes between an assistant
turn's content and the next generation: the turn's close (e.g. `<|im_end|>\\n`), the observation
messages, and the generation prompt. Its cost does not grow with the history.

Strict mode checks each bridge against the real conversation (see `check_bridge` / `check_full`)
and raises `RenderMismatch` naming the first differing token.
"""

from __future__ import annotations

import json
import re
import secrets
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jinja2

from slime_env.errors import InvalidInput, RenderError, RenderMismatch
from slime_env.renderers.jinja import compile_template
from slime_env.token_codec import TokenCodec
from slime_env.types import Message

# Private-use code points: no tokenizer merges them with template text and no template edits them.
SENTINEL = "\ue000slime_env_assistant\ue001"
_BASE = (("system", "S"), ("user", "U"))

HistoryPolicy = Literal["keep", "error"]
SpecialText = Literal["plain", "control"]


@dataclass
class VerifiedPrefix:
    """What strict mode has proved of one ledger: `text`, a prefix of its last full render that ends right before a
    special token, encodes to the ledger's first `ids` ids (or decodes from them, for a non-canonical tokenization
    the policy sampled). The ledger only grows, so a later full render that starts with `text` needs only its rest
    encoded and compared: Hugging Face tokenizers cut the text at added tokens before anything else, so no id spans
    such a cut. This keeps strict mode's per-turn cost flat in the episode's length (one state per ledger)."""

    text: str = ""
    ids: int = 0


class TemplateRenderer:
    """Turns chat messages into token ids for one model family.

    `render_prompt` renders the first prompt; `bridge(generated_ids, messages)` returns the ids
    to insert after a generated turn (close of that turn, the observation messages, the next
    generation prompt). `rewrites_history` lists the ways this template re-renders earlier turns
    differently from how they were generated; the ledger always keeps what was generated.
    In strict mode (`check_*`), such a rewrite is recorded (`on_history_rewrite="keep"`) or raised
    (`"error"`); any other difference from a full render always raises `RenderMismatch`.
    """

    family = "template"
    rewrites_history: tuple[str, ...] = ()
    #: Templates that render a tool message only after an assistant turn that *carries* `tool_calls` (MiniMax-M2,
    #: gpt-oss, Kimi-K2 number or name the results after the calls): the text that ends the rendered calls. The bridge
    #: then gives the sentinel turn the calls parsed from the generated turn (`call_parser`) and starts after it.
    tool_calls_end: str | None = None
    #: The family's tool-call parser (a name in `slime_env.parsers`): reads the calls of a generated turn for
    #: `tool_calls_end` templates and for strict mode's structured history (`template_messages`).
    call_parser: str | None = None
    #: A turn that ended on any stop token is closed: the bridge drops a first id that closes it again (gpt-oss
    #: generates `<|return|>` or `<|call|>` where the template writes `<|end|>`; GLM stops on the next header).
    stop_closes_turn: bool = False
    #: With `stop_closes_turn`: tokens the template closes a turn with that a turn ended on a stop token must not get
    #: (gpt-oss: `<|end|>` after a generated `<|return|>`).
    closing_tokens: tuple[str, ...] = ()
    #: The template moves every system message to the front (DeepSeek): a system message after the first turn
    #: cannot be bridged, and `conversation_trajectory` hoists it as a declared history rewrite.
    hoists_system: bool = False
    #: The template renders only `messages[0]` as a system message and silently drops any later one (gpt-oss): such
    #: a message is refused, in a bridge and in `conversation_trajectory`, instead of being lost.
    drops_late_system: bool = False
    #: The key the template reads an assistant turn's reasoning from (`conversation_trajectory` moves `thinking` /
    #: `reasoning_content` there, whichever the data used).
    reasoning_key: str = "reasoning_content"
    #: Whether messages may hold images (`slime_env.renderers.vision`); a text renderer refuses them by name.
    renders_images: bool = False

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None,
                 template_kwargs: Mapping[str, Any] | None = None,
                 stop_token_ids: Sequence[int] | None = None, strict: bool = False,
                 on_history_rewrite: HistoryPolicy = "keep", cache_size: int = 4096,
                 special_text: SpecialText = "plain"):
        source = chat_template or getattr(tokenizer, "chat_template", None)
        if not isinstance(source, str) or not source:
            raise InvalidInput("tokenizer has no chat_template; pass chat_template=")
        if on_history_rewrite not in ("keep", "error"):
            raise InvalidInput(f"on_history_rewrite must be 'keep' or 'error', got {on_history_rewrite!r}")
        if special_text not in ("plain", "control"):
            raise InvalidInput(f"special_text must be 'plain' or 'control', got {special_text!r}")
        # Special-token text inside a message the policy did not generate (a tool's output, an env's or a dataset's
        # message, a mid-turn insert): "plain" encodes it as the characters it is, so a file the agent reads cannot
        # open or close a turn in the ledger; "control" encodes it as the control tokens it spells, as a tokenizer
        # given the whole rendered text does.
        self.special_text = special_text
        self._marker = f"SLIMEENV{secrets.token_hex(8)}Q"  # unguessable: text cannot pose as a guarded token
        self.tokenizer = tokenizer
        self.strict = strict
        self.on_history_rewrite = on_history_rewrite
        self._source = source
        self._template = compile_template(source)
        self._codec = TokenCodec(tokenizer)
        special = {k: v for k, v in getattr(tokenizer, "special_tokens_map", {}).items() if isinstance(v, str)}
        self._kwargs = {**special, **dict(template_kwargs or {})}
        self._cache: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()
        self._cache_size = cache_size

        close = self._after_sentinel([], add_generation_prompt=False)
        close_ids = self.encode(close)
        specials = set(getattr(tokenizer, "all_special_ids", ()))
        added = getattr(tokenizer, "added_tokens_decoder", None)
        if isinstance(added, Mapping):  # control tokens the tokenizer does not name as its bos/eos/pad (Kimi's)
            specials |= {i for i, t in added.items() if getattr(t, "special", False)}
        # The end-of-turn token: the close starts with it (`<|im_end|>`, `<|eot_id|>`, ...). A generation
        # that already ends with it must not get a second copy.
        self.end_of_turn_id: int | None = close_ids[0] if close_ids and close_ids[0] in specials else None
        stops = list(stop_token_ids) if stop_token_ids is not None else self._default_stop_ids()
        if self.end_of_turn_id is not None and self.end_of_turn_id not in stops:
            stops.insert(0, self.end_of_turn_id)
        self.stop_token_ids: tuple[int, ...] = tuple(stops)

    def __getstate__(self) -> dict[str, Any]:
        # A compiled Jinja template cannot be pickled: it is compiled again on the other side (rollout
        # worker processes get their renderer this way).
        state = self.__dict__.copy()
        del state["_template"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._template = compile_template(self._source)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template writes a `tools` list into the prompt (SmolLM2's, for one, does not)."""
        if not hasattr(self, "_renders_tools"):
            probe = [{"role": "user", "content": "hi"}]
            tool = {"type": "function", "function": {"name": "probe_tool_7f3a", "description": "", "parameters": {}}}
            try:
                self._renders_tools = "probe_tool_7f3a" in self._render(probe, tools=[tool], add_generation_prompt=True)
            except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
                self._renders_tools = False
        return self._renders_tools

    @property
    def renders_tool_calls(self) -> bool:
        """Whether the chat template writes an assistant message's structured `tool_calls` (SmolLM2's does not)."""
        if not hasattr(self, "_renders_tool_calls"):
            call = {"id": "call_0", "type": "function", "function": {"name": "probe_call_7f3a", "arguments": {}}}
            probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
            try:
                self._renders_tool_calls = "probe_call_7f3a" in self._render(probe, tools=None,
                                                                             add_generation_prompt=False)
            except Exception:  # noqa: BLE001 - a template that fails on tool calls does not render them
                self._renders_tool_calls = False
        return self._renders_tool_calls

    # --- rendering -------------------------------------------------------------------------------
    def render_text(self, messages: Sequence[Message | Mapping[str, Any]], *, tools: Sequence[Mapping] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The template's text for a whole conversation (used for the first prompt and strict checks)."""
        return self._render(self.template_messages(messages), tools=tools, add_generation_prompt=add_generation_prompt)

    def render_prompt(self, messages: Sequence[Message], *, tools: Sequence[Mapping] | None = None) -> list[int]:
        """Token ids of the first prompt, ending with the generation prompt (cached: the n samples of a
        group, and repeated system prompts, render once)."""
        try:
            key = ("prompt", tuple(messages), json.dumps(tools, sort_keys=True) if tools else None)
            hash(key)
        except (TypeError, ValueError):
            key = None  # tools that JSON cannot hold, messages that cannot be hashed: no caching
        ids = self._cache.get(key) if key is not None else None
        if ids is None:
            ids = tuple(self._encode_guarded(self._render(self._guard(self.template_messages(messages)), tools=tools,
                                                          add_generation_prompt=True)))
            if key is not None:
                self._remember(key, ids)
        else:
            self._cache.move_to_end(key)
        return list(ids)

    def bridge(self, generated_ids: Sequence[int], messages: Sequence[Message],
               history: Sequence[Message] = ()) -> list[int]:
        """Ids to append after a generated turn so the next generation can start.

        `history` is the conversation so far; only families whose template renders a message
        differently depending on earlier ones look at it (`_base`). A single `assistant` message is
        spliced into the ongoing assistant turn verbatim (no close, no header): this is how
        Search-R1-style envs insert `<information>` mid-turn.
        """
        if len(messages) == 1 and messages[0].role == "assistant":
            return self._encode_inserted(messages[0].content)
        if any(m.role == "assistant" for m in messages):
            raise InvalidInput("an observation may hold one 'assistant' message (a mid-turn insert) "
                               "or none, not assistant messages mixed with others")
        if self.hoists_system or self.drops_late_system:
            at = next((i for i, m in enumerate(messages) if m.role == "system"), None)
            if at is not None:
                what = "moves every system message to the front of the conversation" if self.hoists_system else \
                    "renders only a first system message and drops any later one"
                raise InvalidInput(f"observation message {at} is a system message: the {self.family} template "
                                   f"{what}, so it cannot follow a generated turn (send it as a user message, or put "
                                   "it in the first prompt)")
        self._check_images(messages)
        base = self._base(history)
        calls = self._sentinel_calls(generated_ids, messages, history)
        key = (base, calls, *((m.role, m.content, m.name, m.tool_call_id) for m in messages))
        ids = self._cache.get(key)
        if ids is None:
            ids = tuple(self._encode_guarded(self._after_sentinel(self._guard([m.to_dict() for m in messages]),
                                                                  base=base, calls=calls)))
            self._remember(key, ids)
        else:
            self._cache.move_to_end(key)
        return self._dedupe_end_of_turn(generated_ids, ids)

    def template_messages(self, messages: Sequence[Message | Mapping[str, Any]]) -> list[dict]:
        """`messages` as the chat template takes them. For families with a `call_parser`, a generated assistant turn
        (text) whose calls the parser reads becomes `content` + structured `tool_calls`: the form the template renders
        back into the call format, and the one its tool messages need."""
        self._check_images(messages)
        dicts = [m.to_dict() if isinstance(m, Message) else dict(m) for m in messages]
        if self.call_parser is None:
            return dicts
        return [self._structured(d) if d.get("role") == "assistant" and not d.get("tool_calls") else d
                for d in dicts]

    def _structured(self, d: dict) -> dict:
        from slime_env.parsers import get_parser

        result = get_parser(self.call_parser)(d.get("content") or "")
        if not result.tool_calls:
            return d
        calls = [{"id": c.id or "", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in result.tool_calls]
        return {**d, "content": result.content or "", "tool_calls": calls}

    def _check_images(self, messages: Sequence[Message | Mapping[str, Any]]) -> None:
        if not self.renders_images:
            at = next((i for i, m in enumerate(messages) if isinstance(m, Message) and m.images), None)
            if at is not None:
                raise InvalidInput(f"message {at} holds an image, but the {self.family} renderer renders text only: "
                                   "use a vision renderer (slime_env.renderers.vision) with the model's processor")

    def _sentinel_calls(self, generated_ids: Sequence[int], messages: Sequence[Message],
                        history: Sequence[Message]) -> tuple[tuple[str, str], ...] | None:
        """(name, JSON arguments) of the calls the sentinel turn carries, for `tool_calls_end` templates bridging tool
        messages: the calls of the generated turn, else one per tool message named after it."""
        if self.tool_calls_end is None or not any(m.role == "tool" for m in messages):
            return None
        calls: list[tuple[str, str]] = []
        if self.call_parser is not None:
            from slime_env.parsers import get_parser

            text = history[-1].content if history and history[-1].role == "assistant" else \
                self.assistant_text(generated_ids)
            calls = [(c.name, json.dumps(c.arguments, ensure_ascii=False))
                     for c in get_parser(self.call_parser)(text).tool_calls]
        if not calls:
            calls = [(m.name or "tool", "{}") for m in messages if m.role == "tool"]
        return tuple(calls)

    def _remember(self, key: tuple, ids: tuple[int, ...]) -> None:
        self._cache[key] = ids
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)  # least recently used first

    def assistant_text(self, generated_ids: Sequence[int]) -> str:
        """The content of a generated turn: its text without the trailing stop token."""
        if generated_ids and generated_ids[-1] in self.stop_token_ids:
            generated_ids = generated_ids[:-1]
        return self.decode(generated_ids)

    # --- tokens ----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self._codec.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._codec.decode(ids)

    # --- special-token text the template did not write (`special_text`) ----------------------------------------
    def _specials(self) -> tuple[list[str], re.Pattern | None]:
        """The tokenizer's special tokens' texts (longest first) and a pattern matching any of them."""
        cached = self.__dict__.get("_special_texts")
        if cached is None:
            added = getattr(self.tokenizer, "added_tokens_decoder", None)
            texts = sorted({t.content for t in added.values() if getattr(t, "special", False) and t.content}
                           if isinstance(added, Mapping) else set(), key=len, reverse=True)
            cached = self.__dict__["_special_texts"] = (
                texts, re.compile("|".join(map(re.escape, texts))) if texts else None)
        return cached

    def _guard(self, dicts: list[dict]) -> list[dict]:
        """`dicts` with the special-token text in the content of every message the policy did not generate (all but
        assistant turns) replaced by markers that `_encode_guarded` encodes as plain text; as they are in "control"
        mode or when there is none."""
        texts, pattern = self._specials()
        if self.special_text == "control" or pattern is None:
            return dicts
        index = {t: i for i, t in enumerate(texts)}
        out = []
        for d in dicts:
            content = d.get("content")
            if d.get("role") != "assistant" and isinstance(content, str) and pattern.search(content):
                d = {**d, "content": pattern.sub(lambda m: f"{self._marker}{index[m.group(0)]}Q", content)}
            out.append(d)
        return out

    def _unguard(self, text: str) -> str:
        texts, _ = self._specials()
        return re.sub(rf"{self._marker}(\d+)Q", lambda m: texts[int(m.group(1))], text) if self._marker in text \
            else text

    def _encode_guarded(self, text: str) -> list[int]:
        """Ids of a rendered `text`: as `encode` gives them, but each stretch between two of the template's own
        special tokens that holds a guarded marker is encoded as plain text (its special-token text spelled out)."""
        if self._marker not in text:
            return self.encode(text)
        _, pattern = self._specials()
        ids: list[int] = []
        pending, at = "", 0
        for m in [*pattern.finditer(text), None]:  # the template's own special tokens cut the text
            stretch = text[at:m.start() if m else len(text)]
            if self._marker in stretch:
                ids += self.encode(pending) if pending else []
                ids += self._codec.encode_plain(self._unguard(stretch))
                pending = ""
            else:
                pending += stretch
            if m is not None:
                pending += m.group(0)
                at = m.end()
        return ids + (self.encode(pending) if pending else [])

    def _encode_inserted(self, text: str) -> list[int]:
        """A mid-turn insert's ids: all of it is the env's text."""
        _, pattern = self._specials()
        if self.special_text == "plain" and pattern is not None and pattern.search(text):
            return self._codec.encode_plain(text)
        return self.encode(text)

    # --- strict mode -----------------------------------------------------------------------------
    def check_bridge(self, history: Sequence[Message], generated_ids: Sequence[int],
                     new: Sequence[Message], bridge_ids: Sequence[int], *,
                     tools: Sequence[Mapping] | None = None) -> None:
        """Check `bridge_ids` against the template applied to the real history (not the base).

        `history` ends with the assistant turn that `generated_ids` produced.
        """
        if len(new) == 1 and new[0].role == "assistant":
            return  # a mid-turn insert is the env's own text, checked by check_full
        dicts = self.template_messages(history)
        if not dicts or dicts[-1]["role"] != "assistant":
            raise InvalidInput("check_bridge: history must end with the assistant turn")
        last = {"role": "assistant", "content": SENTINEL}
        if self.tool_calls_end is not None and dicts[-1].get("tool_calls") and any(m.role == "tool" for m in new):
            last["tool_calls"] = dicts[-1]["tool_calls"]
        dicts[-1] = last
        text = self._render(dicts + self._guard([m.to_dict() for m in new]), tools=tools, add_generation_prompt=True)
        after = _after(text, SENTINEL)
        if "tool_calls" in last:
            after = _after(after, self.tool_calls_end)
        expected = self._dedupe_end_of_turn(generated_ids, self._encode_guarded(after))
        if list(expected) != list(bridge_ids):
            i = _first_difference(expected, bridge_ids)
            raise self._mismatch("bridge", i, expected, bridge_ids)

    def check_full(self, messages: Sequence[Message], ledger_ids: Sequence[int], *,
                   tools: Sequence[Mapping] | None = None, verified: VerifiedPrefix | None = None) -> str | None:
        """Compare the whole ledger with a full render of `messages` (ending at a generation prompt).

        Returns None when they agree, a note when they differ by one of this template's known
        history rewrites (policy "keep"); raises `RenderMismatch` otherwise. With `verified` (one per ledger,
        updated on agreement) only the part of the render after what earlier checks proved is encoded and
        compared; the answer is the same as without it.
        """
        text = self._render(self._guard(self.template_messages(messages)), tools=tools, add_generation_prompt=True)
        v = verified
        if v is not None and v.ids and len(ledger_ids) >= v.ids and text.startswith(v.text):
            tail = self._encode_guarded(text[len(v.text):])
            if len(tail) == len(ledger_ids) - v.ids and all(a == b for a, b in zip(tail, ledger_ids[v.ids:])):
                self._advance(v, text, ledger_ids)
                return None
        expected = self._encode_guarded(text)
        if list(expected) == list(ledger_ids) or self.decode(ledger_ids) == self._unguard(text):
            # (same text: the policy sampled a non-canonical tokenization, which is its right)
            if v is not None:
                self._advance(v, text, ledger_ids)
            return None
        i = _first_difference(expected, ledger_ids)
        if self.rewrites_history and self.on_history_rewrite == "keep":
            return f"{self.family} template re-renders history ({'; '.join(self.rewrites_history)}); " \
                   f"ledger kept the generated tokens (first difference at token {i})"
        raise self._mismatch("full render", i, expected, ledger_ids)

    def _advance(self, v: VerifiedPrefix, text: str, ledger_ids: Sequence[int]) -> None:
        """Move `v` to the last cut of `text` (just before the last of the template's own special tokens) whose
        rest encodes to the ledger's tail exactly; `text` agreed with the whole ledger."""
        start = len(v.text) if text.startswith(v.text) else 0
        best = max(((text.rfind(s, start), s, i) for s, i in self._cut_tokens().items()), default=(-1, "", 0))
        cut, _, token = best
        if cut <= start:
            return
        j = next((k for k in range(len(ledger_ids) - 1, v.ids - 1, -1) if ledger_ids[k] == token), -1)
        if j > v.ids and self._encode_guarded(text[cut:]) == list(ledger_ids[j:]):
            v.text, v.ids = text[:cut], j

    def _cut_tokens(self) -> dict[str, int]:
        """The special tokens this template writes between turns that a cut may sit before: atomic added tokens
        that strip no whitespace beside them and are matched before normalisation (so the text on either side
        encodes on its own). Empty for tokenizers without that guarantee: strict mode then encodes whole renders."""
        cached = self.__dict__.get("_cuts")
        if cached is not None:
            return cached
        cuts: dict[str, int] = {}
        added = getattr(self.tokenizer, "added_tokens_decoder", None)
        if isinstance(added, Mapping) and getattr(self._codec, "_backend", None) is not None \
                and not getattr(self.tokenizer, "split_special_tokens", False):
            between = self._after_sentinel([{"role": "user", "content": "U"}])
            for i, tok in added.items():
                content = getattr(tok, "content", None)
                if (content and content in between and getattr(tok, "special", False)
                        and not (tok.lstrip or tok.rstrip or tok.normalized) and self.encode(content) == [i]):
                    cuts[content] = i
        self.__dict__["_cuts"] = cuts
        return cuts

    # --- internals -------------------------------------------------------------------------------
    def _render(self, dicts: list[dict], *, tools, add_generation_prompt: bool) -> str:
        try:
            return self._template.render(messages=dicts, tools=list(tools) if tools else None,
                                         add_generation_prompt=add_generation_prompt, **self._kwargs)
        except jinja2.TemplateError as e:
            roles = [d.get("role") for d in dicts]
            raise RenderError(f"{self.family} chat template failed on roles {roles}: {e}") from e

    def _base(self, history: Sequence[Message]) -> tuple[tuple[str, str], ...]:
        """The fixed conversation the bridge is rendered after, as (role, content) pairs."""
        return _BASE

    def _after_sentinel(self, new: list[dict], add_generation_prompt: bool = True,
                        base: tuple[tuple, ...] = None, calls: tuple[tuple[str, str], ...] | None = None) -> str:
        base = _BASE if base is None else base
        last: dict[str, Any] = {"role": "assistant", "content": SENTINEL}
        if calls:
            last["tool_calls"] = _call_dicts(calls)
        dicts = [*(_base_message(b) for b in base), last, *new]
        after = _after(self._render(dicts, tools=None, add_generation_prompt=add_generation_prompt), SENTINEL)
        return _after(after, self.tool_calls_end) if calls else after

    def _dedupe_end_of_turn(self, generated_ids: Sequence[int], ids: Sequence[int]) -> list[int]:
        eot = self.end_of_turn_id
        if eot is not None and generated_ids and generated_ids[-1] == eot and ids and ids[0] == eot:
            return list(ids[1:])
        if self.stop_closes_turn and generated_ids and ids and generated_ids[-1] in self.stop_token_ids \
                and (ids[0] == generated_ids[-1] or ids[0] in self._closing_ids()):
            return list(ids[1:])
        return list(ids)

    def _closing_ids(self) -> set[int]:
        vocab = self.tokenizer.get_vocab() if self.closing_tokens else {}
        return {vocab[t] for t in self.closing_tokens if t in vocab}

    def _default_stop_ids(self) -> list[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [eos] if isinstance(eos, int) else []

    def _mismatch(self, what: str, i: int, expected: Sequence[int], actual: Sequence[int]) -> RenderMismatch:
        exp = expected[i] if i < len(expected) else None
        act = actual[i] if i < len(actual) else None
        show = lambda t: "end" if t is None else f"{t} {self.decode([t])!r}"  # noqa: E731
        context = self.decode(list(expected[max(0, i - 8):i]))
        return RenderMismatch(f"{self.family} renderer: {what} differs from the chat template at token {i}: "
                              f"template has {show(exp)}, ledger has {show(act)} (after {context!r})",
                              index=i, expected=exp, actual=act)


def _call_dicts(calls: Sequence[tuple[str, str]], start: int = 0) -> list[dict[str, Any]]:
    return [{"id": f"call_{start + i}", "type": "function", "function": {"name": n, "arguments": json.loads(a)}}
            for i, (n, a) in enumerate(calls)]


def _base_message(b: tuple) -> dict[str, Any]:
    """A base entry: (role, content), or (role, content, calls) for an assistant turn carrying tool calls."""
    d: dict[str, Any] = {"role": b[0], "content": b[1]}
    if len(b) > 2 and b[2]:
        d["tool_calls"] = _call_dicts(b[2])
    return d


def _after(text: str, marker: str) -> str:
    at = text.find(marker)
    if at < 0:
        raise RenderError("chat template dropped the assistant content; this template cannot be bridged")
    return text[at + len(marker):]


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
