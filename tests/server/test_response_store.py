"""Stored Responses (`jlco.server.response_store`): the bounded store on its own
(count and byte bounds, oldest out, the metric, 404s naming the id and why), then
through the `openai` SDK against the app in-process (tiny random model, byte-level
tokenizer): a three-turn conversation by previous_response_id gives the greedy tokens of
sending the whole conversation, with cached tokens on turns 2-3; a streamed response is
stored too; GET and DELETE; an evicted id is a 404 naming it."""

from __future__ import annotations

import openai
import pytest
from prometheus_client import CollectorRegistry

from jlco.server.protocol import ApiError
from jlco.server.response_store import ResponseStore
from tests.support.inprocess import sdk_http_client, serving, tiny_config


def _resp(rid: str, text: str = "x") -> dict:
    return {"id": rid, "object": "response", "output": [
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": text}]}]}


def test_bounds_evict_the_oldest_and_say_so():
    reg = CollectorRegistry()
    store = ResponseStore(max_count=2, max_bytes=10_000, registry=reg)
    for i in range(3):
        store.put(f"r{i}", _resp(f"r{i}"), [{"role": "user", "content": "q"}])
    assert len(store) == 2 and reg.get_sample_value("jlco_response_store_evictions_total") == 1
    assert reg.get_sample_value("jlco_response_store_entries") == 2
    assert reg.get_sample_value("jlco_response_store_bytes") == store.nbytes > 0
    with pytest.raises(ApiError) as err:
        store.get("r0")
    assert err.value.status == 404 and err.value.param == "response_id"
    assert err.value.message.startswith("response_id: response 'r0' was evicted")
    assert "at most 2 responses" in err.value.message
    big = "y" * (10_000 - store.nbytes // 2)     # fits beside no other record
    store.put("r3", _resp("r3", big), [])          # over the byte bound with r1, r2
    assert [r for r in ("r1", "r2", "r3") if r in store._records] == ["r3"]
    store.delete("r3")
    assert len(store) == 0 and store.nbytes == 0
    with pytest.raises(ApiError, match="'r3' was deleted"):
        store.get("r3")
    with pytest.raises(ApiError, match="previous_response_id: response 'nope' is not stored"):
        store.chain({"previous_response_id": "nope", "input": "x"})
    with pytest.raises(ValueError, match="max_count=0"):
        ResponseStore(max_count=0, registry=CollectorRegistry())


def test_chain_puts_the_conversation_in_front():
    store = ResponseStore(registry=CollectorRegistry())
    store.put("r1", _resp("r1", "hi"), [{"type": "message", "role": "user", "content": "a"},
                                         *_resp("r1", "hi")["output"]])
    body = store.chain({"previous_response_id": "r1", "input": "b", "instructions": "i"})
    assert body["instructions"] == "i"
    assert [i["role"] for i in body["input"]] == ["user", "assistant", "user"]
    assert body["input"][-1] == {"type": "message", "role": "user", "content": "b"}


@pytest.fixture(scope="module")
def served():
    with serving(tiny_config()) as (app, tc):
        yield app, openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                                 http_client=sdk_http_client(openai, tc), max_retries=0)


GREEDY = dict(model="tiny", temperature=0, max_output_tokens=8)
INSTRUCTIONS = "You are a patient assistant for a library; answer in one short line."
TURNS = ["Which shelf holds the atlases?", "And the dictionaries?", "Thanks, one more: maps?"]


def test_three_turns_by_previous_response_id_equal_the_whole_conversation(served):
    _, client = served
    chained, prev = [], None
    for text in TURNS:
        r = client.responses.create(input=text, instructions=INSTRUCTIONS,
                                    previous_response_id=prev, **GREEDY)
        assert r.store is True and r.previous_response_id == prev
        chained.append(r)
        prev = r.id
    assert all(r.usage.input_tokens_details.cached_tokens > 0 for r in chained[1:])
    history: list = []
    for text, r in zip(TURNS, chained):
        history.append({"role": "user", "content": text})
        whole = client.responses.create(input=history, instructions=INSTRUCTIONS, store=False,
                                        **GREEDY)
        assert whole.output_text == r.output_text
        assert whole.usage.input_tokens == r.usage.input_tokens
        assert whole.usage.output_tokens == r.usage.output_tokens
        history.append({"role": "assistant", "content": r.output_text})
    with pytest.raises(openai.NotFoundError) as err:      # store false: not kept
        client.responses.retrieve(whole.id)
    assert whole.id in err.value.body["message"]


def test_streamed_responses_are_stored_and_retrieved_and_deleted(served):
    _, client = served
    with client.responses.stream(input="Which shelf holds the atlases?",
                                 instructions=INSTRUCTIONS, **GREEDY) as s:
        final = [e.response for e in s if e.type in ("response.completed",
                                                     "response.incomplete")][-1]
    got = client.responses.retrieve(final.id)
    assert got.id == final.id and got.output_text == final.output_text
    nxt = client.responses.create(input="And the dictionaries?", previous_response_id=final.id,
                                  instructions=INSTRUCTIONS, **GREEDY)
    assert nxt.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.delete(final.id) is None
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(input="x", previous_response_id=final.id, **GREEDY)
    assert err.value.body["param"] == "previous_response_id"
    assert f"'{final.id}' was deleted" in err.value.body["message"]


def test_an_evicted_id_is_a_404_naming_it(served):
    app, client = served
    store = app.state.responses
    store.max_count = 2
    registry = app.state.metrics.registry
    before = registry.get_sample_value("jlco_response_store_evictions_total")
    try:
        first = client.responses.create(input="one", **GREEDY)
        for text in ("two", "three"):
            client.responses.create(input=text, **GREEDY)
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.create(input="four", previous_response_id=first.id, **GREEDY)
        assert f"'{first.id}' was evicted" in err.value.body["message"]
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.retrieve(first.id)
        assert first.id in err.value.body["message"]
        assert registry.get_sample_value("jlco_response_store_evictions_total") >= before + 1
    finally:
        store.max_count = 1024
