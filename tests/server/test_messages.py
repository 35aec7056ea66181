"""POST /v1/messages and /v1/messages/count_tokens (`jlco.server.messages`): the
translation of Messages bodies into chat bodies and of chat results (whole, or SSE
chunks) into the message object and Anthropic's events, on hand-written chat results
(thinking and tool calls, which the tiny model never makes), assembled by the
`anthropic` SDK; then through the SDK against the app in-process (tiny random model with
the latent cache offloaded and one MTP draft token, byte-level tokenizer and its chat
template): whole and streamed messages, forced tool use validating against the schema at
temperature 1, a tool_result follow-up, count_tokens, the prefix cache's
cache_read_input_tokens, stop sequences, and errors in Anthropic's shape."""

from __future__ import annotations

import anthropic
import jsonschema
import pytest
from starlette.testclient import TestClient

from jlco.server import messages
from jlco.server.app import ServerState, create_app
from jlco.server.messages_events import MessageEvents, from_chat
from jlco.server.protocol import ApiError
from tests.support.inprocess import http_lib, sdk_http_client, serving, tiny_config

CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"name": "weather", "description": "forecast", "input_schema": CITY},
         {"name": "clock", "input_schema": ZONE, "cache_control": {"type": "ephemeral"}}]
SCHEMAS = {"weather": CITY, "clock": ZONE}
GREEDY = {"extra_body": {"temperature": 0}}


# -- translation: Messages body → chat body ----------------------------------------------

def test_blocks_become_chat_messages():
    body = {"model": "m", "max_tokens": 9, "system": [
        {"type": "text", "text": "be ", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "brief"}], "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "X"}},
            {"type": "tool_use", "id": "t2", "name": "clock", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
             "content": [{"type": "text", "text": "no clock"}]},
            {"type": "text", "text": "thanks"}]}],
        "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"], "thinking": {"type": "enabled", "budget_tokens": 1024},
        "temperature": 0.5, "top_k": 3, "stream": True, "metadata": {"user_id": "u"}}
    chat, origin = messages.translate(body)
    calls = [{"id": "t1", "type": "function", "function": {"name": "weather",
                                                            "arguments": '{"city": "X"}'}},
             {"id": "t2", "type": "function", "function": {"name": "clock",
                                                            "arguments": "{}"}}]
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "calling", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: no clock"},
        {"role": "user", "content": "thanks"}]
    assert origin == ["system", "messages[0].content", "messages[1]",
                      "messages[2].content[0]", "messages[2].content[1]",
                      "messages[2].content"]
    assert chat["tools"][0] == {"type": "function", "function": {
        "name": "weather", "parameters": CITY, "description": "forecast"}}
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["END"] and chat["reasoning_effort"] == "high"
    assert chat["max_tokens"] == 9 and chat["temperature"] == 0.5 and chat["top_k"] == 3
    assert chat["stream_options"] == {"include_usage": True}
    named, _ = messages.translate({**body, "tool_choice": {"type": "tool", "name": "clock"},
                                   "thinking": {"type": "disabled"}, "stream": False})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "clock"}}
    assert named["reasoning_effort"] == "none" and "stream_options" not in named


@pytest.mark.parametrize("change, param", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"system": [{"type": "image"}]}, "system[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "deep"}}, "thinking"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"speed": "fast"}, "speed"),
    ({"metadata": {"tags": []}}, "metadata"),
    ({"output_config": {"effort": "max"}}, "output_config.effort"),
])
def test_refusals_name_the_field(change, param):
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **change}
    with pytest.raises(ApiError) as err:
        messages.translate(body)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.message.startswith(param)


# -- reshaping: chat results → message and events ----------------------------------------

CHAT_MESSAGE = {"role": "assistant", "content": "sure", "reasoning_content": "think",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]}
CHAT_USAGE = {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47,
              "prompt_tokens_details": {"cached_tokens": 32}}


def _chunk(delta=None, finish=None, stop=None, usage=None) -> dict:
    doc = {"choices": [] if delta is None else [{"index": 0, "delta": delta,
                                                 "finish_reason": finish,
                                                 "stop_reason": stop}]}
    if usage:
        doc["usage"] = usage
    return doc


