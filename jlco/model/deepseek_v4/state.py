"""DeepSeek-V4's per-request decode state, and prefill / one-token decode steps over it.

Per layer (b requests, W sliding_window, m the layer's compress rate, T = max_len // m,
c the compressor width, o = 2c with the CSA overlap, else c):
- `window` [b, W, D]: the last W keys (= values), token p at slot p % W.
- `comp` (CSA / HCA) and `index` (CSA's indexer, c = D_I):
  `entries` [b, T, c] (indexer: its keys), entry i pooled from tokens i·m … i·m+m−1;
  `buf_kv` / `buf_gate` [b, m, o]: the open window's projections (gate with its slot's
  position bias), token p at slot p % m;
  `prev_kv` / `prev_gate` [b, m, c] (overlap only): the last complete window's Ca half,
  which the next entry pools with its own Cb half (zero / −inf before the first).
Entry i exists once token i·m+m−1 is in: after token p, (p+1) // m entries. `pos` [b]:
tokens so far (the next token's position). Prefill takes prompts of one length from
position 0; decode steps take one token per request, each at its own position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jlco.model.deepseek_v4.attention import NEG_INF, Compressor, V4Attention, topk_picks
from jlco.model.deepseek_v4.blocks import hc_merge
from jlco.model.deepseek_v4.model import DeepseekV4, V4DecoderLayer

F32 = jnp.float32


def _comp_state(c: Compressor, proj, entries, max_len: int) -> dict:
    """A compressor's state after a prompt of L tokens: proj = (kv, gate) [b, L, o],
    entries [b, L // m, c]."""
    kv, gate = proj
    b, L, o = kv.shape
    m, w = c.rate, c.width
    n = L // m
    if max_len // m < n:
        raise ValueError(f"max_len={max_len} holds {max_len // m} entries, the prompt "
                         f"has {n}")
    st = {"entries": jnp.zeros((b, max_len // m, w), kv.dtype).at[:, :n].set(entries),
          "buf_kv": jnp.zeros((b, m, o), kv.dtype).at[:, :L - n * m].set(kv[:, n * m:]),
          "buf_gate": jnp.zeros((b, m, o), F32).at[:, :L - n * m].set(gate[:, n * m:])}
    if c.overlap:
        if n:
            st["prev_kv"] = kv[:, (n - 1) * m:n * m, :w]
            st["prev_gate"] = gate[:, (n - 1) * m:n * m, :w]
        else:
            st["prev_kv"] = jnp.zeros((b, m, w), kv.dtype)
            st["prev_gate"] = jnp.full((b, m, w), NEG_INF, F32)
    return st


def _layer_state(attn: V4Attention, aux: dict, max_len: int) -> dict:
    kv = aux["kv"]
    b, L, dh = kv.shape
    w = attn.cfg.sliding_window
    keep = jnp.arange(max(L - w, 0), L)
    st = {"window": jnp.zeros((b, w, dh), kv.dtype).at[:, keep % w].set(kv[:, keep])}
    if attn.compressor is not None:
        st["comp"] = _comp_state(attn.compressor, aux["comp"], aux["entries"], max_len)
    if attn.indexer is not None:
        st["index"] = _comp_state(attn.indexer.compressor, aux["icomp"], aux["ikeys"], max_len)
    return st


def prefill(model: DeepseekV4, tokens: jax.Array, max_len: int):
    """tokens [b, L] (one length, from position 0) → (logits [b, L, V] f32, state) with
    room for max_len tokens in all."""
    b, L = tokens.shape
    if L > max_len:
        raise ValueError(f"prompt of {L} tokens is longer than max_len={max_len}")
    logits, auxes = model.forward(tokens)
    layers = [_layer_state(layer.attn, aux, max_len) for layer, aux in zip(model.layers, auxes)]
    return logits, {"pos": jnp.full((b,), L, jnp.int32), "layers": layers}


def _comp_step(c: Compressor, st: dict, x: jax.Array, p: jax.Array) -> dict:
    """Add token p (x [b, 1, d]) to a compressor's open window; the window it completes
    (where (p+1) % m == 0) becomes entry p // m."""
    b, m, w = x.shape[0], c.rate, c.width
    rows = jnp.arange(b)
    kv, gate = c.project(x, p[:, None])
    slot = p % m
    buf_kv = st["buf_kv"].at[rows, slot].set(kv[:, 0])
    buf_gate = st["buf_gate"].at[rows, slot].set(gate[:, 0])
    if c.overlap:
        slots_kv = jnp.concatenate([st["prev_kv"], buf_kv[..., w:]], axis=1)
        slots_gate = jnp.concatenate([st["prev_gate"], buf_gate[..., w:]], axis=1)
    else:
        slots_kv, slots_gate = buf_kv, buf_gate
    entry = c.pool(slots_kv, slots_gate, p + 1 - m)
    done = (p + 1) % m == 0
    i = jnp.minimum(p // m, st["entries"].shape[1] - 1)
    old = st["entries"][rows, i]
    out = dict(st, buf_kv=buf_kv, buf_gate=buf_gate,
               entries=st["entries"].at[rows, i].set(jnp.where(done[:, None], entry, old)))
    if c.overlap:
        out["prev_kv"] = jnp.where(done[:, None, None], buf_kv[..., :w], st["prev_kv"])
        out["prev_gate"] = jnp.where(done[:, None, None], buf_gate[..., :w], st["prev_gate"])
    return out


def attention_step(attn: V4Attention, st: dict, x: jax.Array, p: jax.Array):
    """One token per request: x [b, 1, d] at positions p [b] → (out [b, 1, d], state)."""
    cfg = attn.cfg
    b, w = x.shape[0], cfg.sliding_window
    rows = jnp.arange(b)
    q, kv, qr, (cos, sin) = attn.project(x, p[:, None])
    window = st["window"].at[rows, p % w].set(kv[:, 0])
    slot_pos = p[:, None] - (p[:, None] - jnp.arange(w)[None, :]) % w
    parts = [(window, (slot_pos >= 0)[:, None, :])]
    st = dict(st, window=window)
    if attn.compressor is not None:
        comp = _comp_step(attn.compressor, st["comp"], x, p)
        st["comp"] = comp
        t = comp["entries"].shape[1]
        visible = (jnp.arange(t)[None, :] < ((p + 1) // attn.compressor.rate)[:, None])[:, None]
        if attn.indexer is None:
            parts.append((comp["entries"], visible))
        else:
            index = _comp_step(attn.indexer.compressor, st["index"], x, p)
            st["index"] = index
            iq, iw = attn.indexer.queries(x, qr, cos, sin)
            scores = attn.indexer.scores(iq, iw, index["entries"])
            ids, ok = topk_picks(scores, visible, min(cfg.index_topk, t))
            picked = comp["entries"][rows[:, None, None], ids]          # [b, 1, k, D]
            parts.append((picked, ok))
    return attn.output(attn.attend(q, parts), cos, sin), st


def layer_step(layer: V4DecoderLayer, st: dict, streams, tokens, p):
    post, comb, x = layer.attn_input(streams)
    a, st = attention_step(layer.attn, st, x, p)
    streams = hc_merge(streams, a, post, comb)
    return layer.ffn_block(streams, tokens), st


def decode_step(model: DeepseekV4, state: dict, tokens: jax.Array):
    """tokens [b] at positions state["pos"] → (logits [b, V] f32, state)."""
    p = state["pos"]
    streams = model.streams(tokens[:, None])
    layers = []
    for layer, st in zip(model.layers, state["layers"]):
        streams, st = layer_step(layer, st, streams, tokens[:, None], p)
        layers.append(st)
    return model.logits(streams)[:, 0], {"pos": p + 1, "layers": layers}
