"""Compile Hugging Face chat templates the way `transformers.apply_chat_template` does.

We compile once and call `Template.render` directly: the renderer runs this on every turn, and
going through `apply_chat_template` costs several times more per call. The environment mirrors
transformers' (sandboxed, trim_blocks, lstrip_blocks, loopcontrols, `tojson` without HTML escaping,
`raise_exception`, `strftime_now`); `tests/test_renderers.py` checks both give the same text.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from slime_env.errors import RenderError


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` blocks (assistant-mask markers) as plain output."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_passthrough"), [], [], body).set_lineno(lineno)

    def _passthrough(self, caller):
        return caller()


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template (cached by its text). Raises RenderError on a syntax error."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise RenderError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from e
