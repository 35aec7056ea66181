"""tools/bench_agentic.py and its pieces: the JSON-lines trace format (errors name the
line and field), the synthetic generator (session count, turns, growth, interleaving),
the history each route sends, and a replay through all three routes against the app
in-process (tiny random model): greedy, so every route sees the same prompts and gives
the same replies, and the prefix cache serves every turn after the first; the report's
summary, table and PNG; one-line errors for bad flags."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys

import httpx
import pytest

from jlco.ops import agentic_replay, agentic_trace
from tests.support.inprocess import serving, tiny_config
from tests.support.server import ROOT


def _tool():
    spec = importlib.util.spec_from_file_location("bench_agentic",
                                                  ROOT / "tools" / "bench_agentic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trace_lines_and_their_errors(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"session": "a", "turn": 0, "system": "sys", "user": "hi", "output_tokens": 4}\n'
        '{"session": "b", "turn": 0, "user_tokens": 7, "output_tokens": 2}\n'
        '\n{"session": "a", "turn": 1, "tool_results": ["ok", 5], "output_tokens": 3}\n')
    s = agentic_trace.read_trace(path)
    assert list(s) == ["a", "b"] and [t.turn for t in s["a"]] == [0, 1]
    assert s["a"][0].system == "sys" and s["a"][0].user == "hi"
    assert len(s["b"][0].user) == 7 and s["b"][0].user == agentic_trace.read_trace(path)[
        "b"][0].user                                    # synthetic text is seeded
    assert s["a"][1].tool_results[0] == "ok" and len(s["a"][1].tool_results[1]) == 5
    for line, needle in (
            ('{"session": "a", "turn": 1, "user": "x", "output_tokens": 1}', "out of order"),
            ('{"session": "a", "turn": 0, "user": "x"}', "output_tokens is required"),
            ('{"session": "a", "turn": 0, "user": "x", "output_tokens": 1, "foo": 1}',
             "unknown field 'foo'"),
            ('{"session": "a", "turn": 0, "tool_results": [3], "output_tokens": 1}',
             "no reply has called a tool yet"),
            ('{"session": "a", "turn": 0, "user": -1, "output_tokens": 1}', "user=-1"),
            ('[1]', "a JSON object")):
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=needle) as err:
            agentic_trace.read_trace(path)
        assert str(err.value).startswith(f"{path}:1")


def test_synthetic_sessions_grow_to_their_context_and_interleave():
    lines = agentic_trace.synthetic(3, (10, 12), (4000, 6000), 16, seed=1)
    sessions = {}
    for i, doc in enumerate(lines):
        t = agentic_trace.parse_turn(doc, f"line {i}")
        sessions.setdefault(t.session, []).append(t)
    assert sorted(sessions) == ["s0", "s1", "s2"]
    assert [json.loads(json.dumps(x))["session"] for x in lines[:3]] == ["s0", "s1", "s2"]
    for turns in sessions.values():
        assert 10 <= len(turns) <= 12 and [t.turn for t in turns] == list(range(len(turns)))
        size = sum(len(t.system or "") + len(t.user or "") + sum(map(len, t.tool_results))
                   for t in turns) + 16 * len(turns)
        assert 4000 * 0.9 <= size <= 6000 * 1.05, size
        assert all(t.tool_results for t in turns[1:]) and turns[0].system


def test_each_route_sends_the_same_history():
    turns = [agentic_trace.Turn("s", 0, "u0", (), 4, "sys"),
             agentic_trace.Turn("s", 1, None, ("r0", "r1"), 4),
             agentic_trace.Turn("s", 2, "u2", ("r2",), 4)]
    conv = agentic_trace.Conversation("s")
    for t, reply in zip(turns, ("a0", "a1", None)):
        conv.add(t)
        conv.steps[-1].reply = reply
    chat = conv.chat_messages()
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool", "tool",
                                         "assistant", "tool", "user"]
    assert [c["id"] for c in chat[2]["tool_calls"]] == ["call_s_0_0", "call_s_0_1"]
    assert chat[3] == {"role": "tool", "tool_call_id": "call_s_0_0", "content": "r0"}
    ant = conv.anthropic_messages()
    assert [m["role"] for m in ant] == ["user", "assistant", "user", "assistant", "user"]
    assert ant[3]["content"][1] == {"type": "tool_use", "id": "call_s_1_0", "name": "run",
                                    "input": {"i": 0}}
    items = conv.responses_input()
    assert [i["type"] for i in items] == ["function_call", "function_call_output", "message"]


@pytest.fixture(scope="module")
def app():
    with serving(tiny_config()) as (application, _):
        yield application


def _replay(app, route, trace):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=300) as client:
            await client.post("/v1/reset_prefix_cache")
            return await agentic_replay.replay(client, route, trace, "tiny", 2)
    return asyncio.run(go())


def test_replay_through_every_route(app, tmp_path):
    lines = agentic_trace.synthetic(2, (3, 3), (300, 400), 6, seed=2)
    trace = {}
    for i, doc in enumerate(lines):
        t = agentic_trace.parse_turn(doc, f"line {i}")
        trace.setdefault(t.session, []).append(t)
    runs = {route: _replay(app, route, trace) for route in agentic_replay.ROUTES}
    for route, sessions in runs.items():
        for s in sessions:
            assert [t["turn"] for t in s["turns"]] == [0, 1, 2]
            assert all(t["cached_tokens"] > 0 for t in s["turns"][1:]), (route, s)
            assert all(t["ttft_s"] > 0 and t["output_tokens"] > 0 for t in s["turns"])
            assert 0 < s["hit_rate"] < 1
    key = [[(t["prompt_tokens"], t["reply"]) for t in s["turns"]] for s in runs["chat"]]
    for route in ("responses", "messages"):
        assert [[(t["prompt_tokens"], t["reply"]) for t in s["turns"]]
                for s in runs[route]] == key, route
    tool = _tool()
    targets = [{"label": "server", "routes": [
        dict(tool.summarize(route, runs[route]), duration_s=1.0) for route in runs]}]
    text = tool.table(targets)
    assert "server | messages |" in text and text.count("\n") == 2 + 3 + 2 + 3
    assert "replies equal over every server and route: True" in text
    tool.plot(targets, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0


@pytest.mark.e2e       # the tool as a user runs it: a subprocess
@pytest.mark.parametrize("args, needle", [
    (["--url=http://x:1", "--routes=chat,grpc"], "--routes=chat,grpc: allowed"),
    (["--url=http://x:1", "--min_turns=9", "--max_turns=3"], "--min_turns=9 is above"),
    ([], "give --url"),
    (["--url=http://x:1", "--trace=/nonexistent.jsonl"], "nonexistent.jsonl"),
])
def test_bad_flags_are_one_line_errors(args, needle, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_agentic.py"), *args,
                        f"--out={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
