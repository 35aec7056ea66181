"""The Messages API's output, built from the chat path's output: the `message` object from
a whole chat completion, and Anthropic's event stream from the chat SSE chunks.

POST /v1/messages is an adapter over /v1/chat/completions (`messages`); this module only
reshapes. A chat message becomes content blocks in Anthropic's order: a `thinking` block
(`reasoning_content`), a `text` block, then one `tool_use` block per call. finish_reason
maps to stop_reason: stop → end_turn (stop_sequence when a stop string matched, named in
`stop_sequence`), tool_calls → tool_use, length → max_tokens.

Streamed: `message_start`, then per block `content_block_start`, its deltas
(`thinking_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`, one block
open at a time (a call's fragments follow each other, as the chat route streams them),
then `message_delta` (stop_reason and the usage) and `message_stop`. The chat stream
tells the prompt's size only at its end, so `message_start` carries input_tokens 0 and
`message_delta` the real counts (the SDK's stream helper takes them from there).
"""

from __future__ import annotations

import json
from typing import Any

from jlco.server.responses_events import new_id

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens",
                "abort": "end_turn"}


def usage(u: dict | None) -> dict:
    """The chat usage in Anthropic's names: input_tokens are the uncached ones."""
    u = u or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": u.get("prompt_tokens", 0) - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": u.get("completion_tokens", 0)}


def stop_of(finish: str | None, matched: Any) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish_reason and its stop_reason (the
    stop string that matched, or a stop token id)."""
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(finish, finish), None


def _input(arguments: str) -> dict | None:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def content_of(message: dict) -> list[dict]:
    """A whole chat message → content blocks. A call whose arguments are no JSON object
    (a reply cut by max_tokens) stays text, so nothing generated is lost."""
    out: list[dict] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        out.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content") or ""
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function") or {}
        args = _input(fn.get("arguments", ""))
        if args is None:
            text += fn.get("arguments", "")
        else:
            calls.append({"type": "tool_use", "id": c.get("id") or new_id("toolu"),
                          "name": fn.get("name", ""), "input": args})
    if text:
        out.append({"type": "text", "text": text})
    return out + calls


def message(mid: str, model: str, content: list, stop: tuple, use: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": use}


def from_chat(doc: dict, model: str, mid: str) -> dict:
    """A whole chat completion (one choice) → the `message` object."""
    choice = (doc.get("choices") or [{}])[0]
    return message(mid, model, content_of(choice.get("message") or {}),
                   stop_of(choice.get("finish_reason"), choice.get("stop_reason")),
                   usage(doc.get("usage")))


class MessageEvents:
    """Chat SSE chunks in, Anthropic events out (each an SSE frame `event:` + `data:`);
    the `start` / `chunk` / `end` interface that `responses_events.events` drives."""

    def __init__(self, model: str, mid: str):
        self.model, self.mid = model, mid
        self.index = -1                  # the open block's index (-1: none yet)
        self.kind: str | None = None     # the open block's kind; a call: ("call", index)
        self.finish: str | None = None
        self.matched: Any = None
        self.use: dict | None = None
        self.failed = False

    @staticmethod
    def event(kind: str, **fields: Any) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()

    def start(self) -> list[bytes]:
        return [self.event("message_start", message=message(
            self.mid, self.model, [], (None, None), usage(None)))]

    def chunk(self, doc: dict) -> list[bytes]:
        """One chat chunk (or the chat stream's error object) → events."""
        if doc.get("error"):
            self.failed = True
            err = doc["error"]
            return [self.event("error", error={"type": "api_error", "message": str(
                err.get("message", err) if isinstance(err, dict) else err)})]
        if doc.get("usage"):
            self.use = doc["usage"]
        out: list[bytes] = []
        for choice in doc.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                out += self._block("thinking", {"type": "thinking", "thinking": "",
                                                "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            if delta.get("content"):
                out += self._block("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish, self.matched = choice["finish_reason"], choice.get("stop_reason")
        return out

    def _block(self, kind: Any, block: dict) -> list[bytes]:
        """Open a block of `kind` unless it is the open one (closing that)."""
        if self.kind == kind:
            return []
        out = self._close()
        self.index += 1
        self.kind = kind
        return out + [self.event("content_block_start", index=self.index,
                                 content_block=block)]

    def _delta(self, delta: dict) -> bytes:
        return self.event("content_block_delta", index=self.index, delta=delta)

    def _call(self, call: dict) -> list[bytes]:
        fn = call.get("function") or {}
        out = self._block(("call", call.get("index", 0)), {
            "type": "tool_use", "id": call.get("id") or new_id("toolu"),
            "name": fn.get("name") or "", "input": {}})
        if fn.get("arguments"):
            out.append(self._delta({"type": "input_json_delta",
                                    "partial_json": fn["arguments"]}))
        return out

    def _close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [self.event("content_block_stop", index=self.index)]

    def end(self) -> list[bytes]:
        """The chat stream ended: close the open block, then message_delta and
        message_stop (nothing when it broke off: failed, or the client went away)."""
        if self.failed or self.finish is None:
            return []
        reason, seq = stop_of(self.finish, self.matched)
        return self._close() + [
            self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                       usage=usage(self.use)),
            self.event("message_stop")]
