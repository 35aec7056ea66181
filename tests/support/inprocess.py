"""The server app in this process, over a real engine: what `python -m jlco.serve
--config configs/tiny.py` builds (random weights, the byte-level tokenizer with its
"role: content" chat template), without the subprocess and the HTTP socket. SDK clients
talk to it through Starlette's `TestClient`, which calls the ASGI app (`sdk_http_client`
wraps it for an SDK built on another HTTP library: openai on httpx, anthropic 2 on
httpx2), so the server tests that need no process of their own run in seconds.
"""

from __future__ import annotations

import contextlib
import importlib

from tests.support.server import ROOT


def tiny_config(**changes):
    """configs/tiny.py at a 2048-token context, with `changes` (Config.replace names)."""
    from jlco.config import load_config
    return load_config(ROOT / "configs" / "tiny.py").replace(
        engine__max_context_len=2048, **changes)


@contextlib.contextmanager
def serving(cfg, api_key: str | None = None, name: str = "tiny", engine=None):
    """Yield (app, TestClient) over an engine of `cfg` (random weights, the byte-level
    codec) or over `engine`, built on `cfg` by the caller (no codec: token-id prompts);
    drained and closed at the end."""
    from flax import nnx
    from starlette.testclient import TestClient

    from jlco.engine.core import Engine
    from jlco.model.decoder import DeepseekV32
    from jlco.server.app import ServerState, create_app
    from jlco.server.loop import EngineLoop
    from jlco.server.text import TextCodec

    codec = None
    if engine is None:
        engine = Engine(cfg, DeepseekV32(cfg.model, rngs=nnx.Rngs(0)))
        codec = TextCodec.byte_level(cfg.model.vocab_size)
    state = ServerState(model_name=name, max_context_len=cfg.engine.max_context_len,
                        api_key=api_key, index_topk=cfg.model.index_topk,
                        codec=codec, engine=engine)
    app = create_app(state)
    loop = EngineLoop(engine, max_waiting=cfg.serve.max_queue,
                      import_ttl_s=cfg.serve.import_ttl_s,
                      on_step=app.state.metrics.observe_step)
    loop.start()
    state.loop = loop
    try:
        with TestClient(app, base_url="http://testserver") as client:
            yield app, client
    finally:
        loop.drain(1.0)
        engine.close()


def http_lib(sdk):
    """The HTTP library (httpx or httpx2) that SDK module `sdk` is built on."""
    base = importlib.import_module(f"{sdk.__name__}._base_client")
    return getattr(base, "httpx2", None) or base.httpx


def sdk_http_client(sdk, tc):
    """An HTTP client for SDK module `sdk` that sends its requests to the app through
    TestClient `tc` (whole responses: SSE bodies arrive at once)."""
    lib = http_lib(sdk)
    if isinstance(tc, lib.Client):
        return tc

    class Bridge(lib.BaseTransport):
        def handle_request(self, request):
            r = tc.request(request.method, str(request.url), headers=dict(request.headers),
                           content=request.read())
            return lib.Response(r.status_code, headers=list(r.headers.multi_items()),
                                content=r.content)
    return lib.Client(transport=Bridge(), base_url=str(tc.base_url))
