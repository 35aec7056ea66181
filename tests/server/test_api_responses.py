"""POST /v1/responses (`jlco.server.responses_api`): the translation of Responses bodies
into chat bodies and of chat results (whole, or SSE chunks) into the Responses object and
events, on hand-written chat results (tool calls and reasoning included, which the tiny
model never makes); then through the `openai` client against a real `python -m
jlco.serve` (tiny random model, offload on): string and item inputs, streamed events
against the whole response, the length limit, json_schema, function_call_output items,
and refusals naming the field."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from jlco.server import responses_api
from jlco.server.protocol import ApiError
from jlco.server.responses_events import EventStream, events, from_chat
from tests.support.server import TINY_OFFLOAD, server_fixtures

ECHO = responses_api._echo({"model": "m"})
TOOL = {"type": "function", "name": "get_weather", "description": "weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}, "strict": True}


def _parse_events(frames: list[bytes]) -> list[dict]:
    out = []
    for f in frames:
        head, data = f.decode().rstrip("\n").split("\n", 1)
        doc = json.loads(data.removeprefix("data: "))
        assert head == f"event: {doc['type']}"
        out.append(doc)
    return out


def _strip_ids(resp: dict) -> dict:
    """A response without what differs between two runs (ids, times)."""
    resp = json.loads(json.dumps(resp))
    resp.pop("id"), resp.pop("created_at")
    for item in resp["output"]:
        item.pop("id")
    return resp


# -- translation: Responses body → chat body ---------------------------------------------

def test_items_become_chat_messages():
    body = {"instructions": "be brief", "input": [
        {"role": "developer", "content": "terse"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                          {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "calling", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"}],
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 9, "text": {"format": {"type": "json_schema", "name": "x",
                                                    "schema": {"type": "object"}}},
        "stream": True, "store": True, "seed": 4}
    chat, echo, origin = responses_api.translate(body)
    calls = [{"id": c, "type": "function", "function": {"name": n, "arguments": a}}
             for c, n, a in (("c1", "f", "{}"), ("c2", "g", "{\"x\":1}"), ("c3", "f", "{}"))]
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "system", "content": "terse"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "calling", "tool_calls": calls[:2]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": None, "tool_calls": calls[2:]}]
    assert origin == ["instructions", "input[0]", "input[1]", "input[3]", "input[6]",
                      "input[7]", "input[8]"]
    assert chat["tools"] == [{"type": "function", "function": {
        k: TOOL[k] for k in ("name", "description", "parameters", "strict")}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["max_completion_tokens"] == 9 and chat["seed"] == 4
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert echo["store"] is True and echo["tools"] == [TOOL]


def test_a_string_input_is_one_user_message_and_unused_tool_fields_are_dropped():
    chat, echo, _ = responses_api.translate({"input": "hi", "tool_choice": "auto",
                                             "parallel_tool_calls": True})
    assert chat == {"messages": [{"role": "user", "content": "hi"}]}
    assert echo["tool_choice"] == "auto" and echo["parallel_tool_calls"] is True
    assert echo["text"] == {"format": {"type": "text"}} and echo["temperature"] == 1.0


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": []}, "input"),
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input[0].content"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [dict(TOOL, function={})]}, "tools[0].function"),
    ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "instructions": 3}, "instructions"),
    ({"input": "x", "include": [{}]}, "include"),             # unhashable: still a 400
    ({"input": [{"role": {}, "content": "x"}]}, "input[0].role"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "store": 1}, "store"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as err:
        responses_api.translate(body)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.message.startswith(param)


def test_chat_refusals_come_back_with_the_responses_names():
    origin = ["instructions", "input[2]"]
    cases = [("messages[1].content", "input[2]"), ("messages", "input"),
             ("max_completion_tokens", "max_output_tokens"),
             ("response_format.json_schema.schema", "text.format.schema"),
             ("prompt", "input"), ("temperature", "temperature")]
    for chat_name, name in cases:
        err = responses_api.renamed(ApiError(400, f"{chat_name}: no", chat_name), origin)
        assert err.param == name and err.message == f"{name}: no" and err.status == 400


def test_every_accepted_field_is_declared():
    assert set(responses_api.ResponsesBody.model_fields) == responses_api.FIELDS


# -- conversion: chat results → Responses ----------------------------------------------

def _chat_doc(message, finish="stop"):
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                      "prompt_tokens_details": {"cached_tokens": 3}}}


def test_a_whole_chat_message_with_reasoning_and_tool_calls():
    msg = {"role": "assistant", "content": "", "reasoning_content": "think",
           "tool_calls": [{"id": "call_a", "type": "function",
                           "function": {"name": "f", "arguments": "{\"x\": 1}"}},
                          {"id": "call_b", "type": "function",
                           "function": {"name": "g", "arguments": "{}"}}]}
    resp = from_chat(_chat_doc(msg, "tool_calls"), ECHO, "resp_1", 5)
    Response.model_validate(resp)
    assert resp["status"] == "completed" and resp["incomplete_details"] is None
    assert [o["type"] for o in resp["output"]] == ["reasoning", "function_call",
                                                   "function_call"]
    assert resp["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert [(o["call_id"], o["name"], o["arguments"]) for o in resp["output"][1:]] == [
        ("call_a", "f", "{\"x\": 1}"), ("call_b", "g", "{}")]
    assert resp["usage"] == {"input_tokens": 7, "output_tokens": 5, "total_tokens": 12,
                             "input_tokens_details": {"cached_tokens": 3,
                                                      "cache_write_tokens": 0},
                             "output_tokens_details": {"reasoning_tokens": 0}}


def test_the_length_limit_makes_the_response_incomplete():
    resp = from_chat(_chat_doc({"role": "assistant", "content": "abc"}, "length"), ECHO,
                     "resp_1", 5)
    Response.model_validate(resp)
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["output"][0]["status"] == "incomplete"
    assert resp["output"][0]["content"] == [{"type": "output_text", "text": "abc",
                                             "annotations": []}]


def _chunk(delta=None, finish=None, usage=None):
    doc = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
           "choices": [] if delta is None else [{"index": 0, "delta": delta,
                                                 "finish_reason": finish}]}
    if usage is not None:
        doc["usage"] = usage
    return f"data: {json.dumps(doc)}\n\n".encode()


def _stream(frames: list[bytes]) -> list[dict]:
    async def body():
        for f in frames:
            yield f

    async def run():
        return [e async for e in events(body(), EventStream(ECHO, "resp_1", 5))]
    out = _parse_events(asyncio.run(run()))
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in out:
        adapter.validate_python(e)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


def test_streamed_reasoning_text_and_tool_calls():
    calls = [
        {"index": 0, "id": "call_a", "type": "function",
         "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": "{\"x\""}},
        {"index": 1, "id": "call_b", "type": "function",
         "function": {"name": "g", "arguments": "{}"}},
        {"index": 0, "function": {"arguments": ": 1}"}}]
    frames = [_chunk({"role": "assistant", "content": ""}),
              _chunk({"reasoning_content": "thi"}), _chunk({"reasoning_content": "nk"}),
              _chunk({"content": "I will"}), _chunk({"content": " call"}),
              *[_chunk({"tool_calls": [c]}) for c in calls],
              _chunk({}, "tool_calls"), _chunk(usage=USAGE), b"data: [DONE]\n\n"]
    evs = _stream(frames)
    types = [e["type"] for e in evs]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    final = evs[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call",
                                                    "function_call"]
    assert final["output"][0]["content"][0]["text"] == "think"
    assert final["output"][1]["content"][0]["text"] == "I will call"
    assert [(o["call_id"], o["name"], o["arguments"]) for o in final["output"][2:]] == [
        ("call_a", "f", "{\"x\": 1}"), ("call_b", "g", "{}")]
    args = {}
    for e in evs:
        if e["type"] == "response.function_call_arguments.delta":
            args[e["output_index"]] = args.get(e["output_index"], "") + e["delta"]
    assert args == {2: "{\"x\": 1}", 3: "{}"}
    dones = [e for e in evs if e["type"] == "response.function_call_arguments.done"]
    assert [(d["output_index"], d["name"], d["arguments"]) for d in dones] == [
        (2, "f", "{\"x\": 1}"), (3, "g", "{}")]
    added = [e["output_index"] for e in evs if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in evs if e["type"] == "response.output_item.done"]
    assert added == [0, 1, 2, 3] and sorted(closed) == [0, 1, 2, 3]
    assert final["usage"]["input_tokens"] == 7
    whole = from_chat(_chat_doc({"role": "assistant", "content": "I will call",
                                 "reasoning_content": "think", "tool_calls": [
                                     {"id": "call_a", "function": {"name": "f",
                                                                   "arguments": "{\"x\": 1}"}},
                                     {"id": "call_b", "function": {"name": "g",
                                                                   "arguments": "{}"}}]},
                                "tool_calls"), ECHO, "resp_2", 6)
    whole["usage"] = final["usage"]
    assert _strip_ids(final) == _strip_ids(whole)


def test_a_stream_cut_by_the_length_limit_and_one_that_failed():
    evs = _stream([_chunk({"content": "ab"}), _chunk({"content": "c"}, "length"),
                   _chunk(usage=USAGE), b"data: [DONE]\n\n"])
    assert evs[-1]["type"] == "response.incomplete"
    final = evs[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    whole = from_chat(_chat_doc({"role": "assistant", "content": "abc"}, "length"), ECHO,
                      "r", 6)
    whole["usage"] = final["usage"]
    assert _strip_ids(final) == _strip_ids(whole)
    err = {"error": {"message": "boom", "type": "InternalServerError", "param": None,
                     "code": 500}}
    evs = _stream([_chunk({"content": "ab"}), f"data: {json.dumps(err)}\n\n".encode(),
                   b"data: [DONE]\n\n"])
    assert [e["type"] for e in evs[-2:]] == ["error", "response.failed"]
    assert evs[-1]["response"]["error"]["message"] == "boom"


def test_an_empty_stream_still_says_something():
    evs = _stream([_chunk({"role": "assistant", "content": ""}), _chunk({}, "stop"),
                   b"data: [DONE]\n\n"])
    final = evs[-1]["response"]
    assert final["status"] == "completed"
    assert final["output"][0]["content"] == [{"type": "output_text", "text": "",
                                              "annotations": []}]
    assert not [e for e in evs if e["type"] == "response.output_text.delta"]


# -- through the openai client against a real server -----------------------------------

server, client = server_fixtures(*TINY_OFFLOAD)


GREEDY = dict(temperature=0, max_output_tokens=12)
ITEMS = [{"role": "user", "content": "hello"},
         {"type": "message", "role": "assistant",
          "content": [{"type": "output_text", "text": "hi", "annotations": []}]},
         {"type": "message", "role": "user",
          "content": [{"type": "input_text", "text": "and "},
                      {"type": "input_text", "text": "again"}]}]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "and again"}]


@pytest.mark.e2e
def test_a_string_input(client):
    r = client.responses.create(input="hello", **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.model and r.store is True and r.tools == [] and r.max_output_tokens == 12
    assert [o.type for o in r.output] == ["message"]
    msg = r.output[0]
    assert msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


@pytest.mark.e2e
def test_message_items_and_instructions_are_the_chat_conversation(client):
    """The adapter serves the chat route: the same conversation, the same text."""
    r = client.responses.create(input=ITEMS, instructions="be brief", **GREEDY)
    c = client.chat.completions.create(model=None, messages=CHAT, temperature=0,
                                       max_tokens=12)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.instructions == "be brief"


@pytest.mark.e2e
def test_the_stream_ends_in_the_whole_response(client):
    whole = client.responses.create(input=ITEMS, instructions="be brief", **GREEDY)
    evs = list(client.responses.create(input=ITEMS, instructions="be brief", stream=True,
                                       **GREEDY))
    types = [e.type for e in evs]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response." + whole.status]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    seqs = [e.sequence_number for e in evs]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    deltas = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    final = evs[-1].response
    assert deltas == final.output_text == whole.output_text
    assert evs[-4].text == deltas
    assert _strip_ids(final.model_dump()) == _strip_ids(whole.model_dump())


@pytest.mark.e2e
def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(input="hello", temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"},
    "tag": {"enum": ["red", "green"]}}, "required": ["n", "ok", "tag"],
    "additionalProperties": False}


@pytest.mark.e2e
@pytest.mark.parametrize("seed", [1, 2])
def test_text_format_json_schema(client, seed):
    r = client.responses.create(input="json please", temperature=1.0,
                                max_output_tokens=200, extra_body={"seed": seed},
                                text={"format": {"type": "json_schema", "name": "thing",
                                                 "schema": SCHEMA, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


@pytest.mark.e2e
def test_function_call_output_items_are_the_chat_tool_turn(client):
    items = [{"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": "{\"city\": \"Oslo\"}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "rain"}]
    r = client.responses.create(input=items, tools=[TOOL], **GREEDY)
    chat_tool = [{"type": "function", "function": {
        k: TOOL[k] for k in ("name", "description", "parameters", "strict")}}]
    c = client.chat.completions.create(model=None, temperature=0, max_tokens=12,
                                       tools=chat_tool, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}])
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.output_text == (c.choices[0].message.content or "")


BOUNDED = dict(TOOL, parameters={"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False})


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_is_a_function_call_item(client, stream):
    kw = dict(input="weather?", tools=[BOUNDED], temperature=0, max_output_tokens=100,
              tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        evs = list(client.responses.create(stream=True, **kw))
        r = evs[-1].response
        args = "".join(e.delta for e in evs
                       if e.type == "response.function_call_arguments.delta")
        done = [e for e in evs if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and done[0].arguments == args and done[0].name == "get_weather"
    else:
        r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), BOUNDED["parameters"])


@pytest.mark.e2e
def test_refusals_through_the_client(client, server):
    with pytest.raises(openai.NotFoundError) as err:      # stored responses: response_store
        client.responses.create(input="x", previous_response_id="resp_123")
    assert err.value.body["param"] == "previous_response_id"
    assert "'resp_123' is not stored" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(input="x", extra_body={"frobnicate": 1})
    assert err.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as err:    # the chat route's check, renamed
        client.responses.create(input="x", max_output_tokens=100000)
    assert err.value.body["param"] == "max_output_tokens"
    r = httpx.post(f"{server.url}/v1/responses", content=b"[1]")
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


@pytest.mark.e2e
def test_openapi_declares_the_route(server):
    op = httpx.get(f"{server.url}/openapi.json").json()["paths"]["/v1/responses"]["post"]
    props = op["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"input", "instructions", "tools", "text", "max_output_tokens"} <= set(props)
    assert "error" in op["responses"]["400"]["content"]["application/json"]["schema"][
        "properties"]


def _aborted(server) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith('jlco_request_success_total{finished_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.e2e
def test_a_client_that_leaves_mid_stream_aborts_its_request(server):
    """Closing the Responses stream closes the chat stream under it: the request ends
    "abort" (its slot comes back), as on the chat route."""
    before = _aborted(server)
    body = {"input": "hello", "stream": True, "max_output_tokens": 400, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body) as r:
        lines = r.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass
    deadline = time.monotonic() + 30
    while _aborted(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _aborted(server) == before + 1
