"""The HTTP face of the server: FastAPI routes over an `EngineLoop`.

Routes: POST /v1/completions, POST /v1/chat/completions (needs the checkpoint's chat
template), POST /v1/internal/prefill and /v1/internal/prefilled (PD disaggregation: export a
prefill as a safetensors payload; import one, claimed later by a completion with
`kv_transfer_params`), GET /v1/models, GET /health (200 ready; 503 loading, draining, broken, or
admission paused by a pool watermark), GET /metrics (Prometheus). Every /v1 route
checks `Authorization: Bearer KEY` when the server has an API key. Streaming is SSE
(`data: {json}` chunks, then `data: [DONE]`), the same text as the non-streamed response
because both go through one `Detokenizer`. A client that disconnects aborts its request
(its slot and pages come back at the engine's next step). Handlers ask the engine, never
its scheduler: `check_request` (the engine's one check of a request's fields),
`admission_status()` (health), and refusals by `RequestError.kind` (`loop.refusal`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import secrets
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jlco.engine.scheduler import RequestError
from jlco.server.loop import Delta, EngineLoop, Stream, refusal
from jlco.server.metrics import ServerMetrics
from jlco.server import schema
from jlco.server.responses import Choice, Piece, sse, whole
from jlco.server.protocol import (
    ApiError,
    SamplingRequest,
    bad,
    parse_chat,
    parse_completion,
    parse_json,
)
from jlco.server.text import Detokenizer, TextCodec, render_chat

DISCONNECT_POLL_S = 0.5


@dataclasses.dataclass
class ServerState:
    """What the routes read. `loop`/`engine` are None until the model is loaded."""
    model_name: str
    max_context_len: int
    api_key: str | None = None
    index_topk: int | None = None  # the served model's top-k (jlco.validate reads it)
    codec: TextCodec | None = None
    loop: EngineLoop | None = None
    engine: Any = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    loading: str = "loading the model"
    on_step: Any = None            # called with each engine step's seconds (metrics)
    _rng: secrets.SystemRandom = dataclasses.field(default_factory=secrets.SystemRandom)

    def not_ready(self) -> str | None:
        """Why the server cannot take requests now, or None."""
        if self.loop is None:
            return self.loading
        if self.loop.broken:
            return f"the engine failed: {self.loop.broken}"
        if self.loop.draining:
            return "the server is shutting down"
        return None

    def unhealthy(self) -> str | None:
        """Why a load balancer should route elsewhere: not ready, or admission paused by a
        pool watermark (`serve.host_high_watermark` / `device_high_watermark`; requests
        sent anyway wait in the queue), or None."""
        why = self.not_ready()
        if why:
            return why
        status = self.engine.admission_status()
        pool = status.holding_pool()
        if pool is None:
            return None
        (high, low), use = status.watermarks[pool], status.pool_usage.get(pool, 0.0)
        return (f"admission paused: the {pool} pool is {100 * use:.0f}% used, above "
                f"serve.{pool}_high_watermark={high} (resumes at or below {low})")


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
    app.post("/tokenize", openapi_extra=none)(tokenize)
    app.post("/detokenize", openapi_extra=none)(detokenize)
    app.post("/v1/reset_prefix_cache", openapi_extra=none)(reset_prefix_cache)
    app.post("/v1/completions", openapi_extra=schema.route_extra(schema.CompletionBody))(
        completions)
    app.post("/v1/chat/completions", openapi_extra=schema.route_extra(schema.ChatBody))(chat)
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


async def _auth(request: Request, call_next):
    key = _state(request).api_key
    if key and request.url.path.startswith("/v1"):
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
                    media_type=CONTENT_TYPE_LATEST)


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "jlco", "root": state.model_name, "max_model_len": state.max_context_len,
            "index_topk": state.index_topk}


async def models(request: Request):
    return {"object": "list", "data": [_model_card(_state(request))]}


async def model_info(request: Request, model_id: str):
    """GET /v1/models/{id} (`client.models.retrieve`)."""
    state = _state(request)
    if model_id != state.model_name:
        raise ApiError(404, f"The model `{model_id}` does not exist (this server serves "
                            f"`{state.model_name}`)", "model")
    return _model_card(state)


async def tokenize(request: Request):
    """vLLM's POST /tokenize: {"prompt": text} or {"messages": [...]} (the chat template)
    → {"count", "max_model_len", "tokens"}."""
    state = _state(request)
    body = parse_json(await request.body())
    if state.codec is None:
        raise ApiError(503, state.not_ready() or "no tokenizer loaded")
    if "messages" in body:
        p, messages, add_gen = parse_chat({"messages": body["messages"], **(
            {"add_generation_prompt": body["add_generation_prompt"]}
            if "add_generation_prompt" in body else {})})
        ids = state.codec.encode_chat(_chat_text(state.codec, messages, add_gen))
    elif isinstance(body.get("prompt"), str):
        ids = state.codec.encode(body["prompt"])
    else:
        raise bad("prompt", "required: a string (or \"messages\": a chat)")
    return {"count": len(ids), "max_model_len": state.max_context_len, "tokens": ids}


async def detokenize(request: Request):
    """vLLM's POST /detokenize: {"tokens": [ids]} → {"prompt": text}."""
    state = _state(request)
    body = parse_json(await request.body())
    toks = body.get("tokens")
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                             and t >= 0 for t in toks):
        raise bad("tokens", "required: a list of token ids (integers >= 0)")
    if state.codec is None:
        raise ApiError(503, state.not_ready() or "no tokenizer loaded")
    return {"prompt": state.codec.decode(toks)}


