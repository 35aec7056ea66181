"""The HTTP face of the server: FastAPI routes over an `EngineLoop`.

Routes: POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat template,
DeepSeek-V3.2's encoding, or the demo model's plain one; tools and structured outputs:
`assistant`), POST /v1/responses (OpenAI's Responses API over the chat route:
`responses_api`; stored, GET / DELETE /v1/responses/{id}: `response_store`), POST
/v1/messages and /v1/messages/count_tokens (Anthropic's Messages API over the chat
route: `messages`), POST /v1/internal/prefill and /v1/internal/prefilled (PD
disaggregation: export a prefill as a safetensors payload; import one, claimed later by a
completion with `kv_transfer_params`), GET /v1/models and /v1/models/{id}, POST /tokenize
and /detokenize (vLLM's), POST /v1/reset_prefix_cache, GET /health (200 ready; 503
loading, draining, broken, or admission paused by a pool watermark), GET /metrics
(Prometheus). Bodies and error responses are declared in /openapi.json (`schema`); the
handlers read raw JSON through `protocol`. Every /v1 route and the tokenizer routes
check `Authorization: Bearer KEY` (or `x-api-key: KEY`) when the server has an API key.
Streaming is SSE (`data: {json}` chunks, then `data: [DONE]`), the same text as the
non-streamed response because both go through one `Detokenizer`. A client that disconnects aborts its request
(its slot and pages come back at the engine's next step). Handlers ask the engine, never
its scheduler: `submit` / `claim` with one `SamplingParams` per choice (checked when made;
the engine checks it against its vocabulary once, when it queues), `admission_status()`
(health), and refusals by `RequestError.kind` (`loop.refusal`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import secrets
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest

from jlco.engine.scheduler import RequestError
from jlco.sampling.params import SamplingParams
from jlco.server.loop import Delta, EngineLoop, Stream, refusal
from jlco.server.metrics import ServerMetrics
from jlco.server import schema
from jlco.server import messages, responses_api
from jlco.server.responses import Choice, Piece, sse, whole
from jlco.server.protocol import (
    ApiError,
    SamplingRequest,
    bad,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_json,
    parse_tokenize,
)
from jlco.server.assistant import chat_prompt, shaper_for
from jlco.server.state import ServerState  # noqa: F401 (the app's state, re-exported)
from jlco.server.text import Detokenizer, TextCodec
from jlco.structured.grammar import GrammarError, GrammarSpec

DISCONNECT_POLL_S = 0.5
# What generate_latest writes: the text format 0.0.4 (prometheus_client's newer
# CONTENT_TYPE_LATEST names 1.0.0, which older scrapers do not negotiate).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over `state`. The handlers are this module's functions; each
    reads the state (and the metrics) from `request.app.state`."""
    app = FastAPI(title="jlco", docs_url=None, redoc_url=None)
    app.state.metrics = ServerMetrics(state)
    app.state.jlco = state
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(404, _not_found)
    app.add_exception_handler(405, _bad_method)
    app.middleware("http")(_auth)
    none = schema.route_extra(None)
    app.get("/health")(health)
    app.get("/metrics", responses=schema.METRICS_RESPONSE,
            response_class=Response)(prometheus)
    app.get("/v1/models", openapi_extra=none)(models)
    app.get("/v1/models/{model_id:path}", openapi_extra=none)(model_info)
    app.post("/tokenize", openapi_extra=schema.route_extra(schema.TokenizeBody))(tokenize)
    app.post("/detokenize", openapi_extra=schema.route_extra(schema.DetokenizeBody))(
        detokenize)
    app.post("/v1/reset_prefix_cache", openapi_extra=none)(reset_prefix_cache)
    app.post("/v1/completions", openapi_extra=schema.route_extra(schema.CompletionBody))(
        completions)
    app.post("/v1/chat/completions", openapi_extra=schema.route_extra(schema.ChatBody))(chat)
    responses_api.register(app, chat)      # /v1/responses (stored: response_store), over chat
    messages.register(app, chat)           # POST /v1/messages (Anthropic's), over chat
    app.post("/v1/internal/prefilled", openapi_extra=none)(import_prefilled)
    app.post("/v1/internal/prefill", openapi_extra=none)(export_prefill)
    schema.add_components(app)
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.jlco


async def _api_error(_: Request, err: ApiError):
    return _error(err)


async def _not_found(request: Request, _):
    return _error(ApiError(404, f"no route {request.method} {request.url.path}"))


async def _bad_method(request: Request, exc):
    resp = _error(ApiError(405, f"method {request.method} not allowed on {request.url.path}"))
    allow = (getattr(exc, "headers", None) or {}).get("Allow")
    if allow:
        resp.headers["Allow"] = allow
    return resp


