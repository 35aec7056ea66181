"""Penalties, logit_bias, min_p and min_tokens through the `openai` client against a real
`python -m jlco.serve` (tiny random model, offload on). The numerics are checked against
a numpy reference in tests/engine/test_penalties.py; here: the fields reach the engine
(a +100 bias forces its token, min_tokens holds a stop id back and then stops on it),
streamed and whole responses agree, a free request is unchanged by penalised ones beside
it, and bad values are a 400 naming the field."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from tests.support.server import TINY_OFFLOAD, server_fixtures

pytestmark = pytest.mark.e2e   # real subprocesses: the e2e tier (pyproject.toml)

PROMPT = [(5 * i + 2) % 250 for i in range(48)]
IDS = {"return_token_ids": True}


server, client = server_fixtures(*TINY_OFFLOAD)


def _ids(client, max_tokens=6, **kw):
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=max_tokens,
                                  temperature=0, extra_body=dict(IDS, **kw.pop("extra", {})),
                                  **kw)
    c = r.choices[0]
    return c.model_extra["token_ids"], c.finish_reason, r.usage


def test_a_bias_forces_its_token_and_min_tokens_holds_a_stop_back(client):
    plain, _, _ = _ids(client)
    t = (plain[0] + 1) % 250
    forced, _, _ = _ids(client, logit_bias={str(t): 100})
    assert forced == [t] * 6
    banned, _, _ = _ids(client, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    # t is forced and is a stop id: held back for 3 tokens, then it stops the request
    got, reason, usage = _ids(client, max_tokens=10, logit_bias={str(t): 100},
                              extra={"stop_token_ids": [t], "min_tokens": 3})
    assert t not in got[:3] and got[3] == t and reason == "stop" and len(got) == 4


def test_penalised_requests_leave_free_ones_alone(client):
    plain, _, _ = _ids(client, max_tokens=12)
    rules = dict(presence_penalty=1.5, frequency_penalty=0.5,
                 extra={"repetition_penalty": 1.8, "min_p": 0.1})
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        free = pool.submit(_ids, client, 12)
        ruled = [pool.submit(_ids, client, 12, **dict(rules, extra=dict(rules["extra"])))
                 for _ in range(3)]
        assert free.result()[0] == plain
        outs = [f.result()[0] for f in ruled]
    assert outs[0] == outs[1] == outs[2] != plain
    stream = client.completions.create(model=None, prompt=PROMPT, max_tokens=12,
                                       temperature=0, stream=True, presence_penalty=1.5,
                                       frequency_penalty=0.5, extra_body=dict(
                                           IDS, repetition_penalty=1.8, min_p=0.1))
    assert [t for ev in stream for t in ev.choices[0].model_extra.get("token_ids") or []] \
        == outs[0]


def test_chat_takes_the_penalty_fields(client):
    r = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, presence_penalty=0.5,
                                       frequency_penalty=0.5, logit_bias={"65": 100})
    assert r.choices[0].message.content == "AAAA"       # the demo codec: token 65 is "A"


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("min_p", True), ("min_p", 1.5), ("min_tokens", -1), ("min_tokens", 99),
    ("logit_bias", {"x": 1}), ("logit_bias", {"3": 101}), ("logit_bias", {"100000": 1}),
    ("logit_bias", [1])])
def test_bad_penalty_fields_are_refused_naming_them(server, field, value):
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 8, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
