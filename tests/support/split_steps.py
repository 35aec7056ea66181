"""A whole-model decode step over split state, for the model-level parity tests.

The engine decodes through `jlco.engine.steps` (active masks, offload, MTP); these tests
compare the bare model against references, so they step it directly: tokens in, logits,
hidden and the advanced on-device cache out.
"""

from __future__ import annotations

from functools import partial

import jax
from flax import nnx

from jlco.model.kv_cache import DecodeCache


@partial(jax.jit, static_argnames=("impl",), donate_argnames=("cache",))
def decode_step(graphdef, state, cache: DecodeCache, tokens: jax.Array, *, impl: str = "auto"):
    """tokens [b, s] (s ≥ 1: the next token, plus MTP drafts) for every request →
    (logits [b, s, V] f32, final-normed hidden [b, s, d], cache with lengths += s).
    Requests may have different lengths; each token t sits at lengths[b] + t."""
    model = nnx.merge(graphdef, state)
    h, cache = model(tokens, cache, impl=impl)
    return model.logits(h), h, cache
