"""Tool calls through the `openai` client against a real `python -m jlco.serve` (tiny
random model, byte-level tokenizer): `tool_choice` "required" and a named function return
`tool_calls` whose arguments validate against the tool's schema whatever the weights
(temperature 1, several seeds), streamed deltas assemble to the same calls, the client
parses every response into its typed objects; a conversation with an assistant
`tool_calls` turn (`content: null`) and `role: "tool"` results is accepted; bad tool
fields are a 400 naming them."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from tests.support.server import TINY_OFFLOAD, server_fixtures

pytestmark = pytest.mark.e2e   # real subprocesses: the e2e tier (pyproject.toml)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}
MSG = [{"role": "user", "content": "weather in Paris?"}]


server, client = server_fixtures(*TINY_OFFLOAD, "--override", "engine.max_context_len=2048")


def _check(calls, allowed=("weather", "clock")):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def _streamed(client, **kw):
    calls: dict[int, dict] = {}
    finish = None
    for ev in client.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                if d.function and d.function.name:
                    c["name"] = d.function.name
                if d.function and d.function.arguments:
                    c["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "clock"}}])
def test_forced_calls_validate_streamed_and_whole(client, choice):
    allowed = ("weather", "clock") if choice == "required" else ("clock",)
    for seed in range(6):
        kw = dict(model=None, messages=MSG, tools=TOOLS, tool_choice=choice,
                  temperature=1.0, seed=seed, max_tokens=400)
        r = client.chat.completions.create(**kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        _check(ch.message.tool_calls, allowed)
        calls, finish = _streamed(client, **kw)
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in ch.message.tool_calls]


def test_single_call_without_parallel_tool_calls(client):
    r = client.chat.completions.create(model=None, messages=MSG, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       temperature=1.0, seed=2, max_tokens=400)
    assert len(r.choices[0].message.tool_calls) == 1


def test_a_tool_conversation_is_accepted(client):
    msgs = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city":"Paris","unit":"c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    r = client.chat.completions.create(model=None, messages=msgs, tools=TOOLS,
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str)
    auto = client.chat.completions.create(model=None, messages=msgs, tools=TOOLS,
                                          max_tokens=8, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body,field", [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"x": 1}]}]},
     "messages[0].tool_calls")])
def test_bad_tool_fields_are_refused_naming_them(server, body, field):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": MSG, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
