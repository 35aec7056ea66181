"""Tool calls in a model's own syntax, parsed out of its generated text (whole or
streamed), for the two checkpoint families jlco serves.

DeepSeek-V3.2 ("DSML", new in V3.2; V3.1 used <｜tool▁calls▁begin｜> markers):
    I'll look it up.\\n\\n<｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>
`string="true"` values are text as is; `string="false"` ones are JSON.

GLM-5 (as GLM-4.7; GLM-4.5/4.6 put newlines between the parts, also accepted):
    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>\\
<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>
Values are bare text; the request's tool schema says which are integers, booleans,
objects...; a parameter the schema does not type stays a string.

`parser_for(model_type, tools)` picks the parser from a checkpoint's config.json
model_type."""

from __future__ import annotations

import re

from jlco.chat.tool_stream import ToolCall, ToolCallParser, collect_deltas, new_call_id

__all__ = ["ToolCall", "ToolCallParser", "DeepSeekV32ToolParser", "Glm5ToolParser",
           "PARSERS", "MODEL_TYPES", "parser_for", "collect_deltas", "new_call_id"]

_DSML = "｜DSML｜"
_ATTR = r'\s*=\s*"([^"]*)"'


class DeepSeekV32ToolParser(ToolCallParser):
    """DeepSeek-V3.2's DSML tool-call blocks (see the module docstring)."""

    format_name = "deepseek_v32"
    BLOCK_START = f"<{_DSML}function_calls>"
    BLOCK_END = f"</{_DSML}function_calls>"
    INVOKE = f"<{_DSML}invoke"
    INVOKE_END = f"</{_DSML}invoke>"
    PARAM = f"<{_DSML}parameter"
    PARAM_END = f"</{_DSML}parameter>"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._types: list[str] | None = None

    def _st_content(self) -> bool:
        before, hit = self._scan.until(self.BLOCK_START)
        self._content(before)
        if hit is None:
            return False
        self._block_starts()
        self._state = "block"
        return True

    def _st_block(self) -> bool:
        _, hit = self._scan.until(self.INVOKE, self.BLOCK_END)
        if hit == self.INVOKE:
            self._state = "invoke_head"
        elif hit == self.BLOCK_END:
            self._block_ends()
            self._state = "content"
        return hit is not None

    def _st_invoke_head(self) -> bool:
        head, hit = self._scan.until(">", wait=True)
        if hit is None:
            return False
        m = re.search("name" + _ATTR, head)
        self._begin_call(m.group(1) if m else head.strip())
        self._state = "params"
        return True

    def _st_params(self) -> bool:
        _, hit = self._scan.until(self.PARAM, self.INVOKE_END)
        if hit == self.PARAM:
            self._state = "param_head"
        elif hit == self.INVOKE_END:
            self._end_call()
            self._state = "block"
        return hit is not None

    def _st_param_head(self) -> bool:
        head, hit = self._scan.until(">", wait=True)
        if hit is None:
            return False
        name = re.search("name" + _ATTR, head)
        key = name.group(1) if name else head.strip()
        flag = re.search("string" + _ATTR, head)
        schema = self._arg_types(key)
        if flag is not None:
            as_string = flag.group(1).lower() == "true"
            self._types = schema if schema is not None and not self._plain(schema) \
                else None
        else:   # no attribute: the schema decides
            as_string, self._types = self._plain(schema), schema
        self._open_arg(key, as_string)
        self._state = "value_str" if as_string else "value_raw"
        return True

    def _st_value_str(self) -> bool:
        text, hit = self._scan.until(self.PARAM_END)
        self._string_piece(text)
        if hit is None:
            return False
        self._close_string()
        self._state = "params"
        return True

    def _st_value_raw(self) -> bool:
        text, hit = self._scan.until(self.PARAM_END)
        self._raw += text
        if hit is None:
            return False
        self._close_value(self._types)
        self._state = "params"
        return True

    def _flush(self) -> None:
        state, self._state = self._state, "content"
        if state == "content":
            self._flush_content()
            return
        if state == "value_str":
            self._close_string()
        elif state == "value_raw":
            self._close_value(self._types)
        if state in ("params", "param_head", "value_str", "value_raw"):
            self._end_call()
        self._scan.take_all()


