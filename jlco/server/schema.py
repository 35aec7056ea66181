"""What `/openapi.json` declares for the generation routes: their request bodies (the
fields `jlco.server.protocol` accepts, with their types and ranges) and their error
responses (vLLM's shape). The models describe; they do not validate: the handlers read
the raw JSON through `protocol.parse_completion` / `parse_chat`, the one place that
decides what is accepted (so the schema and the checks are tested against each other in
tests/server/test_api_schema.py, not kept apart by hand).
"""

from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from jlco.server.protocol import MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1, description="vLLM's; -1 or 0 = off")
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 32)
    n: Optional[int] = Field(None, ge=1, le=MAX_N)
    stop: Union[str, list[str], None] = Field(None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = None
    stream: Optional[bool] = None
    stream_options: Optional[dict] = Field(None, description="{\"include_usage\": bool}")
    return_token_ids: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    max_tokens: Optional[int] = Field(None, ge=0, description="completions: 0 only with echo")


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
    err = ErrorBody.model_json_schema()
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
        doc.setdefault("components", {}).setdefault("schemas", {})["Message"] = \
            Message.model_json_schema()
        return doc
    app.openapi = openapi


METRICS_RESPONSE = {"200": {"description": "Prometheus text exposition",
                            "content": {"text/plain; version=0.0.4": {"schema": {
                                "type": "string"}}}}}
