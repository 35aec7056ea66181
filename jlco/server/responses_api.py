"""POST /v1/responses (OpenAI's Responses API, what coding agents speak) as an adapter
over POST /v1/chat/completions: the Responses body becomes a chat body (input items as
messages, `instructions` a system message in front, flat function tools nested as chat
has them, `text.format` as `response_format`, `max_output_tokens` as
`max_completion_tokens`), the chat route's own handler serves it, and its whole JSON or
SSE chunks are reshaped (`responses_events`). One generation path: every check, limit,
metric and abort of the chat route holds here too, and its refusals come back with the
Responses field names.

`store` (default true, as OpenAI's) keeps the response in the server's bounded
in-memory store (`response_store`): `previous_response_id` puts its conversation in
front of the new input, GET / DELETE /v1/responses/{id} read and drop it. Fields jlco
cannot honour are refused by name unless their value asks for nothing, as on the other
routes.
"""

from __future__ import annotations

import json
import time
from typing import Any, Awaitable, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from jlco.server import schema
from jlco.server.protocol import ApiError, asks_nothing, bad, parse_json
from jlco.server.response_store import ResponseStore, as_items
from jlco.server.responses_events import (EventStream, envelope, events, from_chat, new_id,
                                          status_of)

# Responses fields the chat route reads under the same name and checks itself.
PASSED = {"model", "temperature", "top_p", "parallel_tool_calls", "stream",
          "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "stop"}
TRANSLATED = {"input", "instructions", "max_output_tokens", "tools", "tool_choice",
              "text", "reasoning", "store", "previous_response_id", "include",
              "stream_options"}
FREE = {"user", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"}
# Accepted only at values that ask for nothing.
NOOP = {"truncation": (None, "disabled"), "background": (None, False),
        "max_tool_calls": (None,), "top_logprobs": (None, 0), "conversation": (None,),
        "prompt": (None,)}
FIELDS = PASSED | TRANSLATED | FREE | set(NOOP)
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
INCLUDABLE = ("reasoning.encrypted_content",)   # asks for nothing jlco would send


class ResponsesBody(BaseModel):
    """What /openapi.json declares for POST /v1/responses (`translate` decides)."""
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = Field(None, description="the served model's id (or leave it out)")
    input: Union[str, list[dict]] = Field(..., description="text, or a list of message, "
                                          "function_call, function_call_output, reasoning items")
    instructions: Optional[str] = Field(None, description="a system message in front")
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    tools: Optional[list[dict]] = Field(None, description="[{\"type\": \"function\", "
                                        "\"name\", \"description\", \"parameters\", \"strict\"}]")
    tool_choice: Union[str, dict, None] = Field(None, description="none, auto, required or "
                                                "{\"type\": \"function\", \"name\"}")
    parallel_tool_calls: Optional[bool] = None
    stream: Optional[bool] = None
    stream_options: Optional[dict] = Field(None, description="{\"include_obfuscation\"}: "
                                           "ignored")
    store: Optional[bool] = Field(None, description="default true: kept in the server's "
                                  "bounded in-memory store (lost in a restart)")
    previous_response_id: Optional[str] = Field(None, description="a stored response: its "
                                                "conversation goes in front of input")
    text: Optional[dict] = Field(None, description="{\"format\": {\"type\": \"text\" | "
                                 "\"json_object\" | \"json_schema\", ...}}")
    reasoning: Optional[dict] = Field(None, description="{\"effort\"}: the chat's "
                                      "reasoning_effort; summary ignored")
    include: Optional[list[str]] = Field(None, description="[] or "
                                         "[\"reasoning.encrypted_content\"] (ignored)")
    user: Optional[str] = None
    metadata: Optional[dict] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    truncation: Optional[str] = Field(None, json_schema_extra={"enum": [None, "disabled"]})
    background: Optional[bool] = Field(None, json_schema_extra={"enum": [None, False]})
    max_tool_calls: Any = Field(None, json_schema_extra={"enum": [None]})
    top_logprobs: Optional[int] = Field(None, json_schema_extra={"enum": [None, 0]})
    conversation: Any = Field(None, json_schema_extra={"enum": [None]})
    prompt: Any = Field(None, json_schema_extra={"enum": [None]})
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 32)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2)
    logit_bias: Optional[dict[str, float]] = None
    stop: Union[str, list[str], None] = None


