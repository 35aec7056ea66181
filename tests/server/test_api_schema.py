"""/openapi.json against the server's own checks: the request bodies it declares are the
fields `protocol.parse_completion` / `parse_chat` accept (every declared field passes
with a value of its declared type, an undeclared one is refused), every generation route
declares vLLM's error shape, /metrics is text."""

from __future__ import annotations

import pytest

from jlco.server import schema
from jlco.server.app import ServerState, create_app
from jlco.server import protocol
from jlco.server.protocol import ApiError, parse_chat, parse_completion

EXAMPLES = {"model": "m", "temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 3, "n": 2,
            "stop": ["x"], "stop_token_ids": [1], "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True,
            "include_stop_str_in_output": False, "max_tokens": 4, "echo": True,
            "logprobs": 2, "kv_transfer_params": None, "max_completion_tokens": 4,
            "add_generation_prompt": True, "top_logprobs": 2, "chat_template_kwargs": {},
            "user": "u", "request_id": "r", "metadata": {"k": "v"}, "store": False,
            "service_tier": "auto", "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 1,
            "logit_bias": {"3": -1.5}, "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "[a-z]+"},
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
            "parallel_tool_calls": True, "reasoning_effort": "low"}


def _example(model, name):
    """A value of the field's declared type: EXAMPLES', or a no-op field's allowed value."""
    if name in EXAMPLES:
        return EXAMPLES[name]
    enum = model.model_json_schema()["properties"][name]["enum"]
    return enum[-1]


@pytest.fixture(scope="module")
def doc():
    return create_app(ServerState("m", 512)).openapi()


@pytest.mark.parametrize("model, parse, base", [
    (schema.CompletionBody, parse_completion, {"prompt": "hi"}),
    (schema.ChatBody, lambda b: parse_chat(b)[0], {"messages": [{"role": "user",
                                                                 "content": "hi"}]}),
])
def test_declared_fields_are_the_accepted_ones(model, parse, base):
    for name in model.model_fields:
        if name in base:
            continue
        body = dict(base, **{name: _example(model, name)})
        if name in ("logprobs", "top_logprobs") and model is schema.ChatBody:
            body["logprobs"] = True
        if name == "stream_options":
            body["stream"] = True
        if name == "structured_outputs":
            body.pop("response_format", None)
        parse(body)                                   # no "unknown field"
    with pytest.raises(ApiError, match="unknown field"):
        parse(dict(base, frobnicate=1))


@pytest.mark.parametrize("model, fields", [
    (schema.CompletionBody, protocol.COMPLETION_FIELDS),
    (schema.ChatBody, protocol.CHAT_FIELDS),
])
def test_every_accepted_field_is_declared(model, fields):
    accepted = fields | set(protocol.NOOP_FIELDS) | protocol.FREE_FIELDS
    assert accepted == set(model.model_fields)
    assert model.model_json_schema()["additionalProperties"] is False


@pytest.mark.parametrize("model, parse, base, name", [
    (schema.CompletionBody, parse_completion, {"prompt": "hi"}, "n"),
    (schema.CompletionBody, parse_completion, {"prompt": "hi"}, "logprobs"),
    (schema.CompletionBody, parse_completion, {"prompt": "hi", "echo": True}, "max_tokens"),
    (schema.ChatBody, lambda b: parse_chat(b)[0],
     {"messages": [{"role": "u", "content": "hi"}], "logprobs": True}, "top_logprobs"),
    (schema.ChatBody, lambda b: parse_chat(b)[0],
     {"messages": [{"role": "u", "content": "hi"}]}, "max_completion_tokens"),
])
def test_declared_ranges_are_the_checked_ones(model, parse, base, name):
    """For the integers the server itself checks: the declared bounds pass, one past
    them is a 400 naming the field."""
    prop = model.model_json_schema()["properties"][name]["anyOf"][0]
    lo, hi = prop.get("minimum"), prop.get("maximum")
    assert lo is not None
    for ok in (lo, hi):
        if ok is not None:
            parse(dict(base, **{name: ok}))
    for wrong in (lo - 1, None if hi is None else hi + 1):
        if wrong is not None:
            with pytest.raises(ApiError) as err:
                parse(dict(base, **{name: wrong}))
            assert err.value.param == name and err.value.status == 400


def test_routes_declare_bodies_and_errors(doc):
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert "prompt" in body["properties"] or "messages" in body["properties"]
        for code in ("400", "401", "404", "429", "503"):
            err = op["responses"][code]["content"]["application/json"]["schema"]
            assert set(err["properties"]) == {"error"}
    ref = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]["messages"]["items"]["$ref"]
    assert ref.rsplit("/", 1)[-1] in doc["components"]["schemas"]
    assert "text/plain; version=0.0.4" in doc["paths"]["/metrics"]["get"]["responses"]["200"][
        "content"]
    for path in ("/tokenize", "/detokenize"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert "model" in body["schema"]["properties"]
    retrieve = doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]["404"]
    assert "error" in retrieve["content"]["application/json"]["schema"]["properties"]
