"""Indexer fp8 + Hadamard emulation (cfg.indexer_fp8) and fp8 indexer keys in the cache.

The rotation alone must leave q·k unchanged (orthonormal); e4m3 rounding with UE8M0
scales moves scores by at most a few % of their scale (3 mantissa bits: ≤ 2^-4 relative
per value), so emulated scores stay close to exact ones and top-k sets mostly agree.
"""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tests.support.split_steps import decode_step

from jlco.config import load_config
from jlco.model import fp8_emul, kv_cache, prefill
from jlco.model.decoder import DeepseekV32
from jlco.model.indexer import Indexer
from jlco.model.layers import rope_cos_sin
from jlco.pallas.indexer_ref import indexer_scores_ref

CFG = load_config("configs/tiny.py")
S = 40


def test_hadamard_is_orthonormal_and_keeps_dot_products():
    h = fp8_emul.hadamard_matrix(32)
    # entries +-1/sqrt(32) in f32: each entry of H H^T is a 32-term f32 sum, exact up to a
    # few ulps of 1; atol 1e-6 (rtol 1e-7 as numpy's default had it).
    chex.assert_trees_all_close(np.asarray(h @ h.T), np.eye(32), rtol=1e-7, atol=1e-6)
    rng = np.random.RandomState(0)
    q, k = rng.randn(5, 32).astype(np.float32), rng.randn(7, 32).astype(np.float32)
    got = np.asarray(fp8_emul.hadamard_rotate(jnp.asarray(q)) @ fp8_emul.hadamard_rotate(jnp.asarray(k)).T)
    # rotated vs unrotated f32 dot products of N(0,1) vectors (|q.k| ~ 6): the rotation
    # adds a 32-term f32 sum on each side; 1e-5 absolute is a few ulps at that magnitude.
    chex.assert_trees_all_close(got, q @ k.T, rtol=1e-7, atol=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        fp8_emul.hadamard_matrix(24)


def test_pow2_ceil_exact():
    xs = np.array([1e-6, 0.3, 0.5, 1.0, 1.5, 2.0, 3.0, 448.0, 1000.0], np.float32)
    want = np.array([2.0 ** math.ceil(math.log2(float(x))) for x in xs], np.float32)
    chex.assert_trees_all_equal(np.asarray(fp8_emul.pow2_ceil(jnp.asarray(xs))), want)


def test_quantize_e4m3_ue8m0():
    x = jnp.asarray(np.random.RandomState(1).randn(6, 256).astype(np.float32) * 3)
    q, s = fp8_emul.quantize_e4m3(x, 128)
    chex.assert_type(q, jnp.float8_e4m3fn)
    chex.assert_shape([q, s], [(6, 256), (6, 2)])   # codes [rows, d], one scale per 128
    mant = np.frexp(np.asarray(s))[0]
    chex.assert_trees_all_equal(mant, np.full_like(mant, 0.5))   # powers of two
    amax = np.abs(np.asarray(x)).reshape(6, 2, 128).max(-1)
    assert (amax / np.asarray(s) <= 448).all() and (amax / np.asarray(s) > 224).all()
    err = np.abs(np.asarray(fp8_emul.dequantize_e4m3(q, s)) - np.asarray(x))
    assert (err <= np.maximum(np.abs(np.asarray(x)) / 16, np.repeat(np.asarray(s), 128, 1) / 2 ** 9)).all()


def _indexers():
    exact = Indexer(CFG.model, rngs=nnx.Rngs(0))
    emul = Indexer(dataclasses.replace(CFG.model, indexer_fp8=True), rngs=nnx.Rngs(1))
    nnx.update(emul, nnx.state(exact))
    return exact, emul


def test_emulated_scores_close_to_exact():
    exact, emul = _indexers()
    rng = np.random.RandomState(2)
    x = jnp.asarray(rng.randn(1, S, CFG.model.hidden_size).astype(np.float32))
    qr = jnp.asarray(rng.randn(1, S, CFG.model.q_lora_rank).astype(np.float32))
    cos, sin = rope_cos_sin(CFG.model, jnp.arange(S)[None])
    lengths = jnp.array([S])
    scores = []
    for mod in (exact, emul):
        q, k, w = mod.project(x, qr, cos, sin)
        scores.append(np.asarray(indexer_scores_ref(q, w, k, lengths))[0])
    ex, em = scores
    fin = np.isfinite(ex)
    assert (np.isfinite(em) == fin).all()
    rel = np.abs(em[fin] - ex[fin]).max() / np.abs(ex[fin]).max()
    assert 0 < rel < 0.08, rel                     # fp8 moved scores, but only a little
    topk = CFG.model.index_topk
    overlap = np.mean([len(set(np.argsort(-ex[t])[:topk]) & set(np.argsort(-em[t])[:topk])) / topk
                       for t in range(topk, S)])
    assert overlap > 0.8, overlap


def test_fp8_key_cache_roundtrip():
    cfg = CFG.replace(cache__indexer_key_format="fp8")
    cache = kv_cache.init_cache(cfg, 2, 16)
    k = jnp.asarray(np.random.RandomState(3).randn(2, 3, CFG.model.index_head_dim).astype(np.float32))
    pos = jnp.array([[0, 1, 2], [5, 6, 7]], jnp.int32)
    cache = kv_cache.write_index_key(cache, 1, k, pos)
    keys, scale = kv_cache.index_keys(cache, 1)
    chex.assert_type([keys, scale], [jnp.uint8, jnp.float32])
    chex.assert_shape([keys, scale], [(2, 16, CFG.model.index_head_dim), (2, 16)])
    deq = jax.lax.bitcast_convert_type(keys, jnp.float8_e4m3fn).astype(jnp.float32) * scale[..., None]
    want = fp8_emul.fp8_roundtrip(k, CFG.model.index_head_dim)
    chex.assert_trees_all_equal(np.asarray(deq[0, :3]), np.asarray(want[0]))
    chex.assert_trees_all_equal(np.asarray(deq[1, 5:8]), np.asarray(want[1]))


def test_model_with_fp8_indexer_close_to_exact():
    """Whole model: fp8-emulated indexer + fp8 key cache vs exact; same weights."""
    exact = DeepseekV32(CFG.model, rngs=nnx.Rngs(0))
    fp8_model = DeepseekV32(dataclasses.replace(CFG.model, indexer_fp8=True), rngs=nnx.Rngs(0))
    toks = jnp.asarray(np.random.RandomState(4).randint(0, CFG.model.vocab_size, (1, S)), jnp.int32)
    out = []
    for model, cfg in ((exact, CFG), (fp8_model, CFG.replace(cache__indexer_key_format="fp8"))):
        g, s = prefill.split(model)
        logits, _, _ = decode_step(g, s, kv_cache.init_cache(cfg, 1, 64), toks, impl="xla")
        chex.assert_shape(logits, (1, S, CFG.model.vocab_size))   # [b, s, V]
        chex.assert_type(logits, jnp.float32)
        out.append(np.asarray(logits))
    diff = np.abs(out[0] - out[1]).max() / np.abs(out[0]).max()
    assert 0 < diff < 0.05, diff