async def reset_prefix_cache(request: Request):
    """Drop every cached prefix page (vLLM's /reset_prefix_cache; behind the API key)."""
    state = _state(request)
    why = state.not_ready()
    if why:
        raise ApiError(503, why)
    n = await asyncio.wrap_future(state.loop.call(lambda engine: engine.reset_prefix_cache()))
    return {"dropped_pages": n}


async def completions(request: Request):
    params = parse_completion(parse_json(await request.body()))
    return await _serve(request, params, None, chat=False)


async def chat(request: Request):
    params, messages, add_gen = parse_chat(parse_json(await request.body()))
    text = _chat_text(_state(request).codec, messages, add_gen)
    return await _serve(request, params, text, chat=True)


def _chat_text(codec, messages: list[dict], add_gen: bool) -> str:
    """The chat rendered by the codec's template, or a 400."""
    if codec is None or codec.chat_template is None:
        raise ApiError(400, "this model has no chat template (the checkpoint's "
                            "tokenizer_config.json carries none): use /v1/completions",
                       "messages")
    try:
        return render_chat(codec.chat_template, messages, add_generation_prompt=add_gen,
                           bos_token=getattr(codec, "bos_token", None) or "",
                           eos_token=getattr(codec, "eos_token", None) or "")
    except ValueError as err:
        raise ApiError(400, f"messages: {err}", "messages") from None


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
    """A completion: prompt ids, the engine's one check of every field, then one engine
    request per prompt and per `n` queued (or an imported prefill claimed) and their
    tokens streamed or returned whole."""
    state = _state(request)
    why = state.not_ready()
    if why:
        raise ApiError(503, why)
    if p.model is not None and p.model != state.model_name:
        raise ApiError(404, f"The model `{p.model}` does not exist (this server serves "
                            f"`{state.model_name}`)", "model")
    prompts = [(p.prompt_text, p.prompt_ids)] + list(p.more_prompts)
    choices: list[Choice] = []
    try:
        for text, given in prompts:
            ids = _prompt_ids(state.codec, text, given, chat_text)
            for j in range(p.n):
                choices.append(await _queue(request, state, p, ids, text, j, len(choices)))
    except BaseException:
        for c in choices:       # nobody will read them: give their slots back
            state.loop.abort(c.stream, "abort")
            c.stream.closed = True
            request.app.state.metrics.requests.labels("abort").inc()
        raise
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
    if p.stream:
        return StreamingResponse(sse(choices, rid, p, state, chat),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await whole(choices, rid, p, state, chat)


async def _queue(request: Request, state: ServerState, p: SamplingRequest, ids: list[int],
                 text: str | None, j: int, index: int) -> Choice:
    """Check and queue choice `index` (the j-th of its prompt) → its Choice."""
    codec = state.codec
    drop = p.echo and p.max_tokens == 0
    max_new = 1 if drop else _max_new_tokens(state.max_context_len, p, ids)
    stops = set(p.stop_token_ids)
    if not p.ignore_eos and codec is not None and codec.eos_token_id is not None:
        stops.add(codec.eos_token_id)
    seed = p.seed + j if p.seed is not None else state._rng.randrange(2 ** 32)
    sampling = dict(temperature=p.temperature, seed=seed % 2 ** 32,
                    stop_token_ids=sorted(stops), top_p=p.top_p, top_k=p.top_k,
                    prompt_logprobs=(p.logprobs or 0) if p.echo else None,
                    top_logprobs=p.logprobs or 0)
    try:
        state.engine.check_request(ids, max_new, **sampling)
    except RequestError as err:
        raise refusal(err) from None
    stream = Stream(asyncio.get_running_loop(), len(ids))
    req = await asyncio.wrap_future(_start(state, stream, p.prefill_id, ids, max_new, sampling))
    metrics = request.app.state.metrics
    metrics.prompt_tokens.inc(len(ids))
    detok = Detokenizer(codec, p.stop, include_stop=p.include_stop_str_in_output)
    gen = _generate(request, state, stream, detok, metrics)
    return Choice(index, ids, text, req, stream, gen, drop)


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


def _start(state: ServerState, stream: Stream, prefill_id: int | None, ids: list[int],
           max_new: int, sampling: dict) -> concurrent.futures.Future:
    """Queue the request, or claim the imported prefill `prefill_id` → a future of it."""
    if prefill_id is None:
        return state.loop.submit(stream, ids, max_new, **sampling)

    def claim(engine):
        req = engine.claim(prefill_id, ids, max_new, **sampling)
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
                stream.closed = True
                metrics.requests.labels("error").inc()
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
                stream.closed = True
                metrics.requests.labels("stop").inc()
                metrics.e2e.observe(now - stream.t_arrival)
                yield Piece("".join(text), ids, "stop", detok.stop_string, start)
                return
            if delta.finish_reason is not None:
                stream.closed = True
                text.append(detok.finish())
                reason = "stop" if delta.finish_reason == "stop" else delta.finish_reason
                metrics.requests.labels(reason).inc()
                metrics.e2e.observe(now - stream.t_arrival)
                if delta.stop_token is not None:
                    ids.append(delta.stop_token)   # token ids include the stop token
                yield Piece("".join(text), ids, reason, delta.stop_token, start)
                return
            if ids:
                yield Piece("".join(text), ids, start=start)
    finally:
        if not stream.closed:      # the client went away (or the engine failed)
            loop.abort(stream, "abort")
            stream.closed = True
            metrics.requests.labels("abort").inc()   # every request ends in one outcome
