"""Replaying agentic sessions (`jlco.ops.agentic_trace`) against a server, through one of
three routes, each streamed and timed as its client sees it:

  chat       POST /v1/chat/completions, the whole history every turn;
  responses  POST /v1/responses, the turn's new items chained by previous_response_id
             (the server keeps the conversation: `store` true);
  messages   POST /v1/messages (Anthropic's), the whole history every turn.

Per turn: TTFT (send → the first event carrying reply text), ITL ((last text event −
first) / (output tokens − 1): the mean gap per token of the reply), e2e, the prompt's
tokens and those the prefix cache gave (each route's usage names them), the reply's
tokens. Greedy (temperature 0), so the routes' replies can be compared.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx

from jlco.ops.agentic_trace import Conversation, Turn

ROUTES = ("chat", "responses", "messages")


@dataclasses.dataclass
class TurnResult:
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None
    reply: str = ""
    error: str | None = None


class _Timer:
    """Arrival times of the reply's text events."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.first = self.last = None

    def text(self) -> None:
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now

    def finish(self, r: TurnResult) -> None:
        end = time.perf_counter()
        r.e2e_s = end - self.t0
        r.ttft_s = (self.first or end) - self.t0
        if self.first is not None and r.output_tokens > 1:
            r.itl_s = (self.last - self.first) / (r.output_tokens - 1)


def _body(route: str, conv: Conversation, model: str | None, turn: Turn,
          prev: str | None) -> tuple[str, dict]:
    common = {"stream": True, "temperature": 0}
    if model:
        common["model"] = model
    if route == "chat":
        return "/v1/chat/completions", {**common, "messages": conv.chat_messages(),
                                        "max_tokens": turn.output_tokens,
                                        "stream_options": {"include_usage": True}}
    if route == "messages":
        body = {**common, "messages": conv.anthropic_messages(),
                "max_tokens": turn.output_tokens}
        if conv.system is not None:
            body["system"] = conv.system
        return "/v1/messages", body
    body = {**common, "input": conv.responses_input(), "max_output_tokens": turn.output_tokens,
            "store": True}
    if conv.system is not None:
        body["instructions"] = conv.system
    if prev is not None:
        body["previous_response_id"] = prev
    return "/v1/responses", body


def _chat_event(doc: dict, r: TurnResult, timer: _Timer, state: dict) -> None:
    for c in doc.get("choices") or ():
        text = (c.get("delta") or {}).get("content")
        if text:
            timer.text()
            r.reply += text
    u = doc.get("usage")
    if u:
        r.prompt_tokens, r.output_tokens = u["prompt_tokens"], u["completion_tokens"]
        r.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _responses_event(doc: dict, r: TurnResult, timer: _Timer, state: dict) -> None:
    kind = doc.get("type", "")
    if kind == "response.output_text.delta" and doc.get("delta"):
        timer.text()
        r.reply += doc["delta"]
    elif kind in ("response.completed", "response.incomplete"):
        resp = doc["response"]
        state["id"] = resp["id"]
        u = resp.get("usage") or {}
        r.prompt_tokens, r.output_tokens = u.get("input_tokens", 0), u.get("output_tokens", 0)
        r.cached_tokens = (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
    elif kind in ("error", "response.failed"):
        r.error = json.dumps(doc)[:300]


def _messages_event(doc: dict, r: TurnResult, timer: _Timer, state: dict) -> None:
    kind = doc.get("type", "")
    if kind == "content_block_delta" and doc["delta"].get("type") == "text_delta":
        timer.text()
        r.reply += doc["delta"]["text"]
    elif kind == "message_delta":
        u = doc.get("usage") or {}
        r.cached_tokens = u.get("cache_read_input_tokens") or 0
        r.prompt_tokens = u.get("input_tokens", 0) + r.cached_tokens
        r.output_tokens = u.get("output_tokens", 0)
    elif kind == "error":
        r.error = json.dumps(doc)[:300]


EVENTS = {"chat": _chat_event, "responses": _responses_event, "messages": _messages_event}


async def send_turn(client: httpx.AsyncClient, route: str, conv: Conversation, turn: Turn,
                    model: str | None, state: dict) -> TurnResult:
    """One streamed turn; `state` carries the responses route's previous id."""
    path, body = _body(route, conv, model, turn, state.get("id"))
    r, timer = TurnResult(turn.turn), _Timer()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return r
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    doc = json.loads(line[6:])
                    if route == "chat" and "error" in doc:
                        r.error = json.dumps(doc)[:300]
                    EVENTS[route](doc, r, timer, state)
    except (httpx.HTTPError, ValueError, KeyError) as err:
        r.error = f"{type(err).__name__}: {err}"
    timer.finish(r)
    return r


async def replay_session(client: httpx.AsyncClient, route: str, name: str, turns: list[Turn],
                         model: str | None) -> dict:
    """Every turn of one session in order → {session, turns: [TurnResult dicts],
    hit_rate: cached / prompt tokens over the session}."""
    conv, state, out = Conversation(name), {}, []
    for turn in turns:
        conv.add(turn)
        r = await send_turn(client, route, conv, turn, model, state)
        if r.error:
            raise RuntimeError(f"{route} session {name} turn {turn.turn}: {r.error}")
        conv.steps[-1].reply = r.reply
        out.append(dataclasses.asdict(r))
    prompt = sum(t["prompt_tokens"] for t in out)
    return dict(session=name, turns=out,
                hit_rate=sum(t["cached_tokens"] for t in out) / prompt if prompt else 0.0)


async def replay(client: httpx.AsyncClient, route: str, sessions: dict[str, list[Turn]],
                 model: str | None, concurrency: int) -> list[dict]:
    """All sessions, at most `concurrency` at once (their turns interleave on the server)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(name, turns):
        async with gate:
            return await replay_session(client, route, name, turns, model)
    return list(await asyncio.gather(*(one(n, t) for n, t in sessions.items())))