# Routes outside /v1 that the API key guards too (vLLM's tokenizer routes).
KEYED_PATHS = ("/tokenize", "/detokenize")


async def _auth(request: Request, call_next):
    key = _state(request).api_key
    path = request.url.path
    if key and (path.startswith("/v1") or path in KEYED_PATHS):
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return _error(ApiError(401, "missing or wrong API key: send "
                                        "'Authorization: Bearer <key>'"))
    return await call_next(request)


async def health(request: Request):
    why = _state(request).unhealthy()
    if why:
        return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
    return {"status": "ok"}


async def prometheus(request: Request):
    return Response(generate_latest(request.app.state.metrics.registry),
                    media_type=METRICS_CONTENT_TYPE)


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "jlco", "root": state.model_name, "max_model_len": state.max_context_len,
            "index_topk": state.index_topk}


async def models(request: Request):
    return {"object": "list", "data": [_model_card(_state(request))]}


async def model_info(request: Request, model_id: str):
    """GET /v1/models/{id} (`client.models.retrieve`)."""
    state = _state(request)
    _check_model(state, model_id)
    return _model_card(state)


def _codec_for(state: ServerState, model: str | None) -> TextCodec:
    """The tokenizer the (de)tokenize routes use, or why there is none: loading (503),
    another model named (404), a checkpoint without tokenizer.json (400)."""
    _check_model(state, model)
    if state.codec is None:
        if state.loop is None:
            raise ApiError(503, state.loading)
        raise ApiError(400, "this model has no tokenizer (its checkpoint has no "
                            "tokenizer.json): prompts are token ids")
    return state.codec


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"The model `{model}` does not exist (this server serves "
                            f"`{state.model_name}`)", "model")


async def tokenize(request: Request):
    """vLLM's POST /tokenize: {"prompt": text} or {"messages": [...]} (the chat template)
    → {"count", "max_model_len", "tokens"}."""
    state = _state(request)
    t = parse_tokenize(parse_json(await request.body()))
    codec = _codec_for(state, t.model)
    if t.messages is not None:
        text = chat_prompt(codec, state.model_type, t.messages, t.add_generation_prompt,
                           SamplingRequest.plain())
        ids = codec.encode(text) if t.add_special_tokens else codec.encode_chat(text)
    else:       # encode_chat adds no special token: the text alone
        ids = codec.encode(t.prompt) if t.add_special_tokens else codec.encode_chat(t.prompt)
    return {"count": len(ids), "max_model_len": state.max_context_len, "tokens": ids}


async def detokenize(request: Request):
    """vLLM's POST /detokenize: {"tokens": [ids]} → {"prompt": text}."""
    state = _state(request)
    toks, model = parse_detokenize(parse_json(await request.body()))
    return {"prompt": _codec_for(state, model).decode(toks)}


async def reset_prefix_cache(request: Request):
    """Drop every cached prefix page (vLLM's /reset_prefix_cache; behind the API key)."""
    state = _state(request)
    why = state.not_ready()
    if why:
        raise ApiError(503, why)
    n = await asyncio.wrap_future(state.loop.reset_prefix_cache())
    return {"dropped_pages": n}


async def completions(request: Request):
    params = parse_completion(parse_json(await request.body()))
    return await _serve(request, params, None, chat=False)


async def chat(request: Request):
    params, messages, add_gen = parse_chat(parse_json(await request.body()))
    state = _state(request)
    text = chat_prompt(state.codec, state.model_type, messages, add_gen, params)
    return await _serve(request, params, text, chat=True)


async def import_prefilled(request: Request):
    """PD disaggregation, decode side: a prefill made elsewhere (a safetensors payload,
    `jlco.engine.transfer`) takes a slot here; a completion request claims it with
    `"kv_transfer_params": {"prefill_id": ...}` within serve.import_ttl_s."""
    from jlco.engine.transfer import PrefilledRequest
    state = _state(request)
    why = state.not_ready()
    if why:
        raise ApiError(503, why)
    try:
        payload = PrefilledRequest.from_bytes(await request.body())
    except ValueError as err:
        raise ApiError(400, str(err), "body") from None
    req = await asyncio.wrap_future(state.loop.call(functools.partial(_import, payload)))
    return {"prefill_id": f"pf-{req.id}", "prompt_tokens": len(req.prompt),
            "max_tokens": req.max_new_tokens,
            "expires_in_s": state.engine.cfg.serve.import_ttl_s}