def register(app: FastAPI, chat: Callable[[Request], Awaitable[Any]]) -> None:
    """Serve POST /v1/responses on `app` through `chat`, the chat completions handler
    (passed in, not imported: the app module imports this one), and GET / DELETE
    /v1/responses/{id} over the app's `ResponseStore` (`app.state.responses`)."""
    app.state.responses = ResponseStore(registry=app.state.metrics.registry)

    async def responses(request: Request):
        return await create(request, chat)
    extra = schema.route_extra(ResponsesBody)
    extra["responses"]["200"] = {"description": "the response object, or with stream: "
                                 "the Responses events", "content": {
        "application/json": {"schema": {"type": "object"}},
        "text/event-stream": {"schema": {
            "type": "object", "description": "one event: `event` its type, `data` its JSON",
            "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}}}}
    app.post("/v1/responses", openapi_extra=extra)(responses)
    none = schema.route_extra(None)
    app.get("/v1/responses/{response_id}", openapi_extra=none)(retrieve)
    app.delete("/v1/responses/{response_id}", openapi_extra=none)(delete)


async def retrieve(request: Request, response_id: str):
    """GET /v1/responses/{id}: the stored response object."""
    return request.app.state.responses.get(response_id).response


async def delete(request: Request, response_id: str):
    """DELETE /v1/responses/{id}: drop a stored response."""
    request.app.state.responses.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def refuse_unknown(body: dict, fields: set[str], noop: dict[str, tuple]) -> None:
    """A field outside `fields` is refused by name, as is a `noop` field at a value that
    asks for something (allowed: its tuple's values, or leaving it out)."""
    for name, v in body.items():
        if name in noop:
            if not asks_nothing(v, noop[name]):
                allowed = " or ".join(json.dumps(a) for a in noop[name])
                raise bad(name, f"{json.dumps(v)[:60]} is not supported by jlco (allowed: "
                                f"{allowed}, or leave it out)")
        elif name not in fields:
            raise bad(name, "unknown field")


def tool_list(v: Any, keys: set[str], usage: str) -> list[dict] | None:
    """A client's `tools`: None, or a list of objects with no key outside `keys` (one
    outside is refused by name; `usage` says what a tool looks like)."""
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise bad("tools", f"allowed a list of {usage}")
    for i, t in enumerate(v):
        extra = set(t) - keys
        if extra:
            raise bad(f"tools[{i}].{sorted(extra)[0]}", "unknown field")
    return v


def _check_fields(body: dict) -> None:
    refuse_unknown(body, FIELDS, NOOP)
    if not isinstance(body.get("store"), (bool, type(None))):
        raise bad("store", "allowed true or false (default true: kept in memory)")
    inc = body.get("include")
    if inc is not None and (not isinstance(inc, list) or any(
            not isinstance(i, str) or i not in INCLUDABLE for i in inc)):
        raise bad("include", f"allowed a list of {list(INCLUDABLE)} (or leave it out)")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_obfuscation"}):
        raise bad("stream_options", "allowed {\"include_obfuscation\": bool} (ignored)")


def _text(v: Any, field: str, parts: tuple[str, ...]) -> str:
    """A content: a string, or a list of text parts of the types in `parts`, joined."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") in parts
                                   and isinstance(p.get("text"), str) for p in v):
        return "".join(p["text"] for p in v)
    kinds = " or ".join(parts)
    raise bad(field, f"allowed a string or a list of {{\"type\": {kinds}, \"text\"}} parts "
                     "(jlco serves text only)")


def _need_str(item: dict, key: str, field: str) -> str:
    if not isinstance(item.get(key), str):
        raise bad(f"{field}.{key}", "required: a string")
    return item[key]


def _item(item: Any, field: str, msgs: list[dict], origin: list[str]) -> None:
    """One input item onto the chat messages. function_call items join the assistant
    turn before them (text, then calls: one chat turn); reasoning items are dropped
    (chat templates render no past turn's reasoning)."""
    if not isinstance(item, dict):
        raise bad(field, "allowed an input item object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(f"{field}.role", f"allowed one of {sorted(ROLES)}")
        text = _text(item.get("content"), f"{field}.content",
                     ("input_text", "output_text", "text"))
        msgs.append({"role": ROLES[role], "content": text})
    elif kind == "function_call":
        call = {"id": _need_str(item, "call_id", field), "type": "function",
                "function": {"name": _need_str(item, "name", field),
                             "arguments": _need_str(item, "arguments", field)}}
        if msgs and msgs[-1]["role"] == "assistant":
            msgs[-1].setdefault("tool_calls", []).append(call)
            return
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        msgs.append({"role": "tool", "tool_call_id": _need_str(item, "call_id", field),
                     "content": _text(item.get("output"), f"{field}.output",
                                      ("input_text", "output_text", "text"))})
    elif kind == "reasoning":
        return
    else:
        raise bad(f"{field}.type", "allowed message, function_call, function_call_output "
                                   "or reasoning (jlco serves function tools only)")
    origin.append(field)


def _messages(body: dict) -> tuple[list[dict], list[str]]:
    """`instructions` and `input` → chat messages, and the Responses field each came
    from (so a refusal of messages[i] names what the client sent)."""
    msgs: list[dict] = []
    origin: list[str] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "allowed a string")
        msgs.append({"role": "system", "content": instructions})
        origin.append("instructions")
    inp = body.get("input")
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
        origin.append("input")
    elif isinstance(inp, list) and inp:
        for i, item in enumerate(inp):
            _item(item, f"input[{i}]", msgs, origin)
    else:
        raise bad("input", "required: a string or a non-empty list of input items")
    return msgs, origin


def _tools(v: Any) -> list[dict] | None:
    """Flat Responses function tools → chat's {"type": "function", "function": {...}}."""
    tools = tool_list(v, {"type", "name", "description", "parameters", "strict"},
                      "{\"type\": \"function\", \"name\", ...}")
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise bad(f"tools[{i}].type", "allowed \"function\" (jlco serves function "
                                          "tools only)")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict")
              if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any) -> Any:
    if v is None or v in ("none", "auto", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function" and set(v) == {"type", "name"}:
        return {"type": "function", "function": {"name": v["name"]}}
    raise bad("tool_choice", "allowed \"none\", \"auto\", \"required\" or {\"type\": "
                             "\"function\", \"name\"}")


def _response_format(v: Any) -> dict | None:
    """`text` → the chat's response_format ({"format": ...}; verbosity only medium)."""
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) - {"format", "verbosity"}:
        raise bad("text", "allowed {\"format\": {...}}")
    if v.get("verbosity") not in (None, "medium"):
        raise bad("text.verbosity", "not supported by jlco (allowed: \"medium\")")
    fmt = v.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                            "json_schema"):
        raise bad("text.format", "allowed {\"type\": \"text\" | \"json_object\" | "
                                 "\"json_schema\", ...}")
    if fmt["type"] != "json_schema":
        if set(fmt) != {"type"}:
            raise bad("text.format", f"{fmt['type']} takes no other field")
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items()
                                                   if k != "type"}}


def translate(body: dict) -> tuple[dict, dict, list[str]]:
    """A Responses body → (the chat body, the request parameters the response echoes,
    the Responses field behind each chat message)."""
    _check_fields(body)
    msgs, origin = _messages(body)
    chat: dict[str, Any] = {k: body[k] for k in PASSED if k in body}
    chat["messages"] = msgs
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
    else:
        _tool_choice(body.get("tool_choice"))
        chat.pop("parallel_tool_calls", None)    # nothing to call in parallel
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary"}:
            raise bad("reasoning", "allowed {\"effort\", \"summary\"}")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}
    return chat, _echo(body), origin


