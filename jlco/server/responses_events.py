"""The Responses API's output, built from the chat path's output: the `response` object
from a whole chat completion, and the Responses event stream from the chat SSE chunks.

POST /v1/responses is an adapter over /v1/chat/completions (`responses_api`), so one
generation path serves both; this module only reshapes. A chat message becomes output
items in OpenAI's order: a `reasoning` item (`reasoning_content`), a `message` item
(its text; also an empty one when there is nothing else, so a response always says
something), then one `function_call` item per `tool_calls` entry. Item statuses follow
one rule, whole or streamed: "completed", except the last item of a response the length
limit cut ("incomplete"), so a streamed response's final object equals the whole one.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, AsyncIterator


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage(u: dict | None) -> dict | None:
    """The chat usage in the Responses names (None: the chat sent none)."""
    if not u:
        return None
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": u.get("prompt_tokens", 0),
            "output_tokens": u.get("completion_tokens", 0),
            "total_tokens": u.get("total_tokens", 0),
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": reasoning}}


def status_of(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def envelope(echo: dict, rid: str, created: float, status: str, output: list | None = None,
             use: dict | None = None, error: dict | None = None) -> dict:
    """The `response` object: what was made, and the request's parameters echoed."""
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "output": list(output or []), "usage": use, **echo}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def message_item(iid: str, text: str | None, status: str) -> dict:
    """A message item; text None: just opened (no content part yet)."""
    return {"type": "message", "id": iid, "status": status, "role": "assistant",
            "content": [] if text is None else [output_text(text)]}


def reasoning_item(iid: str, text: str | None, status: str) -> dict:
    return {"type": "reasoning", "id": iid, "summary": [], "status": status,
            "content": [] if text is None else [reasoning_text(text)]}


