"""The compiled decode step of a tiny-config engine as HLO text, for tests that check
what XLA:CPU copies (or does not) in one step."""

from __future__ import annotations

from flax import nnx

from jlco.config import load_config
from jlco.engine.core import Engine
from jlco.model.decoder import DeepseekV32


def compiled_decode_step(batch: int, max_len: int):
    """(config, runner, HLO text after optimisation) of the plain decode step (no
    host-driven fetch, no drafts) at `batch` slots, every slot active."""
    cfg = load_config("configs/tiny.py").replace(engine__max_batch_size=batch,
                                                 engine__max_context_len=max_len)
    run = Engine(cfg, DeepseekV32(cfg.model, rngs=nnx.Rngs(0))).runner
    assert run.host is None and run.spec is None
    return cfg, run, run.stepper.lower(run.cache, [], scan=None).compile().as_text()
