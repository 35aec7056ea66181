"""Responses of the completion routes: one `Choice` per prompt and per `n`, their output
as `Piece`s, and the OpenAI shapes built from them (whole or as SSE chunks; usage with
the prefix cache's `cached_tokens`; log-probs from `jlco.server.logprobs`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse

from jlco.server.logprobs import CompletionLogprobs, chat_logprobs
from jlco.server.logprobs import join as logprob_join
from jlco.server.loop import Stream
from jlco.server.protocol import ApiError, SamplingRequest


@dataclasses.dataclass
class Piece:
    """Text and token ids a request produced since the last piece; `finish_reason`
    once it ended."""
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    start: int = 0          # the request's token number of token_ids[0]


@dataclasses.dataclass
class Choice:
    """One choice of a response: its engine request and what reads its output."""
    index: int
    prompt_ids: list[int]
    prompt_text: str | None
    req: Any
    stream: Stream
    gen: Any
    drop: bool          # max_tokens 0 with echo: the one generated token is not returned
    abandon: Any = None  # () -> None: abort the request unless it ended (idempotent)
    shaper: Any = None   # chat: its assistant message (`jlco.server.assistant.Shaper`)


def _abandon_all(choices: list[Choice]) -> None:
    """The response is over: a choice not read to its end (the client left, or an earlier
    choice failed) is aborted, so its slot comes back and its outcome is counted once. A
    generator never started would not run its own clean-up."""
    for c in choices:
        if c.abandon is not None:
            c.abandon()


def usage(choices: list[Choice], n: int) -> dict:
    """Prompt tokens once per prompt (its first choice of `n`), completion tokens of
    every choice; `prompt_tokens_details.cached_tokens`: positions the prefix cache gave."""
    firsts = choices[::n]
    prompt = sum(len(c.prompt_ids) for c in firsts)
    completion = sum(0 if c.drop else len(c.req.tokens) for c in choices)
    u = {"prompt_tokens": prompt, "completion_tokens": completion,
         "total_tokens": prompt + completion,
         "prompt_tokens_details": {"cached_tokens": sum(c.req.cached_tokens for c in firsts)}}
    if any(c.shaper is not None for c in choices):
        u["completion_tokens_details"] = {"reasoning_tokens": sum(
            c.shaper.reasoning_tokens(c.req.tokens) for c in choices if c.shaper is not None)}
    drafted = sum(c.req.num_drafted for c in choices)
    if drafted:
        accepted = sum(c.req.num_accepted for c in choices)
        u["jlco_spec"] = {"drafted_tokens": drafted, "accepted_tokens": accepted,
                          "acceptance": round(accepted / drafted, 4)}
    return u


def _choice(c: Choice, p: SamplingRequest, state, piece: Piece, chat: bool, *,
            delta: bool, logprobs=None) -> dict:
    """One choice entry; `logprobs` the completions builder (`CompletionLogprobs`) whose
    prompt part, with echo, is already out (a streamed response's first piece carries it)."""
    out: dict[str, Any] = {"index": c.index}
    ids, text = ([], "") if c.drop else (piece.token_ids, piece.text)
    finish = piece.finish_reason
    if chat:
        out["delta" if delta else "message"] = _message(c.shaper, text, finish, delta)
        if finish == "stop" and c.shaper.tool_calls_seen:
            finish = "tool_calls"
        if p.logprobs is not None:
            out["logprobs"] = chat_logprobs(state.codec, c.req, piece.start, ids, p.logprobs)
    else:
        out["text"] = text
        out["logprobs"] = None if logprobs is None else logprobs.generated(c.req, piece.start,
                                                                           ids)
    out["finish_reason"] = finish
    out["stop_reason"] = piece.stop_reason
    if p.return_token_ids:
        out["token_ids"] = ids
    return out


def _message(shaper, text: str, finish: str | None, delta: bool) -> dict:
    """A chat choice's message, or its delta: this piece's deltas from the shaper (and
    its last ones when the choice ends) merged into one."""
    if not delta:
        return shaper.message(text)
    parts = shaper.feed(text) + (shaper.finish() if finish is not None else [])
    out: dict[str, Any] = {"role": "assistant", "content": ""}
    for d in parts:
        for key, v in d.items():
            if key == "tool_calls":
                out.setdefault("tool_calls", []).extend(v)
            elif key in ("content", "reasoning_content"):
                out[key] = (out.get(key) or "") + v
    if "tool_calls" in out and not out["content"]:
        out["content"] = None
    return out


def _echo(c: Choice, p: SamplingRequest, state, builder) -> tuple[str, dict | None]:
    """With echo: the prompt's text and (with logprobs) its log-prob entries."""
    text = c.prompt_text if c.prompt_text is not None else state.codec.decode(c.prompt_ids) \
        if state.codec is not None else ""
    return text, None if builder is None else builder.prompt(c.req)


def _entry(c: Choice, p: SamplingRequest, state, piece: Piece, chat: bool, builder,
           echo: bool, *, delta: bool) -> dict:
    """A choice entry; with `echo` (completions) the prompt's text and log-probs first."""
    if not echo or chat:
        return _choice(c, p, state, piece, chat, delta=delta, logprobs=builder)
    text, lp = _echo(c, p, state, builder)
    entry = _choice(c, p, state, piece, chat, delta=delta, logprobs=builder)
    entry["text"] = text + entry["text"]
    if lp is not None:
        entry["logprobs"] = logprob_join([lp, entry["logprobs"]])
    return entry


def _builder(p: SamplingRequest, state, chat: bool):
    return None if chat or p.logprobs is None else CompletionLogprobs(state.codec, p.logprobs)


async def _collect(c: Choice) -> Piece | None:
    """A choice's whole output as one Piece (None: the client went away)."""
    text, ids, last = [], [], None
    async for piece in c.gen:
        text.append(piece.text)
        ids.extend(piece.token_ids)
        last = piece
    if last is None or last.finish_reason is None:
        return None
    return Piece("".join(text), ids, last.finish_reason, last.stop_reason, 0)


async def whole(choices: list[Choice], rid, p: SamplingRequest, state,
                 chat: bool) -> JSONResponse:
    try:
        pieces = await asyncio.gather(*(_collect(c) for c in choices))
    finally:
        _abandon_all(choices)
    if any(x is None for x in pieces):    # the client went away: nobody reads this
        return JSONResponse({}, status_code=499)
    out = []
    for c, piece in zip(choices, pieces):
        out.append(_entry(c, p, state, piece, chat, _builder(p, state, chat), p.echo,
                          delta=False))
    return JSONResponse({
        "id": rid, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": state.model_name, "choices": out,
        "usage": usage(choices, p.n)})


async def sse(choices: list[Choice], rid, p: SamplingRequest, state,
               chat: bool) -> AsyncIterator[bytes]:
    """Each choice's chunks, one choice after another (all were queued at once, so they
    compute together; their tokens wait in their streams)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    def event(entries, usage=None) -> bytes:
        doc = {"id": rid, "object": obj, "created": created, "model": state.model_name,
               "choices": entries}
        if usage is not None or p.include_usage:
            doc["usage"] = usage
        return f"data: {json.dumps(doc)}\n\n".encode()

    try:
        for c in choices:
            builder = _builder(p, state, chat)
            first = True
            async for piece in c.gen:
                yield event([_entry(c, p, state, piece, chat, builder, first and p.echo,
                                    delta=True)])
                first = False
    except ApiError as err:
        yield f"data: {json.dumps(err.body())}\n\n".encode()
    finally:
        _abandon_all(choices)
    if p.include_usage:
        yield event([], usage(choices, p.n))
    yield b"data: [DONE]\n\n"
