"""What the server's routes read: the served model, its codec, the engine and its loop
once loaded, and the structured-output grammars over the served tokenizer."""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any

from jlco.server.loop import EngineLoop
from jlco.server.protocol import bad
from jlco.server.text import TextCodec
from jlco.structured.grammar import Grammars


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
    job: Any = None                # a jlco.server.lockstep.Job when processes run in lockstep
    _rng: secrets.SystemRandom = dataclasses.field(default_factory=secrets.SystemRandom)
    _grammars: Any = None
    tool_call_parser: str | None = None   # a model_type whose syntax to parse (None: served)
    reasoning_parser: str | None = None

    @property
    def model_type(self) -> str:
        """The served checkpoint family (its chat encoding and output parsers)."""
        cfg = getattr(self.engine, "cfg", None)
        return getattr(getattr(cfg, "model", None), "model_type", "deepseek_v32")

    def grammars(self) -> Grammars:
        """Structured outputs over the served tokenizer (built on first use)."""
        if self.codec is None:
            raise bad("response_format", "structured outputs need a tokenizer: serve a "
                                         "checkpoint with tokenizer.json")
        if self._grammars is None:
            self._grammars = Grammars(self.codec.tokenizer, self.engine.cfg.model.vocab_size,
                                      self.codec.eos_token_id)
        return self._grammars

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