def _sdk_stream(frames: list[bytes]):
    """Our events through the anthropic SDK's stream helper (a mock transport)."""
    body, lib = b"".join(frames), http_lib(anthropic)
    transport = lib.MockTransport(lambda req: lib.Response(
        200, content=body, headers={"content-type": "text/event-stream"}))
    client = anthropic.Anthropic(api_key="x", base_url="http://t",
                                 http_client=lib.Client(transport=transport))
    with client.messages.stream(model="m", max_tokens=9, messages=[
            {"role": "user", "content": "x"}]) as s:
        kinds = [e.type for e in s]
        return kinds, s.get_final_message()


def test_whole_and_streamed_shapes_agree_through_the_sdk():
    whole = from_chat({"choices": [{"message": CHAT_MESSAGE, "finish_reason": "tool_calls"}],
                       "usage": CHAT_USAGE}, "m", "msg_1")
    assert whole["content"] == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "sure"},
        {"type": "tool_use", "id": "call_1", "name": "weather",
         "input": {"city": "Paris", "unit": "c"}}]
    assert whole["stop_reason"] == "tool_use" and whole["stop_sequence"] is None
    assert whole["usage"] == {"input_tokens": 8, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 32, "output_tokens": 7}
    conv = MessageEvents("m", "msg_1")
    frames = conv.start()
    for doc in (_chunk({"role": "assistant", "content": "", "reasoning_content": "th"}),
                _chunk({"reasoning_content": "ink"}), _chunk({"content": "su"}),
                _chunk({"content": "re"}),
                _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                        "function": {"name": "weather", "arguments": ""}}]}),
                _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
                _chunk({"tool_calls": [{"index": 0, "function": {
                    "arguments": '"Paris", "unit": "c"}'}}]}, finish="tool_calls"),
                _chunk(usage=CHAT_USAGE)):
        frames += conv.chunk(doc)
    frames += conv.end()
    kinds, final = _sdk_stream(frames)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == 3 == kinds.count("content_block_stop")
    got = final.model_dump()
    assert [{k: v for k, v in b.items() if v is not None and k != "parsed_output"}
            for b in got["content"]] == whole["content"]
    assert got["stop_reason"] == "tool_use"
    assert {k: got["usage"][k] for k in whole["usage"]} == whole["usage"]


def test_stop_sequences_and_a_cut_call():
    doc = {"choices": [{"message": {"role": "assistant", "content": "ab"},
                        "finish_reason": "stop", "stop_reason": "END"}]}
    m = from_chat(doc, "m", "msg_1")
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", "END")
    cut = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": '{"city": "Pa'}}]}
    m = from_chat({"choices": [{"message": cut, "finish_reason": "length"}]}, "m", "x")
    assert m["content"] == [{"type": "text", "text": '{"city": "Pa'}]
    assert m["stop_reason"] == "max_tokens"


def test_errors_are_anthropic_shaped_and_x_api_key_is_a_key():
    app = create_app(ServerState("m", 512, api_key="k"))     # no engine: loading
    with TestClient(app) as c:
        body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
        r = c.post("/v1/messages", json=body)
        assert r.status_code == 401
        assert r.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": r.json()["error"]["message"]}}
        for headers in ({"x-api-key": "k"}, {"Authorization": "Bearer k"}):
            r = c.post("/v1/messages", json=body, headers=headers)     # past the key check
            assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
            r = c.post("/v1/messages/count_tokens", json={"messages": body["messages"]},
                       headers=headers)
            assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        r = c.post("/v1/messages", json={**body, "frobnicate": 1}, headers={"x-api-key": "k"})
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert r.json()["error"] == {"type": "invalid_request_error",
                                     "message": "frobnicate: unknown field"}
        r = c.post("/v1/chat/completions", json={}, headers={"x-api-key": "k"})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400   # OpenAI's shape
        paths = c.get("/openapi.json").json()["paths"]
        assert "/v1/messages" in paths and "/v1/messages/count_tokens" in paths
        err = paths["/v1/messages"]["post"]["responses"]["400"]["content"]
        assert err["application/json"]["schema"]["properties"]["type"] == {"const": "error"}
        assert set(paths["/v1/responses/{response_id}"]) == {"get", "delete"}


# -- the SDK against the app in-process --------------------------------------------------

