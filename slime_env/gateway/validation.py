"""What the gateway checks before anything is rendered or sampled: the body as JSON (depth, valid Unicode), sampling
parameters in their API's ranges, tool schemas, and fields it cannot honour. Every refusal is a `GatewayError` (400)
naming the field, in the route's own error shape: the agent's mistakes are never the engine's 5xx.

The policy on fields: one that changes what is sampled and that the gateway cannot honour is refused (`n > 1`,
`response_format`, `logit_bias`, Anthropic `thinking`, ...), never silently ignored; one that does not change the
sample (`user`, `metadata`, `store`, `service_tier`) is accepted and ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from slime_env.policy import SEED_MAX, SEED_MIN

MAX_DEPTH = 64  # JSON nesting a request may use (tool schemas nest a few levels; templates recurse over them)
JSON_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")


class GatewayError(Exception):
    """A request the gateway refuses: HTTP `status`, OpenAI error `kind` (and `code`) and a message naming the
    field (`param`)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def check_json(body: Any, where: str = "") -> None:
    """Refuse a body nested deeper than `MAX_DEPTH` or holding a string that is not valid Unicode (a lone surrogate
    escape such as "\\ud800", which JSON admits and no tokenizer can encode), naming the field."""
    stack: list[tuple[Any, str, int]] = [(body, where, 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise GatewayError(400, f"{where or 'the request body'}: JSON nested deeper than {MAX_DEPTH} levels",
                               param=where or None)
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, Mapping):
            items = []
            for key, item in value.items():
                at = f"{where}.{key}" if where else str(key)
                _check_text(key, at)
                items.append((item, at, depth + 1))
            stack.extend(reversed(items))  # the first bad field in the body's order is the one named
        elif isinstance(value, list):
            stack.extend(reversed([(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GatewayError(400, f"{where}: not valid Unicode text (a lone surrogate {text[e.start]!r} at character "
                                f"{e.start}; escapes \\ud800-\\udfff must come in pairs)", param=where) from None


# --- sampling parameters ---------------------------------------------------------------------------------------------
def number(body: Mapping[str, Any], key: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    """`body[key]`, a finite number in [low, high] (or (low, high] with `low_open`); None when absent or null."""
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise GatewayError(400, f"{key}: expected a number, got {value!r}", param=key)
    inside = (low < value if low_open else low <= value) and value <= high  # False for NaN
    if not inside:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise GatewayError(400, f"{key}: {value!r} is outside {span}", param=key)
    return value


def integer(body: Mapping[str, Any], key: str, low: int, high: int) -> int | None:
    """`body[key]`, an integer in [low, high]; None when absent or null."""
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise GatewayError(400, f"{key}: expected an integer, got {value!r}", param=key)
    if not low <= value <= high:
        raise GatewayError(400, f"{key}: {value} is outside [{low}, {high}]", param=key)
    return value


def seed(body: Mapping[str, Any], key: str = "seed") -> int | None:
    return integer(body, key, SEED_MIN, SEED_MAX)


# --- fields the gateway cannot honour --------------------------------------------------------------------------------
def refuse(body: Mapping[str, Any], unsupported: Mapping[str, tuple[Callable[[Any], bool], str]]) -> None:
    """Refuse each field of `unsupported` ({field: (is_harmless(value), why)}) whose value would change the sample."""
    for key, (harmless, why) in unsupported.items():
        if key in body and body[key] is not None and not harmless(body[key]):
            raise GatewayError(400, f"{key}: {why}", param=key)


# --- tool schemas ------------------------------------------------------------------------------------------------
def check_schema(schema: Any, where: str, *, top: bool = True) -> None:
    """A tool's parameters as a JSON Schema: an object whose `type` (if given) names JSON types — `object` at the top
    — whose `properties`, `items`, `anyOf` / `oneOf` / `allOf`, `$defs` hold schemas and `required` lists names.
    Structural only (formats and keywords beyond these are the model's business, not the gateway's)."""
    if not isinstance(schema, Mapping):
        raise GatewayError(400, f"{where}: expected a JSON Schema object, got {_show(schema)}", param=where)
    kind = schema.get("type")
    if kind is not None:
        kinds = [kind] if isinstance(kind, str) else kind
        if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
            raise GatewayError(400, f"{where}.type: {kind!r} is not a JSON Schema type ({', '.join(JSON_TYPES)})",
                               param=f"{where}.type")
        if top and kinds != ["object"]:
            raise GatewayError(400, f"{where}.type: a tool's parameters are an 'object' schema, got {kind!r}",
                               param=f"{where}.type")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, Mapping):
            raise GatewayError(400, f"{where}.properties: expected an object of schemas", param=f"{where}.properties")
        for name, sub in props.items():
            check_schema(sub, f"{where}.properties.{name}", top=False)
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise GatewayError(400, f"{where}.required: expected a list of property names", param=f"{where}.required")
    items = schema.get("items")
    if items is not None and not isinstance(items, bool):
        for k, sub in enumerate(items) if isinstance(items, list) else [(None, items)]:
            check_schema(sub, f"{where}.items" + (f"[{k}]" if k is not None else ""), top=False)
    for key in ("anyOf", "oneOf", "allOf"):
        subs = schema.get(key)
        if subs is not None:
            if not isinstance(subs, list) or not subs:
                raise GatewayError(400, f"{where}.{key}: expected a non-empty list of schemas", param=f"{where}.{key}")
            for k, sub in enumerate(subs):
                check_schema(sub, f"{where}.{key}[{k}]", top=False)
    for key in ("$defs", "definitions"):
        defs = schema.get(key)
        if defs is not None:
            if not isinstance(defs, Mapping):
                raise GatewayError(400, f"{where}.{key}: expected an object of schemas", param=f"{where}.{key}")
            for name, sub in defs.items():
                check_schema(sub, f"{where}.{key}.{name}", top=False)
    extra = schema.get("additionalProperties")
    if extra is not None and not isinstance(extra, bool):
        check_schema(extra, f"{where}.additionalProperties", top=False)


def check_tool(name: Any, description: Any, where: str) -> None:
    if not isinstance(name, str) or not name:
        raise GatewayError(400, f"{where}.name: expected a non-empty string, got {_show(name)}", param=f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise GatewayError(400, f"{where}.description: expected a string, got {_show(description)}",
                           param=f"{where}.description")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def finite(value: Any, where: str) -> float:
    """A finite number (not a bool): what a reward must be."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise GatewayError(400, f"{where}: expected a finite number, got {_show(value)}", param=where)
    return float(value)
