"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, what Claude
Code and the `anthropic` SDK speak) as an adapter over POST /v1/chat/completions, as
`responses_api` is for OpenAI's Responses: the Messages body becomes a chat body
(`system` a system message in front, `tool_use` blocks an assistant turn's `tool_calls`,
`tool_result` blocks `role: "tool"` messages, `input_schema` tools as chat functions,
`tool_choice` any → "required", `stop_sequences` → `stop`, `thinking` → the chat's
reasoning_effort), the chat route's own handler serves it, and its whole JSON or SSE
chunks are reshaped (`messages_events`). So the tool schemas constrain decoding, stop
strings cut the text and the model's thinking is parsed exactly as on the chat route.

Errors come back in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`,
for every status on these paths (the auth check's 401 included: `anthropic_errors`);
`x-api-key` is taken wherever `Authorization: Bearer` is. Fields jlco cannot honour
(images, documents, server tools, MCP servers, containers) are refused by name.
`usage.input_tokens` counts the prompt tokens the prefix cache did not give;
`cache_read_input_tokens` those it did (Anthropic's split: the prompt is their sum).
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from jlco.server import schema
from jlco.server.assistant import chat_prompt
from jlco.server.messages_events import MessageEvents, from_chat
from jlco.server.protocol import ApiError, bad, parse_chat, parse_json
from jlco.server.responses_api import inner_request, refuse_unknown, renamed, tool_list
from jlco.server.responses_events import events, new_id

PASSED = {"model", "max_tokens", "temperature", "top_p", "top_k", "stream"}
TRANSLATED = {"messages", "system", "stop_sequences", "tools", "tool_choice", "thinking",
              "output_config"}
# Informational, or asking for what jlco does anyway (cache_control: the prefix cache
# keeps every prompt's pages without marks).
FREE = {"metadata", "cache_control", "user_profile_id", "workspace_id"}
# Accepted only at values that ask for nothing.
NOOP = {"service_tier": (None, "auto", "standard_only"), "container": (None,),
        "mcp_servers": (None,), "context_management": (None,), "speed": (None, "standard"),
        "inference_geo": (None,), "diagnostics": (None,)}
FIELDS = PASSED | TRANSLATED | FREE | set(NOOP)
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking",
                "output_config", "cache_control", "mcp_servers", "context_management"}
DROPPED_BLOCKS = ("thinking", "redacted_thinking")   # past reasoning: templates drop it
# Chat field names → the Messages ones, for the chat route's refusals (longest first).
RENAMES = (("response_format.json_schema", "output_config.format"),
           ("response_format", "output_config.format"),
           ("max_completion_tokens", "max_tokens"), ("reasoning_effort", "thinking"),
           ("stop", "stop_sequences"), ("prompt", "messages"))
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
PATHS = ("/v1/messages", "/v1/messages/count_tokens")


class MessagesBody(BaseModel):
    """What /openapi.json declares for POST /v1/messages (`translate` decides)."""
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = Field(None, description="the served model's id")
    messages: list[dict] = Field(..., min_length=1, description="{\"role\": \"user\" | "
                                 "\"assistant\", \"content\": text or text, tool_use, "
                                 "tool_result, thinking blocks}")
    max_tokens: int = Field(..., ge=1)
    system: Union[str, list[dict], None] = Field(None, description="text or text blocks")
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    stream: Optional[bool] = None
    tools: Optional[list[dict]] = Field(None, description="[{\"name\", \"description\", "
                                        "\"input_schema\"}] (custom tools only)")
    tool_choice: Optional[dict] = Field(None, description="{\"type\": \"auto\" | \"any\" | "
                                        "\"none\"} or {\"type\": \"tool\", \"name\"}")
    thinking: Optional[dict] = Field(None, description="{\"type\": \"enabled\", "
                                     "\"budget_tokens\"}, {\"type\": \"adaptive\"} or "
                                     "{\"type\": \"disabled\"}")
    output_config: Optional[dict] = Field(None, description="{\"format\": {\"type\": "
                                          "\"json_schema\", \"schema\"}}")
    metadata: Optional[dict] = None
    cache_control: Optional[dict] = Field(None, description="accepted, ignored: the prefix "
                                          "cache needs no marks")
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None
    speed: Optional[str] = Field(None, json_schema_extra={"enum": [None, "standard"]})
    inference_geo: Any = Field(None, json_schema_extra={"enum": [None]})
    diagnostics: Any = Field(None, json_schema_extra={"enum": [None]})
    service_tier: Optional[str] = Field(None, json_schema_extra={
        "enum": [None, "auto", "standard_only"]})
    container: Any = Field(None, json_schema_extra={"enum": [None]})
    mcp_servers: Any = Field(None, json_schema_extra={"enum": [None]})
    context_management: Any = Field(None, json_schema_extra={"enum": [None]})


class CountTokensBody(BaseModel):
    """POST /v1/messages/count_tokens: the prompt part of a Messages body."""
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    messages: list[dict] = Field(..., min_length=1)
    system: Union[str, list[dict], None] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[dict] = None
    thinking: Optional[dict] = None
    output_config: Optional[dict] = None
    cache_control: Optional[dict] = None
    mcp_servers: Any = Field(None, json_schema_extra={"enum": [None]})
    context_management: Any = Field(None, json_schema_extra={"enum": [None]})


def register(app: FastAPI, chat: Callable[[Request], Awaitable[Any]]) -> None:
    """Serve the Messages routes on `app` through `chat`, the chat completions handler
    (passed in: the app module imports this one)."""
    async def create_message(request: Request):
        return await create(request, chat)
    extra = _error_schemas(schema.route_extra(MessagesBody))
    extra["responses"]["200"] = {"description": "the message, or with stream: the "
                                 "Messages events", "content": {
        "application/json": {"schema": {"type": "object"}},
        "text/event-stream": {"schema": {"type": "string"}}}}
    app.post("/v1/messages", openapi_extra=extra)(create_message)
    app.post("/v1/messages/count_tokens",
             openapi_extra=_error_schemas(schema.route_extra(CountTokensBody)))(count_tokens)
    app.middleware("http")(anthropic_errors)


ERROR_SCHEMA = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"},
    "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"enum": sorted(set(ERROR_TYPES.values()))},
        "message": {"type": "string"}}}}}


def _error_schemas(extra: dict) -> dict:
    """`route_extra`'s error responses in Anthropic's shape (what these routes send)."""
    for resp in extra["responses"].values():
        resp["content"] = {"application/json": {"schema": ERROR_SCHEMA}}
    return extra


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


async def anthropic_errors(request: Request, call_next):
    """`x-api-key: KEY` counts as `Authorization: Bearer KEY` (on every route); on the
    Messages paths an error response (any status, whoever made it) is Anthropic's shape."""
    key = request.headers.get("x-api-key")
    if key and "authorization" not in request.headers:
        request.scope["headers"] = [*request.scope["headers"],
                                    (b"authorization", f"Bearer {key}".encode())]
    resp = await call_next(request)
    if request.url.path not in PATHS or resp.status_code < 400:
        return resp
    raw = b"".join([part async for part in resp.body_iterator])
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode(errors="replace") or f"HTTP {resp.status_code}"
    headers = {k: v for k, v in resp.headers.items()
               if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(error_body(resp.status_code, message), status_code=resp.status_code,
                        headers=headers)


def _check_fields(body: dict, fields: set[str]) -> None:
    refuse_unknown(body, fields, NOOP)
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or set(meta) - {"user_id"}):
        raise bad("metadata", "allowed {\"user_id\": str} (informational)")


def _text(v: Any, field: str) -> str:
    """A text content: a string, or text blocks joined (cache_control and citations are
    accepted and ignored: the prefix cache needs no marks)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        out = []
        for i, b in enumerate(v):
            if not isinstance(b, dict) or b.get("type") != "text" or \
                    not isinstance(b.get("text"), str):
                kind = b.get("type") if isinstance(b, dict) else None
                raise bad(f"{field}[{i}]", f"{json.dumps(kind)} blocks are not supported "
                                           "here: allowed {\"type\": \"text\", \"text\"} "
                                           "(jlco serves text only)")
            out.append(b["text"])
        return "".join(out)
    raise bad(field, "allowed a string or a list of {\"type\": \"text\", \"text\"} blocks")


def _blocks(content: list, field: str):
    """(field of block i, its type, the block) for each block of a turn's content."""
    for i, b in enumerate(content):
        yield f"{field}[{i}]", b.get("type") if isinstance(b, dict) else None, b


def _assistant(content: Any, field: str) -> dict:
    """An assistant turn: its text and tool_use blocks as one chat message (thinking
    blocks dropped)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad(field, "allowed a string or a list of content blocks")
    text, calls = [], []
    for where, kind, b in _blocks(content, field):
        if kind == "text":
            text.append(_text([b], field))
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or \
                    not isinstance(b.get("input"), dict):
                raise bad(where, "a tool_use block needs id (str), name (str), input (object)")
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b["input"])}})
        elif kind not in DROPPED_BLOCKS:
            raise bad(f"{where}.type", "allowed text, tool_use, thinking or "
                                       "redacted_thinking in an assistant turn")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or
                           (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(content: Any, field: str, msgs: list[dict], origin: list[str]) -> None:
    """A user turn: each tool_result a `tool` message, then its text as a user message."""
    if isinstance(content, str):
        msgs.append({"role": "user", "content": content})
        origin.append(field)
        return
    if not isinstance(content, list) or not content:
        raise bad(field, "allowed a string or a non-empty list of content blocks")
    text = []
    for where, kind, b in _blocks(content, field):
        if kind == "text":
            text.append(_text([b], field))
        elif kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad(f"{where}.tool_use_id", "required: a string")
            out = _text(b.get("content", ""), f"{where}.content")
            if b.get("is_error"):
                out = f"Error: {out}"
            msgs.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": out})
            origin.append(where)
        else:
            raise bad(f"{where}.type", "allowed text or tool_result in a user turn (jlco "
                                       "serves text only)")
    if text:
        msgs.append({"role": "user", "content": "".join(text)})
        origin.append(field)


def _messages(body: dict) -> tuple[list[dict], list[str]]:
    """`system` and `messages` → chat messages, and the Messages field each came from."""
    msgs: list[dict] = []
    origin: list[str] = []
    if body.get("system") is not None:
        msgs.append({"role": "system", "content": _text(body["system"], "system")})
        origin.append("system")
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise bad("messages", "required: a non-empty list of {\"role\", \"content\"}")
    for i, m in enumerate(turns):
        field = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            _user(m.get("content"), f"{field}.content", msgs, origin)
        elif role == "assistant":
            msgs.append(_assistant(m.get("content"), f"{field}.content"))
            origin.append(field)
        else:
            raise bad(f"{field}.role", "allowed \"user\" or \"assistant\" (the system "
                                       "prompt goes in `system`)")
    return msgs, origin


def _tools(v: Any) -> list[dict] | None:
    """Anthropic's custom tools → chat functions (server tools refused by name)."""
    tools = tool_list(v, {"type", "name", "description", "input_schema", "cache_control"},
                      "{\"name\", \"description\", \"input_schema\"}")
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type", "custom") != "custom":
            raise bad(f"tools[{i}].type", f"{json.dumps(t['type'])} is not supported by jlco "
                                          "(allowed \"custom\": client tools with an "
                                          "input_schema)")
        if not isinstance(t.get("input_schema"), dict):
            raise bad(f"tools[{i}].input_schema", "required: a JSON schema object")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any, chat: dict) -> None:
    """tool_choice onto the chat body: auto, any (→ required), none, or a named tool;
    disable_parallel_tool_use → parallel_tool_calls false."""
    if v is None:
        return
    kind = v.get("type") if isinstance(v, dict) else None
    allowed = {"auto": {"disable_parallel_tool_use"}, "any": {"disable_parallel_tool_use"},
               "none": set(), "tool": {"name", "disable_parallel_tool_use"}}
    if kind not in allowed or set(v) - allowed[kind] - {"type"}:
        raise bad("tool_choice", "allowed {\"type\": \"auto\" | \"any\" | \"none\"} or "
                                 "{\"type\": \"tool\", \"name\"} (and "
                                 "disable_parallel_tool_use)")
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": v.get("name")}}
    else:
        chat["tool_choice"] = {"any": "required"}.get(kind, kind)
    if v.get("disable_parallel_tool_use") is not None:
        if not isinstance(v["disable_parallel_tool_use"], bool):
            raise bad("tool_choice.disable_parallel_tool_use", "allowed true or false")
        chat["parallel_tool_calls"] = not v["disable_parallel_tool_use"]


def _thinking(v: Any) -> str | None:
    """`thinking` → the chat's reasoning_effort (the template's thinking switch; the
    budget is not metered apart from max_tokens)."""
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "disabled" and set(v) == {"type"}:
        return "none"
    if kind == "adaptive" and set(v) <= {"type", "display"}:
        return "high"
    if kind == "enabled" and set(v) <= {"type", "budget_tokens", "display"}:
        budget = v.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise bad("thinking.budget_tokens", "required: an integer >= 1")
        return "high"
    raise bad("thinking", "allowed {\"type\": \"enabled\", \"budget_tokens\": int}, "
                          "{\"type\": \"adaptive\"} or {\"type\": \"disabled\"}")


def _output_config(v: Any) -> dict | None:
    """output_config → the chat's response_format (format json_schema; effort only null)."""
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) - {"format", "effort"}:
        raise bad("output_config", "allowed {\"format\": {\"type\": \"json_schema\", "
                                   "\"schema\"}}")
    if v.get("effort") is not None:
        raise bad("output_config.effort", "not supported by jlco (allowed: null; thinking "
                                          "is on or off, see `thinking`)")
    fmt = v.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or \
            set(fmt) != {"type", "schema"}:
        raise bad("output_config.format", "allowed {\"type\": \"json_schema\", \"schema\"}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def translate(body: dict, fields: set[str] = FIELDS) -> tuple[dict, list[str]]:
    """A Messages body → (the chat body, the Messages field behind each chat message)."""
    _check_fields(body, fields)
    msgs, origin = _messages(body)
    chat: dict[str, Any] = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat["messages"] = msgs
    if fields is FIELDS and not isinstance(body.get("max_tokens"), int):
        raise bad("max_tokens", "required: an integer >= 1")
    stops = body.get("stop_sequences")
    if stops:
        chat["stop"] = stops
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        _tool_choice(body.get("tool_choice"), chat)
    elif body.get("tool_choice") not in (None, {"type": "auto"}, {"type": "none"}):
        raise bad("tool_choice", "needs tools")
    effort = _thinking(body.get("thinking"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    fmt = _output_config(body.get("output_config"))
    if fmt is not None:
        chat["response_format"] = fmt
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}
    return chat, origin


async def create(request: Request, chat: Callable[[Request], Awaitable[Any]]):
    """POST /v1/messages: translate, serve through the chat handler, reshape."""
    body = parse_json(await request.body())
    chat_body, origin = translate(body)
    model = request.app.state.jlco.model_name
    try:
        resp = await chat(inner_request(request, json.dumps(chat_body).encode()))
    except ApiError as err:
        raise renamed(err, origin, RENAMES, "messages") from None
    mid = new_id("msg")
    if isinstance(resp, StreamingResponse):
        return StreamingResponse(events(resp.body_iterator, MessageEvents(model, mid)),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    if resp.status_code != 200:
        return resp
    return JSONResponse(from_chat(json.loads(resp.body), model, mid))


async def count_tokens(request: Request):
    """POST /v1/messages/count_tokens → {"input_tokens"}: the prompt /v1/messages would
    send the engine (chat template, tools and thinking switch included)."""
    body = parse_json(await request.body())
    chat_body, origin = translate(body, COUNT_FIELDS)
    state = request.app.state.jlco
    if body.get("model") is not None and body["model"] != state.model_name:
        raise ApiError(404, f"The model `{body['model']}` does not exist (this server "
                            f"serves `{state.model_name}`)", "model")
    if state.codec is None:
        raise ApiError(503, state.loading) if state.loop is None else \
            ApiError(400, "this model has no tokenizer: prompts cannot be counted")
    try:
        params, msgs, add_gen = parse_chat(chat_body)
        text = chat_prompt(state.codec, state.model_type, msgs, add_gen, params)
    except ApiError as err:
        raise renamed(err, origin, RENAMES, "messages") from None
    return {"input_tokens": len(state.codec.encode_chat(text))}
