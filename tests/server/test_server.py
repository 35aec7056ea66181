"""The real server on loopback (`python -m jlco.serve`, tiny random model, offload on)
talked to with a real HTTP client (httpx): completions plain, by token ids and streamed;
streamed text == non-streamed; concurrency; a cancelled stream giving its slot and
pages back; bad requests answered 4xx in vLLM's error shape while the server keeps
serving; served greedy tokens == `python -m jlco.generate`'s."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.support.server import ROOT, TINY_OFFLOAD, ServerProcess

pytestmark = pytest.mark.e2e   # real subprocesses: the e2e tier (pyproject.toml)

TIMEOUT = httpx.Timeout(300.0)
PROMPT_IDS = [(5 * i + 3) % 250 for i in range(80)]   # longer than one 64-token chunk


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(*TINY_OFFLOAD)
    yield srv
    code = srv.stop()
    assert code == 0, srv.stderr[-3000:]
    assert "drained" in srv.stderr


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


def complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"max_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(client, **body) -> list[dict]:
    events = []
    with client.stream("POST", "/v1/completions",
                       json={"max_tokens": 8, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                events.append("[DONE]")
            else:
                events.append(json.loads(line[len("data: "):]))
    assert events[-1] == "[DONE]"
    return events[:-1]


def metrics(client) -> dict:
    text = client.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("" if not s.labels else json.dumps(s.labels, sort_keys=True))
            out[key] = s.value
    return out


def wait_idle(client, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(client)
        if m["jlco_requests_running"] == 0 and m["jlco_requests_waiting"] == 0 \
                and m.get("jlco_host_pool_bytes_used", 0) == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


def test_health_models_and_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "jlco-random-tiny"
    assert models["data"][0]["max_model_len"] == 512
    m = metrics(client)
    assert m["jlco_host_pool_bytes_capacity"] > 0
    assert client.get("/metrics").headers["content-type"].startswith(
        "text/plain; version=0.0.4")
    r = client.post("/metrics")
    assert r.status_code == 405 and r.headers["allow"] == "GET"
    assert r.json()["error"]["code"] == 405


def test_text_and_token_id_completions(client):
    out = complete(client, prompt="Hello, world", max_tokens=6)
    choice = out["choices"][0]
    assert out["object"] == "text_completion" and isinstance(choice["text"], str)
    assert choice["finish_reason"] in ("length", "stop")
    # byte-level prompt: one token per byte
    assert out["usage"]["prompt_tokens"] == len(b"Hello, world")
    assert out["usage"]["total_tokens"] == 12 + out["usage"]["completion_tokens"]
    ids = complete(client, prompt=PROMPT_IDS, max_tokens=6, return_token_ids=True,
                   ignore_eos=True)
    c = ids["choices"][0]
    assert len(c["token_ids"]) == 6 == ids["usage"]["completion_tokens"]
    assert c["finish_reason"] == "length"


@pytest.mark.parametrize("sampling", [dict(temperature=0),
                                      dict(temperature=0.8, top_p=0.9, top_k=50, seed=11)])
def test_streamed_equals_whole(client, sampling):
    body = dict(prompt="The quick brown fox", max_tokens=12, ignore_eos=True,
                return_token_ids=True, **sampling)
    whole = complete(client, **body)["choices"][0]
    events = stream_events(client, stream_options={"include_usage": True}, **body)
    chunks = [e for e in events if e["choices"]]
    assert "".join(e["choices"][0]["text"] for e in chunks) == whole["text"]
    assert sum((e["choices"][0]["token_ids"] for e in chunks), []) == whole["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    # same seed and prompt -> same text (reproducible sampling)
    assert complete(client, **body)["choices"][0]["token_ids"] == whole["token_ids"]


def test_stop_strings_and_stop_token_ids(client):
    base = complete(client, prompt=PROMPT_IDS, max_tokens=10, return_token_ids=True,
                    ignore_eos=True)["choices"][0]
    ids = base["token_ids"]
    out = complete(client, prompt=PROMPT_IDS, max_tokens=10, return_token_ids=True,
                   ignore_eos=True, stop_token_ids=[ids[3]])["choices"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == ids[3]
    assert out["token_ids"] == ids[:ids.index(ids[3]) + 1]
    text = base["text"]
    if len(text) >= 4:
        stop = text[2:4]
        got = complete(client, prompt=PROMPT_IDS, max_tokens=10, ignore_eos=True,
                       stop=[stop])["choices"][0]
        assert got["finish_reason"] == "stop" and got["stop_reason"] == stop
        assert got["text"] == text[:text.index(stop)]


def test_concurrent_clients_all_finish(client, server):
    async def one(ac, i):
        body = {"prompt": [(i * 7 + j) % 250 for j in range(10 + 9 * i)], "max_tokens": 6,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "stream": i % 2 == 0}
        if not body["stream"]:
            r = await ac.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        toks = []
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    toks += json.loads(line[6:])["choices"][0]["token_ids"]
        return toks

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(12)))

    results = asyncio.run(main())
    assert all(len(t) == 6 for t in results)
    # under load == alone (greedy): batch composition does not change a request's tokens
    for i in (0, 5, 11):
        alone = complete(client, prompt=[(i * 7 + j) % 250 for j in range(10 + 9 * i)],
                         max_tokens=6, ignore_eos=True, return_token_ids=True)
        assert alone["choices"][0]["token_ids"] == results[i]
    wait_idle(client)


def test_cancelled_stream_frees_slot_and_pages(client):
    with client.stream("POST", "/v1/completions",
                       json={"prompt": PROMPT_IDS, "max_tokens": 400, "stream": True,
                             "ignore_eos": True, "temperature": 0}) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                n += 1
            if n == 2:
                break       # hang up mid-stream
    m = wait_idle(client)
    assert m["jlco_requests_running"] == 0
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": True}, 400, "n"),
    ({"prompt": "x", "echo": 0}, 400, "echo"),
    ({"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "x", "best_of": True}, 400, "best_of"),
    ({"prompt": "x", "presence_penalty": False}, 400, "presence_penalty"),
    ({"prompt": "x", "seed": True}, 400, "seed"),
    ({"prompt": "x", "top_k": 2.5}, 400, "top_k"),
    ({"prompt": ["x", ""]}, 400, "prompt[1]"),
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ({"prompt": [1] * 600}, 400, "prompt"),
    ({"prompt": [1] * 500, "max_tokens": 100}, 400, "max_tokens"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
])
def test_bad_requests_get_vllm_shaped_errors(client, body, status, param):
    r = (client.post("/v1/completions", content=body) if isinstance(body, bytes)
         else client.post("/v1/completions", json=body))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if param is not None:
        assert err["param"] == param and param in err["message"]
    # and the server keeps serving
    assert complete(client, prompt="ok", max_tokens=1)["usage"]["completion_tokens"] == 1


def test_numbers_read_as_vllm_reads_them(client):
    """2.0 is 2, null the default: the same tokens as the plain integers."""
    body = dict(prompt=PROMPT_IDS, ignore_eos=True, return_token_ids=True, temperature=0.7)
    want = complete(client, **body, max_tokens=3, seed=1, top_k=5)["choices"]
    got = complete(client, **body, max_tokens=3.0, seed=1.0, top_k=5.0, n=None,
                   best_of=None, presence_penalty=0.0)["choices"]
    assert [c["token_ids"] for c in got] == [c["token_ids"] for c in want]
    assert len(got) == 1 and len(got[0]["token_ids"]) == 3


def test_accepted_noop_fields_and_the_demo_chat_template(client):
    out = complete(client, prompt="x", max_tokens=2, logprobs=None, repetition_penalty=1.0,
                   presence_penalty=0, n=1, best_of=None, user="bench")
    assert out["usage"]["completion_tokens"] <= 2
    r = client.post("/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
        "user: hi\nassistant: ")                  # the demo model's plain template
    assert client.get("/v1/nope").status_code == 404


def _outcomes(client) -> float:
    return sum(v for k, v in metrics(client).items()
               if k.startswith("jlco_request_success_total"))


def test_every_request_ends_in_one_outcome(client, server):
    """Finished, stopped, hung up on mid-stream, and choices never read (n=2, the client
    leaves during the first): each engine request counts once in jlco_request_success."""
    wait_idle(client)
    before = _outcomes(client)
    complete(client, prompt=PROMPT_IDS, max_tokens=3, ignore_eos=True)           # 1
    complete(client, prompt=PROMPT_IDS[:20], max_tokens=4, n=2, ignore_eos=True)  # 2
    for n in (1, 2):                                                              # 1 + 2
        with client.stream("POST", "/v1/completions", json={
                "prompt": PROMPT_IDS, "max_tokens": 400, "stream": True, "n": n,
                "ignore_eos": True, "temperature": 0}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break       # hang up after the first chunk
    deadline = time.monotonic() + 60
    while _outcomes(client) < before + 6 and time.monotonic() < deadline:
        time.sleep(0.2)
    m = wait_idle(client)
    time.sleep(1.0)             # nothing is counted twice later on
    assert _outcomes(client) == before + 6, m
    assert m["jlco_request_success_total{\"finished_reason\": \"abort\"}"] >= 3


def test_metrics_invariants(client):
    complete(client, prompt=PROMPT_IDS, max_tokens=4)
    m = metrics(client)
    layers = [k for k in m if k.startswith("jlco_cache_lookups_total{")]
    assert layers
    for k in layers:
        lab = k[len("jlco_cache_lookups_total"):]
        assert m["jlco_cache_hits_total" + lab] <= m[k]
    assert m["jlco_generated_tokens_total"] >= 4 and m["jlco_prompt_tokens_total"] >= 80
    assert m["jlco_time_to_first_token_seconds_count"] >= 1


def test_served_tokens_equal_generate(client):
    """Greedy, offload on: the server's tokens == `python -m jlco.generate`'s for the same
    config and prompt, alone and beside other requests."""
    n = 10
    gen = subprocess.run(
        [sys.executable, "-m", "jlco.generate", "--config", str(ROOT / "configs" / "tiny.py"),
         "--offload", "--prompt_ids", ",".join(map(str, PROMPT_IDS)), "--max_new_tokens",
         str(n), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert gen.returncode == 0, gen.stderr[-2000:]
    want = json.loads(gen.stdout)["tokens"]
    alone = complete(client, prompt=PROMPT_IDS, max_tokens=n, ignore_eos=True,
                     return_token_ids=True)["choices"][0]["token_ids"]
    assert alone == want

    async def crowd():
        async with httpx.AsyncClient(base_url=client.base_url, timeout=TIMEOUT) as ac:
            bodies = [{"prompt": PROMPT_IDS, "max_tokens": n}] + [
                {"prompt": [(3 * j + i) % 250 for j in range(30 + 20 * i)], "max_tokens": 12}
                for i in range(3)]
            rs = await asyncio.gather(*(ac.post("/v1/completions", json={
                **b, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
                for b in bodies))
            return [r.json()["choices"][0]["token_ids"] for r in rs]

    assert asyncio.run(crowd())[0] == want


def test_pd_prefill_export_import_and_claim_over_http(client):
    """A prefill exported by one server (here the same one) and imported through POST
    /v1/internal/prefilled decodes to the tokens of a plain request."""
    exp = client.post("/v1/internal/prefill", json={"prompt": PROMPT_IDS, "max_tokens": 6})
    assert exp.status_code == 200 and exp.headers["content-type"] == "application/octet-stream"
    imp = client.post("/v1/internal/prefilled", content=exp.content,
                      headers={"Content-Type": "application/octet-stream"})
    assert imp.status_code == 200, imp.text
    info = imp.json()
    assert info["prompt_tokens"] == len(PROMPT_IDS) and info["max_tokens"] == 6
    body = dict(prompt=PROMPT_IDS, max_tokens=6, ignore_eos=True, return_token_ids=True)
    claimed = complete(client, kv_transfer_params={"prefill_id": info["prefill_id"]}, **body)
    assert claimed["choices"][0]["token_ids"] == complete(client, **body)["choices"][0]["token_ids"]
    again = client.post("/v1/completions", json={
        **body, "kv_transfer_params": {"prefill_id": info["prefill_id"]}})
    assert again.status_code == 400 and "prefill_id" in again.json()["error"]["message"]
    bad = client.post("/v1/internal/prefilled", content=b"not a payload")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"
    wait_idle(client)
