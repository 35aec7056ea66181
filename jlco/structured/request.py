"""The request fields that ask for structured output, read into one `GrammarSpec`:
OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}) and vLLM's
`structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}),
on completions and chat alike. Shapes are checked here (a 400 naming the field); whether
a schema, regex or grammar compiles is llguidance's to say (`Grammars.compile`)."""

from __future__ import annotations

import json
from typing import Any

from jlco.structured.grammar import GrammarSpec

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class FieldError(ValueError):
    """A bad structured-output field: `field` names it, the message says what is allowed."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def read_structured(body: dict) -> GrammarSpec | None:
    """The spec `body` asks for (None: free text); both fields at once is refused."""
    fmt = _response_format(body.get("response_format"))
    out = _structured_outputs(body.get("structured_outputs"))
    if fmt is not None and out is not None:
        raise FieldError("structured_outputs", "give response_format or structured_outputs, "
                                               "not both")
    return fmt if fmt is not None else out


def _response_format(v: Any) -> GrammarSpec | None:
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text" and set(v) == {"type"}:
        return None
    if kind == "json_object" and set(v) == {"type"}:
        return GrammarSpec("json_object")
    if kind == "json_schema" and set(v) == {"type", "json_schema"}:
        js = v["json_schema"]
        if not isinstance(js, dict) or not isinstance(js.get("name"), str) \
                or set(js) - {"name", "schema", "strict", "description"}:
            raise FieldError("response_format.json_schema", "allowed {\"name\": str, "
                             "\"schema\": object, \"strict\": bool, \"description\": str}")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise FieldError("response_format.json_schema.schema", "allowed a JSON schema "
                                                                   "object")
        return GrammarSpec.json_schema(schema)
    raise FieldError("response_format", "allowed {\"type\": \"text\"}, {\"type\": "
                     "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": {...}}")


def _structured_outputs(v: Any) -> GrammarSpec | None:
    if v is None:
        return None
    given = [k for k in _STRUCTURED_KEYS if isinstance(v, dict) and v.get(k) is not None]
    extra = set(v) - set(_STRUCTURED_KEYS) if isinstance(v, dict) else set()
    if len(given) != 1 or extra:
        raise FieldError("structured_outputs", f"allowed an object with exactly one of "
                                               f"{', '.join(_STRUCTURED_KEYS)}")
    key, val = given[0], v[given[0]]
    field = f"structured_outputs.{key}"
    if key == "json":
        if isinstance(val, str):
            try:
                val = json.loads(val)
            except ValueError:
                raise FieldError(field, "allowed a JSON schema (an object or its JSON "
                                        "text)") from None
        if not isinstance(val, dict):
            raise FieldError(field, "allowed a JSON schema (an object or its JSON text)")
        return GrammarSpec.json_schema(val)
    if key == "json_object":
        if val is not True:
            raise FieldError(field, "allowed true")
        return GrammarSpec("json_object")
    if key == "choice":
        if not isinstance(val, list) or not val or not all(isinstance(c, str) and c
                                                            for c in val):
            raise FieldError(field, "allowed a non-empty list of non-empty strings")
        return GrammarSpec.choices(val)
    if not isinstance(val, str) or not val:
        raise FieldError(field, "allowed a non-empty string")
    return GrammarSpec(key, val)
