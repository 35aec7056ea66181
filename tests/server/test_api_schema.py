"""/openapi.json against the server's own checks: the request bodies it declares are the
fields `protocol.parse_completion` / `parse_chat` accept (every declared field passes
with a value of its declared type, an undeclared one is refused), every generation route
declares vLLM's error shape, /metrics is text."""

from __future__ import annotations

import pytest

from jlco.server import schema
from jlco.server.app import ServerState, create_app
from jlco.server.protocol import ApiError, parse_chat, parse_completion

EXAMPLES = {"model": "m", "temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 3, "n": 2,
            "stop": ["x"], "stop_token_ids": [1], "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True,
            "include_stop_str_in_output": False, "max_tokens": 4, "echo": True,
            "logprobs": 2, "kv_transfer_params": None, "max_completion_tokens": 4,
            "add_generation_prompt": True, "top_logprobs": 2}


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
        body = dict(base, **{name: EXAMPLES[name]})
        if name in ("logprobs", "top_logprobs") and model is schema.ChatBody:
            body["logprobs"] = True
        if name == "stream_options":
            body["stream"] = True
        parse(body)                                   # no "unknown field"
    with pytest.raises(ApiError, match="unknown field"):
        parse(dict(base, frobnicate=1))


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
