"""The evaluator's side of the OpenAI API, with the `openai` client against a real
`python -m jlco.serve` (tiny random model, offload on): log-probs of generated tokens with
their alternatives (completions' legacy shape and chat's), `echo` with prompt log-probs
(lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1, token-id prompts in a
batch), several prompts and `n` choices in one request, streamed log-probs, the demo
model's chat template, and the prefix cache's `cached_tokens`."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from tests.support.server import TINY_OFFLOAD, server_fixtures

pytestmark = pytest.mark.e2e   # real subprocesses: the e2e tier (pyproject.toml)

PROMPT = [(7 * i + 3) % 250 for i in range(70)]


server, client = server_fixtures(*TINY_OFFLOAD)


def _greedy(client, prompt, **kw):
    return client.completions.create(model=None, prompt=prompt, temperature=0, **kw)


def test_generated_tokens_carry_their_alternatives(client):
    r = _greedy(client, PROMPT, max_tokens=5, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and tok_lp <= 0
        assert abs(max(top.values()) - tok_lp) < 1e-5          # greedy: the most likely
    assert lp.text_offset == sorted(lp.text_offset)
    zero = _greedy(client, PROMPT, max_tokens=3, logprobs=0).choices[0].logprobs
    assert zero.token_logprobs == lp.token_logprobs[:3] and zero.top_logprobs == [{}] * 3
    assert _greedy(client, PROMPT, max_tokens=3).choices[0].logprobs is None


def test_echo_is_lm_evals_loglikelihood_request(client):
    """prompt: token-id lists, echo, logprobs 1, max_tokens 1 (lm-eval's local-completions)."""
    batch = [PROMPT[:40], PROMPT[:55], PROMPT, PROMPT[10:60]]
    r = _greedy(client, batch, max_tokens=1, logprobs=1, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c, p in zip(r.choices, batch):
        lp = c.logprobs
        assert len(lp.token_logprobs) == len(p) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
        assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    # position q's log-prob is the same whatever comes after it (prompts 0-2 share a prefix)
    a, b = r.choices[0].logprobs.token_logprobs, r.choices[2].logprobs.token_logprobs
    assert max(abs(x - y) for x, y in zip(a[1:40], b[1:40])) < 1e-5
    # the echoed generated token is the one a plain request gets
    plain = _greedy(client, PROMPT[:40], max_tokens=1, logprobs=1).choices[0].logprobs
    assert abs(a[40] - plain.token_logprobs[0]) < 1e-5
    only = _greedy(client, PROMPT[:40], max_tokens=0, echo=True, logprobs=0).choices[0]
    assert len(only.logprobs.tokens) == 40 and r.usage.completion_tokens == 4


def test_several_prompts_and_n(client):
    prompts = [PROMPT[:20], PROMPT[20:45]]
    r = _greedy(client, prompts, max_tokens=4, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = [_greedy(client, p, max_tokens=4).choices[0].text for p in prompts]
    assert [c.text for c in r.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert r.usage.prompt_tokens == 45 and r.usage.completion_tokens == 16
    sampled = client.completions.create(model=None, prompt=PROMPT[:20], max_tokens=8, n=3,
                                        temperature=1.0, seed=5)
    again = client.completions.create(model=None, prompt=PROMPT[:20], max_tokens=8, n=3,
                                      temperature=1.0, seed=5)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    assert len({c.text for c in sampled.choices}) > 1, "n sampled choices are different draws"


def test_streamed_logprobs_equal_the_whole(client):
    whole = _greedy(client, PROMPT, max_tokens=6, logprobs=2).choices[0].logprobs
    got = []
    for chunk in _greedy(client, PROMPT, max_tokens=6, logprobs=2, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                got += c.logprobs.token_logprobs
    assert got == whole.token_logprobs


def test_chat_logprobs_on_the_demo_model(client):
    r = client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "hello"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-5
        assert bytes(e.bytes).decode(errors="replace") == e.token
    assert math.isfinite(content[0].logprob)


def test_cached_tokens_are_reported(client):
    first = [(3 * i + 1) % 250 for i in range(70)]
    assert _greedy(client, first, max_tokens=2).usage.prompt_tokens_details.cached_tokens == 0
    r = _greedy(client, first + [9] * 30, max_tokens=2)
    # 4 full pages of 16 (the 5th, 64..79, is not full in the first prompt)
    assert r.usage.prompt_tokens_details.cached_tokens == 64
    # the streamed final usage carries it too
    chunks = list(_greedy(client, first + [9] * 30 + [4] * 8, max_tokens=2, stream=True,
                          stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 64
    # and chat: the same long message twice, the second prefill reuses its full pages
    msgs = [{"role": "user", "content": "tell me about the prefix cache " * 3}]
    chat = [client.chat.completions.create(model=None, messages=msgs, max_tokens=1,
                                           temperature=0) for _ in range(2)]
    assert chat[0].usage.prompt_tokens_details.cached_tokens == 0
    assert chat[1].usage.prompt_tokens_details.cached_tokens >= 64


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": [[1, 2], "x", 3]}, "prompt"),
])
def test_bad_values_name_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_models_retrieve_tokenize_and_detokenize(client, server):
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    t = httpx.post(f"{server.url}/tokenize", json={"prompt": "héllo"}, timeout=60).json()
    assert t["count"] == len(t["tokens"]) == len("héllo".encode())     # byte-level demo
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": t["tokens"]}, timeout=60)
    assert d.json() == {"prompt": "héllo"}
    chat = httpx.post(f"{server.url}/tokenize", json={
        "messages": [{"role": "user", "content": "hi"}]}, timeout=60).json()
    assert chat["count"] == len("user: hi\nassistant: ")
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [1, True]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_405_names_the_allowed_methods(server):
    r = httpx.get(f"{server.url}/v1/completions", timeout=60)
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_prefix_metrics_and_reset(client, server):
    def scrape():
        text = httpx.get(f"{server.url}/metrics", timeout=60).text
        return {l.split()[0]: float(l.split()[1]) for l in text.splitlines()
                if l.startswith("jlco_prefix_cache")}
    p = [(11 * i + 2) % 250 for i in range(40)]
    _greedy(client, p, max_tokens=1)
    m = scrape()
    assert m["jlco_prefix_cache_pages"] > 0 and m["jlco_prefix_cache_bytes"] > 0
    assert 0 <= m["jlco_prefix_cache_hits_total"] <= m["jlco_prefix_cache_queries_total"]
    r = httpx.post(f"{server.url}/v1/reset_prefix_cache", timeout=60).json()
    assert r["dropped_pages"] == m["jlco_prefix_cache_pages"]
    assert scrape()["jlco_prefix_cache_pages"] == 0
