"""Chunked prefill over the on-device cache, and the split-state helpers it shares:
the final-hidden → logits head, the MTP draft step, and sampling.

The model is split once (`nnx.split`) and its state passed to plain `jax.jit` functions
that `nnx.merge` inside the trace. `nnx.jit` would walk the module graph in Python on
every call (milliseconds for 61 layers); with split state, a call dispatches through
jit's C++ fast path. The cache argument is donated, so the byte arrays update in place.
A prefill chunk is the model's decode path with s = chunk: no [L, L] matrix is built.
The engine's decode step is `jlco.engine.steps`; this module only fills the cache.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlco.model.decoder import DeepseekV32
from jlco.model.kv_cache import DecodeCache, prefill_scan


def split(model: DeepseekV32):
    """(graphdef, state) for the jitted step functions; do this once per model."""
    return nnx.split(model)


@partial(jax.jit, static_argnames=("impl",), donate_argnames=("cache",))
def _prefill_chunk(graphdef, state, cache, tokens, n_new, *, impl):
    """One ragged chunk → (the hidden state of each request's last real token, every
    position's hidden [b, chunk, d] (for prompt log-probs; unused, it costs its buffer),
    cache)."""
    model = nnx.merge(graphdef, state)
    h, cache = model(tokens, cache, n_new, impl=impl)
    last = jnp.clip(n_new - 1, 0, tokens.shape[1] - 1)
    return h[jnp.arange(h.shape[0]), last], h, dataclasses.replace(cache, scan_len=None)


@partial(jax.jit, static_argnames=("impl",), donate_argnames=("cache",))
def mtp_step(graphdef, state, cache, hidden, next_tokens, start, *, impl: str = "auto"):
    """MTP draft: hidden [b,s,d] at positions start[b]+t with next_tokens [b,s] →
    (draft logits [b,s,V], MTP hidden, cache with the MTP layer's rows written)."""
    model = nnx.merge(graphdef, state)
    return model.mtp_logits(hidden, next_tokens, cache, start, impl=impl)


@partial(jax.jit, static_argnames=("impl",), donate_argnames=("cache",))
def _mtp_rows(graphdef, state, cache, hidden, next_tokens, start, *, impl):
    """The MTP block over a chunk's positions: writes its cache rows only (the draft
    logits are dead code here and compiled away)."""
    return nnx.merge(graphdef, state).mtp_logits(hidden, next_tokens, cache, start, impl=impl)[2]


def mtp_followers(after: np.ndarray, start: int, width: int) -> jax.Array:
    """after [b, n]: the token that follows each position (column t follows position t)
    → columns start .. start + width - 1 [b, width], 0 past the end."""
    follow = np.zeros((after.shape[0], width), np.int32)
    nxt = after[:, start:start + width]
    follow[:, :nxt.shape[1]] = nxt
    return jnp.asarray(follow)


def mtp_rows(model, cache: DecodeCache, hidden, next_tokens, start, *, impl: str,
             scan_len: int | None):
    """The MTP block's cache rows for hidden [b, w, d] at positions start[b] + t with the
    tokens that follow them [b, w], the indexers scanning `scan_len` → cache."""
    graphdef, state = model
    cache = dataclasses.replace(cache, scan_len=scan_len)
    cache = _mtp_rows(graphdef, state, cache, hidden, next_tokens, start, impl=impl)
    return dataclasses.replace(cache, scan_len=None)


@jax.jit
def final_logits(graphdef, state, h):
    """Final-normed hidden states [..., d] → LM-head logits [..., V] f32."""
    return nnx.merge(graphdef, state).logits(h)


def prefill(model, cache: DecodeCache, tokens, prompt_lens=None, *, chunk: int,
            impl: str = "auto", scan_len: int | None | str = "auto", keep_hidden: bool = False,
            mtp_next: np.ndarray | None = None):
    """Append prompts to the cache in chunks of `chunk` tokens.

    model: a DeepseekV32 or its (graphdef, state) from `split`. tokens [b, L] (int,
    right-padded), prompt_lens [b] (default L; 0 leaves a request untouched). Every chunk
    has the same shape, so one compilation serves the whole prompt. scan_len: "auto"
    (`kv_cache.prefill_scan` of the chunk's padded end), or the scan shape to run
    every chunk with (the engine's warm-up compiles each shape on an empty cache).
    → (logits [b, V] at each request's last prompt token, its hidden [b, d], cache),
    and with `keep_hidden` the last chunk's hidden states [b, chunk, d] too.
    mtp_next [b, <= L] (speculative decoding with the MTP layer): the token that follows
    each prompt position (column t follows tokens[:, t]); after each chunk the MTP block
    runs over the same positions (`mtp_rows`), so its cache layer covers the prompt. The
    last position's follower is the first generated token: the first speculative step
    writes that row.
    """
    graphdef, state = split(model) if isinstance(model, DeepseekV32) else model
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[0] != cache.batch:
        raise ValueError(f"prefill: tokens must be [batch={cache.batch}, L]; got {tokens.shape}")
    if not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"prefill: chunk={chunk!r} must be a positive int")
    b, n = tokens.shape
    lens = np.full((b,), n, np.int32) if prompt_lens is None else np.asarray(prompt_lens, np.int32)
    if lens.shape != (b,) or (lens < 0).any() or (lens > n).any():
        raise ValueError(f"prefill: prompt_lens must be [batch] in 0..{n}; got {lens}")
    cached = np.asarray(cache.lengths)    # host copy, advanced chunk by chunk (no syncs)
    room = cache.max_len - cached
    if (lens > room).any():
        raise ValueError(f"prefill: prompt_lens {lens} exceed cache room {room} (max_len "
                         f"{cache.max_len})")
    last_h = None
    for start in range(0, max(int(lens.max()), 1), chunk):
        piece = np.zeros((b, chunk), np.int32)
        width = min(chunk, n - start)
        piece[:, :width] = tokens[:, start:start + width]
        n_new = np.clip(lens - start, 0, chunk).astype(np.int32)
        # The scan shape follows the chunk's padded end, not its real one: a position's
        # piece then runs the same program whatever the prompt's length (prefix reuse).
        end = min(int(cached.max()) + chunk, cache.max_len)
        cached = cached + n_new
        scan = prefill_scan(end, cache.max_len) if scan_len == "auto" else scan_len
        cache = dataclasses.replace(cache, scan_len=scan)
        h, h_all, cache = _prefill_chunk(graphdef, state, cache, jnp.asarray(piece),
                                         jnp.asarray(n_new), impl=impl)
        if mtp_next is not None:
            cache = mtp_rows((graphdef, state), cache, h_all,
                             mtp_followers(np.asarray(mtp_next), start, chunk),
                             jnp.asarray(cached - n_new), impl=impl, scan_len=scan)
        last_h = h if last_h is None else jnp.where(jnp.asarray(n_new > 0)[:, None], h, last_h)
    logits = final_logits(graphdef, state, last_h)
    return (logits, last_h, cache, h_all) if keep_hidden else (logits, last_h, cache)


@jax.jit
def sample(logits: jax.Array, temperature, key: jax.Array):
    """logits [..., V], temperature scalar or [...] (0 = greedy) →
    (tokens [...] int32, logprobs [...]: log-softmax of the untempered logits at the token)."""
    logits = logits.astype(jnp.float32)
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), logits.shape[:-1])
    greedy = jnp.argmax(logits, axis=-1)
    drawn = jax.random.categorical(key, logits / jnp.where(t > 0, t, 1.0)[..., None], axis=-1)
    tok = jnp.where(t > 0, drawn, greedy).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return tok, jnp.take_along_axis(logp, tok[..., None], axis=-1)[..., 0]
