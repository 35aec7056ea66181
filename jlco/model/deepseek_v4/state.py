"""DeepSeek-V4's per-request decode state, and the step that extends it by a chunk of
tokens: prefill (in chunks of any size, from any position) and decode (a chunk of one)
are the same step.

Per layer (b requests, W sliding_window, m the layer's compress rate, T = max_len // m,
c the compressor width, o = 2c with the CSA overlap, else c):
- `window` [b, W, D]: the last W keys (= values), token p at slot p % W.
- `comp` (CSA / HCA) and `index` (CSA's indexer, c = D_I):
  `entries` [b, T, c] (the indexer's: its keys), entry i pooled from tokens
  i·m … i·m+m−1 and written when token i·m+m−1 arrives;
  `buf_kv` / `buf_gate` [b, m, o]: the open window's projections (gate with its slot's
  position bias), token p at slot p % m;
  `prev_kv` / `prev_gate` [b, m, c] (overlap only): the last complete window's Ca half,
  which the next entry pools with its own Cb half (zero / −inf before the first).
`pos` [b]: tokens so far, the next token's position; each request has its own.
With `init_state(record=w)` a CSA layer also keeps `picks` [b, w, k]: the entries its
indexer picked for the last w queries (query p at row p % w, −1: none), which warm an
offloaded hot buffer when the request is installed (`jlco.model.deepseek_v4.offload`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jlco.model.deepseek_v4.attention import NEG_INF, Compressor, V4Attention, topk_picks
from jlco.model.deepseek_v4.blocks import hc_merge
from jlco.model.deepseek_v4.config import CSA, V4Config
from jlco.model.deepseek_v4.model import DeepseekV4, V4DecoderLayer
from jlco.model.layers import dtype_of

F32 = jnp.float32


def _comp_init(b: int, rate: int, width: int, overlap: bool, max_len: int, dt) -> dict:
    o = 2 * width if overlap else width
    st = {"entries": jnp.zeros((b, max_len // rate, width), dt),
          "buf_kv": jnp.zeros((b, rate, o), dt), "buf_gate": jnp.zeros((b, rate, o), F32)}
    if overlap:
        st["prev_kv"] = jnp.zeros((b, rate, width), dt)
        st["prev_gate"] = jnp.full((b, rate, width), NEG_INF, F32)
    return st


def init_state(cfg: V4Config, batch: int, max_len: int, record: int = 0) -> dict:
    """An empty state for `batch` requests of up to max_len tokens each; `record` > 0:
    the CSA layers also keep the picks of the last `record` queries (a prefill's)."""
    dt, layers = dtype_of(cfg), []
    for i in range(cfg.num_hidden_layers):
        st = {"window": jnp.zeros((batch, cfg.sliding_window, cfg.head_dim), dt)}
        rate = cfg.compress_rate(i)
        if rate:
            csa = cfg.layer_types[i] == CSA
            st["comp"] = _comp_init(batch, rate, cfg.head_dim, csa, max_len, dt)
            if csa:
                st["index"] = _comp_init(batch, rate, cfg.index_head_dim, True, max_len, dt)
                if record:
                    k = min(cfg.index_topk, max_len // rate)
                    st["picks"] = jnp.full((batch, record, k), -1, jnp.int32)
        layers.append(st)
    return {"pos": jnp.zeros((batch,), jnp.int32), "layers": layers}


def _comp_chunk(c: Compressor, st: dict, x: jax.Array, p0: jax.Array, n=None) -> dict:
    """Add tokens p0 … p0+s−1 (x [b, s, d]) to a compressor: laid after the open
    window's r = p0 % m buffered tokens, every window they complete becomes an entry.
    n [b] (None: s): a row's real tokens, the first n; the rest (padding) complete no
    window and leave no entry (their buffer slots are rewritten before a window uses
    them)."""
    b, s, _ = x.shape
    n = jnp.full((b,), s, jnp.int32) if n is None else n
    m, w = c.rate, c.width
    rows = jnp.arange(b)[:, None]
    kv, gate = c.project(x, p0[:, None] + jnp.arange(s))
    r = p0 % m
    nw = -(-(m + s) // m)                      # windows the extended run can touch
    slots = r[:, None] + jnp.arange(s)
    ext_kv = jnp.zeros((b, nw * m, kv.shape[-1]), kv.dtype).at[:, :m].set(st["buf_kv"])
    ext_gate = jnp.zeros((b, nw * m, kv.shape[-1]), F32).at[:, :m].set(st["buf_gate"])
    ext_kv = ext_kv.at[rows, slots].set(kv).reshape(b, nw, m, -1)
    ext_gate = ext_gate.at[rows, slots].set(gate).reshape(b, nw, m, -1)
    if c.overlap:
        ca_kv = jnp.concatenate([st["prev_kv"][:, None], ext_kv[:, :-1, :, :w]], axis=1)
        ca_gate = jnp.concatenate([st["prev_gate"][:, None], ext_gate[:, :-1, :, :w]], axis=1)
        pool_kv = jnp.concatenate([ca_kv, ext_kv[..., w:]], axis=2)
        pool_gate = jnp.concatenate([ca_gate, ext_gate[..., w:]], axis=2)
    else:
        pool_kv, pool_gate = ext_kv, ext_gate
    first = (p0 - r)[:, None] + jnp.arange(nw) * m
    entries = c.pool(pool_kv, pool_gate, first)                      # [b, nw, c]
    done = (jnp.arange(nw)[None, :] + 1) * m <= (r + n)[:, None]
    cap = st["entries"].shape[1]
    idx = jnp.where(done, first // m, cap)                           # cap: dropped
    out = dict(st, entries=_write_entries(st["entries"], rows, idx, entries))
    k = (r + n) // m                                                 # windows completed
    out["buf_kv"], out["buf_gate"] = ext_kv[rows[:, 0], k], ext_gate[rows[:, 0], k]
    if c.overlap:
        last = jnp.maximum(k - 1, 0)
        more = (k > 0)[:, None, None]
        out["prev_kv"] = jnp.where(more, ext_kv[rows[:, 0], last, :, :w], st["prev_kv"])
        out["prev_gate"] = jnp.where(more, ext_gate[rows[:, 0], last, :, :w], st["prev_gate"])
    return out


def _write_entries(store, rows, idx, entries):
    """store[row, idx] = entries (idx >= T dropped): an on-device entries array, or a
    store of its own (`jlco.model.deepseek_v4.offload.OffloadEntries`)."""
    if isinstance(store, jax.Array):
        return store.at[rows, idx].set(entries, mode="drop")
    return store.write(rows, idx, entries)


def _picked_entries(comp: dict, rows, ids, ok):
    """The picked entries [b, s, k, D] of comp["entries"] → (them, comp): gathered from
    the array, or through an offloaded store (its hot buffer and host pool)."""
    store = comp["entries"]
    if isinstance(store, jax.Array):
        return store[rows[..., None], ids], comp
    keys, store = store.gather(ids, ok)
    return keys, dict(comp, entries=store)


def _window_parts(window: jax.Array, kv: jax.Array, p0: jax.Array, w: int):
    """The sliding-window keys of queries p0 … p0+s−1: the ring's earlier tokens and the
    chunk's own, each with its mask (key j visible to query t iff t−W < j ≤ t)."""
    s = kv.shape[1]
    t = p0[:, None] + jnp.arange(s)                                   # [b, s]
    ring = (p0 - 1)[:, None] - ((p0 - 1)[:, None] - jnp.arange(w)) % w   # [b, W]
    ring_ok = (ring[:, None, :] >= 0) & (ring[:, None, :] > t[..., None] - w)
    j = jnp.arange(s)
    band = (j[None, :] <= j[:, None]) & (j[None, :] > j[:, None] - w)
    return [(window, ring_ok), (kv, jnp.broadcast_to(band, (kv.shape[0], s, s)))]


def _window_write(window: jax.Array, kv: jax.Array, t: jax.Array, n):
    """The ring after the chunk's keys kv [b, s, D] at positions t [b, s]: the last W
    of them (n [b]: only a row's first n are real; None: all)."""
    return _ring_write(window, kv, t, n)


def _ring_write(ring: jax.Array, new: jax.Array, t: jax.Array, n):
    """ring [b, W, ...] after new [b, s, ...] at positions t [b, s] (slot t % W): the
    last W of them (n [b]: only a row's first n are real; None: all)."""
    b, s = t.shape
    w, rows = ring.shape[1], jnp.arange(b)[:, None]
    if n is None:
        keep = jnp.arange(max(s - w, 0), s)                           # distinct slots
        return ring.at[rows, t[:, keep] % w].set(new[:, keep])
    j = jnp.arange(s)[None, :]
    real = (j < n[:, None]) & (j >= n[:, None] - w)                   # distinct slots
    return ring.at[rows, jnp.where(real, t % w, w)].set(new, mode="drop")


def attention_chunk(attn: V4Attention, st: dict, x: jax.Array, p0: jax.Array, n=None):
    """x [b, s, d] at positions p0 … p0+s−1 → (out [b, s, d], state); n [b] (None: s):
    a row's real tokens, the first n (the rest leave the state as it was)."""
    cfg = attn.cfg
    b, s, _ = x.shape
    w, rows = cfg.sliding_window, jnp.arange(b)[:, None]
    t = p0[:, None] + jnp.arange(s)
    q, kv, qr, (cos, sin) = attn.project(x, t)
    parts = _window_parts(st["window"], kv, p0, w)
    st = dict(st, window=_window_write(st["window"], kv, t, n))
    if attn.compressor is not None:
        st["comp"] = comp = _comp_chunk(attn.compressor, st["comp"], x, p0, n)
        cap = comp["entries"].shape[1]
        visible = jnp.arange(cap) < ((t + 1) // attn.compressor.rate)[..., None]
        if attn.indexer is None:
            parts.append((comp["entries"], visible))
        else:
            st["index"] = index = _comp_chunk(attn.indexer.compressor, st["index"], x, p0, n)
            iq, iw = attn.indexer.queries(x, qr, cos, sin)
            ids, ok = topk_picks(attn.indexer.scores(iq, iw, index["entries"]), visible,
                                 min(cfg.index_topk, cap))
            if "picks" in st:
                st["picks"] = _ring_write(st["picks"], jnp.where(ok, ids, -1), t, n)
            if not isinstance(comp["entries"], jax.Array):     # offloaded: gathered
                ok = ok if n is None else ok & (jnp.arange(s) < n[:, None])[..., None]
                keys, st["comp"] = _picked_entries(comp, rows, ids, ok)    # (pads: no
                parts.append((keys, ok))                                   # lookups)
            elif gather_picks(s, ids.shape[-1], cfg.head_dim, cfg.num_attention_heads, cap):
                keys, st["comp"] = _picked_entries(comp, rows, ids, ok)
                parts.append((keys, ok))                                   # [b, s, k, D]
            else:                                                          # [b, s, T] mask
                picked = jnp.zeros(visible.shape, bool).at[
                    rows[..., None], jnp.arange(s)[None, :, None], ids].max(ok)
                parts.append((comp["entries"], picked))
    return attn.output(attn.attend(q, parts), cos, sin), st


def gather_picks(s: int, k: int, d: int, heads: int, entries: int) -> bool:
    """Whether CSA attends its k picks gathered per query ([s, k, D] keys) rather than
    all T entries under a pick mask ([s, H, T] logits): gathered when one query's
    gathered keys are no bigger than its masked logits (decode, long contexts)."""
    return s == 1 or k * d <= heads * entries


def layer_chunk(layer: V4DecoderLayer, st: dict, streams, tokens, p0, n=None):
    post, comb, x = layer.attn_input(streams)
    a, st = attention_chunk(layer.attn, st, x, p0, n)
    streams = hc_merge(streams, a, post, comb)
    return layer.ffn_block(streams, tokens), st


def forward_chunk(model: DeepseekV4, state: dict, tokens: jax.Array, valid=None):
    """tokens [b, s] at positions pos … pos+s−1 of each request → (logits [b, s, V]
    f32, state). pos + s must stay within `capacity` (checked here when pos is
    concrete; a jitted caller checks it on the host). valid int [b] (None: s): only a
    row's first `valid` tokens are real: the state takes those alone (pos advances by
    valid; with 0 nothing a later token reads changes), so a piece padded to a fixed
    width, or an idle batch slot, leaves no trace; the padding's logits are
    meaningless. A real query never sees a pad key (the pads come after it)."""
    p0 = state["pos"]
    if not isinstance(p0, jax.core.Tracer) and not isinstance(valid, jax.core.Tracer):
        room = capacity(model.cfg, state)
        more = tokens.shape[1] if valid is None else int(jnp.max(jnp.asarray(valid)))
        if int(jnp.max(p0)) + more > room:
            raise ValueError(f"{more} more token(s) after {int(jnp.max(p0))} exceed "
                             f"the state's room of {room} tokens (init_state max_len)")
    streams, layers = model.streams(tokens), []
    n = None if valid is None else jnp.asarray(valid, jnp.int32)
    for layer, st in zip(model.layers, state["layers"]):
        streams, st = layer_chunk(layer, st, streams, tokens, p0, n)
        layers.append(st)
    grown = tokens.shape[1] if n is None else n
    return model.logits(streams), {"pos": p0 + grown, "layers": layers}


def capacity(cfg: V4Config, state: dict) -> int:
    """Tokens a request's state has room for (a compressed layer holds max_len // m
    entries; past that, entries would be lost, so callers stop there)."""
    room = [st["comp"]["entries"].shape[1] * cfg.compress_rate(i)
            for i, st in enumerate(state["layers"]) if "comp" in st]
    return min(room, default=cfg.max_position_embeddings)


def decode_step(model: DeepseekV4, state: dict, tokens: jax.Array):
    """tokens [b], one per request at its own position → (logits [b, V] f32, state)."""
    logits, state = forward_chunk(model, state, tokens[:, None])
    return logits[:, 0], state


def prefill(model: DeepseekV4, tokens: jax.Array, max_len: int, chunk: int | None = None):
    """Prompts [b, L] of one length from position 0, in chunks of `chunk` tokens (None:
    one) → (logits [b, L, V] f32, state with room for max_len tokens). Each chunk runs
    as one jitted `forward_chunk` (traced afresh per call, once per chunk width): op by
    op, a V4 layer's many small operations cost minutes on a CPU mesh."""
    b, L = tokens.shape
    if L > max_len:
        raise ValueError(f"prompt of {L} tokens is longer than max_len={max_len}")
    state, outs = init_state(model.cfg, b, max_len), []
    step, run = chunk or L, nnx.jit(forward_chunk)
    for lo in range(0, L, step):
        logits, state = run(model, state, tokens[:, lo:lo + step])
        outs.append(logits)
    return jnp.concatenate(outs, axis=1), state


def install(batch: dict, slot: int, one: dict) -> dict:
    """`batch` with request `slot` replaced by the one-request state `one` (a request
    prefilled alone joins a running batch)."""
    return jax.tree.map(lambda big, row: big.at[slot].set(row[0]), batch, one)


def state_bytes(cfg: V4Config, max_len: int) -> dict[str, int]:
    """Bytes of one request's state at room for max_len tokens, by part: `window` (every
    layer), `csa_entries` / `hca_entries` (compressed entries, growing with the
    context), `index_keys` (CSA's indexer keys, growing), `carry` (open-window buffers
    and the overlap: fixed). From the state's own shapes, so it cannot drift."""
    shapes = jax.eval_shape(lambda: init_state(cfg, 1, max_len))
    out = dict.fromkeys(("window", "csa_entries", "hca_entries", "index_keys", "carry"), 0)
    for kind, st in zip(cfg.layer_types, shapes["layers"]):
        out["window"] += st["window"].size * st["window"].dtype.itemsize
        for part, sub in (("comp", st.get("comp")), ("index", st.get("index"))):
            for name, leaf in (sub or {}).items():
                nbytes = leaf.size * leaf.dtype.itemsize
                if name != "entries":
                    out["carry"] += nbytes
                elif part == "index":
                    out["index_keys"] += nbytes
                else:
                    out["csa_entries" if kind == CSA else "hca_entries"] += nbytes
    return out