def _import(payload, engine):
    """On the engine thread: take the import, or say that no slot or pages are free now."""
    try:
        return engine.import_prefill(payload)
    except RequestError as err:
        if err.kind == "no_pages":
            raise ApiError(503, f"no host pages for the import: {err}") from None
        if err.kind == "no_slot":
            raise ApiError(503, f"{err}; retry later") from None
        raise


async def export_prefill(request: Request):
    """PD disaggregation, prefill side: prefill {"prompt": text or ids, "max_tokens":
    room the decode node reserves} here and return the payload for
    /v1/internal/prefilled (application/octet-stream)."""
    state = _state(request)
    body = parse_json(await request.body())
    if set(body) - {"prompt", "max_tokens", "model"}:
        raise bad(sorted(set(body) - {"prompt", "max_tokens", "model"})[0], "unknown field")
    p = parse_completion({k: v for k, v in body.items() if k != "model"})
    why = state.not_ready()
    if why:
        raise ApiError(503, why)
    ids = state.codec.encode(p.prompt_text) if p.prompt_text is not None else p.prompt_ids
    data = await asyncio.wrap_future(state.loop.call(
        lambda engine: engine.export_prefill(ids, p.max_tokens).to_bytes()))
    return Response(data, media_type="application/octet-stream")


async def _serve(request: Request, p: SamplingRequest, chat_text: str | None, *, chat: bool):
    """A completion: prompt ids, then one engine request per prompt and per `n` queued
    (or an imported prefill claimed) and their tokens streamed or returned whole."""
    state = _state(request)
    why = state.not_ready()
    if why:
        raise ApiError(503, why)
    _check_model(state, p.model)
    prompts = [(p.prompt_text, p.prompt_ids)] + list(p.more_prompts)
    choices: list[Choice] = []
    try:
        for text, given in prompts:
            ids = _prompt_ids(state.codec, text, given, chat_text)
            for j in range(p.n):
                choices.append(await _queue(request, state, p, ids, text, j, len(choices)))
    except BaseException:
        for c in choices:       # nobody will read them: give their slots back
            c.abandon()
        raise
    for c in choices if chat else ():
        c.shaper = shaper_for(p, state.model_type, chat_text, state.codec,
                              (state.tool_call_parser, state.reasoning_parser))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
    if p.stream:
        return StreamingResponse(sse(choices, rid, p, state, chat),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await whole(choices, rid, p, state, chat)


async def _queue(request: Request, state: ServerState, p: SamplingRequest, ids: list[int],
                 text: str | None, j: int, index: int) -> Choice:
    """Queue choice `index` (the j-th of its prompt) with its own SamplingParams → its
    Choice; a bad field is a 400 naming it."""
    codec = state.codec
    drop = p.echo and p.max_tokens == 0
    max_new = 1 if drop else _max_new_tokens(state.max_context_len, p, ids)
    stops = set(p.stop_token_ids)
    if not p.ignore_eos and codec is not None:
        stops.update(codec.stop_token_ids)
        if codec.eos_token_id is not None:
            stops.add(codec.eos_token_id)
    seed = p.seed + j if p.seed is not None else state._rng.randrange(2 ** 32)
    constraint = None if p.structured is None else await _constraint(state, p.structured)
    try:
        params = p.params(seed=seed % 2 ** 32, stop_token_ids=sorted(stops),
                          constraint=constraint)
    except RequestError as err:
        raise refusal(err) from None
    stream = Stream(asyncio.get_running_loop(), len(ids))
    req = await asyncio.wrap_future(_start(state, stream, p.prefill_id, ids, max_new, params))
    metrics = request.app.state.metrics
    metrics.prompt_tokens.inc(len(ids))
    detok = Detokenizer(codec, p.stop, include_stop=p.include_stop_str_in_output,
                        min_tokens=p.penalties.min_tokens)
    gen = _generate(request, state, stream, detok, metrics)
    return Choice(index, ids, text, req, stream, gen, drop,
                  functools.partial(_abandon, state.loop, stream, metrics))


def _abandon(loop: EngineLoop, stream: Stream, metrics: ServerMetrics) -> None:
    """Nobody reads this request any more (the client went away, or the response ended
    before its turn): abort it and count it "abort", unless it already ended and was
    counted. Every queued request ends in exactly one `jlco_request_success` label."""
    if not stream.closed:
        loop.abort(stream, "abort")
        _outcome(stream, metrics, "abort")


def _outcome(stream: Stream, metrics: ServerMetrics, reason: str) -> None:
    """Count the request's one outcome, the first time it ends (an abandoned request's
    late "abort" from the engine is not counted again)."""
    if not stream.closed:
        stream.closed = True
        metrics.requests.labels(reason).inc()


def _prompt_ids(codec, text: str | None, given: list[int] | None,
                chat_text: str | None) -> list[int]:
    """The prompt's token ids: given, or the text (a rendered chat) encoded."""
    text = chat_text if chat_text is not None else text
    if text is None:
        return given
    ids = codec.encode(text) if chat_text is None else codec.encode_chat(text) \
        if hasattr(codec, "encode_chat") else codec.encode(text)
    if not ids:
        raise bad("prompt", "the text encodes to no tokens")
    return ids


def _max_new_tokens(ctx: int, p: SamplingRequest, ids: list[int]) -> int:
    """max_tokens, or the room left in the context; refused (as vLLM words it) when the
    prompt, or the prompt with max_tokens, does not fit."""
    if len(ids) >= ctx:
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, "
                            f"your prompt has {len(ids)} tokens: shorten it.", "prompt")
    max_new = p.max_tokens if p.max_tokens is not None else ctx - len(ids)
    if len(ids) + max_new > ctx:
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, "
                            f"you requested {len(ids) + max_new} tokens ({len(ids)} in the "
                            f"prompt, {max_new} for the completion): reduce the prompt or "
                            "max_tokens.", "max_tokens" if p.max_tokens else "prompt")
    return max_new


