"""The trajectory viewer: a self-contained HTML page (no network, no CDN) that shows the token ledger.

`build_view(path, out, tokenizer=...)` reads a rollout store, a trajectory file or a training run
(`slime_env.viewer.data.load`) and writes one HTML file: the episode list (filters, sorting, pages), each
episode's turns, its token strip (every token as the tokenizer cut it, coloured by span kind, rollout
log-probs as a heat map, drift reports), the group view (the samples of one prompt with rewards and
advantages) and multi-agent episodes (one ledger per agent, aligned by turn). `slime-env view` is the CLI.
"""

from __future__ import annotations

import html
import json
from datetime import datetime, timezone
from importlib.resources import files
from pathlib import Path
from typing import Any

from slime_env.errors import InvalidInput
from slime_env.viewer.data import Loaded, load

NAMED_TOKENIZERS = ("default", "smollm2", "qwen2.5", "qwen3", "llama3.1", "llama3.2", "deepseek_r1")


def resolve_tokenizer(spec: Any) -> tuple[Any, str]:
    """A tokenizer object and its name: a tokenizer, "none", a built-in name (`NAMED_TOKENIZERS`, built
    offline), or a local folder with tokenizer files (a model or a checkpoint)."""
    if spec is None or spec == "none":
        return None, "none (token ids only)"
    if not isinstance(spec, str):
        return spec, getattr(spec, "name_or_path", type(spec).__name__)
    from slime_env import offline_tokenizers as ot

    builders = {"default": ot.smollm2, "smollm2": ot.smollm2, "qwen2.5": lambda: ot.qwen("2.5"),
                "qwen3": lambda: ot.qwen("3"), "llama3.1": lambda: ot.llama3("3.1"),
                "llama3.2": lambda: ot.llama3("3.2"), "deepseek_r1": ot.deepseek_r1}
    if spec in builders:
        return builders[spec](), spec if spec != "default" else "default (SmolLM2-135M-Instruct)"
    if Path(spec).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(spec, local_files_only=True), spec
    raise InvalidInput(f"tokenizer {spec!r}: give one of {list(NAMED_TOKENIZERS)}, 'none', or a local folder")


def token_pieces(tokenizer: Any, ids: set[int]) -> dict[int, str]:
    """Each id as the text it stands for; bytes of a split multi-byte character shown as `<0xE2>`."""
    if tokenizer is None or not ids:
        return {}
    unique = sorted(ids)
    raw = tokenizer.convert_ids_to_tokens(unique)
    decoded = tokenizer.batch_decode([[i] for i in unique], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
    table = _byte_decoder()
    out = {}
    for i, r, text in zip(unique, raw, decoded):
        if "\ufffd" in text and isinstance(r, str) and all(c in table for c in r):
            text = _hex_bytes(bytes(table[c] for c in r))
        out[i] = text
    return out


def _hex_bytes(data: bytes) -> str:
    """Decodable runs as text, the rest as `<0xNN>` per byte."""
    out, i = [], 0
    while i < len(data):
        for j in range(len(data), i, -1):
            try:
                out.append(data[i:j].decode("utf-8"))
                i = j
                break
            except UnicodeDecodeError:
                continue
        else:
            out.append(f"<0x{data[i]:02X}>")
            i += 1
    return "".join(out)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed (the tokenizers of every family we render use it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def render_html(loaded: Loaded, tokenizer: Any = "default", *, title: str | None = None,
                extra: dict[str, Any] | None = None) -> str:
    """The page for `loaded` as one HTML string (data, script and style inline). `extra` adds top-level data
    fields (`report`: the training report's facts, images and config, shown above the episodes)."""
    tok, tok_name = resolve_tokenizer(tokenizer)
    ids: set[int] = set()
    for ep in loaded.episodes:
        ids.update(ep["prompt_ids"])
        ids.update(ep["response_ids"])
    pieces = token_pieces(tok, ids)
    special = sorted(set(getattr(tok, "all_special_ids", []) or []) & ids) if tok is not None else []
    data = {"title": title or "slime_env trajectories", "sources": loaded.sources, "tokenizer": tok_name,
            "generated_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "warnings": loaded.warnings,
            "pieces": {str(k): v for k, v in pieces.items()}, "special": special, "episodes": loaded.episodes,
            **(extra or {})}
    return page(data)


def page(data: dict[str, Any]) -> str:
    """Fill the page template with `data` (JSON inside a non-executed script tag)."""
    assets = files("slime_env.viewer")
    template = (assets / "page.html").read_text(encoding="utf-8")
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("</", "<\\/")
    return (template.replace("{{title}}", html.escape(data.get("title") or "slime_env"))
            .replace("/*{{style}}*/", (assets / "viewer.css").read_text(encoding="utf-8"))
            .replace("/*{{script}}*/", (assets / "viewer.js").read_text(encoding="utf-8"))
            .replace("{{data}}", payload))


def build_view(path: str | Path, out: str | Path | None = None, *, tokenizer: Any = None,
               title: str | None = None) -> tuple[Path, Loaded]:
    """Write the viewer page for `path` to `out` (default: `<path>/view.html` for a directory, else
    `<file>.html`). `tokenizer`: see `resolve_tokenizer`; None: the run's own model if the directory names
    it, else the default model's. Returns the page's path and what was loaded (warnings included)."""
    path = Path(path)
    loaded = load(path)
    if tokenizer is None:
        hint = loaded.tokenizer_hint
        tokenizer = hint if hint in NAMED_TOKENIZERS or (hint and Path(hint).is_dir()) else "default"
    target = Path(out) if out is not None else (path / "view.html" if path.is_dir() else path.with_suffix(".html"))
    target.write_text(render_html(loaded, tokenizer, title=title or f"slime_env: {path.name}"), encoding="utf-8")
    return target, loaded


__all__ = ["build_view", "load", "page", "render_html", "resolve_tokenizer", "token_pieces"]