class Glm5ToolParser(ToolCallParser):
    """GLM-5's `<tool_call>` blocks (see the module docstring)."""

    format_name = "glm5"
    START, END = "<tool_call>", "</tool_call>"
    KEY, KEY_END = "<arg_key>", "</arg_key>"
    VALUE, VALUE_END = "<arg_value>", "</arg_value>"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._name = ""
        self._key = ""
        self._types: list[str] | None = None

    def _st_content(self) -> bool:
        before, hit = self._scan.until(self.START)
        self._content(before)
        if hit is None:
            return False
        self._block_starts()
        self._name = ""
        self._state = "name"
        return True

    def _st_name(self) -> bool:
        """The name runs to the first newline or tag (a newline before it is skipped)."""
        text, hit = self._scan.until("\n", "<")
        self._name += text
        if hit is None or (hit == "\n" and not self._name.strip()):
            return hit is not None
        if hit == "<":
            self._scan.push_front("<")
        self._begin_call(self._name.strip())
        self._state = "args"
        return True

    def _st_args(self) -> bool:
        _, hit = self._scan.until(self.KEY, self.END)
        if hit == self.KEY:
            self._key = ""
            self._state = "key"
        elif hit == self.END:
            self._end_call()
            self._block_ends()
            self._state = "content"
        return hit is not None

    def _st_key(self) -> bool:
        text, hit = self._scan.until(self.KEY_END)
        self._key += text
        if hit is None:
            return False
        self._state = "value_open"
        return True

    def _st_value_open(self) -> bool:
        _, hit = self._scan.until(self.VALUE, self.END)
        if hit == self.END:     # a key without a value: the call ends without it
            self._scan.push_front(self.END)
            self._state = "args"
        elif hit == self.VALUE:
            key = self._key.strip()
            self._types = self._arg_types(key)
            as_string = self._plain(self._types)
            self._open_arg(key, as_string)
            self._state = "value_str" if as_string else "value_raw"
        return hit is not None

    def _st_value_str(self) -> bool:
        text, hit = self._scan.until(self.VALUE_END)
        self._string_piece(text)
        if hit is None:
            return False
        self._close_string()
        self._state = "args"
        return True

    def _st_value_raw(self) -> bool:
        text, hit = self._scan.until(self.VALUE_END)
        self._raw += text
        if hit is None:
            return False
        self._close_value(self._types)
        self._state = "args"
        return True

    def _flush(self) -> None:
        state, self._state = self._state, "content"
        if state == "content":
            self._flush_content()
            return
        if state == "value_str":
            self._close_string()
        elif state == "value_raw":
            self._close_value(self._types)
        if state != "name":
            self._end_call()
        self._scan.take_all()


PARSERS: dict[str, type[ToolCallParser]] = {
    "deepseek_v32": DeepSeekV32ToolParser,
    "glm5": Glm5ToolParser,
}

# config.json model_type -> the tool-call format its checkpoints use
MODEL_TYPES = {"deepseek_v32": "deepseek_v32", "glm_moe_dsa": "glm5"}


def parser_for(model_type: str, tools: list | None = None, **kwargs) -> ToolCallParser:
    """A fresh parser for one response of a checkpoint of `model_type` (config.json);
    `tools` are the request's tools (their schemas type GLM's argument values)."""
    fmt = MODEL_TYPES.get(model_type)
    if fmt is None:
        raise ValueError(f"model_type: {model_type!r} has no tool-call parser (allowed: "
                         f"{', '.join(sorted(MODEL_TYPES))})")
    return PARSERS[fmt](tools, **kwargs)
