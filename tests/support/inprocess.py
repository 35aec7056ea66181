"""The server app in this process, over a real engine: what `python -m jlco.serve
--config configs/tiny.py` builds (random weights, the byte-level tokenizer with its
"role: content" chat template), without the subprocess and the HTTP socket. SDK clients
talk to it through Starlette's `TestClient` (an `httpx.Client` that calls the ASGI app),
so the server tests that need no process of their own run in seconds.
"""

from __future__ import annotations

import contextlib

from tests.support.server import ROOT


def tiny_config(**changes):
    """configs/tiny.py at a 2048-token context, with `changes` (Config.replace names)."""
    from jlco.config import load_config
    return load_config(ROOT / "configs" / "tiny.py").replace(
        engine__max_context_len=2048, **changes)


@contextlib.contextmanager
def serving(cfg, api_key: str | None = None, name: str = "tiny"):
    """Yield (app, TestClient) over an engine of `cfg`; drained and closed at the end."""
    from flax import nnx
    from starlette.testclient import TestClient

    from jlco.engine.core import Engine
    from jlco.model.decoder import DeepseekV32
    from jlco.server.app import ServerState, create_app
    from jlco.server.loop import EngineLoop
    from jlco.server.text import TextCodec

    engine = Engine(cfg, DeepseekV32(cfg.model, rngs=nnx.Rngs(0)))
    state = ServerState(model_name=name, max_context_len=cfg.engine.max_context_len,
                        api_key=api_key, index_topk=cfg.model.index_topk,
                        codec=TextCodec.byte_level(cfg.model.vocab_size), engine=engine)
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