def _echo(body: dict) -> dict:
    """The request parameters a `response` object carries (OpenAI's defaults when left
    out)."""
    g = body.get
    return {"model": g("model"), "instructions": g("instructions"),
            "max_output_tokens": g("max_output_tokens"),
            "temperature": 1.0 if g("temperature") is None else g("temperature"),
            "top_p": 1.0 if g("top_p") is None else g("top_p"),
            "tools": g("tools") or [], "tool_choice": g("tool_choice") or "auto",
            "parallel_tool_calls": g("parallel_tool_calls") is not False,
            "text": g("text") or {"format": {"type": "text"}},
            "reasoning": g("reasoning"), "store": g("store") is not False,
            "background": False, "previous_response_id": g("previous_response_id"),
            "truncation": "disabled",
            "metadata": g("metadata") or {}, "user": g("user"),
            "service_tier": g("service_tier"), "top_logprobs": g("top_logprobs"),
            "max_tool_calls": None, "prompt_cache_key": g("prompt_cache_key"),
            "safety_identifier": g("safety_identifier")}


# Chat field names → the Responses ones, for the chat route's refusals (longest first).
RENAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
           ("reasoning_effort", "reasoning.effort"), ("prompt", "input"))


def renamed(err: ApiError, origin: list[str], renames=RENAMES,
            whole: str = "input") -> ApiError:
    """The chat route's refusal, naming the field as the client sent it: `origin` the
    client's field behind each chat message, `renames` (chat name, client name) pairs,
    `whole` the client's name for the message list."""
    p = err.param or ""
    new = None
    if p.startswith("messages[") and "]" in p:
        i = p[len("messages["):p.index("]")]
        new = origin[int(i)] if i.isdigit() and int(i) < len(origin) else whole
    elif p == "messages":
        new = whole
    for old, name in renames:
        if new is None and (p == old or p.startswith(old + ".")):
            new = name + p[len(old):]
    if new is None:
        return err
    msg = new + err.message[len(p):] if err.message.startswith(p) else err.message
    return ApiError(err.status, msg, new)


