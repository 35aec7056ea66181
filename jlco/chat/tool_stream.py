"""What every tool-call parser shares: the OpenAI streaming deltas it emits, folding
them back into a whole response, and the base class whose `parse` *is* its streaming
machine run over the whole text -- so a streamed response and the same response parsed
at once cannot disagree, whatever the chunking.

Delta shapes (OpenAI's `choices[i].delta`):
  {"content": "..."}
  {"tool_calls": [{"index": 0, "id": "call_...", "type": "function",
                   "function": {"name": "get_weather", "arguments": ""}}]}
  {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\": \\"Pa"}}]}
A call's name and id come once, in its first delta; its arguments follow in fragments
that join into one JSON object string."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Callable

from jlco.chat._text import Scanner
from jlco.chat.arguments import (is_plain_string, json_string_body, schema_properties,
                                 schema_types, to_json, convert)


@dataclasses.dataclass
class ToolCall:
    """One call the model made; `arguments` is a JSON object string."""
    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict:
        """The `message.tool_calls[i]` entry of a chat completion."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def collect_deltas(deltas: list[dict]) -> tuple[str, list[ToolCall]]:
    """Fold streamed deltas into (content, tool calls), the way a client does."""
    content, calls = [], {}
    for d in deltas:
        content.append(d.get("content") or "")
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], ToolCall("", "", ""))
            call.id = tc.get("id") or call.id
            fn = tc.get("function", {})
            call.name = fn.get("name") or call.name
            call.arguments += fn.get("arguments") or ""
    return "".join(content), [calls[i] for i in sorted(calls)]


class ToolCallParser:
    """Base of the per-format parsers. One instance parses one response: `feed` the
    text deltas as they are decoded, then `finish` once at the end (it releases text
    held back in case it began a delimiter). `parse` handles a whole response and leaves
    the instance's streaming state alone.

    Text outside tool-call blocks is content, except whitespace next to a block (the
    format's own separator, as in "I'll check.\\n\\n<block>"). A response cut off inside
    a call (max_tokens) ends that call with its arguments closed, so they stay JSON."""

    format_name = ""

    def __init__(self, tools: list | None = None,
                 id_factory: Callable[[], str] = new_call_id) -> None:
        self.tools = tools
        self._props = schema_properties(tools)
        self._new_id = id_factory
        self._scan = Scanner()
        self._state = "content"
        self._out: list[dict] = []
        self._ws = ""               # trailing whitespace of content, held back
        self._after_block = False   # just past a block: leading whitespace is dropped
        self._index = -1            # the open call's index
        self._call_name = ""
        self._n_args = 0            # arguments written into the open call
        self._raw = ""              # a value being gathered whole
        self._finished = False

    # --- the public API ---------------------------------------------------------------
    def feed(self, delta: str) -> list[dict]:
        """The deltas `delta` completes (possibly none)."""
        if self._finished:
            raise ValueError("feed: this parser has finished its response (make a new "
                             "parser per response)")
        self._scan.add(delta)
        while self._step():
            pass
        return self._take()

    def finish(self) -> list[dict]:
        """The deltas left at the end of the response."""
        if not self._finished:
            self._finished = True
            while self._step():
                pass
            self._flush()
        return self._take()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, tool calls) of a whole response."""
        fresh = type(self)(self.tools, self._new_id)
        return collect_deltas(fresh.feed(text) + fresh.finish())

    # --- for the formats ---------------------------------------------------------------
    def _step(self) -> bool:
        """Advance the state machine once; False when it needs more text."""
        return getattr(self, "_st_" + self._state)()

    def _flush(self) -> None:
        """At the end of the response: close what is open."""
        raise NotImplementedError

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out

    def _content(self, text: str) -> None:
        if self._after_block:
            text = text.lstrip()
            if not text:
                return
            self._after_block = False
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            if self._out and "content" in self._out[-1]:
                self._out[-1]["content"] += body
            else:
                self._out.append({"content": body})

    def _flush_content(self) -> None:
        self._content(self._scan.take_all())
        if self._ws and not self._after_block:
            self._out.append({"content": self._ws})
        self._ws = ""

    def _block_starts(self) -> None:
        self._ws = ""

    def _block_ends(self) -> None:
        self._after_block = True

    def _begin_call(self, name: str) -> None:
        self._index += 1
        self._call_name, self._n_args = name, 0
        self._out.append({"tool_calls": [{"index": self._index, "id": self._new_id(),
                                          "type": "function",
                                          "function": {"name": name, "arguments": ""}}]})

    def _args(self, fragment: str) -> None:
        if not fragment:
            return
        last = self._out[-1]["tool_calls"][0] if self._out and "tool_calls" in \
            self._out[-1] else None
        if last is not None and last["index"] == self._index:
            fn = last.setdefault("function", {})
            fn["arguments"] = fn.get("arguments", "") + fragment
        else:
            self._out.append({"tool_calls": [{"index": self._index,
                                              "function": {"arguments": fragment}}]})

    def _arg_types(self, key: str) -> list[str] | None:
        props = self._props.get(self._call_name)
        return None if props is None else schema_types(props.get(key))

    def _open_arg(self, key: str, as_string: bool) -> None:
        """Write `"key": ` (and the value's opening quote when it streams as text)."""
        self._args(("{" if self._n_args == 0 else ", ") + to_json(key) + ": "
                   + ('"' if as_string else ""))
        self._n_args += 1
        self._raw = ""

    def _string_piece(self, text: str) -> None:
        self._args(json_string_body(text))

    def _close_string(self) -> None:
        self._args('"')

    def _close_value(self, types: list[str] | None) -> None:
        self._args(to_json(convert(self._raw, types)))
        self._raw = ""

    def _end_call(self) -> None:
        self._args("}" if self._n_args else "{}")
        self._call_name, self._n_args = "", 0

    @staticmethod
    def _plain(types: list[str] | None) -> bool:
        return is_plain_string(types)