async def _constraint(state: ServerState, spec: GrammarSpec):
    """A fresh matcher for `spec`, compiled (once per spec) on a worker thread: a large
    schema never holds the event loop or the engine thread."""
    grammars = state.grammars()
    try:
        return await asyncio.to_thread(grammars.constraint, spec)
    except GrammarError as err:
        raise bad("response_format", f"the {spec.kind} does not compile: {err}") from None


def _start(state: ServerState, stream: Stream, prefill_id: int | None, ids: list[int],
           max_new: int, params: SamplingParams) -> concurrent.futures.Future:
    """Queue the request, or claim the imported prefill `prefill_id` → a future of it
    (a RequestError from the engine's check is its `refusal`)."""
    if prefill_id is None:
        return state.loop.submit(stream, ids, max_new, params)

    def claim(engine):
        req = engine.claim(prefill_id, ids, max_new, params)
        state.loop.attach(stream, req)
        return req
    return state.loop.call(claim)


async def _generate(request: Request, state: ServerState, stream: Stream, detok: Detokenizer,
                    metrics: ServerMetrics) -> AsyncIterator[Piece]:
    """The request's output as `Piece`s; aborts the request if the client goes away or
    the consumer stops early (a cancelled stream)."""
    loop = state.loop
    last_t = None
    n_tokens = 0
    try:
        while True:
            try:
                delta: Delta = await asyncio.wait_for(stream.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            now = time.monotonic()
            if delta.tokens:
                if last_t is None:
                    metrics.ttft.observe(now - stream.t_arrival)
                    if stream.t_scheduled is not None:
                        metrics.queue_time.observe(stream.t_scheduled - stream.t_arrival)
                else:
                    for _ in delta.tokens:   # a delta of k tokens: k gaps of (now-last)/k
                        metrics.itl.observe((now - last_t) / len(delta.tokens))
                last_t = now
                metrics.generated_tokens.inc(len(delta.tokens))
            if delta.error is not None:
                _outcome(stream, metrics, "error")
                raise ApiError(500, f"the engine failed while serving this request: "
                                    f"{delta.error}")
            text, ids = [], []
            for tok in delta.tokens:
                if detok.stopped:
                    break
                if tok == delta.stop_token and delta.finish_reason == "stop":
                    break    # the stop token itself is not part of the text
                ids.append(tok)
                text.append(detok.push(tok))
            start, n_tokens = n_tokens, n_tokens + len(ids)
            if detok.stopped:
                loop.abort(stream, "stop")
                _outcome(stream, metrics, "stop")
                metrics.e2e.observe(now - stream.t_arrival)
                yield Piece("".join(text), ids, "stop", detok.stop_string, start)
                return
            if delta.finish_reason is not None:
                text.append(detok.finish())
                reason = "stop" if delta.finish_reason == "stop" else delta.finish_reason
                _outcome(stream, metrics, reason)
                metrics.e2e.observe(now - stream.t_arrival)
                if delta.stop_token is not None:
                    ids.append(delta.stop_token)   # token ids include the stop token
                yield Piece("".join(text), ids, reason, delta.stop_token, start)
                return
            if ids:
                yield Piece("".join(text), ids, start=start)
    finally:
        _abandon(loop, stream, metrics)     # the client went away: no outcome yet
