"""One response's generated text turned into an OpenAI chat message: the reasoning
splitter first, then the tool-call parser on what is content. The server needs this
pairing for every chat response, streamed or not, and the order matters (a tool-call
block inside thinking is thinking), so it lives here once."""

from __future__ import annotations

from typing import Callable

from jlco.chat.reasoning import reasoning_parser_for
from jlco.chat.tool_parsers import parser_for
from jlco.chat.tool_stream import ToolCall, collect_deltas, new_call_id


class ChatOutput:
    """Deltas for `choices[i].delta`, or the whole `choices[i].message`. `tools`: the
    request's tools, None (or tool_choice "none") for no tool-call parsing."""

    def __init__(self, model_type: str, prompt: str, tools: list | None = None,
                 id_factory: Callable[[], str] = new_call_id, *,
                 tool_format: str | None = None, reasoning_format: str | None = None) -> None:
        """tool_format / reasoning_format: the model_type whose syntax to parse, when it
        is not the checkpoint's (the server's --tool_call_parser / --reasoning_parser)."""
        tools_as, think_as = tool_format or model_type, reasoning_format or model_type
        self._make = lambda: (reasoning_parser_for(think_as, prompt),
                              parser_for(tools_as, tools, id_factory=id_factory)
                              if tools else None)
        self._think, self._calls = self._make()
        self.tool_calls_seen = False

    def feed(self, delta: str) -> list[dict]:
        return self._route(self._think.feed(delta), final=False)

    def finish(self) -> list[dict]:
        return self._route(self._think.finish(), final=True)

    def message(self, text: str) -> dict:
        """The assistant message of a whole response: content (None when empty and
        tools were called, as OpenAI does), reasoning_content (None when there is none)
        and tool_calls (present only when there are some)."""
        think, calls = self._make()
        reasoning, content = think.parse(text)
        tool_calls: list[ToolCall] = []
        if calls is not None:
            content, tool_calls = calls.parse(content)
        msg = {"role": "assistant",
               "content": None if tool_calls and not content else content,
               "reasoning_content": reasoning or None}
        if tool_calls:
            msg["tool_calls"] = [c.as_openai() for c in tool_calls]
        return msg

    def _route(self, deltas: list[dict], final: bool) -> list[dict]:
        out: list[dict] = []
        for d in deltas:
            if "content" in d and self._calls is not None:
                out += self._calls.feed(d["content"])
            else:
                out.append(d)
        if final and self._calls is not None:
            out += self._calls.finish()
        self.tool_calls_seen = self.tool_calls_seen or any("tool_calls" in d for d in out)
        return out


def fold(deltas: list[dict]) -> dict:
    """Streamed deltas folded the way a client does (for tests and logs)."""
    content, calls = collect_deltas([d for d in deltas if "reasoning_content" not in d])
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    msg = {"role": "assistant", "content": None if calls and not content else content,
           "reasoning_content": reasoning or None}
    if calls:
        msg["tool_calls"] = [c.as_openai() for c in calls]
    return msg