@pytest.fixture(scope="module")
def app_client():
    cfg = tiny_config(cache__offload=True, engine__num_draft_tokens=1)
    with serving(cfg) as (_, tc):
        yield tc


@pytest.fixture(scope="module")
def client(app_client):
    return anthropic.Anthropic(base_url="http://testserver", api_key="unused",
                               http_client=sdk_http_client(anthropic, app_client),
                               max_retries=0)


def test_create_whole_and_streamed(client):
    kw = dict(model="tiny", max_tokens=12, system="You answer in one word.",
              messages=[{"role": "user", "content": "Name a colour, any colour at all."}])
    whole = client.messages.create(**kw, **GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "tiny"
    assert whole.stop_reason in ("max_tokens", "end_turn")
    assert whole.usage.output_tokens > 0
    with client.messages.stream(**kw, **GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == (whole.content[0].text if whole.content else "")
    assert [b.model_dump(exclude={"parsed_output"}) for b in final.content] == \
        [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    total = final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert total == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.cache_read_input_tokens > 0     # the same prompt: cached


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "clock"}])
def test_forced_tool_use_validates_at_temperature_1(client, choice):
    allowed = ("weather", "clock") if choice["type"] == "any" else ("clock",)
    for _ in range(3):
        m = client.messages.create(
            model="tiny", max_tokens=200, tools=TOOLS, extra_body={"temperature": 1},
            tool_choice={**choice, "disable_parallel_tool_use": True},
            messages=[{"role": "user", "content": "What is the weather in Paris?"}])
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and len(uses) == 1, m
        assert uses[0].name in allowed and uses[0].id
        jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    # the follow-up turn: the call and its result in the conversation
    follow = client.messages.create(model="tiny", max_tokens=6, tools=TOOLS, **GREEDY,
                                    messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [u.model_dump() for u in uses]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "sunny, 21 C"}]}])
    assert follow.stop_reason in ("max_tokens", "end_turn", "tool_use")
    assert follow.usage.cache_read_input_tokens > 0     # the first turn's prompt


def test_count_tokens_and_the_prefix_cache_across_turns(client, app_client):
    assert app_client.post("/v1/reset_prefix_cache").status_code == 200   # a cold start
    system = "You are a careful assistant for a bakery that sells bread and cakes."
    turn1 = [{"role": "user", "content": "Which bread keeps longest, and why?"}]
    n = client.messages.count_tokens(model="tiny", system=system, messages=turn1,
                                     tools=TOOLS).input_tokens
    m1 = client.messages.create(model="tiny", max_tokens=8, system=system, messages=turn1,
                                tools=TOOLS, **GREEDY)
    assert m1.usage.input_tokens == n and m1.usage.cache_read_input_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": m1.content[0].text if m1.content
                      else "ok"}, {"role": "user", "content": "And cakes?"}]
    n2 = client.messages.count_tokens(model="tiny", system=system, messages=turn2,
                                      tools=TOOLS).input_tokens
    m2 = client.messages.create(model="tiny", max_tokens=8, system=system, messages=turn2,
                                tools=TOOLS, **GREEDY)
    assert m2.usage.cache_read_input_tokens > 0
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == n2


def test_stop_sequences_end_the_text(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hello"}])
    text = client.messages.create(max_tokens=16, **kw, **GREEDY).content[0].text
    at = [i for i, ch in enumerate(text) if ch.isalpha()]   # the random model's bytes
    assert at, text
    stop = text[at[0]:at[0] + 2]
    m = client.messages.create(max_tokens=16, stop_sequences=[stop], **kw, **GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]


def test_refusals_through_the_sdk(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user",
                               "content": [{"type": "image", "source": {
                                   "type": "url", "url": "http://x/y.png"}}]}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.body["error"]["message"].startswith("messages[0].content[0].type")
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-x", max_tokens=4,
                               messages=[{"role": "user", "content": "x"}])
    assert "claude-x" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as err:     # the chat route's, renamed
        client.messages.create(model="tiny", max_tokens=4000,
                               messages=[{"role": "user", "content": "x"}])
    assert "maximum context length is 2048" in err.value.body["error"]["message"]
    assert err.value.body["error"]["type"] == "invalid_request_error"