def inner_request(request: Request, body: bytes) -> Request:
    """A request like `request` whose body is `body` (the chat body): the chat handler
    reads it, and its disconnect checks still hear the client's connection."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()
    return Request(request.scope, receive)


async def create(request: Request, chat: Callable[[Request], Awaitable[Any]]):
    """POST /v1/responses: translate (a stored conversation in front), serve through the
    chat handler, reshape; kept in the store unless `store` is false."""
    body = parse_json(await request.body())
    store: ResponseStore = request.app.state.responses
    full = body if body.get("previous_response_id") is None else store.chain(body)
    chat_body, echo, origin = translate(full)
    echo["model"] = request.app.state.jlco.model_name
    try:
        resp = await chat(inner_request(request, json.dumps(chat_body).encode()))
    except ApiError as err:
        raise renamed(err, origin) from None
    rid, created = new_id("resp"), int(time.time())
    keep = body.get("store") is not False
    if isinstance(resp, StreamingResponse):
        conv = EventStream(echo, rid, created)
        return StreamingResponse(_stored(events(resp.body_iterator, conv), conv,
                                         store if keep else None, full),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    if isinstance(resp, JSONResponse):
        if resp.status_code != 200:
            return resp
        resp = json.loads(resp.body)
    out = from_chat(resp, echo, rid, created)
    if keep:
        store.put(rid, out, as_items(full["input"]) + out["output"])
    return JSONResponse(out)


async def _stored(frames, conv: EventStream, store: ResponseStore | None, body: dict):
    """The event stream; at its end, the final response kept in `store` (unless None,
    or the stream failed or broke off)."""
    try:
        async for frame in frames:
            yield frame
    finally:
        await frames.aclose()       # the client left: the chat stream's requests end now
    if store is not None and conv.finish is not None and conv.error is None:
        final = envelope(conv.echo, conv.rid, conv.created, status_of(conv.finish),
                         conv.output, conv.use)
        store.put(conv.rid, final, as_items(body["input"]) + final["output"])
