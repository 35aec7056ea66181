"""What `/openapi.json` declares for the generation routes: their request bodies (the
fields `jlco.server.protocol` accepts, with their types and ranges) and their error
responses (vLLM's shape). The models describe; they do not validate: the handlers read
the raw JSON through `protocol.parse_completion` / `parse_chat`, the one place that
decides what is accepted (so the schema and the checks are tested against each other in
tests/server/test_api_schema.py, not kept apart by hand).
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model

from jlco.sampling.params import MAX_LOGPROBS
from jlco.sampling.penalties import MAX_LOGIT_BIAS
from jlco.server.protocol import MAX_N, MAX_STOP_STRINGS, NOOP_FIELDS, asks_nothing


def _noop(name: str, allowed: tuple):
    """A field jlco accepts only at values that ask for nothing (protocol.NOOP_FIELDS)."""
    vals: list = []
    for v in allowed:           # 0 and 0.0 are one JSON number
        if v is not None and not asks_nothing(v, tuple(vals)):
            vals.append(v)
    shown = "".join(f" or {json.dumps(v)}" for v in vals)
    return (Any, Field(None, description=f"not implemented: accepted as null{shown}",
                       json_schema_extra={"enum": [None, *vals]}))


# Fields jlco takes and ignores (OpenAI's informational ones), then the no-op ones.
_Accepted = create_model(
    "_Accepted", __config__=ConfigDict(extra="forbid"),
    user=(Optional[str], None), request_id=(Optional[str], None),
    metadata=(Optional[dict], None), store=(Optional[bool], None),
    service_tier=(Optional[str], None),
    **{name: _noop(name, allowed) for name, allowed in NOOP_FIELDS.items()})


class _Sampling(_Accepted):
    model: Optional[str] = Field(None, description="the served model's id (or leave it out)")
    temperature: Optional[float] = Field(None, ge=0, le=100, description="default 1; 0 greedy")
    top_p: Optional[float] = Field(None, gt=0, le=1, description="default 1 (off)")
    top_k: Optional[int] = Field(None, ge=-1, description="vLLM's; -1 or 0 = off")
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 32, description="default: drawn; choice "
                                "j of n samples with seed + j")
    n: Optional[int] = Field(None, ge=1, le=MAX_N, description="choices per prompt (default 1)")
    stop: Union[str, list[str], None] = Field(None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = None
    stream: Optional[bool] = None
    stream_options: Optional[dict] = Field(None, description="{\"include_usage\": bool}")
    return_token_ids: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    max_tokens: Optional[int] = Field(None, ge=0, description="completions: default 16, 0 "
                                      "only with echo; chat: default up to the context")
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2, description="default 0")
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, description="default 0")
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2, description="vLLM's; "
                                                "default 1 (off)")
    min_p: Optional[float] = Field(None, ge=0, le=1, description="default 0 (off)")
    min_tokens: Optional[int] = Field(None, ge=0, description="vLLM's: stop ids held back "
                                      "until this many tokens (default 0)")
    response_format: Optional[dict] = Field(
        None, description="{\"type\": \"text\" | \"json_object\" | \"json_schema\"}")
    structured_outputs: Optional[dict] = Field(
        None, description="vLLM's: exactly one of json, regex, choice, grammar, json_object")
    logit_bias: Optional[dict[str, float]] = Field(
        None, max_length=MAX_LOGIT_BIAS, description="{\"token id\": bias in -100..100}")


class CompletionBody(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(
        ..., description="text, token ids, or a list of either (one choice per prompt and n)")
    echo: Optional[bool] = None
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    kv_transfer_params: Optional[dict] = Field(None, description="{\"prefill_id\": \"pf-N\"}")


class Message(BaseModel):
    role: str
    content: Union[str, list[dict]]


class ChatBody(_Sampling):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    add_generation_prompt: Optional[bool] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: Optional[dict] = Field(None, description="the chat template's "
                                                 "variables (e.g. {\"thinking\": true})")
    tools: Optional[list[dict]] = Field(None, description="[{\"type\": \"function\", "
                                        "\"function\": {\"name\", \"description\", "
                                        "\"parameters\"}}]")
    tool_choice: Union[str, dict, None] = Field(None, description="none, auto, required, "
                                                "or {\"type\": \"function\", \"function\": "
                                                "{\"name\"}}")
    parallel_tool_calls: Optional[bool] = None
    reasoning_effort: Optional[str] = Field(None, description="none turns thinking off, "
                                            "any other effort on")


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: `prompt` (text) or `messages` (rendered by the chat template)."""
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    prompt: Optional[str] = Field(None, description="text; or send messages instead")
    messages: Optional[list[Message]] = Field(None, min_length=1)
    add_special_tokens: Optional[bool] = Field(None, description="default true for a prompt "
                                               "(the tokenizer's BOS rule), false for messages")
    add_generation_prompt: Optional[bool] = Field(None, description="messages only; default "
                                                  "true")


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    tokens: list[int] = Field(..., description="token ids (>= 0)")


class _ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: int


class ErrorBody(BaseModel):
    error: _ErrorDetail


_ERRORS = {400: "a field is invalid (named in `param`)", 401: "missing or wrong API key",
           404: "no such model or route", 429: "the queue is full", 503: "loading or draining"}


def route_extra(body: type[BaseModel] | None) -> dict:
    """`openapi_extra` for a route taking `body` (None: no body): the request body and
    every error response in vLLM's shape."""
    err = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    err.pop("$defs", None)              # _ErrorDetail goes to the document's components
    extra: dict = {"responses": {str(code): {"description": why, "content": {
        "application/json": {"schema": err}}} for code, why in _ERRORS.items()}}
    if body is not None:
        schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
        schema.pop("$defs", None)       # they go to the document's components
        extra["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": schema}}}
    return extra


def add_components(app) -> None:
    """Put the schemas the bodies refer to (`Message`) into the app's OpenAPI document."""
    build = app.openapi

    def openapi():
        doc = build()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas["Message"] = Message.model_json_schema()
        schemas["_ErrorDetail"] = _ErrorDetail.model_json_schema()
        return doc
    app.openapi = openapi


METRICS_RESPONSE = {"200": {"description": "Prometheus text exposition",
                            "content": {"text/plain; version=0.0.4": {"schema": {
                                "type": "string"}}}}}
