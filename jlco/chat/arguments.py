"""Tool-call argument values as JSON: models write each argument as bare text (GLM's
`<arg_value>42</arg_value>`, DeepSeek's `string="false"` parameters), and the OpenAI
API returns `function.arguments` as a JSON object string, so each value must become a
JSON value. The request's tool schemas say which type a parameter has; without one a
value stays the text the model wrote (GLM) or is read as JSON when the model marked it
as not a string (DeepSeek)."""

from __future__ import annotations

import ast
import json
from typing import Any

_SCALARS = ("integer", "number", "boolean", "null")


def to_json(value: Any) -> str:
    """JSON text with non-ASCII kept as is, the spacing json.dumps uses by default (the
    streamed arguments are built piece by piece in exactly this form)."""
    return json.dumps(value, ensure_ascii=False)


def json_string_body(text: str) -> str:
    """`text` escaped for the inside of a JSON string (no quotes): escaping works
    character by character, so pieces escaped apart join into the whole's escape."""
    return to_json(text)[1:-1]


def schema_properties(tools: list | None) -> dict[str, dict]:
    """{function name: its parameters' `properties`} from OpenAI-format tools
    ({"type": "function", "function": {...}}) or bare function dicts; tools that are
    malformed are skipped (the request validator is where they get a 400)."""
    out: dict[str, dict] = {}
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function", tool)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def schema_types(schema: Any) -> list[str] | None:
    """The JSON-schema type names a parameter allows (`type`, a list of them, or the
    branches of anyOf / oneOf), or None when the schema does not say."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return list(t)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            names: list[str] = []
            for branch in schema[key]:
                for name in schema_types(branch) or []:
                    if name not in names:
                        names.append(name)
            return names or None
    return None


def is_plain_string(types: list[str] | None) -> bool:
    """A parameter whose value is streamed as text as it arrives (no conversion)."""
    return types is None or set(types) == {"string"}


def _literal(text: str) -> Any:
    """JSON, else a Python literal (models sometimes write {'a': 1}), else a ValueError."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ValueError(text) from None


def _as_type(text: str, name: str) -> tuple[bool, Any]:
    low = text.lower()
    if name == "boolean":
        return (low in ("true", "false"), low == "true")
    if name == "null":
        return (low in ("null", "none"), None)
    try:
        value = _literal(text)
    except ValueError:
        return False, None
    if name == "integer":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return (isinstance(value, int) and not isinstance(value, bool), value)
    if name == "number":
        return (isinstance(value, (int, float)) and not isinstance(value, bool), value)
    if name == "object":
        return (isinstance(value, dict), value)
    if name == "array":
        return (isinstance(value, (list, tuple)), list(value) if isinstance(value, tuple)
                else value)
    return False, None


def convert(raw: str, types: list[str] | None) -> Any:
    """The value `raw` stands for. With schema types: the first non-string type it
    parses as (integers, numbers, booleans, null, objects, arrays), else the text
    itself. Without (None): JSON if it parses, else the text."""
    text = raw.strip()
    if types is None:
        try:
            return json.loads(text)
        except ValueError:
            return raw
    ordered = [t for t in types if t in _SCALARS or t in ("object", "array")]
    for name in ordered:
        ok, value = _as_type(text, name)
        if ok:
            return value
    return raw
