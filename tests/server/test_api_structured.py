"""Structured outputs through the `openai` client against a real `python -m jlco.serve`
(tiny random model, byte-level tokenizer, offload on): `response_format` json_object and
several json_schemas (nested objects, arrays, enums, required fields, string patterns)
at temperature 1 with different seeds return text that parses and validates, streamed
and not; vLLM's `structured_outputs` regex / choice / grammar; a free request in the same
batch gets the tokens it gets alone; bad specs are a 400 naming the field."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import pytest
from tests.support.server import TINY_OFFLOAD, server_fixtures

pytestmark = pytest.mark.e2e   # real subprocesses: the e2e tier (pyproject.toml)

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"type": "object", "properties": {"w": {"type": "integer"},
                                                  "h": {"type": "integer"}},
                 "required": ["w", "h"], "additionalProperties": False}},
        "required": ["name", "size"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 4},
        "ok": {"type": "boolean"}}, "required": ["tags", "ok"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[a-f0-9]{4}-[0-9]{2}$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["id", "n"], "additionalProperties": False},
}
MSG = [{"role": "user", "content": "give me JSON"}]


# room for json_object's unbounded strings at temperature 1
server, client = server_fixtures(*TINY_OFFLOAD, "--override", "engine.max_context_len=2048")


def _fmt(name):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                   "strict": True}}


def _chat(client, seed, fmt, stream=False):
    kw = dict(model=None, messages=MSG, temperature=1.0, seed=seed,
              response_format=fmt)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(ev.choices[0].delta.content or "" for ev in
                   client.chat.completions.create(stream=True, **kw) if ev.choices)


def test_json_object_and_schemas_always_validate(client):
    jobs = [(s, {"type": "json_object"}, None) for s in range(20)]
    jobs += [(s, _fmt(name), name) for name in SCHEMAS for s in range(20)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda j: (j, _chat(client, j[0], j[1], stream=j[0] % 2 == 1)),
                             jobs))
    for (seed, _, name), text in outs:
        value = json.loads(text)
        if name is None:
            assert isinstance(value, dict), text
        else:
            jsonschema.validate(value, SCHEMAS[name])


def test_streamed_equals_whole(client):
    assert _chat(client, 3, _fmt("nested"), stream=True) == _chat(client, 3, _fmt("nested"))


def test_vllm_structured_outputs(client):
    def one(spec, **kw):
        return client.completions.create(model=None, prompt="x", max_tokens=64,
                                         temperature=1.0, seed=kw.pop("seed", 0),
                                         extra_body={"structured_outputs": spec}).choices[0].text
    for seed in range(5):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", one({"regex": "[0-9]{3}-[a-z]{2}"}, seed=seed))
        assert one({"choice": ["yes", "no", "maybe"]}, seed=seed) in ("yes", "no", "maybe")
        assert re.fullmatch(r"(ab)+c", one({"grammar": 'start: "ab"+ "c"'}, seed=seed))
        assert re.fullmatch(r"(ab)+c", one({"grammar": 'root ::= ("ab")+ "c"'}, seed=seed))
        assert json.loads(one({"json": {"type": "array", "items": {"type": "integer"},
                                        "maxItems": 3}}, seed=seed)) is not None


def test_a_free_request_is_unchanged_beside_constrained_ones(client):
    def free():
        return client.completions.create(model=None, prompt="hello there", max_tokens=24,
                                         temperature=1.0, seed=11).choices[0].text
    alone = free()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(_chat, client, s, {"type": "json_object"}) for s in range(3)]
        mixed = pool.submit(free)
        assert mixed.result() == alone
        [b.result() for b in busy]


@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema"),
    ({"structured_outputs": {"regex": "(["}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_object"},
      "structured_outputs": {"regex": "a"}}, "structured_outputs")])
def test_bad_specs_are_refused_naming_the_field(server, body, field):
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": "x", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
