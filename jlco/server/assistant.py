"""The chat side of a completion: the prompt a chat renders to, and the assistant message
its generated text becomes.

Prompt: the checkpoint's chat template (Jinja) with the request's tools and
chat_template_kwargs; a `deepseek_v32` checkpoint without one gets DeepSeek-V3.2's own
encoding (`jlco.chat.deepseek_v32`, as vLLM's `deepseek_v32` tokenizer mode does).

Message (`Shaper`, one per choice, fed the decoded text as it comes):
  plain   content only (no tools; tool_choice "none");
  named   tool_choice names a function: the text is its arguments (decoded under their
          JSON schema, `jlco.structured.tools`), streamed as argument fragments;
  required  the text is a JSON array of {"name", "parameters"} (decoded under its
          schema), turned into calls when it is complete;
  auto    the model's own tool-call and thinking syntax (`jlco.chat.output.ChatOutput`,
          the parser chosen from the checkpoint's model_type).
A message with calls has `content` null and ends with finish_reason "tool_calls".
"""

from __future__ import annotations

import json
import secrets

from jlco.chat import deepseek_v32, reasoning
from jlco.chat.output import ChatOutput
from jlco.server.protocol import ApiError, SamplingRequest
from jlco.server.text import render_chat


def chat_prompt(codec, model_type: str, messages: list[dict], add_gen: bool,
                p: SamplingRequest) -> str:
    """The prompt text of a chat, or a 400 naming what is wrong."""
    tools = None if p.tools is None else list(p.tools.tools)
    try:
        if codec is not None and codec.chat_template is not None:
            return render_chat(codec.chat_template, messages, add_generation_prompt=add_gen,
                               bos_token=getattr(codec, "bos_token", None) or "",
                               eos_token=getattr(codec, "eos_token", None) or "",
                               tools=tools, **p.template_kwargs)
        if codec is not None and model_type == "deepseek_v32":
            thinking = reasoning.thinking_from_kwargs(p.template_kwargs, default=False)
            return deepseek_v32.encode_messages(messages, tools=tools, thinking=thinking)
    except ValueError as err:
        raise ApiError(400, f"messages: {err}", "messages") from None
    raise ApiError(400, "this model has no chat template (the checkpoint's "
                        "tokenizer_config.json carries none): use /v1/completions",
                   "messages")


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class Shaper:
    """Plain text: every piece is content."""
    tool_calls_seen = False

    def reasoning_tokens(self, token_ids) -> int:
        """Generated tokens inside the thinking block (usage's reasoning_tokens)."""
        return 0

    def feed(self, text: str) -> list[dict]:
        return [{"content": text}] if text else []

    def finish(self) -> list[dict]:
        return []

    def message(self, text: str) -> dict:
        return {"role": "assistant", "content": text}


class NamedShaper(Shaper):
    """tool_choice names `name`: the text is one call's arguments."""
    tool_calls_seen = True

    def __init__(self, name: str):
        self.name, self.id, self.started = name, _call_id(), False

    def _head(self) -> dict:
        self.started = True
        return {"index": 0, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": ""}}

    def feed(self, text: str) -> list[dict]:
        out = [] if self.started else [{"tool_calls": [self._head()]}]
        if text:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def finish(self) -> list[dict]:
        return [] if self.started else [{"tool_calls": [self._head()]}]

    def message(self, text: str) -> dict:
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": text}}]}


class RequiredShaper(Shaper):
    """tool_choice "required": the text is a JSON array of calls, sent when complete
    (text that does not parse, a reply cut by max_tokens, stays content)."""

    def __init__(self):
        self.text, self.calls = [], None

    def feed(self, text: str) -> list[dict]:
        self.text.append(text)
        return []

    def _parse(self, text: str) -> list[dict] | None:
        try:
            calls = json.loads(text)
        except ValueError:
            return None
        if self.calls is None:
            self.calls = [{"id": _call_id(), "type": "function", "function": {
                "name": c["name"], "arguments": json.dumps(c["parameters"])}} for c in calls]
        return self.calls

    @property
    def tool_calls_seen(self) -> bool:
        return bool(self.calls)

    def finish(self) -> list[dict]:
        text = "".join(self.text)
        calls = self._parse(text)
        if calls is None:
            return [{"content": text}] if text else []
        return [{"tool_calls": [dict(c, index=i)]} for i, c in enumerate(calls)]

    def message(self, text: str) -> dict:
        calls = self._parse(text)
        if calls is None:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": None, "tool_calls": calls}


class ParsedShaper(Shaper):
    """The model's own syntax: thinking to reasoning_content, its tool calls parsed."""

    def __init__(self, model_type: str, prompt: str, tools, codec=None, formats=(None, None)):
        self.out = ChatOutput(model_type, prompt, tools, tool_format=formats[0],
                              reasoning_format=formats[1])
        self.opens = reasoning.prompt_opens_thinking(prompt)
        tok = getattr(codec, "tokenizer", None)
        self.delims = None if tok is None else (tok.token_to_id(reasoning.THINK_START),
                                                tok.token_to_id(reasoning.THINK_END))

    def reasoning_tokens(self, token_ids) -> int:
        if self.delims is None or None in self.delims:
            return 0
        return reasoning.count_reasoning_tokens(token_ids, *self.delims, self.opens)

    @property
    def tool_calls_seen(self) -> bool:
        return self.out.tool_calls_seen

    def feed(self, text: str) -> list[dict]:
        return self.out.feed(text)

    def finish(self) -> list[dict]:
        return self.out.finish()

    def message(self, text: str) -> dict:
        return self.out.message(text)


def shaper_for(p: SamplingRequest, model_type: str, prompt: str, codec=None,
               formats=(None, None)) -> Shaper:
    """The shaper of one chat choice (`codec`: the served tokenizer, for the thinking
    delimiters' ids; `formats`: the tool-call and reasoning syntaxes when not the
    checkpoint's)."""
    t = p.tools
    if t is not None and t.named is not None:
        return NamedShaper(t.named)
    if t is not None and t.choice == "required":
        return RequiredShaper()
    thinking = reasoning.prompt_opens_thinking(prompt)
    if (t is not None and t.choice == "auto") or thinking:
        try:
            return ParsedShaper(model_type, prompt, None if t is None else list(t.tools),
                                codec, formats)
        except ValueError:      # a family without a parser: its text is content
            return Shaper()
    return Shaper()
