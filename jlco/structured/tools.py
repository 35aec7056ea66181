"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked, and the
JSON schema that enforces a forced choice: with `tool_choice` a named function the model
writes that function's arguments (an object of its parameter schema); with "required" it
writes a JSON array of {"name", "parameters"} calls (one at most without parallel tool
calls), each naming one of the tools with arguments of its schema, as vLLM enforces
them. Whatever the weights, the arguments then parse and match the schema. "auto" is
left to the model's own tool-call syntax (`jlco.chat.tool_parsers`); "none" to text."""

from __future__ import annotations

import dataclasses
from typing import Any

from jlco.structured.grammar import GrammarSpec
from jlco.structured.request import FieldError

CHOICES = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """tools: the OpenAI tool objects as sent (checked); choice: one of CHOICES or a
    function name (forced); parallel: several calls allowed in one reply."""
    tools: tuple
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.named is not None or self.choice == "required"

    def parameters(self, name: str) -> dict:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    def grammar(self) -> GrammarSpec | None:
        """The spec a forced choice decodes under (None: not forced)."""
        if self.named is not None:
            return GrammarSpec.json_schema(self.parameters(self.named))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]},
            "parameters": self.parameters(t["function"]["name"])},
            "required": ["name", "parameters"], "additionalProperties": False}
            for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return GrammarSpec.json_schema(schema)


def read_tools(body: dict) -> ToolRequest | None:
    """The request's tool fields (None: no tools, or tool_choice "none" with none)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", "allowed true or false")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise FieldError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list):
        raise FieldError("tools", "allowed a list of {\"type\": \"function\", \"function\": "
                                  "{\"name\", \"description\", \"parameters\"}}")
    names = [_check_tool(t, i) for i, t in enumerate(tools)]
    if len(set(names)) != len(names):
        raise FieldError("tools", "function names must be distinct")
    choice = "auto" if choice is None else choice
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else None
        if named not in names:
            raise FieldError("tool_choice", f"allowed one of {CHOICES} or {{\"type\": "
                                            f"\"function\", \"function\": {{\"name\": one of "
                                            f"{names}}}}}")
        choice = "function"
    elif choice not in CHOICES:
        raise FieldError("tool_choice", f"allowed one of {CHOICES} or a named function")
    return ToolRequest(tuple(tools), choice, named, True if parallel is None else parallel)


def _check_tool(t: Any, i: int) -> str:
    field = f"tools[{i}]"
    fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise FieldError(field, "allowed {\"type\": \"function\", \"function\": {\"name\": "
                                "str, \"description\": str, \"parameters\": object}}")
    if set(fn) - {"name", "description", "parameters", "strict"}:
        raise FieldError(f"{field}.function", "allowed name, description, parameters, strict")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise FieldError(f"{field}.function.parameters", "allowed a JSON schema object")
    return fn["name"]