def call_item(iid: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": iid, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _reasoning(m: dict) -> str:
    """The reasoning text of a chat message or delta (vLLM's `reasoning` too)."""
    return m.get("reasoning_content") or m.get("reasoning") or ""


def output_of(message: dict, finish: str | None) -> list[dict]:
    """A whole chat message → output items (the order and status rule above)."""
    out = []
    if _reasoning(message):
        out.append(reasoning_item(new_id("rs"), _reasoning(message), "completed"))
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    if text or not calls:
        out.append(message_item(new_id("msg"), text, "completed"))
    for c in calls:
        fn = c.get("function") or {}
        out.append(call_item(new_id("fc"), c.get("id") or new_id("call"),
                             fn.get("name", ""), fn.get("arguments", ""), "completed"))
    if out and finish == "length":
        out[-1]["status"] = "incomplete"
    return out


def from_chat(doc: dict, echo: dict, rid: str, created: float) -> dict:
    """A whole chat completion (one choice) → the `response` object."""
    choice = (doc.get("choices") or [{}])[0]
    finish = choice.get("finish_reason")
    return envelope(echo, rid, created, status_of(finish),
                    output_of(choice.get("message") or {}, finish), usage(doc.get("usage")))


class _Open:
    """An output item being streamed: its kind, id, place in the output, text so far."""

    def __init__(self, kind: str, iid: str, index: int, name: str = "", call_id: str = ""):
        self.kind, self.id, self.index = kind, iid, index
        self.name, self.call_id, self.text = name, call_id, ""


class EventStream:
    """Chat SSE chunks in, Responses events out (each an SSE frame `event:` + `data:`,
    numbered by `sequence_number`). A text item (reasoning, message) closes when another
    item opens; function calls stay open until the end, so fragments of several calls
    may interleave (they are told apart by the chat's `index`)."""

    def __init__(self, echo: dict, rid: str, created: float):
        self.echo, self.rid, self.created = echo, rid, created
        self.seq = 0
        self.output: list[dict] = []      # every item opened, in output order (final state)
        self.open: list[_Open] = []
        self.calls: dict[int, _Open] = {}   # chat tool-call index → its item
        self.finish: str | None = None
        self.use: dict | None = None
        self.error: dict | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        doc = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(doc)}\n\n".encode()

    def _response(self, status: str, error: dict | None = None) -> dict:
        return envelope(self.echo, self.rid, self.created, status, self.output, self.use,
                        error)

    def start(self) -> list[bytes]:
        resp = self._response("in_progress")
        return [self.event("response.created", response=resp),
                self.event("response.in_progress", response=resp)]

    def chunk(self, doc: dict) -> list[bytes]:
        """One chat chunk (or the chat stream's error object) → events."""
        if doc.get("error"):
            err = doc["error"]
            self.error = {"code": "server_error", "message": str(err.get("message", err))}
            return [self.event("error", code="server_error", message=self.error["message"],
                               param=err.get("param"))]
        if doc.get("usage"):
            self.use = usage(doc["usage"])
        out: list[bytes] = []
        for choice in doc.get("choices") or []:
            delta = choice.get("delta") or {}
            if _reasoning(delta):
                out += self._text("reasoning", _reasoning(delta))
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _add(self, item: dict, kind: str, **names: str) -> tuple[_Open, bytes]:
        it = _Open(kind, item["id"], len(self.output), **names)
        self.output.append(item)
        self.open.append(it)
        return it, self.event("response.output_item.added", output_index=it.index, item=item)

    def _text(self, kind: str, delta: str) -> list[bytes]:
        """A reasoning or content fragment: into the open item of its kind, or a new one
        (closing the open text item of the other kind)."""
        out: list[bytes] = []
        cur = next((o for o in self.open if o.kind == kind), None)
        if cur is None:
            out += self._close([o for o in self.open if o.kind != "call"], "completed")
            build, part = (reasoning_item, reasoning_text) if kind == "reasoning" \
                else (message_item, output_text)
            cur, added = self._add(build(new_id("rs" if kind == "reasoning" else "msg"),
                                         None, "in_progress"), kind)
            out += [added, self.event("response.content_part.added", item_id=cur.id,
                                      output_index=cur.index, content_index=0,
                                      part=part(""))]
        if not delta:
            return out
        cur.text += delta
        where = dict(item_id=cur.id, output_index=cur.index, content_index=0, delta=delta)
        if kind == "reasoning":
            return out + [self.event("response.reasoning_text.delta", **where)]
        return out + [self.event("response.output_text.delta", logprobs=[], **where)]

    def _call(self, call: dict) -> list[bytes]:
        """A streamed `delta.tool_calls` fragment: the first of its index opens a
        function_call item, the arguments are deltas."""
        out: list[bytes] = []
        fn = call.get("function") or {}
        index = call.get("index", len(self.calls))
        cur = self.calls.get(index)
        if cur is None:
            out += self._close([o for o in self.open if o.kind != "call"], "completed")
            call_id = call.get("id") or new_id("call")
            cur, added = self._add(call_item(new_id("fc"), call_id, fn.get("name") or "", "",
                                             "in_progress"), "call", name=fn.get("name") or "",
                                   call_id=call_id)
            self.calls[index] = cur
            out.append(added)
        elif fn.get("name"):
            cur.name += fn["name"]
        if fn.get("arguments"):
            cur.text += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=cur.id,
                                  output_index=cur.index, delta=fn["arguments"]))
        return out

    def _close(self, items: list[_Open], status: str) -> list[bytes]:
        out: list[bytes] = []
        for it in items:
            self.open.remove(it)
            where = dict(item_id=it.id, output_index=it.index)
            if it.kind == "call":
                item = call_item(it.id, it.call_id, it.name, it.text, status)
                out.append(self.event("response.function_call_arguments.done",
                                      arguments=it.text, name=it.name, **where))
            else:
                reasoning = it.kind == "reasoning"
                part = (reasoning_text if reasoning else output_text)(it.text)
                item = (reasoning_item if reasoning else message_item)(it.id, it.text, status)
                done = dict(text=it.text, content_index=0, **where)
                out.append(self.event("response.reasoning_text.done", **done) if reasoning
                           else self.event("response.output_text.done", logprobs=[], **done))
                out.append(self.event("response.content_part.done", content_index=0,
                                      part=part, **where))
            self.output[it.index] = item
            out.append(self.event("response.output_item.done", output_index=it.index,
                                  item=item))
        return out

    def end(self) -> list[bytes]:
        """The chat stream ended: close what is open; the final event (nothing when the
        stream broke off without a finish, i.e. the client went away)."""
        if self.error is not None:
            return [self.event("response.failed", response=self._response(
                "failed", self.error))]
        if self.finish is None:
            return []
        out: list[bytes] = []
        if not any(o["type"] in ("message", "function_call") for o in self.output):
            out += self._text("message", "")
        status = status_of(self.finish)
        for it in sorted(self.open, key=lambda o: o.index):
            last = it.index == len(self.output) - 1
            out += self._close([it], status if last else "completed")
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self.event(kind, response=self._response(status))]


async def events(chunks: AsyncIterator[bytes], conv: EventStream) -> AsyncIterator[bytes]:
    """The chat route's SSE body (`data: {json}` frames, then `data: [DONE]`) → the
    Responses events; closing this closes the chat stream (its requests are aborted)."""
    for e in conv.start():
        yield e
    buf = b""
    try:
        async for part in chunks:
            buf += part if isinstance(part, bytes) else part.encode()
            while b"\n\n" in buf:
                frame, buf = buf.split(b"\n\n", 1)
                data = b"".join(line[5:].strip() for line in frame.split(b"\n")
                                if line.startswith(b"data:"))
                if data and data != b"[DONE]":
                    for e in conv.chunk(json.loads(data)):
                        yield e
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
    for e in conv.end():
        yield e
